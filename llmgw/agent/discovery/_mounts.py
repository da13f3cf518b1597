"""Mount tables: /proc/self/mountinfo and `mount` output; which filesystems are shared.

A filesystem is *shared* when its bytes are not this node's to count: other
machines (or the VM host) write to the same pool, so its free space must never
be added to the node's own disk. The rule, by fstype:

- network and cluster filesystems: nfs, nfs4, lustre, gpfs, beegfs (and its
  old name fhgfs), ceph, cifs, smb3, smbfs, glusterfs, afs, panfs, wekafs,
  orangefs/pvfs2, ocfs2 and gfs2 (shared block devices), davfs, ncpfs;
- hypervisor shares, 9p and virtiofs: the bytes are the host's, and usually
  seen by every VM on it;
- FUSE filesystems whose subtype is one of the above or a network/object store
  client: fuse.sshfs, fuse.s3fs, fuse.gcsfuse, fuse.rclone, fuse.juicefs,
  fuse.glusterfs, fuse.ceph-fuse / fuse.ceph, fuse.goofys, fuse.mountpoint-s3,
  fuse.blobfuse / fuse.blobfuse2, fuse.alluxio-fuse, fuse.davfs,
  fuse.quobyte, fuse.mfs (MooseFS), fuse.lizardfs, fuse.cvmfs.

Everything else (ext4, xfs, btrfs, zfs, overlay, tmpfs, fuse.lxcfs...) is the
node's own. An unknown FUSE subtype counts as the node's own: listing it as
shared would hide real local space, and local FUSE (lxcfs, squashfuse) is the
common case on GPU nodes.
"""

from __future__ import annotations

import re

import attrs

from llmgw.errors import ParseError

SHARED_FSTYPES: frozenset[str] = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs", "ceph", "cifs", "smb3",
        "smbfs", "glusterfs", "afs", "panfs", "wekafs", "orangefs", "pvfs2", "ocfs2",
        "gfs2", "davfs", "ncpfs", "9p", "virtiofs",
    }
)  # fmt: skip
SHARED_FUSE_SUBTYPES: frozenset[str] = frozenset(
    {
        "sshfs", "s3fs", "gcsfuse", "rclone", "juicefs", "glusterfs", "ceph-fuse", "ceph",
        "goofys", "mountpoint-s3", "blobfuse", "blobfuse2", "alluxio-fuse", "davfs",
        "quobyte", "mfs", "lizardfs", "cvmfs", "beegfs", "weka", "lustre",
    }
)  # fmt: skip


def is_shared_fstype(fstype: str) -> bool:
    """True for a filesystem whose bytes other machines share (see the module docstring)."""
    fstype = fstype.strip().lower()
    if fstype in SHARED_FSTYPES:
        return True
    kind, _, subtype = fstype.partition(".")
    return kind in ("fuse", "fuseblk") and subtype in SHARED_FUSE_SUBTYPES


@attrs.frozen
class Mount:
    mount_point: str
    fstype: str
    source: str
    dev: tuple[int, int] | None = None  # major:minor (mountinfo only): st_dev of its files


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \ooo.
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str, *, source: str = "/proc/self/mountinfo") -> tuple[Mount, ...]:
    """Mounts from /proc/<pid>/mountinfo (proc(5)): later lines shadow earlier ones.

    Fields: id, parent id, major:minor, root, mount point, options, optional
    fields ended by a lone "-", then fstype, source and superblock options.
    """
    mounts: list[Mount] = []
    for ln in text.splitlines():
        if not ln.strip():
            continue
        fields = ln.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            raise ParseError(source, f"no ' - ' separator after six fields: {ln[:120]!r}") from None
        if len(fields) < sep + 3:
            raise ParseError(source, f"no fstype and source after ' - ': {ln[:120]!r}")
        major, colon, minor = fields[2].partition(":")
        if not (colon and major.isdecimal() and minor.isdecimal()):
            raise ParseError(source, f"device {fields[2]!r} is not major:minor")
        mount_point = _unescape(fields[4])
        if not mount_point.startswith("/"):
            raise ParseError(source, f"mount point {mount_point!r} is not absolute")
        mounts.append(
            Mount(
                mount_point=mount_point,
                fstype=fields[sep + 1],
                source=_unescape(fields[sep + 2]),
                dev=(int(major), int(minor)),
            )
        )
    return tuple(mounts)


_MOUNT_LINE = re.compile(r"(.+) on (/.*) type (\S+)(?: \(([^)]*)\))?")


def parse_mount_output(text: str, *, source: str = "mount") -> tuple[Mount, ...]:
    """Mounts from `mount` with no arguments: `SOURCE on /point type FSTYPE (options)`."""
    mounts: list[Mount] = []
    for ln in text.splitlines():
        if not ln.strip():
            continue
        m = _MOUNT_LINE.fullmatch(ln.strip())
        if m is None:
            raise ParseError(source, f"line is not 'SOURCE on /point type FSTYPE': {ln[:120]!r}")
        mounts.append(Mount(mount_point=m.group(2), fstype=m.group(3), source=m.group(1)))
    return tuple(mounts)

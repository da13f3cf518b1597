"""The mirror's pure half: a request target decoded into safe segments or refused,
a Range header read against a file's size, the ETag, and the pages of the simple
package index (PEP 503 HTML, PEP 691 JSON). No I/O; the connection loop that uses
them is `_mirror.py`, whose docstring says what the mirror serves and refuses."""

from __future__ import annotations

import html
import json
import re
from urllib.parse import quote, unquote_to_bytes

import attrs

MAX_SEGMENTS = 32
MAX_SEGMENT_BYTES = 255  # NAME_MAX
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# --- pure: the target and the range ------------------------------------------------------


@attrs.frozen
class Refusal:
    """An answer that is not the bytes asked for: status, one line of reason, extra headers."""

    status: int
    reason: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


@attrs.frozen
class Target:
    """A decoded request target: path segments under the root, and whether it ended in /."""

    segments: tuple[str, ...]
    directory: bool


def parse_target(target: bytes) -> Target | Refusal:
    """Decode a request target into safe segments, or refuse it."""
    path = target.split(b"?", 1)[0]
    if not path.startswith(b"/"):
        return Refusal(400, f"the target {_show(target)} is not a path beginning with /")
    directory = path.endswith(b"/")
    raw = path[1:-1] if directory else path[1:]
    parts = raw.split(b"/") if raw else []
    if len(parts) > MAX_SEGMENTS:
        return Refusal(400, f"the path has {len(parts)} segments, at most {MAX_SEGMENTS}")
    segments: list[str] = []
    for part in parts:
        decoded = unquote_to_bytes(part)
        if len(decoded) > MAX_SEGMENT_BYTES:
            return Refusal(400, f"a path segment has {len(decoded)} bytes, at most 255")
        try:
            seg = decoded.decode("utf-8")
        except UnicodeDecodeError:
            return Refusal(400, f"the segment {_show(part)} is not UTF-8 once decoded")
        if seg in ("", ".", ".."):
            return Refusal(400, f"the path {_show(path)} has an empty, . or .. segment")
        if "/" in seg or "\\" in seg or _CONTROL.search(seg):
            return Refusal(
                400, f"the segment {_show(part)} holds a separator or a control character"
            )
        if seg.startswith("."):
            return Refusal(404, f"{_show(path)}: names beginning with a dot are not served")
        segments.append(seg)
    return Target(tuple(segments), directory)


@attrs.frozen
class Unsatisfiable:
    """The one range asked for lies outside the file: 416."""


UNSATISFIABLE = Unsatisfiable()
_RANGE = re.compile(rb"bytes=(\d{0,19})-(\d{0,19})")


def parse_range(header: bytes | None, size: int) -> tuple[int, int] | Unsatisfiable | None:
    """The inclusive byte range one `Range` header asks of a file of `size` bytes.

    None: serve the whole file (no header, another unit, bad syntax, or several
    ranges: RFC 9110 lets a server ignore what it does not take).
    """
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if not first:
        if not last:
            return None
        n = int(last)
        if n == 0 or size == 0:
            return UNSATISFIABLE
        return (max(0, size - n), size - 1)
    start = int(first)
    if last and int(last) < start:
        return None  # invalid: ignored
    if start >= size:
        return UNSATISFIABLE
    end = size - 1 if not last else min(int(last), size - 1)
    return (start, end)


def etag(size: int, mtime_ns: int) -> bytes:
    return b'"%d-%d"' % (size, mtime_ns)


def _show(raw: bytes, limit: int = 80) -> str:
    text = raw[:limit].decode("latin-1").encode("unicode_escape").decode("ascii")
    return repr(text + ("..." if len(raw) > limit else ""))


# --- the simple index (PEP 503 / PEP 691), pure ------------------------------------------

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
DIST_SUFFIXES = (".whl", ".tar.gz", ".zip")
_PROJECT = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_project_name(name: str) -> bool:
    return bool(_PROJECT.match(name))


def wants_json(accept: bytes | None) -> bool:
    """Whether the client's Accept takes PEP 691's JSON (with q above 0)."""
    if not accept:
        return False
    for item in accept.decode("latin-1").split(","):
        kind, *params = (part.strip() for part in item.split(";"))
        if kind.lower() != SIMPLE_JSON:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


def project_list(names: list[str], as_json: bool) -> bytes:
    """The index's root page: normalized project names, sorted."""
    names = sorted(set(names))
    if as_json:
        body = {"meta": {"api-version": "1.0"}, "projects": [{"name": n} for n in names]}
        return json.dumps(body, separators=(",", ":")).encode()
    links = "".join(
        f'<a href="/simple/{html.escape(quote(n), quote=True)}/">{html.escape(n)}</a>\n'
        for n in names
    )
    return _html("Simple index", links)


def project_page(name: str, files: list[tuple[str, str, str]], as_json: bool) -> bytes:
    """One project's page: (file name, its path under the root, sha256) each."""
    if as_json:
        body = {
            "meta": {"api-version": "1.0"},
            "name": name,
            "files": [
                {"filename": f, "url": "/" + quote(path), "hashes": {"sha256": digest}}
                for f, path, digest in files
            ],
        }
        return json.dumps(body, separators=(",", ":")).encode()
    links = "".join(
        f'<a href="{html.escape("/" + quote(path), quote=True)}#sha256={digest}">'
        f"{html.escape(f)}</a>\n"
        for f, path, digest in files
    )
    return _html(f"Links for {html.escape(name)}", links)


def _html(title: str, links: str) -> bytes:
    return (
        f'<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{title}</title></head><body>\n{links}</body></html>\n"
    ).encode()

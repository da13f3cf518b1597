"""Configuration files (agent.yaml, server.yaml, ctl.yaml) into attrs classes.

Loaded with a cattrs converter that refuses unknown keys and wrong types, and
reports every problem with its path, one line each:
`agent.yaml: servers[1]: not a host:port (got 'cp1')`.
"""

from __future__ import annotations

import math
import os
import re
import socket
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NewType, TypeVar

import attrs
import cattrs
import cattrs.gen
from cattrs import cols
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from llmgw.errors import ConfigError

__all__ = [
    "RENAMED_KEYS",
    "AgentConfig",
    "Between",
    "BoundError",
    "CtlConfig",
    "FabricDecl",
    "HostPort",
    "MirrorConfig",
    "ServerConfig",
    "TlsFiles",
    "between",
    "check_mirror_dir",
    "check_tls_files",
    "load",
    "positive",
    "read_yaml",
    "split_host_port",
    "structure",
    "unstructure",
]

T = TypeVar("T")

HostPort = NewType("HostPort", str)
_HOSTPORT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>\d{1,5})$"
)


def split_host_port(value: str) -> tuple[str, int]:
    """`"cp1:7070"` -> `("cp1", 7070)`; `"[::1]:7070"` -> `("::1", 7070)`."""
    m = _HOSTPORT.match(value)
    if not m or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"not a host:port (got {value!r})")
    return (m["v6"] or m["host"]), int(m["port"])


class BoundError(ValueError):
    """A value outside its key's bounds; `key` is the attribute, the path is added around it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _num(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


@attrs.frozen
class Between:
    """An attrs validator for a number's bounds; None (unknown, or "never") always passes.

    `attrs.field(default=5.0, validator=between(0, 300, exclusive_low=True))`
    refuses -1 with "heartbeat_interval_s: must be > 0 and ≤ 300 (got -1)".
    """

    low: float | None = None
    high: float | None = None
    exclusive_low: bool = False

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.exclusive_low else '≥'} {_num(self.low)}")
        if self.high is not None:
            parts.append(f"≤ {_num(self.high)}")
        return "must be " + " and ".join(parts)

    def problem(self, value: Any) -> str | None:
        """Why `value` is out of bounds, or None when it is in (or not a number at all)."""
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        ok = math.isfinite(value)
        if ok and self.low is not None:
            ok = value > self.low if self.exclusive_low else value >= self.low
        if ok and self.high is not None:
            ok = value <= self.high
        return None if ok else f"{self.describe()} (got {_num(value)})"

    def __call__(self, _: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        problem = self.problem(value)
        if problem is not None:
            raise BoundError(attribute.name, problem)


def between(
    low: float | None = None, high: float | None = None, *, exclusive_low: bool = False
) -> Between:
    """Bounds for a config number: `between(0, 300, exclusive_low=True)` is 0 < x ≤ 300."""
    if low is None and high is None:
        raise ValueError("between() needs a low or a high bound")
    return Between(low, high, exclusive_low)


def positive(high: float | None = None) -> Between:
    """An interval or timeout: more than 0, and at most `high` when given."""
    return Between(0, high, exclusive_low=True)


def _bounds(validator: Any) -> list[Between]:
    if isinstance(validator, Between):
        return [validator]
    inner = getattr(validator, "_validators", None)  # attrs.validators.and_
    if inner is not None:
        return [b for v in inner for b in _bounds(v)]
    return []


@attrs.define(kw_only=True, frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


@attrs.define(kw_only=True, frozen=True)
class FabricDecl:
    """A fabric the operator declares: a subnet prefix proves nothing, so it is named here."""

    adapters: list[str]
    interface: str | None = None  # the socket interface NCCL should use beside it


@attrs.define(kw_only=True, frozen=True)
class AgentConfig:
    node_id: str = attrs.field(factory=socket.gethostname)
    server: HostPort | None = None  # tried first when given
    servers: list[HostPort] = attrs.field(factory=list)
    tls: TlsFiles
    state_dir: Path = Path("/var/lib/llmgw-agent")
    reconnect_initial_s: float = attrs.field(default=0.5, validator=positive(60))
    reconnect_max_s: float = attrs.field(default=5.0, validator=positive(3600))
    model_dirs: list[Path] = attrs.field(factory=list)
    # Where fetched sources live, one cache entry per source; created at start, always
    # scanned (an operator's own files there are scanned like model_dirs, never reclaimed).
    weights_dir: Path = Path("/var/lib/llmgw-weights")
    # Downloads at once on this node; more wait (one per source however many shards want it).
    max_concurrent_fetches: int = attrs.field(default=2, validator=between(1, 64))
    fabrics: dict[str, FabricDecl] = attrs.field(factory=dict)
    sglang_python: str | None = None
    engine_paths: dict[str, str] = attrs.field(factory=dict)  # "vllm" -> /opt/vllm/bin/vllm
    labels: dict[str, str] = attrs.field(factory=dict)  # matched by profiles' node_selector
    stop_grace_s: float = attrs.field(default=30.0, validator=positive(3600))
    # Each sample reads /proc, the GPUs and the filesystems: not a busy loop.
    sample_interval_s: float = attrs.field(default=5.0, validator=between(0.1, 3600))
    # A ready shard is health-checked every health_interval_s, each check bounded
    # by health_timeout_s; health_failures in a row make it unhealthy.
    health_interval_s: float = attrs.field(default=5.0, validator=between(0.1, 3600))
    health_timeout_s: float = attrs.field(default=5.0, validator=positive(300))
    health_failures: int = attrs.field(default=3, validator=between(1, 1000))
    # A shard that generates is also asked for one token (llmgw/agent/_health.py): before
    # it is reported ready, then at most every generation_probe_interval_s; each answer
    # within generation_probe_timeout_s.
    generation_probe_interval_s: float = attrs.field(default=30.0, validator=between(1, 86400))
    generation_probe_timeout_s: float = attrs.field(default=30.0, validator=positive(3600))
    # Failed shards whose logs stay under state_dir/failed/.
    failed_shards_kept: int = attrs.field(default=5, validator=between(0, 1000))
    # The start-up inventory; a probe past it is a warning.
    discovery_timeout_s: float = attrs.field(default=60.0, validator=positive(3600))
    # GPU faults: the kernel log whose `NVRM: Xid` lines are read (from its start, then
    # followed); null: not read. And whether NVML's Xid events are watched as well.
    gpu_fault_log: Path | None = Path("/dev/kmsg")
    gpu_fault_nvml_events: bool = True

    def __attrs_post_init__(self) -> None:
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise BoundError(
                "reconnect_max_s",
                f"must be ≥ reconnect_initial_s ({_num(self.reconnect_initial_s)}) "
                f"(got {_num(self.reconnect_max_s)})",
            )

    @property
    def addresses(self) -> list[tuple[str, int]]:
        ordered = ([self.server] if self.server else []) + [
            s for s in self.servers if s != self.server
        ]
        return [split_host_port(s) for s in ordered]


@attrs.define(kw_only=True, frozen=True)
class MirrorConfig:
    """server.yaml's `mirror:`: the weights under `dir`, served on a listener of their own."""

    dir: Path | None = None  # null: no mirror
    listen: HostPort = HostPort("0.0.0.0:8082")
    tls: bool = True  # the control plane's server certificate; false: plain HTTP


@attrs.define(kw_only=True, frozen=True)
class ServerConfig:
    state_dir: Path = Path("/var/lib/llmgw")
    rpc_listen: HostPort = HostPort("0.0.0.0:7070")
    admin_listen: HostPort = HostPort("127.0.0.1:8081")
    router_listen: HostPort | None = HostPort("0.0.0.0:8080")  # null: no router here
    router: dict[str, Any] = attrs.field(factory=dict)  # llmgw.router.RouterConfig's fields
    tls: TlsFiles
    heartbeat_interval_s: float = attrs.field(default=5.0, validator=positive(300))
    missed_heartbeats: int = attrs.field(default=3, validator=between(1, 1000))
    lost_after_s: float = attrs.field(default=60.0, validator=positive(7 * 86400))
    # Each pass plans the whole fleet: more often than 10 times a second is a busy loop.
    reconcile_interval_s: float = attrs.field(default=2.0, validator=between(0.1, 300))
    # After a start, wait for agents before acting.
    reconcile_settle_s: float = attrs.field(default=10.0, validator=between(0, 3600))
    stop_grace_s: float = attrs.field(default=30.0, validator=positive(3600))
    # The ports the reconciler gives an engine whose profile names no `port_range`,
    # [first, last]: the range a fleet's firewall opens between router and nodes.
    engine_ports: tuple[int, int] = attrs.field(default=(8100, 8999))
    # A replica with a rank unhealthy (its /health failing) this long is replaced.
    unhealthy_replace_s: float = attrs.field(default=30.0, validator=positive(86400))
    # A draining node's replica, once replaced, waits this long for its in-flight requests.
    drain_timeout_s: float = attrs.field(default=300.0, validator=positive(86400))
    # A node lost this long is forgotten; null: never.
    forget_after_s: float | None = attrs.field(default=86400.0, validator=positive())
    # Every control plane -> agent call's deadline (engineCheck 90 s, inventory 30 s,
    # stopShard its grace plus this); past it the call is cancelled (llmgw.rpc.Deadlines).
    rpc_deadline_s: float = attrs.field(default=10.0, validator=positive(3600))
    # The agents' listener: accept to finished TLS handshake, and how many at once.
    rpc_handshake_timeout_s: float = attrs.field(default=5.0, validator=positive(300))
    rpc_max_pending_handshakes: int = attrs.field(default=256, validator=between(1, 65536))
    models: list[dict[str, Any]] = attrs.field(
        factory=list
    )  # the catalog: llmgw.cp._fleet._catalog
    # Served names split between catalog models by weight (canaries): llmgw.cp._fleet._traffic.
    traffic: dict[str, Any] | None = None
    # LoRA adapters served on catalog models' replicas: llmgw.cp._fleet._catalog_adapters.
    adapters: list[dict[str, Any]] = attrs.field(factory=list)
    mirror: MirrorConfig = attrs.field(factory=MirrorConfig)  # llmgw.cp._weights._mirror
    # The engines every node installs, by name; null: none declared (llmgw.cp._fleet._engines).
    engines: dict[str, Any] | None = None
    # What the control plane keeps (accounts, keys, overrides, known nodes, the leader lease,
    # usage): null: SQLite in state_dir; a `postgresql://` DSN; or the absolute path of a
    # file holding one (`llmgw-cp init --postgres` writes <state_dir>/secrets/store-dsn).
    store: str | None = None
    # The leader's lease on the store, renewed every third of it; a standby takes over once
    # it has lapsed (llmgw.cp._fleet._leader).
    lease_s: float = attrs.field(default=10.0, validator=between(1, 600))
    # The event log (`ctl events`) as the store keeps it: its newest this many events
    # (llmgw/cp/_observe/_event_keeper.py).
    events_kept: int = attrs.field(default=10_000, validator=between(100, 1_000_000))
    # The RPC address agents dial to reach this control plane, as a standby names it to
    # them; null: rpc_listen's port on this machine's name (its FQDN) when rpc_listen's
    # host is a wildcard, else rpc_listen itself.
    advertise: HostPort | None = None

    @engine_ports.validator
    def _check_engine_ports(self, attribute: attrs.Attribute[Any], value: tuple[int, int]) -> None:
        first, last = value
        if not 0 < first <= last < 65536:
            raise BoundError(
                attribute.name,
                f"must be [first, last] ports, 0 < first ≤ last < 65536 (got {list(value)})",
            )


@attrs.define(kw_only=True, frozen=True)
class CtlConfig:
    admin_url: str = "http://127.0.0.1:8081"
    admin_key: str | None = None
    admin_key_file: Path | None = None


def _describe(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", type(None): "nothing"}.get(type(value))
    return kind or f"{value!r}"


def _origin(tp: Any) -> Any:
    return typing.get_origin(tp)


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(tp: type, word: str) -> Any:
        def hook(value: Any, _: Any) -> Any:
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
                raise TypeError(f"expected {word}, got {_describe(value)}")
            return value

        return hook

    conv.register_structure_hook(str, strict(str, "a string"))
    conv.register_structure_hook(int, strict(int, "an integer"))
    conv.register_structure_hook(float, strict(float, "a number"))
    conv.register_structure_hook(bool, strict(bool, "true or false"))

    def path(value: Any, _: Any) -> Path:
        if not isinstance(value, str) or not value:
            raise TypeError(f"expected a path, got {_describe(value)}")
        return Path(value)

    def host_port(value: Any, _: Any) -> HostPort:
        if not isinstance(value, str):
            raise TypeError(f"expected host:port, got {_describe(value)}")
        split_host_port(value)
        return HostPort(value)

    conv.register_structure_hook(Path, path)
    conv.register_structure_hook(HostPort, host_port)

    # cattrs happily iterates a string into a list of characters and reads any
    # object with .keys(); a config file deserves "expected a list".
    def shaped(kind: type, word: str, factory: Any) -> Any:
        def make(tp: Any) -> Any:
            inner = factory(tp, conv)

            def hook(value: Any, t: Any) -> Any:
                if not isinstance(value, kind):
                    raise TypeError(f"expected {word}, got {_describe(value)}")
                return inner(value, t)

            return hook

        return make

    conv.register_structure_hook_factory(
        lambda t: _origin(t) is list,
        shaped(list, "a list", cols.list_structure_factory),
    )
    conv.register_structure_hook_factory(
        lambda t: _origin(t) is dict,
        shaped(dict, "a mapping", cols.mapping_structure_factory),
    )
    conv.register_structure_hook_factory(
        attrs.has,
        shaped(dict, "a mapping", _bounded_structure_fn),
    )
    return conv


def _bounded_structure_fn(cls: Any, conv: cattrs.Converter) -> Any:
    """cattrs' hook for an attrs class, reporting every key out of bounds, not only the first.

    attrs runs validators one after the other and stops at the first that
    raises; a file with three bad intervals deserves three lines at once.
    """
    inner = cattrs.gen.make_dict_structure_fn(cls, conv)
    checks = [(a.name, b) for a in attrs.fields(cls) for b in _bounds(a.validator)]

    def hook(value: Any, tp: Any) -> Any:
        try:
            return inner(value, tp)
        except Exception as exc:
            found = [
                BoundError(name, problem)
                for name, bound in checks
                if name in value and (problem := bound.problem(value[name])) is not None
            ]
            if not found:
                raise
            keys = {e.key for e in found}
            subs = list(exc.exceptions) if isinstance(exc, ClassValidationError) else [exc]
            others = [e for e in subs if not (isinstance(e, BoundError) and e.key in keys)]
            raise ClassValidationError(
                f"While structuring {cls.__name__}", [*others, *found], cls
            ) from None

    return hook


_converter = _make_converter()

# Keys a file may still hold from an earlier release: named with what replaced them.
RENAMED_KEYS: dict[tuple[type, str], str] = {
    (AgentConfig, "fetch_dir"): "renamed weights_dir: where fetched weights live",
}


def _problems(exc: BaseException, path: str) -> Iterator[str]:
    where = path or "(top level)"
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _problems(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            yield from _problems(sub, path)
    elif isinstance(exc, IterableValidationError):
        indexed, without = exc.group_exceptions()
        for sub, inote in indexed:
            yield from _problems(sub, f"{path}[{inote.index!r}]")
        for sub in without:
            yield from _problems(sub, path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        for key in sorted(exc.extra_fields):
            hint = RENAMED_KEYS.get((exc.cl, key), "unknown key")
            yield f"{path + '.' if path else ''}{key}: {hint}"
    elif isinstance(exc, BoundError):
        yield f"{path + '.' if path else ''}{exc.key}: {exc.message}"
    elif isinstance(exc, KeyError):
        yield f"{where}: required, but missing"
    elif isinstance(exc, (TypeError, ValueError)):
        text = str(exc)
        if "argument after ** must be a mapping" in text or "object is not iterable" in text:
            text = "expected a mapping" if "**" in text else "expected a list"
        yield f"{where}: {text}"
    else:
        yield f"{where}: {type(exc).__name__}: {exc}"


def structure(data: Any, cls: type[T], source: str, at: str = "") -> T:
    """Turn parsed YAML into `cls`, or raise ConfigError listing every problem.

    `at` is where `data` sits in the file (`router` for server.yaml's router
    section), so that each line names the whole key path: `router.retries`.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = f"{at}: expected a mapping" if at else "expected a mapping at the top level"
        raise ConfigError(f"{source}: {where}, got {_describe(data)}")
    try:
        return _converter.structure(data, cls)
    except Exception as exc:
        lines = [f"{source}: {p}" for p in _problems(exc, at)]
        raise ConfigError("\n".join(lines) or f"{source}: {exc}") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's data (None for an empty one), the one way llmgw reads its files.

    A ConfigError names the file, and for bad YAML the line and column:
    `server.yaml: line 3 column 7: not valid YAML: mapping values are not allowed here`.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: not valid YAML: {problem}") from None


def load(path: Path, cls: type[T]) -> T:
    """Read a YAML file into `cls`; every error names the file and the key path."""
    return structure(read_yaml(path), cls, str(path))


def check_tls_files(tls: TlsFiles, source: str | Path, key: str = "tls") -> None:
    """Each TLS file exists and can be read, or a ConfigError naming its key.

    `server.yaml: tls.cert: no such file: /etc/llmgw/pki/server.crt`. What is
    inside (PEM, key matching certificate) is the RPC layer's check, after this.
    """
    problems = []
    for name in ("ca", "cert", "key"):
        path: Path = getattr(tls, name)
        try:
            with path.open("rb") as f:
                f.read(1)
        except FileNotFoundError:
            problems.append(f"{source}: {key}.{name}: no such file: {path}")
        except IsADirectoryError:
            problems.append(f"{source}: {key}.{name}: a directory, not a file: {path}")
        except OSError as exc:
            problems.append(f"{source}: {key}.{name}: cannot read {path}: {exc.strerror or exc}")
    if problems:
        raise ConfigError("\n".join(problems))


def check_mirror_dir(mirror: MirrorConfig, source: str | Path, key: str = "mirror") -> None:
    """`mirror.dir`, when set, is a directory this process can list, or a ConfigError naming it.

    `server.yaml: mirror.dir: no such directory: /srv/weights`.
    """
    path = mirror.dir
    if path is None:
        return
    where = f"{source}: {key}.dir"
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such directory: {path}") from None
    except NotADirectoryError:
        raise ConfigError(f"{where}: not a directory: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot list {path}: {exc.strerror or exc}") from None


def unstructure(value: Any) -> Any:
    return _converter.unstructure(value)

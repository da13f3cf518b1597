"""Configuration files (agent.yaml, server.yaml, ctl.yaml) into attrs classes.

Loaded with a cattrs converter that refuses unknown keys and wrong types, and
reports every problem with its path, one line each:
`agent.yaml: servers[1]: not a host:port (got 'cp1')`.
"""

from __future__ import annotations

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
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 5.0
    model_dirs: list[Path] = attrs.field(factory=list)
    fetch_dir: Path | None = None
    fabrics: dict[str, FabricDecl] = attrs.field(factory=dict)
    sglang_python: str | None = None
    engine_paths: dict[str, str] = attrs.field(factory=dict)  # "vllm" -> /opt/vllm/bin/vllm
    labels: dict[str, str] = attrs.field(factory=dict)  # matched by profiles' node_selector
    stop_grace_s: float = 30.0
    sample_interval_s: float = 5.0

    @property
    def addresses(self) -> list[tuple[str, int]]:
        ordered = ([self.server] if self.server else []) + [
            s for s in self.servers if s != self.server
        ]
        return [split_host_port(s) for s in ordered]


@attrs.define(kw_only=True, frozen=True)
class ServerConfig:
    state_dir: Path = Path("/var/lib/llmgw")
    rpc_listen: HostPort = HostPort("0.0.0.0:7070")
    admin_listen: HostPort = HostPort("127.0.0.1:8081")
    router_listen: HostPort | None = HostPort("0.0.0.0:8080")  # null: no router here
    router: dict[str, Any] = attrs.field(factory=dict)  # llmgw.router.RouterConfig's fields
    tls: TlsFiles
    heartbeat_interval_s: float = 5.0
    missed_heartbeats: int = 3
    lost_after_s: float = 60.0
    reconcile_interval_s: float = 2.0
    reconcile_settle_s: float = 10.0  # after a start, wait for agents before acting
    stop_grace_s: float = 30.0
    models: list[dict[str, Any]] = attrs.field(factory=list)  # the catalog: llmgw.cp._catalog


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
        shaped(dict, "a mapping", lambda t, c: cattrs.gen.make_dict_structure_fn(t, c)),
    )
    return conv


_converter = _make_converter()


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
            yield f"{path + '.' if path else ''}{key}: unknown key"
    elif isinstance(exc, KeyError):
        yield f"{where}: required, but missing"
    elif isinstance(exc, (TypeError, ValueError)):
        text = str(exc)
        if "argument after ** must be a mapping" in text or "object is not iterable" in text:
            text = "expected a mapping" if "**" in text else "expected a list"
        yield f"{where}: {text}"
    else:
        yield f"{where}: {type(exc).__name__}: {exc}"


def structure(data: Any, cls: type[T], source: str) -> T:
    """Turn parsed YAML into `cls`, or raise ConfigError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {_describe(data)}")
    try:
        return _converter.structure(data, cls)
    except Exception as exc:
        lines = [f"{source}: {p}" for p in _problems(exc, "")]
        raise ConfigError("\n".join(lines) or f"{source}: {exc}") from None


def load(path: Path, cls: type[T]) -> T:
    """Read a YAML file into `cls`; every error names the file and the key path."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: not valid YAML: {problem}") from None
    return structure(data, cls, str(path))


def unstructure(value: Any) -> Any:
    return _converter.unstructure(value)

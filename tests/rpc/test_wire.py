"""The call table, the schema, the servers and the servants hold to each other;
the RPC package keeps its shape (one idea a file, small classes)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from llmgw.agent._servant import AgentServant as RealAgentServant
from llmgw.rpc import _agent, _registry, _wire
from llmgw.rpc._schema import SCHEMA_PATH, schema

RPC = Path(_wire.__file__).parent
REPO = RPC.parents[1]


def _methods(interface: object) -> list[str]:
    # The node's list is in ordinal order (@0, @1, ...): capnp refuses a hole.
    return [m.name for m in interface.schema.node.interface.methods]  # type: ignore[attr-defined]


def test_the_packaged_schema_is_the_schema() -> None:
    assert SCHEMA_PATH.read_bytes() == (REPO / "schema" / "llmgw.capnp").read_bytes()


def test_the_call_table_is_the_schemas_agent_interface() -> None:
    by_ordinal = {c.ordinal: c.wire for c in _wire.AGENT_CALL_TABLE}
    by_ordinal.update({o: name for name, o in _wire.RETIRED_AGENT_CALLS.items()})
    assert _methods(schema.Agent) == [by_ordinal[i] for i in range(len(by_ordinal))]
    assert [c.ordinal for c in _wire.AGENT_CALL_TABLE] == sorted(
        c.ordinal for c in _wire.AGENT_CALL_TABLE
    )
    known = {"startShard", "stopShard", "logs", "reclaim", "inventory", "engineCheck"}
    assert set(_wire.AGENT_CALLS) == known | {
        "declareEngines",
        "logSources",
        "relaunchShard",
        "fetchAdapter",
    }


def test_drain_is_retired_and_nothing_calls_it() -> None:
    assert "drain" not in _wire.AGENT_CALLS
    assert _wire.RETIRED_AGENT_CALLS == {"obsoleteDrain": 2}
    with pytest.raises(ValueError, match=r"no agent call named drain"):
        _wire.Deadlines(per_call={"drain": 5})
    callers = [
        str(p.relative_to(REPO))
        for p in (REPO / "llmgw").rglob("*.py")
        if "obsoleteDrain" in p.read_text() and p.parent != RPC
    ]
    assert callers == []


@pytest.mark.parametrize(
    ("interface", "server"),
    [
        (schema.Agent, _agent.AgentImpl),
        (schema.LogSink, _agent._LogSinkImpl),
        (schema.Registry, _registry.RegistryImpl),
        (schema.NodeSession, _registry._SessionImpl),
    ],
)
def test_every_schema_method_is_served(interface: object, server: type) -> None:
    # A method without `NAME_context` answers with pycapnp's AttributeError traceback.
    assert [m for m in _methods(interface) if not hasattr(server, f"{m}_context")] == []


def test_every_agent_call_has_its_handle_its_server_and_its_servant() -> None:
    handle = inspect.getsource(_agent.AgentHandle)
    server = inspect.getsource(_agent.AgentImpl)
    for call in _wire.AGENT_CALL_TABLE:
        assert f'self._call("{call.wire}"' in handle, call
        assert f'self._call("{call.wire}"' in server, call
        assert inspect.iscoroutinefunction(getattr(RealAgentServant, call.servant)), call


def test_the_default_deadlines_come_from_the_table() -> None:
    d = _wire.Deadlines(default_s=7)
    assert {c.wire: d.of(c.wire) for c in _wire.AGENT_CALL_TABLE} == {
        "startShard": 7,
        "stopShard": 7,
        "logs": 7,
        "reclaim": 120,
        "inventory": 30,
        "engineCheck": 90,
        "declareEngines": 7,
        "logSources": 7,
        "relaunchShard": 300,
        "fetchAdapter": 300,
    }


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_wire_module_is_pure() -> None:
    assert _imports(RPC / "_wire.py") <= {
        "__future__",
        "json",
        "collections.abc",
        "attrs",
        "llmgw",
        "llmgw.errors",
    }
    assert _imports(REPO / "llmgw" / "errors.py") <= {"__future__", "collections.abc", "typing"}


def test_one_idea_a_file_and_no_class_over_400_lines() -> None:
    long_files, long_classes = {}, {}
    for path in RPC.glob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) >= 600:
            long_files[path.name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 400:
                    long_classes[f"{path.name}:{node.name}"] = lines
    assert (long_files, long_classes) == ({}, {})


def test_capnp_is_imported_only_where_capnp_objects_live() -> None:
    # The wire table, the codec (handed builders and readers), the gate and TLS need none.
    users = sorted(
        p.name
        for p in RPC.glob("*.py")
        if any(n == "capnp" or n.startswith("capnp.") for n in _imports(p))
    )
    assert users == ["_agent.py", "_net.py", "_schema.py", "_thread.py"]


# docs/architecture.md draws the package in this order.
LAYERS = ["_wire", "_schema", "_codec", "_thread", "_agent", "_registry", "_tls", "_gate", "_net"]


def test_a_module_imports_only_the_modules_above_it() -> None:
    assert sorted(LAYERS) == sorted(p.stem for p in RPC.glob("_*.py") if p.stem != "__init__")
    upward: dict[str, list[str]] = {}
    for i, name in enumerate(LAYERS):
        tree = ast.parse((RPC / f"{name}.py").read_text())
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "llmgw.rpc":
                used.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmgw.rpc."):
                used.add(node.module.removeprefix("llmgw.rpc."))
        bad = sorted(u for u in used if u not in LAYERS[:i])
        if bad:
            upward[name] = bad
    assert upward == {}
    docs = (REPO / "docs" / "architecture.md").read_text()
    drawn = [
        line.split()[0].removesuffix(".py") for line in docs.splitlines() if line.startswith(" _")
    ]
    assert drawn == LAYERS

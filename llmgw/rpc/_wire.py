"""What crosses the wire, decided without the wire: the agent call table, its
deadlines, and the error envelope. No capnp, no trio (tests/rpc/test_wire.py
checks the imports).

Adding a control plane -> agent call
------------------------------------

1. The schema: a method at the next ordinal of `interface Agent` in
   schema/llmgw.capnp, and the same line in its packaged copy
   llmgw/rpc/llmgw.capnp (tests/rpc/test_wire.py holds the two equal).
   Ordinals are never reused (ordinal 2 is a retired placeholder) and
   stay sequential: capnp aborts the process on a hole.
2. The call table, here: an `AgentCall` row in `AGENT_CALL_TABLE` (schema
   name, the servant's method name, its default deadline if 10 s is wrong).
   tests/rpc/test_wire.py holds the table equal to the schema's methods.
3. The capability, llmgw/rpc/_agent.py: the trio handle's method on
   `AgentHandle` (encode the arguments, decode the result, `self._call(...)`
   with the schema name) and, beside it in the same file, the capnp server's
   `<schemaName>_context` on `_AgentImpl` (decode, `self._call(...)`, encode).
   Values travel as llmgw.model attrs classes through `_codec`, so a new struct
   is a class in llmgw/model.py with the schema's field names in snake_case.
4. The servant: the method named in the table on the agent's
   `AgentServant` (llmgw/agent/_servant.py). An agent without it answers
   `NotImplementedRemotely`, so an older agent stays usable.

Then the control plane calls the handle (llmgw/cp/). Calls the other way
(agent -> control plane, `NodeSession`) go in llmgw/rpc/_registry.py the same
way, with their servant in llmgw/cp/_fleet/_registry.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import attrs

from llmgw import errors
from llmgw.errors import Disconnected, LlmgwError, NotImplementedRemotely, RemoteError

# --- The agent call table ---------------------------------------------------------


@attrs.frozen
class AgentCall:
    """One control plane -> agent call of `interface Agent`."""

    wire: str  # the schema's method name
    ordinal: int  # the schema's @N
    servant: str  # what the agent's servant implements
    deadline_s: float | None = None  # the default deadline; None: `Deadlines.default_s`


# In schema order. Ordinal 2 was `drain`, declared and never served: a drain is the
# control plane's (a replacement first, then stopShard with a grace; llmgw/core/_drain.py).
# Ordinals must stay sequential, so the schema keeps it as `obsoleteDrain`, which an
# agent refuses; never reuse it.
AGENT_CALL_TABLE: tuple[AgentCall, ...] = (
    # Answers once the spec is on disk and the first process is scheduled.
    AgentCall("startShard", 0, "start_shard"),
    # The handle adds the grace: the agent waits that long for the engine to exit.
    AgentCall("stopShard", 1, "stop_shard"),
    AgentCall("logs", 3, "logs"),
    # Describes the weights directory (up to 200,000 entries) and deletes whole entries.
    AgentCall("reclaim", 4, "reclaim", 120.0),
    # A full discovery (NVML or nvidia-smi, topology, engine probes) on the agent.
    AgentCall("inventory", 5, "inventory", 30.0),
    # Runs the engine's --help, which the agent bounds at 60 s (SGLang imports torch).
    AgentCall("engineCheck", 6, "engine_check", 90.0),
    AgentCall("declareEngines", 7, "declare_engines"),
    AgentCall("logSources", 8, "log_sources"),
    # Makes the new adapters' sources ready first (a fetch, like fetchAdapter's), then
    # stops the engine; the handle adds the grace, as for stopShard.
    AgentCall("relaunchShard", 9, "relaunch_shard", 300.0),
    # A fetch of an adapter (10-200 MB; fetched once, however many ask).
    AgentCall("fetchAdapter", 10, "fetch_adapter", 300.0),
)
# Placeholders in the schema, by name: ordinal. Each is refused as `NotImplementedRemotely`.
RETIRED_AGENT_CALLS: Mapping[str, int] = {"obsoleteDrain": 2}

AGENT_CALL_BY_WIRE: Mapping[str, AgentCall] = {c.wire: c for c in AGENT_CALL_TABLE}
# The control plane's calls on an agent, by their schema names.
AGENT_CALLS = frozenset(AGENT_CALL_BY_WIRE)
assert len(AGENT_CALLS) == len(AGENT_CALL_TABLE), "a schema name twice in the call table"


# --- Deadlines ----------------------------------------------------------------------


def _per_call(value: Mapping[str, float]) -> dict[str, float]:
    defaults = {c.wire: c.deadline_s for c in AGENT_CALL_TABLE if c.deadline_s is not None}
    merged = {**defaults, **value}
    unknown = sorted(set(merged) - AGENT_CALLS)
    if unknown:
        raise ValueError(
            f"no agent call named {', '.join(unknown)}; known: {', '.join(sorted(AGENT_CALLS))}"
        )
    for name, seconds in merged.items():
        if not 0 < seconds <= 3600:
            raise ValueError(f"deadline of {name}: {seconds!r} s; use more than 0, at most 3600")
    return merged


@attrs.frozen
class Deadlines:
    """How long the control plane waits for an agent to answer, per call (seconds).

    On expiry the call is cancelled (down to the agent's servant) and raises
    `DeadlineExceeded("did not answer CALL in N s")`. `startShard` answers as
    soon as the spec is on disk and the first process is scheduled (loading the
    engine happens after), so it keeps the default. `stopShard` waits on the
    agent for the engine to exit, up to the grace it is given: its deadline is
    that grace plus `default_s`. Log streams (a `LogSink` being fed) have none.
    """

    default_s: float = attrs.field(default=10.0)
    per_call: Mapping[str, float] = attrs.field(factory=dict, converter=_per_call)

    @default_s.validator
    def _check_default(self, _: object, value: float) -> None:
        if not 0 < value <= 3600:
            raise ValueError(f"default deadline {value!r} s; use more than 0, at most 3600")

    def of(self, call: str, extra_s: float = 0.0) -> float:
        return self.per_call.get(call, self.default_s) + max(0.0, extra_s)


# --- Errors ---------------------------------------------------------------------

# An error crosses the wire as the text of a capnp exception (pycapnp carries
# nothing else): this marker, then JSON {"code", "message", "extra"}. Encoded
# here (`encode_error`) and decoded here (`map_remote_error`) through the one
# table in llmgw.errors; the text around it (KJ adds "remote exception: ") is not read.
WIRE_MARK = "llmgw-error/1 "


def encode_error(exc: BaseException) -> str:
    """The text a servant's exception leaves as (the capnp exception's description)."""
    code, message, extra = errors.to_wire(exc)
    return WIRE_MARK + json.dumps({"code": code, "message": message, "extra": extra})


def decode_error(text: str) -> tuple[str, str, dict[str, str]] | None:
    """(code, message, extra) from a text holding the envelope; None without one."""
    at = text.find(WIRE_MARK)
    if at < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(text, at + len(WIRE_MARK))
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    code, message, extra = data.get("code"), data.get("message"), data.get("extra") or {}
    if not isinstance(code, str) or not isinstance(message, str) or not isinstance(extra, dict):
        return None
    return code, message, {str(k): str(v) for k, v in extra.items()}


def map_remote_error(exc: BaseException, what: str) -> LlmgwError:
    """Turn a capnp exception into ours; keeps only its text (and KJ's `type`)."""
    text = str(getattr(exc, "description", None) or exc)
    wire = decode_error(text)
    if wire is not None:
        code, message, extra = wire
        return errors.from_wire(code, f"{what}: {message}", extra)
    kind = getattr(exc, "type", None)
    if kind == "DISCONNECTED":
        return Disconnected(f"{what}: connection lost ({text})")
    if kind == "UNIMPLEMENTED":  # capnp's own: the peer's schema lacks the method
        return NotImplementedRemotely(f"{what}: {text}")
    return RemoteError(f"{what}: {text}")

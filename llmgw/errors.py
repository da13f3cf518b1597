"""One error hierarchy for llmgw.

Every error says whose fault it is: the operator's configuration or input
(`ConfigError`, `UsageError`), a remote peer (`PeerError` and its children), or
outside text we could not read (`ParseError`). Foreign exceptions are mapped to
these at the boundary that meets them, so callers never catch ssl, capnp or
httpx types.

Errors are data on the wire. Each kind has a stable `code`; a servant's error
crosses the RPC boundary as code, message and a few structured fields
(`wire_extra`), and the far side rebuilds it through `from_wire`, the one
table of codes here (the shape of h2's error codes and httpcore's
`map_exceptions`). A code this side does not know becomes a `RemoteError` with
the peer's message, so an older or newer peer never breaks the decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

__all__ = [
    "CODES",
    "INTERNAL",
    "ConfigError",
    "DeadlineExceeded",
    "Disconnected",
    "LlmgwError",
    "NotFound",
    "NotImplementedRemotely",
    "ParseError",
    "PeerError",
    "RegistrationRefused",
    "RemoteError",
    "StaleEpoch",
    "TlsRefused",
    "UsageError",
    "from_wire",
    "to_wire",
]


class LlmgwError(Exception):
    """Root of every error llmgw raises on purpose."""

    code: ClassVar[str] = "error"

    def wire_extra(self) -> dict[str, str]:
        """Structured fields that travel beside the message (only strings)."""
        return {}

    @classmethod
    def from_wire_fields(cls, message: str, extra: Mapping[str, str]) -> LlmgwError:
        """Rebuild one of these from what `wire_extra` sent."""
        return cls(message)


class ConfigError(LlmgwError):
    """The operator's configuration is wrong; the message names the path."""

    code = "config"


class UsageError(LlmgwError):
    """A command was called with input it cannot act on."""

    code = "usage"


class NotFound(UsageError):
    """A command named something (a shard, a node) that does not exist."""

    code = "not-found"


class ParseError(LlmgwError):
    """Outside text (a probe's output, a sysfs file) could not be read.

    `source` names the input (a command line or a path) so the operator can
    reproduce it.
    """

    code = "parse"

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem

    def wire_extra(self) -> dict[str, str]:
        return {"source": self.source, "problem": self.problem}

    @classmethod
    def from_wire_fields(cls, message: str, extra: Mapping[str, str]) -> LlmgwError:
        source, problem = extra.get("source"), extra.get("problem")
        if source is None or problem is None:
            return RemoteError(message)
        return cls(source, problem)


class PeerError(LlmgwError):
    """Something on the other side of a connection failed or refused."""

    code = "peer"


class Disconnected(PeerError):
    """The connection to the peer is gone; every capability on it is broken."""

    code = "disconnected"


class DeadlineExceeded(PeerError):
    """The peer accepted a call and did not answer it in time; the call was cancelled.

    The message is "did not answer CALL in N s"; callers prefix whom they asked.
    """

    code = "deadline"


class TlsRefused(PeerError):
    """A TLS handshake failed; the message says what to change."""

    code = "tls"


class RegistrationRefused(PeerError):
    """The control plane refused a registration.

    `leader` is set when the refusal came from a standby that knows the leader, and
    `epoch` when it knows the lease's epoch too: an agent that lost its session with
    that leader at an older epoch dials it at once (it has been elected again).
    """

    code = "registration-refused"

    def __init__(self, message: str, leader: str | None = None, epoch: int | None = None) -> None:
        super().__init__(message)
        self.leader = leader
        self.epoch = epoch

    def wire_extra(self) -> dict[str, str]:
        extra = {} if self.leader is None else {"leader": self.leader}
        if self.epoch is not None:
            extra["epoch"] = str(self.epoch)
        return extra

    @classmethod
    def from_wire_fields(cls, message: str, extra: Mapping[str, str]) -> LlmgwError:
        raw = extra.get("epoch") or ""
        # From another machine: anything but a plain number is no epoch at all.
        epoch = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 20 else None
        return cls(message, leader=extra.get("leader") or None, epoch=epoch)


class StaleEpoch(PeerError):
    """An agent refused a command from a control plane that is no longer the leader."""

    code = "stale-epoch"


class RemoteError(PeerError):
    """A call reached the peer and the peer answered with an error."""

    code = "remote"


class NotImplementedRemotely(RemoteError):
    """The peer does not implement this call yet."""

    code = "not-implemented"


# Code of an exception that is not ours (a bug on the far side): it decodes as RemoteError.
INTERNAL = "internal"

# The one table: wire code -> the kind it decodes to.
_KINDS: tuple[type[LlmgwError], ...] = (
    LlmgwError,
    ConfigError,
    UsageError,
    NotFound,
    ParseError,
    PeerError,
    Disconnected,
    DeadlineExceeded,
    TlsRefused,
    RegistrationRefused,
    StaleEpoch,
    RemoteError,
    NotImplementedRemotely,
)
CODES: Mapping[str, type[LlmgwError]] = {kind.code: kind for kind in _KINDS}
assert len(CODES) == len(_KINDS), "two error kinds share a code"


def to_wire(exc: BaseException) -> tuple[str, str, dict[str, str]]:
    """(code, message, extra) for an exception a servant raised."""
    if isinstance(exc, LlmgwError):
        return exc.code, str(exc), exc.wire_extra()
    return INTERNAL, f"internal error in {type(exc).__name__}: {exc}", {}


def from_wire(code: str, message: str, extra: Mapping[str, str] | None = None) -> LlmgwError:
    """The error a peer's (code, message, extra) stands for; unknown codes are RemoteError."""
    kind = CODES.get(code)
    if kind is None:
        return RemoteError(message)
    return kind.from_wire_fields(message, extra or {})

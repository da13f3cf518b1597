"""One error hierarchy for llmgw.

Every error says whose fault it is: the operator's configuration or input
(`ConfigError`, `UsageError`), a remote peer (`PeerError` and its children), or
outside text we could not read (`ParseError`). Foreign exceptions are mapped to
these at the boundary that meets them, so callers never catch ssl, capnp or
httpx types.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Root of every error llmgw raises on purpose."""


class ConfigError(LlmgwError):
    """The operator's configuration is wrong; the message names the path."""


class UsageError(LlmgwError):
    """A command was called with input it cannot act on."""


class ParseError(LlmgwError):
    """Outside text (a probe's output, a sysfs file) could not be read.

    `source` names the input (a command line or a path) so the operator can
    reproduce it.
    """

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class PeerError(LlmgwError):
    """Something on the other side of a connection failed or refused."""


class Disconnected(PeerError):
    """The connection to the peer is gone; every capability on it is broken."""


class TlsRefused(PeerError):
    """A TLS handshake failed; the message says what to change."""


class RegistrationRefused(PeerError):
    """The control plane refused a registration.

    `leader` is set when the refusal came from a standby that knows the leader.
    """

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class RemoteError(PeerError):
    """A call reached the peer and the peer answered with an error."""


class NotImplementedRemotely(RemoteError):
    """The peer does not implement this call yet."""

"""The Cap'n Proto boundary. Nothing outside this package imports capnp."""

from llmgw.rpc._bridge import (
    AGENT_CALLS,
    AgentHandle,
    AgentServant,
    CapnpThread,
    ClientConnection,
    Deadlines,
    LogStream,
    PeerInfo,
    RegistryServant,
    SessionHandle,
    SessionServant,
)
from llmgw.rpc._gate import HandshakeLimits

__all__ = [
    "AGENT_CALLS",
    "AgentHandle",
    "AgentServant",
    "CapnpThread",
    "ClientConnection",
    "Deadlines",
    "HandshakeLimits",
    "LogStream",
    "PeerInfo",
    "RegistryServant",
    "SessionHandle",
    "SessionServant",
]

"""The Cap'n Proto boundary. Nothing outside this package imports capnp."""

from llmgw.rpc._bridge import (
    STANDBY_PREFIX,
    AgentHandle,
    AgentServant,
    CapnpThread,
    ClientConnection,
    PeerInfo,
    RegistryServant,
    SessionHandle,
    SessionServant,
)

__all__ = [
    "STANDBY_PREFIX",
    "AgentHandle",
    "AgentServant",
    "CapnpThread",
    "ClientConnection",
    "PeerInfo",
    "RegistryServant",
    "SessionHandle",
    "SessionServant",
]

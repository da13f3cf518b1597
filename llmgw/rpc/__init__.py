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
from llmgw.rpc._tls import check_files as check_certificates
from llmgw.rpc._tls import client_context as client_tls_context
from llmgw.rpc._tls import server_context as server_tls_context

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
    "check_certificates",
    "client_tls_context",
    "server_tls_context",
]

"""The Cap'n Proto boundary. Nothing outside this package imports capnp.

By capability, not by direction (docs/architecture.md, "The RPC boundary"):

- `_wire`: the agent call table, `Deadlines`, the error envelope (no capnp, no trio);
  its docstring says where a new agent call goes;
- `_schema`: the schema, loaded once (this package's copy of schema/llmgw.capnp);
- `_codec`: attrs values <-> capnp structs, by field name;
- `_thread`: the capnp thread (asyncio + KJ) and the trio bridge, `Bridge.answer`
  serving every capnp server's calls, handles and the capability table;
- `_agent`: `Agent` and `LogSink`, each one's trio handle beside its capnp server;
- `_registry`: `Registry` and `NodeSession`, likewise, and the servant Protocols;
- `_net`: `CapnpThread` (the bridge with its connections): dial, listen, accept;
- `_gate`: the agents' listener before TLS; `_tls`: contexts and refusals in words.
"""

from llmgw.rpc._agent import AgentHandle, AgentServant, LogSinkHandle, LogStream
from llmgw.rpc._gate import HandshakeLimits
from llmgw.rpc._net import CapnpThread, ClientConnection
from llmgw.rpc._registry import (
    PeerInfo,
    RegistryHandle,
    RegistryServant,
    SessionHandle,
    SessionServant,
)
from llmgw.rpc._tls import check_files as check_certificates
from llmgw.rpc._tls import client_context as client_tls_context
from llmgw.rpc._tls import server_context as server_tls_context
from llmgw.rpc._wire import AGENT_CALL_TABLE, AGENT_CALLS, AgentCall, Deadlines

__all__ = [
    "AGENT_CALLS",
    "AGENT_CALL_TABLE",
    "AgentCall",
    "AgentHandle",
    "AgentServant",
    "CapnpThread",
    "ClientConnection",
    "Deadlines",
    "HandshakeLimits",
    "LogSinkHandle",
    "LogStream",
    "PeerInfo",
    "RegistryHandle",
    "RegistryServant",
    "SessionHandle",
    "SessionServant",
    "check_certificates",
    "client_tls_context",
    "server_tls_context",
]

"""The node agent."""

from __future__ import annotations

# /proc only, no trio: `llmgw.agent.discovery` imports this package first.
from llmgw.agent._procfs import OWNER_ENV
from llmgw.agent._procfs import environ as process_environ


def main(argv: list[str] | None = None) -> int:
    # Imported here so that `llmgw.agent.discovery` does not drag in trio and capnp.
    from llmgw.agent._main import main as agent_main

    return agent_main(argv)


__all__ = ["OWNER_ENV", "main", "process_environ"]

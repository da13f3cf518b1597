"""The node agent."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    # Imported here so that `llmgw.agent.discovery` does not drag in trio and capnp.
    from llmgw.agent._main import main as agent_main

    return agent_main(argv)


__all__ = ["main"]

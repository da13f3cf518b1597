"""The node agent."""

from llmgw.agent._main import main

__all__ = ["main"]

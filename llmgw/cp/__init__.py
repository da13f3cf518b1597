"""The control plane service."""

from llmgw.cp._main import main, serve

__all__ = ["main", "serve"]

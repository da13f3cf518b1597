"""The operator's CLI."""

from llmgw.ctl._main import main

__all__ = ["main"]

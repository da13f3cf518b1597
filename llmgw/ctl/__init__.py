"""The operator's CLI."""

from llmgw.ctl._args import build_parser
from llmgw.ctl._cert import init_ca, issue_agent, issue_server
from llmgw.ctl._main import main

__all__ = ["build_parser", "init_ca", "issue_agent", "issue_server", "main"]

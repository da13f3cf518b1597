"""The admin pages under `/admin` on the admin listener (quart-trio)."""

from llmgw.cp._pages._app import COOKIE, api_client, make_pages
from llmgw.cp._pages._sessions import Sessions

__all__ = ["COOKIE", "Sessions", "api_client", "make_pages"]

"""The router's keys, read from the control plane's store (llmgw/store).

`StoreKeys` is the router's KeyStore over a Store; it lives in the router
(llmgw/router/_keys.py) since router-only mode reads its own store through it
too. This name stays for the control-plane modules that import it from here.
"""

from llmgw.router import StoreKeys

__all__ = ["StoreKeys"]

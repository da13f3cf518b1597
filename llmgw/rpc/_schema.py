"""The Cap'n Proto schema, loaded once: this package's copy of schema/llmgw.capnp
(tests/rpc/test_wire.py holds the two equal). Its readers and builders are used
on the capnp thread only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import capnp

SCHEMA_PATH = Path(__file__).with_name("llmgw.capnp")
schema: Any = capnp.load(str(SCHEMA_PATH))

"""Token usage per tenant, key and model, by the hour: counted by the router as answers
finish, written to the control plane's store in batches (never on the request path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs


@attrs.frozen
class UsageRow:
    hour: int  # the hour's start, seconds since the epoch (a multiple of 3600)
    tenant: str
    key_id: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UsageSink(Protocol):
    """Where counted usage goes (the control plane's store): adds each row to its hour's."""

    async def add_usage(self, rows: Iterable[UsageRow]) -> None: ...

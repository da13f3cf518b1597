"""Token usage per tenant, key and model, by the hour: counted by the router as answers
finish, written to the control plane's store in batches (never on the request path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from llmgw.keys import UsageRow


class UsageSink(Protocol):
    """Where counted usage goes (the control plane's store): adds each row to its hour's."""

    async def add_usage(self, rows: Iterable[UsageRow]) -> None: ...


HOUR_S = 3600
MAX_PENDING_ROWS = 100_000
FLUSH_BATCH_ROWS = 1000
# A store that stays out: the first failed flush in a row is a warning, then every this
# many (once a minute at the default usage_flush_s of 1 s); the others are debug lines.
WARN_EVERY = 60

_Key = tuple[int, str, str, str]  # (hour, tenant, key_id, model)


class UsageMeter:
    """Usage counted in memory as answers finish, handed to a sink in batches.

    `add` is a dictionary update (the request path never waits on the store).
    `flush` takes what is pending and sends it in batches of `batch_rows`; a batch the
    sink fails on is kept, with every later one, to be sent again next time. At most
    `max_rows` distinct (hour, tenant, key, model) rows wait; past that, new rows are
    dropped and counted (`dropped`), so a store that is down for long costs bounded memory.
    Pure: the caller passes the wall-clock time and awaits `flush` where it does I/O.
    """

    def __init__(
        self, *, max_rows: int = MAX_PENDING_ROWS, batch_rows: int = FLUSH_BATCH_ROWS
    ) -> None:
        self.max_rows = max_rows
        self.batch_rows = batch_rows
        self._rows: dict[_Key, list[int]] = {}
        self.dropped = 0  # requests whose row found the meter full
        self.flushed = 0  # rows the sink has taken
        self.failures = 0  # flushes the sink failed
        self.failing = 0  # flushes failed in a row since the last that went through

    def __repr__(self) -> str:
        return f"<UsageMeter {len(self._rows)} rows pending, {self.dropped} dropped>"

    def statistics(self) -> dict[str, int]:
        return {
            "pending": len(self._rows),
            "dropped": self.dropped,
            "flushed": self.flushed,
            "failures": self.failures,
        }

    def add(
        self,
        now: float,
        tenant: str,
        key_id: str,
        model: str,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        *,
        requests: int = 1,
    ) -> bool:
        """Count one finished request at wall-clock `now`; unknown tokens add 0 (the
        request still counts). False when the meter is full and the row was dropped."""
        key = (int(now) // HOUR_S * HOUR_S, tenant, key_id, model)
        row = self._rows.get(key)
        if row is None:
            if len(self._rows) >= self.max_rows:
                self.dropped += requests
                return False
            row = self._rows[key] = [0, 0, 0]
        row[0] += requests
        row[1] += prompt_tokens or 0
        row[2] += completion_tokens or 0
        return True

    def worth_saying(self) -> bool:
        """Whether the flush that just failed is worth a warning (see WARN_EVERY)."""
        return self.failing <= 1 or self.failing % WARN_EVERY == 0

    def pending(self) -> list[UsageRow]:
        return [UsageRow(*k, *v) for k, v in sorted(self._rows.items())]

    def _merge(self, rows: dict[_Key, list[int]]) -> None:
        for key, (n, p, c) in rows.items():
            row = self._rows.get(key)
            if row is None:
                if len(self._rows) >= self.max_rows:
                    self.dropped += n
                    continue
                row = self._rows[key] = [0, 0, 0]
            row[0] += n
            row[1] += p
            row[2] += c

    async def flush(self, sink: UsageSink) -> int:
        """Send what is pending; the rows sent. Raises what the sink raised, after keeping
        every row it did not take (counted on top of what arrives meanwhile)."""
        taken, self._rows = self._rows, {}
        items = sorted(taken.items())
        sent = 0
        try:
            for start in range(0, len(items), self.batch_rows):
                batch = items[start : start + self.batch_rows]
                await sink.add_usage([UsageRow(*k, *v) for k, v in batch])
                sent += len(batch)
                self.flushed += len(batch)
        except BaseException:
            self.failures += 1
            self.failing += 1
            self._merge(dict(items[sent:]))
            raise
        self.failing = 0
        return sent

"""Hourly usage: each (hour, tenant, key, model) row's requests and tokens, added up."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmgw.errors import UsageError
from llmgw.keys import UsageRow
from llmgw.store._backends import Exec
from llmgw.store._runner import Runner

ADD_USAGE = (
    "INSERT INTO usage (hour, tenant, key_id, model, requests, prompt_tokens,"
    " completion_tokens) VALUES (?,?,?,?,?,?,?)"
    " ON CONFLICT (hour, tenant, key_id, model) DO UPDATE SET"
    " requests = usage.requests + excluded.requests,"
    " prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = usage.completion_tokens + excluded.completion_tokens"
)


class UsageStore:
    """The `usage` table."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add each row's counts to its (hour, tenant, key, model) row, all in one transaction."""
        batch = []
        for r in rows:
            if min(r.requests, r.prompt_tokens, r.completion_tokens) < 0:
                raise UsageError(f"usage row {r!r} has a negative count")
            batch.append(
                (
                    r.hour - r.hour % 3600,
                    r.tenant,
                    r.key_id,
                    r.model,
                    r.requests,
                    r.prompt_tokens,
                    r.completion_tokens,
                )
            )
        if not batch:
            return

        def write(run: Exec) -> None:
            for args in batch:
                run(ADD_USAGE, args)

        await self._run.tx(write)

    async def usage(self, tenant: str | None = None, since: float | None = None) -> list[UsageRow]:
        """Rows from the hour containing `since` on, for one tenant or all."""
        where: list[str] = []
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if since is not None:
            where.append("hour >= ?")
            args.append(int(since) - int(since) % 3600)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        rows = await self._run.q(
            "SELECT hour, tenant, key_id, model, requests, prompt_tokens, completion_tokens"
            f" FROM usage{clause} ORDER BY hour, tenant, key_id, model",
            args,
        )
        return [
            UsageRow(int(h), str(t), str(k), str(m), int(q), int(p), int(c))
            for h, t, k, m, q, p, c in rows
        ]

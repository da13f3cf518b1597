"""The leader lease and what is written under it: the leader's endpoint list.

The lease is one row: holder, epoch and expiry on the database's clock (SQLite's
own on SQLite), so every control plane reads it against one clock. The
published endpoint list is fenced by the lease's epoch: a deposed leader cannot
overwrite its successor's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llmgw.errors import UsageError
from llmgw.store._runner import Runner
from llmgw.store._values import Lease

log = logging.getLogger("llmgw.store")


def _lease(row: Sequence[Any]) -> Lease:
    holder, epoch, expires_at, now = row
    return Lease(str(holder), int(epoch), float(expires_at), float(expires_at) <= float(now))


class LeaseStore:
    """The `lease` and `published_endpoints` rows."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def try_acquire(self, holder: str, ttl_s: float) -> Lease | None:
        """Take the lease when it is free, expired or already this holder's (a control plane
        restarted on the same address), with the epoch one higher; None when another holds it.

        One UPDATE whose condition the database re-checks on the locked row, so of
        two control planes racing for an expired lease exactly one gets it.
        """
        if not holder:
            raise UsageError("a lease needs a holder")
        if not ttl_s > 0:
            raise UsageError(f"lease length {ttl_s!r} s; it must be > 0")
        now = self._run.now_sql
        rows = await self._run.q(
            f"UPDATE lease SET holder = ?, epoch = epoch + 1, expires_at = {now} + ?"
            f" WHERE id = 1 AND (holder IS NULL OR holder = ? OR expires_at <= {now})"
            f" RETURNING holder, epoch, expires_at, {now}",
            (holder, float(ttl_s), holder),
        )
        if not rows:
            return None
        lease = _lease(rows[0])
        log.info("lease taken by %s, epoch %d", holder, lease.epoch)
        return lease

    async def renew(self, holder: str, epoch: int, ttl_s: float) -> bool:
        """Extend the lease; only its holder at its epoch may, and False tells it it lost."""
        if not ttl_s > 0:
            raise UsageError(f"lease length {ttl_s!r} s; it must be > 0")
        rows = await self._run.q(
            f"UPDATE lease SET expires_at = {self._run.now_sql} + ?"
            " WHERE id = 1 AND holder = ? AND epoch = ? RETURNING epoch",
            (float(ttl_s), holder, int(epoch)),
        )
        return bool(rows)

    async def current(self) -> Lease | None:
        """The lease as it stands (expired or not); None when nobody ever took it."""
        rows = await self._run.q(
            f"SELECT holder, epoch, expires_at, {self._run.now_sql} FROM lease"
            " WHERE id = 1 AND holder IS NOT NULL"
        )
        return _lease(rows[0]) if rows else None

    async def publish_endpoints(self, epoch: int, body_json: str) -> bool:
        """Keep the leader's endpoint list for the standbys' routers. Fenced: written only
        while `epoch` is the lease's, so a deposed leader cannot overwrite its successor's
        list; False when refused."""
        rows = await self._run.q(
            f"UPDATE published_endpoints SET epoch = ?, body = ?, at = {self._run.now_sql}"
            " WHERE id = 1 AND ? = (SELECT epoch FROM lease WHERE id = 1) RETURNING epoch",
            (int(epoch), body_json, int(epoch)),
        )
        return bool(rows)

    async def published_endpoints(self) -> tuple[int, str, float] | None:
        """(epoch, the list as published, when) of the last list; None when none was."""
        rows = await self._run.q(
            "SELECT epoch, body, at FROM published_endpoints WHERE id = 1 AND body IS NOT NULL"
        )
        if not rows:
            return None
        epoch, body, at = rows[0]
        return int(epoch), str(body), float(at)

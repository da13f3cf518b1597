"""The audit log: what operators did through the admin API, in order, on the store's clock."""

from __future__ import annotations

from llmgw.store._runner import Runner
from llmgw.store._values import AuditEntry


class AuditStore:
    """The `audit` table: appended to, read newest first."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def audit(self, actor: str, action: str, detail: str = "") -> None:
        await self._run.q(
            f"INSERT INTO audit (at, actor, action, detail) VALUES ({self._run.now_sql}, ?, ?, ?)",
            (actor, action, detail),
        )

    async def recent_audit(self, limit: int = 100) -> list[AuditEntry]:
        """The newest `limit` entries, newest first."""
        rows = await self._run.q(
            "SELECT seq, at, actor, action, detail FROM audit ORDER BY seq DESC LIMIT ?",
            (int(limit),),
        )
        return [AuditEntry(int(s), float(a), str(w), str(x), str(d)) for s, a, w, x, d in rows]

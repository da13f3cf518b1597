"""Each model's rollout, as the control plane keeps it: one row a model, its body JSON.

The body is the control plane's (llmgw/cp/_fleet/_rollouts.py); the store only keeps it,
written on the store's clock, so that a restarted or newly elected control plane
continues a rollout and can undo it.
"""

from __future__ import annotations

from llmgw.store._runner import Runner

UPSERT_ROLLOUT = (
    "INSERT INTO rollouts (model, body, at) VALUES (?, ?, {at})"
    " ON CONFLICT (model) DO UPDATE SET body = excluded.body, at = excluded.at"
)


class RolloutStore:
    """The `rollouts` table."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def put_rollout(self, model: str, body_json: str) -> None:
        await self._run.q(UPSERT_ROLLOUT.format(at=self._run.now_sql), (model, body_json))

    async def delete_rollout(self, model: str) -> bool:
        rows = await self._run.q("DELETE FROM rollouts WHERE model = ? RETURNING model", (model,))
        return bool(rows)

    async def rollouts(self) -> dict[str, str]:
        rows = await self._run.q("SELECT model, body FROM rollouts ORDER BY model")
        return {str(m): str(b) for m, b in rows}

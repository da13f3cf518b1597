"""What the autoscaler shares through the store.

`router_load`: one row per control plane, its routers' load per model (the JSON of
`{router id: {model: RouterLoad}}`, llmgw/core/_load.py) and when it was written
(the writer's wall clock). The leader reads every row written within the last
seconds, so a standby's routers count too; a control plane that stops writing
drops out, and rows older than `KEEP_S` are deleted as others write.

`autoscale_paused`: the models whose count an operator holds (`ctl autoscale pause`),
with the count held, who held it and when. It outlives a failover.
"""

from __future__ import annotations

from llmgw.store._backends import Exec
from llmgw.store._runner import Runner

KEEP_S = 600.0


class AutoscaleStore:
    """The `router_load` and `autoscale_paused` tables."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def put_router_load(self, cp: str, body_json: str, now: float) -> None:
        def write(run: Exec) -> None:
            run(
                "INSERT INTO router_load (cp, body, at) VALUES (?, ?, ?) ON CONFLICT (cp)"
                " DO UPDATE SET body = excluded.body, at = excluded.at",
                (cp, body_json, float(now)),
            )
            run("DELETE FROM router_load WHERE at < ?", (float(now) - KEEP_S,))

        await self._run.tx(write)

    async def router_loads(self, since: float) -> list[tuple[str, str, float]]:
        """(control plane, body, written at) of every row written at or after `since`."""
        rows = await self._run.q(
            "SELECT cp, body, at FROM router_load WHERE at >= ? ORDER BY cp", (float(since),)
        )
        return [(str(cp), str(body), float(at)) for cp, body, at in rows]

    async def pause_autoscale(self, model: str, replicas: int, actor: str, now: float) -> None:
        await self._run.q(
            "INSERT INTO autoscale_paused (model, replicas, actor, at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (model) DO UPDATE SET replicas = excluded.replicas,"
            " actor = excluded.actor, at = excluded.at",
            (model, int(replicas), actor, float(now)),
        )

    async def resume_autoscale(self, model: str) -> bool:
        """False: it was not paused."""
        rows = await self._run.q(
            "DELETE FROM autoscale_paused WHERE model = ? RETURNING model", (model,)
        )
        return bool(rows)

    async def autoscale_paused(self) -> dict[str, tuple[int, str, float]]:
        """model -> (replicas held, actor, at)."""
        rows = await self._run.q("SELECT model, replicas, actor, at FROM autoscale_paused")
        return {str(m): (int(n), str(a), float(t)) for m, n, a, t in rows}

"""The admin pages' sessions, as the store keeps them: the SHA-256 of each session id
(never the id) and when it expires (seconds since the epoch, the writer's clock).

Kept so that a session made on one control plane is valid on another that shares the
store, and survives a failover; a logout deletes the row. Each write also deletes the
expired rows and all but the newest `MAX_STORED` by expiry, so the table stays bounded.
"""

from __future__ import annotations

from llmgw.store._backends import Exec
from llmgw.store._runner import Runner

MAX_STORED = 1024
PUT_SESSION = (
    "INSERT INTO admin_sessions (sid_sha256, expires_at) VALUES (?, ?)"
    " ON CONFLICT (sid_sha256) DO UPDATE SET expires_at = excluded.expires_at"
)
PRUNE_SESSIONS = (
    "DELETE FROM admin_sessions WHERE expires_at <= ? OR sid_sha256 NOT IN"
    " (SELECT sid_sha256 FROM admin_sessions ORDER BY expires_at DESC LIMIT ?)"
)


class SessionStore:
    """The `admin_sessions` table."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def put_admin_session(self, sid_sha256: bytes, expires_at: float, now: float) -> None:
        """Keep a session until `expires_at`; expired ones (as of `now`) are deleted."""

        def write(run: Exec) -> None:
            run(PUT_SESSION, (bytes(sid_sha256), float(expires_at)))
            run(PRUNE_SESSIONS, (float(now), MAX_STORED))

        await self._run.tx(write)

    async def admin_session(self, sid_sha256: bytes) -> float | None:
        """When the session expires; None: no such session (never made, or ended)."""
        rows = await self._run.q(
            "SELECT expires_at FROM admin_sessions WHERE sid_sha256 = ?", (bytes(sid_sha256),)
        )
        return float(rows[0][0]) if rows else None

    async def end_admin_session(self, sid_sha256: bytes) -> bool:
        rows = await self._run.q(
            "DELETE FROM admin_sessions WHERE sid_sha256 = ? RETURNING expires_at",
            (bytes(sid_sha256),),
        )
        return bool(rows)

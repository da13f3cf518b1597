"""Moving a whole store: every row out in one transaction, into an empty store in one.

`llmgw-cp init --postgres` (llmgw/cp/_init_pg.py) moves a control plane's
SQLite store to PostgreSQL this way. A store that already holds accounts or
keys is never merged into; the lease is left free at an epoch at least the
source's, so agents never see a leader's epoch go down.
"""

from __future__ import annotations

import logging

from llmgw.errors import UsageError
from llmgw.store._accounts import INSERT_ACCOUNT, INSERT_KEY, KEY_COLUMNS
from llmgw.store._backends import Exec
from llmgw.store._events import ADD_EVENT
from llmgw.store._nodes import UPSERT_KNOWN, UPSERT_OVERRIDE
from llmgw.store._rollouts import UPSERT_ROLLOUT
from llmgw.store._runner import Runner
from llmgw.store._usage import ADD_USAGE
from llmgw.store._values import StoreDump

log = logging.getLogger("llmgw.store")


def _read(run: Exec) -> StoreDump:
    lease = run("SELECT epoch FROM lease WHERE id = 1")
    return StoreDump(
        accounts=tuple(
            tuple(r)
            for r in run("SELECT name, rpm, tpm, max_band, created_at FROM accounts ORDER BY name")
        ),
        keys=tuple(
            (bytes(r[0]), *r[1:])
            for r in run(
                f"SELECT secret_sha256, {KEY_COLUMNS}, expires_at FROM api_keys"
                " ORDER BY created_at, key_id"
            )
        ),
        overrides=tuple(
            tuple(r)
            for r in run("SELECT node_id, kind, reason, at FROM node_overrides ORDER BY node_id")
        ),
        known_nodes=tuple(
            tuple(r)
            for r in run("SELECT node_id, address, last_seen FROM known_nodes ORDER BY node_id")
        ),
        audit=tuple(
            tuple(r) for r in run("SELECT at, actor, action, detail FROM audit ORDER BY seq")
        ),
        usage=tuple(
            tuple(r)
            for r in run(
                "SELECT hour, tenant, key_id, model, requests, prompt_tokens,"
                " completion_tokens FROM usage ORDER BY hour, tenant, key_id, model"
            )
        ),
        epoch=int(lease[0][0]) if lease else 0,
        rollouts=tuple(
            tuple(r) for r in run("SELECT model, body, at FROM rollouts ORDER BY model")
        ),
        # The event log moves with the store; the admin sessions do not (log in again).
        events=tuple(tuple(r) for r in run("SELECT at, body FROM events ORDER BY seq")),
        # Held counts move; the routers' load does not (the next writes bring it).
        paused=tuple(
            tuple(r)
            for r in run("SELECT model, replicas, actor, at FROM autoscale_paused ORDER BY model")
        ),
    )


class StoreMove:
    """A store's rows out (`export_rows`) and in (`import_rows`)."""

    def __init__(self, runner: Runner) -> None:
        self._run = runner

    async def export_rows(self) -> StoreDump:
        """Everything kept here, as rows, read in one transaction: what a move copies."""
        return await self._run.tx(_read)

    async def import_rows(self, dump: StoreDump) -> None:
        """Copy `dump` in, all in one transaction; refused (UsageError) when this store
        already holds accounts or keys: one store is never merged into another.

        The lease is left free with the epoch at least the dump's, so the next leader's
        epoch is above every epoch agents saw from the store the dump came from.
        """
        where = self._run.where

        def write(run: Exec) -> None:
            accounts = int(run("SELECT COUNT(*) FROM accounts")[0][0])
            keys = int(run("SELECT COUNT(*) FROM api_keys")[0][0])
            if accounts or keys:
                raise UsageError(
                    f"the store at {where} already holds {accounts} accounts and {keys}"
                    " API keys: moving one store into another is refused"
                )
            for row in dump.accounts:
                run(INSERT_ACCOUNT, row)
            for row in dump.keys:
                run(INSERT_KEY, row)
            for row in dump.overrides:
                run(UPSERT_OVERRIDE.format(at="?"), row)
            for row in dump.known_nodes:
                run(UPSERT_KNOWN.format(at="?"), row)
            for row in dump.audit:
                run("INSERT INTO audit (at, actor, action, detail) VALUES (?,?,?,?)", row)
            for row in dump.usage:
                run(ADD_USAGE, row)
            for row in dump.rollouts:
                run(UPSERT_ROLLOUT.format(at="?"), row)
            for row in dump.events:
                run(ADD_EVENT, row)
            for row in dump.paused:
                run(
                    "INSERT INTO autoscale_paused (model, replicas, actor, at) VALUES (?,?,?,?)",
                    row,
                )
            run(
                "UPDATE lease SET holder = NULL, expires_at = 0,"
                " epoch = CASE WHEN epoch > ? THEN epoch ELSE ? END WHERE id = 1",
                (dump.epoch, dump.epoch),
            )

        await self._run.tx(write)
        log.info("store %s: imported %s", where, dump.describe())

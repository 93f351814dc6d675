"""Relayed commands (the ``commands`` table): the signed commands operators sent through the
service, and each one's result once its node answered."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cloudsync.fleet.store import Store, Tx, dumps


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A relayed command as the API and the console show it (its result an object)."""
    return {**row, "result": json.loads(row["result"]) if row["result"] else None}


def sent(
    tx: Tx, ident: str, node: str, name: str, issuer: str, kid: str, actor: str, ts: int
) -> bool:
    """A command kept as sent (in the caller's transaction); False: its id was sent already."""
    made = tx.execute(
        "INSERT INTO commands (id, node, name, issuer, kid, actor, sent_ts) VALUES"
        " (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        (ident, node, name, issuer, kid, actor, ts),
    )
    return bool(made.rowcount == 1)


def answered(tx: Tx, ident: str, node: str, result: Any, ts: int) -> None:
    """A node's result of a command sent to it (the first one counts), in the ingest's
    transaction."""
    tx.execute(
        "UPDATE commands SET result = ?, result_ts = ? WHERE id = ? AND node = ?"
        " AND result IS NULL",
        (dumps(result), ts, ident, node),
    )


class Commands:
    def __init__(self, store: Store, clock: Callable[[], int]) -> None:
        self.store, self.clock = store, clock

    def keep(self, command: dict[str, Any], node: str, actor: str) -> None:
        """A command about to be sent (KeyError: its id was sent already)."""
        with self.store.transaction() as tx:
            if not sent(
                tx,
                command["id"],
                node,
                command["name"],
                command["issuer"],
                command["kid"],
                actor,
                self.clock(),
            ):
                raise KeyError(f"command {command['id']} was sent already")

    def get(self, ident: str) -> dict[str, Any] | None:
        rows = self.store.query("SELECT * FROM commands WHERE id = ?", (ident,))
        return shown(rows[0]) if rows else None

    def of_node(self, node: str, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` commands sent to ``node``."""
        rows = self.store.query(
            "SELECT * FROM commands WHERE node = ? ORDER BY sent_ts DESC LIMIT ?", (node, limit)
        )
        return [shown(r) for r in rows]

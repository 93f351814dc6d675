"""Relayed commands (the ``commands`` table): the signed commands operators sent through the
service, and each one's result once its node answered."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cloudsync.fleet.store import Store


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A relayed command as the API and the console show it (its result an object)."""
    return {**row, "result": json.loads(row["result"]) if row["result"] else None}


class Commands:
    def __init__(self, store: Store, clock: Callable[[], int]) -> None:
        self.store, self.clock = store, clock

    def keep(self, command: dict[str, Any], node: str, actor: str) -> None:
        """A command about to be sent (KeyError: its id was sent already)."""
        with self.store.transaction() as tx:
            made = tx.execute(
                "INSERT INTO commands (id, node, name, issuer, kid, actor, sent_ts) VALUES"
                " (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (command["id"], node, command["name"], command["issuer"], command["kid"], actor,
                 self.clock()),
            )  # fmt: skip
            if made.rowcount != 1:
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

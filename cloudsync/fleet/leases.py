"""Leases (the ``leases`` table): a name held by one replica until it expires, so that of
several replicas one at a time does a job (the runner)."""

from __future__ import annotations

from cloudsync.fleet.store import Store


class Leases:
    def __init__(self, store: Store) -> None:
        self.store = store

    def take(self, name: str, holder: str, now_ms: int, for_ms: int) -> bool:
        """Takes ``name`` for ``holder``, or renews it; whether ``holder`` holds it now (no
        one did, the last holder's lease expired, or it was ``holder``'s)."""
        with self.store.transaction() as tx:
            done = tx.execute(
                "INSERT INTO leases (name, holder, expires) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
                " expires = excluded.expires"
                " WHERE leases.expires < ? OR leases.holder = excluded.holder",
                (name, holder, now_ms + for_ms, now_ms),
            )
            return done.rowcount == 1

    def release(self, name: str, holder: str) -> None:
        with self.store.transaction() as tx:
            tx.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

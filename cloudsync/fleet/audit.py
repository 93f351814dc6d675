"""The audit log (the ``audit`` table): who did what to which target, with what outcome. Every
action the API or the console takes or refuses is written here; both read it back."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from cloudsync.fleet.config import Token
from cloudsync.fleet.store import Store, dumps

MAX_DETAIL = 2000  # characters of an entry's detail (JSON) kept; more is cut and marked


class AuditLog:
    def __init__(self, store: Store, clock: Callable[[], int]) -> None:
        self.store, self.clock = store, clock

    def add(self, who: Token, action: str, target: str, outcome: str, detail: Any = None) -> None:
        text = dumps(detail if detail is not None else {})
        if len(text) > MAX_DETAIL:
            text = dumps({"truncated": text[:MAX_DETAIL]})
        with self.store.transaction() as tx:
            tx.execute(
                "INSERT INTO audit (ts, actor, role, action, target, outcome, detail)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (self.clock(), who.name, who.role, action, target, outcome, text),
            )

    def after(self, after: int, limit: int) -> list[dict[str, Any]]:
        """The oldest ``limit`` entries after id ``after``, their detail an object (the API's
        pages, read forward)."""
        rows = self.store.query(
            "SELECT * FROM audit WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
        )
        for row in rows:
            row["detail"] = json.loads(row["detail"])
        return rows

    def before(self, before: int, contains: str, limit: int) -> list[dict[str, Any]]:
        """The newest entries before id ``before`` whose actor, action, target or outcome has
        ``contains`` in it (the console's pages, read backward)."""
        where, params = "id < ?", list[Any]([before])
        if contains:
            like = "%" + re.sub(r"([\\%_])", r"\\\1", contains) + "%"
            where += (
                " AND ("
                + " OR ".join(
                    f"{c} LIKE ? ESCAPE '\\'" for c in ("actor", "action", "target", "outcome")
                )
                + ")"
            )
            params += [like] * 4
        return self.store.query(
            f"SELECT * FROM audit WHERE {where} ORDER BY id DESC LIMIT ?", (*params, limit)
        )

"""The console's sessions (the ``console_sessions`` table): a session id's SHA-256 and its
holder's name, until it expires or its holder signs out; in the database, so that every replica
knows it and signing out ends it everywhere."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from cloudsync.fleet.store import Store

SESSION_S = 12 * 3600  # a console session's life: signed in again after a working day


def session_hash(session: str) -> str:
    return hashlib.sha256(session.encode(errors="surrogatepass")).hexdigest()


class Sessions:
    def __init__(self, store: Store, clock: Callable[[], int]) -> None:
        self.store, self.clock = store, clock

    def open(self, holder: str) -> str:
        """A new session of ``holder``: its id (only its SHA-256 is kept); expired ones go."""
        session, now = secrets.token_urlsafe(32), self.clock()
        with self.store.transaction() as tx:
            tx.execute("DELETE FROM console_sessions WHERE expires <= ?", (now,))
            tx.execute(
                "INSERT INTO console_sessions (sha256, holder, created_ts, expires)"
                " VALUES (?, ?, ?, ?)",
                (session_hash(session), holder, now, now + SESSION_S * 1000),
            )
        return session

    def close(self, session: str) -> None:
        with self.store.transaction() as tx:
            tx.execute("DELETE FROM console_sessions WHERE sha256 = ?", (session_hash(session),))

    def holder(self, session: str) -> str | None:
        """The name of the session's holder while it lasts, or None."""
        found = self.store.query(
            "SELECT holder FROM console_sessions WHERE sha256 = ? AND expires > ?",
            (session_hash(session), self.clock()),
        )
        return str(found[0]["holder"]) if found else None

"""The fleet service's database: SQLite in its state directory by default, PostgreSQL for
several replicas. One schema and one SQL for both (what the two share: ``ON CONFLICT``
upserts, ``RETURNING``; ``?`` placeholders, turned into psycopg's ``%s``, and ``%`` into
``%%``).

One service serves one fleet, so a database (or a PostgreSQL schema) holds one fleet. JSON
columns are text. Times are milliseconds since the epoch, UTC.

Connections are per thread (the ingest writer, the HTTP handlers' pool, the runner): SQLite in
WAL mode lets readers go on while the writer writes; PostgreSQL connections run in autocommit
outside ``transaction()``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("edgefleet.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'unknown',
    reason TEXT,
    status_ts BIGINT NOT NULL DEFAULT 0,
    first_seen BIGINT NOT NULL,
    last_seen BIGINT NOT NULL DEFAULT 0,
    heartbeats BIGINT NOT NULL DEFAULT 0,
    heartbeat_ts BIGINT NOT NULL DEFAULT 0,
    heartbeat TEXT,
    hardware TEXT NOT NULL DEFAULT '{}',
    software TEXT NOT NULL DEFAULT '{}',
    models TEXT NOT NULL DEFAULT '[]',
    node_labels TEXT NOT NULL DEFAULT '{}',
    labels TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS history (
    node TEXT NOT NULL,
    ts BIGINT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    arrived BIGINT NOT NULL,
    PRIMARY KEY (node, ts, state)
);
CREATE TABLE IF NOT EXISTS steps (
    node TEXT NOT NULL,
    model TEXT NOT NULL,
    version BIGINT NOT NULL,
    step TEXT NOT NULL,
    ts BIGINT NOT NULL,
    PRIMARY KEY (node, model, version)
);
CREATE TABLE IF NOT EXISTS desired (
    node TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    models TEXT NOT NULL,
    ts BIGINT NOT NULL,
    seq BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS managed (
    node TEXT PRIMARY KEY,
    models TEXT NOT NULL,
    digest TEXT NOT NULL,
    ts BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS deployments (
    id TEXT PRIMARY KEY,
    selector TEXT NOT NULL,
    priority INTEGER NOT NULL,
    models TEXT NOT NULL,
    state TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    created_by TEXT NOT NULL,
    updated_ts BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id {serial},
    ts BIGINT NOT NULL,
    actor TEXT NOT NULL,
    role TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    doc TEXT NOT NULL,
    rev BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS rollout_nodes (
    rollout TEXT NOT NULL,
    node TEXT NOT NULL,
    rank INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    state TEXT NOT NULL,
    previous TEXT,
    sent_ts BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (rollout, node)
);
CREATE TABLE IF NOT EXISTS egress_checkpoints (
    node TEXT NOT NULL,
    ledger TEXT NOT NULL,
    seq BIGINT NOT NULL,
    hash TEXT NOT NULL,
    ts BIGINT NOT NULL,
    PRIMARY KEY (node, ledger, seq)
);
CREATE INDEX IF NOT EXISTS egress_checkpoints_by_ts ON egress_checkpoints (ts);
CREATE TABLE IF NOT EXISTS ab_tests (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ab_test_nodes (
    test TEXT NOT NULL,
    node TEXT NOT NULL,
    want TEXT NOT NULL,
    state TEXT NOT NULL,
    cmd TEXT,
    sent_ts BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (test, node)
);
CREATE TABLE IF NOT EXISTS telemetry (
    node TEXT NOT NULL,
    ts BIGINT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    requests BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    p95_ms DOUBLE PRECISION,
    conf_n BIGINT NOT NULL DEFAULT 0,
    conf_sum DOUBLE PRECISION NOT NULL DEFAULT 0,
    routed BIGINT NOT NULL DEFAULT 0,
    fallbacks BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (node, ts, model, version)
);
CREATE INDEX IF NOT EXISTS telemetry_by_model ON telemetry (model, ts);
CREATE TABLE IF NOT EXISTS commands (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    name TEXT NOT NULL,
    issuer TEXT NOT NULL,
    kid TEXT NOT NULL,
    actor TEXT NOT NULL,
    sent_ts BIGINT NOT NULL,
    result TEXT,
    result_ts BIGINT
);
CREATE INDEX IF NOT EXISTS commands_by_node ON commands (node, sent_ts);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    node TEXT NOT NULL,
    id TEXT NOT NULL,
    ts BIGINT NOT NULL,
    arrived BIGINT NOT NULL,
    priority TEXT NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (node, id)
);
CREATE INDEX IF NOT EXISTS events_by_node ON events (node, arrived);
CREATE INDEX IF NOT EXISTS events_by_arrival ON events (arrived);
CREATE TABLE IF NOT EXISTS alerts (
    node TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    alertname TEXT NOT NULL,
    severity TEXT NOT NULL,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    state TEXT NOT NULL,
    starts_ms BIGINT NOT NULL,
    ends_ms BIGINT,
    changed_ms BIGINT NOT NULL,
    PRIMARY KEY (node, fingerprint)
);
CREATE INDEX IF NOT EXISTS alerts_by_state ON alerts (state, node);
CREATE TABLE IF NOT EXISTS enrol_tokens (
    sha256 TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    expires BIGINT NOT NULL,
    created_by TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    used_ts BIGINT,
    used_by TEXT
);
CREATE TABLE IF NOT EXISTS enrolments (
    rid TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    csr TEXT NOT NULL,
    state TEXT NOT NULL,
    how TEXT NOT NULL,
    requested_ts BIGINT NOT NULL,
    decided_ts BIGINT,
    decided_by TEXT,
    reason TEXT,
    cert TEXT,
    serial TEXT,
    not_after BIGINT
);
CREATE INDEX IF NOT EXISTS enrolments_by_state ON enrolments (state, requested_ts);
CREATE TABLE IF NOT EXISTS revoked (
    serial TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    revoked_ts BIGINT NOT NULL,
    revoked_by TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS barred (
    node TEXT PRIMARY KEY,
    barred_ts BIGINT NOT NULL,
    barred_by TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS console_sessions (
    sha256 TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    expires BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    node TEXT NOT NULL,
    id TEXT NOT NULL,
    arrived BIGINT NOT NULL,
    PRIMARY KEY (node, id)
);
CREATE INDEX IF NOT EXISTS records_by_arrival ON records (arrived);
CREATE TABLE IF NOT EXISTS counters (
    node TEXT NOT NULL,
    name TEXT NOT NULL,
    labels TEXT NOT NULL,
    value DOUBLE PRECISION NOT NULL,
    bucket INTEGER NOT NULL,
    PRIMARY KEY (node, name, labels)
);
"""
SERIAL = {"sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT", "postgresql": "BIGSERIAL PRIMARY KEY"}


class StoreError(RuntimeError):
    """The database cannot be opened or used (its message says which and why)."""


class Cursor(Protocol):
    rowcount: int

    def fetchall(self) -> list[Any]: ...
    def fetchone(self) -> Any: ...


class Store:
    """A database by URL: ``sqlite:///path`` (or a plain path) or ``postgresql://...``."""

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith(("postgresql://", "postgres://")):
            self.dialect = "postgresql"
            try:
                import psycopg  # noqa: F401  (optional: pip install 'edged[fleet]')
            except ImportError as exc:
                raise StoreError(
                    "a postgresql:// database needs psycopg (pip install 'psycopg[binary]')"
                ) from exc
        else:
            self.dialect = "sqlite"
            self.path = Path(url.removeprefix("sqlite://"))
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.local = threading.local()
        self.opened: list[Any] = []
        self.lock = threading.Lock()
        with self.transaction() as tx:
            self.advisory_lock(tx, "schema")  # replicas starting at once make it once
            for statement in SCHEMA.replace("{serial}", SERIAL[self.dialect]).split(";"):
                if statement.strip():
                    tx.execute(statement)

    def _connect(self) -> Any:
        conn: Any
        if self.dialect == "postgresql":
            import psycopg

            try:
                conn = psycopg.connect(self.url, autocommit=True)
            except psycopg.Error as exc:
                raise StoreError(f"cannot connect to the database: {exc}") from exc
        else:
            conn = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self.path.chmod(0o600)
        with self.lock:
            self.opened.append(conn)
        return conn

    @property
    def conn(self) -> Any:
        conn = getattr(self.local, "conn", None)
        if conn is None or getattr(conn, "closed", False):
            conn = self.local.conn = self._connect()
        return conn

    def sql(self, text: str) -> str:
        """The statement in the dialect's placeholders (psycopg: ``%s``, and a ``%`` as
        ``%%``; every statement goes with its parameters, if only ``()``)."""
        if self.dialect != "postgresql":
            return text
        return text.replace("%", "%%").replace("?", "%s")

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        conn = self.conn
        if self.dialect == "postgresql":
            with conn.transaction():
                yield Tx(self, conn.cursor())
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield Tx(self, conn.cursor())
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def advisory_lock(self, tx: Tx, name: str) -> None:
        """A lock held until ``tx`` ends: PostgreSQL's advisory lock by name; SQLite's
        transactions (BEGIN IMMEDIATE) hold its one write lock already."""
        if self.dialect == "postgresql":
            tx.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (name,))

    def query(self, text: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows as dicts (outside a transaction: what is committed)."""
        cursor = self.conn.cursor()
        cursor.execute(self.sql(text), tuple(params))
        names = [d[0] for d in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def ping(self) -> None:
        """Raises if the database does not answer."""
        self.query("SELECT 1 AS ok")

    def size_bytes(self) -> int:
        """The database's size on disk (SQLite: the file and its WAL)."""
        if self.dialect == "postgresql":
            return int(self.query("SELECT pg_database_size(current_database()) AS n")[0]["n"])
        return sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())

    def close(self) -> None:
        with self.lock:
            for conn in self.opened:
                try:
                    conn.close()
                except Exception:  # closing what may be broken already
                    log.debug("closing a connection", exc_info=True)
            self.opened.clear()
        self.local = threading.local()


class Tx:
    """A transaction's statements."""

    def __init__(self, store: Store, cursor: Any) -> None:
        self.store, self.cursor = store, cursor

    def execute(self, text: str, params: Sequence[Any] = ()) -> Cursor:
        self.cursor.execute(self.store.sql(text), tuple(params))
        return self.cursor  # type: ignore[no-any-return,unused-ignore]

    def executemany(self, text: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = [tuple(r) for r in rows]
        if rows:
            self.cursor.executemany(self.store.sql(text), rows)

    def rows(self, text: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        self.execute(text, params)
        names = [d[0] for d in self.cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in self.cursor.fetchall()]


def dumps(value: Any) -> str:
    """JSON as the columns keep it (compact, keys sorted: the same value, the same text)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))

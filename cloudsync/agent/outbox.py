"""The outbox: every record cloudsync must deliver, on disk until the broker acknowledges it.

SQLite through sqlite-utils, WAL with ``synchronous=FULL`` (a record that ``put`` returned is on
disk, a power cut does not take it back). One process owns the file.

- **Priorities**: alert (0) before event (1) before telemetry (2); within a priority, the order
  of ``put`` (``seq``, never reused). ``peek`` gives the next records in that order.
- **Idempotency**: each record has an ``id``; a ``put`` of an id already in the outbox, or
  among the last ``remember_ids`` that left it (acknowledged or dead-lettered), is a no-op
  (counted as ``duplicate``): a producer that retries a batch whose answer a crash lost does
  not send its delivered records again under new stream numbers. The id travels in the
  envelope, so a record sent twice (a PUBACK lost to a crash) is recognisably the same record.
- **Leaves only on acknowledgement**: ``ack`` deletes records, and the sender calls it from the
  PUBACK. A record the broker refuses goes to the ``dead`` table with the reason
  (``dead_letter``), never silently.
- **Streams**: each record also gets a number in its stream, the topic it goes to and its
  priority (``telemetry/telemetry``, ``events/alert``, ``result/event`` ...): 1, 2, 3 ... with
  no number skipped, in the outbox's ``epoch`` (a random id made with the file; a new outbox
  starts new streams). The envelope's ``seq`` is that number, beside ``epoch`` and
  ``priority``: a consumer of one topic sees a gap in a stream exactly where the node dropped
  a stored record (TTL, budget) or the broker refused one, each counted below.
- **TTL**: a record may carry an expiry; expired records are dropped before sending and counted
  (``dropped_ttl``).
- **Disk budget**: the records' bytes stay under ``budget_bytes``. To make room, the oldest
  records of the least urgent priority go first, never a more urgent one for a less urgent
  one; a record that cannot fit is not stored. Each record dropped is counted
  (``dropped_budget``): the count is exact, every ``put`` ends in exactly one of stored,
  duplicate or dropped.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from cloudsync.protocol.envelope import Envelope, canonical, new_id, now_ms

PRIORITIES = {"alert": 0, "event": 1, "telemetry": 2}
PRIORITY_NAMES = {number: name for name, number in PRIORITIES.items()}
REMEMBER_IDS = 100_000  # ids kept after their records left (about 5 MB on disk)
ROW_OVERHEAD = 64  # bytes a row costs beyond its body, for the budget
SQLITE_FULL = 13  # sqlite3.SQLITE_FULL from Python 3.11 on (sqlite_errorcode: 3.11 too)
COUNTERS = ("put", "duplicate", "acked", "dropped_budget", "dropped_ttl", "dead")


class OutboxError(Exception):
    """The outbox cannot take the record (a full disk, a body that is not JSON); ``full``: the
    disk (or its quota) is full, so a retry once space returns may succeed."""

    def __init__(self, message: str, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


@dataclass(frozen=True)
class Record:
    seq: int  # the outbox's own order (every stream), for ack and peek
    id: str
    priority: int
    kind: str  # the topic leaf it goes to: telemetry, events, result/{command id}
    body: dict[str, Any]
    created_ms: int
    size: int
    stream_seq: int = 0  # its number in its stream
    epoch: str = ""

    def envelope(self, node: str) -> Envelope:
        """The same bytes every time it is sent: id, seq and ts are the record's."""
        extra = {"epoch": self.epoch, "priority": PRIORITY_NAMES[self.priority]}
        return Envelope(node, self.stream_seq, self.body, self.id, self.created_ms, extra=extra)


def stream_of(kind: str, priority: str) -> str:
    """The stream of a record: the topic leaf it goes to (every result is ``result``) and its
    priority."""
    return f"{kind.partition('/')[0]}/{priority}"


@dataclass(frozen=True)
class Item:
    """What ``put_many`` takes."""

    kind: str
    body: dict[str, Any]
    priority: str = "telemetry"
    id: str | None = None
    ttl_s: float | None = None


class Outbox:
    def __init__(
        self, path: str | Path, budget_bytes: int = 256 << 20, remember_ids: int = REMEMBER_IDS
    ) -> None:
        self.path = Path(path)
        self.budget = budget_bytes
        self.remember_ids = remember_ids
        self._lock = threading.Lock()
        self.full = False  # the last write failed for a full disk (and none succeeded since)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self.db = sqlite_utils.Database(conn)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self._create()
        except (OSError, sqlite3.Error) as exc:
            raise OutboxError(f"cannot open the outbox at {self.path}: {exc}") from None
        self.epoch = self._epoch()
        self.bytes = int(self.db.execute("SELECT total(size) FROM outbox").fetchone()[0])
        self.counters = {
            row[0]: int(row[1]) for row in self.db.execute("SELECT name, value FROM counters")
        }

    def _create(self) -> None:
        self.db.execute(
            """CREATE TABLE IF NOT EXISTS outbox (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                id TEXT NOT NULL UNIQUE,
                priority INTEGER NOT NULL,
                kind TEXT NOT NULL,
                body TEXT NOT NULL,
                size INTEGER NOT NULL,
                created_ms INTEGER NOT NULL,
                expires_ms INTEGER
            )"""
        )
        self.db.execute("CREATE INDEX IF NOT EXISTS outbox_order ON outbox (priority, seq)")
        # ``peek`` drops what expired on every call: an index, not a scan of the whole outbox
        self.db.execute(
            "CREATE INDEX IF NOT EXISTS outbox_expiry ON outbox (expires_ms)"
            " WHERE expires_ms IS NOT NULL"
        )
        if "dead" not in self.db.table_names():
            self.db.table("dead").create(
                {
                    "seq": int,
                    "id": str,
                    "priority": int,
                    "kind": str,
                    "body": str,
                    "reason": str,
                    "at_ms": int,
                },
                pk="seq",
            )
        self.db.execute("CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT)")
        self.db.execute("CREATE TABLE IF NOT EXISTS streams (name TEXT PRIMARY KEY, last INTEGER)")
        # the ids of records that left (acked, dead-lettered), newest ``remember_ids`` of them
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS settled (n INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE)"
        )
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(outbox)")}
        if "stream_seq" not in columns:  # an outbox of an older cloudsync: numbered now, whole
            with self._lock, self._transaction():  # (a crash part-way leaves it as it was)
                self.db.execute(
                    "ALTER TABLE outbox ADD COLUMN stream_seq INTEGER NOT NULL DEFAULT 0"
                )
                last: dict[str, int] = {}
                numbered = []
                for seq, kind, priority in self.db.execute(
                    "SELECT seq, kind, priority FROM outbox ORDER BY seq"
                ).fetchall():
                    stream = stream_of(kind, PRIORITY_NAMES[priority])
                    last[stream] = last.get(stream, 0) + 1
                    numbered.append((last[stream], seq))
                self.db.conn.executemany("UPDATE outbox SET stream_seq = ? WHERE seq = ?", numbered)
                self.db.conn.executemany("INSERT INTO streams VALUES (?, ?)", last.items())
        if "counters" not in self.db.table_names():
            self.db.table("counters").create({"name": str, "value": int}, pk="name")
            self.db.table("counters").insert_all([{"name": n, "value": 0} for n in COUNTERS])

    def _epoch(self) -> str:
        """The id of this outbox's streams, made once with the file."""
        with self._lock, self._transaction():
            row = self.db.execute("SELECT value FROM state WHERE key = 'epoch'").fetchone()
            if row is not None:
                return str(row[0])
            epoch = new_id()[:16]
            self.db.execute("INSERT INTO state VALUES ('epoch', ?)", [epoch])
            return epoch

    def close(self) -> None:
        with self._lock:
            self.db.close()

    # ---- in ----------------------------------------------------------------------------------

    def put(
        self,
        kind: str,
        body: dict[str, Any],
        priority: str = "telemetry",
        id: str | None = None,
        ttl_s: float | None = None,
    ) -> str | None:
        """Store one record: its id, or None when the budget could not take it."""
        (stored,) = self.put_many([Item(kind, body, priority, id, ttl_s)])
        return stored

    def put_many(
        self, items: Sequence[Item], state: dict[str, str] | None = None
    ) -> list[str | None]:
        """Store records in one transaction (batching: one fsync for all): for each, its id
        (a duplicate's too), or None when the budget could not take it. ``state``: keys set in
        the same transaction (a reader's cursor advances exactly when its records are stored)."""
        now = now_ms()
        out: list[str | None] = []
        counts = dict.fromkeys(COUNTERS, 0)
        with self._lock, self._transaction():
            for item in items:
                out.append(self._put(item, now, counts))
            for key, value in (state or {}).items():
                self.db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", [key, value])
            self._bump(counts)
        for name, n in counts.items():
            self.counters[name] = self.counters.get(name, 0) + n
        return out

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (the caller holds the lock): all of it or, on any error,
        nothing (the byte count is read again); SQLite's errors as OutboxError, ``full`` when
        the disk is (SQLITE_FULL)."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            yield
            self.db.execute("COMMIT")
            self.full = False
        except BaseException as exc:
            try:
                if self.db.conn.in_transaction:
                    self.db.execute("ROLLBACK")
                self.bytes = int(self.db.execute("SELECT total(size) FROM outbox").fetchone()[0])
            except sqlite3.Error:  # the rollback failed too: SQLite rolls back on the next use
                pass
            if isinstance(exc, sqlite3.Error):
                code = getattr(exc, "sqlite_errorcode", None)
                full = code == SQLITE_FULL or "disk is full" in str(exc)
                self.full = self.full or full
                raise OutboxError(f"the outbox at {self.path} cannot store: {exc}", full) from exc
            raise

    def _put(self, item: Item, now: int, counts: dict[str, int]) -> str | None:
        if item.priority not in PRIORITIES:
            raise OutboxError(f"priority '{item.priority}': one of {', '.join(PRIORITIES)}")
        try:
            raw = canonical(item.body)
        except (TypeError, ValueError) as exc:
            raise OutboxError(f"a body that is not JSON: {exc}") from None
        record_id = item.id or new_id()
        counts["put"] += 1
        exists = self.db.execute(
            "SELECT 1 FROM outbox WHERE id = ? UNION ALL SELECT 1 FROM settled WHERE id = ?",
            [record_id, record_id],
        ).fetchone()
        if exists:
            counts["duplicate"] += 1
            return record_id
        priority = PRIORITIES[item.priority]
        body, size = raw.decode(), len(raw) + ROW_OVERHEAD  # bytes, not characters
        if not self._make_room(size, priority, counts):
            counts["dropped_budget"] += 1
            return None
        expires = None if item.ttl_s is None else now + int(1000 * item.ttl_s)
        (number,) = self.db.execute(
            "INSERT INTO streams VALUES (?, 1) ON CONFLICT (name) DO UPDATE SET last = last + 1"
            " RETURNING last",
            [stream_of(item.kind, item.priority)],
        ).fetchone()
        self.db.execute(
            "INSERT INTO outbox (id, priority, kind, body, size, created_ms, expires_ms,"
            " stream_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [record_id, priority, item.kind, body, size, now, expires, number],
        )
        self.bytes += size
        return record_id

    def _make_room(self, size: int, priority: int, counts: dict[str, int]) -> bool:
        """Drop the oldest records of the least urgent priorities (never more urgent than
        ``priority``) until ``size`` more bytes fit; False (nothing dropped) if they cannot."""
        if self.bytes + size <= self.budget:
            return True
        if size > self.budget:
            return False
        need = self.bytes + size - self.budget
        victims: list[tuple[int, int]] = []
        freed = 0
        rows = self.db.execute(
            "SELECT seq, size FROM outbox WHERE priority >= ? ORDER BY priority DESC, seq",
            [priority],
        )
        for seq, row_size in rows:
            victims.append((seq, row_size))
            freed += row_size
            if freed >= need:
                break
        if freed < need:
            return False
        self.db.conn.executemany("DELETE FROM outbox WHERE seq = ?", [(s,) for s, _ in victims])
        self.bytes -= freed
        counts["dropped_budget"] += len(victims)
        return True

    def get_state(self, key: str) -> str | None:
        with self._lock:
            row = self.db.execute("SELECT value FROM state WHERE key = ?", [key]).fetchone()
        return None if row is None else str(row[0])

    def states(self, prefix: str) -> dict[str, str]:
        """Every state key that starts with ``prefix``, with its value."""
        with self._lock:
            rows = self.db.execute(
                "SELECT key, value FROM state WHERE substr(key, 1, ?) = ?", [len(prefix), prefix]
            ).fetchall()
        return {str(k): str(v) for k, v in rows}

    # ---- out ---------------------------------------------------------------------------------

    def peek(self, limit: int = 100, exclude: Iterable[int] = ()) -> list[Record]:
        """The next records to send, most urgent first, then in order; expired ones are
        dropped (and counted) first; ``exclude``: the seqs in flight."""
        skip = list(exclude)
        with self._lock:
            now = now_ms()
            with contextlib.suppress(OutboxError):  # a full disk: dropped later, not sent now
                self._expire(now)
            sql = (
                "SELECT seq, id, priority, kind, body, created_ms, size, stream_seq FROM outbox"
                " WHERE (expires_ms IS NULL OR expires_ms >= ?)"
            )
            if skip:
                sql += f" AND seq NOT IN ({','.join('?' * len(skip))})"
            sql += " ORDER BY priority, seq LIMIT ?"
            rows = self.db.execute(sql, [now, *skip, limit]).fetchall()
        return [
            Record(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], r[6], r[7], self.epoch)
            for r in rows
        ]

    def _expire(self, now: int) -> None:
        found = self.db.execute(
            "SELECT count(*), total(size) FROM outbox WHERE expires_ms < ?", [now]
        ).fetchone()
        if not found[0]:
            return
        with self._transaction():
            self.db.execute("DELETE FROM outbox WHERE expires_ms < ?", [now])
            self._bump({"dropped_ttl": int(found[0])})
        self.bytes -= int(found[1])
        self.counters["dropped_ttl"] = self.counters.get("dropped_ttl", 0) + int(found[0])

    def ack(self, seqs: Iterable[int]) -> int:
        """The broker has these: they leave the outbox. The number that did."""
        done = list(seqs)
        if not done:
            return 0
        marks = ",".join("?" * len(done))
        with self._lock:
            with self._transaction():
                found = self.db.execute(
                    f"SELECT count(*), total(size) FROM outbox WHERE seq IN ({marks})", done
                ).fetchone()
                self._settle(f"SELECT id FROM outbox WHERE seq IN ({marks})", done)
                self.db.execute(f"DELETE FROM outbox WHERE seq IN ({marks})", done)
                self._bump({"acked": int(found[0])})
            self.bytes -= int(found[1])
            self.counters["acked"] = self.counters.get("acked", 0) + int(found[0])
        return int(found[0])

    def dead_letter(self, seq: int, reason: str) -> None:
        """The broker refused this record: keep it apart, with why, and stop sending it."""
        with self._lock:
            row = self.db.execute(
                "SELECT seq, id, priority, kind, body, size FROM outbox WHERE seq = ?", [seq]
            ).fetchone()
            if row is None:
                return
            with self._transaction():
                self.db.table("dead").insert(
                    {
                        "seq": row[0],
                        "id": row[1],
                        "priority": row[2],
                        "kind": row[3],
                        "body": row[4],
                        "reason": reason,
                        "at_ms": now_ms(),
                    },
                    replace=True,
                )
                self._settle("SELECT id FROM outbox WHERE seq = ?", [seq])
                self.db.execute("DELETE FROM outbox WHERE seq = ?", [seq])
                self._bump({"dead": 1})
            self.bytes -= int(row[5])
            self.counters["dead"] = self.counters.get("dead", 0) + 1

    def _settle(self, select_ids: str, args: list[int]) -> None:
        """Remember the ids ``select_ids`` finds (records leaving the outbox), and forget the
        oldest beyond ``remember_ids``."""
        self.db.execute(f"INSERT OR IGNORE INTO settled (id) {select_ids}", args)
        self.db.execute(
            "DELETE FROM settled WHERE n <= (SELECT max(n) FROM settled) - ?", [self.remember_ids]
        )

    def _bump(self, counts: dict[str, int]) -> None:
        self.db.conn.executemany(
            "UPDATE counters SET value = value + ? WHERE name = ?",
            [(n, name) for name, n in counts.items() if n],
        )

    # ---- figures -----------------------------------------------------------------------------

    def depth(self) -> dict[str, int]:
        """Records waiting, by priority name."""
        with self._lock:
            rows = dict(self.db.execute("SELECT priority, count(*) FROM outbox GROUP BY priority"))
        return {name: int(rows.get(number, 0)) for name, number in PRIORITIES.items()}

    def oldest_age_s(self) -> float | None:
        """How long the oldest record waiting has been in the outbox (None: it is empty)."""
        with self._lock:
            found = self.db.execute("SELECT min(created_ms) FROM outbox").fetchone()[0]
        return None if found is None else max(0.0, now_ms() - int(found)) / 1000

    def stats(self) -> dict[str, Any]:
        depth = self.depth()
        with self._lock:
            dead = int(self.db.execute("SELECT count(*) FROM dead").fetchone()[0])
        return {
            "depth": depth,
            "pending": sum(depth.values()),
            "bytes": self.bytes,
            "budget_bytes": self.budget,
            "dead_letters": dead,
            "disk_full": self.full,
            "counters": dict(self.counters),
        }

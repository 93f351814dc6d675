"""The outbox on a real SQLite file: priorities, order, idempotency, TTL, the disk budget with
an exact drop count, dead letters, and everything still there after a reopen or a SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cloudsync.agent import outbox
from cloudsync.agent.outbox import COUNTERS, Item, Outbox, OutboxError, Record, stream_of
from cloudsync.protocol.envelope import Envelope, canonical


def test_priorities_then_order_and_only_acks_remove(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    ids = [box.put("telemetry", {"n": i}) for i in range(5)]
    box.put("events", {"what": "model loaded"}, priority="event")
    alert = box.put("events", {"what": "overheating"}, priority="alert")
    first = box.peek(3)
    assert [r.id for r in first] == [alert, first[1].id, ids[0]]
    assert first[1].body == {"what": "model loaded"}
    assert [r.id for r in box.peek(10, exclude=[r.seq for r in first])] == ids[1:]
    assert box.ack([r.seq for r in first]) == 3
    assert [r.body["n"] for r in box.peek(10)] == [1, 2, 3, 4]
    assert box.depth() == {"alert": 0, "event": 0, "telemetry": 4}
    env = box.peek(1)[0].envelope("node-1")
    assert env == box.peek(1)[0].envelope("node-1")  # a resend is the same message
    assert env.id == ids[1] and env.seq == 2  # the second of the telemetry stream
    assert env.extra == {"epoch": box.epoch, "priority": "telemetry"}


def test_each_stream_counts_1_2_3_and_a_gap_is_a_record_the_node_dropped(tmp_path: Path) -> None:
    """The contract of docs/PROTOCOL.md: per topic and priority, seq runs 1, 2, 3 ... in the
    outbox's epoch; a consumer of one topic sees a gap exactly where a stored record expired,
    was pushed out by the budget or refused by the broker, and nowhere else."""
    path = tmp_path / "outbox.db"
    box = Outbox(path)
    box.put_many(
        [Item("telemetry", {"n": i}, ttl_s=0.05 if i == 3 else None) for i in range(6)]
        + [Item("events", {"n": i}, "alert") for i in range(3)]
        + [Item("events", {"n": i}, "event", id=f"e{i % 2}") for i in range(3)]  # a duplicate
        + [Item(f"result/cmd-{i}", {"ok": True}, "event") for i in range(2)]
    )
    time.sleep(0.1)
    refused = next(r for r in box.peek(100) if r.kind == "events" and r.body["n"] == 1)
    box.dead_letter(refused.seq, "broker: not authorized")
    streams: dict[tuple[str, str], list[int]] = {}
    for r in box.peek(100):
        env = r.envelope("n1")
        assert env.extra["epoch"] == box.epoch
        streams.setdefault((r.kind.partition("/")[0], env.extra["priority"]), []).append(env.seq)
    assert streams == {
        ("telemetry", "telemetry"): [1, 2, 3, 5, 6],  # 4 expired
        ("events", "alert"): [1, 3],  # 2 refused by the broker
        ("events", "event"): [1, 2],  # the duplicate has no number of its own
        ("result", "event"): [1, 2],  # every command's result topic: one stream
    }
    assert box.counters["dropped_ttl"] == 1 and box.counters["dead"] == 1
    box.close()
    again = Outbox(path)
    assert again.epoch == box.epoch
    assert again.put("telemetry", {"n": 6}) and again.peek(100)[-1].envelope("n1").seq == 7
    again.close()
    path.unlink()
    fresh = Outbox(path)  # a new file: new streams, told apart by the epoch
    fresh.put("telemetry", {"n": 0})
    env = fresh.peek(1)[0].envelope("n1")
    assert env.seq == 1 and env.extra["epoch"] != box.epoch


def test_an_outbox_of_an_older_cloudsync_keeps_its_records_and_numbers_new_ones(
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    box = Outbox(path)
    box.put_many([Item("telemetry", {"n": 0}), Item("events", {}, "alert")])
    box.put("telemetry", {"n": 1})
    box.db.execute("ALTER TABLE outbox DROP COLUMN stream_seq")  # as an older cloudsync made it
    box.db.execute("DROP TABLE streams")
    box.close()
    again = Outbox(path)
    again.put("telemetry", {"n": 2})
    numbers = [(r.kind, r.envelope("n1").seq) for r in again.peek(10)]
    assert numbers == [("events", 1), ("telemetry", 1), ("telemetry", 2), ("telemetry", 3)]


def test_a_duplicate_id_is_stored_once(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    assert box.put("telemetry", {"n": 1}, id="rec-1") == "rec-1"
    assert box.put("telemetry", {"n": 1}, id="rec-1") == "rec-1"
    assert len(box.peek(10)) == 1
    assert box.counters["put"] == 2 and box.counters["duplicate"] == 1


def test_a_retry_after_delivery_is_a_duplicate_within_the_remembered_ids(tmp_path: Path) -> None:
    """A producer whose answer a crash lost posts the batch again after cloudsync delivered
    it: the delivered (or dead-lettered) ids are not stored again under new stream numbers,
    while the outbox remembers them (the newest ``remember_ids``)."""
    box = Outbox(tmp_path / "outbox.db", remember_ids=3)
    box.put_many([Item("events", {"n": i}, "alert", id=f"a{i}") for i in range(4)])
    first = box.peek(10)
    box.ack(r.seq for r in first[:3])
    box.dead_letter(first[3].seq, "refused")
    again = box.put_many([Item("events", {"n": i}, "alert", id=f"a{i}") for i in range(4)])
    assert again == ["a0", "a1", "a2", "a3"] and box.counters["duplicate"] == 3
    (redone,) = box.peek(10)  # a0: the oldest of 4 that left, beyond the 3 remembered
    assert (redone.id, redone.envelope("n1").seq) == ("a0", 5)
    box.close()
    reopened = Outbox(tmp_path / "outbox.db", remember_ids=3)  # remembered on disk
    assert reopened.put("events", {"n": 3}, "alert", id="a3") == "a3"
    assert reopened.counters["duplicate"] == 4 and len(reopened.peek(10)) == 1


def test_expired_records_are_dropped_and_counted(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 1}, ttl_s=0.05)
    keep = box.put("telemetry", {"n": 2}, ttl_s=60)
    time.sleep(0.1)
    assert [r.id for r in box.peek(10)] == [keep]
    assert box.counters["dropped_ttl"] == 1 and box.bytes == box.peek(1)[0].size


def test_the_budget_drops_the_least_urgent_oldest_first_and_counts_exactly(
    tmp_path: Path,
) -> None:
    box = Outbox(tmp_path / "outbox.db", budget_bytes=10_000)
    stored = box.put_many([Item("telemetry", {"n": i, "pad": "x" * 100}) for i in range(200)])
    size = box.peek(1)[0].size
    kept = 10_000 // size
    assert sum(s is not None for s in stored) == 200  # each put made room by evicting older
    assert len(box.peek(1000)) == kept and box.bytes <= 10_000
    assert [r.body["n"] for r in box.peek(1000)] == list(range(200 - kept, 200))  # newest kept
    alert = box.put("events", {"what": "fire", "pad": "x" * 100}, priority="alert")
    assert alert is not None and box.depth()["alert"] == 1  # a telemetry record made room
    c = box.counters
    assert c["put"] == 201 and c["dropped_budget"] == 201 - len(box.peek(1000))
    fill = box.put_many([Item("events", {"pad": "x" * 100}, "alert") for _ in range(kept + 5)])
    assert box.depth()["telemetry"] == 0  # all telemetry made room for alerts
    late = box.put("telemetry", {"pad": "x" * 100})
    assert late is None  # it cannot push out an alert: it is the one dropped
    c = box.counters
    assert c["put"] == 202 + len(fill)
    assert c["put"] == len(box.peek(1000)) + c["dropped_budget"] + c["duplicate"] + c["acked"]
    with pytest.raises(OutboxError, match="priority"):
        box.put("telemetry", {}, priority="urgent")
    with pytest.raises(OutboxError, match="not JSON"):
        box.put("telemetry", {"x": object()})


def test_dead_letters_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    box = Outbox(path)
    for i in range(3):
        box.put("telemetry", {"n": i})
    refused = box.peek(1)[0]
    box.dead_letter(refused.seq, "broker: payload format invalid")
    box.close()
    again = Outbox(path)
    assert [r.body["n"] for r in again.peek(10)] == [1, 2]
    assert again.stats()["dead_letters"] == 1 and again.counters["dead"] == 1
    assert again.counters["put"] == 3 and again.bytes == sum(r.size for r in again.peek(10))


WRITER = """
import sys
import threading
from cloudsync.agent.outbox import Item, Outbox
box = Outbox(sys.argv[1])
n = 0
while True:
    box.put_many([Item("telemetry", {"n": n + i}) for i in range(50)])
    n += 50
    print(n, flush=True)
"""


def test_sigkill_while_writing_loses_no_stored_record(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    confirmed = 0
    for line in writer.stdout:
        confirmed = int(line)
        if confirmed >= 2000:
            break
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    box = Outbox(path)
    numbers = [r.body["n"] for r in box.peek(1_000_000)]
    assert len(numbers) >= confirmed and len(numbers) % 50 == 0  # whole batches, none lost
    assert numbers == list(range(len(numbers)))  # in order, no gap, no duplicate
    assert box.counters["put"] == len(numbers)


def test_expired_records_are_not_sent_while_the_disk_cannot_drop_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 1}, ttl_s=0.05)
    keep = box.put("telemetry", {"n": 2})
    time.sleep(0.1)

    def full(now: int) -> None:
        raise OutboxError("database or disk is full", full=True)

    monkeypatch.setattr(box, "_expire", full)
    assert [r.id for r in box.peek(10)] == [keep]  # no error, and the expired one not sent
    monkeypatch.undo()
    assert [r.id for r in box.peek(10)] == [keep] and box.counters["dropped_ttl"] == 1


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------


def test_the_byte_count_follows_acks_dead_letters_and_evictions_without_a_reopen(
    tmp_path: Path,
) -> None:
    """The in-memory byte count drives the budget's evictions: it must be the stored bytes
    after each ack and dead letter (``-=`` -> ``+=``), and every counter a number."""
    box = Outbox(tmp_path / "outbox.db", budget_bytes=100_000)
    for i in range(6):
        box.put("telemetry", {"n": i, "pad": "x" * 50})

    def stored() -> int:
        return sum(r.size for r in box.peek(100))

    records = box.peek(100)
    assert box.bytes == stored() > 0
    assert box.ack([records[0].seq, records[1].seq]) == 2
    assert box.bytes == stored() == sum(r.size for r in records[2:])
    box.dead_letter(records[2].seq, "refused")
    assert box.bytes == stored() == sum(r.size for r in records[3:])
    counters = box.stats()["counters"]
    assert {k: counters[k] for k in ("put", "acked", "dead", "dropped_budget")} == {
        "put": 6,
        "acked": 2,
        "dead": 1,
        "dropped_budget": 0,
    }
    assert all(isinstance(v, int) for v in counters.values())


def test_a_record_larger_than_the_whole_budget_is_refused_and_drops_nothing(
    tmp_path: Path,
) -> None:
    box = Outbox(tmp_path / "outbox.db", budget_bytes=2_000)
    kept = [box.put("telemetry", {"n": i}) for i in range(5)]
    before = box.peek(100)
    assert box.put("alert-sized", {"pad": "x" * 3_000}, priority="alert") is None
    assert box.peek(100) == before and all(kept)  # nothing evicted for it
    assert box.counters["dropped_budget"] == 1 and box.bytes == sum(r.size for r in before)


def test_a_record_of_exactly_the_budget_fits_once_the_rest_is_evicted(tmp_path: Path) -> None:
    probe = Outbox(tmp_path / "probe.db")
    probe.put("telemetry", {"pad": "x" * 500})
    size = probe.peek(1)[0].size
    box = Outbox(tmp_path / "outbox.db", budget_bytes=size)
    box.put("telemetry", {"n": 1})
    assert box.put("telemetry", {"pad": "x" * 500}) is not None  # (``>`` -> ``>=``)
    assert [r.size for r in box.peek(10)] == [size] and box.bytes == size
    assert box.counters["dropped_budget"] == 1


class Clock:
    """The outbox's clock (``now_ms``), set by the test: times to the millisecond."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: int = 1_700_000_000_000) -> None:
        self.now = now
        monkeypatch.setattr(outbox, "now_ms", lambda: self.now)


def on_disk(box: Outbox) -> dict[str, int]:
    return {str(k): int(v) for k, v in box.db.execute("SELECT name, value FROM counters")}


def test_a_new_outbox_is_empty_with_its_documented_defaults(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "a" / "b" / "outbox.db")  # its directories are made
    assert box.budget == 256 * 1024 * 1024 and box.remember_ids == 100_000
    assert len(box.epoch) == 16 and int(box.epoch, 16) >= 0
    zero = dict.fromkeys(COUNTERS, 0)
    assert box.counters == zero and on_disk(box) == zero
    assert box.stats() == {
        "depth": {"alert": 0, "event": 0, "telemetry": 0},
        "pending": 0,
        "bytes": 0,
        "budget_bytes": 256 * 1024 * 1024,
        "dead_letters": 0,
        "disk_full": False,
        "counters": zero,
    }
    assert box.peek() == [] and box.oldest_age_s() is None
    assert box.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert box.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert Outbox(tmp_path / "a" / "b" / "other.db").epoch != box.epoch


def test_an_outbox_that_cannot_be_opened_says_where(tmp_path: Path) -> None:
    (tmp_path / "outbox.db").mkdir()
    with pytest.raises(OutboxError) as refused:
        Outbox(tmp_path / "outbox.db")
    assert str(refused.value).startswith(f"cannot open the outbox at {tmp_path / 'outbox.db'}: ")
    assert refused.value.full is False


def test_a_record_keeps_every_field_and_its_envelope_is_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 1})
    box.put("result/cmd-7", {"ok": True, "é": "ü"}, "event", id="r-1", ttl_s=1.5)
    clock.now += 10
    (record,) = box.peek(10, exclude=[1])
    assert record == Record(
        2,
        "r-1",
        1,
        "result/cmd-7",
        {"ok": True, "é": "ü"},
        1_700_000_000_000,
        len(canonical({"ok": True, "é": "ü"})) + 64,
        1,
        box.epoch,
    )
    expires = box.db.execute("SELECT created_ms, expires_ms FROM outbox WHERE id = 'r-1'")
    assert expires.fetchone() == (1_700_000_000_000, 1_700_000_001_500)
    assert box.db.execute("SELECT expires_ms FROM outbox WHERE seq = 1").fetchone() == (None,)
    env = record.envelope("node-9")
    assert env == Envelope(
        "node-9",
        1,
        {"ok": True, "é": "ü"},
        "r-1",
        1_700_000_000_000,
        extra={"epoch": box.epoch, "priority": "event"},
    )
    default = box.peek(10)[1]
    assert (default.priority, default.kind, default.stream_seq, default.size) == (
        2,
        "telemetry",
        1,
        len('{"n":1}') + 64,
    )
    assert default.envelope("n").extra["priority"] == "telemetry"
    assert Item("telemetry", {}) == Item("telemetry", {}, "telemetry", None, None)


def test_streams_are_the_topic_leaf_and_the_priority() -> None:
    assert stream_of("result/cmd-1", "event") == "result/event"
    assert stream_of("telemetry", "telemetry") == "telemetry/telemetry"
    assert stream_of("events", "alert") == "events/alert"


def test_a_record_is_sent_until_its_last_millisecond_then_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 1}, ttl_s=1.5)
    box.put("telemetry", {"n": 2}, ttl_s=0.001)
    box.put("telemetry", {"n": 3})
    size = len('{"n":1}') + 64
    clock.now += 1
    assert [r.body["n"] for r in box.peek()] == [1, 2, 3]
    clock.now += 1
    assert [r.body["n"] for r in box.peek()] == [1, 3]
    assert box.counters["dropped_ttl"] == 1 and on_disk(box)["dropped_ttl"] == 1
    assert box.bytes == 2 * size
    clock.now = 1_700_000_001_500  # its expiry, to the millisecond: still sent
    assert [r.body["n"] for r in box.peek()] == [1, 3]
    assert box.counters["dropped_ttl"] == 1 and box.bytes == 2 * size
    clock.now += 1
    assert [r.body["n"] for r in box.peek()] == [3]
    assert box.counters["dropped_ttl"] == 2 and on_disk(box)["dropped_ttl"] == 2
    assert box.bytes == size and box.depth()["telemetry"] == 1
    assert box.peek() == box.peek() and box.counters["dropped_ttl"] == 2  # nothing more expired


def test_peek_gives_a_hundred_by_default_and_leaves_out_what_is_in_flight(
    tmp_path: Path,
) -> None:
    box = Outbox(tmp_path / "outbox.db")
    box.put_many([Item("telemetry", {"n": i}) for i in range(120)])
    first = box.peek()
    assert [r.body["n"] for r in first] == list(range(100))
    rest = box.peek(exclude=[r.seq for r in first])
    assert [r.body["n"] for r in rest] == list(range(100, 120))
    assert [r.body["n"] for r in box.peek(3, exclude=iter([1, 3]))] == [1, 3, 4]  # seq 2, 4 out


def test_oldest_age_is_in_seconds_and_never_negative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    box = Outbox(tmp_path / "outbox.db")
    assert box.oldest_age_s() is None
    box.put("telemetry", {"n": 1})
    clock.now += 500
    box.put("events", {"n": 2}, "alert")
    clock.now += 2_000
    assert box.oldest_age_s() == 2.5  # the oldest of all priorities
    clock.now -= 3_000  # the clock went back
    assert box.oldest_age_s() == 0.0


def test_acks_count_and_free_bytes_in_memory_and_on_disk_after_each(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    box.put_many([Item("telemetry", {"n": i}) for i in range(5)])
    size = len('{"n":0}') + 64
    seqs = [r.seq for r in box.peek()]
    assert box.ack([]) == 0 and box.ack(iter([])) == 0
    assert box.counters["acked"] == 0 and box.bytes == 5 * size
    assert box.ack([seqs[0], seqs[1], 999]) == 2
    assert box.counters["acked"] == 2 and on_disk(box)["acked"] == 2 and box.bytes == 3 * size
    assert box.ack([seqs[1]]) == 0  # already gone
    assert box.ack(iter(seqs[2:4])) == 2
    assert box.counters["acked"] == 4 and on_disk(box)["acked"] == 4 and box.bytes == size
    assert [r.seq for r in box.peek()] == [seqs[4]]
    assert on_disk(box) == box.counters == {**dict.fromkeys(COUNTERS, 0), "put": 5, "acked": 4}


def test_a_dead_letter_keeps_the_record_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 1})
    box.put("result/cmd-1", {"ok": False}, "event", id="res-1")
    refused = box.peek()[0]
    assert refused.id == "res-1"
    clock.now += 250
    box.dead_letter(refused.seq, "broker: not authorized")
    box.dead_letter(refused.seq, "again")  # gone already: nothing happens
    box.dead_letter(12345, "never stored")
    rows = box.db.execute("SELECT seq, id, priority, kind, body, reason, at_ms FROM dead")
    assert rows.fetchall() == [
        (
            2,
            "res-1",
            1,
            "result/cmd-1",
            '{"ok":false}',
            "broker: not authorized",
            1_700_000_000_250,
        ),
    ]
    assert box.counters["dead"] == 1 and on_disk(box)["dead"] == 1
    assert box.bytes == len('{"n":1}') + 64 and box.stats()["dead_letters"] == 1
    assert box.put("result/cmd-1", {"ok": False}, "event", id="res-1") == "res-1"
    assert box.counters["duplicate"] == 1 and len(box.peek()) == 1  # its id is remembered


def test_counters_missing_from_an_older_file_count_from_zero(tmp_path: Path) -> None:
    """An outbox file whose counters table predates some counters: they count from 0 in
    memory (``get(name, 0)``), after every kind of operation."""
    path = tmp_path / "outbox.db"
    old = Outbox(path)
    old.put_many([Item("telemetry", {"n": i}, ttl_s=0.001 if i == 0 else None) for i in range(4)])
    old.db.execute("DELETE FROM counters")
    old.close()
    time.sleep(0.01)
    box = Outbox(path)
    assert box.counters == {}
    seqs = [r.seq for r in box.peek()]
    assert box.counters == {"dropped_ttl": 1} and len(seqs) == 3
    box.ack(seqs[:1])
    assert box.counters == {"dropped_ttl": 1, "acked": 1}
    box.dead_letter(seqs[1], "refused")
    assert box.counters == {"dropped_ttl": 1, "acked": 1, "dead": 1}
    box.dead_letter(seqs[2], "refused")
    assert box.counters == {"dropped_ttl": 1, "acked": 1, "dead": 2}
    box.put("telemetry", {"n": 9})
    assert box.counters == {
        "put": 1,
        "duplicate": 0,
        "acked": 1,
        "dropped_budget": 0,
        "dropped_ttl": 1,
        "dead": 2,
    }
    assert on_disk(box) == {}  # (no row to count in: the figures since this start)


def test_state_is_kept_with_the_records_and_read_by_key_or_prefix(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    box = Outbox(path)
    assert box.get_state("cursor:a") is None and box.states("cursor:") == {}
    box.put_many([Item("telemetry", {"n": 1})], state={"cursor:a": "10", "cursor:b": "7"})
    box.put_many([], state={"cursor:a": "12", "cursorx": "1", "other": "2"})
    assert box.get_state("cursor:a") == "12" and box.get_state("cursor:c") is None
    assert box.states("cursor:") == {"cursor:a": "12", "cursor:b": "7"}
    assert box.states("cursor") == {"cursor:a": "12", "cursor:b": "7", "cursorx": "1"}
    assert box.states("nothing") == {}
    box.close()
    assert Outbox(path).states("cursor:") == {"cursor:a": "12", "cursor:b": "7"}


def test_room_is_made_from_the_least_urgent_oldest_records_exactly_as_needed(
    tmp_path: Path,
) -> None:
    size = len('{"n":0}') + 64  # every record here: the same size
    box = Outbox(tmp_path / "outbox.db", budget_bytes=4 * size)

    def kept() -> list[tuple[str, int]]:
        names = {0: "alert", 1: "event", 2: "telemetry"}
        return sorted((names[r.priority], r.body["n"]) for r in box.peek())

    box.put("t", {"n": 1})
    box.put("e", {"n": 1}, "event")
    box.put("t", {"n": 2})
    box.put("a", {"n": 1}, "alert")
    assert box.bytes == 4 * size and box.counters["dropped_budget"] == 0
    assert box.put("e", {"n": 2}, "event") is not None  # one telemetry record, the oldest
    assert kept() == [("alert", 1), ("event", 1), ("event", 2), ("telemetry", 2)]
    assert box.counters["dropped_budget"] == 1 and box.bytes == 4 * size
    assert box.put("a", {"n": 2}, "alert") is not None
    assert kept() == [("alert", 1), ("alert", 2), ("event", 1), ("event", 2)]
    assert box.counters["dropped_budget"] == 2 and on_disk(box)["dropped_budget"] == 2
    assert box.put("t", {"n": 3}) is None  # no record as little urgent to push out
    assert box.counters["dropped_budget"] == 3 and box.bytes == 4 * size
    assert box.put("e", {"n": 3}, "event") is not None  # the oldest event, never an alert
    assert kept() == [("alert", 1), ("alert", 2), ("event", 2), ("event", 3)]
    assert box.counters["dropped_budget"] == 4
    big = {"n": 1, "pad": "x" * (2 * size - 64 - len('{"n":1,"pad":""}'))}
    assert len(canonical(big)) + 64 == 2 * size
    assert box.put("a", big, "alert") is not None  # both events go, and only they
    assert kept() == [("alert", 1), ("alert", 1), ("alert", 2)]
    assert box.counters["dropped_budget"] == 6 and box.bytes == 4 * size
    assert (
        on_disk(box)
        == box.counters
        == {
            "put": 9,
            "duplicate": 0,
            "acked": 0,
            "dropped_budget": 6,
            "dropped_ttl": 0,
            "dead": 0,
        }
    )
    huge = Outbox(tmp_path / "other.db", budget_bytes=4 * size)
    huge.put_many([Item("t", {"n": i}) for i in range(3)])
    assert huge.put("a", big, "alert") is not None  # 3 + 2 sizes in 4: the oldest one goes
    assert [(r.priority, r.body["n"]) for r in huge.peek()] == [(0, 1), (2, 1), (2, 2)]
    assert huge.bytes == 4 * size and huge.counters["dropped_budget"] == 1


def test_a_batch_is_stored_whole_or_not_at_all(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    box.put("telemetry", {"n": 0})
    with pytest.raises(OutboxError) as refused:
        box.put_many([Item("telemetry", {"n": 1}), Item("telemetry", {}, "urgent")])
    assert str(refused.value) == "priority 'urgent': one of alert, event, telemetry"
    assert refused.value.full is False and box.full is False
    with pytest.raises(OutboxError) as refused:
        box.put_many([Item("telemetry", {"n": 2}), Item("telemetry", {"x": float("nan")})])
    assert str(refused.value).startswith("a body that is not JSON: ")
    assert [r.body["n"] for r in box.peek()] == [0] and box.bytes == len('{"n":0}') + 64
    assert box.counters["put"] == 1 and on_disk(box)["put"] == 1
    ids = box.put_many([Item("telemetry", {"n": 3}), Item("events", {"n": 4}, "alert", id="x")])
    assert ids[1] == "x" and len(ids[0] or "") == 32
    assert box.counters == on_disk(box) == {**dict.fromkeys(COUNTERS, 0), "put": 3}


def failing(box: Outbox, monkeypatch: pytest.MonkeyPatch, error: sqlite3.Error) -> None:
    """``put_many``'s state write fails with ``error`` (as SQLite or an older Python says)."""
    execute = box.db.execute

    def fail(sql: str, parameters: Any = None) -> Any:
        if sql.startswith("INSERT OR REPLACE INTO state"):
            raise error
        return execute(sql, parameters)

    monkeypatch.setattr(box.db, "execute", fail)


def test_a_full_disk_is_told_apart_from_other_errors_until_a_write_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "outbox.db"
    box = Outbox(path)
    pages = box.db.execute("PRAGMA page_count").fetchone()[0]
    box.db.execute(f"PRAGMA max_page_count = {pages + 2}")
    with pytest.raises(OutboxError) as refused:
        for i in range(20):
            box.put("telemetry", {"pad": "x" * 3000, "n": i})
    assert str(refused.value) == f"the outbox at {path} cannot store: database or disk is full"
    assert refused.value.full is True and box.full is True and box.stats()["disk_full"] is True
    stored = box.peek()
    assert stored and box.bytes == sum(r.size for r in stored)  # the failed put: not counted
    box.db.execute("PRAGMA query_only = ON")  # another error: it does not say the disk is fine
    with pytest.raises(OutboxError) as refused:
        box.put("telemetry", {})
    assert refused.value.full is False and box.full is True
    box.db.execute("PRAGMA query_only = OFF")
    box.db.execute("PRAGMA max_page_count = 1000000")
    assert box.put("telemetry", {}) is not None and box.full is False
    box.db.execute("PRAGMA query_only = ON")
    with pytest.raises(OutboxError) as refused:
        box.put("telemetry", {})
    assert str(refused.value).endswith("cannot store: attempt to write a readonly database")
    assert refused.value.full is False and box.full is False
    box.db.execute("PRAGMA query_only = OFF")
    failing(box, monkeypatch, sqlite3.OperationalError("database or disk is full"))  # 3.10
    with pytest.raises(OutboxError) as refused:
        box.put_many([Item("telemetry", {})], state={"k": "v"})
    assert refused.value.full is True and box.full is True
    assert box.bytes == sum(r.size for r in box.peek())
    box.put("telemetry", {})
    assert box.full is False
    io_error = sqlite3.OperationalError("disk I/O error")
    io_error.sqlite_errorcode = 13  # SQLITE_FULL, whatever it says
    failing(box, monkeypatch, io_error)
    with pytest.raises(OutboxError) as refused:
        box.put_many([Item("telemetry", {})], state={"k": "v"})
    assert refused.value.full is True and box.full is True
    assert isinstance(refused.value.__cause__, sqlite3.OperationalError)


def test_an_outbox_error_is_not_a_full_disk_unless_it_says_so() -> None:
    assert OutboxError("bad").full is False and OutboxError("full", True).full is True
    assert OutboxError("full", full=True).full is True and str(OutboxError("x")) == "x"


def test_every_put_is_counted_once_as_stored_duplicate_or_dropped(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db", budget_bytes=2 * (len('{"n":0}') + 64))
    box.put_many(
        [
            Item("t", {"n": 1}, id="a"),
            Item("t", {"n": 2}, id="a"),
            Item("t", {"n": 3}, "alert"),
            Item("t", {"n": 4}, "alert"),
            Item("t", {"n": 5}),
        ]
    )
    assert (
        box.counters
        == on_disk(box)
        == {
            "put": 5,
            "duplicate": 1,
            "acked": 0,
            "dropped_budget": 2,
            "dropped_ttl": 0,
            "dead": 0,
        }
    )
    assert [r.body["n"] for r in box.peek()] == [3, 4]


def test_one_outbox_is_used_from_several_threads(tmp_path: Path) -> None:
    """The sender acks from its thread what the local API stored from another."""
    box = Outbox(tmp_path / "outbox.db")
    errors: list[BaseException] = []

    def produce(n: int) -> None:
        try:
            box.put("telemetry", {"n": n})
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(r.body["n"] for r in box.peek()) == [0, 1, 2, 3]
    assert box.bytes == 4 * (len('{"n":0}') + 64) and box.counters["put"] == 4


def test_the_file_holds_the_tables_other_cloudsync_versions_open(tmp_path: Path) -> None:
    """The on-disk format (an older or newer cloudsync opens the same file, an operator reads
    its dead letters): each table with its columns (name, type, primary key)."""
    box = Outbox(tmp_path / "outbox.db")
    tables = [t for (t,) in box.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert sorted(tables) == [
        "counters",
        "dead",
        "outbox",
        "settled",
        "sqlite_sequence",
        "state",
        "streams",
    ]

    def columns(table: str) -> list[tuple[str, str, int]]:
        return [(r[1], r[2], r[5]) for r in box.db.execute(f"PRAGMA table_info({table})")]

    assert columns("counters") == [("name", "TEXT", 1), ("value", "INTEGER", 0)]
    assert columns("dead") == [
        ("seq", "INTEGER", 1),
        ("id", "TEXT", 0),
        ("priority", "INTEGER", 0),
        ("kind", "TEXT", 0),
        ("body", "TEXT", 0),
        ("reason", "TEXT", 0),
        ("at_ms", "INTEGER", 0),
    ]


def test_the_budget_counts_a_bodys_bytes_not_its_characters(tmp_path: Path) -> None:
    """A body of non-ASCII text costs its UTF-8 bytes: counted in characters, it was a quarter
    of it at worst, and the file outgrew its budget."""
    box = Outbox(tmp_path / "outbox.db", budget_bytes=100_000)
    body = {"text": "\U0001f600" * 100 + "é" * 100}  # 4 and 2 bytes each
    box.put("events", body)
    (record,) = box.peek(1)
    assert record.size == len(canonical(body)) + outbox.ROW_OVERHEAD == 611 + 64
    assert box.bytes == record.size
    small = Outbox(tmp_path / "small.db", budget_bytes=record.size - 1)
    assert small.put("events", body) is None  # over the budget in bytes, under it in chars
    assert small.counters["dropped_budget"] == 1

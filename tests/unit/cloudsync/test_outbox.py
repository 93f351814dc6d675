"""The outbox on a real SQLite file: priorities, order, idempotency, TTL, the disk budget with
an exact drop count, dead letters, and everything still there after a reopen or a SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudsync.agent.outbox import Item, Outbox, OutboxError


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
        "put": 6, "acked": 2, "dead": 1, "dropped_budget": 0}  # fmt: skip
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

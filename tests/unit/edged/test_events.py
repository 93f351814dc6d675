"""The daemon's event ring: ids after a cursor, a limit, what fell out of the ring; an event's
size, bounded in edged and again where cloudsync makes it a record."""

from __future__ import annotations

import logging

from cloudsync.agent.edged_reader import event_item
from cloudsync.agent.session import result_item
from cloudsync.protocol.envelope import MAX_BODY_BYTES, canonical
from edged.common.events import MAX_MESSAGE, EventLog


def test_events_after_a_cursor_with_limit_and_missed() -> None:
    events = EventLog(capacity=5)
    logger = logging.getLogger("edged.test-events")
    logger.addHandler(events)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("not an event")
        for i in range(8):
            logger.info("model m%d: ready", i)
        logger.error("model bad: unavailable: %s", "corrupt file")
    finally:
        logger.removeHandler(events)
    page = events.after(0, limit=3)
    assert [e["id"] for e in page["events"]] == [5, 6, 7] and page["missed"] == 4
    assert page["last"] == 9 and page["epoch"] == events.after(0)["epoch"]
    tail = events.after(7)
    assert [e["message"] for e in tail["events"]] == [
        "model m7: ready",
        "model bad: unavailable: corrupt file",
    ]
    assert tail["events"][-1]["level"] == "error" and tail["missed"] == 0
    assert events.after(9)["events"] == []


def test_a_huge_message_is_cut_with_a_marker_in_edged_and_again_in_cloudsync() -> None:
    """A 420 KB log line (a routing change quoting its table) was kept whole in edged's ring
    and forwarded whole: cloudsync could not send it and exited (issue 22, item 3)."""
    events = EventLog(capacity=5)
    logger = logging.getLogger("edged.test-events-huge")
    logger.addHandler(events)
    try:
        logger.warning("routing changed: %s", "r" * 420_000)
    finally:
        logger.removeHandler(events)
    (event,) = events.after(0)["events"]
    assert len(event["message"]) < MAX_MESSAGE + 50
    assert event["message"].endswith(f"... [{420_000 + 17 - MAX_MESSAGE} more characters]")
    # what an edged of another make could send: every field oversize, odd values, bad text
    hostile = {
        "id": 7,
        "ts": 1,
        "level": "error",
        "source": "edged.x\ud800",
        "message": "m" * 500_000,
        "table": {"rows": ["x" * 100] * 5000},
        "nan": float("nan"),
        "ok": True,
    }
    item = event_item("e" * 32, hostile)
    size = len(canonical(item.body))
    assert size < MAX_BODY_BYTES and item.priority == "alert" and item.id == f"edged-{'e' * 16}-7"
    assert item.body["truncated"] == ["message", "table"]
    assert item.body["source"] == "edged.x\\ud800" and item.body["nan"] == "NaN"
    assert item.body["message"].startswith("m" * 100) and item.body["ok"] is True
    giant = event_item("e", {"id": 8, "level": "info", **{f"k{i}": "v" * 9000 for i in range(40)}})
    assert (
        giant.body
        == {"from": "edged", "id": 8, "level": "info", "truncated": giant.body["truncated"]}
        and len(giant.body["truncated"]) == 40
    )


def test_a_result_too_large_for_a_record_says_so() -> None:
    item = result_item("c1", {"name": "status", "ok": True, "result": "x" * 300_000})
    assert item.kind == "result/c1" and item.priority == "event"
    assert item.body["ok"] is False and item.body["name"] == "status"
    assert "over the" in item.body["error"]
    small = {"name": "ping", "ok": True, "result": {"pong": True}}
    assert result_item("c2", small).body == small

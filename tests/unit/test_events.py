"""The daemon's event ring: ids after a cursor, a limit, what fell out of the ring."""

from __future__ import annotations

import logging

from edged.events import EventLog


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

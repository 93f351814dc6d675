"""The daemon's events: what its log says at INFO and above, kept in a ring with increasing ids,
read after a cursor (``GET /v1/events?after=N``) by cloudsync, which forwards them to the fleet.

Events are log records of the ``edged`` loggers (a model ready or unavailable, the cloud link up
or down, a config reload, an error): one source of truth, nothing to keep in step. Ids start at
1 for each run of the daemon, which has its own ``epoch`` (a random id): a reader that sees a new
epoch starts again from 0. A reader whose cursor fell out of the ring (``capacity`` events) is
told how many it missed. A message is kept to its first MAX_MESSAGE characters, with a marker
that says how many were cut. What the record's request was (``edged.common.logs.FIELDS``: its
``request_id``, ``model``, ``route``, ``reason``) comes with the event, so the fleet's event log
can be searched by request.
"""

from __future__ import annotations

import collections
import logging
import threading
import uuid
from typing import Any

from edged.common.logs import FIELDS

CAPACITY = 10_000
MAX_MESSAGE = 16384  # characters of a message kept; a longer one is cut, with a marker
MAX_FIELD = 128  # characters of a request's field (its id, model, route, reason) kept


class EventLog(logging.Handler):
    def __init__(self, capacity: int = CAPACITY, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.epoch = uuid.uuid4().hex
        self.ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.last = 0
        self._ring_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break the daemon's logging
            message = str(record.msg)
        if len(message) > MAX_MESSAGE:  # the ring holds 10,000: bounded, as what it forwards
            message = f"{message[:MAX_MESSAGE]}... [{len(message) - MAX_MESSAGE} more characters]"
        event: dict[str, Any] = {
            "ts": int(record.created * 1000),
            "level": record.levelname.lower(),
            "source": record.name,
            "message": message,
        }
        for key in FIELDS:  # what the request was (edged.common.logs binds them): its id, model...
            value = getattr(record, key, None)
            if value is not None:
                event[key] = str(value)[:MAX_FIELD]
        with self._ring_lock:
            self.last += 1
            event["id"] = self.last
            self.ring.append(event)

    def after(self, cursor: int, limit: int = 1000) -> dict[str, Any]:
        """Events with an id above ``cursor``, oldest first, at most ``limit``."""
        with self._ring_lock:
            first = self.ring[0]["id"] if self.ring else self.last + 1
            found = [e for e in self.ring if e["id"] > cursor][:limit]
            last = self.last
        return {
            "epoch": self.epoch,
            "events": found,
            "last": last,
            "missed": max(0, first - cursor - 1),
        }

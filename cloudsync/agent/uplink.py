"""The uplink: every message the agent sends to the broker, recorded in the uplink's egress
ledger (``edged.common.egress``) before it is published. The device's own reports go out even when
the ledger cannot take the entry (a full disk: the alert that says so must reach the fleet):
they are counted, and the first entry written after declares the gap (``unrecorded``: how many
of each stream, their bytes, since when)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import paho.mqtt.client as mqtt

from cloudsync.protocol.envelope import now_ms
from edged.common.egress import Ledger, digest

log = logging.getLogger("cloudsync")


class Uplink:
    def __init__(self, ledger: Ledger, broker: str, client: Callable[[], mqtt.Client]) -> None:
        self.ledger, self.broker, self.client = ledger, broker, client
        # what went while the ledger could not record it: stream -> [count, bytes]
        self.unrecorded: dict[str, list[int]] = {}
        self.unrecorded_since = 0

    def publish(
        self, topic: str, payload: bytes, kind: str, record: str = "", retain: bool = False
    ) -> mqtt.MQTTMessageInfo:
        """Publish at QoS 1 on the session's client, the message recorded first."""
        if self.ledger.enabled:
            try:
                if self.unrecorded:
                    self.ledger.record(
                        "unrecorded",
                        since_ms=self.unrecorded_since,
                        until_ms=now_ms(),
                        streams={
                            k: {"messages": n, "bytes": b} for k, (n, b) in self.unrecorded.items()
                        },
                        why="the ledger could not write (its last error in cloudsync's log)",
                    )
                    self.unrecorded = {}
                self.ledger.record(
                    "mqtt",
                    stream=kind,
                    topic=topic,
                    record=record,
                    bytes=len(payload),
                    sha256=digest(payload),
                    broker=self.broker,
                )
            except (OSError, ValueError) as exc:
                if not self.unrecorded:
                    self.unrecorded_since = now_ms()
                    log.error(
                        "the egress ledger cannot record what cloudsync sends (%s): it"
                        " goes on, counted, and the gap is recorded once it can",
                        exc,
                    )
                counted = self.unrecorded.setdefault(kind.split("/")[0], [0, 0])
                counted[0] += 1
                counted[1] += len(payload)
        return self.client().publish(topic, payload, qos=1, retain=retain)

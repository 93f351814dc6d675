"""The outbox pump: records from the outbox to the broker and their acknowledgements back,
on the MQTT thread. It owns the in-flight map (MQTT message id -> outbox sequence number) and
what waits for the disk: PUBACKed records leave the outbox in one transaction, those the broker
refused go to the dead letters, those it gave to no subscriber go again a little later.
Publishing itself is the uplink's (``agent/uplink.py``: the egress ledger first)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from cloudsync.agent.outbox import Outbox, OutboxError
from cloudsync.protocol.envelope import EnvelopeError, printable
from cloudsync.protocol.topics import Topics

log = logging.getLogger("cloudsync")
RESULT = "result/"  # an outbox kind: a command's result, for .../cmd/{id}/result
ACK_TIMEOUT_S = 120.0  # a record published this long ago with no PUBACK is published again
# while the disk cannot take acks, at most this many times max_inflight records are sent and
# held in memory; then sending waits for the disk
HELD_FACTOR = 4
# PUBACK "No matching subscribers" (MQTT 5 reason code 16): the broker took a record, and gave
# it to no one: the fleet service is away (a broker restart drops Mosquitto's shared
# subscriptions until the service subscribes again; a replica without a persistent session has
# none meanwhile). The record stays in the outbox and goes again this long after.
NO_SUBSCRIBERS = 16
UNHEARD_S = 2.0

Publish = Callable[[str, bytes, str, str], mqtt.MQTTMessageInfo]


class OutboxPump:
    def __init__(
        self, outbox: Outbox, topics: Topics, node: str, max_inflight: int, publish: Publish
    ) -> None:
        self.outbox, self.topics, self.node = outbox, topics, node
        self.max_inflight, self.publish = max_inflight, publish
        self.inflight: dict[int, int] = {}  # MQTT message id -> outbox seq
        self.sent_at: dict[int, float] = {}  # MQTT message id -> when it went (monotonic)
        self.acked: list[int] = []  # PUBACKed, to leave the outbox (kept while it cannot)
        self.refused: dict[int, str] = {}  # refused by the broker: to the dead letters
        self.unsendable: set[int] = set()  # seqs that cannot be sent nor dead-lettered now
        self.unheard: dict[int, float] = {}  # seq -> when to send again (no subscriber had it)
        self.unheard_since = 0.0  # the first of those in this spell (monotonic; 0: none)
        self.write_again = 0.0  # after an ack the disk could not take: when to try again

    def topic_of(self, kind: str) -> str:
        if kind.startswith(RESULT):
            return self.topics.cmd_result(kind[len(RESULT) :])
        return self.topics.events if kind == "events" else self.topics.telemetry

    def published(self, mid: int, rc: Any) -> None:
        """The broker's PUBACK of message ``mid`` (paho's on_publish)."""
        seq = self.inflight.pop(mid, None)
        self.sent_at.pop(mid, None)
        if seq is None:  # a status or a heartbeat
            return
        if rc.is_failure:
            log.error("the broker refused record %d: %s; it goes to the dead letters", seq, rc)
            self.refused[seq] = str(rc)
        elif rc.value == NO_SUBSCRIBERS:
            if not self.unheard_since:  # once a spell
                log.warning(
                    "the broker has no subscriber for the records (the fleet service"
                    " is away): they stay in the outbox, sent again every %.0f s",
                    UNHEARD_S,
                )
                self.unheard_since = time.monotonic()
            self.unheard[seq] = time.monotonic() + UNHEARD_S
        else:
            if self.unheard_since:
                log.info(
                    "the fleet has the records again, after %.0f s without a subscriber",
                    time.monotonic() - self.unheard_since,
                )
                self.unheard_since = 0.0
            self.acked.append(seq)

    def reconnected(self) -> None:
        """paho sends again what was in flight: its PUBACK clock starts now."""
        self.sent_at = dict.fromkeys(self.sent_at, time.monotonic())

    def new_client(self) -> None:
        """A new MQTT client (a renewed certificate): what was in flight goes again from the
        outbox, with its id."""
        self.inflight.clear()
        self.sent_at.clear()

    def turn(self, connected: bool) -> None:
        """Acknowledge what the broker has (one transaction), move what it refused to the dead
        letters, then publish more records. A write the disk cannot take now (full) is tried
        again on the next turn; what was acknowledged is not sent meanwhile."""
        now = time.monotonic()
        if (self.acked or self.refused) and now >= self.write_again:
            try:
                if self.acked:
                    self.outbox.ack(self.acked)
                    self.acked = []
                while self.refused:
                    seq, why = next(iter(self.refused.items()))
                    self.outbox.dead_letter(seq, why)
                    del self.refused[seq]
                self.write_again = 0.0
            except OutboxError as exc:  # said once, tried again every second
                if not self.write_again:
                    log.error("%s; the records the broker has stay until it can", exc)
                self.write_again = now + 1.0
        late = [m for m, t in self.sent_at.items() if now - t > ACK_TIMEOUT_S]
        for mid in late if connected else []:
            # no PUBACK in all that time: sent again from the outbox (the same id); paho's own
            # resend after a reconnect normally answers long before
            log.warning(
                "record %d: no PUBACK in %.0f s; it will be sent again",
                self.inflight.pop(mid),
                ACK_TIMEOUT_S,
            )
            del self.sent_at[mid]
        room = self.max_inflight - len(self.inflight)
        waiting = len(self.acked) + len(self.refused)  # the broker has them, the disk not yet
        if not connected or room <= 0 or waiting >= HELD_FACTOR * self.max_inflight:
            return  # (bounded: what is held is excluded from each peek)
        for seq in [s for s, when in self.unheard.items() if when <= now]:
            del self.unheard[seq]
        held = {
            *self.inflight.values(),
            *self.acked,
            *self.refused,
            *self.unsendable,
            *self.unheard,
        }
        for record in self.outbox.peek(room, exclude=held):
            topic = self.topic_of(record.kind)
            try:
                payload = record.envelope(self.node).encode()
            except (EnvelopeError, ValueError) as exc:  # stored by an older cloudsync: too big
                self._unsendable(record.seq, printable(str(exc)))
                continue
            info = self.publish(topic, payload, record.kind, record.id)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                break  # the connection just went: the outbox still has it
            self.inflight[info.mid] = record.seq
            self.sent_at[info.mid] = now

    def _unsendable(self, seq: int, why: str) -> None:
        log.error("record %d cannot be sent (%s); it goes to the dead letters", seq, why)
        try:
            self.outbox.dead_letter(seq, why)
        except OutboxError as exc:  # not now: skipped until the next start
            log.error("%s", exc)
            self.unsendable.add(seq)

"""The edged reader: the agent's thread that asks edged (its socket API, a short timeout)
for its status, capabilities and metrics every heartbeat interval, keeps the last answer
(``EdgedView``), moves edged's new events into the outbox (each cut to MAX_EVENT_TEXT a field),
turns its metrics into telemetry records (``cloudsync.protocol.telemetry``) and evaluates the
device's alerts. The MQTT thread never waits on edged, and edged never waits on cloudsync.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from threading import Event
from typing import Any

from cloudsync.agent.alerts import Evaluator, Facts, record_id
from cloudsync.agent.config import Config
from cloudsync.agent.delivery import Delivery
from cloudsync.agent.outbox import Item, Outbox, OutboxError
from cloudsync.agent.state import AgentState, EdgedView
from cloudsync.protocol import telemetry
from cloudsync.protocol.envelope import MAX_BODY_BYTES, canonical, now_ms, printable
from edged.client import Client, ClientError
from edged.common.names import DAMAGED

log = logging.getLogger("cloudsync")
EDGED_CURSOR = "edged_events"  # the outbox's state key: "{epoch}:{last event id stored}"
EDGED_METRICS = "edged_metrics"  # the outbox's state key: the read behind the last record
ALERTS = "alerts"  # the outbox's state key: the alerts firing (with their events)
MAX_EVENT_TEXT = 16384  # characters of one text field of an edged event that are forwarded


class EdgedReader:
    """The edged thread of one agent (``run``); what it learns goes to ``state.edged``, the
    outbox and the alerts."""

    def __init__(
        self,
        state: AgentState,
        config: Config,
        outbox: Outbox,
        alerts: Evaluator,
        delivery: Delivery,
        stopping: Event,
        edged_client: Callable[[], Client],
    ) -> None:
        self.state, self.config, self.outbox, self.alerts = state, config, outbox, alerts
        self.delivery, self.stopping, self.edged_client = delivery, stopping, edged_client
        self.next_telemetry = 0.0

    def run(self) -> None:
        """The edged thread: its status and capabilities, and its events into the outbox,
        every heartbeat interval."""
        client = self.edged_client()
        while not self.stopping.is_set():
            try:
                self.once(client)
            except Exception:  # a full disk, a bug: logged, and the next turn tries again
                log.exception("reading edged or evaluating the alerts failed")
            self.stopping.wait(self.config.heartbeat.interval_s)

    def once(self, client: Client) -> None:
        snap = None
        try:
            status = client.status()
            capabilities = client.capabilities()
            snap = telemetry.parse(client.metrics(), time.time(), status.get("epoch") or "")
            self.state.edged = EdgedView(status, capabilities, "", now_ms(), snap.route_totals())
            self.read_events(client)
            self.report_metrics(snap)
        except ValueError as exc:  # not edged's metrics: say so, keep going
            log.error("edged's /metrics cannot be read: %s", exc)
        except ClientError as exc:
            self.state.edged = EdgedView(None, [], exc.message, now_ms())
        if self.config.alerts.enabled:
            self.check_alerts(snap)

    def facts(self, snap: telemetry.Snapshot | None) -> Facts:
        """What the alerts are evaluated on, now."""
        now = time.monotonic()
        facts = Facts(
            now,
            edged_up=self.state.edged.status is not None,
            offline_s=0.0 if self.state.offline_since is None else now - self.state.offline_since,
            outbox_age_s=self.outbox.oldest_age_s(),
            rollbacks={model: time.time() - at for model, at in list(self.state.rollbacks.items())},
        )
        if snap is not None:
            facts.epoch = snap.epoch
            facts.local_load = snap.local_load
            facts.cloud_calls = sum(snap.cloud.values())
            facts.cloud_errors = sum(v for k, v in snap.cloud.items() if k[2] == "error")
        return facts

    def check_alerts(self, snap: telemetry.Snapshot | None) -> None:
        """Evaluate the alerts; each change goes to the fleet through the outbox."""
        items = []
        wall, mono = now_ms(), time.monotonic()
        evaluator = self.alerts
        before = {key: replace(alert) for key, alert in evaluator.alerts.items()}
        for state, alert in evaluator.evaluate(self.facts(snap)):
            since = wall - int((mono - alert.since) * 1000)
            body = self.alerts.event(state, alert, wall, since)
            level = logging.WARNING if state == "firing" else logging.INFO
            log.log(level, "alert %s %s: %s", alert.rule.name, state, body["summary"])
            items.append(Item("events", body, "alert", record_id(body)))
        if items:  # the events and the alerts firing now, in one transaction
            try:
                self.outbox.put_many(items, state={ALERTS: evaluator.saved(mono, wall)})
            except OutboxError:  # a full disk: the changes come again on the next turn
                evaluator.alerts = before
                raise

    def read_events(self, client: Client) -> None:
        """edged's events after the cursor kept in the outbox, stored with the cursor's advance
        in one transaction: none lost, none twice (a new edged epoch starts from 0)."""
        epoch, _, last = (self.outbox.get_state(EDGED_CURSOR) or ":0").partition(":")
        cursor = int(last or 0)
        while True:
            reply = client.events(cursor)
            if reply["epoch"] != epoch:  # a new edged, or the first read: from its start
                if cursor:
                    reply = client.events(0)
                epoch, cursor = reply["epoch"], 0
            if not reply["events"]:
                return
            items = [event_item(epoch, e) for e in reply["events"]]
            if reply["missed"]:
                items.insert(
                    0,
                    Item(
                        "events",
                        {"alert": "edged events missed", "missed": reply["missed"]},
                        "alert",
                    ),
                )
            cursor = reply["events"][-1]["id"]
            self.outbox.put_many(items, state={EDGED_CURSOR: f"{epoch}:{cursor}"})
            if any(e.get("reason") == DAMAGED for e in reply["events"]):
                self.delivery.poke()  # a version refused as damaged: fetched again
            if cursor >= reply["last"]:
                return

    def report_metrics(self, snap: telemetry.Snapshot) -> None:
        """Every ``telemetry.interval_s``: what edged served since the read behind the last
        record (kept in the outbox with the record, in one transaction)."""
        interval = self.config.telemetry.interval_s
        if not interval or time.monotonic() < self.next_telemetry:
            return
        self.next_telemetry = time.monotonic() + interval
        before = telemetry.Snapshot.from_state(self.outbox.get_state(EDGED_METRICS))
        body = telemetry.telemetry(snap, before)
        record = f"metrics-{snap.epoch[:16]}-{int(snap.at * 1000)}"
        items = [Item("telemetry", body, "telemetry", record)] if body else []
        self.outbox.put_many(items, state={EDGED_METRICS: snap.to_state()})


def event_item(epoch: str, event: dict[str, Any]) -> Item:
    """An edged event as an outbox record: errors are alerts; its id is stable across
    retries (the epoch and the event's id). Its text is cut to MAX_EVENT_TEXT characters with a
    marker (``truncated``: the fields cut); an event still too large for a record keeps only its
    id, time, level and source."""
    level = event.get("level", "info")
    priority = "alert" if level in ("error", "critical") else "event"
    body: dict[str, Any] = {"from": "edged"}
    cut = []
    for key, value in event.items():
        if isinstance(value, bool) or value is None or _finite(value):
            body[printable(key, 64)] = value
            continue
        text = value if isinstance(value, str) else json.dumps(value)  # escapes what it must
        body[printable(key, 64)] = printable(text, MAX_EVENT_TEXT)
        if len(text) > MAX_EVENT_TEXT:
            cut.append(key)
    if cut:
        body["truncated"] = cut
    if len(canonical(body)) > MAX_BODY_BYTES - 1024:
        keep = ("from", "id", "ts", "level", "source")
        body = {k: body[k] for k in keep if isinstance(body.get(k), (str, int))}
        body["truncated"] = sorted(set(event) - set(keep))
    return Item("events", body, priority, f"edged-{epoch[:16]}-{event['id']}")


def _finite(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))

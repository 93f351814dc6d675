"""The agent: one MQTT 5 session to the fleet's broker, kept up through bad networks.

One thread owns the MQTT client (paho-mqtt 2.x, driven by ``loop()``): it connects with TLS 1.3
and the node's certificate, ``clean_start`` false and a session expiry (the broker keeps the
node's QoS 1 queue while it is away), sets a retained *offline* last will, publishes a retained
*online* birth with the node's capabilities on every connect, sends a heartbeat every
``heartbeat.interval_s``, and drains the outbox: up to ``max_inflight`` records published at
QoS 1, each deleted from the outbox only when its PUBACK comes (a refusal moves it to the dead
letters). When the connection drops it reconnects after 1, 2, 4 ... 64 s, each delay drawn
between half and all of it (jitter, so a fleet does not reconnect in step). It starts and keeps
working with no network: records wait in the outbox.

Commands on ``.../cmd/{id}`` are verified in the MQTT thread (``cloudsync.protocol.commands``: a
refused one is reported, never run) and run by a worker thread; results go through the outbox.
A third thread asks edged (its socket API, a short timeout) for its status, capabilities and
metrics, keeps the last answer, moves edged's new events into the outbox (``read_events``) and
turns its metrics into telemetry records (``cloudsync.protocol.telemetry``): the MQTT thread
never waits on edged, so a busy or stopped edged does not delay a heartbeat, and edged never
waits on cloudsync.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import platform
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloudsync import __version__
from cloudsync.agent.alerts import Evaluator, Facts, record_id
from cloudsync.agent.config import Config
from cloudsync.agent.delivery import Delivery
from cloudsync.agent.metrics import Exporter
from cloudsync.agent.outbox import Item, Outbox, OutboxError
from cloudsync.protocol import telemetry
from cloudsync.protocol.commands import COMMANDS, Command, Refused, Verifier, load_anchors
from cloudsync.protocol.envelope import (
    MAX_BODY_BYTES,
    MAX_BYTES,
    Envelope,
    EnvelopeError,
    canonical,
    decode,
    now_ms,
    printable,
)
from cloudsync.protocol.mqtt import tls_context
from cloudsync.protocol.topics import TopicError, Topics, check_name, parse
from edged.client import Client, ClientError
from edged.common.backoff import backoff_delay
from edged.events import CAPACITY, EventLog

log = logging.getLogger("cloudsync")
EDGED_CURSOR = "edged_events"  # the outbox's state key: "{epoch}:{last event id stored}"
EDGED_METRICS = "edged_metrics"  # the outbox's state key: the read behind the last record
ROLLBACKS = "rollbacks"  # the outbox's state key: when each model was last rolled back
ALERTS = "alerts"  # the outbox's state key: the alerts firing (with their events)
LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_LOG_LINES = 1000
MAX_LOG_MESSAGE = 500  # characters of one line in a ``logs`` result
MAX_DRAIN_WAIT_S = 600.0  # the command worker waits no longer for a drain
RESULT = "result/"  # an outbox kind: a command's result, for .../cmd/{id}/result
CONNACK_S = 10.0  # a connection that has no CONNACK by then is given up and tried again
ACK_TIMEOUT_S = 120.0  # a record published this long ago with no PUBACK is published again
# the largest MQTT packet cloudsync takes (MQTT 5's Maximum Packet Size: the broker does not
# send a larger one): an envelope and its topic. The fleet's broker has the same limit.
MAX_PACKET = MAX_BYTES + 4096
MAX_EVENT_TEXT = 16384  # characters of one text field of an edged event that are forwarded
RESTART_MAX_S = 30.0  # a thread that failed is started again after 1, 2, 4 ... up to this


def node_name(configured: str) -> str:
    """The configured name, else the host name made a valid topic level."""
    if configured:
        return configured
    host = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())
    return check_name("node", host[:64] or "node")


@dataclass
class EdgedView:
    """What the agent last heard from edged (the collector thread replaces the whole view, the
    MQTT thread reads it: an attribute assignment is atomic)."""

    status: dict[str, Any] | None = None
    capabilities: list[dict[str, Any]] = field(default_factory=list)
    error: str = "not asked yet"
    at_ms: int = 0
    routes: dict[str, int] = field(default_factory=dict)  # decisions since edged started

    def reachability(self) -> dict[str, Any]:
        return {"reachable": self.status is not None, "error": self.error}


class Agent:
    def __init__(self, config: Config, rng: random.Random | None = None) -> None:
        self.config = config
        self.node = node_name(config.node.name)
        self.topics = Topics(config.node.fleet, self.node)
        self.outbox = Outbox(config.outbox.path, config.outbox.budget_mb << 20)
        self.rng = rng or random.Random()
        self.edged = EdgedView()
        self.stopping = threading.Event()
        self.connected = False
        self.inflight: dict[int, int] = {}  # MQTT message id -> outbox seq
        self.sent_at: dict[int, float] = {}  # MQTT message id -> when it went (monotonic)
        self.acked: list[int] = []  # PUBACKed, to leave the outbox (kept while it cannot)
        self.refused: dict[int, str] = {}  # refused by the broker: to the dead letters
        self.unsendable: set[int] = set()  # seqs that cannot be sent nor dead-lettered now
        self.write_again = 0.0  # after an ack the disk could not take: when to try again
        # the sequence of what does not go through the outbox: increasing (next() is atomic)
        self.seq = itertools.count(now_ms() + 1)
        self.attempt = 0
        self.next_connect = 0.0  # time.monotonic() of the next connection attempt
        self.connecting_since: float | None = None  # a socket is open, no CONNACK yet
        self.next_heartbeat = 0.0
        self.heartbeats = 0
        self.verifier = Verifier(
            f"{config.node.fleet}/{self.node}",
            load_anchors(config.commands.trust_dir),
            config.outbox.path.with_name("commands.db"),
            config.commands.max_lifetime_s,
        )
        self.orders: queue.Queue[Command | None] = queue.Queue()
        self.delivery = Delivery(
            config.delivery,
            config.node.fleet,
            self.node,
            lambda: self.verifier.anchors,
            self.outbox,
            self.edged_client,
            config.edged.timeout_s,
        )
        self.delivery.on_rollback = self._rolled_back
        self.next_telemetry = 0.0
        self.events = EventLog()  # cloudsync's own log, for the ``logs`` command
        log.addHandler(self.events)
        self.offline_since: float | None = time.monotonic()  # None while connected
        self.poison = 0  # messages whose handling failed (a bug): acknowledged, logged, counted
        self.restarts: dict[str, int] = {}  # thread name -> times it failed and was restarted
        # model -> time.time() of its last rollback, kept across restarts (ModelRolledBack)
        self.rollbacks: dict[str, float] = json.loads(self.outbox.get_state(ROLLBACKS) or "{}")
        self.alerts = Evaluator(config.alerts)
        self.alerts.restore(self.outbox.get_state(ALERTS), time.monotonic(), now_ms())
        self.exporter = Exporter(self)
        self.client = self._client()

    # ---- the MQTT client -----------------------------------------------------------------

    def _client(self) -> mqtt.Client:
        mq = self.config.mqtt
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"{self.config.node.fleet}.{self.node}",
            protocol=mqtt.MQTTv5,
            transport=mq.transport,
            reconnect_on_failure=False,  # reconnects are ours: backoff with jitter
        )
        if mq.transport == "websockets":
            client.ws_set_options(path=mq.websockets_path)
        client.tls_set_context(tls_context(mq.ca_file, mq.cert_file, mq.key_file))
        client.max_inflight_messages_set(self.config.outbox.max_inflight)
        will = self._envelope({"state": "offline", "reason": "connection lost"})
        client.will_set(self.topics.status, will.encode(), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        # the last net under every callback: paho logs what escapes one and goes on
        client.suppress_exceptions = True
        client.enable_logger(logging.getLogger("cloudsync.paho"))
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = mq.session_expiry_s
        properties.MaximumPacketSize = MAX_PACKET
        client.connect_async(  # only remembers where: ``_connect`` dials
            mq.host, mq.port, mq.keepalive_s, clean_start=False, properties=properties
        )
        return client

    def edged_client(self, timeout: float | None = None) -> Client:
        return Client(str(self.config.edged.socket), timeout=timeout or self.config.edged.timeout_s)

    def _envelope(self, body: dict[str, Any]) -> Envelope:
        return Envelope(self.node, next(self.seq), body)

    def _connect(self) -> None:
        mq = self.config.mqtt
        try:
            self.client.reconnect()  # a new socket, TLS handshake, CONNECT
            self.connecting_since = time.monotonic()
        except (OSError, ssl.SSLError, mqtt.WebsocketConnectionError) as exc:
            self._schedule_reconnect(f"cannot connect to {mq.host}:{mq.port}: {exc}")

    def _schedule_reconnect(self, why: str) -> None:
        self.connecting_since = None
        self.attempt += 1
        mq = self.config.mqtt
        delay = backoff_delay(self.attempt - 1, mq.reconnect_min_s, mq.reconnect_max_s, self.rng)
        self.next_connect = time.monotonic() + delay
        log.warning("%s; next attempt in %.1f s", why, delay)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            self._schedule_reconnect(f"the broker refused the connection: {rc}")
            return
        self.connected = True
        self.offline_since = None
        self.exporter.connections.inc()
        self.connecting_since = None
        self.attempt = 0
        log.info(
            "connected to %s:%s (session %s)",
            self.config.mqtt.host, self.config.mqtt.port,
            "resumed" if flags.session_present else "new",
        )  # fmt: skip
        client.subscribe([(self.topics.commands, 1), (self.topics.desired_models, 1)])
        birth = self._envelope({"state": "online", **self.capabilities()})
        client.publish(self.topics.status, birth.encode(), qos=1, retain=True)
        self.next_heartbeat = time.monotonic()  # a heartbeat right after the birth
        # paho sends again what was in flight: its PUBACK clock starts now
        self.sent_at = dict.fromkeys(self.sent_at, time.monotonic())

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        was = self.connected
        self.connected = False
        if was:
            self.offline_since = time.monotonic()
        if not self.stopping.is_set():
            self._schedule_reconnect(f"disconnected ({rc})" if was else f"connect failed ({rc})")

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        seq = self.inflight.pop(mid, None)
        self.sent_at.pop(mid, None)
        if seq is None:  # a status or a heartbeat
            return
        if rc.is_failure:
            log.error("the broker refused record %d: %s; it goes to the dead letters", seq, rc)
            self.refused[seq] = str(rc)
        else:
            self.acked.append(seq)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        """A command: checked here, run by the worker thread (it may ask edged). Nothing
        escapes: paho would end the MQTT loop, and the broker, which has not had the PUBACK,
        would redeliver the same message at every session resume (a crash loop, fleet-wide)."""
        try:
            self._handle(message)
        except Exception:  # a bug here: logged, counted; the message is acknowledged all the same
            self.poison += 1
            log.exception("a message on %s could not be handled", printable(message.topic, 200))

    def _handle(self, message: Any) -> None:
        try:
            topic = parse(message.topic)
        except TopicError as exc:  # only a node's own topics reach it (the broker's ACL)
            self.refuse(None, printable(f"topic {message.topic!r}: {exc}"))
            return
        if topic.kind == "desired-models":
            if message.payload:  # an empty retained message clears it: nothing to do
                try:
                    self.delivery.desired(decode(message.payload).body)
                except EnvelopeError as exc:
                    self.delivery.report("refused", why=printable(f"the desired state: {exc}"))
            return
        if topic.kind != "cmd" or topic.cmd_id is None:
            return
        try:
            command = self.verifier.check(topic.cmd_id, message.payload)
        except Refused as exc:
            self.refuse(topic.cmd_id, printable(str(exc)))  # it may quote the sender's text
            return
        log.info("command %s (%s) from %s (key %s)", command.id, command.name,
                 command.issuer, command.kid)  # fmt: skip
        self.orders.put(command)

    def refuse(self, cmd_id: str | None, why: str) -> None:
        """A command refused: its result says why (when it has a topic to go to), and an alert
        for the fleet, in one transaction."""
        log.warning("command %s refused: %s", cmd_id or "(no id)", why)
        alert = {"alert": "command refused", "command": cmd_id, "why": why}
        items = [Item("events", alert, "alert")]
        if cmd_id is not None:
            items.insert(0, result_item(cmd_id, {"ok": False, "error": f"refused: {why}"}))
        self.keep(items)

    def report(self, cmd_id: str, result: dict[str, Any]) -> None:
        """A command's result, through the outbox (it reaches the operator once connected)."""
        self.keep([result_item(cmd_id, result)])

    def keep(self, items: list[Item]) -> None:
        """Records into the outbox, in one transaction. When it cannot take them (a full disk)
        they are published now, once, without its guarantees, if the broker is there (the
        operator hears why a command did not run); logged either way."""
        try:
            self.outbox.put_many(items)
            return
        except OutboxError as exc:
            log.error("%s: %d record(s) %s", exc, len(items),
                      "published without it" if self.connected else "lost")  # fmt: skip
        for item in items if self.connected else []:
            payload = self._envelope(item.body).encode()
            self.client.publish(self._topic_of(item.kind), payload, qos=1)

    def work(self) -> None:
        """The worker thread: commands, one at a time."""
        while (command := self.orders.get()) is not None:
            try:
                result = {"ok": True, "result": self.run_command(command)}
            except Exception as exc:  # a command that fails says so; the agent goes on
                result = {"ok": False, "error": printable(str(exc))}
            try:
                self.report(command.id, {"name": command.name, **result})
            except Exception:  # a result the outbox cannot take: said here, the thread goes on
                self.poison += 1
                log.exception("the result of command %s cannot be kept", command.id)

    def run_command(self, command: Command) -> Any:
        """One verified command (docs/PROTOCOL.md lists them); raising fails it."""
        name, args = command.name, command.args
        edged = self.edged_client()
        calls: dict[str, Callable[[], Any]] = {
            "ping": lambda: {"pong": True, "node": self.node, "ts": now_ms()},
            "status": self.status,
            "models": lambda: edged.call("POST", "/v2/repository/index"),
            "routing": edged.routing,
            "set-routing": lambda: edged.set_routing(args),
            "reset-routing": edged.reset_routing,
            "reload": lambda: _reloaded(edged.reload()),
            "drain": lambda: self.drain(args),
            "resume": edged.resume,
            "rollback": lambda: self.rollback(edged, command, args),
            "activate": lambda: edged.activate(_text(args, "model"), _version(args)),
            "versions": lambda: edged.model_versions(_text(args, "model")),
            "cloud-ab": lambda: edged.call(
                "PUT",
                f"/v1/admin/cloud/{_text(args, 'model')}/ab",
                {k: v for k, v in args.items() if k != "model"},
            ),
            "logs": lambda: self.logs(args),
        }
        if name not in calls:
            raise ValueError(f"unknown command '{name}' ({COMMANDS})")
        try:
            return calls[name]()
        except ClientError as exc:
            raise RuntimeError(f"edged: {exc}") from None

    def rollback(self, edged: Client, command: Command, args: dict[str, Any]) -> Any:
        """The version before of ``model`` serves again; with ``from``, only when that version
        is the active one (a rollout's rollback must not take a node that never got it back
        further)."""
        model, wrong = _text(args, "model"), args.get("from")
        active = edged.model_versions(model).get("active")
        if wrong is not None and active != wrong:
            return {"rolled_back": False, "active": active, "why": f"{wrong} is not active"}
        reply = edged.activate(model)
        if isinstance(active, int):
            self.delivery.rolled_back(model, active, f"command {command.id} by {command.issuer}")
        return {"rolled_back": True, **reply}

    def drain(self, args: dict[str, Any]) -> Any:
        """edged checks the arguments; the call waits as long as the drain may."""
        wait = args.get("timeout_s", 30.0)
        if isinstance(wait, (int, float)) and not isinstance(wait, bool):
            args = {**args, "timeout_s": min(float(wait), MAX_DRAIN_WAIT_S)}
            wait = args["timeout_s"]
        else:
            wait = 0.0
        edged = self.edged_client(self.config.edged.timeout_s + wait)
        return edged.call("POST", "/v1/admin/drain", args)

    def logs(self, args: dict[str, Any]) -> dict[str, Any]:
        """The last ``lines`` of edged's (or cloudsync's) log at ``level`` and above, with
        ``contains`` in them when given."""
        source = args.get("source", "edged")
        lines, level = args.get("lines", 100), args.get("level", "info")
        contains = args.get("contains", "")
        if source not in ("edged", "cloudsync"):
            raise ValueError("'source' must be edged or cloudsync")
        if isinstance(lines, bool) or not isinstance(lines, int) or not 1 <= lines <= MAX_LOG_LINES:
            raise ValueError(f"'lines' must be 1 to {MAX_LOG_LINES}")
        if level not in LEVELS:
            raise ValueError(f"'level' must be one of {', '.join(LEVELS)}")
        if not isinstance(contains, str):
            raise ValueError("'contains' must be text")
        if source == "edged":
            edged = self.edged_client()
            last = edged.events(0, 1)["last"]
            reply = edged.events(max(0, last - CAPACITY), CAPACITY)
        else:
            reply = self.events.after(0, CAPACITY)
        floor = LEVELS.index(level)
        found = [
            {**e, "message": printable(str(e.get("message")), MAX_LOG_MESSAGE)}
            for e in reply["events"]
            if e.get("level") in LEVELS
            and LEVELS.index(e["level"]) >= floor
            and contains in str(e.get("message"))
        ][-lines:]
        # the newest lines that fit in one record (1,000 long lines would not)
        room, kept = MAX_BODY_BYTES - 1024, 0
        for line in reversed(found):
            room -= len(canonical(line)) + 1
            if room < 0:
                break
            kept += 1
        result = {"source": source, "epoch": reply["epoch"], "lines": found[len(found) - kept :]}
        return {**result, "left_out": len(found) - kept} if kept < len(found) else result

    # ---- what the node says ----------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """The birth's body: who the node is and what it can do (edged's last answer)."""
        status = self.edged.status or {}
        return {
            "software": {"cloudsync": __version__, "edged": status.get("version")},
            "hardware": {
                "machine": platform.machine(),
                "system": platform.system(),
                "release": platform.release(),
                "cpus": _cpus(),
            },
            "models": [
                {"name": m.get("name"), "version": m.get("version"), "state": m.get("state")}
                for m in status.get("models", [])
            ],
            "capabilities": self.edged.capabilities,
            "edged": self.edged.reachability(),
        }

    def heartbeat_body(self) -> dict[str, Any]:
        status = self.edged.status or {}
        cloud = status.get("cloud") or {}
        return {
            "uptime_s": status.get("uptime_s"),
            "load": status.get("load"),
            "link": cloud.get("link"),
            "inflight": status.get("inflight"),
            "drained": status.get("drained"),
            "routing": self.edged.routes,
            "models": {
                str(m.get("name")): m.get("version")
                for m in status.get("models", [])
                if m.get("state") == "READY"
            },
            "edged": self.edged.reachability(),
            "outbox": self.outbox.stats(),
            "poison_messages": self.poison,
            "thread_restarts": dict(self.restarts),
        }

    def status(self) -> dict[str, Any]:
        """The local API's GET /v1/status."""
        return {
            "node": self.node,
            "fleet": self.config.node.fleet,
            "broker": f"{self.config.mqtt.host}:{self.config.mqtt.port}",
            "connected": self.connected,
            "heartbeats": self.heartbeats,
            "inflight": len(self.inflight),
            "poison_messages": self.poison,
            "thread_restarts": dict(self.restarts),
            "edged": self.edged.reachability(),
            "outbox": self.outbox.stats(),
        }

    # ---- the loops -------------------------------------------------------------------------

    def pump(self) -> None:
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
        for mid in late if self.connected else []:
            # no PUBACK in all that time: sent again from the outbox (the same id); paho's own
            # resend after a reconnect normally answers long before
            log.warning("record %d: no PUBACK in %.0f s; it will be sent again",
                        self.inflight.pop(mid), ACK_TIMEOUT_S)  # fmt: skip
            del self.sent_at[mid]
        room = self.config.outbox.max_inflight - len(self.inflight)
        if not self.connected or room <= 0:
            return
        held = {*self.inflight.values(), *self.acked, *self.refused, *self.unsendable}
        for record in self.outbox.peek(room, exclude=held):
            topic = self._topic_of(record.kind)
            try:
                payload = record.envelope(self.node).encode()
            except (EnvelopeError, ValueError) as exc:  # stored by an older cloudsync: too big
                self._unsendable(record.seq, printable(str(exc)))
                continue
            info = self.client.publish(topic, payload, qos=1)
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

    def _topic_of(self, kind: str) -> str:
        if kind.startswith(RESULT):
            return self.topics.cmd_result(kind[len(RESULT) :])
        return self.topics.events if kind == "events" else self.topics.telemetry

    def step(self) -> None:
        """One turn of the MQTT thread."""
        now = time.monotonic()
        if not self.connected:
            if self.connecting_since is None and now >= self.next_connect:
                self._connect()
            elif self.connecting_since is not None and now - self.connecting_since > CONNACK_S:
                self._schedule_reconnect(f"no CONNACK in {CONNACK_S:.0f} s")
        if self.client.loop(timeout=0.05) == mqtt.MQTT_ERR_NO_CONN:
            self.stopping.wait(0.05)  # no socket to wait on: do not spin
        if self.connected and now >= self.next_heartbeat:
            interval = self.config.heartbeat.interval_s
            # at a fixed rate (no drift from the loop's turns), unless it fell behind
            self.next_heartbeat = max(self.next_heartbeat + interval, now + interval / 2)
            try:
                payload = self._envelope(self.heartbeat_body()).encode()
            except ValueError as exc:  # what edged said cannot be sent (NaN, too large)
                body = {"outbox": self.outbox.stats(), "error": printable(str(exc))}
                payload = self._envelope(body).encode()
            self.client.publish(self.topics.heartbeat, payload, qos=1)
            self.heartbeats += 1
            self.exporter.heartbeats.inc()
        self.pump()

    def collect(self) -> None:
        """The edged thread: its status and capabilities, and its events into the outbox,
        every heartbeat interval."""
        client = self.edged_client()
        while not self.stopping.is_set():
            try:
                self.collect_once(client)
            except Exception:  # a full disk, a bug: logged, and the next turn tries again
                log.exception("reading edged or evaluating the alerts failed")
            self.stopping.wait(self.config.heartbeat.interval_s)

    def collect_once(self, client: Client) -> None:
        snap = None
        try:
            status = client.status()
            capabilities = client.capabilities()
            snap = telemetry.parse(client.metrics(), time.time(), status.get("epoch") or "")
            self.edged = EdgedView(status, capabilities, "", now_ms(), snap.route_totals())
            self.read_events(client)
            self.report_metrics(snap)
        except ValueError as exc:  # not edged's metrics: say so, keep going
            log.error("edged's /metrics cannot be read: %s", exc)
        except ClientError as exc:
            self.edged = EdgedView(None, [], exc.message, now_ms())
        if self.config.alerts.enabled:
            self.check_alerts(snap)

    def facts(self, snap: telemetry.Snapshot | None) -> Facts:
        """What the alerts are evaluated on, now."""
        now = time.monotonic()
        facts = Facts(
            now,
            edged_up=self.edged.status is not None,
            offline_s=0.0 if self.offline_since is None else now - self.offline_since,
            outbox_age_s=self.outbox.oldest_age_s(),
            rollbacks={model: time.time() - at for model, at in list(self.rollbacks.items())},
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
        for state, alert in self.alerts.evaluate(self.facts(snap)):
            since = wall - int((mono - alert.since) * 1000)
            body = self.alerts.event(state, alert, wall, since)
            level = logging.WARNING if state == "firing" else logging.INFO
            log.log(level, "alert %s %s: %s", alert.rule.name, state, body["summary"])
            items.append(Item("events", body, "alert", record_id(body)))
        if items:  # the events and the alerts firing now, in one transaction
            self.outbox.put_many(items, state={ALERTS: self.alerts.saved(mono, wall)})

    def _rolled_back(self, model: str) -> None:
        self.rollbacks[model] = time.time()
        self.outbox.put_many([], state={ROLLBACKS: json.dumps(self.rollbacks)})
        self.exporter.rollbacks.labels(model).inc()

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
                items.insert(0, Item("events", {"alert": "edged events missed",
                                                "missed": reply["missed"]}, "alert"))  # fmt: skip
            cursor = reply["events"][-1]["id"]
            self.outbox.put_many(items, state={EDGED_CURSOR: f"{epoch}:{cursor}"})
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

    def run(self) -> None:
        """Until ``stop``: the MQTT thread here, the edged, delivery and commands threads beside
        it, each restarted if it fails."""
        stop_metrics = self._serve_metrics()
        self.start_thread("edged", self.collect)
        self.start_thread("delivery", self.delivery.run)
        worker = self.start_thread("commands", self.work)
        try:
            self.supervise("mqtt", self._mqtt_loop)
        finally:
            self.orders.put(None)
            self.delivery.stop()
            worker.join(5)
            if stop_metrics is not None:
                stop_metrics()
            self._close()

    def _mqtt_loop(self) -> None:
        while not self.stopping.is_set():
            self.step()

    def start_thread(self, name: str, body: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=self.supervise, args=(name, body), name=name)
        thread.daemon = True
        thread.start()
        return thread

    def supervise(self, name: str, body: Callable[[], None]) -> None:
        """``body`` until it returns; when it fails (a bug, a disk): logged, counted (heartbeat,
        status, ``cloudsync_thread_restarts_total``), and started again after a pause that
        doubles up to RESTART_MAX_S while it keeps failing."""
        failures = 0
        while True:
            started = time.monotonic()
            try:
                body()
                return
            except Exception:
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.exporter.restarts.labels(name).inc()
                failures = 1 if time.monotonic() - started > RESTART_MAX_S else failures + 1
                pause = min(RESTART_MAX_S, 2.0 ** (failures - 1))
                log.exception("the %s thread failed; it starts again in %.0f s", name, pause)
                if self.stopping.wait(pause):
                    return

    def _serve_metrics(self) -> Callable[[], None] | None:
        """/metrics on ``[metrics] port``; a port that cannot be had is logged: the agent's
        work (the fleet) goes on without it."""
        address, port = self.config.metrics.address, self.config.metrics.port
        if not port:
            return None
        try:
            stop = self.exporter.serve(address, port)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d: %s", address, port, exc.strerror or exc)
            return None
        log.info("metrics on http://%s:%d/metrics", address, port)
        return stop

    def stop(self) -> None:
        self.stopping.set()

    def _close(self) -> None:
        if self.connected:
            bye = self._envelope({"state": "offline", "reason": "stopped"})
            info = self.client.publish(self.topics.status, bye.encode(), qos=1, retain=True)
            deadline = time.monotonic() + 2.0
            while not info.is_published() and time.monotonic() < deadline:
                self.client.loop(timeout=0.05)
            self.pump()  # the acks that came meanwhile
            self.client.disconnect()
        self.outbox.close()
        self.verifier.close()


def _text(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"'{key}' must be given (text)")
    return value


def _version(args: dict[str, Any]) -> int:
    value = args.get("version")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("'version' must be given (an integer)")
    return value


def _reloaded(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply["reloaded"]:
        raise RuntimeError(f"edged's reload failed: {reply['error']}")
    return reply


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


def result_item(cmd_id: str, result: dict[str, Any]) -> Item:
    """A command's result as an outbox record; one too large for a record says so instead."""
    size = len(canonical(result))
    if size > MAX_BODY_BYTES - 1024:
        error = f"the result is {size} bytes, over the {MAX_BODY_BYTES - 1024} a record may carry"
        result = {"name": result.get("name"), "ok": False, "error": error}
    return Item(f"{RESULT}{cmd_id}", result, "event")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

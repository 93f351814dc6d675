"""The agent: one MQTT 5 session to the fleet's broker, kept up through bad networks.

One thread owns the MQTT client (paho-mqtt 2.x, driven by ``loop()``): it connects with TLS 1.3
and the node's certificate, ``clean_start`` false and a session expiry (the broker keeps the
node's QoS 1 queue while it is away), sets a retained *offline* last will, publishes a retained
*online* birth with the node's capabilities on every connect, sends a heartbeat every
``heartbeat.interval_s`` (``heartbeat``), and drains the outbox (``pump``): up to
``max_inflight`` records published at QoS 1, each deleted from the outbox only when its PUBACK
comes (a refusal moves it to the dead letters); whatever it publishes goes through ``uplink``
(the egress ledger first). When the connection drops it reconnects after 1, 2, 4 ... 64 s, each
delay drawn between half and all of it (jitter, so a fleet does not reconnect in step). It
starts and keeps working with no network: records wait in the outbox.

Commands on ``.../cmd/{id}`` are verified in the MQTT thread (``cloudsync.protocol.commands``: a
refused one is reported, never run) and run by the commands thread (``handlers``); results go
through the outbox. The edged thread (``edged_reader``) reads edged; the delivery thread
(``delivery``) installs models. The MQTT thread never waits on edged. Every thread runs under
``supervise``: one that fails is logged, counted and started again.
"""

from __future__ import annotations

import itertools
import json
import logging
import platform
import queue
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloudsync import __version__
from cloudsync.agent.alerts import Evaluator
from cloudsync.agent.config import Config
from cloudsync.agent.delivery import Delivery
from cloudsync.agent.edged_reader import ALERTS, EdgedReader
from cloudsync.agent.enrol import Renewal
from cloudsync.agent.handlers import Handlers
from cloudsync.agent.heartbeat import Heartbeat
from cloudsync.agent.metrics import AgentMetrics
from cloudsync.agent.outbox import Item, Outbox, OutboxError
from cloudsync.agent.pump import RESULT, OutboxPump
from cloudsync.agent.state import AgentState
from cloudsync.agent.uplink import Uplink
from cloudsync.protocol.commands import Command, Refused, Verifier, load_anchors, load_scopes
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
from cloudsync.protocol.topics import TopicError, Topics, check_name, client_id, parse
from cloudsync.protocol.trust import TRUST_FILE, Trust, TrustError, TrustState, refuse_revoked
from edged.client import Client
from edged.common.backoff import backoff_delay
from edged.common.egress import Ledger
from edged.common.events import EventLog

log = logging.getLogger("cloudsync")
ROLLBACKS = "rollbacks"  # the outbox's state key: when each model was last rolled back
CONNACK_S = 10.0  # a connection that has no CONNACK by then is given up and tried again
# the largest MQTT packet cloudsync takes (MQTT 5's Maximum Packet Size: the broker does not
# send a larger one): an envelope and its topic. The fleet's broker has the same limit.
MAX_PACKET = MAX_BYTES + 4096
RESTART_MAX_S = 30.0  # a thread that failed is started again after 1, 2, 4 ... up to this


def node_name(configured: str) -> str:
    """The configured name, else the host name made a valid topic level."""
    if configured:
        return configured
    host = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())
    return check_name("node", host[:64] or "node")


class Agent:
    def __init__(self, config: Config, rng: random.Random | None = None) -> None:
        self.config = config
        self.node = node_name(config.node.name)
        self.topics = Topics(config.node.fleet, self.node)
        self.outbox = Outbox(config.outbox.path, config.outbox.budget_mb << 20)
        egress = config.egress
        self.ledger = Ledger(
            egress.directory or config.outbox.path.parent / "uplink",
            int(egress.segment_mb * (1 << 20)),
            int(egress.max_mb * (1 << 20)),
            egress.fsync_s,
        )
        settings = {
            "segment_mb": egress.segment_mb,
            "max_mb": egress.max_mb,
            "fsync_s": egress.fsync_s,
        }
        self.ledger.start(egress.enabled, settings, "cloudsync")
        self.next_sync = 0.0
        self.uplink = Uplink(
            self.ledger, f"{config.mqtt.host}:{config.mqtt.port}", lambda: self.client
        )
        self.pump = OutboxPump(
            self.outbox, self.topics, self.node, config.outbox.max_inflight, self.uplink.publish
        )
        self.rng = rng or random.Random()
        self.state = AgentState(
            offline_since=time.monotonic(),
            rollbacks=json.loads(self.outbox.get_state(ROLLBACKS) or "{}"),
        )
        self.stopping = threading.Event()
        # the sequence of what does not go through the outbox: increasing (next() is atomic)
        self.seq = itertools.count(now_ms() + 1)
        self.attempt = 0
        self.next_connect = 0.0  # time.monotonic() of the next connection attempt
        self.connecting_since: float | None = None  # a socket is open, no CONNACK yet
        provisioned = Trust(
            0,
            load_anchors(config.commands.trust_dir),
            load_scopes(config.commands.trust_dir),
            config.delivery.threshold,
        )
        # the fleet's trust documents replace the provisioned keys (cloudsync.protocol.trust)
        self.trust = TrustState(config.outbox.path.with_name(TRUST_FILE), provisioned)
        self.verifier = Verifier(
            f"{config.node.fleet}/{self.node}",
            self.trust.current.anchors,
            config.outbox.path.with_name("commands.db"),
            config.commands.max_lifetime_s,
            self.trust.current.scopes,
        )
        self.orders: queue.Queue[Command | None] = queue.Queue()
        self.delivery = Delivery(
            config.delivery,
            config.node.fleet,
            self.node,
            self.verifier.manifest_anchors,
            self.outbox,
            self.edged_client,
            config.edged.timeout_s,
            lambda: self.trust.current.threshold,
            self.trust.revoked,
            self._rolled_back,
        )
        if self.trust.error:  # (connected is False: keep() only writes the outbox here)
            self.keep(
                [Item("events", {"alert": "trust refused", "why": self.trust.error}, "alert")]
            )
        self.events = EventLog()  # cloudsync's own log, for the ``logs`` command
        log.addHandler(self.events)
        self.alerts = Evaluator(config.alerts)
        self.alerts.restore(self.outbox.get_state(ALERTS), time.monotonic(), now_ms())
        self.metrics = AgentMetrics(self.state, self.outbox, self.alerts)
        self.heartbeat = Heartbeat(
            self.state, self.outbox, self.ledger, config.heartbeat.interval_s, self._envelope
        )
        self.edged_reader = EdgedReader(
            self.state,
            config,
            self.outbox,
            self.alerts,
            self.delivery,
            self.stopping,
            self.edged_client,
        )
        self.handlers = Handlers(
            self.node, config, self.edged_client, self.status, self.delivery, self.events
        )
        self.renewal = Renewal(config, self.node)
        self.swap = False  # a renewed certificate: a new client at the next turn
        self.client = self._client()

    # ---- the MQTT client -----------------------------------------------------------------

    def _client(self) -> mqtt.Client:
        mq = self.config.mqtt
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id(self.config.node.fleet, self.node),
            protocol=mqtt.MQTTv5,
            transport=mq.transport,
            reconnect_on_failure=False,  # reconnects are ours: backoff with jitter
        )
        if mq.transport == "websockets":
            client.ws_set_options(path=mq.websockets_path)
        context = tls_context(mq.ca_file, mq.cert_file, mq.key_file)
        client.tls_set_context(refuse_revoked(context, self.trust.revoked))
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
        self.state.connected = True
        self.state.offline_since = None
        self.metrics.connections.inc()
        self.connecting_since = None
        self.attempt = 0
        log.info(
            "connected to %s:%s (session %s)",
            self.config.mqtt.host,
            self.config.mqtt.port,
            "resumed" if flags.session_present else "new",
        )
        topics = (
            self.topics.commands,
            self.topics.desired_models,
            self.topics.desired_trust,
            self.topics.renew_answer,
        )
        client.subscribe([(topic, 1) for topic in topics])
        try:
            birth = self._envelope({"state": "online", **self.capabilities()}).encode()
        except ValueError as exc:  # what edged said cannot be sent (NaN, too large)
            birth = self._envelope({"state": "online", "error": printable(str(exc))}).encode()
        self.uplink.publish(self.topics.status, birth, "status", retain=True)
        self.heartbeat.soon(time.monotonic())  # a heartbeat right after the birth
        self.pump.reconnected()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        was = self.state.connected
        self.state.connected = False
        if was:
            self.state.offline_since = time.monotonic()
        if not self.stopping.is_set():
            self._schedule_reconnect(f"disconnected ({rc})" if was else f"connect failed ({rc})")

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        self.pump.published(mid, rc)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        """A command: checked here, run by the worker thread (it may ask edged). Nothing
        escapes: paho would end the MQTT loop, and the broker, which has not had the PUBACK,
        would redeliver the same message at every session resume (a crash loop, fleet-wide)."""
        try:
            self._handle(message)
        except Exception:  # a bug here: logged, counted; the message is acknowledged all the same
            self.state.poison += 1
            topic = getattr(message, "_topic", b"")  # bytes: .topic decodes (and may fail)
            log.exception("a message on %r could not be handled", bytes(topic)[:200])

    def _handle(self, message: Any) -> None:
        try:
            topic = parse(message.topic)
        except TopicError as exc:  # only a node's own topics reach it (the broker's ACL)
            self.refuse(None, printable(f"topic {message.topic!r}: {exc}"))
            return
        if topic.kind == "renew-answer":
            self.swap = self.renewal.answered(message.payload) or self.swap
            return
        if topic.kind == "desired-models":
            if message.payload:  # an empty retained message clears it: nothing to do
                try:
                    self.delivery.desired(decode(message.payload).body)
                except EnvelopeError as exc:
                    self.delivery.report("refused", why=printable(f"the desired state: {exc}"))
            return
        if topic.kind == "desired-trust":
            if message.payload:
                self.take_trust(message.payload)
            return
        if topic.kind != "cmd" or topic.cmd_id is None:
            return
        try:
            command = self.verifier.check(topic.cmd_id, message.payload)
        except Refused as exc:
            self.refuse(topic.cmd_id, printable(str(exc)))  # it may quote the sender's text
            return
        log.info(
            "command %s (%s) from %s (key %s)",
            command.id,
            command.name,
            command.issuer,
            command.kid,
        )
        self.orders.put(command)

    def take_trust(self, payload: bytes) -> None:
        """A trust document (MQTT thread): when it verifies, its keys, scopes, threshold and
        revocations are in force from the next message on; reported either way."""
        try:
            trust = self.trust.offer(decode(payload).body)
        except (EnvelopeError, TrustError) as exc:
            why = printable(f"trust document refused: {exc}")
            log.warning("%s", why)
            self.keep([Item("events", {"alert": "trust refused", "why": why}, "alert")])
            return
        except OSError as exc:  # it cannot be kept: not taken (the broker sends it again)
            log.error("trust document not taken: %s cannot be written (%s)", self.trust.path, exc)
            return
        if trust is None:
            return  # the one in force (retained, sent again at each connection)
        self.verifier.anchors, self.verifier.scopes = dict(trust.anchors), dict(trust.scopes)
        log.warning(
            "trust version %d in force: keys %s, threshold %d, %d revoked certificates",
            trust.version,
            sorted(trust.anchors),
            trust.threshold,
            len(trust.revoked),
        )
        event = {
            "version": trust.version,
            "keys": sorted(trust.anchors),
            "threshold": trust.threshold,
            "revoked": len(trust.revoked),
        }
        self.keep([Item("events", {"trust": event}, "event")])

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
            log.error(
                "%s: %d record(s) %s",
                exc,
                len(items),
                "published without it" if self.state.connected else "lost",
            )
        for item in items if self.state.connected else []:
            payload = self._envelope(item.body).encode()
            self.uplink.publish(self.pump.topic_of(item.kind), payload, item.kind)

    def work(self) -> None:
        """The worker thread: commands, one at a time."""
        while (command := self.orders.get()) is not None:
            try:
                result = {"ok": True, "result": self.handlers.run(command)}
            except Exception as exc:  # a command that fails says so; the agent goes on
                result = {"ok": False, "error": printable(str(exc))}
            try:
                self.report(command.id, {"name": command.name, **result})
            except Exception:  # a result the outbox cannot take: said here, the thread goes on
                self.state.poison += 1
                log.exception("the result of command %s cannot be kept", command.id)

    # ---- what the node says ----------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """The birth's body: who the node is and what it can do (edged's last answer)."""
        status = self.state.edged.status or {}
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
            "capabilities": self.state.edged.capabilities,
            "edged": self.state.edged.reachability(),
            "labels": self.config.node.labels,
        }

    def status(self) -> dict[str, Any]:
        """The local API's GET /v1/status."""
        return {
            "node": self.node,
            "fleet": self.config.node.fleet,
            "broker": f"{self.config.mqtt.host}:{self.config.mqtt.port}",
            "connected": self.state.connected,
            "heartbeats": self.heartbeat.sent,
            "inflight": len(self.pump.inflight),
            "poison_messages": self.state.poison,
            "thread_restarts": dict(self.state.restarts),
            "edged": self.state.edged.reachability(),
            "outbox": self.outbox.stats(),
        }

    # ---- the loops -------------------------------------------------------------------------

    def step(self) -> None:
        """One turn of the MQTT thread."""
        if self.swap:
            self._swap_client()
        now = time.monotonic()
        if not self.state.connected:
            if self.connecting_since is None and now >= self.next_connect:
                self._connect()
            elif self.connecting_since is not None and now - self.connecting_since > CONNACK_S:
                self._schedule_reconnect(f"no CONNACK in {CONNACK_S:.0f} s")
        if self.client.socket() is None:  # no socket to wait on (paho would log an error a
            self.stopping.wait(0.05)  # turn while offline: 20 lines a second): do not spin
        elif self.client.loop(timeout=0.05) == mqtt.MQTT_ERR_NO_CONN:
            self.stopping.wait(0.05)
        beat = self.heartbeat.due(now) if self.state.connected else None
        if beat is not None:
            self.uplink.publish(self.topics.heartbeat, beat, "heartbeat")
            self.metrics.heartbeats.inc()
        if self.state.connected and self.renewal.due(now):
            self.uplink.publish(self.topics.renew, self.renewal.request(now), "renew")
        if now >= self.next_sync:
            self.next_sync = now + self.config.egress.fsync_s
            self.ledger.sync()
        self.pump.turn(self.state.connected)

    def _swap_client(self) -> None:
        """The renewed certificate in use: a new client (paho keeps the TLS context it was
        given) resumes the same persistent session after a clean DISCONNECT (no will); what
        was in flight and not acknowledged goes again from the outbox, with its id."""
        self.swap = False
        old = self.client
        old.on_connect = old.on_disconnect = old.on_publish = old.on_message = None
        try:
            old.disconnect()
            old.loop(timeout=0.05)
        except Exception:  # it goes either way
            log.debug("the old client's disconnect", exc_info=True)
        if self.state.connected:
            self.state.offline_since = time.monotonic()
        self.state.connected = False
        self.pump.new_client()
        self.client = self._client()
        self.connecting_since, self.next_connect, self.attempt = None, 0.0, 0
        log.info("reconnecting with the renewed certificate")

    def _rolled_back(self, model: str) -> None:
        self.state.rollbacks[model] = time.time()
        self.outbox.put_many([], state={ROLLBACKS: json.dumps(self.state.rollbacks)})
        self.metrics.rollbacks.labels(model).inc()

    def run(self) -> None:
        """Until ``stop``: the MQTT thread here, the edged, delivery and commands threads beside
        it, each restarted if it fails."""
        stop_metrics = self._serve_metrics()
        self.start_thread("edged", self.edged_reader.run)
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
            self.ledger.close()

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
                self.state.restarts[name] = self.state.restarts.get(name, 0) + 1
                self.metrics.restarts.labels(name).inc()
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
            stop = self.metrics.serve(address, port)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d: %s", address, port, exc.strerror or exc)
            return None
        log.info("metrics on http://%s:%d/metrics", address, port)
        return stop

    def stop(self) -> None:
        self.stopping.set()

    def _close(self) -> None:
        if self.state.connected:
            bye = self._envelope({"state": "offline", "reason": "stopped"})
            info = self.uplink.publish(self.topics.status, bye.encode(), "status", retain=True)
            deadline = time.monotonic() + 2.0
            while not info.is_published() and time.monotonic() < deadline:
                self.client.loop(timeout=0.05)
            self.pump.turn(self.state.connected)  # the acks that came meanwhile
            self.client.disconnect()
        self.outbox.close()
        self.verifier.close()


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

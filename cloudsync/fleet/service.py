"""``edgefleet serve``: the fleet service. It keeps the node registry from the fleet's messages,
applies the deployments, and answers the HTTP API (cloudsync.fleet.api).

Three threads beside the HTTP server's event loop:

- **MQTT** (paho's): every message of the fleet it needs goes on a queue. Statuses and desired
  states are retained, and every replica subscribes to them itself (a shared subscription gets
  no retained messages); heartbeats and events come through an MQTT 5 shared subscription
  (``$share/{group}/...``), so replicas split them and each is handled by one replica.
- **the writer**: takes what the queue has (up to 5,000 messages or 50 ms), writes it in one
  transaction (cloudsync.fleet.registry), and only then acknowledges the messages to the
  broker (manual PUBACKs, in the order they came). The broker sends at most
  ``receive_maximum`` unacknowledged messages: a slow database holds the fleet's messages on
  the broker, not in the service's memory. Writes are idempotent, so a message that comes
  twice is counted once. A replica killed loses what it had not written (with
  ``session_expiry_s`` 0, the default: a gone replica's session would keep taking its share
  of the shared subscriptions); statuses and desired states are retained and come again,
  heartbeats come every interval, and a rollout reads a node's version from its heartbeats as
  well as from its delivery events.
- **the runner**: holds the database's runner lease (one replica at a time) and, while it does,
  drives the rollouts one turn (cloudsync.fleet.rollouts) and reconciles the deployments: the
  nodes a batch names (births, desired states) at once, every node every ``reconcile_s``; and
  forgets old events.
- **the alerter** (with ``[alerts] alertmanagers``): while this replica holds the lease, sends
  the nodes' alerts to Alertmanager every ``[alerts] resend_s`` (cloudsync.fleet.alerting).

The writer also writes each node event it stores the first time as an ECS JSON line
(``[events] ecs_file``), and answers new devices' enrolment requests and nodes' renewals
(cloudsync.fleet.enrolment) once their batch is written; the API serves every node's series
for Prometheus from the database (cloudsync.fleet.exporter), so any replica answers for the
whole fleet.

SIGTERM stops it cleanly (the runner lease is released at once); after a SIGKILL another
replica takes the lease when it expires, or this one at once when it comes back.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cloudsync.fleet.abtests import ABTests
from cloudsync.fleet.alerting import Alerting
from cloudsync.fleet.audit import AuditLog
from cloudsync.fleet.commands import Commands
from cloudsync.fleet.config import FleetServiceConfig
from cloudsync.fleet.deployments import Deployments, Reconciler
from cloudsync.fleet.enrolment import Decision, Enrolments, Issuer
from cloudsync.fleet.exporter import NodeSeries
from cloudsync.fleet.leases import Leases
from cloudsync.fleet.observe import EventLog
from cloudsync.fleet.registry import Ingested, Message, Registry
from cloudsync.fleet.rollouts import Rollouts
from cloudsync.fleet.sessions import Sessions
from cloudsync.fleet.store import Store
from cloudsync.protocol import envelope
from cloudsync.protocol.mqtt import tls_context
from cloudsync.protocol.topics import (
    PREFIX,
    TopicError,
    Topics,
    client_id,
    enrol_answer,
    enrol_filter,
    parse,
    parse_enrol,
)

log = logging.getLogger("edgefleet.service")
BATCH = 5000
BATCH_WAIT_S = 0.05
RUNNER_LEASE = "runner"
KICK_S = 5.0  # a revoked node still publishing is kicked again at most this often


def now_ms() -> int:
    return int(time.time() * 1000)


def alertmanager_context(config: FleetServiceConfig) -> ssl.SSLContext | None:
    ca = config.alerts.ca_file
    return ssl.create_default_context(cafile=str(ca)) if ca is not None else None


def reserved_names(config: FleetServiceConfig) -> list[str]:
    """Names no node may have: ``[enrolment] reserved``, the service's identity (the sender of
    what it publishes) and the CN of its own certificate on the broker."""
    names = [*config.enrolment.reserved, config.service.identity]
    if config.mqtt.cert_file is not None:
        cert = x509.load_pem_x509_certificate(config.mqtt.cert_file.read_bytes())
        names += [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return names


def load_deploy_key(config: FleetServiceConfig) -> tuple[str, Ed25519PrivateKey] | None:
    path = config.service.deploy_key
    if path is None:
        return None
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise OSError(f"{path} is not an Ed25519 private key")
    return config.service.deploy_kid, key


class Metrics:
    """The service's own /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "edgefleet_messages", "messages written, by kind", ["kind"], registry=r
        )
        self.poison = Counter(
            "edgefleet_poison_messages", "messages dropped as not of the contract", registry=r
        )
        self.lag = Histogram(
            "edgefleet_ingest_lag_seconds",
            "a heartbeat's age (by its node's clock) when its batch is committed",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.batch = Histogram(
            "edgefleet_ingest_batch_seconds", "one batch's transaction", registry=r
        )
        self.queue = Gauge("edgefleet_ingest_queue", "messages waiting for the writer", registry=r)
        self.runner = Gauge(
            "edgefleet_runner", "1 while this replica holds the runner lease", registry=r
        )
        self.published = Counter(
            "edgefleet_desired_published", "desired states published", registry=r
        )
        self.db_errors = Counter(
            "edgefleet_database_errors", "database calls that failed", registry=r
        )
        self.events = Counter(
            "edgefleet_node_events", "nodes' events stored (once each)", registry=r
        )
        self.barred = Counter(
            "edgefleet_revoked_messages", "messages of revoked nodes, dropped", registry=r
        )
        self.kicks = Counter(
            "edgefleet_revoked_sessions_closed",
            "sessions of revoked nodes the service closed on the broker",
            registry=r,
        )
        self.broker_files = Counter(
            "edgefleet_broker_file_errors",
            "writes of the broker's CRL or ACL that failed (the"
            " next full pass tries again), by file",
            ["file"],
            registry=r,
        )
        self.alert_pushes = Counter(
            "edgefleet_alertmanager_pushes",
            "sends of the alerts to Alertmanager, by outcome",
            ["outcome"],
            registry=r,
        )


class Service:
    def __init__(self, config: FleetServiceConfig, clock: Callable[[], int] = now_ms) -> None:
        self.config, self.clock = config, clock
        self.fleet = config.service.fleet
        self.replica = config.service.replica_name()
        self.store = Store(config.service.database_url())
        enrol = config.enrolment
        issuer = None
        if enrol.ca_cert is not None and enrol.ca_key is not None:
            issuer = Issuer(enrol.ca_cert, enrol.ca_key, enrol.cert_days)
        self.enrolments = Enrolments(self.store, issuer, reserved_names(config))
        self.registry = Registry(
            self.store, config.service.offline_after_s, self.enrolments, config.events.checkpoint_s
        )
        self.crl_due = 0.0
        self.write_broker_files(strict=True)  # the broker's crlfile is there before it is needed
        self.deployments = Deployments(self.store, clock)
        self.audit = AuditLog(self.store, clock)
        self.commands = Commands(self.store, clock)
        self.sessions = Sessions(self.store, clock)
        self.leases = Leases(self.store)
        self.rollouts = Rollouts(
            self.store,
            self.deployments,
            self.fleet,
            self.publish_desired,
            self.send_command,
            load_deploy_key(config),
            config.service.identity,
            clock,
            int(config.service.offline_after_s * 1000),
        )
        self.abtests = ABTests(
            self.store,
            self.fleet,
            self.send_command,
            load_deploy_key(config),
            config.service.identity,
            clock,
            int(config.service.offline_after_s * 1000),
        )
        self.reconciler = Reconciler(
            self.store, self.deployments, self.publish_desired, self.rollouts.held
        )
        self.watched: frozenset[str] = frozenset()
        self.watched_at = 0.0
        self.metrics = Metrics()
        self.series = NodeSeries(
            self.store, self.fleet, int(config.service.offline_after_s * 1000), clock
        )
        self.alerting = Alerting(
            self.store,
            self.fleet,
            config.alerts.alertmanagers,
            config.alerts.resend_s,
            clock,
            config.api.public_url,
            alertmanager_context(config),
        )
        ecs = config.events.ecs_file
        self.event_log = EventLog(ecs, self.fleet) if ecs else None
        self.inbox: queue.Queue[tuple[Message, int]] = queue.Queue()
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.dirty: set[str] = set()
        self.full_pass = False
        self.dirty_lock = threading.Lock()
        self.kicked: dict[str, float] = {}  # node: when it may be kicked again (monotonic)
        self.holds_lease = False
        self.seq = 0
        self.threads: list[threading.Thread] = []
        self.client = self._client()

    # ---- MQTT ------------------------------------------------------------------------------

    def _client(self) -> mqtt.Client:
        cfg = self.config.mqtt
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"edgefleet-{self.fleet}-{self.replica}"[:64],
            protocol=mqtt.MQTTv5,
            manual_ack=True,
        )
        client.tls_set_context(tls_context(cfg.ca_file, cfg.cert_file, cfg.key_file))
        client.reconnect_delay_set(1, 30)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        return client

    def filters(self) -> list[tuple[str, int]]:
        base, group = f"{PREFIX}/{self.fleet}/+", self.config.mqtt.share_group
        return [
            (f"{base}/status", 1),
            (f"{base}/desired/models", 1),
            (f"$share/{group}/{base}/heartbeat", 1),
            (f"$share/{group}/{base}/events", 1),
            (f"$share/{group}/{base}/telemetry", 1),
            (f"$share/{group}/{base}/cmd/+/result", 1),
            (f"$share/{group}/{enrol_filter(self.fleet)}", 1),
            (f"$share/{group}/{base}/renew", 1),
        ]

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            log.error("the broker refused the connection: %s", rc)
            return
        log.info("connected to the broker (session present: %s)", flags.session_present)
        client.subscribe(self.filters())

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        """On paho's thread: never raises (a bad topic is acknowledged and dropped)."""
        try:
            if "/_enrol/" in message.topic:
                fleet, rid = parse_enrol(message.topic)
                if fleet != self.fleet:
                    raise TopicError(message.topic)
                msg = Message("enrol", "", message.payload, self.clock(), rid)
            else:
                where = parse(message.topic)
                if where.fleet != self.fleet or where.kind not in (
                    "status",
                    "heartbeat",
                    "events",
                    "telemetry",
                    "desired-models",
                    "cmd-result",
                    "renew",
                ):
                    raise TopicError(message.topic)
                msg = Message(
                    where.kind, where.node, message.payload, self.clock(), where.cmd_id or ""
                )
            self.inbox.put((msg, message.mid))
            self.metrics.queue.inc()
        except Exception:  # a poison topic must not end paho's thread
            self.metrics.poison.inc()
            self._ack(message.mid)

    def _ack(self, mid: int) -> None:
        try:
            self.client.ack(mid, 1)
        except Exception:  # the session redelivers what was not acknowledged
            log.debug("ack %d", mid, exc_info=True)

    def kick(self, node: str) -> None:
        """End ``node``'s open session on the broker, as a revocation by name does: a client of
        the service's connects under the node's client id, which makes the broker close the
        node's connection (MQTT's session takeover), and leaves. From the broker's next reload
        of the CRL the node cannot connect again; until then each batch in which it publishes
        kicks it again, at most every KICK_S. On a thread of its own: never waits on paho's."""
        now = time.monotonic()
        with self.dirty_lock:
            if now < self.kicked.get(node, 0.0):
                return
            self.kicked[node] = now + KICK_S
        threading.Thread(target=self._kick, args=(node,), name=f"kick-{node}", daemon=True).start()

    def _kick(self, node: str) -> None:
        cfg = self.config.mqtt
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id(self.fleet, node), protocol=mqtt.MQTTv5
        )
        connected = threading.Event()
        client.on_connect = lambda *args: connected.set()
        try:
            client.tls_set_context(tls_context(cfg.ca_file, cfg.cert_file, cfg.key_file))
            client.connect(cfg.host, cfg.port, keepalive=10, clean_start=True)
            client.loop_start()
            if connected.wait(10):
                log.warning("node %s is revoked: its session on the broker is closed", node)
                self.metrics.kicks.inc()
            else:
                log.error("node %s is revoked, but its session could not be taken over", node)
            client.disconnect()
        except Exception:  # a thread of its own: logged, never raised
            log.exception("node %s is revoked, but its session could not be taken over", node)
        finally:
            client.loop_stop()

    def publish_desired(self, node: str, entries: list[dict[str, Any]]) -> bool:
        """The node's desired state, retained; written as the node's desired state at once
        (the broker's echo, older by its ``seq``, does not undo a later one)."""
        self.seq = max(self.seq + 1, self.clock())
        payload = envelope.Envelope(
            self.config.service.identity, self.seq, {"models": entries}
        ).encode()
        info = self.client.publish(Topics(self.fleet, node).desired_models, payload, 1, True)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return False
        with self.store.transaction() as tx:
            Registry.desired(tx, node, entries, self.seq, self.clock())
        self.metrics.published.inc()
        return True

    def answer(self, decision: Decision) -> bool:
        """An enrolment request's answer (not retained: the device waits for it, and asks
        again until it has it)."""
        self.seq = max(self.seq + 1, self.clock())
        payload = envelope.Envelope(
            self.config.service.identity, self.seq, decision.answer.body()
        ).encode()
        if decision.node:  # a renewal: on the node's own topic
            topic = Topics(self.fleet, decision.node).renew_answer
        else:
            topic = enrol_answer(self.fleet, decision.rid)
        return self.client.publish(topic, payload, 1).rc == mqtt.MQTT_ERR_SUCCESS

    def send_command(self, node: str, cmd_id: str, payload: bytes) -> bool:
        info = self.client.publish(Topics(self.fleet, node).cmd(cmd_id), payload, 1)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    # ---- the writer ------------------------------------------------------------------------

    def take(self) -> list[tuple[Message, int]]:
        try:
            batch = [self.inbox.get(timeout=0.5)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + BATCH_WAIT_S
        while len(batch) < BATCH:
            try:
                batch.append(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        self.metrics.queue.dec(len(batch))
        return batch

    def write(self, batch: list[tuple[Message, int]]) -> Ingested:
        """Writes ``batch`` until the database takes it, then acknowledges it. A batch the
        database refuses is written message by message: one it refuses alone while it answers
        is dropped as poison; while it does not answer (down, full), the batch waits, and the
        broker holds the rest."""
        delay = 0.5
        while True:
            started = time.perf_counter()
            try:
                done = self.registry.ingest((m for m, _ in batch), self.watched_now())
                self.metrics.batch.observe(time.perf_counter() - started)
                break
            except Exception:
                self.metrics.db_errors.inc()
                log.exception("a batch of %d messages cannot be written", len(batch))
            alone = self.one_by_one([m for m, _ in batch])
            if alone is not None:
                done = alone
                break
            log.error("the database does not answer; trying again in %.1f s", delay)
            if self.stopping.wait(delay):
                return Ingested()
            delay = min(delay * 2, 10.0)
        for _, mid in batch:
            self._ack(mid)
        for kind, n in done.counted.items():
            self.metrics.messages.labels(kind).inc(n)
        self.metrics.events.inc(len(done.events))
        for decision in done.decisions:  # written first: a request sent again gets the same
            self.answer(decision)
        if self.event_log is not None:
            for event in done.events:  # written once: a duplicate was not stored
                self.event_log.write(event)
        if done.poison:
            self.metrics.poison.inc(done.poison)
        written = self.clock()  # the age at commit: the queue and the transaction included
        for sent in done.sent_ms:
            self.metrics.lag.observe(max(0.0, (written - sent) / 1000))
        self.metrics.barred.inc(done.revoked)
        for node in done.barred:  # a revoked node still connected (the broker has not reloaded)
            self.kick(node)
        if done.births or done.desired:
            with self.dirty_lock:
                self.dirty |= done.births | done.desired
        if done.births or done.desired or done.steps:
            self.wake.set()
        return done

    def watched_now(self) -> frozenset[str]:
        if time.monotonic() > self.watched_at:  # what running rollouts judge
            self.watched = frozenset(self.rollouts.watched())
            self.watched_at = time.monotonic() + 2.0
        return self.watched

    def one_by_one(self, messages: list[Message]) -> Ingested | None:
        """Each message in its own transaction; those refused are poison if the database
        answers (None if it does not: nothing is dropped then)."""
        done, refused = Ingested(), 0
        for msg in messages:
            try:
                one = self.registry.ingest([msg], self.watched)
            except Exception:
                refused += 1
                continue
            done.merge(one)
        try:
            self.store.ping()
        except Exception:
            return None
        if refused:
            log.error("%d message(s) the database refuses dropped as poison", refused)
        done.poison += refused
        return done

    def writer(self) -> None:
        while not self.stopping.is_set():
            batch = self.take()
            try:
                if batch:
                    self.write(batch)
            except Exception:  # a bug must not end ingestion: logged, the next batch goes on
                self.metrics.db_errors.inc()
                log.exception("the writer's batch of %d failed", len(batch))

    # ---- the runner ------------------------------------------------------------------------

    def lease(self) -> bool:
        """Takes or renews the runner lease; whether this replica holds it."""
        for_ms = int(self.config.service.lease_s * 1000)
        held = self.leases.take(RUNNER_LEASE, self.replica, self.clock(), for_ms)
        if held != self.holds_lease:
            log.info("%s the runner lease", "took" if held else "lost")
        self.holds_lease = held
        self.metrics.runner.set(1 if held else 0)
        return held

    def release(self) -> None:
        if self.holds_lease:
            self.leases.release(RUNNER_LEASE, self.replica)
            self.holds_lease = False

    def runner(self) -> None:
        cfg = self.config.service
        renew_s = cfg.lease_s / 3
        next_full = 0.0
        while not self.stopping.is_set():
            self.runner_turn(time.monotonic() >= next_full)
            if time.monotonic() >= next_full:
                next_full = time.monotonic() + cfg.reconcile_s
            self.wake.wait(min(1.0, renew_s))
            self.wake.clear()

    def runner_turn(self, full: bool) -> None:
        """Renews the lease; while it holds it, a turn of the rollouts, the A/B tests, then the
        deployments (every node on a full pass, else the nodes that changed). The lease is
        renewed before each part: a long pass does not outlive it unnoticed. A part that fails
        is logged; the next turn tries again, and the nodes it had are kept for it."""
        with self.dirty_lock:
            full = full or self.full_pass
            nodes, self.dirty, self.full_pass = self.dirty, set(), False
        try:
            if not (self.lease() and self.client.is_connected()):
                return
            self.rollouts.turn()
            if self.lease():
                self.abtests.turn()
            if self.lease() and (full or nodes):
                self.reconciler.run(None if full else nodes)
            if full:
                self.rollouts.prune()
                if time.monotonic() >= self.crl_due:  # a fresh CRL before the last one expires
                    self.write_broker_files()
                keep_ms = int(self.config.events.keep_days * 86_400_000)
                anchors_ms = int(self.config.events.checkpoint_keep_days * 86_400_000)
                self.registry.prune(self.clock(), keep_ms, anchors_ms)
        except Exception:  # the database is away: the next turn tries again
            self.metrics.db_errors.inc()
            log.exception("the runner's turn failed")
            with self.dirty_lock:
                self.dirty |= nodes
                self.full_pass = self.full_pass or full

    def write_broker_files(self, strict: bool = False) -> list[str]:
        """The CRL at ``[enrolment] crl_file`` (if set), signed now, again in a day; the ACL at
        ``acl_file`` (if set), with the names barred now. Each in its own attempt: one that
        fails (its base unreadable, a full disk, the database away) is logged and counted, the
        other is written all the same, and the next full pass tries again. Returns the keys of
        the files not written; ``strict`` (at start) raises instead."""
        cfg = self.config.enrolment
        writes: list[tuple[str, Callable[[], None]]] = []
        if cfg.crl_file is not None and self.enrolments.issuer is not None:
            crl_file = cfg.crl_file
            writes.append(("crl_file", lambda: self.enrolments.write_crl(crl_file, self.clock())))
        if cfg.acl_file is not None and cfg.acl_base is not None:
            acl_base, acl_file = cfg.acl_base, cfg.acl_file
            writes.append(("acl_file", lambda: self.enrolments.write_acl(acl_base, acl_file)))
        unwritten = []
        for key, write in writes:
            try:
                write()
            except Exception:
                if strict:
                    raise
                self.metrics.broker_files.labels(key).inc()
                log.exception("[enrolment] %s was not written; the next full pass tries again", key)
                unwritten.append(key)
        self.crl_due = time.monotonic() + (0 if unwritten else 86400)
        return unwritten

    def alerter(self) -> None:
        """Every ``[alerts] resend_s``, while this replica holds the runner lease: the alerts to
        Alertmanager (cloudsync.fleet.alerting)."""
        if not self.alerting.urls:
            return
        while not self.stopping.wait(self.config.alerts.resend_s):
            if not self.holds_lease:
                continue
            try:
                took = self.alerting.push()
                failed = len(self.alerting.urls) - took
                self.metrics.alert_pushes.labels("sent").inc(took)
                self.metrics.alert_pushes.labels("failed").inc(failed)
            except Exception:  # the database is away: the next interval tries again
                self.metrics.db_errors.inc()
                log.exception("the alerts were not sent")

    def reconcile_soon(self, nodes: set[str] | None = None) -> None:
        """An API change: ``nodes`` at the runner's next turn, or every node (None)."""
        with self.dirty_lock:
            if nodes is None:
                self.full_pass = True
            else:
                self.dirty |= nodes
        self.wake.set()

    # ---- life ------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config.mqtt
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = cfg.session_expiry_s
        properties.ReceiveMaximum = cfg.receive_maximum
        self.client.connect_async(
            cfg.host,
            cfg.port,
            keepalive=30,
            clean_start=cfg.session_expiry_s == 0,
            properties=properties,
        )
        self.client.loop_start()
        for target in (self.writer, self.runner, self.alerter):
            thread = threading.Thread(target=target, name=target.__name__, daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        for thread in self.threads:
            thread.join(10)
        try:
            self.release()
        except Exception:  # stopping; the lease expires anyway
            log.warning("the runner lease was not released", exc_info=True)
        self.client.disconnect()
        self.client.loop_stop()
        self.store.close()
        if self.event_log is not None:
            self.event_log.close()

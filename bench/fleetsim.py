#!/usr/bin/env python3
"""fleetsim: a fleet of simulated nodes that speak the real fleet protocol (docs/PROTOCOL.md), for
the fleet service (issue 24) and its tests.

Each node is one MQTT 5 connection of its own (client id ``{fleet}.{node}`` as cloudsync's,
``clean_start`` false with a session expiry, keep-alive 30 s, the largest packet cloudsync
takes), so its last will is real: the retained offline status cloudsync sets. On every connect
it subscribes to its ``cmd/+`` and ``desired/models``, publishes a retained birth shaped as
``cloudsync.agent.session.Agent.capabilities()`` (plus ``labels``), a heartbeat at once and then
every ``heartbeat_s`` (random phase) shaped as ``cloudsync.agent.heartbeat.Heartbeat.body()``, and
every ``telemetry_s`` a telemetry record per model version as ``cloudsync.protocol.telemetry``
makes them. Records (telemetry, events, command results) carry the outbox's ``epoch``,
``priority`` and per-stream ``seq``; they wait in memory while the node is offline.

A retained desired state is applied as cloudsync's delivery applies it: the manifest is checked
(``parse_signed``; with ``trust`` its Ed25519 signatures are verified too), the version floor,
the targets, the URLs, then the steps are reported as delivery events (``accepted``,
``downloaded``, ``active``; ``failed`` for an install of the bad version, ``refused``,
``superseded``) after ``install_delay_s``. Commands: ``ping``, ``rollback`` (``{"model",
"from"}``: the version before serves again, a ``rolled-back`` event), ``versions``, ``status``,
``cloud-ab`` (a split of a model's cloud calls, checked as edged checks it: while a test runs
the node's telemetry carries its calls per arm and the good ones, ``cloud_ab``, drawn at
``ab_good`` per cloud version);
the rest answer as cloudsync does (unknown: its error; known but not simulated: an error that
says so). With ``trust`` commands are verified (``cloudsync.protocol.commands.Verifier``) and a
refused one is reported as cloudsync reports it.

Every install (node, model, version, time, ok) is one JSON line in ``installs``. Knobs for churn
(nodes dropping abruptly, so that the will fires, and back after ``away_s`` with a new birth),
nodes that start offline, and a bad version (installs of it fail at ``bad_fail_rate``; nodes
running it report that failure rate and ``bad_latency_ms`` more latency in their telemetry).

Many nodes, few CPUs: each worker process drives its nodes' paho clients from one thread with a
selector (paho's external event loop: ``socket()``, ``want_write()``, ``loop_read()``,
``loop_write()``, ``loop_misc()``) and a timer heap; nodes are sharded over ``procs`` worker
processes (node i in worker i % procs).

    .venv/bin/python bench/fleetsim.py --nodes 10000 --port 8883 --pki /path/to/pki \\
        --cert-name operator --heartbeat-s 10 --duration 60

Every node connects with the one certificate ``--cert-name`` (the operator's, whose CN may write
every node's topics: the broker's ACL gives a node's CN its own subtree only), or without TLS
(``--no-tls``) to a plain listener. At the end one JSON line of figures goes to stdout; with
``--report-s`` a line of figures so far goes to stderr that often.

Measured on this project's 2-CPU machine against a Mosquitto 2.0.11 started as
tests/mosquitto.py starts it (TLS 1.3, client certificates, ACLs, persistence): 10,000 nodes,
heartbeat 10 s, telemetry 60 s, four workers: every node connected 19.6 s after the start (the
simulator at one CPU meanwhile: TLS handshakes); then 25% of one CPU for ~1,000 heartbeats and
~170 telemetry records a second, 530 MB resident (~53 KB a node); Mosquitto 7% of a CPU, 290 MB.

From Python (tests)::

    sim = Simulator(SimConfig(nodes=30, port=broker.port, pki=pki, heartbeat_s=1)).start()
    sim.wait_connected(timeout=30)
    sim.set_online(["sim-00003"], False)  # dropped: its will fires
    sim.installs()  # [{"node", "model", "version", "ts", "ok", "previous"}, ...]
    sim.stop()  # the figures
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import logging
import math
import os
import random
import resource
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402
from prometheus_client.utils import floatToGoString as le_text  # noqa: E402

from cloudsync.agent.download import DeliveryError, check_url  # noqa: E402
from cloudsync.protocol.commands import COMMANDS, Refused, Verifier  # noqa: E402
from cloudsync.protocol.envelope import (  # noqa: E402
    MAX_BYTES,
    Envelope,
    EnvelopeError,
    decode,
    new_id,
    now_ms,
    printable,
)
from cloudsync.protocol.manifest import Manifest, ManifestError, parse_signed, verify  # noqa: E402
from cloudsync.protocol.mqtt import tls_context  # noqa: E402
from cloudsync.protocol.topics import TopicError, Topics, parse  # noqa: E402
from edged.common.backoff import backoff_delay  # noqa: E402
from edged.common.stats import LATENCY_BUCKETS  # noqa: E402

log = logging.getLogger("fleetsim")

# cloudsync's own figures (cloudsync.agent.session, .delivery, .outbox; edged.admin), copied
# rather than imported: importing the agent costs each worker ~100 MB
MAX_PACKET = MAX_BYTES + 4096  # session.MAX_PACKET: what a node takes (CONNECT's Maximum Packet)
CONNACK_S = 10.0  # session.CONNACK_S: a connection with no CONNACK by then is tried again
RECONNECT_MIN_S, RECONNECT_MAX_S = 1.0, 64.0  # [mqtt] reconnect_min_s, reconnect_max_s
MAX_DESIRED = 256  # delivery.MAX_DESIRED: models in one desired state
PRIORITIES = {"alert": 0, "event": 1, "telemetry": 2}  # outbox.PRIORITIES
OUTBOX_COUNTERS = ("put", "duplicate", "acked", "dropped_budget", "dropped_ttl", "dead")
BUDGET_BYTES = 256 << 20  # [outbox] budget_mb's default
KEEP_VERSIONS = 3  # edged keeps three versions of a model on disk
HISTORY = 10  # edged.admin.versions.HISTORY: activations remembered per model
RESULT = "result/"  # session.RESULT: an outbox kind, a command's result

MAX_WAITING = 1000  # records a node keeps while offline (then the oldest telemetry goes)
CONNECT_SLICE_S = 0.05  # at most this long connecting (blocking TLS handshakes) per turn
TIMER_BATCH = 2000  # timers run per turn before the sockets are served again

# node states
OFF, QUEUED, CONNECTING, ONLINE, AWAY, BACKOFF, CLOSING = (
    "off",
    "queued",
    "connecting",
    "online",
    "away",
    "backoff",
    "closing",
)
# timer kinds
HEARTBEAT, TELEMETRY, CONNECT, CONNACK, INSTALL, CHURN, MISC = range(7)


@dataclass
class SimConfig:
    """Every knob of the simulator (the command line's flags, same names)."""

    nodes: int = 100
    fleet: str = "f1"
    prefix: str = "sim"  # node names: {prefix}-{i:05d}
    host: str = "127.0.0.1"
    port: int = 8883
    pki: Path | None = None  # ca.pem and {cert_name}.pem/.key
    cert_name: str = "operator"
    tls: bool = True
    heartbeat_s: float = 10.0
    telemetry_s: float = 60.0  # 0: no telemetry
    labels: dict[str, list[str]] = field(default_factory=dict)  # values: round robin by index
    models: dict[str, int] = field(default_factory=lambda: {"intent-classifier": 1})
    machine: str = "aarch64"
    offline_start: float = 0.0  # share of nodes that come online only after away_s
    churn: float = 0.0  # share of the nodes dropped per minute (abruptly: the will fires)
    away_s: float = 60.0
    bad_version: str | None = None  # "7" (any model) or "intent-classifier=7"
    bad_fail_rate: float = 0.5
    bad_latency_ms: float = 0.0
    install_delay_s: float = 1.0
    rps: float = 1.0  # calls per second per model and node (telemetry)
    # an A/B test's calls: the share that are good, per cloud version called (others 0.95)
    ab_good: dict[str, float] = field(default_factory=dict)
    fail_rate: float = 0.005  # the share of calls that fail on a good version
    latency_ms: float = 20.0  # a good version's median
    cpu_percent: tuple[float, float] = (5.0, 40.0)  # the heartbeat's load: drawn in this range
    procs: int = 0  # worker processes (0: one per 2,500 nodes, at most 8)
    duration: float = 0.0  # the command line: seconds (0: until SIGTERM or SIGINT)
    installs: Path | None = None  # JSON lines, one per install
    trust: Path | None = None  # a PEM Ed25519 public key (kid: the file's stem): verify
    session_expiry_s: int = 7 * 24 * 3600
    keepalive_s: int = 30
    max_connecting: int = 100  # connections per worker waiting for their CONNACK
    seed: int = 0
    report_s: float = 0.0  # the command line: a line of figures on stderr this often

    def workers(self) -> int:
        if self.procs > 0:
            return min(self.procs, max(1, self.nodes))
        return max(1, min(8, math.ceil(self.nodes / 2500)))

    def name(self, index: int) -> str:
        return f"{self.prefix}-{index:05d}"

    def labels_of(self, index: int) -> dict[str, str]:
        return {k: v[index % len(v)] for k, v in self.labels.items() if v}

    def bad(self) -> tuple[str | None, int | None]:
        """(model or None for any, version) of the bad version."""
        if not self.bad_version:
            return None, None
        model, _, version = self.bad_version.rpartition("=")
        return model or None, int(version)


def parse_labels(text: str) -> dict[str, list[str]]:
    """'site=a|b,tier=x' -> {"site": ["a", "b"], "tier": ["x"]}."""
    labels: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, values = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label '{part}': key=value|value...")
        labels[key.strip()] = [v.strip() for v in values.split("|")]
    return labels


def pairs(text: str) -> list[tuple[str, str]]:
    """'a=1,b=2' -> [("a", "1"), ("b", "2")]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"'{part}': name=value")
        out.append((name.strip(), value.strip()))
    return out


def parse_models(text: str) -> dict[str, int]:
    """'intent-classifier=1,ocr=3' -> {"intent-classifier": 1, "ocr": 3}."""
    return {name: int(version) for name, version in pairs(text)}


# ---- one node ------------------------------------------------------------------------------


class ModelRun:
    """One model on a node's edged: what serves, what it served and since when."""

    __slots__ = ("active", "history", "name", "on_disk", "served", "since", "total")

    def __init__(self, name: str, version: int, now: float) -> None:
        self.name = name
        self.active = version
        self.history = [version]
        self.on_disk = [version]
        self.since = now  # monotonic: when the serving time below was last counted
        self.served: dict[int, float] = {}  # version -> seconds served since the last record
        self.total = 0  # calls since edged started (the heartbeat's routing)

    def count(self, now: float) -> None:
        self.served[self.active] = self.served.get(self.active, 0.0) + now - self.since
        self.since = now

    def activate(self, version: int, now: float) -> int:
        """``version`` serves (edged's activate): the version before."""
        self.count(now)
        before, self.active = self.active, version
        self.history = [*(v for v in self.history if v != version), version][-HISTORY:]
        if version not in self.on_disk:
            self.on_disk = sorted([*self.on_disk, version])
        return before

    def prune(self) -> list[int]:
        """edged keeps three versions on disk, the two last activated among them."""
        keep = {*self.history[-2:], self.active}
        extra = len(self.on_disk) - KEEP_VERSIONS
        removed = [v for v in self.on_disk if v not in keep][: max(0, extra)]
        self.on_disk = [v for v in self.on_disk if v not in removed]
        return removed

    def versions(self) -> dict[str, Any]:
        """edged's GET /v1/admin/models/{m}."""
        return {
            "model": self.name,
            "active": self.active,
            "history": list(self.history),
            "on_disk": list(self.on_disk),
            "serving": [self.active],
        }


class Node:
    __slots__ = (
        "attempt",
        "busy",
        "client",
        "closing_mid",
        "connected_once",
        "counters",
        "current",
        "delivery",
        "edged_epoch",
        "epoch",
        "gen",
        "index",
        "install_token",
        "installing",
        "labels",
        "last_telemetry",
        "models",
        "name",
        "pending",
        "position",
        "seq",
        "splits",
        "started",
        "state",
        "streams",
        "topics",
        "waiting",
        "will",
        "writing",
    )

    def __init__(self, index: int, config: SimConfig, now: float) -> None:
        self.index = index
        self.name = config.name(index)
        self.topics = Topics(config.fleet, self.name)
        self.labels = config.labels_of(index)
        self.models = {m: ModelRun(m, v, now) for m, v in config.models.items()}
        self.splits: dict[str, tuple[str, float]] = {}  # model: (arm b, b's share) (cloud-ab)
        self.client: mqtt.Client | None = None
        self.state = OFF
        self.gen = 0  # changes whenever the connection's timers must be forgotten
        self.attempt = 0
        self.seq = now_ms() + 1  # statuses and heartbeats: increasing for the sender (session)
        self.epoch = new_id()[:16]  # the outbox's epoch
        self.edged_epoch = new_id()[:16]
        self.streams: dict[str, int] = {}  # the outbox's streams: their last seq
        self.counters = dict.fromkeys(OUTBOX_COUNTERS, 0)
        self.waiting: deque[tuple[int, str, bytes]] = deque()  # (priority, topic, payload)
        self.will = self.envelope({"state": "offline", "reason": "connection lost"})
        self.started = now
        self.connected_once = False
        self.writing = False  # registered for EVENT_WRITE
        self.closing_mid = -1
        self.last_telemetry: float | None = None  # time.time() of the last telemetry record
        # delivery: the stored state per model ({"floor", "failed"}) and the desired state
        self.delivery: dict[str, dict[str, int]] = {}
        self.pending: list[Any] | None = None
        self.current: list[Any] = []
        self.position = 0
        self.busy = False
        self.installing: Manifest | None = None
        self.install_token = 0

    def envelope(self, body: dict[str, Any]) -> bytes:
        """A status or a heartbeat: seq increases for the sender, ts is now."""
        self.seq += 1
        return Envelope(self.name, self.seq, body).encode()

    def record(self, kind: str, body: dict[str, Any], priority: str) -> tuple[str, bytes]:
        """A record as the outbox numbers it: (topic, payload); kind is telemetry, events or
        result/{id}."""
        stream = f"{kind.partition('/')[0]}/{priority}"
        seq = self.streams[stream] = self.streams.get(stream, 0) + 1
        self.counters["put"] += 1
        extra = {"epoch": self.epoch, "priority": priority}
        payload = Envelope(self.name, seq, body, extra=extra).encode()
        if kind.startswith(RESULT):
            return self.topics.cmd_result(kind[len(RESULT) :]), payload
        return (self.topics.events if kind == "events" else self.topics.telemetry), payload


# ---- a worker process: its nodes, one thread ----------------------------------------------


class Worker:
    def __init__(self, config: SimConfig, number: int, conn: Connection | None) -> None:
        self.config = config
        self.number = number
        self.conn = conn
        self.rng = random.Random(f"{config.seed}:{number}")
        self.selector = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, int, int, int]] = []  # when, tie, kind, node, gen
        self.tie = itertools.count()
        self.queue: deque[Node] = deque()  # to connect, in order
        self.connecting = 0
        self.stopping = False
        self.started = time.monotonic()
        self.all_connected_at: float | None = None  # time.time() when every node had connected
        self.churn_credit = 0.0
        self.connected_at_stop = 0
        self.parent = os.getppid()
        now = time.monotonic()
        self.nodes = [Node(i, config, now) for i in range(number, config.nodes, config.workers())]
        self.by_name = {n.name: n for n in self.nodes}
        self.ever = 0
        self.stats = dict.fromkeys(
            (
                "connects",
                "connect_errors",
                "refused",
                "connack_timeouts",
                "disconnects",
                "births",
                "heartbeats",
                "telemetry",
                "events",
                "results",
                "installs",
                "install_failures",
                "rollbacks",
                "churned",
                "desired",
                "errors",
            ),
            0,
        )
        self.context: ssl.SSLContext | None = None
        if config.tls:
            if config.pki is None:
                raise ValueError("TLS needs pki (a directory with ca.pem and the certificate)")
            pki, stem = Path(config.pki), config.cert_name
            self.context = tls_context(pki / "ca.pem", pki / f"{stem}.pem", pki / f"{stem}.key")
        self.anchors: dict[str, Ed25519PublicKey] | None = None
        self.verifier: Verifier | None = None
        if config.trust is not None:
            key = serialization.load_pem_public_key(Path(config.trust).read_bytes())
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"{config.trust}: not an Ed25519 public key")
            self.anchors = {Path(config.trust).stem: key}
            # one verifier for the worker's nodes (each check names the node: ``target``);
            # the nonces in memory, for the simulator's lifetime
            self.verifier = Verifier("", self.anchors, Path(":memory:"))
        self.installs = -1
        if config.installs is not None:
            self.installs = os.open(config.installs, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.bad_model, self.bad_version = config.bad()

    # ---- timers and the loop ---------------------------------------------------------------

    def at(self, when: float, kind: int, node: Node | None = None, gen: int = 0) -> None:
        index = -1 if node is None else node.index
        heapq.heappush(self.timers, (when, next(self.tie), kind, index, gen))

    def node_at(self, index: int) -> Node:
        return self.nodes[index // self.config.workers()]

    def run(self) -> None:
        now = time.monotonic()
        if self.conn is not None:
            self.selector.register(self.conn.fileno(), selectors.EVENT_READ, None)
        for node in self.nodes:
            if self.rng.random() < self.config.offline_start:
                node.state = AWAY
                self.at(now + self.config.away_s, CONNECT, node, node.gen)
            else:
                node.state = QUEUED
                self.queue.append(node)
        if self.config.churn > 0:
            self.at(now + 1.0, CHURN)
        checked = now
        while not self.stopping:
            now = time.monotonic()
            ran = 0
            while self.timers and self.timers[0][0] <= now and ran < TIMER_BATCH:
                due, _, kind, index, gen = heapq.heappop(self.timers)
                self.guarded(self.fire, kind, index, gen, due, now)
                ran += 1
            self.connect_some()
            timeout = 0.5
            if self.timers:
                timeout = min(timeout, max(0.0, self.timers[0][0] - time.monotonic()))
            if ran >= TIMER_BATCH or (self.queue and self.connecting < self.config.max_connecting):
                timeout = 0.0
            self.serve(timeout)
            if now - checked > 1.0:
                checked = now
                if os.getppid() != self.parent:  # the simulator went: so do its workers
                    self.stopping = True
        self.shutdown()

    def serve(self, timeout: float) -> None:
        for key, mask in self.selector.select(timeout):
            node = key.data
            if node is None:
                self.guarded(self.control)
                continue
            client = node.client
            if mask & selectors.EVENT_READ:
                self.guarded(self.readable, node)
            if mask & selectors.EVENT_WRITE and client is not None and client.socket() is not None:
                self.guarded(self.flush, node)

    def guarded(self, call: Any, *args: Any) -> None:
        """A bug in one node's handling is logged and counted; the others go on."""
        try:
            call(*args)
        except Exception:
            self.stats["errors"] += 1
            log.exception("worker %d: %s failed", self.number, getattr(call, "__name__", call))

    def fire(self, kind: int, index: int, gen: int, due: float, now: float) -> None:
        if kind == CHURN:
            self.churn(now)
            return
        node = self.node_at(index)
        if kind == HEARTBEAT:
            if node.state == ONLINE and node.gen == gen and node.client is not None:
                node.client.loop_misc()  # paho's keep-alive (nothing to do while heartbeating)
                self.heartbeat(node)
                interval = self.config.heartbeat_s
                # at a fixed rate, unless it fell behind (as cloudsync)
                self.at(max(due + interval, now + interval / 2), HEARTBEAT, node, gen)
        elif kind == MISC:
            if node.state == ONLINE and node.gen == gen and node.client is not None:
                node.client.loop_misc()  # paho's keep-alive
                self.flush(node)
                self.at(now + self.config.keepalive_s / 3, MISC, node, gen)
        elif kind == TELEMETRY:
            self.telemetry(node, now)
            interval = self.config.telemetry_s
            self.at(max(due + interval, now + interval / 2), TELEMETRY, node)
        elif kind == CONNECT:
            if node.gen == gen and node.state in (AWAY, BACKOFF):
                node.state = QUEUED
                self.queue.append(node)
        elif kind == CONNACK:
            if node.gen == gen and node.state == CONNECTING:
                self.stats["connack_timeouts"] += 1
                self.drop(node)  # its on_disconnect tries again
                if node.state == CONNECTING:
                    self.retry(node)
        elif kind == INSTALL and node.install_token == gen:
            self.installed(node, now)

    def connect_some(self) -> None:
        """Connections from the queue: paho dials and shakes hands blocking, so a slice of
        time per turn, and no more waiting for their CONNACK than ``max_connecting``."""
        deadline = time.monotonic() + CONNECT_SLICE_S
        while self.queue and self.connecting < self.config.max_connecting:
            node = self.queue.popleft()
            if node.state == QUEUED:
                self.guarded(self.connect, node)
            if time.monotonic() > deadline:
                return

    # ---- the connection --------------------------------------------------------------------

    def client(self, node: Node) -> mqtt.Client:
        config = self.config
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"{config.fleet}.{node.name}",
            protocol=mqtt.MQTTv5,
            userdata=node,
            reconnect_on_failure=False,
        )
        if self.context is not None:
            client.tls_set_context(self.context)
        client.will_set(node.topics.status, node.will, qos=1, retain=True)
        client.on_connect = self.on_connect
        client.on_disconnect = self.on_disconnect
        client.on_publish = self.on_publish
        client.on_message = self.on_message
        client.on_socket_open = self.on_socket_open
        client.on_socket_close = self.on_socket_close
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = config.session_expiry_s
        properties.MaximumPacketSize = MAX_PACKET
        client.connect_async(
            config.host, config.port, config.keepalive_s, clean_start=False, properties=properties
        )
        return client

    def connect(self, node: Node) -> None:
        if node.client is None:
            node.client = self.client(node)
        node.state = CONNECTING
        node.gen += 1
        self.connecting += 1
        try:
            node.client.reconnect()  # a socket, the TLS handshake (blocking), CONNECT
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self.stats["connect_errors"] += 1
            log.debug("%s: cannot connect: %s", node.name, exc)
            self.retry(node)
            return
        self.at(time.monotonic() + CONNACK_S, CONNACK, node, node.gen)
        self.flush(node)

    def retry(self, node: Node) -> None:
        """Again after 1, 2, 4 ... 64 s, each between half and all of it (cloudsync's)."""
        if node.state == CONNECTING:
            self.connecting -= 1
        node.state = BACKOFF
        node.gen += 1
        node.attempt += 1
        delay = backoff_delay(node.attempt - 1, RECONNECT_MIN_S, RECONNECT_MAX_S, self.rng)
        self.at(time.monotonic() + delay, CONNECT, node, node.gen)

    def drop(self, node: Node) -> None:
        """The connection cut, no DISCONNECT (nor TLS close_notify): the broker publishes the
        will. paho reads the end and calls on_disconnect."""
        client = node.client
        sock = client.socket() if client is not None else None
        if client is None or sock is None:
            return
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # type: ignore[arg-type]
        client.loop_read()
        if client.socket() is not None:  # (paho did not see the end: closed here)
            client._sock_close()
            self.on_disconnect(client, node, None, None, None)

    def close(self, node: Node) -> None:
        """A clean stop, as cloudsync's: the retained offline status "stopped", its PUBACK, then
        DISCONNECT (no will)."""
        client = node.client
        if client is None or node.state != ONLINE:
            return
        node.state = CLOSING
        bye = node.envelope({"state": "offline", "reason": "stopped"})
        node.closing_mid = client.publish(node.topics.status, bye, qos=1, retain=True).mid
        self.flush(node)

    def on_socket_open(self, client: Any, node: Node, sock: Any) -> None:
        node.writing = False
        self.selector.register(sock, selectors.EVENT_READ, node)

    def on_socket_close(self, client: Any, node: Node, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(sock)
        node.writing = False

    def readable(self, node: Node) -> None:
        client = node.client
        assert client is not None
        client.loop_read()
        sock = client.socket()
        # TLS: what OpenSSL has decrypted already is not the selector's to see
        while sock is not None and getattr(sock, "pending", lambda: 0)():
            client.loop_read()
            sock = client.socket()
        self.flush(node)

    def flush(self, node: Node) -> None:
        """Write what paho has queued; wait for the socket only when it cannot take it all."""
        client = node.client
        if client is None or client.socket() is None:
            return
        if client.want_write():
            client.loop_write()
        sock = client.socket()
        if sock is None:
            return
        want = client.want_write()
        if want != node.writing:
            node.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.selector.modify(sock, events, node)

    def on_connect(self, client: Any, node: Node, flags: Any, rc: Any, props: Any) -> None:
        if node.state == CONNECTING:
            self.connecting -= 1
        if rc.is_failure:  # paho closes the connection next: on_disconnect tries again
            self.stats["refused"] += 1
            log.warning("%s: the broker refused the connection: %s", node.name, rc)
            node.state = CONNECTING
            self.connecting += 1
            return
        now = time.monotonic()
        node.state = ONLINE
        node.attempt = 0
        self.stats["connects"] += 1
        client.subscribe([(node.topics.commands, 1), (node.topics.desired_models, 1)])
        client.publish(node.topics.status, node.envelope(self.birth(node)), qos=1, retain=True)
        self.stats["births"] += 1
        self.heartbeat(node)  # right after the birth, as cloudsync
        interval = self.config.heartbeat_s
        # the first time at a random phase, so that the fleet's heartbeats do not come at once
        first = self.rng.uniform(0.0, interval) if not node.connected_once else interval
        self.at(now + first, HEARTBEAT, node, node.gen)
        if self.config.heartbeat_s > self.config.keepalive_s / 3:
            self.at(now + self.config.keepalive_s / 3, MISC, node, node.gen)
        for _, topic, payload in sorted(node.waiting, key=lambda w: w[0]):
            client.publish(topic, payload, qos=1)  # what waited, the most urgent first
        node.waiting.clear()
        if not node.connected_once:
            node.connected_once = True
            self.ever += 1
            if self.ever == len(self.nodes):
                self.all_connected_at = time.time()
            if self.config.telemetry_s > 0:
                node.last_telemetry = time.time()
                delay = self.rng.uniform(0.0, self.config.telemetry_s)
                self.at(now + delay, TELEMETRY, node)

    def on_disconnect(self, client: Any, node: Node, flags: Any, rc: Any, props: Any) -> None:
        if node.state == ONLINE:
            self.stats["disconnects"] += 1
        if node.state in (ONLINE, CONNECTING):
            self.retry(node)
        elif node.state == CLOSING:
            node.state = OFF
        # AWAY and OFF: whoever took it away brings it back

    def on_publish(self, client: Any, node: Node, mid: int, rc: Any, props: Any) -> None:
        if node.state == CLOSING and mid == node.closing_mid:
            client.disconnect()
        elif node.state == ONLINE and not rc.is_failure:
            node.counters["acked"] += 1

    def on_message(self, client: Any, node: Node, message: Any) -> None:
        try:
            topic = parse(message.topic)
        except TopicError:
            return
        if topic.kind == "desired-models":
            self.desired(node, message.payload)
        elif topic.kind == "cmd" and topic.cmd_id is not None:
            self.command(node, topic.cmd_id, message.payload)

    # ---- what a node says ------------------------------------------------------------------

    def send(self, node: Node, kind: str, body: dict[str, Any], priority: str) -> None:
        """A record: published when connected, else kept (bounded) until the next connect."""
        topic, payload = node.record(kind, body, priority)
        if node.state == ONLINE and node.client is not None:
            node.client.publish(topic, payload, qos=1)
            self.flush(node)
            return
        if len(node.waiting) >= MAX_WAITING:  # the disk budget: the least urgent goes first
            worst = max(node.waiting, key=lambda w: w[0])
            node.waiting.remove(worst)
            node.counters["dropped_budget"] += 1
        node.waiting.append((PRIORITIES[priority], topic, payload))

    def birth(self, node: Node) -> dict[str, Any]:
        """``Agent.capabilities()`` of a simulated node, with its labels."""
        models = [
            {"name": m.name, "version": str(m.active), "state": "READY"}
            for m in node.models.values()
        ]
        capabilities = [
            {
                "task_type": "classification",
                "models": [
                    {
                        "model": m.name,
                        "local": {"available": True, "why_not": "", "latency_ms": None, "calls": 0},
                        "cloud": None,
                    }
                    for m in node.models.values()
                ],
            }
        ]
        return {
            "state": "online",
            "software": {"cloudsync": "sim", "edged": "sim"},
            "hardware": {
                "machine": self.config.machine,
                "system": "Linux",
                "release": "sim",
                "cpus": 4,
            },
            "models": models,
            "capabilities": capabilities,
            "edged": {"reachable": True, "error": ""},
            "labels": node.labels,
        }

    def heartbeat(self, node: Node) -> None:
        """``Heartbeat.body()`` of a simulated node."""
        client = node.client
        assert client is not None
        now = time.monotonic()
        depth = dict.fromkeys(PRIORITIES, 0)
        for rank, _, _ in node.waiting:
            depth[("alert", "event", "telemetry")[rank]] += 1
        body = {
            "uptime_s": round(now - node.started, 3),
            "load": {
                "cpu_percent": round(self.rng.uniform(*self.config.cpu_percent), 1),
                "cpu_count": 4,
                "load_average": round(self.rng.uniform(0.1, 2.0), 2),
                "memory_total": 8 << 30,
                "memory_available": 5 << 30,
                "temperature_c": round(self.rng.uniform(40.0, 60.0), 1),
            },
            "link": {
                "endpoint": "https://cloud.example",
                "up": True,
                "rtt_s": 0.04,
                "rtt_p50_s": 0.04,
                "rtt_p95_s": 0.08,
                "bandwidth_bps": 1.25e6,
                "failures": 0,
                "changed": 0.0,
                "last_error": "",
            },
            "inflight": 0,
            "drained": None,
            "routing": {"local": sum(m.total for m in node.models.values())},
            "models": {m.name: str(m.active) for m in node.models.values()},
            "edged": {"reachable": True, "error": ""},
            "outbox": {
                "depth": depth,
                "pending": len(node.waiting),
                "bytes": sum(len(w[2]) for w in node.waiting),
                "budget_bytes": BUDGET_BYTES,
                "dead_letters": 0,
                "disk_full": False,
                "counters": dict(node.counters),
                "oldest_age_s": None,
            },
            "breaker": "closed",
            "cloud_error_ratio": 0.0,
            "cloud_scale_out": False,
            "poison_messages": 0,
            "thread_restarts": {},
        }
        client.publish(node.topics.heartbeat, node.envelope(body), qos=1)
        self.stats["heartbeats"] += 1
        self.flush(node)

    def is_bad(self, model: str, version: int) -> bool:
        return version == self.bad_version and self.bad_model in (None, model)

    def telemetry(self, node: Node, now: float) -> None:
        """What edged served since the last record, per model version, as
        ``cloudsync.protocol.telemetry.telemetry`` says it (nothing served: no record)."""
        rows: list[dict[str, Any]] = []
        routes: dict[str, dict[str, int]] = {}
        config = self.config
        for run in node.models.values():
            run.count(now)
            for version, seconds in sorted(run.served.items()):
                mean = config.rps * seconds
                calls = max(0, round(self.rng.gauss(mean, math.sqrt(mean)))) if mean else 0
                if not calls:
                    continue
                run.total += calls
                routes.setdefault(run.name, {"local": 0})["local"] += calls
                bad = self.is_bad(run.name, version)
                rate = config.bad_fail_rate if bad else config.fail_rate
                failed = int(calls * rate) + (self.rng.random() < calls * rate % 1)
                timeouts = failed // 3
                outcomes = {"success": calls - failed, "error": failed - timeouts}
                outcomes["timeout"] = timeouts
                outcomes = {k: v for k, v in outcomes.items() if v}
                p50 = config.latency_ms * self.rng.uniform(0.9, 1.1)
                extra = config.bad_latency_ms if bad else 0.0
                # each call's latency (log-normal around the median) into edged's buckets
                took = [
                    (p50 * self.rng.lognormvariate(0, 0.6) + extra) / 1000
                    for _ in range(min(calls, 1000))
                ]
                buckets = {le_text(le): sum(t <= le for t in took) for le in LATENCY_BUCKETS}
                buckets["+Inf"] = calls
                row: dict[str, Any] = {
                    "model": run.name,
                    "version": str(version),
                    "requests": calls,
                    "errors": failed,
                    "outcomes": outcomes,
                    "mean_ms": round(1.4 * p50 + extra, 3),
                    "p50_ms": round(p50 + extra, 3),
                    "p95_ms": round(3 * p50 + extra, 3),
                    "p99_ms": round(5 * p50 + extra, 3),
                    "buckets": buckets,
                    "seconds": round(sum(took) * calls / len(took), 6),
                }
                if calls - failed:
                    row["confidence_mean"] = round(self.rng.uniform(0.85, 0.9), 4)
                    row["confidence_n"] = calls - failed
                rows.append(row)
            run.served.clear()
        if not rows:
            return
        wall = time.time()
        interval = None if node.last_telemetry is None else round(wall - node.last_telemetry, 3)
        node.last_telemetry = wall
        metrics = {
            "interval_s": interval,
            "edged_epoch": node.edged_epoch,
            "models": rows,
            "routes": dict(sorted(routes.items())),
            "cloud": {},
            "cloud_ab": self.ab_calls(node, {r["model"]: r["requests"] for r in rows}),
        }
        self.send(node, "telemetry", {"metrics": metrics}, "telemetry")
        self.stats["telemetry"] += 1

    # ---- delivery --------------------------------------------------------------------------

    def report(
        self, node: Node, step: str, manifest: Manifest | None = None, **fields: Any
    ) -> None:
        """A delivery step as cloudsync's event (a failure as an alert)."""
        doc: dict[str, Any] = {"step": step, **fields}
        if manifest is not None:
            doc = {"model": manifest.model, "version": manifest.version, **doc}
        bad = step in ("refused", "failed", "rolled-back")
        self.send(node, "events", {"delivery": doc}, "alert" if bad else "event")
        self.stats["events"] += 1

    def desired(self, node: Node, payload: bytes) -> None:
        if not payload:  # the retained desired state deleted: nothing to do
            return
        self.stats["desired"] += 1
        try:
            body = decode(payload).body
        except EnvelopeError as exc:
            self.report(node, "refused", why=printable(f"the desired state: {exc}"))
            return
        entries = body.get("models")
        if not isinstance(entries, list):
            self.report(node, "refused", why="the desired state has no 'models' list")
            return
        if len(entries) > MAX_DESIRED:
            self.report(node, "refused", why=f"{len(entries)} models: at most {MAX_DESIRED}")
            return
        node.pending = entries  # it replaces the one waiting
        self.advance(node)

    def advance(self, node: Node) -> None:
        """The desired state's entries, one after the other (an install takes a while)."""
        while not node.busy:
            if node.pending is not None:
                node.current, node.pending, node.position = node.pending, None, 0
            if node.position >= len(node.current):
                return
            entry = node.current[node.position]
            node.position += 1
            self.apply(node, entry)

    def manifest(self, doc: Any) -> Manifest:
        if self.anchors is not None:
            return verify(doc, self.anchors)
        if not isinstance(doc, dict) or not isinstance(doc.get("signatures"), list):
            raise ManifestError('a manifest is {"signed": {...}, "signatures": [...]}')
        found = parse_signed(doc.get("signed"))
        if found.expires <= now_ms():
            raise ManifestError("expired: a manifest replayed after its time (freeze)")
        kids = tuple(str(s.get("kid")) for s in doc["signatures"] if isinstance(s, dict))
        return Manifest(
            found.model,
            found.version,
            found.files,
            found.expires,
            found.targets,
            found.smoke,
            kids,
        )

    def apply(self, node: Node, entry: Any) -> None:
        """``cloudsync.agent.delivery.Delivery.apply`` against a simulated edged."""
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("urls"), dict):
                raise ManifestError('each entry is {"manifest": {...}, "urls": {...}}')
            manifest = self.manifest(entry.get("manifest"))
        except ManifestError as exc:
            self.report(node, "refused", why=printable(str(exc)))
            return
        if manifest.for_node(self.config.fleet, node.name, self.config.machine):
            return
        state = node.delivery.setdefault(manifest.model, {})
        stored = state.get("floor", 0)
        if state.get("failed") == manifest.version:
            return  # reported when it failed; a new version is needed
        run = node.models.get(manifest.model)
        if run is None:
            why = f"edged has no model '{manifest.model}' (a new model needs its directory"
            self.report(node, "refused", manifest, why=why + " and config.pbtxt first)")
            return
        if run.active == manifest.version:
            if stored < manifest.version:
                state["floor"] = manifest.version
                self.report(node, "active", manifest)
            return
        floor = max(stored, run.active, *run.on_disk)
        if manifest.version < floor:
            why = (
                f"version {manifest.version} is below {floor}, already accepted or installed"
                " here (rollback)"
            )
            self.report(node, "refused", manifest, why=why)
            return
        urls = entry["urls"]
        try:
            missing = [f.path for f in manifest.files if not isinstance(urls.get(f.path), str)]
            if missing:
                raise DeliveryError(f"no URL for {', '.join(missing)}", retry=False)
            for file in manifest.files:
                try:
                    check_url(urls[file.path])
                except DeliveryError as exc:
                    raise DeliveryError(f"{file.path}: {exc}", retry=False) from None
        except DeliveryError as exc:
            self.report(node, "refused", manifest, why=str(exc))
            return
        if stored < manifest.version:
            state["floor"] = manifest.version
            self.report(
                node, "accepted", manifest, bytes=manifest.size, signed_by=list(manifest.kids)
            )
        node.busy = True
        node.installing = manifest
        node.install_token += 1
        delay = self.config.install_delay_s
        self.at(time.monotonic() + delay, INSTALL, node, node.install_token)

    def installed(self, node: Node, now: float) -> None:
        """The download and the install are done: active, or failed (the bad version)."""
        manifest = node.installing
        node.busy, node.installing = False, None
        assert manifest is not None
        run = node.models[manifest.model]
        size = manifest.size
        if manifest.version in run.on_disk:
            self.report(node, "downloaded", manifest, bytes=0, resumed_bytes=size)
        else:
            self.report(node, "downloaded", manifest, bytes=size, resumed_bytes=0)
        state = node.delivery.setdefault(manifest.model, {})
        if node.pending is not None:  # a newer desired state came meanwhile: it decides
            self.report(node, "superseded", manifest)
        elif state.get("failed") == manifest.version:
            pass  # rolled back by an operator meanwhile
        elif self.is_bad(manifest.model, manifest.version) and (
            self.rng.random() < self.config.bad_fail_rate
        ):
            state["failed"] = manifest.version
            why = (
                f"model '{manifest.model}' version {manifest.version}: smoke case 1: output"
                " 'probabilities' differs from the expected beyond atol (simulated)"
            )
            self.report(node, "failed", manifest, stage="install", why=why)
            self.stats["install_failures"] += 1
            self.log_install(node, manifest, False, run.active)
        else:
            previous = run.activate(manifest.version, now)
            removed = run.prune()
            seconds = round(self.config.install_delay_s, 3)
            self.report(
                node, "active", manifest, previous=previous, removed=removed, seconds=seconds
            )
            self.stats["installs"] += 1
            self.log_install(node, manifest, True, previous)
        self.advance(node)

    def log_install(self, node: Node, manifest: Manifest, ok: bool, previous: int) -> None:
        if self.installs < 0:
            return
        line = {
            "node": node.name,
            "model": manifest.model,
            "version": manifest.version,
            "ts": now_ms(),
            "ok": ok,
            "previous": previous,
        }
        os.write(self.installs, (json.dumps(line, sort_keys=True) + "\n").encode())

    # ---- commands --------------------------------------------------------------------------

    def ab_calls(self, node: Node, calls: dict[str, int]) -> dict[str, Any]:
        """Each model under an A/B test (0 < b's share < 1): its calls this interval split
        between the arms, each good at the arm's ``ab_good``."""
        out: dict[str, Any] = {}
        for model, (b_name, share) in sorted(node.splits.items()):
            if not 0 < share < 1 or not calls.get(model):
                continue
            arms: dict[str, dict[str, int]] = {}
            for _ in range(calls[model]):
                arm = b_name if self.rng.random() < share else model
                row = arms.setdefault(arm, {"calls": 0, "good": 0})
                row["calls"] += 1
                row["good"] += self.rng.random() < self.config.ab_good.get(arm, 0.95)
            out[model] = arms
        return out

    def cloud_ab(self, node: Node, args: dict[str, Any]) -> dict[str, Any]:
        """edged's PUT /v1/admin/cloud/{model}/ab, as its admin checks it."""
        model, b_name, share = args.get("model"), args.get("b_cloud_name"), args.get("b_share", 0)
        if model not in node.models:
            raise RuntimeError(f"edged: 404: no model '{model}'")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise RuntimeError("edged: 400: 'b_share' must be a share of calls, 0 to 1")
        if share and not isinstance(b_name, str):
            raise RuntimeError("edged: 400: 'b_cloud_name' must name the cloud model of arm b")
        if args.get("decided_by", "edged") not in ("edged", "fleet"):
            raise RuntimeError("edged: 400: 'decided_by' must be 'edged' or 'fleet'")
        if share:
            node.splits[str(model)] = (str(b_name), float(share))
        else:
            node.splits.pop(str(model), None)
        ab = {"b_cloud_name": b_name, "b_share": float(share)} if share else None
        return {"model": model, "ab": ab}

    def command(self, node: Node, cmd_id: str, payload: bytes) -> None:
        if self.verifier is not None:
            self.verifier.target = f"{self.config.fleet}/{node.name}"
            try:
                checked = self.verifier.check(cmd_id, payload)
            except Refused as exc:
                self.refuse(node, cmd_id, printable(str(exc)))
                return
            name, args, issuer = checked.name, checked.args, checked.issuer
        else:
            try:
                env = decode(payload)
            except EnvelopeError as exc:
                self.refuse(node, cmd_id, printable(f"not a command envelope: {exc}"))
                return
            body = env.body
            if not isinstance(body.get("name"), str) or not isinstance(body.get("args", {}), dict):
                why = "a command needs 'name' (a string) and 'args' (an object)"
                self.refuse(node, cmd_id, why)
                return
            name, args, issuer = str(body["name"]), dict(body.get("args", {})), env.node
        try:
            result: dict[str, Any] = {
                "ok": True,
                "result": self.run_command(node, cmd_id, name, args, issuer),
            }
        except Exception as exc:  # a command that fails says so
            result = {"ok": False, "error": printable(str(exc))}
        self.send(node, f"{RESULT}{cmd_id}", {"name": name, **result}, "event")
        self.stats["results"] += 1

    def refuse(self, node: Node, cmd_id: str, why: str) -> None:
        self.send(node, f"{RESULT}{cmd_id}", {"ok": False, "error": f"refused: {why}"}, "event")
        alert = {"alert": "command refused", "command": cmd_id, "why": why}
        self.send(node, "events", alert, "alert")
        self.stats["results"] += 1

    def run_command(
        self, node: Node, cmd_id: str, name: str, args: dict[str, Any], issuer: str
    ) -> Any:
        if name == "ping":
            return {"pong": True, "node": node.name, "ts": now_ms()}
        if name == "rollback":
            return self.rollback(node, cmd_id, args, issuer)
        if name == "versions":
            return self.model(node, args).versions()
        if name == "cloud-ab":
            return self.cloud_ab(node, args)
        if name == "status":
            return {
                "node": node.name,
                "fleet": self.config.fleet,
                "broker": f"{self.config.host}:{self.config.port}",
                "connected": node.state == ONLINE,
                "heartbeats": self.stats["heartbeats"],
                "inflight": 0,
                "poison_messages": 0,
                "thread_restarts": {},
                "edged": {"reachable": True, "error": ""},
            }
        if name in {c.strip() for c in COMMANDS.split(",")}:
            raise RuntimeError(f"edged: 501: '{name}' is not simulated by fleetsim")
        raise ValueError(f"unknown command '{name}' ({COMMANDS})")

    def model(self, node: Node, args: dict[str, Any]) -> ModelRun:
        model = args.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("'model' must be given (text)")
        run = node.models.get(model)
        if run is None:
            raise RuntimeError(f"edged: 404: no model '{model}'")
        return run

    def rollback(self, node: Node, cmd_id: str, args: dict[str, Any], issuer: str) -> Any:
        """``Handlers.rollback``: the version before serves again (with ``from``: only when
        that version is the active one); the delivery will not install it again."""
        run = self.model(node, args)
        wrong, active = args.get("from"), run.active
        if wrong is not None and active != wrong:
            return {"rolled_back": False, "active": active, "why": f"{wrong} is not active"}
        earlier = [v for v in run.history if v != active and v in run.on_disk]
        if not earlier:
            raise RuntimeError(
                f"edged: 404: model '{run.name}' has no earlier version on disk to roll back to"
            )
        previous = run.activate(earlier[-1], time.monotonic())
        node.delivery.setdefault(run.name, {})["failed"] = active
        self.report(
            node, "rolled-back", model=run.name, version=active, why=f"command {cmd_id} by {issuer}"
        )
        self.stats["rollbacks"] += 1
        return {"rolled_back": True, **run.versions(), "previous": previous}

    # ---- churn and control -----------------------------------------------------------------

    def churn(self, now: float) -> None:
        self.churn_credit += self.config.churn / 60 * len(self.nodes)
        count = int(self.churn_credit)
        self.churn_credit -= count
        online = [n for n in self.nodes if n.state == ONLINE] if count else []
        for node in self.rng.sample(online, min(count, len(online))):
            self.away(node, now + self.config.away_s)
            self.stats["churned"] += 1
        self.at(now + 1.0, CHURN)

    def away(self, node: Node, back: float | None) -> None:
        """Dropped abruptly (the will fires); back at ``back`` (None: when told)."""
        state = node.state
        node.state = AWAY if back is not None else OFF
        node.gen += 1
        if state == CONNECTING:
            self.connecting -= 1
        if state in (ONLINE, CONNECTING, CLOSING):
            self.drop(node)
        if back is not None:
            self.at(back, CONNECT, node, node.gen)

    def set_online(self, names: list[str], online: bool, how: str) -> int:
        done = 0
        for name in names:
            node = self.by_name.get(name)
            if node is None:
                continue
            done += 1
            if online:
                if node.state in (OFF, AWAY, BACKOFF):
                    node.gen += 1
                    node.state = QUEUED
                    self.queue.append(node)
            elif how == "stopped" and node.state == ONLINE:
                self.close(node)
            else:
                self.away(node, None)
        return done

    def figures(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            **self.stats,
            "nodes": len(self.nodes),
            "connected": sum(n.state == ONLINE for n in self.nodes),
            "connected_at_stop": self.connected_at_stop,
            "ever_connected": self.ever,
            "all_connected_at": self.all_connected_at,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            **memory(),
        }

    def control(self) -> None:
        assert self.conn is not None
        while self.conn.poll():
            try:
                message = self.conn.recv()
            except EOFError:
                self.stopping = True
                return
            op = message[0]
            if op == "stop":
                self.stopping = True
                return  # answered once stopped
            if op == "online":
                self.conn.send(self.set_online(message[1], message[2], message[3]))
            elif op == "stats":
                self.conn.send(self.figures())

    def shutdown(self) -> None:
        """Every node stops cleanly ("stopped", then DISCONNECT), within a few seconds."""
        self.connected_at_stop = sum(n.state == ONLINE for n in self.nodes)
        for node in self.nodes:
            if node.state == ONLINE:
                self.guarded(self.close, node)
        deadline = time.monotonic() + 5.0
        while any(n.state == CLOSING for n in self.nodes) and time.monotonic() < deadline:
            self.serve(0.1)
        for node in self.nodes:
            client = node.client
            if client is not None and client.socket() is not None:
                node.state = OFF
                client._sock_close()
        if self.installs >= 0:
            os.close(self.installs)
        if self.verifier is not None:
            self.verifier.close()
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(self.figures())


def memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, MB (not ru_maxrss: after fork and
    exec it starts from the parent's)."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
    return {k: round(v, 1) for k, v in found.items()}


def raise_fd_limit() -> int:
    """The soft limit on open files up to the hard one (a socket per node); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def config_doc(config: SimConfig) -> dict[str, Any]:
    """The config as builtins (what goes to a worker)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}


def config_of(doc: dict[str, Any]) -> SimConfig:
    paths = {k: Path(doc[k]) for k in ("pki", "installs", "trust") if doc.get(k) is not None}
    return SimConfig(**{**doc, **paths})


def worker_main(number: int, fd: int) -> None:
    """A worker process (this file with ``--worker N FD``): its share of the nodes, told what
    to do over the socket ``fd`` (its config first), until told to stop (or SIGTERM)."""
    conn = Connection(fd)
    config = config_of(conn.recv())
    logging.basicConfig(
        level=logging.WARNING, format=f"fleetsim[{number}] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    limit = raise_fd_limit()
    worker = Worker(config, number, conn)
    if limit < len(worker.nodes) + 64:
        log.warning("%d nodes, and open files are limited to %d", len(worker.nodes), limit)

    def stop(signum: int, frame: Any) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    worker.run()


# ---- the simulator: its worker processes ----------------------------------------------------


class Simulator:
    """N simulated nodes in ``config.workers()`` processes; ``start``, ``stop``, and meanwhile
    ``stats``, ``set_online``, ``installs``."""

    def __init__(self, config: SimConfig | None = None, **knobs: Any) -> None:
        self.config = config or SimConfig(**knobs)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if self.config.installs is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fleetsim-")
            self.config.installs = Path(self._tmp.name) / "installs.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.lock = threading.Lock()
        self.started = 0.0
        self.started_wall = 0.0
        self.final: dict[str, Any] | None = None

    @property
    def names(self) -> list[str]:
        return [self.config.name(i) for i in range(self.config.nodes)]

    def start(self) -> Simulator:
        config = self.config
        assert config.installs is not None
        Path(config.installs).write_bytes(b"")
        raise_fd_limit()
        self.started, self.started_wall = time.monotonic(), time.time()
        # each worker a new interpreter running this file (no fork of a process with threads,
        # nothing of the caller's __main__ run again), told what to do over a socket pair
        for number in range(config.workers()):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    str(number),
                    str(theirs.fileno()),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(config_doc(config))
            self.procs.append(proc)
            self.conns.append(conn)
        return self

    def _ask(self, number: int, message: tuple[Any, ...], timeout: float = 30.0) -> Any:
        conn = self.conns[number]
        conn.send(message)
        if not conn.poll(timeout):
            raise TimeoutError(f"worker {number} did not answer {message[0]} in {timeout} s")
        return conn.recv()

    def stats(self) -> dict[str, Any]:
        """The figures so far, summed over the workers."""
        with self.lock:
            if self.final is not None:
                return self.final
            return self._sum([self._ask(n, ("stats",)) for n in range(len(self.conns))])

    def _sum(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for part in parts:
            for key, value in part.items():
                if isinstance(value, (int, float)) and key != "all_connected_at":
                    total[key] = round(total.get(key, 0) + value, 3)
        # since the simulator started: when the last node had connected (once)
        ends = [p.get("all_connected_at") for p in parts]
        done = [e for e in ends if e is not None]
        whole = done and len(done) == len(ends)
        total["all_connected_s"] = round(max(done) - self.started_wall, 3) if whole else None
        usage = resource.getrusage(resource.RUSAGE_SELF)
        total["cpu_s"] = round(total.get("cpu_s", 0) + usage.ru_utime + usage.ru_stime, 3)
        wall = time.monotonic() - self.started
        total["wall_s"] = round(wall, 3)
        total["cpu_percent"] = round(100 * total["cpu_s"] / wall, 1) if wall else 0.0
        total["procs"] = len(parts)
        return total

    def wait_connected(self, count: int | None = None, timeout: float = 60.0) -> bool:
        """Until ``count`` nodes (all by default) are connected at once."""
        want = self.config.nodes if count is None else count
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stats()["connected"] >= want:
                return True
            time.sleep(0.1)
        return False

    def set_online(self, names: Iterable[str], online: bool = True, how: str = "lost") -> int:
        """Take nodes offline (``how``: "lost", the connection cut so that the will fires, or
        "stopped", a clean stop) until told otherwise, or bring them back (a new birth); how
        many of ``names`` are nodes of this simulator."""
        if how not in ("lost", "stopped"):
            raise ValueError("how: lost or stopped")
        shards: dict[int, list[str]] = {}
        workers = self.config.workers()
        for name in names:
            prefix, _, number = name.rpartition("-")
            if prefix == self.config.prefix and number.isdigit():  # else not one of ours
                shards.setdefault(int(number) % workers, []).append(name)
        with self.lock:
            return sum(self._ask(n, ("online", part, online, how)) for n, part in shards.items())

    def installs(self) -> list[dict[str, Any]]:
        """Every install so far: {"node", "model", "version", "ts", "ok", "previous"}."""
        assert self.config.installs is not None
        text = Path(self.config.installs).read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Every node stops cleanly; the workers exit; the final figures."""
        with self.lock:
            if self.final is not None:
                return self.final
            parts = []
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
            for number, conn in enumerate(self.conns):
                try:
                    if conn.poll(timeout):
                        parts.append(conn.recv())
                except (EOFError, OSError):
                    log.warning("worker %d ended without its figures", number)
            for proc in self.procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(5)
            for conn in self.conns:
                conn.close()
            self.final = self._sum(parts)
            return self.final

    def __enter__(self) -> Simulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """``stop``, and the installs log goes when it was a temporary file of its own."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


# ---- the command line -----------------------------------------------------------------------


def options(argv: list[str] | None = None) -> SimConfig:
    d = SimConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--fleet", default=d.fleet)
    p.add_argument("--prefix", default=d.prefix, help="node names: {prefix}-{i:05d}")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--pki", type=Path, help="ca.pem and {cert-name}.pem/.key")
    p.add_argument("--cert-name", default=d.cert_name, help="the certificate every node uses")
    p.add_argument("--no-tls", action="store_true", help="a plain TCP listener")
    p.add_argument("--heartbeat-s", type=float, default=d.heartbeat_s)
    p.add_argument("--telemetry-s", type=float, default=d.telemetry_s, help="0: none")
    p.add_argument("--labels", default="", help="'site=a|b,tier=x': values round robin")
    p.add_argument("--models", default="intent-classifier=1", help="'name=version,...'")
    p.add_argument("--machine", default=d.machine, help="the hardware's machine name")
    p.add_argument("--offline-start", type=float, default=0.0, help="share online after --away-s")
    p.add_argument("--churn", type=float, default=0.0, help="share of nodes dropped per minute")
    p.add_argument("--away-s", type=float, default=d.away_s)
    p.add_argument("--bad-version", help="'7' or 'model=7': installs fail, worse telemetry")
    p.add_argument("--bad-fail-rate", type=float, default=d.bad_fail_rate)
    p.add_argument("--bad-latency-ms", type=float, default=d.bad_latency_ms)
    p.add_argument("--install-delay-s", type=float, default=d.install_delay_s)
    p.add_argument("--rps", type=float, default=d.rps, help="calls/s per model and node")
    p.add_argument(
        "--ab-good",
        default="",
        help="'v2=0.9,v3=0.8': the share of an A/B test's"
        " calls to each cloud version that are good (others 0.95)",
    )
    p.add_argument("--fail-rate", type=float, default=d.fail_rate)
    p.add_argument("--latency-ms", type=float, default=d.latency_ms)
    p.add_argument("--procs", type=int, default=0, help="worker processes (0: by --nodes)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds (0: until a signal)")
    p.add_argument("--installs", type=Path, help="the installs, JSON lines")
    p.add_argument("--trust", type=Path, help="verify manifests and commands with this key")
    p.add_argument("--session-expiry-s", type=int, default=d.session_expiry_s)
    p.add_argument("--max-connecting", type=int, default=d.max_connecting)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-s", type=float, default=0.0, help="figures on stderr this often")
    a = p.parse_args(argv)
    if not a.no_tls and a.pki is None:
        p.error("--pki is needed for TLS (or --no-tls)")
    return SimConfig(
        nodes=a.nodes,
        fleet=a.fleet,
        prefix=a.prefix,
        host=a.host,
        port=a.port,
        pki=a.pki,
        cert_name=a.cert_name,
        tls=not a.no_tls,
        heartbeat_s=a.heartbeat_s,
        telemetry_s=a.telemetry_s,
        labels=parse_labels(a.labels),
        models=parse_models(a.models),
        machine=a.machine,
        offline_start=a.offline_start,
        churn=a.churn,
        away_s=a.away_s,
        bad_version=a.bad_version,
        bad_fail_rate=a.bad_fail_rate,
        bad_latency_ms=a.bad_latency_ms,
        install_delay_s=a.install_delay_s,
        rps=a.rps,
        ab_good={k: float(v) for k, v in pairs(a.ab_good)},
        fail_rate=a.fail_rate,
        latency_ms=a.latency_ms,
        procs=a.procs,
        duration=a.duration,
        installs=a.installs,
        trust=a.trust,
        session_expiry_s=a.session_expiry_s,
        max_connecting=a.max_connecting,
        seed=a.seed,
        report_s=a.report_s,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # (the simulator starts its workers so)
        worker_main(int(argv[1]), int(argv[2]))
        return 0
    config = options(argv)
    done = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sim = Simulator(config).start()
    deadline = time.monotonic() + config.duration if config.duration > 0 else math.inf
    while not done.is_set() and time.monotonic() < deadline:
        step = min(config.report_s or 1.0, deadline - time.monotonic())
        done.wait(max(0.0, step))
        if config.report_s > 0 and not done.is_set():
            print(json.dumps(sim.stats(), sort_keys=True), file=sys.stderr, flush=True)
    figures = sim.stop()
    figures["config"] = config_doc(config)
    sim.close()
    print(json.dumps(figures, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

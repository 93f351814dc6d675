"""Canary rollouts: a signed model version reaches the fleet in stages, gated by live health.

A rollout has an id, a manifest with its URLs, stages (shares of the nodes: 10% then 100% by
default), a soak time per stage and gates. Its nodes are those online when it is created that
the manifest targets; stage k takes the first ``round(share * n)`` of them (at least one) in
the order of ``sha256(rollout id / node)``: a stable choice, different for each rollout, so
that no node is always the canary.

For each stage the controller (``edgefleet rollout create``, in the operator's shell or a
service) publishes the new desired state to the stage's new nodes, waits until each reports the
version active, then soaks: every second it compares the canary nodes' telemetry for the new
version since the stage started with the other nodes' over the same time. A gate that fails
aborts the rollout: every node that got the version is told (a signed ``rollback`` command) to
make the version before active again, and gets its previous desired state back. So does a
canary node that reports its install failed or rolled back, or none that activates in time.

The gates, as differences from the nodes not in the stage (the baseline):

- failure rate (errors, timeouts, refused inputs) above the baseline's by ``max_failure``;
- p95 latency above the baseline's by the factor ``1 + max_p95_increase``;
- fallback rate (local calls that the cloud had to finish) above the baseline's by
  ``max_fallback``;
- mean confidence (a classifier's best score, edged's ``edged_inference_confidence``) below the
  baseline's by ``max_confidence_drop``: the new version is less sure of the same traffic;

each only once the canary nodes served ``min_requests`` calls. The rollout's record is kept
retained on ``edge/v1/{fleet}/_fleet/rollouts/{id}``: ``status`` reads it, ``abort`` acts on
it, ``promote`` ends the soak of the running controller.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.registry import model_of
from cloudsync.protocol import commands, envelope
from cloudsync.protocol.envelope import EnvelopeError
from cloudsync.protocol.manifest import parse_signed
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.telemetry import FAILED_OUTCOMES
from cloudsync.protocol.topics import PREFIX, TopicError, Topics, check_name, parse

log = logging.getLogger("cloudsync.rollout")
FLEET_LEVEL = "_fleet"  # no node is named so: names starting with _ are the fleet's


def record_topic(fleet: str, rollout_id: str) -> str:
    return f"{PREFIX}/{check_name('fleet', fleet)}/{FLEET_LEVEL}/rollouts/{rollout_id}"


def control_topic(fleet: str, rollout_id: str) -> str:
    return record_topic(fleet, rollout_id) + "/control"


def pick(nodes: list[str], rollout_id: str, share: float) -> list[str]:
    """The nodes of a stage: the first ``round(share * n)`` (at least 1) by a stable hash."""
    ranked = sorted(nodes, key=lambda n: hashlib.sha256(f"{rollout_id}/{n}".encode()).digest())
    return ranked[: max(1, round(share * len(nodes)))]


@dataclass
class Gates:
    max_failure: float = 0.05
    max_p95_increase: float = 1.0
    max_fallback: float = 0.1
    min_requests: int = 20
    max_confidence_drop: float = 0.1


@dataclass
class Rollout:
    """The record (retained on the broker)."""

    id: str
    fleet: str
    model: str
    version: int
    manifest: dict[str, Any]
    urls: dict[str, str]
    stages: list[float]
    soak_s: float
    gates: Gates
    nodes: list[str]
    state: str = "running"  # running, done, aborted
    stage: int = 0
    touched: list[str] = field(default_factory=list)
    previous: dict[str, str | None] = field(default_factory=dict)  # node: desired state before
    why: str = ""
    log: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {what}")
        log.info("rollout %s: %s", self.id, what)

    def as_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> Rollout:
        doc = json.loads(payload)
        doc["gates"] = Gates(**doc["gates"])
        return cls(**doc)


@dataclass
class NodeFigures:
    """What the controller knows of one node from its messages."""

    online: bool = False
    machine: str = ""
    desired: bytes | None = None  # its retained desired state
    steps: dict[int, str] = field(default_factory=dict)  # version of the model: its last step
    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (ts, telemetry row)
    routes: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (ts, routes)


class FleetView:
    """The fleet as its messages tell it, for one model."""

    def __init__(self, fleet: str, model: str) -> None:
        self.fleet, self.model = fleet, model
        self.nodes: dict[str, NodeFigures] = {}
        self.control: list[dict[str, Any]] = []
        self.record: bytes | None = None

    def take(self, topic: str, payload: bytes) -> None:
        if f"/{FLEET_LEVEL}/rollouts/" in topic:
            if topic.endswith("/control"):
                self.control.append(json.loads(payload or b"{}"))
            else:
                self.record = payload
            return
        try:
            where = parse(topic)
        except TopicError:
            return
        node = self.nodes.setdefault(where.node, NodeFigures())
        if where.kind == "desired-models":
            node.desired = payload or None
            return
        try:
            env = envelope.decode(payload)
        except EnvelopeError:
            return
        body = env.body
        if where.kind == "status":
            node.online = body.get("state") == "online"
            node.machine = str(body.get("hardware", {}).get("machine", ""))
        elif where.kind == "events" and isinstance(body.get("delivery"), dict):
            step = body["delivery"]
            if step.get("model") == self.model and isinstance(step.get("version"), int):
                node.steps[step["version"]] = str(step.get("step"))
        elif where.kind == "telemetry" and isinstance(body.get("metrics"), dict):
            for row in body["metrics"].get("models", []):
                if row.get("model") == self.model:
                    node.rows.append((env.ts, row))
            routes = body["metrics"].get("routes", {}).get(self.model)
            if routes:
                node.routes.append((env.ts, routes))

    def figures(self, nodes: list[str], since: int, version: int | None) -> dict[str, Any]:
        """Calls, failures, the worst p95 and fallbacks of ``nodes`` since ``since`` (ms), for
        ``version`` (None: any)."""
        requests = failed = fallbacks = routed = scored = 0
        p95 = confidence = 0.0
        for name in nodes:
            node = self.nodes.get(name, NodeFigures())
            for ts, row in node.rows:
                if ts < since or (version is not None and row.get("version") != str(version)):
                    continue
                requests += row["requests"]
                failed += sum(row["outcomes"].get(o, 0) for o in FAILED_OUTCOMES)
                if row["requests"] >= 5 and row.get("p95_ms") is not None:
                    p95 = max(p95, float(row["p95_ms"]))
                if row.get("confidence_n"):
                    scored += row["confidence_n"]
                    confidence += row["confidence_mean"] * row["confidence_n"]
            for ts, routes in node.routes:
                if ts >= since:
                    routed += sum(routes.values())
                    fallbacks += routes.get("fallback", 0)
        return {
            "requests": requests,
            "failure_rate": failed / requests if requests else 0.0,
            "p95_ms": p95 or None,
            "fallback_rate": fallbacks / routed if routed else 0.0,
            "confidence": confidence / scored if scored else None,
        }


def breached(gates: Gates, canary: dict[str, Any], baseline: dict[str, Any]) -> str:
    """Why the canary's figures fail a gate ("" when they do not, or are too few yet)."""
    if canary["requests"] < gates.min_requests:
        return ""
    if canary["failure_rate"] > baseline["failure_rate"] + gates.max_failure:
        return (f"failure rate {canary['failure_rate']:.1%} against {baseline['failure_rate']:.1%}"
                f" on the other nodes (more than {gates.max_failure:.1%} worse)")  # fmt: skip
    slow, usual = canary["p95_ms"], baseline["p95_ms"]
    if slow and usual and slow > usual * (1 + gates.max_p95_increase):
        return f"p95 {slow:.1f} ms against {usual:.1f} ms on the other nodes"
    sure, usually = canary["confidence"], baseline["confidence"]
    if sure is not None and usually is not None and sure < usually - gates.max_confidence_drop:
        return f"mean confidence {sure:.3f} against {usually:.3f} on the other nodes"
    if canary["fallback_rate"] > baseline["fallback_rate"] + gates.max_fallback:
        return (f"fallback rate {canary['fallback_rate']:.1%} against"
                f" {baseline['fallback_rate']:.1%}")  # fmt: skip
    return ""


class Controller:
    """Runs one rollout over an MQTT connection as the operator."""

    def __init__(
        self,
        client: SyncClient,
        operator: str,
        key: Ed25519PrivateKey,
        kid: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client, self.operator, self.key, self.kid = client, operator, key, kid
        self.clock = clock
        self.seen = 0
        self.view: FleetView | None = None

    def watch(self, fleet: str, model: str, rollout_id: str) -> FleetView:
        self.view = FleetView(fleet, model)
        for leaf in ("status", "events", "telemetry", "desired/models"):
            self.client.subscribe(f"{PREFIX}/{fleet}/+/{leaf}")
        self.client.subscribe(record_topic(fleet, rollout_id))
        self.client.subscribe(control_topic(fleet, rollout_id))
        return self.view

    def pump(self, wait: float = 0.0) -> None:
        """Take the messages that came (waiting up to ``wait`` for one)."""
        assert self.view is not None
        for topic, payload in self.client.wait_messages(self.seen + 1, wait)[self.seen :]:
            self.seen += 1
            self.view.take(topic, payload)

    def create(
        self,
        rollout_id: str,
        fleet: str,
        manifest: dict[str, Any],
        urls: dict[str, str],
        stages: list[float],
        soak_s: float,
        gates: Gates,
    ) -> Rollout:
        signed = parse_signed(manifest.get("signed"))
        view = self.watch(fleet, signed.key, rollout_id)
        self.pump(1.0)
        deadline = time.monotonic() + 1.0  # retained messages come at once
        while time.monotonic() < deadline:
            self.pump(0.1)
        if view.record is not None:
            raise ValueError(f"rollout '{rollout_id}' exists already")
        nodes = sorted(
            name for name, node in view.nodes.items()
            if node.online and not signed.for_node(fleet, name, node.machine)
        )  # fmt: skip
        if not nodes:
            raise ValueError("no online node of the fleet is a target of this manifest")
        rollout = Rollout(rollout_id, fleet, signed.key, signed.version, manifest, urls,
                          stages, soak_s, gates, nodes)  # fmt: skip
        rollout.note(f"created for {len(nodes)} nodes, stages {stages}")
        self.save(rollout)
        return rollout

    def save(self, rollout: Rollout) -> None:
        topic = record_topic(rollout.fleet, rollout.id)
        self.client.publish(topic, rollout.as_json(), retain=True)

    def run(self, rollout: Rollout, activation_timeout_s: float = 300.0) -> Rollout:
        """The stages, until done or aborted."""
        view = self.view
        assert view is not None
        while rollout.state == "running" and rollout.stage < len(rollout.stages):
            share = rollout.stages[rollout.stage]
            new = [n for n in pick(rollout.nodes, rollout.id, share) if n not in rollout.touched]
            for name in new:
                self.deliver(rollout, name)
            rollout.note(f"stage {rollout.stage + 1} ({share:.0%}): {len(new)} more nodes,"
                         f" {len(rollout.touched)} in all: {', '.join(new)}")  # fmt: skip
            self.save(rollout)
            why = self.wait_active(rollout, activation_timeout_s)
            last = rollout.stage == len(rollout.stages) - 1
            if not why and not last and rollout.state == "running":
                why = self.soak(rollout)
            if rollout.state != "running":  # aborted from another shell, which rolled back
                rollout.note(f"aborted elsewhere: {rollout.why}")
                return rollout
            if why:
                return self.abort(rollout, why)
            rollout.stage += 1
            self.save(rollout)
        if rollout.state == "running":
            rollout.state = "done"
            rollout.note(f"done: version {rollout.version} on {len(rollout.touched)} nodes")
            self.save(rollout)
        return rollout

    def deliver(self, rollout: Rollout, node: str) -> None:
        """The node's desired state with this version of the model (its others kept)."""
        assert self.view is not None
        before = self.view.nodes.get(node, NodeFigures()).desired
        rollout.previous[node] = before.decode() if before else None
        entries = []
        if before:
            try:
                entries = [e for e in envelope.decode(before).body.get("models", [])
                           if model_of(e) != rollout.model]  # fmt: skip
            except EnvelopeError:
                entries = []
        entries.append({"manifest": rollout.manifest, "urls": rollout.urls})
        self.publish_desired(rollout.fleet, node, {"models": entries})
        rollout.touched.append(node)

    def publish_desired(self, fleet: str, node: str, body: dict[str, Any] | None) -> None:
        topic = Topics(fleet, node).desired_models
        payload = b"" if body is None else envelope.Envelope(
            self.operator, int(self.clock() * 1000), body).encode()  # fmt: skip
        self.client.publish(topic, payload, retain=True)

    def _control(self, rollout: Rollout) -> str | None:
        """An abort by someone else (the record) or a promote (the control topic)."""
        assert self.view is not None
        self.pump(0.0)
        if self.view.record is not None:
            kept = Rollout.from_json(self.view.record)
            if kept.state == "aborted" and rollout.state == "running":
                rollout.state, rollout.why = "aborted", kept.why
                return "aborted"
        while self.view.control:
            if self.view.control.pop(0).get("action") == "promote":
                return "promote"
        return None

    def wait_active(self, rollout: Rollout, timeout_s: float) -> str:
        assert self.view is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._control(rollout) == "aborted":
                return ""
            pending = []
            for name in rollout.touched:
                step = self.view.nodes.get(name, NodeFigures()).steps.get(rollout.version)
                if step in ("failed", "rolled-back", "refused"):
                    return f"node {name}: the version {step} there"
                if step != "active":
                    pending.append(name)
            if not pending:
                return ""
            self.pump(0.5)
        return f"not active in {timeout_s:.0f} s on {', '.join(pending)}"

    def soak(self, rollout: Rollout) -> str:
        assert self.view is not None
        since = int(self.clock() * 1000)
        stage = list(rollout.touched)
        others = [n for n in rollout.nodes if n not in stage]
        deadline = time.monotonic() + rollout.soak_s
        rollout.note(f"soaking {rollout.soak_s:.0f} s")
        self.save(rollout)
        while time.monotonic() < deadline:
            action = self._control(rollout)
            if action == "aborted":
                return ""
            if action == "promote":
                rollout.note("promoted by the operator")
                return ""
            self.pump(0.5)
            for name in stage:
                step = self.view.nodes.get(name, NodeFigures()).steps.get(rollout.version)
                if step in ("failed", "rolled-back"):
                    return f"node {name}: the version {step} there"
            canary = self.view.figures(stage, since, rollout.version)
            baseline = self.view.figures(others, since, None)
            why = breached(rollout.gates, canary, baseline)
            if why:
                return why
        return ""

    def abort(self, rollout: Rollout, why: str) -> Rollout:
        """Every node that got the version goes back to the version before."""
        rollout.state, rollout.why = "aborted", why
        rollout.note(f"aborted: {why}; rolling back {len(rollout.touched)} nodes")
        self.save(rollout)
        for name in rollout.touched:
            target = f"{rollout.fleet}/{name}"
            cmd_id, payload = commands.sign(
                self.key,
                self.kid,
                self.operator,
                target,
                "rollback",
                {"model": rollout.model, "from": rollout.version},
            )
            self.client.publish(Topics(rollout.fleet, name).cmd(cmd_id), payload)
            previous = rollout.previous.get(name)
            body = envelope.decode(previous.encode()).body if previous else None
            self.publish_desired(rollout.fleet, name, body)
        rollout.note("rollback sent")
        self.save(rollout)
        return rollout

"""Rollouts run by the fleet service: a signed model version reaches a group of nodes in stages,
gated by their health, as a state machine kept in the database, so that the service can be
killed at any point and the runner that holds the lease next goes on where it was.

A rollout is created for the nodes that are online and that its selector (or its deployment's)
and its manifest's targets pick; each node's stage is fixed then (``pick``: the first
``round(share * n)`` by ``sha256(rollout id / node)``). Each runner turn (``Rollouts.turn``):

- **deliver**: the stage's nodes get the version, at most ``max_unavailable`` at a time (a node
  that was sent the version and has not reported it active is unavailable) and only inside the
  rollout's time window, if it has one. A node's desired state before is written first, then
  the new one is published, then the node is marked sent: killed in between, the next runner
  publishes the same desired state again (a node leaves a version it has alone, so none
  installs twice) and never computes the "before" from what it published itself;
- **soak**: once every node of the stage reports the version active, the canary's telemetry
  since then is compared with the nodes' that do not have it, by the gates of
  ``cloudsync.fleet.gates`` (failure rate, p95, fallbacks, confidence), until ``soak_s``
  pass (or an operator promotes); then the next stage;
- **abort** (a gate, a node whose install failed or rolled back, one not active within
  ``activation_timeout_s``, or an operator): every node that was sent the version gets its
  desired state before back and a signed ``rollback`` command (from the service's deploy key,
  which may sign nothing else); each is marked when done, so a restart sends only what is left.

With a ``deployment``, the rollout is how that deployment's model changes version: its nodes
are the deployment's, and when the rollout is done the deployment gives the new version (to
nodes that join later too). Without one, a model that a deployment gives cannot be rolled out.
While a rollout runs or aborts, the deployments' reconciler leaves its model alone on its nodes.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.deployments import Deployments, Invalid, check_entry, with_entry_in
from cloudsync.fleet.gates import Gates, breached, pick
from cloudsync.fleet.registry import FAILED_STEPS, forget_telemetry, model_of
from cloudsync.fleet.store import Store, Tx, dumps
from cloudsync.protocol import commands
from cloudsync.protocol.labels import check_labels, selects
from cloudsync.protocol.manifest import parse_signed
from cloudsync.protocol.topics import NAME

log = logging.getLogger("edgefleet.rollouts")
RESEND_AFTER_MS = 30_000
WINDOW = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-3]):([0-5][0-9])\Z")


@dataclass
class Rollout:
    id: str
    model: str
    version: int
    entry: dict[str, Any]  # {manifest, urls}
    selector: dict[str, str]
    deployment: str | None
    stages: list[float]
    soak_s: float
    gates: Gates
    max_unavailable: int
    window: str | None  # "HH:MM-HH:MM" UTC
    activation_timeout_s: float
    state: str = "running"  # running, paused, aborting, aborted, done
    stage: int = 0
    phase: str = "deliver"  # deliver, soak
    soak_since: int = 0
    soak_until: int = 0
    why: str = ""
    created_by: str = ""
    created_ts: int = 0
    updated_ts: int = 0
    log: list[str] = field(default_factory=list)
    rev: int = 0  # the record's revision: a save of an older one is refused (Stale)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_window(text: Any) -> tuple[int, int] | None:
    """The window "HH:MM-HH:MM" (UTC) as minutes of the day; None for none; ValueError if
    bad."""
    if text is None:
        return None
    found = WINDOW.match(text) if isinstance(text, str) else None
    if found is None:
        raise ValueError("window: HH:MM-HH:MM (UTC), 00:00 to 23:59")
    h1, m1, h2, m2 = (int(g) for g in found.groups())
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == end:
        raise ValueError("window: two different times of day")
    return start, end


def in_window(window: str | None, now_ms: int) -> bool:
    bounds = parse_window(window)
    if bounds is None:
        return True
    minute = (now_ms // 60_000) % 1440
    start, end = bounds
    return start <= minute < end if start < end else minute >= start or minute < end


def check(doc: Any, anchors: dict[str, Any] | None, now_ms: int) -> Rollout:
    """A rollout from an API body (Invalid names the first bad field)."""
    if not isinstance(doc, dict):
        raise Invalid("body: an object {id, manifest, urls, ...}")
    known = {
        "id",
        "manifest",
        "urls",
        "selector",
        "deployment",
        "stages",
        "soak_s",
        "gates",
        "max_unavailable",
        "window",
        "activation_timeout_s",
    }
    unknown = set(doc) - known
    if unknown:
        raise Invalid(f"{sorted(unknown)[0]}: not a field of a rollout")
    ident = doc.get("id")
    if not isinstance(ident, str) or not NAME.match(ident):
        raise Invalid("id: 1 to 64 letters, digits, _ or -, not first _")
    entry = {"manifest": doc.get("manifest"), "urls": doc.get("urls")}
    signed = check_entry(entry, anchors, now_ms)
    if signed.remove:
        raise Invalid(
            "manifest.signed.remove: a removal is deployed (POST /v1/deployments),"
            " not rolled out: there is no version to watch in canaries"
        )
    try:
        selector = check_labels(doc.get("selector", {}), "selector")
        window = doc.get("window")
        parse_window(window)
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    deployment = doc.get("deployment")
    if deployment is not None and (not isinstance(deployment, str) or not NAME.match(deployment)):
        raise Invalid("deployment: a deployment's id")
    stages = doc.get("stages", [0.1, 1.0])
    if (
        not isinstance(stages, list)
        or not 1 <= len(stages) <= 10
        or not all(_number(s) and 0 < s <= 1 for s in stages)
        or stages != sorted(stages)
        or stages[-1] != 1
    ):
        raise Invalid("stages: 1 to 10 growing shares of the nodes (0-1], the last 1")
    soak_s, timeout_s = doc.get("soak_s", 600.0), doc.get("activation_timeout_s", 600.0)
    if not _number(soak_s) or not 0 <= soak_s <= 7 * 86400:
        raise Invalid("soak_s: 0 to 604800 seconds")
    if not _number(timeout_s) or not 1 <= timeout_s <= 86400:
        raise Invalid("activation_timeout_s: 1 to 86400 seconds")
    most = doc.get("max_unavailable", 0)
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        raise Invalid("max_unavailable: nodes installing at once (0: a tenth of the nodes)")
    gates_doc = doc.get("gates", {})
    try:
        if not isinstance(gates_doc, dict):
            raise TypeError
        gates = Gates(**gates_doc)
        if not all(_number(v) and v >= 0 for v in asdict(gates).values()):
            raise TypeError
    except TypeError:
        raise Invalid(f"gates: an object of {', '.join(asdict(Gates()))}, numbers >= 0") from None
    return Rollout(
        ident,
        signed.key,
        signed.version,
        entry,
        selector,
        deployment,
        [float(s) for s in stages],
        float(soak_s),
        gates,
        most,
        window,
        float(timeout_s),
    )


def with_entry(
    entries: list[dict[str, Any]], model: str, entry: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """A node's desired entries with ``model``'s replaced by ``entry`` (None: removed), in
    the order of their models (the same state, the same bytes, whoever composes it)."""
    kept = [e for e in entries if model_of(e) != model] + ([entry] if entry else [])
    return sorted(kept, key=lambda e: model_of(e) or "")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Conflict(Exception):
    """A rollout that cannot start (409): it exists, or its model is another's."""


class Stale(Exception):
    """The rollout's record changed since it was read: the turn or the action starts again."""


class Rollouts:
    """The rollouts in the database, and the runner's turn over them."""

    def __init__(
        self,
        store: Store,
        deployments: Deployments,
        fleet: str,
        publish: Callable[[str, list[dict[str, Any]]], bool],
        send: Callable[[str, str, bytes], bool],
        deploy_key: tuple[str, Ed25519PrivateKey] | None,
        identity: str,
        clock: Callable[[], int],
        offline_after_ms: int = 30_000,
    ) -> None:
        self.store, self.deployments, self.fleet = store, deployments, fleet
        self.publish, self.send, self.deploy_key = publish, send, deploy_key
        self.identity, self.clock = identity, clock
        self.offline_after_ms = offline_after_ms

    # ---- records ---------------------------------------------------------------------------

    def _load(self, row: dict[str, Any]) -> Rollout:
        doc = json.loads(row["doc"])
        doc["gates"] = Gates(**doc["gates"])
        doc["rev"] = row["rev"]
        return Rollout(**doc)

    def all(self) -> list[Rollout]:
        rows = self.store.query("SELECT doc, rev FROM rollouts ORDER BY id")
        return [self._load(r) for r in rows]

    def get(self, ident: str) -> Rollout | None:
        rows = self.store.query("SELECT doc, rev FROM rollouts WHERE id = ?", (ident,))
        return self._load(rows[0]) if rows else None

    def save(self, tx: Tx, rollout: Rollout, note: str = "") -> None:
        """The record, if nobody changed it since it was read (Stale: an operator's action or
        another runner came first; the caller's transaction is rolled back)."""
        rollout.updated_ts = self.clock()
        if note:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rollout.updated_ts / 1000))
            rollout.log = [*rollout.log[-199:], f"{stamp} {note}"]
        doc = rollout.as_dict()
        doc.pop("rev")
        done = tx.execute(
            "UPDATE rollouts SET state = ?, doc = ?, rev = rev + 1 WHERE id = ? AND rev = ?",
            (rollout.state, dumps(doc), rollout.id, rollout.rev),
        )
        if done.rowcount != 1:
            raise Stale(rollout.id)
        rollout.rev += 1
        if note:
            log.info("rollout %s: %s", rollout.id, note)

    def nodes(self, ident: str) -> list[dict[str, Any]]:
        return self.store.query(
            "SELECT node, stage, state, sent_ts FROM rollout_nodes WHERE rollout = ?"
            " ORDER BY stage, rank",
            (ident,),
        )

    def states(self) -> dict[str, int]:
        """How many rollouts are in each state."""
        rows = self.store.query("SELECT state, COUNT(*) AS n FROM rollouts GROUP BY state")
        return {r["state"]: int(r["n"]) for r in rows}

    def of_node(self, node: str) -> list[dict[str, Any]]:
        """The rollouts ``node`` is in: its stage and state in each."""
        return self.store.query(
            "SELECT rollout, stage, state FROM rollout_nodes WHERE node = ? ORDER BY rollout",
            (node,),
        )

    def running(self) -> list[Rollout]:
        """The rollouts that hold their model on their nodes (running, paused, aborting)."""
        rows = self.store.query(
            "SELECT doc, rev FROM rollouts WHERE state IN ('running',"
            " 'paused', 'aborting') ORDER BY id"
        )
        return [self._load(r) for r in rows]

    def held(self) -> dict[str, set[str]]:
        """Node: the models that running rollouts hold there (the reconciler leaves them)."""
        models = {r.id: r.model for r in self.running()}
        if not models:
            return {}
        marks = ", ".join("?" for _ in models)
        rows = self.store.query(
            f"SELECT node, rollout FROM rollout_nodes WHERE rollout IN ({marks})", tuple(models)
        )
        held: dict[str, set[str]] = {}
        for row in rows:
            held.setdefault(row["node"], set()).add(models[row["rollout"]])
        return held

    def prune(self, keep_ms: int = 3_600_000) -> int:
        """Telemetry no running rollout judges (older than its soak and than ``keep_ms``)
        deleted; how many rows."""
        cutoff = self.clock() - keep_ms
        for rollout in self.running():
            if rollout.phase == "soak":
                cutoff = min(cutoff, rollout.soak_since)
        with self.store.transaction() as tx:
            return forget_telemetry(tx, cutoff)

    def watched(self) -> set[str]:
        """The models whose telemetry running rollouts judge."""
        return {r.model for r in self.running()}

    def create(self, rollout: Rollout, actor: str) -> Rollout:
        """The rollout with its nodes and their stages, saved; Conflict if it cannot start. The
        checks and the writes are one transaction under the rollouts' lock (two creates at once
        cannot both take a model's nodes)."""
        if self.deploy_key is None:
            raise Conflict(
                "the service has no deploy key ([service] deploy_key): it could not"
                " sign the rollbacks an abort needs"
            )
        now = self.clock()
        rollout.created_by, rollout.created_ts, rollout.log = actor, now, []
        signed = parse_signed(rollout.entry["manifest"]["signed"])
        with self.store.transaction() as tx:
            self.store.advisory_lock(tx, "rollouts")
            deps = [self.deployments.load(r) for r in tx.rows("SELECT * FROM deployments")]
            selector = rollout.selector
            if rollout.deployment is not None:
                dep = next((d for d in deps if d.id == rollout.deployment), None)
                if dep is None:
                    raise Conflict(f"no deployment {rollout.deployment}")
                if not any(model_of(e) == rollout.model for e in dep.models):
                    raise Conflict(f"deployment {dep.id} does not give {rollout.model}")
                selector = dep.selector
            busy = tx.rows(
                "SELECT n.node, r.doc FROM rollout_nodes n JOIN rollouts r ON r.id = n.rollout"
                " WHERE r.state IN ('running', 'paused', 'aborting')"
            )
            taken = {
                row["node"] for row in busy if json.loads(row["doc"])["model"] == rollout.model
            }
            targets = []
            for row in tx.rows(
                "SELECT node, node_labels, labels, hardware, state, last_seen"
                " FROM nodes ORDER BY node"
            ):
                labels = {**json.loads(row["node_labels"]), **json.loads(row["labels"])}
                machine = str(json.loads(row["hardware"]).get("machine", ""))
                fresh = row["state"] == "online" and row["last_seen"] >= now - self.offline_after_ms
                if not (fresh and selects(selector, labels)) or signed.for_node(
                    self.fleet, row["node"], machine
                ):
                    continue
                if rollout.deployment is None:
                    owner = next(
                        (
                            d.id
                            for d in deps
                            if selects(d.selector, labels)
                            and any(model_of(e) == rollout.model for e in d.models)
                        ),
                        None,
                    )
                    if owner is not None:
                        raise Conflict(
                            f"{rollout.model} is given by deployment {owner}: roll"
                            f" it out through it (deployment: {owner})"
                        )
                if row["node"] in taken:
                    raise Conflict(f"{rollout.model} is in another rollout on {row['node']}")
                targets.append(row["node"])
            if not targets:
                raise Conflict("no online node is a target of this rollout")
            if not rollout.max_unavailable:
                rollout.max_unavailable = max(1, len(targets) // 10)
            ranked = pick(targets, rollout.id, 1.0)
            stage_of: dict[str, int] = {}
            for k, share in enumerate(rollout.stages):
                for node in pick(targets, rollout.id, share):
                    stage_of.setdefault(node, k)
            made = tx.execute(
                "INSERT INTO rollouts (id, state, doc, rev) VALUES (?, 'running', '{}', 0)"
                " ON CONFLICT (id) DO NOTHING",
                (rollout.id,),
            )
            if made.rowcount != 1:
                raise Conflict(f"rollout {rollout.id} exists")
            tx.executemany(
                "INSERT INTO rollout_nodes (rollout, node, rank, stage, state) VALUES"
                " (?, ?, ?, ?, 'pending')",
                [(rollout.id, n, i, stage_of[n]) for i, n in enumerate(ranked)],
            )
            sizes = [
                sum(1 for s in stage_of.values() if s <= k) for k in range(len(rollout.stages))
            ]
            self.save(
                tx,
                rollout,
                f"created by {actor} for {len(targets)} nodes: version"
                f" {rollout.version} of {rollout.model}, stages of {sizes} nodes,"
                f" {rollout.max_unavailable} at a time",
            )
        return rollout

    def act(self, ident: str, action: str, actor: str) -> Rollout:
        """An operator's pause, resume, promote or abort (Conflict when it does not apply),
        read and written in one transaction (again if the runner wrote in between)."""
        for _ in range(5):
            try:
                return self._act(ident, action, actor)
            except Stale:
                continue
        raise Conflict(f"rollout {ident} is changing: try again")

    def _act(self, ident: str, action: str, actor: str) -> Rollout:
        with self.store.transaction() as tx:
            rows = tx.rows("SELECT doc, rev FROM rollouts WHERE id = ?", (ident,))
            if not rows:
                raise KeyError(ident)
            rollout = self._load(rows[0])
            state = rollout.state
            if action == "pause" and state == "running":
                rollout.state = "paused"
            elif action == "resume" and state == "paused":
                rollout.state = "running"
                if rollout.phase == "soak":  # what came while paused was not judged: again
                    rollout.soak_since = self.clock()
                    rollout.soak_until = rollout.soak_since + int(rollout.soak_s * 1000)
            elif action == "promote" and state == "running" and rollout.phase == "soak":
                rollout.soak_until = self.clock()
            elif action == "abort" and state in ("running", "paused"):
                self._abort(tx, rollout, f"aborted by {actor}")
                return rollout
            else:
                raise Conflict(
                    f"cannot {action} a rollout that is {state}"
                    + (f" ({rollout.phase})" if state == "running" else "")
                )
            self.save(tx, rollout, f"{action} by {actor}")
        return rollout

    # ---- the runner's turn -----------------------------------------------------------------

    def turn(self) -> None:
        """One step of each running or aborting rollout; one that fails is logged and the
        others go on."""
        for rollout in self.running():
            if rollout.state == "paused":
                continue
            try:
                self.advance(rollout)
            except Stale:  # an operator acted meanwhile: the next turn reads it again
                log.debug("rollout %s changed during the turn", rollout.id)
            except Exception:
                log.exception("rollout %s: its turn failed (the next turn tries again)", rollout.id)

    def advance(self, rollout: Rollout) -> None:
        if rollout.state == "aborting":
            self._roll_back(rollout)
            return
        now = self.clock()
        rows = self.store.query(
            "SELECT n.node, n.stage, n.state, n.sent_ts, s.step, d.state AS online,"
            " d.last_seen, d.heartbeat FROM rollout_nodes n"
            " LEFT JOIN steps s ON s.node = n.node AND s.model = ? AND s.version = ?"
            " LEFT JOIN nodes d ON d.node = n.node WHERE n.rollout = ? ORDER BY n.rank",
            (rollout.model, rollout.version, rollout.id),
        )
        for row in rows:
            row["fresh"] = row["online"] == "online" and (row["last_seen"] or 0) >= (
                now - self.offline_after_ms
            )
            if row["state"] == "sent" and row["step"] != "active" and self._serving(rollout, row):
                row["step"] = "active"  # its heartbeat says so, whatever became of the event
        stage = [r for r in rows if r["stage"] <= rollout.stage]
        timeout_ms = int(rollout.activation_timeout_s * 1000)
        for row in rows:
            if row["state"] in ("sent", "active") and row["step"] in FAILED_STEPS:
                return self.abort(rollout, f"node {row['node']}: the version {row['step']} there")
            if (
                row["state"] == "sent"
                and row["step"] != "active"
                and row["fresh"]
                and now - row["sent_ts"] > timeout_ms
            ):
                return self.abort(
                    rollout,
                    f"node {row['node']}: not active in {rollout.activation_timeout_s:.0f} s",
                )
        activated = [r["node"] for r in stage if r["state"] == "sent" and r["step"] == "active"]
        if activated:
            with self.store.transaction() as tx:
                tx.executemany(
                    "UPDATE rollout_nodes SET state = 'active' WHERE rollout = ? AND node = ?",
                    [(rollout.id, n) for n in activated],
                )
        for row in stage:
            if row["node"] in activated:
                row["state"] = "active"
        self._resend(rollout, [r for r in stage if r["state"] in ("sending", "sent")], now)
        # an offline node waits (pending) until it is back; the stage does not wait for it
        pending = [r["node"] for r in stage if r["state"] == "pending" and r["fresh"]]
        busy = sum(1 for r in stage if r["state"] in ("sending", "sent"))
        if pending and in_window(rollout.window, now):
            for node in pending[: max(0, rollout.max_unavailable - busy)]:
                self._deliver(rollout, node)
            return
        if pending or busy:
            return
        away = sum(1 for r in stage if r["state"] == "pending")
        with self.store.transaction() as tx:
            if rollout.phase == "deliver" and rollout.stage < len(rollout.stages) - 1:
                rollout.phase, rollout.soak_since = "soak", now
                rollout.soak_until = now + int(rollout.soak_s * 1000)
                self.save(
                    tx,
                    rollout,
                    f"stage {rollout.stage + 1}: {len(stage) - away} nodes"
                    f" active{f', {away} offline' if away else ''}; soaking"
                    f" {rollout.soak_s:.0f} s",
                )
                return
            why = self.gates(rollout) if rollout.phase == "soak" else ""
            if why:  # judged until the soak's very end (and after a pause, again)
                self._abort(tx, rollout, why)
            elif rollout.stage == len(rollout.stages) - 1:
                self._done(tx, rollout, len(rows) - away, away)
            elif now >= rollout.soak_until:
                rollout.stage, rollout.phase = rollout.stage + 1, "deliver"
                self.save(
                    tx, rollout, f"stage {rollout.stage}: soaked; stage {rollout.stage + 1} begins"
                )

    @staticmethod
    def _serving(rollout: Rollout, row: dict[str, Any]) -> bool:
        """Whether the node's last heartbeat serves the version (its delivery events may have
        gone to a replica that is gone)."""
        try:
            beat = json.loads(row["heartbeat"] or "{}")
            serving = (beat.get("models") or {}).get(rollout.model)
        except (ValueError, AttributeError):
            return False
        return serving is not None and str(serving) == str(rollout.version)

    def gates(self, rollout: Rollout) -> str:
        """Why the canary's telemetry since the soak began fails a gate, or ""."""
        canary = self.figures(rollout, True)
        baseline = self.figures(rollout, False)
        return breached(rollout.gates, canary, baseline)

    def figures(self, rollout: Rollout, canary: bool) -> dict[str, Any]:
        """The telemetry figures of the nodes that have the version (``canary``) for it, or of
        the nodes it has not reached, since the soak began."""
        member = "IN" if canary else "NOT IN"
        # the canary's figures of the version; routes are per model (version "")
        version = " AND (t.version = ? OR t.version = '')" if canary else ""
        params: tuple[Any, ...] = (rollout.model, rollout.soak_since, rollout.id)
        rows = self.store.query(
            "SELECT COALESCE(SUM(t.requests), 0) AS requests, COALESCE(SUM(t.failed), 0) AS"
            " failed, MAX(CASE WHEN t.requests >= 5 THEN t.p95_ms END) AS p95,"
            " COALESCE(SUM(t.conf_n), 0) AS conf_n, COALESCE(SUM(t.conf_sum), 0) AS conf_sum,"
            " COALESCE(SUM(t.routed), 0) AS routed, COALESCE(SUM(t.fallbacks), 0) AS fallbacks"
            " FROM telemetry t WHERE t.model = ? AND t.ts >= ? AND t.node "
            + member
            + " (SELECT node FROM rollout_nodes WHERE rollout = ? AND state <> 'pending')"
            + version,
            params + ((str(rollout.version),) if canary else ()),
        )
        r = rows[0]
        requests, routed, scored = int(r["requests"]), int(r["routed"]), int(r["conf_n"])
        return {
            "requests": requests,
            "failure_rate": int(r["failed"]) / requests if requests else 0.0,
            "p95_ms": float(r["p95"]) if r["p95"] is not None else None,
            "fallback_rate": int(r["fallbacks"]) / routed if routed else 0.0,
            "confidence": float(r["conf_sum"]) / scored if scored else None,
        }

    def _current(self, node: str) -> list[dict[str, Any]]:
        """The node's desired entries as last published (by anyone; the service writes what it
        publishes at once)."""
        rows = self.store.query("SELECT models FROM desired WHERE node = ?", (node,))
        return json.loads(rows[0]["models"]) if rows else []

    def _deliver(self, rollout: Rollout, node: str) -> None:
        """The node's entry of the model before is kept, then its desired state with the
        version published, then the node is marked sent."""
        current = self._current(node)
        before = next((e for e in current if model_of(e) == rollout.model), None)
        with self.store.transaction() as tx:
            marked = tx.execute(
                "UPDATE rollout_nodes SET state = 'sending', previous = ?, sent_ts = ?"
                " WHERE rollout = ? AND node = ? AND state = 'pending' AND EXISTS (SELECT 1"
                " FROM rollouts WHERE id = ? AND state = 'running')",
                (dumps(before), self.clock(), rollout.id, node, rollout.id),
            )
            if marked.rowcount != 1:  # paused or aborted since the turn began
                raise Stale(rollout.id)
        self._publish(rollout, node, current)

    def _publish(self, rollout: Rollout, node: str, current: list[dict[str, Any]]) -> None:
        if self.publish(node, with_entry(current, rollout.model, rollout.entry)):
            with self.store.transaction() as tx:
                tx.execute(
                    "UPDATE rollout_nodes SET state = 'sent', sent_ts = ? WHERE"
                    " rollout = ? AND node = ? AND state = 'sending'",
                    (self.clock(), rollout.id, node),
                )

    def _resend(self, rollout: Rollout, rows: list[dict[str, Any]], now: int) -> None:
        """A node left 'sending' (killed between the two writes) is published again; one
        'sent' whose desired state does not hold the version (another publisher replaced it,
        or the broker lost it) gets it again, after a while."""
        for row in rows:
            if row["state"] == "sent" and (row["step"] or now - row["sent_ts"] < RESEND_AFTER_MS):
                continue
            current = self._current(row["node"])
            if row["state"] == "sent" and rollout.entry in current:
                continue
            if (
                self.store.query("SELECT state FROM rollouts WHERE id = ?", (rollout.id,))[0][
                    "state"
                ]
                != "running"
            ):
                raise Stale(rollout.id)
            self._publish(rollout, row["node"], current)

    def abort(self, rollout: Rollout, why: str) -> None:
        with self.store.transaction() as tx:
            self._abort(tx, rollout, why)

    def _abort(self, tx: Tx, rollout: Rollout, why: str) -> None:
        rollout.state, rollout.why = "aborting", why
        tx.execute(
            "UPDATE rollout_nodes SET state = 'rollback' WHERE rollout = ? AND state IN"
            " ('sending', 'sent', 'active')",
            (rollout.id,),
        )
        self.save(tx, rollout, f"aborting: {why}")

    def _roll_back(self, rollout: Rollout) -> None:
        """Each node sent the version: its desired state before, and a signed rollback; marked
        once sent (killed before, the next runner sends it again: a rollback ``from`` a version
        that is not active does nothing)."""
        if self.deploy_key is None:
            log.error(
                "rollout %s: cannot roll back without a deploy key ([service]"
                " deploy_key): its nodes wait",
                rollout.id,
            )
            return
        kid, key = self.deploy_key
        rows = self.store.query(
            "SELECT node, previous FROM rollout_nodes WHERE rollout = ? AND state = 'rollback'",
            (rollout.id,),
        )
        for row in rows:
            node = row["node"]
            cmd_id, payload = commands.sign(
                key,
                kid,
                self.identity,
                f"{self.fleet}/{node}",
                "rollback",
                {"model": rollout.model, "from": rollout.version},
            )
            if not self.send(node, cmd_id, payload):  # first: the version before serves
                return  # the broker is away: the next turn
            before = json.loads(row["previous"] or "null")
            if not self.publish(node, with_entry(self._current(node), rollout.model, before)):
                return
            with self.store.transaction() as tx:
                tx.execute(
                    "UPDATE rollout_nodes SET state = 'rolled-back' WHERE rollout = ? AND node = ?",
                    (rollout.id, node),
                )
        with self.store.transaction() as tx:
            rollout.state = "aborted"
            self.save(tx, rollout, f"aborted: {len(rows)} nodes told to roll back")

    def _done(self, tx: Tx, rollout: Rollout, count: int, away: int) -> None:
        rollout.state = "done"
        if rollout.deployment is not None:
            with_entry_in(tx, rollout.deployment, rollout.model, rollout.entry, self.clock())
        offline = (
            f"; {away} offline, left pending (a deployment gives it to them when they are back)"
            if away
            else ""
        )
        self.save(tx, rollout, f"done: version {rollout.version} on {count} nodes{offline}")

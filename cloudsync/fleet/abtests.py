"""A/B tests of a cloud model across the fleet, decided by the fleet service: the calls of many
nodes, each with too few to decide alone, added up.

An operator starts a test (``POST /v1/ab-tests``: the model, arm b's cloud name, b's share,
the nodes by selector, the stopping rule and what a good call is). The nodes picked are the
online ones the selector picks then. Each runner turn (``ABTests.turn``):

- **split**: each node is sent a signed ``cloud-ab`` command (the service's deploy key: its
  scope file on the nodes must name ``cloud-ab``) that sets the split with ``decided_by:
  fleet``: the node sends b's share of its calls to arm b, judges each call by the test's rule
  (answered, within ``latency_ms``, at least ``min_confidence`` sure, an operator's score of
  at least ``min_score`` posted to the node) and counts it
  (``edged_cloud_ab_calls_total{model, cloud_model, good}``), but decides nothing itself;
- **count**: the nodes' counts arrive in telemetry (``cloudsync.fleet.observe``); the test's arms
  are their sums over its nodes since the test started (arm b: calls of ``b_cloud_name``; arm
  a: every other version of the model), and ``edged.common.abtest.verdict`` applies the rule
  (the same Beta test and stopping rule as a node's own test): b wins, a wins, or after
  ``max_calls`` in all, no difference (a stays);
- **promote**: once decided (or stopped by an operator), every node is sent the final split:
  all calls to b when b won, else none. The decision, with its evidence, is the test's log and
  the service's log.

A command is re-sent to a node that is online and has not answered it for 30 s (a command
published while it was away expired, or was lost); a node that answers with an error (no cloud
tier, no such model) is marked failed with the error, and not sent it again. The test is
``done`` when every node has the final split or failed; a node that stays offline keeps it
``promoting`` (it is sent the final split when it is back). Killed at any point, the next
runner goes on: every step is a row in the database written before the command is published.
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

from cloudsync.fleet.commands import sent as command_sent
from cloudsync.fleet.deployments import Invalid
from cloudsync.fleet.rollouts import Conflict
from cloudsync.fleet.store import Store, Tx, dumps
from cloudsync.protocol import commands
from cloudsync.protocol.labels import check_labels, selects
from cloudsync.protocol.topics import NAME
from edged.common.abtest import Arm, verdict
from edged.common.names import MODEL_NAME

log = logging.getLogger("edgefleet.abtests")
RESEND_AFTER_MS = 30_000
COUNTER = "edged_cloud_ab_calls_total"
ACTIVE = ("running", "promoting")
CLOUD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")  # a version on the server


@dataclass
class FleetAB:
    id: str
    model: str
    b_cloud_name: str
    b_share: float = 0.5
    selector: dict[str, str] = field(default_factory=dict)
    min_calls: int = 200  # of each arm, over the nodes, before it may decide
    confidence: float = 0.95
    max_calls: int = 20_000
    latency_ms: float | None = None  # None: the nodes' [cloud] ab_latency_ms
    min_confidence: float | None = None  # None: the nodes' [cloud] ab_min_confidence
    min_score: float | None = None  # None: the nodes' [cloud] ab_min_score
    state: str = "running"  # running, promoting, done
    decided: str | None = None  # a, b, none (no difference), stopped (by an operator)
    p_b_better: float | None = None
    arms: dict[str, dict[str, int]] = field(default_factory=dict)  # since the start
    baseline: dict[str, dict[str, int]] = field(default_factory=dict)  # the counts then
    why: str = ""
    created_by: str = ""
    created_ts: int = 0
    decided_ts: int = 0
    updated_ts: int = 0
    log: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def final(self) -> dict[str, Any]:
        """The split every node gets once the test is over (b won: all of it to b)."""
        if self.decided == "b":
            return {"model": self.model, "b_cloud_name": self.b_cloud_name, "b_share": 1.0}
        return {"model": self.model, "b_cloud_name": None, "b_share": 0.0}

    def split(self) -> dict[str, Any]:
        """The split the nodes count under while it runs."""
        rule = {
            "latency_ms": self.latency_ms,
            "min_confidence": self.min_confidence,
            "min_score": self.min_score,
        }
        split = {"model": self.model, "b_cloud_name": self.b_cloud_name, "b_share": self.b_share}
        return {**split, "decided_by": "fleet", **{k: v for k, v in rule.items() if v is not None}}


def check(doc: Any) -> FleetAB:
    """A test from an API body (Invalid names the first bad field)."""
    if not isinstance(doc, dict):
        raise Invalid("body: an object {id, model, b_cloud_name, ...}")
    unknown = set(doc) - {
        "id",
        "model",
        "b_cloud_name",
        "b_share",
        "selector",
        "min_calls",
        "confidence",
        "max_calls",
        "latency_ms",
        "min_confidence",
        "min_score",
    }
    if unknown:
        raise Invalid(f"{sorted(unknown)[0]}: not a field of an A/B test")
    for key, pattern, what in (
        ("id", NAME, "1 to 64 letters, digits, _ or -, not first _"),
        ("model", MODEL_NAME, "a model's name (1 to 64 letters, digits, _, . or -)"),
        (
            "b_cloud_name",
            CLOUD_NAME,
            "the cloud model of arm b (1 to 128 letters, digits, _, . or -)",
        ),
    ):
        if not isinstance(doc.get(key), str) or not pattern.match(doc[key]):
            raise Invalid(f"{key}: {what}")
    if doc["b_cloud_name"] == doc["model"]:
        raise Invalid("b_cloud_name: arm b must be another version than the model's own")
    test = FleetAB(doc["id"], doc["model"], doc["b_cloud_name"])
    try:
        test.selector = check_labels(doc.get("selector", {}), "selector")
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    ranges: dict[str, tuple[float, float, bool]] = {  # low, high, low allowed
        "b_share": (0.0, 1.0, False),
        "confidence": (0.5, 1.0, False),
        "latency_ms": (0.0, 3_600_000.0, True),
        "min_confidence": (0.0, 1.0, True),
        "min_score": (0.0, 1.0, True),
    }
    for key, (low, high, closed) in ranges.items():
        value = doc.get(key)
        if value is None:
            continue
        if not _number(value) or not (low <= value if closed else low < value) or value > high:
            raise Invalid(f"{key}: a number {'from' if closed else 'above'} {low:g} to {high:g}")
        setattr(test, key, float(value))
    if test.b_share == 1.0 or test.confidence == 1.0:
        raise Invalid("b_share and confidence: below 1")
    for key, low in (("min_calls", 1), ("max_calls", 2)):
        value = doc.get(key, getattr(test, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 10**9:
            raise Invalid(f"{key}: a whole number, {low} to 1000000000")
        setattr(test, key, value)
    return test


def _one(rows: list[dict[str, Any]]) -> FleetAB | None:
    return FleetAB(**json.loads(rows[0]["doc"])) if rows else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ABTests:
    """The fleet's A/B tests in the database, and the runner's turn over them."""

    def __init__(
        self,
        store: Store,
        fleet: str,
        send: Callable[[str, str, bytes], bool],
        deploy_key: tuple[str, Ed25519PrivateKey] | None,
        identity: str,
        clock: Callable[[], int],
        offline_after_ms: int = 30_000,
    ) -> None:
        self.store, self.fleet, self.send, self.deploy_key = store, fleet, send, deploy_key
        self.identity, self.clock, self.offline_after_ms = identity, clock, offline_after_ms

    # ---- records ---------------------------------------------------------------------------

    def all(self) -> list[FleetAB]:
        return [
            FleetAB(**json.loads(r["doc"]))
            for r in self.store.query("SELECT doc FROM ab_tests ORDER BY id")
        ]

    def get(self, ident: str) -> FleetAB | None:
        return _one(self.store.query("SELECT doc FROM ab_tests WHERE id = ?", (ident,)))

    def nodes(self, ident: str) -> list[dict[str, Any]]:
        return self.store.query(
            "SELECT n.node, n.want, n.state, n.cmd, n.sent_ts, c.result FROM ab_test_nodes n"
            " LEFT JOIN commands c ON c.id = n.cmd WHERE n.test = ? ORDER BY n.node",
            (ident,),
        )

    def _save(self, tx: Tx, test: FleetAB, note: str = "") -> None:
        test.updated_ts = self.clock()
        if note:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(test.updated_ts / 1000))
            test.log = [*test.log[-199:], f"{stamp} {note}"]
            log.info("A/B test %s: %s", test.id, note)
        tx.execute(
            "UPDATE ab_tests SET state = ?, doc = ? WHERE id = ?",
            (test.state, dumps(test.as_dict()), test.id),
        )

    def _load(self, tx: Tx, ident: str) -> FleetAB | None:
        return _one(tx.rows("SELECT doc FROM ab_tests WHERE id = ?", (ident,)))

    # ---- what operators do -----------------------------------------------------------------

    def create(self, test: FleetAB, actor: str) -> FleetAB:
        """The test with its nodes, saved (the next turn sends them the split); Conflict if it
        cannot start."""
        if self.deploy_key is None:
            raise Conflict(
                "the service has no deploy key ([service] deploy_key) to sign the"
                " nodes' cloud-ab commands"
            )
        now = self.clock()
        test.created_by, test.created_ts, test.log = actor, now, []
        with self.store.transaction() as tx:
            self.store.advisory_lock(tx, "abtests")
            taken = {
                row["node"]
                for row in tx.rows(
                    "SELECT n.node, t.doc FROM ab_test_nodes n JOIN ab_tests t ON t.id = n.test"
                    " WHERE t.state IN ('running', 'promoting')"
                )
                if json.loads(row["doc"])["model"] == test.model
            }
            targets = []
            for row in tx.rows(
                "SELECT node, node_labels, labels, state, last_seen FROM nodes ORDER BY node"
            ):
                labels = {**json.loads(row["node_labels"]), **json.loads(row["labels"])}
                fresh = row["state"] == "online" and row["last_seen"] >= now - self.offline_after_ms
                if fresh and selects(test.selector, labels):
                    if row["node"] in taken:
                        raise Conflict(f"{row['node']} is in another A/B test of {test.model}")
                    targets.append(row["node"])
            if not targets:
                raise Conflict("no online node is picked by the selector")
            made = tx.execute(
                "INSERT INTO ab_tests (id, state, doc) VALUES (?, 'running', '{}')"
                " ON CONFLICT (id) DO NOTHING",
                (test.id,),
            )
            if made.rowcount != 1:
                raise Conflict(f"A/B test {test.id} exists")
            tx.executemany(
                "INSERT INTO ab_test_nodes (test, node, want, state, sent_ts) VALUES"
                " (?, ?, 'split', 'pending', 0)",
                [(test.id, node) for node in targets],
            )
            test.baseline = self._counted(tx, test)
            test.arms = {arm: {"calls": 0, "good": 0} for arm in ("a", "b")}
            self._save(
                tx,
                test,
                f"started by {actor} on {len(targets)} nodes: {test.b_share:.0%}"
                f" of {test.model}'s cloud calls to {test.b_cloud_name}",
            )
        return test

    def stop(self, ident: str, actor: str) -> FleetAB:
        """An operator ends a running test: arm a alone (KeyError: none such; Conflict: it
        is over)."""
        with self.store.transaction() as tx:
            self.store.advisory_lock(tx, "abtests")
            test = self._load(tx, ident)
            if test is None:
                raise KeyError(ident)
            if test.state != "running":
                raise Conflict(f"A/B test {ident} is {test.state} ({test.decided})")
            self._decide(tx, test, "stopped", f"stopped by {actor}: arm a alone")
        return test

    # ---- the runner ------------------------------------------------------------------------

    def turn(self) -> None:
        """Each active test: count, decide, and send what nodes lack."""
        for row in self.store.query(
            "SELECT id FROM ab_tests WHERE state IN ('running', 'promoting') ORDER BY id"
        ):
            self.advance(row["id"])

    def advance(self, ident: str) -> None:
        sends: list[tuple[str, str, bytes]] = []
        with self.store.transaction() as tx:
            self.store.advisory_lock(tx, "abtests")
            test = self._load(tx, ident)
            if test is None or test.state not in ACTIVE:
                return
            if test.state == "running":
                self._count(tx, test)
            sends = self._commands(tx, test)
        for node, cmd_id, payload in sends:  # after the commit: a lost one is sent again
            if not self.send(node, cmd_id, payload):
                return  # the broker is away: the next turn

    def _count(self, tx: Tx, test: FleetAB) -> None:
        now = self._counted(tx, test)
        arms = {
            arm: {k: now[arm][k] - test.baseline.get(arm, {}).get(k, 0) for k in now[arm]}
            for arm in now
        }
        if arms == test.arms:
            return
        test.arms = arms
        a, b = (Arm(arms[x]["calls"], arms[x]["good"]) for x in ("a", "b"))
        decided, p_b = verdict(a, b, test.min_calls, test.confidence, test.max_calls)
        test.p_b_better = None if p_b is None else round(p_b, 4)
        evidence = (
            f"good calls: a {a.good} of {a.calls}, b {b.good} of {b.calls};"
            f" P(b better) = {p_b if p_b is not None else 0.5:.4f}"
        )
        if decided == "b":
            self._decide(
                tx,
                test,
                decided,
                f"arm b ({test.b_cloud_name}) is better, it gets every call ({evidence})",
            )
        elif decided == "a":
            self._decide(
                tx,
                test,
                decided,
                f"arm a is better, arm b ({test.b_cloud_name}) gets no more calls ({evidence})",
            )
        elif decided == "none":
            self._decide(
                tx,
                test,
                decided,
                f"no difference after {test.max_calls} calls: arm a stays ({evidence})",
            )
        else:
            self._save(tx, test)

    def _decide(self, tx: Tx, test: FleetAB, decided: str, why: str) -> None:
        test.state, test.decided, test.why, test.decided_ts = (
            "promoting",
            decided,
            why,
            self.clock(),
        )
        tx.execute(
            "UPDATE ab_test_nodes SET want = 'final', state = 'pending', cmd = NULL,"
            " sent_ts = 0 WHERE test = ?",
            (test.id,),
        )
        self._save(tx, test, f"decided: {why}")

    def _counted(self, tx: Tx, test: FleetAB) -> dict[str, dict[str, int]]:
        """The test's nodes' counts of the model's A/B calls, per arm, as the counters hold
        them now."""
        arms = {arm: {"calls": 0, "good": 0} for arm in ("a", "b")}
        rows = tx.rows(
            "SELECT labels, value FROM counters WHERE name = ? AND node IN"
            " (SELECT node FROM ab_test_nodes WHERE test = ?)",
            (COUNTER, test.id),
        )
        for row in rows:
            labels = json.loads(row["labels"])
            if labels.get("model") != test.model:
                continue
            arm = arms["b" if labels.get("cloud_model") == test.b_cloud_name else "a"]
            arm["calls"] += int(row["value"])
            arm["good"] += int(row["value"]) if labels.get("good") == "true" else 0
        return arms

    def _commands(self, tx: Tx, test: FleetAB) -> list[tuple[str, str, bytes]]:
        """Nodes whose command was answered marked; what is to send (now or again) signed,
        kept in ``commands`` and marked sent, in the caller's transaction."""
        now = self.clock()
        sends = []
        fresh_after = now - self.offline_after_ms
        for row in tx.rows(
            "SELECT n.node, n.want, n.cmd, n.sent_ts, c.result, s.state AS online, s.last_seen"
            " FROM ab_test_nodes n LEFT JOIN commands c ON c.id = n.cmd"
            " LEFT JOIN nodes s ON s.node = n.node WHERE n.test = ? AND n.state IN"
            " ('pending', 'sent')",
            (test.id,),
        ):
            if row["result"] is not None:
                ok = bool(json.loads(row["result"]).get("ok"))
                tx.execute(
                    "UPDATE ab_test_nodes SET state = ? WHERE test = ? AND node = ?",
                    ("done" if ok else "failed", test.id, row["node"]),
                )
                continue
            online = row["online"] == "online" and (row["last_seen"] or 0) >= fresh_after
            if not online or (row["cmd"] and row["sent_ts"] > now - RESEND_AFTER_MS):
                continue
            assert self.deploy_key is not None  # checked when the test was made
            kid, key = self.deploy_key
            args = test.split() if row["want"] == "split" else test.final()
            target = f"{self.fleet}/{row['node']}"
            cmd_id, payload = commands.sign(key, kid, self.identity, target, "cloud-ab", args)
            command_sent(
                tx, cmd_id, row["node"], "cloud-ab", self.identity, kid, f"ab-test {test.id}", now
            )
            tx.execute(
                "UPDATE ab_test_nodes SET state = 'sent', cmd = ?, sent_ts = ? WHERE"
                " test = ? AND node = ?",
                (cmd_id, now, test.id, row["node"]),
            )
            sends.append((row["node"], cmd_id, payload))
        if test.state == "promoting":
            left = tx.rows(
                "SELECT COUNT(*) AS n FROM ab_test_nodes WHERE test = ? AND state IN"
                " ('pending', 'sent')",
                (test.id,),
            )[0]["n"]
            if not left:
                failed = tx.rows(
                    "SELECT COUNT(*) AS n FROM ab_test_nodes WHERE test = ? AND state = 'failed'",
                    (test.id,),
                )[0]["n"]
                test.state = "done"
                self._save(tx, test, f"done: every node has the final split ({failed} failed)")
        return sends

"""The fleet's A/B tests (cloudsync.fleet.abtests) on a real database (SQLite and PostgreSQL):
nodes' births, telemetry and command results go through the registry as the service writes
them; what the runner publishes is recorded at the seam (the service gives it paho's publish)
and each command is verified as a node verifies it. The end to end run, with simulated nodes
over a real Mosquitto and the service's process, is tests/integration/cloudsync/
test_fleet_deploy.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.abtests import RESEND_AFTER_MS, ABTests, check
from cloudsync.fleet.deployments import Invalid
from cloudsync.fleet.registry import Message, Registry
from cloudsync.fleet.rollouts import Conflict
from cloudsync.fleet.store import Store
from cloudsync.protocol.commands import Verifier
from cloudsync.protocol.envelope import Envelope

NOW = 1_800_000_000_000
KEY = Ed25519PrivateKey.generate()
MODEL, B = "intent", "intent-v2"


class Fleet:
    """Nodes n0..n{count-1} born online, and the runner's seam."""

    def __init__(self, store: Store, tmp_path: Path, count: int = 4, site: str = "a") -> None:
        self.store, self.clock, self.seq = store, NOW, 0
        self.sent: list[tuple[str, str, dict[str, Any]]] = []  # node, command id, args
        self.verifier = Verifier("", {"deploy-1": KEY.public_key()}, tmp_path / "nonces.db")
        self.tests = ABTests(
            store, "f1", self.send, ("deploy-1", KEY), "edgefleet", lambda: self.clock, 30_000
        )
        self.registry = Registry(store, offline_after_s=30)
        for i in range(count):
            self.born(f"n{i}", {"site": site if i < count - 1 else "other"})

    def message(self, kind: str, node: str, body: dict[str, Any], cmd_id: str = "") -> None:
        self.seq += 1
        env = Envelope(
            node,
            self.seq,
            body,
            ts=self.clock,
            id=f"r{self.seq}",
            extra={"priority": "telemetry", "epoch": "e1"},
        )
        done = self.registry.ingest([Message(kind, node, env.encode(), self.clock, cmd_id)])
        assert done.poison == 0

    def born(self, node: str, labels: dict[str, str]) -> None:
        self.message("status", node, {"state": "online", "labels": labels})

    def send(self, node: str, cmd_id: str, payload: bytes) -> bool:
        self.verifier.target = f"f1/{node}"
        command = self.verifier.check(cmd_id, payload)  # as the node checks it
        assert command.name == "cloud-ab" and command.issuer == "edgefleet"
        self.sent.append((node, cmd_id, command.args))
        return True

    def answer(self, ok: bool = True, error: str = "") -> None:
        """Every command sent so far answered, as cloudsync answers."""
        for node, cmd_id, _ in self.sent:
            body = {"name": "cloud-ab", "ok": ok, **({"result": {}} if ok else {"error": error})}
            self.message("cmd-result", node, body, cmd_id)

    def calls(self, node: str, a: tuple[int, int], b: tuple[int, int]) -> None:
        """A telemetry record: arm a's (calls, good) and arm b's, as a node counts them."""
        arms = {MODEL: {"calls": a[0], "good": a[1]}, B: {"calls": b[0], "good": b[1]}}
        self.message("telemetry", node, {"metrics": {"models": [], "cloud_ab": {MODEL: arms}}})


def start(fleet: Fleet, **more: Any) -> Any:
    doc = {
        "id": "t1",
        "model": MODEL,
        "b_cloud_name": B,
        "selector": {"site": "a"},
        "min_calls": 100,
        **more,
    }
    return fleet.tests.create(check(doc), "alice")


@pytest.mark.parametrize("better", ["a", "b"])
def test_a_fleet_test_splits_adds_the_nodes_up_decides_and_promotes(
    store: Store, tmp_path: Path, better: str
) -> None:
    fleet = Fleet(store, tmp_path)
    fleet.calls("n0", (50, 50), (50, 40))  # counted before the test: not its evidence
    test = start(fleet, latency_ms=250)
    assert test.baseline == {"a": {"calls": 50, "good": 50}, "b": {"calls": 50, "good": 40}}
    fleet.tests.turn()
    # the three nodes of site a (not the fourth) get the split, counted by the fleet's rule
    assert [(n, args) for n, _, args in fleet.sent] == [
        (
            f"n{i}",
            {
                "model": MODEL,
                "b_cloud_name": B,
                "b_share": 0.5,
                "decided_by": "fleet",
                "latency_ms": 250.0,
            },
        )
        for i in range(3)
    ]
    fleet.answer()
    fleet.tests.turn()
    assert {r["node"]: r["state"] for r in fleet.tests.nodes("t1")} == dict.fromkeys(
        ("n0", "n1", "n2"), "done"
    )
    # each node alone has too few calls to decide; the three together have enough
    good, bad = (38, 30) if better == "a" else (30, 38)
    for node in ("n0", "n1", "n2"):
        fleet.calls(node, (40, good), (40, bad))
        fleet.calls("n3", (40, 0), (40, 40))  # not in the test: not counted
        fleet.tests.turn()
        got = fleet.tests.get("t1")
        assert got is not None
        if node != "n2":
            assert got.state == "running" and got.p_b_better is None  # < 100 calls an arm
    assert got.arms == {"a": {"calls": 120, "good": 3 * good}, "b": {"calls": 120, "good": 3 * bad}}
    assert got.state == "promoting" and got.decided == better
    assert (got.p_b_better > 0.95) if better == "b" else (got.p_b_better < 0.05)
    evidence = f"good calls: a {3 * good} of 120, b {3 * bad} of 120; P(b better) = "
    assert evidence in got.why and got.log[-1].endswith(f"decided: {got.why}")
    final = (
        {"model": MODEL, "b_cloud_name": B, "b_share": 1.0}
        if better == "b"
        else {"model": MODEL, "b_cloud_name": None, "b_share": 0.0}
    )
    assert [args for _, _, args in fleet.sent[3:]] == [final] * 3
    fleet.calls("n0", (5, 5), (5, 0))  # late counts change nothing decided
    fleet.answer()
    fleet.tests.turn()
    done = fleet.tests.get("t1")
    assert done is not None and done.state == "done" and done.arms == got.arms
    assert done.log[-1].endswith("done: every node has the final split (0 failed)")
    fleet.tests.turn()
    assert len(fleet.sent) == 6  # nothing more to send


def test_a_node_that_does_not_answer_is_sent_again_one_that_fails_is_not(
    store: Store, tmp_path: Path
) -> None:
    fleet = Fleet(store, tmp_path, count=3, site="a")  # n0, n1 in site a
    start(fleet)
    fleet.tests.turn()
    assert [n for n, _, _ in fleet.sent] == ["n0", "n1"]
    first = fleet.sent[:]
    fleet.sent = [first[1]]
    fleet.answer(ok=False, error="edged: 404: this edged has no cloud tier ([cloud] url)")
    fleet.clock += RESEND_AFTER_MS - 1
    fleet.tests.turn()
    assert len(fleet.sent) == 1  # n0 waits: not yet 30 s
    fleet.clock += 2
    fleet.born("n0", {"site": "a"})  # still online
    fleet.tests.turn()
    assert [n for n, _, _ in fleet.sent[1:]] == ["n0"] and fleet.sent[1][1] != first[0][1]
    rows = {r["node"]: r for r in fleet.tests.nodes("t1")}
    assert rows["n1"]["state"] == "failed" and "no cloud tier" in rows["n1"]["result"]
    assert rows["n0"]["state"] == "sent" and rows["n0"]["cmd"] == fleet.sent[1][1]
    # an operator stops it: arm a alone, sent to the node that failed the split too
    stopped = fleet.tests.stop("t1", "bob")
    assert stopped.state == "promoting" and stopped.decided == "stopped"
    assert stopped.why == "stopped by bob: arm a alone"
    with pytest.raises(Conflict, match="promoting"):
        fleet.tests.stop("t1", "bob")
    with pytest.raises(KeyError):
        fleet.tests.stop("t9", "bob")
    fleet.sent = []
    fleet.clock += 60_000  # offline now (no heartbeat for a minute): nothing is sent
    fleet.tests.turn()
    assert fleet.sent == []
    fleet.born("n0", {"site": "a"})
    fleet.born("n1", {"site": "a"})
    fleet.tests.turn()
    final = {"model": MODEL, "b_cloud_name": None, "b_share": 0.0}
    assert sorted((n, args == final) for n, _, args in fleet.sent) == [("n0", True), ("n1", True)]
    fleet.answer()
    fleet.tests.turn()
    assert fleet.tests.get("t1").state == "done"  # type: ignore[union-attr]


def test_what_cannot_start_is_refused(store: Store, tmp_path: Path) -> None:
    fleet = Fleet(store, tmp_path)
    start(fleet)
    with pytest.raises(Conflict, match="exists"):
        fleet.tests.create(
            check({"id": "t1", "model": "other", "b_cloud_name": "x", "selector": {"site": "a"}}),
            "alice",
        )
    with pytest.raises(Conflict, match="n0 is in another A/B test of intent"):
        start(fleet, id="t2")
    with pytest.raises(Conflict, match="no online node"):
        start(fleet, id="t3", selector={"site": "nowhere"})
    keyless = ABTests(store, "f1", fleet.send, None, "edgefleet", lambda: NOW)
    with pytest.raises(Conflict, match="deploy key"):
        keyless.create(check({"id": "t4", "model": MODEL, "b_cloud_name": B}), "alice")
    assert [t.id for t in fleet.tests.all()] == ["t1"]


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ([], "body"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "share": 0.5}, "share"),
        ({"id": "_t", "model": "m", "b_cloud_name": "b"}, "id"),
        ({"id": "t", "model": "m/../x", "b_cloud_name": "b"}, "model"),
        ({"id": "t", "model": "m", "b_cloud_name": "b" * 129}, "b_cloud_name"),
        ({"id": "t", "model": "m", "b_cloud_name": "m"}, "b_cloud_name"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "b_share": 0}, "b_share"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "b_share": 1}, "b_share"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "b_share": True}, "b_share"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "confidence": 0.5}, "confidence"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "min_calls": 0}, "min_calls"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "max_calls": 1.5}, "max_calls"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "latency_ms": -1}, "latency_ms"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "min_confidence": 2}, "min_confidence"),
        ({"id": "t", "model": "m", "b_cloud_name": "b", "selector": {"a b": "c"}}, "selector"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(doc: Any, field: str) -> None:
    with pytest.raises(Invalid, match=f"^{field}"):
        check(doc)

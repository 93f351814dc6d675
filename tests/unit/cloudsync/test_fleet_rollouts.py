"""The rollout state machine's guards (cloudsync.fleet.rollouts) on a real SQLite database, where
timing cannot be arranged between processes: a runner working from a record read before an
operator paused or aborted the rollout neither sends the version to another node nor writes the
old record back. What the runner publishes is recorded at the seam (the service gives it
paho's publish); the end-to-end runs are tests/integration/cloudsync/test_fleet_deploy.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.deployments import Deployments, Invalid
from cloudsync.fleet.registry import Message, Registry
from cloudsync.fleet.rollouts import Rollouts, Stale, check, in_window, parse_window
from cloudsync.fleet.store import Store
from cloudsync.protocol import manifest
from cloudsync.protocol.envelope import Envelope

NOW = 1_800_000_000_000
KEY = Ed25519PrivateKey.generate()


def body(version: int, model: str = "m", ident: str = "r1", **more: Any) -> dict[str, Any]:
    files = [{"path": "m.onnx", "sha256": "a" * 64, "length": 1}]
    doc = manifest.sign(manifest.make(model, version, files, lifetime_s=1e9), {"k": KEY})
    return {"id": ident, "manifest": doc, "urls": {"m.onnx": "https://cdn/m"}, **more}


class Runner:
    def __init__(self, tmp_path: Path, nodes: int = 10) -> None:
        self.store = Store(str(tmp_path / "fleet.db"))
        self.clock = NOW
        self.published: list[tuple[str, int]] = []
        self.commands: list[str] = []
        self.rollouts = Rollouts(
            self.store, Deployments(self.store, lambda: self.clock), "f1", self.publish,
            self.send, ("deploy-1", KEY), "edgefleet", lambda: self.clock, 30_000,
        )  # fmt: skip
        self.desired: dict[str, list[dict[str, Any]]] = {}
        births = [Message("status", f"n{i}", Envelope(f"n{i}", 1, {"state": "online"},
                                                       ts=NOW).encode(), NOW)
                  for i in range(nodes)]  # fmt: skip
        Registry(self.store).ingest(births)

    def publish(self, node: str, entries: list[dict[str, Any]]) -> bool:
        """As the service publishes: the node's desired state written at once."""
        versions = [e["manifest"]["signed"]["version"] for e in entries]
        self.published.append((node, versions[-1] if versions else 0))
        self.desired[node] = entries
        with self.store.transaction() as tx:
            Registry.desired(tx, node, entries, len(self.published), self.clock)
        return True

    def report(self, node: str, model: str, version: int, step: str) -> None:
        """The node's delivery event, through the registry as the service writes it."""
        event = {"delivery": {"model": model, "version": version, "step": step}}
        payload = Envelope(node, 1, event, ts=self.clock).encode()
        Registry(self.store).ingest([Message("events", node, payload, self.clock)])

    def send(self, node: str, cmd_id: str, payload: bytes) -> bool:
        self.commands.append(node)
        return True


def test_a_runner_with_an_old_record_neither_delivers_nor_overwrites(tmp_path: Path) -> None:
    run = Runner(tmp_path)
    made = run.rollouts.create(check(body(2, stages=[0.2, 1.0], max_unavailable=1), None, NOW),
                               "alice")  # fmt: skip
    assert made.state == "running" and made.max_unavailable == 1
    stale = run.rollouts.get("r1")
    assert stale is not None
    run.rollouts.advance(stale)  # one node sent (one at a time)
    assert len(run.published) == 1
    old = run.rollouts.get("r1")
    run.rollouts.act("r1", "abort", "bob")  # meanwhile, an operator aborts
    assert old is not None
    # the runner's turn, still holding the record it read before the abort: the next node of
    # the stage is not sent the version, and the old record is not written back
    run.clock += 1000
    with pytest.raises(Stale):
        run.rollouts.advance(old)
    assert len(run.published) == 1
    with pytest.raises(Stale), run.store.transaction() as tx:
        run.rollouts.save(tx, old, "a stale write")
    kept = run.rollouts.get("r1")
    assert kept is not None and kept.state == "aborting" and kept.why == "aborted by bob"
    # the turn rolls back the node that was sent the version, and only it
    run.rollouts.turn()
    assert run.commands == [run.published[0][0]]
    assert run.published[-1] == (run.published[0][0], 0)  # its desired state before: none
    done = run.rollouts.get("r1")
    assert done is not None and done.state == "aborted"


def test_a_pause_stops_deliveries_that_a_turn_had_planned(tmp_path: Path) -> None:
    run = Runner(tmp_path)
    run.rollouts.create(check(body(2, stages=[1.0], max_unavailable=3), None, NOW), "a")
    planned = run.rollouts.get("r1")
    assert planned is not None
    run.rollouts.act("r1", "pause", "bob")
    with pytest.raises(Stale):
        run.rollouts.advance(planned)  # it would send three nodes the version
    assert run.published == []
    run.rollouts.turn()  # paused: nothing
    assert run.published == []
    run.rollouts.act("r1", "resume", "bob")
    run.rollouts.turn()
    assert len(run.published) == 3


def test_windows() -> None:
    assert parse_window(None) is None and parse_window("22:00-04:30") == (1320, 270)
    for bad in ("10:75-01:00", "24:00-01:00", "1:00-02:00", "10:00-10:00", 5, "aa:bb-cc:dd"):
        with pytest.raises(ValueError, match="window"):
            parse_window(bad)
    minute = 60_000
    midnight = NOW - NOW % (1440 * minute)
    assert in_window("22:00-04:30", midnight + 23 * 60 * minute)
    assert in_window("22:00-04:30", midnight + 4 * 60 * minute)
    assert not in_window("22:00-04:30", midnight + 12 * 60 * minute)
    assert in_window("09:00-17:00", midnight + 9 * 60 * minute)
    assert not in_window("09:00-17:00", midnight + 17 * 60 * minute)


def test_two_rollouts_of_two_models_on_one_node_keep_each_others_entries(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    for model, ident in (("a", "ra"), ("b", "rb")):
        run.rollouts.create(check(body(2, model, ident, stages=[1.0]), None, NOW), "alice")
    run.rollouts.turn()  # both deliver to n0 in one turn
    models = [(e["manifest"]["signed"]["model"], e["manifest"]["signed"]["version"])
              for e in run.desired["n0"]]  # fmt: skip
    assert models == [("a", 2), ("b", 2)]  # the second publish kept the first's entry
    run.report("n0", "a", 2, "active")
    run.report("n0", "b", 2, "failed")
    run.rollouts.turn()  # rb aborts (and rolls back b only); ra is done
    run.rollouts.turn()
    states = {r.id: r.state for r in run.rollouts.all()}
    assert states == {"ra": "done", "rb": "aborted"}, states
    kept = [(e["manifest"]["signed"]["model"], e["manifest"]["signed"]["version"])
            for e in run.desired["n0"]]  # fmt: skip
    assert kept == [("a", 2)]  # b's entry before: none; a's stays


def test_a_node_offline_does_not_time_out_and_one_offline_at_its_turn_waits(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=4)
    away = Envelope("n3", 2, {"state": "offline"}, ts=NOW).encode()
    made = check(body(2, stages=[1.0], activation_timeout_s=5, max_unavailable=4), None, NOW)
    run.rollouts.create(made, "a")
    Registry(run.store).ingest([Message("status", "n3", away, NOW)])  # gone before its turn
    run.rollouts.turn()
    sent = [node for node, _ in run.published]
    assert sorted(sent) == ["n0", "n1", "n2"]
    will = Envelope(sent[0], 2, {"state": "offline"}, ts=NOW + 1).encode()
    Registry(run.store).ingest([Message("status", sent[0], will, NOW + 1)])
    for node in sent[1:]:
        run.report(node, "m", 2, "active")
    run.clock += 60_000  # far past the activation timeout, for the offline node too
    beats = [Message("heartbeat", n, Envelope(n, 3, {"models": {"m": "2"}}, ts=run.clock)
                     .encode(), run.clock) for n in sent[1:]]  # fmt: skip
    Registry(run.store).ingest(beats)
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "running", got.log  # not aborted for it
    assert "n3" not in sent  # offline at its turn: not sent
    back = Envelope(sent[0], 4, {"state": "online"}, ts=run.clock).encode()
    Registry(run.store).ingest([Message("status", sent[0], back, run.clock)])
    run.report(sent[0], "m", 2, "active")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "done", got.log
    assert "1 offline, left pending" in got.log[-1]


def telemetry(node: str, ts: int, version: str, requests: int, fallbacks: int) -> Message:
    metrics = {
        "models": [{"model": "m", "version": version, "requests": requests,
                    "outcomes": {"ok": requests}, "p95_ms": 10.0}],
        "routes": {"m": {"local": requests - fallbacks, "fallback": fallbacks}},
    }  # fmt: skip
    return Message("telemetry", node, Envelope(node, 5, {"metrics": metrics}, ts=ts).encode(), ts)


def test_the_gates_judge_the_soak_to_its_end_and_again_after_a_pause(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=4)
    made = check(body(2, stages=[0.25, 1.0], soak_s=60, max_unavailable=4), None, NOW)
    run.rollouts.create(made, "a")
    run.rollouts.turn()
    canary = run.published[0][0]
    run.report(canary, "m", 2, "active")
    run.rollouts.turn()  # soaking now
    soaking = run.rollouts.get("r1")
    assert soaking is not None and soaking.phase == "soak"
    run.rollouts.act("r1", "pause", "bob")
    run.clock += 120_000  # the soak's time passes while paused: the canary falls back a lot
    others = [f"n{i}" for i in range(4) if f"n{i}" != canary]
    Registry(run.store).ingest(
        [telemetry(canary, run.clock, "2", 100, 60)]
        + [telemetry(n, run.clock, "1", 100, 1) for n in others],
        frozenset({"m"}),
    )
    run.rollouts.act("r1", "resume", "bob")  # the soak starts again: what came is judged anew
    resumed = run.rollouts.get("r1")
    assert resumed is not None and resumed.soak_since == run.clock
    run.clock += 1000
    Registry(run.store).ingest(
        [telemetry(canary, run.clock, "2", 100, 60)]
        + [telemetry(n, run.clock, "1", 100, 1) for n in others],
        frozenset({"m"}),
    )
    run.rollouts.turn()
    judged = run.rollouts.get("r1")
    assert judged is not None and judged.state == "aborting", judged.log
    assert judged.why.startswith("fallback rate 60.0% against 1.0%"), judged.why


def test_telemetry_is_kept_while_a_soak_judges_it_and_an_hour_besides(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    rows = [telemetry("n0", NOW - age, "1", 10, 0) for age in (7_200_000, 1_800_000, 0)]
    Registry(run.store).ingest(rows, frozenset({"m"}))
    assert run.rollouts.prune() == 2  # the one two hours old (a row for the model, one for routes)
    left = run.store.query("SELECT ts FROM telemetry ORDER BY ts")
    assert {r["ts"] for r in left} == {NOW - 1_800_000, NOW}


def test_a_removal_is_deployed_not_rolled_out() -> None:
    removal = manifest.sign(manifest.make("m", 3, [], lifetime_s=1e9, remove=True), {"k": KEY})
    with pytest.raises(Invalid, match=r"^manifest.signed.remove: a removal is deployed"):
        check({"id": "r1", "manifest": removal, "urls": {}}, None, NOW)


def test_a_package_and_a_model_of_the_same_name_are_two_rollouts_on_one_node(
    tmp_path: Path,
) -> None:
    """A release of edged (a package manifest, key package:edged) rolls out as a model does,
    beside a model that happens to be called edged: each keeps the other's entry, each is
    judged by its own nodes' steps."""
    run = Runner(tmp_path, nodes=1)
    files = [{"path": "edged_0.2.0_arm64.deb", "sha256": "a" * 64, "length": 1}]
    signed = manifest.make("edged", 7, files, lifetime_s=1e9, deb_version="0.2.0")
    package = {"id": "rp", "manifest": manifest.sign(signed, {"k": KEY}), "stages": [1.0],
               "urls": {"edged_0.2.0_arm64.deb": "https://cdn/edged.deb"}}  # fmt: skip
    made = check(package, None, NOW)
    assert made.model == "package:edged"
    run.rollouts.create(made, "alice")
    run.rollouts.create(check(body(2, "edged", "rm", stages=[1.0]), None, NOW), "alice")
    run.rollouts.turn()
    kinds = sorted((e["manifest"]["signed"]["type"], e["manifest"]["signed"]["version"])
                   for e in run.desired["n0"])  # fmt: skip
    assert kinds == [("model", 2), ("package", 7)]
    run.report("n0", "package:edged", 7, "active")  # the updater committed it
    run.report("n0", "edged", 2, "rolled-back")  # the model's version did not hold
    run.rollouts.turn()
    run.rollouts.turn()
    assert {r.id: r.state for r in run.rollouts.all()} == {"rp": "done", "rm": "aborted"}
    assert [e["manifest"]["signed"]["type"] for e in run.desired["n0"]] == ["package"]

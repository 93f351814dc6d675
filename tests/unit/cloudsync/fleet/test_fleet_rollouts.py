"""The rollout state machine's guards (cloudsync.fleet.rollouts) on a real SQLite database, where
timing cannot be arranged between processes: a runner working from a record read before an
operator paused or aborted the rollout neither sends the version to another node nor writes the
old record back. What the runner publishes is recorded at the seam (the service gives it
paho's publish); the end-to-end runs are tests/integration/cloudsync/test_fleet_deploy.py."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.deployments import Deployments, Invalid
from cloudsync.fleet.deployments import check as check_deployment
from cloudsync.fleet.gates import Gates, pick
from cloudsync.fleet.registry import Message, Registry, model_of
from cloudsync.fleet.rollouts import (
    Conflict,
    Rollout,
    Rollouts,
    Stale,
    check,
    in_window,
    parse_window,
    with_entry,
)
from cloudsync.fleet.store import Store, Tx, dumps
from cloudsync.protocol import manifest
from cloudsync.protocol.envelope import Envelope, decode

NOW = 1_800_000_000_000
KEY = Ed25519PrivateKey.generate()


def body(
    version: int,
    model: str = "m",
    ident: str = "r1",
    targets: dict[str, Any] | None = None,
    **more: Any,
) -> dict[str, Any]:
    files = [{"path": "m.onnx", "sha256": "a" * 64, "length": 1}]
    signed = manifest.make(model, version, files, lifetime_s=1e9, targets=targets)
    doc = manifest.sign(signed, {"k": KEY})
    return {"id": ident, "manifest": doc, "urls": {"m.onnx": "https://cdn/m"}, **more}


class Runner:
    def __init__(self, tmp_path: Path, nodes: int = 10) -> None:
        self.store = Store(str(tmp_path / "fleet.db"))
        self.clock = NOW
        self.published: list[tuple[str, int]] = []
        self.commands: list[str] = []
        self.payloads: list[tuple[str, bytes]] = []  # (command id, payload) as sent
        self.up = True  # whether the broker takes a publish
        self.down: set[str] = set()  # nodes whose publish the broker does not take
        self.broker = True  # whether the broker takes a command
        self.rollouts = self.engine(("deploy-1", KEY))
        self.desired: dict[str, list[dict[str, Any]]] = {}
        births = [
            Message(
                "status", f"n{i}", Envelope(f"n{i}", 1, {"state": "online"}, ts=NOW).encode(), NOW
            )
            for i in range(nodes)
        ]
        Registry(self.store).ingest(births)

    def engine(self, deploy_key: tuple[str, Ed25519PrivateKey] | None) -> Rollouts:
        """A rollouts engine over this runner's store, clock and broker."""
        deployments = Deployments(self.store, lambda: self.clock)
        return Rollouts(
            self.store,
            deployments,
            "f1",
            self.publish,
            self.send,
            deploy_key,
            "edgefleet",
            lambda: self.clock,
        )

    def publish(self, node: str, entries: list[dict[str, Any]]) -> bool:
        """As the service publishes: the node's desired state written at once."""
        if not self.up or node in self.down:
            return False
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
        if not self.broker:
            return False
        self.commands.append(node)
        self.payloads.append((cmd_id, payload))
        return True


def test_a_runner_with_an_old_record_neither_delivers_nor_overwrites(tmp_path: Path) -> None:
    run = Runner(tmp_path)
    made = run.rollouts.create(
        check(body(2, stages=[0.2, 1.0], max_unavailable=1), None, NOW), "alice"
    )
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
    models = [
        (e["manifest"]["signed"]["model"], e["manifest"]["signed"]["version"])
        for e in run.desired["n0"]
    ]
    assert models == [("a", 2), ("b", 2)]  # the second publish kept the first's entry
    run.report("n0", "a", 2, "active")
    run.report("n0", "b", 2, "failed")
    run.rollouts.turn()  # rb aborts (and rolls back b only); ra is done
    run.rollouts.turn()
    states = {r.id: r.state for r in run.rollouts.all()}
    assert states == {"ra": "done", "rb": "aborted"}, states
    kept = [
        (e["manifest"]["signed"]["model"], e["manifest"]["signed"]["version"])
        for e in run.desired["n0"]
    ]
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
    beats = [
        Message(
            "heartbeat", n, Envelope(n, 3, {"models": {"m": "2"}}, ts=run.clock).encode(), run.clock
        )
        for n in sent[1:]
    ]
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
        "models": [
            {
                "model": "m",
                "version": version,
                "requests": requests,
                "outcomes": {"ok": requests},
                "p95_ms": 10.0,
            }
        ],
        "routes": {"m": {"local": requests - fallbacks, "fallback": fallbacks}},
    }
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
    refused = (
        "manifest.signed.remove: a removal is deployed (POST /v1/deployments), not rolled out:"
        " there is no version to watch in canaries"
    )
    with pytest.raises(Invalid, match=f"^{re.escape(refused)}$"):
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
    package = {
        "id": "rp",
        "manifest": manifest.sign(signed, {"k": KEY}),
        "stages": [1.0],
        "urls": {"edged_0.2.0_arm64.deb": "https://cdn/edged.deb"},
    }
    made = check(package, None, NOW)
    assert made.model == "package:edged"
    run.rollouts.create(made, "alice")
    run.rollouts.create(check(body(2, "edged", "rm", stages=[1.0]), None, NOW), "alice")
    run.rollouts.turn()
    kinds = sorted(
        (e["manifest"]["signed"]["type"], e["manifest"]["signed"]["version"])
        for e in run.desired["n0"]
    )
    assert kinds == [("model", 2), ("package", 7)]
    run.report("n0", "package:edged", 7, "active")  # the updater committed it
    run.report("n0", "edged", 2, "rolled-back")  # the model's version did not hold
    run.rollouts.turn()
    run.rollouts.turn()
    assert {r.id: r.state for r in run.rollouts.all()} == {"rp": "done", "rm": "aborted"}
    assert [e["manifest"]["signed"]["type"] for e in run.desired["n0"]] == ["package"]


# ---- the API body: check() ------------------------------------------------------------------

ID = "id: 1 to 64 letters, digits, _ or -, not first _"
STAGES = "stages: 1 to 10 growing shares of the nodes (0-1], the last 1"
SOAK = "soak_s: 0 to 604800 seconds"
TIMEOUT = "activation_timeout_s: 1 to 86400 seconds"
MOST = "max_unavailable: nodes installing at once (0: a tenth of the nodes)"
GATES = (
    "gates: an object of max_failure, max_p95_increase, max_fallback, min_requests,"
    " max_confidence_drop, numbers >= 0"
)
WINDOW = "window: HH:MM-HH:MM (UTC), 00:00 to 23:59"
DEPLOYMENT = "deployment: a deployment's id"


def test_a_body_with_only_its_id_and_entry_gets_the_defaults() -> None:
    doc = body(3)
    made = check(doc, None, NOW)
    assert made.as_dict() == {
        "id": "r1",
        "model": "m",
        "version": 3,
        "entry": {"manifest": doc["manifest"], "urls": doc["urls"]},
        "selector": {},
        "deployment": None,
        "stages": [0.1, 1.0],
        "soak_s": 600.0,
        "gates": asdict(Gates()),
        "max_unavailable": 0,
        "window": None,
        "activation_timeout_s": 600.0,
        "state": "running",
        "stage": 0,
        "phase": "deliver",
        "soak_since": 0,
        "soak_until": 0,
        "why": "",
        "created_by": "",
        "created_ts": 0,
        "updated_ts": 0,
        "log": [],
        "rev": 0,
    }


def test_every_field_of_a_body_is_kept_in_the_rollout() -> None:
    doc = body(
        4,
        "m",
        "r-2",
        selector={"site": "a"},
        deployment="d1",
        stages=[0.25, 1],
        soak_s=0,
        gates={"max_failure": 0, "min_requests": 5},
        max_unavailable=3,
        window="22:00-04:30",
        activation_timeout_s=1,
    )
    made = check(doc, None, NOW)
    assert (made.id, made.model, made.version) == ("r-2", "m", 4)
    assert made.selector == {"site": "a"} and made.deployment == "d1"
    assert made.stages == [0.25, 1.0] and all(type(s) is float for s in made.stages)
    assert made.soak_s == 0.0 and type(made.soak_s) is float
    assert made.activation_timeout_s == 1.0 and type(made.activation_timeout_s) is float
    assert made.gates == Gates(max_failure=0, min_requests=5)
    assert made.max_unavailable == 3 and made.window == "22:00-04:30"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("stages", [1.0]),
        ("stages", [0.5, 0.5, 1.0]),
        ("stages", [k / 10 for k in range(1, 11)]),
        ("soak_s", 604800.0),
        ("soak_s", 0.5),
        ("activation_timeout_s", 86400.0),
        ("max_unavailable", 0),
        ("window", "00:00-23:59"),
        ("deployment", None),
        ("deployment", "d" * 64),
        ("selector", {}),
    ],
)
def test_the_bounds_of_each_field_are_taken(name: str, value: Any) -> None:
    made = check(body(2, **{name: value}), None, NOW)
    assert getattr(made, name) == value


@pytest.mark.parametrize("gates", [{}, {"max_fallback": 0.0}, {"min_requests": 0}])
def test_gates_of_zero_or_none_are_taken(gates: dict[str, Any]) -> None:
    assert check(body(2, gates=gates), None, NOW).gates == Gates(**gates)


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"zz": 1, "extra": 2}, "extra: not a field of a rollout"),
        ({"id": 5}, ID),
        ({"id": "_r"}, ID),
        ({"id": "r" * 65}, ID),
        ({"urls": {}}, "urls: no URL for m.onnx"),
        ({"manifest": 5}, "manifest: an object {signed, signatures}"),
        ({"selector": []}, "selector: an object of label: value"),
        ({"selector": {"site": 5}}, "selector.site: value 5: 1 to 63 of letters, digits, . _ / -"),
        ({"window": "24:00-01:00"}, WINDOW),
        ({"window": 5}, WINDOW),
        ({"window": "10:00-10:00"}, "window: two different times of day"),
        ({"deployment": 5}, DEPLOYMENT),
        ({"deployment": "_d"}, DEPLOYMENT),
        ({"deployment": ""}, DEPLOYMENT),
        ({"stages": "1"}, STAGES),
        ({"stages": []}, STAGES),
        ({"stages": [0.1] * 10 + [1.0]}, STAGES),
        ({"stages": [True, 1]}, STAGES),
        ({"stages": ["0.5", 1]}, STAGES),
        ({"stages": [0, 1]}, STAGES),
        ({"stages": [-0.5, 1]}, STAGES),
        ({"stages": [0.5, 1.5]}, STAGES),
        ({"stages": [0.6, 0.5, 1]}, STAGES),
        ({"stages": [0.5]}, STAGES),
        ({"stages": [0.5, 0.9]}, STAGES),
        ({"soak_s": "60"}, SOAK),
        ({"soak_s": True}, SOAK),
        ({"soak_s": None}, SOAK),
        ({"soak_s": -1}, SOAK),
        ({"soak_s": 604800.5}, SOAK),
        ({"activation_timeout_s": "60"}, TIMEOUT),
        ({"activation_timeout_s": True}, TIMEOUT),
        ({"activation_timeout_s": 0.999}, TIMEOUT),
        ({"activation_timeout_s": 0}, TIMEOUT),
        ({"activation_timeout_s": 86400.5}, TIMEOUT),
        ({"max_unavailable": True}, MOST),
        ({"max_unavailable": 1.0}, MOST),
        ({"max_unavailable": -1}, MOST),
        ({"max_unavailable": "2"}, MOST),
        ({"max_unavailable": None}, MOST),
        ({"gates": []}, GATES),
        ({"gates": {"max_wait": 1}}, GATES),
        ({"gates": {"max_failure": -0.01}}, GATES),
        ({"gates": {"min_requests": True}}, GATES),
        ({"gates": {"max_fallback": "0.1"}}, GATES),
        ({"gates": {"max_p95_increase": None}}, GATES),
    ],
)
def test_a_bad_field_is_named_in_the_refusal(more: dict[str, Any], message: str) -> None:
    with pytest.raises(Invalid, match=f"^{re.escape(message)}$"):
        check(body(2, **more), None, NOW)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(Invalid, match=r"^body: an object \{id, manifest, urls, \.\.\.\}$"):
        check([body(2)], None, NOW)


# ---- windows and entries -----------------------------------------------------------------------


def test_a_window_is_two_times_of_day_in_minutes() -> None:
    assert parse_window("00:00-23:59") == (0, 1439)
    assert parse_window("23:59-00:00") == (1439, 0)
    assert parse_window("19:05-20:10") == (1145, 1210)
    assert parse_window("09:30-10:00") == (570, 600)
    bad = (
        "01:00-24:00",
        "00:60-01:00",
        "01:00-01:60",
        " 01:00-02:00",
        "01:00-02:00 ",
        "0100-0200",
        "01:00 02:00",
        "",
        "01:00-02:00-03:00",
    )
    for text in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(WINDOW)}$"):
            parse_window(text)
    with pytest.raises(ValueError, match=r"^window: two different times of day$"):
        parse_window("23:59-23:59")


def test_a_window_holds_from_its_first_minute_to_before_its_last() -> None:
    minute = 60_000
    midnight = NOW - NOW % (1440 * minute) + 3 * 1440 * minute  # another day than NOW's

    def at(hour: int, minutes: int, seconds: int = 0) -> int:
        return midnight + (hour * 60 + minutes) * minute + seconds * 1000

    assert in_window(None, NOW)
    assert not in_window("09:00-17:00", at(8, 59, 59))
    assert in_window("09:00-17:00", at(9, 0))
    assert in_window("09:00-17:00", at(16, 59, 59))
    assert not in_window("09:00-17:00", at(17, 0))
    assert not in_window("22:00-04:30", at(21, 59, 59))
    assert in_window("22:00-04:30", at(22, 0))
    assert in_window("22:00-04:30", at(0, 0))
    assert in_window("22:00-04:30", at(4, 29, 59))
    assert not in_window("22:00-04:30", at(4, 30))
    assert not in_window("22:00-04:30", at(12, 0))


def entry(model: str, version: int) -> dict[str, Any]:
    doc = body(version, model)
    return {"manifest": doc["manifest"], "urls": doc["urls"]}


def test_a_nodes_entries_are_composed_in_the_order_of_their_models() -> None:
    a1, b1, b2, c1 = entry("a", 1), entry("b", 1), entry("b", 2), entry("c", 1)
    assert with_entry([c1, b1, a1], "b", b2) == [a1, b2, c1]
    assert with_entry([c1, a1], "b", b2) == [a1, b2, c1]
    assert with_entry([c1, b1, a1], "b", None) == [a1, c1]
    assert with_entry([], "b", None) == []
    odd = {"note": "no manifest"}  # kept, first (it has no model)
    upper = {**entry("A", 1)}
    assert with_entry([upper, odd], "b", b2) == [odd, upper, b2]


# ---- creating a rollout ----------------------------------------------------------------------


def make(run: Runner, ident: str = "r1", model: str = "m", **more: Any) -> Rollout:
    return run.rollouts.create(check(body(2, model, ident, **more), None, run.clock), "alice")


def states(run: Runner, ident: str = "r1") -> dict[str, str]:
    return {r["node"]: r["state"] for r in run.rollouts.nodes(ident)}


def ranked(nodes: int, ident: str = "r1") -> list[str]:
    return pick([f"n{i}" for i in range(nodes)], ident, 1.0)


def alive(run: Runner, nodes: int) -> None:
    """Each node's heartbeat now (it is seen: fresh)."""
    beats = [
        Message("heartbeat", f"n{i}", Envelope(f"n{i}", 9, {}, ts=run.clock).encode(), run.clock)
        for i in range(nodes)
    ]
    Registry(run.store).ingest(beats)


def born(run: Runner, node: str, ts: int, **status: Any) -> None:
    payload = Envelope(node, 1, {"state": "online", **status}, ts=ts).encode()
    Registry(run.store).ingest([Message("status", node, payload, ts)])


def test_a_rollout_is_created_for_its_targets_each_in_its_stage(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=10)
    run.clock = NOW + 5000
    made = make(run, stages=[0.2, 0.5, 1.0])
    assert (made.created_by, made.created_ts, made.updated_ts, made.rev) == (
        "alice",
        NOW + 5000,
        NOW + 5000,
        1,
    )
    assert made.max_unavailable == 1  # a tenth of ten
    assert made.log == [
        "2027-01-15T08:00:05Z created by alice for 10 nodes: version 2 of m,"
        " stages of [2, 5, 10] nodes, 1 at a time"
    ]
    got = run.rollouts.get("r1")
    assert got is not None and got.as_dict() == made.as_dict()
    order = ranked(10)
    assert run.rollouts.nodes("r1") == [
        {"node": n, "stage": 0 if i < 2 else 1 if i < 5 else 2, "state": "pending", "sent_ts": 0}
        for i, n in enumerate(order)
    ]
    ranks = run.store.query("SELECT node, rank, previous FROM rollout_nodes ORDER BY rank")
    assert [(r["node"], r["rank"], r["previous"]) for r in ranks] == [
        (n, i, None) for i, n in enumerate(order)
    ]
    assert run.store.query("SELECT state, rev FROM rollouts") == [{"state": "running", "rev": 1}]
    assert run.rollouts.get("r2") is None


@pytest.mark.parametrize(("nodes", "most"), [(1, 1), (9, 1), (15, 1), (20, 2), (25, 2)])
def test_max_unavailable_is_a_tenth_of_the_nodes_and_at_least_one(
    tmp_path: Path, nodes: int, most: int
) -> None:
    run = Runner(tmp_path, nodes=nodes)
    made = make(run, stages=[1.0])
    assert made.max_unavailable == most and type(made.max_unavailable) is int


def test_max_unavailable_given_is_kept(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=20)
    assert make(run, max_unavailable=7).max_unavailable == 7


def test_only_nodes_online_and_seen_lately_are_targets(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=3)
    away = Envelope("n2", 2, {"state": "offline"}, ts=NOW).encode()
    Registry(run.store).ingest([Message("status", "n2", away, NOW)])
    run.clock = NOW + 30_000  # n0 and n1 were seen 30 s ago: fresh still
    assert [r["node"] for r in run.rollouts.nodes(make(run).id)] == ["n1", "n0"]
    run.clock = NOW + 30_001
    born(run, "n1", NOW + 30_001)
    make(run, "r2", "other")
    assert list(states(run, "r2")) == ["n1"]


def test_targets_are_picked_by_the_selector_on_the_labels_the_operators_label_over(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=0)
    born(run, "n0", NOW, labels={"site": "a"})
    born(run, "n1", NOW, labels={"site": "b"})
    born(run, "n2", NOW, labels={"site": "a"})
    born(run, "n3", NOW)
    registry = Registry(run.store)
    assert registry.set_labels("n1", {"site": "a"}) and registry.set_labels("n2", {"site": "b"})
    made = make(run, selector={"site": "a"})
    assert sorted(states(run)) == ["n0", "n1"] and made.selector == {"site": "a"}


def test_targets_are_those_the_manifest_targets(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=0)
    born(run, "n0", NOW, hardware={"machine": "aarch64"})
    born(run, "n1", NOW, hardware={"machine": "x86_64"})
    born(run, "n2", NOW)
    make(run, targets={"hardware": ["aarch64"]})
    assert list(states(run)) == ["n0"]
    make(run, "r2", "m2", targets={"nodes": ["n1", "n2"]})
    assert sorted(states(run, "r2")) == ["n1", "n2"]
    with pytest.raises(Conflict, match=r"^no online node is a target of this rollout$"):
        make(run, "r3", "m3", targets={"fleet": "f2"})
    assert run.rollouts.get("r3") is None
    make(run, "r4", "m4", targets={"fleet": "f1"})
    assert sorted(states(run, "r4")) == ["n0", "n1", "n2"]
    make(run, "r5", "m5", targets={"hardware": [""]})  # a node that did not say its machine
    assert list(states(run, "r5")) == ["n2"]


def test_a_service_without_a_deploy_key_cannot_create_a_rollout(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    keyless = run.engine(None)
    refused = (
        "the service has no deploy key ([service] deploy_key): it could not sign the rollbacks"
        " an abort needs"
    )
    with pytest.raises(Conflict, match=f"^{re.escape(refused)}$"):
        keyless.create(check(body(2), None, NOW), "alice")
    assert run.rollouts.all() == []


def deploy(run: Runner, ident: str, *entries: dict[str, Any], **more: Any) -> None:
    doc = {"id": ident, "models": list(entries), **more}
    assert Deployments(run.store, lambda: run.clock).create(check_deployment(doc), "alice")


def test_a_model_a_deployment_gives_rolls_out_through_it(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=0)
    born(run, "n0", NOW, labels={"site": "a"})
    born(run, "n1", NOW, labels={"site": "b"})
    deploy(run, "d1", entry("m", 1), entry("x", 1), selector={"site": "a"})
    deploy(run, "d2", entry("y", 1))
    with pytest.raises(
        Conflict,
        match=r"^m is given by deployment d1: roll it out through it"
        r" \(deployment: d1\)$",
    ):
        make(run)
    with pytest.raises(Conflict, match=r"^no deployment d9$"):
        make(run, deployment="d9")
    with pytest.raises(Conflict, match=r"^deployment d2 does not give m$"):
        make(run, deployment="d2")
    made = make(run, deployment="d1", selector={"site": "b"})  # the deployment's nodes
    assert made.deployment == "d1" and list(states(run)) == ["n0"]
    make(run, "r2", "z", selector={"site": "b"})  # no deployment gives z
    assert list(states(run, "r2")) == ["n1"]


def test_a_node_is_in_one_rollout_of_a_model_at_a_time(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    make(run, stages=[1.0], max_unavailable=2)
    with pytest.raises(Conflict, match=r"^m is in another rollout on n0$"):
        make(run, "r2")
    with pytest.raises(Conflict, match=r"^rollout r1 exists$"):
        make(run, "r1", "other")
    make(run, "r3", "other")  # another model: the same nodes
    run.rollouts.act("r1", "pause", "bob")
    with pytest.raises(Conflict, match=r"^m is in another rollout on n0$"):
        make(run, "r2")
    run.rollouts.act("r1", "abort", "bob")
    with pytest.raises(Conflict, match=r"^m is in another rollout on n0$"):
        make(run, "r2")  # aborting: its nodes are still its
    run.rollouts.turn()
    assert [r.state for r in run.rollouts.all()] == ["aborted", "running"]
    assert sorted(states(run, make(run, "r2").id)) == ["n0", "n1"]


# ---- operators' actions ----------------------------------------------------------------------


def soaking(tmp_path: Path, soak_s: float = 60, nodes: int = 4) -> Runner:
    """A rollout whose first stage (half the nodes) soaks since NOW + 1000."""
    run = Runner(tmp_path, nodes=nodes)
    make(run, stages=[0.5, 1.0], soak_s=soak_s, max_unavailable=nodes)
    run.rollouts.turn()
    for node, _ in run.published:
        run.report(node, "m", 2, "active")
    run.clock += 1000
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.phase == "soak"
    return run


def test_pause_resume_promote_and_abort_apply_only_where_they_can(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    make(run)
    for action, message in (("resume", "running (deliver)"), ("promote", "running (deliver)")):
        with pytest.raises(
            Conflict, match=re.escape(f"cannot {action} a rollout that is {message}")
        ):
            run.rollouts.act("r1", action, "bob")
    paused = run.rollouts.act("r1", "pause", "bob")
    assert (paused.state, paused.rev, paused.soak_since, paused.soak_until) == ("paused", 2, 0, 0)
    assert paused.log[-1].endswith(" pause by bob")
    assert run.rollouts.running()[0].state == "paused"
    for action in ("pause", "promote"):
        with pytest.raises(Conflict, match=rf"^cannot {action} a rollout that is paused$"):
            run.rollouts.act("r1", action, "bob")
    run.clock += 5000
    resumed = run.rollouts.act("r1", "resume", "carol")
    assert (resumed.state, resumed.rev, resumed.soak_since, resumed.soak_until) == (
        "running",
        3,
        0,
        0,
    )
    assert resumed.log[-1].endswith(" resume by carol") and resumed.updated_ts == NOW + 5000
    assert run.rollouts.act("r1", "pause", "bob").state == "paused"
    aborted = run.rollouts.act("r1", "abort", "dave")
    assert (aborted.state, aborted.why) == ("aborting", "aborted by dave")
    assert aborted.log[-1].endswith(" aborting: aborted by dave")
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting" and got.rev == 5
    for action in ("pause", "resume", "promote", "abort"):
        with pytest.raises(Conflict, match=rf"^cannot {action} a rollout that is aborting$"):
            run.rollouts.act("r1", action, "bob")
    with pytest.raises(KeyError):
        run.rollouts.act("r9", "pause", "bob")


def test_a_running_rollout_is_aborted_at_once(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    make(run)
    aborted = run.rollouts.act("r1", "abort", "dave")
    assert (aborted.state, aborted.why, aborted.rev) == ("aborting", "aborted by dave", 2)
    assert run.store.query("SELECT state FROM rollouts") == [{"state": "aborting"}]


def test_resume_restarts_the_soak_and_promote_ends_it(tmp_path: Path) -> None:
    run = soaking(tmp_path)
    got = run.rollouts.get("r1")
    assert got is not None and (got.soak_since, got.soak_until) == (NOW + 1000, NOW + 61_000)
    run.rollouts.act("r1", "pause", "bob")
    run.clock = NOW + 100_000
    resumed = run.rollouts.act("r1", "resume", "bob")
    assert (resumed.soak_since, resumed.soak_until) == (NOW + 100_000, NOW + 160_000)
    run.clock = NOW + 101_000
    promoted = run.rollouts.act("r1", "promote", "bob")
    assert (promoted.soak_since, promoted.soak_until) == (NOW + 100_000, NOW + 101_000)
    assert promoted.log[-1].endswith(" promote by bob") and promoted.stage == 0
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and (got.stage, got.phase) == (1, "deliver")


def test_an_action_on_a_record_that_keeps_changing_is_tried_five_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run)
    tries: list[str] = []

    def changed(ident: str, action: str, actor: str) -> Rollout:
        tries.append(action)
        raise Stale(ident)

    monkeypatch.setattr(run.rollouts, "_act", changed)
    with pytest.raises(Conflict, match=r"^rollout r1 is changing: try again$"):
        run.rollouts.act("r1", "pause", "bob")
    assert tries == ["pause"] * 5


def test_an_action_is_tried_again_when_the_runner_wrote_in_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run)
    act = run.rollouts._act
    tries: list[str] = []

    def once_changed(ident: str, action: str, actor: str) -> Rollout:
        tries.append(action)
        if len(tries) < 5:
            raise Stale(ident)
        return act(ident, action, actor)

    monkeypatch.setattr(run.rollouts, "_act", once_changed)
    assert run.rollouts.act("r1", "pause", "bob").state == "paused"
    assert len(tries) == 5


# ---- the runner's turn -------------------------------------------------------------------------


def test_a_stage_is_delivered_at_most_max_unavailable_nodes_at_a_time(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=5)
    order = ranked(5)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    assert [node for node, _ in run.published] == order[:2]
    assert run.rollouts.nodes("r1") == [
        {
            "node": n,
            "stage": 0,
            "state": "sent" if i < 2 else "pending",
            "sent_ts": NOW if i < 2 else 0,
        }
        for i, n in enumerate(order)
    ]
    run.clock += 1000
    run.rollouts.turn()
    assert len(run.published) == 2  # both still installing: no third
    run.report(order[0], "m", 2, "active")
    run.rollouts.turn()
    assert [node for node, _ in run.published] == order[:3]
    got = {r["node"]: (r["state"], r["sent_ts"]) for r in run.rollouts.nodes("r1")}
    assert got == {
        order[0]: ("active", NOW),
        order[1]: ("sent", NOW),
        order[2]: ("sent", NOW + 1000),
        order[3]: ("pending", 0),
        order[4]: ("pending", 0),
    }


def test_the_stages_soak_in_turn_until_the_last_is_active(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=4)
    order = ranked(4)
    make(run, stages=[0.5, 1.0], soak_s=60, max_unavailable=4)
    run.rollouts.turn()
    assert sorted(states(run).items()) == sorted(
        [(order[0], "sent"), (order[1], "sent"), (order[2], "pending"), (order[3], "pending")]
    )
    for node in order[:2]:
        run.report(node, "m", 2, "active")
    run.clock = NOW + 1000
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None
    assert (got.stage, got.phase, got.soak_since, got.soak_until) == (
        0,
        "soak",
        NOW + 1000,
        NOW + 61_000,
    )
    assert got.log[-1].endswith(" stage 1: 2 nodes active; soaking 60 s")
    assert states(run)[order[0]] == "active" and states(run)[order[1]] == "active"
    run.clock = NOW + 60_999
    run.rollouts.turn()
    same = run.rollouts.get("r1")
    assert same is not None and (same.stage, same.phase, same.rev) == (0, "soak", got.rev)
    run.clock = NOW + 61_000
    alive(run, 4)
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and (got.stage, got.phase) == (1, "deliver")
    assert got.log[-1].endswith(" stage 1: soaked; stage 2 begins")
    assert len(run.published) == 2  # the next turn delivers
    run.rollouts.turn()
    assert [node for node, _ in run.published[2:]] == order[2:]
    for node in order[2:]:
        run.report(node, "m", 2, "active")
    run.rollouts.turn()
    done = run.rollouts.get("r1")
    assert (
        done is not None
        and done.state == "done"
        and done.log[-1].endswith(" done: version 2 on 4 nodes")
    )
    assert set(states(run).values()) == {"active"}
    assert run.rollouts.running() == [] and run.rollouts.watched() == set()
    run.rollouts.turn()  # done: nothing more
    assert len(run.published) == 4


def test_a_stage_does_not_wait_for_a_node_offline_and_says_so(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=4)
    order = ranked(4)
    make(run, stages=[0.5, 1.0], soak_s=0, max_unavailable=4)
    will = Envelope(order[1], 2, {"state": "offline"}, ts=NOW).encode()
    Registry(run.store).ingest([Message("status", order[1], will, NOW)])
    run.rollouts.turn()
    assert [node for node, _ in run.published] == [order[0]]
    run.report(order[0], "m", 2, "active")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.phase == "soak"
    assert got.log[-1].endswith(" stage 1: 1 nodes active, 1 offline; soaking 0 s")
    run.rollouts.turn()  # no soak: the next stage at once
    got = run.rollouts.get("r1")
    assert got is not None and (got.stage, got.phase) == (1, "deliver")
    run.rollouts.turn()
    for node in order[2:]:
        run.report(node, "m", 2, "active")
    run.rollouts.turn()
    done = run.rollouts.get("r1")
    assert done is not None and done.state == "done"
    assert done.log[-1].endswith(
        " done: version 2 on 3 nodes; 1 offline, left pending (a deployment gives it to them"
        " when they are back)"
    )
    assert states(run)[order[1]] == "pending"


def test_a_node_not_seen_lately_is_not_delivered(tmp_path: Path) -> None:
    for late, sent in ((30_000, [("n0", 2)]), (30_001, [])):
        run = Runner(tmp_path / str(late), nodes=1)
        make(run, stages=[1.0])
        run.clock = NOW + late
        run.rollouts.turn()
        assert run.published == sent


def test_deliveries_wait_for_the_window(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)  # NOW is 08:00 UTC
    make(run, stages=[1.0], window="09:00-17:00")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert run.published == [] and got is not None and (got.state, got.rev) == ("running", 1)
    run.clock = NOW + 3_600_000
    alive(run, 1)
    run.rollouts.turn()
    assert run.published == [("n0", 2)]


@pytest.mark.parametrize("step", ["failed", "rolled-back", "refused"])
def test_a_node_whose_install_fails_aborts_the_rollout(tmp_path: Path, step: str) -> None:
    run = Runner(tmp_path, nodes=3)
    order = ranked(3)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    run.report(order[2], "m", 2, step)  # not sent the version: not its failure
    run.report(order[0], "m", 2, "downloading")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "running"
    run.report(order[1], "m", 2, step)
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting"
    assert got.why == f"node {order[1]}: the version {step} there"
    assert states(run) == {order[0]: "rollback", order[1]: "rollback", order[2]: "pending"}


def test_a_node_active_that_rolls_back_later_aborts_the_rollout(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    make(run, stages=[0.5, 1.0], max_unavailable=2)
    run.rollouts.turn()
    run.report(order[0], "m", 2, "active")
    run.rollouts.turn()
    assert states(run)[order[0]] == "active"
    run.clock += 1000
    run.report(order[0], "m", 2, "rolled-back")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.why == f"node {order[0]}: the version rolled-back there"


def test_a_node_not_active_in_time_aborts_the_rollout(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run, stages=[1.0], activation_timeout_s=5)
    run.rollouts.turn()
    run.report("n0", "m", 2, "downloading")
    run.clock = NOW + 5000
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "running"
    run.clock = NOW + 5001
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting"
    assert got.why == "node n0: not active in 5 s" and states(run) == {"n0": "rollback"}


def test_a_heartbeat_serving_the_version_counts_as_active() -> None:
    rollout = check(body(2), None, NOW)
    for beat, serving in (
        ('{"models": {"m": "2"}}', True),
        ('{"models": {"m": 2, "x": 1}}', True),
        ('{"models": {"m": "1"}}', False),
        ('{"models": {"x": "2"}}', False),
        ('{"models": null}', False),
        ('{"models": ["m"]}', False),
        ("[]", False),
        ("{not json", False),
        (None, False),
    ):
        assert Rollouts._serving(rollout, {"heartbeat": beat}) is serving, beat


def test_a_node_left_sending_is_published_again(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run, stages=[1.0])
    run.up = False  # killed (or the broker away) between the two writes
    run.rollouts.turn()
    assert run.published == [] and states(run) == {"n0": "sending"}
    assert run.rollouts.nodes("r1")[0]["sent_ts"] == NOW
    run.up = True
    run.clock = NOW + 1000
    run.rollouts.turn()
    assert run.published == [("n0", 2)]
    assert run.rollouts.nodes("r1") == [
        {"node": "n0", "stage": 0, "state": "sent", "sent_ts": NOW + 1000}
    ]


def test_a_node_left_sending_is_not_published_again_once_paused(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run, stages=[1.0])
    run.up = False
    run.rollouts.turn()
    old = run.rollouts.get("r1")
    run.rollouts.act("r1", "pause", "bob")
    run.up = True
    assert old is not None
    with pytest.raises(Stale):
        run.rollouts.advance(old)
    assert run.published == [] and states(run) == {"n0": "sending"}


def test_a_node_whose_desired_state_lost_the_version_gets_it_again_after_a_while(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    assert len(run.published) == 2
    with run.store.transaction() as tx:  # another publisher replaced order[1]'s
        Registry.desired(tx, order[1], [entry("x", 1)], 99, NOW)
    run.clock = NOW + 29_999
    run.rollouts.turn()
    assert len(run.published) == 2
    run.clock = NOW + 30_000
    run.rollouts.turn()
    assert [n for n, _ in run.published[2:]] == [order[1]]  # order[0]'s holds it still
    versions = [e["manifest"]["signed"]["version"] for e in run.desired[order[1]]]
    assert versions == [2, 1]  # m's, then x's kept
    assert run.rollouts.nodes("r1")[1] == {
        "node": order[1],
        "stage": 0,
        "state": "sent",
        "sent_ts": NOW,
    }  # its activation's time goes on


def test_a_node_that_reported_a_step_is_not_sent_the_version_again(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    run.report(order[0], "m", 2, "downloading")
    with run.store.transaction() as tx:
        for node in order:
            Registry.desired(tx, node, [], 99, NOW)
    run.clock = NOW + 30_000
    run.rollouts.turn()
    assert [node for node, _ in run.published[2:]] == [order[1]]


def test_a_node_left_sending_counts_as_installing(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    make(run, stages=[1.0], max_unavailable=1)
    run.up = False
    run.rollouts.turn()
    run.rollouts.turn()
    assert states(run) == {order[0]: "sending", order[1]: "pending"}


def test_a_node_sent_later_is_published_again_after_one_that_was_not(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    make(run, stages=[1.0], max_unavailable=2)
    run.down = {order[1]}
    run.rollouts.turn()
    assert states(run) == {order[0]: "sent", order[1]: "sending"}
    run.down = set()
    run.clock = NOW + 1000
    run.rollouts.turn()
    assert [node for node, _ in run.published] == order
    assert states(run) == {order[0]: "sent", order[1]: "sent"}


def heartbeat(run: Runner, node: str, models: dict[str, Any]) -> None:
    beat = Envelope(node, 9, {"models": models}, ts=run.clock).encode()
    Registry(run.store).ingest([Message("heartbeat", node, beat, run.clock)])


def test_a_node_whose_heartbeat_serves_the_version_is_active_without_its_event(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=2)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    run.clock = NOW + 1000
    heartbeat(run, "n0", {"m": "2"})
    heartbeat(run, "n1", {"m": "1"})
    run.rollouts.turn()
    assert states(run) == {"n0": "active", "n1": "sent"}
    run.clock = NOW + 2000
    heartbeat(run, "n1", {"m": 2})
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "done"


def test_the_version_before_is_kept_and_given_back_with_a_signed_rollback(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    order = ranked(2)
    before = [entry("m", 1), entry("x", 1)]
    with run.store.transaction() as tx:
        Registry.desired(tx, order[0], before, 1, NOW)
    made = make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    rows = run.store.query("SELECT node, previous FROM rollout_nodes ORDER BY rank")
    assert rows == [
        {"node": order[0], "previous": dumps(before[0])},
        {"node": order[1], "previous": "null"},
    ]
    assert run.desired[order[0]] == [made.entry, before[1]]
    run.rollouts.act("r1", "abort", "bob")
    run.rollouts.turn()
    assert run.desired == {order[0]: before, order[1]: []}
    assert sorted(run.commands) == sorted(order)
    for (cmd_id, payload), node in zip(run.payloads, run.commands, strict=True):
        env = decode(payload)
        assert env.id == cmd_id and env.node == "edgefleet" and env.extra["kid"] == "deploy-1"
        assert env.body["name"] == "rollback" and env.body["target"] == f"f1/{node}"
        assert env.body["args"] == {"model": "m", "from": 2}
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborted"
    assert got.log[-1].endswith(" aborted: 2 nodes told to roll back")
    assert states(run) == {order[0]: "rolled-back", order[1]: "rolled-back"}
    run.rollouts.turn()  # aborted: nothing more
    assert len(run.commands) == 2


def test_a_rollback_the_broker_does_not_take_is_sent_again(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=3)
    order = ranked(3)
    make(run, stages=[1.0], max_unavailable=2)
    run.rollouts.turn()
    sent = len(run.published)
    run.rollouts.act("r1", "abort", "bob")
    assert states(run) == {order[0]: "rollback", order[1]: "rollback", order[2]: "pending"}
    run.broker = False
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting" and len(run.published) == sent
    run.broker, run.up = True, False  # the command goes, the desired state does not
    run.rollouts.turn()
    assert len(run.commands) == 1 and states(run)[run.commands[0]] == "rollback"
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting"
    run.up = True
    run.rollouts.turn()
    first = run.commands[0]
    assert run.commands[1] == first and sorted(run.commands[1:]) == sorted(order[:2])
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborted"
    assert states(run) == {order[0]: "rolled-back", order[1]: "rolled-back", order[2]: "pending"}


def test_a_service_without_a_deploy_key_leaves_an_abort_waiting(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run, stages=[1.0])
    run.rollouts.turn()
    run.rollouts.act("r1", "abort", "bob")
    keyless = run.engine(None)
    keyless.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "aborting" and run.commands == []
    assert states(run) == {"n0": "rollback"}


def test_a_rollout_through_a_deployment_makes_it_give_the_version_when_done(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=2)
    x1, m1 = entry("x", 1), entry("m", 1)
    deploy(run, "d1", x1, m1)
    made = make(run, stages=[1.0], max_unavailable=2, deployment="d1")
    run.rollouts.turn()
    for node in ("n0", "n1"):
        run.report(node, "m", 2, "active")
    run.clock = NOW + 7000
    run.rollouts.turn()
    dep = Deployments(run.store, lambda: run.clock).get("d1")
    assert dep is not None and dep.models == [x1, made.entry] and dep.updated_ts == NOW + 7000
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "done"


def test_a_rollout_whose_deployment_is_gone_is_done_all_the_same(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    deploy(run, "d1", entry("m", 1))
    make(run, stages=[1.0], deployment="d1")
    run.rollouts.turn()
    run.report("n0", "m", 2, "active")
    assert Deployments(run.store, lambda: run.clock).delete("d1")
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "done"
    assert run.store.query("SELECT id FROM deployments") == []


# ---- the gates' figures, telemetry kept ---------------------------------------------------------


def rows_of_telemetry(run: Runner, *rows: tuple[Any, ...]) -> None:
    """(node, ts, model, version, requests, failed, p95_ms, conf_n, conf_sum, routed,
    fallbacks) as the registry writes them."""
    with run.store.transaction() as tx:
        tx.executemany(
            "INSERT INTO telemetry (node, ts, model, version, requests, failed, p95_ms,"
            " conf_n, conf_sum, routed, fallbacks) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?,"
            " ?, ?)",
            rows,
        )


def test_the_canary_is_judged_on_its_version_since_the_soak_against_the_others(
    tmp_path: Path,
) -> None:
    run = soaking(tmp_path, soak_s=600)  # order[0] and order[1] have the version
    a, b, c, d = ranked(4)
    since = NOW + 1000
    rows_of_telemetry(
        run,
        (a, since, "m", "2", 10, 2, 50.0, 4, 3.0, 0, 0),
        (b, since + 1, "m", "2", 5, 1, 80.0, 0, 0.0, 0, 0),
        (b, since + 2, "m", "2", 4, 0, 999.0, 0, 0.0, 0, 0),  # too few calls for its p95
        (a, since, "m", "", 0, 0, None, 0, 0.0, 20, 5),  # routes: per model
        (a, since - 1, "m", "2", 100, 100, 500.0, 0, 0.0, 0, 0),  # before the soak
        (b, since, "m", "1", 100, 50, 500.0, 0, 0.0, 0, 0),  # the version before, on a canary
        (b, since, "other", "2", 100, 90, 500.0, 0, 0.0, 0, 0),
        (c, since, "m", "1", 40, 4, 20.0, 10, 9.0, 0, 0),
        (d, since, "m", "1", 3, 0, 700.0, 0, 0.0, 0, 0),
        (d, since, "m", "", 0, 0, None, 0, 0.0, 50, 1),
        ("n9", since + 5, "m", "1", 7, 0, None, 0, 0.0, 0, 0),  # in no rollout: a baseline
    )
    got = run.rollouts.get("r1")
    assert got is not None
    assert run.rollouts.figures(got, True) == {
        "requests": 19,
        "failure_rate": 3 / 19,
        "p95_ms": 80.0,
        "fallback_rate": 0.25,
        "confidence": 0.75,
    }
    assert run.rollouts.figures(got, False) == {
        "requests": 50,
        "failure_rate": 4 / 50,
        "p95_ms": 20.0,
        "fallback_rate": 0.02,
        "confidence": 0.9,
    }
    assert run.rollouts.gates(got) == ""  # 19 calls: too few for the gates (20)
    got.gates = Gates(min_requests=19)
    assert run.rollouts.gates(got) == (
        "failure rate 15.8% against 8.0% on the other nodes (more than 5.0% worse)"
    )


def test_no_telemetry_is_no_figures(tmp_path: Path) -> None:
    run = soaking(tmp_path)
    got = run.rollouts.get("r1")
    assert got is not None
    none = {
        "requests": 0,
        "failure_rate": 0.0,
        "p95_ms": None,
        "fallback_rate": 0.0,
        "confidence": None,
    }
    assert run.rollouts.figures(got, True) == none and run.rollouts.figures(got, False) == none


def test_a_gate_failed_at_the_end_of_the_soak_aborts_the_rollout(tmp_path: Path) -> None:
    run = soaking(tmp_path, soak_s=60)
    a, b, c, d = ranked(4)
    run.clock = NOW + 61_000  # the soak's very end
    rows_of_telemetry(
        run,
        (a, NOW + 2000, "m", "2", 30, 10, 10.0, 0, 0.0, 0, 0),
        (c, NOW + 2000, "m", "1", 30, 0, 10.0, 0, 0.0, 0, 0),
    )
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and (got.state, got.stage) == ("aborting", 0)
    assert got.why.startswith("failure rate 33.3% against 0.0%")
    assert states(run) == {a: "rollback", b: "rollback", c: "pending", d: "pending"}


def test_the_last_stage_is_done_once_active_without_a_soak(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=2)
    make(run, stages=[1.0], soak_s=600, max_unavailable=2)
    run.rollouts.turn()
    for node in ("n0", "n1"):
        run.report(node, "m", 2, "active")
    rows_of_telemetry(run, ("n0", NOW, "m", "2", 30, 30, 10.0, 0, 0.0, 0, 0))
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and got.state == "done" and got.phase == "deliver"


def test_telemetry_a_soak_judges_is_kept_older_than_an_hour(tmp_path: Path) -> None:
    run = soaking(tmp_path, soak_s=86400)  # soaking since NOW + 1000
    run.clock = NOW + 10_000_000
    rows_of_telemetry(
        run,
        *[
            ("n0", ts, "m", "1", 1, 0, None, 0, 0.0, 0, 0)
            for ts in (NOW + 999, NOW + 1000, NOW + 6_399_999, NOW + 6_400_000)
        ],
    )
    assert run.rollouts.prune() == 1
    run.rollouts.act("r1", "pause", "bob")  # paused, it judges it still after its resume
    assert run.rollouts.prune() == 0
    run.rollouts.act("r1", "abort", "bob")
    run.rollouts.turn()  # aborted: nobody judges it
    assert run.rollouts.prune() == 2
    assert [r["ts"] for r in run.store.query("SELECT ts FROM telemetry")] == [NOW + 6_400_000]
    assert run.rollouts.prune(keep_ms=5_000_000) == 0
    assert run.rollouts.prune(keep_ms=3_599_999) == 1


def test_a_soak_newer_than_an_hour_keeps_an_hour(tmp_path: Path) -> None:
    run = soaking(tmp_path, soak_s=86400)
    rows_of_telemetry(
        run,
        ("n0", NOW - 3_599_000, "m", "1", 1, 0, None, 0, 0.0, 0, 0),
        ("n0", NOW - 3_599_001, "m", "1", 1, 0, None, 0, 0.0, 0, 0),
    )
    assert run.rollouts.prune() == 1  # cutoff: NOW + 1000 - 3_600_000
    run.clock += 1
    assert run.rollouts.prune() == 1


def test_a_rollout_in_its_deliver_phase_keeps_no_telemetry(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    made = make(run, stages=[1.0])
    made.soak_since = NOW - 9_000_000  # as if soaked once: the record's phase is what counts
    with run.store.transaction() as tx:
        run.rollouts.save(tx, made)
    rows_of_telemetry(run, ("n0", NOW - 3_600_001, "m", "1", 1, 0, None, 0, 0.0, 0, 0))
    assert run.rollouts.prune() == 1


# ---- records ----------------------------------------------------------------------------------


def test_the_record_keeps_the_last_two_hundred_notes(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    made = make(run)
    made.log = [f"note {i}" for i in range(250)]
    run.clock = NOW + 61_000
    with run.store.transaction() as tx:
        run.rollouts.save(tx, made, "one more")
    got = run.rollouts.get("r1")
    assert got is not None and len(got.log) == 200 and got.rev == 2
    assert got.log[0] == "note 51" and got.log[-1] == "2027-01-15T08:01:01Z one more"
    assert got.updated_ts == NOW + 61_000
    run.clock = NOW + 62_000
    kept = list(got.log)
    with run.store.transaction() as tx:
        run.rollouts.save(tx, got)  # no note: the log as it is
    again = run.rollouts.get("r1")
    assert again is not None and again.log == kept and again.rev == 3
    assert again.updated_ts == NOW + 62_000


def test_the_rollouts_are_listed_by_id_and_hold_their_model_on_their_nodes(
    tmp_path: Path,
) -> None:
    run = Runner(tmp_path, nodes=2)
    assert run.rollouts.held() == {} and run.rollouts.watched() == set()
    make(run, "rb", "b", stages=[1.0])
    make(run, "ra", "a", stages=[1.0], selector={})
    make(run, "rc", "c", targets={"nodes": ["n1"]})
    assert [r.id for r in run.rollouts.all()] == ["ra", "rb", "rc"]
    assert [r.id for r in run.rollouts.running()] == ["ra", "rb", "rc"]
    assert run.rollouts.held() == {"n0": {"a", "b"}, "n1": {"a", "b", "c"}}
    assert run.rollouts.watched() == {"a", "b", "c"}
    run.rollouts.act("rb", "pause", "bob")
    run.rollouts.act("rc", "abort", "bob")
    assert run.rollouts.held() == {"n0": {"a", "b"}, "n1": {"a", "b", "c"}}  # paused, aborting
    run.rollouts.turn()  # rc aborted
    assert run.rollouts.held() == {"n0": {"a", "b"}, "n1": {"a", "b"}}
    assert [r.id for r in run.rollouts.running()] == ["ra", "rb"]
    assert run.rollouts.watched() == {"a", "b"}


def test_a_paused_soak_does_not_end(tmp_path: Path) -> None:
    run = soaking(tmp_path, soak_s=60)
    run.rollouts.act("r1", "pause", "bob")
    run.clock = NOW + 120_000
    run.rollouts.turn()
    got = run.rollouts.get("r1")
    assert got is not None and (got.state, got.stage, got.phase) == ("paused", 0, "soak")


def test_a_create_holds_the_rollouts_lock_for_its_checks_and_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL, two creates at once cannot both take a model's nodes (SQLite's
    transactions hold its one write lock already)."""
    run = Runner(tmp_path, nodes=1)
    held: list[tuple[bool, str]] = []
    lock = run.store.advisory_lock

    def spy(tx: Tx, name: str) -> None:
        held.append((isinstance(tx, Tx), name))
        lock(tx, name)

    monkeypatch.setattr(run.store, "advisory_lock", spy)
    make(run)
    assert held == [(True, "rollouts")]


def by_default(run: Runner) -> Rollouts:
    """The rollouts of ``run`` with the service's default offline time."""
    clock = run.clock
    deployments = Deployments(run.store, lambda: clock)
    return Rollouts(
        run.store,
        deployments,
        "f1",
        run.publish,
        run.send,
        ("deploy-1", KEY),
        "edgefleet",
        lambda: clock,
    )


def test_a_node_is_fresh_for_thirty_seconds_by_default(tmp_path: Path) -> None:
    run = Runner(tmp_path / "fresh", nodes=1)
    run.clock = NOW + 30_000
    by_default(run).create(check(body(2), None, NOW), "alice")
    assert list(states(run)) == ["n0"]
    run = Runner(tmp_path / "stale", nodes=1)
    run.clock = NOW + 30_001
    with pytest.raises(Conflict, match=r"^no online node is a target of this rollout$"):
        by_default(run).create(check(body(2), None, NOW), "alice")


def test_a_manifest_is_verified_against_the_anchors_now() -> None:
    doc = body(2)
    anchors = {"k": KEY.public_key()}
    assert check(doc, anchors, NOW).version == 2
    with pytest.raises(Invalid, match=r"^manifest: 0 valid signature\(s\)"):
        check(doc, {"k2": Ed25519PrivateKey.generate().public_key()}, NOW)
    expires = doc["manifest"]["signed"]["expires"]
    with pytest.raises(Invalid, match=r"^manifest: expired 1 s ago"):
        check(doc, anchors, expires + 1000)


def test_one_rollout_that_fails_its_turn_does_not_stop_the_others(tmp_path: Path) -> None:
    run = Runner(tmp_path, nodes=1)
    make(run, "ra", "a", stages=[1.0])
    make(run, "rb", "b", stages=[1.0])
    make(run, "rc", "c", stages=[1.0])
    run.rollouts.act("ra", "pause", "bob")
    publish = run.rollouts.publish

    def broken(node: str, entries: list[dict[str, Any]]) -> bool:
        if any(model_of(e) == "b" for e in entries):
            raise ConnectionError("the broker is away")
        return publish(node, entries)

    run.rollouts.publish = broken
    run.rollouts.turn()  # ra paused; rb fails; rc goes on
    assert [model_of(e) for e in run.desired["n0"]] == ["c"]

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

from cloudsync.fleet.deployments import Deployments
from cloudsync.fleet.registry import Message, Registry
from cloudsync.fleet.rollouts import Rollouts, Stale, check, in_window, parse_window
from cloudsync.fleet.store import Store
from cloudsync.protocol import manifest
from cloudsync.protocol.envelope import Envelope

NOW = 1_800_000_000_000
KEY = Ed25519PrivateKey.generate()


def body(version: int, **more: Any) -> dict[str, Any]:
    files = [{"path": "m.onnx", "sha256": "a" * 64, "length": 1}]
    doc = manifest.sign(manifest.make("m", version, files, lifetime_s=1e9), {"k": KEY})
    return {"id": "r1", "manifest": doc, "urls": {"m.onnx": "https://cdn/m"}, **more}


class Runner:
    def __init__(self, tmp_path: Path, nodes: int = 10) -> None:
        self.store = Store(str(tmp_path / "fleet.db"))
        self.clock = NOW
        self.published: list[tuple[str, int]] = []
        self.commands: list[str] = []
        self.rollouts = Rollouts(
            self.store, Deployments(self.store, lambda: self.clock), "f1", self.publish,
            self.send, ("deploy-1", KEY), "edgefleet", lambda: self.clock,
        )  # fmt: skip
        births = [Message("status", f"n{i}", Envelope(f"n{i}", 1, {"state": "online"},
                                                       ts=NOW).encode(), NOW)
                  for i in range(nodes)]  # fmt: skip
        Registry(self.store).ingest(births)

    def publish(self, node: str, entries: list[dict[str, Any]]) -> bool:
        versions = [e["manifest"]["signed"]["version"] for e in entries]
        self.published.append((node, versions[-1] if versions else 0))
        return True

    def send(self, node: str, cmd_id: str, payload: bytes) -> bool:
        self.commands.append(node)
        return True


def test_a_runner_with_an_old_record_neither_delivers_nor_overwrites(tmp_path: Path) -> None:
    run = Runner(tmp_path)
    made = run.rollouts.create(check(body(2, stages=[0.2, 1.0], max_unavailable=1), None, NOW),
                               "alice", 60_000)  # fmt: skip
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
    run.rollouts.create(check(body(2, stages=[1.0], max_unavailable=3), None, NOW), "a", 60_000)
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

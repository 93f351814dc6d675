"""The fleet simulator (bench/fleetsim.py, issue 24) against a real Mosquitto (TLS 1.3, client
certificates, ACLs): 30 simulated nodes in two worker processes come online with retained births
that carry their labels, heartbeat, install a signed desired version (and fail the bad one), roll
back on a signed command, answer ping and unknown commands as cloudsync does, refuse a forged
command, and a dropped node's will fires; the installs log has one line per install, and a node
that comes back to the same retained desired state installs nothing again.

The operator's side is a test client subscribed to the fleet's topics, as the fleet service
will be.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench import fleetsim
from bench.fleetsim import SimConfig, Simulator
from cloudsync.agent.session import MAX_PACKET
from cloudsync.protocol import manifest
from cloudsync.protocol.commands import sign
from cloudsync.protocol.envelope import Envelope, decode
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics, parse
from tests.conftest import wait_for
from tests.mosquitto import OPERATOR, Broker

FLEET, MODEL, NODES = "f1", "intent-classifier", 30
NAMES = [f"sim-{i:05d}" for i in range(NODES)]
BIRTH_KEYS = {"state", "software", "hardware", "models", "capabilities", "edged", "labels"}
HEARTBEAT_KEYS = {
    "uptime_s",
    "load",
    "link",
    "breaker",
    "cloud_error_ratio",
    "cloud_scale_out",
    "inflight",
    "drained",
    "routing",
    "models",
    "edged",
    "outbox",
    "poison_messages",
    "thread_restarts",
}
SITES = ["a", "b", "c"]


class Fleet:
    """What the operator's client has seen, decoded: (topic, envelope) per leaf."""

    def __init__(self, client: SyncClient) -> None:
        self.client = client

    def of(self, kind: str, node: str | None = None) -> list[tuple[str, Envelope]]:
        found = []
        for topic, payload in self.client.wait_messages(0, 0):
            where = parse(topic)
            if where.kind == kind and node in (None, where.node) and payload:
                found.append((where.node, decode(payload)))
        return found

    def steps(self, node: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        return [
            (name, env.body["delivery"])
            for name, env in self.of("events", node)
            if "delivery" in env.body
        ]

    def result(self, cmd_id: str) -> dict[str, Any] | None:
        for topic, payload in self.client.wait_messages(0, 0):
            if topic.endswith(f"/cmd/{cmd_id}/result"):
                return decode(payload).body
        return None

    def last_heartbeat_models(self, node: str, after_ms: int) -> dict[str, str] | None:
        beats = [env for name, env in self.of("heartbeat", node) if env.ts > after_ms]
        return beats[-1].body["models"] if beats else None


def test_30_simulated_nodes_speak_the_protocol(tmp_path: Path, pki: Path) -> None:
    assert fleetsim.MAX_PACKET == MAX_PACKET  # the simulator's copy of cloudsync's figure
    broker = Broker(tmp_path / "mosquitto", pki).start()
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "fleet-1.pub"
    trust.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    operator = SyncClient(broker.port, pki, OPERATOR)
    sim: Simulator | None = None
    try:
        assert operator.connect()
        for leaf in ("status", "heartbeat", "events", "telemetry"):
            operator.subscribe(f"edge/v1/{FLEET}/+/{leaf}")
        operator.subscribe(f"edge/v1/{FLEET}/+/cmd/+/result")
        fleet = Fleet(operator)
        config = SimConfig(
            nodes=NODES,
            fleet=FLEET,
            prefix="sim",
            port=broker.port,
            pki=pki,
            cert_name=OPERATOR,
            heartbeat_s=1.0,
            telemetry_s=1.0,
            procs=2,
            labels={"site": SITES, "tier": ["edge"]},
            models={MODEL: 1},
            install_delay_s=0.2,
            bad_version=f"{MODEL}=3",
            bad_fail_rate=1.0,
            installs=tmp_path / "installs.jsonl",
            trust=trust,
            rps=5.0,
        )
        sim = Simulator(config).start()
        assert sim.wait_connected(timeout=30)

        # births: retained, online, shaped as cloudsync's, with the labels round robin
        def births() -> dict[str, dict[str, Any]]:
            return {n: e.body for n, e in fleet.of("status") if e.body["state"] == "online"}

        wait_for(lambda: len(births()) == NODES, 15, "30 births")
        for i, name in enumerate(NAMES):
            body = births()[name]
            assert set(body) == BIRTH_KEYS, body
            assert body["labels"] == {"site": SITES[i % 3], "tier": "edge"}
            assert body["software"] == {"cloudsync": "sim", "edged": "sim"}
            assert body["models"] == [{"name": MODEL, "version": "1", "state": "READY"}]
        retained = SyncClient(broker.port, pki, OPERATOR)  # a newcomer gets them retained
        assert retained.connect()
        retained.subscribe(f"edge/v1/{FLEET}/+/status")
        got = retained.wait_messages(NODES, 10)
        retained.close()
        assert {parse(t).node for t, _ in got} == set(NAMES)

        # heartbeats: every node, seq and ts increasing; telemetry rows per model version
        wait_for(lambda: all(len(fleet.of("heartbeat", n)) >= 2 for n in NAMES), 10, "heartbeats")
        for name in NAMES:
            beats = [e for _, e in fleet.of("heartbeat", name)]
            assert set(beats[0].body) == HEARTBEAT_KEYS
            assert beats[0].body["models"] == {MODEL: "1"}
            assert all(a.seq < b.seq and a.ts <= b.ts for a, b in itertools.pairwise(beats))
        wait_for(lambda: len(fleet.of("telemetry")) >= NODES, 10, "telemetry")
        _, record = fleet.of("telemetry")[0]
        assert record.extra["priority"] == "telemetry" and record.seq == 1
        row = record.body["metrics"]["models"][0]
        assert row["model"] == MODEL and row["version"] == "1" and row["requests"] > 0
        assert {"errors", "outcomes", "p95_ms", "mean_ms"} <= set(row)

        # a signed desired state: accepted, downloaded, active on every node, once
        def desired(node: str, version: int) -> None:
            files = [{"path": "model.onnx", "sha256": "0" * 64, "length": 1024}]
            doc = manifest.sign(manifest.make(MODEL, version, files), {"fleet-1": key})
            urls = {"model.onnx": f"https://cdn.example/{MODEL}/{version}/model.onnx"}
            body = {"models": [{"manifest": doc, "urls": urls}]}
            payload = Envelope(OPERATOR, version, body).encode()
            assert not operator.publish(
                Topics(FLEET, node).desired_models, payload, retain=True
            ).is_failure

        for name in NAMES:
            desired(name, 2)

        def active(version: int) -> set[str]:
            return {
                n for n, d in fleet.steps() if d["step"] == "active" and d["version"] == version
            }

        wait_for(lambda: active(2) == set(NAMES), 15, "version 2 active on 30 nodes")
        steps = fleet.steps(NAMES[0])
        assert [d["step"] for _, d in steps] == ["accepted", "downloaded", "active"]
        assert steps[0][1]["signed_by"] == ["fleet-1"] and steps[0][1]["bytes"] == 1024
        assert steps[2][1]["previous"] == 1
        active_ms = max(e.ts for _, e in fleet.of("events") if "delivery" in e.body)
        wait_for(
            lambda: all(fleet.last_heartbeat_models(n, active_ms) == {MODEL: "2"} for n in NAMES),
            10,
            "version 2 in the next heartbeats",
        )

        # the bad version fails its install (fail rate 1.0): an alert, version 2 stays
        desired(NAMES[5], 3)
        wait_for(lambda: any(d["step"] == "failed" for _, d in fleet.steps(NAMES[5])), 10, "failed")
        failed = next(d for _, d in fleet.steps(NAMES[5]) if d["step"] == "failed")
        assert failed["version"] == 3 and failed["stage"] == "install"

        # a signed rollback: the version before serves, a rolled-back event and the result
        target = f"{FLEET}/{NAMES[1]}"
        cmd_id, payload = sign(
            key, "fleet-1", OPERATOR, target, "rollback", {"model": MODEL, "from": 2}
        )
        sent_ms = Envelope("x", 0, {}).ts
        assert not operator.publish(Topics(FLEET, NAMES[1]).cmd(cmd_id), payload).is_failure
        wait_for(lambda: fleet.result(cmd_id) is not None, 10, "the rollback's result")
        result = fleet.result(cmd_id)
        assert result is not None and result["ok"] and result["name"] == "rollback", result
        assert result["result"]["rolled_back"] is True and result["result"]["active"] == 1
        back = [d for _, d in fleet.steps(NAMES[1]) if d["step"] == "rolled-back"]
        assert back and back[0]["version"] == 2 and cmd_id in back[0]["why"]
        wait_for(
            lambda: fleet.last_heartbeat_models(NAMES[1], sent_ms + 500) == {MODEL: "1"},
            10,
            "version 1 in the heartbeat after the rollback",
        )

        # ping, an unknown command, a forged one: answered as cloudsync answers them
        ping_id, ping = sign(key, "fleet-1", OPERATOR, target, "ping")
        odd_id, odd = sign(key, "fleet-1", OPERATOR, target, "reboot")
        forged_id, forged = sign(Ed25519PrivateKey.generate(), "fleet-1", OPERATOR, target, "ping")
        for cid, signed in ((ping_id, ping), (odd_id, odd), (forged_id, forged)):
            assert not operator.publish(Topics(FLEET, NAMES[1]).cmd(cid), signed).is_failure
        wait_for(lambda: all(fleet.result(c) for c in (ping_id, odd_id, forged_id)), 10, "answers")
        pong = fleet.result(ping_id)
        assert pong is not None and pong["ok"] and pong["result"]["pong"] is True
        unknown = fleet.result(odd_id)
        assert unknown is not None and not unknown["ok"]
        assert unknown["error"].startswith("unknown command 'reboot'")
        refused = fleet.result(forged_id)
        assert refused == {
            "ok": False,
            "error": "refused: the signature does not verify: forged or altered",
        }

        # a node dropped: its will (retained offline, connection lost); back: a new birth, and
        # the same retained desired state installs nothing again (nor the rolled-back version)
        dropped = [NAMES[2], NAMES[1]]
        assert sim.set_online(dropped, False) == 2

        def statuses(node: str) -> list[dict[str, Any]]:
            return [e.body for _, e in fleet.of("status", node)]

        for name in dropped:
            wait_for(
                lambda n=name: statuses(n)[-1] == {"state": "offline", "reason": "connection lost"},
                10,
                f"{name}'s will",
            )
        assert sim.stats()["connected"] == NODES - 2
        sim.set_online(dropped, True)
        for name in dropped:
            wait_for(lambda n=name: statuses(n)[-1]["state"] == "online", 10, f"{name} back")
        assert statuses(NAMES[1])[-1]["models"][0]["version"] == "1"  # still rolled back
        rebirth_ms = max(e.ts for _, e in fleet.of("status", NAMES[2]))
        wait_for(
            lambda: fleet.last_heartbeat_models(NAMES[2], rebirth_ms + 1000) is not None,
            10,
            "a heartbeat a while after the new birth",
        )

        # the installs log: one line per install, none twice, none skipped
        installs = sim.installs()
        per: dict[tuple[str, str, int], int] = defaultdict(int)
        for line in installs:
            per[(line["node"], line["model"], line["version"])] += 1
        assert set(per.values()) == {1}, json.dumps(installs)
        assert {n for (n, _, v), _ in per.items() if v == 2} == set(NAMES)
        assert [(x["node"], x["ok"]) for x in installs if x["version"] == 3] == [(NAMES[5], False)]
        assert len(installs) == NODES + 1

        figures = sim.stop()
        assert figures["errors"] == 0 and figures["installs"] == NODES
        assert figures["install_failures"] == 1 and figures["rollbacks"] == 1
        assert figures["connected"] == 0 and figures["heartbeats"] >= 2 * NODES
        wait_for(
            lambda: all(statuses(n)[-1].get("reason") == "stopped" for n in NAMES),
            10,
            "every node stopped cleanly",
        )
    finally:
        if sim is not None:
            sim.stop()
        operator.close()
        broker.kill()

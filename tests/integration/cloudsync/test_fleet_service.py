"""The fleet service (``edgefleet serve``, issue 24) as a real process against a real Mosquitto
(TLS, ACLs) and, for the scaled mode, a real PostgreSQL, both started here: the registry from
the nodes' own messages, `edgefleet nodes` through the service for 10,000 nodes, roles and the
audit log, hostile calls, and two replicas sharing one database and the broker's shared
subscription.

The nodes here are births and heartbeats the test publishes as the nodes would (the operator's
certificate may write every node's topics); tests/integration/cloudsync/test_fleet_deploy.py
runs simulated nodes that install what they are told.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloudsync.fleet.cli import main as edgefleet_main
from cloudsync.protocol.envelope import Envelope
from cloudsync.protocol.mqtt import SyncClient
from cloudsync.protocol.topics import Topics
from edged.common.egress import Ledger, verify
from tests import asunit
from tests.fleetservice import TOKENS, FleetService
from tests.integration.cloudsync.test_fleet_nodes import births
from tests.mosquitto import OPERATOR, Broker
from tests.postgres import Postgres


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    yield broker
    broker.kill()


@pytest.fixture
def service(tmp_path: Path, broker: Broker) -> Iterator[FleetService]:
    service = FleetService(tmp_path / "service", broker).start()
    yield service
    service.kill()


def heartbeats(broker: Broker, nodes: list[str], rounds: int, start_ms: int) -> int:
    """``rounds`` heartbeats of each node, 10 s apart by their envelopes, each acknowledged by
    the broker; how many were sent."""
    client = SyncClient(broker.port, broker.pki, OPERATOR)
    assert client.connect()
    sent = []
    try:
        for r in range(rounds):
            for node in nodes:
                ts = start_ms + r * 10_000
                body = {"uptime_s": r * 10, "outbox": {"pending": 0}}
                payload = Envelope(node, ts, body, ts=ts).encode()
                sent.append(client.client.publish(Topics("f1", node).heartbeat, payload, 1))
        for info in sent:
            info.wait_for_publish(60)
            assert info.is_published()
    finally:
        client.close()
    return len(sent)


def test_nodes_through_the_service_for_10000_nodes(service: FleetService, broker: Broker) -> None:
    births(broker, 10_000)
    counted = service.wait_for(
        lambda: service.call("GET", "/v1/nodes?limit=1", role="viewer")[1]["counts"], 60
    )
    service.wait_for(
        lambda: service.call("GET", "/v1/nodes?limit=1")[1]["counts"].get("online") == 10_000, 60
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cloudsync.fleet.cli", "--json", "--service", service.url, "nodes"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EDGEFLEET_TOKEN": TOKENS["viewer"]},
    )
    took = time.monotonic() - started
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rows = json.loads(done.stdout)
    assert [r["node"] for r in rows] == [f"sim-{i:05d}" for i in range(10_000)]
    assert {r["state"] for r in rows} == {"online"} and counted
    print(f"edgefleet --service nodes: 10,000 nodes in {took:.1f} s (process start included)")
    # no token, or a wrong one: refused, and said so
    refused = subprocess.run(
        [sys.executable, "-m", "cloudsync.fleet.cli", "--service", service.url, "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "EDGEFLEET_TOKEN"},
    )
    assert refused.returncode == 2 and "EDGEFLEET_TOKEN" in refused.stderr
    wrong = subprocess.run(
        [sys.executable, "-m", "cloudsync.fleet.cli", "--service", service.url, "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EDGEFLEET_TOKEN": "not-a-token"},
    )
    assert wrong.returncode == 1 and "401" in wrong.stderr


def test_a_node_from_birth_to_will_with_its_heartbeats(
    service: FleetService, broker: Broker, pki: Path, tmp_path: Path
) -> None:
    """A real cloudsync agent's birth (labels from its config), heartbeats, a command relayed
    by the service, and its will; the service runs as its unit does (its own user, its
    umask, the default descriptor limit)."""
    from tests.mosquitto import cloudsync_config

    if service.account is not None:  # root runs the suite (make test): the unit's way
        assert service.proc is not None
        status = asunit.proc_status(service.proc.pid)
        assert status["Uid"].split()[:2] == [str(service.account.uid)] * 2, status["Uid"]
        assert status["Umask"] == "0077" and asunit.open_files_limit(service.proc.pid) == 1024
        database = service.workdir / "state" / "fleet.db"
        assert database.stat().st_uid == service.account.uid
        assert oct(database.stat().st_mode & 0o777) == "0o600", oct(database.stat().st_mode)

    work = tmp_path / "n1"
    (work / "trust").mkdir(parents=True)
    key = tmp_path / "keys"
    assert edgefleet_main(["keygen", "--kid", "fleet-1", "--dir", str(key)]) == 0
    shutil.copy(key / "fleet-1.pub", work / "trust" / "fleet-1.pub")
    config = work / "cloudsync.toml"
    config.write_text(
        cloudsync_config(broker, work, "f1", more="[heartbeat]\ninterval_s = 1\n").replace(
            'name = "n1"', 'name = "n1"\nlabels = { site = "berlin", tier = "camera" }'
        )
    )
    with (work / "agent.log").open("wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)], stderr=log
        )
    try:

        def seen() -> dict[str, object] | None:
            status, row = service.call("GET", "/v1/nodes/n1", role="viewer")
            return row if status == 200 and row["heartbeats"] >= 2 else None

        row = service.wait_for(seen, 30)
        assert row, service.logs()
        assert row["state"] == "online" and row["labels"] == {"site": "berlin", "tier": "camera"}
        assert row["node_labels"] == row["labels"] and row["operator_labels"] == {}
        assert row["hardware"]["machine"] and row["software"]["cloudsync"]
        assert row["heartbeat"]["outbox"]["pending"] >= 0
        # an operator label overlays the node's own
        status, _ = service.call(
            "PUT", "/v1/nodes/n1/labels", {"labels": {"tier": "gate"}}, role="operator"
        )
        assert status == 200
        _, row = service.call("GET", "/v1/nodes/n1")
        assert row["labels"] == {"site": "berlin", "tier": "gate"} and row["fleet"] == "f1"
        _, page = service.call("GET", "/v1/nodes?selector=tier=gate,site=berlin")
        assert [r["node"] for r in page["nodes"]] == ["n1"]

        # a command the operator signs, relayed by the service, its result kept; signed for
        # the service's fleet (no --fleet needed; another one is refused before signing)
        def relay(*fleet: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cloudsync.fleet.cli",
                    "--json",
                    *fleet,
                    "--service",
                    service.url,
                    "--timeout",
                    "30",
                    "cmd",
                    "n1",
                    "ping",
                    "--sign-key",
                    str(key / "fleet-1.key"),
                    "--kid",
                    "fleet-1",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "EDGEFLEET_TOKEN": TOKENS["operator"]},
            )

        other = relay("--fleet", "f2")
        assert other.returncode == 2 and "the service serves fleet f1" in other.stderr
        relayed = relay()
        assert relayed.returncode == 0, relayed.stderr + service.logs()[-2000:]
        assert json.loads(relayed.stdout)["ok"] is True
        _, kept = service.call("GET", "/v1/nodes/n1/commands", role="viewer")
        [command] = kept["commands"]
        assert (command["name"], command["kid"], command["actor"]) == (
            "ping",
            "fleet-1",
            "operator-user",
        )
        assert command["result"]["ok"] is True and command["result_ts"] >= command["sent_ts"]
        envelope_doc = {
            "command": {
                "v": 1,
                "id": command["id"],
                "ts": 1,
                "node": "op",
                "seq": 1,
                "body": {},
                "kid": "k",
                "sig": "s",
            }
        }
        assert service.call("POST", "/v1/nodes/n1/commands", envelope_doc, role="viewer")[0] == 403
        status, why = service.call("POST", "/v1/nodes/n1/commands", envelope_doc, role="operator")
        assert status == 422 and why["error"].startswith("command.body.target"), why
        _, log = service.call("GET", "/v1/audit")
        assert ("command ping", "n1", "sent") in [
            (e["action"], e["target"], e["outcome"]) for e in log["entries"]
        ]
        # the uplink's egress ledger: every message it published, recorded first; the service
        # keeps its head from a heartbeat, and the node's ledger holds that checkpoint
        _, anchors = service.call("GET", "/v1/nodes/n1/egress-checkpoints", role="viewer")
        (anchor,) = anchors["checkpoints"]  # one an hour; edged is not there: no edged head
        assert anchor["ledger"] == "uplink" and anchor["seq"] >= 3
        report = verify(work / "uplink", {anchor["seq"]: anchor["hash"]})
        assert report.ok and report.anchors == [f"{anchor['seq']}:{anchor['hash']}"], report
        sent = Ledger(work / "uplink").entries(limit=1000, match=lambda e: e["kind"] == "mqtt")
        streams = {e["stream"] for e in sent}
        assert {"status", "heartbeat", "result/" + command["id"]} <= streams, streams
        assert all(e["sha256"] and e["bytes"] > 0 and e["broker"] for e in sent)
        assert not verify(work / "uplink", {anchor["seq"]: "0" * 64}).ok  # a rewritten ledger
        lines = subprocess.run(
            [
                sys.executable,
                "-m",
                "cloudsync.fleet.cli",
                "--service",
                service.url,
                "checkpoints",
                "n1",
                "--ledger",
                "uplink",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "EDGEFLEET_TOKEN": TOKENS["viewer"]},
        )
        assert lines.stdout.split() == [f"{anchor['seq']}:{anchor['hash']}"], lines.stderr
    finally:
        agent.kill()  # SIGKILL: the broker publishes its will
        agent.wait(10)
    gone = service.wait_for(
        lambda: service.call("GET", "/v1/nodes/n1")[1]["state"] == "offline", 60
    )
    assert gone
    _, history = service.call("GET", "/v1/nodes/n1/history")
    assert [h["state"] for h in history["history"]] == ["offline", "online"]
    assert history["history"][0]["reason"] == "connection lost"


def test_roles_and_the_audit_log(service: FleetService, broker: Broker) -> None:
    births(broker, 3)
    service.wait_for(lambda: service.call("GET", "/v1/nodes")[1]["counts"].get("online") == 3)
    body = {"labels": {"site": "a"}}
    assert service.call("GET", "/v1/nodes", role=None)[0] == 401
    assert service.call("GET", "/v1/nodes", role="viewer")[0] == 200
    status, why = service.call("PUT", "/v1/nodes/sim-00000/labels", body, role="viewer")
    assert (status, why) == (403, {"error": "role viewer may not do this: operator needed"})
    assert service.call("POST", "/v1/deployments", {"id": "d"}, role="viewer")[0] == 403
    assert service.call("DELETE", "/v1/deployments/d", role="viewer")[0] == 403
    assert service.call("GET", "/v1/audit", role="viewer")[0] == 403
    assert service.call("PUT", "/v1/nodes/sim-00000/labels", body, role="operator")[0] == 200
    assert service.call("PUT", "/v1/nodes/nobody/labels", body, role="operator")[0] == 404
    status, why = service.call(
        "POST", "/v1/deployments", {"id": "d", "models": []}, role="operator"
    )
    assert status == 422 and why["error"].startswith("models:")
    status, why = service.call("PUT", "/v1/nodes/sim-00000/labels", raw=b"{nope", role="admin")
    assert status == 400 and why["error"].startswith("body: not JSON")
    _, log = service.call("GET", "/v1/audit", role="operator")
    got = [(e["actor"], e["action"], e["target"], e["outcome"]) for e in log["entries"]]
    assert got == [
        (
            "viewer-user",
            "PUT /v1/nodes/sim-00000/labels",
            "/v1/nodes/sim-00000/labels",
            "denied: operator",
        ),
        ("viewer-user", "POST /v1/deployments", "/v1/deployments", "denied: operator"),
        ("viewer-user", "DELETE /v1/deployments/d", "d", "denied: operator"),
        ("operator-user", "set labels", "sim-00000", "done"),
        ("operator-user", "set labels", "nobody", "refused: no such node"),
        (
            "operator-user",
            "create deployment",
            "d",
            "refused: models: a list of 1 to 32 entries {manifest, urls}",
        ),
        ("admin-user", "set labels", "sim-00000", "refused: body is not JSON"),
    ]
    assert log["entries"][3]["detail"] == {"site": "a"} and log["next"] is None


def test_hostile_calls_are_refused_and_the_service_goes_on(service: FleetService) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    status, why = service.call("POST", "/v1/deployments", raw=deep, role="operator")
    assert status == 400 and "not JSON" in why["error"]
    status, _ = service.call("POST", "/v1/deployments", raw=b"x" * (2 << 20), role="operator")
    assert status == 413
    for query in ("limit=abc", "state=zombie", "selector=a", "selector=a=b%20c"):
        assert service.call("GET", f"/v1/nodes?{query}")[0] == 400, query
    assert service.call("GET", "/v1/audit?after=x")[0] == 400
    assert service.call("GET", "/v1/nodes/" + "x" * 5000)[0] == 404
    status, why = service.call("PUT", "/v1/nodes/n/labels", {"labels": {"k": 1}})
    assert status == 422 and why["error"].startswith("labels.k")
    assert service.call("GET", "/v1/nowhere")[0] == 404
    assert service.call("PATCH", "/v1/nodes")[0] == 405
    assert service.call("GET", "/healthz", role=None)[0] == 200


def test_two_replicas_count_every_heartbeat_once_and_hand_over_the_runner(
    tmp_path: Path, broker: Broker, postgres: Postgres
) -> None:
    url = postgres.create_database("fleet")
    one = FleetService(tmp_path / "one", broker, database=url, replica="one").start()
    two = FleetService(tmp_path / "two", broker, database=url, replica="two").start()
    try:
        nodes = [f"hb-{i:03d}" for i in range(200)]
        sent = heartbeats(broker, nodes, 10, int(time.time() * 1000) - 100_000)

        def total() -> int:
            rows = postgres.psql("SELECT COALESCE(SUM(heartbeats), 0) FROM nodes", "fleet")
            return int(rows.stdout.strip() or 0)

        assert one.wait_for(lambda: total() >= sent, 60)
        time.sleep(1.0)  # anything counted twice would come now
        assert total() == sent == 2000
        split = [
            sum(
                float(line.split()[-1])
                for line in s.call("GET", "/metrics")[1].splitlines()
                if line.startswith('edgefleet_messages_total{kind="heartbeat"}')
            )
            for s in (one, two)
        ]
        print(f"heartbeats written by each replica: {split}")
        assert sum(split) == sent and min(split) > 0  # both took a share
        runners = [s.call("GET", "/healthz")[1]["runner"] for s in (one, two)]
        assert sorted(runners) == [False, True]
        holder, other = (one, two) if runners[0] else (two, one)
        holder.kill()
        taken = other.wait_for(lambda: other.call("GET", "/healthz")[1]["runner"], 20)
        assert taken, other.logs()
    finally:
        one.kill()
        two.kill()

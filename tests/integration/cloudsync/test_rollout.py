"""A canary rollout over 20 real nodes (each an edged and a cloudsync agent, all real
processes) on a real Mosquitto, with nginx as the CDN and the real fleet service running it:
the first stage touches 2 nodes, a version that fails in service is stopped by the gates on
the nodes' own telemetry and every canary node goes back (the service's deploy key signs the
rollbacks), a good version reaches all 20 once an operator promotes it, and one an operator
aborts goes back everywhere. Driven by the real ``edgefleet --service URL rollout`` command."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edged.client import Client
from tests import asunit
from tests.conftest import Daemon, skip_or_fail, wait_for
from tests.fleetservice import FleetService
from tests.integration.edged.test_model_install import answer, smoke
from tests.modelfiles import add_model, scale_model
from tests.mosquitto import Broker, cloudsync_config, edgefleet, make_pki
from tests.nginx import SECRET, Cdn

MODEL = "scale"
NODES = [f"n{i}" for i in range(1, 21)]
PAIR = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 1, 1, 1]}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for why in (Broker.available(), Cdn.available()):
        if why:
            skip_or_fail(why)
    return make_pki(tmp_path_factory.mktemp("pki"), NODES)


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[Any]]]:
    started: list[subprocess.Popen[Any]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_canary_over_20_nodes_aborts_a_bad_version_and_promotes_a_good_one(
    tmp_path: Path,
    pki: Path,
    make_daemon: type[Daemon],
    agents: list[subprocess.Popen[Any]],
) -> None:
    broker = Broker(tmp_path / "mosquitto", pki).start()
    cdn = Cdn(tmp_path / "cdn", pki).start()
    keyfile, deploy_keyfile = tmp_path / "fleet-1.key", tmp_path / "deploy-1.key"
    trust = tmp_path / "trust"  # the nodes' and the service's: the fleet key, the deploy key
    trust.mkdir()
    for name, path in (("fleet-1", keyfile), ("deploy-1", deploy_keyfile)):
        key = Ed25519PrivateKey.generate()
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (trust / f"{name}.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    (trust / "deploy-1.commands").write_text("rollback\n")  # a scoped key: rollbacks only
    keys = f'deploy_key = "{deploy_keyfile}"\ntrust_dir = "{trust}"'
    service = FleetService(tmp_path / "service", broker, more=keys).start()
    secret = tmp_path / "cdn.secret"
    secret.write_text(SECRET)
    edgeds: dict[str, Daemon] = {}
    for node in NODES:
        repository = tmp_path / node / "models"
        add_model(repository, MODEL, {1: 1.0})
        edgeds[node] = make_daemon(repository).start(wait=False)
    for daemon in edgeds.values():
        daemon.wait_ready()
    for node in NODES:
        work = tmp_path / node / "agent"
        work.mkdir(parents=True)
        (work / "trust").mkdir()
        for name in ("fleet-1.pub", "deploy-1.pub", "deploy-1.commands"):
            (work / "trust" / name).write_bytes((trust / name).read_bytes())
        config = work / "cloudsync.toml"
        config.write_text(
            cloudsync_config(
                broker,
                work,
                "f1",
                node,
                edgeds[node].socket,
                more="[heartbeat]\ninterval_s = 1\n[telemetry]\ninterval_s = 1\n[delivery]\n"
                f'staging_dir = "{edgeds[node].workdir / "state" / "staging"}"\n'  # edged's own
                f'ca_file = "{pki}/ca.pem"\n'
                "health_window_s = 0\n",
            )
        )
        (work / "cloudsync.log").touch()
        unit = edgeds[node].account  # cloudsync.service runs as edged's user
        if unit is not None:
            unit.own(work)
            asunit.reachable(pki)
        with (work / "cloudsync.log").open("wb") as log:
            agents.append(
                subprocess.Popen(
                    [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    **(unit.popen() if unit else {}),
                )
            )

    stop = threading.Event()

    def traffic() -> None:  # every node, all the time: one row and two rows
        clients = {n: Client(str(d.socket), timeout=10) for n, d in edgeds.items()}
        while not stop.is_set():
            for client in clients.values():
                with contextlib.suppress(Exception):
                    answer(client)
                with contextlib.suppress(Exception):
                    client.infer_json(MODEL, PAIR)
            time.sleep(0.05)

    def manifest(version: int, factor: float, **model: Any) -> Path:
        path = tmp_path / "versions" / str(version) / "model.onnx"
        scale_model(path, factor, **model)
        cdn.put(f"{MODEL}/{version}/model.onnx", path.read_bytes())
        smoke_file = path.with_name("smoke.json")
        smoke_file.write_text(json.dumps(smoke(factor)))
        out = path.with_name("manifest.json")
        made = edgefleet(
            broker,
            "manifest",
            "--model",
            MODEL,
            "--version",
            str(version),
            "--file",
            str(path),
            "--sign",
            f"fleet-1={keyfile}",
            "--smoke",
            str(smoke_file),
            "--out",
            str(out),
        )
        assert made.returncode == 0, made.stderr
        return out

    def create(name: str, version: int, soak: float) -> dict[str, Any]:
        return service.edgefleet(
            "rollout",
            "create",
            name,
            "--manifest",
            str(tmp_path / "versions" / str(version) / "manifest.json"),
            "--cdn",
            cdn.base,
            "--cdn-prefix",
            f"/models/{MODEL}/{version}",
            "--secure-link-secret-file",
            str(secret),
            "--stages",
            "10,100",
            "--soak",
            str(soak),
            "--min-requests",
            "10",
            "--activation-timeout",
            "120",
            # the shared two-core test machine runs 40 processes: latency is not the gate here
            "--max-p95-increase",
            "10",
        )

    def status(name: str) -> dict[str, Any]:
        _, record = service.call("GET", f"/v1/rollouts/{name}?nodes=1", role="viewer")
        return record

    def ended(name: str, timeout: float) -> dict[str, Any]:
        record = service.wait_for(
            lambda: (r := status(name))["state"] in ("done", "aborted") and r, timeout, 1
        )
        assert record, f"rollout {name} still {status(name)['state']}: {status(name)['log']}"
        print("\n".join(record["log"]))  # the rollout's log, shown with -s or on a failure
        return record

    def soaking(name: str) -> None:
        wait_for(lambda: status(name)["phase"] == "soak", 120, f"rollout {name} soaking")

    sender = threading.Thread(target=traffic)
    sender.start()
    try:

        def online() -> bool:
            table = edgefleet(broker, "--json", "nodes", "--wait", "1")
            rows = json.loads(table.stdout or "[]")
            return sum(r["state"] == "online" for r in rows) == len(NODES)

        wait_for(online, 60, "20 nodes online")
        wait_for(
            lambda: (
                service.call("GET", "/v1/nodes?state=online")[1]["counts"].get("online")
                == len(NODES)
            ),
            60,
            "20 nodes online at the service",
        )
        manifest(2, 2.0, single_row=True)  # passes its smoke test, fails on two rows
        assert create("r-bad", 2, 60)["state"] == "running"
        record = ended("r-bad", 300)
        assert record["state"] == "aborted" and record["why"].startswith("failure rate"), record
        canary = [n["node"] for n in record["node_states"] if n["state"] != "pending"]
        assert len(canary) == 2 and record["stage_sizes"] == [2, 20], record
        for node in NODES:
            client = edgeds[node].client
            wait_for(lambda c=client: answer(c) == ("1", 1.0), 30, f"{node} on version 1")
            if node not in canary:
                assert client.model_versions(MODEL)["on_disk"] == [1], node

        manifest(3, 3.0)
        create("r-good", 3, 600)  # an operator promotes it: no 600 s soak
        soaking("r-good")
        assert service.edgefleet("rollout", "promote", "r-good")["state"] == "running"
        record = ended("r-good", 300)
        assert record["state"] == "done", record
        assert any("promote by operator-user" in line for line in record["log"]), record["log"]
        assert any(f"done: version 3 on {len(NODES)} nodes" in line for line in record["log"])
        for node in NODES:
            wait_for(lambda c=edgeds[node].client: answer(c) == ("3", 3.0), 30, f"{node} on 3")

        manifest(4, 4.0)
        create("r-stop", 4, 600)  # an operator aborts it
        soaking("r-stop")
        assert service.edgefleet("rollout", "abort", "r-stop")["state"] in ("aborting", "aborted")
        record = ended("r-stop", 120)
        assert record["state"] == "aborted" and record["why"] == "aborted by operator-user", record
        for node in NODES:
            client = edgeds[node].client
            wait_for(lambda c=client: answer(c) == ("3", 3.0), 30, f"{node} back on version 3")
    finally:
        stop.set()
        sender.join()
        service.kill()
        cdn.stop()
        broker.kill()

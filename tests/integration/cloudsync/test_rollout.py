"""A canary rollout over 20 real nodes (each an edged and a cloudsync agent, all real
processes) on a real Mosquitto, with nginx as the CDN: the first stage touches 2 nodes, a
version that fails in service is stopped by the fleet's gates and every canary node goes back,
a good version reaches all 20. Driven by the real `edgefleet rollout` command."""

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
from tests.integration.edged.test_model_install import answer, smoke
from tests.modelfiles import add_model, scale_model
from tests.mosquitto import Broker, cloudsync_config, edgefleet, edgefleet_command, make_pki
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
    key = Ed25519PrivateKey.generate()
    keyfile = tmp_path / "fleet-1.key"
    keyfile.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))  # fmt: skip
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
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
        (work / "trust" / "fleet-1.pub").write_bytes(public)
        config = work / "cloudsync.toml"
        config.write_text(cloudsync_config(
            broker, work, "f1", node, edgeds[node].socket,
            more="[heartbeat]\ninterval_s = 1\n[telemetry]\ninterval_s = 1\n[delivery]\n"
            f'staging_dir = "{edgeds[node].workdir / "state" / "staging"}"\n'  # edged's own
            f'ca_file = "{pki}/ca.pem"\n'
            "health_window_s = 0\n",
        ))  # fmt: skip
        (work / "cloudsync.log").touch()
        unit = edgeds[node].account  # cloudsync.service runs as edged's user
        if unit is not None:
            unit.own(work)
            asunit.reachable(pki)
        with (work / "cloudsync.log").open("wb") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "cloudsync.agent.cli", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, **(unit.popen() if unit else {}),
            ))  # fmt: skip

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
        made = edgefleet(broker, "manifest", "--model", MODEL, "--version", str(version),
                         "--file", str(path), "--sign", f"fleet-1={keyfile}",
                         "--smoke", str(smoke_file), "--out", str(out))  # fmt: skip
        assert made.returncode == 0, made.stderr
        return out

    def create(name: str, version: int, soak: float) -> list[str]:
        return [
            "rollout", "create", name, "--manifest", str(tmp_path / "versions" /
            str(version) / "manifest.json"), "--cdn", cdn.base, "--cdn-prefix",
            f"/models/{MODEL}/{version}", "--secure-link-secret-file", str(secret),
            "--stages", "10,100", "--soak", str(soak), "--min-requests", "10",
            # the shared two-core test machine runs 40 processes: latency is not the gate here
            "--max-p95-increase", "10", "--sign-key", str(keyfile), "--kid", "fleet-1",
        ]  # fmt: skip

    def in_background(name: str, version: int) -> subprocess.Popen[str]:
        """A rollout with a long soak, its controller running beside the test."""
        command = edgefleet_command(broker, *create(name, version, 600))
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        agents.append(proc)  # stopped by PID at the end, whatever happens

        def soaking() -> bool:
            shown = edgefleet(broker, "--json", "rollout", "status", name)
            return shown.returncode == 0 and "soaking" in str(json.loads(shown.stdout)["log"])

        wait_for(soaking, 60, f"rollout {name} soaking")
        return proc

    sender = threading.Thread(target=traffic)
    sender.start()
    try:

        def online() -> bool:
            table = edgefleet(broker, "--json", "nodes", "--wait", "1")
            rows = json.loads(table.stdout or "[]")
            return sum(r["state"] == "online" for r in rows) == len(NODES)

        wait_for(online, 60, "20 nodes online")
        manifest(2, 2.0, single_row=True)  # passes its smoke test, fails on two rows
        bad = edgefleet(broker, *create("r-bad", 2, 8), timeout=300)
        print(bad.stdout, bad.stderr)  # the rollout's log, shown with -s or on a failure
        assert bad.returncode == 1 and "aborted: failure rate" in bad.stderr, bad.stderr
        status = json.loads(edgefleet(broker, "--json", "rollout", "status", "r-bad").stdout)
        canary = status["touched"]
        assert len(canary) == 2 and status["state"] == "aborted", status
        for node in NODES:
            client = edgeds[node].client
            wait_for(lambda c=client: answer(c) == ("1", 1.0), 20, f"{node} on version 1")
            if node not in canary:
                assert client.model_versions(MODEL)["on_disk"] == [1], node

        manifest(3, 3.0)
        running = in_background("r-good", 3)  # an operator promotes it: no 600 s soak
        assert edgefleet(broker, "rollout", "promote", "r-good").returncode == 0
        out, err = running.communicate(timeout=120)
        print(out, err)
        assert running.returncode == 0, err
        assert "stage 1 (10%): 2 more nodes" in out and "promoted by the operator" in out
        assert "done: version 3 on 20 nodes" in out
        for node in NODES:
            assert answer(edgeds[node].client) == ("3", 3.0), node

        manifest(4, 4.0)
        running = in_background("r-stop", 4)  # an operator aborts it from another shell
        stopped = edgefleet(broker, "rollout", "abort", "r-stop", "--why", "wrong build",
                            "--sign-key", str(keyfile), "--kid", "fleet-1")  # fmt: skip
        assert stopped.returncode == 0 and "aborted: wrong build" in stopped.stdout
        running.communicate(timeout=60)
        assert running.returncode == 1
        for node in NODES:
            client = edgeds[node].client
            wait_for(lambda c=client: answer(c) == ("3", 3.0), 20, f"{node} back on version 3")
    finally:
        stop.set()
        sender.join()
        cdn.stop()
        broker.kill()

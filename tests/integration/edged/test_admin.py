"""Operator controls on a real edged (/v1/admin, edgectl): routing overrides kept across
restarts and reloads, drain and resume with the real cloud tier (MLServer) taking the work,
reload answered with its outcome, and /v1/admin refused to callers not listed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from edged.client import ClientError
from tests.conftest import Cloud, Daemon, wait_for
from tests.integration.edged.test_routing import ask, edged_with_cloud

CLOUD_RULE = {"name": "cloud-first", "task_type": "text-classification", "action": "cloud"}


def edgectl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_routing_overrides_and_drain_outlive_restarts_and_the_cloud_takes_drained_work(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    daemon = edged_with_cloud(make_daemon, faults_cleared)
    client = daemon.client
    shown = client.routing()
    assert shown["overrides"] == {} and shown["routing"]["local_threshold_ms"] == 100.0
    assert ask(client, 1)["route"] == "local"

    shown = client.set_routing({"rules": [CLOUD_RULE], "local_threshold_ms": 42})
    assert shown["overrides"]["local_threshold_ms"] == 42
    answer = ask(client, 2)
    assert answer["route"] == "cloud" and "rule 'cloud-first'" in answer["reason"], answer

    # bad settings: refused whole, naming the key; the settings in force stay
    for patch, says in [
        ({"local_threshold_ms": -1}, "local_threshold_ms"),
        ({"rules": [{"action": "local", "when": "cpu <"}]}, "rules.0.when"),
        ({"max_latency": 5}, "unknown key"),
        ([1, 2], "JSON object"),
    ]:
        with pytest.raises(ClientError) as refused:
            client.set_routing(patch)  # type: ignore[arg-type]
        assert refused.value.status == 400 and says in refused.value.message, refused.value
    assert client.routing()["overrides"]["local_threshold_ms"] == 42
    assert ask(client, 3)["route"] == "cloud"
    client.set_routing({"rules": None})  # null: that override is gone, the file's rules apply
    assert client.routing()["overrides"] == {"local_threshold_ms": 42}
    assert ask(client, 4)["route"] == "local"

    drained = client.drain("thermal maintenance", timeout_s=5)
    assert drained["drained"] and drained["local_inflight"] == 0
    answer = ask(client, 5)
    assert answer["route"] == "cloud", answer
    assert "drained by the operator: thermal maintenance" in answer["reason"]
    with pytest.raises(ClientError) as refused:  # a private input cannot go to the cloud
        ask(client, 6, private=True)
    assert refused.value.status == 503 and "drained" in refused.value.message
    status = edgectl(daemon, "status")
    assert "LOCAL TIER DRAINED BY THE OPERATOR: THERMAL MAINTENANCE" in status.stdout

    assert daemon.stop() == 0
    daemon.start()
    wait_for(lambda: daemon.client.status()["cloud"]["link"]["up"], 10, "the cloud link up")
    client = daemon.client
    assert client.status()["drained"] == "drained by the operator: thermal maintenance"
    assert client.routing()["routing"]["local_threshold_ms"] == 42
    shown_text = edgectl(daemon, "routing").stdout
    assert "local_threshold_ms = 42.0   (override)" in shown_text, shown_text
    assert "max_latency_ms = 500.0\n" in shown_text

    resumed = edgectl(daemon, "resume")
    assert resumed.returncode == 0 and client.status()["drained"] is None
    assert ask(client, 7)["route"] == "local"
    reset = edgectl(daemon, "routing", "reset")
    assert reset.returncode == 0 and client.routing()["overrides"] == {}
    kept = json.loads((daemon.workdir / "state" / "admin.json").read_text())
    assert kept == {"routing_overrides": {}, "drained": None, "models": {}, "cloud_ab": {}}
    assert daemon.stop() == 0


def test_a_pipeline_loaded_while_drained_serves_after_the_resume(
    make_daemon: type[Daemon],
) -> None:
    """A pipeline warms up through its step models when it loads; edged started drained (from
    admin.json) must still load it, so it serves once resumed (found installing the package:
    the intent pipeline stayed unavailable after an upgrade of a drained device)."""
    config = '[models]\nload = ["intent", "text-embedding", "text-encoder"]\n'
    daemon = make_daemon(config=config)
    state = daemon.workdir / "state"
    state.mkdir()
    drained = {"reason": "drained by the operator: swap", "since": 0}
    (state / "admin.json").write_text(json.dumps({"drained": drained}))
    client = daemon.start().client
    assert client.status()["drained"] == "drained by the operator: swap"
    with pytest.raises(ClientError) as refused:  # no cloud: drained work is refused
        client.intent(["turn the lights off"])
    assert refused.value.status == 503 and "drained" in refused.value.message
    client.resume()
    answer = client.task("intent", {"texts": ["turn the lights off"]})
    assert answer["route"] == "local" and answer["intents"][0]["intent"]


def test_reload_answers_with_its_outcome_and_overrides_stay_over_the_new_file(
    make_daemon: type[Daemon],
) -> None:
    config = '[models]\nload = ["intent-classifier"]\n'
    daemon = make_daemon(config=config).start()
    client = daemon.client
    assert edgectl(daemon, "routing", "set", "local_threshold_ms=42").returncode == 0
    daemon.config.write_text(config + "[routing]\nmax_latency_ms = 800\n")
    assert client.reload() == {"reloaded": True, "error": None}
    routing = client.routing()["routing"]
    assert routing["max_latency_ms"] == 800 and routing["local_threshold_ms"] == 42

    daemon.config.write_text(config + "[routing]\nmax_latency_ms = -3\n")
    reply = client.reload()
    assert not reply["reloaded"] and "max_latency_ms" in reply["error"], reply
    failed = edgectl(daemon, "reload")
    assert failed.returncode == 1 and "reload failed" in failed.stderr
    assert client.routing()["routing"]["max_latency_ms"] == 800  # the previous settings stay
    assert ask(client, 1)["route"] == "local"  # serving all along
    bad = edgectl(daemon, "routing", "set", "local_threshold_ms")
    assert bad.returncode == 2 and "not name=value" in bad.stderr

    (daemon.workdir / "state" / "admin.json").write_text("{not json")
    daemon.config.write_text(config)
    assert daemon.stop() == 0
    daemon.start()  # a damaged file: said in the log, the file's settings apply
    assert daemon.client.routing()["overrides"] == {}
    assert "cannot read" in daemon.logs() and "admin.json" in daemon.logs()
    assert daemon.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to call the socket as another user")
def test_admin_is_for_root_and_the_listed_users(make_daemon: type[Daemon]) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    # a socket another user can reach (pytest's temporary directories are root's only)
    public = Path(tempfile.mkdtemp(prefix="edged-admin-"))
    public.chmod(0o755)
    try:
        daemon = make_daemon(
            config="[models]\nload = []\n[server]\nsocket_mode = 0o666\nadmin_uids = [4242]\n",
            flags=("--socket", str(public / "edged.sock")),
        )
        daemon.socket = public / "edged.sock"
        daemon.give(public)
        daemon.start()
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        command = [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*nobody, *command, *args], capture_output=True, text=True, timeout=60, env=env
            )

        assert run("status").returncode == 0, run("status").stderr  # not an admin call
        refused = run("drain")
        assert refused.returncode == 4
        assert "uid 65534 gid 65534 is not allowed /v1/admin" in refused.stderr
        assert daemon.client.status()["drained"] is None
        assert edgectl(daemon, "drain").returncode == 0  # root may
        assert daemon.stop() == 0
    finally:
        shutil.rmtree(public, ignore_errors=True)

"""The path decision end to end: a real edged, a real third-party OIP server as the cloud
(MLServer on loopback, serving the same intent-classifier.onnx), and a fault-injecting TCP proxy
between them (latency, blackhole, reset). Faults are real: bytes held or delayed on a real
socket, real 500s from the server, a real CPU hog. What reached the cloud is read from the
server's own journal of the requests it saw.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.peer import Peer, ensure_venv, start_peer
from edged.client import Client, ClientError
from tests.conftest import CLOUD_MODEL as MODEL
from tests.conftest import CLOUD_MODEL_B as MODEL_B
from tests.conftest import MODELS, Cloud, Daemon, copy_model, linked_repository, wait_for
from tests.faultproxy import FaultProxy
from tests.integration.edged.test_scheduling import metric
from tests.media import wav_bytes

DIM = 384
PRIVATE_HEAD = [0.0625, -0.125, 0.25, -0.5]  # the first values of every private input


def edged_with_cloud(
    make_daemon: type[Daemon],
    cloud: Cloud,
    routing: str = "",
    extra: str = "",
    models: tuple[str, ...] = (MODEL,),
    repository: Path = MODELS,
) -> Daemon:
    config = f"""
[models]
load = {json.dumps(list(models))}
[cloud]
url = "http://{cloud.proxy.address}"
{extra}
[routing]
{routing}
"""
    daemon = make_daemon(repository, config=config).start()
    wait_for(lambda: cloud_state(daemon.client)["link"]["up"], 10, "the cloud link up")
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the cloud catalog")
    return daemon


def cloud_state(client: Client) -> dict[str, Any]:
    return dict(client.status()["cloud"])


ALWAYS_CLOUD = """
[[routing.rules]]
name = "cloud-first"
task_type = "text-classification"
action = "cloud"
"""


def embedding(i: int, private: bool = False) -> np.ndarray:
    x = np.random.default_rng(i).standard_normal((1, DIM)).astype(np.float32)
    x /= np.linalg.norm(x)
    if private:
        x[0, :4] = PRIVATE_HEAD
    return x


def ask(client: Client, i: int, **parameters: Any) -> dict[str, Any]:
    """One request; its answer's parameters, its probabilities and when it was sent."""
    sent = time.monotonic()
    outputs, params = client.infer_answer(
        MODEL,
        {"embedding": embedding(i, parameters.get("private", False))},
        binary=False,
        parameters=parameters,
        request_id=f"{'private' if parameters.get('private') else 'req'}-{i}",
    )
    return {**params, "i": i, "sent": sent, "probabilities": outputs["probabilities"]}


def routes(rows: list[dict[str, Any]]) -> str:
    return " ".join(f"{r['i']}:{r['route']}" for r in rows)


# ---- every answer says where it ran and why ---------------------------------------------------


def test_answers_say_where_they_ran_and_why(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud)
    client = daemon.client
    local = ask(client, 1)
    assert local["route"] == "local", local
    assert "estimate" in local["reason"] or "threshold" in local["reason"]
    assert local["actual_ms"] > 0
    remote = ask(client, 1, route="cloud")
    assert remote["route"] == "cloud", remote
    assert remote["reason"] == "the request asked for cloud"
    np.testing.assert_allclose(remote["probabilities"], local["probabilities"], atol=1e-5)
    assert any(r["id"] == "req-1" for r in cloud.seen())  # the server saw it
    hedged = ask(client, 3, route="hedged")
    assert hedged["route"] == "hedged" and "answered first" in hedged["reason"], hedged
    np.testing.assert_allclose(hedged["probabilities"], ask(client, 3)["probabilities"], atol=1e-5)
    explained = ask(client, 2, route="cloud", explain=True)
    (step,) = json.loads(explained["route_trace"])
    assert step["model"] == MODEL and step["route"] == "cloud" and step["trace"]
    assert metric(client, "edged_route_decisions_total", model=MODEL, route="cloud") == 2
    assert metric(client, "edged_route_decisions_total", model=MODEL, route="hedged") == 1
    state = cloud_state(client)
    assert state["breaker"] == "closed" and state["link"]["rtt_s"] > 0
    # the capability registry: the task type, both tiers, what was measured on each
    (group,) = [g for g in client.capabilities() if g["task_type"] == "text-classification"]
    (row,) = group["models"]
    assert row["model"] == MODEL and row["local"]["available"] and row["cloud"]["available"]
    assert row["local"]["calls"] >= 2 and row["cloud"]["calls"] >= 2
    assert row["cloud"]["latency_ms"] > 0 and row["cloud"]["cloud_name"] == MODEL


def test_the_cloud_over_grpc(make_daemon: type[Daemon], faults_cleared: Cloud) -> None:
    cloud = faults_cleared
    config = f'[models]\nload = ["{MODEL}"]\n[cloud]\nurl = "grpc://{cloud.peer.grpc_url}"\n'
    daemon = make_daemon(config=config).start()
    client = daemon.client
    wait_for(lambda: MODEL in cloud_state(client)["catalog"], 10, "the catalog over gRPC")
    local, remote = ask(client, 5, route="local"), ask(client, 5, route="cloud")
    assert remote["route"] == "cloud", remote
    np.testing.assert_allclose(remote["probabilities"], local["probabilities"], atol=1e-5)
    assert "req-5" in {s["id"] for s in cloud.seen()}
    cloud.fail_every(1)  # every call fails on the server: INTERNAL, then the device answers
    failed = ask(client, 6, route="cloud")
    assert failed["route"] == "fallback" and "StatusCode.INTERNAL" in failed["reason"], failed


def test_without_a_local_model_the_cloud_is_retried_within_the_deadline(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud)
    client = daemon.client
    client.unload(MODEL)  # only the cloud can serve now: no local fallback
    cloud.fail_every(2, status=503)  # every other call: 503, which is worth a retry
    answers = [ask(client, 300 + i) for i in range(4)]
    assert {a["route"] for a in answers} == {"cloud"}, answers
    assert "only the cloud can serve" in answers[0]["reason"]
    ids = [s["id"] for s in cloud.seen()]
    assert sum(ids.count(f"req-{300 + i}") for i in range(4)) > 4  # some were sent twice
    cloud.fail_every(1, status=500)  # every call fails, and 500 is not worth a retry
    with pytest.raises(ClientError) as failed:
        ask(client, 400)
    assert failed.value.status == 503 and "the cloud failed" in failed.value.message
    assert [s["id"] for s in cloud.seen()].count("req-400") == 1


def test_unsure_local_answers_escalate_to_the_cloud(
    make_daemon: type[Daemon], faults_cleared: Cloud, tmp_path: Path
) -> None:
    cloud = faults_cleared
    repository = linked_repository(tmp_path / "models", [MODEL])
    config = copy_model(repository, MODEL) / "config.pbtxt"
    config.write_text(
        config.read_text()
        + 'parameters {\n  key: "escalate_below"\n  value { string_value: "0.95" }\n}\n'
    )
    daemon = edged_with_cloud(make_daemon, cloud, repository=repository)
    client = daemon.client
    answers = [ask(client, i) for i in range(10)]  # random embeddings: unsure answers
    unsure = [a for a in answers if a["probabilities"].max() < 0.95]
    assert unsure and all(a["route"] == "escalated" for a in unsure), answers
    assert "confidence" in unsure[0]["reason"] and "the cloud answered" in unsure[0]["reason"]
    escalated = {f"req-{a['i']}" for a in unsure}
    assert escalated <= {s["id"] for s in cloud.seen()}
    # private: never escalated; a failing cloud: the local answer stands, and says so
    assert ask(client, 1, private=True)["route"] == "local"
    cloud.fail_every(1)
    kept = ask(client, 2)
    assert kept["route"] == "local" and "the cloud failed" in kept["reason"], kept


def test_the_scale_out_signal_rises_with_the_clouds_errors_and_falls_after(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """A cloud answering 503 to one call in 4: over scale_out_error_rate (5%) with enough
    calls in the window, edged raises the scale-out signal: the metric an autoscaler reads,
    the status, an event for the fleet naming the figures; healthy again, the window empties
    and the signal falls, with an event too."""
    cloud = faults_cleared
    extra = "scale_out_window_s = 4\nscale_out_min_calls = 12\nbreaker_min_calls = 1000"
    daemon = edged_with_cloud(make_daemon, cloud, extra=extra)
    client = daemon.client
    scale = metric(client, "edged_cloud_scale_out")
    assert scale == 0 and cloud_state(client)["scale_out"]["needed"] is False
    cloud.fail_every(4, status=503)
    answers = [ask(client, i, route="cloud") for i in range(12)]
    assert [a["route"] for a in answers].count("fallback") == 3, routes(answers)
    assert metric(client, "edged_cloud_scale_out") == 1
    assert metric(client, "edged_cloud_scale_out_error_ratio") == 0.25
    state = cloud_state(client)["scale_out"]
    assert state == {"needed": True, "calls": 12, "failures": 3, "window_s": 4.0, "threshold": 0.05}
    said = [e["message"] for e in client.events()["events"] if "scale" in e["message"]]
    assert said == [
        f"cloud http://{cloud.proxy.address}: scale out: 3 of 12 calls failed in the last 4 s,"
        " more than 5.0% (the metric edged_cloud_scale_out is 1)"
    ]
    cloud.fail_every(0)
    assert ask(client, 20, route="cloud")["route"] == "cloud"
    wait_for(lambda: metric(client, "edged_cloud_scale_out") == 0, 10, "the signal lowered")
    said = [e["message"] for e in client.events()["events"] if "scale" in e["message"]]
    assert said[1].endswith("scale-out signal lowered: 0 of 0 calls failed in the last 4 s")


def test_the_learned_policy_decides_learns_and_remembers(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    daemon = edged_with_cloud(make_daemon, faults_cleared, 'policy = "learned"')
    client = daemon.client
    answers = [ask(client, i, timeout=200_000) for i in range(30)]
    assert all(a["reason"].startswith("learned: P(in time) drawn local") for a in answers)
    assert {a["route"] for a in answers} <= {"local", "cloud"}
    assert metric(client, "edged_route_decisions_total", model=MODEL, reason="learned") == 30
    assert daemon.stop() == 0
    state = json.loads((daemon.workdir / "state" / "routing-learner.json").read_text())
    assert state["rows"] and all(row[0] == MODEL for row in state["rows"])
    daemon.start()  # the same state directory: it resumes
    wait_for(lambda: "the learner resumes with" in daemon.logs(), 10, "the learner resumed")


def test_sighup_applies_new_rules(make_daemon: type[Daemon], faults_cleared: Cloud) -> None:
    daemon = edged_with_cloud(make_daemon, faults_cleared)
    assert ask(daemon.client, 1)["route"] == "local"
    daemon.config.write_text(daemon.config.read_text() + ALWAYS_CLOUD)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: ask(daemon.client, 2)["route"] == "cloud", 10, "the new rule applied")
    assert "rule 'cloud-first'" in ask(daemon.client, 3)["reason"]


# ---- privacy ----------------------------------------------------------------------------------


def test_private_inputs_never_reach_the_cloud(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud, ALWAYS_CLOUD, models=(MODEL, "intent"))
    client = daemon.client
    before = len(cloud.seen())
    # under a cloud-first rule, asking for the cloud, with the cloud failing, under load
    cloud.fail_every(2)
    with ThreadPoolExecutor(16) as pool:
        rows = list(pool.map(lambda i: ask(client, i, private=True, route="cloud"), range(40)))
        public = list(pool.map(lambda i: ask(client, 1000 + i), range(40)))
    assert {r["route"] for r in rows} == {"local"}
    assert all("private" in r["reason"] for r in rows)
    # the rule sends public ones out (until the failing cloud's circuit opens)
    assert {r["route"] for r in public} & {"cloud", "fallback"}
    assert all("circuit" in r["reason"] for r in public if r["route"] == "local")
    # the task API: the pipeline's classifier step stays on the device too
    reply = client.call("POST", "/v1/intent?private=true&route=cloud", {"texts": ["open a ticket"]})
    assert reply["route"] == "local" and "private" in reply["reason"]
    # with the local model gone, a private request fails rather than leave the device, while a
    # public one goes to the cloud (now healthy again: its circuit closes after the cool-down)
    cloud.fail_every(0)
    client.unload(MODEL)
    wait_for(lambda: cloud_state(client)["breaker"] != "open", 70, "the circuit to half-open")
    with pytest.raises(ClientError) as failed:
        ask(client, 7, private=True)
    assert failed.value.status == 503 and "private" in failed.value.message
    assert "only the cloud can serve" in ask(client, 8)["reason"]
    seen = cloud.seen()[before:]
    sent = {f"req-{r['i']}" for r in public if r["route"] in ("cloud", "fallback")}
    assert sent and sent <= {s["id"] for s in seen}  # the public ones reached it: it can tell
    assert not [s for s in seen if s["id"].startswith("private")], "a private id reached the cloud"
    assert not [s for s in seen if np.allclose(s["head"], PRIVATE_HEAD)], "private data leaked"


# ---- the link: cut, slow -----------------------------------------------------------------------


def test_link_cut_mid_traffic_runs_locally_and_returns_without_flapping(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud, ALWAYS_CLOUD)
    client = daemon.client
    rate, count, cut_at, restore_at = 40.0, 200, 40, 100
    start = time.monotonic() + 0.1
    cut = restored = 0.0
    futures = []
    with ThreadPoolExecutor(32) as pool:
        for i in range(count):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            if i == cut_at:
                cloud.proxy.blackhole()
                cut = time.monotonic()
            if i == restore_at:
                cloud.proxy.restore()
                restored = time.monotonic()
            futures.append(pool.submit(ask, client, i))
        rows = [f.result() for f in futures]  # every request succeeded (else this raises)
    print(routes(rows))
    assert all(r["route"] == "cloud" for r in rows[: cut_at - 1]), routes(rows[:cut_at])
    # in flight at the cut: the cloud call gave up in time to run locally
    during = [r for r in rows if cut <= r["sent"] < restored]
    assert {r["route"] for r in during} <= {"local", "fallback"}
    known = [r for r in during if r["route"] == "local"]
    detected = known[0]["sent"] - cut
    print(f"cut seen {detected * 1000:.0f} ms after it began; first local: {known[0]['reason']}")
    assert detected <= 1.0
    assert all(r["route"] == "local" for r in during if r["sent"] >= cut + 1.0)
    # after the restore: back to the cloud, once, for good (no flapping)
    after = [r for r in rows if r["sent"] >= restored]
    back = next(k for k, r in enumerate(after) if r["route"] == "cloud")
    print(f"back on the cloud {after[back]['sent'] - restored:.2f} s after the restore")
    assert all(r["route"] == "cloud" for r in after[back:]), routes(after)


def test_slow_link_sends_tight_deadlines_local(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud, ALWAYS_CLOUD)
    client = daemon.client
    for i in range(5):  # the cloud's service time is learned
        assert ask(client, i, timeout=300_000)["route"] == "cloud"
    cloud.proxy.delay(0.2)  # 200 ms each way: a 400 ms round trip
    wait_for(lambda: cloud_state(client)["link"]["rtt_s"] > 0.35, 30, "the RTT measured at 400 ms")
    assert cloud_state(client)["link"]["up"]  # slow, not cut
    tight = [ask(client, 10 + i, timeout=300_000) for i in range(5)]  # 300 ms deadline
    assert {r["route"] for r in tight} == {"local"}, [r["reason"] for r in tight]
    assert "over the deadline" in tight[0]["reason"]
    loose = ask(client, 20, timeout=2_000_000)  # 2 s: the rule's cloud still fits
    assert loose["route"] == "cloud" and loose["actual_ms"] >= 400


# ---- device load -------------------------------------------------------------------------------


def test_cpu_hog_sends_eligible_requests_to_the_cloud(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    rule = """
[[routing.rules]]
name = "brief"
task_type = "text-classification"
when = "local_load < 80%"
action = "local"
otherwise = "cloud"
"""
    daemon = edged_with_cloud(make_daemon, cloud, rule, extra="", models=(MODEL,))
    client = daemon.client
    wait_for(lambda: client.status()["load"]["cpu_percent"] is not None, 5, "a load sample")
    calm = ask(client, 1)
    if client.status()["load"]["cpu_percent"] < 80:
        assert calm["route"] == "local", calm
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        wait_for(lambda: client.status()["load"]["cpu_percent"] >= 90, 15, "the CPU hog seen")
        busy = [ask(client, 10 + i) for i in range(10)]
        private = [ask(client, 50 + i, private=True) for i in range(5)]
    finally:
        for hog in hogs:
            os.kill(hog.pid, signal.SIGKILL)
            hog.wait()
    assert {r["route"] for r in busy} == {"cloud"}, busy
    assert "rule 'brief'" in busy[0]["reason"] and "does not hold" in busy[0]["reason"]
    assert {r["route"] for r in private} == {"local"}  # under load too
    assert not [s for s in cloud.seen() if s["id"].startswith("private")]
    wait_for(lambda: client.status()["load"]["cpu_percent"] < 60, 15, "the CPU calm again")
    assert ask(client, 30)["route"] == "local"


# ---- the circuit breaker -----------------------------------------------------------------------


def test_cloud_5xx_opens_the_breaker_then_it_closes_after_recovery(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud, ALWAYS_CLOUD)
    client = daemon.client
    cloud.fail_every(10)  # a 500 for one call in ten
    rows = []
    for i in range(60):  # sequential, 50 per second
        rows.append(ask(client, i))  # each one succeeds: a failed cloud call runs locally
        time.sleep(0.02)
    print(routes(rows))
    assert any(r["route"] == "fallback" for r in rows)
    opened = [r for r in rows if "circuit" in r["reason"] and r["route"] == "local"]
    assert opened, "the breaker never opened"
    state = cloud_state(client)
    assert state["breaker_opened"] >= 1
    cloud.fail_every(0)  # the cloud recovers
    wait_for(lambda: ask(client, 100)["route"] == "cloud", 10, "traffic back on the cloud")
    for i in range(5):
        assert ask(client, 200 + i)["route"] == "cloud"
    state = cloud_state(client)
    assert state["breaker"] == "closed" and state["breaker_trials"] >= 3, state


# ---- cloud tiers -------------------------------------------------------------------------


@pytest.fixture
def spot(tmp_path: Path) -> Iterator[tuple[Peer, FaultProxy, Path]]:
    """A second real OIP server (MLServer, the same model), 200 ms further away behind its own
    proxy: the cheap, interruptible tier. Stopped by PID at the end (if the test has not)."""
    journal = tmp_path / "spot.jsonl"
    onnx = MODELS / MODEL / "1" / "model.onnx"
    peer = start_peer(ensure_venv(), onnx, MODEL, tmp_path / "spot", journal=journal)
    proxy = FaultProxy("127.0.0.1", int(peer.http_url.rsplit(":", 1)[1]))
    proxy.delay(0.2)
    try:
        yield peer, proxy, journal
    finally:
        proxy.close()
        peer.stop()


def test_work_that_can_wait_goes_to_the_cheap_tier_and_moves_when_it_is_killed(
    make_daemon: type[Daemon], faults_cleared: Cloud, spot: tuple[Peer, FaultProxy, Path]
) -> None:
    """Two real OIP servers as tiers, on-demand (cost 1) and spot (0.3, 200 ms further): work
    that can wait (priority 2, 3 s left) goes to spot, the cheapest expected in time; urgent
    work (300 ms) to on-demand, as spot is not expected within half its time; spot SIGKILLed
    in the middle of 80 calls that can wait: every one is answered by the cloud within its
    time, those after the kill by on-demand."""
    cloud, (peer, proxy, journal) = faults_cleared, spot
    extra = (
        f'name = "on-demand"\ncost = 1.0\n[[cloud.tiers]]\nname = "spot"\n'
        f'url = "http://{proxy.address}"\ncost = 0.3\n'
    )
    daemon = edged_with_cloud(make_daemon, cloud, extra=extra)
    client = daemon.client

    def tier(name: str) -> dict[str, Any]:
        return next(t for t in client.status()["cloud_tiers"] if t["name"] == name)

    wait_for(lambda: MODEL in tier("spot")["catalog"], 10, "the spot tier's catalog")
    assert [t["name"] for t in client.status()["cloud_tiers"]] == ["on-demand", "spot"]
    edgectl = [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), "status"]
    shown = subprocess.run(edgectl, capture_output=True, text=True, check=True).stdout
    assert f"cloud tier spot (cost 0.3): http://{proxy.address} link up" in shown, shown
    assert "cloud tier on-demand (cost 1): http://" in shown, shown
    assert (tier("on-demand")["cost"], tier("spot")["cost"]) == (1.0, 0.3)
    # an A/B split on the second tier (the admin API's "tier"), kept across a restart
    split = {"tier": "spot", "b_cloud_name": MODEL_B, "b_share": 0.2}
    ab = {"b_cloud_name": MODEL_B, "b_share": 0.2}
    assert client.call("PUT", f"/v1/admin/cloud/{MODEL}/ab", split) == {
        "model": MODEL,
        "ab": ab,
        "tier": "spot",
    }
    with pytest.raises(ClientError) as refused:
        client.call("PUT", f"/v1/admin/cloud/{MODEL}/ab", {**split, "tier": "moon"})
    assert refused.value.status == 400 and "'tier' must name a cloud tier: on-demand, spot" in (
        refused.value.message
    )
    assert daemon.stop() == 0
    daemon.start()
    client = daemon.client
    wait_for(lambda: MODEL in tier("spot")["catalog"], 10, "the spot tier's catalog")
    assert tier("spot")["ab"] == {MODEL: ab}
    assert tier("spot")["ab_tests"][MODEL]["decided"] is None and tier("on-demand")["ab"] == {}
    client.call("PUT", f"/v1/admin/cloud/{MODEL}/ab", {"tier": "spot", "b_share": 0})
    assert tier("spot")["ab"] == {}
    client.unload(MODEL)  # only the cloud serves: what spot drops must reach on-demand
    wait = {"priority": 2, "timeout": 3_000_000}
    low = ask(client, 12000, **wait)
    assert low["route"] == "cloud" and "tier spot (cheapest expected in time)" in low["reason"]
    urgent = ask(client, 12001, timeout=300_000)
    assert "tier on-demand (cheapest expected within half the time)" in urgent["reason"], urgent
    spot_ids = {json.loads(line)["id"] for line in journal.read_text().splitlines()}
    assert "req-12000" in spot_ids and "req-12001" not in spot_ids

    killed = threading.Event()

    def one(i: int) -> dict[str, Any]:
        if i == 30:
            peer.proc.send_signal(signal.SIGKILL)  # an interruption, in the middle of traffic
            peer.proc.wait()
            killed.set()
        return ask(client, 12100 + i, **wait)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(80)))
    assert killed.is_set()
    assert all(a["route"] == "cloud" for a in answers), routes(answers)
    assert all(time.monotonic() - a["sent"] < 60 for a in answers)
    on_demand = {s["id"] for s in cloud.seen()}
    spot_ids = {json.loads(line)["id"] for line in journal.read_text().splitlines()}
    served = [f"req-{12100 + i}" for i in range(80)]
    assert all(i in on_demand or i in spot_ids for i in served)
    assert all(i in on_demand for i in served[40:]), "after the kill, on-demand serves"
    assert any(i in spot_ids for i in served[:30]), "before it, spot did"
    moved = [a for a in answers if "tier spot failed" in a["reason"]]
    assert all("; tier on-demand (cheapest expected" in a["reason"] for a in moved), moved[:2]
    wait_for(lambda: not tier("spot")["link"]["up"], 10, "the spot tier's link down")
    after = ask(client, 12300, **wait)
    assert "tier on-demand (cheapest expected in time)" in after["reason"], after
    # per tier: calls by outcome, and what the answered ones cost
    for tier, price in (("spot", 0.3), ("on-demand", 1.0)):
        answered = metric(client, "edged_cloud_tier_calls_total", tier=tier, outcome="success")
        assert answered >= 2
        cost = metric(client, "edged_cloud_cost_total", tier=tier)
        assert cost == pytest.approx(price * answered)
    assert metric(client, "edged_cloud_tier_calls_total", tier="spot", outcome="error") >= 1
    assert metric(client, "edged_cloud_tier_link_up", tier="spot") == 0
    assert metric(client, "edged_cloud_tier_link_up", tier="on-demand") == 1
    assert metric(client, "edged_cloud_tier_breaker_state", tier="on-demand", state="closed") == 1


# ---- cloud A/B -----------------------------------------------------------------------------


def test_a_cloud_ab_split_sends_a_share_to_arm_b_with_metrics_per_arm(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    cloud = faults_cleared
    split = f'[[cloud.models]]\nname = "{MODEL}"\nb_cloud_name = "{MODEL_B}"\nb_share = 0.3\n'
    daemon = edged_with_cloud(make_daemon, cloud, extra=split)
    client = daemon.client

    def served(first: int, count: int) -> dict[str, int]:
        answers = [ask(client, first + i, route="cloud") for i in range(count)]
        assert all(a["route"] == "cloud" for a in answers)
        ids = {f"req-{first + i}" for i in range(count)}
        seen = [s["model"] for s in cloud.seen() if s["id"] in ids]
        assert len(seen) == count
        return {arm: seen.count(arm) for arm in (MODEL, MODEL_B)}

    arms = served(5000, 200)
    assert 35 <= arms[MODEL_B] <= 90, arms  # 30% of 200: 60, binomial sd 6.5
    for arm, count in arms.items():  # the metrics per arm agree with the server's own journal
        assert metric(client, "edged_cloud_requests_total", cloud_model=arm) == count
    assert metric(client, "edged_cloud_request_duration_seconds_count", cloud_model=MODEL_B) > 0
    explained = client.infer_answer(
        MODEL, {"embedding": embedding(1)}, parameters={"route": "cloud", "explain": True}
    )[1]
    assert json.loads(explained["route_trace"])[0]["cloud_model"] in (MODEL, MODEL_B)

    assert client.set_ab(MODEL, MODEL_B, 1.0)["ab"] == {"b_cloud_name": MODEL_B, "b_share": 1.0}
    assert served(6000, 20) == {MODEL: 0, MODEL_B: 20}
    assert daemon.stop() == 0
    daemon.start()  # the split set by command is kept
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the catalog")
    assert cloud_state(daemon.client)["ab"][MODEL]["b_share"] == 1.0
    assert served(7000, 10) == {MODEL: 0, MODEL_B: 10}
    assert client.set_ab(MODEL, None, 0)["ab"] is None
    assert served(8000, 10) == {MODEL: 10, MODEL_B: 0}
    with pytest.raises(ClientError) as refused:
        client.set_ab(MODEL, MODEL_B, 2)
    assert refused.value.status == 400 and "b_share" in refused.value.message


@pytest.mark.parametrize(("worse", "how"), [("b", "fails"), ("a", "fails"), ("b", "unsure")])
def test_an_ab_test_stops_a_worse_arm_b_and_promotes_a_better_one(
    make_daemon: type[Daemon], faults_cleared: Cloud, worse: str, how: str
) -> None:
    """Half the calls to each arm; the worse one (the real server fails one of its calls in 3
    with 503, and answers it 50 ms later; or answers every call unsure: uniform scores, under
    ab_min_confidence) loses within 400 calls, at least 30 per arm: arm b stopped (all calls
    to a) or promoted (all to b), with an event naming the evidence, the status, and the
    decision kept across a restart."""
    cloud = faults_cleared
    split = (
        f"ab_min_calls = 30\nab_min_confidence = 0.25\n"
        f'[[cloud.models]]\nname = "{MODEL}"\nb_cloud_name = "{MODEL_B}"\n'
        f"b_share = 0.5\n"
    )
    daemon = edged_with_cloud(make_daemon, cloud, extra=split)
    client = daemon.client
    arm = [MODEL_B if worse == "b" else MODEL]
    if how == "fails":
        cloud.fail_every(3, status=503, delay_s=0.05, models=arm)
    else:
        cloud.fail_every(0, models=arm, flatten=True)
    first = {("b", "fails"): 9000, ("a", "fails"): 10000, ("b", "unsure"): 11000}[worse, how]
    calls = 0  # (each case its own ids: the journal is shared)
    while calls < 400:
        ask(client, first + calls, route="cloud")
        calls += 1
        if calls % 10 == 0 and cloud_state(client)["ab_tests"][MODEL]["decided"]:
            break
    test = cloud_state(client)["ab_tests"][MODEL]
    better = "a" if worse == "b" else "b"
    assert test["decided"] == better, (calls, test)
    assert min(test["a"]["calls"], test["b"]["calls"]) >= 30
    assert test["p_b_better"] >= 0.95 if better == "b" else test["p_b_better"] <= 0.05
    said = [e["message"] for e in client.events()["events"] if "A/B" in e["message"]]
    verdict = {
        "a": f"arm a is better: arm b ({MODEL_B}) gets no more calls",
        "b": f"arm b ({MODEL_B}) is better: it gets every call",
    }[better]
    assert said[-1].startswith(f"cloud A/B of {MODEL} decided: {verdict} (good calls: a ")
    cloud.fail_every(0)
    after = [ask(client, first + 500 + i, route="cloud") for i in range(10)]
    ids = {f"req-{first + 500 + i}" for i in range(10)}
    arms = {s["model"] for s in cloud.seen() if s["id"] in ids}
    assert all(a["route"] == "cloud" for a in after)
    assert arms == {MODEL if better == "a" else MODEL_B}
    assert daemon.stop() == 0
    daemon.start()  # the decision is kept (as a split set by command is)
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the catalog")
    ab = cloud_state(daemon.client)["ab"].get(MODEL)
    assert ab == (None if better == "a" else {"b_cloud_name": MODEL_B, "b_share": 1.0})
    assert MODEL not in cloud_state(daemon.client)["ab_tests"]  # nothing left to test


def test_an_ab_split_the_fleet_decides_counts_each_arm_and_decides_nothing_here(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """A split set with ``decided_by: fleet`` (the fleet service's cloud-ab command): past the
    calls a test of its own would have decided on (arm b fails one call in 3), the node still
    splits; its counts per arm, good and not by the rule the command gave (latency_ms), are the
    metric the fleet adds up; kept across a restart. Bad rule fields are 400s naming them."""
    cloud = faults_cleared
    daemon = edged_with_cloud(make_daemon, cloud, extra="ab_min_calls = 30\n")
    client = daemon.client
    split = {"b_cloud_name": MODEL_B, "b_share": 0.5, "decided_by": "fleet", "latency_ms": 60000}
    assert client.call("PUT", f"/v1/admin/cloud/{MODEL}/ab", split)["ab"] == {
        "b_cloud_name": MODEL_B,
        "b_share": 0.5,
    }
    cloud.fail_every(3, status=503, models=[MODEL_B])
    for i in range(160):
        ask(client, 12000 + i, route="cloud")
    cloud.fail_every(0)
    test = cloud_state(client)["ab_tests"][MODEL]
    assert test["decided"] is None and test["decided_by"] == "fleet"
    assert test["rule"]["latency_s"] == 60.0
    assert min(test["a"]["calls"], test["b"]["calls"]) >= 30  # its own test would have decided
    assert test["b"]["good"] < test["b"]["calls"] and test["a"]["good"] == test["a"]["calls"]
    for arm, cloud_model in (("a", MODEL), ("b", MODEL_B)):
        good = metric(client, "edged_cloud_ab_calls_total", cloud_model=cloud_model, good="true")
        bad = metric(client, "edged_cloud_ab_calls_total", cloud_model=cloud_model, good="false")
        assert (good, good + bad) == (test[arm]["good"], test[arm]["calls"]), arm
    assert daemon.stop() == 0
    daemon.start()
    wait_for(lambda: MODEL in cloud_state(daemon.client)["catalog"], 10, "the catalog")
    kept = cloud_state(daemon.client)["ab_tests"][MODEL]
    assert kept["decided_by"] == "fleet" and kept["rule"]["latency_s"] == 60.0
    for field, value in (("decided_by", "me"), ("latency_ms", -1), ("min_confidence", 2)):
        with pytest.raises(ClientError) as refused:
            daemon.client.call("PUT", f"/v1/admin/cloud/{MODEL}/ab", {**split, field: value})
        assert refused.value.status == 400 and f"'{field}'" in refused.value.message


def test_an_operators_scores_decide_an_ab_test(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """With ab_min_score, an answered call counts when the operator scores its answer (the
    same server answers both arms here: only the scores differ, 0.9 for a's answers and 0.3
    for b's, looked up in the server's journal): arm a wins within 200 calls, at least 30 an
    arm scored; calls are waiting meanwhile, not counted. Scores for a model whose test takes
    none are a 409; a bad score a 400 naming it."""
    cloud = faults_cleared
    extra = (
        f'ab_min_calls = 30\nab_min_score = 0.5\n[[cloud.models]]\nname = "{MODEL}"\n'
        f'b_cloud_name = "{MODEL_B}"\nb_share = 0.5\n'
    )
    daemon = edged_with_cloud(make_daemon, cloud, extra=extra)
    client = daemon.client
    first, calls = 20000, 0
    while calls < 200 and not cloud_state(client)["ab_tests"][MODEL]["decided"]:
        for i in range(calls, calls + 20):
            ask(client, first + i, route="cloud")
        ids = {f"req-{first + i}" for i in range(calls, calls + 20)}
        waiting = cloud_state(client)["ab_tests"][MODEL]
        assert (
            waiting["waiting_for_score"] == 20
            and waiting["a"]["calls"] + waiting["b"]["calls"] == calls
        )
        arm = {s["id"]: s["model"] for s in cloud.seen() if s["id"] in ids}
        scores = {i: 0.3 if model == MODEL_B else 0.9 for i, model in arm.items()}
        reply = client.score_ab(MODEL, {**scores, "req-none": 1.0})
        decided = cloud_state(client)["ab_tests"][MODEL]["decided"]
        assert reply["counted"] + reply["not_waiting"] == 21  # once decided, none waits
        assert reply["counted"] == 20 or (decided and reply["counted"] > 0), reply
        calls += 20
    test = cloud_state(client)["ab_tests"][MODEL]
    assert test["decided"] == "a" and min(test["a"]["calls"], test["b"]["calls"]) >= 30, test
    assert test["b"]["good"] == 0 and test["a"]["good"] == test["a"]["calls"]
    assert test["rule"]["min_score"] == 0.5 and test["unscored"] == 0
    with pytest.raises(ClientError) as refused:
        client.score_ab(MODEL, {"req-1": 0.5})
    assert refused.value.status == 409 and "takes scores" in refused.value.message
    with pytest.raises(ClientError) as refused:
        client.score_ab(MODEL, {"req-1": 1.5})
    assert refused.value.status == 400 and "'scores[0].score'" in refused.value.message
    for bad, field in (
        ({f"r{i}": 0.5 for i in range(1001)}, "'scores'"),
        ({"x" * 257: 0.5}, "'scores[0].request_id'"),
        ({"r": float("nan")}, ""),
    ):
        with pytest.raises(ClientError) as refused:
            client.score_ab(MODEL, bad)
        assert refused.value.status == 400 and field in refused.value.message


def test_a_decoupled_model_is_not_sent_to_the_cloud(
    make_daemon: type[Daemon], faults_cleared: Cloud
) -> None:
    """A decoupled model's responses stream from the device: with the cloud up, a request that
    asks for the cloud runs locally as one that leaves the choice does, and both say why;
    nothing reaches the cloud."""
    daemon = edged_with_cloud(
        make_daemon, faults_cleared, models=(MODEL, "vad-segments", "vad-silero")
    )
    triton = grpcclient.InferenceServerClient(
        f"unix://{daemon.socket.with_name('edged-grpc.sock')}"
    )
    audio = grpcclient.InferInput("audio", [1], "BYTES")
    audio.set_data_from_numpy(np.array([wav_bytes(np.zeros(16000, np.float32))], object))
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    seen = len(faults_cleared.seen())
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        triton.async_stream_infer(
            "vad-segments",
            [audio],
            request_id="cloud",
            enable_empty_final_response=True,
            parameters={"route": "cloud"},
        )
        triton.async_stream_infer(
            "vad-segments",
            [audio],
            request_id="auto",
            enable_empty_final_response=True,
            parameters={"explain": True},
        )
    finally:
        triton.stop_stream()
    got = {}
    while not answers.empty():
        result, error = answers.get_nowait()
        assert error is None, error
        got[result.get_response().id] = result.get_response().parameters
    assert sorted(got) == ["auto", "cloud"]
    for parameters in got.values():
        assert parameters["route"].string_param == "local"
        assert parameters["reason"].string_param == (
            "cloud excluded: a decoupled model streams its responses from the device only"
        )
    (first, *steps) = json.loads(got["auto"]["route_trace"].string_param)
    assert first["model"] == "vad-segments" and first["basis"] == "unavailable"
    assert steps and {s["model"] for s in steps} == {"vad-silero"}
    assert len(faults_cleared.seen()) == seen

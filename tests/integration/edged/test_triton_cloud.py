"""The cloud tier against Triton Inference Server itself (issue 46), behind nginx as the API
gateway: TLS 1.3 only, mutual TLS with the fleet CA's device certificate, a bearer token, the
path prefix ``/api/v1`` for REST and gRPC over TLS (HTTP/2) with the same checks.

Triton is the real server (2.51.0 from nvidia-pytriton's wheel, bench/triton_peer.py): the
catalog comes from its repository index, the calls reach its python backend (ONNX Runtime, the
same model.onnx as the device's), its errors are its own. Where it differs from MLServer (the
cloud of the other tests), the test says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.triton_peer import metadata
from tests.conftest import CLOUD_MODEL, CLOUD_MODEL_B, Cloud, Daemon, wait_for
from tests.integration.edged.test_routing import ask, cloud_state
from tests.nginx import Gateway
from tests.pki import gateway_pki

TOKEN = "Bearer triton-fleet-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gateway_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(
    triton: Cloud, pki: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    missing = Gateway.available()
    if missing:
        pytest.skip(missing)
    upstream = triton.peer.http_url.removeprefix("http://")
    work = tmp_path_factory.mktemp("gateway")
    gw = Gateway(
        work, pki, http_upstream=upstream, grpc_upstream=triton.peer.grpc_url, token=TOKEN
    ).start()
    yield gw
    gw.stop()


@pytest.fixture
def clean(triton: Cloud) -> Iterator[Cloud]:
    """Triton without faults, before and after."""
    triton.fail_every(0)
    yield triton
    triton.fail_every(0)


def behind(make_daemon: type[Daemon], url: str, pki: Path, more: str = "") -> Daemon:
    """edged with the gateway at ``url`` as its cloud: the CA, the device's certificate and the
    token (0600, edged's)."""
    token = pki / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    settings = {
        "url": url,
        "ca_file": str(pki / "ca.pem"),
        "cert_file": str(pki / "device.pem"),
        "key_file": str(pki / "device.key"),
        "token_file": str(token),
    }
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
    daemon = make_daemon(config=f'[models]\nload = ["{CLOUD_MODEL}"]\n[cloud]\n{lines}\n{more}')
    daemon.give(pki)
    daemon.start()
    wait_for(lambda: CLOUD_MODEL in cloud_state(daemon.client)["catalog"], 15, "the catalog")
    return daemon


def journal(cloud: Cloud) -> list[dict[str, Any]]:
    return [row for row in cloud.seen() if row.get("server") == "triton"]


def test_triton_is_the_real_server(triton: Cloud) -> None:
    meta = metadata(triton.peer)
    print(f"\ncloud tier: {meta['name']} {meta['version']}, extensions {meta['extensions']}")
    assert meta["name"] == "triton" and meta["version"] == "2.51.0"
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(
        meta["extensions"]  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("transport", ["https", "grpcs"])
def test_calls_reach_triton_through_the_gateway(
    make_daemon: type[Daemon], gateway: Gateway, pki: Path, clean: Cloud, transport: str
) -> None:
    """The catalog from Triton's repository index; a call the caller sends to the cloud is
    answered by Triton (the same model file: the same probabilities as on the device), through
    the gateway with TLS 1.3, the device's certificate and the token."""
    url = (
        f"https://localhost:{gateway.port}/api/v1"
        if transport == "https"
        else f"grpcs://localhost:{gateway.grpc_port}"
    )
    daemon = behind(make_daemon, url, pki)
    state = cloud_state(daemon.client)
    assert state["link"]["up"] and {CLOUD_MODEL, CLOUD_MODEL_B} <= set(state["catalog"]), state
    before = len(journal(clean))
    cloud = ask(daemon.client, 7, route="cloud")
    local = ask(daemon.client, 7, route="local")
    assert (cloud["route"], cloud["reason"]) == ("cloud", "the request asked for cloud"), cloud
    assert local["route"] == "local", local
    np.testing.assert_allclose(cloud["probabilities"], local["probabilities"], rtol=1e-5)
    seen = journal(clean)[before:]
    assert [(r["model"], r["id"]) for r in seen] == [(CLOUD_MODEL, "req-7")], seen
    calls = [s for s in gateway.seen() if s["uri"].endswith(("/infer", "/ModelInfer"))]
    expected = (
        f"/api/v1/v2/models/{CLOUD_MODEL}/infer"
        if transport == "https"
        else "/inference.GRPCInferenceService/ModelInfer"
    )
    assert calls[-1] == {
        "port": str(gateway.port if transport == "https" else gateway.grpc_port),
        "uri": expected,
        "status": "200",
        "tls": "TLSv1.3",
        "client": "CN=edge-node-1",
        "token": TOKEN,
    }, calls


@pytest.mark.parametrize(("status", "code"), [(503, "UNAVAILABLE"), (500, "INTERNAL")])
def test_a_triton_error_is_answered_on_the_device(
    make_daemon: type[Daemon], gateway: Gateway, pki: Path, clean: Cloud, status: int, code: str
) -> None:
    """Triton's python backend fails the call (its error code ``code``, which Triton's HTTP
    frontend answers with ``status``): edged answers on the device, route ``fallback``, and says
    what the cloud said."""
    daemon = behind(make_daemon, f"https://localhost:{gateway.port}/api/v1", pki)
    clean.fail_every(1, status=status)
    answer = ask(daemon.client, 3, route="cloud")
    assert answer["route"] == "fallback", answer
    assert str(status) in answer["reason"] and "injected fault" in answer["reason"], answer
    statuses = [s["status"] for s in gateway.seen() if s["uri"].endswith("/infer")]
    assert statuses[-1] == str(status), statuses


def cloud_row(daemon: Daemon) -> dict[str, Any]:
    """The intent classifier's cloud tier as the capability registry shows it."""
    for task in daemon.client.capabilities():
        for row in task.get("models", []):
            if row["model"] == CLOUD_MODEL and row.get("cloud"):
                return dict(row["cloud"])
    return {}


@pytest.mark.parametrize("transport", ["https", "grpcs"])
def test_tritons_statistics_teach_edged_the_clouds_service_time(
    make_daemon: type[Daemon], gateway: Gateway, pki: Path, clean: Cloud, transport: str
) -> None:
    """Other callers make the cloud's model slow (0.25 s a call, Triton's python backend told
    to wait); edged, which sends nothing there, learns it from Triton's statistics through the
    gateway (REST, and gRPC's statistics as JSON), and learns that it is quick again."""
    import tritonclient.http as httpclient

    url = (
        f"https://localhost:{gateway.port}/api/v1"
        if transport == "https"
        else f"grpcs://localhost:{gateway.grpc_port}"
    )
    daemon = behind(make_daemon, url, pki, "stats_interval_s = 0.2\n")
    other = httpclient.InferenceServerClient(clean.peer.http_url.removeprefix("http://"))
    vector = httpclient.InferInput("embedding", [1, 384], "FP32")
    vector.set_data_from_numpy(np.ones((1, 384), np.float32))

    def others_call(times: int) -> None:
        for _ in range(times):
            other.infer(CLOUD_MODEL, [vector])

    before = len(journal(clean))
    clean.fail_every(0, delay_s=0.25, models=[CLOUD_MODEL])
    others_call(10)
    wait_for(lambda: (cloud_row(daemon).get("service_ms") or 0) >= 250, 20, "the slow cloud")
    time.sleep(0.5)  # the last read
    slow = cloud_row(daemon)
    # the routing estimate, taught as by 10 calls: at least 1 - 0.8^10 of the way to 250 ms
    assert slow["latency_ms"] >= 0.89 * 250 and slow["calls"] >= 10, slow
    clean.fail_every(0)
    others_call(20)
    wait_for(lambda: (cloud_row(daemon).get("service_ms") or 1e9) < 50, 20, "the quick cloud")
    quick = cloud_row(daemon)
    assert quick["latency_ms"] < slow["latency_ms"], (slow, quick)
    assert cloud_state(daemon.client)["service_ms"][CLOUD_MODEL] < 50
    # edged itself called nothing: only the others' calls reached Triton
    assert len(journal(clean)) - before == 30

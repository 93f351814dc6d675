"""Dynamic batching, admission control and metrics, through the socket of a real daemon."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from prometheus_client.parser import text_string_to_metric_families

from edged.client import Client, ClientError
from tests.conftest import MODELS, Daemon, wait_for

ENCODER = "text-encoder"


def metric(client: Client, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry ``labels`` (0 when there are none)."""
    status, headers, body = client.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    total = 0.0
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def token_batch(rows: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 20000, size=(rows, length)).astype(np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }


def test_64_concurrent_requests_run_batched_with_the_unbatched_results(client: Client) -> None:
    requests = [token_batch(1, 16, seed) for seed in range(64)]
    executions = metric(client, "edged_inference_executions_total", model=ENCODER)
    batches = metric(client, "edged_inference_batch_size_count", model=ENCODER)
    rows = metric(client, "edged_inference_batch_size_sum", model=ENCODER)
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda feeds: client.infer(ENCODER, feeds), requests))
    ran = metric(client, "edged_inference_executions_total", model=ENCODER) - executions
    print(f"64 requests ran in {ran:.0f} executions")
    assert 0 < ran < 64
    assert metric(client, "edged_inference_batch_size_count", model=ENCODER) - batches == ran
    assert metric(client, "edged_inference_batch_size_sum", model=ENCODER) - rows == 64
    session = ort.InferenceSession(str(MODELS / ENCODER / "1" / "model.onnx"))
    for feeds, answer in zip(requests, answers):
        (alone,) = session.run(["embedding"], feeds)  # the same request, unbatched
        np.testing.assert_allclose(answer["embedding"], alone, rtol=0, atol=1e-5)


def test_one_bad_request_among_concurrent_ones_fails_alone(client: Client) -> None:
    bad = token_batch(1, 16, 99)
    bad["input_ids"][0, 5] = 999_999  # past the vocabulary: ONNX Runtime refuses it at run time
    requests = [token_batch(1, 16, seed) for seed in range(15)] + [bad]

    def call(feeds: dict[str, np.ndarray]) -> int:
        try:
            client.infer(ENCODER, feeds)
        except ClientError as exc:
            assert "indices element out of data bound" in exc.message
            return exc.status
        return 200

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(call, requests))
    assert statuses == [200] * 15 + [400]


def test_a_full_queue_answers_429_with_retry_after_at_once(make_daemon: type[Daemon]) -> None:
    daemon = make_daemon(
        config='[scheduler]\nmax_queue_size = 2\n[models]\nload = ["text-encoder"]\n'
    ).start()
    heavy = token_batch(64, 128, 0)  # ~0.5 s of work per request on a small CPU
    outcomes: list[tuple[int, float | None]] = []

    def call(_: int) -> None:
        try:
            daemon.client.infer(ENCODER, heavy)
            outcomes.append((200, None))
        except ClientError as exc:
            outcomes.append((exc.status, exc.retry_after))

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(call, range(12)))
    statuses = sorted(status for status, _ in outcomes)
    print(f"statuses under overload: {statuses}")
    assert set(statuses) == {200, 429}
    assert all(retry is not None and retry >= 1 for status, retry in outcomes if status == 429)
    rejected = metric(daemon.client, "edged_inference_requests_total", outcome="rejected")
    assert rejected == statuses.count(429)
    assert daemon.client.infer(ENCODER, token_batch(1, 8, 1))["embedding"].shape == (1, 384)
    assert daemon.stop() == 0


def test_a_timeout_behind_a_busy_queue_is_refused_or_expires_never_answered_late(
    make_daemon: type[Daemon],
) -> None:
    daemon = make_daemon(config='[models]\nload = ["text-encoder"]\n').start()
    heavy = token_batch(64, 128, 0)
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(daemon.client.infer, ENCODER, heavy) for _ in range(6)]

        def queued() -> bool:
            return metric(daemon.client, "edged_inference_queue_depth", model=ENCODER) >= 3

        wait_for(queued, 60, "a busy queue", daemon.proc)
        try:
            daemon.client.infer(ENCODER, token_batch(1, 8, 2), parameters={"timeout": 2000})
            raise AssertionError("a 2 ms timeout behind seconds of work was answered")
        except ClientError as exc:
            assert exc.status in (429, 504), exc
            print(f"{exc.status}: {exc.message}")
        for future in busy:
            assert future.result()["embedding"].shape == (64, 384)
    assert daemon.stop() == 0


def test_priority_and_timeout_parameters_are_checked(client: Client) -> None:
    for params, wanted in (
        ({"priority": 7}, "priority 7 is outside 1..2"),
        ({"timeout": -5}, "parameter 'timeout'"),
    ):
        try:
            client.infer(ENCODER, token_batch(1, 8, 3), parameters=params)
            raise AssertionError(f"{params} was accepted")
        except ClientError as exc:
            assert exc.status == 400 and wanted in exc.message
    # An urgent request is served like any other when there is no queue.
    urgent = client.infer(ENCODER, token_batch(1, 8, 3), parameters={"priority": 1})
    assert urgent["embedding"].shape == (1, 384)


def test_task_api_takes_priority_and_timeout_from_the_query(client: Client) -> None:
    def embed(query: str) -> tuple[int, bytes]:
        status, _, body = client.request(
            "POST",
            "/v1/embed" + query,
            json.dumps({"texts": ["urgent text"]}).encode(),
            {"Content-Type": "application/json"},
        )
        return status, body

    status, body = embed("?priority=1&timeout=5000000")
    assert status == 200 and len(json.loads(body)["embeddings"][0]) == 384
    status, body = embed("?priority=3")  # reaches the encoder's scheduler, which has 2 levels
    assert status == 400 and b"priority 3 is outside 1..2" in body


def test_metrics_follow_prometheus_conventions(client: Client) -> None:
    client.intent(["how hot is the gpu"])
    status, _, body = client.request("GET", "/metrics")
    assert status == 200
    text = body.decode()
    for name in (
        "edged_inference_requests_total",
        "edged_inference_request_duration_seconds_bucket",
        "edged_inference_queue_duration_seconds_bucket",
        "edged_inference_compute_duration_seconds_bucket",
        "edged_inference_batch_size_bucket",
        "edged_inference_queue_depth",
        "edged_requests_in_flight",
    ):
        assert name in text, name
    ok = metric(client, "edged_inference_requests_total", model="intent", outcome="success")
    assert ok >= 1
    assert 'model="text-encoder",version="1"' in text  # the step a pipeline called counts too
    assert 'model="no-such-model"' not in text  # labels never come from what clients ask


def test_metrics_on_a_loopback_tcp_port(make_daemon: type[Daemon], tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = make_daemon(
        config=f'[metrics]\nport = {port}\n[models]\nload = ["intent-classifier"]\n'
    ).start()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        assert b"edged_requests_in_flight" in reply.read()
    assert daemon.stop() == 0


def test_the_default_tensor_models_that_take_batches_have_dynamic_batching(
    client: Client,
) -> None:
    for model in ("text-encoder", "text-encoder-int8", "intent-classifier"):
        config = client.model_config(model)
        assert config["dynamic_batching"]["priority_levels"] == "2", model

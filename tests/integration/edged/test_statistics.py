"""Triton's statistics extension as Triton's own clients read it: tritonclient.grpc on edged's
gRPC socket, tritonclient.http through a loopback relay (its HTTP client cannot reach a Unix
socket). The figures are the calls this test makes (deltas), on both protocols alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from tests.conftest import Daemon
from tests.relay import tcp_relay

MODEL = "text-encoder"


@pytest.fixture(scope="module")
def clients(daemon: Daemon) -> Iterator[tuple[grpcclient.InferenceServerClient, Any]]:
    grpc_path = daemon.socket.with_name("edged-grpc.sock")
    with tcp_relay(daemon.socket) as address:
        yield (
            grpcclient.InferenceServerClient(url=f"unix://{grpc_path}"),
            httpclient.InferenceServerClient(url=address),
        )


def stats(client: grpcclient.InferenceServerClient, version: str = "") -> dict[str, Any]:
    reply = client.get_inference_statistics(MODEL, version)
    doc = json_format.MessageToDict(reply, preserving_proto_field_name=True)
    [row] = doc["model_stats"]
    return dict(row)


def number(row: dict[str, Any], *path: str) -> int:
    value: Any = row
    for key in path:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return int(value or 0)


def call(client: grpcclient.InferenceServerClient, rows: int) -> None:
    ids = np.tile(np.array([[101, 7592, 2088, 102]], dtype=np.int64), (rows, 1))
    inputs = []
    for name, array in (
        ("input_ids", ids),
        ("attention_mask", np.ones_like(ids)),
        ("token_type_ids", np.zeros_like(ids)),
    ):
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.infer(MODEL, inputs)


def test_statistics_count_the_calls_made_on_both_protocols(
    clients: tuple[grpcclient.InferenceServerClient, Any],
) -> None:
    grpc_client, http_client = clients
    assert "statistics" in grpc_client.get_server_metadata().extensions
    before = stats(grpc_client)
    started_ms = time.time() * 1000
    for rows in (1, 1, 3):  # one after another: three executions, of 1, 1 and 3 rows
        call(grpc_client, rows)
    bad = grpcclient.InferInput("input_ids", [1, 2], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 2), np.float32))
    with pytest.raises(InferenceServerException):
        grpc_client.infer(MODEL, [bad])
    after = stats(grpc_client, "1")
    assert (after["name"], after["version"]) == (MODEL, "1")

    def delta(*path: str) -> int:
        return number(after, *path) - number(before, *path)

    assert delta("inference_stats", "success", "count") == 3
    assert delta("inference_stats", "success", "ns") > 0
    assert delta("inference_count") == 5  # rows, as Triton counts a batch's inferences
    assert delta("execution_count") == 3
    assert delta("inference_stats", "compute_infer", "count") == 3
    assert (
        0
        < delta("inference_stats", "compute_infer", "ns")
        <= delta("inference_stats", "success", "ns")
    )
    assert delta("inference_stats", "queue", "count") == 3
    assert number(after, "last_inference") >= started_ms - 1
    sizes = {int(b["batch_size"]): b for b in after["batch_stats"]}
    earlier = {int(b["batch_size"]): b for b in before.get("batch_stats", [])}
    assert (
        number(sizes[3], "compute_infer", "count")
        - number(earlier.get(3, {}), "compute_infer", "count")
        == 1
    )
    # the refused call (a wrong input) failed: counted so, with no execution
    assert delta("inference_stats", "fail", "count") == 1

    # the same figures over REST, Triton's JSON (numbers, not strings)
    rest = http_client.get_inference_statistics(MODEL)
    [row] = rest["model_stats"]
    assert row["inference_stats"]["success"]["count"] == number(
        after, "inference_stats", "success", "count"
    )
    assert row["execution_count"] == number(after, "execution_count")
    assert row["inference_count"] == number(after, "inference_count")
    every = {
        (r["name"], r["version"]) for r in http_client.get_inference_statistics()["model_stats"]
    }
    assert {(MODEL, "1"), ("intent-classifier", "1")} <= every


def test_unknown_models_and_versions_are_not_found(
    clients: tuple[grpcclient.InferenceServerClient, Any],
) -> None:
    grpc_client, http_client = clients
    for model, version in (("no-such-model", ""), (MODEL, "9")):
        with pytest.raises(InferenceServerException) as found:
            grpc_client.get_inference_statistics(model, version)
        assert found.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as rest:
            http_client.get_inference_statistics(model, version)
        assert rest.value.status() == "404", rest.value

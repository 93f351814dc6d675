"""Issue 44, point 13: what Triton's statistics count, and which config.pbtxt edged shows.

A real edged with small real models (y = x * factor, tests/modelfiles.py) and the default
repository's text-encoder with the pipeline that calls it (text-embedding, which warms its step
up when it loads). Each refused call of a model is a failure in its statistics, whatever refused
it: its inputs, an unknown version, a shared-memory region it names, a parameter, an output it
asks for; edged's own calls (a pipeline's warm-up at load, an install's smoke test) are nobody's
calls. ``GET /v2/models/{m}/config`` shows the config of the version that serves, and gRPC's
ModelConfig with a version that version's own.

Before this was fixed: the statistics counted 5 of these 9 refused calls over REST (a
shared-memory region, an unknown version and a bad parameter were missing; an unknown output
was a success), text-encoder showed a success and an execution before anyone called it, and
after a version with its own config.pbtxt (max_batch_size 8) was installed, the config endpoint
still showed the model's (4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from edged.client import Client, ClientError
from tests.conftest import Daemon, linked_repository
from tests.integration.edged.test_model_install import configured, smoke, staged, staging
from tests.modelfiles import CONFIG, add_model, scale_model

MODEL = "scale"
ROW = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
NOWHERE = {"shared_memory_region": "nowhere", "shared_memory_byte_size": 8}
WIDE = (CONFIG % "").replace("max_batch_size: 4", "max_batch_size: 8")


def stats(client: Client, model: str) -> dict[str, dict[str, Any]]:
    """The model's statistics over REST, by version."""
    doc = client.call("GET", f"/v2/models/{model}/stats")
    return {row["version"]: row for row in doc["model_stats"]}


def figures(row: dict[str, Any]) -> dict[str, int]:
    """What a caller's call moves: its outcome, the rows run, the executions, the queue."""
    calls = row["inference_stats"]
    return {
        "success": calls["success"]["count"],
        "fail": calls["fail"]["count"],
        "queue": calls["queue"]["count"],
        "inference_count": row["inference_count"],
        "execution_count": row["execution_count"],
    }


def grpc_client(daemon: Daemon) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        url=f"unix://{daemon.socket.with_name('edged-grpc.sock')}"
    )


def test_every_refused_call_is_a_failure_and_none_is_a_success(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    add_model(repository, MODEL, {1: 2.0})
    daemon = make_daemon(repository).start()
    client = daemon.client
    before = figures(stats(client, MODEL)["1"])
    shared = {"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": NOWHERE}
    refused: list[tuple[str, dict[str, Any], str | None]] = [
        ("a wrong datatype", {"inputs": [{**ROW, "datatype": "INT32", "data": [1, 2]}]}, None),
        ("a wrong shape", {"inputs": [{**ROW, "shape": [1, 3], "data": [1.0] * 3}]}, None),
        ("a batch over 4", {"inputs": [{**ROW, "shape": [5, 2], "data": [1.0] * 10}]}, None),
        ("an unknown input", {"inputs": [{**ROW, "name": "z"}]}, None),
        ("an unknown version", {"inputs": [ROW]}, "9"),
        ("an input in a region nobody registered", {"inputs": [shared]}, None),
        (
            "an output to a region nobody registered",
            {"inputs": [ROW], "outputs": [{"name": "y", "parameters": NOWHERE}]},
            None,
        ),
        ("a bad priority", {"inputs": [ROW], "parameters": {"priority": "high"}}, None),
        ("an unknown output", {"inputs": [ROW], "outputs": [{"name": "nope"}]}, None),
    ]
    for why, doc, version in refused:
        with pytest.raises(ClientError) as answer:
            client.infer_json(MODEL, doc, version=version)
        assert 400 <= answer.value.status < 500, (why, answer.value)

    # the same refusals on gRPC: an unknown version and a region nobody registered
    grpc = grpc_client(daemon)
    row = grpcclient.InferInput("x", [1, 2], "FP32")
    row.set_data_from_numpy(np.array([[1.0, 2.0]], np.float32))
    with pytest.raises(InferenceServerException):
        grpc.infer(MODEL, [row], model_version="9")
    region = grpcclient.InferInput("x", [1, 2], "FP32")
    region.set_shared_memory("nowhere", 8)
    with pytest.raises(InferenceServerException):
        grpc.infer(MODEL, [region])

    after = figures(stats(client, MODEL)["1"])
    moved = {key: after[key] - before[key] for key in after}
    # every one failed; only the unknown output's ran (the model answered, edged refused the
    # answer): an execution of one row, a failed call all the same
    assert moved == {
        "success": 0,
        "fail": len(refused) + 2,
        "queue": 1,
        "inference_count": 1,
        "execution_count": 1,
    }, moved

    # and a call that runs is one success, one execution of one row
    assert client.infer_json(MODEL, {"inputs": [ROW]})["outputs"][0]["data"] == [2.0, 4.0]
    last = figures(stats(client, MODEL)["1"])
    assert {key: last[key] - after[key] for key in last} == {
        "success": 1,
        "fail": 0,
        "queue": 1,
        "inference_count": 1,
        "execution_count": 1,
    }


def test_warm_ups_and_smoke_tests_are_not_callers_calls(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repository = linked_repository(tmp_path / "models", ["text-encoder", "text-embedding"])
    add_model(repository, MODEL, {1: 1.0})
    daemon = make_daemon(repository).start()
    client = daemon.client
    nobody = {"success": 0, "fail": 0, "queue": 0, "inference_count": 0, "execution_count": 0}
    # text-embedding warmed text-encoder up when it loaded: edged's call, not a caller's
    assert figures(stats(client, "text-encoder")["1"]) == nobody
    assert figures(stats(client, "text-embedding")["1"]) == nobody
    assert figures(stats(client, MODEL)["1"]) == nobody

    # a caller's call of the pipeline counts there, and its step's call at the step
    client.infer_json(
        "text-embedding",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]},
    )
    assert figures(stats(client, "text-embedding")["1"])["success"] == 1
    step = figures(stats(client, "text-encoder")["1"])
    assert (step["success"], step["execution_count"], step["inference_count"]) == (1, 1, 1)

    # an install's smoke test is edged's check of the version, not a call of it
    source, files = staged(staging(daemon), 2, 3.0)
    client.install(MODEL, 2, source, files, smoke(3.0))
    assert figures(stats(client, MODEL)["2"]) == nobody


def config_over_grpc(daemon: Daemon, version: str = "") -> dict[str, Any]:
    reply = grpc_client(daemon).get_model_config(MODEL, version)
    return dict(json_format.MessageToDict(reply.config, preserving_proto_field_name=True))


def test_the_config_shown_is_the_serving_versions_own(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    add_model(repository, MODEL, {1: 1.0})
    daemon = make_daemon(repository).start()
    client = daemon.client
    assert client.model_config(MODEL)["max_batch_size"] == 4

    source, files = configured(staging(daemon), MODEL, 2, 2.0, WIDE)
    client.install(MODEL, 2, source, files, smoke(2.0))
    doc = {"inputs": [{**ROW, "shape": [8, 2], "data": [1.0] * 16}]}
    assert client.infer_json(MODEL, doc)["model_version"] == "2"  # 8 rows: version 2's config
    assert client.model_config(MODEL)["max_batch_size"] == 8
    assert int(config_over_grpc(daemon)["max_batch_size"]) == 8

    assert client.activate(MODEL)["active"] == 1  # a rollback takes the old config back
    assert client.model_config(MODEL)["max_batch_size"] == 4


def test_a_versioned_config_is_that_versions_own(make_daemon: type[Daemon], tmp_path: Path) -> None:
    repository = tmp_path / "models"
    add_model(repository, MODEL, {1: 1.0}, policy="version_policy: { all { } }")
    scale_model(repository / MODEL / "2" / "model.onnx", 2.0)
    (repository / MODEL / "2" / "config.pbtxt").write_text(WIDE)
    daemon = make_daemon(repository).start()
    assert daemon.client.model_config(MODEL)["max_batch_size"] == 8  # the newest serves
    assert int(config_over_grpc(daemon, "1")["max_batch_size"]) == 4
    assert int(config_over_grpc(daemon, "2")["max_batch_size"]) == 8
    with pytest.raises(InferenceServerException) as unknown:
        config_over_grpc(daemon, "9")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    # the same over REST, by its versioned path
    for version, rows in (("1", 4), ("2", 8)):
        shown = daemon.client.call("GET", f"/v2/models/{MODEL}/versions/{version}/config")
        assert shown["max_batch_size"] == rows
    with pytest.raises(ClientError) as missing:
        daemon.client.call("GET", f"/v2/models/{MODEL}/versions/9/config")
    assert missing.value.status == 404

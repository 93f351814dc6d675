"""New model versions on a real edged: installed from a staging directory (files checked, moved
in at once, smoke-tested), switched to at one point in time under 200 requests/s with none
failed, three versions kept on disk, rollback, and the active version kept across restarts.

The model is a real ONNX graph run by ONNX Runtime: y = x * factor, a factor per version, so
each answer says which version gave it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloudsync.protocol.manifest import file_entry
from edged.client import Client, ClientError
from tests.conftest import Daemon
from tests.integration.edged.test_admin import edgectl
from tests.modelfiles import add_model, scale_model

MODEL = "scale"


def staging(daemon: Daemon) -> Path:
    """edged's staging directory, the only place it installs from."""
    return daemon.workdir / "state" / "staging"


def staged(root: Path, version: int, factor: float) -> tuple[str, list[dict[str, Any]]]:
    """A version's files in a staging directory: (the directory, its file list)."""
    directory = root / f"{MODEL}-{version}"
    scale_model(directory / "model.onnx", factor)
    return str(directory), [file_entry(directory / "model.onnx")]


def smoke(factor: float) -> list[dict[str, Any]]:
    return [
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, -2.0]}],
            "outputs": [{"name": "y", "data": [factor, -2 * factor], "atol": 1e-6}],
        }
    ]


def answer(client: Client) -> tuple[str, float]:
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 1.0]}]}
    reply = client.infer_json(MODEL, doc)
    return reply["model_version"], reply["outputs"][0]["data"][0]


@pytest.fixture
def edged(make_daemon: type[Daemon], tmp_path: Path) -> Daemon:
    repository = tmp_path / "models"
    add_model(repository, MODEL, {1: 1.0})
    return make_daemon(repository).start()


def test_a_new_version_takes_over_at_one_point_under_200_requests_a_second(
    edged: Daemon, tmp_path: Path
) -> None:
    client = edged.client
    seen: list[tuple[float, str, float]] = []
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:  # one request every 5 ms, each answer recorded in order
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                version, y = answer(client)
                seen.append((time.monotonic(), version, y))
            except ClientError as exc:
                failures.append(exc.message)
            next_at += 0.005
            time.sleep(max(0.0, next_at - time.monotonic()))

    sender = threading.Thread(target=load)
    sender.start()
    try:
        time.sleep(1.0)
        source, files = staged(staging(edged), 2, 2.0)
        installed = client.install(MODEL, 2, source, files, smoke(2.0))
        time.sleep(1.0)
    finally:
        stop.set()
        sender.join()
    assert failures == []
    versions = [v for _, v, _ in seen]
    switch = versions.index("2")
    assert set(versions[:switch]) == {"1"} and set(versions[switch:]) == {"2"}, "one switch"
    assert all(y == float(v) for _, v, y in seen)  # each version answers with its own factor
    span = seen[-1][0] - seen[0][0]
    print(
        f"{len(seen)} requests in {span:.2f} s ({len(seen) / span:.0f}/s), {len(failures)}"
        f" failed, version 2 from request {switch + 1}; install {installed['seconds']} s"
    )
    assert len(seen) / span > 150, f"{len(seen) / span:.0f} requests/s"
    assert installed["active"] == 2 and installed["previous"] == 1
    assert installed["smoke_cases"] == 1 and installed["on_disk"] == [1, 2]
    assert not Path(source).exists()  # moved in, not copied
    assert [m["version"] for m in client.repository_index()] == ["2"]  # 1 unloaded


def test_bad_files_and_a_failed_smoke_test_change_nothing(edged: Daemon) -> None:
    client = edged.client
    source, files = staged(staging(edged), 2, 2.0)
    with (Path(source) / "model.onnx").open("ab") as f:
        f.write(b"\0")  # one byte more than listed
    with pytest.raises(ClientError) as refused:
        client.install(MODEL, 2, source, files)
    assert refused.value.status == 400 and "bytes" in refused.value.message

    source, files = staged(staging(edged), 3, 3.0)
    corrupt = Path(source) / "model.onnx"
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF  # same length, another digest
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ClientError) as refused:
        client.install(MODEL, 3, source, files)
    assert "SHA-256" in refused.value.message

    source, files = staged(staging(edged), 4, 4.0)
    (Path(source) / "extra.bin").write_bytes(b"x")
    with pytest.raises(ClientError) as refused:
        client.install(MODEL, 4, source, files)
    assert "'extra.bin' is not in the file list" in refused.value.message

    source, files = staged(staging(edged), 5, 5.0)
    with pytest.raises(ClientError) as refused:  # a version that answers wrong
        client.install(MODEL, 5, source, files, smoke(6.0))
    assert "smoke case 1: output 'y' differs by up to" in refused.value.message
    state = client.model_versions(MODEL)
    assert state["active"] == 1 and state["on_disk"] == [1], state  # nothing left behind
    assert answer(client) == ("1", 1.0)

    with pytest.raises(ClientError) as refused:
        client.install(MODEL, 1, source, files)
    assert "is the active one" in refused.value.message
    with pytest.raises(ClientError) as refused:
        client.install("nope", 2, source, files)
    assert refused.value.status == 404


def test_ten_updates_keep_three_versions_roll_back_and_survive_a_restart(edged: Daemon) -> None:
    client = edged.client
    for version in range(2, 12):
        source, files = staged(staging(edged), version, float(version))
        client.install(MODEL, version, source, files, smoke(float(version)))
    state = client.model_versions(MODEL)
    assert state["on_disk"] == [9, 10, 11] and state["active"] == 11
    assert answer(client) == ("11", 11.0)
    shown = edgectl(edged, "models", "versions", MODEL).stdout
    # the last ten activations are remembered
    assert "scale: version 11 active; activated before: [2, 3, 4, 5, 6, 7, 8, 9, 10]" in shown
    assert "on disk: [9, 10, 11]" in shown

    rolled = edgectl(edged, "--json", "models", "rollback", MODEL)  # the one before
    assert rolled.returncode == 0, rolled.stderr
    assert json.loads(rolled.stdout)["active"] == 10 and json.loads(rolled.stdout)["previous"] == 11
    assert answer(client) == ("10", 10.0)
    # a version staged and never activated (a crash before its smoke test) must not serve
    scale_model(edged.models / MODEL / "12" / "model.onnx", 12.0)
    assert edged.stop() == 0
    edged.start()
    client = edged.client
    assert answer(client) == ("10", 10.0)
    assert client.model_versions(MODEL)["history"][-2:] == [11, 10]
    assert client.activate(MODEL, 11)["active"] == 11
    with pytest.raises(ClientError) as missing:
        client.activate(MODEL, 3)
    assert missing.value.status == 404 and "no version 3 on disk" in missing.value.message
    np.testing.assert_equal(answer(client), ("11", 11.0))

"""New model versions on a real edged: installed from a staging directory (files checked, moved
in at once, smoke-tested), switched to at one point in time under 200 requests/s with none
failed, three versions kept on disk, rollback, and the active version kept across restarts.

The model is a real ONNX graph run by ONNX Runtime: y = x * factor, a factor per version, so
each answer says which version gave it."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloudsync.protocol.manifest import file_entry
from edged.client import Client, ClientError
from tests.asunit import owned_like
from tests.conftest import MODELS, Daemon
from tests.integration.edged.test_admin import edgectl
from tests.modelfiles import CONFIG, add_model, scale_model

MODEL = "scale"


def staging(daemon: Daemon) -> Path:
    """edged's staging directory, the only place it installs from."""
    return daemon.workdir / "state" / "staging"


def staged(root: Path, version: int, factor: float) -> tuple[str, list[dict[str, Any]]]:
    """A version's files in a staging directory: (the directory, its file list)."""
    directory = root / f"{MODEL}-{version}"
    scale_model(directory / "model.onnx", factor)
    owned_like(root, directory)
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
    with pytest.raises(ClientError) as refused:  # a model new here comes with its config
        client.install("nope", 2, source, files)
    assert refused.value.status == 400 and "must carry its config.pbtxt" in refused.value.message
    assert not (edged.models / "nope").exists()


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


def configured(
    root: Path, name: str, version: int, factor: float, config: str
) -> tuple[str, list[dict[str, Any]]]:
    """A version that carries its own config.pbtxt, staged: (the directory, its file list)."""
    directory = root / f"{name}-{version}"
    scale_model(directory / "model.onnx", factor)
    (directory / "config.pbtxt").write_text(config)
    owned_like(root, directory)
    return str(directory), [file_entry(directory / f) for f in ("model.onnx", "config.pbtxt")]


def rows(client: Client, model: str, count: int) -> tuple[str, list[float]]:
    """``count`` rows of ones in one request: (the version that answered, the values)."""
    doc = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [count, 2], "data": [1.0] * (2 * count)}
        ]
    }
    reply = client.infer_json(model, doc)
    return reply["model_version"], reply["outputs"][0]["data"]


def test_a_new_model_comes_with_its_config_is_checked_serves_and_survives_a_restart(
    edged: Daemon,
) -> None:
    client, root = edged.client, staging(edged)
    cases: list[tuple[str, str, list[dict[str, Any]], str]] = [
        ("fresh", 'platform: "nonsense"\n', [], "platform 'nonsense'"),
        ("fresh", 'name: "other"\n' + CONFIG % "", [], "differs from the model's, 'fresh'"),
        ("fresh", CONFIG % "", smoke(4.0), "smoke case 1: output 'y' differs"),
        ("-x", CONFIG % "", [], "is not a model name"),
        (".hidden", CONFIG % "", [], "is not a model name"),
        ("a" * 65, CONFIG % "", [], "is not a model name"),
        ("fresh", "x" * (1 << 20) + "\n", [], "over 1024 KiB"),
    ]
    for name, config, cases_, why in cases:
        source, files = configured(root, name, 1, 3.0, config)
        with pytest.raises(ClientError) as refused:
            client.install(name, 1, source, files, cases_)
        assert refused.value.status == 400 and why in refused.value.message, refused.value
        # nothing is left: no directory in the repository, no entry, the staging moved away
        assert sorted(p.name for p in edged.models.iterdir()) == [MODEL]
        assert name not in [m["name"] for m in client.repository_index()]
        with pytest.raises(ClientError) as missing:
            client.model_versions(name)
        assert missing.value.status == 404
    assert answer(client) == ("1", 1.0)

    source, files = configured(root, "fresh", 1, 3.0, CONFIG % "")
    done = client.install("fresh", 1, source, files, smoke(3.0))
    assert done["active"] == 1 and done["previous"] is None and done["on_disk"] == [1]
    assert rows(client, "fresh", 1) == ("1", [3.0, 3.0])
    assert (edged.models / "fresh" / "config.pbtxt").read_text() == CONFIG % ""
    assert not (root / "fresh-1").exists()  # moved in
    assert edged.stop() == 0
    edged.start()
    assert rows(edged.client, "fresh", 1) == ("1", [3.0, 3.0])
    assert edged.client.model_versions("fresh")["active"] == 1


def test_a_version_with_its_own_config_serves_with_it_and_a_rollback_takes_the_old_one_back(
    edged: Daemon,
) -> None:
    client, root = edged.client, staging(edged)
    assert rows(client, MODEL, 4) == ("1", [1.0] * 8)  # max_batch_size 4 in the model's config
    # a broken config in a new version: refused, version 1 serves as it did
    source, files = configured(root, MODEL, 2, 2.0, (CONFIG % "").replace("4", "-1"))
    with pytest.raises(ClientError) as refused:
        client.install(MODEL, 2, source, files, smoke(2.0))
    assert refused.value.status == 503, refused.value  # it fails to load, as a bad model file
    assert refused.value.message.endswith("max_batch_size must be >= 0")
    assert client.model_versions(MODEL)["on_disk"] == [1]

    one_row = (CONFIG % "").replace("max_batch_size: 4", "max_batch_size: 1")
    source, files = configured(root, MODEL, 2, 2.0, one_row)
    client.install(MODEL, 2, source, files, smoke(2.0))
    assert rows(client, MODEL, 1) == ("2", [2.0, 2.0])
    with pytest.raises(ClientError) as refused:  # the new config is in force
        rows(client, MODEL, 4)
    assert refused.value.status == 400
    # the model's own config.pbtxt is left as it was: version 1's
    assert (edged.models / MODEL / "config.pbtxt").read_text() == CONFIG % ""
    assert edged.stop() == 0  # a restart keeps version 2 with its config
    edged.start()
    client = edged.client
    with pytest.raises(ClientError):
        rows(client, MODEL, 4)
    assert client.activate(MODEL)["active"] == 1  # a rollback: version 1 with its config
    assert rows(client, MODEL, 4) == ("1", [1.0] * 8)


def test_a_removed_model_stops_serving_its_directory_goes_and_a_pipeline_keeps_its_models(
    edged: Daemon,
) -> None:
    client = edged.client
    add_model(edged.models, "doomed", {1: 5.0, 2: 6.0})
    owned_like(edged.models, edged.models / "doomed")
    client.load("doomed")
    assert rows(client, "doomed", 1) == ("2", [6.0, 6.0])
    done = client.remove_model("doomed")
    assert done == {"model": "doomed", "removed": [1, 2]}
    assert not (edged.models / "doomed").exists() and (edged.models / ".doomed.removed").is_file()
    with pytest.raises(ClientError) as gone:
        rows(client, "doomed", 1)
    assert gone.value.status == 404
    assert "doomed" not in [m["name"] for m in client.repository_index()]
    with pytest.raises(ClientError) as gone:
        client.remove_model("doomed")
    assert gone.value.status == 404
    assert edged.stop() == 0  # not back after a restart; the others serve
    edged.start()
    with pytest.raises(ClientError):
        rows(edged.client, "doomed", 1)
    assert answer(edged.client) == ("1", 1.0)
    # a new model of that name later: the tombstone goes
    source, files = configured(staging(edged), "doomed", 3, 7.0, CONFIG % "")
    edged.client.install("doomed", 3, source, files, smoke(7.0))
    assert rows(edged.client, "doomed", 1) == ("3", [7.0, 7.0])
    assert not (edged.models / ".doomed.removed").exists()


def test_a_model_that_a_serving_pipeline_calls_is_not_removed(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    for name in ("vad", "vad-silero"):  # the shipped pipeline and the model it calls (links)
        subprocess.run(["cp", "-al", str(MODELS / name), str(repository)], check=True)
    client = make_daemon(repository).start().client
    with pytest.raises(ClientError) as refused:
        client.remove_model("vad-silero")
    assert refused.value.status == 409, refused.value
    assert "called by vad: remove or change that first" in refused.value.message
    assert (repository / "vad-silero" / "config.pbtxt").is_file()
    assert [m["state"] for m in client.repository_index()] == ["READY", "READY"]
    assert client.remove_model("vad")["removed"] == [1]
    assert client.remove_model("vad-silero")["removed"] == [1]
    assert sorted(p.name for p in repository.iterdir()) == [".vad-silero.removed", ".vad.removed"]

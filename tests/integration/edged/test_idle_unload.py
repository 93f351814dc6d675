"""Idle unload on a real edged: a model nobody calls is unloaded (its memory goes back), the
next call loads it again and gets the same answer; with every model idle, the Jetson power-mode
hint switches nvpmodel's mode and switches it back on the next load."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.idle_unload import idle, tree_rss
from edged.client import Client
from tests.conftest import Daemon, linked_repository, wait_for

TEXT = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["idle time"]}]}

# nvpmodel exists only on a Jetson (JetPack): this stand-in keeps the mode in a file and logs
# its calls, with the real tool's output format (`nvpmodel -q`: the mode's name, then number).
NVPMODEL = """#!/bin/sh
echo "$*" >> "{log}"
case "$1" in
  -q) echo "NV Power Mode: MODE_$(cat "{mode}")"; cat "{mode}" ;;
  -m) echo "$2" > "{mode}" ;;
  *) exit 2 ;;
esac
"""


def metric(client: Client, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(client.metrics()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def embed(client: Client) -> np.ndarray:
    reply = client.call("POST", "/v2/models/text-embedding/infer", TEXT)
    return np.array(reply["outputs"][0]["data"], dtype=np.float32)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_idle_model_gives_its_memory_back_and_the_next_call_loads_it(
    make_daemon: type[Daemon], tmp_path: Path, isolation: str
) -> None:
    repo = linked_repository(tmp_path / "repo", ["text-embedding", "text-encoder"])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "mode").write_text("0\n")
    (tmp_path / "calls").touch()
    tool = bindir / "nvpmodel"
    tool.write_text(NVPMODEL.format(log=tmp_path / "calls", mode=tmp_path / "mode"))
    tool.chmod(0o755)
    config = "[models]\nidle_unload_s = 1.5\nidle_power_mode = 2\n"
    config += f'[onnxruntime]\nisolation = "{isolation}"\n'
    path = f"{bindir}:{os.environ['PATH']}"
    daemon = make_daemon(repo, config=config)
    # the wrapper an operator gives edged (docs/OPERATIONS.md): it runs as edged's user
    daemon.give(bindir, tmp_path / "mode", tmp_path / "calls")
    daemon.start(env={"PATH": path})
    client = daemon.client

    assert daemon.proc is not None
    before = embed(client)
    loaded = tree_rss(daemon.proc.pid)  # edged and its worker processes
    workers = metric(client, "edged_worker_resident_memory_bytes")
    assert (workers is not None and workers > 0) == (isolation == "process")
    assert metric(client, "edged_model_version_info", model="text-encoder", idle="false") == 1
    # the start-up self-test: what the session really runs on (this machine: the CPU)
    runtime = {"model": "text-encoder", "providers": "CPUExecutionProvider", "fallback": "false"}
    assert metric(client, "edged_model_runtime_info", **runtime) == 1
    # /proc tells the CPU load (from the second sample: it is a difference)
    wait_for(lambda: metric(client, "edged_local_load_ratio") is not None, 10, "the load")

    wait_for(lambda: idle(client, "text-encoder"), 30, "text-encoder unloaded while idle")
    assert metric(client, "edged_model_version_info", model="text-encoder", idle="true") == 1
    # counted once the runtime is unloaded (a worker's exit takes a moment after "idle")
    wait_for(
        lambda: metric(client, "edged_model_idle_unloads_total", model="text-encoder") == 1,
        10,
        "the unload counted",
    )
    wait_for(lambda: not metric(client, "edged_worker_resident_memory_bytes"), 10, "no worker")
    unloaded = tree_rss(daemon.proc.pid)
    model_size = (repo / "text-encoder" / "1" / "model.onnx").stat().st_size
    print(
        f"{isolation}: RSS loaded {loaded / 2**20:.0f} MiB, idle {unloaded / 2**20:.0f} MiB,"
        f" model file {model_size / 2**20:.0f} MiB"
    )
    assert loaded - unloaded > model_size / 2, "unloading gave back less than half the model"
    wait_for(lambda: (tmp_path / "mode").read_text().strip() == "2", 30, "the idle power mode")

    after = embed(client)  # loads it again
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    assert not idle(client, "text-encoder")
    assert metric(client, "edged_model_wake_duration_seconds_count", model="text-encoder") == 1
    assert (tmp_path / "mode").read_text().strip() == "0"  # back before the model loaded
    assert (tmp_path / "calls").read_text().split("\n")[:3] == ["-q", "-m 2", "-m 0"]
    assert daemon.stop() == 0

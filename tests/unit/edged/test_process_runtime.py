"""ProcessRuntime on real ONNX Runtime sessions in real worker processes: the same answers as
in-process, errors mapped, a crashed worker reported and replaced, memory given back."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edged.common.errors import EdgedError, InvalidRequest, ModelLoadError, Unavailable
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.runtimes.base import Runtime, Tensors
from edged.runtimes.onnxruntime import OnnxRuntime
from edged.runtimes.process import ProcessRuntime, rss_bytes, wants_process
from tests.conftest import MODELS, require_models

# y = 2x and t = s (a BYTES tensor), batched, four instances: requests overlap in the worker.
CONFIG = """platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "x" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "s" data_type: TYPE_STRING dims: [ 1 ] }
]
output [
  { name: "y" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "t" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { count: 4 kind: KIND_CPU } ]
"""
SETTINGS = OnnxRuntimeConfig(providers=["cpu"], intra_op_threads=1, isolation="process")
Factory = Callable[..., Runtime]


def double_and_echo(repo: Path) -> Path:
    """A model directory with y = 2x and t = s; returns its version directory."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["y"]),
            helper.make_node("Identity", ["s"], ["t"]),
        ],
        "double_and_echo",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2]),
            helper.make_tensor_value_info("s", TensorProto.STRING, ["batch", 1]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2]),
            helper.make_tensor_value_info("t", TensorProto.STRING, ["batch", 1]),
        ],
        [helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    version = repo / "m" / "1"
    version.mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text(CONFIG)
    onnx.save(model, str(version / "model.onnx"))
    return version


def runtime(kind: Factory, version_dir: Path) -> Runtime:
    return kind(read_config(version_dir.parent), version_dir, SETTINGS, ThreadPoolExecutor(2))


def request(rows: int, value: float) -> Tensors:
    return {
        "x": np.full((rows, 2), value, np.float32),
        "s": np.array([[f"row {i} of {value}".encode()] for i in range(rows)], dtype=object),
    }


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def comm(pid: int) -> str:
    """The short process name that ps -e shows."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def gone(pid: int) -> bool:
    """True when no process (not even a zombie) has this pid."""
    return not Path(f"/proc/{pid}").exists()


def test_answers_as_the_in_process_runtime_does_with_concurrent_calls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    version = double_and_echo(tmp_path)
    caplog.set_level(logging.INFO, logger="edged")

    async def scenario() -> None:
        local, isolated = runtime(OnnxRuntime, version), runtime(ProcessRuntime, version)
        await local.load()
        await isolated.load()
        for rows, value in ((1, 1.5), (3, -2.0), (8, 0.25)):
            want, got = (
                await local.infer(request(rows, value), {}),
                await isolated.infer(request(rows, value), {"priority": 1}),
            )
            assert want.keys() == got.keys() == {"y", "t"}
            np.testing.assert_array_equal(got["y"], want["y"])
            np.testing.assert_array_equal(got["t"], want["t"])
            assert got["t"].dtype == want["t"].dtype == object
        # Many calls at once share the one pipe; each gets its own answer back.
        calls = [isolated.infer(request(1 + i % 8, float(i)), {}) for i in range(48)]
        for i, out in enumerate(await asyncio.gather(*calls)):
            np.testing.assert_array_equal(out["y"], np.full((1 + i % 8, 2), 2.0 * i))
        meta = isolated.metadata()
        assert meta["providers"] == local.metadata()["providers"] == ["CPUExecutionProvider"]
        assert meta["isolation"] == "process"
        assert meta["pid"] != os.getpid()
        assert meta["rss_bytes"] > 20_000_000  # Python, numpy and ONNX Runtime at least
        assert comm(meta["pid"]) == "edged:m"
        await isolated.unload()
        await local.unload()
        # The worker's own log lines reach the parent's logging, with the worker's pid.
        loaded = [r for r in caplog.records if "loaded model.onnx" in r.getMessage()]
        assert meta["pid"] in {r.process for r in loaded}

    run(scenario)


def test_input_errors_come_back_as_the_in_process_runtime_raises_them(tmp_path: Path) -> None:
    version = double_and_echo(tmp_path)
    wrong_width = {"x": np.ones((1, 3), np.float32), "s": np.array([[b"a"]], dtype=object)}

    async def scenario() -> None:
        local, isolated = runtime(OnnxRuntime, version), runtime(ProcessRuntime, version)
        await local.load()
        await isolated.load()
        with pytest.raises(InvalidRequest) as want:
            await local.infer(wrong_width, {})
        with pytest.raises(InvalidRequest) as got:
            await isolated.infer(wrong_width, {})
        assert got.value.message == want.value.message
        assert got.value.status == 400
        assert "INVALID_ARGUMENT" in got.value.message and "model 'm'" in got.value.message
        # Any other failure is a 500 that names the model and what went wrong.
        with pytest.raises(EdgedError) as other:
            await isolated.infer({"x": np.ones((1, 2), np.float32)}, {})
        assert type(other.value) is EdgedError and other.value.status == 500
        assert "model 'm' failed in its worker process: ValueError" in other.value.message
        # The worker serves on after errors.
        out = await isolated.infer(request(2, 3.0), {})
        np.testing.assert_array_equal(out["y"], np.full((2, 2), 6.0))
        await isolated.unload()
        await local.unload()

    run(scenario)


def test_a_killed_worker_fails_its_calls_with_503_and_a_new_load_serves_again(
    tmp_path: Path,
) -> None:
    version = double_and_echo(tmp_path)

    async def scenario() -> None:
        isolated = runtime(ProcessRuntime, version)
        await isolated.load()
        pid = isolated.metadata()["pid"]
        # Stopped, the worker cannot answer: the call is surely in flight when it is killed.
        os.kill(pid, signal.SIGSTOP)
        pending = asyncio.ensure_future(isolated.infer(request(1, 1.0), {}))
        await asyncio.sleep(0)  # one turn of the loop: the call is sent and waits
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Unavailable) as crashed:
            await pending
        message = crashed.value.message
        assert "model 'm' version 1 is unavailable" in message
        assert f"(pid {pid}) was killed by signal SIGKILL" in message
        assert "load the model again" in message
        with pytest.raises(Unavailable, match="SIGKILL"):  # later calls, at once
            await isolated.infer(request(1, 1.0), {})
        assert gone(pid)  # reaped, no zombie
        assert isolated.metadata()["pid"] is None
        await isolated.unload()
        await isolated.unload()  # idempotent
        await isolated.load()
        fresh = isolated.metadata()["pid"]
        assert fresh != pid
        out = await isolated.infer(request(2, 4.0), {})
        np.testing.assert_array_equal(out["y"], np.full((2, 2), 8.0))
        await isolated.unload()
        assert gone(fresh)
        with pytest.raises(ModelLoadError, match="not loaded"):
            await isolated.infer(request(1, 1.0), {})

    run(scenario)


def test_a_worker_that_dies_while_loading_is_a_load_error(tmp_path: Path) -> None:
    version = double_and_echo(tmp_path)

    async def scenario() -> None:
        isolated = runtime(ProcessRuntime, version)
        loading = asyncio.ensure_future(isolated.load())
        deadline = time.monotonic() + 30
        while (pid := isolated.metadata()["pid"]) is None:  # the child is started in the pool
            assert time.monotonic() < deadline and not loading.done()
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)  # long before it has imported ONNX Runtime
        with pytest.raises(ModelLoadError) as failed:
            await loading
        assert failed.value.message == (
            f"model 'm' version 1: its worker process (pid {pid}) was killed by signal SIGKILL"
            " while loading"
        )
        assert gone(pid)
        await isolated.unload()

    run(scenario)


def test_a_corrupt_model_is_a_load_error_with_onnx_runtimes_reason(tmp_path: Path) -> None:
    version = double_and_echo(tmp_path)
    model = version / "model.onnx"
    model.write_bytes(model.read_bytes()[:40])

    async def scenario() -> None:
        local, isolated = runtime(OnnxRuntime, version), runtime(ProcessRuntime, version)
        with pytest.raises(ModelLoadError) as want:
            await local.load()
        with pytest.raises(ModelLoadError) as got:
            await isolated.load()
        assert got.value.message == want.value.message
        assert got.value.message.startswith(f"ONNX Runtime cannot load {model}")
        assert isolated.metadata()["pid"] is None
        await isolated.unload()

    run(scenario)


def test_minilm_with_int64_inputs_matches_and_its_memory_stays_in_the_worker() -> None:
    """The daemon's RSS does not grow by the model's size; unloading ends the worker."""
    require_models()
    version = MODELS / "text-encoder" / "1"
    ids = np.random.default_rng(7).integers(1000, 20000, (3, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[2, 8:] = 0  # a padded row
    tokens = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    me = os.getpid()

    async def scenario() -> None:
        isolated = runtime(ProcessRuntime, version)
        before = rss_bytes(me)
        await isolated.load()
        got = await isolated.infer(tokens, {})
        isolated_growth = rss_bytes(me) - before
        meta = isolated.metadata()
        worker_rss = meta["rss_bytes"]
        await isolated.unload()
        assert gone(meta["pid"]) and isolated.metadata()["rss_bytes"] == 0

        local = runtime(OnnxRuntime, version)
        before = rss_bytes(me)
        await local.load()
        want = await local.infer(tokens, {})
        local_growth = rss_bytes(me) - before
        await local.unload()

        assert got["embedding"].shape == (3, 384)
        np.testing.assert_allclose(got["embedding"], want["embedding"], rtol=0, atol=1e-6)
        size = (version / "model.onnx").stat().st_size
        print(
            f"\ntext-encoder ({size / 2**20:.0f} MiB file): daemon RSS +"
            f"{isolated_growth / 2**10:.0f} KiB with the worker (worker RSS"
            f" {worker_rss / 2**20:.0f} MiB, 0 after unload), +{local_growth / 2**20:.1f} MiB"
            " loaded in-process"
        )
        assert worker_rss > size
        assert local_growth > size / 2
        assert isolated_growth < size / 10

    run(scenario)


# A daemon in miniature: loads the model in a worker, prints the worker's pid, then runs one
# call per line read and prints y[0, 0]. Its stdout is the test's channel and nothing else:
# whatever else goes to file descriptor 1 goes to stderr, the worker's output included (ONNX
# Runtime prints its "EP Error ... Falling back" banner there when a GPU provider of the
# default list fails to start: TensorRT on a GPU machine without its libraries).
DAEMON = """
import asyncio, os, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.runtimes.process import ProcessRuntime

channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

async def main() -> None:
    version = Path(sys.argv[1])
    runtime = ProcessRuntime(
        read_config(version.parent), version, OnnxRuntimeConfig(), ThreadPoolExecutor(2)
    )
    await runtime.load()
    print(runtime.metadata()["pid"], file=channel, flush=True)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        feeds = {"x": np.full((1, 2), 2.0, np.float32), "s": np.array([["a"]], dtype=object)}
        print((await runtime.infer(feeds, {}))["y"][0, 0], file=channel, flush=True)

asyncio.run(main())
"""


def ended(pid: int) -> bool:
    """True when the process has exited (gone, or a zombie its new parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_worker_ignores_sigterm_and_ends_with_its_daemon(tmp_path: Path) -> None:
    """systemd's stop signals the whole group: the daemon drains, then ends its workers; and a
    daemon killed outright leaves no worker holding memory."""
    version = double_and_echo(tmp_path)
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DAEMON), str(version)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as daemon:
        assert daemon.stdin is not None and daemon.stdout is not None
        try:
            worker = int(daemon.stdout.readline())
            os.kill(worker, signal.SIGTERM)
            daemon.stdin.write("call\n")
            daemon.stdin.flush()
            assert daemon.stdout.readline().strip() == "4.0"
        finally:
            daemon.kill()
    deadline = time.monotonic() + 20
    while not ended(worker):  # the worker reads EOF on its pipe and exits
        assert time.monotonic() < deadline, f"worker {worker} outlived its daemon"
        time.sleep(0.01)


CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


@pytest.mark.parametrize(
    ("isolation", "providers", "available", "expected"),
    [
        ("process", ["cpu"], [CPU], True),
        ("thread", ["cuda", "cpu"], [CUDA, CPU], False),
        ("auto", ["tensorrt", "cuda", "cpu"], [CPU], False),  # a CPU-only build
        ("auto", ["tensorrt", "cuda", "cpu"], [CUDA, CPU], True),
        ("auto", ["tensorrt", "cpu"], [TRT, CPU], True),
        ("auto", ["cpu"], [TRT, CUDA, CPU], False),  # the GPU is there but not wanted
    ],
)
def test_auto_isolation_picks_a_process_when_a_gpu_provider_is_in_use(
    isolation: str, providers: list[str], available: list[str], expected: bool
) -> None:
    settings = OnnxRuntimeConfig.model_validate({"isolation": isolation, "providers": providers})
    assert wants_process(settings, available) is expected

"""What edged asks of ONNX Runtime's GPU providers: TensorRT's options and engine cache key,
the provider choice and the start-up self-test. This machine has no GPU: the options and the
self-test are checked as data, and on a real CPU session; the GPU test skips with its reason
unless onnxruntime-gpu and a GPU are there (bench/gpu_check.sh runs it on a GPU machine)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.runtimes import gpu
from edged.runtimes.onnxruntime import OnnxRuntime, choose_providers
from tests.modelfiles import add_model

ALL = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_providers_are_chosen_in_order_among_those_of_this_build() -> None:
    assert choose_providers(["tensorrt", "cuda", "cpu"], ALL) == ALL
    assert choose_providers(["cuda"], ALL) == ALL[1:]  # CPU always last
    assert choose_providers(["tensorrt"], ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_tensorrt_is_not_asked_for_where_its_library_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime-gpu lists TensorRT's provider without TensorRT installed; asked for, the
    session falls back with a banner on stdout at every load (seen on an H200). Here there is
    no libnvinfer at all: the real lookup says so."""
    gpu.tensorrt_loadable.cache_clear()
    assert gpu.tensorrt_loadable() is False
    assert gpu.usable_providers(ALL) == ALL[1:]
    monkeypatch.setattr(gpu, "tensorrt_loadable", lambda: True)  # a machine that has it
    assert gpu.usable_providers(ALL) == ALL


def test_tensorrt_builds_fp16_by_default_int8_only_with_a_calibration_table() -> None:
    cache = Path("/var/cache/edged/tensorrt/ocr-det/2/key")
    fp16 = gpu.tensorrt_options(cache, "fp16")
    assert fp16["trt_fp16_enable"] == "True" and "trt_int8_enable" not in fp16
    assert fp16["trt_engine_cache_enable"] == "True"
    assert fp16["trt_engine_cache_path"] == str(cache) and fp16["trt_timing_cache_enable"]
    assert "trt_timing_cache_path" not in fp16  # ONNX Runtime < 1.17 refuses it (JetPack 5)
    assert "trt_profile_min_shapes" not in fp16
    assert gpu.tensorrt_options(cache, "fp32")["trt_fp16_enable"] == "False"
    assert "trt_int8_enable" not in gpu.tensorrt_options(cache, "int8")  # no table: FP16
    table = Path("/models/ocr-det/2/calibration.flatbuffers")
    int8 = gpu.tensorrt_options(cache, "int8", table)
    assert int8["trt_int8_enable"] == int8["trt_fp16_enable"] == "True"
    assert int8["trt_int8_calibration_table_name"] == str(table)


def test_the_engine_cache_is_keyed_by_model_content_tensorrt_gpu_and_precision(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"graph one")
    base = tmp_path / "cache"

    def key(**change: str) -> Path:
        args = {"precision": "fp16", "gpu": "Orin (nvgpu)", "trt": "10.3.0", **change}
        return gpu.engine_cache_dir(
            base, "ocr-det", "2", model, args["precision"], args["gpu"], args["trt"]
        )

    first = key()
    assert first == key()  # the same after a restart
    assert first.parent == base / "ocr-det" / "2"
    assert first.name.endswith("-trt10.3.0-orin-nvgpu-fp16")
    assert len({first, key(precision="int8"), key(gpu="RTX 4090"), key(trt="8.6.2")}) == 4
    model.write_bytes(b"graph two")
    assert key() != first


def test_the_gpu_is_named_by_the_driver_else_by_the_jetson_device_tree(tmp_path: Path) -> None:
    # The files' layouts as the NVIDIA driver and a Jetson's kernel write them (faked: there is
    # neither here).
    assert gpu.gpu_name(tmp_path) == "unknown"
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\0")
    assert gpu.gpu_name(tmp_path) == "NVIDIA Jetson AGX Orin Developer Kit"
    info = tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0/information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\n")
    assert gpu.gpu_name(tmp_path) == "NVIDIA H200"


def test_the_self_test_names_the_gpu_providers_a_session_fell_back_from() -> None:
    assert gpu.self_test(ALL, ALL) == ""
    assert gpu.self_test(["CPUExecutionProvider"], ["CPUExecutionProvider"]) == ""
    why = gpu.self_test(ALL, ["CPUExecutionProvider"])
    assert why.startswith("asked for TensorRT and CUDA, but ONNX Runtime runs it on CPU")
    assert gpu.self_test(ALL, ALL[1:]).startswith("asked for TensorRT, but")


def _session(tmp_path: Path, providers: list[str]) -> OnnxRuntime:
    add_model(tmp_path, "double", {1: 2.0})
    settings = OnnxRuntimeConfig(providers=providers, tensorrt_cache_dir=tmp_path / "trt")
    config = read_config(tmp_path / "double")
    return OnnxRuntime(config, tmp_path / "double" / "1", settings, ThreadPoolExecutor(1))


def test_a_cpu_session_reports_what_it_asked_for_and_uses(tmp_path: Path) -> None:
    runtime = _session(tmp_path, ["tensorrt", "cuda", "cpu"])
    asyncio.run(runtime.load())
    available = ort.get_available_providers()
    meta = runtime.metadata()
    # TensorRT's provider only where its library loads (on the H200 without TensorRT: CUDA, CPU)
    usable = gpu.usable_providers(available)
    assert meta["requested"] == choose_providers(["tensorrt", "cuda", "cpu"], usable)
    assert meta["providers"] == runtime.session.get_providers()  # type: ignore[union-attr]
    if "CUDAExecutionProvider" not in available:  # this CPU build: nothing to fall back from
        assert meta == {
            "providers": ["CPUExecutionProvider"],
            "requested": ["CPUExecutionProvider"],
            "precision": "",
            "fallback": "",
        }


def test_on_a_gpu_the_session_really_runs_on_cuda(tmp_path: Path) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(
            "no CUDA provider in this onnxruntime build (a CPU-only machine): the GPU path is"
            " checked where bench/gpu_check.sh runs"
        )
    runtime = _session(tmp_path, ["cuda", "cpu"])
    asyncio.run(runtime.load())
    assert runtime.metadata()["fallback"] == "", runtime.metadata()
    assert runtime.metadata()["providers"][0] == "CUDAExecutionProvider"
    out = asyncio.run(runtime.infer({"x": np.ones((1, 2), np.float32)}, {}))
    np.testing.assert_allclose(out["y"], 2.0)


def test_the_dynamic_inputs_shape_ranges_go_to_tensorrt(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})  # max_batch_size 4, x: [2]
    profiles = gpu.profile_shapes(read_config(tmp_path / "double"))
    assert profiles == {"x": ([1, 2], [4, 2], [4, 2])}
    options = gpu.tensorrt_options(tmp_path, "fp16", None, profiles)
    assert options["trt_profile_min_shapes"] == "x:1x2"
    assert options["trt_profile_opt_shapes"] == options["trt_profile_max_shapes"] == "x:4x2"
    other = {"x": ([1, 2], [8, 2], [8, 2])}
    assert gpu.profile_key(profiles) == gpu.profile_key(dict(profiles))
    assert gpu.profile_key(profiles) != gpu.profile_key(other)  # another engine file

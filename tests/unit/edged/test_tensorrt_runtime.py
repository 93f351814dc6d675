"""The native TensorRT runtime. This machine has no GPU, no TensorRT and no pycuda: here, the
optimization profiles it derives from config.pbtxt, which models it serves, and that a model
asking for it without the libraries is unavailable with the reason while the rest serve. The
engine itself is built and run only where a GPU is (the last test; bench/gpu_check.sh)."""

from __future__ import annotations

import asyncio
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edged.common.errors import ModelLoadError
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.models.repository import ModelManager, State
from edged.runtimes.gpu import profile_shapes
from edged.runtimes.tensorrt import TensorRtRuntime, TensorRtSettings, wants_tensorrt
from tests.modelfiles import add_model

HAVE_TRT = all(importlib.util.find_spec(m) for m in ("tensorrt", "pycuda"))


def config_of(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.pbtxt").write_text(text)
    return tmp_path / "m"


def test_the_batch_dimension_ranges_from_one_to_max_batch_size(tmp_path: Path) -> None:
    directory = config_of(
        tmp_path,
        """platform: "tensorrt_plan" max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 48, 320 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 10 ] } ]""",
    )
    config = read_config(directory)
    assert wants_tensorrt(config)
    assert profile_shapes(config) == {"x": ([1, 3, 48, 320], [8, 3, 48, 320], [8, 3, 48, 320])}


def test_other_dynamic_dimensions_need_their_range_in_the_config(tmp_path: Path) -> None:
    text = """platform: "onnxruntime_onnx" max_batch_size: 32
        input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
        output [ { name: "e" data_type: TYPE_FP32 dims: [ 384 ] } ]
        parameters { key: "runtime" value { string_value: "tensorrt" } }"""
    config = read_config(config_of(tmp_path, text))
    assert wants_tensorrt(config)
    with pytest.raises(ModelLoadError, match="give its range as parameter trt_profile_ids"):
        profile_shapes(config)
    ranged = (
        text
        + """
        parameters { key: "trt_profile_ids" value { string_value: "1,16;8,128;32,512" } }"""
    )
    config = read_config(config_of(tmp_path, ranged))
    assert profile_shapes(config) == {"ids": ([1, 16], [8, 128], [32, 512])}
    bad = (
        text
        + """
        parameters { key: "trt_profile_ids" value { string_value: "1,16;8,128;32" } }"""
    )
    with pytest.raises(ModelLoadError, match="needs 2 dimensions"):
        profile_shapes(read_config(config_of(tmp_path, bad)))


def test_an_onnx_model_that_does_not_ask_for_it_stays_with_onnx_runtime(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})
    assert not wants_tensorrt(read_config(tmp_path / "double"))


def test_without_tensorrt_such_a_model_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    if HAVE_TRT:
        pytest.skip("tensorrt and pycuda are installed here: the GPU test covers this machine")
    add_model(tmp_path, "double", {1: 2.0})
    add_model(tmp_path, "engine", {1: 2.0})
    text = (tmp_path / "engine" / "config.pbtxt").read_text()
    (tmp_path / "engine" / "config.pbtxt").write_text(
        text + 'parameters { key: "runtime" value { string_value: "tensorrt" } }\n'
    )
    executor = ThreadPoolExecutor(2)
    settings = OnnxRuntimeConfig(tensorrt_cache_dir=tmp_path / "trt")

    def factory(config, version_dir):  # type: ignore[no-untyped-def]
        from edged.runtimes.onnxruntime import OnnxRuntime

        if wants_tensorrt(config):
            return TensorRtRuntime(config, version_dir, TensorRtSettings.of(settings), executor)
        return OnnxRuntime(config, version_dir, settings, executor)

    async def scenario() -> None:
        manager = ModelManager(tmp_path, factory)
        await manager.load_all()
        rows = {r["name"]: r for r in manager.index()}
        assert rows["double"]["state"] == State.READY.value
        assert rows["engine"]["state"] == State.UNAVAILABLE.value
        assert "needs tensorrt and pycuda" in rows["engine"]["reason"]
        await manager.close()

    asyncio.run(scenario())


def test_on_a_gpu_an_onnx_model_is_built_once_then_loaded_from_the_cache(tmp_path: Path) -> None:
    if not HAVE_TRT:
        pytest.skip(
            "no tensorrt and pycuda here (a machine without a GPU, or a GPU machine without"
            " TensorRT): the native runtime is unverified here"
        )
    add_model(tmp_path, "double", {1: 2.0})
    config = read_config(tmp_path / "double")
    settings = TensorRtSettings(tmp_path / "trt", "fp32")
    executor = ThreadPoolExecutor(1)

    async def scenario() -> None:
        first = TensorRtRuntime(config, tmp_path / "double" / "1", settings, executor)
        await first.load()
        assert not first.cached
        out = await first.infer({"x": np.ones((3, 2), np.float32)}, {})
        np.testing.assert_allclose(out["y"], 2.0)
        await first.unload()
        again = TensorRtRuntime(config, tmp_path / "double" / "1", settings, executor)
        await again.load()
        assert again.cached  # the engine cache hit on the second start
        await again.unload()

    asyncio.run(scenario())

"""The native TensorRT runtime (tensorrt + pycuda): Triton's ``tensorrt_plan`` models (a
serialized engine, ``model.plan``), and ONNX models whose config asks for it (parameter
``runtime: "tensorrt"``), built into an engine once and kept in the engine cache
(``runtimes/gpu.py``: keyed by the model file, TensorRT's version, the GPU and the precision).

TensorRT's name-based tensor API (``num_io_tensors``, ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3``) is the one of TensorRT 8.5 and later, 10 included
(JetPack 5.1 and 6). Dynamic dimensions take their range from the config: the batch from 1 to
``max_batch_size``, others from the parameter ``trt_profile_<input>`` ("min;opt;max", each
shape comma-separated, batch included). TensorRT's log goes to ``logging``.

Both libraries are optional: without them such a model is unavailable with the reason, and the
rest serve. Not run on a GPU yet (the one GPU machine lent had no TensorRT): see
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edged.common.errors import InvalidRequest, ModelLoadError, Unavailable
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import PLAN_PLATFORM, ModelConfig
from edged.runtimes import gpu
from edged.runtimes.base import Tensors

log = logging.getLogger(__name__)
WORKSPACE_BYTES = 1 << 30


def wants_tensorrt(config: ModelConfig) -> bool:
    """A model this runtime serves: a TensorRT plan, or an ONNX model that asks for it."""
    return config.platform == PLAN_PLATFORM or config.parameters.get("runtime") == "tensorrt"


def _import() -> tuple[Any, Any]:
    try:
        trt = importlib.import_module("tensorrt")
        cuda = importlib.import_module("pycuda.driver")
    except ImportError as exc:
        raise ModelLoadError(
            f"the native TensorRT runtime needs tensorrt and pycuda ({exc}); on JetPack:"
            " apt install python3-libnvinfer, pip install pycuda"
        ) from None
    return trt, cuda


@dataclass(frozen=True)
class TensorRtSettings:
    """What the native runtime takes of the ``[onnxruntime]`` section (its engines are built
    as the TensorRT provider's are): where engines are cached and their precision."""

    cache_dir: Path
    precision: Literal["fp16", "fp32", "int8"] = "fp16"

    @classmethod
    def of(cls, section: OnnxRuntimeConfig) -> TensorRtSettings:
        return cls(section.tensorrt_cache_dir, section.precision)


class TensorRtRuntime:
    """One version of a model as a TensorRT engine, one execution context per call at a time."""

    def __init__(
        self,
        config: ModelConfig,
        version_dir: Path,
        settings: TensorRtSettings,
        executor: Executor,
    ) -> None:
        self.config = config
        self.version_dir = version_dir
        self.settings = settings
        self.executor = executor
        self.path = version_dir / config.model_filename()
        self.engine: Any = None
        self.context: Any = None  # TensorRT's execution context (its activation memory)
        self.stream: Any = None
        self.cuda_context: Any = None
        self.lock = threading.Lock()  # one execution at a time (the scheduler batches)
        self.cached = False  # the engine came from the cache (or is a plan)

    # ---- load --------------------------------------------------------------------------

    async def load(self) -> None:
        if not self.path.is_file():
            raise ModelLoadError(f"model file {self.path} does not exist")
        await asyncio.get_running_loop().run_in_executor(self.executor, self._load)

    def _load(self) -> None:
        trt, cuda = _import()
        logger = _logger(trt)
        cuda.init()
        self.cuda_context = cuda.Device(0).make_context()
        try:
            plan = self._plan(trt, logger)
            runtime = trt.Runtime(logger)
            self.engine = runtime.deserialize_cuda_engine(plan)
            if self.engine is None:
                raise ModelLoadError(f"TensorRT cannot deserialize {self.path.name} (see the log)")
            self.context = self.engine.create_execution_context()
            if self.context is None:  # its activation memory did not fit
                raise ModelLoadError(
                    f"TensorRT cannot create an execution context for {self.path.name}"
                    " (not enough GPU memory?)"
                )
            self.stream = cuda.Stream()
        except BaseException:
            self.cuda_context.pop()
            self._release()
            raise
        self.cuda_context.pop()
        log.info(
            "model %s: TensorRT %s engine ready (%s)",
            self.config.name,
            trt.__version__,
            "from the cache" if self.cached else "built now",
        )

    def _plan(self, trt: Any, logger: Any) -> bytes:
        if self.config.platform == PLAN_PLATFORM:
            self.cached = True
            return self.path.read_bytes()
        cache = gpu.engine_cache_dir(
            self.settings.cache_dir,
            self.config.name,
            self.version_dir.name,
            self.path,
            self.settings.precision,
            gpu.this_gpu(),
            trt.__version__,
        )
        shapes = gpu.profile_shapes(self.config)
        engine_file = cache / f"profile-{gpu.profile_key(shapes)}.plan"
        if engine_file.is_file():
            self.cached = True
            return engine_file.read_bytes()
        plan = self._build(trt, logger, shapes)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = engine_file.with_suffix(".tmp")
            tmp.write_bytes(plan)
            tmp.replace(engine_file)  # whole or absent: never a half-written engine
        except OSError as exc:
            log.warning("model %s: engine not cached in %s: %s", self.config.name, cache, exc)
        return plan

    def _build(self, trt: Any, logger: Any, shapes: gpu.Profiles) -> bytes:
        builder = trt.Builder(logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # TensorRT 8
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(self.path)):  # external weights beside it too
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ModelLoadError(f"TensorRT cannot parse {self.path.name}: {errors}")
        build = builder.create_builder_config()
        build.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        if self.settings.precision == "int8":
            log.warning(
                "model %s: the native TensorRT runtime has no INT8 calibration; building FP16",
                self.config.name,
            )
        # platform_has_fast_fp16 is gone from TensorRT 11 (every GPU it supports has it)
        if self.settings.precision != "fp32" and getattr(builder, "platform_has_fast_fp16", True):
            build.set_flag(trt.BuilderFlag.FP16)
        if shapes:
            profile = builder.create_optimization_profile()
            for name, (low, opt, high) in shapes.items():
                profile.set_shape(name, low, opt, high)
            build.add_optimization_profile(profile)
        log.info(
            "model %s: building a TensorRT engine (minutes on a Jetson; cached after)",
            self.config.name,
        )
        plan = builder.build_serialized_network(network, build)
        if plan is None:
            raise ModelLoadError(f"TensorRT could not build an engine for {self.path.name}")
        return bytes(plan)

    # ---- infer -------------------------------------------------------------------------

    async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        if self.engine is None:
            raise ModelLoadError(f"model '{self.config.name}' is not loaded")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._run, inputs)

    def _run(self, inputs: Tensors) -> Tensors:
        trt, cuda = _import()
        with self.lock:
            self.cuda_context.push()
            try:
                return self._execute(trt, cuda, inputs)
            finally:
                self.cuda_context.pop()

    def _execute(self, trt: Any, cuda: Any, inputs: Tensors) -> Tensors:
        engine, context, stream = self.engine, self.context, self.stream
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        hosts: dict[str, np.ndarray] = {}
        for name in (n for n in names if is_input[n]):  # every shape checked before any memory
            if name not in inputs:
                raise InvalidRequest(f"model '{self.config.name}' needs input '{name}'")
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            hosts[name] = np.ascontiguousarray(inputs[name], dtype=dtype)
            if not context.set_input_shape(name, hosts[name].shape):
                raise InvalidRequest(
                    f"model '{self.config.name}' cannot take input '{name}' of shape"
                    f" {list(hosts[name].shape)} (outside its engine's optimization profile)"
                )
        for name in (n for n in names if not is_input[n]):
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            hosts[name] = np.empty(tuple(context.get_tensor_shape(name)), dtype)
        buffers: dict[str, Any] = {}
        try:  # freed here, with the CUDA context current (a leak on any other thread)
            for name, host in hosts.items():
                buffers[name] = cuda.mem_alloc(max(1, host.nbytes))
                context.set_tensor_address(name, int(buffers[name]))
                if is_input[name]:
                    cuda.memcpy_htod_async(buffers[name], host, stream)
            if not context.execute_async_v3(stream.handle):
                raise Unavailable(f"model '{self.config.name}': TensorRT failed to run (see log)")
            for name in (n for n in names if not is_input[n]):
                cuda.memcpy_dtoh_async(hosts[name], buffers[name], stream)
            stream.synchronize()
        finally:
            stream.synchronize()
            for buffer in buffers.values():
                buffer.free()
        return {name: hosts[name] for name in names if not is_input[name]}

    async def unload(self) -> None:
        if self.cuda_context is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._release)

    def _release(self) -> None:
        """Free the engine and its context with the CUDA context current, then the context."""
        with self.lock:  # after the execution in progress
            cuda_context, self.cuda_context = self.cuda_context, None
            if cuda_context is None:
                return
            cuda_context.push()
            try:
                self.context = self.engine = self.stream = None
            finally:
                # detach while current: from another thread than the one that made it, a
                # context that is not current is not destroyed (pycuda leaks it)
                cuda_context.detach()

    def metadata(self) -> dict[str, Any]:
        return {
            "providers": ["TensorRT"] if self.engine is not None else [],
            "precision": "fp32" if self.settings.precision == "fp32" else "fp16",
            "engine_cached": self.cached,
        }


@functools.cache
def _logger(trt: Any) -> Any:
    """The process's one TensorRT logger (TensorRT keeps a single logger pointer: a second one
    is ignored, and freeing the first would leave it dangling), writing to ``logging``."""
    levels = {
        trt.ILogger.INTERNAL_ERROR: logging.CRITICAL,
        trt.ILogger.ERROR: logging.ERROR,
        trt.ILogger.WARNING: logging.WARNING,
        trt.ILogger.INFO: logging.DEBUG,  # TensorRT is chatty at INFO
        trt.ILogger.VERBOSE: logging.DEBUG,
    }

    class Bridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if severity != trt.ILogger.VERBOSE:  # tens of thousands of lines per build
                logging.getLogger("tensorrt").log(levels.get(severity, logging.INFO), "%s", msg)

    return Bridge()

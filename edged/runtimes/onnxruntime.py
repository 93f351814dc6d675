"""ONNX Runtime: execution providers from config and availability, thread settings, warm-up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edged.common.errors import EdgedError, InvalidRequest, ModelLoadError, Unavailable
from edged.common.heap import trim_heap
from edged.common.stats import ewma
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import ModelConfig, oip_datatype
from edged.oip.tensors import DATATYPES
from edged.runtimes import gpu
from edged.runtimes.base import Tensors

log = logging.getLogger(__name__)
# ONNX Runtime's own warnings go to stderr uncoordinated with logging; its errors reach us as
# exceptions with the same text, so keep only fatal lines from its logger.
ort.set_default_logger_severity(4)
# What session.run raises when the input is at fault (shapes the graph cannot take).
INVALID_ARGUMENT = ort.capi.onnxruntime_pybind11_state.InvalidArgument
FAIL = ort.capi.onnxruntime_pybind11_state.Fail
# What session.run raises when a provider fails at run time (a TensorRT engine build out of
# memory): with the fallback disabled, instead of quietly rebuilding the session on the CPU.
EP_FAIL = ort.capi.onnxruntime_pybind11_state.EPFail

# Config names -> ONNX Runtime provider names, in the order of preference.
PROVIDERS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}


# Runs that give their memory back when they end (``OnnxModel._heavy``): ONNX Runtime's CPU
# arena shrinks to what it holds between runs, then the C heap is trimmed.
HEAVY_S = 0.05
HEAVY_BYTES = 1 << 20
# ... but not a run this quick, whatever its inputs: in a millisecond a core touches a few MB at
# most, so there is little to give back, and the trim would cost more than the run (a camera
# frame of 6.2 MB into a graph of 0.2 ms: 0.81 ms a call with it, 0.70 without)
QUICK_S = 0.001
SHRINK = ort.RunOptions()
SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


def choose_providers(wanted: Sequence[str], available: Sequence[str]) -> list[str]:
    """The wanted providers that this ONNX Runtime build has, in order; CPU always last."""
    chosen = [PROVIDERS[w] for w in wanted if PROVIDERS[w] in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


class OnnxRuntime:
    """One version of an ONNX model in an ``InferenceSession``."""

    def __init__(
        self,
        config: ModelConfig,
        version_dir: Path,
        settings: OnnxRuntimeConfig,
        executor: Executor,
    ) -> None:
        self.config = config
        self.path = version_dir / config.model_filename()
        self.settings = settings
        self.executor = executor
        self.session: ort.InferenceSession | None = None
        self.requested: list[str] = []  # the providers asked for (those this build has)
        self.fallback = ""  # why the session does not use all of them ("" when it does)
        self.output_names = [o.name for o in config.outputs]
        # Moving average of execution time: tiny models run on the event loop (no thread hop).
        self.recent_s: float | None = None
        batched = config.max_batch_size > 0
        # Triton's reshape: the shape clients send differs from the one the graph takes.
        self.reshapes = {
            spec.name: (batched, spec.reshape) for spec in config.inputs if spec.reshape is not None
        }

    def _create(self) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.settings.intra_op_threads
        options.inter_op_num_threads = self.settings.inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning threads of one session starve the others on a 2-core device (OCR ran 2x slower).
        spin = "1" if self.settings.allow_spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        available = gpu.usable_providers(ort.get_available_providers())
        providers = choose_providers(self.settings.providers, available)
        self.requested = providers
        return ort.InferenceSession(
            str(self.path),
            sess_options=options,
            providers=providers,
            provider_options=[
                self._tensorrt() if p == "TensorrtExecutionProvider" else {} for p in providers
            ],
        )

    def _tensorrt(self) -> dict[str, str]:
        """TensorRT's options: precision, calibration and the engine cache of this version."""
        settings = self.settings
        cache = gpu.engine_cache_dir(
            settings.tensorrt_cache_dir,
            self.config.name,
            self.path.parent.name,
            self.path,
            settings.precision,
            gpu.this_gpu(),
            gpu.tensorrt_version(),
        )
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # TensorRT then builds its engine at every load
            name = self.config.name
            log.warning("model %s: no TensorRT engine cache at %s: %s", name, cache, exc)
        table = self.path.parent / settings.int8_calibration_table
        if settings.precision == "int8" and not table.is_file():
            log.warning(
                "model %s: INT8 needs a calibration table at %s; building FP16 instead",
                self.config.name,
                table,
            )
        try:
            profiles = None if self.reshapes else gpu.profile_shapes(self.config)
        except ModelLoadError as exc:  # TensorRT then builds for the shapes it first sees
            log.warning("model %s: no TensorRT shape ranges: %s", self.config.name, exc.message)
            profiles = None
        return gpu.tensorrt_options(
            cache, settings.precision, table if table.is_file() else None, profiles
        )

    async def load(self) -> None:
        """Create the session, check it against config.pbtxt and warm it up."""
        if not self.path.is_file():
            raise ModelLoadError(f"model file {self.path} does not exist")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            session = await loop.run_in_executor(self.executor, self._create)
        except Exception as exc:  # ONNX Runtime raises its own types for corrupt files
            raise ModelLoadError(f"ONNX Runtime cannot load {self.path}: {exc}") from None
        self._check(session)
        session.disable_fallback()  # a provider that fails at run time is an error, not the CPU
        self.session = session
        if not self.output_names:
            self.output_names = [o.name for o in session.get_outputs()]
        log.info(
            "model %s: loaded %s with %s in %.0f ms",
            self.config.name,
            self.path.name,
            ", ".join(session.get_providers()),
            (time.monotonic() - started) * 1000,
        )
        await self._warm_up()
        # The self-test, after the warm-up (TensorRT may build its engine at the first run).
        self.fallback = gpu.self_test(self.requested, session.get_providers())
        if self.fallback:
            log.warning("model %s: %s", self.config.name, self.fallback)

    def _check(self, session: ort.InferenceSession) -> None:
        graph_inputs = {i.name for i in session.get_inputs()}
        graph_outputs = {o.name for o in session.get_outputs()}
        for spec in self.config.inputs:
            if spec.name not in graph_inputs:
                raise ModelLoadError(
                    f"config.pbtxt input '{spec.name}' is not in {self.path.name}"
                    f" (graph inputs: {', '.join(sorted(graph_inputs))})"
                )
        for spec in self.config.outputs:
            if spec.name not in graph_outputs:
                raise ModelLoadError(
                    f"config.pbtxt output '{spec.name}' is not in {self.path.name}"
                    f" (graph outputs: {', '.join(sorted(graph_outputs))})"
                )

    def _warm_up_samples(self) -> list[tuple[Tensors, int]]:
        """Triton's model_warmup entries, or one zero-filled request of batch 1."""
        samples: list[tuple[Tensors, int]] = []
        rng = np.random.default_rng(0)
        for warmup in self.config.proto.model_warmup:
            batch = max(1, warmup.batch_size)
            feeds: Tensors = {}
            for name, spec in warmup.inputs.items():
                datatype = oip_datatype(spec.data_type)
                shape = ([batch] if self.config.max_batch_size > 0 else []) + list(spec.dims)
                dtype = DATATYPES[datatype]
                if spec.input_data_file:
                    path = self.config.directory / "warmup" / spec.input_data_file
                    try:
                        raw = np.fromfile(path, dtype=dtype.newbyteorder("<"))
                        feeds[name] = raw.astype(dtype).reshape(shape)
                    except (OSError, ValueError) as exc:
                        raise ModelLoadError(
                            f"model_warmup input_data_file {path}: {exc}"
                        ) from None
                elif spec.random_data and dtype.kind in "iu":
                    feeds[name] = rng.integers(0, 100, size=shape).astype(dtype)
                elif spec.random_data:
                    feeds[name] = rng.standard_normal(shape).astype(dtype)
                else:
                    feeds[name] = np.zeros(shape, dtype=dtype)
            samples.append((feeds, max(1, warmup.count)))
        if samples:
            return samples
        feeds = {}
        for spec in self.config.inputs:
            dims = [1 if d < 0 else d for d in spec.shape(self.config.max_batch_size)]
            feeds[spec.name] = np.zeros(dims, dtype=DATATYPES[spec.datatype])
        return [(feeds, 1)]

    async def _warm_up(self) -> None:
        started = time.monotonic()
        runs = 0
        for feeds, count in self._warm_up_samples():
            for _ in range(count):
                try:
                    await self.infer(feeds, {})
                except EdgedError as exc:
                    raise ModelLoadError(f"warm-up failed: {exc.message}") from None
                runs += 1
        log.debug(
            "model %s: %d warm-up runs in %.0f ms",
            self.config.name,
            runs,
            (time.monotonic() - started) * 1000,
        )

    async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Run the session in the executor (the scheduler in front of it limits how many run
        at once to instance_group's count, and batches)."""
        session = self.session
        if session is None:
            raise ModelLoadError(f"model '{self.config.name}' is not loaded")
        feeds = inputs
        if self.reshapes:
            feeds = dict(inputs)
            for name, (batched, shape) in self.reshapes.items():
                if name in feeds:
                    lead = list(feeds[name].shape[:1]) if batched else []
                    feeds[name] = feeds[name].reshape(lead + list(shape))
        started = time.perf_counter()
        try:
            if self.recent_s is not None and self.recent_s * 1e6 < self.settings.inline_max_us:
                results = session.run(self.output_names, feeds)
            elif self._heavy(feeds):
                # ONNX Runtime's arena keeps the largest run's activations for good (a batch of
                # long texts took 1.5 GiB that never came back): a heavy run gives them back
                # when it ends, and the C heap its free pages after it
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(
                    self.executor, session.run, self.output_names, feeds, SHRINK
                )
                await loop.run_in_executor(self.executor, trim_heap)
            else:
                results = await asyncio.get_running_loop().run_in_executor(
                    self.executor, session.run, self.output_names, feeds
                )
        except EP_FAIL as exc:
            name = self.config.name
            raise Unavailable(f"model '{name}': its execution provider failed: {exc}") from None
        except (INVALID_ARGUMENT, FAIL) as exc:  # FAIL: e.g. a sequence past the positions
            raise InvalidRequest(f"model '{self.config.name}' rejected the input: {exc}") from None
        self.recent_s = ewma(self.recent_s, time.perf_counter() - started)
        return dict(zip(self.output_names, results))

    def _heavy(self, feeds: Tensors) -> bool:
        """A run whose memory is worth giving back: large inputs, or a model that takes long
        (its activations are large); not one that recently took under ``QUICK_S``. Measured,
        the runs interleaved: OCR's detector 87.1 ms plain, 88.7 ms with the arena shrunk and
        the heap trimmed; the text encoder on 16 x 256 tokens the same within noise."""
        recent = self.recent_s
        if recent is not None and (recent >= HEAVY_S or recent < QUICK_S):
            return recent >= HEAVY_S
        return sum(int(v.nbytes) for v in feeds.values()) >= HEAVY_BYTES

    async def unload(self) -> None:
        """Drop the session (ONNX Runtime frees it when the last reference goes: an execution
        still running holds one) and return the freed heap to the system."""
        self.session = None
        self.recent_s = None
        await asyncio.get_running_loop().run_in_executor(self.executor, trim_heap)

    def metadata(self) -> dict[str, Any]:
        """The execution providers asked for and actually in use (the start-up self-test),
        and the precision TensorRT builds in."""
        in_use = self.session.get_providers() if self.session else []
        return {
            "providers": in_use,
            "requested": self.requested,
            "precision": self.settings.precision if "TensorrtExecutionProvider" in in_use else "",
            "fallback": self.fallback,
        }

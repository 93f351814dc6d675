"""What ONNX Runtime's GPU providers need from edged: TensorRT's options (precision, INT8
calibration, an engine cache keyed so that a changed model, TensorRT, GPU or precision never
reuses a stale engine), and the self-test that says which providers a session really uses
(ONNX Runtime falls back to the CPU when a GPU provider fails to start, with a warning on its
own logger only).

GPU libraries are optional: nothing here imports them at module level.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from edged.common.errors import ModelLoadError
from edged.models.model_config import ModelConfig

log = logging.getLogger(__name__)

Profiles = dict[str, tuple[list[int], list[int], list[int]]]  # input -> (min, opt, max) shape
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
SHORT = {"TensorrtExecutionProvider": "TensorRT", "CUDAExecutionProvider": "CUDA"}


# TensorRT's runtime library, by the sonames ONNX Runtime's provider loads (TensorRT 10: JetPack
# 6 and pip; TensorRT 8: JetPack 5)
NVINFER = ("libnvinfer.so.10", "libnvinfer.so.8")


@functools.cache
def tensorrt_loadable() -> bool:
    """Whether TensorRT's library can be loaded. An onnxruntime-gpu build lists its TensorRT
    provider whether or not TensorRT is installed; asked for without it, the session falls back
    with an "EP Error" banner printed on stdout, at every load (seen on an H200 without it)."""
    for name in NVINFER:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    log.info("TensorRT's library (%s) is not installed: its provider is skipped", NVINFER[0])
    return False


def usable_providers(available: Sequence[str]) -> list[str]:
    """ONNX Runtime's available providers, less TensorRT's when its library is missing."""
    if "TensorrtExecutionProvider" in available and not tensorrt_loadable():
        return [p for p in available if p != "TensorrtExecutionProvider"]
    return list(available)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


@functools.cache
def tensorrt_version() -> str:
    """The TensorRT Python package's version (JetPack's or pip's), else "unknown"."""
    for name in ("tensorrt", "tensorrt-cu12", "tensorrt_libs", "tensorrt-libs"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def gpu_name(root: Path = Path("/")) -> str:
    """The GPU the engines are built for: the NVIDIA driver's name of GPU 0, or a Jetson's
    model from the device tree ("unknown" when neither says)."""
    gpus = sorted((root / "proc/driver/nvidia/gpus").glob("*/information"))
    for info in gpus:
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    model = root / "proc/device-tree/model"
    if model.is_file():
        return model.read_text(errors="replace").strip("\x00\n ")
    return "unknown"


@functools.cache
def this_gpu() -> str:
    """This machine's ``gpu_name()``, read once (it does not change while edged runs)."""
    return gpu_name()


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read once per content (a wake after an idle unload reuses it)."""
    stat = path.stat()
    return _sha256(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def engine_cache_dir(
    base: Path, model: str, version: str, model_file: Path, precision: str, gpu: str, trt: str
) -> Path:
    """Where TensorRT keeps the engines of one model version: a directory per model file
    content, TensorRT version, GPU and precision, so that any change builds anew instead of
    loading an engine built for something else, and the same one is found after a restart."""
    key = f"{file_sha256(model_file)[:16]}-trt{_slug(trt)}-{_slug(gpu)}-{precision}"
    return base / model / version / key


def tensorrt_options(
    cache: Path,
    precision: str,
    calibration: Path | None = None,
    profiles: Profiles | None = None,
) -> dict[str, str]:
    """ONNX Runtime's TensorRT provider options: the engine and timing caches in ``cache``
    (the timing cache goes where the engines are: ``trt_timing_cache_path`` is refused by
    ONNX Runtime before 1.17), FP16 unless ``fp32``, INT8 (with FP16 for the layers INT8
    cannot take) only with a calibration table, and the shape ranges of the dynamic inputs (so
    the engine is built at load for all of them, not at the first request for its shapes)."""
    options = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": "True",
        "trt_fp16_enable": "False" if precision == "fp32" else "True",
    }
    if precision == "int8" and calibration is not None:
        options["trt_int8_enable"] = "True"
        options["trt_int8_calibration_table_name"] = str(calibration)
    for i, which in enumerate(("min", "opt", "max")):
        if profiles:
            options[f"trt_profile_{which}_shapes"] = ",".join(
                f"{name}:{'x'.join(map(str, shapes[i]))}" for name, shapes in profiles.items()
            )
    return options


def profile_key(profiles: Profiles) -> str:
    """A short digest of shape ranges (an engine built for others must not be reused)."""
    text = ";".join(f"{n}={s}" for n, s in sorted(profiles.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def self_test(requested: Sequence[str], in_use: Sequence[str]) -> str:
    """Why a session does not run where it was asked to ("" when it does): the GPU providers
    requested (and present in this ONNX Runtime build) that the session is not using."""
    missing = [SHORT[p] for p in requested if p in GPU_PROVIDERS and p not in in_use]
    if not missing:
        return ""
    running = ", ".join(SHORT.get(p, p.removesuffix("ExecutionProvider")) for p in in_use)
    return (
        f"asked for {' and '.join(missing)}, but ONNX Runtime runs it on {running or 'nothing'}:"
        " the provider failed to start (CUDA, cuDNN or TensorRT libraries missing or not"
        " matching this onnxruntime-gpu build, or no GPU visible to edged)"
    )


def profile_shapes(config: ModelConfig) -> Profiles:
    """The (min, opt, max) shape of each input with a dynamic dimension: the batch from 1 to
    ``max_batch_size`` (optimised for the largest), others from ``trt_profile_<input>``."""
    shapes: Profiles = {}
    batch = config.max_batch_size
    for spec in config.inputs:
        full = spec.shape(batch)
        if all(d >= 0 for d in full):
            continue
        given = config.parameters.get(f"trt_profile_{spec.name}")
        if given:
            try:
                low, opt, high = ([int(d) for d in part.split(",")] for part in given.split(";"))
            except ValueError:
                raise ModelLoadError(
                    f"model '{config.name}': trt_profile_{spec.name} must be"
                    ' "min;opt;max" shapes such as "1,16;8,128;32,512"'
                ) from None
            if not len(low) == len(opt) == len(high) == len(full):
                raise ModelLoadError(
                    f"model '{config.name}': trt_profile_{spec.name} needs {len(full)} dimensions"
                )
            shapes[spec.name] = (low, opt, high)
            continue
        if any(d < 0 for d in full[1 if batch > 0 else 0 :]):
            raise ModelLoadError(
                f"model '{config.name}': input '{spec.name}' has a variable dimension other than"
                f" the batch; give its range as parameter trt_profile_{spec.name}"
            )
        rest = list(full[1:])
        shapes[spec.name] = ([1, *rest], [batch, *rest], [batch, *rest])
    return shapes

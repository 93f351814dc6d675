"""What ONNX Runtime's GPU providers need from edged: TensorRT's options (precision, INT8
calibration, an engine cache keyed so that a changed model, TensorRT, GPU or precision never
reuses a stale engine), and the self-test that says which providers a session really uses
(ONNX Runtime falls back to the CPU when a GPU provider fails to start, with a warning on its
own logger only).

GPU libraries are optional: nothing here imports them at module level.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import re
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
SHORT = {"TensorrtExecutionProvider": "TensorRT", "CUDAExecutionProvider": "CUDA"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


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


def file_sha256(path: Path) -> str:
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
    cache: Path, precision: str, calibration: Path | None = None
) -> dict[str, str]:
    """ONNX Runtime's TensorRT provider options: the engine and timing caches in ``cache``,
    FP16 unless ``fp32``, INT8 (with FP16 for the layers INT8 cannot take) only with a
    calibration table."""
    options = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache),
        "trt_fp16_enable": "False" if precision == "fp32" else "True",
    }
    if precision == "int8" and calibration is not None:
        options["trt_int8_enable"] = "True"
        options["trt_int8_calibration_table_name"] = str(calibration)
    return options


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

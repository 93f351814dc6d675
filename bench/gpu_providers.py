#!/usr/bin/env python3
"""ONNX Runtime's execution providers on this machine: CPU, CUDA, TensorRT FP32 and FP16, for
text-encoder (MiniLM) and ocr-rec (PP-OCRv4 recognition) at batch 1, 8 and 32, with edged's own
provider options (edged/runtimes/gpu.py), then edged's native TensorRT runtime (FP16); and how
far each one's outputs are from the CPU's (FP16 agreement). A provider this onnxruntime build
does not have, or that falls back to the CPU (the self-test), is a row saying so, not a figure.
Each TensorRT configuration is loaded twice: the second load comes from the engine cache.

    .venv/bin/python bench/gpu_providers.py [--runs 50] [--cache DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edged.models.model_config import read_config  # noqa: E402
from edged.runtimes import gpu  # noqa: E402
from edged.runtimes.tensorrt import TensorRtRuntime, TensorRtSettings  # noqa: E402

# The native runtime's optimization profiles for this benchmark's shapes (batch 1 to 32)
PROFILES = {
    "text-encoder": {
        f"trt_profile_{name}": "1,64;8,64;32,64"
        for name in ("input_ids", "attention_mask", "token_type_ids")
    },
    "ocr-rec": {"trt_profile_x": "1,3,48,320;8,3,48,320;32,3,48,320"},
}

MODELS = ROOT / "models"
CONFIGS = [  # (label, providers, TensorRT precision)
    ("CPU", ["CPUExecutionProvider"], ""),
    ("CUDA", ["CUDAExecutionProvider", "CPUExecutionProvider"], ""),
    ("TensorRT fp32", ["TensorrtExecutionProvider", "CPUExecutionProvider"], "fp32"),
    ("TensorRT fp16", ["TensorrtExecutionProvider", "CPUExecutionProvider"], "fp16"),
]


def feeds(model: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if model == "text-encoder":
        ids = rng.integers(1000, 20000, size=(batch, 64)).astype(np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        ones = np.ones_like(ids)
        return {"input_ids": ids, "attention_mask": ones, "token_type_ids": ones * 0}
    return {"x": rng.standard_normal((batch, 3, 48, 320)).astype(np.float32)}


def configured(model: str) -> Any:
    """The model's config, with the shape ranges of this benchmark."""
    config = read_config(MODELS / model)
    config.parameters.update(PROFILES[model])
    return config


def profiles(model: str) -> gpu.Profiles:
    return gpu.profile_shapes(configured(model))


def session(model: str, providers: list[str], precision: str, cache: Path) -> Any:
    path = MODELS / model / "1" / "model.onnx"
    options: list[dict[str, str]] = [{} for _ in providers]
    if providers[0] == "TensorrtExecutionProvider":
        where = gpu.engine_cache_dir(
            cache, model, "1", path, precision, gpu.this_gpu(), gpu.tensorrt_version()
        )
        where.mkdir(parents=True, exist_ok=True)
        options[0] = gpu.tensorrt_options(where, precision, None, profiles(model))
    found = ort.InferenceSession(str(path), providers=providers, provider_options=options)
    found.disable_fallback()  # a provider failing at run time is an error, not CPU figures
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--cache", type=Path, help="TensorRT engine cache (default: a temp dir)")
    args = parser.parse_args()
    available = ort.get_available_providers()
    print(
        f"onnxruntime {ort.__version__}, providers in this build: {', '.join(available)};"
        f" GPU: {gpu.this_gpu()}; TensorRT: {gpu.tensorrt_version()}"
    )
    print(
        "| model | provider | load, 1st / 2nd (cache) | batch 1 | batch 8 | batch 32 |"
        " max abs diff vs CPU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        for model in ("text-encoder", "ocr-rec"):
            reference: dict[int, np.ndarray] = {}
            for label, providers, precision in CONFIGS:
                if providers[0] not in available:
                    print(f"| {model} | {label} | not in this onnxruntime build | | | | |")
                    continue
                loads = []
                for _ in range(2):
                    started = time.perf_counter()
                    sess = session(model, providers, precision, cache)
                    loads.append(time.perf_counter() - started)
                fallback = gpu.self_test(providers, sess.get_providers())
                if fallback:
                    print(f"| {model} | {label} | fell back: {fallback} | | | | |")
                    continue
                cells, diffs = [], []
                for batch in (1, 8, 32):
                    inputs = feeds(model, batch)
                    out = sess.run(None, inputs)[0]
                    times = []
                    for _ in range(args.runs):
                        started = time.perf_counter()
                        sess.run(None, inputs)
                        times.append(time.perf_counter() - started)
                    cells.append(f"{statistics.median(times) * 1000:.2f} ms")
                    if label == "CPU":
                        reference[batch] = out
                    else:
                        diffs.append(float(np.max(np.abs(out - reference[batch]))))
                diff = f"{max(diffs):.2e}" if diffs else "(reference)"
                print(
                    f"| {model} | {label} | {loads[0]:.2f} s / {loads[1]:.2f} s |"
                    f" {' | '.join(cells)} | {diff} |"
                )
            native(model, cache, reference, args.runs)


async def timed(runtime: TensorRtRuntime, inputs: dict[str, np.ndarray], runs: int) -> list[float]:
    times = []
    for _ in range(runs):  # one event loop for all: only the runtime's own cost is timed
        started = time.perf_counter()
        await runtime.infer(inputs, {})
        times.append(time.perf_counter() - started)
    return times


def native(model: str, cache: Path, reference: dict[int, np.ndarray], runs: int) -> None:
    """The native TensorRT runtime (FP16), built once, then loaded from its engine cache."""
    config = configured(model)
    settings = TensorRtSettings(cache / "native", "fp16")
    with ThreadPoolExecutor(1) as executor:
        loads, runtime = [], None
        try:
            for _ in range(2):
                if runtime is not None:
                    asyncio.run(runtime.unload())
                runtime = TensorRtRuntime(config, MODELS / model / "1", settings, executor)
                started = time.perf_counter()
                asyncio.run(runtime.load())
                loads.append(time.perf_counter() - started)
        except Exception as exc:  # no tensorrt/pycuda, or no GPU: say so
            print(f"| {model} | TensorRT native fp16 | {str(exc)[:120]} | | | | |")
            return
        assert runtime is not None
        cells, diffs = [], []
        for batch in (1, 8, 32):
            inputs = feeds(model, batch)
            out = next(iter(asyncio.run(runtime.infer(inputs, {})).values()))
            times = asyncio.run(timed(runtime, inputs, runs))
            cells.append(f"{statistics.median(times) * 1000:.2f} ms")
            diffs.append(float(np.max(np.abs(out - reference[batch]))))
        asyncio.run(runtime.unload())
        hit = "hit" if runtime.cached else "MISS"
        print(
            f"| {model} | TensorRT native fp16 | {loads[0]:.2f} s / {loads[1]:.2f} s ({hit}) |"
            f" {' | '.join(cells)} | {max(diffs):.2e} |"
        )


if __name__ == "__main__":
    main()

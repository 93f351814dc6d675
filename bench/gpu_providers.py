#!/usr/bin/env python3
"""ONNX Runtime's execution providers on this machine: CPU, CUDA, TensorRT FP32 and FP16, for
text-encoder (MiniLM) and ocr-rec (PP-OCRv4 recognition) at batch 1, 8 and 32, with edged's
own provider options (edged/runtimes/gpu.py); and how far each provider's outputs are from
the CPU's (FP16 agreement). A provider this onnxruntime build does not have, or that falls back
to the CPU (the self-test), is a row saying so, not a figure. The second TensorRT session of a
configuration is built from the engine cache of the first: its load time shows the cache hit.

    .venv/bin/python bench/gpu_providers.py [--runs 50] [--cache DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edged.runtimes import gpu  # noqa: E402

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


def session(model: str, providers: list[str], precision: str, cache: Path) -> Any:
    path = MODELS / model / "1" / "model.onnx"
    options: list[dict[str, str]] = [{} for _ in providers]
    if providers[0] == "TensorrtExecutionProvider":
        where = gpu.engine_cache_dir(
            cache, model, "1", path, precision, gpu.gpu_name(), gpu.tensorrt_version()
        )
        where.mkdir(parents=True, exist_ok=True)
        options[0] = gpu.tensorrt_options(where, precision)
    return ort.InferenceSession(str(path), providers=providers, provider_options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--cache", type=Path, help="TensorRT engine cache (default: a temp dir)")
    args = parser.parse_args()
    available = ort.get_available_providers()
    print(f"onnxruntime {ort.__version__}, providers in this build: {', '.join(available)};"
          f" GPU: {gpu.gpu_name()}; TensorRT: {gpu.tensorrt_version()}")  # fmt: skip
    print("| model | provider | load, 1st / 2nd (cache) | batch 1 | batch 8 | batch 32 |"
          " max abs diff vs CPU |")  # fmt: skip
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
                print(f"| {model} | {label} | {loads[0]:.2f} s / {loads[1]:.2f} s |"
                      f" {' | '.join(cells)} | {diff} |")  # fmt: skip


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A/B of ONNX Runtime thread spinning in edged: daemons started alternately with
``onnxruntime.allow_spinning`` true and false, each timed on one small MiniLM call (batch 1,
tensors), one OCR request and one 8-text embedding request. Prints medians per run.

    .venv/bin/python bench/spinning.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import edged_argv, timed  # noqa: E402
from edged.client import Client  # noqa: E402
from tests.media import text_image  # noqa: E402

MODELS = ROOT / "models"


def median_ms(fn: Callable[[], object], runs: int) -> float:
    return statistics.median(timed(fn, runs)) * 1000


def run(spin: bool, feeds: dict[str, np.ndarray], image: bytes) -> str:
    workdir = Path(tempfile.mkdtemp())
    (workdir / "edged.toml").write_text(f"[onnxruntime]\nallow_spinning = {str(spin).lower()}\n")
    proc = subprocess.Popen(edged_argv(workdir, workdir / "edged.toml"))
    try:
        client = Client(str(workdir / "edged.sock"))
        while not ((workdir / "edged.sock").exists() and client.ready()):
            time.sleep(0.05)
        encoder = median_ms(lambda: client.infer("text-encoder", feeds), 200)
        ocr = median_ms(lambda: client.ocr(image), 20)
        texts = ["How warm is the GPU on this Jetson right now?"] * 8
        embed = median_ms(lambda: client.embed(texts), 50)
    finally:
        proc.terminate()
        proc.wait(60)
    return f"| {spin} | {encoder:.2f} | {ocr:.2f} | {embed:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds")
    args = parser.parse_args()
    tok = Tokenizer.from_file(str(MODELS / "text-embedding" / "1" / "tokenizer.json"))
    tok.no_padding()
    enc = tok.encode("How warm is the GPU on this Jetson right now?")
    feeds = {
        "input_ids": np.array([enc.ids], np.int64),
        "attention_mask": np.array([enc.attention_mask], np.int64),
        "token_type_ids": np.array([enc.type_ids], np.int64),
    }
    image = text_image(["Invoice number 48213", "Total due: 1,250.00 EUR"])
    print("| allow_spinning | text-encoder p50 ms | ocr p50 ms | embed x8 p50 ms |")
    print("| --- | --- | --- | --- |")
    for _ in range(args.rounds):
        for spin in (True, False):
            print(run(spin, feeds, image), flush=True)


if __name__ == "__main__":
    main()

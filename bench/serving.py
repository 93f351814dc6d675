#!/usr/bin/env python3
"""Serving benchmark: start-up to READY, latency through the socket against in-process, RSS.

Baselines measured in the same run on the same machine:
- tensor models: ONNX Runtime's ``InferenceSession.run`` in this process, same inputs;
- pipelines: edged's own ModelManager in this process (no socket, no HTTP), same inputs.
``ratio`` is socket p50 / in-process p50. Batch 1, sequential calls; medians and p99.

    .venv/bin/python bench/serving.py [--runs 200] [--starts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edged.app import Daemon  # noqa: E402
from edged.client import Client  # noqa: E402
from edged.common.stats import percentile  # noqa: E402
from edged.config import Config  # noqa: E402
from tests.media import speech_in_silence, text_image  # noqa: E402

MODELS = ROOT / "models"
Tensors = dict[str, np.ndarray]


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    ordered = sorted(samples)
    p99 = percentile(ordered, 0.99) or 0.0
    return statistics.median(ordered) * 1000, p99 * 1000


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    for _ in range(max(3, runs // 20)):  # warm-up
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def edged_argv(workdir: Path, config: Path | None = None, models: Path = MODELS) -> list[str]:
    """edged's command line in a benchmark: the socket ``workdir/edged.sock``, its state under
    ``workdir``, the repository, warnings only; ``config`` when given."""
    flags = {
        "--socket": workdir / "edged.sock",
        "--models": models,
        "--state-dir": workdir / "state",
        "--log-level": "warning",
        **({"--config": config} if config is not None else {}),
    }
    return [sys.executable, "-m", "edged", *(str(x) for item in flags.items() for x in item)]


def start_daemon(workdir: Path) -> tuple[subprocess.Popen[bytes], Client, float]:
    socket = workdir / "edged.sock"
    started = time.perf_counter()
    proc = subprocess.Popen(edged_argv(workdir))
    client = Client(str(socket))
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"edged exited with {proc.returncode}")
        try:
            if socket.exists() and client.ready():
                return proc, client, time.perf_counter() - started
        except Exception:
            pass
        time.sleep(0.01)


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory (VmRSS) in MiB; ``self`` is this one."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants alive now (a process gone meanwhile is left out)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(current)
    return found


def tensor_inputs() -> dict[str, Tensors]:
    """Batch-1 inputs for each tensor model."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODELS / "text-embedding" / "1" / "tokenizer.json"))
    tok.no_padding()  # the shipped tokenizer.json pads to 128 tokens; the pipeline does not
    enc = tok.encode("How warm is the GPU on this Jetson right now?")
    text = {
        "input_ids": np.array([enc.ids], np.int64),
        "attention_mask": np.array([enc.attention_mask], np.int64),
        "token_type_ids": np.array([enc.type_ids], np.int64),
    }
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((1, 384)).astype(np.float32)
    embedding /= np.linalg.norm(embedding)
    return {
        "text-encoder": text,
        "text-encoder-int8": text,
        "intent-classifier": {"embedding": embedding},
        "vad-silero": {
            "input": rng.standard_normal((1, 576)).astype(np.float32) * 0.1,
            "state": np.zeros((2, 1, 128), np.float32),
            "sr": np.array([16000], np.int64),  # config dims [1]; the graph takes a scalar
        },
    }


def graph_feeds(session: ort.InferenceSession, inputs: Tensors) -> Tensors:
    """The same inputs shaped as the graph itself takes them (Triton's reshape undone)."""
    ranks = {i.name: len(i.shape) for i in session.get_inputs()}
    return {k: v.reshape(()) if ranks[k] == 0 else v for k, v in inputs.items()}


def blob(data: bytes) -> np.ndarray:
    array = np.empty(1, dtype=object)
    array[0] = data
    return array


def pipeline_inputs() -> dict[str, tuple[Tensors, Callable[[Client], object]]]:
    """Inputs for each pipeline, and the task-API call that sends the same through the socket."""
    sentence = "How warm is the GPU on this Jetson right now?"
    image = text_image(["Invoice number 48213", "Total due: 1,250.00 EUR"])
    wav, _, _ = speech_in_silence("Turn on the lights in the kitchen.", 0.5, 0.5)
    text = np.array([sentence.encode()], dtype=object)
    return {
        "text-embedding": ({"text": text}, lambda c: c.embed([sentence])),
        "intent": ({"text": text}, lambda c: c.intent([sentence])),
        "ocr": ({"image": blob(image)}, lambda c: c.ocr(image)),
        "vad": ({"audio": blob(wav)}, lambda c: c.vad(wav)),
    }


def in_process_pipelines(runs: int) -> dict[str, list[float]]:
    """Time each pipeline through edged's ModelManager in this process."""
    config = Config()
    config.models.repository = MODELS
    daemon = Daemon(config)
    results: dict[str, list[float]] = {}

    async def measure() -> None:
        await daemon.manager.load_all(list(pipeline_inputs()))
        for name, (inputs, _) in pipeline_inputs().items():
            n = runs if name not in ("ocr", "vad") else max(10, runs // 10)
            for _ in range(3):
                await daemon.manager.infer(name, None, inputs)
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                await daemon.manager.infer(name, None, inputs)
                samples.append(time.perf_counter() - start)
            results[name] = samples
        await daemon.manager.close()

    asyncio.run(measure())
    daemon.executor.shutdown()
    return results


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon and wait for it."""
    proc.terminate()
    proc.wait(60)


def measure_socket(
    client: Client, runs: int
) -> tuple[list[list[Any]], dict[str, tuple[float, float]]]:
    """Tensor models against ONNX Runtime in this process; pipelines' socket timings."""
    rows: list[list[Any]] = []
    for name, inputs in tensor_inputs().items():
        session = ort.InferenceSession(
            str(MODELS / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        feeds = graph_feeds(session, inputs)
        raw = percentiles(timed(lambda s=session, x=feeds: s.run(None, x), runs))
        sock = percentiles(timed(lambda n=name, x=inputs: client.infer(n, x), runs))
        rows.append([name, "ORT session.run", *raw, *sock, sock[0] / raw[0]])
    pipelines = {}
    for name, (_, call) in pipeline_inputs().items():
        n = runs if name not in ("ocr", "vad") else max(10, runs // 10)
        pipelines[name] = percentiles(timed(lambda c=call: c(client), n))
    return rows, pipelines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="calls per model (OCR/VAD: 1/10)")
    parser.add_argument("--starts", type=int, default=3, help="daemon starts to time")
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}")

    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        starts = []
        for i in range(args.starts):
            proc, client, seconds = start_daemon(Path(tmp) / f"s{i}")
            starts.append(seconds)
            if i < args.starts - 1:
                stop(proc)
        try:
            rss_ready = rss_mib(proc.pid)
            rows, socket_pipelines = measure_socket(client, args.runs)
            rss_after = rss_mib(proc.pid)
        finally:
            stop(proc)

    for name, samples in in_process_pipelines(args.runs).items():
        base = percentiles(samples)
        sock = socket_pipelines[name]
        rows.append([name, "edged in-process", *base, *sock, sock[0] / base[0]])

    print(
        f"\nstart to READY (all default models): median {statistics.median(starts):.2f} s"
        f" of {len(starts)} ({', '.join(f'{s:.2f}' for s in starts)})"
    )
    print(
        f"RSS with all default models loaded: {rss_ready:.0f} MiB at READY,"
        f" {rss_after:.0f} MiB after the benchmark\n"
    )
    header = [
        "model",
        "baseline",
        "base p50 ms",
        "base p99 ms",
        "socket p50 ms",
        "socket p99 ms",
        "ratio p50",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        cells = [row[0], row[1], *(f"{v:.2f}" for v in row[2:6]), f"{row[6]:.2f}x"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

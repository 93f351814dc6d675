#!/usr/bin/env python3
"""Idle unload: the memory a real edged gives back when its model goes idle, and what the next
call pays to load it again.

A real edged serving ``text-embedding`` (MiniLM: the ``text-encoder`` tensor model, 86 MiB of
ONNX) with ``[models] idle_unload_s``, once per isolation (``thread``: the session in the
daemon; ``process``: in a worker subprocess). Each cycle: warm calls, then wait until the
encoder is idle-unloaded, then one call (it loads the model again: the wake) and warm calls
again. Memory is the resident set of edged and its child processes, read from /proc (not from
edged's own metrics). Baseline in the same run: the warm call.

    .venv/bin/python bench/idle_unload.py [--cycles 5] [--idle-s 1.5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import process_tree  # noqa: E402
from edged.client import Client  # noqa: E402
from tests.conftest import Daemon, linked_repository, wait_for  # noqa: E402

BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["idle time"]}]}
PAGE = 4096


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total = 0
    for current in process_tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int(Path(f"/proc/{current}/statm").read_text().split()[1]) * PAGE
    return total


def call_ms(client: Client) -> float:
    started = time.perf_counter()
    client.call("POST", "/v2/models/text-embedding/infer", BODY)
    return (time.perf_counter() - started) * 1000


def idle(client: Client, model: str = "text-encoder") -> bool:
    """Whether edged's repository index says the model is idle-unloaded."""
    return any(r["name"] == model and r.get("idle") for r in client.status()["models"])


def run(isolation: str, cycles: int, idle_s: float, workdir: Path) -> dict[str, float]:
    repo = linked_repository(workdir / "repo", ["text-embedding", "text-encoder"])
    config = f'[models]\nidle_unload_s = {idle_s}\n[onnxruntime]\nisolation = "{isolation}"\n'
    daemon = Daemon(workdir, repo, config).start()
    assert daemon.proc is not None
    client = daemon.client
    loaded, asleep, wakes, warm = [], [], [], []
    try:
        for _ in range(cycles):
            warm += [call_ms(client) for _ in range(10)]
            loaded.append(tree_rss(daemon.proc.pid))
            wait_for(lambda: idle(client), 60, "the encoder idle-unloaded")
            time.sleep(0.3)  # a worker process takes a moment to exit
            asleep.append(tree_rss(daemon.proc.pid))
            wakes.append(call_ms(client))
    finally:
        daemon.stop()
    mib = 2**20
    return {
        "loaded_mib": statistics.median(loaded) / mib,
        "idle_mib": statistics.median(asleep) / mib,
        "wake_ms": statistics.median(wakes),
        "warm_ms": statistics.median(warm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=1.5)
    parser.add_argument("--isolation", nargs="+", default=["thread", "process"])
    args = parser.parse_args()
    rows = []
    for isolation in args.isolation:
        with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
            rows.append((isolation, run(isolation, args.cycles, args.idle_s, Path(tmp))))
    cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"{args.cycles} cycles each, medians; {cpus} CPUs")
    print(
        "| isolation | RSS loaded | RSS idle-unloaded | given back | wake call | warm call |"
        " wake / warm |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for isolation, r in rows:
        back = r["loaded_mib"] - r["idle_mib"]
        print(
            f"| {isolation} | {r['loaded_mib']:.0f} MiB | {r['idle_mib']:.0f} MiB |"
            f" {back:.0f} MiB ({back / r['loaded_mib']:.0%}) | {r['wake_ms']:.0f} ms |"
            f" {r['warm_ms']:.1f} ms | {r['wake_ms'] / r['warm_ms']:.0f}x |"
        )


if __name__ == "__main__":
    main()

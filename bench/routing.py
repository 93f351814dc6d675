#!/usr/bin/env python3
"""Routing benchmarks: the cost of one decision, and what hedging does to the tail.

1. ``decide()``: the pure path decision, timed call by call (``perf_counter_ns``) over random
   requests and facts, with a policy of 8 rules with conditions; baseline in the same run: an
   empty Python function call, and the raw ``Rule`` matching alone.
2. Hedging, end to end: a real edged (text-encoder, 128 tokens) with a real cloud (MLServer on
   loopback, behind the fault-injecting proxy of the tests). The cloud stands for a faster
   machine: it serves the INT8 encoder (about 2x faster here) for the same model name
   (``[[cloud.models]] cloud_name``), over a link of 2 ms RTT where a chunk is held 200 ms more
   with probability 5% (an erratic path: spikes, as on Wi-Fi). Sequential requests routed
   ``local``, ``cloud`` and ``hedged`` (both at once, the first answer wins), interleaved in
   rounds so drift hits all three alike; client-side latency percentiles. With 2 CPUs or
   more, edged is pinned to all but the last CPU and the cloud side (MLServer, the proxy, this
   client) to the last one, so that the two tiers do not share cores, as two machines would not.

    .venv/bin/python bench/routing.py [--requests 300] [--decisions 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer import ensure_venv, start_peer  # noqa: E402
from bench.serving import edged_argv, stop  # noqa: E402
from edged.client import Client  # noqa: E402
from edged.common.stats import percentile  # noqa: E402
from edged.routing.conditions import parse  # noqa: E402
from edged.routing.decide import Path as Tier  # noqa: E402
from edged.routing.decide import Policy, RouteRequest, Rule, decide  # noqa: E402
from tests.faultproxy import FaultProxy  # noqa: E402

MODELS = ROOT / "models"


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ---- 1. decide() ------------------------------------------------------------------------------


def bench_decide(count: int) -> None:
    rules = tuple(
        Rule(
            action,
            task_type=task,
            when=parse(cond),
            otherwise=other,  # type: ignore[arg-type]
            name=f"r{i}",
        )
        for i, (task, cond, action, other) in enumerate(
            [
                ("ocr", "payload > 1MB and rtt < 50ms", "cloud", None),
                ("asr", "battery < 20%", "cloud", None),
                ("text-generation", "deadline > 2s", "cloud", None),
                ("feature-extraction", "temperature > 80C or gpu > 90%", "cloud", None),
                ("image-classification", "queue > 16", "cloud", None),
                ("detection", "memory > 90%", "cloud", None),
                ("text-classification", "local_load < 80%", "local", "cloud"),
                (None, "rtt > 300ms", "local", "auto"),
            ]
        )
    )
    policy = Policy(rules=rules)
    rng = random.Random(0)
    tasks = ["text-classification", "feature-extraction", "ocr", "other"]
    cases = []
    for _ in range(1000):
        request = RouteRequest(
            "m",
            rng.choice(tasks),
            private=rng.random() < 0.1,
            deadline_s=rng.choice([None, 0.1, 0.3, 1.0]),
            payload_bytes=rng.randrange(10**7),
        )
        local = Tier(rng.random() < 0.95, "not loaded", rng.choice([None, 0.002, 0.08, 0.4]))
        cloud = Tier(rng.random() < 0.8, "link down", rng.choice([None, 0.03, 0.2, 0.6]))
        facts = {
            "local_load": rng.uniform(0, 100),
            "cpu": rng.uniform(0, 100),
            "gpu": rng.choice([None, rng.uniform(0, 100)]),
            "memory": rng.uniform(0, 100),
            "temperature": rng.uniform(30, 90),
            "battery": None,
            "rtt": rng.uniform(1, 500),
            "deadline": rng.uniform(1, 1000),
            "payload": float(request.payload_bytes),
            "queue": float(rng.randrange(32)),
        }
        cases.append((request, local, cloud, facts))

    def nothing(*args: Any) -> None:
        return None

    def timed(fn: Any) -> list[float]:
        samples = []
        clock = time.perf_counter_ns
        for i in range(count):
            args = cases[i % len(cases)]
            t = clock()
            fn(*args, policy)
            samples.append((clock() - t) / 1000)
        return sorted(samples)

    def rules_only(request: RouteRequest, local: Tier, cloud: Tier, facts: Any, p: Policy) -> Any:
        for rule in p.rules:
            if rule.applies_to(request) and (rule.when is None or rule.when.holds(facts)):
                return rule
        return None

    results = {
        "empty call": timed(nothing),
        "rules only": timed(rules_only),
        "decide()": timed(decide),
    }
    routes: dict[str, int] = {}
    for case in cases:
        route = decide(*case, policy).route
        routes[route] = routes.get(route, 0) + 1
    rows = [
        [name, percentile(s, 0.5), percentile(s, 0.99), percentile(s, 0.999), max(s)]
        for name, s in results.items()
    ]
    print(f"\n## decide(): {count} calls, 8 rules, 1000 distinct cases (routes: {routes})\n")
    print(table(rows, ["what", "p50 us", "p99 us", "p99.9 us", "max us"]))


# ---- 2. hedging -------------------------------------------------------------------------------


def tokens(length: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(1000, 20000, size=(1, length)).astype(np.int64)
    ids[0, 0], ids[0, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids}


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (taskset -a: threads that exist already too)."""
    subprocess.run(
        ["taskset", "-a", "-cp", ",".join(map(str, cpus)), str(pid)],
        check=True,
        capture_output=True,
    )


def bench_hedging(requests: int, workdir: Path) -> None:
    venv = ensure_venv()
    peer = start_peer(
        venv,
        MODELS / "text-encoder-int8" / "1" / "model.onnx",
        "text-encoder-int8",
        workdir / "mlserver",
        session_config={
            "session.intra_op.allow_spinning": "0",
            "session.inter_op.allow_spinning": "0",
        },
    )
    proxy = FaultProxy("127.0.0.1", int(peer.http_url.rsplit(":", 1)[1]))
    config = workdir / "edged.toml"
    config.write_text(
        f"""
[models]
load = ["text-encoder"]
[cloud]
url = "http://{proxy.address}"
[[cloud.models]]
name = "text-encoder"
cloud_name = "text-encoder-int8"
"""
    )
    socket = workdir / "edged.sock"
    proc = subprocess.Popen(edged_argv(workdir, config))
    client = Client(str(socket))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status = client.status()
                if status["ready"] and "text-encoder" in status["cloud"]["catalog"]:
                    break
            except Exception:
                pass
            time.sleep(0.05)
        else:
            raise SystemExit("edged or its cloud did not come up")
        cpus = sorted(os.sched_getaffinity(0))
        split = "shared CPUs"
        if len(cpus) >= 2:
            pin(proc.pid, cpus[:-1])
            pin(peer.proc.pid, cpus[-1:])
            pin(os.getpid(), cpus[-1:])
            split = f"edged on CPU {cpus[:-1]}, cloud on CPU {cpus[-1:]}"
        proxy.delay(0.001)
        proxy.erratic(0.05, 0.2)
        policies = ["local", "cloud", "hedged"]
        latency: dict[str, list[float]] = {p: [] for p in policies}
        winners: dict[str, int] = {"local": 0, "cloud": 0}
        for policy in policies:  # warm-up
            for i in range(10):
                client.infer_answer("text-encoder", tokens(128, i), parameters={"route": policy})
        for i in range(requests):
            for policy in policies:
                feeds = tokens(128, 1000 + i)
                params = {"route": policy, "timeout": 2_000_000}
                t = time.perf_counter()
                _, answer = client.infer_answer("text-encoder", feeds, parameters=params)
                latency[policy].append((time.perf_counter() - t) * 1000)
                if answer["route"] != policy:
                    raise SystemExit(f"asked {policy}, ran {answer['route']}: {answer['reason']}")
                if policy == "hedged":
                    winners["local" if "local answered first" in answer["reason"] else "cloud"] += 1
        rows = []
        local_p99 = percentile(sorted(latency["local"]), 0.99)
        for policy in policies:
            s = sorted(latency[policy])
            p99 = percentile(s, 0.99)
            rows.append([policy, statistics.median(s), percentile(s, 0.95), p99, p99 / local_p99])
        print(
            f"\n## hedging: text-encoder, 128 tokens, {requests} sequential requests per route;"
            " cloud = INT8 encoder on MLServer behind a 2 ms link with 5% chunks held 200 ms;"
            f" {split}\n"
        )
        print(table(rows, ["route", "p50 ms", "p95 ms", "p99 ms", "p99 / local p99"]))
        print(
            f"\nhedged: the first answer came from local {winners['local']}x, cloud"
            f" {winners['cloud']}x"
        )
    finally:
        stop(proc)
        proxy.close()
        peer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--skip-hedging", action="store_true")
    args = parser.parse_args()
    bench_decide(args.decisions)
    if not args.skip_hedging:
        with tempfile.TemporaryDirectory(prefix="edged-bench-routing-") as tmp:
            bench_hedging(args.requests, Path(tmp))
    print(json.dumps({"python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()

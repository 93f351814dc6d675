#!/usr/bin/env python3
"""Traces for the routing lab: a device's load and its network over time, and a request mix.

A trace is what the world did, drawn once with a fixed seed, so every policy (and the oracle)
faces exactly the same world: the timeline (every 100 ms: local load, thermal throttling, RTT,
bandwidth, outage) and the requests (arrival time, task type, payload, deadline, privacy label,
and what each path *would* take at that moment: ``local_ms`` on the device, ``cloud_ms`` in the
cloud, None when the cloud cannot be reached; and the same without the request's own noise,
``local_median_ms`` and ``cloud_median_ms``). A policy's choices do not change the world (no
queueing feedback): the lab measures choices, not capacity.

Latency models (from the figures this project measured, rounded; see docs/ROUTING.md):

- local: the task's base time x (1 + 2 (load/100)^3) (80% load doubles it) x 2.5 while
  throttled, x a log-normal noise (sigma 0.15);
- cloud: RTT (log-normal, sigma 0.1) + the task's service time (log-normal, sigma 0.2) +
  payload / bandwidth; None during an outage.

    .venv/bin/python bench/lab/traces.py          # (re)writes bench/lab/traces/*.json.gz
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TRACE_DIR = HERE / "traces"
STEP = 0.1  # seconds per timeline step

# task: local base ms, cloud service ms, payload bytes, deadlines ms, share of the mix
TASKS: dict[str, tuple[float, float, int, tuple[float, ...], float]] = {
    "text-classification": (3.0, 4.0, 1_500, (20.0, 100.0), 0.35),
    "feature-extraction": (30.0, 8.0, 2_000, (25.0, 50.0, 200.0), 0.30),
    "ocr": (160.0, 35.0, 150_000, (150.0, 300.0, 1000.0), 0.20),
    "speech-recognition": (350.0, 60.0, 320_000, (300.0, 600.0, 2000.0), 0.15),
}
PRIVATE_SHARE = 0.1


@dataclass
class Trace:
    name: str
    description: str
    seed: int
    duration_s: float
    change_at_s: float | None  # a regime change (adaptation is measured after it)
    env: dict[str, list[Any]]  # load, throttled, rtt_ms, bandwidth, outage: one per STEP
    requests: list[dict[str, Any]]

    def at(self, t: float) -> dict[str, Any]:
        i = min(len(self.env["load"]) - 1, max(0, int(t / STEP)))
        return {key: values[i] for key, values in self.env.items()}

    def save(self, path: Path) -> None:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(self.__dict__, f, separators=(",", ":"))

    @classmethod
    def load(cls, path: Path) -> Trace:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return cls(**json.load(f))


def local_ms(base: float, load: float, throttled: bool, noise: float) -> float:
    return base * (1 + 2 * (load / 100) ** 3) * (2.5 if throttled else 1.0) * noise


def random_walk(rng: np.random.Generator, n: int, low: float, high: float, sigma: float) -> Any:
    values = np.empty(n)
    x = (low + high) / 2
    for i in range(n):
        x = min(high, max(low, x + rng.normal(0, sigma)))
        values[i] = x
    return values


def bursts(rng: np.random.Generator, n: int, every_s: float, length_s: tuple[float, float]) -> Any:
    """A boolean mask: bursts starting as a Poisson process, each of a uniform length."""
    mask = np.zeros(n, dtype=bool)
    t = rng.exponential(every_s)
    while t < n * STEP:
        length = rng.uniform(*length_s)
        mask[int(t / STEP) : int((t + length) / STEP)] = True
        t += length + rng.exponential(every_s)
    return mask


def arrivals(
    rng: np.random.Generator, n: int, duration_s: float, rate: float
) -> Iterator[tuple[float, int, str, int]]:
    """Poisson arrivals at ``rate`` per second of the task mix: (time, its timeline step, task,
    payload bytes); the caller draws the rest of each request before the next arrives."""
    names = list(TASKS)
    shares = np.array([TASKS[t][4] for t in names])
    t = rng.exponential(1 / rate)
    while t < duration_s:
        task = str(rng.choice(names, p=shares / shares.sum()))
        payload = int(TASKS[task][2] * rng.lognormal(0, 0.3))
        yield t, min(n - 1, int(t / STEP)), task, payload
        t += rng.exponential(1 / rate)


def build(
    name: str,
    description: str,
    seed: int,
    world: Callable[[np.random.Generator, int], dict[str, Any]],
    duration_s: float = 300.0,
    rate: float = 10.0,
    change_at_s: float | None = None,
) -> Trace:
    """Draw the timeline with ``world``, then Poisson arrivals at ``rate`` per second."""
    rng = np.random.default_rng(seed)
    n = int(duration_s / STEP)
    env = world(rng, n)
    requests = []
    for t, i, task, payload in arrivals(rng, n, duration_s, rate):
        base, service, _, deadlines, _ = TASKS[task]
        local_median = local_ms(base, env["load"][i], bool(env["throttled"][i]), 1.0)
        local = local_median * rng.lognormal(0, 0.15)
        transfer = payload / env["bandwidth"][i] * 1000
        cloud = cloud_median = None
        if not env["outage"][i]:
            cloud_median = env["rtt_ms"][i] + service + transfer
            cloud = env["rtt_ms"][i] * rng.lognormal(0, 0.1) + service * rng.lognormal(0, 0.2)
            cloud += transfer
        requests.append(
            {
                "t": round(float(t), 4),
                "task": task,
                "payload": payload,
                "deadline_ms": float(rng.choice(deadlines)),
                "private": bool(rng.random() < PRIVATE_SHARE),
                "local_ms": round(float(local), 3),
                "cloud_ms": None if cloud is None else round(float(cloud), 3),
                # without this request's own noise: what a perfectly informed policy can know
                "local_median_ms": round(float(local_median), 3),
                "cloud_median_ms": None if cloud_median is None else round(float(cloud_median), 3),
            }
        )
    plain = {
        key: [round(float(v), 3) if not isinstance(v, (bool, np.bool_)) else bool(v) for v in vals]
        for key, vals in env.items()
    }
    return Trace(name, description, seed, duration_s, change_at_s, plain, requests)


def _env(load: Any, throttled: Any, rtt: Any, bandwidth: Any, outage: Any) -> dict[str, Any]:
    return {
        "load": list(load),
        "throttled": list(throttled),
        "rtt_ms": list(rtt),
        "bandwidth": list(bandwidth),
        "outage": list(outage),
    }


def lan(rng: np.random.Generator, n: int) -> dict[str, Any]:
    load = random_walk(rng, n, 15, 45, 1.0)
    rtt = 3 * rng.lognormal(0, 0.2, n)
    return _env(load, np.zeros(n, bool), rtt, np.full(n, 50e6), np.zeros(n, bool))


def wifi(rng: np.random.Generator, n: int) -> dict[str, Any]:
    load = random_walk(rng, n, 20, 50, 1.0)
    spikes = bursts(rng, n, 20.0, (1.0, 4.0))
    rtt = np.where(spikes, rng.uniform(150, 500, n), 12 * rng.lognormal(0, 0.3, n))
    bandwidth = np.where(spikes, 0.5e6, 4e6)
    return _env(load, np.zeros(n, bool), rtt, bandwidth, np.zeros(n, bool))


def cellular(rng: np.random.Generator, n: int) -> dict[str, Any]:
    load = random_walk(rng, n, 20, 50, 1.0)
    outage = bursts(rng, n, 45.0, (3.0, 15.0))
    rtt = 70 * rng.lognormal(0, 0.3, n)
    return _env(load, np.zeros(n, bool), rtt, np.full(n, 1e6), outage)


def busy_device(rng: np.random.Generator, n: int) -> dict[str, Any]:
    heavy = bursts(rng, n, 30.0, (20.0, 60.0))
    load = np.where(heavy, random_walk(rng, n, 85, 99, 1.5), random_walk(rng, n, 30, 60, 1.5))
    throttled = np.zeros(n, bool)
    hot = 0.0
    for i in range(n):  # throttles after 15 s above 90%, until it cools below 70%
        hot = hot + STEP if load[i] > 90 else (0.0 if load[i] < 70 else hot)
        throttled[i] = hot > 15.0 or (throttled[i - 1] and load[i] >= 70 if i else False)
    rtt = 3 * rng.lognormal(0, 0.2, n)
    return _env(load, throttled, rtt, np.full(n, 50e6), np.zeros(n, bool))


def degrading(rng: np.random.Generator, n: int) -> dict[str, Any]:
    """LAN for the first half; then the network degrades to a slow uplink (250 ms, 0.5 MB/s)."""
    env = lan(rng, n)
    half = n // 2
    slow = 250 * rng.lognormal(0, 0.2, n - half)
    env["rtt_ms"] = env["rtt_ms"][:half] + list(slow)
    env["bandwidth"] = env["bandwidth"][:half] + [0.5e6] * (n - half)
    return env


TRACES: dict[str, tuple[str, Callable[[np.random.Generator, int], dict[str, Any]]]] = {
    "lan": ("stable LAN: RTT about 3 ms, 50 MB/s, the device at 15-45% load", lan),
    "wifi": ("Wi-Fi: RTT about 12 ms, 4 MB/s, with spikes of 150-500 ms for 1-4 s", wifi),
    "cellular": ("cellular: RTT about 70 ms, 1 MB/s, outages of 3-15 s about every 45 s", cellular),
    "busy-device": (
        "a device under heavy local load: bursts of 85-99% for 20-60 s, thermal throttling"
        " (x2.5) after 15 s above 90%; LAN",
        busy_device,
    ),
    "degrading": ("LAN for 150 s, then the network degrades to 250 ms and 0.5 MB/s", degrading),
}


def generate(name: str, seed: int = 0, duration_s: float = 300.0, rate: float = 10.0) -> Trace:
    description, world = TRACES[name]
    change = duration_s / 2 if name == "degrading" else None
    return build(name, description, seed, world, duration_s, rate, change)


def main() -> None:
    TRACE_DIR.mkdir(exist_ok=True)
    for seed, name in enumerate(TRACES, start=1):
        trace = generate(name, seed=seed)
        path = TRACE_DIR / f"{name}.json.gz"
        trace.save(path)
        reachable = sum(r["cloud_ms"] is not None for r in trace.requests)
        print(
            f"{path.relative_to(HERE.parents[1])}: {len(trace.requests)} requests,"
            f" cloud reachable for {reachable}, {math.ceil(path.stat().st_size / 1024)} KiB"
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Seeing the fleet through the fleet service (issue 25): what every node's series and the web
console cost at fleet sizes, for docs/BENCHMARKS.md. Everything on this machine, on loopback: a
real Mosquitto, the service as its own process (SQLite), N simulated nodes (bench/fleetsim.py,
heartbeat every 10 s, telemetry every ``--telemetry-s``) and Debian's Prometheus scraping the
service every ``--scrape-s`` (tests/prometheus.py); each started here and stopped by its PID.

For each ``--nodes`` N, once every node is online and ``--warm-s`` has passed (every node has
sent telemetry, so its counters exist):

- ``GET /v1/fleet/metrics`` ``--runs`` times from here (each of ``--shards`` shards: the
  slowest one's time, as one scrape target's): the wall time (median), its bytes and samples;
  and, in this process, prometheus_client rendering the largest shard's families from memory
  (``generate_latest`` of a registry holding exactly those samples): the floor any exporter
  of that many samples pays, as the baseline of the ratio;
- Prometheus' own view of its scrapes of the service (``scrape_duration_seconds``,
  ``scrape_samples_scraped``: the median of its last ``--runs`` scrapes);
- the service's CPU (% of one CPU, from /proc) and its writer's busy share (the batch
  histogram's sum) over a ``--window-s`` window while Prometheus scrapes it and telemetry is
  added up;
- each console page's server time (``Server-Timing``, the median of ``--runs`` warm loads, as a
  viewer): overview, nodes, a node, deployments, rollouts.

    .venv/bin/python bench/fleet_observe.py [--nodes 1000 10000] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.fleet_service import (  # noqa: E402
    fleet,
    machine,
    metrics,
    proc_cpu_s,
    stop_service,
    table,
)
from tests.fleetservice import TOKENS  # noqa: E402
from tests.mosquitto import Broker, make_pki  # noqa: E402
from tests.prometheus import Prometheus  # noqa: E402

PAGES = ["/", "/nodes", "/nodes/sim-00042", "/deployments", "/rollouts"]


def timed_get(url: str, headers: dict[str, str]) -> tuple[float, bytes, dict[str, str]]:
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=120) as r:
        body = r.read()
        return time.perf_counter() - started, body, dict(r.headers)


class Frozen:
    """A collector of families already made (the baseline's registry)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


def render_floor(text: str, runs: int) -> float:
    """prometheus_client's generate_latest of the same families from memory: seconds (median)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Frozen(list(text_string_to_metric_families(text))))  # type: ignore[arg-type]
    took = []
    for _ in range(runs):
        started = time.perf_counter()
        generate_latest(registry)
        took.append(time.perf_counter() - started)
    return statistics.median(took)


def measure(args: argparse.Namespace, work: Path, pki: Path, n: int) -> dict[str, Any]:
    bench = argparse.Namespace(
        heartbeat_s=10.0,
        telemetry_s=args.telemetry_s,
        seed=0,
        install_delay_s=1.0,
        reconcile_s=30.0,
        lease_s=15.0,
    )
    with fleet(bench, work / f"n{n}", pki, n) as f:
        service = f.service
        prom = Prometheus(
            work / f"prom{n}",
            f"127.0.0.1:{service.port}",
            TOKENS["viewer"],
            interval_s=args.scrape_s,
            shards=args.shards,
        ).start()
        try:
            time.sleep(args.warm_s)
            auth = {"Authorization": f"Bearer {TOKENS['viewer']}"}
            walls, texts = [], [b""] * args.shards
            for _ in range(args.runs):
                took = 0.0
                for shard in range(args.shards):
                    url = f"{service.url}/v1/fleet/metrics?shard={shard}&shards={args.shards}"
                    wall, texts[shard], _ = timed_get(url, auth)
                    took = max(took, wall)
                walls.append(took)  # the slowest shard: what a scrape of one target takes
            text = b"".join(texts)
            decoded = text.decode()
            samples = sum(1 for line in decoded.splitlines() if line and line[0] != "#")
            floor = render_floor(max(texts, key=len).decode(), args.runs)
            # the window: the service's CPU and its writer while Prometheus scrapes
            pid = service.proc.pid if service.proc else 0
            before_m, cpu0, t0 = metrics(service), proc_cpu_s(pid), time.monotonic()
            time.sleep(args.window_s)
            after_m, cpu1, t1 = metrics(service), proc_cpu_s(pid), time.monotonic()
            batch = "edgefleet_ingest_batch_seconds_sum"
            busy = (after_m.get(batch, 0) - before_m.get(batch, 0)) / (t1 - t0)
            scrapes = prom.query(
                f'scrape_duration_seconds{{job="edgefleet"}}[{int(args.runs * args.scrape_s)}s]'
            )
            durations = [float(v) for target in scrapes for _, v in target["values"]]
            scraped = prom.query('sum(scrape_samples_scraped{job="edgefleet"})')
            pages = {}
            cookie = {"Cookie": f"edgefleet_console={TOKENS['viewer']}"}
            for path in PAGES:
                times = []
                for _ in range(args.runs + 1):
                    _, _, headers = timed_get(f"{service.url}/console{path}", cookie)
                    times.append(float(headers["Server-Timing"].split("dur=")[1]))
                pages[path] = statistics.median(times[1:])  # warm: the first compiles
            return {
                "nodes": n,
                "scrape_s": statistics.median(walls),
                "bytes": len(text),
                "samples": samples,
                "floor_s": floor,
                "prom_scrape_s": statistics.median(durations) if durations else None,
                "prom_samples": float(scraped[0]["value"][1]) if scraped else None,
                "service_cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
                "writer_busy_pct": 100 * busy,
                "pages_ms": pages,
                "counters": after_m.get('edgefleet_messages_total{kind="telemetry"}', 0),
            }
        finally:
            prom.stop()
            stop_service(service)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", nargs="+", type=int, default=[1000, 10000])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--telemetry-s", type=float, default=10.0)
    p.add_argument("--scrape-s", type=float, default=10.0)
    p.add_argument("--warm-s", type=float, default=30.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--shards", type=int, default=1, help="scrape targets (shard, shards)")
    args = p.parse_args(argv)
    why = Broker.available()
    if why:
        print(why, file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="fleet-observe-") as tmp:
        work = Path(tmp)
        pki = make_pki(work / "pki", [])
        for n in args.nodes:
            results.append(measure(args, work, pki, n))
            print(f"# {n} nodes: {results[-1]}", file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"command: {' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}")
    print(
        f"telemetry every {args.telemetry_s:g} s, Prometheus scrapes every {args.scrape_s:g} s"
        f" ({args.shards} shard(s): a scrape's time is the slowest shard's); medians of"
        f" {args.runs}"
    )
    rows = []
    for r in results:
        rows.append(
            [
                f"{r['nodes']:,}",
                f"{r['samples']:,}",
                f"{r['bytes'] / 1e6:.1f} MB",
                f"{r['scrape_s'] * 1000:.0f} ms",
                f"{r['floor_s'] * 1000:.0f} ms",
                f"{r['scrape_s'] / r['floor_s']:.1f}x",
                "-" if r["prom_scrape_s"] is None else f"{r['prom_scrape_s'] * 1000:.0f} ms",
                f"{r['service_cpu_pct']:.1f} %",
                f"{r['writer_busy_pct']:.1f} %",
            ]
        )
    print(
        table(
            [
                "nodes",
                "samples",
                "exposition",
                "GET /v1/fleet/metrics",
                "render floor",
                "ratio",
                "Prometheus' scrape",
                "service CPU",
                "writer busy",
            ],
            rows,
        )
    )
    print()
    print(
        table(
            ["console page (warm, server time)", *[f"{r['nodes']:,} nodes" for r in results]],
            [[path, *[f"{r['pages_ms'][path]:.1f} ms" for r in results]] for path in PAGES],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The per-call cost guard (issue 46, part of ``make bench``): edged's server CPU per call on
the intent head (a model that costs microseconds, so the serving path is what is measured),
over REST (http.client, binary tensors) and gRPC (tritonclient.grpc) on its Unix sockets,
against the floor of the same stack in the same run (a bare aiohttp handler and a bare
grpc.aio servicer answering a fixed response: bench/triton_clients.py's ``BARE``). The ratio
edged / floor is what the machine's load does not move much; it fails (exit 1) when a ratio
passes its budget, so that the per-call cost cannot creep up unseen as features come.

Budgets: the ratios of bench/triton_clients.py's run on 2026-12-07 (REST 5.9x, gRPC 3.4x at
concurrency 8; this script gave 5.3-5.6x and 2.9-3.2x: docs/BENCHMARKS.md), with a quarter on
top for the noise of a shared machine.
Lower them as the path gets leaner.

    .venv/bin/python bench/percall.py [--seconds 4] [--concurrency 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import grpc_client, rest_client, start_edged, table, tensor_inputs  # noqa: E402
from bench.triton_clients import bare_server, run  # noqa: E402

# edged's CPU per call / the floor's: the ratio measured (2026-12-07, on uvloop) and a quarter
BUDGETS = {"rest": 4.2 * 1.25, "grpc": 2.6 * 1.25}
MODEL = "intent-classifier"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3, help="runs per cell (the median counts)")
    args = parser.parse_args()
    feeds = tensor_inputs()[MODEL]
    cost: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc, sock = start_edged(work / "edged")
        try:
            edged = {
                "rest": rest_client(str(sock), MODEL, feeds),
                "grpc": grpc_client(f"unix://{sock.with_name('edged-grpc.sock')}", MODEL, feeds),
            }
            for kind, make in edged.items():
                run(make, args.concurrency, 1.0, proc.pid)  # warm-up
                runs = [
                    run(make, args.concurrency, args.seconds, proc.pid)[1] for _ in range(args.runs)
                ]
                cost[("edged", kind)] = statistics.median(runs)
        finally:
            proc.terminate()
            proc.wait(60)
        for kind in ("rest", "grpc"):
            with bare_server(kind, work) as (path, pid):
                make = (
                    grpc_client(f"unix://{path}", "m", feeds)
                    if kind == "grpc"
                    else rest_client(str(path), "m", feeds)
                )
                run(make, args.concurrency, 1.0, pid)
                runs = [run(make, args.concurrency, args.seconds, pid)[1] for _ in range(args.runs)]
                cost[("floor", kind)] = statistics.median(runs)
    rows, over = [], []
    for kind in ("rest", "grpc"):
        ratio = cost[("edged", kind)] / cost[("floor", kind)]
        verdict = "ok" if ratio <= BUDGETS[kind] else "OVER BUDGET"
        if ratio > BUDGETS[kind]:
            over.append(kind)
        rows.append(
            [
                kind,
                str(args.concurrency),
                f"{cost[('edged', kind)]:.0f}",
                f"{cost[('floor', kind)]:.0f}",
                f"{ratio:.2f}x",
                f"{BUDGETS[kind]:.2f}x",
                verdict,
            ]
        )
    header = ["protocol", "conc.", "edged µs/call", "floor µs/call", "ratio", "budget", ""]
    print(table(rows, header))
    if over:
        print(f"per-call cost over budget: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The routing lab: every policy over every shipped trace; tables and latency CDF plots.

    .venv/bin/python bench/lab/run.py [--seeds 5] [--plots docs/routing]   # or: make bench-lab

The learned policy draws at random (Thompson sampling): it runs with ``--seeds`` seeds and the
table gives the median of each figure (and the worst SLO over the seeds). The others are
deterministic. Writes a Markdown table to stdout and, with ``--plots``, one PNG per trace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.lab.sim import POLICIES, Learned, Replay, Result, run_all, summary  # noqa: E402
from bench.lab.traces import TRACE_DIR, Trace  # noqa: E402

COLUMNS = [
    ("policy", "policy"),
    ("slo_percent", "SLO %"),
    ("regret_points", "regret (points)"),
    ("p50_ms", "p50 ms"),
    ("p95_ms", "p95 ms"),
    ("p99_ms", "p99 ms"),
    ("cloud_calls", "cloud calls"),
    ("cloud_vs_oracle", "cloud / oracle"),
    ("cloud_vs_informed", "cloud / informed"),
    ("cost_per_1000", "cost / 1,000 requests"),
    ("violations", "privacy violations"),
    ("adaptation", "settled after (requests)"),
]


def learned_over_seeds(trace: Trace, seeds: int) -> tuple[dict[str, Any], Result]:
    """The learned policy's row: medians over seeds (worst SLO noted); one run for the plot."""
    runs = [Replay(trace, Learned(seed=s), "learned").run() for s in range(seeds)]
    oracle = run_all(trace, {})[0]  # the references only
    rows = [summary([oracle, r], trace)[1] for r in runs]
    merged: dict[str, Any] = {"policy": f"learned (median of {seeds} seeds)"}
    for key in ("slo_percent", "regret_points", "p50_ms", "p95_ms", "p99_ms", "cloud_calls"):
        merged[key] = statistics.median(r[key] for r in rows)
    merged["violations"] = max(r["violations"] for r in rows)
    settled = [r["adaptation"] for r in rows]
    merged["adaptation"] = None if None in settled else max(settled)  # type: ignore[type-var]
    merged["worst_slo"] = min(r["slo_percent"] for r in rows)
    median_run = sorted(runs, key=lambda r: r.slo)[len(runs) // 2]
    return merged, median_run


def cdf_plot(results: list[Result], trace: Trace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for result in results:
        latencies = sorted(min(o.latency_ms, 1e5) for o in result.outcomes)
        n = len(latencies)
        ax.plot(latencies, [(i + 1) / n for i in range(n)], label=result.policy, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{trace.name}: {trace.description}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the learned policy")
    parser.add_argument("--plots", type=Path, help="directory for the CDF plots (PNG)")
    args = parser.parse_args()
    fixed = {k: v for k, v in POLICIES.items() if k != "learned"}
    header = "| trace | " + " | ".join(title for _, title in COLUMNS) + " |"
    print(header)
    print("|" + " --- |" * (len(COLUMNS) + 1))
    for path in sorted(TRACE_DIR.glob("*.json.gz")):
        trace = Trace.load(path)
        results = run_all(trace, fixed)
        rows = summary(results, trace)
        learned, run = learned_over_seeds(trace, args.seeds)
        rows.append(learned)
        oracle_calls = max(1, rows[0]["cloud_calls"])
        informed_calls = max(1, rows[1]["cloud_calls"])
        for row in rows:
            row["cloud_vs_oracle"] = f"{row['cloud_calls'] / oracle_calls:.2f}x"
            row["cloud_vs_informed"] = f"{row['cloud_calls'] / informed_calls:.2f}x"
            # one cloud tier here, at 1 a call (bench/lab/tiers.py prices two)
            row["cost_per_1000"] = f"{1000 * row['cloud_calls'] / len(trace.requests):.1f}"
            if "worst_slo" in row:
                row["slo_percent"] = f"{row['slo_percent']} (worst {row['worst_slo']})"
            cells = ["-" if row.get(k) is None else str(row[k]) for k, _ in COLUMNS]
            print(f"| {trace.name} | " + " | ".join(cells) + " |")
        if args.plots is not None:
            args.plots.mkdir(parents=True, exist_ok=True)
            cdf_plot([*results, run], trace, args.plots / f"cdf-{trace.name}.png")


if __name__ == "__main__":
    main()

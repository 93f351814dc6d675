"""What a cloud says of its own service time: Triton's statistics extension.

Triton counts, per model version, its successful inferences and the nanoseconds they took from
arrival to answer (``inference_stats.success``: queue and compute, no network). Read every
``[cloud] stats_interval_s``, the difference between two reads is the cloud's service time per
inference since the last one, whoever called it: edged learns that the cloud got busy, or free
again, while it sends nothing there (edged.cloud feeds it to the routing estimates of a model
it did not call itself in that time; its own calls teach it better). The first read of a model
gives its mean over everything the server has served (a prior for a model never called).
"""

from __future__ import annotations

from typing import Any

NS = 1e-9


def totals(doc: Any) -> dict[str, tuple[int, int]]:
    """Per model name: (successful inferences, their nanoseconds), summed over its versions,
    from Triton's statistics document (REST's JSON, or gRPC's as JSON, whose 64-bit numbers
    are strings). What is not a number is skipped, not trusted."""
    found: dict[str, tuple[int, int]] = {}
    rows = doc.get("model_stats") if isinstance(doc, dict) else None
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            continue
        try:
            success = row.get("inference_stats", {}).get("success", {})
            count, ns = int(success.get("count", 0)), int(success.get("ns", 0))
        except (AttributeError, TypeError, ValueError):
            continue
        if count < 0 or ns < 0:
            continue
        before = found.get(row["name"], (0, 0))
        found[row["name"]] = (before[0] + count, before[1] + ns)
    return found


class ServiceTimes:
    """Each model's service time from successive reads of the cloud's statistics."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] = {}
        self.seconds: dict[str, float] = {}  # the last figure of each model (the status)

    def update(self, doc: Any) -> dict[str, tuple[float, int]]:
        """Seconds per inference since the last read, and how many inferences that is, of
        each model that served any (its mean over all it served, the first time); a counter
        that went back (the server restarted) starts afresh."""
        fresh: dict[str, tuple[float, int]] = {}
        for name, (count, ns) in totals(doc).items():
            before = self.last.get(name)
            self.last[name] = (count, ns)
            if before is None or count < before[0] or ns < before[1]:
                before = (0, 0)
            served = count - before[0]
            if served > 0:
                fresh[name] = ((ns - before[1]) * NS / served, served)
                self.seconds[name] = fresh[name][0]
        return fresh

    def as_ms(self) -> dict[str, float]:
        return {name: round(s * 1000, 3) for name, s in sorted(self.seconds.items())}

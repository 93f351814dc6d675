"""Learned latency estimates, per model and path, given load and payload size.

Every finished request teaches its path. Local estimates are kept per load band (the busier of
CPU and GPU in quarters: 0-25%, 25-50%, 50-75%, 75-100%) and payload size band (powers of 4 of
bytes); the cloud's are kept as *service time* (the call's time minus the link's RTT at that
moment) per size band, so a prediction adds the RTT measured now: when the network slows, the
estimate follows at once instead of waiting for traffic that no longer goes there.

An estimate is an EWMA of the time plus an EWMA of its absolute deviation; ``predict`` gives
the mean plus ``spread`` deviations (1 by default: a cautious figure, not the median). An
unseen band borrows from the nearest band measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edged.common.stats import ewma

LOAD_BANDS = 4


def load_band(load_percent: float | None) -> int:
    if load_percent is None:
        return 0
    return min(LOAD_BANDS - 1, max(0, int(load_percent // (100 / LOAD_BANDS))))


def size_band(payload_bytes: int) -> int:
    return 0 if payload_bytes <= 1 else int(math.log(payload_bytes, 4))


@dataclass
class Estimate:
    mean: float
    deviation: float = 0.0
    count: int = 1

    def update(self, seconds: float, alpha: float) -> None:
        self.deviation = ewma(self.deviation, abs(seconds - self.mean), alpha)
        self.mean = ewma(self.mean, seconds, alpha)
        self.count += 1


Key = tuple[str, str, int, int]  # model, path, load band, size band


class Estimates:
    """Latency per (model, path, load band, size band)."""

    def __init__(self, alpha: float = 0.2, spread: float = 1.0) -> None:
        self.alpha = alpha
        self.spread = spread
        self.table: dict[Key, Estimate] = {}

    def _key(self, model: str, path: str, load: float | None, payload: int) -> Key:
        band = load_band(load) if path == "local" else 0
        return (model, path, band, size_band(payload))

    def observe(
        self,
        model: str,
        path: str,
        seconds: float,
        load: float | None = None,
        payload: int = 0,
        rtt: float | None = None,
        times: int = 1,
    ) -> None:
        """A request on ``path`` took ``seconds``; for the cloud, ``rtt`` is the link's RTT then.
        ``times``: so many requests took that on average (a server's statistics), learned as
        that many observations of it would be."""
        if path.startswith("cloud") and rtt is not None:  # a tier's too ("cloud:<name>")
            seconds = max(0.0, seconds - rtt)
        key = self._key(model, path, load, payload)
        found = self.table.get(key)
        if found is None:
            self.table[key] = Estimate(seconds, count=max(1, times))
        else:
            found.update(seconds, 1 - (1 - self.alpha) ** max(1, times))
            found.count += max(1, times) - 1

    def lookup(self, model: str, path: str, load: float | None, payload: int) -> Estimate | None:
        """The estimate of this band, else the nearest measured one."""
        key = self._key(model, path, load, payload)
        found = self.table.get(key)
        if found is not None:
            return found
        best: tuple[int, Estimate] | None = None
        for (m, p, lb, sb), estimate in self.table.items():
            if m == model and p == path:
                distance = abs(lb - key[2]) * 8 + abs(sb - key[3])
                if best is None or distance < best[0]:
                    best = (distance, estimate)
        return None if best is None else best[1]

    def predict(
        self,
        model: str,
        path: str,
        load: float | None = None,
        payload: int = 0,
        rtt: float | None = None,
        bandwidth: float | None = None,
    ) -> float | None:
        """Expected seconds on ``path`` (None: never measured). For the cloud, the current
        ``rtt`` and the payload's transfer time over ``bandwidth`` (bytes/s) are added."""
        found = self.forecast(model, path, load, payload, rtt, bandwidth)
        return None if found is None else found[0]

    def forecast(
        self,
        model: str,
        path: str,
        load: float | None = None,
        payload: int = 0,
        rtt: float | None = None,
        bandwidth: float | None = None,
    ) -> tuple[float, float] | None:
        """``predict``'s figure and the deviation it was learned with (seconds)."""
        found = self.lookup(model, path, load, payload)
        if found is None:
            return None
        seconds = found.mean + self.spread * found.deviation
        if path.startswith("cloud"):
            seconds += rtt or 0.0
            if bandwidth:
                seconds += payload / bandwidth
        return seconds, found.deviation

    def summary(self, model: str, path: str) -> tuple[float, int] | None:
        """Mean seconds over every band of ``model`` on ``path`` (weighted by count), and how
        many calls taught it; None when never measured."""
        rows = [e for (m, p, _, _), e in self.table.items() if m == model and p == path]
        count = sum(e.count for e in rows)
        if not count:
            return None
        return sum(e.mean * e.count for e in rows) / count, count

    def as_list(self) -> list[dict[str, object]]:
        return [
            {
                "model": m,
                "path": p,
                "load_band": f"{lb * 25}-{lb * 25 + 25}%" if p == "local" else None,
                "size_band": f"<{4 ** (sb + 1)} B",
                "mean_ms": round(e.mean * 1000, 3),
                "deviation_ms": round(e.deviation * 1000, 3),
                "count": e.count,
            }
            for (m, p, lb, sb), e in sorted(self.table.items())
        ]

"""Exponential backoff with jitter, for whatever retries: the cloud link's probes, cloudsync's
reconnects and downloads."""

from __future__ import annotations

import random


def backoff_delay(step: int, low: float, high: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter: ``low * 2**step`` capped at ``high``, then half to all
    of it (so that many waiting clients do not retry in step)."""
    delay = min(high, low * 2 ** min(step, 30))
    return delay / 2 + (rng.uniform if rng else random.uniform)(0, delay / 2)

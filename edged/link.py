"""Link monitor: the state of the network path to one cloud endpoint.

RTT comes from cheap probes (OIP ``GET /v2/health/ready``, or anything that costs one round
trip) sent every ``interval`` seconds, and from real requests (``observe``). After a failed probe
the next one goes at once with twice the timeout, so a cut link is down within
``interval + 3 * timeout`` (0.2 + 0.75 = 0.95 s with the defaults) while a link that merely
became slower answers the second probe and stays up; on a slow link the probe timeout grows to
3x the p95 RTT. While the link is down, probes back off exponentially with jitter from
``backoff_min`` to ``backoff_max`` (1 s to 64 s), so a dead endpoint is not hammered. It keeps an
EWMA
and a window for percentiles. Up/down has hysteresis: the link goes down after ``down_after``
failures in a row (a probe that times out counts) and comes back only after ``up_after``
successes in a row, so a flaky link does not flap. Bandwidth is estimated from the payloads of
real requests: bytes over (duration - RTT), for payloads large enough to tell.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from edged.background import Background
from edged.common.backoff import backoff_delay
from edged.common.stats import ewma, percentile

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[None]]  # one round trip; raises when the endpoint failed
MIN_BANDWIDTH_BYTES = 64 * 1024  # smaller payloads are all latency


@dataclass(frozen=True)
class LinkState:
    """What routing needs to know about a link, at one moment."""

    endpoint: str
    up: bool
    rtt_s: float | None  # EWMA
    rtt_p50_s: float | None
    rtt_p95_s: float | None
    bandwidth_bps: float | None  # bytes per second
    failures: int  # in a row
    changed: float  # time.monotonic() of the last up/down change
    last_error: str  # why the last probe failed ("" if none has)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LinkMonitor(Background):
    """RTT, up/down with hysteresis and bandwidth for one endpoint."""

    def __init__(
        self,
        endpoint: str,
        probe: Probe,
        interval: float = 0.2,
        timeout: float = 0.25,
        max_timeout: float = 2.0,
        backoff_min: float = 1.0,
        backoff_max: float = 64.0,
        down_after: int = 2,
        up_after: int = 3,
        alpha: float = 0.2,
        window: int = 200,
        on_change: Callable[[bool], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``on_change(up)`` is called at each up/down change; ``rng`` draws the backoff's
        jitter (a seeded one makes a replay repeatable)."""
        self.endpoint = endpoint
        self.probe = probe
        self.interval = interval
        self.timeout = timeout
        self.max_timeout = max_timeout
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.down_after = down_after
        self.up_after = up_after
        self.alpha = alpha
        self.on_change = on_change
        self.rng = rng or random.Random()
        self.samples: deque[float] = deque(maxlen=window)
        self.rtt: float | None = None
        self.bandwidth: float | None = None
        self.up = False  # until the first probes answer
        self.failures = 0
        self.successes = 0
        self.changed = time.monotonic()
        self.last_error = ""
        self._transition = asyncio.Event()  # set (and replaced) at each up/down change
        self.task_name = f"link:{endpoint}"

    def observe(self, seconds: float | None, payload_bytes: int = 0, rtt: bool = True) -> None:
        """One round trip: its time, or None when it failed. Real requests report here too,
        with ``rtt=False`` when their time includes the server's work (then only a payload
        large enough to measure bandwidth is timed)."""
        if seconds is None:
            self.failures += 1
            self.successes = 0
            if self.up and self.failures >= self.down_after:
                self._change(False)
            return
        self.failures = 0
        self.successes += 1
        if payload_bytes >= MIN_BANDWIDTH_BYTES and self.rtt is not None and seconds > self.rtt:
            rate = payload_bytes / (seconds - self.rtt)
            self.bandwidth = ewma(self.bandwidth, rate, self.alpha)
        elif rtt:  # small payloads measure the round trip
            self.samples.append(seconds)
            self.rtt = ewma(self.rtt, seconds, self.alpha)
        if not self.up and self.successes >= self.up_after:
            self._change(True)

    def _change(self, up: bool) -> None:
        self.up = up
        self.changed = time.monotonic()
        self._transition.set()
        self._transition = asyncio.Event()
        log.warning("link to %s is %s", self.endpoint, "up" if up else "DOWN")
        if self.on_change is not None:
            self.on_change(up)

    async def wait_until(self, up: bool) -> None:
        """Return once the link is (or becomes) up, or down."""
        while self.up != up:
            await self._transition.wait()

    def state(self) -> LinkState:
        ordered = sorted(self.samples)
        return LinkState(
            endpoint=self.endpoint,
            up=self.up,
            rtt_s=self.rtt,
            rtt_p50_s=percentile(ordered, 0.5),
            rtt_p95_s=percentile(ordered, 0.95),
            bandwidth_bps=self.bandwidth,
            failures=self.failures,
            changed=self.changed,
            last_error=self.last_error,
        )

    def probe_timeout(self) -> float:
        """How long a probe may take: ``timeout``, or 3x the p95 RTT on a slow link (a slow
        link is not a cut one), twice that after a failure, at most ``max_timeout``."""
        p95 = percentile(sorted(self.samples), 0.95) or 0.0
        base = max(self.timeout, 3 * p95) * (2 if self.failures else 1)
        return min(self.max_timeout, base)

    def silence_is_failure(self, seconds: float) -> bool:
        """Does no answer within ``seconds`` say the path failed? Only when that is at least as
        long as a probe may take; a shorter wait (a tight deadline) says nothing."""
        return seconds >= self.probe_timeout()

    def backoff(self, attempt: int) -> float:
        """The pause before probe ``attempt`` (0, 1, ...) of a link that is down: exponential,
        with jitter (half to all of it)."""
        return backoff_delay(attempt, self.backoff_min, self.backoff_max, self.rng)

    async def probe_once(self) -> None:
        """Send one probe and record what became of it (a timeout is a failure)."""
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.probe(), self.probe_timeout())
        except Exception as exc:  # refused, reset, timed out, 5xx: the endpoint failed
            error = str(exc) or type(exc).__name__
            if error != self.last_error:  # once per kind of failure, not per probe
                log.warning("probe of %s failed: %s", self.endpoint, error)
            self.last_error = error
            self.observe(None)
        else:
            self.observe(time.perf_counter() - started)

    async def _run(self) -> None:
        attempt = 0  # failed probes since the link went down
        while True:
            await self.probe_once()
            if not self.failures:
                attempt = 0
                await asyncio.sleep(self.interval)
            elif not self.up and self.failures >= self.down_after:
                await asyncio.sleep(self.backoff(attempt))
                attempt += 1
            # else: a first failure: probe again at once, so a cut shows in time


def oip_ready_probe(session: Any, base_url: str) -> Probe:
    """A probe that asks an OIP server ``GET {base_url}/v2/health/ready`` over an aiohttp
    session; anything but 200 is a failure."""

    async def probe() -> None:
        async with session.get(f"{base_url.rstrip('/')}/v2/health/ready") as response:
            await response.read()
            if response.status != 200:
                raise ConnectionError(f"ready answered {response.status}")

    return probe

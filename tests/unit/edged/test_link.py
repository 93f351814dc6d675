"""The link monitor: hysteresis and bandwidth on recorded round trips, and probes against a real
OIP-style HTTP server on loopback that the test cuts (stalls) and restores."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from edged.link import LinkMonitor, oip_ready_probe


async def never() -> None:
    raise AssertionError("this test feeds observe() directly")


def test_hysteresis_no_flapping_and_percentiles() -> None:
    link = LinkMonitor("cloud", never, down_after=2, up_after=3)
    for _ in range(2):
        link.observe(0.010)
    assert not link.up  # 2 successes are not yet 3
    link.observe(0.030)
    assert link.up
    for outcome in [None, 0.01, None, 0.01, None, 0.01]:  # flaky, never 2 failures in a row
        link.observe(outcome)
    assert link.up
    link.observe(None)
    link.observe(None)
    assert not link.up and link.state().failures == 2
    for outcome in [0.01, 0.01, None, 0.01, 0.01]:  # a failure resets the way back
        link.observe(outcome)
    assert not link.up
    link.observe(0.01)
    assert link.up
    state = link.state()
    assert state.rtt_p50_s == 0.01 and state.rtt_p95_s == 0.03
    assert 0.01 <= state.rtt_s < 0.02


def test_a_slow_link_is_not_a_cut_one() -> None:
    link = LinkMonitor("cloud", never, timeout=0.3, max_timeout=2.0)
    assert link.probe_timeout() == 0.3
    for _ in range(10):
        link.observe(0.400)  # RTT raised to 400 ms
    assert abs(link.probe_timeout() - 1.2) < 1e-9 and link.up


def test_bandwidth_from_large_payloads_only() -> None:
    link = LinkMonitor("cloud", never)
    link.observe(0.020)  # RTT 20 ms
    link.observe(0.030, payload_bytes=1_000)  # small: counts as a round trip
    assert link.bandwidth is None
    link.observe(0.020 + 1.0, payload_bytes=1_000_000)  # 1 MB in 1 s beyond the RTT
    assert link.bandwidth is not None and 0.9e6 < link.bandwidth < 1.1e6


def test_a_cut_link_is_down_within_1_s_and_back_after_recovery() -> None:
    async def scenario() -> None:
        cut = asyncio.Event()

        async def ready(request: web.Request) -> web.Response:
            if cut.is_set():
                await asyncio.sleep(5)  # a blackhole: the answer never comes in time
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/v2/health/ready", ready)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            link = LinkMonitor("cloud", oip_ready_probe(session, f"http://127.0.0.1:{port}"))
            link.start()
            await link.wait_until(up=True)
            assert link.rtt is not None and link.rtt < 0.3
            cut.set()
            started = time.monotonic()
            await link.wait_until(up=False)
            detected = time.monotonic() - started
            print(f"cut detected in {detected * 1000:.0f} ms")
            assert detected < 1.0
            cut.clear()
            await link.wait_until(up=True)
            await link.stop()
        await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_second_probe_waits_longer_and_a_down_link_backs_off() -> None:
    changes: list[bool] = []
    link = LinkMonitor("cloud", never, timeout=0.25, down_after=2, on_change=changes.append)
    link.observe(None)
    assert link.probe_timeout() == 0.5  # after a failure: twice the timeout (slow is not cut)
    for _ in range(3):
        link.observe(0.01)
    link.observe(None)
    link.observe(None)
    assert changes == [True, False]
    for attempt, ceiling in [(0, 1.0), (1, 2.0), (3, 8.0), (6, 64.0), (30, 64.0)]:
        pauses = [link.backoff(attempt) for _ in range(200)]
        assert ceiling / 2 <= min(pauses) and max(pauses) <= ceiling  # jitter: half to all
        assert max(pauses) - min(pauses) > ceiling / 10  # and it does vary

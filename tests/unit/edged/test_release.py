"""The steps of a stop after the drain (``edged.app.Release``): each waited for while the
budget lasts; one that hangs, ignores its cancellation or fails is named in the log, and the
steps after it still run."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from edged.app import Release


async def forever() -> None:
    await asyncio.Event().wait()


DEAF = {"hears": False}


async def deaf() -> None:
    """A step that swallows its cancellation and goes on (a loop with a broad except), until
    the test lets it end."""
    while not DEAF["hears"]:
        try:
            await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            continue


async def broken() -> None:
    raise RuntimeError("the store's file is gone")


def test_a_hung_step_is_named_and_left_behind_and_the_rest_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    async def quick(name: str) -> None:
        await asyncio.sleep(0.01)
        ran.append(name)

    async def stop() -> float:
        release = Release(1.0)
        started = time.monotonic()
        await release("the models", quick("first"))
        await release("the cloud tier", forever())
        await release("the knowledge store", deaf())
        await release("the chat model", broken())
        await release("the load monitor", quick("last"))
        return time.monotonic() - started

    # not asyncio.run: it would wait for the deaf step, as edged's own end does (systemd's
    # TimeoutStopSec ends that, the log having named the step)
    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="edged"):
        try:
            took = loop.run_until_complete(asyncio.wait_for(stop(), 30))
        finally:
            DEAF["hears"] = True
            loop.run_until_complete(asyncio.sleep(0.2))  # the deaf step ends
            loop.close()
    assert ran == ["first", "last"]
    # the budget (1 s), then at least 0.5 s for each step after it is spent
    assert 1.0 <= took < 3.0
    errors = [r.getMessage() for r in caplog.records if r.name == "edged"]
    assert errors[0].startswith("stopping: the cloud tier did not finish within 1.0 s")
    assert errors[1] == "stopping: the knowledge store did not finish within 0.5 s; left behind"
    gone = 'RuntimeError("the store\'s file is gone")'
    assert errors[2] == f"stopping: the chat model failed: {gone}"
    assert len(errors) == 3


def test_a_cancelled_task_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    async def stop() -> None:
        task = asyncio.ensure_future(forever())
        await asyncio.sleep(0)
        task.cancel()
        await Release(1.0)("task t", task)
        assert task.cancelled()

    with caplog.at_level(logging.ERROR, logger="edged"):
        asyncio.run(stop())
    assert not [r for r in caplog.records if r.name == "edged"]

"""The scheduler on a real ONNX Runtime session of a small graph: batching, priority, timeouts,
admission. A gate (an asyncio.Event before the real execution) holds the worker busy so that the
tests assert order and outcomes, not times."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edged.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    Unavailable,
)
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.request import CONTEXT, RequestContext, RequestQos, qos_from_parameters
from edged.runtimes.base import Tensors
from edged.runtimes.onnxruntime import OnnxRuntime
from edged.scheduler import QueuePolicy, Scheduler, Settings, _Estimate
from tests.unit.edged.test_repository import add_model

Scenario = Callable[["Bench"], Awaitable[None]]


class Bench:
    """A scheduler in front of a real ORT session (y = 2x), with a gate and an execution log."""

    def __init__(self, tmp_path: Path, batching: str, max_queue_size: int = 64) -> None:
        add_model(tmp_path, "m", {1: 2.0}, batching)
        self.config = read_config(tmp_path / "m")
        self.runtime = OnnxRuntime(
            self.config, tmp_path / "m" / "1", OnnxRuntimeConfig(), ThreadPoolExecutor(2)
        )
        self.gate = asyncio.Event()
        self.gate.set()
        self.executions: list[list[float]] = []  # the first column of each execution's rows
        self.started = asyncio.Event()
        self.scheduler = Scheduler(
            "m", Settings.from_config(self.config, max_queue_size), self.execute
        )

    async def execute(self, feeds: Tensors) -> Tensors:
        self.started.set()
        await self.gate.wait()
        self.executions.append([float(v) for v in feeds["x"][:, 0]])
        return await self.runtime.infer(feeds, {})

    def submit(
        self, value: float, rows: int = 1, priority: int = 0, timeout_us: int = 0
    ) -> asyncio.Task[Tensors]:
        """A request of ``rows`` rows filled with ``value``, as a task."""
        x = np.full((rows, 2), value, np.float32)

        async def call() -> Tensors:
            CONTEXT.set(
                RequestContext(qos_from_parameters({"priority": priority, "timeout": timeout_us}))
            )
            return await self.scheduler.submit({"x": x})

        return asyncio.ensure_future(call())

    async def hold(self) -> asyncio.Task[Tensors]:
        """Occupy the only worker with a request that waits at the closed gate."""
        self.gate.clear()
        self.started.clear()
        blocker = self.submit(-1.0)
        await self.started.wait()
        return blocker


def run(tmp_path: Path, batching: str, scenario: Scenario, **kwargs: int) -> None:
    async def main() -> None:
        bench = Bench(tmp_path, batching, **kwargs)
        await bench.runtime.load()
        try:
            await scenario(bench)
        finally:
            await bench.scheduler.close()

    asyncio.run(main())


BATCHING = "dynamic_batching { }"
PRIORITIES = "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"


def test_concurrent_requests_run_in_fewer_executions_with_the_results_of_one_each(
    tmp_path: Path,
) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        tasks = [bench.submit(float(i), rows=1 + i % 3) for i in range(64)]
        await asyncio.sleep(0)
        bench.gate.set()
        results = await asyncio.gather(*tasks)
        await blocker
        for i, out in enumerate(results):  # each its own rows, as if alone
            np.testing.assert_array_equal(out["y"], np.full((1 + i % 3, 2), 2.0 * i, np.float32))
        executions = len(bench.executions) - 1  # the blocker ran alone
        assert executions < 64
        assert all(len(rows) <= 4 for rows in bench.executions)  # max_batch_size
        assert bench.scheduler.depth == 0

    run(tmp_path, BATCHING, scenario)


def test_without_dynamic_batching_each_request_runs_alone(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        tasks = [bench.submit(float(i)) for i in range(5)]
        await asyncio.sleep(0)
        bench.gate.set()
        await asyncio.gather(blocker, *tasks)
        assert [len(e) for e in bench.executions] == [1] * 6

    run(tmp_path, "", scenario)


def test_a_high_priority_request_is_dequeued_before_older_low_priority_ones(
    tmp_path: Path,
) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        # Low-priority requests of 3 rows each: with max_batch_size 4, one per execution.
        low = [bench.submit(float(i), rows=3) for i in range(1, 6)]
        await asyncio.sleep(0)
        urgent = bench.submit(100.0, rows=3, priority=1)
        await asyncio.sleep(0)
        bench.gate.set()
        await asyncio.gather(blocker, urgent, *low)
        firsts = [rows[0] for rows in bench.executions]
        assert firsts == [-1.0, 100.0, 1.0, 2.0, 3.0, 4.0, 5.0]

    run(tmp_path, PRIORITIES, scenario)


def test_a_priority_outside_the_levels_is_refused(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        with pytest.raises(InvalidRequest, match=r"priority 3 is outside 1\.\.2"):
            await bench.submit(1.0, priority=3)

    run(tmp_path, PRIORITIES, scenario)


def test_a_timeout_that_expires_in_the_queue_is_an_error_never_a_late_answer(
    tmp_path: Path,
) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        doomed = bench.submit(7.0, timeout_us=50_000)
        patient = bench.submit(8.0)
        with pytest.raises(DeadlineExceeded, match="timed out after") as late:
            await doomed  # while the worker is still held: the answer could not have come
        waited = float(late.value.message.split("after ")[1].split(" ms")[0])
        assert 50.0 <= waited < 1000.0, late.value.message  # its time in the queue, in ms
        assert not blocker.done()
        bench.gate.set()
        await asyncio.gather(blocker, patient)
        assert all(7.0 not in rows for rows in bench.executions)

    run(tmp_path, BATCHING, scenario)


def test_a_delay_policy_moves_expired_requests_behind_those_in_time(tmp_path: Path) -> None:
    policy = (
        "dynamic_batching { priority_levels: 2 default_priority_level: 2"
        " default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 500000"
        " max_queue_size: 3 } }"
    )

    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        old = bench.submit(1.0, rows=3)
        urgent_old = bench.submit(3.0, rows=3, priority=1)
        await asyncio.sleep(0.55)  # their 500 ms pass: late, but still queued
        assert not old.done() and not urgent_old.done()
        fresh = bench.submit(2.0, rows=3)  # 500 ms to be taken: in time even on a slow CI
        fresh2 = bench.submit(4.0, rows=3)
        # Late requests still count against max_queue_size (3 at level 2: old, fresh, fresh2).
        with pytest.raises(Overloaded, match="queue of priority 2 is full"):
            await bench.submit(5.0, rows=3)
        bench.gate.set()
        await asyncio.gather(blocker, old, urgent_old, fresh, fresh2)
        # Level 1 (late or not) before level 2; within level 2, in time before late.
        assert [rows[0] for rows in bench.executions] == [-1.0, 3.0, 2.0, 4.0, 1.0]

    run(tmp_path, policy, scenario)


def test_request_timeouts_obey_allow_timeout_override(tmp_path: Path) -> None:
    policy = "dynamic_batching { default_queue_policy { default_timeout_microseconds: 10000000 } }"

    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        ignored = bench.submit(3.0, timeout_us=10_000)  # override not allowed: 10 s applies
        await asyncio.sleep(0.1)
        assert not ignored.done()
        bench.gate.set()
        await asyncio.gather(blocker, ignored)

    run(tmp_path, policy, scenario)


def test_a_full_queue_is_refused_at_once_with_a_retry_estimate(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        queued = [bench.submit(float(i)) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match=r"queue of priority 1 is full \(3 requests\)") as err:
            await bench.submit(9.0)
        # nothing measured yet (the only execution has not ended): the least Retry-After
        assert err.value.status == 429 and err.value.retry_after == 0.001
        bench.gate.set()
        await asyncio.gather(blocker, *queued)

    run(tmp_path, "", scenario, max_queue_size=3)


def test_retry_after_is_the_rows_ahead_over_the_instances_and_half_an_execution(
    tmp_path: Path,
) -> None:
    """Retry-After estimates when a new request would start: every row queued at its level and
    more urgent ones, at the measured time per row, spread over the instances, plus half an
    execution while every instance is busy (what is running ends half-way, on average)."""

    async def scenario(bench: Bench) -> None:
        bench.gate.clear()
        running = [bench.submit(-1.0, rows=4), bench.submit(-2.0, rows=4)]  # both instances
        await asyncio.sleep(0.1)
        assert bench.scheduler.running == 2
        bench.scheduler.estimate = _Estimate(row_s=0.01, exec_s=0.1)  # as if measured
        queued = [bench.submit(float(i), rows=2) for i in range(3)]  # 6 rows, max_queue_size 3
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="is full") as full:
            await bench.submit(9.0)
        assert full.value.retry_after == pytest.approx(6 * 0.01 / 2 + 0.1 / 2)
        bench.gate.set()
        await asyncio.gather(*running, *queued)

    add = "dynamic_batching { }\ninstance_group [ { count: 2 kind: KIND_CPU } ]"
    run(tmp_path, add, scenario, max_queue_size=3)


def test_the_estimates_are_moving_averages_per_row_and_per_execution() -> None:
    estimate = _Estimate()
    assert (estimate.row_s, estimate.exec_s) == (None, None)
    estimate.add(0.4, 4)  # the first execution starts them
    assert (estimate.row_s, estimate.exec_s) == (pytest.approx(0.1), pytest.approx(0.4))
    estimate.add(0.2, 0)  # no rows (a request without a batch dimension) counts as one
    assert estimate.row_s == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    assert estimate.exec_s == pytest.approx(0.4 + 0.2 * (0.2 - 0.4))


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(tmp_path: Path) -> None:
    async def slow(bench: Bench) -> None:
        original = bench.execute

        async def execute(feeds: Tensors) -> Tensors:
            await asyncio.sleep(0.05)  # a model that takes 50 ms per execution
            return await original(feeds)

        bench.scheduler.execute = execute
        await bench.submit(0.0)  # the scheduler learns how long an execution takes
        # Idle: a timeout shorter than the execution itself is fine (it bounds the queue wait).
        out = await bench.submit(8.0, timeout_us=20_000)
        np.testing.assert_array_equal(out["y"], [[16.0, 16.0]])
        blocker = await bench.hold()
        queued = [bench.submit(float(i), rows=4) for i in range(1, 5)]  # 4 executions ahead
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="cannot be met") as refused:
            await bench.submit(9.0, timeout_us=100_000)  # ~200 ms of work ahead
        assert refused.value.retry_after > 0.1
        # A timeout the queue can meet is admitted (4 executions of 50 ms ahead, 2 s budget).
        patient = bench.submit(10.0, timeout_us=2_000_000)
        bench.gate.set()
        await asyncio.gather(blocker, *queued, patient)

    run(tmp_path, BATCHING, slow)


def test_a_caller_that_goes_away_leaves_the_queue(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        gone = bench.submit(5.0)
        await asyncio.sleep(0)
        assert bench.scheduler.depth == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert bench.scheduler.depth == 0
        bench.gate.set()
        await blocker
        assert all(5.0 not in rows for rows in bench.executions)

    run(tmp_path, BATCHING, scenario)


def test_one_bad_request_in_a_batch_fails_alone(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        original = bench.execute

        async def execute(feeds: Tensors) -> Tensors:
            if 13.0 in feeds["x"][:, 0]:  # stands for input the graph rejects at run time
                raise InvalidRequest("model 'm' rejected the input: 13")
            return await original(feeds)

        bench.scheduler.execute = execute
        blocker = await bench.hold()
        tasks = [bench.submit(v) for v in (12.0, 13.0, 14.0)]
        await asyncio.sleep(0)
        bench.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await blocker
        assert isinstance(results[1], InvalidRequest)
        # [12, 13, 14] fails; halves [12] and [13, 14]; [13, 14] fails; [13] and [14] alone.
        assert bench.executions[1:] == [[12.0], [14.0]]
        np.testing.assert_array_equal(results[0]["y"], [[24.0, 24.0]])  # type: ignore[index]
        np.testing.assert_array_equal(results[2]["y"], [[28.0, 28.0]])  # type: ignore[index]

    run(tmp_path, BATCHING, scenario)


def test_a_preferred_batch_size_is_sent_without_waiting_for_the_delay(tmp_path: Path) -> None:
    policy = (
        "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 5000000 }"
    )

    async def scenario(bench: Bench) -> None:
        first, second = bench.submit(1.0), bench.submit(2.0)
        done, _ = await asyncio.wait({first, second}, timeout=2)  # not the 5 s delay
        assert len(done) == 2 and bench.executions == [[1.0, 2.0]]
        alone = bench.submit(3.0)  # one row: waits for company until the delay ends
        await asyncio.sleep(0.2)
        assert not alone.done()
        company = bench.submit(4.0)
        await asyncio.gather(alone, company)
        assert bench.executions[-1] == [3.0, 4.0]

    run(tmp_path, policy, scenario)


def test_two_instances_run_two_executions_at_once(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        bench.gate.clear()
        tasks = [bench.submit(float(i), rows=4) for i in range(3)]  # 4 rows: one per execution
        await asyncio.sleep(0.1)
        assert bench.scheduler.running == 2 and bench.scheduler.depth == 1
        bench.gate.set()
        await asyncio.gather(*tasks)

    add = "dynamic_batching { }\ninstance_group [ { count: 2 kind: KIND_CPU } ]"
    run(tmp_path, add, scenario)


def test_requests_due_are_expired_before_a_batch_is_formed(tmp_path: Path) -> None:
    """A worker that never yields (inline executions) must not serve requests past their
    timeout: the check happens when the batch is formed, not only in the timer."""

    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        doomed = bench.submit(7.0, timeout_us=1_000)
        await asyncio.sleep(0)
        time.sleep(0.01)  # noqa: ASYNC251 (on purpose: the loop is blocked past the deadline)
        bench.gate.set()
        await blocker
        with pytest.raises(DeadlineExceeded):
            await doomed
        assert all(7.0 not in rows for rows in bench.executions)

    run(tmp_path, BATCHING, scenario)


def test_close_answers_everything_still_queued(tmp_path: Path) -> None:
    async def scenario(bench: Bench) -> None:
        blocker = await bench.hold()
        waiting = bench.submit(1.0)
        await asyncio.sleep(0)
        await bench.scheduler.close()
        for task in (blocker, waiting):
            with pytest.raises(Unavailable, match="stopped before the request ran"):
                await task
        assert bench.scheduler.depth == 0

    run(tmp_path, BATCHING, scenario)


def test_queue_settings_are_checked_at_load(tmp_path: Path) -> None:
    add_model(tmp_path, "bad", {1: 1.0}, "dynamic_batching { preferred_batch_size: [ 8 ] }")
    with pytest.raises(ModelLoadError, match="preferred_batch_size 8 is over max_batch_size 4"):
        Settings.from_config(read_config(tmp_path / "bad"), 16)


def test_request_parameters_give_priority_and_timeout() -> None:
    qos = qos_from_parameters({"priority": 1, "timeout": 2_000_000})
    assert qos.priority == 1 and qos.deadline is not None
    assert qos_from_parameters({}) == RequestQos()
    for bad in ({"priority": -1}, {"timeout": "soon"}, {"priority": 1.5}, {"timeout": True}):
        with pytest.raises(InvalidRequest):
            qos_from_parameters(bad)


# ---- admission, without a runtime: a scheduler in front of an execution the test holds -------


def settings(levels: int = 1, timeout_s: float = 0.0, override: bool = True) -> Settings:
    policy = QueuePolicy(
        max_queue_size=8,
        default_timeout_s=timeout_s,
        reject_on_timeout=True,
        allow_timeout_override=override,
    )
    return Settings(
        max_batch_size=4,
        preferred=(),
        max_delay_s=0.0,
        levels=levels,
        default_level=levels,
        policies=dict.fromkeys(range(1, levels + 1), policy),
        instances=1,
    )


def held(settings: Settings) -> tuple[Scheduler, asyncio.Event, list[Tensors]]:
    """A scheduler whose executions (y = x + 1) wait for the returned event; what each ran."""
    gate, ran = asyncio.Event(), []

    async def execute(feeds: Tensors) -> Tensors:
        ran.append(feeds)
        await gate.wait()
        return {"y": feeds["x"] + 1} if "x" in feeds else {}

    return Scheduler("m", settings, execute), gate, ran


async def call(scheduler: Scheduler, inputs: Tensors, qos: RequestQos) -> Tensors:
    CONTEXT.set(RequestContext(qos))
    return await scheduler.submit(inputs)


def test_a_requests_own_timeout_may_shorten_the_policys_never_extend_it() -> None:
    now = 1000.0
    scheduler = Scheduler("m", settings(timeout_s=10.0), lambda feeds: asyncio.sleep(0, feeds))
    policy = scheduler.settings.policies[1]
    assert scheduler._deadline(RequestQos(deadline=now + 5), policy, now) == now + 5
    assert scheduler._deadline(RequestQos(deadline=now + 20), policy, now) == now + 10
    assert scheduler._deadline(RequestQos(), policy, now) == now + 10
    free = Scheduler("m", settings(), lambda feeds: asyncio.sleep(0, feeds)).settings.policies[1]
    assert scheduler._deadline(RequestQos(deadline=now + 20), free, now) == now + 20
    assert scheduler._deadline(RequestQos(), free, now) is None
    fixed = settings(timeout_s=10.0, override=False).policies[1]
    assert scheduler._deadline(RequestQos(deadline=now + 5), fixed, now) == now + 10


def test_the_last_priority_level_is_one_and_the_next_is_refused_naming_the_range() -> None:
    scheduler = Scheduler("m", settings(levels=2), lambda feeds: asyncio.sleep(0, feeds))
    assert scheduler._level(RequestQos(priority=2)) == 2
    assert scheduler._level(RequestQos(priority=1)) == 1
    assert scheduler._level(RequestQos(priority=0)) == 2  # the default level
    with pytest.raises(InvalidRequest) as refused:
        scheduler._level(RequestQos(priority=3))
    assert refused.value.message == ("priority 3 is outside 1..2 (model 'm' has 2 priority levels)")


def test_a_timeout_already_past_is_refused_before_the_request_is_queued() -> None:
    async def scenario() -> None:
        scheduler, gate, ran = held(settings())
        gate.set()
        with pytest.raises(DeadlineExceeded) as late:
            await call(scheduler, {"x": np.ones((1, 2))}, RequestQos(deadline=time.monotonic() - 1))
        assert late.value.message == (
            "model 'm': the request's timeout passed before it was queued"
        )
        assert ran == [] and scheduler.depth == 0
        await scheduler.close()

    asyncio.run(scenario())


def test_a_refusal_names_the_timeout_and_the_work_ahead_in_milliseconds() -> None:
    async def scenario() -> None:
        scheduler, gate, _ = held(settings())
        running = asyncio.ensure_future(call(scheduler, {"x": np.ones((4, 2))}, RequestQos()))
        await asyncio.sleep(0.01)
        scheduler.estimate = _Estimate(row_s=10.0, exec_s=0.1)  # as if measured
        queued = asyncio.ensure_future(call(scheduler, {"x": np.ones((3, 2))}, RequestQos()))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:  # 3 rows x 10 s + half of 100 ms ahead
            await call(
                scheduler, {"x": np.ones((1, 2))}, RequestQos(deadline=time.monotonic() + 10)
            )
        timeout, ahead = re.findall(r"([\d.]+) ms", refused.value.message)
        assert 9990.0 <= float(timeout) <= 10000.0, refused.value.message  # what was left of it
        assert ahead == "30050.0", refused.value.message
        assert refused.value.message.startswith("model 'm': the timeout of ")
        assert refused.value.retry_after == pytest.approx(30.05)
        gate.set()
        await asyncio.gather(running, queued)
        await scheduler.close()

    asyncio.run(scenario())


def test_a_request_that_started_before_its_timeout_gets_its_answer() -> None:
    """The timeout bounds the wait in the queue: once a worker took the request, its timer
    finds it gone and the answer comes, however long the execution takes."""

    async def scenario() -> None:
        scheduler, gate, _ = held(settings())
        task = asyncio.ensure_future(
            call(scheduler, {"x": np.ones((1, 2))}, RequestQos(deadline=time.monotonic() + 0.02))
        )
        await asyncio.sleep(0.1)  # taken at once, then its deadline passed while it ran
        assert not task.done() and scheduler.running == 1
        gate.set()
        np.testing.assert_array_equal((await task)["y"], [[2.0, 2.0]])
        await scheduler.close()

    asyncio.run(scenario())


def test_requests_due_are_expired_when_a_worker_looks_even_before_their_timers_run() -> None:
    async def scenario() -> None:
        scheduler, gate, _ = held(settings())
        running = asyncio.ensure_future(call(scheduler, {"x": np.ones((1, 2))}, RequestQos()))
        await asyncio.sleep(0.01)
        doomed = asyncio.ensure_future(
            call(scheduler, {"x": np.ones((1, 2))}, RequestQos(deadline=time.monotonic() + 0.001))
        )
        await asyncio.sleep(0)  # queued, its timer set
        time.sleep(0.005)  # noqa: ASYNC251 (on purpose: past its deadline, the timer not run)
        scheduler._expire_due()  # what a worker does before it forms a batch
        assert scheduler.depth == 0  # taken out and answered (the task sees it next)
        with pytest.raises(DeadlineExceeded, match="timed out after"):
            await doomed
        gate.set()
        await running
        await scheduler.close()

    asyncio.run(scenario())


def test_requests_of_other_shapes_never_share_an_execution() -> None:
    async def scenario() -> None:
        scheduler, gate, ran = held(settings())
        first = asyncio.ensure_future(call(scheduler, {"x": np.ones((1, 2))}, RequestQos()))
        await asyncio.sleep(0.01)  # running: the next two queue behind it
        narrow = asyncio.ensure_future(call(scheduler, {"x": np.ones((1, 2))}, RequestQos()))
        wide = asyncio.ensure_future(call(scheduler, {"x": np.ones((1, 3))}, RequestQos()))
        none = asyncio.ensure_future(call(scheduler, {}, RequestQos()))  # no inputs: one row
        gate.set()
        answers = await asyncio.gather(first, narrow, wide, none)
        assert [a["y"].shape for a in answers[:3]] == [(1, 2), (1, 2), (1, 3)]
        assert answers[3] == {}
        assert sorted(feeds["x"].shape for feeds in ran if "x" in feeds) == [(1, 2), (1, 2), (1, 3)]
        await scheduler.close()

    asyncio.run(scenario())


def settings_of(tmp_path: Path, max_batch_size: int, batching: str, name: str = "s") -> Settings:
    """The scheduler's settings read from a config.pbtxt of ``batching`` (no model needed)."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.pbtxt").write_text(
        f'platform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n' + batching
    )
    return Settings.from_config(read_config(tmp_path / name), 64)


def test_the_queue_policies_and_batching_are_read_from_the_config_field_by_field(
    tmp_path: Path,
) -> None:
    config = (
        "dynamic_batching { preferred_batch_size: [ 0, 1, 4 ] max_queue_delay_microseconds: 2500"
        " priority_levels: 3 default_priority_level: 2"
        " default_queue_policy { max_queue_size: 5 default_timeout_microseconds: 1500000"
        " timeout_action: DELAY allow_timeout_override: true }"
        " priority_queue_policy { key: 1 value { default_timeout_microseconds: 250000 } }"
        " priority_queue_policy { key: 3 value { max_queue_size: 7 } } }"
    )
    default = QueuePolicy(
        max_queue_size=5,
        default_timeout_s=1.5,
        reject_on_timeout=False,
        allow_timeout_override=True,
    )
    assert settings_of(tmp_path, 4, config) == Settings(
        max_batch_size=4,
        preferred=(1, 4),
        max_delay_s=0.0025,
        levels=3,
        default_level=2,
        policies={
            # a level's own policy: its unset fields are proto defaults, no override
            1: QueuePolicy(
                max_queue_size=64,
                default_timeout_s=0.25,
                reject_on_timeout=True,
                allow_timeout_override=False,
            ),
            2: default,
            3: QueuePolicy(
                max_queue_size=7,
                default_timeout_s=0.0,
                reject_on_timeout=True,
                allow_timeout_override=False,
            ),
        },
        instances=1,
    )
    # without dynamic batching, or without a batch dimension: one row, no delay, no preference
    plain = QueuePolicy(
        max_queue_size=64,
        default_timeout_s=0.0,
        reject_on_timeout=True,
        allow_timeout_override=True,
    )
    alone = Settings(
        max_batch_size=1,
        preferred=(),
        max_delay_s=0.0,
        levels=1,
        default_level=1,
        policies={1: plain},
        instances=1,
    )
    assert (
        settings_of(
            tmp_path,
            0,
            "dynamic_batching { max_queue_delay_microseconds: 900 preferred_batch_size: [ 1 ] }",
            "unbatched",
        )
        == alone
    )
    assert settings_of(tmp_path, 4, "", "none") == alone
    one = settings_of(tmp_path, 1, "dynamic_batching { max_queue_delay_microseconds: 900 }", "one")
    assert (one.max_batch_size, one.max_delay_s) == (1, 0.0009)  # batching, of one row


@pytest.mark.parametrize(
    ("batching", "message"),
    [
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
            "model 'bad': default_priority_level 3 is outside 1..2",
        ),
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 1"
            " priority_queue_policy { key: 0 value { } } }",
            "model 'bad': priority_queue_policy 0 is outside 1..2",
        ),
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 1"
            " priority_queue_policy { key: 3 value { } } }",
            "model 'bad': priority_queue_policy 3 is outside 1..2",
        ),
        (
            "dynamic_batching { preferred_batch_size: [ 5 ] }",
            "model 'bad': preferred_batch_size 5 is over max_batch_size 4",
        ),
    ],
)
def test_queue_settings_outside_their_range_are_refused_naming_them(
    tmp_path: Path, batching: str, message: str
) -> None:
    with pytest.raises(ModelLoadError) as refused:
        settings_of(tmp_path, 4, batching, "bad")
    assert refused.value.message == message

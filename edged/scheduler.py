"""The per-model scheduler: Triton's dynamic batcher, priority queues, timeouts, admission.

Every tensor model version has one ``Scheduler`` in front of its runtime. Requests wait in one
queue per priority level (1 is the most urgent); ``instance_group`` count workers take work from
the queues, the most urgent and oldest first. With ``dynamic_batching`` in config.pbtxt a worker
merges the waiting requests whose tensors fit together (same names, datatypes and non-batch
dimensions) into one execution of at most ``max_batch_size`` rows, waiting up to
``max_queue_delay_microseconds`` for a ``preferred_batch_size``; the outputs are split back by
rows, so every request gets what it would have got alone.

Admission is decided when a request arrives, never later: a full queue
(``max_queue_size``, else ``scheduler.max_queue_size`` so memory stays bounded) or a timeout
that the work ahead cannot meet is refused at once with 429 and a Retry-After estimate. A
request whose timeout expires while it waits gets a timeout error (504) at that moment, never a
late answer (``timeout_action: REJECT``); with ``DELAY`` it goes behind the requests of its
level that are still in time instead (and still counts against the queue's size).

Priority and timeout come from the request, as Triton takes them: parameters ``priority``
(0: the model's default level) and ``timeout`` (microseconds). They are set once per request in
the request context (``edged.request``, a context variable), so the steps a pipeline calls
inherit them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as pb

from edged.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    Unavailable,
)
from edged.common.stats import ewma
from edged.models.model_config import ModelConfig
from edged.request import RequestQos, current_qos, own_call
from edged.runtimes.base import Tensors

REJECT = pb.ModelQueuePolicy.TimeoutAction.REJECT


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy for one priority level."""

    max_queue_size: int
    default_timeout_s: float  # 0: none
    reject_on_timeout: bool
    allow_timeout_override: bool


@dataclass(frozen=True)
class Settings:
    """What the scheduler of one model takes from its config.pbtxt."""

    max_batch_size: int  # rows per execution; 1 without dynamic batching
    preferred: tuple[int, ...]
    max_delay_s: float
    levels: int
    default_level: int
    policies: dict[int, QueuePolicy]
    instances: int

    @classmethod
    def from_config(cls, config: ModelConfig, max_queue_size: int) -> Settings:
        """Read ``dynamic_batching`` and ``instance_group``; ``max_queue_size`` bounds queues
        the config leaves unbounded."""
        proto = config.proto
        batching = proto.HasField("dynamic_batching") and config.max_batch_size > 0
        db = proto.dynamic_batching
        levels = max(1, db.priority_levels)
        default_level = db.default_priority_level if levels > 1 else 1
        if not 1 <= default_level <= levels:
            raise ModelLoadError(
                f"model '{config.name}': default_priority_level {default_level} is outside"
                f" 1..{levels}"
            )

        def policy(message: pb.ModelQueuePolicy, explicit: bool) -> QueuePolicy:
            return QueuePolicy(
                max_queue_size=message.max_queue_size or max_queue_size,
                default_timeout_s=message.default_timeout_microseconds / 1e6,
                reject_on_timeout=message.timeout_action == REJECT,
                # Without a policy in the config, a request's own timeout is honoured.
                allow_timeout_override=message.allow_timeout_override or not explicit,
            )

        default = policy(db.default_queue_policy, db.HasField("default_queue_policy"))
        policies = {level: default for level in range(1, levels + 1)}
        for level, message in db.priority_queue_policy.items():
            if not 1 <= level <= levels:
                raise ModelLoadError(
                    f"model '{config.name}': priority_queue_policy {level} is outside 1..{levels}"
                )
            policies[level] = policy(message, True)
        preferred = tuple(sorted(p for p in db.preferred_batch_size if p > 0))
        limit = config.max_batch_size if batching else 1
        if any(p > limit for p in preferred):
            raise ModelLoadError(
                f"model '{config.name}': preferred_batch_size {max(preferred)} is over"
                f" max_batch_size {limit}"
            )
        return cls(
            max_batch_size=limit,
            preferred=preferred if batching else (),
            max_delay_s=db.max_queue_delay_microseconds / 1e6 if batching else 0.0,
            levels=levels,
            default_level=default_level,
            policies=policies,
            instances=config.instance_count,
        )


@dataclass(eq=False)
class Pending:
    """A request waiting in a queue, then running."""

    inputs: Tensors
    rows: int
    key: tuple[Any, ...]  # requests with equal keys can run in one execution
    level: int
    deadline: float | None
    reject_on_timeout: bool
    enqueued: float
    future: asyncio.Future[Tensors]
    late: bool = False  # DELAY: past its timeout, behind its level's requests in time
    timer: asyncio.TimerHandle | None = None
    own: bool = False  # edged's own call (a warm-up): the observer does not see it

    def finish(self, result: Tensors | BaseException) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


@dataclass
class Observer:
    """Where the scheduler reports what it does for callers (Prometheus metrics in the daemon):
    edged's own requests (a pipeline's warm-up) are not reported."""

    queued: Callable[[float], None] = lambda seconds: None
    executed: Callable[[int, float], None] = lambda rows, seconds: None


def batch_key(inputs: Tensors) -> tuple[Any, ...]:
    """Names, datatypes and non-batch dimensions: what must match to share an execution."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in inputs.items()))


@dataclass
class _Estimate:
    """Moving averages of execution time, per row and per execution, for admission and
    Retry-After (None until the first execution)."""

    row_s: float | None = None
    exec_s: float | None = None

    def add(self, seconds: float, rows: int) -> None:
        self.row_s = ewma(self.row_s, seconds / max(1, rows))
        self.exec_s = ewma(self.exec_s, seconds)


class Scheduler:
    """Queues, batches and runs the requests of one model version."""

    def __init__(
        self,
        name: str,
        settings: Settings,
        execute: Callable[[Tensors], Awaitable[Tensors]],
    ) -> None:
        self.name = name
        self.settings = settings
        self.execute = execute
        self.observer = Observer()  # the daemon's metrics attach theirs
        levels = range(1, settings.levels + 1)
        self.queues: dict[int, deque[Pending]] = {level: deque() for level in levels}
        # timeout_action DELAY: requests past their timeout, served after their level's queue
        self.late: dict[int, deque[Pending]] = {level: deque() for level in levels}
        self.arrived = asyncio.Event()
        self.forming = asyncio.Lock()  # one worker forms a batch at a time
        self.workers: list[asyncio.Task[None]] = []
        self.running = 0  # executions in progress
        self.estimate = _Estimate()

    # ---- admission ---------------------------------------------------------------------------

    def _at(self, level: int) -> list[Pending]:
        return [*self.queues[level], *self.late[level]]

    @property
    def depth(self) -> int:
        """Requests waiting (not yet running)."""
        return sum(len(self.queues[lv]) + len(self.late[lv]) for lv in self.queues)

    def _wait_estimate(self, level: int) -> float:
        """Seconds until a new request at ``level`` starts running: the rows queued at this
        level and more urgent ones, plus what is running (half an execution on average)."""
        row_s, exec_s = self.estimate.row_s, self.estimate.exec_s
        if row_s is None or exec_s is None:
            return 0.0
        rows = sum(p.rows for lv in range(1, level + 1) for p in self._at(lv))
        wait = rows * row_s / self.settings.instances
        if self.running >= self.settings.instances:
            wait += exec_s / 2
        return wait

    def _retry_after(self) -> float:
        return max(0.001, self._wait_estimate(self.settings.levels))

    def _level(self, qos: RequestQos) -> int:
        if qos.priority == 0 or self.settings.levels == 1:
            return self.settings.default_level
        if qos.priority > self.settings.levels:
            raise InvalidRequest(
                f"priority {qos.priority} is outside 1..{self.settings.levels}"
                f" (model '{self.name}' has {self.settings.levels} priority levels)"
            )
        return qos.priority

    def _deadline(self, qos: RequestQos, policy: QueuePolicy, now: float) -> float | None:
        default = now + policy.default_timeout_s if policy.default_timeout_s else None
        asked = qos.deadline if policy.allow_timeout_override else None
        if asked is None:
            return default
        return asked if default is None else min(asked, default)  # may shorten, not extend

    async def submit(self, inputs: Tensors) -> Tensors:
        """Queue a request and wait for its outputs (or its error)."""
        qos = current_qos()
        level = self._level(qos)
        policy = self.settings.policies[level]
        now = time.monotonic()
        deadline = self._deadline(qos, policy, now)
        if deadline is not None and deadline <= now and policy.reject_on_timeout:
            raise DeadlineExceeded(  # e.g. a pipeline's later step, after earlier ones took it
                f"model '{self.name}': the request's timeout passed before it was queued"
            )
        if len(self.queues[level]) + len(self.late[level]) >= policy.max_queue_size:
            raise Overloaded(
                f"model '{self.name}': the queue of priority {level} is full"
                f" ({policy.max_queue_size} requests)",
                self._retry_after(),
            )
        if deadline is not None and policy.reject_on_timeout:
            wait = self._wait_estimate(level)
            if now + wait > deadline:
                raise Overloaded(
                    f"model '{self.name}': the timeout of {(deadline - now) * 1000:.1f} ms cannot"
                    f" be met: about {wait * 1000:.1f} ms of work is queued ahead",
                    self._retry_after(),
                )
        loop = asyncio.get_running_loop()
        first = next(iter(inputs.values()), None)
        pending = Pending(
            inputs=inputs,
            rows=int(first.shape[0]) if first is not None and first.ndim else 1,
            key=batch_key(inputs),
            level=level,
            deadline=deadline,
            reject_on_timeout=policy.reject_on_timeout,
            enqueued=now,
            future=loop.create_future(),
            own=own_call(),
        )
        if deadline is not None:
            pending.timer = loop.call_at(deadline, self._expire, pending)
        self.queues[level].append(pending)
        self._start_workers()
        self.arrived.set()
        try:
            return await pending.future
        except asyncio.CancelledError:  # the caller went away (client hung up): leave the queue
            self._remove(pending)
            if pending.timer is not None:
                pending.timer.cancel()
            raise

    def _remove(self, pending: Pending) -> bool:
        queue = (self.late if pending.late else self.queues)[pending.level]
        try:
            queue.remove(pending)
        except ValueError:
            return False  # already taken by a worker
        return True

    def _expire(self, pending: Pending) -> None:
        """The timeout passed while the request waited: 504 (REJECT), or behind (DELAY)."""
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if not self._remove(pending):
            return
        if pending.reject_on_timeout:
            waited = (time.monotonic() - pending.enqueued) * 1000
            pending.finish(
                DeadlineExceeded(
                    f"model '{self.name}': the request timed out after {waited:.1f} ms in the queue"
                )
            )
        else:
            pending.late = True
            self.late[pending.level].append(pending)

    def _expire_due(self) -> None:
        """Expire what is due now even if its timer has not run yet (a busy loop)."""
        now = time.monotonic()
        for queue in self.queues.values():
            for p in [p for p in queue if p.deadline is not None and p.deadline <= now]:
                self._expire(p)

    # ---- execution ---------------------------------------------------------------------------

    def _start_workers(self) -> None:
        if not self.workers:
            loop = asyncio.get_running_loop()
            # In a context of their own: the first request's (its id, routing) is not theirs.
            self.workers = [
                contextvars.Context().run(
                    loop.create_task, self._work(), name=f"scheduler:{self.name}:{i}"
                )
                for i in range(self.settings.instances)
            ]

    def _waiting(self) -> list[Pending]:
        """Every waiting request in the order they are served: by priority level, each level's
        requests in time, then its late ones."""
        return [p for level in sorted(self.queues) for p in self._at(level)]

    def _take(self) -> list[Pending]:
        """The next batch: the first waiting request and those that fit with it. Requests of
        another shape are passed over, not a barrier (Triton stops at the first one)."""
        waiting = self._waiting()
        if not waiting:
            return []
        head = waiting[0]
        chosen, rows = [head], head.rows
        for p in waiting[1:]:
            if rows >= self.settings.max_batch_size:
                break
            if p.key == head.key and rows + p.rows <= self.settings.max_batch_size:
                chosen.append(p)
                rows += p.rows
        return chosen

    def _preferred(self, rows: int) -> int:
        """The largest preferred batch size that ``rows`` reaches (0: none)."""
        return max((size for size in self.settings.preferred if size <= rows), default=0)

    async def _form(self) -> list[Pending]:
        """Wait for work; send at once when the batch is full or reaches a preferred size, else
        when the first request has waited max_queue_delay; take the batch off the queues."""
        while True:
            self._expire_due()
            batch = self._take()
            if not batch:
                self.arrived.clear()
                await self.arrived.wait()
                continue
            rows = sum(p.rows for p in batch)
            if rows >= self.settings.max_batch_size:
                break
            preferred = self._preferred(rows)
            if preferred:
                batch = self._trim(batch, preferred)
                break
            remaining = batch[0].enqueued + self.settings.max_delay_s - time.monotonic()
            if remaining <= 0:
                break  # the delay is over: send everything there is
            self.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)
        for p in batch:
            self._remove(p)
            if p.timer is not None:
                p.timer.cancel()
                p.timer = None
        return batch

    @staticmethod
    def _trim(batch: list[Pending], size: int) -> list[Pending]:
        """The leading requests of a batch that fit in ``size`` rows (at least one)."""
        kept, total = [], 0
        for p in batch:
            if total + p.rows > size:
                break
            kept.append(p)
            total += p.rows
        return kept or batch[:1]

    async def _work(self) -> None:
        while True:
            async with self.forming:
                batch = await self._form()
            await self._run(batch)
            # not held while the next is awaited: its inputs are a caller's (a view of its
            # region; a frame of 6 MB) and the answer has gone
            del batch
            await asyncio.sleep(0)  # let timers and arrivals run between inline executions

    async def _run(self, batch: list[Pending]) -> None:
        started = time.monotonic()
        for p in batch:
            if not p.own:
                self.observer.queued(started - p.enqueued)
        live = [p for p in batch if not p.future.done()]
        self.running += 1
        try:
            results = await self._results(live)
        except asyncio.CancelledError:  # shutdown: nobody is left without an answer
            for p in live:
                p.finish(Unavailable(f"model '{self.name}' stopped before the request ran"))
            raise
        finally:
            self.running -= 1
        for p, result in zip(live, results):
            p.finish(result)

    async def _results(self, live: list[Pending]) -> list[Tensors | BaseException]:
        """Execute the batch; each request gets its outputs or its error. When the graph refuses
        a merged batch (400), halve it until the requests at fault are found: only they fail."""
        if not live:
            return []
        try:
            callers = sum(p.rows for p in live if not p.own)
            if len(live) == 1:
                return [await self._execute(live[0].inputs, callers)]
            merged = {
                name: np.concatenate([p.inputs[name] for p in live]) for name in live[0].inputs
            }
            return list(self._split(await self._execute(merged, callers), live))
        except InvalidRequest as exc:
            if len(live) == 1:
                return [exc]
            half = len(live) // 2
            return [*await self._results(live[:half]), *await self._results(live[half:])]
        except Exception as exc:
            return [exc] * len(live)

    async def _execute(self, feeds: Tensors, callers: int) -> Tensors:
        """One execution; the observer sees it with the ``callers``' rows of it (none: it was
        edged's own warm-up), the estimate of the work ahead with all of them."""
        rows = len(next(iter(feeds.values()))) if feeds else 0
        started = time.monotonic()
        try:
            return await self.execute(feeds)
        finally:
            seconds = time.monotonic() - started
            self.estimate.add(seconds, rows)
            if callers:
                self.observer.executed(callers, seconds)

    @staticmethod
    def _split(outputs: Tensors, batch: list[Pending]) -> list[Tensors]:
        bounds = list(itertools.accumulate(p.rows for p in batch))[:-1]
        pieces = {name: np.split(array, bounds) for name, array in outputs.items()}
        return [{name: parts[i] for name, parts in pieces.items()} for i in range(len(batch))]

    async def close(self) -> None:
        """Stop the workers; whatever still waits gets an error."""
        for task in self.workers:
            task.cancel()
        for task in self.workers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.workers = []
        for p in self._waiting():
            p.finish(Unavailable(f"model '{self.name}' stopped before the request ran"))
        for queue in (*self.queues.values(), *self.late.values()):
            queue.clear()

"""Each call of a model counted once, as Triton's statistics and edged's request metrics show it.

The rule lives here alone. A caller's call of a model (REST, gRPC, the task API) is open from
where the data plane takes it to its answer; a local version's run inside it joins it rather than
counting again. So a call counts once, when its last part ends, under the version that ran it:
with that run's failure if the run failed, else with the call's own end (an answer refused after
the run is a failure too). A call that fails before any version runs it (an unknown version, a
shared-memory region, a parameter, the cloud) counts under the version it named if the model has
it, else under the one that serves by default; an answer from the cloud is no version's success.
A run that no caller's call of its model holds open (a pipeline's step) counts by itself. edged's
own calls (``edged.request.own_call``: a pipeline's warm-up at load, an install's smoke test)
count nowhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from edged.metrics import Metrics
from edged.request import own_call


@dataclass
class Call:
    """One call of a model, until it is counted."""

    model: str
    started: float
    own: bool  # edged's own call: counted nowhere
    named: int | None = None  # the version the caller named (None: the default one)
    version: int | None = None  # the local version that ran it (None: none did)
    failure: BaseException | None = None  # how that run failed (None: it did not)
    error: BaseException | None = None  # how the caller's call ended (None: answered)
    open: bool = True  # the caller's call has not ended yet
    runs: int = 0  # runs of it in flight (a hedge's loser may end after the call)


# the caller's call open in this task and the tasks it starts (asyncio copies the context)
_OPEN: contextvars.ContextVar[Call | None] = contextvars.ContextVar("edged_call", default=None)


class Calls:
    """Counts the calls of the repository's models into the metrics."""

    def __init__(self, metrics: Metrics, charged: Callable[[str, int | None], int | None]) -> None:
        """``charged(model, named)``: the version that a call no version ran counts under (None:
        none, when the model is unknown or nothing serves: a label comes from the repository,
        never from what a caller asked for)."""
        self.metrics = metrics
        self.charged = charged

    @contextlib.contextmanager
    def call(self, model: str) -> Iterator[Call]:
        """A caller's call of ``model``: whoever reads the version it names sets ``named``."""
        call = Call(model, time.monotonic(), own_call())
        token = _OPEN.set(call)
        try:
            yield call
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            _OPEN.reset(token)
            call.open = False
            self._end(call)

    @contextlib.contextmanager
    def run(self, model: str, named: int | None) -> Iterator[Call]:
        """A local run of ``model``: part of the caller's call of it that is open, else a call
        of its own (a pipeline's step); whoever resolves the version sets ``version``."""
        call = _OPEN.get()
        if call is None or call.model != model or not call.open:
            call = Call(model, time.monotonic(), own_call(), named, open=False)
        call.runs += 1
        call.failure = None  # the last run tells how the local work went
        try:
            yield call
        except BaseException as exc:
            call.failure = exc
            raise
        finally:
            call.runs -= 1
            self._end(call)

    def _end(self, call: Call) -> None:
        """Count ``call`` once its caller's part and its runs have all ended."""
        if call.open or call.runs or call.own:
            return
        error = call.failure or call.error
        version = call.version
        if version is None:
            if error is None:
                return  # answered where no version of ours ran it: the cloud
            version = self.charged(call.model, call.named)
            if version is None:
                return
        self.metrics.finished(call.model, version, time.monotonic() - call.started, error)

"""The rule that counts each call of a model once (edged.models.calls), on its own: a caller's
call and the local runs inside it, refusals before any run, the cloud's answers, a hedge's loser
that ends after the call, a pipeline's step, and edged's own calls."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

import pytest

from edged.common.errors import InvalidRequest, NotFound
from edged.metrics import Metrics
from edged.models.calls import Calls
from edged.request import own_calls


@dataclass
class Counted:
    """What the metrics were told: (model, version, outcome) per call."""

    rows: list[tuple[str, int, str]] = field(default_factory=list)

    def finished(
        self, model: str, version: int, seconds: float, error: BaseException | None
    ) -> None:
        assert seconds >= 0
        self.rows.append((model, version, "success" if error is None else type(error).__name__))


def calls_for(
    counted: Counted, serving: int | None = 2, versions: tuple[int, ...] = (1, 2)
) -> Calls:
    """The repository's answer: ``m`` has ``versions``, ``serving`` serves; others are unknown."""

    def charged(model: str, named: int | None) -> int | None:
        if model != "m":
            return None
        return named if named in versions else serving

    return Calls(cast(Metrics, counted), charged)


def test_a_call_and_its_run_count_once_under_the_version_that_ran() -> None:
    counted = Counted()
    calls = calls_for(counted)
    with calls.call("m"), calls.run("m", None) as run:
        run.version = 1
    assert counted.rows == [("m", 1, "success")]


def test_an_answer_refused_after_the_run_is_a_failure() -> None:
    counted = Counted()
    calls = calls_for(counted)
    with pytest.raises(InvalidRequest), calls.call("m"):
        with calls.run("m", None) as run:
            run.version = 2
        raise InvalidRequest("model 'm' has no output 'nope'")
    assert counted.rows == [("m", 2, "InvalidRequest")]


def test_a_failed_run_is_the_calls_outcome_even_when_the_cloud_answers_after_it() -> None:
    counted = Counted()
    calls = calls_for(counted)
    with calls.call("m"), pytest.raises(RuntimeError), calls.run("m", None) as run:
        run.version = 2
        raise RuntimeError("the local runtime failed")
    assert counted.rows == [("m", 2, "RuntimeError")]


def test_a_refusal_before_any_run_counts_under_the_named_version_else_the_serving_one() -> None:
    counted = Counted()
    calls = calls_for(counted)
    for named in (1, 9, None):
        with pytest.raises(NotFound), calls.call("m") as call:
            call.named = named
            raise NotFound("refused")
    assert counted.rows == [("m", 1, "NotFound"), ("m", 2, "NotFound"), ("m", 2, "NotFound")]


def test_nothing_counts_for_an_unknown_model_a_model_nothing_serves_or_a_cloud_answer() -> None:
    counted = Counted()
    with pytest.raises(NotFound), calls_for(counted).call("other"):
        raise NotFound("unknown model 'other'")
    with pytest.raises(NotFound), calls_for(counted, serving=None).call("m"):
        raise NotFound("not ready")
    with calls_for(counted).call("m"):
        pass  # answered by the cloud: no version of ours ran it
    assert counted.rows == []


def test_a_pipelines_step_counts_by_itself_and_the_pipeline_once() -> None:
    counted = Counted()
    calls = calls_for(counted)
    with calls.call("m"), calls.run("m", None) as run:
        run.version = 2
        with calls.run("step", None) as step:
            step.version = 1
    assert counted.rows == [("step", 1, "success"), ("m", 2, "success")]


def test_a_hedges_losing_run_that_ends_after_the_call_counts_once_when_it_ends() -> None:
    counted = Counted()
    calls = calls_for(counted)

    async def scenario() -> None:
        started = asyncio.Event()

        async def local() -> None:
            with calls.run("m", None) as run:
                run.version = 2
                started.set()
                await asyncio.sleep(10)

        with calls.call("m"):
            loser = asyncio.ensure_future(local())
            await started.wait()
        assert counted.rows == []  # the call answered (the cloud won); its run is in flight
        loser.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loser

    asyncio.run(scenario())
    assert counted.rows == [("m", 2, "CancelledError")]


def test_edged_own_calls_count_nowhere() -> None:
    counted = Counted()
    calls = calls_for(counted)
    with own_calls(), calls.run("m", 2) as run:
        run.version = 2
    assert counted.rows == []

"""A/B tests that decide (edged/routing/abtest.py): the exact P(b better) against sampling,
and the stopping rule: never before min_calls per arm, the better arm found, equal arms left
undecided at max_calls (arm a stays), latency counted when a bound is set."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.common.abtest import MAX_PENDING, ABTest, Arm, p_b_better


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((50, 40), (50, 45)),
        ((100, 90), (100, 80)),
        ((3000, 2900), (2000, 1950)),
        ((7, 7), (3, 0)),
        ((0, 0), (0, 0)),
        ((400, 12), (380, 30)),
    ],
)
def test_p_b_better_is_what_sampling_the_posteriors_says(
    a: tuple[int, int], b: tuple[int, int]
) -> None:
    arm_a, arm_b = Arm(*a), Arm(*b)
    rng = np.random.default_rng(7)
    draws = 400_000
    sample_a = rng.beta(1 + arm_a.good, 1 + arm_a.calls - arm_a.good, draws)
    sample_b = rng.beta(1 + arm_b.good, 1 + arm_b.calls - arm_b.good, draws)
    assert p_b_better(arm_a, arm_b) == pytest.approx((sample_b > sample_a).mean(), abs=0.005)
    assert p_b_better(arm_a, arm_b) + p_b_better(arm_b, arm_a) == pytest.approx(1.0, abs=1e-9)


def run(test: ABTest, good: dict[str, float], seconds: dict[str, float], seed: int) -> int:
    """Calls split 50/50 until the test decides (or 20,000 calls): how many it took."""
    rng = random.Random(seed)
    for n in range(1, 20_001):
        arm = "b" if rng.random() < 0.5 else "a"
        if test.record(arm, rng.random() < good[arm], seconds[arm]) is not None:
            return n
    return -1


FAST = {"a": 0.01, "b": 0.01}


def test_a_worse_arm_b_is_stopped_and_a_better_one_promoted() -> None:
    worse = ABTest("m-b", min_calls=50)
    calls = run(worse, {"a": 0.99, "b": 0.80}, FAST, seed=1)
    assert worse.decided == "a" and 100 <= calls <= 400, (calls, worse.as_dict())
    assert min(worse.arms["a"].calls, worse.arms["b"].calls) >= 50
    assert worse.p_b <= 0.05
    better = ABTest("m-b", min_calls=50)
    calls = run(better, {"a": 0.80, "b": 0.99}, FAST, seed=2)
    assert better.decided == "b" and calls <= 400 and better.p_b >= 0.95
    assert better.summary().startswith("good calls: a ")


def test_equal_arms_end_undecided_at_max_calls_and_a_stays() -> None:
    test = ABTest("m-b", min_calls=50, max_calls=1000, confidence=0.999)
    calls = run(test, {"a": 0.95, "b": 0.95}, FAST, seed=3)
    assert test.decided == "none" and 1000 <= calls <= 1060, calls


def test_latency_counts_when_a_bound_is_set() -> None:
    slow = {"a": 0.01, "b": 0.3}
    test = ABTest("m-b", min_calls=30, latency_s=0.1)
    run(test, {"a": 1.0, "b": 1.0}, slow, seed=4)
    assert test.decided == "a" and test.arms["b"].good == 0
    unbounded = ABTest("m-b", min_calls=30, max_calls=200)
    run(unbounded, {"a": 1.0, "b": 1.0}, slow, seed=4)
    assert unbounded.decided == "none"  # both always answer: no difference without a bound


def test_a_decided_test_counts_no_more() -> None:
    test = ABTest("m-b", min_calls=5)
    run(test, {"a": 1.0, "b": 0.0}, FAST, seed=5)
    before = test.as_dict()
    assert test.record("b", True, 0.01) is None
    assert test.as_dict() == before and before["decided"] == "a"
    assert before["rule"] == {
        "min_calls": 5,
        "confidence": 0.95,
        "max_calls": 5000,
        "latency_s": None,
        "min_confidence": None,
        "min_score": None,
    }


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans()), max_size=300),
    st.integers(1, 40),
)
def test_never_decides_before_min_calls_of_each_arm(
    calls: list[tuple[str, bool]], min_calls: int
) -> None:
    test = ABTest("m-b", min_calls=min_calls, max_calls=10_000)
    for arm, ok in calls:
        if test.record(arm, ok, 0.0) is not None:
            assert min(test.arms["a"].calls, test.arms["b"].calls) >= min_calls
            assert test.decided in ("a", "b")
    assert test.arms["a"].calls + test.arms["b"].calls <= len(calls)  # "c" is no arm


def test_confidence_counts_when_a_floor_is_set_and_the_model_has_one() -> None:
    test = ABTest("m-b", min_calls=20, min_confidence=0.5)
    for _ in range(20):
        test.record("a", True, 0.01, confidence=0.9)
        test.record("b", True, 0.01, confidence=0.2)  # answered, but unsure
    assert test.decided == "a" and test.arms["b"].good == 0
    assert test.as_dict()["rule"]["min_confidence"] == 0.5
    blind = ABTest("m-b", min_calls=20, max_calls=40)
    for _ in range(20):
        blind.record("a", True, 0.01, confidence=0.9)
        blind.record("b", True, 0.01, confidence=0.2)
    assert blind.decided == "none"  # no floor: confidence is not counted
    no_output = ABTest("m-b", min_calls=20, max_calls=40, min_confidence=0.5)
    for _ in range(20):
        no_output.record("a", True, 0.01)
        no_output.record("b", True, 0.01)  # a model without a confidence output
    assert no_output.decided == "none" and no_output.arms["b"].good == 20


def test_scores_decide_what_waited_for_them_and_nothing_else() -> None:
    """With min_score: an answered call waits for its score (by request id), a failed one
    counts at once; a score for no waiting call, a second score, a late one, a call without an
    id and one pushed out by MAX_PENDING newer ones count nothing."""
    test = ABTest("m-b", min_calls=2, max_calls=100, min_score=0.6, score_wait_s=10.0)
    test.wait("r1", "a", "m", 0.0)
    test.wait("r2", "b", "m-b", 0.0)
    test.wait("r1", "a", "m", 0.0)  # the same id twice: neither can be told apart
    test.wait("", "b", "m-b", 0.0)  # no id: it cannot be scored
    assert test.count("b", False) is None  # a failed call: counted at once
    assert (test.arms["a"].calls, test.arms["b"].calls, test.unscored) == (0, 1, 2)
    assert test.scored("r2", 1.0) == ("b", "m-b")
    assert test.scored("r2", 1.0) is None  # scored already
    assert test.scored("nobody", 1.0) is None
    assert test.scored("r1", 10.5) is None  # too late: expired, not counted
    assert test.unscored == 3 and not test.pending
    test.wait("r3", "a", "m", 20.0)
    for i in range(MAX_PENDING):
        test.wait(f"x{i}", "b", "m-b", 20.0)
    assert len(test.pending) == MAX_PENDING and "r3" not in test.pending
    assert test.as_dict()["waiting_for_score"] == MAX_PENDING
    assert test.as_dict()["unscored"] == 4 and test.as_dict()["rule"]["min_score"] == 0.6

"""A/B tests of a cloud model that decide by themselves: which arm gives more good calls.

A call is *good* when the cloud answered it (no timeout, no 5xx, no broken connection: the
failures the breaker counts), within ``latency_s`` when one is set, and, when
``min_confidence`` is set and the model has a confidence output, at least that sure (the
quality signal: a classifier's best score, its least sure row). With ``min_score`` set, an
answered call that passes those waits for an operator's score of its answer (0 to 1, by its
request id, within ``score_wait_s``): at least ``min_score`` is good, less is bad; a call
never scored (no request id, not scored in time, or pushed out by ``MAX_PENDING`` newer ones)
is not counted (``unscored``), a call that failed counts at once. A call drawn for an arm
whose own circuit is open (edged.breaker.ArmBreakers: its version kept failing) goes to the
other arm and counts at once as a bad call of the drawn one (``refused``): the arm could not
take it, so a failing arm loses by the same rule instead of leaving the test short of calls
for ever. Each arm's share of good calls has a Beta posterior (a uniform prior, Beta(1, 1));
after every call the test computes P(b's share > a's) exactly (Miller's sum over Beta
functions, no sampling: the same counts give the same answer). The stopping rule, fixed
before the first call:

- no decision before each arm has ``min_calls`` calls; from then on the test looks again each
  time the calls in all have grown by 5% (at most about 90 looks up to ``max_calls``, each a
  sum of a few thousand terms at most);
- then b wins when P(b better) >= ``confidence``, a wins when P(b better) <= 1 - ``confidence``;
- after ``max_calls`` calls in all without either, the test ends undecided and arm a stays (b
  could not show it is better).

Checking after every call makes a false winner more likely than ``1 - confidence`` (the
peeking problem); ``min_calls`` bounds it, and the decision's record carries the counts so an
operator can judge it. A decision is final: the test stops counting, and a new split (the
operator's) starts a new test.

A test *decided by the fleet* (``decides`` false: the fleet service's A/B across nodes,
``cloudsync.fleet.abtests``) counts the same way and never decides here: each node's good and
bad calls per arm reach the fleet service in telemetry, which adds them up over the nodes and
applies ``verdict`` with its own rule.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_PENDING = 10_000  # answered calls of one test waiting for their score, at most


@dataclass
class Arm:
    calls: int = 0
    good: int = 0
    refused: int = 0  # of its bad calls, those its open circuit sent to the other arm

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "good": self.good, "refused": self.refused}


def _log_beta(x: float, y: float) -> float:
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


def _greater(a: Arm, b: Arm) -> float:
    """P(p_b > p_a), summing over b's good calls."""
    alpha_a, beta_a = 1 + a.good, 1 + a.calls - a.good
    alpha_b, beta_b = 1 + b.good, 1 + b.calls - b.good
    base = _log_beta(alpha_a, beta_a)
    return sum(
        math.exp(
            _log_beta(alpha_a + i, beta_a + beta_b)
            - math.log(beta_b + i)
            - _log_beta(1 + i, beta_b)
            - base
        )
        for i in range(alpha_b)
    )


def verdict(
    a: Arm, b: Arm, min_calls: int, confidence: float, max_calls: int
) -> tuple[str | None, float | None]:
    """The stopping rule on these counts: ("a" | "b" | "none" | None, P(b better)); the
    probability is None while an arm has fewer than ``min_calls`` calls."""
    if min(a.calls, b.calls) < min_calls:
        return None, None
    p = p_b_better(a, b)
    if p >= confidence:
        return "b", p
    if p <= 1 - confidence:
        return "a", p
    return ("none" if a.calls + b.calls >= max_calls else None), p


def p_b_better(a: Arm, b: Arm) -> float:
    """P(p_b > p_a) for p_x ~ Beta(1 + good, 1 + bad), exactly (the sum runs over the arm
    with fewer good calls: P(b > a) = 1 - P(a > b))."""
    p = _greater(a, b) if b.good <= a.good else 1 - _greater(b, a)
    return min(1.0, max(0.0, p))


@dataclass
class ABTest:
    """One model's test between its arms a and b (see the module's doc)."""

    b_name: str
    min_calls: int = 100
    confidence: float = 0.95
    max_calls: int = 5000
    latency_s: float | None = None
    min_confidence: float | None = None
    decides: bool = True  # False: the fleet decides (this node counts)
    min_score: float | None = None  # an operator's score, at least this: good (None: no scores)
    score_wait_s: float = 3600.0
    # request id -> (arm, the arm's cloud name, until when its score may come), oldest first
    pending: OrderedDict[str, tuple[str, str, float]] = field(default_factory=OrderedDict)
    unscored: int = 0
    arms: dict[str, Arm] = field(default_factory=lambda: {"a": Arm(), "b": Arm()})
    decided: str | None = None  # "a", "b", or "none" (undecided after max_calls)
    p_b: float = 0.5
    checked_at: int = 0  # calls in all at the last check

    def good(self, ok: bool, seconds: float, confidence: float | None = None) -> bool:
        """Whether a call counts as good: answered, in time, sure enough (``confidence``: its
        answer's, when the model has one)."""
        good = ok and (self.latency_s is None or seconds <= self.latency_s)
        if self.min_confidence is not None and confidence is not None:
            good = good and confidence >= self.min_confidence
        return good

    def record(
        self, arm: str, ok: bool, seconds: float, confidence: float | None = None
    ) -> str | None:
        """One call's outcome; the decision when this call made it, else None."""
        return self.count(arm, self.good(ok, seconds, confidence))

    def wait(self, request_id: str, arm: str, cloud_name: str, now: float) -> None:
        """An answered call that waits for its score (``now``: monotonic seconds)."""
        self.expire(now)
        if not request_id or request_id in self.pending or self.decided is not None:
            self.unscored += 1  # it could not be told from another
            return
        if len(self.pending) >= MAX_PENDING:
            self.pending.popitem(last=False)
            self.unscored += 1
        self.pending[request_id] = (arm, cloud_name, now + self.score_wait_s)

    def scored(self, request_id: str, now: float) -> tuple[str, str] | None:
        """The arm and cloud name of the call that waited for this score (None: no such call
        waits: never made, scored already, or too late)."""
        self.expire(now)
        found = self.pending.pop(request_id, None)
        return None if found is None else (found[0], found[1])

    def expire(self, now: float) -> None:
        while self.pending:
            first = next(iter(self.pending.values()))
            if first[2] >= now:
                return
            self.pending.popitem(last=False)
            self.unscored += 1

    def count(self, arm: str, good: bool, refused: bool = False) -> str | None:
        """One call judged ``good`` or not (``refused``: the arm's open circuit sent it to the
        other arm, a bad call); the decision when this call made it, else None."""
        if self.decided is not None or arm not in self.arms:
            return None
        self.arms[arm].calls += 1
        self.arms[arm].good += good and not refused
        self.arms[arm].refused += refused
        a, b = self.arms["a"], self.arms["b"]
        calls = a.calls + b.calls
        if not self.decides or calls < self.checked_at * 1.05:
            return None  # checked when 5% more calls came in: bounded work, fewer peeks
        decided, p_b = verdict(a, b, self.min_calls, self.confidence, self.max_calls)
        if p_b is None:
            return None
        self.checked_at, self.p_b, self.decided = calls, p_b, decided
        return decided

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.arms["a"].as_dict(),
            "b": self.arms["b"].as_dict(),
            "p_b_better": round(self.p_b, 4),
            "decided": self.decided,
            "decided_by": "edged" if self.decides else "fleet",
            "waiting_for_score": len(self.pending),
            "unscored": self.unscored,
            "rule": {
                "min_calls": self.min_calls,
                "confidence": self.confidence,
                "max_calls": self.max_calls,
                "latency_s": self.latency_s,
                "min_confidence": self.min_confidence,
                "min_score": self.min_score,
            },
        }

    def summary(self) -> str:
        """The evidence, in a line."""
        a, b = self.arms["a"], self.arms["b"]
        return (
            f"good calls: a {a.good} of {a.calls}, b {b.good} of {b.calls};"
            f" P(b better) = {self.p_b:.4f}"
        )

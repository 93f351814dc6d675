"""A learned routing policy: Thompson sampling over "meets the deadline", per context.

For each request that both tiers could serve, it draws how likely the request is to finish
within its deadline on the device; if that draw or the posterior's mean is ``good_enough``
(0.9) it runs there, with no cloud call (the cloud costs money and the data stays home).
Otherwise it draws the same for the cloud and sends it there only if the cloud is likely to
make it (at least even odds) and clearly likelier than the device (by ``cost_margin``). Each
likelihood is a Beta posterior over a context bucket: the model, the tier and the slack (the
deadline over the tier's latency estimate, in bands; the estimates already follow load and
RTT). Every outcome it sees (the tier that ran; both for hedged calls) updates its bucket.

- Informed start: a bucket it has never seen starts from the latency estimate (the chance that
  a latency with that mean and deviation is under the deadline), worth ``prior_weight`` outcomes.
- Forgetting: evidence fades with a half-life (``half_life_s``), so a bucket that once failed
  is tried again (Thompson sampling draws from a wider posterior), and a changed world is
  learned within a few dozen requests.
- Bounded exploration: draws come from the posteriors, so a tier that is clearly worse is
  rarely drawn, and a cloud call on a hunch (a lucky draw against a posterior under even odds)
  goes at most once per ``explore_every_s`` per model; a draw can never overrule privacy or
  availability, which ``decide`` settles before the learner is asked.
- State: ``to_json`` / ``from_json``, so it survives restarts.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from typing import Any

from edged.routing.decide import Decision, Path, RouteRequest, Tier

SLACK_BANDS = (0.7, 1.0, 1.4, 2.0)  # deadline / estimate
Key = tuple[str, str, int]  # model, tier, slack band


def slack_band(deadline: float, predicted: float | None) -> int:
    if predicted is None or predicted <= 0:
        return len(SLACK_BANDS) + 1  # unmeasured
    ratio = deadline / predicted
    return sum(ratio > edge for edge in SLACK_BANDS)


def chance_within(deadline: float, path: Path) -> float:
    """P(latency <= deadline) on ``path`` as its estimate sees it: normal around the prediction
    (taken as mean + 1 deviation) with the learned deviation (x1.25: a mean absolute deviation
    as a standard deviation), at least 5% of the mean; 0.5 when nothing is measured."""
    if path.predicted_s is None:
        return 0.5
    deviation = path.deviation_s or 0.0
    mean = path.predicted_s - deviation
    sigma = max(1.25 * deviation, 0.05 * mean, 1e-4)
    return 0.5 * (1 + math.erf((deadline - mean) / sigma / math.sqrt(2)))


class Learner:
    def __init__(
        self,
        good_enough: float = 0.9,
        cost_margin: float = 0.1,
        half_life_s: float = 30.0,
        prior_weight: float = 10.0,
        explore_every_s: float = 10.0,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.good_enough = good_enough
        self.cost_margin = cost_margin
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self.explore_every_s = explore_every_s
        self.explored: dict[str, float] = {}  # model: when a cloud call last went on a hunch
        self.random = random.Random(seed)
        self.clock = clock
        self.table: dict[Key, list[float]] = {}  # successes, failures, when last updated

    def key(self, request: RouteRequest, tier: Tier, path: Path, deadline: float) -> Key:
        """The estimates already follow load and RTT: the bucket is how they stand against the
        deadline."""
        return (request.model, tier, slack_band(deadline, path.predicted_s))

    def posterior(self, key: Key, deadline: float, path: Path) -> tuple[float, float]:
        """Beta(alpha, beta): the informed prior plus the faded evidence."""
        p0 = chance_within(deadline, path)
        alpha = 1 + self.prior_weight * p0
        beta = 1 + self.prior_weight * (1 - p0)
        found = self.table.get(key)
        if found is not None:
            fade = 0.5 ** ((self.clock() - found[2]) / self.half_life_s)
            alpha += found[0] * fade
            beta += found[1] * fade
        return alpha, beta

    def choose(
        self, request: RouteRequest, local: Path, cloud: Path, deadline: float
    ) -> tuple[Tier, str]:
        """local or cloud for a request both can serve, and why."""

        def draw(tier: Tier, path: Path) -> tuple[float, float]:
            """A Thompson draw and the posterior mean."""
            key = self.key(request, tier, path, deadline)
            alpha, beta = self.posterior(key, deadline, path)
            return self.random.betavariate(alpha, beta), alpha / (alpha + beta)

        mine, expected = draw("local", local)
        if max(mine, expected) >= self.good_enough:  # very likely in time: no cloud call
            return "local", f"learned: P(in time) drawn local {mine:.2f}, good enough"
        theirs, believed = draw("cloud", cloud)
        # a cloud call must be likely to help, and clearly likelier than the device
        if not (theirs >= 0.5 and theirs > mine + self.cost_margin):
            return "local", f"learned: P(in time) drawn local {mine:.2f}, cloud {theirs:.2f}"
        why = f"learned: P(in time) drawn local {mine:.2f}, cloud {theirs:.2f}"
        if believed < 0.5:  # a hunch against the evidence: exploration, at a bounded rate
            now = self.clock()
            if now - self.explored.get(request.model, -math.inf) < self.explore_every_s:
                return "local", why + " (exploration spent)"
            self.explored[request.model] = now
            why += " (exploring)"
        return "cloud", why

    def refine(
        self, decision: Decision, request: RouteRequest, local: Path, cloud: Path
    ) -> Decision:
        """``decide()``'s decision, with the learner choosing where the cost model chose (the
        hard constraints, the caller and the rules stand as they are)."""
        if decision.basis != "estimate":
            return decision
        tier, reason = self.choose(request, local, cloud, decision.deadline_s)
        other: Tier = "cloud" if tier == "local" else "local"
        return dataclasses.replace(
            decision,
            route=tier,
            reason=reason,
            basis="learned",
            fallback=other,
            predicted_s=local.predicted_s if tier == "local" else cloud.predicted_s,
            trace=(*decision.trace[:-1], f"-> {tier}: {reason}"),
        )

    def learn(
        self, request: RouteRequest, tier: Tier, path: Path, deadline: float, in_time: bool
    ) -> None:
        """What happened on ``tier`` (as it was predicted when the choice was made)."""
        key = self.key(request, tier, path, deadline)
        now = self.clock()
        found = self.table.get(key)
        if found is None:
            self.table[key] = [float(in_time), float(not in_time), now]
            return
        fade = 0.5 ** ((now - found[2]) / self.half_life_s)
        found[0] = found[0] * fade + in_time
        found[1] = found[1] * fade + (not in_time)
        found[2] = now

    def to_json(self) -> dict[str, Any]:
        """The evidence, with ages instead of clock readings (the clock restarts)."""
        now = self.clock()
        return {"rows": [[*k, a, b, now - t] for k, (a, b, t) in self.table.items()]}

    def load_json(self, doc: dict[str, Any]) -> None:
        now = self.clock()
        self.table = {
            (str(m), str(t), int(s)): [float(a), float(f), now - float(age)]
            for m, t, s, a, f, age in doc.get("rows", [])
        }

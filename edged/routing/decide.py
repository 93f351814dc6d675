"""The path decision: a pure function over plain data, no I/O, no clock.

``decide(request, local, cloud, facts, policy)`` says where one request runs and why:

1. hard constraints: a private input never goes to the cloud; a tier that cannot serve the model
   now (not loaded, no cloud endpoint, link down, circuit open, model not in the cloud catalog)
   is never chosen; when no tier can serve, the route is ``none`` with both reasons;
2. the caller's override (``route`` parameter), within those constraints;
3. the operator's rules, in order: the first one whose ``task_type``/``model`` match and whose
   condition holds (or that has an ``otherwise``) decides ``local``, ``cloud`` or ``auto``; a
   rule is a preference, so when its tier is predicted to miss the deadline and the other tier
   fits, the other one runs;
4. the cost model (``auto``): predicted latency per path against the deadline and the local
   threshold (the brief's localThreshold with cloud fallback), a cost weight on cloud calls,
   and hedging when the local estimate comes within ``hedge_margin`` of the deadline.

Each decision names the other tier as ``fallback`` when it could serve, so the executor can
retry there if the chosen path fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from edged.routing.conditions import Condition, Facts

Action = Literal["local", "cloud", "auto"]
Route = Literal["local", "cloud", "hedged", "none"]
Tier = Literal["local", "cloud"]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows about one request."""

    model: str
    task_type: str | None = None
    private: bool = False
    deadline_s: float | None = None  # time left; None: the policy's default
    payload_bytes: int = 0
    override: Route | None = None  # the caller's ``route`` parameter: local, cloud or hedged


@dataclass(frozen=True, slots=True)
class Path:
    """One tier for one request: can it serve, and how fast it is expected to be."""

    available: bool
    why_not: str = ""  # when not available
    predicted_s: float | None = None  # None: not measured yet
    cost: float = 0.0  # per call, in the operator's unit (cloud)
    deviation_s: float | None = None  # how much the latency varies around the prediction


@dataclass(frozen=True, slots=True)
class Rule:
    """An operator rule (``[[routing.rules]]``)."""

    action: Action
    task_type: str | None = None  # None: any
    model: str | None = None  # None: any
    when: Condition | None = None  # None: always
    otherwise: Action | None = None  # the action when ``when`` does not hold (None: next rule)
    name: str = ""

    def applies_to(self, request: RouteRequest) -> bool:
        return (self.task_type is None or self.task_type == request.task_type) and (
            self.model is None or self.model == request.model
        )

    def label(self, index: int) -> str:
        return f"rule '{self.name}'" if self.name else f"rule {index + 1}"


@dataclass(frozen=True, slots=True)
class Policy:
    """The operator's routing settings."""

    rules: tuple[Rule, ...] = ()
    default_deadline_s: float = 0.5
    local_threshold_s: float = 0.1
    cloud_cost_weight_s: float = 0.0  # seconds of latency one unit of cloud cost is worth
    hedging: bool = True
    hedge_margin: float = 0.2  # hedge when local estimate > (1 - margin) * deadline


@dataclass(frozen=True, slots=True)
class Decision:
    route: Route
    reason: str
    fallback: Tier | None = None
    predicted_s: float | None = None  # of the chosen route
    predicted_local_s: float | None = None
    predicted_cloud_s: float | None = None
    deadline_s: float = 0.0
    basis: str = "estimate"  # what decided: private, unavailable, request, rule, estimate
    rule: str | None = None
    trace: tuple[str, ...] = field(default=())


def _ms(seconds: float | None) -> str:
    return "unmeasured" if seconds is None else f"{seconds * 1000:.1f} ms"


def decide(
    request: RouteRequest,
    local: Path,
    cloud: Path,
    facts: Facts | Mapping[str, float | None],
    policy: Policy,
) -> Decision:
    """Where ``request`` runs, and why. Pure: the same arguments give the same decision."""
    deadline = policy.default_deadline_s if request.deadline_s is None else request.deadline_s
    pl, pc = local.predicted_s, cloud.predicted_s
    trace: list[str] = []

    def done(route: Route, reason: str, basis: str, rule: str | None = None) -> Decision:
        fallback: Tier | None = None
        if route == "local" and cloud_ok:
            fallback = "cloud"
        elif route == "cloud" and local.available:
            fallback = "local"
        predicted = {"local": pl, "cloud": pc, "hedged": _min(pl, pc)}.get(route)
        trace.append(f"-> {route}: {reason}")
        return Decision(
            route, reason, fallback, predicted, pl, pc, deadline, basis, rule, tuple(trace)
        )

    # 1. hard constraints
    cloud_ok = cloud.available and not request.private
    why_cloud = "the input is private" if request.private else cloud.why_not
    if not cloud_ok:
        trace.append(f"cloud excluded: {why_cloud}")
    if not local.available:
        trace.append(f"local excluded: {local.why_not}")
        if not cloud_ok:
            why = f"no tier can serve: local {local.why_not}; cloud {why_cloud}"
            return done("none", why, "unavailable")
        return done("cloud", f"only the cloud can serve: local {local.why_not}", "unavailable")
    if not cloud_ok:
        basis = "private" if request.private else "unavailable"
        return done("local", f"cloud excluded: {why_cloud}", basis)

    # 2. the caller's choice
    if request.override is not None:
        return done(request.override, f"the request asked for {request.override}", "request")

    # 3. operator rules
    for index, rule in enumerate(policy.rules):
        if not rule.applies_to(request):
            continue
        label = rule.label(index)
        holds = rule.when is None or rule.when.holds(facts)
        action = rule.action if holds else rule.otherwise
        condition = rule.when.text if rule.when is not None else "always"
        trace.append(f"{label}: '{condition}' is {'true' if holds else 'false'}")
        if action is None:
            continue
        if action != "auto":
            verb = "holds" if holds else "does not hold"
            why = f"{label}: '{condition}' {verb} -> {action}"
            mine, other = (pl, pc) if action == "local" else (pc, pl)
            if mine is not None and mine > deadline and (other is None or other <= deadline):
                # a rule states a preference; the deadline is the caller's requirement
                switch: Tier = "cloud" if action == "local" else "local"
                why += (
                    f", but its estimate {_ms(mine)} is over the deadline {_ms(deadline)}"
                    f" and {switch} may fit ({_ms(other)})"
                )
                return done(switch, why, "rule", label)
            return done(action, why, "rule", label)
        break  # auto: the cost model decides

    # 4. the cost model
    if pl is None:
        return done("local", "no local estimate yet: the device goes first", "estimate")
    if pl <= policy.local_threshold_s and pl <= deadline:
        return done(
            "local",
            f"local estimate {_ms(pl)} within the local threshold {_ms(policy.local_threshold_s)}",
            "estimate",
        )
    if pc is None:  # the limits that local is over, each named
        over = []
        if pl > policy.local_threshold_s:
            over.append(f"the local threshold {_ms(policy.local_threshold_s)}")
        if pl > deadline:
            over.append(f"the deadline {_ms(deadline)}")
        return done(
            "cloud",
            f"local estimate {_ms(pl)} over {' and '.join(over)}; cloud not measured yet",
            "estimate",
        )
    if policy.hedging and (1 - policy.hedge_margin) * deadline < pl <= deadline and pc <= deadline:
        return done(
            "hedged",
            f"local estimate {_ms(pl)} close to the deadline {_ms(deadline)}, cloud {_ms(pc)}:"
            " both run, the first answer wins",
            "estimate",
        )
    cloud_score = pc + policy.cloud_cost_weight_s * cloud.cost
    local_fits, cloud_fits = pl <= deadline, pc <= deadline
    if local_fits != cloud_fits:
        winner: Tier = "local" if local_fits else "cloud"
        return done(
            winner,
            f"only {winner} fits the deadline {_ms(deadline)} (local {_ms(pl)}, cloud {_ms(pc)})",
            "estimate",
        )
    winner = "local" if pl <= cloud_score else "cloud"
    fits = "both fit" if local_fits else "neither fits"
    cost = f" + cost {cloud_score - pc:.3f} s" if cloud_score != pc else ""
    return done(
        winner,
        f"{winner} is faster: local {_ms(pl)}, cloud {_ms(pc)}{cost}"
        f" ({fits} the deadline {_ms(deadline)})",
        "estimate",
    )


def _min(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)

"""The path decision (pure): conditions, estimates and ``decide()``."""

from edged.routing.conditions import Condition, parse
from edged.routing.decide import Decision, Path, Policy, RouteRequest, Rule, decide
from edged.routing.estimates import Estimates

__all__ = [
    "Condition",
    "Decision",
    "Estimates",
    "Path",
    "Policy",
    "RouteRequest",
    "Rule",
    "decide",
    "parse",
]

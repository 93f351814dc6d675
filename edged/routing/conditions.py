"""Conditions of routing rules: ``local_load < 80%``, ``rtt > 150ms and payload >= 1MB``.

A small grammar, parsed once when the config is read (never ``eval``): comparisons
``<variable> <op> <number>[unit]`` joined by ``and`` / ``or`` (``and`` binds tighter). A variable
whose value is unknown at decision time (no GPU, no battery, no link measured) makes its
comparison false, so a rule never fires on a guess.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# variable -> (what it measures, the unit values are kept in, the units one may write)
VARIABLES: dict[str, tuple[str, dict[str, float]]] = {
    "local_load": ("the busier of CPU and GPU, percent", {"%": 1.0}),
    "cpu": ("CPU utilisation, percent", {"%": 1.0}),
    "gpu": ("GPU utilisation, percent", {"%": 1.0}),
    "memory": ("memory used, percent", {"%": 1.0}),
    "temperature": ("hottest thermal zone, degrees Celsius", {"c": 1.0}),
    "battery": ("battery charge, percent", {"%": 1.0}),
    "rtt": ("round trip to the cloud, milliseconds", {"ms": 1.0, "s": 1000.0}),
    "deadline": ("time the request has left, milliseconds", {"ms": 1.0, "s": 1000.0}),
    "payload": (
        "request size, bytes",
        {"b": 1.0, "kb": 1e3, "mb": 1e6, "kib": 1024.0, "mib": 1024.0**2},
    ),
    "queue": ("requests waiting for the model on the device", {}),
}
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
    "!=": operator.ne,
}
_COMPARISON = re.compile(
    r"^\s*([a-z_]+)\s*(<=|>=|==|!=|<|>)\s*(-?\d+(?:\.\d+)?)\s*([a-z%]*)\s*$", re.IGNORECASE
)

Facts = Mapping[str, float | None]


@dataclass(frozen=True)
class Comparison:
    variable: str
    op: str
    value: float  # in the variable's base unit

    def holds(self, facts: Facts) -> bool:
        seen = facts.get(self.variable)
        return seen is not None and OPERATORS[self.op](seen, self.value)


@dataclass(frozen=True)
class Condition:
    """OR of ANDs of comparisons, with the text it came from."""

    text: str
    any_of: tuple[tuple[Comparison, ...], ...]

    def holds(self, facts: Facts) -> bool:
        return any(all(c.holds(facts) for c in group) for group in self.any_of)

    def variables(self) -> set[str]:
        return {c.variable for group in self.any_of for c in group}


def _comparison(text: str) -> Comparison:
    match = _COMPARISON.match(text)
    if match is None:
        raise ValueError(
            f"cannot read '{text.strip()}': write <variable> <op> <number>[unit],"
            " e.g. 'local_load < 80%'"
        )
    variable, op, number, unit = match.groups()
    variable, unit = variable.lower(), unit.lower()
    if variable not in VARIABLES:
        raise ValueError(f"unknown variable '{variable}'; known: {', '.join(VARIABLES)}")
    units = VARIABLES[variable][1]
    if unit and unit not in units:
        allowed = ", ".join(units) or "none"
        raise ValueError(f"'{variable}' takes the units {allowed}, not '{unit}'")
    return Comparison(variable, op, float(number) * units.get(unit, 1.0))


def parse(text: str) -> Condition:
    """Parse a condition; ValueError says what is wrong with it."""
    if not text.strip():
        raise ValueError("the condition is empty")
    groups = []
    for alternative in re.split(r"\s+or\s+", text.strip(), flags=re.IGNORECASE):
        parts = re.split(r"\s+and\s+", alternative, flags=re.IGNORECASE)
        groups.append(tuple(_comparison(p) for p in parts))
    return Condition(text.strip(), tuple(groups))

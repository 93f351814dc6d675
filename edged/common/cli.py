"""What the command-line tools (edgectl, edgefleet) share: the usage error and ``name=value``
arguments."""

from __future__ import annotations

import json
from typing import Any


class UsageError(Exception):
    """The command line cannot be carried out as given (exit code 2)."""


def key_values(items: list[str]) -> dict[str, Any]:
    """``name=value`` arguments as a mapping: JSON values (50, true, null, [...]) as such, any
    other value as text."""
    out: dict[str, Any] = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not name or not equals:
            raise UsageError(f"'{item}' is not name=value")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out

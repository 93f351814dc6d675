"""Node labels: what a node says of itself in its birth (``[node] labels`` in cloudsync.toml)
and what operators add through the fleet service; deployments select nodes by them.

A label's key and value are 1 to 63 letters, digits, ``.``, ``_``, ``/`` or ``-`` (Kubernetes'
label syntax, without its prefix rules); a node has at most 32. A selector is a set of labels a
node must all carry, with the same values (an empty selector selects every node).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

LABEL = re.compile(r"^[A-Za-z0-9._/-]{1,63}\Z")
MAX_LABELS = 32


class LabelError(ValueError):
    """Labels that are not of the contract; the message names the label."""


def check_labels(value: Any, what: str = "labels") -> dict[str, str]:
    """``value`` as labels, or LabelError naming the first bad one."""
    if not isinstance(value, Mapping):
        raise LabelError(f"{what}: an object of label: value")
    if len(value) > MAX_LABELS:
        raise LabelError(f"{what}: {len(value)} labels, at most {MAX_LABELS}")
    for key, val in value.items():
        if not isinstance(key, str) or not LABEL.match(key):
            raise LabelError(f"{what}: key {key!r}: 1 to 63 of letters, digits, . _ / -")
        if not isinstance(val, str) or not LABEL.match(val):
            raise LabelError(f"{what}.{key}: value {val!r}: 1 to 63 of letters, digits, . _ / -")
    return dict(value)


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` carries every label of ``selector``."""
    return all(labels.get(key) == value for key, value in selector.items())

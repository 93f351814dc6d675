"""A rollout's judgement, pure: which nodes a stage takes, and whether the canary's figures
fail a gate against the other nodes' (the fleet service's rollouts, cloudsync.fleet.rollouts,
compute the figures in SQL; the console shows them).

The gates, as differences from the nodes not in the stage (the baseline):

- failure rate (errors, timeouts, refused inputs) above the baseline's by ``max_failure``;
- p95 latency above the baseline's by the factor ``1 + max_p95_increase``;
- fallback rate (local calls that the cloud had to finish) above the baseline's by
  ``max_fallback``;
- mean confidence (a classifier's best score, edged's ``edged_inference_confidence``) below the
  baseline's by ``max_confidence_drop``: the new version is less sure of the same traffic;

each only once the canary nodes served ``min_requests`` calls.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


def pick(nodes: list[str], rollout_id: str, share: float) -> list[str]:
    """The nodes of a stage: the first ``round(share * n)`` (at least 1) in the order of
    ``sha256(rollout id / node)``: a stable choice, different for each rollout, so that no node
    is always the canary, and a later stage only adds nodes."""
    ranked = sorted(nodes, key=lambda n: hashlib.sha256(f"{rollout_id}/{n}".encode()).digest())
    return ranked[: max(1, round(share * len(nodes)))]


@dataclass
class Gates:
    max_failure: float = 0.05
    max_p95_increase: float = 1.0
    max_fallback: float = 0.1
    min_requests: int = 20
    max_confidence_drop: float = 0.1


def breached(gates: Gates, canary: dict[str, Any], baseline: dict[str, Any]) -> str:
    """Why the canary's figures fail a gate ("" when they do not, or are too few yet)."""
    if canary["requests"] < gates.min_requests:
        return ""
    if canary["failure_rate"] > baseline["failure_rate"] + gates.max_failure:
        return (
            f"failure rate {canary['failure_rate']:.1%} against {baseline['failure_rate']:.1%}"
            f" on the other nodes (more than {gates.max_failure:.1%} worse)"
        )
    slow, usual = canary["p95_ms"], baseline["p95_ms"]
    if slow and usual and slow > usual * (1 + gates.max_p95_increase):
        return f"p95 {slow:.1f} ms against {usual:.1f} ms on the other nodes"
    sure, usually = canary["confidence"], baseline["confidence"]
    if sure is not None and usually is not None and sure < usually - gates.max_confidence_drop:
        return f"mean confidence {sure:.3f} against {usually:.3f} on the other nodes"
    if canary["fallback_rate"] > baseline["fallback_rate"] + gates.max_fallback:
        return (
            f"fallback rate {canary['fallback_rate']:.1%} against {baseline['fallback_rate']:.1%}"
        )
    return ""

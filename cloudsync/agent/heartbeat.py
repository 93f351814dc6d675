"""The heartbeat: every ``heartbeat.interval_s`` while connected (and right after each birth),
what the node is doing: edged's load, link, breaker, routes, models serving and ledger head
(from the agent's state), the outbox's figures, the uplink ledger's head, poison messages and
thread restarts. At a fixed rate, not drifting with the MQTT loop's turns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cloudsync.agent.outbox import Outbox
from cloudsync.agent.state import AgentState
from cloudsync.protocol.envelope import Envelope, printable
from edged.common.egress import Ledger


class Heartbeat:
    def __init__(
        self,
        state: AgentState,
        outbox: Outbox,
        ledger: Ledger,
        interval_s: float,
        envelope: Callable[[dict[str, Any]], Envelope],
    ) -> None:
        self.state, self.outbox, self.ledger = state, outbox, ledger
        self.interval_s, self.envelope = interval_s, envelope
        self.next_at = 0.0  # time.monotonic() of the next one
        self.sent = 0

    def soon(self, now: float) -> None:
        """The next one at ``now`` (right after a birth)."""
        self.next_at = now

    def due(self, now: float) -> bytes | None:
        """The heartbeat to publish now, or None before its time."""
        if now < self.next_at:
            return None
        # at a fixed rate (no drift from the loop's turns), unless it fell behind
        self.next_at = max(self.next_at + self.interval_s, now + self.interval_s / 2)
        self.sent += 1
        try:
            return self.envelope(self.body()).encode()
        except ValueError as exc:  # what edged said cannot be sent (NaN, too large)
            body = {"outbox": self.outbox.stats(), "error": printable(str(exc))}
            return self.envelope(body).encode()

    def body(self) -> dict[str, Any]:
        edged = self.state.edged
        status = edged.status or {}
        cloud = status.get("cloud") or {}
        return {
            "uptime_s": status.get("uptime_s"),
            "load": status.get("load"),
            "link": cloud.get("link"),
            "breaker": cloud.get("breaker"),
            "cloud_error_ratio": cloud.get("error_rate"),
            "cloud_scale_out": (cloud.get("scale_out") or {}).get("needed"),
            "inflight": status.get("inflight"),
            "drained": status.get("drained"),
            "routing": edged.routes,
            "models": {
                str(m.get("name")): m.get("version")
                for m in status.get("models", [])
                if m.get("state") == "READY"
            },
            "edged": edged.reachability(),
            "outbox": {**self.outbox.stats(), "oldest_age_s": self.outbox.oldest_age_s()},
            "poison_messages": self.state.poison,
            "thread_restarts": dict(self.state.restarts),
            # the egress ledgers' heads: checkpoints the fleet keeps (a device cannot rewrite
            # its ledger past them unseen)
            "egress": {
                "edged": (status.get("egress") or {}).get("head"),
                "uplink": self.ledger.head.as_dict() if self.ledger.enabled else None,
            },
        }

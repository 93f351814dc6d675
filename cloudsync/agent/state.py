"""What the agent's parts share: a small state that one part writes and the others read (the
heartbeat, the status, the metrics and the alerts), so that no part is handed the whole agent.
Each field has one writer, named beside it; an attribute assignment is atomic, so a reader sees
the old value or the new one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EdgedView:
    """What the agent last heard from edged (the edged reader replaces the whole view)."""

    status: dict[str, Any] | None = None
    capabilities: list[dict[str, Any]] = field(default_factory=list)
    error: str = "not asked yet"
    at_ms: int = 0
    routes: dict[str, int] = field(default_factory=dict)  # decisions since edged started

    def reachability(self) -> dict[str, Any]:
        return {"reachable": self.status is not None, "error": self.error}


@dataclass
class AgentState:
    edged: EdgedView = field(default_factory=EdgedView)  # the edged reader's
    connected: bool = False  # the MQTT thread's
    offline_since: float | None = None  # the MQTT thread's: monotonic, None while connected
    poison: int = 0  # the MQTT and commands threads': messages whose handling failed (a bug)
    restarts: dict[str, int] = field(default_factory=dict)  # the supervisor's: thread -> times
    rollbacks: dict[str, float] = field(default_factory=dict)  # the delivery thread's: model ->
    # time.time() of its last rollback, kept across restarts (ModelRolledBack)

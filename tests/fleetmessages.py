"""Messages as nodes send them to the fleet service (the registry's ``Message``: topic kind,
node, payload, arrival time), for the fleet's unit tests: a status, a heartbeat with every
figure, an event or an alert, any record."""

from __future__ import annotations

from typing import Any

from cloudsync.fleet.registry import Message
from cloudsync.protocol.envelope import Envelope

NOW = 1_800_000_000_000


def msg(
    kind: str,
    node: str,
    body: dict[str, Any],
    ts: int = NOW,
    ident: str = "",
    priority: str = "event",
    arrived: int = 0,
) -> Message:
    extra = {"priority": priority, "epoch": "e1"} if kind in ("events", "telemetry") else {}
    env = Envelope(node, 1, body, ts=ts, extra=extra, **({"id": ident} if ident else {}))
    return Message(kind, node, env.encode(), arrived or ts + 10)


def heartbeat(node: str, ts: int = NOW, cpu: float = 93.0) -> Message:
    return msg(
        "heartbeat",
        node,
        {
            "load": {
                "cpu_percent": cpu,
                "gpu_percent": 12.0,
                "memory_total": 8 << 30,
                "memory_available": 2 << 30,
                "temperature_c": 51.5,
                "throttled": False,
                "power_mode": "15W",
                "cpu_count": "four",
            },  # a wrong type: absent, no harm
            "link": {
                "up": True,
                "rtt_s": 0.042,
                "rtt_p50_s": 0.04,
                "rtt_p95_s": 0.09,
                "bandwidth_bps": 1.5e6,
            },
            "breaker": "open",
            "cloud_error_ratio": 0.25,
            "cloud_scale_out": True,
            "inflight": 3,
            "models": {"intent-classifier": "2"},
            "edged": {"reachable": True, "error": ""},
            "outbox": {
                "depth": {"alert": 0, "event": 1, "telemetry": 4},
                "pending": 5,
                "bytes": 900,
                "budget_bytes": 1 << 20,
                "dead_letters": 2,
                "disk_full": False,
                "counters": {"put": 10, "acked": 5},
                "oldest_age_s": 12.5,
            },
        },
        ts,
    )


def status(node: str, state: str = "online", ts: int = NOW) -> Message:
    body = {
        "state": state,
        "labels": {"site": "berlin", "hw.kind": "orin"},
        "software": {"cloudsync": "1.2", "edged": "1.3"},
    }
    return msg("status", node, body, ts - 1000)


def alert(state: str, at_ms: int, **labels: str) -> dict[str, Any]:
    return {
        "alert": "EdgedLocalLoadHigh",
        "state": state,
        "severity": "warning",
        "labels": labels,
        "value": 0.95,
        "summary": "Local load above 90% for 5m",
        "description": "busy",
        "active_since_ms": NOW - 300_000,
        "at_ms": at_ms,
    }

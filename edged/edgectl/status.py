"""``edgectl status`` and ``edgectl capabilities``: whether edged is ready, its load and cloud
link, every model's state; the task types and the tiers that serve them."""

from __future__ import annotations

import argparse
from typing import Any

from edged.client import Client
from edged.edgectl.base import format_table


def cmd_status(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Readiness, load, the cloud tier and every model's state."""
    status = client.status()
    rows = [
        [m["name"], m.get("version", "-"), m["state"], m.get("reason", "")]
        for m in status["models"]
    ]
    text = (
        f"edged {status['version']} on {client.socket_path}: "
        f"{'ready' if status['ready'] else 'NOT READY'}, up {status['uptime_s']:.0f} s, "
        f"{status['inflight']} in flight\n"
        + (f"LOCAL TIER {status['drained'].upper()}\n" if status.get("drained") else "")
        + f"{_load_line(status.get('load') or {})}"
        + _cloud_lines(status)
        + format_table(rows, ["MODEL", "VERSION", "STATE", "REASON"])
    )
    return status, text


def _load_line(load: dict[str, Any]) -> str:
    """One line of device load: the figures the providers could tell."""
    parts = []
    for key, label, unit in (
        ("cpu_percent", "cpu", "%"),
        ("memory_used_percent", "memory", "%"),
        ("gpu_percent", "gpu", "%"),
        ("temperature_c", "temp", " C"),
        ("power_w", "power", " W"),
    ):
        if load.get(key) is not None:
            parts.append(f"{label} {load[key]:.1f}{unit}")
    if load.get("throttled"):
        parts.append("THROTTLED")
    return f"load: {', '.join(parts)}\n" if parts else ""


def _cloud_lines(status: dict[str, Any]) -> str:
    """A line on the cloud tier (link, RTT, circuit, catalog); one per tier when there are
    several (``[[cloud.tiers]]``), with its name and cost per call."""
    tiers = status.get("cloud_tiers") or []
    if len(tiers) > 1:
        return "".join(
            _cloud_line(t, f"cloud tier {t['name']} (cost {t['cost']:g})") for t in tiers
        )
    return _cloud_line(status.get("cloud"), "cloud")


def _cloud_line(cloud: dict[str, Any] | None, title: str) -> str:
    if not cloud:
        return f"{title}: none configured\n"
    link = cloud["link"]
    rtt = f", rtt {link['rtt_s'] * 1000:.1f} ms" if link.get("rtt_s") is not None else ""
    return (
        f"{title}: {cloud['url']} link {'up' if link['up'] else 'DOWN'}{rtt},"
        f" circuit {cloud['breaker']}, serves {', '.join(cloud['catalog']) or 'nothing'}\n"
    )


def cmd_capabilities(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """Task types and the tiers that serve their models, with measured latency."""
    found = client.capabilities()

    def tier(info: dict[str, Any] | None) -> str:
        if info is None:
            return "-"
        if not info["available"]:
            return f"no ({info['why_not']})"
        latency = info["latency_ms"]
        return "yes" + (f", {latency:.1f} ms over {info['calls']}" if latency is not None else "")

    rows = [
        [group["task_type"], m["model"], tier(m["local"]), tier(m["cloud"])]
        for group in found
        for m in group["models"]
    ]
    return found, format_table(rows, ["TASK TYPE", "MODEL", "LOCAL", "CLOUD"])

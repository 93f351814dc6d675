"""``edgectl top``: one device's load, cloud link, routes, queues and models in a terminal.

Pure functions from what edged answers (``GET /v1/status`` and ``GET /metrics``, parsed into a
``Scrape``) to a rich renderable, so that a frame can be drawn and checked without a terminal;
the loop that reads, draws and takes keys is ``edged.top_live``. Rates and latency percentiles
come from the difference between two reads; a frame without a previous read shows totals.
A figure that edged does not report is left out of the frame, never shown as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import (
    Console,
    ConsoleOptions,
    Group,
    JustifyMethod,
    RenderableType,
    RenderResult,
)
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from edged.common.stats import quantile

__all__ = ["Scrape", "render_frame", "render_unreachable"]

Labels = dict[str, str]
Key = tuple[str, ...]

BAR_WIDTH = 16
MAX_ROUTES = 8  # route x reason rows; the busiest first, the rest counted
ROUTE_STYLES = {
    "local": "green",
    "cloud": "cyan",
    "hedged": "magenta",
    "escalated": "yellow",
    "fallback": "yellow",
    "none": "red",
}
STATE_STYLES = {"READY": "green", "LOADING": "yellow", "UNLOADING": "yellow"}
# the caller got no answer and it was not its fault: the "errors" of the fleet's telemetry too
ERROR_OUTCOMES = ("error", "timeout", "unavailable")


@dataclass(frozen=True)
class Scrape:
    """One read of ``/metrics``: every sample by its name (``..._total``, ``..._bucket``)."""

    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Prometheus' text format; raises ValueError when it is not that."""
        samples: dict[str, list[tuple[Labels, float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):  # NaN: the exporter could not tell
                    samples.setdefault(sample.name, []).append(
                        (dict(sample.labels), float(sample.value))
                    )
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        """The first sample of ``name`` with these labels, or None when there is none."""
        for have, value in self.samples.get(name, ()):
            if all(have.get(k) == v for k, v in labels.items()):
                return value
        return None

    def sums(self, name: str, keys: tuple[str, ...]) -> dict[Key, float]:
        """Samples of ``name`` added up by the values of the ``keys`` labels."""
        out: dict[Key, float] = {}
        for labels, value in self.samples.get(name, ()):
            key = tuple(labels.get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + value
        return out

    def labelled(self, name: str) -> list[Labels]:
        """The label sets of ``name``'s samples (for info metrics, whose value is always 1)."""
        return [labels for labels, _ in self.samples.get(name, ())]


def increase(
    now: Mapping[Key, float], before: Mapping[Key, float] | None, series: int | None = None
) -> dict[Key, float]:
    """How much each counter grew since the previous read (None: no previous read, the totals).
    A counter that went down restarted, so its whole value is the increase (Prometheus' rule);
    with ``series``, keys that share their first ``series`` labels restart together (a
    histogram's buckets), so that the buckets stay cumulative."""
    if before is None:
        return dict(now)
    restarted = {key[:series] for key, value in now.items() if value < before.get(key, 0.0)}
    return {
        key: value if key[:series] in restarted else value - before.get(key, 0.0)
        for key, value in now.items()
    }


# ---- formatting ------------------------------------------------------------------------------


def load_style(percent: float) -> str:
    """Severity of a utilisation: red above 90 %, yellow above 70 %."""
    return "bold red" if percent > 90 else "yellow" if percent > 70 else "green"


def temperature_style(celsius: float) -> str:
    """Severity of the hottest zone: Jetson modules throttle from about 85-95 C."""
    return "bold red" if celsius > 85 else "yellow" if celsius > 70 else "green"


def _bar(percent: float) -> Text:
    filled = round(BAR_WIDTH * min(max(percent, 0.0), 100.0) / 100)
    style = load_style(percent)
    return Text.assemble(("█" * filled, style), ("░" * (BAR_WIDTH - filled), "dim"))


def _uptime(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit == "MiB" else f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _figure(status_value: Any, metric: float | None, scale: float = 1.0) -> float | None:
    """The status' figure, else the metric's (times ``scale``): both come from the same sample,
    and either may be missing on an older or a newer edged."""
    if isinstance(status_value, int | float) and not isinstance(status_value, bool):
        return float(status_value)
    return None if metric is None else metric * scale


# ---- panels ----------------------------------------------------------------------------------


def _header(status: Mapping[str, Any], host: str) -> Text:
    ready = status.get("ready")
    parts: list[Text | str] = [
        Text(f"edged {status.get('version', '?')}", style="bold"),
        f" on {host}" if host else "",
        f" · up {_uptime(status['uptime_s'])}" if "uptime_s" in status else "",
        " · ",
        Text("READY", style="bold green") if ready else Text("NOT READY", style="bold red"),
    ]
    if status.get("drained") is not None:
        parts += [" · ", Text(f"LOCAL TIER DRAINED ({status['drained']})", style="bold yellow")]
    if "inflight" in status:
        # the status request that fetched this frame is itself in flight: not the device's work
        parts.append(f" · {max(int(status['inflight']) - 1, 0)} in flight")
    return Text.assemble(*parts)


def _load_panel(load: Mapping[str, Any], scrape: Scrape) -> Panel:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    rows = (
        ("cpu", "cpu_percent", "edged_device_cpu_utilization_ratio"),
        ("gpu", "gpu_percent", "edged_device_gpu_utilization_ratio"),
        ("memory", "memory_used_percent", "edged_device_memory_used_ratio"),
    )
    for label, key, metric in rows:
        percent = _figure(load.get(key), scrape.value(metric), 100.0)
        if percent is None:
            continue
        detail = f"{percent:.1f}%"
        if key == "cpu_percent" and load.get("cpu_count"):
            detail += f" of {load['cpu_count']} CPUs"
        if key == "memory_used_percent" and load.get("memory_total"):
            detail += f" of {_bytes(load['memory_total'])}"
        grid.add_row(label, _bar(percent), Text(detail, style=load_style(percent)))
    routing = scrape.value("edged_local_load_ratio")
    if routing is not None:
        percent = routing * 100
        grid.add_row("routing", _bar(percent), Text(f"{percent:.1f}%", style=load_style(percent)))
    temperature = _figure(
        load.get("temperature_c"), scrape.value("edged_device_temperature_celsius")
    )
    if temperature is not None:
        grid.add_row(
            "temp", "", Text(f"{temperature:.1f} °C", style=temperature_style(temperature))
        )
    power = _figure(load.get("power_w"), scrape.value("edged_device_power_watts"))
    if power is not None:
        mode = f" ({load['power_mode']})" if load.get("power_mode") else ""
        grid.add_row("power", "", f"{power:.1f} W{mode}")
    if load.get("throttled") or scrape.value("edged_device_throttled"):
        grid.add_row("", "", Text("THROTTLED", style="bold red"))
    rss = scrape.value("process_resident_memory_bytes")
    if rss is not None:
        workers = scrape.value("edged_worker_resident_memory_bytes")
        extra = f" + workers {_bytes(workers)}" if workers else ""
        grid.add_row("edged rss", "", f"{_bytes(rss)}{extra}")
    body: RenderableType = grid if grid.row_count else Text("no load figures", style="dim")
    return Panel(body, title="Load", title_align="left")


def _link_panel(cloud: Mapping[str, Any] | None, scrape: Scrape) -> Panel:
    up_metric = scrape.value("edged_cloud_link_up")
    if cloud is None and up_metric is None:
        return Panel(Text("no cloud tier", style="dim"), title="Link", title_align="left")
    cloud = cloud or {}
    link = cloud.get("link") or {}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    if cloud.get("url"):
        grid.add_row("cloud", Text(str(cloud["url"]), overflow="ellipsis", no_wrap=True))
    up = link.get("up") if "up" in link else (None if up_metric is None else up_metric > 0)
    if up is not None:
        state = Text("up", style="bold green") if up else Text("DOWN", style="bold red")
        if not up and link.get("failures"):
            state.append(f" ({link['failures']} failures in a row)")
        grid.add_row("link", state)
    rtts = []
    for statistic, key in (("ewma", "rtt_s"), ("p50", "rtt_p50_s"), ("p95", "rtt_p95_s")):
        seconds = _figure(
            link.get(key), scrape.value("edged_cloud_link_rtt_seconds", statistic=statistic)
        )
        if seconds is not None:
            rtts.append(f"{statistic} {seconds * 1000:.1f}")
    if rtts:
        grid.add_row("rtt ms", ", ".join(rtts))
    breaker = cloud.get("breaker") or next(
        (
            labels.get("state")
            for labels, value in scrape.samples.get("edged_cloud_breaker_state", ())
            if value == 1
        ),
        None,
    )
    if breaker:
        style = {"closed": "green", "half_open": "yellow"}.get(breaker, "bold red")
        grid.add_row("breaker", Text(breaker, style=style))
    error_rate = _figure(cloud.get("error_rate"), scrape.value("edged_cloud_breaker_error_ratio"))
    if error_rate is not None:
        style = "bold red" if error_rate > 0.1 else "yellow" if error_rate > 0 else "green"
        grid.add_row("errors", Text(f"{error_rate * 100:.1f}%", style=style))
    bandwidth = _figure(
        link.get("bandwidth_bps"), scrape.value("edged_cloud_link_bandwidth_bytes_per_second")
    )
    if bandwidth is not None:
        grid.add_row("bandwidth", f"{_bytes(bandwidth)}/s")
    if up is False and link.get("last_error"):
        grid.add_row("last error", Text(str(link["last_error"]), style="red"))
    return Panel(grid, title="Link", title_align="left")


def _routes_panel(scrape: Scrape, previous: Scrape | None, interval: float | None) -> Panel:
    name, keys = "edged_route_decisions_total", ("route", "reason")
    totals = scrape.sums(name, keys)
    if not totals:
        return Panel(Text("no decisions yet", style="dim"), title="Routes", title_align="left")
    rates: dict[Key, float] = {}
    if previous is not None and interval:
        rates = {k: v / interval for k, v in increase(totals, previous.sums(name, keys)).items()}
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False, expand=True)
    table.add_column("ROUTE", no_wrap=True)
    table.add_column("REASON", overflow="ellipsis", no_wrap=True, ratio=1)
    table.add_column("/s", justify="right", no_wrap=True)
    table.add_column("TOTAL", justify="right", no_wrap=True)
    ordered = sorted(totals, key=lambda k: (-rates.get(k, 0.0), -totals[k], k))
    for key in ordered[:MAX_ROUTES]:
        route, reason = key
        table.add_row(
            Text(route, style=ROUTE_STYLES.get(route, "")),
            reason,
            _rate(rates.get(key)) if rates else "-",
            f"{totals[key]:.0f}",
        )
    if len(ordered) > MAX_ROUTES:
        table.add_row("", Text(f"... {len(ordered) - MAX_ROUTES} more", style="dim"), "", "")
    return Panel(table, title="Routes", title_align="left")


def _model_rows(status: Mapping[str, Any], scrape: Scrape) -> list[dict[str, Any]]:
    """The repository index rows, marked idle where edged says so; versions that only the
    ``edged_model_version_info`` metric knows are added."""
    rows = [dict(row) for row in status.get("models") or []]
    seen = {(row.get("name"), row.get("version")) for row in rows}
    idle = set()
    for labels in scrape.labelled("edged_model_version_info"):
        key = (labels.get("model"), labels.get("version"))
        if labels.get("idle") == "true":
            idle.add(key)
        if key not in seen:
            seen.add(key)
            rows.append({"name": key[0], "version": key[1], "state": labels.get("state", "?")})
    for row in rows:
        row["idle"] = bool(row.get("idle")) or (row.get("name"), row.get("version")) in idle
    return rows


def _models_panel(
    status: Mapping[str, Any],
    scrape: Scrape,
    previous: Scrape | None,
    interval: float | None,
    compact: bool = False,
) -> Panel:
    model = ("model", "version")
    depth = scrape.sums("edged_inference_queue_depth", model)
    requests_now = scrape.sums("edged_inference_requests_total", (*model, "outcome"))
    requests_before = (
        previous.sums("edged_inference_requests_total", (*model, "outcome")) if previous else None
    )
    requests = increase(requests_now, requests_before, series=2)
    buckets_name = "edged_inference_request_duration_seconds_bucket"
    buckets_now = scrape.sums(buckets_name, (*model, "le"))
    buckets_before = previous.sums(buckets_name, (*model, "le")) if previous else None
    buckets = increase(buckets_now, buckets_before, series=2)

    # compact: one space between columns, so that 80 columns show every figure
    table = Table(
        box=box.SIMPLE_HEAD,
        padding=(0, 0) if compact else (0, 1),
        pad_edge=False,
        show_edge=False,
        expand=True,
    )
    columns: list[tuple[str, JustifyMethod]] = [
        ("MODEL", "left"),
        ("VER", "right"),
        ("STATE", "left"),
        ("QUEUE", "right"),
        ("REQ/S", "right"),
        ("REQS", "right"),
        ("ERR%", "right"),
        ("P50ms", "right"),
        ("P95ms", "right"),
    ]
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True)
    table.add_column("REASON", overflow="ellipsis", no_wrap=True, ratio=1, style="dim")
    for row in _model_rows(status, scrape):
        name, version = str(row.get("name")), str(row.get("version", ""))
        state = str(row.get("state", "?"))
        state_text = Text(state, style=STATE_STYLES.get(state, "bold red"))
        if row["idle"]:
            state_text.append(" idle", style="dim")
        queued = depth.get((name, version))
        total = sum(v for k, v in requests_now.items() if k[:2] == (name, version))
        recent = {k[2]: v for k, v in requests.items() if k[:2] == (name, version)}
        count = sum(recent.values())
        failed = sum(recent.get(outcome, 0.0) for outcome in ERROR_OUTCOMES)
        error = None if count <= 0 else 100.0 * failed / count
        histogram = {
            float(k[2]): v for k, v in buckets.items() if k[:2] == (name, version) and k[2]
        }
        table.add_row(
            name,
            version or "-",
            state_text,
            Text("-" if queued is None else f"{queued:.0f}", style="yellow" if queued else ""),
            _rate(count / interval) if previous is not None and interval else "-",
            f"{total:.0f}",
            Text(
                "-" if error is None else f"{error:.1f}",
                style="" if not error else "bold red" if error > 5 else "yellow",
            ),
            _ms(quantile(0.5, histogram)),
            _ms(quantile(0.95, histogram)),
            str(row.get("reason") or ""),
        )
    return Panel(table, title="Models", title_align="left")


class _Frame:
    """Header, the Load, Link and Routes panels side by side as the width allows, then Models."""

    def __init__(self, header: Text, small: list[Panel], models: Callable[[bool], Panel]) -> None:
        self.header, self.small, self.models = header, small, models

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        per_row = 3 if width >= 150 else 2 if width >= 100 else 1
        yield self.header
        for start in range(0, len(self.small), per_row):
            panels = self.small[start : start + per_row]
            # panels side by side share the tallest one's height, so that their borders line up
            cell = options.update(width=width // len(panels), height=None)
            for panel in panels:
                panel.height = None
            height = max(len(console.render_lines(panel, cell)) for panel in panels)
            grid = Table.grid(expand=True)
            for panel in panels:
                panel.height = height
                grid.add_column(ratio=1)
            grid.add_row(*panels)
            yield grid
        yield self.models(width < 100)


def render_frame(
    status: Mapping[str, Any],
    scrape: Scrape,
    previous: Scrape | None = None,
    interval: float | None = None,
    host: str = "",
) -> RenderableType:
    """One frame from a status document and a scrape; with the scrape taken ``interval`` seconds
    before (``previous``), rates and latency percentiles over that interval, else totals and
    percentiles since edged started."""
    if previous is not None and not interval:
        previous = None
    return _Frame(
        _header(status, host),
        [
            _load_panel(status.get("load") or {}, scrape),
            _link_panel(status.get("cloud"), scrape),
            _routes_panel(scrape, previous, interval),
        ],
        lambda compact: _models_panel(status, scrape, previous, interval, compact),
    )


def render_unreachable(message: str, interval: float, host: str = "") -> RenderableType:
    """The frame while edged does not answer: what failed, and that the view keeps trying."""
    where = f" on {host}" if host else ""
    return Group(
        Text(f"edged{where}: not answering", style="bold red"),
        Panel(
            Text.assemble((message, "red"), f"\nretrying every {interval:g} s; q or Ctrl-C quits"),
            title="edged unreachable",
            title_align="left",
            border_style="red",
        ),
    )

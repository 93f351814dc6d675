"""edgectl top's frames, drawn without a terminal: from status documents shaped by edged's own
classes (LoadSnapshot, CloudEndpoint) and metrics text that edged's own registry renders."""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console, RenderableType

from edged.cloud import CloudEndpoint
from edged.common.errors import DeadlineExceeded, InvalidRequest
from edged.common.load import LoadSnapshot
from edged.config import CloudConfig
from edged.metrics import Metrics
from edged.top import Scrape, render_frame, render_unreachable

GIB = 1024**3


def status(load: LoadSnapshot | None = None, cloud: dict[str, Any] | None = None) -> dict[str, Any]:
    """A /v1/status document with the keys DataPlane.status() answers."""
    return {
        "name": "edged",
        "version": "0.1.0",
        "ready": True,
        "uptime_s": 3723.5,
        "epoch": "e1",
        "inflight": 3,  # the status request itself is one of them
        "drained": None,
        "load": (load or LoadSnapshot()).as_dict(),
        "cloud": cloud,
        "models": [
            {"name": "intent-classifier", "version": "1", "state": "READY", "reason": ""},
            {"name": "ocr", "version": "2", "state": "READY", "reason": ""},
            {"name": "vad", "state": "UNAVAILABLE", "reason": "missing step vad-silero"},
        ],
    }


def draw(frame: RenderableType, width: int = 160, color: bool = False) -> str:
    """The frame as a 160-column terminal shows it (ANSI codes kept with ``color``)."""
    console = Console(
        file=io.StringIO(),
        record=True,
        width=width,
        force_terminal=color,
        color_system="standard",
        no_color=not color,
    )
    console.print(frame)
    return console.export_text(styles=color)


def coloured(text: str, shown: str, colour: int) -> bool:
    """Whether ``shown`` is drawn in an ANSI colour (31 red, 32 green, 33 yellow), bold or not."""
    return re.search(rf"\x1b\[(?:\d+;)*{colour}m[^\x1b]*{re.escape(shown)}", text) is not None


def row(text: str, model: str) -> list[str]:
    """A model's row of the Models table, cell by cell."""
    for line in text.splitlines():
        cells = line.replace("│", " ").split()
        if cells[:1] == [model]:
            return cells
    raise AssertionError(f"no row for {model} in\n{text}")


def served(metrics: Metrics, model: str, version: int, seconds: list[float]) -> None:
    for s in seconds:
        metrics.finished(model, version, s, None)


def test_first_frame_shows_totals_and_every_model() -> None:
    metrics = Metrics()
    served(metrics, "intent-classifier", 1, [0.003] * 10)
    metrics.finished("intent-classifier", 1, 0.5, DeadlineExceeded("late"))
    metrics.finished("intent-classifier", 1, 0.001, InvalidRequest("bad input"))  # not an error
    metrics.queue_depth.labels("intent-classifier", "1").set(4)
    for _ in range(12):
        metrics.route("intent-classifier", "local", "estimate")
    scrape = Scrape.parse(metrics.render().decode())
    text = draw(render_frame(status(), scrape, host="jetson-7"))

    assert "edged 0.1.0 on jetson-7 · up 1h 02m · READY · 2 in flight" in text
    # MODEL VER STATE QUEUE REQ/S REQS ERR% P50ms P95ms: no rate without a previous read
    cells = row(text, "intent-classifier")
    assert cells[:7] == ["intent-classifier", "1", "READY", "4", "-", "12", "8.3"], cells
    assert 2.5 <= float(cells[7]) <= 5.0  # p50 in the 2.5-5 ms bucket
    assert row(text, "ocr")[:6] == ["ocr", "2", "READY", "-", "-", "0"]  # no queue: a pipeline
    assert row(text, "vad")[:3] == ["vad", "-", "UNAVAILABLE"]
    assert "missing step vad-silero" in text
    assert re.search(r"local\s+estimate\s+-\s+12", text), text


def test_rates_and_percentiles_come_from_the_last_interval() -> None:
    metrics = Metrics()
    served(metrics, "intent-classifier", 1, [2.0] * 50)  # slow, before the interval
    metrics.route("intent-classifier", "local", "estimate")
    before = Scrape.parse(metrics.render().decode())
    served(metrics, "intent-classifier", 1, [0.003] * 40)
    for route, reason in [("local", "estimate")] * 30 + [("cloud", "private")] * 10:
        metrics.route("intent-classifier", route, reason)
    now = Scrape.parse(metrics.render().decode())
    text = draw(render_frame(status(), now, before, 2.0))

    cells = row(text, "intent-classifier")
    assert cells[4:7] == ["20.0", "90", "0.0"], cells  # 40 requests in 2 s, of 90 in all
    assert float(cells[8]) <= 5.0  # p95 of the interval: the slow ones before it do not count
    assert re.search(r"local\s+estimate\s+15\.0\s+31", text), text
    assert re.search(r"cloud\s+private\s+5\.00\s+10", text), text
    assert row(text, "ocr")[4] == "0"  # no calls in the interval: a rate of 0, not "-"


def test_a_counter_that_went_down_means_edged_restarted() -> None:
    old, new = Metrics(), Metrics()
    served(old, "intent-classifier", 1, [2.0] * 100)
    served(new, "intent-classifier", 1, [0.003] * 6)
    before = Scrape.parse(old.render().decode())
    text = draw(render_frame(status(), Scrape.parse(new.render().decode()), before, 1.0))
    cells = row(text, "intent-classifier")
    assert cells[4:6] == ["6.00", "6"], cells  # not -94 per second
    assert float(cells[8]) <= 5.0  # the new run's buckets whole, not their difference


def test_high_load_is_red_and_low_load_green() -> None:
    load = LoadSnapshot(
        cpu_percent=95.0, cpu_count=6, memory_total=8 * GIB, memory_available=6 * GIB
    )
    text = draw(render_frame(status(load), Scrape()), color=True)
    assert coloured(text, "95.0% of 6 CPUs", 31), text
    assert coloured(text, "25.0% of 8.0 GiB", 32), text
    plain = draw(render_frame(status(load), Scrape()))
    assert "95.0% of 6 CPUs" in plain and "25.0% of 8.0 GiB" in plain


def test_figures_edged_does_not_report_are_left_out() -> None:
    load = LoadSnapshot(cpu_percent=12.0, memory_total=8 * GIB, memory_available=4 * GIB)
    metrics = Metrics()
    text = draw(render_frame(status(load), Scrape.parse(metrics.render().decode())))
    assert "cpu" in text and "memory" in text
    for absent in ("gpu", "temp", "power", "routing", "THROTTLED", "workers", "None", "nan"):
        assert absent not in text, absent
    assert "no cloud tier" in text and "no decisions yet" in text


def test_the_newer_metrics_are_shown_when_edged_exports_them() -> None:
    newer = "\n".join(
        [
            "edged_local_load_ratio 0.93",
            "edged_device_gpu_utilization_ratio 0.93",
            "edged_device_temperature_celsius 88.5",
            "edged_device_power_watts 14.2",
            "process_resident_memory_bytes 415236096",
            'edged_model_version_info{model="ocr",version="2",state="READY",idle="true"} 1.0',
            'edged_model_version_info{model="ocr",version="3",state="LOADING",idle="false"} 1.0',
            "",
        ]
    )
    scrape = Scrape.parse(newer)
    frame = render_frame(status(LoadSnapshot(cpu_percent=20.0)), scrape)
    text = draw(frame)
    assert re.search(r"gpu\s+█+░*\s+93\.0%", text) and re.search(r"routing\s+█+░*\s+93\.0%", text)
    assert "88.5 °C" in text and "14.2 W" in text and "396.0 MiB" in text
    assert row(text, "ocr")[:4] == ["ocr", "2", "READY", "idle"]
    assert row(text, "ocr")[4] != "idle" and ["ocr", "3", "LOADING"] in [
        line.replace("│", " ").split()[:3] for line in text.splitlines()
    ]
    assert coloured(draw(frame, color=True), "88.5 °C", 31)  # hot


def test_the_cloud_link_panel() -> None:
    assert "no cloud tier" in draw(render_frame(status(cloud=None), Scrape()))
    cloud = CloudEndpoint(CloudConfig(url="https://gw.example.com/api/v1")).state()
    cloud["link"].update(up=True, rtt_s=0.0421, rtt_p50_s=0.04, rtt_p95_s=0.088)
    cloud.update(breaker="open", error_rate=0.25)
    frame = render_frame(status(cloud=cloud), Scrape())
    text = draw(frame)
    assert "no cloud tier" not in text and "https://gw.example.com/api/v1" in text
    assert re.search(r"link\s+up", text) and "ewma 42.1, p50 40.0, p95 88.0" in text
    assert re.search(r"breaker\s+open", text) and re.search(r"errors\s+25\.0%", text)
    text = draw(frame, color=True)
    assert coloured(text, "open", 31) and coloured(text, "25.0%", 31)
    cloud["link"].update(up=False, failures=3, last_error="connection refused")
    text = draw(render_frame(status(cloud=cloud), Scrape()))
    assert "DOWN (3 failures in a row)" in text and "connection refused" in text


def test_a_drained_edged_says_why() -> None:
    doc = {**status(), "drained": "maintenance", "ready": True}
    assert "LOCAL TIER DRAINED (maintenance)" in draw(render_frame(doc, Scrape()))


def test_an_unreachable_edged_is_said_and_retried() -> None:
    text = draw(render_unreachable("cannot reach edged at /run/edged/edged.sock", 2.0, "box"))
    assert "cannot reach edged at /run/edged/edged.sock" in text and "retrying every 2 s" in text


def test_a_narrow_terminal_stacks_the_panels() -> None:
    text = draw(render_frame(status(), Scrape()), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.index("Load") < text.index("Link") < text.index("Routes") < text.index("Models")

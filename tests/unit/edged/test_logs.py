"""Structured logs: ECS JSON lines, the format chosen for the stream, and the bound request
context (across asyncio tasks, and through the real data plane and router)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.common import logs
from edged.config import ModelsConfig, OnnxRuntimeConfig, RoutingConfig
from edged.dataplane.plane import DataPlane
from edged.metrics import Metrics
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager
from edged.oip.tensors import InferRequest
from edged.pipelines.base import Pipeline
from edged.routing.router import Router
from edged.runtimes.base import Runtime, Tensors
from edged.runtimes.onnxruntime import OnnxRuntime
from tests.modelfiles import add_model

ROOT = Path(__file__).resolve().parents[3]
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
log = logging.getLogger("edged.test-logs")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The root logger sends JSON lines to a buffer for one test; restored afterwards."""
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    stream = io.StringIO()
    assert logs.setup_logging("debug", "json", "node-7", "edged", stream=stream) == "json"
    yield stream
    for handler in root.handlers[:]:
        if handler not in before[0]:
            root.removeHandler(handler)
    root.setLevel(before[1])


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every line as JSON (a line that is not JSON fails the test here)."""
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def by_message(stream: io.StringIO) -> dict[str, dict[str, Any]]:
    return {row["message"]: row for row in lines(stream)}


def ours(row: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields of a line, by their ECS names (absent ones left out)."""
    found = {
        "http.request.id": row.get("http", {}).get("request", {}).get("id"),
        **{f"edged.{k}": v for k, v in row.get("edged", {}).items()},
    }
    return {k: v for k, v in found.items() if v is not None}


# ---- JSON lines --------------------------------------------------------------------------


def test_json_lines_have_ecs_base_fields_and_the_bound_request(captured: io.StringIO) -> None:
    log.info("outside any request")
    with logs.bind(request_id="req-1", model="text-encoder"):
        log.info("served %s", "ünïcode")
        with logs.bind(route="cloud", reason="rule 'big' matched"):
            log.warning("routed")
        log.debug("after the route")
    rows = lines(captured)
    assert [r["message"] for r in rows] == [
        "outside any request",
        "served ünïcode",
        "routed",
        "after the route",
    ]
    for row in rows:
        assert TIMESTAMP.match(row["@timestamp"]), row["@timestamp"]
        assert row["host"]["name"] == "node-7" and row["service"]["name"] == "edged"
        assert row["log"]["logger"] == "edged.test-logs"
        assert row["ecs.version"]
        # our names never leak out under their Python spelling
        assert not {"model", "route", "request_id", "reason"} & set(row)
    assert [r["log.level"] for r in rows] == ["info", "info", "warning", "debug"]
    assert ours(rows[0]) == {}
    assert ours(rows[1]) == {"http.request.id": "req-1", "edged.model": "text-encoder"}
    assert ours(rows[2]) == {
        "http.request.id": "req-1",
        "edged.model": "text-encoder",
        "edged.route": "cloud",
        "edged.reason": "rule 'big' matched",
    }
    assert ours(rows[3]) == ours(rows[1])
    assert logs.bound() == {}


def test_extra_at_the_call_site_wins_over_the_bound_context(captured: io.StringIO) -> None:
    with logs.bind(request_id="req-2", model="bound-model"):
        log.info("explicit", extra={"model": "ocr-det", "route": "local"})
    log.error("no context", extra={"request_id": "req-3", "reason": "deadline"})
    rows = by_message(captured)
    assert ours(rows["explicit"]) == {
        "http.request.id": "req-2",
        "edged.model": "ocr-det",
        "edged.route": "local",
    }
    assert ours(rows["no context"]) == {"http.request.id": "req-3", "edged.reason": "deadline"}


def test_an_exception_is_an_ecs_error_on_one_line(captured: io.StringIO) -> None:
    table: dict[str, int] = {}
    try:
        table["missing"]
    except KeyError:
        log.exception("lookup failed")
    (row,) = lines(captured)
    assert row["log.level"] == "error" and row["message"] == "lookup failed"
    assert row["error"]["type"] == "KeyError" and "missing" in row["error"]["message"]
    assert "test_an_exception_is_an_ecs_error_on_one_line" in row["error"]["stack_trace"]


def test_unknown_fields_are_refused_and_none_unbinds() -> None:
    with pytest.raises(TypeError, match="unknown log field"):
        logs.set_fields(modle="typo")
    token = logs.set_fields(model="m", route="local")
    logs.set_fields(route=None)
    assert logs.bound() == {"model": "m"}
    logs.reset_fields(token)
    assert logs.bound() == {}


def test_text_keeps_todays_line_with_the_time_first() -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    stream = io.StringIO()
    try:
        assert logs.setup_logging("info", "text", "node-7", "edged", stream=stream) == "text"
        with logs.bind(request_id="req-4"):
            log.info("plain")
        log.debug("below the level")
    finally:
        for handler in root.handlers[:]:
            if handler not in before[0]:
                root.removeHandler(handler)
        root.setLevel(before[1])
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO edged.test-logs: plain\n", stream.getvalue()
    ), stream.getvalue()


def test_setting_up_twice_replaces_the_first_handler(captured: io.StringIO) -> None:
    other = io.StringIO()
    logs.setup_logging("info", "json", "node-8", "cloudsync", stream=other)
    log.info("once")
    assert captured.getvalue() == ""
    (row,) = lines(other)
    assert row["host"]["name"] == "node-8" and row["service"]["name"] == "cloudsync"


# ---- the format chosen -------------------------------------------------------------------


def journal_stream_of(path: Path) -> str:
    """$JOURNAL_STREAM as systemd sets it for a stream: "device:inode"."""
    found = os.stat(path)
    return f"{found.st_dev}:{found.st_ino}"


def test_auto_is_journal_when_journal_stream_names_stderr(tmp_path: Path) -> None:
    with (tmp_path / "stderr").open("w") as stream, (tmp_path / "other").open("w"):
        named = {"JOURNAL_STREAM": journal_stream_of(tmp_path / "stderr")}
        assert logs.under_journald(stream, named)
        assert logs.choose_format("auto", stream, named, journal_available=True) == "journal"
        # under journald without systemd-python: not a terminal, so JSON lines
        assert logs.choose_format("auto", stream, named, journal_available=False) == "json"
        # a child whose stderr was redirected inherits the variable, not the stream
        elsewhere = {"JOURNAL_STREAM": journal_stream_of(tmp_path / "other")}
        assert not logs.under_journald(stream, elsewhere)
        assert logs.choose_format("auto", stream, elsewhere, journal_available=True) == "json"
        for bad in ("", "12", "a:b", ":"):
            assert not logs.under_journald(stream, {"JOURNAL_STREAM": bad})
        assert logs.choose_format("auto", stream, {}, journal_available=True) == "json"
    assert not logs.under_journald(io.StringIO(), named)  # no descriptor at all


def test_auto_is_text_on_a_terminal_and_json_on_a_pipe(tmp_path: Path) -> None:
    leader, follower = os.openpty()
    reader, writer = os.pipe()
    with open(follower, "w") as terminal, open(writer, "w") as pipe:
        assert logs.choose_format("auto", terminal, {}, journal_available=True) == "text"
        assert logs.choose_format("auto", pipe, {}, journal_available=True) == "json"
        # asked for explicitly, a format is what it says, terminal or not
        assert logs.choose_format("json", terminal, {}) == "json"
        assert logs.choose_format("text", pipe, {}) == "text"
    os.close(leader)
    os.close(reader)
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        logs.choose_format("xml", io.StringIO(), {})


def test_journal_without_systemd_python_warns_once_and_writes_json() -> None:
    """In a child process where systemd-python cannot be imported (None in sys.modules is
    Python's own way of making an import fail), ``journal`` falls back to JSON lines on stderr
    with one warning, and the program goes on."""
    script = (
        "import sys, logging\n"
        "sys.modules['systemd.journal'] = None\n"
        "from edged.common import logs\n"
        "print(logs.setup_logging('info', 'journal', 'node-7', 'edged'))\n"
        "print(logs.setup_logging('info', 'journal', 'node-7', 'edged'))\n"
        "logging.getLogger('edged').info('still running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["json", "json"]
    rows = [json.loads(line) for line in done.stderr.splitlines()]
    assert [r["log.level"] for r in rows] == ["warning", "info"], done.stderr
    assert "systemd-python is not installed" in rows[0]["message"]
    assert rows[1]["message"] == "still running"


# ---- the context across asyncio tasks ----------------------------------------------------


def test_concurrent_tasks_keep_their_own_request_context(captured: io.StringIO) -> None:
    """Two requests interleave on one loop (each waits for the other to have bound its fields
    before logging); a task started inside a request inherits it and its own changes stay
    its own."""

    async def scenario() -> None:
        bound: set[str] = set()
        both_bound = asyncio.Event()  # (asyncio.Barrier is 3.11; JetPack 6 has 3.10)

        async def request(request_id: str, model: str) -> None:
            logs.set_fields(request_id=request_id, model=model)
            bound.add(request_id)
            if len(bound) == 2:
                both_bound.set()
            await both_bound.wait()
            log.info("working on %s", request_id)

            async def step() -> None:
                logs.set_fields(model=f"{model}-step", route="cloud")
                log.info("step of %s", request_id)

            await asyncio.create_task(step())
            log.info("done %s", request_id)

        await asyncio.gather(request("a", "model-a"), request("b", "model-b"))
        log.info("the loop's own")

    asyncio.run(scenario())
    rows = by_message(captured)
    for rid in ("a", "b"):
        mine = {"http.request.id": rid, "edged.model": f"model-{rid}"}
        assert ours(rows[f"working on {rid}"]) == mine
        assert ours(rows[f"step of {rid}"]) == {
            **mine,
            "edged.model": f"model-{rid}-step",
            "edged.route": "cloud",
        }
        assert ours(rows[f"done {rid}"]) == mine  # the step's fields stayed in the step
    assert ours(rows["the loop's own"]) == {}


# ---- through the real data plane and router ----------------------------------------------


class Relay(Pipeline):
    """A pipeline that logs before and after calling its step model through the router."""

    async def run(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        log.info("relay: before the step")
        out = await self.steps.call(self.step("step_model"), inputs)
        log.info("relay: after the step")
        return out


RELAY_CONFIG = """backend: "pipeline"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
parameters { key: "pipeline" value { string_value: "relay" } }
parameters { key: "step_model" value { string_value: "double" } }
"""


def test_a_served_request_binds_its_id_model_and_route(
    captured: io.StringIO, tmp_path: Path
) -> None:
    """Through DataPlane.infer and Router.infer with ONNX Runtime: the pipeline's lines carry
    the OIP request id, its model and its route; its step's binding ends with the step; after
    the answer (where the transport logs its access line) the route that served is bound; a
    request without an id gets a generated one."""
    add_model(tmp_path, "double", {1: 2.0})
    (tmp_path / "relay" / "1").mkdir(parents=True)
    (tmp_path / "relay" / "config.pbtxt").write_text(RELAY_CONFIG)
    executor = ThreadPoolExecutor(2)
    metrics = Metrics()
    routers: list[Router] = []

    def factory(config: ModelConfig, version_dir: Path) -> Runtime:
        if config.is_pipeline:
            return Relay(config, version_dir, routers[0], executor, ModelsConfig())
        return OnnxRuntime(config, version_dir, OnnxRuntimeConfig(), executor)

    async def scenario() -> None:
        manager = ModelManager(tmp_path, factory, metrics)
        routers.append(Router(manager, RoutingConfig(), None, None, metrics))
        plane = DataPlane(manager, routers[0])
        await manager.load_all()
        plane.ready = True
        x = {"x": np.ones((1, 2), np.float32)}

        async def serve(request_id: str | None) -> None:
            response, _ = await plane.infer("relay", None, InferRequest(dict(x), id=request_id))
            assert float(response.outputs["y"][0, 0]) == 2.0
            log.info("answered %s", request_id)

        await asyncio.gather(serve("oip-1"), serve("oip-2"), serve(None))
        await manager.close()

    try:
        asyncio.run(scenario())
    finally:
        executor.shutdown()
    rows = [r for r in lines(captured) if r["message"].startswith(("relay:", "answered"))]
    request_ids = {ours(r).get("http.request.id") for r in rows}
    assert {"oip-1", "oip-2"} < request_ids and len(request_ids) == 3, rows
    generated = (request_ids - {"oip-1", "oip-2"}).pop()
    assert isinstance(generated, str) and re.fullmatch(r"[0-9a-f]{12}", generated)
    for rid in ("oip-1", "oip-2", generated):
        mine = [ours(r) for r in rows if ours(r).get("http.request.id") == rid]
        assert len(mine) == 3, rows  # before, after, answered
        for fields in mine:
            assert fields["edged.model"] == "relay"  # never the step's, after it ran
            assert fields["edged.route"] == "local"
            assert fields["edged.reason"]

"""The model lifecycle on a real repository of small ONNX graphs, run by ONNX Runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.common.errors import NotFound, Unavailable
from edged.config import OnnxRuntimeConfig, RoutingConfig
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager, State
from edged.routing.router import Router
from edged.runtimes.base import Tensors
from edged.runtimes.onnxruntime import OnnxRuntime
from tests.modelfiles import add_model


def manager_for(repo: Path, idle_unload_s: float = 0.0) -> ModelManager:
    executor = ThreadPoolExecutor(2)

    def factory(config: ModelConfig, version_dir: Path) -> OnnxRuntime:
        return OnnxRuntime(config, version_dir, OnnxRuntimeConfig(), executor)

    return ModelManager(repo, factory, idle_unload_s=idle_unload_s)


async def unload_when_idle(manager: ModelManager) -> list[tuple[str, int]]:
    """Let the models go idle (twice ``idle_unload_s``), then unload them."""
    await asyncio.sleep(2 * manager.idle_unload_s)
    return await manager.unload_idle()


async def run(manager: ModelManager, name: str, version: int | None = None) -> tuple[int, float]:
    _, served, out = await manager.infer(name, version, {"x": np.ones((1, 2), np.float32)})
    return served, float(out["y"][0, 0])


def test_loads_models_and_serves_the_newest_version(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0, 2: 3.0}, "version_policy: { all: {} }")

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        assert await run(manager, "double") == (2, 3.0)
        assert await run(manager, "double", 1) == (1, 2.0)
        with pytest.raises(NotFound, match="no version 7"):
            await run(manager, "double", 7)
        with pytest.raises(NotFound, match="unknown model"):
            await run(manager, "nope")
        await manager.close()

    asyncio.run(scenario())


def test_a_truncated_model_is_unavailable_with_its_reason_and_others_serve(tmp_path: Path) -> None:
    add_model(tmp_path, "good", {1: 2.0})
    add_model(tmp_path, "broken", {1: 2.0})
    path = tmp_path / "broken" / "1" / "model.onnx"
    path.write_bytes(path.read_bytes()[:40])

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        assert await run(manager, "good") == (1, 2.0)
        with pytest.raises(Unavailable, match="ONNX Runtime cannot load"):
            await run(manager, "broken")
        rows = {r["name"]: r for r in manager.index()}
        assert rows["broken"]["state"] == State.UNAVAILABLE.value
        assert "cannot load" in rows["broken"]["reason"]
        await manager.close()

    asyncio.run(scenario())


def test_sync_adds_changes_and_removes_models(tmp_path: Path) -> None:
    add_model(tmp_path, "a", {1: 2.0})
    add_model(tmp_path, "b", {1: 5.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        add_model(tmp_path, "a", {2: 4.0})  # a new version: the default policy serves the latest
        add_model(tmp_path, "c", {1: 7.0})  # a new model
        for f in (tmp_path / "b").rglob("*"):
            if f.is_file():
                f.unlink()
        for d in sorted((tmp_path / "b").rglob("*"), reverse=True):
            d.rmdir()
        (tmp_path / "b").rmdir()
        await manager.sync()
        assert await run(manager, "a") == (2, 4.0)
        assert await run(manager, "c") == (1, 7.0)
        with pytest.raises(NotFound):
            await run(manager, "b")
        await manager.close()

    asyncio.run(scenario())


def test_unload_waits_for_requests_in_flight(tmp_path: Path) -> None:
    add_model(tmp_path, "m", {1: 2.0})

    async def scenario() -> None:
        gate = asyncio.Event()
        executor = ThreadPoolExecutor(2)

        class Gated(OnnxRuntime):
            """Real ONNX Runtime, held at the gate so that requests stay in flight."""

            async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
                await gate.wait()
                return await super().infer(inputs, parameters)

        def factory(config: ModelConfig, version_dir: Path) -> OnnxRuntime:
            return Gated(config, version_dir, OnnxRuntimeConfig(), executor)

        manager = ModelManager(tmp_path, factory)
        gate.set()  # open for the warm-up at load
        await manager.load_all()
        gate.clear()
        inflight = [asyncio.create_task(run(manager, "m")) for _ in range(20)]
        await asyncio.sleep(0.05)  # all 20 are now waiting at the gate
        unloading = asyncio.create_task(manager.unload("m"))
        await asyncio.sleep(0.2)
        assert not unloading.done(), "unload returned while 20 requests were in flight"
        with pytest.raises(Unavailable):  # no new work while draining
            await run(manager, "m")
        gate.set()
        await unloading
        results = await asyncio.gather(*inflight)
        assert all(r == (1, 2.0) for r in results)
        with pytest.raises(Unavailable):
            await run(manager, "m")
        await manager.load("m")
        assert await run(manager, "m") == (1, 2.0)
        await manager.close()

    asyncio.run(scenario())


def test_an_idle_model_is_unloaded_and_the_next_calls_load_it_once(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})
    add_model(tmp_path, "busy", {1: 4.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        manager.idle_unload_s = 1.0  # longer than a load on a busy CI machine
        await manager.load_all()
        assert await manager.unload_idle() == []  # just loaded: not idle yet
        await asyncio.sleep(1.05)
        await run(manager, "busy")  # called: stays loaded
        assert await manager.unload_idle() == [("double", 1)]
        rows = {r["name"]: r for r in manager.index()}
        assert rows["double"]["state"] == "READY" and rows["double"]["idle"] is True
        assert "idle" not in rows["busy"] and not manager.all_asleep()
        _, mv = manager.resolve("double", None)
        assert isinstance(mv.runtime, OnnxRuntime) and mv.runtime.session is None
        # three calls at once: one load, three answers
        answers = await asyncio.gather(*(run(manager, "double") for _ in range(3)))
        assert answers == [(1, 2.0)] * 3
        assert mv.runtime.session is not None and not mv.asleep
        wakes = manager.metrics.registry.get_sample_value(
            "edged_model_wake_duration_seconds_count", {"model": "double"}
        )
        unloads = manager.metrics.registry.get_sample_value(
            "edged_model_idle_unloads_total", {"model": "double"}
        )
        assert (wakes, unloads) == (1.0, 1.0)
        await asyncio.sleep(1.05)
        assert sorted(await manager.unload_idle()) == [("busy", 1), ("double", 1)]
        assert manager.all_asleep()
        await manager.close()

    asyncio.run(scenario())


def test_an_idle_model_whose_file_went_bad_answers_503_and_loads_when_fixed(
    tmp_path: Path,
) -> None:
    add_model(tmp_path, "double", {1: 2.0})
    path = tmp_path / "double" / "1" / "model.onnx"
    good = path.read_bytes()

    async def scenario() -> None:
        manager = manager_for(tmp_path, idle_unload_s=0.01)
        await manager.load_all()
        assert await unload_when_idle(manager) == [("double", 1)]
        path.write_bytes(good[:40])
        with pytest.raises(Unavailable, match="unloaded while idle and cannot load again"):
            await run(manager, "double")
        path.write_bytes(good)
        assert await run(manager, "double") == (1, 2.0)
        await manager.close()

    asyncio.run(scenario())


def test_the_wake_cost_of_an_idle_model_is_its_last_load_time(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path, idle_unload_s=0.01)
        await manager.load_all()
        assert manager.wake_cost("double") == 0.0 and manager.wake_cost("nope") == 0.0
        await unload_when_idle(manager)
        _, mv = manager.resolve("double", None)
        assert manager.wake_cost("double") == mv.load_s > 0
        await run(manager, "double")
        assert manager.wake_cost("double") == 0.0
        await manager.close()

    asyncio.run(scenario())


def test_routing_predicts_the_wake_and_does_not_learn_it_as_latency(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path, idle_unload_s=0.01)
        router = Router(manager, RoutingConfig(), None, None, manager.metrics)
        await manager.load_all()
        inputs = {"x": np.ones((1, 2), np.float32)}
        for _ in range(3):
            await router.infer("double", None, inputs)
        warm, calls = router.estimates.summary("double", "local") or (0.0, 0)
        await unload_when_idle(manager)
        path, _, _ = router._local_path("double", None, 8)
        _, mv = manager.resolve("double", None)
        assert path.predicted_s is not None and path.predicted_s >= warm + mv.load_s
        await router.infer("double", None, inputs)  # it loads again: not a latency sample
        assert router.estimates.summary("double", "local") == (warm, calls)
        await router.infer("double", None, inputs)
        assert router.estimates.summary("double", "local")[1] == calls + 1  # type: ignore[index]
        await manager.close()

    asyncio.run(scenario())


def test_a_caller_that_gives_up_does_not_cancel_the_wake_for_the_others(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path, idle_unload_s=0.01)
        await manager.load_all()
        await unload_when_idle(manager)
        _, mv = manager.resolve("double", None)
        caller = asyncio.create_task(run(manager, "double"))
        await asyncio.sleep(0)  # the caller runs to its first wait: it starts the wake...
        wake = mv.wake
        assert wake is not None and not wake.done()
        caller.cancel()  # ...and gives up before it ends (a deadline shorter than the load)
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not wake.cancelled()  # the load goes on without its caller
        await asyncio.wait_for(asyncio.shield(wake), 10)
        assert (
            not mv.asleep
            and manager.metrics.registry.get_sample_value(
                "edged_model_wake_duration_seconds_count", {"model": "double"}
            )
            == 1.0
        )
        assert await run(manager, "double") == (1, 2.0)
        await manager.close()

    asyncio.run(scenario())


def test_a_figure_that_cannot_be_read_costs_its_own_metrics_not_the_scrape(
    tmp_path: Path,
) -> None:
    add_model(tmp_path, "double", {1: 2.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        await manager.load_all()
        manager.metrics.state.models = manager.index
        assert 'edged_model_version_info{idle="false"' in manager.metrics.render().decode()
        manager.repository = tmp_path / "gone"  # index() raises: the repository vanished
        text = manager.metrics.render().decode()
        assert "edged_model_version_info{" not in text and "process_resident_memory" in text
        await manager.close()

    asyncio.run(scenario())


def test_a_load_that_would_leave_too_little_memory_free_is_refused(tmp_path: Path) -> None:
    add_model(tmp_path, "double", {1: 2.0})

    async def scenario() -> None:
        manager = manager_for(tmp_path)
        manager.min_free_mb = 128
        free = {"bytes": 100 << 20}  # as the load monitor would say on a busy Jetson
        manager.memory_free = lambda: free["bytes"]
        await manager.load_all()
        with pytest.raises(Unavailable, match=r"MiB of memory is free; models\.min_free_mb"):
            await run(manager, "double")
        free["bytes"] = 1 << 30
        await manager.load("double")
        assert await run(manager, "double") == (1, 2.0)
        manager.idle_unload_s = 0.01  # a wake is admitted the same way
        await unload_when_idle(manager)
        free["bytes"] = 50 << 20
        with pytest.raises(Unavailable, match="cannot load again: model 'double'"):
            await run(manager, "double")
        await manager.close()

    asyncio.run(scenario())

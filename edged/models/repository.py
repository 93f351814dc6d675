"""The model repository and the lifecycle of the models in it.

Triton's layout: ``<repository>/<model>/config.pbtxt`` and ``<repository>/<model>/<version>/``.
Models load concurrently; a pipeline loads after the models it calls (its ``*_model``
parameters). A model that fails to load is kept with its reason; the others serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.common.errors import (
    ConfigError,
    Conflict,
    EdgedError,
    InvalidRequest,
    ModelLoadError,
    NotFound,
    Unavailable,
)
from edged.common.names import DAMAGED
from edged.metrics import Metrics
from edged.models import files
from edged.models.calls import Calls
from edged.models.model_config import ModelConfig, read_config
from edged.runtimes.base import Runtime, Tensors
from edged.scheduler import Scheduler, Settings

log = logging.getLogger(__name__)

RuntimeFactory = Callable[[ModelConfig, Path], Runtime]
VERSION = re.compile(r"[1-9][0-9]*\Z")  # Triton ignores version directories like "01"


class State(str, enum.Enum):
    """A model version's state, with Triton's names."""

    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass
class ModelVersion:
    """One version of a model and what became of it."""

    version: int
    state: State = State.LOADING
    reason: str = ""
    runtime: Runtime | None = None
    scheduler: Scheduler | None = None  # tensor models: queues, batching; pipelines: none
    config: ModelConfig | None = None  # the config this version was loaded with
    signature: tuple[Any, ...] = ()
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = field(default_factory=time.monotonic)
    asleep: bool = False  # its runtime was unloaded while idle; the next call loads it again
    load_s: float = 0.0  # what its last load took: what waking it costs a call
    waking: asyncio.Lock = field(default_factory=asyncio.Lock)  # an idle unload or a wake
    wake: asyncio.Task[None] | None = None  # the load again in progress: one for all callers
    damaged: str = ""  # its files are not those installed (edged.models.files.damage): why


@dataclass
class ModelEntry:
    """A model directory: its config (if it parsed) and its versions."""

    name: str
    directory: Path
    config: ModelConfig | None = None
    error: str = ""
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    keep: bool = False  # its new config.pbtxt is broken: keep serving the loaded versions

    @property
    def ready_versions(self) -> list[int]:
        """Versions that serve, oldest first."""
        return sorted(v for v, mv in self.versions.items() if mv.state is State.READY)

    def dependencies(self) -> list[str]:
        """The models a pipeline calls, from its ``*_model`` parameters."""
        if self.config is None or not self.config.is_pipeline:
            return []
        return [v for k, v in sorted(self.config.parameters.items()) if k.endswith("_model")]


def _signature(config_path: Path, version_dir: Path) -> tuple[Any, ...]:
    """What identifies a version's content on disk, to tell changed versions on reload."""
    files = sorted(p for p in version_dir.rglob("*") if p.is_file())
    stats = [
        (str(p.relative_to(version_dir)), p.stat().st_size, p.stat().st_mtime_ns) for p in files
    ]
    return (config_path.stat().st_mtime_ns, tuple(stats))


async def check_files(mv: ModelVersion, version_dir: Path) -> None:
    """Before a load: the version's files against the list its install kept (in a thread: it
    reads them all); ModelLoadError, and ``mv.damaged`` saying why, when they differ."""
    mv.damaged = await asyncio.to_thread(files.damage, version_dir)
    if mv.damaged:
        raise ModelLoadError(f"damaged on disk, not loaded: {mv.damaged}")


def damaged_fields(name: str, mv: ModelVersion) -> dict[str, str]:
    """A log record's fields when ``mv`` was refused as damaged: its event says so to cloudsync
    (``reason`` "damaged", ``model``), which fetches the version again."""
    return {"model": name, "reason": DAMAGED} if mv.damaged else {}


class ModelManager:
    """Finds, loads, serves and unloads the models of one repository."""

    def __init__(
        self,
        repository: Path,
        factory: RuntimeFactory,
        metrics: Metrics | None = None,
        max_queue_size: int = 256,
        idle_unload_s: float = 0.0,
        min_free_mb: int = 0,
        memory_free: Callable[[], int | None] | None = None,
        before_load: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``max_queue_size`` bounds every queue that a model's config leaves unbounded;
        tensor models not called for ``idle_unload_s`` are unloaded by ``unload_idle`` (0:
        never); a load must leave ``min_free_mb`` of the ``memory_free()`` bytes free (None:
        unknown); ``before_load`` runs before any load (the power-mode hint)."""
        self.repository = repository
        self.factory = factory
        self.metrics = metrics or Metrics()
        self.calls = Calls(self.metrics, self.charged)  # what the statistics count
        self.max_queue_size = max_queue_size
        self.idle_unload_s = idle_unload_s
        self.before_load = before_load
        self.memory_free: Callable[[], int | None] = memory_free or (lambda: None)
        self.min_free_mb = min_free_mb
        self.entries: dict[str, ModelEntry] = {}
        # the version that serves a model's requests, whatever its version policy says (set by
        # an activation, edged.admin): a staged version never serves before it is activated
        self.pinned: dict[str, int] = {}
        self._lock = asyncio.Lock()

    # ---- discovery -------------------------------------------------------------------------

    def scan(self) -> dict[str, Path]:
        """Model directories: those with a config.pbtxt."""
        if not self.repository.is_dir():
            raise ModelLoadError(f"model repository {self.repository} is not a directory")
        return {
            d.name: d
            for d in sorted(self.repository.iterdir())
            if d.is_dir() and (d / "config.pbtxt").is_file()
        }

    # ---- loading ---------------------------------------------------------------------------

    async def load_all(self, names: Iterable[str] | None = None) -> None:
        """Load the named models (default: all found), dependencies first, concurrently."""
        found = self.scan()
        wanted = list(found) if not names else list(names)
        for name in wanted:
            if name not in found:
                self.entries[name] = ModelEntry(name, self.repository / name)
                self.entries[name].error = f"model '{name}' is not in {self.repository}"
                log.error("%s", self.entries[name].error)
        async with self._lock:
            await self._load_many({n: found[n] for n in wanted if n in found}, found)

    async def _load_many(self, targets: Mapping[str, Path], found: Mapping[str, Path]) -> None:
        tasks: dict[str, asyncio.Task[None]] = {}

        def start(name: str, chain: tuple[str, ...]) -> asyncio.Task[None]:
            if name in tasks:
                return tasks[name]
            entry = self._read_entry(name, found[name])
            deps = []
            for dep in entry.dependencies():
                if dep in chain:
                    entry.error = f"pipeline dependency cycle: {' -> '.join((*chain, dep))}"
                elif dep in found and (dep in targets or not self._serving(dep)):
                    deps.append(start(dep, (*chain, name)))
            tasks[name] = asyncio.create_task(self._load_entry(entry, deps), name=f"load:{name}")
            return tasks[name]

        for name in targets:
            start(name, ())
        if tasks:
            await asyncio.gather(*tasks.values())

    def _serving(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and bool(entry.ready_versions)

    def _read_entry(self, name: str, directory: Path) -> ModelEntry:
        """A fresh entry with the config on disk; a serving model whose new config is broken
        keeps its entry (and goes on serving) instead."""
        old = self.entries.get(name)
        entry = ModelEntry(name, directory, versions=old.versions if old else {})
        try:
            entry.config = read_config(directory)
        except EdgedError as exc:
            if old is not None and old.config is not None and old.ready_versions:
                log.error(
                    "model %s: %s; still serving the previous configuration", name, exc.message
                )
                old.keep = True
                return old
            entry.error = exc.message
        self.entries[name] = entry
        return entry

    async def _load_entry(self, entry: ModelEntry, deps: list[asyncio.Task[None]]) -> None:
        if deps:
            await asyncio.gather(*deps)
        if entry.keep:
            entry.keep = False
            return
        try:
            await self._load_checked(entry)
        except Exception as exc:  # a bug in one model's loading must not stop the others
            log.exception("model %s: loading failed", entry.name)
            entry.error = f"loading failed: {type(exc).__name__}: {exc}"

    async def _load_checked(self, entry: ModelEntry) -> None:
        if not entry.error:
            entry.error = self.missing_step(entry.name)
        if entry.error or entry.config is None:
            log.error("model %s: unavailable: %s", entry.name, entry.error)
            await self._retire(entry, list(entry.versions))
            return
        config = entry.config
        on_disk = sorted(
            int(d.name) for d in entry.directory.iterdir() if d.is_dir() and VERSION.match(d.name)
        )
        wanted = config.version_policy(on_disk)
        pin = self.pinned.get(entry.name)
        if pin is not None and pin in on_disk:
            wanted = [pin]
        elif pin is not None:
            log.error(
                "model %s: its active version %d is not on disk; serving by its version policy",
                entry.name,
                pin,
            )
        if not wanted:
            entry.error = f"no version directory in {entry.directory} matches the version policy"
            log.error("model %s: unavailable: %s", entry.name, entry.error)
            await self._retire(entry, list(entry.versions))
            return
        await asyncio.gather(*(self._load_version(entry, config, v) for v in wanted))
        if entry.ready_versions and not set(entry.ready_versions) & set(wanted):
            # Triton keeps serving what it has when a new version fails: so do we.
            log.error(
                "model %s: no new version loaded; still serving %s",
                entry.name,
                entry.ready_versions,
            )
            return
        keep = {*wanted, *await self._fall_back(entry, config, wanted, on_disk)}
        await self._retire(entry, [v for v in entry.versions if v not in keep])

    async def _fall_back(
        self, entry: ModelEntry, config: ModelConfig, wanted: list[int], on_disk: list[int]
    ) -> list[int]:
        """When no version serves because those wanted are damaged on disk, the newest earlier
        version on disk that loads serves until they are installed again (cloudsync fetches
        them again): it, or [] when there is none."""
        damaged = [v for v in wanted if v in entry.versions and entry.versions[v].damaged]
        if entry.ready_versions or not damaged:
            return []
        for older in sorted((v for v in on_disk if v < min(damaged)), reverse=True):
            await self._load_version(entry, config, older)
            if older in entry.ready_versions:
                log.error(
                    "model %s: version %s damaged on disk; version %d serves until it is"
                    " installed again",
                    entry.name,
                    ", ".join(map(str, damaged)),
                    older,
                )
                return [older]
        return []

    async def _load_version(self, entry: ModelEntry, config: ModelConfig, version: int) -> None:
        """Load ``version`` with ``config`` (the model's), or with the version's own config.pbtxt
        when it has one (a configuration delivered with the version: edged's addition to
        Triton's layout, so that a rollback goes back to the configuration too)."""
        version_dir = entry.directory / str(version)
        own = (version_dir / "config.pbtxt").is_file()
        signature = _signature(
            (version_dir if own else entry.directory) / "config.pbtxt", version_dir
        )
        current = entry.versions.get(version)
        if current and current.state is State.READY and current.signature == signature:
            return  # unchanged: keep serving it
        fresh = ModelVersion(version, config=config, signature=signature)
        fresh.idle.set()
        if current is None or current.state is not State.READY:
            entry.versions[version] = fresh  # shown as LOADING; a ready one serves meanwhile
        try:
            await check_files(fresh, version_dir)
            if own:
                config = fresh.config = read_config(version_dir, entry.name)
            settings = Settings.from_config(config, self.max_queue_size)
            config.check_label_files(version_dir)
            runtime = self.factory(config, version_dir)
            self._admit(entry.name, version, signature)
            if self.before_load is not None:
                await self.before_load()
            started = time.monotonic()
            await runtime.load()
            fresh.load_s = time.monotonic() - started
        except Exception as exc:
            fresh.state = State.UNAVAILABLE
            fresh.reason = (
                exc.message if isinstance(exc, EdgedError) else f"{type(exc).__name__}: {exc}"
            )
            log.error(
                "model %s version %d: unavailable: %s",
                entry.name,
                version,
                fresh.reason,
                extra=damaged_fields(entry.name, fresh),
            )
            if current is None or current.state is not State.READY:
                entry.versions[version] = fresh
            return
        fresh.runtime = runtime
        if not config.is_pipeline:
            fresh.scheduler = Scheduler(entry.name, settings, lambda f: runtime.infer(f, {}))
            self.metrics.attach(fresh.scheduler, entry.name, version)
        fresh.state = State.READY
        # The swap is one assignment: requests that started on the old runtime finish on it.
        entry.versions[version] = fresh
        log.info("model %s version %d: ready", entry.name, version)
        if current is not None and current.runtime is not None:
            await self._drain_and_unload(current)

    async def _drain_and_unload(self, mv: ModelVersion) -> None:
        mv.state = State.UNLOADING
        await mv.idle.wait()
        if mv.wake is not None:  # a load again that its callers left: unload what it loads
            with contextlib.suppress(Exception):
                await mv.wake
        if mv.scheduler is not None:
            await mv.scheduler.close()
        if mv.runtime is not None:
            await mv.runtime.unload()
        mv.runtime = None
        mv.scheduler = None
        mv.state = State.UNAVAILABLE
        mv.reason = "unloaded"

    async def _retire(self, entry: ModelEntry, versions: list[int]) -> None:
        for v in versions:
            mv = entry.versions.pop(v, None)
            if mv is not None and mv.runtime is not None:
                await self._drain_and_unload(mv)

    async def activate(
        self,
        name: str,
        version: int,
        check: Callable[[int], Awaitable[None]],
        new: Path | None = None,
    ) -> int | None:
        """Load ``version`` beside the one serving, ``check`` it (a smoke test: raising fails
        it), then make it the one that serves in one assignment, and unload the others after
        their requests finish. Returns the version that served before (None: none did). On a
        failure the version is unloaded and the one serving goes on.

        ``new``: the directory of a model new to the repository, whose ``version`` carries its
        config.pbtxt; the model exists from the switch on (its ``check`` writes the model's
        config.pbtxt, which makes the repository find it again after a restart)."""
        async with self._lock:
            if new is not None:
                if name in self.entries:
                    raise InvalidRequest(f"model '{name}' is in the repository already")
                try:
                    config = read_config(new / str(version), name)
                except ConfigError as exc:
                    raise InvalidRequest(exc.message) from None
                self.entries[name] = ModelEntry(name, new, config)
            try:
                return await self._activate(name, version, check)
            except BaseException:
                if new is not None:
                    self.entries.pop(name, None)
                    self.pinned.pop(name, None)
                raise

    async def _activate(
        self, name: str, version: int, check: Callable[[int], Awaitable[None]]
    ) -> int | None:
        entry = self.entry(name)
        if entry.config is None:
            raise Unavailable(f"model '{name}' cannot take a new version: {entry.error}")
        before = self.pinned.get(name)
        if before is None or before not in entry.ready_versions:
            before = entry.ready_versions[-1] if entry.ready_versions else None
        if before is not None:
            self.pinned[name] = before  # requests stay there while the new one loads
        await self._load_version(entry, entry.config, version)
        fresh = entry.versions.get(version)
        try:
            if fresh is None or fresh.state is not State.READY:
                raise ModelLoadError(
                    f"model '{name}' version {version} failed to load: "
                    f"{fresh.reason if fresh else 'not found'}"
                )
            await check(version)
        except BaseException:
            if version != before:
                await self._retire(entry, [version])
            raise
        self.pinned[name] = version  # the switch: requests from now on get this version
        entry.error = ""
        log.info("model %s: version %d active (was %s)", name, version, before)
        await self._retire(entry, [v for v in entry.versions if v != version])
        return before

    async def load(self, name: str) -> None:
        """Load or reload one model (Triton's repository load); raises if it does not serve."""
        found = self.scan()
        if name not in found:
            raise NotFound(f"model '{name}' is not in the repository {self.repository}")
        async with self._lock:
            await self._load_many({name: found[name]}, found)
        entry = self.entries[name]
        if not entry.ready_versions:
            raise ModelLoadError(f"model '{name}' failed to load: {self.reason(name)}")

    async def unload(self, name: str) -> None:
        """Unload every version of a model, after in-flight requests finish."""
        async with self._lock:
            entry = self.entries.get(name)
            if entry is None:
                raise NotFound(f"model '{name}' is not loaded")
            await self._retire(entry, list(entry.versions))
            entry.error = "unloaded"
        log.info("model %s: unloaded", name)

    async def remove(self, name: str) -> None:
        """Unload every version of a model (after their requests finish) and forget it; its
        directory is the caller's to remove. Conflict while a pipeline that serves calls it."""
        async with self._lock:
            entry = self.entry(name)
            callers = sorted(
                n for n, e in self.entries.items() if name in e.dependencies() and e.ready_versions
            )
            if callers:
                raise Conflict(
                    f"model '{name}' is called by {', '.join(callers)}: remove or change"
                    f" {'that' if len(callers) == 1 else 'those'} first"
                )
            await self._retire(entry, list(entry.versions))
            del self.entries[name]
            self.pinned.pop(name, None)
        log.warning("model %s: removed", name)

    async def sync(self, names: Iterable[str] | None = None) -> None:
        """Poll the repository (SIGHUP): load new or changed models (of ``names``, default all),
        unload the ones that left the repository."""
        found = self.scan()
        wanted = set(names or found)
        async with self._lock:
            for name in [n for n in self.entries if n not in found]:
                await self._retire(self.entries[name], list(self.entries[name].versions))
                del self.entries[name]
            await self._load_many({n: d for n, d in found.items() if n in wanted}, found)

    async def close(self) -> None:
        """Unload everything (shutdown)."""
        async with self._lock:
            for entry in self.entries.values():
                await self._retire(entry, list(entry.versions))

    # ---- serving ---------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        """The entry of a known model, or NotFound."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"unknown model '{name}'")
        return entry

    def reason(self, name: str) -> str:
        """Why a model does not serve (empty when it does)."""
        entry = self.entry(name)
        if entry.ready_versions:
            return ""
        reasons = [f"version {v}: {mv.reason}" for v, mv in entry.versions.items() if mv.reason]
        return entry.error or "; ".join(reasons) or "not loaded"

    def resolve(self, name: str, version: int | None) -> tuple[ModelEntry, ModelVersion]:
        """The version that serves a request: the one asked for, else the newest ready one."""
        entry = self.entry(name)
        missing = self.missing_step(name)
        if version is not None:
            mv = entry.versions.get(version)
            if mv is None:
                raise NotFound(f"model '{name}' has no version {version}")
            if mv.state is not State.READY:
                raise Unavailable(f"model '{name}' version {version} is not ready: {mv.reason}")
            if missing:
                raise Unavailable(f"model '{name}' cannot run: {missing}")
            return entry, mv
        if missing and entry.ready_versions:
            raise Unavailable(f"model '{name}' cannot run: {missing}")
        serving = self.serving(entry)
        if serving is None:
            raise Unavailable(f"model '{name}' is not ready: {self.reason(name)}")
        return entry, serving

    def serving(self, entry: ModelEntry) -> ModelVersion | None:
        """The version that serves a call naming none: the active (pinned) one while it is
        ready, else the newest ready one (None: none is ready)."""
        pinned = entry.versions.get(self.pinned.get(entry.name, -1))
        if pinned is not None and pinned.state is State.READY:
            return pinned
        ready = entry.ready_versions
        return entry.versions[ready[-1]] if ready else None

    def charged(self, name: str, named: int | None) -> int | None:
        """The version that a failed call of ``name`` no version ran counts under: the one it
        named if the model has it, else the one that serves (None: an unknown model, or none
        serves)."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        if named is not None and named in entry.versions:
            return named
        serving = self.serving(entry)
        return serving.version if serving is not None else None

    def missing_step(self, name: str, seen: frozenset[str] = frozenset()) -> str:
        """Why a pipeline cannot run now because a model it calls does not serve ("" if none)."""
        entry = self.entries.get(name)
        if entry is None or name in seen:
            return ""
        for dep in entry.dependencies():
            dep_entry = self.entries.get(dep)
            if dep_entry is None or not dep_entry.ready_versions:
                why = self.reason(dep) if dep_entry else "not in the repository"
                return f"step model '{dep}' is unavailable: {why}"
            deeper = self.missing_step(dep, seen | {name})
            if deeper:
                return deeper
        return ""

    async def infer(
        self,
        name: str,
        version: int | None,
        inputs: Tensors,
        parameters: Mapping[str, Any] | None = None,
    ) -> tuple[ModelEntry, int, Tensors]:
        """Check the inputs against the model's config and run them: a run of the caller's call,
        counted with it (``edged.models.calls``)."""
        with self.calls.run(name, version) as call:
            entry, mv = self.resolve(name, version)
            assert mv.config is not None and mv.runtime is not None
            call.version = mv.version
            mv.inflight += 1  # from here on, unload_idle leaves this version alone
            mv.idle.clear()
            mv.last_used = time.monotonic()
            try:
                mv.config.check_inputs(inputs)
                if mv.asleep:
                    await self._wake(entry.name, mv)
                if mv.scheduler is not None:
                    outputs = await mv.scheduler.submit(inputs)
                else:
                    outputs = await mv.runtime.infer(inputs, parameters or {})
            finally:
                mv.inflight -= 1
                if mv.inflight == 0:
                    mv.idle.set()
        return entry, mv.version, outputs

    # ---- idle unload ---------------------------------------------------------------------

    async def unload_idle(self) -> list[tuple[str, int]]:
        """Unload the runtimes of tensor-model versions nobody called for ``idle_unload_s``
        (they stay READY: the next call loads them again). Returns those unloaded now."""
        if not self.idle_unload_s:
            return []
        now = time.monotonic()
        done = []
        for entry in list(self.entries.values()):
            for mv in list(entry.versions.values()):
                if (
                    mv.state is not State.READY
                    or mv.asleep
                    or mv.scheduler is None  # pipelines hold little: their steps are models
                    or mv.inflight
                    or mv.waking.locked()
                    or mv.wake is not None
                    or now - mv.last_used < self.idle_unload_s
                ):
                    continue
                async with mv.waking:
                    mv.asleep = True  # before the first await: a call from now on waits
                    assert mv.runtime is not None
                    await mv.runtime.unload()
                self.metrics.idle_unloads.labels(entry.name).inc()
                log.info(
                    "model %s version %d: unloaded after %.0f s without calls; the next call"
                    " loads it again",
                    entry.name,
                    mv.version,
                    now - mv.last_used,
                )
                done.append((entry.name, mv.version))
        return done

    def all_asleep(self) -> bool:
        """Whether every tensor-model version that serves is idle-unloaded (and there is one)."""
        serving = [
            mv
            for entry in self.entries.values()
            for mv in entry.versions.values()
            if mv.state is State.READY and mv.scheduler is not None
        ]
        return bool(serving) and all(mv.asleep for mv in serving)

    def _admit(self, name: str, version: int, signature: tuple[Any, ...]) -> None:
        """Refuse a load that would leave less than ``min_free_mb`` of memory free (a Jetson's
        memory is the GPU's too: an engine that does not fit takes the device down, not only
        the model). What a load needs is taken as its files' size (from ``_signature``)."""
        free = self.memory_free()
        if free is None or not self.min_free_mb:
            return
        need = sum(size for _, size, _ in signature[1])
        if free - need < self.min_free_mb << 20:
            raise ModelLoadError(
                f"model '{name}': loading {version} needs about {need >> 20} MiB and"
                f" {free >> 20} MiB of memory is free; models.min_free_mb keeps"
                f" {self.min_free_mb} MiB free (unload a model, or lower it)"
            )

    def wake_cost(self, name: str, seen: frozenset[str] = frozenset()) -> float:
        """Seconds a call of ``name`` would wait now for idle-unloaded models to load again:
        its serving version's, and for a pipeline its steps' (0 when all are loaded)."""
        entry = self.entries.get(name)
        if entry is None or name in seen:
            return 0.0
        try:
            _, mv = self.resolve(name, None)
        except EdgedError:
            return 0.0
        cost = mv.load_s if mv.asleep else 0.0
        return cost + sum(self.wake_cost(dep, seen | {name}) for dep in entry.dependencies())

    async def _wake(self, name: str, mv: ModelVersion) -> None:
        """Load an idle-unloaded version again: one load however many calls wait for it, in a
        task of its own, so that a caller that gives up (a hedge lost, a deadline, a hang-up)
        does not cancel it for the others."""
        if mv.wake is None:
            mv.wake = asyncio.create_task(self._load_again(name, mv), name=f"wake:{name}")

            def done(task: asyncio.Task[None]) -> None:
                mv.wake = None
                if not task.cancelled():
                    task.exception()  # retrieved: every caller may have gone

            mv.wake.add_done_callback(done)
        await asyncio.shield(mv.wake)

    async def _load_again(self, name: str, mv: ModelVersion) -> None:
        async with mv.waking:  # after an unload in progress
            if not mv.asleep or mv.runtime is None:
                return
            started = time.monotonic()
            if self.before_load is not None:
                await self.before_load()
            try:
                self._admit(name, mv.version, mv.signature)
                await check_files(mv, self.entry(name).directory / str(mv.version))
                await mv.runtime.load()
            except Exception as exc:
                why = exc.message if isinstance(exc, EdgedError) else f"{type(exc).__name__}: {exc}"
                log.error(
                    "model %s version %d: loading again failed: %s",
                    name,
                    mv.version,
                    why,
                    extra=damaged_fields(name, mv),
                )
                raise Unavailable(
                    f"model '{name}' version {mv.version} was unloaded while idle and cannot"
                    f" load again: {why}"
                ) from None
            mv.asleep = False
            seconds = mv.load_s = time.monotonic() - started
            self.metrics.wake_seconds.labels(name).observe(seconds)
            log.info(
                "model %s version %d: loaded again on demand in %.0f ms",
                name,
                mv.version,
                seconds * 1000,
            )

    # ---- what pipelines see (runtimes.base.Steps) --------------------------------------------

    async def call(self, name: str, inputs: Tensors) -> Tensors:
        """Run the newest ready version of a model for a pipeline."""
        return (await self.infer(name, None, inputs))[2]

    def config_of(self, name: str) -> ModelConfig:
        """The configuration of the newest ready version of a model."""
        _, mv = self.resolve(name, None)
        assert mv.config is not None
        return mv.config

    def labels_of(self, name: str, output: str, version: int | None = None) -> list[str]:
        """The labels of a classification output (newest ready version by default), or []."""
        entry, mv = self.resolve(name, version)
        assert mv.config is not None
        for spec in mv.config.outputs:
            if spec.name == output:
                return mv.config.labels(spec, entry.directory / str(mv.version)) or []
        return []

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: every model and version with state and reason."""
        rows: list[dict[str, Any]] = []
        for name in sorted(set(self.scan()) | set(self.entries)):
            entry = self.entries.get(name)
            if entry is None or not entry.versions:
                reason = entry.error if entry else "not loaded"
                rows.append({"name": name, "state": State.UNAVAILABLE.value, "reason": reason})
                continue
            missing = self.missing_step(name)
            for v, mv in sorted(entry.versions.items()):
                state, reason = mv.state.value, mv.reason
                if missing and mv.state is State.READY:
                    state, reason = State.UNAVAILABLE.value, missing
                row: dict[str, Any] = {
                    "name": name,
                    "version": str(v),
                    "state": state,
                    "reason": reason,
                }
                if mv.asleep:
                    row["idle"] = True
                    row["reason"] = reason or "unloaded while idle; the next call loads it"
                rows.append(row)
        return rows

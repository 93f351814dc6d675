"""The composition root: build the daemon from its config, run it, stop it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from edged import systemd
from edged.admin import ADMIN_FILE, Admin
from edged.cloud import CloudEndpoint, CloudError, read_token
from edged.common import connections, logs
from edged.common.egress import Ledger
from edged.common.errors import ConfigError, EdgedError, ModelLoadError, Unavailable
from edged.common.events import EventLog
from edged.common.live import Live
from edged.config import Config
from edged.dataplane.plane import DataPlane
from edged.device import LoadMonitor
from edged.device.power import IdlePowerMode
from edged.knowledge.answer import ChatAnswer
from edged.knowledge.service import AskSettings, KnowledgeService
from edged.metrics import Metrics, StateCollector
from edged.models import install
from edged.models.model_config import ModelConfig
from edged.models.repository import ModelManager
from edged.oip.tensors import text_tensor
from edged.pipelines.factory import create_pipeline
from edged.request import CONTEXT, RouteContext, current_route, set_route
from edged.routing.router import Router
from edged.runtimes.base import Runtime
from edged.runtimes.onnxruntime import OnnxRuntime
from edged.runtimes.process import ProcessRuntime, wants_process
from edged.runtimes.tensorrt import TensorRtRuntime, TensorRtSettings, wants_tensorrt
from edged.server.access import Access
from edged.server.grpc.relay import GrpcServer
from edged.server.grpc.relay import start_server as start_grpc
from edged.server.regions import RegionSocket
from edged.server.rest.endpoints import metrics_handler
from edged.server.rest.routes import create_app
from edged.server.services import Services
from edged.tasks.run import TaskRunner

log = logging.getLogger("edged")


def clear_socket_path(path: Path) -> None:
    """Make ``path`` free for a new Unix socket: check its length, create its directory, remove
    a stale socket; refuse a live one or a file that is not a socket."""
    if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with the terminating NUL
        raise ConfigError(f"socket path {path} is longer than the 107 bytes Unix sockets allow")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path.parent}: {exc.strerror}") from None
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a process that is gone
        else:
            raise ConfigError(f"another process is already serving on {path}")
        finally:
            probe.close()


def bind_unix(path: Path, mode: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """Create the listening socket with ``mode`` from the first instant (no chmod race)."""
    clear_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot create the socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    sock.listen(1024)
    return sock


# what a reload changes while serving (Daemon.apply); every other key of these sections needs a
# restart (the socket, its mode, the limits a listener was built with, the repository)
RELOADED_SERVER = (
    "allowed_uids",
    "allowed_gids",
    "admin_uids",
    "admin_gids",
    "admin_group",
    "drain_timeout_s",
)
RELOADED_MODELS = ("load", "max_image_pixels", "idle_unload_s", "min_free_mb")


class Daemon:
    """edged: the model manager, the data plane and the REST server, wired together."""

    def __init__(self, config: Config, reread: Callable[[], Config] | None = None) -> None:
        """``reread`` gives the config afresh on SIGHUP: the file and the command-line flags."""
        self.config = config
        self.reread = reread
        self.events = EventLog()
        log.addHandler(self.events)  # edged's loggers' records, for GET /v1/events
        threads = max(4, 2 * (os.cpu_count() or 1))
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="infer")
        # every part gets what it reads at construction; the lambdas read the parts made below
        self.metrics = Metrics(
            StateCollector(  # read when Prometheus scrapes
                load=lambda: self.load.latest,
                cloud=lambda: self.cloud.state() if self.cloud else None,
                tiers=lambda: [tier.state() for tier in self.router.clouds],
                models=lambda: self.manager.index(),
                runtimes=self._runtimes,
            )
        )
        self.load = LoadMonitor(interval=config.device.interval_s)
        self.power = (
            IdlePowerMode(config.models.idle_power_mode, config.state_dir / "power-mode")
            if config.models.idle_power_mode is not None
            else None
        )
        self.manager = ModelManager(
            config.models.repository,
            self.make_runtime,
            self.metrics,
            config.scheduler.max_queue_size,
            config.models.idle_unload_s,
            config.models.min_free_mb,
            memory_free=lambda: self.load.latest.memory_available,
            before_load=self.power.busy if self.power is not None else None,
        )

        def local_names() -> list[str]:
            return list(self.manager.entries)

        egress = config.egress
        self.ledger = Ledger(
            egress.directory or config.state_dir / "egress",
            int(egress.segment_mb * (1 << 20)),
            int(egress.max_mb * (1 << 20)),
            egress.fsync_s,
        )
        recording = self.ledger if egress.enabled else None  # every call that leaves, first
        tiers = (config.cloud, *config.cloud.tiers) if config.cloud.url else ()
        clouds = [CloudEndpoint(tier, local_names, recording) for tier in tiers]
        self.cloud = clouds[0] if clouds else None  # the first tier: A/B, metrics, status
        self.router = Router(
            self.manager, config.routing, self.cloud, self.load, self.metrics, clouds[1:]
        )
        self.plane = DataPlane(
            self.manager,
            self.router,
            self.load,
            self.events,
            config.server.shm_regions,
            config.server.shm_regions_per_uid,
            self.ledger,
        )
        self.admin = Admin(
            config.state_dir / ADMIN_FILE,
            self.router,
            self.manager,
            self.reload,
            config.models.keep_versions,
            lambda: self.plane.ready,
            ledger=self.ledger,
        )
        knowledge = config.knowledge
        token = read_token(knowledge.token_file) or ""
        self.chat = (  # an OpenAI-compatible answer model, when one is configured
            ChatAnswer(
                knowledge.answer_url,
                knowledge.answer_model or "",
                read_token(knowledge.answer_token_file),
                recording,
            )
            if knowledge.answer_url
            else None
        )
        # question, passages -> answer: the endpoint, else the OIP model through the router
        self.answerer = self.chat or self._answer
        self.knowledge = KnowledgeService(
            knowledge.uri or config.state_dir / "knowledge.db",
            self._embed,
            self._embedding_dim,
            self.executor,
            token=token,
            index=knowledge.index,
            chunk_size=knowledge.chunk_size,
            overlap=knowledge.chunk_overlap,
            min_free_mb=knowledge.min_free_mb,
            embed_batch=knowledge.embed_batch,
            answer=self.answerer,
            ask=AskSettings(
                knowledge.answer_threshold,
                knowledge.answer_model,
                knowledge.ask_passages,
                knowledge.private_namespaces,
                knowledge.answer_timeout_s,
            ),
        )
        # what the REST adapter serves beside the data plane (/v1/kb, /v1/tasks)
        self.services = Services(self.plane.check_ready, self.knowledge, self.task_runner(config))
        # the settings a reload may change while serving, swapped whole (Daemon.apply)
        self.server_settings, self.model_settings = Live(config.server), Live(config.models)
        # who may call and who is admin, on both sockets
        self.access = Access(self.server_settings)
        self.grpc: GrpcServer | None = None
        self.regions: RegionSocket | None = None
        self.metrics_runner: web.AppRunner | None = None
        self.stopping = asyncio.Event()
        self.reloads: set[asyncio.Task[str | None]] = set()
        self.owned_socket: Path | None = None

    async def _embed(self, texts: list[str]) -> Any:
        """Embeddings for the knowledge store, from the local model; private: what is being
        indexed never leaves the device."""
        token = set_route(RouteContext(deadline=time.monotonic() + 60.0, private=True))
        try:
            _, outputs = await self.router.infer(
                self.config.knowledge.embedding_model, None, {"text": text_tensor("texts", texts)}
            )
        finally:
            CONTEXT.reset(token)  # the request's own routing context, for what follows
        return outputs["embedding"]

    async def _answer(self, question: str, passages: list[str]) -> tuple[str, str, str]:
        """The answer model's answer to ``question`` from ``passages``, within the request's
        routing context (its deadline; a private request never reaches it): (answer, route,
        reason)."""
        model = self.config.knowledge.answer_model
        assert model is not None
        inputs = {
            "question": text_tensor("question", [question]),
            "context": text_tensor("context", passages),
        }
        try:
            _, outputs = await self.router.infer(model, None, inputs)
        except CloudError as exc:
            raise Unavailable(f"the cloud failed: {exc.message}") from None
        answer = outputs.get("answer")
        if answer is None or answer.size == 0:
            raise Unavailable(f"the answer model '{model}' gave no 'answer' output")
        first = answer.ravel()[0]
        text = first.decode("utf-8", "replace") if isinstance(first, bytes) else str(first)
        ctx = current_route()
        last = ctx.decisions[-1] if ctx is not None and ctx.decisions else {}
        return text, str(last.get("route", "local")), str(last.get("reason", ""))

    def _runtimes(self) -> list[tuple[str, int, dict[str, Any]]]:
        """(model, version, the runtime's metadata) of every loaded tensor-model version."""
        return [
            (entry.name, mv.version, mv.runtime.metadata())
            for entry in list(self.manager.entries.values())
            for mv in list(entry.versions.values())
            if mv.runtime is not None and mv.scheduler is not None and not mv.asleep
        ]

    def _embedding_dim(self) -> int:
        """The size of the embedding model's vectors, from its config (no model call)."""
        config = self.manager.config_of(self.config.knowledge.embedding_model)
        return next(o.dims[-1] for o in config.outputs if o.name == "embedding")

    @property
    def learner_state(self) -> Path:
        """Where the learned routing policy keeps what it learned across restarts."""
        return self.config.state_dir / "routing-learner.json"

    def make_runtime(self, model: ModelConfig, version_dir: Path) -> Runtime:
        """The runtime that serves one model version, by its platform or backend."""
        if model.is_pipeline:
            return create_pipeline(
                model, version_dir, self.router, self.executor, self.model_settings
            )
        section = self.config.onnxruntime
        if wants_tensorrt(model):
            return TensorRtRuntime(model, version_dir, TensorRtSettings.of(section), self.executor)
        if model.platform == "onnxruntime_onnx":
            return (ProcessRuntime if wants_process(section) else OnnxRuntime)(
                model, version_dir, section, self.executor
            )
        raise ModelLoadError(f"model '{model.name}': platform '{model.platform}' is not supported")

    def listen(self) -> socket.socket:
        """The socket passed by systemd, or our own at server.socket."""
        activated = systemd.listen_sockets()
        if activated:
            log.info("using the socket passed by systemd (%s)", activated[0].getsockname())
            for extra in activated[1:]:
                extra.close()
            return activated[0]
        path = self.config.server.socket
        sock = bind_unix(path, self.config.server.socket_mode)
        self.owned_socket = path
        return sock

    def status_line(self) -> str:
        """A one-line summary for systemd's STATUS=."""
        rows = self.manager.index()
        ready = sum(1 for r in rows if r["state"] == "READY")
        return f"serving {ready} of {len(rows)} model versions"

    def apply(self, fresh: Config) -> None:
        """Take the settings that can change while serving from a re-read config file."""
        tasks = self.task_runner(fresh)  # first: a bad template refuses the whole file
        logs.setup_logging(fresh.log.level, fresh.log.format, socket.gethostname(), "edged")
        self.config.log = fresh.log
        self.config.onnxruntime = fresh.onnxruntime  # for the models loaded from now on
        # New snapshots swapped in whole: the running ones with the keys that change while
        # serving taken from the file (the others need a restart). The access lists apply to
        # both sockets at once (REST and gRPC read the same settings).
        server = self.config.server.model_copy(
            update={k: getattr(fresh.server, k) for k in RELOADED_SERVER}
        )
        self.config.server = server
        self.server_settings.swap(server)
        self.access.refresh()
        models = self.config.models.model_copy(
            update={k: getattr(fresh.models, k) for k in RELOADED_MODELS}
        )
        self.config.models = models
        self.model_settings.swap(models)
        self.manager.idle_unload_s = fresh.models.idle_unload_s
        self.manager.min_free_mb = fresh.models.min_free_mb
        self.config.scheduler = fresh.scheduler
        self.manager.max_queue_size = fresh.scheduler.max_queue_size  # for later loads
        self.config.routing = fresh.routing
        self.admin.configure(fresh.routing)  # with the operator's overrides over it
        self.services.tasks = tasks
        self.config.tasks = fresh.tasks

    def task_runner(self, config: Config) -> TaskRunner:
        """/v1/tasks with the config's templates and the knowledge store's answer model."""
        answer_model = config.knowledge.answer_model
        answer = self.answerer if answer_model else None
        private_namespaces = config.knowledge.private_namespaces
        return TaskRunner(
            self.plane,
            self.router,
            config.tasks,
            self.knowledge,
            answer,
            answer_model,
            private_namespaces,
        )

    async def reload(self) -> str | None:
        """SIGHUP (and POST /v1/admin/reload): re-read the config and poll the repository; never
        stops serving. Returns what went wrong, or None.

        A config that no longer validates keeps the previous settings; the repository is polled
        either way.
        """
        if self.plane.ready:
            systemd.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        error: str | None = None
        try:
            if self.reread is not None:
                try:
                    self.apply(self.reread())
                except EdgedError as exc:
                    error = f"keeping the previous configuration: {exc.message}"
                    log.error("reload: %s", error)
                else:
                    log.info(
                        "reloaded the configuration; server.socket, server.socket_mode,"
                        " server.max_request_bytes, state_dir, models.repository and cloud change"
                        " only on restart"
                    )
            await self.manager.sync(self.config.models.load)
        except EdgedError as exc:
            error = exc.message
            log.error("reload failed, still serving the previous state: %s", exc.message)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc} (the daemon's log has the details)"
            log.exception("reload failed, still serving the previous state")
        finally:
            if self.plane.ready:
                systemd.notify("READY=1", f"STATUS={self.status_line()}")
        return error

    async def _keep_learner(self, every: float = 60.0) -> None:
        """Save what the learned routing policy learned now and then (and at stop), so that a
        crash loses at most a minute of it."""
        while True:
            await asyncio.sleep(every)
            self.router.save_state(self.learner_state)

    async def _unload_idle(self) -> None:
        """Unload the models idle for models.idle_unload_s (read afresh: SIGHUP may change it);
        with every model idle, the power-mode hint."""
        while True:
            idle = self.config.models.idle_unload_s
            await asyncio.sleep(min(10.0, max(0.1, idle / 4)) if idle else 10.0)
            try:
                unloaded = idle and await self.manager.unload_idle()
                if unloaded and self.power is not None:
                    await self.power.idle(self.manager.all_asleep)
            except Exception:  # a runtime whose unload fails: logged, the next turn goes on
                log.exception("idle unload failed")

    async def _watchdog(self, interval: float) -> None:
        while True:
            systemd.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit code."""
        if not self.manager.repository.is_dir():
            raise ConfigError(
                f"models.repository {self.manager.repository} is not a directory"
                " (set it in the config or with --models)"
            )
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create state_dir {self.config.state_dir}: {exc.strerror}"
            ) from None
        cfg = self.config.egress
        settings = {"segment_mb": cfg.segment_mb, "max_mb": cfg.max_mb, "fsync_s": cfg.fsync_s}
        self.ledger.start(cfg.enabled, settings, "edged")
        try:  # installs are taken from there only (0700)
            install.ensure_staging(self.admin.staging)
        except ConfigError as exc:  # serving goes on; installs say why they cannot
            log.error("%s; model installs are refused until it is", exc.message)
        if self.power is not None:
            await self.power.recover()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGINT, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        if os.environ.get("EDGED_TEST_HOOKS") == "1":
            # a test hook (never set by the units): SIGUSR2 wedges the event loop for
            # EDGED_TEST_HANG_S seconds, as a stuck model would; the watchdog pings stop
            hang = float(os.environ.get("EDGED_TEST_HANG_S", "5"))
            loop.add_signal_handler(signal.SIGUSR2, time.sleep, hang)
            log.warning("test hooks on: SIGUSR2 hangs the event loop for %.1f s", hang)
        runner = web.AppRunner(
            create_app(self.plane, self.server_settings, self.admin, self.access, self.services),
            handle_signals=False,
            access_log=None,
            # A client that hangs up cancels its request instead of leaving the work running.
            handler_cancellation=True,
            # We drain ourselves (below); what is left after drain_timeout_s is cut short.
            shutdown_timeout=1.0,
            # a malformed request (anyone on the socket can send one) is a short warning
            logger=connections.QuietLog(logging.getLogger("aiohttp.server")),
            keepalive_timeout=self.config.server.read_timeout_s,
        )
        await runner.setup()
        try:
            sock = self.listen()
        except BaseException:
            await runner.cleanup()
            raise
        site = connections.CappedSite(runner, sock, self.config.server.max_connections)
        await site.start()
        try:
            await self._start_extra_servers()
        except BaseException:
            await self._stop_extra_servers()
            await runner.cleanup()
            raise
        self.load.start()
        self.router.load_state(self.learner_state)
        for tier in self.router.clouds:
            tier.start()
            log.info("cloud tier %s: %s", tier.name, tier.url)
        interval = systemd.watchdog_interval()
        watchdog = loop.create_task(self._watchdog(interval), name="watchdog") if interval else None
        keeper = loop.create_task(self._keep_learner(), name="learner-state")
        loading = loop.create_task(self.manager.load_all(self.config.models.load), name="load")
        idle = loop.create_task(self._unload_idle(), name="idle-unload")
        sweep = connections.sweep_idle(runner, self.config.server.read_timeout_s)
        sweeper = loop.create_task(sweep, name="idle-connections")
        syncer = loop.create_task(self._sync_ledger(), name="egress-fsync")
        try:
            await self._serve(loading, sock.getsockname())
        finally:
            tasks = [t for t in (watchdog, loading, keeper, idle, sweeper, syncer) if t]
            await self._shutdown(runner, site, tasks)
        return 0

    async def _sync_ledger(self) -> None:
        """fsync the ledger's new entries every [egress] fsync_s."""
        while True:
            await asyncio.sleep(self.config.egress.fsync_s)
            try:
                await asyncio.to_thread(self.ledger.sync)
            except OSError as exc:
                log.error("the egress ledger cannot be synced: %s", exc)

    async def _start_extra_servers(self) -> None:
        """gRPC on its own Unix socket, and /metrics on a TCP port, as configured."""
        server = self.config.server
        if server.grpc:
            path = server.grpc_path()
            sock = bind_unix(path, server.socket_mode)  # edged accepts: the caller's credentials
            try:
                self.grpc = await start_grpc(self.plane, sock, path, server, self.access)
            except BaseException as exc:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                if isinstance(exc, RuntimeError):  # grpc reports a failed bind so
                    raise ConfigError(f"cannot serve gRPC on {path}: {exc}") from None
                raise
            log.info("gRPC (GRPCInferenceService) on unix:%s", path)
        if server.shm_regions:
            path = server.shm_path()
            self.regions = RegionSocket(self.plane, self.access, self.server_settings)
            self.regions.start(bind_unix(path, server.socket_mode, socket.SOCK_SEQPACKET))
            log.info("sealed shared-memory regions on unix:%s (seqpacket)", path)
        metrics = self.config.metrics
        if metrics.port:
            app = web.Application()
            app.router.add_get("/metrics", metrics_handler(self.metrics))
            self.metrics_runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await self.metrics_runner.setup()
            try:
                await web.TCPSite(self.metrics_runner, metrics.address, metrics.port).start()
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve metrics on {metrics.address}:{metrics.port}: {exc.strerror}"
                ) from None
            log.info("metrics on http://%s:%d/metrics", metrics.address, metrics.port)

    async def _stop_extra_servers(self, grace: float = 0) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace)
            self.grpc = None
            with contextlib.suppress(FileNotFoundError):
                self.config.server.grpc_path().unlink()
        if self.regions is not None:
            await self.regions.stop()
            self.regions = None
            with contextlib.suppress(FileNotFoundError):
                self.config.server.shm_path().unlink()
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
            self.metrics_runner = None

    def _on_hup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload(), name="reload")
        self.reloads.add(task)
        task.add_done_callback(self.reloads.discard)

    async def _serve(self, loading: asyncio.Task[None], address: str) -> None:
        """Wait for the models, say READY, then serve until told to stop."""
        log.info("listening on %s; loading models from %s", address, self.manager.repository)
        systemd.notify("STATUS=loading models")
        started = time.monotonic()
        stop = asyncio.get_running_loop().create_task(self.stopping.wait(), name="stop")
        await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            stop.result()
            return  # stopped while loading
        loading.result()
        self.plane.ready = True
        systemd.notify("READY=1", f"STATUS={self.status_line()}")
        log.info("ready in %.2f s: %s", time.monotonic() - started, self.status_line())
        log.info(
            'try: curl --unix-socket %s -d \'{"texts": ["hello"]}\' http://localhost/v1/intent',
            address,
        )
        await stop

    async def _shutdown(
        self, runner: web.AppRunner, site: web.SockSite, tasks: list[asyncio.Task[None]]
    ) -> None:
        """Drain requests in flight (up to drain_timeout_s), then release everything."""
        drain = self.config.server.drain_timeout_s
        log.info("stopping: draining %d requests (up to %.0f s)", self.plane.inflight, drain)
        systemd.notify("STOPPING=1", "STATUS=draining requests")
        self.plane.stopping = True
        self.plane.ready = False  # /v2/health/ready answers 503 to connections kept alive
        await site.stop()  # no new connections; the requests in flight go on
        # gRPC stops taking calls at once and lets those in flight finish within the drain time.
        grpc_stopped = asyncio.ensure_future(self._stop_extra_servers(drain))
        try:
            await asyncio.wait_for(self.plane.idle.wait(), drain)
        except asyncio.TimeoutError:
            log.warning(
                "%d requests still running after %.0f s: cut short", self.plane.inflight, drain
            )
        release = Release(RELEASE_S)
        await release("the gRPC server", grpc_stopped)
        await release("the REST server", runner.cleanup())
        self.plane.shm.close()
        for task in (*tasks, *self.reloads):
            task.cancel()
            await release(f"task {task.get_name()}", task)
        await release("the load monitor", self.load.stop())
        self.router.save_state(self.learner_state)
        await release("the knowledge store", self.knowledge.close())
        if self.chat is not None:
            await release("the chat model", self.chat.close())
        for tier in self.router.clouds:
            await release(f"the cloud tier {tier.name}", tier.stop())
        await release("the egress ledger", asyncio.to_thread(self.ledger.close))
        if self.power is not None:
            await release("the power mode", self.power.busy())  # the power mode edged found
        await release("the models", self.manager.close())
        log.removeHandler(self.events)
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.owned_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                self.owned_socket.unlink()
        log.info("stopped")


RELEASE_S = 10.0  # what stopping may take after the drain, all steps together


class Release:
    """The steps of a stop after the drain, each waited for while the budget lasts: one that
    hangs is named in the log and left behind (cancelled, not awaited), so a stop ends in
    ``drain_timeout_s`` + ``RELEASE_S`` whatever a step does, inside systemd's TimeoutStopSec,
    and the journal says which step it was."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    async def __call__(self, what: str, step: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(step)
        left = max(0.5, self.deadline - time.monotonic())  # a step after a hang still runs
        done, _ = await asyncio.wait({task}, timeout=left)
        if not done:
            task.cancel()
            log.error("stopping: %s did not finish within %.1f s; left behind", what, left)
        elif not task.cancelled() and task.exception() is not None:
            log.error("stopping: %s failed: %r", what, task.exception())

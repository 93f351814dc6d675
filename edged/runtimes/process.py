"""Process isolation: an ONNX model's session in a worker subprocess.

CUDA and TensorRT contexts and allocator arenas stay with a process after its session is
destroyed; only the process's exit gives all of them back. So a GPU model runs in a child
process (started with "spawn": forking a threaded asyncio process is unsafe) that builds an
``OnnxRuntime`` and serves it; unloading the model ends the child.

One pipe carries everything, pickled (protocol 5): requests tagged with an id, so that
concurrent calls share it and finish in any order, and the replies, errors and log records.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import logging.handlers
import multiprocessing
import multiprocessing.util  # before our atexit hook, which must run before its own
import os
import pickle
import queue
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as pb

from edged.common.errors import (
    DeadlineExceeded,
    EdgedError,
    InvalidRequest,
    ModelLoadError,
    Unavailable,
)
from edged.config import OnnxRuntimeConfig
from edged.models.model_config import ModelConfig
from edged.runtimes.base import Tensors
from edged.runtimes.gpu import GPU_PROVIDERS, usable_providers
from edged.runtimes.onnxruntime import OnnxRuntime, choose_providers

__all__ = ["EXIT_TIMEOUT_S", "GPU_PROVIDERS", "ProcessRuntime", "rss_bytes", "wants_process"]

log = logging.getLogger(__name__)

# How long unload() waits for a clean exit (CUDA teardown included) before SIGKILL.
EXIT_TIMEOUT_S = 10.0
KILLED_TIMEOUT_S = 5.0
PICKLE_PROTOCOL = 5  # in-band buffers: numpy arrays cross with one copy less than protocol 4

# Errors that come back from the child as themselves; any other becomes a plain EdgedError.
ERRORS: dict[str, type[EdgedError]] = {
    cls.__name__: cls for cls in (InvalidRequest, ModelLoadError, Unavailable, DeadlineExceeded)
}
Message = tuple[Any, ...]


def wants_process(settings: OnnxRuntimeConfig, available: Sequence[str] | None = None) -> bool:
    """Whether sessions run in worker processes: isolation "process", or "auto" with a GPU
    provider in use (``available``: ONNX Runtime's providers, asked when not given)."""
    if settings.isolation != "auto":
        return settings.isolation == "process"
    if available is None:
        available = usable_providers(ort.get_available_providers())
    return any(p in GPU_PROVIDERS for p in choose_providers(settings.providers, available))


def rss_bytes(pid: int) -> int:
    """The resident memory of a process, from /proc/<pid>/statm; 0 when it is gone."""
    try:
        resident = Path(f"/proc/{pid}/statm").read_text().split()[1]
    except (OSError, IndexError):
        return 0
    return int(resident) * os.sysconf("SC_PAGE_SIZE")


def describe_exit(exitcode: int | None) -> str:
    """How a child ended, for people: 'was killed by signal SIGKILL', 'exited with code 1'."""
    if exitcode is None:
        return "ended"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"was killed by signal {name}"
    return f"exited with code {exitcode}"


# ---- the parent's side -----------------------------------------------------------------------

_LIVE: weakref.WeakSet[_Worker] = weakref.WeakSet()


@atexit.register
def _kill_live_workers() -> None:
    # multiprocessing joins its children at exit, and ours ignore SIGTERM: one left running
    # (a path that skipped unload) would hang the daemon's exit.
    for worker in list(_LIVE):
        worker.kill()


class _Worker:
    """One child process, the pipe to it and the calls waiting on it."""

    def __init__(self, model: str, label: str, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self.label = label
        self.loop = loop
        self.process: multiprocessing.process.BaseProcess | None = None
        self.pending: dict[int, asyncio.Future[Tensors]] = {}
        self.ids = itertools.count(1)
        self.outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self.loaded: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.gone: asyncio.Future[str] = loop.create_future()
        self.death: str | None = None  # set when the child ended without being asked to
        self.fault: str | None = None  # what the parent found wrong with the child, if anything
        self.stopping = False
        self.started = False
        self.lock = threading.Lock()  # start() in the pool vs kill() on a cancelled load

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        if self.process is None or not self.started or self.gone.done():
            return None
        return self.process.pid

    def start(
        self,
        config: ModelConfig,
        version_dir: Path,
        settings: OnnxRuntimeConfig,
    ) -> None:
        """Start the child (blocking for a few milliseconds: run it in the executor)."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self.process = context.Process(
            target=_child_main,
            args=(
                theirs,
                config.proto.SerializeToString(),
                config.directory,
                version_dir,
                settings,
                logging.getLogger("edged").getEffectiveLevel(),
            ),
            name=f"edged-worker {config.name}/{version_dir.name}",
            daemon=True,
        )
        with self.lock:
            if self.stopping:  # the load was cancelled before the child started
                theirs.close()
                ours.close()
                return
            try:
                self.process.start()
            finally:
                theirs.close()  # the child's copy alone must hold it: its exit is our EOF
            self.started = True
        _LIVE.add(self)
        for target, name in ((self._read, "reader"), (self._write, "writer")):
            thread = threading.Thread(
                target=target, args=(ours,), name=f"{name} of {self.process.name}", daemon=True
            )
            thread.start()

    async def call(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """One inference in the child."""
        if self.gone.done():
            raise Unavailable(self.death or f"{self.label} was unloaded")
        future: asyncio.Future[Tensors] = self.loop.create_future()
        request = next(self.ids)
        self.pending[request] = future
        self.outbox.put(("infer", request, dict(inputs), dict(parameters)))
        try:
            return await future
        finally:
            self.pending.pop(request, None)

    async def stop(self) -> None:
        """Ask the child to exit; SIGKILL it if it has not within EXIT_TIMEOUT_S."""
        self.stopping = True
        if not self.started or self.gone.done():
            return
        self.outbox.put(("exit",))
        try:
            await asyncio.wait_for(asyncio.shield(self.gone), EXIT_TIMEOUT_S)
            return
        except asyncio.TimeoutError:
            log.warning(
                "%s: worker process did not exit in %.0f s; killing it", self.label, EXIT_TIMEOUT_S
            )
        self.kill()
        try:
            await asyncio.wait_for(asyncio.shield(self.gone), KILLED_TIMEOUT_S)
        except asyncio.TimeoutError:  # a process in uninterruptible sleep (a stuck driver call)
            log.error("%s: worker process survives SIGKILL for now", self.label)

    def kill(self) -> None:
        """SIGKILL the child (the reader thread reaps it and reports)."""
        with self.lock:
            self.stopping = True
            # Not process.exitcode: that reaps, racing the reader thread's join.
            if self.started and self.process is not None and not self.gone.done():
                self.process.kill()

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(callback, *args)

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                message = pickle.loads(data)
            except Exception as exc:  # e.g. MemoryError: the call it answers is unknown
                self.fault = f"sent a reply that cannot be read ({exc!r}) and was killed"
                with self.lock:
                    assert self.process is not None
                    self.process.kill()
                continue
            if message[0] == "log":
                _relog(message[1])
            else:
                self._post(self._deliver, message)
        self.outbox.put(None)  # the writer closes the pipe
        assert self.process is not None
        self.process.join()  # EOF: the child has exited (or is exiting): reap it
        self._post(self._ended, self.process.exitcode)

    def _write(self, conn: Connection) -> None:
        broken = False
        while (message := self.outbox.get()) is not None:
            if broken:
                continue
            try:
                data = pickle.dumps(message, protocol=PICKLE_PROTOCOL)
            except Exception as exc:  # e.g. a parameter that cannot be pickled
                error = EdgedError(f"{self.label}: cannot pass the request to its worker: {exc}")
                self._post(self._fail, message[1], error)
                continue
            try:
                conn.send_bytes(data)
            except OSError:  # the child is gone; the reader reports how
                broken = True
        conn.close()

    def _deliver(self, message: Message) -> None:
        kind = message[0]
        if kind == "loaded" and not self.loaded.done():
            self.loaded.set_result(message[1])
        elif kind == "failed" and not self.loaded.done():
            self.loaded.set_exception(ModelLoadError(message[2]))
        elif kind == "done":
            future = self.pending.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "error":
            self._fail(message[1], ERRORS.get(message[2], EdgedError)(message[3]))

    def _fail(self, request: int, error: EdgedError) -> None:
        future = self.pending.get(request)
        if future is not None and not future.done():
            future.set_exception(error)

    def _ended(self, exitcode: int | None) -> None:
        assert self.process is not None
        _LIVE.discard(self)
        how = self.fault or describe_exit(exitcode)
        who = f"its worker process (pid {self.process.pid}) {how}"
        if not self.loaded.done():
            self.loaded.set_exception(ModelLoadError(f"{self.label}: {who} while loading"))
        elif not self.stopping:
            self.death = (
                f"{self.label} is unavailable: {who}; load the model again to serve it"
                f" (POST /v2/repository/models/{self.model}/load)"
            )
            log.error("%s", self.death)
        error = Unavailable(self.death or f"{self.label} was unloaded")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.gone.set_result(how)


def _relog(record: logging.LogRecord) -> None:
    """Hand a record of the child to the parent's logging (its pid stays in the record)."""
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


class ProcessRuntime:
    """One version of an ONNX model, served by an ``OnnxRuntime`` in a worker subprocess."""

    def __init__(
        self,
        config: ModelConfig,
        version_dir: Path,
        settings: OnnxRuntimeConfig,
        executor: Executor,
    ) -> None:
        self.config = config
        self.version_dir = version_dir
        self.settings = settings
        self.executor = executor
        self.label = f"model '{config.name}' version {version_dir.name}"
        self._loaded: dict[str, Any] = {}  # the child's OnnxRuntime.metadata()
        self._worker: _Worker | None = None

    @property
    def pid(self) -> int | None:
        """The worker's pid while it runs (loading or serving)."""
        return self._worker.pid if self._worker is not None else None

    async def load(self) -> None:
        """Start a worker that loads, checks and warms up the model; a fresh one each time."""
        await self.unload()
        loop = asyncio.get_running_loop()
        worker = _Worker(self.config.name, self.label, loop)
        self._worker = worker
        try:
            await loop.run_in_executor(
                self.executor, worker.start, self.config, self.version_dir, self.settings
            )
            metadata = await worker.loaded
        except ModelLoadError:
            self._worker = None
            await worker.stop()
            raise
        except Exception as exc:  # start() failed: out of processes or memory
            self._worker = None
            worker.kill()
            raise ModelLoadError(f"{self.label}: cannot start a worker process: {exc}") from None
        except BaseException:  # cancelled: leave no child behind
            self._worker = None
            worker.loaded.cancel()
            worker.kill()
            raise
        if self._worker is not worker:  # unload() ran meanwhile and ended it
            raise ModelLoadError(f"{self.label} was unloaded while loading")
        self._loaded = metadata
        log.info("%s: serving in worker process %s", self.label, worker.pid)

    async def infer(self, inputs: Tensors, parameters: Mapping[str, Any]) -> Tensors:
        """Run one request in the worker; the scheduler may run several at once."""
        worker = self._worker
        if worker is None or not worker.loaded.done():
            raise ModelLoadError(f"model '{self.config.name}' is not loaded")
        if worker.death is not None:
            raise Unavailable(worker.death)
        return await worker.call(inputs, parameters)

    async def unload(self) -> None:
        """End the worker (all its memory goes back); harmless when there is none."""
        worker, self._worker = self._worker, None
        self._loaded = {}
        if worker is not None:
            await worker.stop()

    def metadata(self) -> dict[str, Any]:
        """The in-process runtime's facts (the providers in use), and the worker's: its pid
        and resident memory."""
        pid = self.pid
        return {
            "providers": [],
            **self._loaded,
            "isolation": "process",
            "pid": pid,
            "rss_bytes": rss_bytes(pid) if pid is not None else 0,
        }


# ---- the child's side ------------------------------------------------------------------------


class _Sender:
    """The child's end of the pipe, shared by the event loop and logging from any thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        data = pickle.dumps(message, protocol=PICKLE_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(data)

    def put_nowait(self, record: logging.LogRecord) -> None:
        """QueueHandler's side: forward a prepared (already formatted) record."""
        with contextlib.suppress(OSError):  # the parent is gone; we exit at the next read
            self.send(("log", record))


def _name_process(title: str, name: str) -> None:
    try:
        import setproctitle  # optional: the command line ps shows
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(title)
    # The short name (15 bytes) that ps -e, top and the kernel's OOM report show.
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"edged:{name}"[:15])


def _error_of(exc: BaseException, model: str) -> tuple[str, str]:
    if isinstance(exc, EdgedError):
        return type(exc).__name__, exc.message
    return "", f"model '{model}' failed in its worker process: {type(exc).__name__}: {exc}"


def _child_main(
    conn: Connection,
    proto: bytes,
    directory: Path,
    version_dir: Path,
    settings: OnnxRuntimeConfig,
    log_level: int,
) -> None:
    """The worker process: load the model, then serve requests until asked to exit."""
    # The parent ends the worker after draining its requests; a SIGTERM or SIGINT sent to the
    # whole group (systemd's stop, Ctrl-C) must not cut them short. If the parent dies, the
    # pipe's EOF ends the worker.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = ModelConfig(pb.ModelConfig.FromString(proto), directory)
    _name_process(f"edged-worker {config.name}/{version_dir.name}", config.name)
    sender = _Sender(conn)
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(sender)]  # type: ignore[arg-type]
    root.setLevel(log_level)
    asyncio.run(_serve(conn, sender, config, version_dir, settings))
    # The exit gives every byte back; finalising the interpreter and ONNX Runtime's statics
    # first would only add ~200 ms to each unload.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _serve(
    conn: Connection,
    sender: _Sender,
    config: ModelConfig,
    version_dir: Path,
    settings: OnnxRuntimeConfig,
) -> None:
    threads = ThreadPoolExecutor(config.instance_count, thread_name_prefix="infer")
    runtime = OnnxRuntime(config, version_dir, settings, threads)
    try:
        await runtime.load()
    except Exception as exc:  # every failure goes back as the load's reason
        sender.send(("failed", *_error_of(exc, config.name)))
        return
    sender.send(("loaded", runtime.metadata()))
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Message | None] = asyncio.Queue()
    threading.Thread(target=_receive, args=(conn, loop, inbox), daemon=True).start()
    running: set[asyncio.Task[None]] = set()
    while (message := await inbox.get()) is not None and message[0] == "infer":
        task = asyncio.create_task(_run(runtime, sender, *message[1:]))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running)
    await runtime.unload()
    threads.shutdown()


def _receive(
    conn: Connection, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[Message | None]
) -> None:
    while True:
        try:
            message: Message | None = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed the pipe or died
            message = None
        loop.call_soon_threadsafe(inbox.put_nowait, message)
        if message is None or message[0] != "infer":
            return


async def _run(
    runtime: OnnxRuntime,
    sender: _Sender,
    request: int,
    inputs: Tensors,
    parameters: dict[str, Any],
) -> None:
    try:
        reply: Message = ("done", request, await runtime.infer(inputs, parameters))
    except Exception as exc:  # the caller gets every failure, mapped
        reply = ("error", request, *_error_of(exc, runtime.config.name))
    try:
        sender.send(reply)
    except OSError:  # the parent is gone; the loop ends at the reader's EOF
        pass
    except Exception as exc:  # outputs that cannot be pickled
        error = f"model '{runtime.config.name}' cannot return its outputs: {exc!r}"
        with contextlib.suppress(OSError):
            sender.send(("error", request, "", error))

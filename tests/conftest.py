"""Fixtures that start real edged daemons on real Unix sockets, and stop them by PID."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis  # (imported here, at collection: its pytest plugin would import it
import pytest  # at the summary, where CPython 3.11's compiler can trip over threads still running)

from bench.peer import Peer, ensure_venv, start_peer
from bench.triton_peer import ensure_triton, start_triton
from edged.client import Client, ClientError
from tests import asunit
from tests.faultproxy import FaultProxy
from tests.mosquitto import Broker, make_pki

# make mutation (tests/mutation/run.py sets EDGED_MUTATION=1): each mutant runs its module's
# unit tests, so their properties try fewer examples, the same ones every run (a score that
# does not drift); a test that asks for many asks through examples()
MUTATION = os.environ.get("EDGED_MUTATION") == "1"
hypothesis.settings.register_profile(
    "mutation", max_examples=100, derandomize=True, deadline=None, database=None
)
if MUTATION:
    hypothesis.settings.load_profile("mutation")


def examples(wanted: int) -> int:
    """A property's example count: ``wanted``, or at most 300 under make mutation."""
    return min(wanted, 300) if MUTATION else wanted


ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
CLOUD_MODEL = "intent-classifier"  # what the cloud tier serves in tests
CLOUD_MODEL_B = "intent-classifier-b"  # the same model under another name: arm b of an A/B
ANSWER_MODEL = "kb-answer"  # and its question-answering model (bench/peer.py ANSWER_RUNTIME)
SPEECH_MODEL = "transcribe"  # an open-vocabulary recogniser (bench/peer.py SPEECH_RUNTIME)


def require_models() -> None:
    """The default repository must be built (make test does it); fail loudly otherwise."""
    if not (MODELS / "text-encoder" / "1" / "model.onnx").is_file():
        pytest.fail("the default model repository is not built: run `make models` first")


def unseen_intents() -> list[dict[str, str]]:
    """Sentences of each intent label that models/intents.tsv does not have (a check of the
    shipped model on text it never saw), as ``{"label", "text"}`` rows."""
    path = Path(__file__).parent / "intents-unseen.tsv"
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    known = {line.split("\t", 1)[-1].strip().lower() for line in (MODELS / "intents.tsv").open()}
    assert not [r["text"] for r in rows if r["text"].lower() in known], "seen sentences"
    return rows


def skip_or_fail(reason: str) -> None:
    """Skip with the reason printed; under CI (``CI`` set) a missing part is a failure instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)")
    pytest.skip(reason)


def wait_for(
    condition: object, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait for a condition (a callable returning truthy), failing with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"edged exited with {proc.returncode} while waiting for {what}")
        try:
            if condition():  # type: ignore[operator]
                return
        except ClientError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Daemon:
    """One edged process with its own socket, state dir and log file, run as edged.service runs
    it (tests/asunit.py: a user of its own, the unit's umask and descriptor limit) unless
    ``as_unit`` is false: a test about root says so. A repository of the test's own is the
    daemon's, as /var/lib/edged/models is edged's; the default one is only read."""

    def __init__(
        self,
        workdir: Path,
        models: Path = MODELS,
        config: str = "",
        flags: tuple[str, ...] = (),
        as_unit: bool = True,
        python: str = sys.executable,
    ) -> None:
        self.workdir = workdir
        self.flags = flags
        self.account = asunit.account() if as_unit else None
        self.python = python
        self.socket = workdir / "edged.sock"
        self.models = models
        self.log = workdir / "edged.log"
        self.config = workdir / "edged.toml"
        self.config.write_text(config)
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "edged",
            "--config",
            str(self.config),
            "--socket",
            str(self.socket),
            "--state-dir",
            str(self.workdir / "state"),
            "--models",
            str(self.models),
            *self.flags,
        ]

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> Daemon:
        unit: dict[str, Any] = {}
        if self.account is not None:
            self.log.touch()
            self.account.own(self.workdir)
            if self.models.resolve() != MODELS:
                self.account.own(self.models)  # links into the default one stay root's
            asunit.reachable(self.models)
            unit = self.account.popen()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                **unit,
            )
        if wait:
            self.wait_ready()
        return self

    def give(self, *paths: Path) -> None:
        """Paths the test hands to edged (a directory for its socket, a disk): its user's, as
        the package makes /run/edged and /var/lib/edged edged's."""
        if self.account is not None:
            for path in paths:
                self.account.own(path)

    @property
    def client(self) -> Client:
        return Client(str(self.socket), timeout=60)

    def wait_ready(self, timeout: float = 120) -> None:
        wait_for(lambda: self.socket.exists() and self.client.ready(), timeout, "READY", self.proc)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (SIGKILL if it does not stop in time)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            raise AssertionError(
                f"edged did not stop within {timeout} s; log:\n{self.logs()}"
            ) from None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def make_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type[Daemon]]:
    """Build daemons for one test; each is stopped by PID at the end."""
    started: list[Daemon] = []

    class Tracked(Daemon):
        def __init__(
            self,
            models: Path = MODELS,
            config: str = "",
            flags: tuple[str, ...] = (),
            as_unit: bool = True,
            python: str = sys.executable,
        ) -> None:
            super().__init__(
                tmp_path_factory.mktemp("edged"), models, config, flags, as_unit, python
            )
            started.append(self)

    yield Tracked
    for daemon in started:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One edged serving the default repository for the whole session."""
    require_models()
    workdir = tmp_path_factory.mktemp("edged-session")
    proc = Daemon(workdir, config="[server]\nmax_request_bytes = 8388608\n")
    try:
        proc.start()
    except BaseException:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
        raise
    yield proc
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="session")
def client(daemon: Daemon) -> Client:
    """A client of the session daemon."""
    return daemon.client


def linked_repository(target: Path, names: list[str] | None = None) -> Path:
    """A repository whose models are symlinks into the default one (cheap to alter per test)."""
    require_models()
    target.mkdir(parents=True, exist_ok=True)
    for model in sorted(MODELS.iterdir()):
        if (model / "config.pbtxt").is_file() and (names is None or model.name in names):
            (target / model.name).symlink_to(model, target_is_directory=True)
    return target


def copy_model(repository: Path, name: str) -> Path:
    """Replace a linked model with a real copy that the test may damage."""
    link = repository / name
    link.unlink()
    shutil.copytree(MODELS / name, link)
    return link


# ---- the cloud tier: Triton on loopback, behind a fault-injecting proxy ----------------------


@dataclass
class Cloud:
    peer: Peer
    proxy: FaultProxy
    journal: Path
    faults: Path

    def seen(self) -> list[dict[str, Any]]:
        """Every request the cloud server saw (its own journal)."""
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines() if line]

    def fail_every(
        self,
        n: int,
        status: int = 500,
        delay_s: float = 0.0,
        models: list[str] | None = None,
        flatten: bool = False,
    ) -> None:
        """The server fails one call in ``n`` (0: none) with ``status``, each after ``delay_s``;
        ``flatten``: its answers are uniform (unsure); ``models``: only calls of these
        (default: all)."""
        faults: dict[str, Any] = {
            "fail_every": n,
            "status": status,
            "delay_s": delay_s,
            "flatten": flatten,
        }
        if models is not None:
            faults["models"] = models
        self.faults.write_text(json.dumps(faults))


# the cloud of the cloud-tier tests: Triton Inference Server itself (the brief's cloud), or
# MLServer (EDGED_TEST_CLOUD=mlserver: the cloud of the suite before issue 46)
CLOUD_SERVER = os.environ.get("EDGED_TEST_CLOUD", "triton")


def start_cloud(server: str, work: Path) -> Cloud:
    """``server`` ("triton" or "mlserver") serving the cloud model, its B arm, the answer and
    speech models, with the journal and the faults; a fault proxy in front of its REST port."""
    try:
        venv = ensure_triton() if server == "triton" else ensure_venv()
    except (RuntimeError, OSError) as exc:
        skip_or_fail(f"cannot install {server} for the cloud tier: {exc}")
    journal, faults = work / "journal.jsonl", work / "faults.json"
    served = {"answer_model": ANSWER_MODEL, "speech_model": SPEECH_MODEL}
    if server == "triton":
        models = {CLOUD_MODEL: MODELS / CLOUD_MODEL, CLOUD_MODEL_B: MODELS / CLOUD_MODEL}
        peer = start_triton(venv, models, work / "triton", journal=journal, faults=faults, **served)
    else:
        onnx = MODELS / CLOUD_MODEL / "1" / "model.onnx"
        peer = start_peer(
            venv,
            onnx,
            CLOUD_MODEL,
            work / "mlserver",
            journal=journal,
            faults=faults,
            more_models={CLOUD_MODEL_B: onnx},
            **served,
        )
    return Cloud(
        peer, FaultProxy("127.0.0.1", int(peer.http_url.rsplit(":", 1)[1])), journal, faults
    )


@pytest.fixture(scope="session")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """The cloud tier of the tests (CLOUD_SERVER), on loopback behind a fault proxy."""
    found = start_cloud(CLOUD_SERVER, tmp_path_factory.mktemp("cloud"))
    try:
        yield found
    finally:
        found.proxy.close()
        found.peer.stop()


@pytest.fixture(scope="session")
def triton(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cloud]:
    """Triton Inference Server itself (bench/triton_peer.py: 2.51.0 from nvidia-pytriton's
    wheel, in a venv of the system's Python): the cloud when it is Triton, else one of its own
    (no MLServer started for it)."""
    if CLOUD_SERVER == "triton":
        yield request.getfixturevalue("cloud")
        return
    found = start_cloud("triton", tmp_path_factory.mktemp("triton"))
    try:
        yield found
    finally:
        found.proxy.close()
        found.peer.stop()


def answer_model_config(cloud: Cloud) -> str:
    """edged's config lines for the tests' cloud as its cloud tier and its answer model."""
    return (
        f'[cloud]\nurl = "http://{cloud.proxy.address}"\n[[cloud.models]]\n'
        f'name = "{ANSWER_MODEL}"\n[knowledge]\nanswer_model = "{ANSWER_MODEL}"\n'
    )


@pytest.fixture
def faults_cleared(cloud: Cloud) -> Iterator[Cloud]:
    cloud.proxy.restore()
    cloud.fail_every(0)
    yield cloud
    cloud.proxy.restore()
    cloud.fail_every(0)


class LoopThread:
    """A server on its own asyncio loop in a thread of the test process: ``_serve`` starts it,
    ``_close`` stops it."""

    def start(self) -> Any:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._main, args=(started,), daemon=True).start()
        assert started.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        started.set()
        self.loop.run_forever()
        self.loop.close()

    async def _serve(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError


@pytest.fixture(scope="session")
def postgres_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real PostgreSQL for the session's store-level tests (each takes a new database)."""
    from tests.postgres import Postgres

    why = Postgres.available()
    if why:
        skip_or_fail(why)
    server = Postgres(tmp_path_factory.mktemp("pg")).start()
    yield server
    server.stop()


# ---- the fleet's fixtures: a real Mosquitto with the fleet's PKI, cloudsync as a process ----
# (the agent's class imported in its fixture: tests/cloudsync_agent.py imports this module)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fleet's PKI for nodes n1 and n2 and the operator (a module's own where it needs
    others)."""
    why = Broker.available()
    if why:
        skip_or_fail(why)
    return make_pki(tmp_path_factory.mktemp("pki"), ["n1", "n2"])


@pytest.fixture
def broker(tmp_path: Path, pki: Path) -> Iterator[Broker]:
    """A Mosquitto of the test's own (not started: ``broker.start()``), killed after it."""
    server = Broker(tmp_path / "mosquitto", pki)
    yield server
    server.kill()


@pytest.fixture
def agent(tmp_path: Path, broker: Broker) -> Iterator[Any]:
    """cloudsync for node n1 of that broker (not started: ``agent.start()``), killed after."""
    from tests.cloudsync_agent import Agent

    made = Agent(tmp_path / "agent", broker)
    yield made
    if made.proc is not None and made.proc.poll() is None:
        made.proc.kill()
        made.proc.wait()

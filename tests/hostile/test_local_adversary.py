"""Issue 21, item 4: a local caller who is not admin reaches no admin control, on either socket.

A real edged whose REST and gRPC sockets are mode 0666 in a world-traversable directory, so
that uid 65534 can connect and every refusal seen is edged's own, not the file mode's. As uid
65534 (``setpriv``) a probe calls every ``/v1/admin`` endpoint, repository load and unload over
REST, and RepositoryModelLoad/Unload and an infer over gRPC with tritonclient; each must be
refused (403 / PERMISSION_DENIED, naming what is needed) and nothing may change. Also: admin
lists left empty no longer mean "everyone", SIGHUP applies changed lists on both transports,
and an install takes only regular files from edged's own staging directory and never deletes a
directory outside it.

Before this was fixed: with the admin lists empty everyone was admin; repository load/unload had
no admin check; the gRPC socket applied neither ``allowed_*`` nor admin; SIGHUP did not re-read
the admin lists; an install accepted a version with a symlink to /etc, and one given the hashes
of any directory edged could rename moved it in and deleted it when it failed to load.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudsync.protocol.manifest import file_entry
from edged.client import ClientError
from tests.asunit import owned_like
from tests.conftest import ROOT, Daemon, wait_for
from tests.modelfiles import add_model, scale_model

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
MODEL = "scale"
SOCKETS = '[server]\nsocket_mode = "0666"\n'
X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}

# Run as uid 65534: each action over REST or gRPC, what came back as JSON.
PROBE = """
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from edged.client import Client

rest_path, grpc_path, actions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rest = Client(rest_path, timeout=30)
triton = grpcclient.InferenceServerClient(url="unix://" + grpc_path)
seen = []
for action in actions:
    if action[0] == "rest":
        _, method, path, doc = action
        body = json.dumps(doc).encode() if doc is not None else None
        status, _, payload = rest.request(method, path, body, {"Content-Type": "application/json"})
        seen.append([status, payload.decode(errors="replace")])
        continue
    _, op, model = action
    try:
        if op == "live":
            triton.is_server_live()
        elif op == "infer":
            x = grpcclient.InferInput("x", [1, 2], "FP32")
            x.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
            triton.infer(model, [x])
        elif op == "load":
            triton.load_model(model)
        elif op == "unload":
            triton.unload_model(model)
        elif op == "index":
            triton.get_model_repository_index()
        elif op == "stats":
            triton.get_inference_statistics(model)
        elif op == "stream":
            import queue
            got = queue.Queue()
            triton.start_stream(callback=lambda result, error: got.put(error))
            x = grpcclient.InferInput("x", [1, 2], "FP32")
            x.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
            try:
                triton.async_stream_infer(model, [x])
            except InferenceServerException:
                pass  # the stream ended already: its callback has why
            error = got.get(timeout=30)
            triton.stop_stream()
            if error is not None:
                raise error
        seen.append(["OK", ""])
    except InferenceServerException as exc:
        seen.append([str(exc.status()).rsplit(".", 1)[-1], exc.message()])
print(json.dumps(seen))
"""

ADMIN_CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/v1/admin/routing", None),
    ("PATCH", "/v1/admin/routing", {"local_threshold_ms": 1}),
    ("DELETE", "/v1/admin/routing", None),
    ("POST", "/v1/admin/reload", None),
    ("POST", "/v1/admin/drain", {"reason": "mine now", "timeout_s": 1}),
    ("POST", "/v1/admin/resume", None),
    ("GET", f"/v1/admin/models/{MODEL}", None),
    ("DELETE", f"/v1/admin/models/{MODEL}", None),
    ("POST", f"/v1/admin/models/{MODEL}/install", {"version": 2, "source": "/tmp", "files": []}),
    ("POST", f"/v1/admin/models/{MODEL}/activate", {"version": 1}),
    ("POST", f"/v1/admin/models/{MODEL}/rollback", None),
    ("PUT", f"/v1/admin/cloud/{MODEL}/ab", {"b_cloud_name": "x", "b_share": 0.5}),
    ("POST", f"/v1/admin/cloud/{MODEL}/ab/scores", {"scores": [{"request_id": "r", "score": 1}]}),
    ("GET", "/v1/admin/egress", None),  # who sent what, when
    ("GET", "/v1/admin/egress/verify", None),
    ("POST", f"/v2/repository/models/{MODEL}/unload", None),
    ("POST", f"/v2/repository/models/{MODEL}/load", None),
    ("GET", "/v1/events?after=0", None),  # the daemon's log lines
]


class Public(Daemon):
    """A daemon in a world-traversable directory (pytest's are root's only)."""

    @property
    def grpc_socket(self) -> Path:
        return self.socket.with_name("edged-grpc.sock")

    @property
    def staging(self) -> Path:
        return self.workdir / "state" / "staging"

    def as_nobody(
        self, actions: list[list[Any]], groups: tuple[int, ...] = ()
    ) -> list[list[str | int]]:
        """uid 65534 (gid 65534, with these supplementary ``groups``) makes the calls."""
        who = NOBODY if not groups else [*NOBODY[:-1], f"--groups={','.join(map(str, groups))}"]
        probe = subprocess.run(
            [
                *who,
                sys.executable,
                "-c",
                PROBE,
                str(self.socket),
                str(self.grpc_socket),
                json.dumps(actions),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert probe.returncode == 0, probe.stderr
        seen: list[list[str | int]] = json.loads(probe.stdout)
        return seen

    def reloads(self) -> int:
        return self.logs().count("reloaded the configuration")

    def hup(self, config: str) -> None:
        """A new config file, then SIGHUP; returns once the reload is done."""
        before = self.reloads()
        self.config.write_text(config)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: self.reloads() > before, 30, "the reload", self.proc)

    def model_ready(self) -> bool:
        return self.client.request("GET", f"/v2/models/{MODEL}/ready")[0] == 200


@pytest.fixture
def public() -> Iterator[type[Public]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    top = Path(tempfile.mkdtemp(prefix="edged-adversary-"))
    top.chmod(0o755)
    started: list[Public] = []

    class Made(Public):
        def __init__(self, config: str) -> None:
            work = Path(tempfile.mkdtemp(dir=top))
            work.chmod(0o755)
            repository = work / "models"
            add_model(repository, MODEL, {1: 1.0})
            super().__init__(work, repository, config)
            started.append(self)

    try:
        yield Made
    finally:
        for daemon in started:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()
        shutil.rmtree(top, ignore_errors=True)


def refusal_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.logs().splitlines() if "refused" in line]


def test_nobody_reaches_no_admin_call_on_either_socket_with_the_admin_lists_left_empty(
    public: type[Public],
) -> None:
    daemon = public(SOCKETS).start()
    admin_json = daemon.workdir / "state" / "admin.json"
    before = admin_json.read_bytes() if admin_json.exists() else None
    actions: list[list[Any]] = [["rest", m, p, d] for m, p, d in ADMIN_CALLS]
    actions += [["grpc", "unload", MODEL], ["grpc", "load", MODEL]]
    # not admin calls: allowed (the allowed lists are empty)
    actions += [["rest", "GET", "/v2/health/ready", None], ["grpc", "infer", MODEL]]
    seen = daemon.as_nobody(actions)
    for (kind, *what), (status, message) in zip(actions[:-2], seen[:-2]):
        expected = 403 if kind == "rest" else "PERMISSION_DENIED"
        assert status == expected, (what, status, message)
        assert "uid 65534" in str(message) and "admin needs uid 0" in str(message), message
        assert "group edged-admin" in str(message), message
    assert seen[-2][0] == 200 and seen[-1][0] == "OK", seen[-2:]
    # nothing changed
    client = daemon.client
    assert daemon.model_ready()
    assert client.status()["drained"] is None
    assert client.routing()["overrides"] == {}
    assert client.model_versions(MODEL)["on_disk"] == [1]
    assert (admin_json.read_bytes() if admin_json.exists() else None) == before
    # refusals are WARNINGs, rate-limited: not a line per request, never an ERROR
    lines = refusal_lines(daemon)
    assert 1 <= len(lines) <= 3, lines
    assert "ERROR" not in daemon.logs() and "Traceback" not in daemon.logs()
    # root is admin, and the lists set explicitly keep working
    # (tests/integration/edged/test_admin.py)
    client.unload(MODEL)
    assert not daemon.model_ready()
    client.load(MODEL)
    assert daemon.model_ready()
    assert daemon.stop() == 0


def test_the_allowed_lists_hold_on_the_grpc_socket_too(public: type[Public]) -> None:
    daemon = public(SOCKETS + "allowed_uids = [0]\n").start()
    actions: list[list[Any]] = [
        ["rest", "GET", "/v2/health/live", None],
        ["rest", "POST", f"/v2/models/{MODEL}/infer", X],
        ["grpc", "live", ""],
        ["grpc", "infer", MODEL],
        ["grpc", "index", ""],
        ["grpc", "unload", MODEL],
        ["grpc", "stream", MODEL],
        ["grpc", "stats", MODEL],
    ]
    seen = daemon.as_nobody(actions)
    for (kind, *what), (status, message) in zip(actions, seen):
        assert status == (403 if kind == "rest" else "PERMISSION_DENIED"), (what, status, message)
        assert "uid 65534" in str(message) and "server.allowed_uids" in str(message), message
    assert daemon.model_ready()
    assert daemon.client.infer_json(MODEL, X)["outputs"][0]["data"] == [1.0, 2.0]
    assert daemon.stop() == 0


def test_sighup_applies_changed_lists_on_both_sockets(public: type[Public]) -> None:
    daemon = public(SOCKETS + "allowed_uids = [0]\n").start()
    assert [s[0] for s in daemon.as_nobody([["grpc", "infer", MODEL]])] == ["PERMISSION_DENIED"]

    daemon.hup(SOCKETS + "allowed_uids = [0, 65534]\nadmin_uids = [65534]\n")
    seen = daemon.as_nobody(
        [
            ["rest", "GET", "/v2/health/live", None],
            ["grpc", "infer", MODEL],
            ["grpc", "unload", MODEL],
        ]
    )
    assert [s[0] for s in seen] == [200, "OK", "OK"], seen
    assert not daemon.model_ready()
    seen = daemon.as_nobody([["rest", "POST", f"/v2/repository/models/{MODEL}/load", None]])
    assert seen[0][0] == 200, seen
    assert daemon.model_ready()

    daemon.hup(SOCKETS + "allowed_uids = [0, 65534]\nadmin_uids = []\n")
    seen = daemon.as_nobody(
        [
            ["rest", "POST", f"/v2/repository/models/{MODEL}/unload", None],
            ["rest", "POST", "/v1/admin/drain", None],
            ["grpc", "unload", MODEL],
            ["grpc", "infer", MODEL],
        ]
    )
    assert [s[0] for s in seen] == [403, 403, "PERMISSION_DENIED", "OK"], seen
    assert daemon.model_ready() and daemon.client.status()["drained"] is None

    daemon.hup(SOCKETS + "allowed_uids = [0]\n")
    seen = daemon.as_nobody([["rest", "GET", "/v2/health/live", None], ["grpc", "live", ""]])
    assert [s[0] for s in seen] == [403, "PERMISSION_DENIED"], seen
    assert daemon.stop() == 0


def test_a_supplementary_group_makes_an_admin_on_both_sockets(public: type[Public]) -> None:
    """Admin by a group the caller holds besides its primary one (SO_PEERGROUPS): listed in
    admin_gids, or named by admin_group."""
    try:
        users = grp.getgrnam("users").gr_gid
    except KeyError:
        pytest.skip("no group 'users' here")
    daemon = public(SOCKETS + 'admin_gids = [4243]\nadmin_group = "users"\n').start()
    unload = [["rest", "POST", f"/v2/repository/models/{MODEL}/unload", None]]
    load = [["grpc", "load", MODEL]]
    seen = daemon.as_nobody(unload + load)  # no extra group: not admin
    assert [s[0] for s in seen] == [403, "PERMISSION_DENIED"], seen
    for groups in ((4243,), (users,)):
        seen = daemon.as_nobody(unload, groups)
        assert seen[0][0] == 200, (groups, seen)
        assert not daemon.model_ready()
        seen = daemon.as_nobody(load, groups)
        assert seen[0][0] == "OK", (groups, seen)
        assert daemon.model_ready()
    assert daemon.stop() == 0


# ---- installs -------------------------------------------------------------------------------


def _hardlink(directory: Path, outside: Path) -> None:
    os.link(outside, directory / "weights.bin")


def _fifo(directory: Path, outside: Path) -> None:
    os.mkfifo(directory / "pipe")


def _symlink_dir(directory: Path, outside: Path) -> None:
    (directory / "etc").symlink_to("/etc", target_is_directory=True)


def _symlink_file(directory: Path, outside: Path) -> None:
    (directory / "notes.txt").symlink_to(outside)


@pytest.mark.parametrize(
    ("plant", "listed", "says"),
    [
        (_symlink_dir, None, "'etc' is a symbolic link"),
        (_symlink_file, "notes.txt", "'notes.txt' is a symbolic link"),
        (_fifo, None, "'pipe' is not a regular file"),
        (_hardlink, "weights.bin", "'weights.bin' has 2 links"),
    ],
)
def test_an_install_takes_only_regular_files(
    public: type[Public], plant: Any, listed: str | None, says: str
) -> None:
    daemon = public("").start()
    outside = daemon.workdir / "outside.bin"
    outside.write_bytes(b"secret " * 100)
    daemon.staging.mkdir(parents=True, exist_ok=True)
    staged = daemon.staging / f"{MODEL}-2"
    scale_model(staged / "model.onnx", 2.0)
    plant(staged, outside)
    files = [file_entry(staged / "model.onnx")]
    if listed is not None:  # listed with the right hash: the kind of file is what is refused
        files.append({**file_entry(outside), "path": listed})
    with pytest.raises(ClientError) as refused:
        daemon.client.install(MODEL, 2, str(staged), files)
    assert refused.value.status == 400 and says in refused.value.message, refused.value
    assert not (daemon.models / MODEL / "2").exists()
    assert daemon.client.model_versions(MODEL)["on_disk"] == [1]
    assert outside.read_bytes() == b"secret " * 100
    assert daemon.stop() == 0


def test_an_install_from_outside_the_staging_directory_is_refused_and_deletes_nothing(
    public: type[Public],
) -> None:
    daemon = public("").start()
    client = daemon.client
    staging = daemon.staging
    staging.mkdir(parents=True, exist_ok=True)  # cloudsync makes it when edged has not yet
    # a directory edged can rename, that is not a model version: its hashes given
    victim = daemon.workdir / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious\n")
    owned_like(daemon.workdir, victim)
    files = [file_entry(victim / "data.txt")]
    sources = [
        str(victim),
        str(staging / ".." / "victim"),  # out by ..
        f"{staging}/../../victim",
        "victim",  # relative
    ]
    (staging / "link").symlink_to(victim, target_is_directory=True)  # out by a symlink
    sources.append(str(staging / "link"))
    for source in sources:
        with pytest.raises(ClientError) as refused:
            client.install(MODEL, 2, source, files)
        assert refused.value.status == 400, (source, refused.value)
        assert "staging directory" in refused.value.message, (source, refused.value)
        assert (victim / "data.txt").read_text() == "precious\n", source
        assert not (daemon.models / MODEL / "2").exists(), source
    assert client.model_versions(MODEL)["on_disk"] == [1]
    # the same version staged where edged takes it from: installed
    staged = staging / f"{MODEL}-2"
    scale_model(staged / "model.onnx", 2.0)
    owned_like(staging, staged)  # as cloudsync stages it, as edged's user
    client.install(MODEL, 2, str(staged), [file_entry(staged / "model.onnx")])
    assert client.infer_json(MODEL, X)["outputs"][0]["data"] == [2.0, 4.0]
    assert victim.is_dir() and not staged.exists()
    assert stat.S_IMODE(staging.stat().st_mode) == 0o700  # edged's own, made at start
    assert daemon.stop() == 0

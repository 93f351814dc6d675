"""Issue 44, point 8: system shared memory holds nothing for a process that has no region left,
and one uid cannot take every region.

A real edged (as its unit runs it: 1,024 descriptors) with Triton's system shared memory. Many
processes each register a region and unregister it, then stay idle: edged must hold no pidfd
for any of them, and its descriptors must come back to where they were. Processes that register
and exit without unregistering leave nothing either. As uid 65534 (``setpriv``) a caller
registers regions until it is refused: at ``server.shm_regions_per_uid`` (16 of the 64), with a
400 (INVALID_ARGUMENT on gRPC) that names the limit and the setting, while root and another uid
still register.

Before this was fixed: a pidfd per process stayed open from its first registration until it
exited, whether it still had a region or not (1,100 idle processes took edged to 1,022 of its
1,024 descriptors), and one uid could register all 64 regions, so root was refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import asunit
from tests.conftest import ROOT, Daemon, skip_or_fail
from tests.hostile.test_local_adversary import SOCKETS, Public, public  # noqa: F401
from tests.modelfiles import add_model

IDLE = 300  # processes that register, unregister and stay: each held a pidfd before the fix
EXITING = 10  # processes that register and exit without unregistering
JSON = {"Content-Type": "application/json"}

# Forks ``count`` processes one after another; each registers region r<i> over REST, unregisters
# it (mode "unregister", then stays idle until stdin closes) or exits at once (mode "exit").
# Prints each process's statuses (or what went wrong) as one JSON line once all have reported.
CYCLES = """
import json, os, sys
from edged.client import Client

rest, key, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
seen, children = [], []
for i in range(count):
    report, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report)
        os.close(1)  # only the parent answers: the test's read ends if it does
        statuses = []
        try:
            client = Client(rest, timeout=30)
            body = json.dumps({"key": key, "offset": 0, "byte_size": 16}).encode()
            statuses.append(client.request(
                "POST", f"/v2/systemsharedmemory/region/r{i}/register", body,
                {"Content-Type": "application/json"})[0])
            if mode == "unregister":
                statuses.append(client.request(
                    "POST", f"/v2/systemsharedmemory/region/r{i}/unregister")[0])
        except Exception as exc:
            statuses.append(repr(exc))
        os.write(told, json.dumps(statuses).encode())
        os.close(told)
        if mode == "unregister":
            sys.stdin.read()  # idle, its connection closed, until the test lets it go
        os._exit(0)
    os.close(told)
    with os.fdopen(report) as answer:
        seen.append(json.loads(answer.read() or '["no report"]'))
    children.append(pid)
print(json.dumps(seen), flush=True)
sys.stdin.read()
for pid in children:
    os.waitpid(pid, 0)
"""

# As another uid: registers regions q0, q1, ... of a key until refused (at most ``most``); prints
# how many it registered, the REST refusal and the gRPC one for one more, then holds them until
# stdin closes (a process's regions go when it exits).
FILL = """
import json, sys
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from edged.client import Client

rest, grpc_path, key, most = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = Client(rest, timeout=30)
body = json.dumps({"key": key, "offset": 0, "byte_size": 16}).encode()
registered, refused = 0, None
for i in range(most):
    status, _, answer = client.request(
        "POST", f"/v2/systemsharedmemory/region/q{i}/register", body,
        {"Content-Type": "application/json"})
    if status != 200:
        refused = [status, json.loads(answer)["error"]]
        break
    registered += 1
try:
    grpcclient.InferenceServerClient("unix://" + grpc_path).register_system_shared_memory(
        "one-more", key, 16)
    grpc_refused = ["OK", ""]
except InferenceServerException as exc:
    grpc_refused = [str(exc.status()).rsplit(".", 1)[-1], exc.message()]
print(json.dumps([registered, refused, grpc_refused]), flush=True)
sys.stdin.read()  # holding its regions until the test lets go
"""


@pytest.fixture
def shm_key() -> Iterator[str]:
    """A 4 KiB file in /dev/shm that edged's user may open (its group, or mode 0666) and any
    caller may read: the tests are about how many registrations, not about modes."""
    name = f"edged_quota_{os.getpid()}"
    path = Path("/dev/shm") / name
    path.write_bytes(bytes(4096))
    os.chmod(path, 0o666)
    account = asunit.account()  # edged's user in these tests (None: whoever runs them)
    if account is not None:
        os.chown(path, -1, account.gid)
    yield f"/{name}"
    path.unlink()


def descriptors(pid: int) -> list[str]:
    """What each of the process's descriptors is (``/proc/PID/fd``'s links)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def pidfds(pid: int) -> int:
    return sum(1 for target in descriptors(pid) if target == "anon_inode:[pidfd]")


def settled(pid: int, held: int, timeout: float = 30) -> tuple[int, int]:
    """(descriptors, pidfds) once edged holds at most ``held`` descriptors and no pidfd, or as
    they are at ``timeout``: edged closes a connection's socket after its caller has."""
    deadline = time.monotonic() + timeout
    while True:
        now = (len(descriptors(pid)), pidfds(pid))
        if (now[0] <= held and now[1] == 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_processes_without_a_region_leave_edged_no_descriptor(
    make_daemon: type[Daemon], tmp_path: Path, shm_key: str
) -> None:
    repository = tmp_path / "models"
    add_model(repository, "scale", {1: 1.0})
    daemon = make_daemon(repository).start()
    assert daemon.proc is not None
    pid, rest, client = daemon.proc.pid, str(daemon.socket), daemon.client
    region = json.dumps({"key": shm_key, "offset": 0, "byte_size": 16}).encode()

    def call(what: str, name: str = "") -> int:
        path = (
            f"/v2/systemsharedmemory/region/{name}/{what}"
            if name
            else f"/v2/systemsharedmemory/{what}"
        )
        return client.request("POST", path, region if what == "register" else None, JSON)[0]

    assert client.request("GET", "/v2/systemsharedmemory/status")[0] == 200
    baseline = len(descriptors(pid))

    # many processes that registered and unregistered, alive and idle
    idle = subprocess.Popen(
        [sys.executable, "-c", CYCLES, rest, shm_key, str(IDLE), "unregister"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert idle.stdout is not None
        seen = json.loads(idle.stdout.readline())
        assert seen == [[200, 200]] * IDLE
        held, pids = settled(pid, baseline)
        print(
            f"{IDLE} idle processes that unregistered: edged holds {held} descriptors"
            f" ({pids} pidfds), {baseline} before them"
        )
        assert held <= baseline and pids == 0, (
            f"edged holds {held} descriptors, {pids} of them pidfds, for {IDLE} processes that"
            f" have no region; {baseline} before them"
        )
    finally:
        assert idle.stdin is not None
        idle.stdin.close()
        idle.wait(60)

    # this process (alive throughout): its pidfd stays while it has a region, not after
    assert call("register", "a") == 200 and call("register", "b") == 200
    assert pidfds(pid) == 1
    assert call("unregister", "a") == 200
    assert pidfds(pid) == 1  # "b" is still its
    assert call("unregister", "b") == 200
    assert pidfds(pid) == 0
    # its region unregistered by another process of the same uid: the pidfd goes too
    assert call("register", "c") == 200
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from edged.client import Client; "
            "print(Client(sys.argv[1]).request('POST', '/v2/systemsharedmemory/unregister')[0])",
            rest,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert other.stdout.strip() == "200", other.stderr
    assert pidfds(pid) == 0

    # processes that registered and exited without unregistering: their regions go, and the
    # pidfds that watched them
    gone = subprocess.run(
        [sys.executable, "-c", CYCLES, rest, shm_key, str(EXITING), "exit"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert gone.returncode == 0 and json.loads(gone.stdout) == [[200]] * EXITING, gone.stderr
    held, pids = settled(pid, baseline)
    assert held <= baseline and pids == 0, (held, pids, baseline)
    assert client.request("GET", "/v2/systemsharedmemory/status")[2] == b"[]"
    logs = daemon.logs()
    assert "ERROR" not in logs and "Traceback" not in logs, logs
    assert daemon.stop() == 0


@contextlib.contextmanager
def filled(daemon: Public, uid: int, key: str, most: int) -> Iterator[list[object]]:
    """As ``uid`` (its own group, no other), register until refused (see FILL); the process
    stays, holding its regions, until the block ends."""
    if shutil.which("setpriv") is None:
        skip_or_fail("another uid needs setpriv (util-linux)")
    probe = subprocess.Popen(
        [
            *asunit.setpriv(uid),
            sys.executable,
            "-c",
            FILL,
            str(daemon.socket),
            str(daemon.grpc_socket),
            key,
            str(most),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/"},
    )
    assert probe.stdin is not None and probe.stdout is not None and probe.stderr is not None
    try:
        line = probe.stdout.readline()
        assert line, probe.stderr.read()
        yield json.loads(line)
    finally:
        probe.stdin.close()
        probe.wait(60)


def test_one_uid_fills_its_quota_and_root_and_others_still_register(
    public: type[Public],  # noqa: F811
    shm_key: str,
) -> None:
    daemon = public(SOCKETS).start()  # the defaults: 64 regions, 16 a uid
    client = daemon.client
    body = json.dumps({"key": shm_key, "offset": 0, "byte_size": 16}).encode()
    message = (
        "uid 65534 has 16 shared-memory regions registered, as many as one uid may"
        " (server.shm_regions_per_uid = 16): unregister one first"
    )
    with filled(daemon, 65534, shm_key, most=64) as nobody:
        assert nobody == [16, [400, message], ["INVALID_ARGUMENT", message]]
        # while uid 65534 holds its 16: root is not starved, nor is another uid
        status, _, answer = client.request(
            "POST", "/v2/systemsharedmemory/region/roots/register", body, JSON
        )
        assert status == 200, answer
        with filled(daemon, 65533, shm_key, most=3) as another:
            assert another == [3, None, ["OK", ""]]
    assert client.request("POST", "/v2/systemsharedmemory/unregister")[0] == 200
    logs = daemon.logs()
    assert "ERROR" not in logs and "Traceback" not in logs, logs
    assert daemon.stop() == 0

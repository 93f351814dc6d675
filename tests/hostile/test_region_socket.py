"""Issue 46: the region socket, where a local caller gets a sealed memfd that edged reads in
place and calls models over (edged.server.regions), as a way in that an adversary uses.

A real edged as its unit runs it (its own user, 1,024 descriptors), its sockets mode 0666 in a
world-traversable directory so that uid 65534 (``setpriv``) reaches them and every refusal seen
is edged's own. uid 65534 gets a region, writes a tensor into it and has it read by REST, by
tritonclient over gRPC and by the region socket itself, the output written back into the
region; root does not see it, and it goes when its process exits. Garbage, a message past
64 KiB, deep nesting, unknown keys, sizes past the limit and descriptors sent to edged each get a
refusal naming the field, and leave edged no descriptor; an idle connection is closed after
``server.read_timeout_s``; the connection past 64 gets a 503; a caller not on
``server.allowed_uids`` gets a 403.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import pytest

from tests.conftest import ROOT, wait_for
from tests.hostile.test_local_adversary import MODEL, NOBODY, SOCKETS, Public, public  # noqa: F401
from tests.hostile.test_shm_quota import descriptors

# Run as uid 65534: a region of 16 bytes; x = [[1, 2]] written in it, read by REST (its output
# y placed at offset 8) and by gRPC; prints what came back, then waits for stdin to close.
NOBODY_REGION = """
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
from edged.client import Client

rest, grpc_path = sys.argv[1], sys.argv[2]
client = Client(rest, timeout=30)
region = client.shared_region("mine", 16)
region.array([1, 2], np.float32)[...] = [1.0, 2.0]
doc = {
    "inputs": [region.input("x", "FP32", [1, 2], 8)],
    "outputs": [{"name": "y", "parameters": {"shared_memory_region": "mine",
                 "shared_memory_byte_size": 8, "shared_memory_offset": 8}}],
}
answer = client.infer_json("scale", doc)
placed = region.array([1, 2], np.float32, offset=8).tolist()
triton = grpcclient.InferenceServerClient(url="unix://" + grpc_path)
x = grpcclient.InferInput("x", [1, 2], "FP32")
x.set_shared_memory("mine", 8)
by_grpc = triton.infer("scale", [x]).as_numpy("y").tolist()
listed = [r["name"] for r in client.call("GET", "/v2/systemsharedmemory/status")]
region.array([1, 2], np.float32)[...] = [3.0, 4.0]
doc = {"inputs": [region.input("x", "FP32", [1, 2], 8)], "outputs": [region.output("y", 8, 8)]}
over_socket = region.infer("scale", doc)
refused = []
for model, bad in (("scale", {"inputs": [region.input("x", "FP32", [1, 2], 8, 12)]}),
                   ("nothing-here", doc), ("", doc)):
    try:
        region.infer(model, bad)
    except Exception as exc:
        refused.append([exc.status, exc.message])
print(json.dumps([answer["outputs"][0]["parameters"], placed, by_grpc, listed,
                  over_socket["outputs"][0]["parameters"],
                  region.array([1, 2], np.float32, offset=8).tolist(), refused]), flush=True)
sys.stdin.read()
"""


def exchange(path: Any, message: bytes, fds: list[int] | None = None) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        if fds:
            socket.send_fds(sock, [message], fds)
        else:
            sock.send(message)
        reply, got, _, _ = socket.recv_fds(sock, 65536, 4)
        for fd in got:
            os.close(fd)
        answer: dict[str, Any] = json.loads(reply)
        answer["fds"] = len(got)
        return answer


def nothing_kept(pid: int, before: Counter[str], timeout: float) -> None:
    """Wait until edged holds no descriptor it did not hold at ``before``, naming any it keeps.
    Fewer is no leak: a connection of the start's readiness probe may have been open then."""
    try:
        wait_for(lambda: not Counter(descriptors(pid)) - before, timeout, "descriptors to go")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: kept {Counter(descriptors(pid)) - before}") from None


def regions_socket(daemon: Public) -> Any:
    return daemon.socket.with_name("edged-shm.sock")


def test_nobody_gets_a_region_edged_reads_in_place_and_root_does_not_see_it(
    public: type[Public],  # noqa: F811
) -> None:
    daemon = public(SOCKETS).start()
    pid = daemon.proc.pid if daemon.proc else 0
    before = Counter(descriptors(pid))
    child = subprocess.Popen(
        [*NOBODY, sys.executable, "-c", NOBODY_REGION, str(daemon.socket), str(daemon.grpc_socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/"},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        parameters, placed, by_grpc, listed, by_socket, placed_2, refused = json.loads(line)
        assert parameters == {"shared_memory_region": "mine", "shared_memory_byte_size": 8}
        assert placed == [[1.0, 2.0]] and by_grpc == [[1.0, 2.0]]  # the scale model's y = x
        assert listed == ["mine"]
        # the same over the region socket itself, with no HTTP
        assert by_socket == parameters and placed_2 == [[3.0, 4.0]]
        assert refused[0][0] == 400 and "offset 12 + 8 bytes is past its 16 bytes" in refused[0][1]
        assert refused[1][0] == 404 and "nothing-here" in refused[1][1]
        assert refused[2] == [400, "model: a model's name"]
        assert daemon.client.call("GET", "/v2/systemsharedmemory/status") == []  # root's view
        held = descriptors(pid)  # the mapping's and the pidfd
        assert held.count("/memfd:edged:mine (deleted)") == 1 and "anon_inode:[pidfd]" in held
    finally:
        child.communicate("", timeout=60)
    wait_for(lambda: "its 1 region(s) unregistered" in daemon.logs(), 30, "the region to go")
    # the gRPC relay keeps a pair whose caller left for EOF_GRACE_S (5 s) before closing it
    nothing_kept(pid, before, 30)
    assert "/memfd:edged:mine (deleted)" not in descriptors(pid)
    assert daemon.stop() == 0


HOSTILE: list[tuple[bytes, int, str]] = [
    (b"\xff\xfe garbage", 400, "not valid JSON"),
    (b"[1, 2]", 400, "one JSON object"),
    (b"[" * 4000, 400, "nested too deeply"),
    (b'{"a": NaN}', 400, "JSON has no NaN"),
    (b"{}" + b" " * 65536, 413, "at most 65536 bytes"),
    (json.dumps({"name": "a", "byte_size": 8, "fd": 3}).encode(), 400, "'fd': not a key here"),
    (json.dumps({"model": 5, "inputs": []}).encode(), 400, "model: a model's name"),
    (json.dumps({"model": "scale", "inputs": []}).encode(), 400, "non-empty 'inputs'"),
    (json.dumps({"name": "a/b", "byte_size": 8}).encode(), 400, "region name"),
    (json.dumps({"name": "a", "byte_size": 1 << 40}).encode(), 400, "byte_size: an integer"),
    (json.dumps({"name": "a", "byte_size": -1}).encode(), 400, "byte_size: an integer"),
    (json.dumps({"name": "a"}).encode(), 400, "byte_size: an integer"),
]


def test_garbage_and_descriptors_sent_to_edged_are_refused_and_leave_it_nothing(
    public: type[Public],  # noqa: F811
) -> None:
    daemon = public(SOCKETS + "read_timeout_s = 2\n").start()
    pid = daemon.proc.pid if daemon.proc else 0
    path = regions_socket(daemon)
    before = Counter(descriptors(pid))
    nulls = [os.open("/dev/null", os.O_RDONLY) for _ in range(32)]
    try:
        for message, status, says in HOSTILE:
            for fds in (None, nulls):  # descriptors passed along: closed by the kernel, unread
                reply = exchange(path, message, fds)
                assert reply["status"] == status and says in reply["error"], (message[:40], reply)
                assert reply["fds"] == 0
    finally:
        for fd in nulls:
            os.close(fd)
    made = exchange(path, json.dumps({"name": "ok", "byte_size": 4096}).encode(), nulls[:0])
    assert made == {"name": "ok", "byte_size": 4096, "key": "memfd:ok", "fds": 1}
    # its connection is closed; the region stays while the process that asked lives
    assert [r["name"] for r in daemon.client.call("GET", "/v2/systemsharedmemory/status")] == ["ok"]
    daemon.client.call("POST", "/v2/systemsharedmemory/region/ok/unregister")
    nothing_kept(pid, before, 10)
    # idle connections are closed after read_timeout_s; the one past 64 is told so
    held = []
    for _ in range(64):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(str(path))
        held.append(sock)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # told, and closed
            sock.settimeout(30)
            sock.connect(str(path))
            extra = json.loads(sock.recv(4096))
        assert extra["status"] == 503 and "64 connections are open" in extra["error"]
        started = time.monotonic()
        held[0].settimeout(30)
        assert held[0].recv(100) == b""  # closed by edged, idle
        assert 1 < time.monotonic() - started < 20
    finally:
        for sock in held:
            sock.close()
    assert exchange(path, b"{}")["status"] == 400  # and it serves the next
    assert "Traceback" not in daemon.logs()
    assert daemon.stop() == 0


def test_a_caller_that_reads_no_answer_is_dropped_and_its_regions_go(
    public: type[Public],  # noqa: F811
) -> None:
    daemon = public(SOCKETS).start()
    pid = daemon.proc.pid if daemon.proc else 0
    before = len(descriptors(pid))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(str(regions_socket(daemon)))
        sock.settimeout(30)
        sent = 0
        try:
            for i in range(100_000):  # answers pile up unread until edged gives up on it
                sock.send(json.dumps({"name": f"r{i % 8}", "byte_size": 64}).encode())
                sent += 1
        except OSError:
            pass
        assert sent < 100_000
    wait_for(lambda: len(descriptors(pid)) <= before + 8 * 2, 10, "the descriptors")
    assert daemon.client.ready()
    assert daemon.stop() == 0


def test_a_caller_off_the_allowed_list_is_refused(public: type[Public]) -> None:  # noqa: F811
    daemon = public(SOCKETS + "allowed_uids = [0]\n").start()
    probe = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.connect(sys.argv[1])\n"
        "s.send(json.dumps({'name': 'x', 'byte_size': 8}).encode())\n"
        "print(s.recv(4096).decode())\n"
    )
    done = subprocess.run(
        [*NOBODY, sys.executable, "-c", probe, str(regions_socket(daemon))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    reply = json.loads(done.stdout)
    assert reply["status"] == 403, done.stderr
    assert "uid 65534" in reply["error"] and "server.allowed_uids" in reply["error"]
    assert exchange(regions_socket(daemon), b'{"name": "root", "byte_size": 8}')["fds"] == 1
    assert daemon.stop() == 0


@pytest.mark.parametrize("config", ["shm_regions = 0\n"])
def test_no_region_socket_while_shared_memory_is_off(
    public: type[Public],  # noqa: F811
    config: str,
) -> None:
    daemon = public(SOCKETS + config).start()
    assert not regions_socket(daemon).exists()
    assert daemon.stop() == 0

"""Issue 21, item 2: no other local user can reach the knowledge store. A real edged with the
store in use (a private passage ingested, so Milvus Lite is open) must have no TCP socket in
LISTEN state in its process or its children, no Unix socket other than its own API sockets that
uid 65534 can connect to, and no store file or directory under the state directory that uid
65534 can read or list. Until Milvus Lite was put on a private Unix socket, any local user could
connect to its gRPC port on 127.0.0.1, list the collections, read a private passage and drop
the collection.

The daemon's work directory is made world-traversable (pytest's own are root's only, which
would hide everything from uid 65534 whatever edged does): the store must not rely on the modes
of the directories above it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pymilvus
import pytest

from edged.knowledge.store import Chunk, KnowledgeStore
from tests import asunit
from tests.conftest import Daemon, require_models

NOBODY = asunit.setpriv(65534)
LISTEN = "0A"  # /proc/net/tcp's st for TCP_LISTEN
ACCEPTCON = 0x00010000  # /proc/net/unix's Flags bit for a listening socket
SECRET = "The door code of the server room is 4417, changed every Monday."

# Run as uid 65534: try each target, print what happened to each as JSON.
PROBE = """
import json, os, socket, sys
targets = json.loads(sys.argv[1])
seen = {}
for kind, path in targets:
    try:
        if kind == "connect":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path.replace("@", "\\0", 1) if path.startswith("@") else path)
        elif kind == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        seen[path] = "ok"
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps(seen))
"""


@pytest.fixture
def edged() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    require_models()
    public = Path(tempfile.mkdtemp(prefix="edged-kb-listener-"))
    public.chmod(0o755)
    daemon = Daemon(public, config='[models]\nload = ["text-embedding"]\n')
    try:
        yield daemon.start()
        assert daemon.stop() == 0, daemon.logs()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        shutil.rmtree(public, ignore_errors=True)


def family(pid: int) -> list[int]:
    """The process and all its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        try:
            names = list(fds.iterdir())
        except OSError:
            continue
        for fd in names:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def tcp_listeners(pid: int, inodes: set[int]) -> list[str]:
    """``address:port (inode)`` of each listening TCP socket among ``inodes``."""
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN and inode in inodes:
                address, port = local.split(":")
                found.append(f"{table} {address}:{int(port, 16)} (inode {inode})")
    return found


def unix_listeners(pid: int, inodes: set[int]) -> list[str]:
    """Paths (``@name`` for the abstract namespace) of the named listening Unix sockets among
    ``inodes``; an unnamed one cannot be reached by name at all."""
    found = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        flags, inode = int(fields[3], 16), int(fields[6])
        if flags & ACCEPTCON and inode in inodes and len(fields) > 7:
            found.append(fields[7])
    return found


def as_nobody(targets: list[tuple[str, str]]) -> dict[str, str]:
    probe = subprocess.run(
        [*NOBODY, sys.executable, "-I", "-c", PROBE, json.dumps(targets)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert probe.returncode == 0, probe.stderr
    return dict(json.loads(probe.stdout))


def test_no_other_user_reaches_the_knowledge_store(edged: Daemon) -> None:
    client = edged.client
    written = client.call(
        "POST",
        "/v1/kb/hr/ingest",
        {"documents": [{"text": SECRET, "source": "hr/doors.md", "private": True}]},
    )
    assert written["chunks"] == 1
    found = client.kb_search("hr", "door code")[0]["metadata"]
    assert found == {"private": True, "owner": os.getuid()}  # the ingester's: root's here
    assert edged.proc is not None
    pids = family(edged.proc.pid)
    inodes = socket_inodes(pids)

    # (a) no TCP listener in edged or its children: loopback is every local user's
    problems = [f"edged (PIDs {pids}) listens on TCP: {t}" for t in tcp_listeners(pids[0], inodes)]

    # (b) uid 65534 reaches none of its Unix sockets but edged's own API sockets
    ours = {
        str(edged.socket),
        *(str(edged.socket.with_name(f"edged-{n}.sock")) for n in ("grpc", "shm")),
    }
    others = [path for path in unix_listeners(edged.proc.pid, inodes) if path not in ours]
    state = edged.workdir / "state"
    # the unit's umask (0027) closes the state directory to others; opened here, since the
    # store must not rely on the modes of the directories above it
    state.chmod(state.stat().st_mode | 0o005)
    store = sorted(state.glob("knowledge*"))
    assert store, f"no knowledge store under {state}: {sorted(os.listdir(state))}"
    paths = [p for top in store for p in [top, *(top.rglob("*") if top.is_dir() else [])]]
    files = [p for p in paths if p.is_file()]
    assert files, f"the store wrote no file under {state}"
    targets = [("list", str(state))]  # the control: the state directory itself is listable
    targets += [("connect", path) for path in others]
    targets += [("list" if p.is_dir() else "read", str(p)) for p in paths if not p.is_socket()]
    seen = as_nobody(targets)
    assert seen.pop(str(state)) == "ok", "uid 65534 cannot list the state directory at all"
    problems += [f"uid 65534 reached {path}" for path, how in seen.items() if how == "ok"]
    # and a socket the store listens on, if any, is closed to others by its own mode too
    problems += [
        f"{path} is open to others ({Path(path).stat().st_mode & 0o777:o})"
        for path in others
        if not path.startswith("@") and Path(path).stat().st_mode & 0o077
    ]
    assert problems == [], "\n".join(problems)


def test_a_store_path_too_long_for_a_socket_serves_from_a_private_temporary_directory(
    tmp_path: Path,
) -> None:
    data = tmp_path / ("d" * 100) / "kb.db"
    store = KnowledgeStore(str(data), 4)
    try:
        assert store.local is not None and store.local.temporary
        run = store.local.run
        assert run.stat().st_mode & 0o777 == 0o700
        assert store.local.socket.stat().st_mode & 0o777 == 0o600
        assert data.stat().st_mode & 0o777 == 0o700
        store.upsert("n", [Chunk("a chunk", np.ones(4))])
        assert store.search("n", [np.ones(4)], k=1)[0][0].text == "a chunk"
    finally:
        store.close()
    assert not run.exists()


def test_a_milvus_server_by_uri_gets_its_token_and_no_local_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[dict[str, str]] = []

    class Client:
        def __init__(self, **kwargs: str) -> None:
            opened.append(kwargs)

        def close(self) -> None:
            pass

    monkeypatch.setattr(pymilvus, "MilvusClient", Client)
    for uri in ("http://milvus:19530", "https://milvus.example:443", "unix:/run/milvus.sock"):
        store = KnowledgeStore(uri, 4, token="root:Milvus")
        assert store.local is None and store.disk is None
        store.close()
    assert opened == [
        {"uri": uri, "token": "root:Milvus"}
        for uri in ("http://milvus:19530", "https://milvus.example:443", "unix:/run/milvus.sock")
    ]

"""Issue 44, point 10: private knowledge is private to its owner, not to everyone who may call
edged. A real edged whose REST socket is 0666 in a world-traversable directory, so that two
other local uids (65534 and 65533, ``setpriv``) both may call it; every refusal seen is edged's.

Found: any member of group edged could search, ingest into and delete from another user's
private namespace. Now a namespace in ``knowledge.private_namespaces`` belongs to the uid whose
ingest made it, and a document ingested ``private`` in a shared namespace is found and deleted
by its owner only; root (the test) and edged's own uid see everything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import asunit
from tests.conftest import MODELS, ROOT, Daemon

ALICE, MALLORY = 65534, 65533
CONFIG = """
[server]
socket_mode = "0666"
[models]
load = ["text-embedding"]
[knowledge]
private_namespaces = ["diary"]
"""
DIARY = {"source": "diary/monday.md", "text": "Monday: the access code of the lab is 4471."}
NOTE = {"source": "notes/wifi.md", "text": "The guest Wi-Fi password is on the fridge."}
SECRET = {
    "source": "notes/bank.md",
    "text": "My bank PIN is 9902, do not share it.",
    "private": True,
}
# As a uid: each call, (status, JSON answer or text).
PROBE = """
import json, sys
from edged.client import Client
client = Client(sys.argv[1], timeout=60)
seen = []
for method, path, doc in json.loads(sys.argv[2]):
    status, _, payload = client.request(method, path, json.dumps(doc).encode() if doc is not None
                                        else None, {"Content-Type": "application/json"})
    try:
        seen.append([status, json.loads(payload)])
    except ValueError:
        seen.append([status, payload.decode(errors="replace")])
print(json.dumps(seen))
"""


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as uids 65534 and 65533")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    work = Path(tempfile.mkdtemp(prefix="edged-owners-"))
    work.chmod(0o755)
    daemon = Daemon(work, MODELS, CONFIG).start()
    try:
        yield daemon
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def calls(daemon: Daemon, uid: int, *actions: tuple[str, str, Any]) -> list[list[Any]]:
    probe = subprocess.run(
        [
            *asunit.setpriv(uid),
            sys.executable,
            "-c",
            PROBE,
            str(daemon.socket),
            json.dumps(actions),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert probe.returncode == 0, probe.stderr
    seen: list[list[Any]] = json.loads(probe.stdout)
    return seen


def test_a_private_namespace_is_its_owners(daemon: Daemon) -> None:
    [made] = calls(daemon, ALICE, ("POST", "/v1/kb/diary/ingest", {"documents": [DIARY]}))
    assert made == [200, {"namespace": "diary", "documents": 1, "chunks": 1}]
    refused = f"namespace 'diary' is private to its owner (uid {ALICE}); uid {MALLORY} may not"
    seen = calls(
        daemon,
        MALLORY,
        ("POST", "/v1/kb/diary/search", {"query": "lab access code"}),
        ("POST", "/v1/kb/diary/ask", {"question": "what is the lab's code?"}),
        ("POST", "/v1/kb/diary/ingest", {"documents": [NOTE]}),
        ("POST", "/v1/kb/diary/delete", {"source": "diary/monday.md"}),
        ("GET", "/v1/kb/diary/stats", None),
    )
    for status, answer in seen:
        assert status == 403 and answer["error"].startswith(refused), seen
    [(status, found)] = calls(
        daemon, ALICE, ("POST", "/v1/kb/diary/search", {"query": "lab access code"})
    )
    assert status == 200 and [h["source"] for h in found["hits"]] == ["diary/monday.md"]
    # root (edged's admin, who reads the files anyway) sees it; nothing of it was deleted
    assert daemon.client.call("GET", "/v1/kb/diary/stats")["chunks"] == 1


def test_a_private_document_in_a_shared_namespace_is_its_owners(daemon: Daemon) -> None:
    [made] = calls(daemon, ALICE, ("POST", "/v1/kb/notes/ingest", {"documents": [NOTE, SECRET]}))
    assert made[0] == 200, made
    # the owner's spoofed metadata cannot make a chunk someone else's, nor public
    [spoof] = calls(
        daemon,
        MALLORY,
        (
            "POST",
            "/v1/kb/notes/ingest",
            {
                "documents": [
                    {
                        "source": "notes/x.md",
                        "text": "nothing",
                        "metadata": {"owner": ALICE, "private": True},
                    }
                ]
            },
        ),
    )
    assert spoof[0] == 200
    search = ("POST", "/v1/kb/notes/search", {"query": "bank PIN", "k": 5})
    [(status, theirs)] = calls(daemon, MALLORY, search)
    assert status == 200 and "notes/bank.md" not in [h["source"] for h in theirs["hits"]]
    assert {h["source"] for h in theirs["hits"]} == {"notes/wifi.md", "notes/x.md"}
    assert all("owner" not in h["metadata"] for h in theirs["hits"])
    [(status, mine)] = calls(daemon, ALICE, search)
    assert mine["hits"][0]["source"] == "notes/bank.md"
    assert mine["hits"][0]["metadata"] == {"private": True, "owner": ALICE}
    [(status, answer)] = calls(
        daemon, MALLORY, ("POST", "/v1/kb/notes/delete", {"source": "notes/bank.md"})
    )
    assert status == 403, answer
    assert answer["error"] == (
        f"1 of those chunks are another uid's private ones; uid {MALLORY} may not delete them"
    )
    [(status, gone)] = calls(
        daemon, ALICE, ("POST", "/v1/kb/notes/delete", {"source": "notes/bank.md"})
    )
    assert (status, gone) == (200, {"namespace": "notes", "deleted": 1})

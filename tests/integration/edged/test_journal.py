"""Structured logs for real: records sent to a real systemd-journald and read back with
journalctl, and a real edged's log of one inference request, as journal fields and as JSON lines.

The journald is the real one (/lib/systemd/systemd-journald), started by the test in a private
mount namespace (``unshare --mount``) with tmpfs over /run/systemd, /run/log and
/var/log/journal, so its sockets and journal files are the test's alone and the host's logs are
untouched; it needs no systemd as PID 1. Processes that log to it join that namespace with
``nsenter --mount`` (systemd-python sends to the fixed path /run/systemd/journal/socket);
journalctl reads its files through /proc/PID/root. It needs root (mount namespaces); where it
cannot run, the tests say why and skip (fail under CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.client import ClientError
from tests.conftest import Daemon, linked_repository, skip_or_fail

ROOT = Path(__file__).resolve().parents[3]
JOURNALD = Path("/lib/systemd/systemd-journald")
# tmpfs over what journald writes: its sockets and state, the volatile and the persistent journal
PRIVATE_JOURNAL = (
    "set -e; mount -t tmpfs tmpfs /run/systemd; mount -t tmpfs tmpfs /run/log;"
    " if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi;"
    " mkdir /run/systemd/journal; exec {journald}"
)
SMALL = ["intent-classifier"]  # loads in milliseconds
EMBEDDING = {"embedding": np.zeros((1, 384), np.float32)}


@dataclass
class Journald:
    """A real systemd-journald in its own mount namespace."""

    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def directory(self) -> Path:
        """Its journal files, seen from outside its namespace."""
        return Path(f"/proc/{self.proc.pid}/root/run/log/journal")

    def enter(self) -> list[str]:
        """A command prefix that runs a program in its namespace (the same PID: no fork)."""
        return ["nsenter", "--target", str(self.proc.pid), "--mount", "--"]

    def entries(self, *matches: str) -> list[dict[str, Any]]:
        """The entries matching ``FIELD=value`` matches, read with journalctl."""
        done = subprocess.run(
            ["journalctl", f"--directory={self.directory}", "-o", "json", "--no-pager", *matches],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    def wait_for(self, count: int, *matches: str, timeout: float = 15) -> list[dict[str, Any]]:
        """At least ``count`` matching entries, once journald has written them."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.entries(*matches)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} of {count} entries for {matches}: {found}")
            time.sleep(0.05)


@pytest.fixture
def journald(tmp_path: Path) -> Iterator[Journald]:
    """Start a real journald for one test; stop it by PID."""
    if sys.platform != "linux" or os.geteuid() != 0:
        skip_or_fail("a private journald needs root on Linux (mount namespaces)")
    for tool in ("unshare", "nsenter", "journalctl"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} is missing (util-linux, systemd packages)")
    if not JOURNALD.is_file():
        skip_or_fail(f"{JOURNALD} is missing: install the systemd package (make test does)")
    try:
        import systemd.journal  # noqa: F401
    except ImportError:
        skip_or_fail("systemd-python is not installed: make setup builds it (libsystemd-dev)")
    log = tmp_path / "journald.log"
    script = PRIVATE_JOURNAL.format(journald=JOURNALD)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Journald(proc, log)
    try:
        socket_path = Path(f"/proc/{proc.pid}/root/run/systemd/journal/socket")
        deadline = time.monotonic() + 15
        while not socket_path.exists():
            if proc.poll() is not None:
                skip_or_fail(f"systemd-journald could not run here: {log.read_text()!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"journald made no socket in 15 s: {log.read_text()!r}")
            time.sleep(0.02)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_inside(journald: Journald, script: str) -> subprocess.CompletedProcess[str]:
    """A Python child in journald's namespace, run to its end."""
    done = subprocess.run(
        [*journald.enter(), sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"},
    )
    assert done.returncode == 0, done.stderr
    return done


def by_message(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["MESSAGE"].split("\n", 1)[0]: e for e in entries}


# ---- records through the journal handler -------------------------------------------------

SENDER = """
import logging
from edged.common import logs

print(logs.setup_logging("info", "journal", "node-7", "edged"))
log = logging.getLogger("edged.routing.router")
log.info("before any request")
with logs.bind(request_id="req-9", model="intent-classifier", route="cloud", reason="rule 'big'"):
    log.warning("routed")
    log.info("explicit", extra={"model": "ocr-det"})
try:
    1 / 0
except ZeroDivisionError:
    log.exception("failed")
"""


def test_records_reach_journald_with_model_route_request_id_and_node(journald: Journald) -> None:
    assert run_inside(journald, SENDER).stdout.split() == ["journal"]
    found = by_message(journald.wait_for(4, "SYSLOG_IDENTIFIER=edged"))
    before, routed = found["before any request"], found["routed"]
    explicit, failed = found["explicit"], found["failed"]
    # what systemd-python's JournalHandler gives
    assert before["_TRANSPORT"] == "journal" and before["PRIORITY"] == "6"
    assert before["LOGGER"] == "edged.routing.router" and before["CODE_FILE"] == "<string>"
    assert before["CODE_FUNC"] == "<module>" and before["THREAD_NAME"] == "MainThread"
    # ours: the node always, the request's fields while one is bound
    assert before["NODE"] == "node-7"
    assert not {"MODEL", "ROUTE", "REASON", "REQUEST_ID"} & set(before)
    assert routed["PRIORITY"] == "4"
    assert {k: routed[k] for k in ("MODEL", "ROUTE", "REASON", "REQUEST_ID", "NODE")} == {
        "MODEL": "intent-classifier",
        "ROUTE": "cloud",
        "REASON": "rule 'big'",
        "REQUEST_ID": "req-9",
        "NODE": "node-7",
    }
    assert explicit["MODEL"] == "ocr-det" and explicit["REQUEST_ID"] == "req-9"
    assert failed["PRIORITY"] == "3" and "ZeroDivisionError" in failed["EXCEPTION_TEXT"]
    # systemd-python also sends the record's lowercase attributes: journald drops those names
    for entry in found.values():
        assert all(re.fullmatch("[A-Z0-9_]+", key) for key in entry), entry


STREAMED = """
import logging, os, socket, sys
from edged.common import logs

# What systemd does for a service with StandardError=journal: stderr is a stream to journald
# (stdout protocol header: identifier, unit, priority, level prefix, syslog, kmsg, console)
# and $JOURNAL_STREAM names it.
stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
stream.connect("/run/systemd/journal/stdout")
stream.sendall(b"edged-stream\\n\\n6\\n0\\n0\\n0\\n0\\n")
os.dup2(stream.fileno(), 2)
found = os.fstat(2)
os.environ["JOURNAL_STREAM"] = f"{found.st_dev}:{found.st_ino}"
print(logs.setup_logging("info", "auto", "node-7", "edged"))
logging.getLogger("edged").info("chose the journal", extra={"request_id": "r-auto"})
print("a plain line on stderr", file=sys.stderr, flush=True)
"""


def test_auto_picks_the_journal_when_stderr_is_journalds_stream(journald: Journald) -> None:
    assert run_inside(journald, STREAMED).stdout.split() == ["journal"]
    (native,) = journald.wait_for(1, "SYSLOG_IDENTIFIER=edged")
    assert native["MESSAGE"] == "chose the journal" and native["_TRANSPORT"] == "journal"
    assert native["REQUEST_ID"] == "r-auto" and native["NODE"] == "node-7"
    (plain,) = journald.wait_for(1, "SYSLOG_IDENTIFIER=edged-stream")
    assert plain["MESSAGE"] == "a plain line on stderr" and plain["_TRANSPORT"] == "stdout"


# ---- a real edged's request in its log ---------------------------------------------------


def test_edged_logs_a_request_to_journald_with_its_fields(
    journald: Journald, make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """edged with ``[log] format = "journal"`` in journald's namespace: the access line of one
    inference carries its request id, model, route and the node (the host name)."""
    daemon = make_daemon(
        models=linked_repository(tmp_path / "repo", SMALL),
        config='[log]\nformat = "journal"\n',
        flags=("--log-level", "debug"),
    )
    with daemon.log.open("ab") as out:
        daemon.proc = subprocess.Popen(
            [*journald.enter(), *daemon.command()], stdout=out, stderr=subprocess.STDOUT
        )
    daemon.wait_ready()
    _, answer = daemon.client.infer_answer("intent-classifier", EMBEDDING, request_id="jr-1")
    (line,) = journald.wait_for(1, "REQUEST_ID=jr-1", "LOGGER=edged.server.rest")
    assert daemon.stop() == 0, daemon.logs()
    assert "POST /v2/models/intent-classifier/infer -> 200" in line["MESSAGE"]
    assert line["MODEL"] == "intent-classifier" and line["ROUTE"] == answer["route"] == "local"
    assert line["REASON"] == answer["reason"]
    assert line["NODE"] == socket.gethostname() and line["SYSLOG_IDENTIFIER"] == "edged"
    assert line["PRIORITY"] == "7"  # debug
    assert '"message"' not in daemon.logs()  # no record went to stderr as well
    started = journald.entries("SYSLOG_IDENTIFIER=edged", "LOGGER=edged")
    assert any(e["MESSAGE"].startswith("ready in") for e in started)


def test_edged_logs_a_request_as_an_ecs_json_line(
    make_daemon: type[Daemon], tmp_path: Path
) -> None:
    """edged with ``[log] format = "json"`` and --log-level debug: its stderr is JSON lines;
    the access line of a request carries its OIP id (or a generated one), the model, the
    route and the node by their ECS names."""
    daemon = make_daemon(
        models=linked_repository(tmp_path / "repo", SMALL),
        config='[log]\nformat = "json"\n',
        flags=("--log-level", "debug"),
    ).start()
    _, answer = daemon.client.infer_answer("intent-classifier", EMBEDDING, request_id="jl-1")
    daemon.client.infer("intent-classifier", EMBEDDING)  # no id: edged makes one
    assert daemon.stop() == 0, daemon.logs()
    rows = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    access = [r for r in rows if "/infer -> 200" in r["message"]]
    assert len(access) == 2, daemon.logs()
    mine, other = access
    assert mine["http"]["request"]["id"] == "jl-1"
    assert mine["edged"] == {
        "model": "intent-classifier",
        "route": "local",
        "reason": answer["reason"],
    }
    assert mine["log.level"] == "debug" and mine["log"]["logger"] == "edged.server.rest"
    assert mine["host"]["name"] == socket.gethostname() and mine["service"]["name"] == "edged"
    assert mine["@timestamp"].endswith("Z")
    generated = other["http"]["request"]["id"]
    assert len(generated) == 12 and int(generated, 16) >= 0
    assert other["edged"]["model"] == "intent-classifier"
    assert any(r["message"].startswith("ready in") for r in rows)


@pytest.mark.parametrize("access_log", ["errors", "all"])
def test_at_the_default_level_the_access_line_is_kept_for_errors_or_every_request(
    make_daemon: type[Daemon], tmp_path: Path, access_log: str
) -> None:
    """At info (the default level): ``[server] access_log = "errors"`` (the default) writes
    the access line of a request answered 4xx or 5xx, with its request id and model, and none
    for a 200; ``"all"`` writes one for every request, with its route."""
    daemon = make_daemon(
        models=linked_repository(tmp_path / "repo", SMALL),
        config=f'[server]\naccess_log = "{access_log}"\n[log]\nformat = "json"\n',
    ).start()
    daemon.client.infer_answer("intent-classifier", EMBEDDING, request_id="ok-1")
    with pytest.raises(ClientError):
        daemon.client.infer_answer(
            "intent-classifier", {"wrong": EMBEDDING["embedding"]}, request_id="bad-1"
        )
    assert daemon.stop() == 0, daemon.logs()
    rows = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    lines = [
        r for r in rows if r["log"]["logger"] == "edged.server.rest" and " -> " in r["message"]
    ]
    access = {r["http"]["request"]["id"]: r for r in lines if "http" in r}
    if access_log == "all":  # the readiness polls too (no request id: no inference)
        assert any("GET /v2/health/ready -> 200" in r["message"] for r in lines)
    assert sorted(access) == (["bad-1", "ok-1"] if access_log == "all" else ["bad-1"])
    bad = access["bad-1"]
    assert "/v2/models/intent-classifier/infer -> 400" in bad["message"]
    assert bad["log.level"] == "info" and bad["edged"]["model"] == "intent-classifier"
    if access_log == "all":
        assert access["ok-1"]["message"].split(" in ")[1].split(" (")[0].endswith("ms, local")

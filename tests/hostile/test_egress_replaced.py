"""The egress ledger's file replaced under a running edged (issue 44, point 12): a copy with fewer
entries renamed over the segment edged writes hid every later entry, because edged went on
writing to the unlinked file and ``edgectl egress verify`` read only the files ("ok: 778
entries" while edged's head was 791). Verify now compares the files with edged's own head, and
edged notices before its next entry that the file at the path is no longer the one it opened:
it logs an error (an event for the fleet) and goes on in a new segment whose first entry records
the change, so the chain on disk shows the break instead of hiding it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.common.egress import Ledger, digest, segments, verify
from tests.conftest import Cloud, Daemon
from tests.hashproxy import HashProxy
from tests.integration.edged.test_egress import start
from tests.integration.edged.test_routing import ALWAYS_CLOUD, ask


def filled(directory: Path, count: int) -> Ledger:
    ledger = Ledger(directory)
    ledger.open()
    for i in range(count):
        ledger.record("cloud-infer", request_id=f"r{i}", bytes=100 + i, sha256=digest(b"%d" % i))
    return ledger


def replace_by_rename(segment: Path, keep: int) -> None:
    """What the outside tester did: a copy of the segment's first ``keep`` entries, written
    beside it (its owner and mode), renamed over it."""
    rows = segment.read_bytes().splitlines(keepends=True)
    copy = segment.with_name("copy.tmp")
    copy.write_bytes(b"".join(rows[:keep]))
    shutil.copystat(segment, copy)
    st = segment.stat()
    os.chown(copy, st.st_uid, st.st_gid)
    os.rename(copy, segment)


def test_verify_fails_when_the_files_end_before_edgeds_head(tmp_path: Path) -> None:
    """The tester's case as verify sees it: no entry written since the rename."""
    ledger = filled(tmp_path, 10)
    head = ledger.head
    (segment,) = segments(tmp_path)
    replace_by_rename(segment, 8)
    assert verify(tmp_path).ok  # the files alone cannot tell
    report = verify(tmp_path, head=head)
    assert not report.ok and report.edged_head == head
    assert "the ledger on disk ends at entry 8, edged's head is 11" in report.error, report.error
    # a ledger rewritten whole, as long as edged's: its entry at edged's head is not edged's
    other = filled(tmp_path / "other", 10)
    assert other.head.seq == head.seq and other.head.hash != head.hash
    rewritten = verify(tmp_path / "other", head=head)
    assert not rewritten.ok and f"seq {head.seq} is not edged's" in rewritten.error
    assert verify(tmp_path / "other", head=other.head).ok


@pytest.mark.parametrize("how", ["replaced", "renamed away", "deleted", "truncated"])
def test_a_ledger_whose_file_changed_under_it_goes_on_in_a_new_segment(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = filled(tmp_path, 10)
    (segment,) = segments(tmp_path)
    before = ledger.head
    if how == "replaced":
        replace_by_rename(segment, 8)
    elif how == "renamed away":
        segment.rename(tmp_path / "elsewhere.jsonl")
    elif how == "deleted":
        segment.unlink()
    else:
        rows = segment.read_bytes().splitlines(keepends=True)
        os.truncate(segment, sum(len(r) for r in rows[:8]))
    with caplog.at_level(logging.ERROR, logger="edged.common.egress"):
        for i in range(3):
            ledger.record("cloud-infer", request_id=f"after-{i}", bytes=1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "changed under edged" in errors[0], errors  # logged once
    new = tmp_path / f"egress-{before.seq + 1:012d}.jsonl"
    entries = [json.loads(raw) for raw in new.read_bytes().splitlines()]
    assert [e["kind"] for e in entries] == ["replaced", "cloud-infer", "cloud-infer", "cloud-infer"]
    assert entries[0]["segment"] == segment.name and entries[0]["prev"] == before.hash
    assert ledger.head.seq == before.seq + 4
    ledger.close()
    report = verify(tmp_path, head=ledger.head)
    assert not report.ok, report
    if how in ("replaced", "truncated"):
        assert f"seq {before.seq + 1} after 8" in report.error, report.error
        assert f"entry 8, edged's head is {ledger.head.seq}" in report.error, report.error
        assert f"{segment.name} changed under edged" in report.error, report.error
    else:
        assert "no pruned entry records that cut" in report.error, report.error


@pytest.fixture
def hashing(cloud: Cloud) -> Iterator[HashProxy]:
    proxy = HashProxy(f"http://{cloud.proxy.address}").start()
    yield proxy
    proxy.stop()


@pytest.mark.usefixtures("faults_cleared")
def test_a_ledger_file_replaced_under_edged_fails_edgectl_verify(
    make_daemon: type[Daemon], hashing: HashProxy, tmp_path: Path
) -> None:
    """The tester's steps against a real edged: entries, the segment replaced by a shorter
    copy, more entries; ``edgectl egress verify`` fails naming where the files end and edged's
    head, and edged logged the change (an error event, which cloudsync forwards)."""
    daemon = start(make_daemon, hashing, routing=ALWAYS_CLOUD)
    client = daemon.client
    for i in range(6):
        assert ask(client, 37000 + i)["route"] == "cloud"
    directory = daemon.workdir / "state" / "egress"
    (segment,) = segments(directory)
    kept = client.egress(limit=1)["head"]["seq"] - 3
    replace_by_rename(segment, kept)
    for i in range(3):
        assert ask(client, 37100 + i)["route"] == "cloud"
    head = client.egress(limit=1)["head"]["seq"]

    def edgectl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "edged.edgectl", "--socket", str(daemon.socket), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    found = edgectl("egress", "verify")
    assert found.returncode == 1, (found.stdout, found.stderr)
    assert f"entry {kept}, edged's head is {head}" in found.stderr, found.stderr
    assert "changed under edged" in daemon.logs()
    events = client.events()["events"]
    assert [e for e in events if e["level"] == "error" and "changed under edged" in e["message"]]
    # edgectl on edged's own directory compares with edged too; a copy, offline, cannot
    live = edgectl("egress", "verify", "--dir", str(directory))
    assert live.returncode == 1 and f"edged's head is {head}" in live.stderr, live.stderr
    good = tmp_path / "copy"
    good.mkdir()
    shutil.copy(segment, good / segment.name)
    offline = edgectl("egress", "verify", "--dir", str(good))
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.startswith(f"ok: {kept} entries") and "not compared" in offline.stdout
    assert daemon.stop() == 0
    gone = edgectl("egress", "verify", "--dir", str(good))
    assert gone.returncode == 0 and "not compared with edged's head" in gone.stdout, gone

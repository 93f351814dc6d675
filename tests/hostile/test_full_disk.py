"""State files on a full disk (a real tmpfs, mounted by the test; root only): a write that cannot
complete leaves the old file whole and no temporary file behind; an admin change that cannot be
kept is refused (507) and not applied."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from edged.atomic import write_atomic
from edged.client import ClientError
from tests.conftest import Daemon
from tests.hostile.conftest import fill


def test_a_state_file_on_a_full_disk_keeps_its_old_content(small_disk: Path) -> None:
    state = small_disk / "admin.json"
    write_atomic(state, '{"old": true}')
    assert state.read_text() == '{"old": true}' and oct(state.stat().st_mode)[-3:] == "600"
    fill(small_disk)
    with pytest.raises(OSError) as caught:
        write_atomic(state, '{"new": true}' + " " * 8192)
    assert caught.value.errno == errno.ENOSPC
    assert state.read_text() == '{"old": true}'
    assert sorted(p.name for p in small_disk.iterdir()) == ["admin.json", "filler"]
    (small_disk / "filler").unlink()  # space again: the next write goes through
    write_atomic(state, '{"new": true}')
    assert state.read_text() == '{"new": true}'


def test_an_admin_change_that_cannot_be_kept_is_refused_and_not_applied(
    make_daemon: type[Daemon], small_disk: Path
) -> None:
    """On a full disk, an admin PATCH was a 400 "applied, but cannot keep it" while the change
    took effect, and it left an empty admin.json.tmp."""
    daemon = make_daemon(config='[models]\nload = ["intent-classifier"]\n',
                         flags=("--state-dir", str(small_disk)))  # fmt: skip
    daemon.start()
    client = daemon.client
    before = client.call("GET", "/v1/admin/routing")["routing"]["local_threshold_ms"]
    fill(small_disk)
    with pytest.raises(ClientError) as caught:
        client.call("PATCH", "/v1/admin/routing", {"local_threshold_ms": before + 7})
    assert caught.value.status == 507 and "not applied" in str(caught.value)
    assert client.call("GET", "/v1/admin/routing")["routing"]["local_threshold_ms"] == before
    with pytest.raises(ClientError) as caught:
        client.call("POST", "/v1/admin/drain", {"reason": "disk full", "timeout_s": 0})
    assert caught.value.status == 507
    assert client.status()["drained"] is None, client.status()
    assert not [p.name for p in small_disk.iterdir() if p.name.endswith(".tmp")]
    (small_disk / "filler").unlink()
    reply = client.call("PATCH", "/v1/admin/routing", {"local_threshold_ms": before + 7})
    assert reply["routing"]["local_threshold_ms"] == before + 7
    assert json.loads((small_disk / "admin.json").read_text())["routing_overrides"] == {
        "local_threshold_ms": before + 7
    }
    assert daemon.stop() == 0

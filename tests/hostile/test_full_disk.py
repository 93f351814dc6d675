"""State files on a full disk (a real tmpfs, mounted by the test; root only): a write that cannot
complete leaves the old file whole and no temporary file behind; an admin change that cannot be
kept is refused (507) and not applied."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from edged.client import ClientError
from edged.common.atomic import write_atomic
from edged.common.egress import verify
from tests.conftest import CLOUD_MODEL as MODEL
from tests.conftest import Cloud, Daemon, wait_for
from tests.hostile.conftest import fill
from tests.integration.edged.test_routing import ask


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
    daemon = make_daemon(
        config='[models]\nload = ["intent-classifier"]\n', flags=("--state-dir", str(small_disk))
    )
    daemon.give(small_disk)  # its state directory: edged's, as /var/lib/edged is
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


def test_a_call_the_egress_ledger_cannot_record_is_not_sent(
    make_daemon: type[Daemon], small_disk: Path, faults_cleared: Cloud
) -> None:
    """The ledger on a full disk: a cloud call it cannot record is not made (the request falls
    back to the device and says why); the cloud never sees it; a line half written is cut
    back; with space again, calls are recorded and sent, and the chain verifies."""
    cloud = faults_cleared
    egress = f'[egress]\ndirectory = "{small_disk / "egress"}"\nsegment_mb = 1\nmax_mb = 2\n'
    config = (
        f'[models]\nload = ["{MODEL}"]\n[cloud]\nurl = "http://{cloud.proxy.address}"\n{egress}'
    )
    daemon = make_daemon(config=config)
    daemon.give(small_disk)
    daemon.start()
    client = daemon.client
    wait_for(lambda: MODEL in client.status()["cloud"]["catalog"], 10, "the cloud's catalog")
    assert ask(client, 40000, route="cloud")["route"] == "cloud"
    filler = fill(small_disk)  # (the ledger's last page may still take a few entries)
    sent = ["req-40000"]
    for i in range(40001, 40020):
        kept = ask(client, i, route="cloud")
        if kept["route"] != "cloud":
            break
        sent.append(f"req-{i}")
    assert (
        kept["route"] == "fallback"
        and "the egress ledger cannot record this call" in (kept["reason"])
    ), kept
    assert f"req-{i}" not in {s["id"] for s in cloud.seen()}
    assert client.status()["egress"]["failed"]
    filler.unlink()
    assert ask(client, 40100, route="cloud")["route"] == "cloud"
    report = verify(small_disk / "egress")
    assert report.ok and report.torn == 0, report
    recorded = [e["request_id"] for e in client.egress(kind="cloud-infer")["entries"]]
    assert recorded == [*sent, "req-40100"]

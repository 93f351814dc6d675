"""The package as it runs in the field: installed by dpkg in a Debian 12 tree booted with systemd
as PID 1 (tests/field/rig.py), each daemon as its own user under the unit's hardening, umask
and limits, called by the tree's own users through the package's own client libraries.

Not here, and so named: a Jetson's sysfs and jtop, nvpmodel, TensorRT and a GPU (this machine
has none: edged's load monitor reads /proc and cgroups, the runtime is ONNX Runtime on the CPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.asunit import open_files_limit, proc_status
from tests.field.rig import Field
from tests.integration.test_units import LIMITS

FRESH_REST = 100
FRESH_GRPC = 500
WATCHDOG_S = 30  # edged.service's WatchdogSec


def active(field: Field, unit: str) -> bool:
    return field.run("systemctl", "is-active", unit, check=False).stdout.strip() == "active"


def failed_units(field: Field) -> list[str]:
    return field.run("systemctl", "--failed", "--plain", "--no-legend").stdout.splitlines()


def test_the_tree_boots_and_the_package_starts_with_no_failed_unit(field: Field) -> None:
    assert failed_units(field) == []
    assert field.run("systemctl", "is-system-running", check=False).stdout.strip() == "running"
    for unit in ("edged.socket", "edged.service", "edged-updater.path"):
        assert field.run("systemctl", "is-active", unit).stdout.strip() == "active", unit
    for unit in ("cloudsync.service", "edgefleet.service"):  # the operator enables them
        assert field.run("systemctl", "is-enabled", unit, check=False).stdout.strip() == "disabled"


def test_edged_runs_as_its_own_user_under_the_units_umask_and_limits(field: Field) -> None:
    pid = field.host_pid("edged.service")
    assert pid, "edged.service has no main process"
    edged_uid = field.run("id", "-u", "edged").stdout.strip()
    status = proc_status(pid)
    assert status["Uid"].split() == [edged_uid] * 4
    assert status["Umask"] == "0027"
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"  # SystemCallFilter
    assert int(status["CapEff"], 16) == 0
    assert open_files_limit(pid) == 1024  # LimitNOFILE: systemd's default soft limit


def test_every_fresh_connection_of_an_allowed_user_is_answered(field: Field) -> None:
    rest = field.probe("rest", str(FRESH_REST))
    grpc = field.probe("grpc", str(FRESH_GRPC))
    print(
        f"\nfresh connections as alice: REST {rest['answered']}/{FRESH_REST}, "
        f"gRPC {grpc['answered']}/{FRESH_GRPC}"
    )
    assert (rest["answered"], rest["errors"]) == (FRESH_REST, [])
    assert (grpc["answered"], grpc["errors"]) == (FRESH_GRPC, [])


def test_a_user_outside_the_groups_is_refused_and_admin_is_the_admin_groups(
    field: Field,
) -> None:
    outsider = field.probe("rest", "1", user="bob")
    assert outsider["answered"] == 0 and "no permission to use" in outsider["errors"][0]
    outsider = field.probe("grpc", "1", user="bob")
    assert outsider["answered"] == 0 and outsider["failed"] == 1
    assert field.probe("admin", user="alice")["status"] == 403
    assert field.probe("admin", user="carol") == {"status": 200}


def test_the_default_models_answer_through_the_packages_clients(field: Field) -> None:
    found = field.probe("infer")
    print(f"\nfirst inferences in the field: {found['seconds']}")
    assert found["answers"]["intent"]["intent"] == "image-report"
    assert found["answers"]["embed"] == [1, 384]
    assert found["answers"]["grpc"] == [1, 384]
    assert found["answers"]["region"] is True  # a sealed memfd, under the unit's filters


def test_the_journal_carries_the_documented_fields(field: Field) -> None:
    missing = field.probe("missing")  # a call for a model that does not exist: a 404
    assert missing["status"] == 404
    lines = field.run("journalctl", "-u", "edged", "-o", "json", "--no-pager").stdout
    entries = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    ours = [e for e in entries if "LOGGER" in e]  # edged's own lines, not systemd's about it
    assert all(e["_SYSTEMD_UNIT"] == "edged.service" for e in ours)
    assert ours, "no entry from edged's journal handler"
    assert {"MESSAGE", "PRIORITY", "LOGGER", "CODE_FILE", "CODE_LINE"} <= set(ours[0])
    request = [e for e in ours if e.get("REQUEST_ID") == missing["request_id"]]
    assert request, f"no entry with REQUEST_ID={missing['request_id']}"
    assert request[0]["MODEL"] == "no-such-model"


@pytest.mark.parametrize("unit", sorted(LIMITS))
def test_exposure_as_the_booted_systemd_scores_it(field: Field, unit: str) -> None:
    done = field.run("systemd-analyze", "security", "--no-pager", unit)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found, done.stdout[-500:]
    print(f"\n{unit}: exposure {found.group(1)} in the booted tree (bound {LIMITS[unit]})")
    assert float(found.group(1)) <= LIMITS[unit]


def test_the_first_call_to_a_stopped_edged_starts_it(field: Field) -> None:
    field.run("systemctl", "stop", "edged.service")
    assert field.run("systemctl", "is-active", "edged.socket").stdout.strip() == "active"
    assert field.main_pid("edged.service") == 0
    answer = field.probe("rest", "1")  # answered while the models load: live, not ready
    assert (answer["answered"], answer["errors"]) == (1, [])
    ready = field.wait("READY=1", lambda: active(field, "edged.service"), 300)
    print(f"\nsocket activation: the first call answered, edged ready {ready:.1f} s later")


def test_a_hung_edged_is_restarted_by_the_watchdog(field: Field) -> None:
    field.wait("edged ready", lambda: active(field, "edged.service"), 300)  # pings from READY
    before = field.main_pid("edged.service")
    stopped = time.time()
    os.kill(field.host_pid("edged.service"), signal.SIGSTOP)  # hung: no more watchdog pings

    def fired() -> float | None:
        """When systemd logged the watchdog's timeout (the journal's own time: the polling's
        delay on a busy machine does not count, and no window of the last lines, which the
        restarted edged's own lines would push it out of), in seconds after the SIGSTOP."""
        lines = field.run(
            "journalctl",
            "-u",
            "edged",
            "-o",
            "json",
            "--no-pager",
            "--since",
            f"@{int(stopped) - 1}",
        ).stdout
        for entry in (json.loads(line) for line in lines.splitlines() if line.startswith("{")):
            if "Watchdog timeout" in entry.get("MESSAGE", ""):
                return int(entry["__REALTIME_TIMESTAMP"]) / 1e6 - stopped
        return None

    field.wait("the watchdog", fired, WATCHDOG_S + 60)
    back = field.wait(
        "a new edged",
        lambda: (
            field.main_pid("edged.service") not in (0, before)
            and field.probe("rest", "1")["answered"] == 1
        ),
        120,
    )
    after = fired()
    assert after is not None
    print(
        f"\nwatchdog: fired {after:.1f} s after SIGSTOP (WatchdogSec={WATCHDOG_S}), "
        f"a new edged answering {back:.1f} s after that"
    )
    assert 0 < after <= WATCHDOG_S + 5


def test_after_everything_no_unit_has_failed(field: Field) -> None:
    assert failed_units(field) == []

"""The systemd units as shipped (systemd/): `systemd-analyze verify` finds nothing to say, and
`systemd-analyze security --offline=yes` scores their exposure within the bounds the project
set (lower is better): edged.service <= 4.0 (it keeps GPU device access), cloudsync.service,
edgefleet.service and edged-updater.service <= 2.5. The units name /usr/bin/edged and the
other commands the package installs; here verify is given copies that name this checkout's
commands instead, every other line as shipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail

UNITS = Path(__file__).resolve().parents[2] / "systemd"
BIN = Path(sys.executable).parent
LIMITS = {
    "edged.service": 4.0,
    "cloudsync.service": 2.5,
    "edgefleet.service": 2.5,
    "edged-updater.service": 2.5,  # root for dpkg, and bounded to what dpkg uses
}


@pytest.fixture(scope="module")
def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        skip_or_fail("systemd-analyze is not installed (make test installs systemd)")
    assert found is not None
    return found


def test_every_unit_verifies_clean(analyze: str, tmp_path: Path) -> None:
    units = []
    for unit in sorted(UNITS.iterdir()):
        text = unit.read_text()
        for command in ("edged", "cloudsync", "edgefleet", "edged-updater"):
            text = text.replace(f"/usr/bin/{command} ", f"{BIN / command} ")
        (tmp_path / unit.name).write_text(text)
        units.append(str(tmp_path / unit.name))
    assert {Path(u).name for u in units} >= {
        "edged.service",
        "edged.socket",
        "cloudsync.service",
        "edgefleet.service",
        "edged-updater.service",
        "edged-updater.path",
    }
    done = subprocess.run(
        [analyze, "verify", "--man=no", *units], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


@pytest.mark.parametrize("unit", sorted(LIMITS))
def test_exposure_is_within_the_bound(analyze: str, unit: str) -> None:
    done = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(UNITS / unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    score = float(found.group(1))
    print(f"{unit}: exposure {score}")
    assert score <= LIMITS[unit], done.stdout


def test_edged_is_bounded_in_memory_and_tasks(analyze: str) -> None:
    """MemoryHigh < MemoryMax, TasksMax set (figures in the unit's comment and docs/SECURITY.md):
    a hostile caller or a leak ends in a restart, not a device swapping to a halt."""
    settings = dict(
        line.split("=", 1)
        for line in (UNITS / "edged.service").read_text().splitlines()
        if re.match(r"(MemoryHigh|MemoryMax|TasksMax)=", line)
    )
    size = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    high, most = (
        int(settings[k][:-1]) * size[settings[k][-1]] for k in ("MemoryHigh", "MemoryMax")
    )
    assert 1 << 30 <= high < most and int(settings["TasksMax"]) >= 256, settings

"""The booted field tree, once for the field suite (tests/field/rig.py): a fresh Debian 12 tree
from build/debian-base.tar, booted with systemd as PID 1, the package installed by dpkg in it.
`make field` (and `make test`) build the package and the tree first."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, skip_or_fail
from tests.field.rig import Field, Network
from tests.packaging.test_deb import BASE, package

FAILED: list[str] = []  # a tree that did not come up: said once, not booted again per test


@pytest.fixture(scope="session")
def network() -> Iterator[Network]:
    """The field's LAN (the device's and the fleet's namespaces), removed after the trees."""
    if os.geteuid() != 0:
        skip_or_fail("network namespaces for the field need root (make test runs as root)")
    lan = Network()
    try:
        yield lan
    finally:
        lan.remove()


@pytest.fixture(scope="session")
def field(network: Network) -> Iterator[Field]:
    if FAILED:
        pytest.fail(f"the field tree did not come up (see the first error): {FAILED[0]}")
    if os.geteuid() != 0:
        skip_or_fail("booting a tree with systemd-nspawn needs root (make test runs as root)")
    for tool in ("systemd-nspawn", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            skip_or_fail(f"{tool} is not installed (make field installs systemd-container)")
    if not package().is_file() or not BASE.is_file():
        skip_or_fail(f"{package().name} or {BASE.name} is missing: run `make field`")
    work = ROOT / "build" / "field"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "nspawn.log"
    log.unlink(missing_ok=True)
    started = time.monotonic()
    rig = Field.unpack(BASE, work / "tree", log, Network.DEVICE)
    try:
        state = rig.boot()
        booted = time.monotonic() - started
        took = rig.install(package())
        ready = rig.wait("edged to answer alice", lambda: rig.probe("rest", "1")["answered"], 300)
        print(
            f"\nfield: tree unpacked and booted in {booted:.1f} s ({state}); dpkg -i "
            f"{took:.1f} s; edged answering {ready:.1f} s after"
        )
    except BaseException as exc:
        FAILED.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        rig.poweroff()
        raise
    try:
        yield rig
    finally:
        rig.poweroff()
        shutil.rmtree(work / "tree", ignore_errors=True)

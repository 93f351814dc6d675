"""JetPack's Pythons as packaged: the package built for each target in a tree of it
(debian/build-in-tree.sh, `make deb-targets`: Ubuntu 22.04's Python 3.10 for JetPack 6, Ubuntu
24.04's 3.12 for JetPack 7, Debian 13's 3.13), installed by dpkg in a fresh tree of that
target (what the package depends on, from the target's archive) booted with systemd as PID 1;
edged started by its unit as its user, and the default models answering through the package's
own clients, on the target's Python. Debian 12's package is the field rig's (test_field.py).

`make packaging-targets` builds what this needs and sets EDGED_TARGETS=1, so a missing part
fails; elsewhere (`make test`, CI) a missing part is a skip saying which, since each build takes
minutes. amd64 here: the arm64 builds are the same under qemu (`make deb-arm64`).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import ROOT
from tests.field.rig import PYTHON, Field
from tests.field.test_field import active, failed_units
from tests.packaging.test_deb import VERSION

TARGETS = {
    "jammy": ("Ubuntu 22.04, JetPack 6", "3.10"),
    "noble": ("Ubuntu 24.04, JetPack 7", "3.12"),
    "trixie": ("Debian 13", "3.13"),
}


def missing(reason: str) -> None:
    """Skip, saying why; a failure under `make packaging-targets` (EDGED_TARGETS set)."""
    if os.environ.get("EDGED_TARGETS"):
        pytest.fail(f"{reason} (EDGED_TARGETS is set, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.mark.parametrize("suite", sorted(TARGETS))
def test_the_targets_package_installs_and_serves_on_its_python(suite: str) -> None:
    where, python = TARGETS[suite]
    deb = ROOT / "build" / "deb" / suite / f"edged_{VERSION}_amd64.deb"
    base = ROOT / "build" / f"base-{suite}.tar"
    for path, make in ((deb, "make deb-targets"), (base, "make packaging-targets")):
        if not path.is_file():
            missing(f"{path.relative_to(ROOT)} is missing ({where}): {make} builds it")
    if os.geteuid() != 0:
        missing("booting a tree with systemd-nspawn needs root (make test runs as root)")
    work = ROOT / "build" / "field" / suite
    work.mkdir(parents=True, exist_ok=True)
    tree = Field.unpack(base, work / "tree", work / "nspawn.log")
    try:
        tree.boot()
        took = tree.install(deb)
        ready = tree.wait("edged to answer alice", lambda: tree.probe("rest", "1")["answered"], 300)
        release = tree.run("sh", "-c", ". /etc/os-release; echo $PRETTY_NAME").stdout.strip()
        found = tree.run(PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])")
        assert found.stdout.strip() == python
        depends = tree.run("dpkg-query", "-W", "-f", "${Depends}", "edged").stdout
        assert f"python3 (>= {python}~)" in depends, depends
        answers = tree.probe("infer")
        assert answers["answers"]["intent"]["intent"] == "image-report"
        assert answers["answers"]["embed"] == [1, 384]
        assert answers["answers"]["grpc"] == [1, 384]
        assert active(tree, "edged.service")
        user = tree.run("stat", "-c", "%U", f"/proc/{tree.main_pid('edged.service')}")
        assert user.stdout.strip() == "edged"
        size = int(tree.run("dpkg-query", "-W", "-f", "${Installed-Size}", "edged").stdout)
        print(
            f"\n{release} ({where}), Python {python}: package {deb.stat().st_size / 2**20:.0f} "
            f"MB, installed {size / 1024:.0f} MB; dpkg -i {took:.1f} s, edged answering "
            f"{ready:.1f} s after; first inferences {answers['seconds']}"
        )
        assert failed_units(tree) == []
    finally:
        tree.poweroff()
        shutil.rmtree(work / "tree", ignore_errors=True)

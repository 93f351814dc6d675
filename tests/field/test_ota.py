"""Software OTA in the field: a package handed over in the spool as cloudsync hands it over
(edged's user's files in /var/lib/edged/updates, request.json last), the package's own
edged-updater.path starting edged-updater.service under systemd, which restarts the units with
systemctl. A good package commits; a bad one (its edged exits at start) rolls back by itself;
a power cut (every process of the tree killed at once) while dpkg unpacks leaves the old
version or the new one installed and serving after the next boot, never neither.

One setting differs from the package: the health window is 40 s instead of 180 (a drop-in for
edged-updater.service), so that the bad package's rollback does not take three minutes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.protocol.manifest import file_entry, make, sign
from tests.conftest import ROOT
from tests.field.rig import Field
from tests.field.test_field import failed_units
from tests.packaging.test_deb import VERSION, package
from tests.packaging.test_updater import build

SPOOL = "/var/lib/edged/updates"
STORE = "/var/lib/edged-updater"
HEALTH_S = 40
DROP_IN = f"""[Service]
ExecStart=
ExecStart=/usr/bin/edged-updater recover --health-s {HEALTH_S}
ExecStart=/usr/bin/edged-updater apply-spool --health-s {HEALTH_S}
"""
BUILDS = {"A": (f"{VERSION}+1", False), "B": (f"{VERSION}+2", False), "BAD": (f"{VERSION}+3", True)}


class Releases:
    """The fleet's side: builds of the package, signed manifests, handed over in the spool."""

    def __init__(self, field: Field, key: Ed25519PrivateKey, builds: dict[str, Path]) -> None:
        self.field = field
        self.key = key
        self.builds = builds
        self.release = 0

    def hand_over(self, name: str) -> int:
        """What cloudsync does once it has the .deb: into the spool as edged's, then the
        request (by a rename, so the path unit sees it whole)."""
        self.release += 1
        deb = self.builds[name]
        signed = make("edged", self.release, [file_entry(deb)], deb_version=BUILDS[name][0])
        request = self.field.root / "field" / "request.json"
        request.write_text(json.dumps({"manifest": sign(signed, {"fleet-1": self.key})}))
        inside = f"/field/{deb.name}"
        self.field.run(
            "install", "-o", "edged", "-g", "edged", "-m", "0640", inside, f"{SPOOL}/{deb.name}"
        )
        self.field.run(
            "install",
            "-o",
            "edged",
            "-g",
            "edged",
            "-m",
            "0640",
            "/field/request.json",
            f"{SPOOL}/.request.json",
        )
        self.field.run("mv", f"{SPOOL}/.request.json", f"{SPOOL}/request.json")
        return self.release

    def result(self, release: int, timeout: float = 600) -> dict[str, Any]:
        """The updater's answer in the spool for ``release`` (cloudsync would take it)."""
        path = self.field.root / SPOOL.lstrip("/") / "result.json"

        def answered() -> bool:
            return path.is_file() and json.loads(path.read_text()).get("version") == release

        self.field.wait(f"the updater's result for release {release}", answered, timeout)
        found: dict[str, Any] = json.loads(path.read_text())
        path.unlink()
        return found


def phase(journal: Path) -> str:
    """The updater's phase in its journal ("" with none under way)."""
    return str(json.loads(journal.read_text()).get("phase", "")) if journal.exists() else ""


def installed(field: Field) -> str:
    return field.run("dpkg-query", "-W", "-f=${db:Status-Abbrev}${Version}", "edged").stdout


def serving(field: Field) -> None:
    field.wait("edged serving", lambda: field.probe("rest", "1")["answered"] == 1, 180)


@pytest.fixture(scope="module")
def releases(field: Field) -> Iterator[Releases]:
    work = ROOT / "build" / "field" / "builds"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    unpacked = work / "unpacked"
    subprocess.run(["dpkg-deb", "-R", str(package()), str(unpacked)], check=True)
    builds = {}
    for name, (version, broken) in BUILDS.items():
        builds[name] = field.root / "field" / f"edged_{name}.deb"
        build(unpacked, version, builds[name], broken)
    shutil.rmtree(unpacked)
    key = Ed25519PrivateKey.generate()
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (field.root / "etc" / "edged" / "trust" / "fleet-1.pub").write_bytes(pem)
    drop_in = field.root / "etc" / "systemd" / "system" / "edged-updater.service.d"
    drop_in.mkdir(parents=True, exist_ok=True)
    (drop_in / "field.conf").write_text(DROP_IN)
    field.run("systemctl", "daemon-reload")
    field.run("edged-updater", "keep", f"/field/{package().name}")  # the way back, once
    yield Releases(field, key, builds)
    shutil.rmtree(work, ignore_errors=True)


def test_a_good_package_commits_and_a_bad_one_rolls_back_by_itself(
    field: Field, releases: Releases
) -> None:
    assert installed(field) == f"ii {VERSION}"
    started = time.monotonic()
    result = releases.result(releases.hand_over("A"))
    took = time.monotonic() - started
    assert result["outcome"] == "committed", result
    assert installed(field) == f"ii {BUILDS['A'][0]}"
    serving(field)
    assert failed_units(field) == []

    started = time.monotonic()
    result = releases.result(releases.hand_over("BAD"))
    back = time.monotonic() - started
    assert result["outcome"] == "rolled-back" and "edged" in result["why"], result
    assert installed(field) == f"ii {BUILDS['A'][0]}"
    serving(field)
    assert failed_units(field) == []
    print(
        f"\nOTA through edged-updater.path: committed in {took:.1f} s, the bad package rolled "
        f"back in {back:.1f} s (health window {HEALTH_S} s)"
    )


def test_a_power_cut_while_dpkg_unpacks_leaves_a_whole_version_after_the_boot(
    field: Field, releases: Releases
) -> None:
    release = releases.hand_over("B")
    journal = field.root / STORE.lstrip("/") / "journal.json"
    field.wait("the install under way", lambda: phase(journal) == "installing", 300)
    time.sleep(2.0)  # dpkg is unpacking
    field.power_cut()
    assert phase(journal) == "installing"

    state = field.boot()  # edged-updater.service runs `recover` at boot
    result = releases.result(release)  # recover answers for the release it finished
    assert result["outcome"] == "rolled-back", result
    assert installed(field) == f"ii {BUILDS['A'][0]}"
    serving(field)
    assert failed_units(field) == [], state

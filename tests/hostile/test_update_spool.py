"""The update spool from root's side: edged-updater (root) takes what unprivileged cloudsync
left in ``/var/lib/edged/updates``, so everything there is written here by an adversary with
another uid (65534, ``setpriv``): links to root's files, FIFOs, oversize and nested JSON,
a .deb that grows or is swapped, links planted where the result is written, the spool itself
a link or writable by all. Each is refused before anything changes, with a result in the spool
that names the file, no root file is read or written through a link, and nothing blocks.

The updater runs in this process against the real trust checks; this machine has no edged
package installed, so a request that passes every check of its files ends at "not installed":
the furthest an update goes without dpkg (tests/packaging/test_updater.py installs for real).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudsync.protocol import spool
from cloudsync.protocol.manifest import file_entry, make, sign
from cloudsync.updater import Settings, Updater
from tests import asunit
from tests.conftest import skip_or_fail

NOBODY = asunit.setpriv(65534)
SECRET = b'{"manifest": "root\'s own file: never read through a link"}'


@dataclass
class Spool:
    base: Path
    spool: Path
    secret: Path
    updater: Updater
    key: Ed25519PrivateKey
    deb: Path  # what cloudsync would have downloaded (not a real package)

    def nobody(self, script: str) -> None:
        """``script`` (sh) run in the spool by uid 65534, its owner."""
        subprocess.run([*NOBODY, "sh", "-ec", script], cwd=self.spool, check=True, timeout=30)

    def request(self, deb: Path | None = None, **signed: Any) -> str:
        doc = make("edged", 7, [file_entry(deb or self.deb)], 3600.0, deb_version="1.0+1")
        doc.update(signed)
        return json.dumps({"manifest": sign(doc, {"fleet-1": self.key})})

    def put(self, name: str, data: str | bytes) -> None:
        staged = self.base / "incoming"
        staged.write_bytes(data.encode() if isinstance(data, str) else data)
        staged.chmod(0o644)
        self.nobody(f"cp {staged} {name}")

    def take(self) -> dict[str, Any]:
        """apply-spool, bounded in time (a FIFO must not block it), and the result it wrote."""
        signal.alarm(20)
        try:
            answer = self.updater.apply_spool()
        finally:
            signal.alarm(0)
        assert answer is not None and answer["outcome"] == "refused", answer
        result = self.spool / spool.RESULT
        assert not result.is_symlink() and result.is_file()
        written = json.loads(result.read_bytes())
        assert written == answer
        assert not os.path.lexists(self.spool / spool.REQUEST)  # taken, whatever it was
        assert self.secret.read_bytes() == SECRET and self.secret.stat().st_mode & 0o777 == 0o600
        assert not list((self.base / "store" / "packages").glob("*.deb"))  # nothing kept
        (self.spool / spool.RESULT).unlink()
        return written


@pytest.fixture
def box() -> Iterator[Spool]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        skip_or_fail("the adversary is another uid: needs root and setpriv (make test runs so)")
    base = Path(tempfile.mkdtemp(prefix="edged-spool-", dir="/tmp"))
    try:
        base.chmod(0o755)
        where = base / "updates"
        where.mkdir(mode=0o750)
        os.chown(where, 65534, 65534)
        secret = base / "secret.json"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        trust = base / "trust"
        trust.mkdir()
        key = Ed25519PrivateKey.generate()
        pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (trust / "fleet-1.pub").write_bytes(pem)
        settings_ = Settings(
            store=base / "store",
            trust_dir=trust,
            trust_file=base / "trust.json",
            socket=base / "no.sock",
            cloudsync_socket=base / "no-cs.sock",
            restart=("true",),
            health_s=1,
            spool=where,
        )
        deb = base / "edged_1.0+1_amd64.deb"
        deb.write_bytes(b"!<arch>\n" + os.urandom(4096))
        deb.chmod(0o644)
        box = Spool(base, where, secret, Updater(settings_), key, deb)
        box.put(deb.name, deb.read_bytes())
        yield box
    finally:
        shutil.rmtree(base)


def test_links_fifos_and_oversize_requests_are_refused_naming_the_file(box: Spool) -> None:
    assert box.updater.apply_spool() is None  # no request: nothing written
    assert not (box.spool / spool.RESULT).exists()
    cases = [
        (f"ln -s {box.secret} request.json", "request.json: cannot be opened"),
        ("mkfifo request.json", "request.json: not a regular file"),
        ("mkdir request.json", "request.json: not a regular file"),
        ("head -c 2000000 /dev/zero > request.json", "request.json: 2000000 bytes, more than"),
    ]
    for script, says in cases:
        box.nobody(script)
        result = box.take()
        assert says in result["why"] and result["version"] is None, (script, result)
    for body, says in (
        ("[" * 200_000, "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ("\udcff".encode("utf-8", "surrogatepass"), "not JSON"),
        ('{"manifest": 5}', "the manifest:"),
    ):
        box.put(spool.REQUEST, body)
        result = box.take()
        assert says in result["why"], (body[:20], result)


def test_a_package_reached_through_a_link_a_fifo_or_grown_is_refused(box: Spool) -> None:
    name = box.deb.name
    length = box.deb.stat().st_size
    for script, says in (
        (f"rm {name}; ln -s {box.secret} {name}", f"{name}: cannot be opened"),
        (f"rm {name}; mkfifo {name}", f"{name}: not a regular file"),
        (f"rm {name}; head -c {length + 1} /dev/zero > {name}", f"{length + 1} bytes, more than"),
        (f"rm {name}; head -c {length} /dev/zero > {name}", "not the file the manifest lists"),
        (f"rm {name}", f"{name}: "),
    ):
        box.nobody(script)
        box.put(spool.REQUEST, box.request())
        result = box.take()
        assert says in result["why"] and result["version"] == 7, (script, result)
    # the right file gets as far as this machine allows (no edged package here)
    box.put(name, box.deb.read_bytes())
    box.put(spool.REQUEST, box.request())
    assert "is not edged 1.0+1" in box.take()["why"]


def test_forged_and_foreign_manifests_are_refused(box: Spool) -> None:
    stranger = Ed25519PrivateKey.generate()
    forged = make("edged", 8, [file_entry(box.deb)], 3600.0, deb_version="1.0+1")
    box.put(spool.REQUEST, json.dumps({"manifest": sign(forged, {"fleet-1": stranger})}))
    assert "fleet-1's signature does not verify" in box.take()["why"]
    model = make("edged", 9, [file_entry(box.deb, "model.onnx")], 3600.0)
    box.put(spool.REQUEST, json.dumps({"manifest": sign(model, {"fleet-1": box.key})}))
    assert "not a manifest of the edged package" in box.take()["why"]


def test_the_result_replaces_links_planted_in_its_way_and_follows_none(box: Spool) -> None:
    target = box.base / "root-file"
    target.write_bytes(b"root's")
    part = f".{spool.RESULT}.{os.getpid()}.part"
    box.nobody(f"ln -s {target} {spool.RESULT}; ln -s {target} {part}")
    box.put(spool.REQUEST, "{}")
    box.take()
    assert target.read_bytes() == b"root's"
    assert not os.path.lexists(box.spool / part)


def test_a_spool_that_is_a_link_or_writable_by_all_is_not_read(box: Spool) -> None:
    box.put(spool.REQUEST, box.request())
    box.spool.chmod(0o777)
    refused = box.updater.apply_spool()
    assert refused is not None and "writable by every user" in refused["why"]
    box.spool.chmod(0o750)
    moved = box.base / "real"
    box.spool.rename(moved)
    box.spool.symlink_to(moved)
    refused = box.updater.apply_spool()
    assert refused is not None and "not a directory this updater opens" in refused["why"]
    # nothing was read, taken or written there
    assert (moved / spool.REQUEST).exists() and not (moved / spool.RESULT).exists()


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    manifest=JSON,
    signed=st.dictionaries(
        st.sampled_from(
            ["model", "version", "type", "deb_version", "remove", "files", "expires", "targets"]
        ),
        JSON,
        max_size=3,
    ),
)
def test_any_request_is_refused_with_a_result_and_never_raises(
    box: Spool, manifest: Any, signed: dict[str, Any]
) -> None:
    for body in ({"manifest": manifest}, json.loads(box.request(**signed))):
        (box.spool / spool.REQUEST).write_text(json.dumps(body))
        assert box.take()["outcome"] == "refused"

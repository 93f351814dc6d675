"""edged-updater in a clean Debian 12 tree (the packaging tests' chroot, no network), with the
real package: a good .deb goes from version N to N+1; a bad one (edged never becomes ready) is
rolled back by itself; and a power cut at each point of an update (the updater SIGKILLed at a
named point, or its whole process group killed while dpkg unpacks; edged killed with it, then
a "boot": edged started again and `edged-updater recover`) leaves N or N+1 installed and
serving, never neither.

What is not simulated: the page cache lost at a power cut (a chroot shares the host's kernel);
the journal and the kept packages are fsynced, dpkg syncs its own database. Without systemd in
the tree, a script stands in for `systemctl restart` (it starts edged as its unit would).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloudsync.fleet.common import secure_link_url
from cloudsync.protocol import envelope
from cloudsync.protocol.manifest import file_entry, make, sign
from edged.client import Client, ClientError
from tests.cloudsync_agent import NODE, bodies, operator
from tests.conftest import skip_or_fail, wait_for
from tests.mosquitto import OPERATOR, Broker, cloudsync_config, make_pki
from tests.nginx import SECRET, Cdn
from tests.packaging.test_deb import BASE, SOCKET, VERSION, Tree, deb, debian_tree  # noqa: F401

RESTART = "/usr/local/sbin/edged-restart"
# Stands in for `systemctl try-restart edged`: edged as its unit runs it, its output to a file
# (the updater must not wait on it), its PID kept so that the next restart (or a test) ends it.
RESTART_SCRIPT = """#!/bin/sh
if [ -f /run/edged/test.pid ]; then
    pid=$(cat /run/edged/test.pid)
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
fi
install -d -o edged -g edged /run/edged
setsid setpriv --reuid=edged --regid=edged --init-groups /usr/bin/edged \
    >>/tmp/edged.log 2>&1 </dev/null &
echo $! > /run/edged/test.pid
"""
BROKEN_EDGED = "#!/bin/sh\necho 'this build of edged is broken' >&2\nexit 1\n"


@dataclass
class World:
    tree: Tree
    key: Ed25519PrivateKey
    builds: dict[str, str]  # name -> path of the .deb inside the tree
    versions: dict[str, str]  # name -> Debian version
    release: int = 0  # the last manifest version signed

    def manifest(self, name: str) -> str:
        """A signed package manifest for a build (a new release number each time)."""
        self.release += 1
        inside = self.builds[name]
        signed = make(
            "edged",
            self.release,
            [file_entry(self.tree.path(inside))],
            deb_version=self.versions[name],
        )
        path = f"/tmp/manifest-{self.release}.json"
        self.tree.path(path).write_text(json.dumps(sign(signed, {"fleet-1": self.key})))
        return path

    def updater(self, *args: str, crash: str = "", health_s: float = 120) -> subprocess.Popen[str]:
        env = ["env", f"EDGED_UPDATER_CRASH={crash}"] if crash else []
        command = [*env, "edged-updater", *args, "--restart", RESTART, "--health-s", str(health_s)]
        return subprocess.Popen(
            ["unshare", "--net", "chroot", str(self.tree.root), *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )

    def update(self, name: str, crash: str = "", health_s: float = 120) -> tuple[int, Any]:
        proc = self.updater(
            "apply", self.manifest(name), self.builds[name], crash=crash, health_s=health_s
        )
        out, err = proc.communicate(timeout=900)
        print(err[-2000:])
        return proc.returncode, json.loads(out) if out.strip() else {}

    def installed(self) -> str:
        return self.tree.run(
            "dpkg-query", "-W", "-f=${db:Status-Abbrev}${Version}", "edged", check=False
        ).strip()

    def power_cut(self) -> None:
        """Everything stops at once: edged too (the updater already is)."""
        pid_file = self.tree.path("/run/edged/test.pid")
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            pid_file.unlink()

    def boot(self) -> Any:
        """What a boot does: edged starts (its unit), and edged-updater recover runs."""
        self.tree.run(RESTART)
        proc = self.updater("recover", health_s=60)
        out, err = proc.communicate(timeout=900)
        print(err[-2000:])
        return json.loads(out)

    def serving(self) -> str:
        """The version of edged that answers (ready), within two minutes."""
        client = Client(str(self.tree.path(SOCKET)), timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if client.ready():
                    return str(client.server_metadata()["version"])
            except (ClientError, OSError):
                pass
            time.sleep(0.5)
        log = self.tree.path("/tmp/edged.log").read_text(errors="replace")[-2000:]
        raise AssertionError(f"edged is not serving: {log}")


def build(unpacked: Path, version: str, out: Path, broken: bool = False) -> None:
    control = unpacked / "DEBIAN" / "control"
    text = control.read_text()
    old = next(line for line in text.splitlines() if line.startswith("Version: "))
    control.write_text(text.replace(old, f"Version: {version}"))
    script = unpacked / "usr" / "lib" / "edged" / "bin" / "edged"
    saved = script.read_bytes()
    if broken:
        script.write_text(BROKEN_EDGED)
    try:
        subprocess.run(
            ["dpkg-deb", "-Zgzip", "-z1", "-b", str(unpacked), str(out)],
            check=True,
            capture_output=True,
        )
    finally:
        script.write_bytes(saved)


@pytest.fixture(scope="module")
def world(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:  # noqa: F811
    with debian_tree(BASE, tmp_path_factory.mktemp("updater")) as tree:
        world = World(tree, Ed25519PrivateKey.generate(), {"N": "/tmp/edged_N.deb"}, {"N": VERSION})
        try:
            shutil.copy(deb, tree.path("/tmp/edged_N.deb"))
            tree.run("dpkg", "-i", "/tmp/edged_N.deb")
            unpacked = tmp_path_factory.mktemp("unpacked") / "edged"
            subprocess.run(["dpkg-deb", "-R", str(deb), str(unpacked)], check=True)
            for name, version, broken in (
                ("A", f"{VERSION}+1", False),
                ("B", f"{VERSION}+2", False),
                ("BAD", f"{VERSION}+3", True),
            ):
                build(unpacked, version, tree.path(f"/tmp/edged_{name}.deb"), broken)
                world.builds[name], world.versions[name] = f"/tmp/edged_{name}.deb", version
            shutil.rmtree(unpacked)
            trust = tree.path("/etc/edged/trust")
            trust.mkdir(exist_ok=True)
            pem = world.key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            (trust / "fleet-1.pub").write_bytes(pem)
            script = tree.path(RESTART)
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(RESTART_SCRIPT)
            script.chmod(0o755)
            tree.run(RESTART)
            yield world
        finally:
            world.power_cut()


def test_good_bad_and_a_power_cut_at_each_point_leave_n_or_n_plus_1_serving(
    world: World,
) -> None:
    assert world.serving() == VERSION
    # no way back yet: refused before anything changes
    code, _ = world.update("A")
    assert code == 2 and world.installed() == f"ii {VERSION}"
    world.tree.run("edged-updater", "keep", "/tmp/edged_N.deb")
    # what it is handed is checked before anything changes: the .deb the manifest lists, a
    # manifest the fleet's keys signed
    proc = world.updater("apply", world.manifest("A"), world.builds["B"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "is not the file the manifest lists" in err, err
    forged = world.tree.path(world.manifest("A"))
    doc = json.loads(forged.read_text())
    doc["signatures"][0]["sig"] = doc["signatures"][0]["sig"][::-1]
    forged.write_text(json.dumps(doc))
    proc = world.updater("apply", f"/{forged.relative_to(world.tree.root)}", world.builds["A"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "valid signature" in err, err
    assert world.installed() == f"ii {VERSION}"

    # a good package: N -> N+1, committed
    code, result = world.update("A")
    assert code == 0 and result["outcome"] == "committed", result
    assert world.installed() == f"ii {world.versions['A']}"
    assert world.serving() == VERSION  # the package's edged (its --version is the source's)
    assert not world.tree.path("/var/lib/edged-updater/journal.json").exists()
    kept = world.tree.path("/var/lib/edged-updater/packages")
    assert {p.name for p in kept.glob("*.deb")} == {
        f"edged_{VERSION}.deb",
        f"edged_{world.versions['A']}.deb",
    }  # N and N+1: the way back, and the way back from the next

    # a bad one (edged exits at start): rolled back to N+1 by itself
    code, result = world.update("BAD", health_s=20)
    assert code == 1 and result["outcome"] == "rolled-back", result
    assert "edged" in result["why"] and result["to"] == world.versions["BAD"]
    assert world.installed() == f"ii {world.versions['A']}"
    world.serving()
    # the same release again: refused, from the updater's own record
    proc = world.updater("apply", f"/tmp/manifest-{world.release}.json", world.builds["BAD"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "was rolled back here" in err, err

    # a power cut at each point of the update A -> B, then a boot
    expected = {
        "staged": ("abandoned", "A"),
        "installing": ("rolled-back", "A"),
        "dpkg": ("rolled-back", "A"),  # the process group killed while dpkg unpacks
        "installed": ("rolled-back", "A"),
        "checking": ("committed", "B"),
    }
    for point, (outcome, version) in expected.items():
        if point == "dpkg":
            proc = world.updater("apply", world.manifest("B"), world.builds["B"])
            journal = world.tree.path("/var/lib/edged-updater/journal.json")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and '"installing"' not in (
                journal.read_text() if journal.exists() else ""
            ):
                time.sleep(0.05)
            time.sleep(2.0)  # dpkg is unpacking
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            code, _ = world.update("B", crash=point)
            assert code == -signal.SIGKILL, point
        world.power_cut()
        recovered = world.boot()
        assert recovered["outcome"] == outcome, (point, recovered)
        assert world.installed() == f"ii {world.versions[version]}", point
        world.serving()
        if version == "B":  # back to A for the next point: an update like any other
            assert world.update("A")[1]["outcome"] == "committed"

    # cut short while rolling back a bad package: the boot finishes the rollback
    code, _ = world.update("BAD", crash="rolling-back", health_s=20)
    assert code == -signal.SIGKILL
    world.power_cut()
    assert world.boot()["outcome"] == "rolled-back"
    assert world.installed() == f"ii {world.versions['A']}"
    world.serving()
    status = json.loads(world.tree.run("edged-updater", "status"))
    assert status["installed"] == world.versions["A"] and status["journal"] == {}


def test_cloudsync_fetches_a_package_and_hands_it_to_the_updater_through_the_spool(
    world: World, tmp_path: Path
) -> None:
    """The whole way of a package manifest: the desired state on a real Mosquitto, the package's
    cloudsync (as edged's user, in the tree, on the host's loopback) fetching the .deb from nginx
    into the spool and writing request.json, `edged-updater apply-spool` (what
    edged-updater.path starts; no systemd in the tree, so the test starts it once the request is
    there) updating, and cloudsync reporting the outcome: active, then a bad release
    rolled-back."""
    for why in (Broker.available(), Cdn.available()):
        if why:
            skip_or_fail(why)
    tree = world.tree
    world.power_cut()  # whatever the test before left: a boot, and the way back kept
    world.boot()
    current = next(n for n, v in world.versions.items() if world.installed() == f"ii {v}")
    tree.run("edged-updater", "keep", world.builds[current])
    good = "B" if current != "B" else "A"
    # a Debian system resolves localhost (the CDN's certificate names it); debootstrap's tree
    # has no /etc/hosts
    tree.path("/etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    pki = make_pki(tree.path("/etc/edged/test-pki"), ["n1"])
    broker = Broker(tmp_path / "mosquitto", pki).start()
    cdn = Cdn(tmp_path / "cdn", pki).start()
    work = Path("/var/lib/edged/cs")
    inside = cloudsync_config(broker, work, "f1", edged_socket=Path(SOCKET))
    inside = inside.replace(str(tree.root), "").replace(f"{work}/trust", "/etc/edged/trust")
    inside = inside.replace(f"{work}/cloudsync.sock", "/run/edged/cloudsync.sock")
    inside += (
        '[delivery]\nca_file = "/etc/edged/test-pki/ca.pem"\nretry_s = 2\n'
        "attempts = 2\n[heartbeat]\ninterval_s = 1\n"
    )
    tree.path("/etc/edged/cloudsync.toml").write_text(inside)
    tree.run("install", "-d", "-o", "edged", "-g", "edged", str(work))
    tree.run("chown", "-R", "edged:edged", "/etc/edged/test-pki")
    consumer = operator(broker)
    with (tmp_path / "cloudsync.log").open("ab") as log:
        agent = subprocess.Popen(
            [
                "chroot",
                str(tree.root),
                "setpriv",
                "--reuid=edged",
                "--regid=edged",
                "--init-groups",
                "/usr/bin/cloudsync",
                "--config",
                "/etc/edged/cloudsync.toml",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
    spool_dir = tree.path("/var/lib/edged/updates")

    def steps() -> list[dict[str, Any]]:
        found = bodies(list(consumer.received), "events")
        return [e.body["delivery"] for e in found if "delivery" in e.body]

    def step(name: str, release: int, timeout: float = 120) -> dict[str, Any]:
        def row() -> dict[str, Any] | None:
            return next(
                (r for r in steps() if r["step"] == name and r.get("version") == release), None
            )

        wait_for(row, timeout, f"step {name} of release {release}: {steps()}", agent)
        found = row()
        assert found is not None and found["model"] == "package:edged", found
        return found

    def deliver(name: str) -> int:
        manifest = json.loads(tree.path(world.manifest(name)).read_text())
        uri = cdn.put(
            f"edged/{Path(world.builds[name]).name}", tree.path(world.builds[name]).read_bytes()
        )
        urls = {Path(world.builds[name]).name: secure_link_url(cdn.base, uri, SECRET, 600)}
        body = {"models": [{"manifest": manifest, "urls": urls}]}
        payload = envelope.Envelope(OPERATOR, int(time.time() * 1000), body).encode()
        assert not consumer.publish(NODE.desired_models, payload, retain=True).is_failure
        return world.release

    try:
        release = deliver(good)
        wait_for(
            lambda: (spool_dir / "request.json").exists(),
            120,
            f"the request in the spool: {steps()}",
            agent,
        )
        assert step("accepted", release)["deb_version"] == world.versions[good]
        deb = Path(world.builds[good]).name
        assert step("downloaded", release)["bytes"] == tree.path(world.builds[good]).stat().st_size
        step("handed-over", release)
        assert (spool_dir / deb).stat().st_uid != 0  # cloudsync's, not root's
        proc = world.updater("apply-spool")
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0 and json.loads(out)["outcome"] == "committed", err
        assert world.installed() == f"ii {world.versions[good]}"
        active = step("active", release)
        assert active["outcome"] == "committed" and active["deb_version"] == world.versions[good]
        assert not (spool_dir / "result.json").exists()  # taken by cloudsync
        assert not (spool_dir / "request.json").exists()
        world.serving()

        release = deliver("BAD")
        wait_for(
            lambda: (spool_dir / "request.json").exists(),
            120,
            f"the request in the spool: {steps()}",
            agent,
        )
        proc = world.updater("apply-spool", health_s=20)
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 1 and json.loads(out)["outcome"] == "rolled-back", err
        back = step("rolled-back", release)
        assert "edged" in back["why"] and back["deb_version"] == world.versions["BAD"]
        assert world.installed() == f"ii {world.versions[good]}"
        world.serving()
        # the same release is not handed over again (cloudsync's state, and the updater's)
        time.sleep(6)
        assert not (spool_dir / "request.json").exists()
        assert [r["step"] for r in steps() if r.get("version") == release].count("handed-over") == 1
    finally:
        agent.kill()
        agent.wait()
        consumer.close()
        cdn.stop()
        broker.kill()
        print((tmp_path / "cloudsync.log").read_text(errors="replace")[-3000:])

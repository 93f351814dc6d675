"""The Debian package as users get it: lintian's verdict, then one package's life in a fresh
Debian 12 tree (mmdebstrap, made by `make test` from Debian's mirror with what the package
depends on): `dpkg -i` with no network, edged --version, edged started in the tree answering an
inference over its socket, an upgrade to a newer build keeping the operator's config and edged's
state, and a purge removing what Debian's policy says it must.

`make test` builds both (`make deb`, build/debian-base.tar). The tree is entered with chroot
and `unshare --net` (so nothing in it can reach a network); these tests need root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.client import Client, ClientError
from tests.conftest import ROOT, skip_or_fail

BASE = ROOT / "build" / "debian-base.tar"
# The first line of the changelog: "edged (VERSION) unstable; urgency=medium".
VERSION = (ROOT / "debian" / "changelog").read_text().split("(", 1)[1].split(")", 1)[0]
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
SOCKET = "run/edged/edged.sock"


def package() -> Path:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True)
    return ROOT / "build" / "deb" / f"edged_{VERSION}_{arch.stdout.strip()}.deb"


@pytest.fixture(scope="module")
def deb() -> Path:
    if shutil.which("dpkg-deb") is None:
        skip_or_fail("dpkg-deb is not installed (not a Debian system)")
    if not package().is_file():
        skip_or_fail(f"{package().name} is not built: run `make deb` (make test does)")
    return package()


class Tree:
    """A Debian tree in a directory, entered with chroot and without a network."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = ENV | (env or {})

    def run(self, *command: str, check: bool = True, timeout: float = 300) -> str:
        started = time.monotonic()
        done = subprocess.run(
            ["unshare", "--net", "chroot", str(self.root), *command],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        print(f"{' '.join(command)}: {time.monotonic() - started:.1f} s, exit {done.returncode}")
        if check:
            assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def start_edged(self) -> subprocess.Popen[bytes]:
        """edged as its user, as the unit starts it (without systemd: no socket activation)."""
        uid, gid = (int(self.run("id", flag, "edged").strip()) for flag in ("-u", "-g"))
        run_dir = self.path("/run/edged")
        run_dir.mkdir(exist_ok=True)
        os.chown(run_dir, uid, gid)
        log = (self.root / "tmp" / "edged.log").open("wb")
        # unshare and chroot exec what follows: the PID is edged's.
        as_edged = ["setpriv", "--reuid=edged", "--regid=edged", "--init-groups"]
        return subprocess.Popen(
            ["unshare", "--net", "chroot", str(self.root), *as_edged, "/usr/bin/edged"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )

    def client(self, proc: subprocess.Popen[bytes], ready_s: float = 180) -> Client:
        client = Client(str(self.path(SOCKET)), timeout=60)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"edged exited {proc.returncode}: {self.log()}"
            try:
                if client.ready():
                    return client
            except (ClientError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"edged in the tree was not ready in {ready_s} s: {self.log()}")

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, self.log()

    def log(self) -> str:
        return (self.root / "tmp" / "edged.log").read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def debian_tree(base: Path, root: Path, env: dict[str, str] | None = None) -> Iterator[Tree]:
    """The tree of ``base`` (a tarball `make test` makes) in ``root``, with /proc, removed after
    (skipped, saying why, without root or the tarball)."""
    if os.geteuid() != 0:
        skip_or_fail("installing into a Debian tree needs root (chroot, dpkg)")
    if not base.is_file():
        skip_or_fail(f"{base} is missing: `make test` makes it with mmdebstrap")
    subprocess.run(["tar", "-xf", str(base), "-C", str(root)], check=True)
    (root / "proc").mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
    try:
        yield Tree(root, env)
    finally:
        subprocess.run(["umount", "--lazy", str(root / "proc")], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tree(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    with debian_tree(BASE, tmp_path_factory.mktemp("debian12")) as found:
        yield found


def test_lintian_reports_no_errors(deb: Path) -> None:
    if shutil.which("lintian") is None:
        skip_or_fail("lintian is not installed (make test installs it)")
    done = subprocess.run(
        ["lintian", "--fail-on", "error", "--tag-display-limit", "0", str(deb)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout)
    errors = [line for line in done.stdout.splitlines() if line.startswith("E:")]
    assert done.returncode == 0 and not errors, done.stdout + done.stderr
    # Every warning left is one docs/OPERATIONS.md lists and justifies.
    documented = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for line in done.stdout.splitlines():
        if line.startswith("W:"):
            tag = line.split()[2]
            assert f"`{tag}`" in documented, f"lintian warning not in docs/OPERATIONS.md: {line}"


def test_installs_offline_and_serves_from_the_package(deb: Path, tree: Tree) -> None:
    shutil.copy(deb, tree.path("/tmp/edged.deb"))
    tree.run("dpkg", "-i", "/tmp/edged.deb")
    assert tree.run("edged", "--version").strip() == f"edged {VERSION}"
    assert tree.run("cloudsync", "--version").strip() == f"cloudsync {VERSION}"
    assert {"video", "render"} <= set(tree.run("id", "-nG", "edged").split())
    conffiles = tree.run("dpkg-query", "-W", "-f=${Conffiles}", "edged")
    assert "/etc/edged/edged.toml" in conffiles and "/etc/edged/cloudsync.toml" in conffiles
    assert "/etc/edgefleet/edgefleet.toml" in conffiles
    tree.run("edged", "validate-config", "--config", "/etc/edged/edged.toml")
    # The units, enabled as the package says: edged and its socket at boot, cloudsync by the
    # operator once the fleet is configured.
    wants = tree.path("/etc/systemd/system")
    assert (wants / "multi-user.target.wants" / "edged.service").is_symlink()
    assert (wants / "sockets.target.wants" / "edged.socket").is_symlink()
    assert (wants / "multi-user.target.wants" / "edged-updater.service").is_symlink()
    for operators in ("cloudsync.service", "edgefleet.service"):
        assert not (wants / "multi-user.target.wants" / operators).exists()
        assert tree.path(f"/lib/systemd/system/{operators}").is_file()
    assert "edgefleet" in tree.run("getent", "passwd", "edgefleet")
    # The units as installed, with the commands they name in place: systemd finds nothing to say.
    units = [
        f"/lib/systemd/system/{u}"
        for u in (
            "edged.service",
            "edged.socket",
            "cloudsync.service",
            "edgefleet.service",
            "edged-updater.service",
        )
    ]
    assert tree.run("systemd-analyze", "verify", "--man=no", *units).strip() == ""
    # The state and cache directories, edged's; the models seeded into the repository, its
    # directories edged's, the ONNX files hard links to the package's (read-only to edged).
    for path, mode in (
        ("/var/lib/edged", "750"),
        ("/var/lib/edged/staging", "700"),
        ("/var/lib/edged/models", "750"),
        ("/var/cache/edged", "750"),
        ("/var/lib/edged/models/intent-classifier/1", "755"),
    ):
        assert tree.run("stat", "-c", "%U %G %a", path).split() == ["edged", "edged", mode], path
    seeded = tree.path("/var/lib/edged/models/intent-classifier/1/model.onnx")
    assert os.path.samefile(
        seeded, tree.path("/usr/share/edged/models/intent-classifier/1/model.onnx")
    )
    # Debian's Python bindings are importable from the package's environment: python3-systemd
    # (in the tree) for real; TensorRT's python3-libnvinfer exists only in NVIDIA's JetPack and
    # CUDA repositories, so a stand-in module where it installs stands for it.
    python = "/usr/lib/edged/bin/python"
    tree.run(python, "-c", "import systemd.daemon")
    # the fleet service serves its OpenAPI document from the package
    tree.run(python, "-c", "from cloudsync.fleet.api import OPENAPI; assert OPENAPI.is_file()")
    standin = tree.path(f"/usr/lib/python3.{python_minor(tree)}/dist-packages/tensorrt")
    standin.mkdir(parents=True)
    (standin / "__init__.py").write_text("__version__ = 'stand-in'\n")
    assert tree.run(python, "-c", "import tensorrt; print(tensorrt.__version__)").strip() == (
        "stand-in"
    )
    shutil.rmtree(standin)

    proc = tree.start_edged()
    try:
        client = tree.client(proc)
        answer = client.task("intent", {"texts": ["turn off the lights in the kitchen"]})
        print("answer from the installed package:", answer)
        assert answer["route"] == "local" and answer["intents"][0]["intent"]
        # State for the upgrade to keep: a drain (admin.json in /var/lib/edged).
        client.drain(reason="upgrade test")
    finally:
        tree.stop(proc)


def python_minor(tree: Tree) -> str:
    return tree.run("python3", "-c", "import sys; print(sys.version_info[1])").strip()


def test_an_upgrade_keeps_the_operators_config_and_edgeds_state(
    deb: Path, tree: Tree, tmp_path: Path
) -> None:
    config = tree.path("/etc/edged/edged.toml")
    config.write_text(config.read_text() + "\n[scheduler]\nmax_queue_size = 99\n")
    state = tree.path("/var/lib/edged/admin.json").read_text()
    assert '"drained"' in state
    # a model removed from the device (as edged removes one: its directory gone, a tombstone
    # left) is not seeded again by the upgrade; one deleted by hand is
    models = tree.path("/var/lib/edged/models")
    shutil.rmtree(models / "vad")
    (models / ".vad.removed").write_text("removed\n")
    shutil.rmtree(models / "intent")
    # The next build: this package with a higher version (what changes between builds is not
    # what is tested here; what dpkg keeps is).
    unpacked = tmp_path / "unpacked"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(unpacked)], check=True)
    control = unpacked / "DEBIAN" / "control"
    control.write_text(control.read_text().replace(f"Version: {VERSION}", f"Version: {VERSION}+1"))
    subprocess.run(
        ["dpkg-deb", "-Zgzip", "-z1", "-b", str(unpacked), str(tree.path("/tmp/next.deb"))],
        check=True,
        capture_output=True,
    )
    tree.run("dpkg", "-i", "/tmp/next.deb")
    assert tree.run("dpkg-query", "-W", "-f=${Version}", "edged") == f"{VERSION}+1"
    assert "max_queue_size = 99" in config.read_text()
    assert tree.path("/var/lib/edged/admin.json").read_text() == state
    assert not list(tree.path("/etc/edged").glob("*.dpkg-*")), "dpkg asked about a conffile"
    assert not (models / "vad").exists() and (models / "intent" / "config.pbtxt").is_file()
    proc = tree.start_edged()
    try:
        client = tree.client(proc)
        assert client.status()["drained"], "the drain did not outlive the upgrade"
        client.resume()
        answer = client.task("intent", {"texts": ["what is the weather tomorrow"]})
        assert answer["route"] == "local"
    finally:
        tree.stop(proc)


def test_purge_removes_the_package_its_state_and_its_config(tree: Tree) -> None:
    tree.run("dpkg", "--purge", "edged")
    for gone in (
        "/usr/lib/edged",
        "/usr/bin/edged",
        "/usr/share/edged",
        "/var/lib/edged",
        "/var/cache/edged",
        "/etc/edged",
        "/lib/systemd/system/edged.service",
        "/etc/systemd/system/multi-user.target.wants/edged.service",
        "/etc/systemd/system/sockets.target.wants/edged.socket",
    ):
        assert not os.path.lexists(tree.path(gone)), f"{gone} is left after the purge"
    # The system user stays, as Debian's practice is: files it owns may remain elsewhere.
    assert tree.run("id", "-u", "edged", check=False).strip().isdigit()

"""The field rig: a fresh Debian 12 tree booted with systemd as PID 1 (``systemd-nspawn -b``),
the package installed in it by ``dpkg -i`` as an operator would, and the units run by systemd
as the package ships them. The tree's network is a namespace of the tests' own (``Network``):
a device tree and a fleet tree, each behind its own end of a veth pair, and nothing else. The
tests drive it from outside with ``nsenter`` into all of the
container's namespaces, as root or, through ``setpriv``, as one of the field's users.

What cannot be here is named by the tests that would need it (a Jetson's sysfs and jtop,
nvpmodel, TensorRT, a GPU), never passed over in silence.
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
from pathlib import Path
from typing import Any

from tests.asunit import proc_status

NSPAWN = ["systemd-nspawn", "-q", "--register=no", "--keep-unit"]
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
PROBE = Path(__file__).with_name("probe.py")
PYTHON = "/usr/lib/edged/bin/python"  # the package's interpreter: Debian's python3, its venv

# The field's users, made in the tree after the package (systemd-sysusers): a program allowed
# to call edged, a user outside edged's groups, an operator in the admin group.
USERS = """\
u alice - "a program allowed to call edged"
m alice edged
u bob - "a user outside edged's groups"
u carol - "an operator"
m carol edged
m carol edged-admin
"""


class Network:
    """Two network namespaces joined by a veth pair, the field's LAN: the device's
    (``DEVICE``) and the fleet's (``FLEET``), each with its loopback. Named namespaces outlive
    the trees in them, so a tree's power cut and boot find the same network; ``link`` takes the
    device's cable out and puts it back."""

    DEVICE, FLEET = "edged-field-device", "edged-field-fleet"
    DEVICE_ADDRESS, FLEET_ADDRESS = "10.77.0.2", "10.77.0.1"

    def __init__(self) -> None:
        self.remove()
        for name in (self.DEVICE, self.FLEET):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip(
            "link",
            "add",
            "eth0",
            "netns",
            self.DEVICE,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.FLEET,
        )
        for name, address in ((self.DEVICE, self.DEVICE_ADDRESS), (self.FLEET, self.FLEET_ADDRESS)):
            ip("-n", name, "address", "add", f"{address}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    def link(self, up: bool) -> None:
        ip("-n", self.DEVICE, "link", "set", "eth0", "up" if up else "down")

    def remove(self) -> None:
        """Both namespaces (and so the pair), where they are (a run killed earlier left them)."""
        for name in (self.DEVICE, self.FLEET):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Field:
    """One booted tree: ``boot``, ``run`` commands in it, ``power_cut`` or ``poweroff``; its
    network is the named namespace ``netns`` (None: its own loopback only)."""

    def __init__(self, root: Path, log: Path, netns: str | None = None) -> None:
        self.root = root
        self.log = log
        self.netns = netns
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.init = 0  # the container's PID 1, as the host numbers it

    @classmethod
    def unpack(cls, base: Path, root: Path, log: Path, netns: str | None = None) -> Field:
        """A fresh tree from the tarball ``base`` (mmdebstrap's), at ``root``."""
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        subprocess.run(
            ["tar", "-x", "--numeric-owner", "-C", str(root), "-f", str(base)], check=True
        )
        # nspawn boots a tree only with an os-release and a machine id it may set up itself
        (root / "etc" / "machine-id").write_text("")
        return cls(root, log, netns)

    def boot(self, timeout: float = 180) -> str:
        """Start the tree's systemd; return ``systemctl is-system-running`` once it settles."""
        network = (
            f"--network-namespace-path=/run/netns/{self.netns}"
            if self.netns
            else ("--private-network")
        )
        with self.log.open("ab") as out:
            self.nspawn = subprocess.Popen(
                [*NSPAWN, network, "-D", str(self.root), "-b"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.init:
            if self.nspawn.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"systemd-nspawn did not start the tree:\n{self.logs()}")
            self.init = container_init(self.nspawn.pid)
            time.sleep(0.1)
        while True:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state not in ("initializing", "starting", ""):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"the tree's systemd is still {state!r} after {timeout} s")
            time.sleep(0.5)

    def run(
        self,
        *command: str,
        user: str | None = None,
        check: bool = True,
        timeout: float = 300,
        input: bytes | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``command`` inside the booted tree, as root or as ``user`` (with its groups)."""
        assert self.init, "the tree is not booted"
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"]
        done = subprocess.run(
            ["nsenter", "-t", str(self.init), "-a", "--", *(as_user if user else []), *command],
            input=input.decode() if input is not None else None,
            capture_output=True,
            text=True,
            env=ENV,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def probe(self, *args: str, user: str | None = "alice", timeout: float = 600) -> dict[str, Any]:
        """tests/field/probe.py, run by the package's Python as ``user`` (None: root): its JSON
        answer."""
        done = self.run(PYTHON, "/field/probe.py", *args, user=user, timeout=timeout)
        return json.loads(done.stdout.splitlines()[-1])

    def install(self, deb: Path) -> float:
        """``dpkg -i`` the package in the running tree (its postinst starts the units), then the
        field's users; the seconds dpkg took."""
        (self.root / "field").mkdir(exist_ok=True)
        shutil.copy(deb, self.root / "field" / deb.name)
        shutil.copy(PROBE, self.root / "field" / "probe.py")
        started = time.monotonic()
        self.run("dpkg", "-i", f"/field/{deb.name}", timeout=600)
        took = time.monotonic() - started
        (self.root / "etc" / "sysusers.d").mkdir(exist_ok=True)
        (self.root / "etc" / "sysusers.d" / "field.conf").write_text(USERS)
        self.run("systemd-sysusers", "/etc/sysusers.d/field.conf")
        return took

    def main_pid(self, unit: str) -> int:
        """The unit's MainPID in the tree's numbering (0: not running)."""
        return int(self.run("systemctl", "show", "-P", "MainPID", unit).stdout.strip() or 0)

    def host_pid(self, unit: str) -> int:
        """The unit's main process as the host numbers it (for /proc here), or 0."""
        inner = self.main_pid(unit)
        if not inner:
            return 0
        ours = os.readlink(f"/proc/{self.init}/ns/pid")
        for pid, status in processes():
            spaces = status.get("NSpid", "").split()
            if spaces[1:] == [str(inner)] and os.readlink(f"/proc/{pid}/ns/pid") == ours:
                return pid
        return 0

    def wait(self, what: str, condition: Any, timeout: float) -> float:
        """Seconds until ``condition()`` is truthy; fails naming ``what`` after ``timeout``."""
        started = time.monotonic()
        while True:
            with contextlib.suppress(AssertionError, ValueError):
                if condition():
                    return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.2)

    def power_cut(self) -> None:
        """Every process of the tree killed at once: SIGKILL to its PID 1 ends its namespace."""
        if self.init:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init, signal.SIGKILL)
        self._reap()

    def poweroff(self) -> None:
        if self.init:
            self.run("systemctl", "poweroff", check=False, timeout=30)
        self._reap()

    def _reap(self) -> None:
        if self.nspawn is not None:
            try:
                self.nspawn.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait()
        self.nspawn, self.init = None, 0

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def processes() -> Iterator[tuple[int, dict[str, str]]]:
    """Each process of the host and its status (those that end meanwhile left out)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                yield int(entry.name), proc_status(entry.name)


def container_init(nspawn: int) -> int:
    """The PID (host numbering) of the process that is PID 1 in a new PID namespace below
    ``nspawn``'s process, or 0 while there is none."""
    for pid, status in processes():
        if status.get("NSpid", "").split()[1:] == ["1"] and descends(pid, nspawn):
            return pid
    return 0


def descends(pid: int, ancestor: int) -> bool:
    with contextlib.suppress(OSError):
        while pid > 1:
            pid = int(proc_status(pid)["PPid"])
            if pid == ancestor:
                return True
    return False

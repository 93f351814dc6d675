"""Daemons in tests run as their systemd units run them: a user of their own (never root), the
units' umask (``UMask=0027``) and systemd's default descriptor limit (``LimitNOFILE``: 1,024
soft, 524,288 hard). A test that is about root says so and starts its daemon as root.

The user, ``edged-test``, is a system user made here (``useradd``) the first time; it owns the
daemon's working directory, and the directories above it let it through (``o+x``: enter, not
list): pytest's ``/tmp/pytest-of-root`` is 0700.
"""

from __future__ import annotations

import os
import pwd
import resource
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USER = "edged-test"
UMASK = 0o027
NOFILE = (1024, 524288)


@dataclass(frozen=True)
class Account:
    """Who a daemon runs as, and how."""

    name: str
    uid: int
    gid: int

    def popen(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start a process as the unit would."""
        return {
            "user": self.uid,
            "group": self.gid,
            "extra_groups": [],
            "umask": UMASK,
            "preexec_fn": _limits,
        }

    def own(self, path: Path) -> None:
        """``path`` (a file, or a directory and all in it, links not followed) becomes this
        account's, and reachable through its parents."""
        reachable(path)
        os.chown(path, self.uid, self.gid, follow_symlinks=False)
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chown(os.path.join(root, name), self.uid, self.gid, follow_symlinks=False)


def setpriv(uid: int) -> list[str]:
    """The command prefix that runs a program as ``uid`` (the group of that number, no other
    groups): a second local user, for the tests of who may call."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _limits() -> None:
    # runs after the switch to the user: a limit may be lowered, never raised
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = NOFILE[1] if hard == resource.RLIM_INFINITY else min(NOFILE[1], hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE[0], hard), hard))


def account(name: str = USER) -> Account | None:
    """The tests' unit user (made if missing); None where this process is not root and so
    cannot start a process as another user (the daemon then runs as whoever runs the tests).

    The user must reach the interpreters: pyenv's live in /root (0700), which becomes 0711.
    Without it a venv's python still starts (setpriv execs it before it drops its
    capabilities) but finds no standard library of its own and takes /usr/lib's, another
    version's."""
    if os.geteuid() != 0:
        return None
    reachable(Path(sys.base_prefix) / "lib")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                name,
            ],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
    return Account(name, entry.pw_uid, entry.pw_gid)


def reachable(path: Path) -> None:
    """Let any user enter the directories above ``path`` (``o+x``: enter, not list)."""
    for parent in [path, *path.parents] if path.is_dir() else path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def proc_status(pid: int | str) -> dict[str, str]:
    """``/proc/PID/status``: each field's value, stripped."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def open_files_limit(pid: int) -> int:
    """The process's soft limit on descriptors (``/proc/PID/limits``)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no descriptor limit in /proc/{pid}/limits")


def owned_like(place: Path, path: Path) -> None:
    """``path`` (and all in it) takes the owner of ``place``, the directory it is in: what a
    test puts where edged keeps its own files (its staging directory, its repository), as
    cloudsync, running as edged's user, would have written it."""
    info = place.stat()
    os.chown(path, info.st_uid, info.st_gid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), info.st_uid, info.st_gid, follow_symlinks=False)

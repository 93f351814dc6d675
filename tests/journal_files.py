"""Real journal files for the tests of the ``logs`` command's journal source: written by
systemd-journal-remote (Debian's package, one of make test's) from the journal's export format,
trusted fields included (the unit, the PID, the command line), which no client of a running
journald can set. ``JOURNAL`` is a device's journal of the last two hours: edged failing at its
config, systemd saying so, a private line, other units' lines."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.conftest import skip_or_fail

REMOTE = Path("/lib/systemd/systemd-journal-remote")
NOW_US = int(time.time() * 1_000_000)
BOOT = "0123456789abcdef0123456789abcdef"
SECRET = "s3cr3t-token-on-a-command-line"
KEYS = {"ts", "unit", "identifier", "pid", "level", "message"}
REQUEST_KEYS = {"request_id", "model", "route", "reason"}


def entry(ago_s: float, unit: str, priority: int, message: str, **more: str) -> dict[str, str]:
    at = NOW_US - int(ago_s * 1_000_000)
    return {
        "__REALTIME_TIMESTAMP": str(at),
        "__MONOTONIC_TIMESTAMP": str(at % 10**12),
        "_BOOT_ID": BOOT,
        "_SYSTEMD_UNIT": unit,
        "_PID": "4242",
        "_CMDLINE": f"/usr/bin/{unit} --token {SECRET}",
        "_HOSTNAME": "jetson-17",
        "PRIORITY": str(priority),
        "SYSLOG_IDENTIFIER": unit.split(".")[0],
        "MESSAGE": message,
        **more,
    }


def write(directory: Path, entries: list[dict[str, str]]) -> None:
    """Real journal files in ``directory``, from the export format."""
    if not REMOTE.exists():
        skip_or_fail(f"{REMOTE} is missing: apt install systemd-journal-remote (make test does)")
    text = "".join("".join(f"{k}={v}\n" for k, v in e.items()) + "\n" for e in entries)
    done = subprocess.run(
        [str(REMOTE), f"--output={directory / 'test.journal'}", "-"],
        input=text.encode(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


SYSTEMD_LINE = {
    **entry(50, "init.scope", 4, "edged.service: Main process exited, code=exited, status=78"),
    "_PID": "1",
    "UNIT": "edged.service",
    "SYSLOG_IDENTIFIER": "systemd",
}
JOURNAL = [
    entry(7200, "edged.service", 3, "an error two hours ago"),
    entry(60, "edged.service", 6, "edged 0.1.0 starting"),
    entry(55, "edged.service", 3, "config error: server.bogus: not a key", REQUEST_ID="r-1"),
    SYSTEMD_LINE,
    entry(40, "edged.service", 4, "intent slow", MODEL="intent", ROUTE="local", NODE="n"),
    entry(30, "edged.service", 4, "patient 42 said hello", PRIVATE="1", REQUEST_ID="r-2"),
    entry(20, "ssh.service", 3, "Accepted publickey for root"),
    entry(10, "cloudsync.service", 6, "connected to the broker"),
    entry(5, "edged.service", 7, "a debug line"),
]

"""systemd glue: readiness and status notifications, the watchdog, socket activation.

Uses systemd-python when it is installed; otherwise a few lines of the same protocol. All of it
does nothing outside systemd (no NOTIFY_SOCKET, no LISTEN_FDS).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

log = logging.getLogger(__name__)

sd_daemon: Any
try:  # imported by name: type checkers see the module or not depending on the build
    sd_daemon = importlib.import_module("systemd.daemon")
except ImportError:  # the wheel-less systemd-python was not built; the protocol is simple
    sd_daemon = None

LISTEN_FDS_START = 3


def notify(*fields: str) -> bool:
    """Send ``KEY=value`` fields to the service manager; False when not under systemd."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return False
    message = "\n".join(fields)
    address = os.environ["NOTIFY_SOCKET"]
    try:
        if sd_daemon is not None:
            return bool(sd_daemon.notify(message))
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:  # the manager went away: never let that stop serving or draining
        log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2 / 1_000_000


def listen_sockets() -> list[socket.socket]:
    """Sockets passed by socket activation (LISTEN_FDS), consumed from the environment."""
    if sd_daemon is not None:
        fds = list(sd_daemon.listen_fds(True))
    else:
        count = os.environ.get("LISTEN_FDS", "")
        pid = os.environ.get("LISTEN_PID", "")
        fds = []
        if count.isdigit() and pid == str(os.getpid()):
            fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)))
        for key in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
    sockets = []
    for fd in fds:
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets

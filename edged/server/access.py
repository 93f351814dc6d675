"""Who may call edged and who is admin: one check for the REST and the gRPC socket.

A caller is the process at the other end of the Unix socket, as the kernel says: its uid and
primary gid (``SO_PEERCRED``) and its supplementary groups (``SO_PEERGROUPS``, Linux 4.13), all
as they were when it connected.

- **Allowed**: with ``server.allowed_uids``/``allowed_gids`` both empty, anyone who can open the
  socket (its file mode and group decide); else a caller whose uid is listed or one of whose
  groups is.
- **Admin** (``/v1/admin``, repository load and unload on either socket) fails closed: root,
  edged's own uid (a process running as edged can rewrite its state and models anyway: cloudsync
  runs so), the members of ``server.admin_group`` (``edged-admin``, made by the package), and
  ``server.admin_uids``/``admin_gids``. Empty lists add no one; they never mean "everyone".

A refusal is ``Forbidden`` (403, PERMISSION_DENIED on gRPC) naming what is needed, and one
WARNING line at most every ``every_s`` seconds (with how many were not logged): a caller cannot
fill the journal by being refused. The settings are read at each check, so a SIGHUP that changes
them applies to both sockets at once (``refresh`` looks the group up again).
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import platform
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from edged.common.errors import Forbidden
from edged.common.live import Live
from edged.config import ServerConfig

log = logging.getLogger(__name__)

# Python has no name for it: 59 where Linux numbers socket options as asm-generic does (x86,
# Arm, RISC-V: what edged ships for); elsewhere unknown, so the primary gid only.
GENERIC = ("x86_64", "i686", "i386", "aarch64", "arm", "riscv", "ppc", "s390")
SO_PEERGROUPS: int | None = getattr(socket, "SO_PEERGROUPS", None) or (
    59 if sys.platform == "linux" and platform.machine().startswith(GENERIC) else None
)
NGROUPS_MAX = 65536


@dataclass(frozen=True)
class Peer:
    """The caller at the other end of a Unix socket, from the kernel."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @property
    def gids(self) -> frozenset[int]:
        return self.groups | {self.gid}

    def __str__(self) -> str:
        return f"uid {self.uid} gid {self.gid}"


def peer_groups(sock: Any) -> frozenset[int]:
    """The peer's supplementary groups (SO_PEERGROUPS); none where the kernel cannot say."""
    if SO_PEERGROUPS is None:
        return frozenset()
    count = 64
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * count)
        except OSError as exc:
            if exc.errno == errno.ERANGE and count < NGROUPS_MAX:
                count = NGROUPS_MAX
                continue
            return frozenset()  # ENOPROTOOPT (before Linux 4.13): the primary gid only
        return frozenset(struct.unpack(f"{len(raw) // 4}I", raw))


def peer_of(sock: Any) -> Peer | None:
    """The caller on a connected Unix socket, or None (another family, or the kernel says
    nothing)."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, peer_groups(sock))


class Access:
    """The allowed and admin checks over the server settings as they are now (a reload swaps
    them: each check reads the snapshot of its time)."""

    def __init__(self, settings: Live[ServerConfig], every_s: float = 10.0) -> None:
        self.settings = settings
        self.own_uid = os.getuid()
        self.admin_gid: int | None = None
        self.every_s = every_s
        self.last = -every_s
        self.quiet = 0
        self.refresh()

    def refresh(self) -> None:
        """Look ``admin_group`` up again (at start and on SIGHUP)."""
        name = self.settings.now().admin_group
        self.admin_gid = None
        if not name:
            return
        try:
            self.admin_gid = grp.getgrnam(name).gr_gid
        except KeyError:
            log.info("server.admin_group: there is no group %s here; it makes no one admin", name)

    def is_allowed(self, peer: Peer | None) -> bool:
        settings = self.settings.now()
        if not (settings.allowed_uids or settings.allowed_gids):
            return True
        return peer is not None and (
            peer.uid in settings.allowed_uids or not peer.gids.isdisjoint(settings.allowed_gids)
        )

    def is_admin(self, peer: Peer | None) -> bool:
        if peer is None:
            return False
        settings = self.settings.now()
        if peer.uid in (0, self.own_uid) or peer.uid in settings.admin_uids:
            return True
        gids = set(settings.admin_gids)
        if self.admin_gid is not None:
            gids.add(self.admin_gid)
        return not peer.gids.isdisjoint(gids)

    def check_allowed(self, peer: Peer | None, transport: str) -> None:
        """Forbidden unless ``peer`` may call at all."""
        if self.is_allowed(peer):
            return
        self._refuse(
            f"{peer or 'an unknown peer'} is not allowed by server.allowed_uids/allowed_gids"
            " (neither lists its uid or any of its groups)",
            transport,
        )

    def check_admin(self, peer: Peer | None, what: str, transport: str) -> None:
        """Forbidden unless ``peer`` is admin; ``what`` names the call refused."""
        if self.is_admin(peer):
            return
        self._refuse(
            f"{peer or 'an unknown peer'} is not allowed {what}: admin needs {self.needed()}",
            transport,
        )

    def needed(self) -> str:
        """Who is admin, in words."""
        who = ["uid 0"]
        if self.own_uid != 0:
            who.append(f"uid {self.own_uid} (edged's own)")
        name = self.settings.now().admin_group
        if name:
            who.append(f"group {name}" + ("" if self.admin_gid is not None else " (absent here)"))
        return ", ".join(who) + " or server.admin_uids/admin_gids"

    def _refuse(self, message: str, transport: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            more = f" ({self.quiet} more since the last one)" if self.quiet else ""
            log.warning("refused on %s: %s%s", transport, message, more)
            self.last, self.quiet = now, 0
        else:
            self.quiet += 1
        raise Forbidden(message)

"""Triton's system shared memory extension: a local client passes tensors through a POSIX
shared-memory region (``/dev/shm/<key>``) instead of the socket.

A client registers a region (a name, the key it created with ``shm_open``, an offset and a
size); an input then says ``shared_memory_region``, ``shared_memory_byte_size`` and, optionally,
``shared_memory_offset`` instead of carrying data, and a requested output with the same
parameters is written into the region instead of the answer.

What edged holds is bounded and the caller's own:

- A region belongs to the uid that registered it: another uid neither sees nor uses nor
  unregisters it (a name is per uid), and edged reads a region only for a caller whom its file
  mode lets read it (and writes outputs only where it lets the caller write): a file of another
  uid is not readable through edged unless its permissions allow that uid. edged opens the file
  itself (``O_NOFOLLOW``: a link is refused), so edged's user must be able to open it too (the
  file's group, or mode 0666): the refusal says so.
- At most ``max_regions`` regions at once, and ``per_uid`` of them of one uid, so that one uid
  cannot take them all and leave root (or anyone else) none; root is held to its own quota
  only, so that several uids together cannot leave it none either; each is checked against the
  file's size when it is registered and again at each use (a file made smaller since is an
  error, not a crash). There is no cap on bytes: a region is the caller's own file, and what
  edged holds for it is one descriptor, whatever its size (reads are bounded per request).
- Tensors are read and written with ``pread``/``pwrite`` on the file, not through a mapping: a
  client that truncates its file under a mapping would kill edged (SIGBUS). That is one copy
  by the kernel, the same one a mapping's page faults would do, and none through the socket.
- A region that cannot shrink is read in place, with no copy: a **sealed memfd** that edged
  makes (``create``, asked for on the region socket, ``edged.server.regions``) and hands to
  its caller with SCM_RIGHTS. Its seals (shrink, grow, and seal: no other seal can be added)
  are set before the caller has it, so nothing the caller does can take a page from under
  edged's mapping; an input is a view of the mapping, an output written into it. Its pages are
  charged to whoever first touches them (the caller, writing its frames): edged only reads.
- A process's regions go when it exits (a pidfd watched by the event loop): nothing is left
  open for a client that crashed. The pidfd is closed as soon as the process has no region
  left (unregistered by itself or by another process of its uid), not only when it exits: an
  idle client that once used shared memory holds nothing in edged. So edged holds at most two
  descriptors a region (its file and its process's pidfd), ``2 * max_regions`` in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edged.common.errors import InvalidRequest

log = logging.getLogger(__name__)
SHM_ROOT = Path("/dev/shm")
# a POSIX shared-memory name is one path component; Triton's clients pass it with its "/"
KEY = re.compile(r"/?[A-Za-z0-9_.@+=-]{1,200}")
NAME = re.compile(r"[A-Za-z0-9_.@+=-]{1,128}")
PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
# a memfd edged makes: it cannot shrink or grow, and no seal can be added (nor write refused)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    writable: bool
    uid: int
    pid: int
    mapping: mmap.mmap | None = None  # a sealed memfd of edged's: read in place (fd is -1)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


def may(uid: int, gids: frozenset[int], info: os.stat_result, write: bool) -> bool:
    """Whether the file's mode lets this caller read it (and write it, with ``write``)."""
    if uid == 0:
        return True
    if info.st_uid == uid:
        bits = info.st_mode >> 6
    elif info.st_gid in gids:
        bits = info.st_mode >> 3
    else:
        bits = info.st_mode
    need = 0o6 if write else 0o4
    return bits & need == need


@dataclass(frozen=True)
class Use:
    """Where a tensor goes or comes from: a region, an offset in it, a size."""

    region: str
    byte_size: int
    offset: int = 0


def use_of(where: str, params: dict[str, Any]) -> Use | None:
    """The shared-memory parameters of an input or a requested output (None: it has none)."""
    region = params.get("shared_memory_region")
    if region is None:
        return None
    size, offset = params.get("shared_memory_byte_size"), params.get("shared_memory_offset", 0)
    if not isinstance(region, str) or not NAME.fullmatch(region):
        raise InvalidRequest(f"{where}: shared_memory_region must be a region's name")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequest(f"{where}: {key} must be an integer >= 0")
    assert isinstance(size, int) and isinstance(offset, int)
    return Use(region, size, offset)


@dataclass
class Regions:
    """Every region registered: by (uid, name)."""

    max_regions: int = 64
    per_uid: int = 16
    root: Path = SHM_ROOT
    regions: dict[tuple[int, str], Region] = field(default_factory=dict)
    # pid -> its pidfd and the loop that watches it: only while the pid has a region
    watched: dict[int, tuple[int, asyncio.AbstractEventLoop]] = field(default_factory=dict)
    # Reads run in worker threads: a region's descriptor is not closed (and its number reused
    # by another file) while one reads through it.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, caller: Any, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """``caller``: a ``Peer`` (uid, gids, pid); InvalidRequest names what is wrong."""
        self._admit(caller, name)
        if not isinstance(key, str) or not KEY.fullmatch(key) or key.strip("/.") == "":
            raise InvalidRequest("key: a shared-memory name (/name, one path component)")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"{what}: an integer >= 0")
        path = self.root / key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            writable = True
        except PermissionError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as exc:
                raise InvalidRequest(self._unopened(key, exc)) from None
            writable = False
        except OSError as exc:
            raise InvalidRequest(self._unopened(key, exc)) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidRequest(f"key {key}: not a shared-memory file")
            if not may(caller.uid, caller.gids, info, write=False):
                raise InvalidRequest(f"key {key}: its mode does not let {caller} read it")
            writable = writable and may(caller.uid, caller.gids, info, write=True)
            if offset + byte_size > info.st_size:
                raise InvalidRequest(
                    f"region '{name}': offset {offset} + byte_size {byte_size} is past the end"
                    f" of {key} ({info.st_size} bytes)"
                )
            self.watch(caller.pid)
        except BaseException:
            os.close(fd)
            raise
        self._add(Region(name, key, offset, byte_size, fd, writable, caller.uid, caller.pid))

    def create(
        self, caller: Any, name: Any, byte_size: Any, limit: int, per_uid: int = 1 << 62
    ) -> int:
        """A sealed memfd of ``byte_size`` bytes, registered as the caller's region ``name``
        and mapped here: the returned descriptor is for the caller (the one who passes it on
        closes it); edged keeps the mapping. ``limit``: the most bytes a region may have;
        ``per_uid``: the most bytes of such regions one uid may hold (an output edged writes
        into a page the caller never touched is charged to edged)."""
        self._admit(caller, name)
        if (
            isinstance(byte_size, bool)
            or not isinstance(byte_size, int)
            or not (0 < byte_size <= limit)
        ):
            raise InvalidRequest(
                f"byte_size: an integer from 1 to {limit} (server.max_request_bytes)"
            )
        held = sum(
            r.byte_size for (uid, _), r in self.regions.items() if uid == caller.uid and r.mapping
        )
        if held + byte_size > per_uid:
            raise InvalidRequest(
                f"byte_size: uid {caller.uid} holds {held} bytes of sealed regions; {byte_size}"
                f" more would pass {per_uid} (server.shm_memfd_mb_per_uid)"
            )
        fd = os.memfd_create(f"edged:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, byte_size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(fd, byte_size)  # its own descriptor: fd goes to the caller
            self.watch(caller.pid)
        except BaseException:
            os.close(fd)
            raise
        key = f"memfd:{name}"
        self._add(Region(name, key, 0, byte_size, -1, True, caller.uid, caller.pid, mapping))
        return fd

    def _admit(self, caller: Any, name: Any) -> None:
        """Refuse a new region of ``caller`` named ``name`` past a quota or by a bad name."""
        if caller is None:
            raise InvalidRequest("shared memory is for local callers on edged's Unix sockets")
        if self.max_regions == 0:
            raise InvalidRequest("system shared memory is off here (server.shm_regions = 0)")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest("region name: 1 to 128 letters, digits or _.@+=-")
        if (caller.uid, name) in self.regions:
            raise InvalidRequest(f"region '{name}' is registered already: unregister it first")
        held = sum(1 for uid, _ in self.regions if uid == caller.uid)
        if held >= self.per_uid:
            raise InvalidRequest(
                f"uid {caller.uid} has {held} shared-memory regions registered, as many as one"
                f" uid may (server.shm_regions_per_uid = {self.per_uid}): unregister one first"
            )
        if len(self.regions) >= self.max_regions and caller.uid != 0:  # root: its quota only
            raise InvalidRequest(
                f"{len(self.regions)} regions are registered, all callers together: at most"
                f" that many (server.shm_regions = {self.max_regions})"
            )

    def _add(self, region: Region) -> None:
        with self.lock:
            self.regions[(region.uid, region.name)] = region
        log.info(
            "shared memory: uid %d registered region %s (%s, %d bytes)",
            *(region.uid, region.name, region.key, region.byte_size),
        )

    @staticmethod
    def _unopened(key: str, exc: OSError) -> str:
        if isinstance(exc, PermissionError):
            return (
                f"key {key}: edged cannot open it (let edged's group read and write it:"
                " chgrp edged, mode 0660)"
            )
        if isinstance(exc, FileNotFoundError):
            return f"key {key}: no such shared-memory file"
        return f"key {key}: cannot be opened ({exc.strerror}; a link is refused)"

    def unregister(self, caller: Any, name: str | None) -> None:
        """The caller's region ``name``, or all of the caller's (None); unknown: an error."""
        if caller is None:
            return
        with self.lock:
            names = [n for (uid, n) in self.regions if uid == caller.uid and name in (None, n)]
            if name is not None and not names:
                raise InvalidRequest(f"no shared-memory region '{name}' is registered")
            for n in names:
                self._drop(self.regions.pop((caller.uid, n)))
        self._unwatch_idle()

    def status(self, caller: Any, name: str | None) -> list[dict[str, Any]]:
        if caller is None:
            return []
        found = [
            r.status()
            for (uid, n), r in sorted(self.regions.items())
            if uid == caller.uid and name in (None, n)
        ]
        if name is not None and not found:
            raise InvalidRequest(f"no shared-memory region '{name}' is registered")
        return found

    def _region(self, caller: Any, use: Use, write: bool) -> Region:
        region = self.regions.get((caller.uid, use.region)) if caller is not None else None
        if region is None:
            raise InvalidRequest(f"no shared-memory region '{use.region}' is registered")
        if use.offset + use.byte_size > region.byte_size:
            raise InvalidRequest(
                f"region '{use.region}': offset {use.offset} + {use.byte_size} bytes is past its"
                f" {region.byte_size} bytes"
            )
        if write and not region.writable:
            raise InvalidRequest(f"region '{use.region}': not writable by {caller} and edged")
        if region.mapping is None and (
            os.fstat(region.fd).st_size < region.offset + use.offset + use.byte_size
        ):
            raise InvalidRequest(f"region '{use.region}': its file is smaller than registered")
        return region

    def read(self, caller: Any, use: Use, limit: int) -> memoryview:
        """The bytes of ``use`` (at most ``limit``: checked before anything is allocated)."""
        if use.byte_size > limit:
            raise InvalidRequest(
                f"region '{use.region}': {use.byte_size} bytes, more than {limit} for a request"
            )
        with self.lock:
            region = self._region(caller, use, write=False)  # checked before allocating
            if region.mapping is not None:  # sealed: a view, kept valid while it is held
                return memoryview(region.mapping)[use.offset : use.offset + use.byte_size]
            data = np.empty(use.byte_size, np.uint8).data  # not zeroed: all read over
            got = os.preadv(region.fd, [data], region.offset + use.offset)
        if got != use.byte_size:
            raise InvalidRequest(f"region '{use.region}': its file is smaller than registered")
        return data

    def check(self, caller: Any, use: Use) -> None:
        """Refuse ``use`` as a place to write to now, as ``write`` would (InvalidRequest)."""
        with self.lock:
            self._region(caller, use, write=True)

    def write(self, caller: Any, use: Use, data: bytes) -> None:
        if len(data) > use.byte_size:
            raise InvalidRequest(
                f"region '{use.region}': the output is {len(data)} bytes, the request gave"
                f" {use.byte_size}"
            )
        with self.lock:
            region = self._region(caller, use, write=True)
            if region.mapping is not None:
                region.mapping[use.offset : use.offset + len(data)] = data
                return
            os.pwrite(region.fd, data, region.offset + use.offset)

    def copies(self, caller: Any) -> bool:
        """Whether reading the caller's regions copies (a file of its own: ``pread``), so
        that a request naming one is decoded off the event loop; a memfd's is a view."""
        uid = getattr(caller, "uid", None)
        return any(r.mapping is None for (owner, _), r in self.regions.items() if owner == uid)

    # ---- lifetime ---------------------------------------------------------------------------

    def watch(self, pid: int) -> None:
        """The caller's regions go when it exits (a pidfd in the running event loop)."""
        if pid in self.watched or pid <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test of this class alone): nothing to watch with
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            raise InvalidRequest(f"the calling process ({pid}) is gone ({exc.strerror})") from None
        self.watched[pid] = (fd, loop)
        loop.add_reader(fd, self._exited, pid)

    def _unwatch(self, pid: int) -> None:
        fd, loop = self.watched.pop(pid)
        with contextlib.suppress(RuntimeError):  # the loop is closed: it watches nothing
            loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _unwatch_idle(self) -> None:
        """Close the pidfd of each process that has no region left. Kept until the process
        exited, a pidfd for every idle client that had once registered ran edged out of
        descriptors (issue 44)."""
        with self.lock:
            holding = {region.pid for region in self.regions.values()}
        for pid in [pid for pid in self.watched if pid not in holding]:
            self._unwatch(pid)

    def _exited(self, pid: int) -> None:
        self._unwatch(pid)
        with self.lock:
            gone = [key for key, r in self.regions.items() if r.pid == pid]
            for key in gone:
                self._drop(self.regions.pop(key))
        if gone:
            log.info(
                "shared memory: process %d exited; its %d region(s) unregistered", pid, len(gone)
            )

    def _drop(self, region: Region) -> None:
        if region.mapping is not None:
            # A request still reading a view keeps the mapping: unmapped when the last goes.
            with contextlib.suppress(BufferError):
                region.mapping.close()
            return
        with contextlib.suppress(OSError):
            os.close(region.fd)

    def close(self) -> None:
        with self.lock:
            for region in self.regions.values():
                self._drop(region)
            self.regions.clear()
        for pid in list(self.watched):
            self._unwatch(pid)


@dataclass
class Bound:
    """The regions as one caller sees them: what the decoders and encoders are handed."""

    regions: Regions
    caller: Any
    limit: int

    def read(self, use: Use) -> memoryview:
        return self.regions.read(self.caller, use, self.limit)

    def check(self, use: Use) -> None:
        self.regions.check(self.caller, use)

    @property
    def copies(self) -> bool:
        return self.regions.copies(self.caller)

    def write(self, use: Use, data: bytes) -> None:
        self.regions.write(self.caller, use, data)

"""The update spool: how unprivileged cloudsync hands a package to edged-updater (root), and
how the outcome comes back.

``/var/lib/edged/updates`` (``[delivery] spool_dir``) is edged's user's directory. cloudsync
downloads and checks the .deb there under the name its manifest lists, then writes
``request.json`` (``{"manifest": {signed manifest}}``, atomically); ``edged-updater.path`` sees
it and starts ``edged-updater.service``, whose ``apply-spool`` takes the request (removes it),
checks everything again itself, updates, and writes ``result.json``; cloudsync reports it as
delivery steps and removes it.

Whatever is in the directory may have been put there by an attacker who has edged's user,
so the root side (``open_spool``, ``read_file``, ``open_file``, ``write_file``) follows no
link, opens no FIFO or device, reads no more than a bound that is checked before reading, and
writes its result by a rename inside the directory it opened (a link planted under the name is
replaced, never followed).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from typing import IO, Any

REQUEST = "request.json"
RESULT = "result.json"
MAX_REQUEST = 1 << 20  # a signed manifest: far less
MAX_RESULT = 64 << 10
PACKAGE = "edged"
# the updater's outcomes, and the delivery step each is reported as
STEPS = {
    "committed": "active",
    "rolled-back": "rolled-back",
    "refused": "failed",
    "abandoned": "failed",
}


class SpoolError(Exception):
    """A spool entry that is refused; the message says why (it names the file)."""


def installed(package: str = PACKAGE) -> str:
    """The Debian version of ``package`` installed and configured ("" when none, or no dpkg)."""
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Abbrev} ${Version}", package],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    status, _, version = done.stdout.partition(" ")
    return version.strip() if status.strip() == "ii" else ""


def open_spool(path: str | os.PathLike[str]) -> int:
    """A descriptor of the spool directory itself (not of what a link there names)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SpoolError(f"{path}: not a directory this updater opens ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if mode & stat.S_IWOTH:  # anyone could have written it: nothing in it is taken
        os.close(fd)
        raise SpoolError(f"{path}: writable by every user")
    return fd


def open_file(spool: int, name: str, limit: int) -> IO[bytes]:
    """``name`` in the spool, for reading: a regular file of at most ``limit`` bytes, reached
    through no link (a FIFO does not block the open; it is refused)."""
    if "/" in name or name in ("", ".", ".."):
        raise SpoolError(f"{name!r}: not a file name")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=spool)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SpoolError(f"{name}: cannot be opened ({exc.strerror}; a link is refused)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SpoolError(f"{name}: not a regular file")
    if info.st_size > limit:
        os.close(fd)
        raise SpoolError(f"{name}: {info.st_size} bytes, more than {limit}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_file(spool: int, name: str, limit: int) -> bytes:
    """All of ``name`` (``open_file``); never more than ``limit`` bytes, even if it grows."""
    with open_file(spool, name, limit) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise SpoolError(f"{name}: more than {limit} bytes")
    return data


def read_json(spool: int, name: str, limit: int) -> dict[str, Any]:
    """A JSON object from the spool (``SpoolError`` for anything else, with the file's name)."""
    try:
        doc = json.loads(read_file(spool, name, limit))
    except (ValueError, RecursionError):
        raise SpoolError(f"{name}: not JSON") from None
    if not isinstance(doc, dict):
        raise SpoolError(f"{name}: not a JSON object")
    return doc


def take(directory: str | os.PathLike[str], name: str, limit: int) -> dict[str, Any] | None:
    """The JSON object ``name`` in the spool, removed whatever it held (None: there is none);
    SpoolError, naming it, for a spool that is not opened or a file that is not one."""
    spool = open_spool(directory)
    try:
        try:
            return read_json(spool, name, limit)
        except FileNotFoundError:
            return None
        finally:
            remove(spool, name)
    finally:
        os.close(spool)


def open_in(directory: str | os.PathLike[str], name: str, limit: int) -> IO[bytes]:
    """``open_file`` of ``name`` in the spool ``directory``."""
    spool = open_spool(directory)
    try:
        return open_file(spool, name, limit)
    finally:
        os.close(spool)


def write_file(spool: int, name: str, data: bytes) -> None:
    """``name`` in the spool, whole or not at all: written to a new file (O_EXCL, no link
    followed) and renamed over ``name`` within the same directory."""
    part = f".{name}.{os.getpid()}.part"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(2):
        try:
            fd = os.open(part, flags, 0o644, dir_fd=spool)
            break
        except FileExistsError:  # left by a crash, or planted: removed (unlink follows nothing)
            os.unlink(part, dir_fd=spool)
    else:
        raise SpoolError(f"{part}: cannot be created")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, name, src_dir_fd=spool, dst_dir_fd=spool)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part, dir_fd=spool)
        raise
    os.fsync(spool)


def remove(spool: int, name: str) -> None:
    """``name`` gone from the spool (a directory planted there: renamed out of the way)."""
    try:
        os.unlink(name, dir_fd=spool)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        aside = f".{name}.{time.time_ns()}.refused"
        os.rename(name, aside, src_dir_fd=spool, dst_dir_fd=spool)

"""A model version's files: what may be in a version directory (directories and regular files
of one link), their lengths and SHA-256 against a list, and the list kept with the version.

An install (``edged.models.install``) checks the staged files against the manifest's list and
keeps that list in the version directory (``RECORD``, edged's own file there, not one of the
version's). Each load checks the files against it again (``damage``), so that a file damaged on
disk since (bytes flipped, a file truncated by a power cut) is refused with the reason instead of
being loaded, and cloudsync fetches the version again (docs/OPERATIONS.md, "A damaged model
file"). A version with no list (the package's default models, one placed by hand) is loaded as
it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from edged.common.atomic import write_atomic
from edged.common.errors import InvalidRequest

CHUNK = 1 << 20
RECORD = ".edged-files.json"  # in a version directory: its files as installed


def regular_files(directory: Path) -> dict[str, os.stat_result]:
    """Every file under ``directory`` by its relative path (with its ``lstat``); InvalidRequest
    for anything but directories and regular files with one link."""
    found: dict[str, os.stat_result] = {}
    pending = [(directory, "")]
    while pending:
        where, prefix = pending.pop()
        try:
            entries = sorted(os.scandir(where), key=lambda e: e.name)
        except OSError as exc:
            raise InvalidRequest(f"cannot read '{prefix or '.'}': {exc.strerror}") from None
        for entry in entries:
            name = f"{prefix}{entry.name}"
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                raise InvalidRequest(
                    f"'{name}' is a symbolic link: a version holds only directories and regular"
                    " files"
                )
            if stat.S_ISDIR(info.st_mode):
                pending.append((Path(entry.path), f"{name}/"))
            elif not stat.S_ISREG(info.st_mode):
                raise InvalidRequest(
                    f"'{name}' is not a regular file (a device, FIFO or socket): a version holds"
                    " only directories and regular files"
                )
            elif info.st_nlink != 1:
                raise InvalidRequest(
                    f"'{name}' has {info.st_nlink} links: a version's files are its own, not"
                    " hard links to others"
                )
            else:
                found[name] = info
    return found


def _relative(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(f"file '{path}' is outside the version directory")
    return path


def _hash_file(directory: Path, name: str, seen: os.stat_result) -> tuple[int, str]:
    """(length, SHA-256) of the regular file ``name`` that ``regular_files`` saw, opened without
    following a link; InvalidRequest if another file is there now."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(directory / name, flags)
    except OSError as exc:
        raise InvalidRequest(f"file '{name}': {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (
            seen.st_dev,
            seen.st_ino,
        ):
            raise InvalidRequest(f"file '{name}' changed while it was checked")
        digest = hashlib.sha256()
        while chunk := f.read(CHUNK):
            digest.update(chunk)
        return info.st_size, digest.hexdigest()


def check_files(directory: Path, files: Any) -> None:
    """Each listed file has its length and SHA-256 (InvalidRequest names the first that does
    not); files not listed are refused too: what serves is exactly what was signed. Only
    directories and regular files of one link may be there (``regular_files``)."""
    if not isinstance(files, list) or not files:
        raise InvalidRequest("'files' must list the version's files: [{path, sha256, length}]")
    found = regular_files(directory)
    for name in [n for n in found if n.startswith(RECORD)]:  # edged's own (and a temporary
        del found[name]  # one a kill left while it was written), not the version's
    listed = set()
    for row in files:
        if not isinstance(row, dict) or not isinstance(row.get("path"), str):
            raise InvalidRequest("each file must be {path, sha256, length}")
        name = _relative(row["path"])
        listed.add(name)
        if name not in found:
            raise InvalidRequest(f"file '{name}': no such file in the version directory")
        size, sha256 = _hash_file(directory, name, found[name])
        if size != row.get("length"):
            listed_length = row.get("length")
            raise InvalidRequest(f"file '{name}' has {size} bytes, {listed_length} listed")
        if sha256 != row.get("sha256"):
            raise InvalidRequest(f"file '{name}': its SHA-256 is not the one listed")
    extra = sorted(set(found) - listed)
    if extra:
        raise InvalidRequest(f"'{extra[0]}' is not in the file list")


def record(directory: Path, files: list[dict[str, Any]]) -> None:
    """Keep the list ``check_files`` just passed in the version directory (atomically)."""
    rows = [
        {"path": _relative(r["path"]), "sha256": r["sha256"], "length": r["length"]} for r in files
    ]
    write_atomic(directory / RECORD, json.dumps({"files": rows}, sort_keys=True), 0o640)


def damage(directory: Path) -> str:
    """Why the version's files are not the ones installed (blocking: it reads them all); ''
    when they are, or when the version has no list."""
    try:
        data = (directory / RECORD).read_bytes()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"its list of files ({RECORD}) cannot be read: {exc.strerror}"
    try:
        rows = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError):
        return f"its list of files ({RECORD}) is damaged"
    try:
        check_files(directory, rows)
    except InvalidRequest as exc:
        return exc.message
    return ""

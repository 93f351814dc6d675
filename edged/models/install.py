"""New model versions into the repository: checked, moved in atomically, smoke-tested, pruned.

cloudsync (or an operator) stages a version's files in a directory of its own in edged's staging
directory, ``{state_dir}/staging`` (0700, edged's user's; best on the repository's file system),
and asks edged to install it (``POST /v1/admin/models/{m}/install``). edged takes a ``source``
only there: an absolute path whose parent is the staging directory, naming a directory, not a
link. Everything under it must be a directory or a regular file with one link (no symlink, hard
link, device, FIFO or socket: ``lstat``, and each file opened with ``O_NOFOLLOW`` and checked to
be the one seen), and each listed file has its length and SHA-256 (nothing unlisted). Then the
directory moves to ``{repository}/{model}/{version}`` in one ``rename`` (a crash leaves it whole
or absent, never half there), loads beside the version serving, runs the smoke cases, and only
then do requests switch to it (``ModelManager.activate``). A marker in the staging directory says
the version was moved in from there until the install ends, so that a failed install removes
only what it moved in (through the staging directory), an install cut short by a crash resumes
on it, and a version that was on disk before is never replaced or removed, unless its files are
no longer those installed (``edged.models.files``: the list of files an install keeps in the
version directory; a damaged version is installed again over itself). The newest ``keep``
versions stay on disk, and always the active one and the one before it (the rollback target).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from edged.common.errors import ConfigError, InvalidRequest
from edged.common.names import is_model_name
from edged.models.files import check_files, damage, record
from edged.models.repository import VERSION, ModelManager
from edged.oip.tensors import decode_request
from edged.request import own_calls

SMOKE_ATOL = 1e-4
CONFIG = "config.pbtxt"


# ---- the staging directory --------------------------------------------------------------------

STAGING = "staging"


def ensure_staging(staging: Path) -> None:
    """The staging directory, made 0700 if absent (cloudsync may have made it first): a
    directory of edged's own uid, not a link; ConfigError otherwise."""
    try:
        staging.mkdir(mode=0o700, exist_ok=True)
        info = staging.lstat()
    except OSError as exc:
        raise ConfigError(
            f"cannot create the staging directory {staging}: {exc.strerror}"
        ) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"the staging directory {staging} must be a directory of edged's own user"
            f" (uid {os.getuid()}), not a link"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(staging, 0o700)


def staged_source(staging: Path, source: Any) -> Path:
    """The version directory that ``source`` names: by an absolute path, directly in
    ``staging``; InvalidRequest for any other."""
    if not isinstance(source, str) or not os.path.isabs(source) or "\0" in source:
        raise InvalidRequest(
            f"'source' must be the absolute path of the staged version's directory in the"
            f" staging directory {staging}"
        )
    path = Path(os.path.normpath(source))
    if (
        path.name.startswith(".")
        or os.path.realpath(path.parent) != os.path.realpath(staging)
        or path.parent == path
    ):
        raise InvalidRequest(
            f"'source' {source} is not a directory in the staging directory {staging}: edged"
            " installs only from there"
        )
    return path


def _marker(staging: Path, target: Path) -> Path:
    """Present while a version moved in from staging is being installed."""
    return staging / f".moved-{target.parent.name}-{target.name}"


def stage(staging: Path, source: Any, files: Any, target: Path) -> None:
    """Check the files staged at ``source`` (in ``staging``), then move them in as ``target``
    (blocking: run in a thread). With no ``source`` left, a ``target`` moved in from staging by
    an install cut short is checked where it is. Afterwards ``discard`` or ``done``."""
    ensure_staging(staging)
    path = staged_source(staging, source)
    marker = _marker(staging, target)
    try:
        info = path.lstat()
    except FileNotFoundError:
        if not (marker.exists() and target.is_dir() and not target.is_symlink()):
            raise InvalidRequest(f"'source' {source} is not a directory") from None
        check_files(target, files)
        record(target, files)
        return
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidRequest(
            f"'source' {source} is a link or a file, not a directory in the staging directory"
        )
    # a version on disk is replaced only when an install cut short moved it in, or when its
    # files are no longer the ones installed (damaged: this is its repair)
    if os.path.lexists(target) and not marker.exists() and not damage(target):
        raise InvalidRequest(
            f"version {target.name} of '{target.parent.name}' is on disk already and was not"
            " installed from staging: activate it, or remove it from the repository first"
        )
    check_files(path, files)
    record(path, files)
    marker.write_text(f"{target}\n")
    _fsync_directory(staging)
    move_in(staging, path, target)


def done(staging: Path, target: Path) -> None:
    """The install of ``target`` ended with it serving: its marker goes."""
    marker = _marker(staging, target)
    marker.unlink(missing_ok=True)


def discard(staging: Path, target: Path) -> None:
    """The install of ``target`` failed: if it was moved in from staging (the marker says so), it
    goes back into staging and is removed there; a version that was on disk before stays."""
    marker = _marker(staging, target)
    if not marker.exists():
        return
    if os.path.lexists(target):
        _remove_through(staging, target)
    marker.unlink(missing_ok=True)


def _remove_through(staging: Path, directory: Path) -> None:
    """Remove ``directory`` (one moved in from staging) by renaming it into staging first; on
    another file system (it was copied in), where it is."""
    trash = staging / f".discarded-{uuid.uuid4().hex}"
    try:
        os.rename(directory, trash)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.rmtree(directory, ignore_errors=True)
        return
    shutil.rmtree(trash, ignore_errors=True)


# ---- models new to the repository, and removed from it --------------------------------------


def new_model_directory(repository: Path, name: str, files: Any) -> Path:
    """The directory for a model the repository does not have yet: ``name`` must be a model
    name, and the version's ``files`` must hold its config.pbtxt (InvalidRequest otherwise).
    A directory left by an install cut short (no config.pbtxt in it) is taken as it is."""
    if not is_model_name(name):
        raise InvalidRequest(
            f"'{name[:80]}' is not a model name (1 to 64 letters, digits, '_', '.', '-', the"
            " first a letter or digit)"
        )
    rows = files if isinstance(files, list) else []
    if not any(isinstance(row, dict) and row.get("path") == CONFIG for row in rows):
        raise InvalidRequest(
            f"model '{name}' is new to this node: its version must carry its {CONFIG} among its"
            " files"
        )
    directory = repository / name
    if (directory / CONFIG).exists():
        raise InvalidRequest(
            f"model '{name}' is in the repository but not loaded: reload edged first"
        )
    directory.mkdir(exist_ok=True)
    return directory


def publish_config(directory: Path, version: int) -> None:
    """A new model's own config.pbtxt, a copy of its first version's, written whole and renamed
    in: from now on the repository finds the model (a restart serves it). Its tombstone goes."""
    incoming = directory / f".{CONFIG}.incoming"
    shutil.copyfile(directory / str(version) / CONFIG, incoming)
    with incoming.open("rb") as f:
        os.fsync(f.fileno())
    os.rename(incoming, directory / CONFIG)
    _fsync_directory(directory)
    tombstone(directory).unlink(missing_ok=True)


def tombstone(directory: Path) -> Path:
    """Beside a removed model's directory: the package does not seed the model again."""
    return directory.with_name(f".{directory.name}.removed")


def remove_model(staging: Path, directory: Path) -> None:
    """A removed model's directory goes (renamed into staging first: the repository never
    holds half a model); its tombstone stays, so that a package upgrade does not bring it
    back (``debian/edged.postinst`` looks for it)."""
    ensure_staging(staging)
    mark = tombstone(directory)
    mark.write_text(
        "removed by the fleet or an operator; delete this file to let the package"
        " seed the model again\n"
    )
    _fsync_directory(directory.parent)
    if os.path.lexists(directory):
        _remove_through(staging, directory)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_in(staging: Path, source: Path, target: Path) -> None:
    """``source`` becomes ``target`` in one rename (a version there already, moved in from
    staging by an install cut short, is removed through staging first)."""
    if os.path.lexists(target):
        _remove_through(staging, target)
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise InvalidRequest(f"cannot move {source} to {target}: {exc.strerror}") from None
        # another file system: copied beside the target first, then renamed in
        incoming = target.with_name(f".{target.name}.incoming")
        shutil.rmtree(incoming, ignore_errors=True)
        try:
            shutil.copytree(source, incoming)
            for path in incoming.rglob("*"):
                if path.is_file():
                    with path.open("rb") as f:
                        os.fsync(f.fileno())
            os.rename(incoming, target)
        except OSError as copy_exc:
            shutil.rmtree(incoming, ignore_errors=True)
            raise InvalidRequest(f"cannot copy {source} to {target}: {copy_exc.strerror}") from None
        shutil.rmtree(source, ignore_errors=True)
    _fsync_directory(target.parent)  # the rename itself is durable before the version is used


async def smoke_test(manager: ModelManager, name: str, version: int, cases: Any) -> int:
    """Run each case on ``version``; InvalidRequest says which output differs. Returns how many
    cases passed. The cases are edged's own calls: the version's statistics do not count them."""
    if not isinstance(cases, list):
        raise InvalidRequest("'smoke' must be a list of {inputs, outputs}")
    for number, case in enumerate(cases, 1):
        if not isinstance(case, dict) or not isinstance(case.get("outputs"), list):
            raise InvalidRequest(f"smoke case {number} must be {{inputs, outputs}}")
        request = decode_request(json.dumps({"inputs": case.get("inputs")}).encode())
        with own_calls():
            _, _, outputs = await manager.infer(name, version, request.inputs)
        for want in case["outputs"]:
            output = want.get("name") if isinstance(want, dict) else None
            if output not in outputs:
                raise InvalidRequest(f"smoke case {number}: no output '{output}'")
            got, expected = outputs[output], np.asarray(want.get("data"))
            if got.dtype == object or expected.dtype.kind in "OUS":
                same = got.ravel().tolist() == [
                    e.encode() if isinstance(e, str) else e for e in expected.ravel().tolist()
                ]
                if not same:
                    raise InvalidRequest(f"smoke case {number}: output '{output}' differs")
                continue
            atol = float(want.get("atol", SMOKE_ATOL))
            if got.size != expected.size:
                raise InvalidRequest(
                    f"smoke case {number}: output '{output}' has {got.size} values,"
                    f" {expected.size} expected"
                )
            worst = float(np.max(np.abs(got.ravel().astype(np.float64) - expected.ravel())))
            if not worst <= atol:
                raise InvalidRequest(
                    f"smoke case {number}: output '{output}' differs by up to {worst:.6g}"
                    f" (atol {atol:g})"
                )
    return len(cases)


def prune(model_dir: Path, keep: int, also: set[int]) -> list[int]:
    """Remove all but the newest ``keep`` version directories and those in ``also``."""
    versions = sorted(
        int(d.name) for d in model_dir.iterdir() if d.is_dir() and VERSION.match(d.name)
    )
    kept = set(versions[-keep:]) | also
    removed = [v for v in versions if v not in kept]
    for version in removed:
        shutil.rmtree(model_dir / str(version))
    return removed

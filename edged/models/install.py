"""New model versions into the repository: checked, moved in atomically, smoke-tested, pruned.

cloudsync (or an operator) stages a version's files in a directory on the repository's file
system and asks edged to install it (``POST /v1/admin/models/{m}/install``). edged checks each
file's length and SHA-256 against the list it was given, moves the directory to
``{repository}/{model}/{version}`` in one ``rename`` (a crash leaves it whole or absent, never
half there), loads it beside the version serving, runs the smoke cases on it, and only then
switches requests to it (``ModelManager.activate``). The newest ``keep`` versions stay on disk,
and always the active one and the one before it (the rollback target).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import InvalidRequest
from edged.models.repository import VERSION, ModelManager
from edged.protocol.tensors import decode_request

SMOKE_ATOL = 1e-4
CHUNK = 1 << 20


def sha256_of(path: Path, limit: int | None = None) -> Any:
    """The SHA-256 of a file (its first ``limit`` bytes), read in chunks: the hash object, so
    a download can go on feeding it."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        left = limit
        while left is None or left > 0:
            chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest


def check_files(directory: Path, files: Any) -> None:
    """Each listed file has its length and SHA-256 (InvalidRequest names the first that does
    not); files not listed are refused too: what serves is exactly what was signed."""
    if not isinstance(files, list) or not files:
        raise InvalidRequest("'files' must list the version's files: [{path, sha256, length}]")
    listed = set()
    for row in files:
        if not isinstance(row, dict) or not isinstance(row.get("path"), str):
            raise InvalidRequest("each file must be {path, sha256, length}")
        path = (directory / row["path"]).resolve()
        if directory.resolve() not in path.parents:
            raise InvalidRequest(f"file '{row['path']}' is outside the version directory")
        listed.add(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise InvalidRequest(f"file '{row['path']}': {exc.strerror}") from None
        if size != row.get("length"):
            listed_length = row.get("length")
            raise InvalidRequest(f"file '{row['path']}' has {size} bytes, {listed_length} listed")
        if sha256_of(path).hexdigest() != row.get("sha256"):
            raise InvalidRequest(f"file '{row['path']}': its SHA-256 is not the one listed")
    extra = [p for p in directory.rglob("*") if p.is_file() and p.resolve() not in listed]
    if extra:
        raise InvalidRequest(f"'{extra[0].relative_to(directory)}' is not in the file list")


def stage(source: Path, files: Any, target: Path) -> None:
    """Check the staged files, then move them in as ``target`` (blocking: run in a thread).
    With no ``source`` left, a ``target`` moved in before (an install cut short) is checked
    where it is."""
    if not source.is_dir():
        if not target.is_dir():
            raise InvalidRequest(f"'source' {source} is not a directory")
        check_files(target, files)
        return
    check_files(source, files)
    move_in(source, target)


def move_in(source: Path, target: Path) -> None:
    """``source`` becomes ``target`` in one rename (a version there already is replaced)."""
    if target.exists():
        shutil.rmtree(target)
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
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable before the version is used
    finally:
        os.close(fd)


async def smoke_test(manager: ModelManager, name: str, version: int, cases: Any) -> int:
    """Run each case on ``version``; InvalidRequest says which output differs. Returns how many
    cases passed."""
    if not isinstance(cases, list):
        raise InvalidRequest("'smoke' must be a list of {inputs, outputs}")
    for number, case in enumerate(cases, 1):
        if not isinstance(case, dict) or not isinstance(case.get("outputs"), list):
            raise InvalidRequest(f"smoke case {number} must be {{inputs, outputs}}")
        request = decode_request(json.dumps({"inputs": case.get("inputs")}).encode())
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

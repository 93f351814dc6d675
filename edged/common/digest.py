"""File digests, read in chunks (a model file may be gigabytes)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

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

"""What a model may be called: a directory of the repository, a path segment of every API, a
name in signed manifests (one definition for edged, cloudsync and the fleet service); and the
reason edged's event gives for a version refused as damaged on disk, which cloudsync acts on."""

from __future__ import annotations

import re
from typing import Any

# matched whole (``fullmatch``): "$" alone would let a trailing newline through
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def is_model_name(value: Any) -> bool:
    return isinstance(value, str) and MODEL_NAME.fullmatch(value) is not None


DAMAGED = "damaged"  # the ``reason`` of the event of a version whose files are not those installed

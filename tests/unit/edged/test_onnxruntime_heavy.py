"""Which runs give their memory back (OnnxRuntime._heavy): a large input or a slow model,
not a quick run whatever its inputs, and the first run of a large input (not yet timed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edged.config import OnnxRuntimeConfig
from edged.models.model_config import read_config
from edged.runtimes.onnxruntime import HEAVY_BYTES, HEAVY_S, QUICK_S, OnnxRuntime
from tests.unit.edged.test_repository import add_model

SMALL = {"x": np.zeros(4, np.float32)}
LARGE = {"x": np.zeros(HEAVY_BYTES, np.uint8)}


@pytest.mark.parametrize(
    ("recent", "feeds", "heavy"),
    [
        (None, LARGE, True),  # not yet timed: its inputs say
        (None, SMALL, False),
        (QUICK_S / 2, LARGE, False),  # a quick run: nothing worth a trim
        (QUICK_S, LARGE, True),
        (QUICK_S, SMALL, False),
        (HEAVY_S, SMALL, True),  # a slow one: its activations are large
        (HEAVY_S / 2, SMALL, False),
    ],
)
def test_what_is_a_heavy_run(
    tmp_path: Path, recent: float | None, feeds: dict[str, np.ndarray], heavy: bool
) -> None:
    add_model(tmp_path, "m", {1: 2.0})
    runtime = OnnxRuntime(
        read_config(tmp_path / "m"),
        tmp_path / "m" / "1",
        OnnxRuntimeConfig(),
        ThreadPoolExecutor(1),
    )
    runtime.recent_s = recent
    assert runtime._heavy(feeds) is heavy

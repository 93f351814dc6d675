"""edged/common/heap.py: glibc's thresholds are fixed where glibc is, and its own environment
setting wins."""

from __future__ import annotations

import pytest

from edged.common import heap


def test_the_thresholds_are_fixed_unless_the_environment_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if heap.MALLOPT is None:
        pytest.skip("no mallopt in this C library (not glibc): nothing to fix")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap.fix_thresholds() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert heap.fix_thresholds() is True
    heap.trim_heap()  # and trims without an error

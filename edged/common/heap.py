"""The C heap under a long-running daemon (glibc's malloc; each function a no-op elsewhere).

glibc's mmap threshold is dynamic: each large block freed raises it (up to 32 MiB), after which
blocks of that size come from the heap, where a block still in use keeps the pages around it. A
daemon that now and then serves one large request (256 texts of 16 KB, a 36 MP image) then keeps
what that request took: +22 % RSS that stayed, measured (issue 44). A fixed threshold keeps every
large block in a mapping of its own, given back when freed (+6 %, the same request; its cost,
an mmap and fresh pages per large block, did not show in the request's time). The free top of
the heap over 256 KiB goes back as well.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

_LIBC = ctypes.CDLL(None)
# glibc's functions, looked up in the process's own symbols (no ldconfig run); None elsewhere
MALLOC_TRIM: Callable[[int], int] | None = getattr(_LIBC, "malloc_trim", None)
MALLOPT: Callable[[int, int], int] | None = getattr(_LIBC, "mallopt", None)
M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
# Blocks of 128 KiB and over get a mapping of their own: glibc's default before it adapts.
MMAP_THRESHOLD = 128 << 10

# A request whose body is this large is followed by a trim once no request is in flight (the
# REST server): after two callers of 256 texts of 16 KB, with the thresholds fixed, the heap
# still kept 8 to 24 MiB on a loaded machine; with the trim, 0 to 15.
LARGE_BYTES = 1 << 20

log = logging.getLogger("edged.heap")


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps them after a session goes,
    so the daemon's RSS would not drop as much)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def fix_thresholds(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold and its trim threshold (twice that), which turns its dynamic
    adjustment off; False where the C library has no ``mallopt`` or refused, or where
    ``MALLOC_MMAP_THRESHOLD_``, glibc's own setting, is in the environment (it wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if MALLOPT is None:
        log.debug("no mallopt in this C library: the heap's thresholds stay its own")
        return False
    # The trim threshold too: the dynamic adjustment had raised it to twice the largest block
    # freed so far (the imports' already), and the heap's free top would stay (+15 %, measured).
    return bool(MALLOPT(M_MMAP_THRESHOLD, threshold)) and bool(
        MALLOPT(M_TRIM_THRESHOLD, 2 * threshold)
    )

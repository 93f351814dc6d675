"""A settings section as it is now: a reload swaps in a new snapshot whole.

The daemon's parts that read settings while serving (the access checks, the REST adapter, the
pipelines) hold a ``Live`` and ask it for ``now()`` where they use a value; a reload builds a
new snapshot (``model_copy`` of the running one with the keys that may change while serving
taken from the file) and swaps it in, one reference assignment. A reader sees the old snapshot
or the new one, never half of each, and no object a reader holds is changed under it."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Live(Generic[T]):
    def __init__(self, snapshot: T) -> None:
        self._snapshot = snapshot

    def now(self) -> T:
        return self._snapshot

    def swap(self, snapshot: T) -> T:
        """``snapshot`` from now on; the one before."""
        before, self._snapshot = self._snapshot, snapshot
        return before

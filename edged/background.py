"""A loop that runs in the background from ``start`` until ``stop`` (monitors, samplers)."""

from __future__ import annotations

import asyncio
import contextlib


class Background:
    """Subclasses implement ``_run``; ``start`` and ``stop`` manage its task."""

    task_name = "background"
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Run ``_run`` in the background (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

"""The Jetson power-mode hint: a lower nvpmodel mode while every model is idle-unloaded, the
mode before it back before any model loads.

``nvpmodel`` is NVIDIA's tool (JetPack) and needs root: under the shipped unit edged runs as
its own user, so an operator who wants the hint provides a way (docs/OPERATIONS.md). A machine
without the tool, or a refusal, is logged once and the hint is off; serving never waits on it
for more than ``TIMEOUT_S``. The mode to restore is also kept in a file, so that an edged that
crashed in the low mode restores it when it starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from edged.common.atomic import write_atomic

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0


class IdlePowerMode:
    """Switches to ``mode`` on ``idle()`` and back to the mode found then on ``busy()``."""

    def __init__(self, mode: int, saved: Path, command: str = "nvpmodel") -> None:
        self.mode = mode
        self.saved = saved  # holds the mode to restore while switched
        self.command = command
        self.before: int | None = None  # the mode to restore; None: not switched
        self.broken = ""  # why the hint is off
        self.lock = asyncio.Lock()  # one switch at a time: a load never races an idle switch

    async def _run(self, *args: str) -> str:
        path = shutil.which(self.command)
        if path is None:
            raise OSError(f"{self.command} is not installed (not a Jetson?)")
        proc = await asyncio.create_subprocess_exec(
            path,
            *args,
            stdin=asyncio.subprocess.DEVNULL,  # a mode that wants a reboot asks: answer no
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        except BaseException:  # too slow, or edged is stopping: leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise OSError(f"{self.command} {' '.join(args)} did not finish") from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise OSError(f"{self.command} {' '.join(args)} failed ({proc.returncode}): {text}")
        return text

    def _off(self, exc: Exception) -> None:
        self.broken = str(exc)
        log.warning("power-mode hint off: %s", exc)

    async def recover(self) -> None:
        """At start: a mode left switched by an edged that did not stop cleanly comes back."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.before = int(self.saved.read_text())
            log.warning("power mode %d was left switched by the last run: restoring", self.before)
            await self.busy()

    async def idle(self, still: Callable[[], bool]) -> None:
        """Every model is idle-unloaded (while ``still()`` says so): the low-power mode,
        remembering the current one."""
        async with self.lock:
            if self.broken or self.before is not None or not still():
                return
            try:
                # ``nvpmodel -q`` prints "NV Power Mode: <name>" then the mode's number
                current = int((await self._run("-q")).split()[-1])
                if current == self.mode or not still():
                    return
                self.before = current  # first: whatever happens next, busy() restores it
                write_atomic(self.saved, f"{current}\n")  # a crash leaves it whole or absent
                await self._run("-m", str(self.mode))
            except (OSError, ValueError, IndexError) as exc:
                self._off(exc)
                return
        log.info("every model idle: power mode %d (was %d)", self.mode, current)

    async def busy(self) -> None:
        """A model loads: the mode from before ``idle()``."""
        async with self.lock:
            if self.before is None:
                return
            before, self.before = self.before, None
            try:
                await self._run("-m", str(before))
            except OSError as exc:
                self._off(exc)
                return
            finally:
                self.saved.unlink(missing_ok=True)
        log.info("a model is loading: power mode %d again", before)

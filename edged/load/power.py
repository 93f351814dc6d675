"""The Jetson power-mode hint: a lower nvpmodel mode while every model is idle-unloaded, the
mode before it back as soon as a model loads again.

``nvpmodel`` is NVIDIA's tool (JetPack) and needs root: under the shipped unit edged runs as
its own user, so an operator who wants the hint grants it (docs/OPERATIONS.md). A machine
without the tool, or a refusal, is logged once and the hint is off; serving never waits on it
for more than ``TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0


class IdlePowerMode:
    """Switches to ``mode`` on ``idle()`` and back to the mode found then on ``busy()``."""

    def __init__(self, mode: int, command: str = "nvpmodel") -> None:
        self.mode = mode
        self.command = command
        self.before: int | None = None  # the mode to restore; None: not switched
        self.broken = ""  # why the hint is off

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
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise OSError(f"{self.command} {' '.join(args)} took over {TIMEOUT_S:.0f} s") from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise OSError(f"{self.command} {' '.join(args)} failed ({proc.returncode}): {text}")
        return text

    def _off(self, exc: Exception) -> None:
        self.broken = str(exc)
        log.warning("power-mode hint off: %s", exc)

    async def idle(self) -> None:
        """Every model is idle-unloaded: the low-power mode, remembering the current one."""
        if self.broken or self.before is not None:
            return
        try:
            # ``nvpmodel -q`` prints "NV Power Mode: <name>" then the mode's number
            current = int((await self._run("-q")).split()[-1])
            if current == self.mode:
                return
            await self._run("-m", str(self.mode))
        except (OSError, ValueError, IndexError) as exc:
            self._off(exc)
            return
        self.before = current
        log.info("every model idle: power mode %d (was %d)", self.mode, current)

    async def busy(self) -> None:
        """A model loads again: the mode from before ``idle()``."""
        if self.before is None:
            return
        before, self.before = self.before, None
        try:
            await self._run("-m", str(before))
        except OSError as exc:
            self._off(exc)
            return
        log.info("a model is loading: power mode %d again", before)

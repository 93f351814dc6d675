"""The snapshot, the provider contract and the sampler."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from edged.background import Background
from edged.common.load import LoadSnapshot

log = logging.getLogger(__name__)


class Provider(Protocol):
    """One source of load figures."""

    name: str

    def available(self) -> bool:
        """Whether this machine has what the provider reads."""
        ...

    def sample(self) -> dict[str, Any]:
        """Fields of ``LoadSnapshot`` it can tell now (missing keys: it cannot)."""
        ...


def default_providers(root: Path = Path("/")) -> list[Provider]:
    """The providers for this machine, most specific first (``root``: for tests)."""
    from edged.device.jetson import JetsonSysfs
    from edged.device.jtop import Jtop
    from edged.device.nvml import Nvml
    from edged.device.procfs import ProcFs

    candidates: list[Provider] = [JetsonSysfs(root), ProcFs(root)]
    if root == Path("/"):  # these read services and drivers, not files under root
        candidates[1:1] = [Jtop(), Nvml()]
    found = [p for p in candidates if p.available()]
    skipped = [p.name for p in candidates if p not in found]
    log.info(
        "load providers: %s%s",
        ", ".join(p.name for p in found),
        f" (not on this machine: {', '.join(skipped)})" if skipped else "",
    )
    return found


def merge(samples: list[tuple[str, dict[str, Any]]]) -> LoadSnapshot:
    """The first provider that has a field gives it; dictionaries are merged the same way."""
    merged: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(LoadSnapshot)}
    for _, values in samples:
        for key, value in values.items():
            if key not in names or value is None:
                continue
            if isinstance(value, dict):
                merged[key] = {**value, **merged.get(key, {})}
            elif key not in merged:
                merged[key] = value
    temperatures = merged.get("temperatures") or {}
    if temperatures and "temperature_c" not in merged:
        merged["temperature_c"] = max(temperatures.values())
    sources = tuple(name for name, values in samples if values)
    return LoadSnapshot(taken=time.monotonic(), sources=sources, **merged)


class LoadMonitor(Background):
    """Samples the providers every ``interval`` seconds (from ``start`` to ``stop``); ``latest``
    is the newest snapshot."""

    task_name = "load-monitor"

    def __init__(self, providers: list[Provider] | None = None, interval: float = 1.0) -> None:
        """``providers`` default to ``default_providers()``, found at the first sample (off
        the event loop, not at construction: probing imports libraries and reads devices)."""
        self.providers = providers
        self.interval = interval
        self.latest = LoadSnapshot()

    def sample(self) -> LoadSnapshot:
        """Read every provider once; a provider that fails is skipped (and logged)."""
        if self.providers is None:
            self.providers = default_providers()
        samples = []
        for provider in self.providers:
            try:
                samples.append((provider.name, provider.sample()))
            except Exception as exc:  # a vanished sysfs file must not stop the sampling
                log.warning("load provider %s failed: %s", provider.name, exc)
        self.latest = merge(samples)
        return self.latest

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # File reads are fast, but never on the loop's time: a slow sysfs node must not stall.
            await loop.run_in_executor(None, self.sample)
            await asyncio.sleep(self.interval)

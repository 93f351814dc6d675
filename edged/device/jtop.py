"""jtop (jetson-stats), optional: it is AGPL-licensed and needs its own root service
(``jtop.service``, socket ``/run/jtop.sock``), so edged only uses it when both are there, and
reads sysfs itself otherwise. It adds what sysfs alone does not give without root: the GPU's
share of the shared memory, and the power mode without reading nvpmodel's files.

``from_jtop`` turns jtop 4.x's dictionaries (``jetson.stats``, ``.gpu``, ``.memory``,
``.temperature``, ``.power``) into LoadSnapshot fields; it is what the tests check, on
dictionaries built as jtop documents them.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
SOCKET = Path("/run/jtop.sock")


def from_jtop(
    stats: dict[str, Any],
    gpu: dict[str, Any],
    memory: dict[str, Any],
    temperature: dict[str, Any],
    power: dict[str, Any],
) -> dict[str, Any]:
    """LoadSnapshot fields from jtop's dictionaries (kB, kHz, mW, C as jtop gives them)."""
    out: dict[str, Any] = {}
    cpus = [v for k, v in stats.items() if k.startswith("CPU") and k[3:].isdigit()]
    online = [float(v) for v in cpus if isinstance(v, (int, float))]
    if online:
        out["cpu_percent"] = round(sum(online) / len(online), 1)
        out["cpu_count"] = len(cpus)
    for device in gpu.values():
        load = device.get("status", {}).get("load")
        if load is not None:
            out["gpu_percent"] = float(load)
        cur = device.get("freq", {}).get("cur")
        if cur is not None:
            out["gpu_frequency_hz"] = int(cur) * 1000
        break
    ram = memory.get("RAM", {})
    if "tot" in ram:
        out["memory_total"] = int(ram["tot"]) * 1024
        if "used" in ram:
            out["memory_available"] = (int(ram["tot"]) - int(ram["used"])) * 1024
    zones = {
        name: float(zone["temp"])
        for name, zone in temperature.items()
        if zone.get("online", True) and zone.get("temp", -256) > -40
    }
    if zones:
        out["temperatures"] = zones
    rails = {
        name: round(rail["power"] / 1000, 3)
        for name, rail in power.get("rail", {}).items()
        if rail.get("online", True) and "power" in rail
    }
    if rails:
        out["rails_w"] = rails
    total = power.get("tot", {}).get("power")
    if total is not None:
        out["power_w"] = round(total / 1000, 3)
    mode = stats.get("nvp model")
    if mode:
        out["power_mode"] = str(mode)
    return out


class Jtop:
    """Reads jtop's service when the package and its service are both present."""

    name = "jtop"

    def __init__(self, socket: Path = SOCKET) -> None:
        self.socket = socket
        self._module: Any = None
        self._jetson: Any = None

    def available(self) -> bool:
        try:
            module = importlib.import_module("jtop")
        except ImportError:
            log.debug("jtop (jetson-stats) is not installed")
            return False
        if not self.socket.exists():
            log.info("jtop is installed but its service is not running (%s)", self.socket)
            return False
        self._module = module
        return True

    def sample(self) -> dict[str, Any]:
        if self._jetson is None:  # connect on the first sample, in the sampler's thread
            self._jetson = self._module.jtop()
            self._jetson.start()
        j = self._jetson
        if not j.ok(spin=True):  # spin: do not wait for jtop's next update
            return {}
        return from_jtop(j.stats, j.gpu, j.memory, j.temperature, j.power)

"""NVIDIA Jetson from sysfs, the way jetson-stats (jtop 4.x) finds the same files, without its
root service: GPU load and clock, thermal zones, INA3221 power rails, over-current throttling
events and the nvpmodel power mode. Memory is shared by CPU and GPU on a Jetson, so /proc's
figures (the procfs provider) already count the GPU's.

Layouts (L4T 35/36, Orin and Xavier):
- GPU: ``/sys/class/devfreq/<dev>`` whose ``device/of_node/name`` is ga10b, gv11b, gp10b, gpu
  or gb10b; ``device/load`` in per-mille, ``cur_freq`` in Hz.
- Thermal: ``/sys/devices/virtual/thermal/thermal_zone*/{type,temp}``, milli-degrees C;
  PMIC zones and unreadable ones (offline) are skipped.
- Power: ``/sys/bus/i2c/devices/*/name`` containing ina3221, then
  ``hwmon/hwmon*/in<N>_label``, ``in<N>_input`` (mV), ``curr<N>_input`` (mA). Total power is
  ``VDD_IN`` (or ``POM_5V_IN``) when the board has it, else the sum of the rails.
- Throttling: the ``soctherm_oc`` hwmon's ``oc<N>_event_cnt`` counters grew since the last sample.
- Power mode: ``/var/lib/nvpmodel/status`` (``pmode:0000``) named by ``/etc/nvpmodel.conf``.
- jetson_clocks: it pins the clocks at their maximum, so it is on when the GPU's devfreq
  ``min_freq`` equals its ``max_freq`` and every online CPU's ``scaling_min_freq`` its
  ``scaling_max_freq``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from edged.device.procfs import read_or_none

GPU_NODES = {"ga10b", "gv11b", "gp10b", "gpu", "gb10b"}
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")
MODE_NAME = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")


def _text(path: Path) -> str | None:
    text = read_or_none(path)
    return None if text is None else text.strip()


def _number(path: Path) -> int | None:
    text = _text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class JetsonSysfs:
    """Jetson figures from sysfs; ``root`` lets tests point it at a tree they build."""

    name = "jetson-sysfs"

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._oc_events: int | None = None

    def available(self) -> bool:
        compatible = self.root / "proc/device-tree/compatible"
        try:
            if b"nvidia,tegra" in compatible.read_bytes():
                return True
        except OSError:
            pass
        return (self.root / "etc/nv_tegra_release").is_file()

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out.update(self._gpu())
        out["temperatures"] = self._temperatures()
        rails = self._rails()
        if rails:
            out["rails_w"] = rails
            total = next((rails[name] for name in TOTAL_RAILS if name in rails), None)
            out["power_w"] = round(total if total is not None else sum(rails.values()), 3)
        out["throttled"] = self._throttled()
        out["power_mode"] = self._power_mode()
        out["clocks_pinned"] = self._clocks_pinned()
        return out

    def _gpu_devfreq(self) -> Path | None:
        for entry in sorted((self.root / "sys/class/devfreq").glob("*")):
            if _text(entry / "device/of_node/name") in GPU_NODES:
                return entry
        return None

    def _gpu(self) -> dict[str, Any]:
        entry = self._gpu_devfreq()
        if entry is None:
            return {}
        load = _number(entry / "device/load")
        return {
            "gpu_percent": None if load is None else load / 10,
            "gpu_frequency_hz": _number(entry / "cur_freq"),
        }

    def _clocks_pinned(self) -> bool | None:
        """Whether jetson_clocks holds the clocks at their maximum (None: cannot tell)."""
        pairs = []
        gpu = self._gpu_devfreq()
        if gpu is not None:
            pairs.append((_number(gpu / "min_freq"), _number(gpu / "max_freq")))
        for cpu in sorted((self.root / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq")):
            pairs.append((_number(cpu / "scaling_min_freq"), _number(cpu / "scaling_max_freq")))
        known = [(low, high) for low, high in pairs if low is not None and high is not None]
        if not known:
            return None
        return all(low == high for low, high in known)

    def _temperatures(self) -> dict[str, float]:
        zones: dict[str, float] = {}
        for zone in sorted((self.root / "sys/devices/virtual/thermal").glob("thermal_zone*")):
            kind = _text(zone / "type")
            milli = _number(zone / "temp")
            if not kind or kind.startswith("PMIC") or milli is None or milli <= -40000:
                continue
            zones[kind] = milli / 1000
        return zones

    def _rails(self) -> dict[str, float]:
        rails: dict[str, float] = {}
        for device in sorted((self.root / "sys/bus/i2c/devices").glob("*")):
            if "ina3221" not in (_text(device / "name") or ""):
                continue
            for hwmon in sorted(device.glob("hwmon/hwmon*"))[:1]:
                for label_file in sorted(hwmon.glob("in*_label")):
                    channel = label_file.name[2:].split("_")[0]
                    label = _text(label_file)
                    if not label or "NC" in label.split("_") or channel == "7":
                        continue
                    millivolts = _number(hwmon / f"in{channel}_input")
                    milliamps = _number(hwmon / f"curr{channel}_input")
                    if millivolts is not None and milliamps is not None:
                        rails[label] = round(millivolts * milliamps / 1e6, 3)
        return rails

    def _throttled(self) -> bool | None:
        counters = None
        for hwmon in sorted((self.root / "sys/class/hwmon").glob("hwmon*")):
            if _text(hwmon / "name") != "soctherm_oc":
                continue
            counts = [_number(p) or 0 for p in sorted(hwmon.glob("oc*_event_cnt"))]
            counters = sum(counts)
        if counters is None:
            return None
        last, self._oc_events = self._oc_events, counters
        return last is not None and counters > last

    def _power_mode(self) -> str | None:
        status = _text(self.root / "var/lib/nvpmodel/status")
        if not status or not status.startswith("pmode:"):
            return None
        mode = int(status.split(":", 1)[1] or 0)
        names = dict(MODE_NAME.findall(_text(self.root / "etc/nvpmodel.conf") or ""))
        return names.get(str(mode), f"mode {mode}")

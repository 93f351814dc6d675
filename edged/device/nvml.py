"""NVML (desktop and data-centre GPUs), optional: ``nvidia-ml-py`` and an NVIDIA driver. On a
machine without them the provider stays out (logged). With several GPUs the figures are of the
busiest one; ``temperatures`` and ``rails_w`` name each GPU."""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)

# Throttle reasons that mean the GPU is slowed by heat or power, not by being idle.
THROTTLE_MASK_NAMES = (
    "nvmlClocksThrottleReasonSwPowerCap",
    "nvmlClocksThrottleReasonHwSlowdown",
    "nvmlClocksThrottleReasonSwThermalSlowdown",
    "nvmlClocksThrottleReasonHwThermalSlowdown",
    "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
)


class Nvml:
    """GPU utilisation, clock, temperature, power and throttling from NVML."""

    name = "nvml"

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._mask = 0

    def available(self) -> bool:
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            self._handles = [
                nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
            ]
        except Exception as exc:  # ImportError, or NVMLError without a driver or a GPU
            log.debug("NVML is not usable here: %s", exc)
            return False
        self._nvml = nvml
        for name in THROTTLE_MASK_NAMES:
            self._mask |= int(getattr(nvml, name, 0))
        return bool(self._handles)

    def sample(self) -> dict[str, Any]:
        nvml = self._nvml
        best: dict[str, Any] = {}
        temperatures: dict[str, float] = {}
        rails: dict[str, float] = {}
        throttled = False
        for i, handle in enumerate(self._handles):
            util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            temperatures[f"gpu{i}"] = float(
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            )
            rails[f"gpu{i}"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000  # mW -> W
            reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            throttled = throttled or bool(reasons & self._mask)
            if not best or util > best["gpu_percent"]:
                clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS)
                best = {"gpu_percent": util, "gpu_frequency_hz": int(clock) * 1_000_000}
        return {**best, "temperatures": temperatures, "rails_w": rails, "throttled": throttled}

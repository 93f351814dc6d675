"""The device's load at one moment: what edged's monitor samples (edged.device), its metrics and
its status show, cloudsync's heartbeat carries and the fleet service's series are made of."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoadSnapshot:
    """The device's load at one moment. ``None``: no provider could tell."""

    taken: float = 0.0  # time.monotonic()
    cpu_percent: float | None = None  # all CPUs of the device, 0-100
    cpu_count: int | None = None
    cpu_limit: float | None = None  # CPUs this process may use (cgroup quota), if limited
    cpu_pressure: float | None = None  # PSI "some" avg10, % of time tasks waited for a CPU
    load_average: float | None = None  # 1-minute
    memory_total: int | None = None  # bytes (Jetson: shared by CPU and GPU)
    memory_available: int | None = None  # bytes, the cgroup's limit taken into account
    gpu_percent: float | None = None
    gpu_frequency_hz: int | None = None
    temperature_c: float | None = None  # the hottest zone
    temperatures: dict[str, float] = field(default_factory=dict)
    power_w: float | None = None  # total input power (Jetson: VDD_IN)
    rails_w: dict[str, float] = field(default_factory=dict)
    throttled: bool | None = None
    power_mode: str | None = None  # nvpmodel
    clocks_pinned: bool | None = None  # jetson_clocks: clocks held at their maximum
    sources: tuple[str, ...] = ()

    @property
    def memory_used_percent(self) -> float | None:
        if not self.memory_total or self.memory_available is None:
            return None
        return 100.0 * (1 - self.memory_available / self.memory_total)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the API and telemetry."""
        out = dataclasses.asdict(self)
        out["memory_used_percent"] = self.memory_used_percent
        out["sources"] = list(self.sources)
        return out

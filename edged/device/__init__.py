"""Device load: providers probed in order, merged into one ``LoadSnapshot``, sampled in the
background at a configurable rate.

Providers, most specific first: Jetson sysfs (GPU load, thermal zones, power rails, nvpmodel),
jtop when jetson-stats and its service are installed, NVML on machines with an NVIDIA driver,
then /proc and cgroup limits (always there). A field takes the value of the first provider
that has it. An absent provider is logged, not fatal.
"""

from __future__ import annotations

from edged.device.monitor import LoadMonitor, LoadSnapshot, Provider, default_providers

__all__ = ["LoadMonitor", "LoadSnapshot", "Provider", "default_providers"]

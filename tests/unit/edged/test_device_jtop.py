"""jtop's dictionaries, built as jetson-stats 4.x documents them (jtop/jtop.py, and its tests'
fixtures): this machine has neither a Jetson nor jtop's service, so the dictionaries are made
here. The live connection to jtop.service is unverified until a Jetson runs the suite."""

from __future__ import annotations

from edged.device.jtop import Jtop, from_jtop

STATS = {
    "time": 0,
    "uptime": 100,
    "CPU1": 20,
    "CPU2": 40,
    "CPU3": "OFF",
    "CPU4": 60,
    "RAM": 0.5,
    "GPU": 30.0,
    "nvp model": "MAXN",
}
GPU = {
    "ga10b": {
        "type": "integrated",
        "status": {"railgate": False, "tpc_pg_mask": False, "3d_scaling": True, "load": 30.0},
        "freq": {"governor": "nvhost_podgov", "cur": 306000, "max": 1300500, "min": 306000},
        "power_control": "auto",
    }
}
MEMORY = {"RAM": {"tot": 16_000_000, "used": 6_000_000, "free": 8_000_000, "shared": 1_000_000}}
TEMPERATURE = {
    "cpu": {"temp": 45.5, "online": True},
    "cv0": {"temp": -256, "online": False},
    "tj": {"temp": 47.0, "online": True},
}
POWER = {
    "rail": {"VDD_CPU_GPU_CV": {"volt": 5032, "curr": 320, "power": 1610, "online": True}},
    "tot": {"volt": 5040, "curr": 1500, "power": 7560, "online": True, "name": "VDD_IN"},
}


def test_jtop_dictionaries_become_snapshot_fields() -> None:
    out = from_jtop(STATS, GPU, MEMORY, TEMPERATURE, POWER)
    assert out["cpu_percent"] == 40.0 and out["cpu_count"] == 4  # CPU3 is offline
    assert out["gpu_percent"] == 30.0 and out["gpu_frequency_hz"] == 306_000_000
    assert out["memory_total"] == 16_000_000 * 1024
    assert out["memory_available"] == 10_000_000 * 1024
    assert out["temperatures"] == {"cpu": 45.5, "tj": 47.0}  # cv0 is offline
    assert out["rails_w"] == {"VDD_CPU_GPU_CV": 1.61} and out["power_w"] == 7.56
    assert out["power_mode"] == "MAXN"


def test_missing_parts_give_nothing() -> None:
    assert from_jtop({}, {}, {}, {}, {}) == {}


def test_jtop_stays_out_without_the_package_or_its_service() -> None:
    assert not Jtop().available()


def test_nvml_stays_out_without_a_driver() -> None:
    """No NVIDIA driver on this machine: NVML is absent, which is logged, not fatal. Its
    readings are unverified until a GPU machine runs the suite (the device tool lent none)."""
    from edged.device.nvml import Nvml

    assert not Nvml().available()

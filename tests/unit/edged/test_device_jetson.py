"""The Jetson sysfs provider against trees built from the documented layouts of an Orin NX on
L4T 36 (JetPack 6) and an AGX Orin board: this machine is no Jetson, so its sysfs is faked
here, and only here. Sources: jetson-stats 4.3.1 (jtop/core/gpu.py, temperature.py, power.py),
the kernel's ina3221 documentation and the Tegra234 device trees."""

from __future__ import annotations

from pathlib import Path

from edged.device import LoadMonitor
from edged.device.jetson import JetsonSysfs
from edged.device.procfs import ProcFs


def write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


GPU = "sys/devices/platform/bus@0/17000000.gpu"


def orin_nx(root: Path) -> Path:
    """An Orin NX 16GB on JetPack 6 as jtop sees it."""
    gpu = GPU
    write(
        root,
        {
            "proc/device-tree/compatible": b"nvidia,p3768-0000+p3767-0000\0nvidia,p3767-0000\0"
            b"nvidia,tegra234\0",
            "etc/nv_tegra_release": "# R36 (release), REVISION: 3.0, GCID: 36923193\n",
            f"{gpu}/load": "437\n",  # per-mille
            f"{gpu}/of_node/name": "gpu\n",
            f"{gpu}/devfreq/17000000.gpu/cur_freq": "918000000\n",
            f"{gpu}/devfreq/17000000.gpu/min_freq": "306000000\n",
            f"{gpu}/devfreq/17000000.gpu/max_freq": "918000000\n",
            "sys/devices/system/cpu/cpu0/cpufreq/scaling_min_freq": "1984000\n",
            "sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq": "1984000\n",
            "sys/devices/system/cpu/cpu1/cpufreq/scaling_min_freq": "1984000\n",
            "sys/devices/system/cpu/cpu1/cpufreq/scaling_max_freq": "1984000\n",
            "sys/devices/virtual/thermal/thermal_zone0/type": "cpu-thermal\n",
            "sys/devices/virtual/thermal/thermal_zone0/temp": "52437\n",
            "sys/devices/virtual/thermal/thermal_zone1/type": "gpu-thermal\n",
            "sys/devices/virtual/thermal/thermal_zone1/temp": "48906\n",
            "sys/devices/virtual/thermal/thermal_zone2/type": "tj-thermal\n",
            "sys/devices/virtual/thermal/thermal_zone2/temp": "53125\n",
            "sys/devices/virtual/thermal/thermal_zone3/type": "cv0-thermal\n",
            "sys/devices/virtual/thermal/thermal_zone3/temp": "-256000\n",  # offline
            "sys/bus/i2c/devices/1-0040/name": "ina3221\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in1_label": "VDD_IN\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in1_input": "5048\n",  # mV
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/curr1_input": "1480\n",  # mA
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in2_label": "VDD_CPU_GPU_CV\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in2_input": "5040\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/curr2_input": "560\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in3_label": "VDD_SOC\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in3_input": "5040\n",
            "sys/bus/i2c/devices/1-0040/hwmon/hwmon3/curr3_input": "360\n",
            "sys/class/hwmon/hwmon5/name": "soctherm_oc\n",
            "sys/class/hwmon/hwmon5/oc1_event_cnt": "0\n",
            "sys/class/hwmon/hwmon5/oc2_event_cnt": "3\n",
            "var/lib/nvpmodel/status": "pmode:0002\n",
            "etc/nvpmodel.conf": "< POWER_MODEL ID=0 NAME=MAXN >\nCPU_ONLINE CORE_0 1\n"
            "< POWER_MODEL ID=1 NAME=10W >\n< POWER_MODEL ID=2 NAME=15W >\n",
        },
    )
    devfreq = root / "sys/class/devfreq/17000000.gpu"
    devfreq.parent.mkdir(parents=True, exist_ok=True)
    devfreq.symlink_to(root / gpu / "devfreq/17000000.gpu", target_is_directory=True)
    (root / gpu / "devfreq/17000000.gpu/device").symlink_to(root / gpu, target_is_directory=True)
    return root


def test_orin_nx_on_jetpack_6(tmp_path: Path) -> None:
    provider = JetsonSysfs(orin_nx(tmp_path))
    assert provider.available()
    out = provider.sample()
    assert out["gpu_percent"] == 43.7 and out["gpu_frequency_hz"] == 918_000_000
    assert out["temperatures"] == {
        "cpu-thermal": 52.437,
        "gpu-thermal": 48.906,
        "tj-thermal": 53.125,
    }
    assert out["rails_w"] == {"VDD_IN": 7.471, "VDD_CPU_GPU_CV": 2.822, "VDD_SOC": 1.814}
    assert out["power_w"] == 7.471  # VDD_IN is the board's input: not the sum
    assert out["power_mode"] == "15W"
    assert out["throttled"] is False  # the first sample has nothing to compare with
    assert out["clocks_pinned"] is False  # the GPU's devfreq may go down to 306 MHz
    write(tmp_path, {f"{GPU}/devfreq/17000000.gpu/min_freq": "918000000\n"})
    assert provider.sample()["clocks_pinned"] is True  # as after `jetson_clocks`
    write(tmp_path, {"sys/devices/system/cpu/cpu1/cpufreq/scaling_min_freq": "729600\n"})
    assert provider.sample()["clocks_pinned"] is False  # one CPU still scales
    (tmp_path / "sys/class/hwmon/hwmon5/oc2_event_cnt").write_text("5\n")
    assert provider.sample()["throttled"] is True
    assert provider.sample()["throttled"] is False  # no new events since


def test_agx_orin_without_vdd_in_sums_its_rails(tmp_path: Path) -> None:
    base = "sys/bus/i2c/devices/1-0040"
    write(
        tmp_path,
        {
            "etc/nv_tegra_release": "# R35 (release), REVISION: 4.1\n",
            f"{base}/name": "ina3221\n",
            f"{base}/hwmon/hwmon1/in1_label": "VDD_GPU_SOC\n",
            f"{base}/hwmon/hwmon1/in1_input": "5000\n",
            f"{base}/hwmon/hwmon1/curr1_input": "1000\n",
            f"{base}/hwmon/hwmon1/in2_label": "VDD_CPU_CV\n",
            f"{base}/hwmon/hwmon1/in2_input": "5000\n",
            f"{base}/hwmon/hwmon1/curr2_input": "400\n",
            f"{base}/hwmon/hwmon1/in3_label": "NC\n",
            f"{base}/hwmon/hwmon1/in3_input": "0\n",
            f"{base}/hwmon/hwmon1/curr3_input": "0\n",
            "var/lib/nvpmodel/status": "pmode:0007\n",
        },
    )
    out = JetsonSysfs(tmp_path).sample()
    assert out["power_w"] == 7.0 and set(out["rails_w"]) == {"VDD_GPU_SOC", "VDD_CPU_CV"}
    assert out["power_mode"] == "mode 7"  # no nvpmodel.conf to name it
    assert "gpu_percent" not in out and out["throttled"] is None


def test_not_a_jetson_here() -> None:
    assert not JetsonSysfs().available()  # this machine: the provider stays out


def test_merged_with_procfs_the_jetson_figures_come_first(tmp_path: Path) -> None:
    root = orin_nx(tmp_path)
    write(root, {"proc/stat": "cpu  1 0 1 8 0 0 0 0\n", "proc/meminfo": "MemTotal: 100 kB\n"})
    snapshot = LoadMonitor([JetsonSysfs(root), ProcFs(root)]).sample()
    assert snapshot.sources == ("jetson-sysfs", "procfs")
    assert snapshot.temperature_c == 53.125 and snapshot.gpu_percent == 43.7
    assert snapshot.memory_total == 100 * 1024

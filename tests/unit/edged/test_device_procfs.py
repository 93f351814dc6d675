"""The /proc and cgroup provider: on this machine's real /proc (a real CPU hog moves it), and on
trees built in the documented formats for the cgroup limits this container does not have."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from edged.device import LoadMonitor
from edged.device.procfs import ProcFs

MEMINFO = "MemTotal:        8000000 kB\nMemFree:         1000000 kB\nMemAvailable:    6000000 kB\n"
STAT = (
    "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\ncpu1 50 0 50 400 0 0 0 0 0 0\n"
)


def test_real_cpu_load_is_seen() -> None:
    provider = ProcFs()
    assert provider.available()
    provider.sample()
    time.sleep(0.5)
    quiet = provider.sample()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(quiet["cpu_count"])
    ]
    try:
        provider.sample()
        time.sleep(1.0)
        busy = provider.sample()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"cpu idle {quiet['cpu_percent']} %, with {len(hogs)} hogs {busy['cpu_percent']} %")
    assert busy["cpu_percent"] >= 80
    assert 0 < busy["memory_available"] <= busy["memory_total"]
    assert busy["load_average"] is not None


def build(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_limits(tmp_path: Path) -> None:
    root = build(
        tmp_path,
        {
            "proc/stat": STAT,
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/system.slice/edged.service\n",
            "proc/pressure/cpu": "some avg10=12.50 avg60=3.00 avg300=1.00 total=1\n",
            "sys/fs/cgroup/system.slice/edged.service/memory.max": "1073741824\n",
            "sys/fs/cgroup/system.slice/edged.service/memory.current": "268435456\n",
            "sys/fs/cgroup/system.slice/edged.service/cpu.max": "150000 100000\n",
        },
    )
    out = ProcFs(root).sample()
    assert out["memory_total"] == 8_000_000 * 1024
    assert out["memory_available"] == 1073741824 - 268435456  # the cgroup allows less
    assert out["cpu_limit"] == 1.5 and out["cpu_count"] == 2
    assert out["cpu_pressure"] == 12.5
    assert out["cpu_percent"] is None  # no interval yet


def test_cgroup_v1_and_no_limits(tmp_path: Path) -> None:
    root = build(
        tmp_path,
        {
            "proc/stat": STAT,
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "4:memory:/\n3:cpu,cpuacct:/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": "1000\n",
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    provider = ProcFs(root)
    out = provider.sample()
    assert out["memory_available"] == 6_000_000 * 1024  # "unlimited": MemAvailable stands
    assert out["cpu_limit"] is None and out["cpu_pressure"] is None
    (root / "proc/stat").write_text(STAT.replace("cpu  100 0 100 800", "cpu  250 0 150 900"))
    assert provider.sample()["cpu_percent"] == 66.7  # 200 busy of 300 jiffies


def test_monitor_merges_and_survives_a_failing_provider(tmp_path: Path) -> None:
    class Broken:
        name = "broken"

        def available(self) -> bool:
            return True

        def sample(self) -> dict[str, object]:
            raise OSError("the sysfs node vanished")

    root = build(tmp_path, {"proc/stat": STAT, "proc/meminfo": MEMINFO})
    snapshot = LoadMonitor([Broken(), ProcFs(root)]).sample()
    assert snapshot.sources == ("procfs",)
    assert snapshot.memory_used_percent == 25.0
    assert snapshot.as_dict()["memory_total"] == 8_000_000 * 1024

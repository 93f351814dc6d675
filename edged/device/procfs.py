"""/proc and cgroup limits: there on every Linux box.

CPU % is the whole device's, from /proc/stat deltas between samples (other processes' load
matters to routing as much as ours). Memory available is /proc/meminfo's MemAvailable, lowered to
what the cgroup still allows when it has a limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``). The CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) becomes
``cpu_limit``. Pressure (PSI) is read when the kernel has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def read_or_none(path: Path) -> str | None:
    """A file's text, or None when it cannot be read (absent, vanished, no permission)."""
    try:
        return path.read_text()
    except OSError:
        return None


class ProcFs:
    """CPU, memory, load average, pressure and cgroup limits."""

    name = "procfs"

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._last: tuple[int, int] | None = None  # (busy, total) jiffies at the last sample
        self.cpu_count = 0

    def available(self) -> bool:
        return (self.root / "proc/stat").is_file()

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu_percent": self._cpu_percent()}
        meminfo = self._meminfo()
        if meminfo:
            out["memory_total"] = meminfo.get("MemTotal")
            available = meminfo.get("MemAvailable")
            room = self._cgroup_memory_room()
            if available is not None and room is not None:
                available = min(available, room)
            out["memory_available"] = available
        loadavg = read_or_none(self.root / "proc/loadavg")
        if loadavg:
            out["load_average"] = float(loadavg.split()[0])
        out["cpu_pressure"] = self._pressure()
        out["cpu_limit"] = self._cpu_limit()
        out["cpu_count"] = self.cpu_count or None
        return out

    def _cpu_percent(self) -> float | None:
        text = read_or_none(self.root / "proc/stat")
        if not text or not text.startswith("cpu "):
            return None
        lines = text.splitlines()
        self.cpu_count = sum(1 for line in lines if line[:3] == "cpu" and line[3:4].isdigit())
        fields = [int(v) for v in lines[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already in user/nice
        busy = total - idle
        last, self._last = self._last, (busy, total)
        if last is None or total <= last[1]:
            return None  # the first sample has no interval yet
        return round(100.0 * (busy - last[0]) / (total - last[1]), 1)

    def _meminfo(self) -> dict[str, int]:
        text = read_or_none(self.root / "proc/meminfo") or ""
        values = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return values

    def _cgroup(self) -> Path:
        """This process's cgroup directory (v2), or the v1 hierarchy root."""
        own = read_or_none(self.root / "proc/self/cgroup") or ""
        for line in own.splitlines():
            hierarchy, _, path = line.partition(":")[2].partition(":")
            if hierarchy == "" and path:  # v2: "0::/path"
                return self.root / "sys/fs/cgroup" / path.lstrip("/")
        return self.root / "sys/fs/cgroup"

    def _cgroup_memory_room(self) -> int | None:
        base = self._cgroup()
        for limit_file, usage_file in (
            (base / "memory.max", base / "memory.current"),
            (base / "memory/memory.limit_in_bytes", base / "memory/memory.usage_in_bytes"),
        ):
            limit, usage = read_or_none(limit_file), read_or_none(usage_file)
            if limit is None or usage is None:
                continue
            limit = limit.strip()
            if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
                return None
            return max(0, int(limit) - int(usage.strip()))
        return None

    def _cpu_limit(self) -> float | None:
        base = self._cgroup()
        v2 = read_or_none(base / "cpu.max")
        if v2:
            quota, period = v2.split()[:2]  # "max 100000" or "150000 100000"
            return None if quota == "max" else round(int(quota) / int(period), 2)
        quota_text = read_or_none(base / "cpu/cpu.cfs_quota_us")
        period_text = read_or_none(base / "cpu/cpu.cfs_period_us")
        if quota_text and period_text and int(quota_text) > 0:
            return round(int(quota_text) / int(period_text), 2)
        return None

    def _pressure(self) -> float | None:
        text = read_or_none(self.root / "proc/pressure/cpu")
        if not text:
            return None
        for part in text.splitlines()[0].split():
            if part.startswith("avg10="):
                return float(part[6:])
        return None

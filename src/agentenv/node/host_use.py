"""What the host has and how busy it is, read from /proc for admission (node/admission.py).

- CPUs: the ones this process may run on (`sched_getaffinity`: a node confined to some CPUs by
  a cpuset or `taskset` has those), at start.
- Memory: MemTotal and MemAvailable (/proc/meminfo).
- Pressure: the "some avg10" of /proc/pressure/cpu and /proc/pressure/memory, the share of the
  last 10 s in which at least one task waited for a CPU or for memory (PSI). A kernel without
  PSI (no CONFIG_PSI, or booted with psi=0: the files are missing or refuse reads) gives None.
- CPU busy: the share of the host's CPU time that was not idle over about the last 10 s
  (/proc/stat, one reading kept per second), the CPU figure where there is no PSI.

A sample costs four small /proc reads (~50 us): admission takes one per decision, the
heartbeat one per beat.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: the busy share's window, as PSI's avg10
BUSY_WINDOW_S = 10.0


@dataclass(frozen=True)
class HostUse:
    cpus: int
    memory_total_mib: int
    memory_available_mib: int
    #: PSI "some avg10" in percent; None where the kernel has no PSI
    cpu_pressure: float | None
    memory_pressure: float | None
    #: percent of the host's CPU time busy over the last ~10 s (/proc/stat)
    cpu_busy: float


def host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class HostProbe:
    def __init__(self, proc: Path = Path("/proc"), cpus: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self.cpus = cpus or host_cpus()
        self.clock = clock
        self._stat: deque[tuple[float, int, int]] = deque()  # (time, total ticks, idle ticks)

    def sample(self) -> HostUse:
        total, available = self._meminfo()
        return HostUse(cpus=self.cpus, memory_total_mib=total, memory_available_mib=available,
                       cpu_pressure=self._pressure("cpu"),
                       memory_pressure=self._pressure("memory"), cpu_busy=self._busy())

    def _meminfo(self) -> tuple[int, int]:
        total = available = 0
        for line in (self.proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) // 1024
            elif line.startswith("MemAvailable:"):
                available = int(line.split()[1]) // 1024
                break  # MemAvailable comes after MemTotal
        return total, available

    def _pressure(self, kind: str) -> float | None:
        try:
            text = (self.proc / "pressure" / kind).read_text()
        except OSError:  # missing (no CONFIG_PSI) or EOPNOTSUPP (psi=0)
            return None
        for line in text.splitlines():
            if line.startswith("some "):
                for field in line.split()[1:]:
                    name, _, value = field.partition("=")
                    if name == "avg10":
                        try:
                            return float(value)
                        except ValueError:
                            return None
        return None

    def _busy(self) -> float:
        """Percent busy since the oldest reading kept (since boot at the first sample)."""
        try:
            with open(self.proc / "stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0.0
        # user nice system idle iowait irq softirq steal (guest time is inside user already)
        total = sum(fields[:8])
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        now = self.clock()
        readings = self._stat
        while len(readings) > 1 and now - readings[1][0] >= BUSY_WINDOW_S:
            readings.popleft()
        if not readings or now - readings[-1][0] >= 1.0:
            readings.append((now, total, idle))
        _, base_total, base_idle = readings[0]
        if base_total == total:  # no tick since the only reading: the share since boot
            base_total = base_idle = 0
        spent = total - base_total
        if spent <= 0:
            return 0.0
        return max(0.0, min(100.0, 100.0 * (spent - (idle - base_idle)) / spent))

"""Resource samples of a sandbox's VM: QEMU's CPU time and resident memory from /proc, the
root disk's allocated bytes from its layer files."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from agentenv.node.backend import MetricSample
from agentenv.runtime.vm import VM

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class MetricsSampler:
    """CPU use is a rate: each sample is measured against the previous one of its sandbox."""

    def __init__(self) -> None:
        self._cpu_seen: dict[str, tuple[float, int]] = {}  # sandbox id -> (time, ticks)

    def forget(self, sandbox_id: str) -> None:
        self._cpu_seen.pop(sandbox_id, None)

    def sample(self, sandbox_id: str, vm: VM) -> MetricSample:
        """Blocking (it reads /proc and stats the disk's files): run it in a thread."""
        now = time.time()
        ticks, rss = 0, 0
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{vm.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])
            with open(f"/proc/{vm.pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE_SIZE
        cpus = vm.machine.vcpus
        prev = self._cpu_seen.get(sandbox_id)
        self._cpu_seen[sandbox_id] = (now, ticks)
        pct = 0.0
        if prev and now > prev[0]:
            pct = max(0.0, (ticks - prev[1]) / CLK_TCK / (now - prev[0]) / cpus * 100)
        mem_total = vm.machine.memory_mib << 20
        disk_used, disk_total = 0, 0
        for disk in vm.disks:
            if disk.config.name != "rootfs":
                continue
            disk_total = disk.config.size
            paths = [Path(x.path) for x in disk.layers]
            upper = Path(vm.workdir) / "disks" / "rootfs"
            if upper.is_dir():
                paths.extend(p for p in upper.rglob("*") if p.is_file())
            for p in paths:
                with contextlib.suppress(OSError):
                    disk_used += p.stat().st_blocks * 512
        return MetricSample(timestamp=now, cpu_count=cpus, cpu_used_pct=round(min(pct, 100.0), 2),
                            mem_used=min(rss, mem_total), mem_total=mem_total, mem_cache=0,
                            disk_used=min(disk_used, disk_total), disk_total=disk_total)

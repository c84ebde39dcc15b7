"""Cold memory back to the host: a DAMON scheme that pages out memory nobody touches.

DAMON (the kernel's data access monitor) watches physical memory in regions, samples which
regions are accessed, and a DAMOS scheme (DAMON-based operation scheme) with the `pageout`
action reclaims the regions no sample saw accessed for `min_age`: clean page cache is dropped
(it reads back from the disk), anonymous memory is swapped out when the guest has swap. The
pages it frees land in the buddy allocator, where the balloon's free-page reporting hands them
to QEMU, which drops them from the host (runtime/qemu.py). The kernel state lives in the VM's
memory, so a template's setting carries over to every sandbox restored from its snapshot.

This is the scheme DAMON_RECLAIM runs (physical address space, pageout of regions with no
access for min_age, oldest first under a size and a time quota, free-memory watermarks), set
up through DAMON's sysfs interface (/sys/kernel/mm/damon/admin) rather than DAMON_RECLAIM's
module parameters: in the guest kernel (Debian's 6.12.95) those never reach the running
context. DAMON_RECLAIM stages the parameters on its live context, then commits an empty
staging context over it (fixed upstream by "mm/damon/reclaim: use parameter context
correctly"), so once enabled it monitors with the default intervals and holds no scheme at all:
it reclaims nothing. The sysfs interface commits a context built whole.

The host sends a whole setting (`POST /aenv/reclaim`, `{"enabled", "minAgeSeconds",
"quotaMBPerSecond", "quotaCpuMsPerSecond", "watermarks": {"high", "mid", "low"}, "sampleMs",
"aggregationMs"}`; `{"enabled": false}` alone turns it off). `GET /aenv/reclaim` is the
kernel's view: the scheme and its counters of what it tried and reclaimed.

Nothing of agentenv is imported: this runs from the tools disk.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ADMIN = "/sys/kernel/mm/damon/admin"
IOMEM = "/proc/iomem"
SWAPS = "/proc/swaps"
# The quotas are per second: DAMON resets its charge every this many ms.
QUOTA_INTERVAL_MS = 1000
# How often the free-memory watermarks are checked (µs).
WATERMARK_INTERVAL_US = 5_000_000
MiB = 1 << 20
ULONG_MAX = (1 << 64) - 1
UINT_MAX = (1 << 32) - 1

# The context and the scheme this module owns: kdamond 0 of the sysfs interface.
_KDAMOND = "kdamonds/0"
_CONTEXT = _KDAMOND + "/contexts/0"
_SCHEME = _CONTEXT + "/schemes/0"

# The scheme's counters (stats/) and their JSON names.
_STATS = {
    "nr_tried": "regionsTried",
    "sz_tried": "bytesTried",
    "nr_applied": "regionsReclaimed",
    "sz_applied": "bytesReclaimed",
    "qt_exceeds": "quotaExceeded",
}
_FIELDS = ("enabled", "minAgeSeconds", "quotaMBPerSecond", "quotaCpuMsPerSecond", "watermarks",
           "sampleMs", "aggregationMs")


class ReclaimError(Exception):
    """`status` is the HTTP status envd answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Setting:
    enabled: bool
    min_age_s: float = 0.0
    quota_mb: int = 0
    quota_ms: int = 0
    watermarks: tuple[int, int, int] = (1000, 999, 0)  # high, mid, low: free memory per mille
    sample_ms: int = 0
    aggregation_ms: int = 0

    @property
    def min_age_aggregations(self) -> int:
        """min_age in DAMON's unit for region ages: aggregation intervals, rounded up."""
        return max(1, math.ceil(self.min_age_s * 1000 / self.aggregation_ms))


def _number(body: dict[str, Any], name: str, low: float, high: float, *, whole: bool) -> Any:
    value = body.get(name)
    kinds = int if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if whole else "a number"
        raise ReclaimError(400, f"{name} must be {kind} from {low:g} to {high:g}, got {value!r}")
    return value


def parse(body: Any) -> Setting:
    """The setting a request body asks for; ReclaimError 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise ReclaimError(400, "the body must be a JSON object")
    unknown = set(body) - set(_FIELDS)
    if unknown:
        raise ReclaimError(400, f"unknown fields {sorted(unknown)}")
    enabled = body.get("enabled")
    if not isinstance(enabled, bool):
        raise ReclaimError(400, f"enabled must be true or false, got {enabled!r}")
    if not enabled:
        return Setting(enabled=False)
    missing = [name for name in _FIELDS if name not in body]
    if missing:
        raise ReclaimError(400, f"missing fields {missing} (an enabled setting names them all)")
    sample = _number(body, "sampleMs", 1, 60_000, whole=True)
    aggregation = _number(body, "aggregationMs", 1, 600_000, whole=True)
    if aggregation < sample:
        raise ReclaimError(400, f"aggregationMs ({aggregation}) must be at least sampleMs "
                                f"({sample})")
    marks = body["watermarks"]
    if not isinstance(marks, dict) or set(marks) != {"high", "mid", "low"}:
        raise ReclaimError(400, "watermarks must be an object {high, mid, low} (free memory per "
                                f"mille), got {marks!r}")
    levels = tuple(_number(marks, key, 0, 1000, whole=True) for key in ("high", "mid", "low"))
    if not levels[0] >= levels[1] >= levels[2]:
        raise ReclaimError(400, f"watermarks must be high >= mid >= low, got {marks}")
    return Setting(
        enabled=True,
        min_age_s=_number(body, "minAgeSeconds", 0, 30 * 86400, whole=False),
        quota_mb=_number(body, "quotaMBPerSecond", 1, 1 << 20, whole=True),
        quota_ms=_number(body, "quotaCpuMsPerSecond", 1, QUOTA_INTERVAL_MS, whole=True),
        watermarks=levels,  # type: ignore[arg-type]
        sample_ms=sample, aggregation_ms=aggregation)


def system_ram(iomem: str) -> list[tuple[int, int]]:
    """The guest's RAM as [start, end) physical ranges: the top-level `System RAM` entries of
    /proc/iomem (readable with their real addresses by root only)."""
    ranges: list[tuple[int, int]] = []
    with open(iomem, encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith(" ") or not line.rstrip().endswith(": System RAM"):
                continue
            start, _, end = line.split(" :", 1)[0].partition("-")
            low, high = int(start, 16), int(end, 16) + 1
            if high > low:
                ranges.append((low, high))
    if not ranges or all(low == 0 and high <= 1 for low, high in ranges):
        raise ReclaimError(500, f"no System RAM in {iomem} (not readable as root?)")
    return sorted(ranges)


def _swap_active(swaps: str) -> bool:
    try:
        with open(swaps, encoding="ascii", errors="replace") as f:
            return len(f.read().strip().splitlines()) > 1  # a header line, then one per device
    except OSError:
        return False


@dataclass
class Reclaim:
    """The pageout scheme in DAMON's sysfs interface under `admin`."""

    admin: str = ADMIN
    iomem: str = IOMEM
    swaps: str = SWAPS
    # envd applies settings in worker threads: two requests at once must not mix their writes
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def available(self) -> bool:
        return os.path.isfile(os.path.join(self.admin, "kdamonds", "nr_kdamonds"))

    def _path(self, name: str) -> str:
        return os.path.join(self.admin, name)

    def _read(self, name: str) -> str:
        with open(self._path(name), encoding="ascii") as f:
            return f.read().strip()

    def _write(self, name: str, value: object) -> None:
        try:
            with open(self._path(name), "w", encoding="ascii") as f:
                f.write(str(value))
        except OSError as exc:
            status = 409 if exc.errno == errno.EBUSY else 400
            raise ReclaimError(status, f"the kernel refused {name} = {value}: "
                                       f"{exc.strerror or exc}") from None

    def running(self) -> bool:
        try:
            return self._read(_KDAMOND + "/state") == "on"
        except OSError:
            return False

    def apply(self, body: Any) -> dict[str, Any]:
        """Stop DAMON, build the context and the scheme anew, start it when enabled (region
        ages start over). Returns status()."""
        setting = parse(body)
        if not self.available():
            raise ReclaimError(501, f"this guest kernel has no DAMON sysfs interface ({self.admin})")
        with self._lock:
            self._apply(setting)
        return self.status()

    def _apply(self, setting: Setting) -> None:
        if self.running():
            self._write(_KDAMOND + "/state", "off")
        if not setting.enabled:
            return
        self._write("kdamonds/nr_kdamonds", 1)
        self._write(_KDAMOND + "/contexts/nr_contexts", 1)
        self._write(_CONTEXT + "/operations", "paddr")
        self._write(_CONTEXT + "/monitoring_attrs/intervals/sample_us", setting.sample_ms * 1000)
        self._write(_CONTEXT + "/monitoring_attrs/intervals/aggr_us",
                    setting.aggregation_ms * 1000)
        ram = system_ram(self.iomem)
        self._write(_CONTEXT + "/targets/nr_targets", 1)
        regions = _CONTEXT + "/targets/0/regions"
        self._write(regions + "/nr_regions", len(ram))
        for index, (start, end) in enumerate(ram):
            # end first: a region's start may not pass its end at any moment
            self._write(f"{regions}/{index}/end", end)
            self._write(f"{regions}/{index}/start", start)
        self._write(_CONTEXT + "/schemes/nr_schemes", 1)
        self._write(_SCHEME + "/action", "pageout")
        # Every region of a page or more that no sample saw accessed for min_age. A range's
        # files start at 0..0 in sysfs: each bound is written.
        pattern = _SCHEME + "/access_pattern"
        for name, low, high in (("sz", 4096, ULONG_MAX), ("nr_accesses", 0, 0),
                                ("age", setting.min_age_aggregations, UINT_MAX)):
            self._write(f"{pattern}/{name}/max", high)
            self._write(f"{pattern}/{name}/min", low)
        quotas = _SCHEME + "/quotas"
        self._write(quotas + "/ms", setting.quota_ms)
        self._write(quotas + "/bytes", setting.quota_mb * MiB)
        self._write(quotas + "/reset_interval_ms", QUOTA_INTERVAL_MS)
        # Under the quota the regions untouched longest go first (DAMON_RECLAIM's weights).
        for name, weight in (("sz_permil", 0), ("nr_accesses_permil", 0), ("age_permil", 1000)):
            self._write(f"{quotas}/weights/{name}", weight)
        marks = _SCHEME + "/watermarks"
        self._write(marks + "/metric", "free_mem_rate")
        self._write(marks + "/interval_us", WATERMARK_INTERVAL_US)
        high, mid, low = setting.watermarks
        for name, value in (("high", high), ("mid", mid), ("low", low)):
            self._write(f"{marks}/{name}", value)
        # Without swap, anonymous pages cannot be paged out: DAMON would spend its quota on
        # them for nothing. With swap (the user's), cold anonymous memory goes too.
        skip_anon = not _swap_active(self.swaps)
        self._write(_SCHEME + "/filters/nr_filters", 1 if skip_anon else 0)
        if skip_anon:
            self._write(_SCHEME + "/filters/0/type", "anon")
            self._write(_SCHEME + "/filters/0/matching", "Y")
        self._write(_KDAMOND + "/state", "on")

    def _stats(self) -> dict[str, int]:
        # DAMON copies a running scheme's counters to sysfs when asked; a request while another
        # is served is refused (EBUSY), so a few tries.
        for _ in range(5):
            try:
                self._write(_KDAMOND + "/state", "update_schemes_stats")
                break
            except ReclaimError:
                time.sleep(0.05)
        return {json_name: int(self._read(f"{_SCHEME}/stats/{name}"))
                for name, json_name in _STATS.items()}

    def status(self) -> dict[str, Any]:
        if not self.available():
            return {"available": False}
        if not self.running():
            return {"available": True, "enabled": False}
        intervals = _CONTEXT + "/monitoring_attrs/intervals"
        aggregation_us = int(self._read(intervals + "/aggr_us"))
        reset_ms = max(1, int(self._read(_SCHEME + "/quotas/reset_interval_ms")))
        return {
            "available": True,
            "enabled": True,
            "kdamondPid": int(self._read(_KDAMOND + "/pid")),
            "minAgeSeconds": int(self._read(_SCHEME + "/access_pattern/age/min"))
            * aggregation_us / 1e6,
            "quotaMBPerSecond": int(self._read(_SCHEME + "/quotas/bytes"))
            * QUOTA_INTERVAL_MS / reset_ms / MiB,
            "quotaCpuMsPerSecond": int(self._read(_SCHEME + "/quotas/ms"))
            * QUOTA_INTERVAL_MS / reset_ms,
            "watermarks": {name: int(self._read(f"{_SCHEME}/watermarks/{name}"))
                           for name in ("high", "mid", "low")},
            "sampleMs": int(self._read(intervals + "/sample_us")) / 1000,
            "aggregationMs": aggregation_us / 1000,
            "skipAnonymous": int(self._read(_SCHEME + "/filters/nr_filters")) > 0,
            "stats": self._stats(),
        }

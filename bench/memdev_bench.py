"""Shared memory device benchmark: restores from blockd's memory device (runtime/memdev.py)
against the materialised raw memory file (runtime/memory.py), side by side in one run.

Two runtimes on one blockd, one per kind of RAM file, restore the same snapshots in turn:

- restore to running, the snapshot's first user (the file kind exports the stack first, the
  device kind opens a device), and a second restore while the first VM runs (both reuse);
- the same after the host's page cache was dropped, and with the startup pack's prefetch;
- a second restore while the first VM runs, the page cache dropped before it (issue 25:
  no slower through memfs than from the raw file), through memfs with and without the
  warm-up of the startup pack's load ranges ("device_warm", "device"), alternating;
- page-in throughput from an empty page cache: sequential and random 4 KiB reads of the
  memfs file against the raw file (issue 25: >= 0.7);
- bytes on disk per snapshot beyond its layers (the raw file's allocated blocks vs none);
- Rss/Pss of the guest RAM mapping of two VMs restored from one snapshot.

Prints one JSON object per line. Needs root and QEMU.

    python bench/memdev_bench.py --quick [--focus]

`--focus`: only the cold second restore and the page-in figures (after one restore that
records the startup pack), with `--rounds` samples of each variant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.blockd.memfs import live_pid
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.memdev import PACK_NAME, SharedMemoryDevices
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import blockd_in, make_ext4_layer, mapping_kib, sh

PREFIXES = {"device": "amd", "file": "amf"}
SLOTS = {"device": 29501, "file": 29601}  # far from tests/runtime (1) and other benches
ROOTFS = 64 << 20
PAGE = 4096
MiB = 1 << 20


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, *, higher_is_better: bool = False,
         **extra: Any) -> None:
    """ratio > 1: better than the baseline (time: baseline / value; rate: value / baseline)."""
    ratio = None
    if baseline_value and value:
        ratio = round(value / baseline_value if higher_is_better else baseline_value / value, 2)
    print(json.dumps({"metric": metric, "value": round(value, 2), "unit": unit,
                      "baseline": baseline, "ratio": ratio,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 2),
                      **extra}), flush=True)


def to_running_ms(vm: VM) -> float:
    t = vm.timings
    return t["memory_file_ms"] + t["process_ms"] + t["load_ms"] + t["cont_ms"]


def major_faults(pid: int) -> int:
    """QEMU's major page faults so far (each waited for a read: of its binary, libraries, or
    guest RAM from the memory file)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


async def first_command_ms(vm: VM) -> float:
    t0 = time.perf_counter()
    await sh(vm, "ls -R /bin /etc > /dev/null 2>&1; cat /tmp/fill > /dev/null; echo ok", timeout=120)
    return (time.perf_counter() - t0) * 1e3


def page_in_mib_s(path: Path, offsets: list[int]) -> float:
    """MiB/s of 4 KiB preads at `offsets`, in that order, from an empty page cache."""
    drop_caches()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = bytearray(PAGE)
        t0 = time.perf_counter()
        for off in offsets:
            os.preadv(fd, [buf], off)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return len(offsets) * PAGE / MiB / seconds


def data_pages(path: Path) -> list[int]:
    """Offsets of the pages of a sparse file that hold data (SEEK_DATA / SEEK_HOLE)."""
    pages: list[int] = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            pages.extend(range(start - start % PAGE, pos, PAGE))
    finally:
        os.close(fd)
    return pages


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


async def page_in(rts: dict[str, Runtime], snap: Any, quick: bool, memfs_pid: int) -> None:
    """Cold page-in throughput of the memfs file against the raw file (issue 25). The random
    reads also with the reader and memfs on one CPU ("one_cpu"): the same reads without the
    wake-ups of an idle CPU per FUSE round trip (bench/RESULTS.md, 2026-12-06)."""
    layers = [Path(x.path) for x in snap.memory_layers]
    size = snap.machine.memory_bytes
    device = rts["device"].memory
    assert isinstance(device, SharedMemoryDevices)
    device.prefetch_enabled = False  # a fresh device would warm the page cache along its pack
    files = {kind: await asyncio.to_thread(rts[kind].memory.acquire, snap.id, layers, size)
             for kind in ("file", "device")}
    try:
        pages = data_pages(files["file"])
        random_pages = random.Random(1).sample(pages, min(len(pages), 2048 if quick else 8192))
        sequential = list(range(0, size, PAGE))
        rates: dict[str, dict[str, list[float]]] = {"sequential": {}, "random": {}}
        one_cpu: dict[str, list[float]] = {}
        every_cpu = os.sched_getaffinity(0)
        for _ in range(2 if quick else 5):
            for kind in ("file", "device"):
                rates["sequential"].setdefault(kind, []).append(page_in_mib_s(files[kind], sequential))
                rates["random"].setdefault(kind, []).append(page_in_mib_s(files[kind], random_pages))
            cpu = {min(every_cpu)}
            os.sched_setaffinity(0, cpu)
            pin_threads(memfs_pid, cpu)
            try:
                for kind in ("file", "device"):
                    one_cpu.setdefault(kind, []).append(page_in_mib_s(files[kind], random_pages))
            finally:
                os.sched_setaffinity(0, every_cpu)
                pin_threads(memfs_pid, every_cpu)
        emit("page_in_random_4k_cold_device_one_cpu", statistics.median(one_cpu["device"]), "MiB/s",
             "page_in_random_4k_cold_file_one_cpu", statistics.median(one_cpu["file"]),
             higher_is_better=True, samples=[round(x) for x in one_cpu["device"]],
             baseline_samples=[round(x) for x in one_cpu["file"]], pages=len(random_pages),
             note="diagnostic: reader and memfs pinned to one CPU")
        for pattern, by_kind in rates.items():
            emit(f"page_in_{pattern}_4k_cold_device", statistics.median(by_kind["device"]), "MiB/s",
                 f"page_in_{pattern}_4k_cold_file", statistics.median(by_kind["file"]),
                 higher_is_better=True, samples=[round(x) for x in by_kind["device"]],
                 baseline_samples=[round(x) for x in by_kind["file"]],
                 pages=len(sequential if pattern == "sequential" else random_pages), goal=">= 0.7")
    finally:
        device.prefetch_enabled = True
        for kind in ("file", "device"):
            rts[kind].memory.release(snap.id)


async def cold_second_restore(rts: dict[str, Runtime], snap: Any, rounds: int) -> None:
    """A second restore while a first VM of each kind runs, the page cache dropped before it:
    the pages the second VM's start and load touch that the first did not keep mapped come
    from disk, through memfs or from the raw file. The variants alternate (and rotate which
    goes first), so the host's load drifting during the run weighs on all alike. "device" is
    memfs without the warm-up of the pack's load ranges (the prefetch switch off), as before
    it; "device_warm" with it."""
    variants = ("file", "device", "device_warm")
    dev = rts["device"].memory
    assert isinstance(dev, SharedMemoryDevices)
    cold_second: dict[str, list[float]] = {v: [] for v in variants}
    cold_phases: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    warms: list[dict[str, float]] = []
    dev.last_prefetch = None
    first_vms = {kind: await rts[kind].restore(snap) for kind in ("file", "device")}
    # A fresh device with a pack prefetches its chunks in the background: not during samples.
    deadline = time.monotonic() + 60
    while dev.last_prefetch is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    try:
        for rep in range(rounds):
            for variant in variants[rep % 3:] + variants[:rep % 3]:
                kind = "file" if variant == "file" else "device"
                dev.prefetch_enabled = variant != "device"
                dev.last_warm = None
                drop_caches()
                b = await rts[kind].restore(snap)
                cold_second[variant].append(to_running_ms(b))
                cold_phases[variant].append({**b.timings, "majflt": major_faults(b.pid)})
                if variant == "device_warm" and dev.last_warm is not None:
                    warms.append(dev.last_warm)
                await rts[kind].kill(b)
    finally:
        dev.prefetch_enabled = True
        for kind, a in first_vms.items():
            await rts[kind].kill(a)
    for variant in ("device", "device_warm", "file"):
        emit(f"restore_second_cold_cache_to_running_p50_{variant}",
             statistics.median(cold_second[variant]), "ms",
             "restore_second_cold_cache_to_running_p50_file", statistics.median(cold_second["file"]),
             samples=[round(x) for x in cold_second[variant]], goal="device ratio >= 1.0",
             phases_p50={k: round(statistics.median(t[k] for t in cold_phases[variant]), 1)
                         for k in ("memory_file_ms", "process_ms", "load_ms", "cont_ms")},
             qemu_major_faults_p50=statistics.median(t["majflt"] for t in cold_phases[variant]))
    emit("restore_second_cold_cache_warm_vs_no_warm", statistics.median(cold_second["device_warm"]),
         "ms", "restore_second_cold_cache_to_running_p50_device",
         statistics.median(cold_second["device"]),
         warm_ranges=warms[-1]["ranges"] if warms else None,
         warm_bytes_p50=statistics.median(w["bytes"] for w in warms) if warms else None,
         warm_ms_p50=statistics.median(w["ms"] for w in warms) if warms else None)


async def main(quick: bool, focus: bool = False, rounds: int | None = None) -> None:
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="mdb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dirs
    blockd = blockd_in(root)  # with FUSE files: the memory devices
    blockd.start()
    client = AsyncBlockdClient(blockd.socket)
    rts: dict[str, Runtime] = {}
    try:
        for kind in ("device", "file"):
            rts[kind] = Runtime(RuntimeConfig(
                state_dir=root / f"state-{kind}", network_prefix=PREFIXES[kind],
                envd_init_path="/cgi-bin/init", slot_pool_low=2, slot_pool_high=4,
                slot_first_index=SLOTS[kind], memory_device="blockd" if kind == "device" else "file"),
                blockd=client)
            await rts[kind].start(kernel_for_probe=guest.kernel)
        assert isinstance(rts["device"].memory, SharedMemoryDevices)
        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS)
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                        memory_mib=512, disks=[DiskSource("rootfs", ROOTFS, layers=[layer])])
        vm = await rts["device"].boot(spec)
        # Guest memory worth sharing: 96 MiB of data in tmpfs.
        await sh(vm, "yes 0123456789abcdef | head -c 1048576 > /tmp/p1m;"
                     " cat $(yes /tmp/p1m | head -n 96) > /tmp/fill; rm /tmp/p1m; echo ok", timeout=300)
        snap = await rts["device"].pause(vm, wait_teardown=True)
        layers_bytes = sum(x.size for x in snap.memory_layers)
        reps = 3 if quick else 10
        rounds = rounds or max(reps, 6)
        if focus:
            # One restore of a fresh device records the startup pack (PACK_WINDOW later).
            pack = Path(snap.device_state).parent / PACK_NAME
            a = await rts["device"].restore(snap)
            deadline = time.monotonic() + 30
            while not pack.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await rts["device"].kill(a)
            await asyncio.sleep(3)  # memfs closes the released device (its sweep)
            await cold_second_restore(rts, snap, rounds)
            memfs_pid = live_pid(root / "state")
            assert memfs_pid is not None
            await page_in(rts, snap, quick, memfs_pid)
            return

        # 1. Restore to running, first user of the snapshot (then killed: the file is removed /
        #    the device released), alternating kinds.
        first: dict[str, list[float]] = {"device": [], "file": []}
        memfile: dict[str, list[float]] = {"device": [], "file": []}
        disk_bytes: dict[str, int] = {}
        for _ in range(reps):
            for kind in ("file", "device"):
                rt = rts[kind]
                child = await rt.restore(snap)
                first[kind].append(to_running_ms(child))
                memfile[kind].append(child.timings["memory_file_ms"])
                st = os.stat(child.mem_path)
                # The device's file lives in blockd's FUSE mount: no blocks on any disk.
                disk_bytes[kind] = 0 if kind == "device" else st.st_blocks * 512
                await rt.kill(child)
        for kind in ("device", "file"):
            emit(f"restore_first_to_running_p50_{kind}", statistics.median(first[kind]), "ms",
                 "restore_first_to_running_p50_file", statistics.median(first["file"]),
                 samples=[round(x) for x in first[kind]])
            emit(f"memory_file_ms_p50_{kind}", statistics.median(memfile[kind]), "ms",
                 "memory_file_ms_p50_file", statistics.median(memfile["file"]))
            emit(f"disk_bytes_per_snapshot_{kind}", disk_bytes[kind], "bytes",
                 "disk_bytes_per_snapshot_file", disk_bytes["file"], memory_layers_bytes=layers_bytes,
                 note="on disk beyond the snapshot's own layers while a VM of it runs")

        # 2. A second restore while the first runs (both kinds reuse their file/device), and the
        #    guest RAM mapping of the two VMs.
        for kind in ("file", "device"):
            rt = rts[kind]
            a = await rt.restore(snap)
            again = []
            phases: dict[str, list[float]] = {"memory_file_ms": [], "process_ms": [],
                                              "load_ms": [], "cont_ms": []}
            for _ in range(max(reps, 10)):
                b = await rt.restore(snap)
                again.append(to_running_ms(b))
                for name, values in phases.items():
                    values.append(b.timings[name])
                await rt.kill(b)
            b = await rt.restore(snap)
            for v in (a, b):
                await sh(v, "cat /tmp/fill > /dev/null; echo ok", timeout=120)
            ram = [mapping_kib(v.pid, v.mem_path) for v in (a, b)]
            emit(f"restore_second_to_running_p50_{kind}", statistics.median(again), "ms",
                 "restore_second_to_running_p50_file", None, samples=[round(x) for x in again],
                 phases_p50={k: round(statistics.median(v), 1) for k, v in phases.items()})
            emit(f"guest_ram_pss_per_vm_of_two_{kind}", sum(m["Pss"] for m in ram) / 2 / 1024, "MiB",
                 None, None, rss_mib=round(sum(m["Rss"] for m in ram) / 2 / 1024, 1),
                 shared_clean_mib=round(sum(m["Shared_Clean"] for m in ram) / 2 / 1024, 1))
            await rt.kill(a)
            await rt.kill(b)

        # 2b. The same second restore with the page cache dropped after the first VM started
        #     (its own mapped pages stay), memfs with and without the load's warm-up.
        await cold_second_restore(rts, snap, rounds)

        # 2c. Page-in throughput, cold (no VM maps the file meanwhile).
        memfs_pid = live_pid(root / "state")
        assert memfs_pid is not None
        await page_in(rts, snap, quick, memfs_pid)

        # 3. From an empty page cache: restore + a first command that reads the guest's files
        #    and its 96 MiB tmpfs file; the device with and without the startup pack.
        dev = rts["device"].memory
        assert isinstance(dev, SharedMemoryDevices)
        pack = Path(snap.device_state).parent / PACK_NAME
        deadline = time.monotonic() + 30
        while not (pack.exists() and "memory" in pack.read_text()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        cold: dict[str, list[float]] = {"file": [], "device": [], "device_prefetch": []}
        for _ in range(reps):
            for variant in ("file", "device", "device_prefetch"):
                rt = rts["file" if variant == "file" else "device"]
                dev.prefetch_enabled = variant == "device_prefetch"
                drop_caches()
                t0 = time.perf_counter()
                child = await rt.restore(snap)
                await first_command_ms(child)
                cold[variant].append((time.perf_counter() - t0) * 1e3)
                await rt.kill(child)
        for variant, values in cold.items():
            emit(f"cold_cache_restore_plus_first_command_p50_{variant}", statistics.median(values),
                 "ms", "cold_cache_restore_plus_first_command_p50_file", statistics.median(cold["file"]),
                 samples=[round(x) for x in values],
                 pack_chunks=len(json.loads(pack.read_text()).get("memory", [])) if pack.exists() else None)
    finally:
        for rt in rts.values():
            await rt.close()
        await client.close()
        for prefix in PREFIXES.values():
            await teardown_host(prefix)
        blockd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--focus", action="store_true",
                        help="only the cold second restore and the page-in figures")
    parser.add_argument("--rounds", type=int, default=None,
                        help="samples of each cold second restore variant (default 6, or 10)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("memdev_bench needs root (network namespaces, FUSE, drop_caches)")
    asyncio.run(main(args.quick, args.focus, args.rounds))

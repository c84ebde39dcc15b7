"""VM lifecycle benchmark: restore, pause, fork, memory per forked child.

Baselines measured in the same run: a cold boot of the same image (restore must beat it by
20x or more) and a full `migrate` of guest RAM to a file (what pausing costs without memory
layers). Prints one JSON object per line. Needs root and QEMU; runs under the accelerator
the runtime detects (TCG on this machine kind).

    python bench/lifecycle_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pwd
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import blockd_in, make_ext4_layer, pss_kib, sh

PREFIX = "aeb"
# Slot addresses far from the ones tests/runtime and a node use (from slot 1). The runtime skips
# addresses another runtime holds anyway; this only keeps the two ranges apart.
SLOT_FIRST_INDEX = 29001
ROOTFS = 64 << 20


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: Any) -> None:
    ratio = None
    if baseline_value and value:
        ratio = round(baseline_value / value, 2)
    line = {"metric": metric, "value": round(value, 2), "unit": unit, "baseline": baseline,
            "baseline_value": None if baseline_value is None else round(baseline_value, 2),
            "ratio": ratio, **extra}
    print(json.dumps(line), flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def dirty(vm: VM, mib: int) -> None:
    """Write `mib` MiB of non-zero data into guest memory (tmpfs page cache): 1 MiB made by
    `yes`, then copied `mib` times by one `cat` (kernel copies, fast even under TCG)."""
    await sh(vm, "rm -f /tmp/fill; yes 0123456789abcdef | head -c 1048576 > /tmp/p1m;"
                 f" cat $(yes /tmp/p1m | head -n {mib}) > /tmp/fill; rm /tmp/p1m; echo ok",
             timeout=300)


async def full_migrate_ms(vm: VM, out: Path, qemu_user: str | None) -> tuple[float, float]:
    """Baseline: stop and migrate all of guest RAM plus devices to a file (QEMU's own way).
    Returns (ms until QEMU reports completion, ms until the file is also fsynced)."""
    proc = vm.process
    # QEMU runs as an unprivileged user (runtime/privilege.py) and cannot create files in the
    # bench's directory: the file is made here and given to that user.
    out.touch(mode=0o600)
    if qemu_user:
        owner = pwd.getpwnam(qemu_user)
        os.chown(out, owner.pw_uid, owner.pw_gid)
    await proc.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
    t0 = time.perf_counter()
    await proc.execute("stop")
    await proc.execute("migrate", {"uri": f"file:{out}"})
    while True:
        state = (await proc.execute("query-migrate"))["status"]
        if state in ("completed", "failed"):
            break
        await asyncio.sleep(0.001)
    done = (time.perf_counter() - t0) * 1e3
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    synced = (time.perf_counter() - t0) * 1e3
    await proc.execute("cont")
    out.unlink(missing_ok=True)
    if state != "completed":
        raise RuntimeError("baseline migrate failed")
    return done, synced


def to_running_ms(vm: VM) -> float:
    """Restore until `cont` returned (memory file, QEMU, device state, cont): the VM runs."""
    t = vm.timings
    return t["memory_file_ms"] + t["process_ms"] + t["load_ms"] + t["cont_ms"]


async def main(quick: bool) -> None:
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    blockd = blockd_in(root)
    blockd.start()
    client = AsyncBlockdClient(blockd.socket)
    rt = Runtime(RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=4,
                               slot_pool_high=20, slot_first_index=SLOT_FIRST_INDEX),
                 blockd=client)
    try:
        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS)
        await rt.start(kernel_for_probe=guest.kernel)
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                        memory_mib=512, disks=[DiskSource("rootfs", ROOTFS, layers=[layer])])
        await rt.slots.fill(20)

        t0 = time.perf_counter()
        vm = await rt.boot(spec)
        boot_ms = (time.perf_counter() - t0) * 1e3
        emit("cold_boot_to_envd", boot_ms, "ms", mode=rt.accel)
        base = await rt.pause(vm)

        # Restore: the memory file is materialised once (held by the reference taken here),
        # then every restore maps it. Cold = QEMU spawned on demand; warm = from `prime()`.
        t0 = time.perf_counter()
        await asyncio.to_thread(rt.memory.acquire, base.id, [Path(x.path) for x in base.memory_layers],
                                base.machine.memory_bytes)
        emit("materialise_memory_file", (time.perf_counter() - t0) * 1e3, "ms",
             layer_mib=round(base.memory_layers[-1].size / 2**20, 1))
        reps = 3 if quick else 20
        for warm in (False, True):
            times: list[float] = []
            running: list[float] = []
            inits: list[float] = []
            for _ in range(reps):
                if warm:
                    await rt.prime(base, 1)
                t0 = time.perf_counter()
                child = await rt.restore(base)
                times.append((time.perf_counter() - t0) * 1e3)
                running.append(to_running_ms(child))
                inits.append(child.timings["envd_init_ms"])
                await rt.kill(child)
            await rt.unprime(base.id)
            kind = "warm" if warm else "cold"
            if warm:
                warm_running = running
            emit(f"restore_{kind}_to_running_p50", statistics.median(running), "ms",
                 "cold_boot_to_envd", boot_ms)
            emit(f"restore_{kind}_to_running_p99", pct(running, 0.99), "ms",
                 "cold_boot_to_envd", boot_ms)
            emit(f"restore_{kind}_incl_envd_init_p50", statistics.median(times), "ms",
                 "cold_boot_to_envd", boot_ms)
            emit(f"restore_{kind}_incl_envd_init_p99", pct(times, 0.99), "ms",
                 "cold_boot_to_envd", boot_ms)
            emit(f"restore_{kind}_envd_init_alone_p50", statistics.median(inits), "ms")

        # Restore cost must not grow with guest memory: the same image booted as a 2 GiB guest,
        # warm restores to running, against the 512 MiB guest's above.
        big = await rt.pause(await rt.boot(dataclasses.replace(spec, memory_mib=2048)))
        big_running: list[float] = []
        for _ in range(reps):
            await rt.prime(big, 1)
            child = await rt.restore(big)
            big_running.append(to_running_ms(child))
            await rt.kill(child)
        await rt.unprime(big.id)
        emit("restore_warm_to_running_p50_2048MiB_guest", statistics.median(big_running), "ms",
             "restore_warm_to_running_p50_512MiB_guest", statistics.median(warm_running))

        # Pause with 16 / 128 MiB dirtied since the restore, against a full migrate. Our pause
        # fsyncs its files, so the fair baseline is the migrate plus an fsync of its file; the
        # migrate without fsync is reported too.
        for mib in (16, 128):
            times = []
            pages: list[float] = []
            phases: dict[str, float] = {}
            for _ in range((3 if mib == 16 else 1) if quick else 10):
                vm = await rt.restore(base)
                await dirty(vm, mib)
                t0 = time.perf_counter()
                snap = await rt.pause(vm)
                times.append((time.perf_counter() - t0) * 1e3)
                pages.append(vm.timings["snapshot_written_pages"])
                phases = {k.removeprefix("snapshot_"): round(v, 1) for k, v in vm.timings.items()
                          if k.startswith("snapshot_") and k.endswith("_ms")}
                shutil.rmtree(Path(snap.device_state).parent, ignore_errors=True)
            vm = await rt.restore(base)
            await dirty(vm, mib)
            migrate_ms: float | None = None
            migrate_fsync_ms: float | None = None
            if not rt.config.qemu_jail:  # a jailed QEMU writes no file but its own, within
                # RLIMIT_FSIZE: QEMU's own full migrate to a file is a baseline of the unjailed
                migrate_ms, migrate_fsync_ms = await full_migrate_ms(
                    vm, root / "full-migrate.bin", rt.config.qemu_user)
            await rt.kill(vm)
            written = round(statistics.mean(pages) * 4096 / 2**20, 1)
            emit(f"pause_p50_{mib}MiB_dirty", statistics.median(times), "ms",
                 "full_migrate_to_file_plus_fsync", migrate_fsync_ms, written_mib=written,
                 samples=[round(t, 1) for t in times], last=phases)
            emit(f"pause_p99_{mib}MiB_dirty", pct(times, 0.99), "ms",
                 "full_migrate_to_file_plus_fsync", migrate_fsync_ms)
            if migrate_ms is not None:
                emit(f"pause_p50_{mib}MiB_dirty_vs_unsynced_migrate", statistics.median(times),
                     "ms", "full_migrate_to_file_no_fsync", migrate_ms)

        # Fork: per child at 1, 4, 16 children; to running (every child's `cont` returned) and
        # including every child's envd /init.
        fork_16_ms: list[float] = []
        for count in (1, 4, 16):
            source = await rt.restore(base)
            t0 = time.perf_counter()
            _, children = await rt.fork(source, count)
            total = (time.perf_counter() - t0) * 1e3
            if count == 16:
                fork_16_ms.append(total / count)
            snap_ms = source.timings["snapshot_total_ms"]
            running = snap_ms + max(to_running_ms(c) for c in children)
            emit(f"fork_to_running_per_child_at_{count}", running / count, "ms",
                 "cold_boot_to_envd", boot_ms)
            emit(f"fork_per_child_at_{count}", total / count, "ms", "cold_boot_to_envd", boot_ms,
                 snapshot_ms=round(snap_ms, 1))
            if count == 16:
                await asyncio.sleep(3)  # let the children settle idle
                mem = [pss_kib(c.pid) for c in children]
                emit("pss_per_idle_forked_child", statistics.mean(m["Pss"] for m in mem) / 1024,
                     "MiB", "rss_per_idle_forked_child",
                     statistics.mean(m["Rss"] for m in mem) / 1024)
            for c in (*children, source):
                await rt.kill(c)

        # The fork of 16 again with each child's vCPUs on threads of their own (tcg_threads
        # "multi", what "auto" replaced when the host is oversubscribed), then "auto" again,
        # so the two alternate in the same run.
        if rt.accel == "tcg":
            multi_ms: list[float] = []
            for mode in ("multi", "auto") * (1 if quick else 2):
                rt.config.tcg_threads = mode
                source = await rt.restore(base)
                t0 = time.perf_counter()
                _, children = await rt.fork(source, 16)
                (multi_ms if mode == "multi" else fork_16_ms).append(
                    (time.perf_counter() - t0) * 1e3 / 16)
                for c in (*children, source):
                    await rt.kill(c)
            emit("fork_per_child_at_16_auto_threads", statistics.median(fork_16_ms), "ms",
                 "fork_per_child_at_16_multithreaded_tcg", statistics.median(multi_ms),
                 auto=[round(x) for x in fork_16_ms], multi=[round(x) for x in multi_ms])
    finally:
        await rt.close()
        await client.close()
        await teardown_host(PREFIX)
        blockd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("lifecycle_bench needs root (network namespaces)")
    asyncio.run(main(args.quick))

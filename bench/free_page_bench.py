"""Free-page reporting and per-VM host memory.

1. Two VMs restored from one snapshot, side by side: one as the runtime starts QEMU now (RAM
   file opened writable under the punch-hole filter, so free-page reporting returns memory),
   the baseline as before (`return_free_memory=False`: RAM file `readonly=on`, QEMU refuses
   every discard). Each guest writes 256 MiB into tmpfs and deletes it; their QEMU's RSS and
   PSS are read after it sat idle for a few seconds.
2. Idle forked children per TCG translation-buffer size (`tcg_tb_size_mib`): PSS per child
   and envd /init latency of the children (translation work dominates it under TCG), each
   size forked from the same running source in the same run, rounds interleaved.

Prints one JSON object per line. Needs root and QEMU.

    python bench/free_page_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import VM, BootSpec, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import pss_kib, sh

PREFIX = "afb"
# Slot addresses apart from the other tests' and benches' (1, 24001, 26001, 27001, 28001, 29001, ...).
SLOT_FIRST_INDEX = 25001
FREE_MIB = 256
MiB = 1 << 20


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: Any) -> None:
    ratio = None
    if baseline_value and value and baseline_value > 0 and value > 0:
        ratio = round(baseline_value / value, 2)
    line = {"metric": metric, "value": round(value, 2), "unit": unit, "baseline": baseline,
            "baseline_value": None if baseline_value is None else round(baseline_value, 2),
            "ratio": ratio, **extra}
    print(json.dumps(line), flush=True)


def mib(pid: int) -> dict[str, float]:
    return {k: v / 1024 for k, v in pss_kib(pid).items()}


async def touch_and_free(vm: VM) -> None:
    """The guest writes FREE_MIB MiB into tmpfs, then deletes it."""
    out = await sh(vm, "mount -o remount,size=400M /tmp;"
                       f" dd if=/dev/zero of=/tmp/fill bs=1M count={FREE_MIB} 2>/dev/null;"
                       " echo filled", timeout=300)
    assert "filled" in out, out


async def reporting(rt: Runtime, base: Any, idle_s: float) -> VM:
    """Section 1; returns the reporting VM (still running) for the fork section."""
    vms: dict[str, VM] = {}
    for name, enabled in (("reporting", True), ("baseline", False)):
        rt.config.return_free_memory = enabled
        vms[name] = await rt.restore(base)
    rt.config.return_free_memory = True
    await asyncio.gather(*(touch_and_free(vm) for vm in vms.values()))
    full = {name: mib(vm.pid) for name, vm in vms.items()}
    await asyncio.gather(*(sh(vm, "rm /tmp/fill; echo ok") for vm in vms.values()))
    t0 = time.monotonic()
    returned_s = None
    while time.monotonic() - t0 < idle_s:
        if returned_s is None and mib(vms["reporting"].pid)["Rss"] < (
                full["reporting"]["Rss"] - 0.75 * FREE_MIB):
            returned_s = time.monotonic() - t0
        await asyncio.sleep(0.1)
    idle = {name: mib(vm.pid) for name, vm in vms.items()}
    refused = "not supported" in vms["baseline"].process.stderr_log.read_text(errors="replace")
    for key in ("Rss", "Pss", "Private_Dirty"):
        emit(f"idle_{key.lower()}_after_{FREE_MIB}MiB_freed", idle["reporting"][key], "MiB",
             "free_page_reporting_refused", idle["baseline"][key], idle_s=idle_s,
             while_filled=round(full["reporting"][key], 1),
             baseline_while_filled=round(full["baseline"][key], 1))
    # Bigger is better here: no ratio (baseline/value would read the wrong way round).
    emit("memory_returned_to_host", full["reporting"]["Rss"] - idle["reporting"]["Rss"], "MiB",
         freed=FREE_MIB, baseline_returned=round(
             full["baseline"]["Rss"] - idle["baseline"]["Rss"], 1),
         baseline_refused_in_stderr=refused)
    if returned_s is not None:
        emit("time_to_return_75pct_of_freed", returned_s * 1e3, "ms")
    await rt.kill(vms["baseline"])
    return vms["reporting"]


async def forks(rt: Runtime, source: VM, sizes: list[int], count: int, rounds: int,
                settle_s: float) -> None:
    """Section 2: per tb-size, PSS per idle child and the children's /init latency."""
    pss: dict[int, list[float]] = {s: [] for s in sizes}
    rss: dict[int, list[float]] = {s: [] for s in sizes}
    init: dict[int, list[float]] = {s: [] for s in sizes}
    first_cmd: dict[int, list[float]] = {s: [] for s in sizes}
    default = rt.config.tcg_tb_size_mib
    for r in range(rounds):
        order = sizes if r % 2 == 0 else list(reversed(sizes))
        for size in order:
            rt.config.tcg_tb_size_mib = size
            _, children = await rt.fork(source, count)
            rt.config.tcg_tb_size_mib = default
            init[size] += [c.timings["envd_init_ms"] for c in children]

            async def timed(vm: VM) -> float:
                t0 = time.perf_counter()
                await sh(vm, "ls / >/dev/null; echo ok")
                return (time.perf_counter() - t0) * 1e3

            first_cmd[size] += await asyncio.gather(*(timed(c) for c in children))
            await asyncio.sleep(settle_s)
            for c in children:
                m = mib(c.pid)
                pss[size].append(m["Pss"])
                rss[size].append(m["Rss"])
            for c in children:
                await rt.kill(c)
    ref = sizes[0]
    for size in sizes:
        emit(f"pss_per_idle_forked_child_tb{size}", statistics.mean(pss[size]), "MiB",
             f"pss_per_idle_forked_child_tb{ref}", statistics.mean(pss[ref]), children=count,
             rounds=rounds, rss=round(statistics.mean(rss[size]), 1))
        emit(f"fork_child_envd_init_p50_tb{size}", statistics.median(init[size]), "ms",
             f"fork_child_envd_init_p50_tb{ref}", statistics.median(init[ref]))
        emit(f"fork_child_first_command_p50_tb{size}", statistics.median(first_cmd[size]), "ms",
             f"fork_child_first_command_p50_tb{ref}", statistics.median(first_cmd[ref]))


async def main(quick: bool, sizes: list[int], count: int | None, rounds: int | None) -> None:
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="afb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    count = count or (4 if quick else 16)
    rt = Runtime(RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               slot_first_index=SLOT_FIRST_INDEX, envd_init_path="/cgi-bin/init",
                               slot_pool_low=2, slot_pool_high=count + 4))
    try:
        await rt.start(kernel_for_probe=guest.kernel)
        await rt.slots.fill(count + 3)
        vm = await rt.boot(BootSpec(kernel=guest.kernel, initramfs=guest.initramfs,
                                    cmdline=guest.cmdline_base, memory_mib=512))
        base = await rt.pause(vm, wait_teardown=True)
        source = await reporting(rt, base, idle_s=4.0 if quick else 10.0)
        await forks(rt, source, sizes, count, rounds or (1 if quick else 3),
                    settle_s=2.0 if quick else 3.0)
        await rt.kill(source)
    finally:
        await rt.close()
        await teardown_host(PREFIX)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 children, one round (< 60 s)")
    parser.add_argument("--tb-sizes", default=None,
                        help="comma-separated tcg_tb_size_mib values, the first is the reference "
                             "(default: the runtime's default, then 16 and 8)")
    parser.add_argument("--children", type=int, default=None, help="children per fork")
    parser.add_argument("--rounds", type=int, default=None, help="forks per tb size")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("free_page_bench needs root (network namespaces)")
    default_tb = RuntimeConfig().tcg_tb_size_mib
    tb_sizes = ([int(x) for x in args.tb_sizes.split(",")] if args.tb_sizes
                else list(dict.fromkeys([default_tb, 16, 8])))
    asyncio.run(main(args.quick, tb_sizes, args.children, args.rounds))

"""Cold memory back to the host: what a sandbox's QEMU gives back once its guest has read files
and gone idle, with the template's cold-memory reclaim off and on, side by side in one run.

The project's real guest (kernel, initramfs, tools disk, envd) boots, writes a file of
--file-mib MiB of random bytes to its root disk, drops its caches and is paused: the template.
Three sandboxes are restored from it at once and each gets a setting through envd:

- off:        ColdMemory.off(), the baseline: the guest keeps its page cache;
- on:         ColdMemory(minAgeSeconds=--min-age), the defaults otherwise (a DAMON pageout
              scheme, sampled every 100 ms, aggregated every 2 s; guest/envd/reclaim.py);
- on-2mib:    as on, restored from a second template booted with the kernel's default order
              of free-page reporting (9: whole 2 MiB blocks only), which shows what the guest
              command line's page_reporting_order=0 adds.

All three read the file at once (`cat`), then idle for --idle seconds. The host memory of each
VM is its QEMU's PSS (smaps_rollup; guest RAM is a private mapping of the snapshot's memory
device, whose shared pages count in part), sampled every second.

Figures (one JSON object per line; baseline = off unless named):
- reclaim_given_back_mib: the PSS after the read minus the PSS at the end;
- reclaim_given_back_fraction: that over the file's size;
- reclaim_time_to_80pct_s: from the end of the read until 80% of the file's size is given back
  (null: never);
- reclaim_idle_cpu_pct: QEMU's CPU over the last 30 s of the idle time (a core = 100);
- reclaim_reporting_order0_given_back_mib: `on` against `on-2mib`.

Needs root (network namespaces) and qemu-system-x86_64.

    python bench/reclaim_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.envd_client import ColdMemory, EnvdClient
from agentenv.guest.build.assets import build_assets
from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
from agentenv.runtime.vm import VM, BootSpec, Runtime
from agentenv.testing.harness import (
    LoopThread,
    blockd_in,
    close_runtime,
    guest_sh,
    pss_kib,
    real_guest_disks,
)

GUEST_STATE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))
PREFIX, FIRST_SLOT = "acm", 31401  # 31401-31600: disjoint from the other VM tests and benches
DISK_BYTES = 1 << 30
GOAL = 0.8  # of the file, given back


@dataclass
class Sandbox:
    name: str
    setting: ColdMemory
    template: Any  # the SnapshotRecord it is restored from
    vm: VM | None = None
    peak: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (s after read, MiB)
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, CPU s)
    guest: dict[str, Any] = field(default_factory=dict)  # the guest's view at the end


def emit(metric: str, value: float | None, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: Any) -> None:
    ratio = None
    if value and baseline_value:
        ratio = round(value / baseline_value, 2)
    print(json.dumps({"metric": metric, "value": None if value is None else round(value, 2),
                      "unit": unit, "baseline": baseline,
                      "baseline_value": None if baseline_value is None
                      else round(baseline_value, 2), "ratio": ratio, **extra}), flush=True)


def held_mib(vm: VM) -> float:
    return pss_kib(vm.pid)["Pss"] / 1024


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def set_cold_memory(vm: VM, setting: ColdMemory) -> dict[str, Any]:
    envd = EnvdClient(vm.envd_url)
    try:
        return await envd.set_cold_memory(setting)
    finally:
        await envd.close()


async def make_template(args: argparse.Namespace, rt: Runtime, work: Path,
                        cmdline_extra: str = "") -> Any:
    """A booted guest that wrote the file and dropped its caches, paused."""
    assets = build_assets(GUEST_STATE)
    work.mkdir()
    boot = BootSpec(kernel=assets.kernel, initramfs=assets.initramfs,
                    cmdline=f"{assets.cmdline_base} {cmdline_extra}".strip(),
                    memory_mib=args.memory_mib, disks=real_guest_disks(assets, work, DISK_BYTES))
    vm = await rt.boot(boot)
    await guest_sh(vm, f"dd if=/dev/urandom of=/data.bin bs=1M count={args.file_mib}"
                       " 2>/dev/null && sync && echo 1 > /proc/sys/vm/drop_caches", timeout=600)
    return await rt.pause(vm, wait_teardown=True)


async def run(args: argparse.Namespace, rt: Runtime, root: Path) -> list[Sandbox]:
    template = await make_template(args, rt, root / "template")
    # the last of a parameter's words on the kernel command line wins
    order9 = await make_template(args, rt, root / "template-order9",
                                 "page_reporting.page_reporting_order=9")
    on = ColdMemory(minAgeSeconds=args.min_age)
    sandboxes = [Sandbox("off", ColdMemory.off(), template), Sandbox("on", on, template),
                 Sandbox("on-2mib", on, order9)]
    for sbx in sandboxes:
        sbx.vm = await rt.restore(sbx.template)
        await set_cold_memory(sbx.vm, sbx.setting)
    order = await guest_sh(sandboxes[2].vm,  # type: ignore[arg-type]
                           "cat /sys/module/page_reporting/parameters/page_reporting_order")
    assert order.strip() == "9", order
    await asyncio.sleep(5)  # what the restores themselves touched settles
    vms = [sbx.vm for sbx in sandboxes if sbx.vm is not None]
    before = {sbx.name: held_mib(sbx.vm) for sbx in sandboxes if sbx.vm}
    t_read = time.monotonic()
    await asyncio.gather(*(guest_sh(vm, "cat /data.bin > /dev/null", timeout=600) for vm in vms))
    read_s = time.monotonic() - t_read
    t0 = time.monotonic()
    for sbx in sandboxes:
        assert sbx.vm is not None
        sbx.peak = held_mib(sbx.vm)
        print(json.dumps({"sandbox": sbx.name, "before_mib": round(before[sbx.name], 1),
                          "after_read_mib": round(sbx.peak, 1), "read_s": round(read_s, 1)}),
              flush=True)
    while (now := time.monotonic()) - t0 < args.idle:
        for sbx in sandboxes:
            assert sbx.vm is not None
            sbx.samples.append((now - t0, held_mib(sbx.vm)))
            sbx.cpu.append((now, cpu_seconds(sbx.vm.pid)))
        await asyncio.sleep(1)
    for sbx in sandboxes:
        assert sbx.vm is not None
        envd = EnvdClient(sbx.vm.envd_url)
        try:
            sbx.guest = {"reclaim": (await envd.cold_memory()).get("stats"),
                         "meminfo": (await guest_sh(sbx.vm, "grep -E '^(MemFree|Cached):'"
                                                    " /proc/meminfo")).split(),
                         # free blocks per order (4 KiB .. 4 MiB) of the largest zone
                         "buddyinfo": (await guest_sh(sbx.vm, "tail -1 /proc/buddyinfo"))
                         .split()[4:]}
        finally:
            await envd.close()
        await rt.kill(sbx.vm)
    return sandboxes


def report(args: argparse.Namespace, sandboxes: list[Sandbox]) -> None:
    by_name = {sbx.name: sbx for sbx in sandboxes}
    figures: dict[str, dict[str, float | None]] = {}
    for sbx in sandboxes:
        end = sbx.samples[-1][1]
        given = sbx.peak - end
        reached = next((t for t, mib in sbx.samples if sbx.peak - mib >= GOAL * args.file_mib),
                       None)
        window = [(t, c) for t, c in sbx.cpu if t >= sbx.cpu[-1][0] - 30]
        idle_cpu = (window[-1][1] - window[0][1]) / max(1e-9, window[-1][0] - window[0][0]) * 100
        figures[sbx.name] = {"given": given, "fraction": given / args.file_mib, "time": reached,
                             "cpu": idle_cpu, "end": end}
        print(json.dumps({"sandbox": sbx.name, "end_mib": round(end, 1),
                          "given_back_mib": round(given, 1), "time_to_80pct_s": reached,
                          "idle_cpu_pct": round(idle_cpu, 2), "guest": sbx.guest}), flush=True)
    off, on, on9 = figures["off"], figures["on"], figures["on-2mib"]
    context = {"file_mib": args.file_mib, "min_age_s": args.min_age, "idle_s": args.idle,
               "memory_mib": args.memory_mib}
    emit("reclaim_given_back_mib", on["given"], "MiB", "off", off["given"], **context)
    emit("reclaim_given_back_fraction", on["fraction"], "ratio", "off", off["fraction"],
         goal=GOAL)
    emit("reclaim_time_to_80pct_s", on["time"], "s", "off", off["time"],
         goal_s=120, schedule=by_name["on"].setting.model_dump())
    emit("reclaim_idle_cpu_pct", on["cpu"], "% of a core", "off", off["cpu"])
    emit("reclaim_reporting_order0_given_back_mib", on["given"], "MiB", "on-2mib (order 9)",
         on9["given"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file-mib", type=int, default=300)
    parser.add_argument("--min-age", type=float, default=30.0,
                        help="seconds a page sits untouched before it goes (the default's)")
    parser.add_argument("--idle", type=float, default=150.0, help="seconds of idle after the read")
    parser.add_argument("--memory-mib", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="--min-age 10 --idle 60")
    args = parser.parse_args()
    if args.quick:
        args.min_age, args.idle = 10.0, 60.0
    root = Path(tempfile.mkdtemp(prefix="acm", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as its own user: it must reach the state dir
    blockd = blockd_in(root)
    blockd.start()
    loop = LoopThread()
    rt: Runtime | None = None
    try:
        rt = Runtime(RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                                   slot_first_index=FIRST_SLOT, envd_init_path="/init",
                                   slot_pool_low=1, boot_timeout=300,
                                   **privilege_settings_from_env(os.environ)),
                     blockd=AsyncBlockdClient(blockd.socket))
        loop.run(rt.start(kernel_for_probe=build_assets(GUEST_STATE).kernel))
        sandboxes = loop.run(run(args, rt, root), timeout=args.idle + 1800)
        report(args, sandboxes)
    finally:
        close_runtime(loop, rt, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Cost of least privilege and cgroups: the same runtime, the same snapshot, rounds alternating
between "hardened" (QEMU as aenv-vm, -sandbox, one cgroup per VM) and "plain" (QEMU as root,
no -sandbox, no cgroup), so both see the same host load.

Per mode: restore of a snapshot to a running VM (cold: QEMU spawned on demand; warm: from a
primed process) and to envd answering /init, and the host memory of idle restored VMs (PSS and
RSS per VM, and the cgroup's charge when there is one). Prints one JSON object per line.

`--cgroups-only`: both modes run QEMU as aenv-vm under -sandbox, only the per-VM cgroup differs
("cgroups-off" vs "cgroups-on"), the cost of the cgroups alone. `--fork N` adds a fork of N
children from a running restored VM per mode and round (time until every child's envd answered
/init; the fork of 16 is the case that once missed its deadline with cgroups on).

    python bench/privilege_bench.py --quick [--cgroups-only] [--fork 16]
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

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.runtime.cgroup import CgroupManager
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import blockd_in, make_ext4_layer, pss_kib, sh

PREFIX = "aep"
SLOT_FIRST_INDEX = 27001  # away from tests/runtime (1..) and lifecycle_bench (29001..)
ROOTFS = 64 << 20


def emit(metric: str, **fields: Any) -> None:
    print(json.dumps({"metric": metric, **fields}), flush=True)


def to_running_ms(vm: VM) -> float:
    t = vm.timings
    return t["memory_file_ms"] + t["process_ms"] + t["load_ms"] + t["cont_ms"]


def set_mode(rt: Runtime, mode: str, user: Any, cgroups: CgroupManager) -> None:
    """Switch what the next spawn uses (the runtime reads these per QEMU it starts)."""
    privileged = mode in ("plain",)
    rt.vm_user = None if privileged else user
    rt.config.qemu_sandbox = not privileged
    rt.cgroups = cgroups if mode in ("hardened", "cgroups-on") else CgroupManager(None, {})


async def main(quick: bool, cgroups_only: bool = False, fork: int = 0) -> None:
    modes = ("cgroups-off", "cgroups-on") if cgroups_only else ("plain", "hardened")
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="pb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    blockd = blockd_in(root)
    blockd.start()
    client = AsyncBlockdClient(blockd.socket)
    rt = Runtime(RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=4,
                               slot_pool_high=12, slot_first_index=SLOT_FIRST_INDEX,
                               cgroups=os.environ.get("AENV_CGROUPS") or "auto"),
                 blockd=client)
    try:
        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS)
        await rt.start(kernel_for_probe=guest.kernel)
        user, cgroups = rt.vm_user, rt.cgroups
        emit("setup", accel=rt.accel, user=user.name if user else None,
             cgroups=cgroups.version, parents={k: str(v) for k, v in cgroups.parents.items()})
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                        memory_mib=512, disks=[DiskSource("rootfs", ROOTFS, layers=[layer])])
        vm = await rt.boot(spec)
        base = await rt.pause(vm, wait_teardown=True)
        # Held for the whole run: every restore maps the same materialised file.
        await asyncio.to_thread(rt.memory.acquire, base.id,
                                [Path(x.path) for x in base.memory_layers],
                                base.machine.memory_bytes)
        rounds = 3 if quick else 10
        results: dict[str, dict[str, list[float]]] = {
            m: {"cold_running": [], "cold_init": [], "warm_running": [], "warm_init": []}
            for m in modes}
        for n in range(rounds):
            # The order alternates per round: neither mode always runs after the other.
            for mode in modes if n % 2 == 0 else modes[::-1]:
                set_mode(rt, mode, user, cgroups)
                for warm in (False, True):
                    if warm:
                        await rt.prime(base, 1)
                    t0 = time.perf_counter()
                    child = await rt.restore(base)
                    total = (time.perf_counter() - t0) * 1e3
                    kind = "warm" if warm else "cold"
                    results[mode][f"{kind}_running"].append(to_running_ms(child))
                    results[mode][f"{kind}_init"].append(total)
                    await rt.kill(child)
                    await rt.unprime(base.id)
        for mode, series in results.items():
            for name, values in series.items():
                emit(f"restore_{name}_ms", mode=mode, p50=round(statistics.median(values), 1),
                     min=round(min(values), 1), max=round(max(values), 1), n=len(values))

        if fork:
            forks: dict[str, list[float]] = {m: [] for m in modes}
            for n in range(2 if quick else 4):
                for mode in modes if n % 2 == 0 else modes[::-1]:
                    set_mode(rt, mode, user, cgroups)
                    source = await rt.restore(base)
                    t0 = time.perf_counter()
                    _, children = await rt.fork(source, fork)
                    forks[mode].append((time.perf_counter() - t0) * 1e3)
                    for vm in (*children, source):
                        await rt.kill(vm)
            for mode, values in forks.items():
                emit(f"fork_{fork}_ms", mode=mode, p50=round(statistics.median(values), 1),
                     min=round(min(values), 1), max=round(max(values), 1), n=len(values))
            off, on = (statistics.median(forks[m]) for m in modes)
            emit(f"fork_{fork}_ratio", value=round(on / off, 3), baseline=modes[0])

        # Memory of idle VMs, both modes side by side.
        per_mode = 2 if quick else 4
        vms: dict[str, list[VM]] = {m: [] for m in modes}
        for _ in range(per_mode):
            for mode in modes:
                set_mode(rt, mode, user, cgroups)
                child = await rt.restore(base)
                await sh(child, "echo warm")
                vms[mode].append(child)
        await asyncio.sleep(3)
        for mode, children in vms.items():
            pss = [pss_kib(c.pid)["Pss"] / 1024 for c in children]
            rss = [pss_kib(c.pid)["Rss"] / 1024 for c in children]
            charged = []
            for c in children:
                group = c.process.cgroup
                for d in group.dirs if group else []:
                    for name in ("memory.current", "memory.usage_in_bytes"):
                        if (d / name).exists():
                            charged.append(int((d / name).read_text()) / 2**20)
            emit("idle_vm_memory_mib", mode=mode, pss=round(statistics.mean(pss), 1),
                 rss=round(statistics.mean(rss), 1),
                 cgroup_charge=round(statistics.mean(charged), 1) if charged else None,
                 n=len(children))
        for children in vms.values():
            for c in children:
                await rt.kill(c)
        rt.memory.release(base.id)
    finally:
        await rt.close()
        await client.close()
        await teardown_host(PREFIX)
        blockd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 2 idle VMs per mode")
    parser.add_argument("--cgroups-only", action="store_true",
                        help="both modes hardened, only the per-VM cgroup differs")
    parser.add_argument("--fork", type=int, default=0, metavar="N",
                        help="also time a fork of N children per mode (1..16)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("privilege_bench needs root (network namespaces, cgroups)")
    if not 0 <= args.fork <= 16:
        parser.error(f"--fork must be 0..16, not {args.fork}")
    asyncio.run(main(args.quick, args.cgroups_only, args.fork))

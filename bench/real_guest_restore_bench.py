"""The project's real guest (kernel, initramfs, tools disk, Python envd): restore of a paused VM
including envd's /init, and what the guest's first request after the restore costs QEMU.

Every restore starts a new QEMU under TCG whose translation cache is empty, so the first /init
pays for translating every guest code path it takes. Measured, side by side in one run and in
alternating order (the host is noisy):

- real_guest_restore_with_init_ms: `Runtime.restore()` with env vars and an access token (p50);
- real_guest_first_init_cpu_ms: host CPU of the QEMU process (all threads, /proc schedstat)
  from `cont` until /init has answered, restores with /init held back and sent by the bench (p50);
- real_guest_first_init_tb_count: translated blocks TCG made meanwhile (QMP `info jit`, p50).

With --settle-after-restore S the bench waits S seconds between `cont` and the first /init, so
the kernel's own post-resume work (timers, RCU, vmgenid, the virtio-net announce) is done and
the two /init figures are the request's own cost.

The candidate is the guest built from this tree (build_assets, cached under --state). The
baseline is another set of guest assets given with --baseline-assets DIR (vmlinuz, initramfs.img,
tools.ext4; e.g. a copy of the assets before a guest change), else the runtime's busybox test
guest (its /init is a shell CGI). Needs root (network namespaces) and qemu-system-x86_64.
Prints one JSON object per line; --quick stays under a minute once the assets are cached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GUEST_STATE = Path("/var/cache/aenv-test/guest/state")  # shared with tests/guest
NETWORK_PREFIX = "abr"
ROOTFS_SIZE = 64 << 20


@dataclass
class Guest:
    label: str
    init_path: str
    spec: Any
    record: Any = None
    restore_ms: list[float] = field(default_factory=list)
    init_cpu_ms: list[float] = field(default_factory=list)
    init_tbs: list[int] = field(default_factory=list)


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float) -> None:
    ratio = value / baseline_value if baseline_value else float("nan")
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, "baseline": baseline,
                      "baseline_value": round(baseline_value, 3), "ratio": round(ratio, 3)}), flush=True)


def qemu_cpu_ms(pid: int) -> float:
    """CPU time of every thread of a process (schedstat: nanoseconds, unlike /proc/PID/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e6


async def tb_count(vm: Any) -> int:
    info = await vm.process.execute("human-monitor-command", {"command-line": "info jit"})
    match = re.search(r"TB count\s+(\d+)", info)
    if not match:
        raise RuntimeError(f"QEMU's `info jit` has no TB count: {info[:200]!r}")
    return int(match.group(1))


def real_guest_spec(kernel: Path, initramfs: Path, tools: Path, layer: Path, cmdline: str) -> Any:
    from agentenv.runtime.vm import BootSpec, DiskSource

    return BootSpec(kernel=kernel, initramfs=initramfs, cmdline=cmdline, memory_mib=256,
                    disks=[DiskSource("tools", tools.stat().st_size, read_only=True, file=tools),
                           DiskSource("rootfs", ROOTFS_SIZE, layers=[layer])])


async def run(args: argparse.Namespace) -> None:
    from agentenv.blockd.client import AsyncBlockdClient
    from agentenv.guest.build.assets import CMDLINE_BASE, build_assets
    from agentenv.guest.build.rootfs import busybox_root, make_rootfs_image
    from agentenv.runtime.config import RuntimeConfig
    from agentenv.runtime.network import teardown_host
    from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
    from agentenv.storage.export import import_raw
    from agentenv.testing.harness import blockd_in, make_ext4_layer

    assets = build_assets(args.state)
    root = Path(tempfile.mkdtemp(prefix="realguest", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dir
    blockd = blockd_in(root)
    blockd.start()
    runtime: Runtime | None = None
    try:
        raw = make_rootfs_image(busybox_root(root / "bbroot"), root / "user.ext4", ROOTFS_SIZE)
        user_layer = import_raw(raw, root / "user.layer")
        candidate = Guest("real guest (this tree)", "/init", real_guest_spec(
            assets.kernel, assets.initramfs, assets.tools_image, user_layer, assets.cmdline_base))
        if args.baseline_assets:
            base_dir = args.baseline_assets
            baseline = Guest(f"real guest ({base_dir})", "/init", real_guest_spec(
                base_dir / "vmlinuz", base_dir / "initramfs.img", base_dir / "tools.ext4", user_layer,
                CMDLINE_BASE))
        else:
            from agentenv.testing.guest import build_test_guest

            test_guest = build_test_guest()
            layer = make_ext4_layer(root / "test.layer", ROOTFS_SIZE)
            baseline = Guest("busybox test guest", "/cgi-bin/init", BootSpec(
                kernel=test_guest.kernel, initramfs=test_guest.initramfs,
                cmdline=test_guest.cmdline_base, memory_mib=256,
                disks=[DiskSource("rootfs", ROOTFS_SIZE, layers=[layer])]))
        guests = [candidate, baseline]
        config = RuntimeConfig(state_dir=root / "state", network_prefix=NETWORK_PREFIX,
                               slot_first_index=args.slot_first_index, boot_timeout=300)
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        await runtime.start(kernel_for_probe=assets.kernel)
        for guest in guests:
            runtime.config.envd_init_path = guest.init_path
            vm = await runtime.boot(guest.spec)
            # Let boot-time work (envd's imports, the journal, page reporting) finish, as in
            # a sandbox paused a while after it started.
            await asyncio.sleep(args.settle_before_pause)
            guest.record = await runtime.pause(vm)

        real_init = runtime.envd_init

        async def held_back(*_args: Any, **_kwargs: Any) -> None:
            return None

        for round_index in range(args.restores):
            order = guests if round_index % 2 == 0 else guests[::-1]
            for guest in order:
                runtime.config.envd_init_path = guest.init_path
                started = time.perf_counter()
                vm = await runtime.restore(guest.record, env_vars={"FOO": "bar"}, access_token="tok")
                guest.restore_ms.append((time.perf_counter() - started) * 1e3)
                await runtime.kill(vm)
                # The first /init alone: restore with it held back, then send it.
                runtime.envd_init = held_back  # type: ignore[method-assign]
                try:
                    vm = await runtime.restore(guest.record)
                finally:
                    runtime.envd_init = real_init  # type: ignore[method-assign]
                await asyncio.sleep(args.settle_after_restore)
                cpu_before, tbs_before = qemu_cpu_ms(vm.process.pid), await tb_count(vm)
                await runtime.envd_init(vm, {"FOO": "bar"}, "tok")
                guest.init_cpu_ms.append(qemu_cpu_ms(vm.process.pid) - cpu_before)
                guest.init_tbs.append(await tb_count(vm) - tbs_before)
                await runtime.kill(vm)
                print(f"# round {round_index} {guest.label}: restore {guest.restore_ms[-1]:.0f} ms, "
                      f"first /init {guest.init_cpu_ms[-1]:.0f} ms CPU, {guest.init_tbs[-1]} TBs",
                      file=sys.stderr, flush=True)

        emit("real_guest_restore_with_init_ms", statistics.median(candidate.restore_ms), "ms",
             baseline.label, statistics.median(baseline.restore_ms))
        settled = f"_settled_{args.settle_after_restore:g}s" if args.settle_after_restore else ""
        emit(f"real_guest_first_init_cpu_ms{settled}", statistics.median(candidate.init_cpu_ms), "ms",
             baseline.label, statistics.median(baseline.init_cpu_ms))
        emit(f"real_guest_first_init_tb_count{settled}", statistics.median(candidate.init_tbs), "TBs",
             baseline.label, statistics.median(baseline.init_tbs))
    finally:
        if runtime is not None:
            await runtime.close()
            await runtime.blockd.close()
        await teardown_host(NETWORK_PREFIX)
        blockd.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 restores of each kind (under a minute)")
    parser.add_argument("--restores", type=int, default=None, help="restores per guest and kind (default 11)")
    parser.add_argument("--baseline-assets", type=Path, default=None,
                        help="directory with vmlinuz, initramfs.img and tools.ext4 to compare against")
    parser.add_argument("--state", type=Path, default=GUEST_STATE, help="guest assets cache (build_assets)")
    parser.add_argument("--settle-before-pause", type=float, default=None,
                        help="seconds a booted guest runs before it is paused (default 5, --quick 3)")
    parser.add_argument("--settle-after-restore", type=float, default=0.0,
                        help="seconds between a restore's `cont` and the first /init measured (default 0)")
    parser.add_argument("--slot-first-index", type=int, default=23101)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("real_guest_restore_bench needs root (network namespaces)")
    if args.restores is None:
        args.restores = 5 if args.quick else 11
    if args.settle_before_pause is None:
        args.settle_before_pause = 3.0 if args.quick else 5.0
    if args.baseline_assets is not None:
        missing = [n for n in ("vmlinuz", "initramfs.img", "tools.ext4") if not (args.baseline_assets / n).is_file()]
        if missing:
            sys.exit(f"--baseline-assets {args.baseline_assets}: missing {', '.join(missing)}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

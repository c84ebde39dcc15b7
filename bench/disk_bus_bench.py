"""The writable disk on virtio-scsi (the guest gets ENOSPC at blockd's upper cap) against
virtio-blk (EIO), side by side in one run, under the runtime's accelerator (TCG here).

Each bus boots the test guest with the real guest's layout: a read-only tools disk on
virtio-blk (it carries bench/diskio, compiled static here) and a writable blockd disk (vdb
or sda). Measured per bus, runs interleaved: boot to envd, snapshot + restore to envd, and
4 KiB O_DIRECT I/O at queue depth 1 on the raw writable disk (bench/diskio: sequential and
random read and write IOPS over 48 MiB, --io-rounds times). With --real-guest-state, the real
guest (kernel, initramfs, tools disk built there) also boots to envd with its root on each bus.

    python bench/disk_bus_bench.py [--boots 2] [--restores 3] [--ios 2000] [--io-rounds 3]
        [--real-guest-state DIR --real-boots 2]

Needs root (network namespaces). Prints one JSON object per line: metric, value, unit,
baseline, baseline_value, ratio (virtio-scsi / virtio-blk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import VMDiedError
from agentenv.runtime.vm import VM, BootSpec, DiskSource, Runtime
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import LoopThread, blockd_in, close_runtime, make_ext4_layer, sh

Bus = Literal["virtio-blk", "virtio-scsi"]
BUSES: tuple[Bus, Bus] = ("virtio-blk", "virtio-scsi")
DEVICE = {"virtio-blk": "/dev/vdb", "virtio-scsi": "/dev/sda"}
DISK = 64 << 20
PREFIX = "adb"
MODES = ("seqread", "randread", "seqwrite", "randwrite")


def build_diskio(out: Path) -> Path:
    """bench/diskio.c as a static binary padded to 4 KiB: the tools disk's whole content."""
    binary = out.with_suffix(".bin")
    subprocess.run(["gcc", "-O2", "-static", "-s", "-o", str(binary),
                    str(Path(__file__).with_name("diskio.c"))], check=True)
    data = binary.read_bytes()
    out.write_bytes(data + bytes(-len(data) % 4096))
    return out


def _order(round_: int) -> tuple[Bus, Bus]:
    """Alternate which bus goes first, so a drift in the host's load hits both alike."""
    return BUSES if round_ % 2 == 0 else (BUSES[1], BUSES[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boots", type=int, default=2)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--ios", type=int, default=2000, help="4 KiB requests per I/O case")
    parser.add_argument("--io-rounds", type=int, default=3)
    parser.add_argument("--real-guest-state", type=Path, default=None,
                        help="also boot the real guest (its assets built in this state dir) "
                             "with root on each bus")
    parser.add_argument("--real-boots", type=int, default=2)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="dbb", dir="/tmp"))
    root.chmod(0o711)
    blockd = blockd_in(root)
    blockd.start()
    loop = LoopThread()
    runtime: Runtime | None = None
    figures: dict[str, dict[Bus, list[float]]] = {}
    failures: list[dict[str, str]] = []

    def add(metric: str, bus: Bus, value: float) -> None:
        figures.setdefault(metric, {"virtio-blk": [], "virtio-scsi": []})[bus].append(value)

    try:
        tools = build_diskio(root / "diskio.img")
        tools.chmod(0o644)
        layer = make_ext4_layer(root / "disk.layer", DISK)
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1, boot_timeout=300)
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        specs = {bus: BootSpec(
            kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
            disks=[DiskSource("tools", tools.stat().st_size, read_only=True, file=tools),
                   DiskSource("rootfs", DISK, layers=[layer], bus=bus)], memory_mib=256)
            for bus in BUSES}
        kept: dict[Bus, VM] = {}
        for round_ in range(args.boots):
            for bus in _order(round_):
                t0 = time.monotonic()
                try:
                    vm = loop.run(runtime.boot(specs[bus]))
                except VMDiedError as exc:
                    # Counted, not fatal: a QEMU dying at boot is itself a figure to compare.
                    failures.append({"bus": bus, "phase": "boot", "error": str(exc)[-300:]})
                    continue
                add("boot_to_envd", bus, (time.monotonic() - t0) * 1000)
                if bus not in kept:
                    kept[bus] = vm
                else:
                    loop.run(runtime.kill(vm))
        for bus in BUSES:
            out = loop.run(sh(kept[bus], f"dd if=/dev/vda of=/tmp/diskio bs=64k 2>/dev/null;"
                                         f" chmod +x /tmp/diskio; ls {DEVICE[bus]}", timeout=120))
            assert DEVICE[bus] in out, out
        for round_ in range(args.io_rounds):
            for mode, bus in ((m, b) for m in MODES for b in _order(round_)):
                out = loop.run(sh(kept[bus], f"/tmp/diskio {mode} {DEVICE[bus]} {args.ios} 48",
                                  timeout=600))
                words = out.split()
                if len(words) != 2 or words[0] != mode:
                    raise SystemExit(f"{bus} {mode}: diskio said {out!r}")
                add(f"{mode}_4k_qd1", bus, float(words[1]))
        records = {bus: loop.run(runtime.snapshot(kept[bus])) for bus in BUSES}
        for bus in BUSES:
            loop.run(runtime.kill(kept[bus]))
        for round_ in range(args.restores):
            for bus in _order(round_):
                t0 = time.monotonic()
                vm = loop.run(runtime.restore(records[bus]))
                add("restore_to_envd", bus, (time.monotonic() - t0) * 1000)
                loop.run(runtime.kill(vm))
        if args.real_guest_state is not None:
            from agentenv.guest.build import build_assets

            assets = build_assets(args.real_guest_state)
            user_root = make_ext4_layer(root / "user.layer", 256 << 20)
            for round_ in range(args.real_boots):
                for bus in _order(round_):
                    real = BootSpec(kernel=assets.kernel, initramfs=assets.initramfs,
                                    cmdline=assets.cmdline_base, disks=[
                                        DiskSource("tools", assets.tools_image.stat().st_size,
                                                   read_only=True, file=assets.tools_image),
                                        DiskSource("rootfs", 256 << 20, layers=[user_root],
                                                   bus=bus)])
                    t0 = time.monotonic()
                    try:
                        vm = loop.run(runtime.boot(real))
                    except VMDiedError as exc:
                        failures.append({"bus": bus, "phase": "real guest boot",
                                         "error": str(exc)[-300:]})
                        continue
                    add("real_guest_boot_to_envd", bus, (time.monotonic() - t0) * 1000)
                    loop.run(runtime.kill(vm))
    finally:
        close_runtime(loop, runtime, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    for failure in failures:
        print(json.dumps({"metric": "vm_died", **failure}), flush=True)
    for metric, by_bus in figures.items():
        unit = "ms" if metric.endswith("envd") else "IOPS"
        if not by_bus["virtio-blk"] or not by_bus["virtio-scsi"]:
            continue
        blk, scsi = statistics.median(by_bus["virtio-blk"]), statistics.median(by_bus["virtio-scsi"])
        print(json.dumps({"metric": f"{metric}_virtio_scsi", "value": round(scsi, 1), "unit": unit,
                          "baseline": f"{metric}_virtio_blk", "baseline_value": round(blk, 1),
                          "ratio": round(scsi / blk, 3), "runs": len(by_bus["virtio-scsi"]),
                          "samples": {bus: [round(v) for v in values]
                                      for bus, values in by_bus.items()},
                          "loadavg_1m_start_end": [round(load_start, 2), round(load, 2)]}),
              flush=True)


if __name__ == "__main__":
    main()

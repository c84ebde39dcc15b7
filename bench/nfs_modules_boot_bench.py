"""What the NFSv4 client's modules in the initramfs cost a cold boot (docs/volumes.md §7.1).

The real guest (kernel, tools disk, envd, a busybox root disk) is cold-booted to envd-ready
(Runtime.boot returns when envd answers) with two initramfs files built from the same kernel
tree: one with nfsv4 and its dependencies (stage 1 loads them), one without (what the guest
assets hold since this measurement: envd loads them from the tools disk when a shared volume is
mounted). Runs alternate (with, without, with, ...) so drift hits both alike.

    sudo PYTHONPATH=src .venv/bin/python bench/nfs_modules_boot_bench.py [--runs 3]

Needs root (network slots), QEMU, blockd. Run it under `flock /tmp/aenv-vmtest.lock`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.guest.build import kernel
from agentenv.guest.build.assets import build_assets
from agentenv.guest.build.rootfs import busybox_root, make_rootfs_image
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
from agentenv.storage.export import import_raw
from agentenv.testing.harness import LoopThread, blockd_in, close_runtime

GUEST_CACHE = Path(os.environ.get("AENV_TEST_GUEST_STATE", "/var/cache/aenv-test/guest/state"))
PREFIX = "anb"


def _kernel_tree(state: Path) -> kernel.KernelTree:
    for d in sorted((state / "guest" / "work").glob("kernel-*")):
        release = d / ".release"
        if release.is_file():
            return kernel.KernelTree(d, release.read_text().strip())
    raise SystemExit(f"no unpacked kernel under {state}/guest/work")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    assets = build_assets(GUEST_CACHE)
    tree = _kernel_tree(GUEST_CACHE)
    root = Path(tempfile.mkdtemp(prefix="nfsboot", dir="/tmp"))
    root.chmod(0o711)
    with_nfs, without = root / "initramfs-with-nfs.gz", root / "initramfs-without-nfs.gz"
    optional = tuple(m for m in kernel.OPTIONAL_MODULES if m != "nfsv4")
    kernel.build_initramfs(tree, _busybox(GUEST_CACHE), with_nfs, (*optional, "nfsv4"))
    kernel.build_initramfs(tree, _busybox(GUEST_CACHE), without, optional)
    variants = {"with nfsv4": with_nfs, "without": without}
    sizes = {k: v.stat().st_size for k, v in variants.items()}
    raw = make_rootfs_image(busybox_root(root / "bbroot"), root / "user.ext4", 64 << 20)
    layer = import_raw(raw, root / "user.layer")
    tools_size = assets.tools_image.stat().st_size
    blockd = blockd_in(root)
    blockd.start()
    loop = LoopThread()
    runtime: Runtime | None = None
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        config = RuntimeConfig(state_dir=root / "state", network_prefix=PREFIX,
                               envd_init_path="/init", slot_pool_low=1, boot_timeout=300)
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=assets.kernel))
        for _ in range(args.runs):
            for name, initramfs in variants.items():
                spec = BootSpec(kernel=assets.kernel, initramfs=initramfs,
                                cmdline=assets.cmdline_base, memory_mib=512,
                                disks=[DiskSource("tools", tools_size, read_only=True,
                                                  file=assets.tools_image),
                                       DiskSource("rootfs", 64 << 20, layers=[layer])])
                t0 = time.monotonic()
                vm = loop.run(runtime.boot(spec))
                times[name].append(time.monotonic() - t0)
                loop.run(runtime.kill(vm))
                print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    finally:
        close_runtime(loop, runtime, PREFIX, blockd)
        shutil.rmtree(root, ignore_errors=True)
    print(f"accel {runtime.accel if runtime else '?'}; initramfs bytes {sizes}")
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} s, runs "
              f"{', '.join(f'{v:.2f}' for v in values)}")
    diff = statistics.median(times["with nfsv4"]) - statistics.median(times["without"])
    print(f"cost of nfsv4 at boot (median difference): {diff:+.2f} s")


def _busybox(state: Path) -> Path:
    for d in sorted((state / "guest" / "work").glob("busybox-*")):
        if (d / "bin" / "busybox").is_file():
            return d / "bin" / "busybox"
    raise SystemExit(f"no busybox under {state}/guest/work")


if __name__ == "__main__":
    main()

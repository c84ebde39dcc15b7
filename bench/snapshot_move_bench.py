"""Snapshots that move: a restore from a snapshot pulled lazily (its memory and disk layers
read through the chunk cache: blockd's for the disks, memfs's for the memory) against one
pulled whole (`aenv snapshot pull --download`), side by side in one run.

A test guest fills 96 MiB of tmpfs, is paused, and the snapshot is pushed to a docker-registry
on loopback. It is then fetched twice into two snapshot roots: lazily and whole. Each is
restored once from an empty page cache (two runtimes on one blockd, so that each has its own
memory device), followed by a first command that reads the guest's files and the 96 MiB:

- pull time, restore-to-first-command time, and pull + restore (what a node that does not hold
  the snapshot waits for);
- bytes fetched from the registry at restore (the background completer is off) against the
  snapshot's total.

Prints one JSON object per line. Needs root, QEMU and docker-registry.

    python bench/snapshot_move_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.template.registry_server import start_registry, stop_registry

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.blockd.remote import install_private_store
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
from agentenv.snapshot.repository import fetch, push
from agentenv.testing.guest import build_test_guest
from agentenv.testing.harness import blockd_in, make_ext4_layer, sh

PREFIXES = {"lazy": "asl", "whole": "asw"}
SLOTS = {"lazy": 29701, "whole": 29801}  # far from tests/runtime and the other benches
ROOTFS = 64 << 20


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: Any) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value and value else None
    print(json.dumps({"metric": metric, "value": round(value, 2), "unit": unit,
                      "baseline": baseline, "ratio": ratio,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 2),
                      **extra}), flush=True)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


async def fetched_bytes(client: AsyncBlockdClient, state: Path) -> int:
    """Bytes blockd's and memfs's chunk stores fetched so far."""
    from agentenv.blockd.memfs import SWEEP_SECONDS
    from agentenv.blockd.remote.service import memfs_remote_stats

    await asyncio.sleep(SWEEP_SECONDS + 0.5)  # memfs writes its counters on each sweep
    stats = await client.call("remote_stats")
    memory = memfs_remote_stats(state) or {}
    return sum(stats["fetched_bytes"].values()) + sum(memory.get("fetched_bytes", {}).values())


async def main(quick: bool) -> None:
    install_private_store()
    guest = build_test_guest()
    root = Path(tempfile.mkdtemp(prefix="smb", dir="/tmp"))
    root.chmod(0o711)  # QEMU runs as aenv-vm: it must reach the state dirs
    os.environ["AENV_REMOTE_BACKGROUND_BW"] = "0"  # bytes fetched = what the restore touched
    blockd = blockd_in(root)
    blockd.start()
    (root / "registry").mkdir()
    registry = start_registry(root / "registry")
    client = AsyncBlockdClient(blockd.socket)
    rts: dict[str, Runtime] = {}
    try:
        for kind in ("lazy", "whole"):
            rts[kind] = Runtime(RuntimeConfig(
                state_dir=root / f"state-{kind}", network_prefix=PREFIXES[kind],
                envd_init_path="/cgi-bin/init", slot_pool_low=1, slot_pool_high=2,
                slot_first_index=SLOTS[kind], memory_device="blockd"), blockd=client)
            await rts[kind].start(kernel_for_probe=guest.kernel)
        layer = make_ext4_layer(root / "rootfs.layer", ROOTFS)
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs, cmdline=guest.cmdline_base,
                        memory_mib=512, disks=[DiskSource("rootfs", ROOTFS, layers=[layer])])
        vm = await rts["lazy"].boot(spec)
        await sh(vm, "yes 0123456789abcdef | head -c 1048576 > /tmp/p1m;"
                     " cat $(yes /tmp/p1m | head -n 96) > /tmp/fill; rm /tmp/p1m; echo ok", timeout=300)
        snap = await rts["lazy"].pause(vm, wait_teardown=True)
        ref = f"{registry.host}/bench/snapshot:one"
        pushed = await asyncio.to_thread(push, Path(snap.device_state).parent, ref, {})
        total = int(pushed["bytes"])
        results: dict[str, dict[str, float]] = {}
        for kind in ("whole", "lazy"):
            drop_caches()
            t0 = time.perf_counter()
            got = await asyncio.to_thread(fetch, ref, root / f"pulled-{kind}", lazy=kind == "lazy")
            t1 = time.perf_counter()
            before = await fetched_bytes(client, blockd.state_dir)
            drop_caches()
            t2 = time.perf_counter()
            child = await rts[kind].restore(got.record)
            await sh(child, "ls -R /bin /etc > /dev/null 2>&1; cat /tmp/fill > /dev/null; echo ok",
                     timeout=300)
            t3 = time.perf_counter()
            after = await fetched_bytes(client, blockd.state_dir)
            await rts[kind].kill(child)
            results[kind] = {"pull_ms": (t1 - t0) * 1e3, "restore_first_command_ms": (t3 - t2) * 1e3,
                             "pulled_bytes": got.bytes_fetched, "restore_bytes": after - before}
        w, z = results["whole"], results["lazy"]
        emit("snapshot_pull_ms_lazy", z["pull_ms"], "ms", "snapshot_pull_ms_whole", w["pull_ms"],
             pulled_bytes=z["pulled_bytes"], whole_pulled_bytes=w["pulled_bytes"])
        emit("restore_to_first_command_ms_lazy", z["restore_first_command_ms"], "ms",
             "restore_to_first_command_ms_whole", w["restore_first_command_ms"])
        emit("pull_plus_restore_to_first_command_ms_lazy",
             z["pull_ms"] + z["restore_first_command_ms"], "ms",
             "pull_plus_restore_to_first_command_ms_whole",
             w["pull_ms"] + w["restore_first_command_ms"])
        emit("bytes_fetched_at_restore_lazy", z["restore_bytes"], "bytes", "snapshot_total_bytes",
             total, memory_layers_bytes=sum(x.size for x in snap.memory_layers),
             whole_restore_bytes=w["restore_bytes"],
             note="lazy restore fetches through the chunk caches; background completer off")
        emit("bytes_fetched_pull_plus_restore_lazy", z["pulled_bytes"] + z["restore_bytes"],
             "bytes", "bytes_fetched_pull_whole", w["pulled_bytes"], quick=quick)
    finally:
        for rt in rts.values():
            await rt.close()
        await client.close()
        for prefix in PREFIXES.values():
            await teardown_host(prefix)
        blockd.stop()
        stop_registry(registry)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one restore of each kind (the only mode)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("snapshot_move_bench needs root (network namespaces, FUSE, drop_caches)")
    asyncio.run(main(args.quick))

"""Volumes (docs/volumes.md §6): a dataset mounted read-only by N sandboxes against the baseline
a user would otherwise build, N private copies of it in each sandbox's root disk (uploaded
through envd's /files, as the SDK's files.write does). Measured side by side in one run:

- create to first read: `Sandbox.create(volume_mounts=...)` + reading the file's first byte,
  against `Sandbox.create()` + uploading the dataset + the same read;
- host disk bytes: what the volume's layers and the sandboxes' disk uppers take, with N mounts
  against N copies (page cache is not measured: the host is shared with other work);
- guest read throughput of the dataset, guest caches dropped, host cache warm: sequential 1 MiB
  reads and random 4 KiB reads from a read-only mount, a copy-on-write mount, and the root disk,
  in alternating rounds (medians);
- shared read-write (`rw-shared`, NFS to the node's ganesha, docs/volumes.md §7.1) against the
  same guest's root disk, in alternating rounds (medians): sequential 1 MiB writes (fsync at
  the end), sequential 1 MiB reads with the guest's cache dropped, and small files created
  (4 KiB each, written and closed, one sync at the end). `--shared-only` runs this part alone.

Starts its own VM node (tests/node's helpers); needs root and QEMU. Prints JSON lines.

    flock /tmp/aenv-vmtest.lock scripts/isolated.sh python bench/volume_bench.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.node import conftest

PREFIX, FIRST_SLOT = "avb", 21201  # 21201-21400
DATA = "/mnt/data/blob.bin"
COPY = "/home/user/blob.bin"
# Reads the file with a cold guest cache: sequential 1 MiB reads, then 4 KiB reads at random
# aligned offsets; prints MiB/s and reads/s.
READER = r"""
import os, random, sys, time
path = sys.argv[1]
open("/proc/sys/vm/drop_caches", "w").write("3")
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
t = time.perf_counter(); done = 0
while done < size:
    got = os.pread(fd, 1 << 20, done)
    if not got: break
    done += len(got)
seq = done / (time.perf_counter() - t) / (1 << 20)
open("/proc/sys/vm/drop_caches", "w").write("3")
rng = random.Random(1); n = 2000
t = time.perf_counter()
for _ in range(n):
    os.pread(fd, 4096, rng.randrange(size // 4096) * 4096)
print(f"{seq:.1f} {n / (time.perf_counter() - t):.1f}")
"""


# In one guest: write SIZE MiB sequentially in 1 MiB writes (fsync), read it back with the
# guest's cache dropped, create FILES files of 4 KiB (one sync at the end); prints MiB/s,
# MiB/s, files/s; removes what it made.
SHARED_RW = r"""
import os, sys, time
top, size_mb, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(top, exist_ok=True)
path = os.path.join(top, "seq.bin")
buf = os.urandom(1 << 20)
t = time.perf_counter()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(size_mb):
    os.write(fd, buf)
os.fsync(fd); os.close(fd)
write = size_mb / (time.perf_counter() - t)
open("/proc/sys/vm/drop_caches", "w").write("3")
t = time.perf_counter(); fd = os.open(path, os.O_RDONLY); done = 0
while True:
    got = os.read(fd, 1 << 20)
    if not got: break
    done += len(got)
os.close(fd)
read = done / (1 << 20) / (time.perf_counter() - t)
small = os.path.join(top, "small"); os.makedirs(small, exist_ok=True)
data = os.urandom(4096)
t = time.perf_counter()
for i in range(files):
    fd = os.open(os.path.join(small, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data); os.close(fd)
os.sync()
created = files / (time.perf_counter() - t)
for i in range(files):
    os.unlink(os.path.join(small, f"f{i}"))
os.unlink(path)
print(f"{write:.1f} {read:.1f} {created:.1f}")
"""


def emit(metric: str, value: float, unit: str, baseline: str | None = None,
         baseline_value: float | None = None, **extra: Any) -> None:
    line: dict[str, Any] = {"metric": metric, "value": round(value, 2), "unit": unit, **extra}
    if baseline is not None and baseline_value:
        line |= {"baseline": baseline, "baseline_value": round(baseline_value, 2),
                 "ratio": round(value / baseline_value, 3)}
    print(json.dumps(line), flush=True)


def allocated(paths: list[Path]) -> int:
    """Bytes the files under `paths` take on disk (sparse files counted as allocated)."""
    total = 0
    for top in paths:
        for dirpath, _, names in os.walk(top):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    continue
    return total


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(node: conftest.NodeProcess, count: int, size_mb: int, rounds: int) -> None:
    from e2b import Sandbox, Volume

    state = node.state_dir
    uppers = state / "vm-backend" / "runtime" / "vms"
    layers = state / "volumes" / "layers"
    blob = os.urandom(size_mb << 20)
    local = Path(tempfile.mkdtemp(prefix="aenv-volbench-")) / "blob.bin"
    local.write_bytes(blob)
    vol = Volume.create("bench")
    made: list[Sandbox] = []
    try:
        with open(local, "rb") as f:
            vol.write_file("/blob.bin", f)

        def first_read(sbx: Sandbox, path: str) -> None:
            assert sbx.commands.run(f"head -c 1 {path} | wc -c").stdout.strip() == "1"

        start_bytes = allocated([uppers, layers])
        # N read-only mounts (the first create seals the volume: timed apart)
        t0 = time.perf_counter()
        sealing = Sandbox.create(volume_mounts={"/mnt/data": vol}, timeout=1800)
        first_read(sealing, DATA)
        seal_ms = (time.perf_counter() - t0) * 1e3
        made.append(sealing)
        mounted_ms = []
        for _ in range(count - 1):
            t0 = time.perf_counter()
            sbx = Sandbox.create(volume_mounts={"/mnt/data": vol}, timeout=1800)
            first_read(sbx, DATA)
            mounted_ms.append((time.perf_counter() - t0) * 1e3)
            made.append(sbx)
        for sbx in made:  # every sandbox reads the whole dataset once
            sbx.commands.run(f"cat {DATA} > /dev/null", timeout=600)
        after_mounts = allocated([uppers, layers])

        # the baseline: N sandboxes with a private copy each
        copied_ms = []
        copies: list[Sandbox] = []
        for _ in range(count):
            t0 = time.perf_counter()
            sbx = Sandbox.create(timeout=1800)
            with open(local, "rb") as f:
                sbx.files.write(COPY, f, request_timeout=1800)
            first_read(sbx, COPY)
            copied_ms.append((time.perf_counter() - t0) * 1e3)
            copies.append(sbx)
        made += copies
        for sbx in copies:
            sbx.commands.run("sync", user="root", timeout=600)
        mounts_bytes = after_mounts - start_bytes
        copies_bytes = allocated([uppers, layers]) - after_mounts
        emit("create_to_first_read_ms_p50", sorted(mounted_ms)[len(mounted_ms) // 2], "ms",
             f"create + upload {size_mb} MiB + read", sorted(copied_ms)[len(copied_ms) // 2],
             first_create_with_seal_ms=round(seal_ms), count=count)
        emit("host_disk_bytes", mounts_bytes, "bytes", f"{count} private copies",
             copies_bytes, count=count, dataset_bytes=len(blob),
             mounts_over_one_copy=round(mounts_bytes / len(blob), 3),
             volume_layer_bytes=allocated([layers]))

        # guest read throughput: read-only mount, copy-on-write mount, root disk
        cow = Sandbox.create(volume_mounts={"/mnt/data": "bench:cow"}, timeout=1800)
        made.append(cow)
        kinds = (("ro", made[0], DATA), ("cow", cow, DATA), ("root", copies[0], COPY))
        for _, sbx, path in kinds:
            sbx.commands.run(f"cat {path} > /dev/null", timeout=600)  # the host's cache warm
        seq: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
        rand: dict[str, list[float]] = {k: [] for k, _, _ in kinds}
        for _ in range(rounds):  # alternating: the host's load falls on each alike
            for what, sbx, path in kinds:
                out = sbx.commands.run(f"python3 -c '{READER}' {path}", user="root",
                                       timeout=1800).stdout.split()
                seq[what].append(float(out[0]))
                rand[what].append(float(out[1]))
        for what in ("ro", "cow"):
            emit(f"seq_read_mib_s_{what}", median(seq[what]), "MiB/s", "root disk",
                 median(seq["root"]), rounds=rounds)
            emit(f"rand_4k_reads_s_{what}", median(rand[what]), "reads/s", "root disk",
                 median(rand["root"]), rounds=rounds)
    finally:
        for sbx in made:
            with contextlib.suppress(Exception):  # killed already; the node goes anyway
                sbx.kill()
        Volume.destroy(vol.volume_id)
        shutil.rmtree(local.parent, ignore_errors=True)


def run_shared(size_mb: int, files: int, rounds: int) -> None:
    """Shared read-write over NFS against the root disk, in one guest (module doc)."""
    from e2b import Sandbox, Volume

    vol = Volume.create("bench-shared")
    sbx: Sandbox | None = None
    try:
        sbx = Sandbox.create(volume_mounts={"/mnt/s": "bench-shared:rw-shared"}, timeout=1800)
        kinds = (("nfs", "/mnt/s/bench"), ("root", "/home/user/bench"))
        got: dict[str, list[list[float]]] = {k: [] for k, _ in kinds}
        for _ in range(rounds):  # alternating: the host's load falls on each alike
            for what, top in kinds:
                out = sbx.commands.run(f"python3 -c '{SHARED_RW}' {top} {size_mb} {files}",
                                       user="root", timeout=1800).stdout.split()
                got[what].append([float(v) for v in out])
        for index, (metric, unit) in enumerate((("shared_rw_seq_write_mib_s", "MiB/s"),
                                                ("shared_rw_seq_read_mib_s", "MiB/s"),
                                                ("shared_rw_small_files_s", "files/s"))):
            emit(metric, median([r[index] for r in got["nfs"]]), unit, "root disk",
                 median([r[index] for r in got["root"]]), rounds=rounds, size_mb=size_mb,
                 files=files, all_nfs=[r[index] for r in got["nfs"]],
                 all_root=[r[index] for r in got["root"]])
    finally:
        if sbx is not None:
            with contextlib.suppress(Exception):
                sbx.kill()
        with contextlib.suppress(Exception):
            Volume.destroy(vol.volume_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=8, help="sandboxes mounting the volume")
    parser.add_argument("--size-mb", type=int, default=512, help="the dataset's size")
    parser.add_argument("--rounds", type=int, default=5, help="read measurements of each kind")
    parser.add_argument("--quick", action="store_true", help="4 sandboxes, 128 MiB, 3 rounds")
    parser.add_argument("--shared-only", action="store_true",
                        help="only shared read-write against the root disk")
    parser.add_argument("--files", type=int, default=500, help="small files per round (shared)")
    args = parser.parse_args()
    count, size_mb, rounds = ((4, 128, 3) if args.quick
                              else (args.count, args.size_mb, args.rounds))
    base = Path(tempfile.mkdtemp(prefix="aenv-volbench-node-"))
    node = conftest.vm_node_process(base / "state", base / "node.log", PREFIX, FIRST_SLOT,
                                    {**conftest.NO_READY_POOLS, "AENV_VOLUME_SHARED_RW": "1"})
    node.start_timeout = 1200
    try:
        with conftest.serving_vm_node(node, PREFIX):
            if not args.shared_only:
                run(node, count, size_mb, rounds)
            run_shared(min(size_mb, 256), args.files, rounds)
    finally:
        for root in [*conftest._REACHABLE_ROOTS, base]:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

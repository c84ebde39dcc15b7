"""Remote layers benchmark (docs/remote-layers.md), each figure beside its baseline in the
same run. The image is tests/remote/bigimage.py's 1 GiB overlaybd image (built once, cached
under /var/cache/aenv-test), pushed to a docker-registry on loopback; nodes are real blockd
processes.

- first_read_ms: create a read-only device of the image and read what a start reads (three
  small files and a 16 MiB file, with debugfs from the device's FUSE file) with an empty chunk
  cache, against the same with the blob as a local layer. Also bytes_fetched against the blob
  size. (No VM: the device's first reads are what differs between remote and local.)
- warm_iops: 4 KiB random reads over NBD (one client, queue depth 1) from a region the chunk
  cache holds, against the local layer.
- p2p_mbps: a cold node reading the disk from a peer that holds it, against a cold node
  reading it from the registry.
- vm_first_command_ms: a VM (the runtime's busybox test guest, TCG) booted with the image as
  its disk, from create to the answer of its first command (mount the disk, `cat
  /mnt/disk/hello.txt`), the disk a remote layer with an empty chunk cache against the same
  blob as a local layer; rounds alternate the order, blockd is restarted with an emptied chunk
  cache before every boot and the page cache of the local blob and of the registry's files is
  dropped, so neither side starts warm. Also bytes fetched per remote boot against the blob.
  Needs root and network namespaces (run it under scripts/isolated.sh).

Prints one JSON object per line. `--quick` reads 256 MiB instead of the whole disk for the
throughput figures and boots 3 rounds instead of 5. `--only` runs one part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.blockd.conftest import Daemon
from tests.blockd.nbdclient import NbdClient
from tests.remote import bigimage
from tests.template.registry_server import start_registry, stop_registry

from agentenv.template.pull import pull_image

MiB = 1 << 20


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float,
         **extra: object) -> None:
    ratio = value / baseline_value if baseline_value else float("nan")
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit,
                      "baseline": baseline, "baseline_value": round(baseline_value, 3),
                      "ratio": round(ratio, 3), **extra}), flush=True)


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[Daemon] = []
        # static peers' trust file: each node's line (`aenv peer-key`), with its chunk server
        self.trust_file = root / "peers.trust"
        self.trust: dict[str, str] = {}

    def _write_trust(self) -> None:
        tmp = self.trust_file.with_suffix(".new")
        tmp.write_text("".join(line + "\n" for line in self.trust.values()))
        os.replace(tmp, self.trust_file)  # blockds read it again when it changes

    def node(self, name: str, peers: list[str] = (), serve: str | None = None) -> Daemon:  # type: ignore[assignment]
        from agentenv.blockd.remote.identity import load_identity

        d = Daemon(Path(tempfile.mkdtemp(prefix=f"rb{name}", dir="/tmp")))
        self.trust[name] = load_identity(d.state_dir, name).trust_line()
        self._write_trust()
        d.extra_args = ["--chunk-cache-size", "4G", "--remote-background-bw", "0",
                        "--peer-node-id", name, "--peer-trust-file", str(self.trust_file)]
        for p in peers:
            d.extra_args += ["--peer", f"http://{p}"]
        if serve:
            d.extra_args += ["--p2p-listen", serve]
        d.start()
        self.daemons.append(d)
        if serve:  # (a port 0 is known once it listens)
            self.trust[name] += f" http://{stats(d)['p2p']}"
            self._write_trust()
        return d

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(d.state_dir / "fuse")],
                           stderr=subprocess.DEVNULL, check=False)
            shutil.rmtree(d.root, ignore_errors=True)


def device(d: Daemon, image: Path) -> dict:  # type: ignore[type-arg]
    with d.client() as c:
        return c.call("create", image=str(image), readonly=True)  # type: ignore[no-any-return]


def stats(d: Daemon) -> dict:  # type: ignore[type-arg]
    with d.client() as c:
        return c.call("remote_stats")  # type: ignore[no-any-return]


def first_read(d: Daemon, image: Path, out: Path) -> float:
    t0 = time.perf_counter()
    info = device(d, image)
    for path in ("/hello.txt", "/etc/hostname", "/etc/motd", "/data/medium.bin"):
        subprocess.run(["debugfs", "-R", f"dump {path} {out}", info["file"]], check=True,
                       capture_output=True)
    return (time.perf_counter() - t0) * 1e3


def read_all(info: dict, size: int) -> float:  # type: ignore[type-arg]
    c = NbdClient(info["nbd"], info["export"], timeout=300)
    t0 = time.perf_counter()
    try:
        for off in range(0, size, 8 * MiB):
            c.read(off, min(8 * MiB, size - off))
    finally:
        c.close()
    return size / MiB / (time.perf_counter() - t0)


def iops(info: dict, region: int, seconds: float) -> float:  # type: ignore[type-arg]
    c = NbdClient(info["nbd"], info["export"], timeout=60)
    rng = random.Random(7)
    n = 0
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(200):
                c.read(rng.randrange(region // 4096) * 4096, 4096)
            n += 200
        return n / seconds
    finally:
        c.close()


def drop_page_cache(path: Path) -> None:
    """Evict a file's (or a tree's files') clean pages from the host page cache."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


FIRST_COMMAND = ("mount -t ext4 /dev/vda /mnt/disk && cat /mnt/disk/hello.txt")


def vm_first_command(image: bigimage.BigImage, descriptor: Path, registry_root: Path,
                     root: Path, rounds: int) -> None:
    """Boot the test guest with the image as its disk, remote (cold chunk cache) and local
    side by side, and time create -> first command's answer."""
    from agentenv.blockd.client import AsyncBlockdClient, BlockdClient
    from agentenv.runtime.config import RuntimeConfig, privilege_settings_from_env
    from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
    from agentenv.testing.guest import build_test_guest
    from agentenv.testing.harness import LoopThread, blockd_in, close_runtime, sh

    if os.geteuid() != 0:
        raise SystemExit("the VM figure needs root (network namespaces): run it as root, "
                         "under scripts/isolated.sh")
    prefix = "arb"
    guest = build_test_guest()
    vmroot = root / "vm"
    vmroot.mkdir()
    root.chmod(0o711)
    vmroot.chmod(0o711)  # QEMU runs as aenv-vm and must reach <vmroot>/state
    cache_dir = vmroot / "chunk-cache"
    os.environ["AENV_CHUNK_CACHE_DIR"] = str(cache_dir)
    os.environ["AENV_REMOTE_BACKGROUND_BW"] = "0"  # what is fetched is what the boot read
    blockd = blockd_in(vmroot, fuse=False)
    loop = LoopThread()
    runtime: Runtime | None = None

    def fresh_blockd() -> None:
        # A new process over an empty chunk cache: cold for the remote side, and no state
        # kept in blockd's memory for either side.
        blockd.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
        blockd.start()

    def fetched() -> int:
        with BlockdClient(blockd.socket) as c:
            return sum(c.call("remote_stats")["fetched_bytes"].values())

    async def boot_and_ask(layer: Path) -> tuple[float, float, str]:
        assert runtime is not None
        spec = BootSpec(kernel=guest.kernel, initramfs=guest.initramfs,
                        cmdline=guest.cmdline_base, memory_mib=256, vcpus=1,
                        disks=[DiskSource("rootfs", image.virtual_size, layers=[layer])])
        t0 = time.perf_counter()
        vm = await runtime.boot(spec)
        t_boot = time.perf_counter()
        try:
            answer = await sh(vm, FIRST_COMMAND, timeout=180)
            t_answer = time.perf_counter()
        finally:
            await runtime.kill(vm)
        return (t_boot - t0) * 1e3, (t_answer - t0) * 1e3, answer

    try:
        blockd.start()
        config = RuntimeConfig(state_dir=vmroot / "state", network_prefix=prefix,
                               envd_init_path="/cgi-bin/init", slot_pool_low=1, boot_timeout=300,
                               **privilege_settings_from_env(os.environ))
        runtime = Runtime(config, blockd=AsyncBlockdClient(blockd.socket))
        loop.run(runtime.start(kernel_for_probe=guest.kernel))
        loop.run(boot_and_ask(image.blob))  # warm-up: QEMU, kernel and initramfs in page cache
        results: dict[str, list[tuple[float, float]]] = {"local": [], "remote": []}
        remote_bytes: list[int] = []
        want = bigimage.SMALL_FILES["hello.txt"].decode()
        for r in range(rounds):
            for side in (("local", "remote") if r % 2 == 0 else ("remote", "local")):
                fresh_blockd()
                drop_page_cache(image.blob)
                drop_page_cache(registry_root)
                boot_ms, answer_ms, answer = loop.run(
                    boot_and_ask(image.blob if side == "local" else descriptor), timeout=600)
                if answer != want:
                    raise RuntimeError(f"{side} VM answered {answer!r}, wanted {want!r}")
                results[side].append((boot_ms, answer_ms))
                if side == "remote":
                    remote_bytes.append(fetched())
                print(json.dumps({"round": r, "side": side, "boot_ms": round(boot_ms, 1),
                                  "first_command_ms": round(answer_ms, 1)}),
                      file=sys.stderr, flush=True)
        med = {side: (statistics.median(b for b, _ in v), statistics.median(a for _, a in v))
               for side, v in results.items()}
        emit("vm_first_command_ms", med["remote"][1], "ms", "local layer", med["local"][1],
             goal="<= 2x", rounds=rounds, stat="median",
             remote_boot_ms=round(med["remote"][0], 1), local_boot_ms=round(med["local"][0], 1),
             # On a loaded host the noise only adds: the fastest rounds compare the costs.
             min_ratio=round(min(a for _, a in results["remote"])
                             / min(a for _, a in results["local"]), 3),
             remote_all=[round(a) for _, a in results["remote"]],
             local_all=[round(a) for _, a in results["local"]])
        # The guest boots from its initramfs: the disk is first read by the mount, so what
        # the disk's source changes shows most in the time from envd's answer to the command's.
        after = {side: statistics.median(a - b for b, a in v) for side, v in results.items()}
        emit("vm_first_command_after_boot_ms", after["remote"], "ms", "local layer",
             after["local"], rounds=rounds, stat="median",
             min_ratio=round(min(a - b for b, a in results["remote"])
                             / min(a - b for b, a in results["local"]), 3),
             remote_all=[round(a - b) for b, a in results["remote"]],
             local_all=[round(a - b) for b, a in results["local"]])
        emit("vm_bytes_fetched", statistics.median(remote_bytes), "bytes", "blob size",
             image.blob_size, goal="<= 0.1", all=remote_bytes)
    finally:
        close_runtime(loop, runtime, prefix, blockd)
        os.environ.pop("AENV_CHUNK_CACHE_DIR", None)
        os.environ.pop("AENV_REMOTE_BACKGROUND_BW", None)


# -- eviction policies ---------------------------------------------------------------------
# Chunk traces, in 1 MiB chunks: (blob, chunk index) per guest read, each access being R small
# reads of the chunk in a row (a 1 MiB chunk is read as 128 KiB NBD requests, and ZFile 4 KiB
# blocks: correlated references that say nothing about reuse). A sequential miss also fetches
# a readahead window, as the store does.
Access = tuple[str, int, bool]  # blob, chunk, sequential (readahead on a miss)
READS_PER_ACCESS = 8
READAHEAD = 8


def scan_with_hot_set(scan: int, hot: int, every: int) -> list[Access]:
    """A one-off sequential read of `scan` chunks (a 1 GiB image read once, a background
    completion) while a sandbox re-reads its `hot` chunks after every `every` scan chunks."""
    out: list[Access] = []
    for i in range(scan):
        if i % every == 0:
            out += [("hot", h, False) for h in range(hot)]
        out.append(("scan", i, True))
    return out + [("hot", h, False) for h in range(hot)]


def zipf_reads(chunks: int, n: int, seed: int = 3) -> list[Access]:
    """Random reads, a few chunks much hotter than the rest (Zipf, s = 1)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(chunks)]
    order = list(range(chunks))
    rng.shuffle(order)
    return [("z", order[k], False) for k in rng.choices(range(chunks), weights, k=n)]


def scan_twice(chunks: int) -> list[Access]:
    return [("scan", i, True) for _ in range(2) for i in range(chunks)]


def replay(policy: str, trace: list[Access], capacity_chunks: int) -> dict[str, Any]:
    """Drive the real ChunkCache (4 KiB chunks standing for 1 MiB ones: the policy sees chunk
    counts only) the way the store does: a read that misses fetches and inserts the chunk."""
    from agentenv.blockd.remote.cache import VERIFIED, ChunkCache

    cs = 4096
    chunk = bytes(cs)
    with tempfile.TemporaryDirectory(prefix="evict-") as tmp:
        cache = ChunkCache(Path(tmp), capacity_chunks * cs, chunk_size=cs, policy=policy)
        states = {}
        fetched = hits = accesses = 0
        seen: set[tuple[str, int]] = set()
        hot_hits = hot_accesses = 0
        peak = 0
        buf = memoryview(bytearray(512))
        for blob, idx, sequential in trace:
            if blob not in states:
                states[blob] = cache.blob(hashlib.sha256(blob.encode()).hexdigest(), 1 << 30)
            state = states[blob]
            accesses += 1
            # The reads of one access go forward through the chunk, as a guest's do.
            step = cs // READS_PER_ACCESS
            hit = cache.read(state, idx, 0, buf)
            if hit:
                hits += 1
            else:
                want = range(idx, min(idx + READAHEAD, state.nchunks)) if sequential else [idx]
                for i in want:
                    if not state.present[i]:
                        cache.insert(state, i, chunk, VERIFIED)
                        fetched += 1
                        seen.add((blob, i))
                peak = max(peak, cache.size)
            if blob == "hot":
                hot_accesses += 1
                hot_hits += hit
            for j in range(1, READS_PER_ACCESS):
                cache.read(state, idx, j * step, buf)
        evictions = cache.stats.evictions
        cache.close()
    if peak > capacity_chunks * cs:
        raise AssertionError(f"{policy}: cache held {peak} bytes, capacity {capacity_chunks * cs}")
    return {"hit_ratio": hits / accesses,
            "hot_hit_ratio": round(hot_hits / hot_accesses, 3) if hot_accesses else None,
            "fetched_mib": fetched,
            "refetched_mib": fetched - len(seen), "evictions": evictions}


def eviction(quick: bool) -> None:
    scan = 1024  # the 1 GiB image, read once
    cap = 256  # a 256 MiB cache: smaller than the scan plus the hot set
    cases: list[tuple[str, list[Access], int]] = [
        (f"scan 1 GiB + hot 32 MiB re-read every {g} MiB, cache {cap} MiB",
         scan_with_hot_set(scan, 32, g), cap) for g in ((64, 256) if quick else (16, 64, 256, 512))]
    cases.append((f"scan 4 GiB + hot 32 MiB re-read every 256 MiB, cache {cap} MiB",
                  scan_with_hot_set(4 * scan, 32, 256), cap))
    cases += [(f"zipf reads over 2 GiB, cache {cap} MiB", zipf_reads(2048, 20000 if quick else 60000),
               cap),
              (f"1 GiB read twice, cache {cap} MiB", scan_twice(scan), cap)]
    for name, trace, capacity in cases:
        lru = replay("lru", trace, capacity)
        twoq = replay("2q", trace, capacity)
        emit("eviction_fetched_mib", twoq["fetched_mib"], "MiB", "lru", lru["fetched_mib"],
             case=name, hit_ratio_2q=round(twoq["hit_ratio"], 3),
             hit_ratio_lru=round(lru["hit_ratio"], 3),
             hot_hit_ratio_2q=twoq["hot_hit_ratio"], hot_hit_ratio_lru=lru["hot_hit_ratio"],
             refetched_mib_2q=twoq["refetched_mib"], refetched_mib_lru=lru["refetched_mib"],
             evictions_2q=twoq["evictions"], evictions_lru=lru["evictions"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["reads", "vm", "eviction"], default=None,
                        help="run one part: the device reads (first reads, warm IOPS, P2P), "
                             "the VM boots or the eviction policies (in-process traces)")
    args = parser.parse_args()
    if args.only in (None, "eviction"):
        eviction(args.quick)
    if args.only == "eviction":
        return
    image = bigimage.build()
    root = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    (root / "registry").mkdir()
    os.environ["DOCKER_CONFIG"] = str(root / "docker")
    registry = start_registry(root / "registry")
    bench = Bench(root)
    try:
        bigimage.push(image, registry.host, "big", "v1")
        ref = f"{registry.host}/big:v1"
        span = 256 * MiB if args.quick else image.virtual_size
        if args.only in (None, "vm"):
            pulled = pull_image(ref, state_dir=root / "vm-state")
            vm_first_command(image, pulled.lowers[0], root / "registry", root,
                             3 if args.quick else 5)
        if args.only == "vm":
            return

        # 1. First reads: cold remote vs local layer.
        local = bench.node("local")
        local_json = root / "local.json"
        local_json.write_text(json.dumps({"lowers": [{"file": str(image.blob)}]}))
        local_ms = first_read(local, local_json, root / "out")
        remote = bench.node("remote", serve="127.0.0.1:0")
        pulled = pull_image(ref, state_dir=root / "remote-state")
        remote_ms = first_read(remote, pulled.image_json, root / "out")
        fetched = sum(stats(remote)["fetched_bytes"].values()) + pulled.bytes_downloaded
        emit("first_read_ms", remote_ms, "ms", "local layer", local_ms,
             goal="<= 2x", pull_ms=round(pulled.seconds * 1e3, 1))
        emit("bytes_fetched", fetched, "bytes", "blob size", image.blob_size, goal="<= 0.1")

        # 2. Warm chunk cache vs local layer: 4 KiB random reads in a region both hold.
        region = 128 * MiB
        remote_info = device(remote, pulled.image_json)
        local_info = device(local, local_json)
        read_all(remote_info, region)  # warm
        read_all(local_info, region)
        secs = 3.0 if args.quick else 10.0
        emit("warm_iops", iops(remote_info, region, secs), "reads/s", "local layer",
             iops(local_info, region, secs), goal=">= 0.8")

        # 3. P2P vs registry: two cold nodes, one reading from the remote node (warmed over
        # the span first), one from the registry.
        read_all(remote_info, span)
        port = stats(remote)["p2p"]
        from_registry = bench.node("reg")
        peer_node = bench.node("peer", peers=[port])
        reg_json = pull_image(ref, state_dir=root / "reg-state").image_json
        peer_json = pull_image(ref, state_dir=root / "peer-state").image_json
        reg_mbps = read_all(device(from_registry, reg_json), span)
        peer_mbps = read_all(device(peer_node, peer_json), span)
        peer_stats = stats(peer_node)
        emit("p2p_mbps", peer_mbps, "MiB/s", "registry", reg_mbps, goal=">= 0.7",
             peer_bytes=peer_stats["fetched_bytes"].get("peer", 0),
             registry_bytes=peer_stats["fetched_bytes"].get("registry", 0), span=span)
    finally:
        bench.close()
        stop_registry(registry)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

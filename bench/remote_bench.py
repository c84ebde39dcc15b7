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

Prints one JSON object per line. `--quick` reads 256 MiB instead of the whole disk for the
throughput figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.blockd.conftest import Daemon
from tests.blockd.nbdclient import NbdClient
from tests.remote import bigimage
from tests.template.conftest import _start_registry, _stop

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
        self.secret = root / "secret"
        self.secret.write_text(secrets.token_hex(16))

    def node(self, name: str, peers: list[str] = (), serve: str | None = None) -> Daemon:  # type: ignore[assignment]
        d = Daemon(Path(tempfile.mkdtemp(prefix=f"rb{name}", dir="/tmp")))
        d.extra_args = ["--chunk-cache-size", "4G", "--remote-background-bw", "0",
                        "--cluster-secret-file", str(self.secret)]
        for p in peers:
            d.extra_args += ["--peer", f"http://{p}"]
        if serve:
            d.extra_args += ["--p2p-listen", serve]
        d.start()
        self.daemons.append(d)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    image = bigimage.build()
    root = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    (root / "registry").mkdir()
    os.environ["DOCKER_CONFIG"] = str(root / "docker")
    registry = _start_registry(root / "registry", None)
    bench = Bench(root)
    try:
        bigimage.push(image, registry.host, "big", "v1")
        ref = f"{registry.host}/big:v1"
        span = 256 * MiB if args.quick else image.virtual_size

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
        _stop(registry)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

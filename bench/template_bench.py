"""Benchmark: OCI image -> overlaybd layers (aenv pull), cold and with a warm layer cache.

Builds a synthetic rootfs image (three gzip layers, the upper ones replacing and deleting files
of the lower), pushes it to Debian's docker-registry on loopback and pulls it through blockd.
Baseline, measured in the same run: GNU `tar -x` of the same layer blobs, one after the other,
into a loop-mounted ext4 on a 64 GiB sparse file (same mkfs options), including the unmount.

Prints one JSON object per line: metric, value, unit, baseline, baseline_value, ratio.
Needs root (loop devices, mounts, FUSE).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from agentenv.template.apply import apply_layer  # noqa: E402
from agentenv.template.convert import MKFS_ARGS, VIRTUAL_SIZE, PrivateBlockd, loop_mount  # noqa: E402
from agentenv.template.layercache import LayerCache  # noqa: E402
from agentenv.template.pull import _base_layer, pull_image  # noqa: E402


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _file_bytes(rng: random.Random, size: int) -> bytes:
    # Half random, half repetitive text: compresses roughly like real binaries + docs.
    half = size // 2
    text = (b"lorem ipsum dolor sit amet %d\n" % rng.randrange(1000)) * (half // 20 + 1)
    return rng.randbytes(size - half) + text[:half]


def build_layers(total_mib: int, seed: int = 7) -> list[bytes]:
    """Three uncompressed layers of about total_mib MiB together."""
    rng = random.Random(seed)
    sizes = [0.65, 0.25, 0.10]
    layers: list[bytes] = []
    names: list[str] = []
    for index, share in enumerate(sizes):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            budget = int(total_mib * share * (1 << 20))
            if index:
                for victim in rng.sample(names, min(len(names) // 20, 200)):
                    parent, _, base = victim.rpartition("/")
                    info = tarfile.TarInfo(f"{parent}/.wh.{base}")
                    tar.addfile(info, io.BytesIO(b""))
            d = 0
            while budget > 0:
                directory = f"usr/lib/pkg{index}-{d}"
                info = tarfile.TarInfo(directory)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
                for f in range(40):
                    size = int(rng.paretovariate(1.2) * 2000) if f % 10 else rng.randrange(200_000, 2_000_000)
                    size = min(size, budget, 8 << 20)
                    name = f"{directory}/file{f}.so"
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = size, 0o755 if f % 3 == 0 else 0o644, 1_600_000_000
                    tar.addfile(info, io.BytesIO(_file_bytes(rng, size)))
                    names.append(name)
                    if f % 7 == 0:
                        link = tarfile.TarInfo(f"{directory}/link{f}")
                        link.type, link.linkname = tarfile.SYMTYPE, f"file{f}.so"
                        tar.addfile(link)
                    budget -= size
                    if budget <= 0:
                        break
                d += 1
        layers.append(buffer.getvalue())
    return layers


class Registry:
    def __init__(self, work: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (work / "registry.yml").write_text(
            f"version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n"
            f"  filesystem:\n    rootdirectory: {work / 'registry'}\nhttp:\n  addr: 127.0.0.1:{self.port}\n")
        self.process = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/v2/", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("docker-registry did not start")

    def push(self, repo: str, tag: str, blobs: list[bytes], manifest: bytes) -> None:
        base = f"http://127.0.0.1:{self.port}/v2/{repo}"
        with httpx.Client(timeout=120) as http:
            for data in blobs:
                location = http.post(f"{base}/blobs/uploads/").headers["location"]
                sep = "&" if "?" in location else "?"
                http.put(f"{location}{sep}digest={_digest(data)}", content=data).raise_for_status()
            http.put(f"{base}/manifests/{tag}", content=manifest, headers={
                "Content-Type": "application/vnd.oci.image.manifest.v1+json"}).raise_for_status()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def make_image(layers: list[bytes]) -> tuple[list[bytes], list[bytes], bytes]:
    blobs = [gzip.compress(layer, compresslevel=1) for layer in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/sh"]},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(x) for x in layers]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _digest(b), "size": len(b)} for b in blobs],
    }).encode()
    return blobs, [config], manifest


def python_apply_plain_loop(blob_files: list[Path], diff_ids: list[str], work: Path) -> float:
    """Our applier onto a plain loop-mounted raw file: the conversion minus blockd/FUSE."""
    disk = work / "plain.raw"
    with open(disk, "wb") as f:
        f.truncate(VIRTUAL_SIZE)
    subprocess.run([*MKFS_ARGS, str(disk)], check=True)
    started = time.perf_counter()
    with loop_mount(disk, work / "plain-mnt") as root:
        for blob, diff_id in zip(blob_files, diff_ids, strict=True):
            apply_layer(root, blob, "application/vnd.oci.image.layer.v1.tar+gzip", diff_id)
    elapsed = time.perf_counter() - started
    disk.unlink()
    return elapsed


def baseline_tar(blob_files: list[Path], work: Path) -> float:
    disk = work / "baseline.raw"
    with open(disk, "wb") as f:
        f.truncate(VIRTUAL_SIZE)
    subprocess.run([*MKFS_ARGS, str(disk)], check=True)  # not timed: pulls reuse a base layer
    started = time.perf_counter()
    with loop_mount(disk, work / "baseline-mnt") as root:
        for blob in blob_files:
            subprocess.run(["tar", "-x", "-z", "--numeric-owner", "--same-permissions", "--xattrs",
                            "-f", str(blob), "-C", str(root)], check=True)
    elapsed = time.perf_counter() - started  # includes the unmount: the data reached the file
    disk.unlink()
    return elapsed


def emit(metric: str, value: float, unit: str, baseline: str | None, baseline_value: float | None) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value else None
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, "baseline": baseline,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 3),
                      "ratio": ratio}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small image (under 60 s)")
    parser.add_argument("--mib", type=int, default=None, help="uncompressed image size in MiB")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("template_bench needs root (loop devices, mounts, FUSE)")
    total_mib = args.mib or (48 if args.quick else 320)
    work = Path(tempfile.mkdtemp(prefix="aenv-template-bench-", dir="/var/tmp"))
    registry = Registry(work)
    blockd = PrivateBlockd(work)
    try:
        layers = build_layers(total_mib)
        blobs, configs, manifest = make_image(layers)
        registry.push("bench/rootfs", "v1", blobs + configs, manifest)
        blob_files = []
        for i, blob in enumerate(blobs):
            path = work / f"layer{i}.tar.gz"
            path.write_bytes(blob)
            blob_files.append(path)
        socket_path = blockd.start()
        ref = f"127.0.0.1:{registry.port}/bench/rootfs:v1"
        subprocess.run(["sync"], check=True)

        # The empty-ext4 base layer is made once per host; time it apart from the image.
        t0 = time.perf_counter()
        _base_layer(LayerCache(work / "state" / "layer-cache"))
        base_layer_s = time.perf_counter() - t0
        base_s = baseline_tar(blob_files, work)
        plain_s = python_apply_plain_loop(blob_files, [_digest(x) for x in layers], work)
        cold = pull_image(ref, name="cold", state_dir=work / "state", blockd=socket_path)
        warm = pull_image(ref, name="warm", state_dir=work / "state", blockd=socket_path)
        assert warm.layers_converted == 0 and warm.bytes_downloaded == 0
        layer_bytes = sum(p.stat().st_size for p in cold.lowers)

        emit("image_uncompressed_mib", sum(len(x) for x in layers) / (1 << 20), "MiB", None, None)
        emit("image_compressed_mib", sum(len(b) for b in blobs) / (1 << 20), "MiB", None, None)
        emit("base_layer_once_s", base_layer_s, "s", None, None)
        emit("pull_cold_s", cold.seconds, "s", "tar_x_loop_ext4_s", base_s)
        emit("convert_only_s", cold.timings.get("convert", 0.0), "s", "tar_x_loop_ext4_s", base_s)
        emit("apply_python_plain_loop_s", plain_s, "s", "tar_x_loop_ext4_s", base_s)
        emit("pull_warm_s", warm.seconds, "s", "tar_x_loop_ext4_s", base_s)
        emit("overlaybd_layers_mib", layer_bytes / (1 << 20), "MiB", None, None)
    finally:
        blockd.stop()
        registry.stop()
        if os.environ.get("AENV_BENCH_KEEP"):
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark: OCI image -> overlaybd layers (aenv pull), cold and with a warm layer cache.

Builds a synthetic rootfs image (three gzip layers, the upper ones replacing and deleting files
of the lower), pushes it to Debian's docker-registry on loopback and pulls it through blockd.
Baseline, measured in the same run: GNU `tar -x` of the same layer blobs, one after the other,
into a loop-mounted ext4 on a 64 GiB sparse file (same mkfs options), including the unmount.
Rounds alternate baseline and cold pull (the machine may be shared); figures are the best of
the rounds, with each round's values and ratio listed. References: our applier onto a plain
loop-mounted file (no blockd), and `tar -x` decompressing with ISA-L's igzip (as we do) when
the `igzip` tool is installed. The cold pull's steps (summed over its layers) are printed too.

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
import statistics
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
from agentenv.template.convert import (  # noqa: E402
    MKFS_ARGS,
    VIRTUAL_SIZE,
    loop_mount,
    private_blockd,
    start_private,
)
from agentenv.template.layercache import CONVERTER_KIND, LayerCache  # noqa: E402
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


def _entries(layer: bytes) -> int:
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        return len(tar.getmembers())


def rootfs_layers(rootfs_tar: Path, seed: int = 7) -> list[bytes]:
    """A real rootfs tarball (e.g. a debootstrap'ed Debian) cut into three layers in entry
    order, about 65/25/10 % of the bytes; the upper two delete some files of the lower."""
    rng = random.Random(seed)
    with tarfile.open(rootfs_tar) as source:
        members = source.getmembers()
        total = sum(m.size for m in members) or 1
        layers: list[bytes] = []
        names: list[str] = []
        start = 0
        for index, share in enumerate((0.65, 0.90, 1.0)):
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
                if index:
                    for victim in rng.sample(names, min(len(names) // 20, 200)):
                        parent, _, base = victim.rpartition("/")
                        tar.addfile(tarfile.TarInfo(f"{parent}/.wh.{base}" if parent else f".wh.{base}"))
                done = sum(m.size for m in members[:start])
                end = start
                while end < len(members) and (done < share * total or index == 2):
                    member = members[end]
                    tar.addfile(member, source.extractfile(member) if member.isreg() else None)
                    if member.isreg() and not member.name.endswith(".wh..wh..opq"):
                        names.append(member.name)
                    done += member.size
                    end += 1
                start = end
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


def _fresh_ext4(disk: Path) -> None:
    disk.unlink(missing_ok=True)
    with open(disk, "wb") as f:
        f.truncate(VIRTUAL_SIZE)
    subprocess.run([*MKFS_ARGS, str(disk)], check=True)  # not timed: pulls reuse a base layer
    subprocess.run(["sync"], check=True)


def python_apply_plain_loop(blob_files: list[Path], diff_ids: list[str], work: Path) -> float:
    """Our applier onto a plain loop-mounted raw file: the conversion minus blockd/FUSE."""
    disk = work / "plain.raw"
    _fresh_ext4(disk)
    started = time.perf_counter()
    with loop_mount(disk, work / "plain-mnt") as root:
        for blob, diff_id in zip(blob_files, diff_ids, strict=True):
            apply_layer(root, blob, "application/vnd.oci.image.layer.v1.tar+gzip", diff_id)
    elapsed = time.perf_counter() - started
    disk.unlink()
    return elapsed


def baseline_tar(blob_files: list[Path], work: Path, decompressor: str | None = None) -> float:
    """`tar -x` of the layers, one after the other, into a loop-mounted ext4, up to the end of
    the unmount (the data reached the file). `decompressor`: tar's -I program (default: -z,
    i.e. gzip(1))."""
    disk = work / "baseline.raw"
    _fresh_ext4(disk)
    how = ["-z"] if decompressor is None else ["-I", decompressor]
    started = time.perf_counter()
    with loop_mount(disk, work / "baseline-mnt") as root:
        for blob in blob_files:
            subprocess.run(["tar", "-x", *how, "--numeric-owner", "--same-permissions", "--xattrs",
                            "-f", str(blob), "-C", str(root)], check=True)
    elapsed = time.perf_counter() - started
    disk.unlink()
    return elapsed


def cold_phases(cache: LayerCache, lowers: list[Path]) -> dict[str, float]:
    """Per-step seconds of a cold conversion, summed over its layers (from the entries' meta)."""
    totals: dict[str, float] = {}
    for layer in lowers:
        meta_file = layer.parent / "meta.json"
        if layer.parent.parent.name != CONVERTER_KIND or not meta_file.exists():
            continue
        for name, seconds in json.loads(meta_file.read_text()).get("phases", {}).items():
            totals[name] = totals.get(name, 0.0) + seconds
    return totals


def emit(metric: str, value: float, unit: str, baseline: str | None, baseline_value: float | None,
         **extra: object) -> None:
    ratio = round(value / baseline_value, 3) if baseline_value else None
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, "baseline": baseline,
                      "baseline_value": None if baseline_value is None else round(baseline_value, 3),
                      "ratio": ratio, **extra}), flush=True)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small image (under 60 s)")
    parser.add_argument("--mib", type=int, default=None, help="uncompressed image size in MiB")
    parser.add_argument("--rootfs-tar", type=Path, default=None,
                        help="a real rootfs tarball (e.g. debootstrap output) to cut into the "
                             "three layers instead of the synthetic tree")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurement rounds, baseline and pull interleaved (default 3, quick 2)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("template_bench needs root (loop devices, mounts, FUSE)")
    total_mib = args.mib or (48 if args.quick else 320)
    rounds = args.rounds or (2 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="aenv-template-bench-", dir="/var/tmp"))
    registry = Registry(work)
    blockd = private_blockd(work)
    try:
        layers = rootfs_layers(args.rootfs_tar) if args.rootfs_tar else build_layers(total_mib)
        blobs, configs, manifest = make_image(layers)
        registry.push("bench/rootfs", "v1", blobs + configs, manifest)
        blob_files = []
        for i, blob in enumerate(blobs):
            path = work / f"layer{i}.tar.gz"
            path.write_bytes(blob)
            blob_files.append(path)
        diff_ids = [_digest(x) for x in layers]
        socket_path = start_private(blockd)
        ref = f"127.0.0.1:{registry.port}/bench/rootfs:v1"
        state = work / "state"
        cache = LayerCache(state / "layer-cache")
        subprocess.run(["sync"], check=True)

        # The empty-ext4 base layer is made once per host; time it apart from the image.
        t0 = time.perf_counter()
        _base_layer(cache)
        base_layer_s = time.perf_counter() - t0
        igzip = shutil.which("igzip")
        # The machine may be shared: baseline and pull alternate, and each figure is the best
        # of its rounds (the ratio compares bests; the per-round ratios are listed too).
        tar_s: list[float] = []
        tar_igzip_s: list[float] = []
        plain_s: list[float] = []
        cold_s: list[float] = []
        warm_s: list[float] = []
        phases: list[dict[str, float]] = []
        cold = None
        for _ in range(rounds):
            shutil.rmtree(cache.root / CONVERTER_KIND)  # cold again; the base layer stays
            (cache.root / CONVERTER_KIND).mkdir()
            tar_s.append(baseline_tar(blob_files, work))
            subprocess.run(["sync"], check=True)
            cold = pull_image(ref, name="cold", state_dir=state, blockd=socket_path)
            cold_s.append(cold.seconds)
            phases.append({**cold_phases(cache, cold.lowers),
                           "download_and_convert": cold.timings.get("convert", 0.0),
                           "resolve": cold.timings.get("resolve", 0.0)})
            warm = pull_image(ref, name="warm", state_dir=state, blockd=socket_path)
            assert warm.layers_converted == 0 and warm.bytes_downloaded == 0
            warm_s.append(warm.seconds)
            plain_s.append(python_apply_plain_loop(blob_files, diff_ids, work))
            if igzip:
                tar_igzip_s.append(baseline_tar(blob_files, work, igzip))
        assert cold is not None
        layer_bytes = sum(p.stat().st_size for p in cold.lowers[1:])
        best = cold_s.index(min(cold_s))
        pairwise = _rounded([c / t for c, t in zip(cold_s, tar_s, strict=True)])

        emit("image_uncompressed_mib", sum(len(x) for x in layers) / (1 << 20), "MiB", None, None,
             image=str(args.rootfs_tar or "synthetic"),
             entries=sum(_entries(x) for x in layers))
        emit("image_compressed_mib", sum(len(b) for b in blobs) / (1 << 20), "MiB", None, None)
        emit("base_layer_once_s", base_layer_s, "s", None, None)
        emit("pull_cold_s", min(cold_s), "s", "tar_x_loop_ext4_s", min(tar_s),
             rounds=_rounded(cold_s), baseline_rounds=_rounded(tar_s), round_ratios=pairwise,
             median_round_ratio=statistics.median(pairwise))
        for name, seconds in phases[best].items():
            emit(f"pull_cold_phase_{name}_s", seconds, "s", None, None)
        emit("apply_python_plain_loop_s", min(plain_s), "s", "tar_x_loop_ext4_s", min(tar_s),
             rounds=_rounded(plain_s))
        if tar_igzip_s:
            emit("pull_cold_vs_tar_igzip_s", min(cold_s), "s", "tar_x_igzip_loop_ext4_s",
                 min(tar_igzip_s), baseline_rounds=_rounded(tar_igzip_s))
        emit("pull_warm_s", max(warm_s), "s", "tar_x_loop_ext4_s", min(tar_s), rounds=_rounded(warm_s))
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

"""A >= 1 GiB overlaybd image for the remote-layer tests and bench: an ext4 root (a few small
files, a 16 MiB file and a 1 GiB random file, made with `mkfs.ext4 -d`) turned into one
ZFile (LZ4, block CRCs), tar-wrapped overlaybd layer by our converter (`import_raw`), as an
OCI image annotated the way containerd's overlaybd converter annotates its images.

Building it takes ~30 s, so the result is kept under /var/cache/aenv-test, keyed by the
converter's version and the build recipe; the random bytes come from numpy's PCG64 (fast,
seeded, so the same key gives the same bytes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from agentenv.storage.export import import_raw
from agentenv.template.layercache import CONVERTER_KIND
from tests.remote import chunktables

RECIPE_VERSION = 1
CACHE_ROOT = Path(os.environ.get("AENV_TEST_CACHE", "/var/cache/aenv-test"))
BIG = 1 << 30
MEDIUM = 16 << 20
SMALL_FILES = {"etc/hostname": b"remote-test\n", "hello.txt": b"hello from a remote layer\n",
               "etc/motd": b"lazy bytes\n"}
ANNOTATION = "containerd.io/snapshot/overlaybd/blob-digest"


@dataclass
class BigImage:
    folder: Path
    blob: Path  # the layer blob
    blob_digest: str
    blob_size: int
    config: bytes
    manifest: bytes
    virtual_size: int
    disk_sha256: str  # of the whole virtual disk
    big_sha256: str
    medium_sha256: str

    @property
    def manifest_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()


def _random_file(path: Path, size: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    hasher = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            block = rng.bytes(n)
            hasher.update(block)
            f.write(block)
            left -= n
    return hasher.hexdigest()


def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            hasher.update(block)
    return hasher.hexdigest()


def build(cache_root: Path = CACHE_ROOT, big: int = BIG) -> BigImage:
    key = hashlib.sha256(f"{RECIPE_VERSION} {CONVERTER_KIND} import_raw lz4 tar {big} "
                         f"{MEDIUM}".encode()).hexdigest()[:16]
    folder = cache_root / f"remote-image-{key}"
    record = folder / "image.json"
    if not record.exists():
        cache_root.mkdir(parents=True, exist_ok=True)
        work = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        (work / "root" / "etc").mkdir(parents=True)
        (work / "root" / "data").mkdir()
        for name, data in SMALL_FILES.items():
            (work / "root" / name).write_bytes(data)
        big_sha = _random_file(work / "root" / "data" / "big.bin", big, 1)
        medium_sha = _random_file(work / "root" / "data" / "medium.bin", MEDIUM, 2)
        raw = work / "disk.ext4"
        vsize = big + MEDIUM + (96 << 20)
        with open(raw, "wb") as f:
            f.truncate(vsize)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(work / "root"), "-E",
                        "root_owner=0:0,lazy_itable_init=0", "-U",
                        "6a1c1b9e-6a3c-4a5e-9a51-5a1e5a1e5a1e", str(raw)],
                       check=True, capture_output=True)
        shutil.rmtree(work / "root")
        disk_sha = _file_sha256(raw)
        blob = work / "layer.blob"
        import_raw(raw, blob, compress="lz4", tar=True)
        raw.unlink()
        blob_digest = "sha256:" + _file_sha256(blob)
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "config": {"Cmd": ["/bin/sh"]},
                             "rootfs": {"type": "layers", "diff_ids": [blob_digest]}}).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                       "size": len(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": blob_digest, "size": blob.stat().st_size,
                        "annotations": {ANNOTATION: blob_digest}}],
        }).encode()
        (work / "config.json").write_bytes(config)
        (work / "manifest.json").write_bytes(manifest)
        (work / "image.json").write_text(json.dumps({
            "blob_digest": blob_digest, "virtual_size": vsize, "disk_sha256": disk_sha,
            "big_sha256": big_sha, "medium_sha256": medium_sha}))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(work, folder)
    facts = json.loads(record.read_text())
    blob = folder / "layer.blob"
    return BigImage(folder, blob, facts["blob_digest"], blob.stat().st_size,
                    (folder / "config.json").read_bytes(), (folder / "manifest.json").read_bytes(),
                    facts["virtual_size"], facts["disk_sha256"], facts["big_sha256"],
                    facts["medium_sha256"])


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            yield block


def push(image: BigImage, host: str, repository: str, tag: str) -> None:
    """Upload the blobs (streamed) and the manifest with the registry API."""
    base = f"http://{host}/v2/{repository}"
    with httpx.Client(timeout=300) as http:
        for digest, source in ((image.blob_digest, image.blob),
                               ("sha256:" + hashlib.sha256(image.config).hexdigest(), image.config)):
            if http.head(f"{base}/blobs/{digest}").status_code == 200:
                continue
            start = http.post(f"{base}/blobs/uploads/")
            assert start.status_code == 202, start.text
            location = start.headers["location"]
            if location.startswith("/"):
                location = f"http://{host}{location}"
            sep = "&" if "?" in location else "?"
            body = _chunks(source) if isinstance(source, Path) else source
            size = source.stat().st_size if isinstance(source, Path) else len(source)
            done = http.put(f"{location}{sep}digest={digest}", content=body,
                            headers={"Content-Type": "application/octet-stream",
                                     "Content-Length": str(size)})
            assert done.status_code == 201, done.text
        # With the layer's chunk table, as agentenv's pushes publish it (peers may serve it).
        manifest = chunktables.annotate(
            image.manifest, lambda _digest: open(image.blob, "rb"))  # noqa: SIM115 (it closes)
        reply = http.put(f"{base}/manifests/{tag}", content=manifest,
                         headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert reply.status_code == 201, reply.text

"""Content-addressed cache of overlaybd layers made from (or pulled as) OCI layers.

    <root>/base/<hex>/layer                    the empty ext4 every converted image starts from
    <root>/ext4-v2/<key hex>/layer             a tar layer applied onto its parents' ext4,
                                               sealed; key = sha256(base digest + " " + OCI
                                               chain ID): the result depends on every layer
                                               below it
    <root>/overlaybd/<blob digest hex>/layer   an overlaybd-format layer blob, as pulled
    <root>/remote/<blob digest hex>/layer      a remote layer's descriptor (storage/blob.py):
                                               the blob stays in its registry, read on demand
    <root>/*/<hex>/meta.json                   what the entry was made from
    <root>/locks/<kind>-<hex>.lock             one converter at a time per entry (flock)
    <root>/blobs/<hex>                         downloads in flight (deleted once converted)
    <root>/work/                               scratch space for conversions (same filesystem,
                                               so results are published with one rename)

An entry directory appears only complete (it is built in work/ and renamed into place), so
its existence is the cache hit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentenv.settings import get_settings

CONVERTER_KIND = "ext4-v2"  # bump when the conversion (mkfs options, applier rules) changes
# v2: PAX times applied to the nanosecond (v1 rounded them through a float)
NATIVE_KIND = "overlaybd"
REMOTE_KIND = "remote"  # an overlaybd blob left in its registry: `layer` is its descriptor
BASE_KIND = "base"
LAYER_FILE = "layer"
META_FILE = "meta.json"


def layer_cache_dir(state_dir: Path) -> Path:
    """The node's layer cache: $AENV_LAYER_CACHE, else <state>/layer-cache."""
    return get_settings().layer_cache or Path(state_dir) / "layer-cache"


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI chain IDs: ChainID(L0) = DiffID(L0), ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln))."""
    chains: list[str] = []
    for diff_id in diff_ids:
        if not chains:
            chains.append(diff_id)
        else:
            chains.append("sha256:" + hashlib.sha256(f"{chains[-1]} {diff_id}".encode()).hexdigest())
    return chains


def converted_key(base_digest: str, chain_id: str) -> str:
    """Cache key of a converted layer: its chain, on top of which base layer."""
    return "sha256:" + hashlib.sha256(f"{base_digest} {chain_id}".encode()).hexdigest()


def file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()


def _hex(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    if algorithm != "sha256" or len(value) != 64:
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return value


class LayerCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for sub in (CONVERTER_KIND, NATIVE_KIND, REMOTE_KIND, BASE_KIND, "locks", "blobs", "work"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def entry_dir(self, kind: str, digest: str) -> Path:
        return self.root / kind / _hex(digest)

    def lookup(self, kind: str, digest: str) -> Path | None:
        """The cached layer file, or None."""
        layer = self.entry_dir(kind, digest) / LAYER_FILE
        return layer if layer.exists() else None

    def meta(self, kind: str, digest: str) -> dict[str, Any]:
        return dict(json.loads((self.entry_dir(kind, digest) / META_FILE).read_text()))

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive lock across processes (flock on a file under locks/)."""
        path = self.root / "locks" / f"{name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def entry_lock(self, kind: str, digest: str) -> contextlib.AbstractContextManager[None]:
        return self.lock(f"{kind}-{_hex(digest)}")

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / _hex(digest)

    def blob_lock(self, digest: str) -> contextlib.AbstractContextManager[None]:
        return self.lock(f"blob-{_hex(digest)}")

    @contextlib.contextmanager
    def workspace(self) -> Iterator[Path]:
        """A scratch directory on the cache's filesystem, removed afterwards. It holds a flock
        while in use, so `clean_stale_work` can tell the leftovers of a killed puller."""
        path = Path(tempfile.mkdtemp(dir=self.root / "work"))
        fd = os.open(path / ".in-use", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)

    def clean_stale_work(self) -> list[Path]:
        """Remove scratch directories whose puller is gone (their flock is free). One with a
        filesystem still mounted in it is left alone: unmounting is the operator's call."""
        removed = []
        for path in (self.root / "work").iterdir():
            marker = path / ".in-use"
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime < 60:
                    continue  # young: its owner may not have taken the lock yet
            try:
                fd = os.open(marker, os.O_RDWR)
            except (FileNotFoundError, NotADirectoryError):
                continue  # being created right now, or not ours
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use
            finally:
                os.close(fd)
            if os.path.ismount(path / "mnt"):  # where convert.py mounts
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        for blob in (self.root / "blobs").glob("*.partial.*"):
            pid = blob.name.split(".partial.")[1].split(".")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                blob.unlink(missing_ok=True)
        return removed

    def publish(self, kind: str, digest: str, staged_dir: Path, meta: dict[str, Any]) -> Path:
        """Move a staged entry (holding `layer`) into place; the caller holds the entry lock."""
        (staged_dir / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        layer = staged_dir / LAYER_FILE
        with open(layer, "rb") as f:
            os.fsync(f.fileno())
        final = self.entry_dir(kind, digest)
        if final.exists():  # a leftover without its layer file (lookup said miss)
            shutil.rmtree(final)
        os.replace(staged_dir, final)
        return final / LAYER_FILE

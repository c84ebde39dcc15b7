"""Layers whose bytes are not in a local file: remote blobs (docs/remote-layers.md).

A remote layer is named on disk by a small JSON *descriptor* file where a layer file would be
(`<layer-cache>/remote/<hex>/layer`): the blob's digest and size and where it can be fetched
(registry, repository). Everything that handles layers by path (image configs, snapshots,
the garbage collector) keeps working; only `layer.open_layer` looks inside: it hands the
descriptor to the process's *remote opener*, which returns a `BlobSource`, and reads the
layer's wrappers (tar, ZFile, LSMT) through it.

blockd installs its chunk cache as the opener (blockd/remote/store.py); any other process
gets, on first use, a private store under a temporary directory (for `aenv layer inspect`,
`aenv image export`, tests).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentenv import boundedjson
from agentenv.fsutil import atomic_write
from agentenv.storage.errors import LayerFormatError

DESCRIPTOR_KEY = "aenvRemoteLayer"
DESCRIPTOR_VERSION = 1
MAX_DESCRIPTOR_BYTES = 4 << 20  # (a chunk table: 43 KiB per GiB of blob)


class WouldBlock(Exception):
    """A read that would have to wait for the network, refused because the calling thread
    asked not to block (blockd's inline reads on its event loop, `nonblocking()`)."""


_local = threading.local()


@contextlib.contextmanager
def nonblocking() -> Iterator[None]:
    """Within this block, a read of a remote blob whose bytes are not local raises WouldBlock
    instead of fetching them."""
    old = getattr(_local, "nonblocking", False)
    _local.nonblocking = True
    try:
        yield
    finally:
        _local.nonblocking = old


def blocking_allowed() -> bool:
    return not getattr(_local, "nonblocking", False)


class BlobSource(Protocol):
    """Random read access to the bytes of one blob."""

    @property
    def size(self) -> int: ...

    def pread(self, length: int, offset: int) -> bytes:
        """Up to `length` bytes at `offset` (short only at the end of the blob)."""
        ...

    def readinto(self, offset: int, buf: memoryview) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BlobLocation:
    """One place a blob can be fetched from: a repository of an OCI registry."""

    registry: str  # as in the image reference: host[:port], docker.io for Docker Hub
    repository: str
    api_host: str | None = None  # where the registry API really is (registry-1.docker.io)
    insecure: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"registry": self.registry, "repository": self.repository}
        if self.api_host:
            out["apiHost"] = self.api_host
        if self.insecure is not None:
            out["insecure"] = self.insecure
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str) -> BlobLocation:
        if not isinstance(obj, dict) or not isinstance(obj.get("registry"), str) \
                or not isinstance(obj.get("repository"), str):
            raise LayerFormatError(where, None, "a remote layer source needs registry and "
                                                "repository strings")
        insecure = obj.get("insecure")
        return cls(obj["registry"], obj["repository"], obj.get("apiHost") or None,
                   insecure if isinstance(insecure, bool) else None)


@dataclass
class RemoteLayerRef:
    """What a descriptor file says."""

    digest: str
    size: int
    sources: list[BlobLocation] = field(default_factory=list)
    media_type: str = ""
    facts: dict[str, Any] = field(default_factory=dict)  # inspect_layer's answer, at pull
    path: Path | None = None
    # The blob's per-chunk SHA-256 table, as its manifest published it (the layer annotation
    # blockd/remote/chunkdigests.ANNOTATION): what lets blockd take its chunks from peers.
    chunk_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {DESCRIPTOR_KEY: DESCRIPTOR_VERSION, "digest": self.digest, "size": self.size,
               "mediaType": self.media_type, "sources": [s.to_json() for s in self.sources],
               "facts": self.facts}
        if self.chunk_sha256 is not None:
            doc["chunkSha256"] = self.chunk_sha256
        return doc

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_json(), indent=1) + "\n", mode=0o644)
        self.path = path


def is_descriptor(head: bytes) -> bool:
    """A descriptor is JSON; no layer blob starts with `{` (tar, ZFile and LSMT start with
    a name or a magic)."""
    return head.lstrip()[:1] == b"{" and DESCRIPTOR_KEY.encode() in head


def load_descriptor(path: Path) -> RemoteLayerRef:
    path = Path(path)
    try:
        raw = path.read_bytes()[:MAX_DESCRIPTOR_BYTES]
        doc = boundedjson.loads(raw, "the descriptor")
    except (OSError, ValueError) as exc:
        raise LayerFormatError(path, None, f"unreadable remote layer descriptor: {exc}") from exc
    if not isinstance(doc, dict) or doc.get(DESCRIPTOR_KEY) != DESCRIPTOR_VERSION:
        raise LayerFormatError(path, None, f"not a remote layer descriptor (version "
                                           f"{DESCRIPTOR_VERSION} expected)")
    digest, size = doc.get("digest"), doc.get("size")
    if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71:
        raise LayerFormatError(path, None, f"remote layer digest {digest!r} is not sha256")
    if not isinstance(size, int) or size <= 0:
        raise LayerFormatError(path, None, f"remote layer size {size!r} is not a byte count")
    sources = [BlobLocation.from_json(s, str(path)) for s in doc.get("sources") or []]
    facts = doc.get("facts") if isinstance(doc.get("facts"), dict) else {}
    table = doc.get("chunkSha256")
    return RemoteLayerRef(digest, size, sources, str(doc.get("mediaType") or ""), facts, path,
                          table if isinstance(table, str) else None)


RemoteOpener = Callable[[RemoteLayerRef], BlobSource]
_opener: RemoteOpener | None = None
#: makes the opener of a process that installed none (blockd's private chunk store: the
#: CLI, the node and tests install it: agentenv.blockd.remote.install_private_store)
_default_opener: Callable[[], RemoteOpener] | None = None
_opener_lock = threading.Lock()


def set_remote_opener(opener: RemoteOpener | None) -> None:
    """Install (or with None remove) the process's way to open remote layers."""
    global _opener
    with _opener_lock:
        _opener = opener


def set_default_remote_opener(factory: Callable[[], RemoteOpener] | None) -> None:
    """How a process that installed no opener reads remote layers (made at the first read)."""
    global _default_opener
    with _opener_lock:
        _default_opener = factory


def open_remote(ref: RemoteLayerRef) -> BlobSource:
    global _opener
    with _opener_lock:
        if _opener is None:
            if _default_opener is None:
                raise LayerFormatError(
                    ref.path, None, f"remote layer {ref.digest}: this process has no reader of "
                    "remote layers (blockd installs its chunk cache; other programs call "
                    "agentenv.blockd.remote.install_private_store())")
            _opener = _default_opener()
        opener = _opener
    return opener(ref)

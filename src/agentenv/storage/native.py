"""`NativeImage`: an `Image` whose data path runs in the native core (storage/_native.cpp).

The core does reads, writes, discards and flushes without the GIL, and serves NBD
connections on threads of their own (blockd/nbd.py hands them over after negotiation).
Python keeps the format's reference code and the control plane: the merged read-only index
is built here (Image.__init__) and handed to the core as int64 arrays; a seal, a resize or a
close pauses the core (in-flight requests finish, new ones wait), takes the upper's state
back into the Python `Upper` (index, append position, index-log position), runs the
reference code, and binds the resulting stack to the core again. The files the core writes
are byte-identical to what `Upper` writes for the same operations (tests/storage/
test_native.py checks it).

ZFile layers are decoded by the core (LZ4 by its own decoder, ZSTD by libzstd). A remote
layer is read by the core from the chunk cache (its `ChunkMap`), and through Python only for
the chunks it misses; everything else never enters Python per request.

`AENV_BLOCKD_NATIVE=0` turns the native core off (blockd then opens plain `Image`s); so does
a build without the extension (`available()` says why).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agentenv.settings import setting_text
from agentenv.storage import budget
from agentenv.storage.budget import NodeDiskFull
from agentenv.storage.errors import ImageUsageError
from agentenv.storage.image import Image
from agentenv.storage.lsmt import FlatIndex
from agentenv.storage.upper import UpperFull
from agentenv.storage.zfile import ALGO_LZ4, ALGO_ZSTD, ZFileReader

log = logging.getLogger("agentenv.storage.native")

try:
    from agentenv.storage import _native
except ImportError as exc:  # built without the extension: the Python path serves
    _native = None  # type: ignore[assignment]
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

ENV_SWITCH = "AENV_BLOCKD_NATIVE"


def available() -> bool:
    return _native is not None


def unavailable_reason() -> str | None:
    return None if _IMPORT_ERROR is None else str(_IMPORT_ERROR)


def enabled() -> bool:
    """Whether blockd should open images on the native core: built, and not switched off."""
    switch = setting_text(ENV_SWITCH).strip().lower()
    if switch not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ImageUsageError(f"{ENV_SWITCH}={switch!r}: use 1 (native core) or 0 (Python)")
    return available() and switch not in ("0", "false", "no", "off")


def configure_disk_budget(reserve: int | None, grant: int = budget.GRANT) -> None:
    """The node's disk budget (storage/budget.py) for every upper of this process, on both
    paths (None: off)."""
    budget.configure(reserve, grant)
    if _native is not None:
        _native.set_disk_budget(-1 if reserve is None else reserve, grant)


def chunk_map(marks: bytes) -> Any:
    """The chunk cache's presence marks of one blob (blockd/remote/cache.py): a ChunkMap
    the cores read without the GIL when the core is built, else a bytearray."""
    return bytearray(marks) if _native is None else _native.ChunkMap(marks)


def _remote_spec(source: Any, stream_size: int) -> tuple[Any, int, int, int] | None:
    """(chunk map, cache fd, chunk size, stream size) of a remote blob whose cache the core
    can read (blockd/remote/store.py RemoteBlob.native_view), else None."""
    view = getattr(source, "native_view", None)
    got = view() if view is not None else None
    if got is None:
        return None
    chunks, fd, chunk_size = got
    return chunks, fd, chunk_size, stream_size


_ZFILE_SPECS: weakref.WeakKeyDictionary[ZFileReader, tuple[bytes, int, int, bool]] = \
    weakref.WeakKeyDictionary()


def _zfile_spec(reader: ZFileReader) -> tuple[bytes, int, int, bool, bool]:
    """The jump table as the core reads it (made once per open layer, not at every bind)."""
    spec = _ZFILE_SPECS.get(reader)
    if spec is None:
        spec = _ZFILE_SPECS[reader] = (np.asarray(reader.offsets, dtype=np.int64).tobytes(),
                                       reader.block_size, reader.size, reader.verify,
                                       reader.algo == ALGO_ZSTD)
    return spec


def _arrays(index: FlatIndex) -> tuple[bytes, bytes, bytes, bytes]:
    return tuple(np.asarray(column, dtype=np.int64).tobytes()  # type: ignore[return-value]
                 for column in (index.starts, index.ends, index.moffsets, index.layers))


def _lists(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype=np.int64).tolist()  # type: ignore[no-any-return]


class NativeImage(Image):
    """An Image served by the native core; same API and on-disk result as Image."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _native is None:
            raise ImageUsageError(f"the native core is not built: {_IMPORT_ERROR}")
        super().__init__(*args, **kwargs)
        self._core = _native.Core()
        self._bind()

    @property
    def native_core(self) -> Any:
        """The core, for blockd's NBD server to run connections on (`serve`)."""
        return self._core

    @property
    def reading_core(self) -> Any:
        """The core, for readers on threads of their own that may wait for a remote piece
        (memfs's FUSE workers, blockd/memfs.py): every stack, remote layers included."""
        return self._core

    # -- handing state between the core and the reference code ------------------------------

    def _bind(self) -> None:
        """Give the core the current view: merged index, layer sources, upper state."""
        v = self._view
        layers = [self._layer_spec(src, base) for src, base in zip(v.srcs, v.bases, strict=True)]
        up = v.upper
        upper = None
        if up is not None:
            writable = self._writable and up.writable and up.index_fd is not None
            if writable:
                up.write_log()  # the core starts with nothing queued
            upper = (up.data_fd, up.index_fd if up.index_fd is not None else -1, up.data_eof,
                     up.index_eof, up.log_entries, up.rw_tag, _arrays(up.index),
                     -1 if up.limit is None else up.limit, up.reuse, up.log_buffer, writable)
        self._core.configure(v.vsize, _arrays(v.ro), layers, self._read_foreign, upper,
                             self._upper_full)

    @staticmethod
    def _layer_spec(src: Any, base: int) -> tuple[Any, ...]:
        """How the core reads a layer slot: (fd, base, through Python?[, remote[, zfile]]).

        A remote layer on a chunk cache with a ChunkMap is read by the core from the cache
        (remote: (map, cache fd, chunk size, stream size)); a ZFile layer (LZ4 or ZSTD),
        local or remote, is decoded by the core (zfile: (block starts, block size, stream
        size, verify, zstd?)). What the core misses or cannot check goes through
        `_read_foreign`."""
        if type(src) is int:
            return (src, base, False)
        if isinstance(src, ZFileReader):
            if src.algo not in (ALGO_LZ4, ALGO_ZSTD):
                return (-1, 0, True)
            zf = _zfile_spec(src)
            if src.blob is None:
                return (src.fd, 0, False, None, zf)
            remote = _remote_spec(src.blob, src.blob.size)
            return (-1, 0, True) if remote is None else (-1, 0, False, remote, zf)
        remote = _remote_spec(src.blob, src.size)
        return (-1, 0, True) if remote is None else (-1, base, False, remote)

    def _read_foreign(self, slot: int, pos: int, buf: memoryview, serving: bool) -> int:
        """A ZFile or remote layer's bytes, for the core (called with the GIL). On a native
        serving thread a failure is logged here and answered with EIO; a Python caller gets
        the exception itself."""
        src = self._view.srcs[slot]
        if not serving:
            return src.readinto(pos, buf)  # type: ignore[union-attr]
        try:
            return src.readinto(pos, buf)  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("layer read failed", extra={"layer": str(self._view.layers[slot].path),
                                                    "offset": pos, "error": str(exc)})
            return -1

    def _upper_full(self, used: int, need: int, limit: int, node: bool) -> OSError:
        """The core's ENOSPC as the Python path raises it: the node's budget (used: the free
        bytes, limit: the reserve) or the disk's cap."""
        if node:
            return NodeDiskFull(used, need, limit)
        up = self._view.upper
        assert up is not None
        return UpperFull(up.data_path, used, need, limit)

    def _sync_out(self) -> None:
        """Copy the core's upper state into the Python Upper (the core is paused)."""
        up = self._view.upper
        if up is None or not self._writable or up.index_fd is None:
            return
        data_eof, index_eof, entries, (s, e, m, lay) = self._core.export_upper()
        up.data_eof, up.index_eof, up.log_entries = data_eof, index_eof, entries
        up.pending_log.clear()
        up.pending_bytes = 0
        with up.index_lock:
            up.index = FlatIndex(_lists(s), _lists(e), _lists(m), _lists(lay))

    @contextlib.contextmanager
    def _handoff(self) -> Iterator[None]:
        """Pause the core and give the reference code the upper; rebind afterwards."""
        self._core.pause()
        try:
            self._sync_out()
            yield
        finally:
            try:
                if not self._closed:
                    self._bind()
            finally:
                self._core.resume()

    # -- data path ---------------------------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        if length <= 0 or offset < 0 or offset + length > self._view.vsize or self._closed:
            self._check_range(self._view, offset, length)
            return b""
        return self._core.read(offset, length)  # type: ignore[no-any-return]

    def readinto(self, offset: int, buf: bytearray | memoryview) -> int:
        mv = memoryview(buf).cast("B")
        self._check_range(self._view, offset, len(mv))
        if mv:
            self._core.readinto(offset, mv)
        return len(mv)

    def read_pieces(self, offset: int, length: int) -> list[bytes | bytearray | memoryview]:
        self._check_range(self._view, offset, length)
        return [self._core.read(offset, length)] if length else []

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        self._check_writable()
        self._check_range(self._view, offset, len(data))
        if data:
            self._core.write(offset, data)

    def _zero_range(self, offset: int, length: int) -> None:
        self._check_writable()
        self._check_range(self._view, offset, length)
        self._core.zero(offset, length)

    def flush(self) -> None:
        if self._closed:
            raise ImageUsageError("image is closed")
        if self._writable and self._view.upper is not None:
            self._core.flush()

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        with self._handoff():
            listed = list(super().extents())
        return iter(listed)

    def allocation(self, offset: int, length: int, max_runs: int) -> list[tuple[int, bool]]:
        """(length, has_data) runs covering [offset, offset+length) (at most `max_runs`)."""
        self._check_range(self._view, offset, length)
        return self._core.allocation(offset, length, max_runs)  # type: ignore[no-any-return]

    # -- control plane -------------------------------------------------------------------------

    @property
    def upper_used(self) -> int:
        return self._core.upper_used  # type: ignore[no-any-return]

    def _apply_upper_cap(self) -> None:
        super()._apply_upper_cap()
        cap = self._upper_cap()
        self._core.set_limit(-1 if cap is None else cap)

    def resize(self, new_size: int) -> None:
        with self._handoff():
            super().resize(new_size)

    def snapshot_and_restack(self, sealed_path: Path) -> Path:
        with self._handoff():
            return super().snapshot_and_restack(sealed_path)

    def close(self) -> None:
        if self._closed:
            return
        self._core.pause()
        try:
            self._sync_out()
            self._core.close()  # requests still coming get "closed" (EIO over NBD)
            super().close()
        finally:
            self._core.resume()

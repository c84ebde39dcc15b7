"""The writable upper layer: append-only `upper.data` plus the `upper.index` log (docs/overlaybd.md §4.1).

Every write appends its data at the data file's EOF and one 16-byte mapping per <= 4 MiB piece
to the index log; discards and write-zeroes append zeroed mappings (<= 16383 sectors each)
with no data. The in-memory index (sector units; layer 0 = data, ZEROED) is rebuilt at open by
replaying the log in file order (later entries override earlier ones). `seal_in_place` turns
the data file into a sealed read-only layer exactly as C++ `close_seal` does (docs/overlaybd.md §4.3).

Growth cap and reuse: a write whose whole range is already mapped to upper data is written
over that data in place (no append, no log entry), so a guest rewriting the same blocks (a
log file, a database page) does not grow the upper; the file stays a valid overlaybd upper.
Anything else appends, and `limit` (bytes of data plus index log, None = no cap) refuses an
append that would pass it with `UpperFull` (an OSError with ENOSPC: blockd answers the NBD
request with ENOSPC, the upper stays as it was). Appends also stay within the node's disk
budget when one is configured (storage/budget.py: `NodeDiskFull`, ENOSPC too).

Concurrency: the caller serialises writers; readers look up `index` while holding
`index_lock`, which writers take only while mutating the in-memory index. A reader that
resolved a mapping preads it after releasing the lock: an in-place overwrite racing with it
may show it old or new data, which is what overlapping in-flight requests get from a disk.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from agentenv.fsutil import fsync_dir
from agentenv.storage import budget
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.lsmt import (
    FLAG_DATA,
    FLAG_HEADER,
    FLAG_SEALED,
    FLAG_SPARSE_RW,
    HT_BLOCK,
    HT_SECTORS,
    MAX_IO_SIZE,
    MAX_LENGTH,
    MAX_RW_ENTRIES,
    SECTOR,
    ZEROED,
    FlatIndex,
    HeaderTrailer,
    decode_mappings,
    encode_mapping,
    random_uuid,
)

UPPER_DATA = "upper.data"
UPPER_INDEX = "upper.index"
LOG_BUFFER = 1 << 20


class UpperFull(OSError):
    """An append would take the upper past its cap (errno ENOSPC)."""

    def __init__(self, path: Path, size: int, need: int, limit: int) -> None:
        super().__init__(errno.ENOSPC,
                         f"upper {path.parent} is full: {size} bytes used, a write needs "
                         f"{need} more, the cap is {limit} bytes")
        self.used, self.need, self.limit = size, need, limit


def is_upper_path(path: Path) -> bool:
    """True for an upper directory (holds upper.data) or a data file beside an upper.index."""
    if path.is_dir():
        return (path / UPPER_DATA).exists()
    if path.name == UPPER_DATA or (path.parent / UPPER_INDEX).exists():
        with open(path, "rb") as f:
            block = f.read(HT_BLOCK)
        try:
            ht = HeaderTrailer.unpack(block, path, 0)
        except LayerFormatError:
            return False
        if (path.parent / UPPER_INDEX).exists() and ht.is_header:
            size = os.path.getsize(path)
            if size >= 2 * HT_BLOCK:
                with open(path, "rb") as f:
                    f.seek(size - HT_BLOCK)
                    try:
                        tr = HeaderTrailer.unpack(f.read(HT_BLOCK), path, size - HT_BLOCK)
                        if tr.is_sealed and not tr.is_header:
                            return False  # sealed in place: a read-only layer now
                    except LayerFormatError:
                        pass
            return True
    return False


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, pos: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwrite(fd, mv, pos)
        mv = mv[n:]
        pos += n


class Upper:
    """An open writable (or read-only opened) upper layer. Offsets are in sectors."""

    #: Index-log bytes queued in memory before they are written to upper.index. blockd sets
    #: 0: a write it acknowledged must survive the daemon's death (in the page cache), since
    #: the client reconnects to the next daemon and a later flush there must cover it.
    log_buffer = LOG_BUFFER

    def __init__(self, data_path: Path, index_path: Path, data_fd: int, index_fd: int | None,
                 data_header: HeaderTrailer, index: FlatIndex, data_eof: int, index_eof: int,
                 log_entries: int, writable: bool, rw_tag: int) -> None:
        self.data_path = data_path
        self.index_path = index_path
        self.data_fd = data_fd
        self.index_fd = index_fd
        self.data_header = data_header
        self.index = index
        self.index_lock = threading.Lock()
        self.data_eof = data_eof
        self.index_eof = index_eof
        self.log_entries = log_entries
        self.writable = writable
        self.rw_tag = rw_tag
        self.pending_log: list[bytes] = []
        self.pending_bytes = 0
        self.limit: int | None = None  # cap on used_bytes for appends (see module docstring)
        self.grant_left = 0  # growth the node's disk budget granted, not used yet (budget.py)
        self.reuse = True  # overwrite fully mapped ranges in place

    # -- creation and opening ------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, virtual_size: int, *, uuid: str | None = None,
               parent_uuid: str | None = None, rw_tag: int = 0) -> Upper:
        """Write an empty RW pair (as `overlaybd-create`) atomically, then open it."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # a sandbox's disk: private
        uuid = uuid or random_uuid()
        data_hdr = HeaderTrailer(flags=FLAG_HEADER | FLAG_DATA, virtual_size=virtual_size,
                                 uuid=uuid, parent_uuid=parent_uuid or "")
        index_hdr = HeaderTrailer(flags=FLAG_HEADER, index_offset=HT_BLOCK,
                                  virtual_size=virtual_size, uuid=uuid,
                                  parent_uuid=parent_uuid or "")
        # Index first: after a crash between the two renames the data file is still the
        # previous (sealed) one, which Image.open recognises and rolls forward.
        for name, block in ((UPPER_INDEX, index_hdr.pack()), (UPPER_DATA, data_hdr.pack())):
            tmp = directory / f".{name}.tmp-{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / name)
        fsync_dir(directory)
        return cls.open(directory, writable=True, rw_tag=rw_tag)

    @classmethod
    def open(cls, directory: Path | None = None, *, writable: bool = True,
             data_path: Path | None = None, index_path: Path | None = None,
             rw_tag: int = 0) -> Upper:
        """Open an RW pair with the C++ open_file_rw checks; replays the index log."""
        if data_path is None or index_path is None:
            if directory is None:
                raise ValueError("give the upper directory or both file paths")
            data_path = data_path or directory / UPPER_DATA
            index_path = index_path or directory / UPPER_INDEX
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        fds: list[int] = []
        try:
            for p in (data_path, index_path):
                try:
                    fds.append(os.open(p, flags))
                except FileNotFoundError as exc:
                    raise LayerFormatError(p, None, "upper file does not exist") from exc
            dfd, ifd = fds
            data_size = os.fstat(dfd).st_size
            index_size = os.fstat(ifd).st_size
            if data_size < HT_BLOCK:
                raise LayerFormatError(data_path, 0, f"truncated upper data file: {data_size} bytes")
            if index_size < HT_BLOCK:
                raise LayerFormatError(index_path, 0, f"truncated upper index: {index_size} bytes")
            dh = HeaderTrailer.unpack(os.pread(dfd, HT_BLOCK, 0), data_path, 0)
            if not dh.is_header or not dh.is_data:
                raise LayerFormatError(data_path, 28, f"not an upper data header (flags {dh.flags:#x})")
            if dh.is_sparse:
                raise LayerFormatError(data_path, 28, "sparse RW uppers are not supported")
            ih = HeaderTrailer.unpack(os.pread(ifd, HT_BLOCK, 0), index_path, 0)
            if ih.is_data or ih.is_sealed or ih.index_offset != HT_BLOCK:
                raise LayerFormatError(index_path, 28,
                                       f"not an upper index header (flags {ih.flags:#x}, "
                                       f"index_offset {ih.index_offset})")
            count = (index_size - HT_BLOCK) // 16  # C++ floors a torn last entry away
            if count > MAX_RW_ENTRIES:
                raise LayerFormatError(index_path, HT_BLOCK, f"index log of {count} entries is too big")
            raw = os.pread(ifd, count * 16, HT_BLOCK)
            offsets, lengths, moffsets, zeroed, _tags = decode_mappings(raw)
            data_sectors = data_size // SECTOR
            index = FlatIndex()
            for i, (off, ln, mo, z) in enumerate(
                    zip(offsets, lengths, moffsets, zeroed, strict=True)):
                if z:
                    ok = HT_SECTORS <= mo <= data_sectors
                else:
                    ok = mo >= HT_SECTORS and mo + ln <= data_sectors
                if not ok:
                    raise LayerFormatError(
                        index_path, HT_BLOCK + 16 * i,
                        f"index entry {i} maps sectors [{mo}, {mo + ln}) outside the data file "
                        f"({data_sectors} sectors)")
                index.insert(off, off + ln, mo, ZEROED if z else 0)
            # Appends go to the first sector boundary at or after EOF.
            data_eof = -(-data_size // SECTOR) * SECTOR
            return cls(Path(data_path), Path(index_path), dfd, ifd, dh,
                       index, data_eof, HT_BLOCK + count * 16, count, writable, rw_tag)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    # -- properties ----------------------------------------------------------------------

    @property
    def virtual_size(self) -> int:
        return self.data_header.virtual_size

    @property
    def uuid(self) -> str:
        return self.data_header.uuid

    @property
    def data_size(self) -> int:
        return self.data_eof - HT_BLOCK

    @property
    def used_bytes(self) -> int:
        """What the cap counts: data appended plus index-log entries (headers excluded)."""
        return self.data_eof - HT_BLOCK + 16 * self.log_entries

    def _reserve(self, data_bytes: int, entries: int) -> None:
        """Room for an append: within the cap, then within the node's disk budget."""
        need = data_bytes + 16 * entries
        if not need:  # an in-place rewrite: no growth, nothing to refuse
            return
        limit = self.limit
        if limit is not None:
            used = self.used_bytes
            if used + need > limit:
                raise UpperFull(self.data_path, used, need, limit)
        if need <= self.grant_left:
            self.grant_left -= need
        else:
            budget.take(self, need)

    # -- mutation (caller serialises writers) -----------------------------------------------

    def _append_log(self, entries: list[bytes]) -> None:
        """Queue index-log entries; they reach the file at flush() (or when 1 MiB queue up).
        Nothing is durable before flush anyway, and data always precedes its entry on disk."""
        self.pending_log.extend(entries)
        self.pending_bytes += 16 * len(entries)
        self.log_entries += len(entries)
        if self.pending_bytes >= self.log_buffer:
            self.write_log()

    def write_log(self) -> None:
        """Write queued index-log entries to upper.index (no fsync)."""
        if not self.pending_log:
            return
        blob = b"".join(self.pending_log)
        pwrite_all(self.index_fd, blob, self.index_eof)  # type: ignore[arg-type]
        self.index_eof += len(blob)
        self.pending_log.clear()
        self.pending_bytes = 0

    def write_extent(self, sector: int, data: bytes | bytearray | memoryview) -> None:
        """Write sector-aligned data for virtual sector `sector`: the parts the upper already
        holds data for are written over it in place, the rest appended (split at 4 MiB).
        Only writers change the index, and they are serialised, so a mapping looked up here
        cannot move before the pwrite. The cap is checked before anything is written."""
        n = len(data)
        if self.reuse:
            end = sector + (n >> 9)
            with self.index_lock:
                own = [p for p in self.index.lookup(sector, end) if p[3] == 0]
            if own:
                gaps: list[tuple[int, int]] = []
                pos = sector
                for s, ln, _mo, _layer in own:
                    if s > pos:
                        gaps.append((pos, s - pos))
                    pos = s + ln
                if pos < end:
                    gaps.append((pos, end - pos))
                self._reserve(sum(ln for _s, ln in gaps) * SECTOR,
                              sum(-(-ln * SECTOR // MAX_IO_SIZE) for _s, ln in gaps))
                mv = memoryview(data)
                for s, ln, mo, _layer in own:
                    rel = (s - sector) * SECTOR
                    pwrite_all(self.data_fd, mv[rel : rel + ln * SECTOR], mo * SECTOR)
                for s, ln in gaps:
                    rel = (s - sector) * SECTOR
                    self._append(s, mv[rel : rel + ln * SECTOR])
                return
        self._reserve(n, -(-n // MAX_IO_SIZE))
        self._append(sector, data)

    def _append(self, sector: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if n <= MAX_IO_SIZE:
            at = self.data_eof
            written = os.pwrite(self.data_fd, data, at)
            if written != n:  # short write: finish it
                pwrite_all(self.data_fd, memoryview(data)[written:], at + written)
            self.data_eof = at + n
            mo = at >> 9
            count = n >> 9
            self._append_log([encode_mapping(sector, count, mo, False, self.rw_tag)])
            with self.index_lock:
                self.index.insert(sector, sector + count, mo, 0)
            return
        mv = memoryview(data)
        entries: list[bytes] = []
        inserts: list[tuple[int, int, int]] = []
        pos = 0
        while pos < len(mv):
            chunk = mv[pos : pos + MAX_IO_SIZE]
            at = self.data_eof
            pwrite_all(self.data_fd, chunk, at)
            self.data_eof += len(chunk)
            s = sector + pos // SECTOR
            n = len(chunk) // SECTOR
            entries.append(encode_mapping(s, n, at // SECTOR, False, self.rw_tag))
            inserts.append((s, n, at // SECTOR))
            pos += len(chunk)
        self._append_log(entries)
        with self.index_lock:
            for s, n, mo in inserts:
                self.index.insert(s, s + n, mo, 0)

    def zero_extent(self, sector: int, count: int) -> None:
        """Record a zeroed mapping (discard / write-zeroes), split at 16383 sectors."""
        self._reserve(0, -(-count // MAX_LENGTH))
        entries: list[bytes] = []
        inserts: list[tuple[int, int]] = []
        mo = self.data_eof // SECTOR
        while count > 0:
            n = min(count, MAX_LENGTH)
            entries.append(encode_mapping(sector, n, mo, True, self.rw_tag))
            inserts.append((sector, n))
            sector += n
            count -= n
        self._append_log(entries)
        with self.index_lock:
            for s, n in inserts:
                self.index.insert(s, s + n, mo, ZEROED)

    def flush(self) -> None:
        """Data first, then the index log (so a durable entry never points at lost data)."""
        os.fsync(self.data_fd)
        if self.index_fd is not None:
            self.write_log()
            os.fsync(self.index_fd)

    def set_virtual_size(self, size: int) -> None:
        """Rewrite `virtual_size` in both headers (C++ update_vsize)."""
        raw = size.to_bytes(8, "little")
        pwrite_all(self.data_fd, raw, 48)
        if self.index_fd is not None:
            pwrite_all(self.index_fd, raw, 48)
        self.data_header = self.data_header.with_(virtual_size=size)

    def sealed_index_bytes(self) -> bytes:
        """The in-memory index dumped as C++ close_seal does: sorted, zeroed included, tag 0."""
        parts = [
            encode_mapping(s, e - s, m, lay == ZEROED, 0)
            for s, e, m, lay in zip(self.index.starts, self.index.ends, self.index.moffsets,
                                    self.index.layers, strict=True)
        ]
        return b"".join(parts)

    def seal_in_place(self) -> HeaderTrailer:
        """Append index, zero padding to 512 and the trailer to the data file; fsync.

        The header is not rewritten; the trailer takes vsize, uuid and parent from the header
        and has an empty user_tag (C++ close_seal layout, TV4 in docs/overlaybd.md §11)."""
        index = self.sealed_index_bytes()
        ioff = self.data_eof
        pad = (-len(index)) % SECTOR
        flags = FLAG_DATA | FLAG_SEALED | (self.data_header.flags & FLAG_SPARSE_RW)
        trailer = self.data_header.with_(flags=flags, index_offset=ioff,
                                         index_size=len(index) // 16, user_tag=b"")
        pwrite_all(self.data_fd, index + bytes(pad) + trailer.pack(), ioff)
        os.fsync(self.data_fd)
        self.data_eof = ioff + len(index) + pad + HT_BLOCK
        return trailer

    def close(self) -> None:
        """Write queued index entries (without fsync) and close both files."""
        if self.writable and self.index_fd is not None and self.data_fd >= 0:
            self.write_log()
        for fd in (self.data_fd, self.index_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.data_fd = -1
        self.index_fd = None
        self.grant_left = 0  # back to the node's budget

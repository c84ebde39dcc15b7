"""Apply an OCI/Docker layer tarball onto a directory, as containerd's naive applier does.

Rules (containerd `archive.Apply` without overlay whiteout conversion):
* `.wh.NAME` removes NAME; `.wh..wh..opq` empties its directory of everything this layer has
  not itself unpacked;
* an existing path is replaced unless both it and the entry are directories (then only the
  metadata changes);
* parent paths are resolved inside the root (symlinks never lead out of it), the last
  component is not followed;
* ownership is numeric (uid/gid from the header), then xattrs, then the mode (setuid, setgid
  and sticky kept; symlinks keep theirs), then times; directory times are set at the end;
* hard links, symlinks, character and block devices and fifos are created as such.
The uncompressed stream is hashed to check the layer's diff_id from the image config.

Hostile layers: a name or hard-link target whose `..` climbs above the root, and whiteouts
naming '', '.' or '..', are refused (LayerApplyError), never clamped. tarfile is used only to
parse headers (never to extract): its header-parsing CVEs (CVE-2024-6232's quadratic PAX
regexes on this 3.11.7, headers read whole into memory) are closed by our checks before its
code sees the bytes (_TarInfo._proc_pax/_proc_gnulong), whatever the interpreter's patch level;
a parser subprocess with a time limit would cost the pipelined applier its speed.

Speed (bench/template_bench.py): a worker thread inflates (ISA-L for gzip, several times faster
than gzip(1)) and hashes the stream ahead of the applier; tar headers are parsed by a quicker
path for the common case; a new file is created with O_EXCL first (no lookup unless something
is in the way) and its metadata set through its descriptor; large files start writeback at
once so a loop-mounted disk below sees the data while the apply goes on.

Bounded: a layer's uncompressed stream may not exceed AENV_LAYER_MAX_UNCOMPRESSED_BYTES (a gzip
of zeros expands a thousandfold): the worker counts what it inflates and stops the layer with an
error naming it before the applier writes a byte past the limit.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import gzip
import hashlib
import io
import os
import posixpath
import queue
import re
import shutil
import stat
import struct
import tarfile
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

import zstandard
from isal import igzip, isal_zlib

from agentenv.registry.blobtap import BlobTap
from agentenv.registry.errors import UnsupportedImageError
from agentenv.settings import setting_text
from agentenv.template.errors import LayerApplyError

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_COPY_CHUNK = 1 << 20
_MAX_SYMLINK_HOPS = 255
T = TypeVar("T")
_PIPELINE_DEPTH = 8  # uncompressed blocks decoded ahead of the applier
#: bytes one layer may expand to (0: no limit but the 64 GiB filesystem it is applied onto)
MAX_UNCOMPRESSED_ENV = "AENV_LAYER_MAX_UNCOMPRESSED_BYTES"
DEFAULT_MAX_UNCOMPRESSED = 16 << 30


def uncompressed_limit() -> int | None:
    """AENV_LAYER_MAX_UNCOMPRESSED_BYTES (default 16 GiB); None for no limit."""
    raw = setting_text(MAX_UNCOMPRESSED_ENV).strip()
    try:
        value = int(raw) if raw else DEFAULT_MAX_UNCOMPRESSED
    except ValueError:
        raise LayerApplyError(f"{MAX_UNCOMPRESSED_ENV} must be a number of bytes, "
                              f"got {raw!r}") from None
    if value < 0:
        raise LayerApplyError(f"{MAX_UNCOMPRESSED_ENV} must be 0 or more, got {raw!r}")
    return value or None

# Layer media types this applier accepts, by compression ("" = plain tar).
TAR_LAYER_TYPES: dict[str, str] = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class ApplyStats:
    diff_id: str  # sha256 of the uncompressed tar stream
    entries: int
    bytes_written: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds per conversion step


def compression_of(media_type: str) -> str:
    """'' / 'gzip' / 'zstd' for a supported tar layer media type; raise for any other."""
    try:
        return TAR_LAYER_TYPES[media_type]
    except KeyError:
        raise UnsupportedImageError(
            f"layer media type {media_type!r} is not supported (tar, tar+gzip and tar+zstd are)"
        ) from None


class _Prefixed(io.RawIOBase):
    """`head`, then the rest of `rest` (a stream whose first bytes were read already)."""

    def __init__(self, head: bytes, rest: io.RawIOBase) -> None:
        self.head = head
        self.rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        return self.rest.readinto(buffer)  # type: ignore[no-any-return]


@contextlib.contextmanager
def _open_source(blob: Path | BlobTap) -> Iterator[tuple[BinaryIO, bytes, Callable[[], int]]]:
    """(raw stream at offset 0, its first 4 bytes, compressed bytes consumed so far)."""
    if isinstance(blob, BlobTap):
        with blob.open() as reader:
            head = b""
            while len(head) < 4 and (more := reader.read(4 - len(head))):
                head += more
            stream = io.BufferedReader(_Prefixed(head, reader), buffer_size=_COPY_CHUNK)
            yield stream, head, lambda: reader.position  # type: ignore[misc]
        return
    with open(blob, "rb", buffering=0) as raw:
        head = os.pread(raw.fileno(), 4, 0)
        yield raw, head, lambda: raw.tell()  # type: ignore[misc]


def _decompressed(raw: BinaryIO, compression: str) -> BinaryIO:
    if compression == "gzip":
        # ISA-L's inflate: several times faster than zlib's or gzip(1)'s on the same data.
        return igzip.IGzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return reader  # type: ignore[return-value]
    return raw


class _Pipeline(io.RawIOBase):
    """The uncompressed tar stream, made by a worker thread that reads the blob, decompresses
    it and hashes the result (ISA-L, zstd and sha256 all run without the GIL), a few blocks
    ahead of the applier. `hasher` covers every byte up to the end of the stream once the
    reader has seen EOF; errors of the worker are raised to the reader."""

    _END = b""

    def __init__(self, raw: BinaryIO, compression: str, limit: int | None) -> None:
        self.hasher = hashlib.sha256()
        self._raw = raw
        self._compression = compression
        self._limit = limit
        self._blocks: queue.Queue[bytes] = queue.Queue(_PIPELINE_DEPTH)
        self._current = memoryview(b"")
        self._error: BaseException | None = None
        self._stopping = False
        self._eof = False
        self._worker = threading.Thread(target=self._produce, name="layer-decompress", daemon=True)
        self._worker.start()

    def readable(self) -> bool:
        return True

    def _put(self, block: bytes) -> bool:
        while not self._stopping:
            try:
                self._blocks.put(block, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            stream = _decompressed(self._raw, self._compression)
            total = 0
            while not self._stopping:
                block = stream.read(_COPY_CHUNK)
                if not block:
                    break
                total += len(block)
                if self._limit is not None and total > self._limit:
                    raise LayerApplyError(
                        f"expands to more than {self._limit} bytes uncompressed "
                        f"({MAX_UNCOMPRESSED_ENV})")
                self.hasher.update(block)
                if not self._put(block):
                    return
        except BaseException as exc:
            self._error = exc
        self._put(self._END)

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes with one copy (a whole block with none)."""
        if size is None or size < 0:
            return b"".join(iter(lambda: self.read(_COPY_CHUNK), b""))
        if not self._current:
            if self._eof:
                return b""
            block = self._blocks.get()
            if not block:
                self._eof = True
                if self._error is not None:
                    raise self._error
                return b""
            if len(block) <= size:
                return block
            self._current = memoryview(block)
        data = bytes(self._current[:size])
        self._current = self._current[len(data):]
        return data

    def drain(self) -> None:
        """Read to the end of the stream (the tar reader stops at the end-of-archive blocks:
        the rest still has to decompress and is part of the diff_id)."""
        while self.read(_COPY_CHUNK):
            pass

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(queue.Empty):
            while True:
                self._blocks.get_nowait()
        # The worker stops after its current read; one stuck on a stalled download ends
        # when the download does (the tap then reports it).
        self._worker.join(timeout=30)
        super().close()


class _ForwardReader(io.RawIOBase):
    """The pipeline as a file tarfile's regular mode can use: it only ever seeks forward
    when members are read in order (skipping is reading), and this spares its stream layer
    (a quarter of the applier's time on layers of many small files)."""

    def __init__(self, pipeline: _Pipeline) -> None:
        self._pipeline = pipeline
        self._position = 0
        self._pushed = b""

    def unread(self, data: bytes) -> None:
        """Give back bytes just read (a header looked at before tarfile parses it)."""
        self._pushed = data + self._pushed
        self._position -= len(data)

    def _next(self, size: int) -> bytes:
        if self._pushed:
            chunk, self._pushed = self._pushed[:size], self._pushed[size:]
            return chunk
        return self._pipeline.read(size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            position += self._position
        elif whence != os.SEEK_SET:
            raise io.UnsupportedOperation("a layer stream cannot seek from its end")
        if position < self._position:
            raise io.UnsupportedOperation("a layer stream cannot seek backwards")
        while self._position < position:
            skipped = self._next(min(position - self._position, _COPY_CHUNK))
            if not skipped:
                break
            self._position += len(skipped)
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        """Exactly `size` bytes unless the stream ends first."""
        if size is None or size < 0:
            size = 1 << 62
        chunks: list[bytes] = []
        wanted = size
        while wanted > 0:
            chunk = self._next(min(wanted, _COPY_CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            wanted -= len(chunk)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._position += len(data)
        return data

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@contextlib.contextmanager
def open_uncompressed(blob: Path | BlobTap, compression: str,
                      position_holder: list[Callable[[], int]] | None = None) -> Iterator[_Pipeline]:
    """The layer's tar stream. The compression named by the media type must match the bytes."""
    with _open_source(blob) as (raw, head, position):
        if position_holder is not None:
            position_holder.append(position)
        actual = "gzip" if head[:2] == _GZIP_MAGIC else "zstd" if head == _ZSTD_MAGIC else ""
        if compression and actual != compression:
            raise LayerApplyError(f"media type says {compression} but the blob is not "
                                  f"{compression} data")
        pipeline = _Pipeline(raw, actual, uncompressed_limit())
        try:
            yield pipeline
        finally:
            pipeline.close()


_WRITEBACK_MIN = 128 << 10
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages out now, without waiting (sync_file_range WRITE).
    Under a loop-mounted disk this moves the data to the device while the applier goes on,
    rather than all at once at unmount; no journal commit is forced. Best effort."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _clean_name(name: str, what: str = "entry") -> str:
    """Relative path inside the root ('' is the root itself; a leading `/` or `./` is
    dropped). A name whose `..` would climb above the root is refused, not clamped: such a
    layer was made to attack whoever unpacks it."""
    if "\0" in name:
        raise LayerApplyError(f"{what} {name!r} has a NUL byte in its name")
    parts: list[str] = []
    for comp in name.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise LayerApplyError(f"{what} {name!r} points outside the layer root")
            parts.pop()
        else:
            parts.append(comp)
    return "/".join(parts)


# PAX and GNU long-name headers are read whole into memory by tarfile, and older
# interpreters parse PAX records with backtracking regexes (CVE-2024-6232, fixed in 3.11.10:
# quadratic in a long run of digits). Checked here before tarfile sees them, whatever the
# interpreter: a size cap, a linear record parse, and no digit run a regex could choke on.
MAX_META_HEADER = 1 << 20
_MAX_DIGIT_RUN = 64
_DIGIT_RUN = re.compile(rb"[0-9]{%d}" % (_MAX_DIGIT_RUN + 1))


def _check_pax(buf: bytes) -> None:
    if _DIGIT_RUN.search(buf):
        raise tarfile.HeaderError(f"PAX header with a run of more than {_MAX_DIGIT_RUN} digits")
    pos = 0
    while pos < len(buf):
        space = buf.find(b" ", pos, pos + 21)
        digits = buf[pos:space]
        if space < 0 or not digits.isdigit():
            raise tarfile.HeaderError(f"malformed PAX record at byte {pos}")
        length = int(digits)
        record = buf[pos : pos + length]
        if length <= space - pos + 1 or len(record) != length or not record.endswith(b"\n") \
                or b"=" not in record[space - pos + 1 :]:
            raise tarfile.HeaderError(f"malformed PAX record at byte {pos}")
        if record[space - pos + 1 :].startswith(b"GNU.sparse."):
            raise tarfile.HeaderError("GNU sparse files (PAX GNU.sparse.*) are not supported in a layer")
        pos += length


class _TarInfo(tarfile.TarInfo):
    """tarfile's TarInfo with a quicker header parser for the common case (ustar/GNU/PAX
    headers with octal numbers and a valid unsigned checksum); anything else (base-256
    numbers, GNU sparse, signed checksums, bad or end-of-archive blocks) is left to tarfile's
    own parser, so the result and the errors are the same. Header parsing is most of the
    applier's Python time on layers of many small files."""

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:
        if len(buf) != tarfile.BLOCKSIZE or buf[156:157] == tarfile.GNUTYPE_SPARSE:
            return super().frombuf(buf, encoding, errors)
        try:
            (name, mode, uid, gid, size, mtime, chksum, kind, linkname, _magic, uname, gname,
             devmajor, devminor, prefix) = _HEADER.unpack(buf)
            numbers = [int(field.split(b"\0", 1)[0].strip(b" ") or b"0", 8) if field[0] < 0o200
                       else -1 for field in (mode, uid, gid, size, mtime, chksum, devmajor, devminor)]
        except ValueError:
            return super().frombuf(buf, encoding, errors)
        if -1 in numbers or numbers[5] != 256 + sum(buf) - sum(buf[148:156]):
            return super().frombuf(buf, encoding, errors)
        obj = cls()
        obj.name = name.split(b"\0", 1)[0].decode(encoding, errors)
        obj.mode, obj.uid, obj.gid, obj.size, obj.mtime, obj.chksum = numbers[:6]
        obj.devmajor, obj.devminor = numbers[6:]
        obj.type = kind
        obj.linkname = linkname.split(b"\0", 1)[0].decode(encoding, errors)
        obj.uname = uname.split(b"\0", 1)[0].decode(encoding, errors)
        obj.gname = gname.split(b"\0", 1)[0].decode(encoding, errors)
        prefix_name = prefix.split(b"\0", 1)[0].decode(encoding, errors)
        if kind == tarfile.AREGTYPE and obj.name.endswith("/"):
            obj.type = tarfile.DIRTYPE  # old V7 tar: a directory is a file with a trailing slash
        if obj.isdir():
            obj.name = obj.name.rstrip("/")
        if prefix_name and obj.type not in tarfile.GNU_TYPES:
            obj.name = prefix_name + "/" + obj.name
        return obj

    def _proc_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_META_HEADER:
            raise tarfile.HeaderError(f"PAX header of {self.size} bytes (limit {MAX_META_HEADER})")
        reader = tarfile_.fileobj
        if isinstance(reader, _ForwardReader):
            buf = reader.read(self._block(self.size))
            reader.unread(buf)
            _check_pax(buf[: self.size].rstrip(b"\0"))
        return super()._proc_pax(tarfile_)  # type: ignore[misc,no-any-return]

    def _proc_gnulong(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_META_HEADER:
            raise tarfile.HeaderError(f"GNU long name of {self.size} bytes (limit {MAX_META_HEADER})")
        return super()._proc_gnulong(tarfile_)  # type: ignore[misc,no-any-return]


# name, mode, uid, gid, size, mtime, chksum, type, linkname, magic+version, uname, gname,
# devmajor, devminor, prefix (ustar layout; the last 12 bytes are padding).
_HEADER = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s12x")


class LayerApplier:
    """Applies one layer onto `root`."""

    def __init__(self, root: Path, progress: Callable[[], None] | None = None) -> None:
        self.root = os.path.realpath(root)
        self.progress = progress
        self.unpacked: set[str] = set()
        self._dirs: list[tuple[str, tarfile.TarInfo]] = []
        self._resolved: dict[str, str] = {}
        self.bytes_written = 0
        self.entries = 0

    # -- path resolution inside the root -----------------------------------------------------

    def _resolve_dir(self, rel: str) -> str:
        """Host path of directory `rel`, following symlinks but never leaving the root."""
        if rel in self._resolved:
            return self._resolved[rel]
        pending = [c for c in rel.split("/") if c and c != "."]
        pending.reverse()
        current = self.root
        hops = 0
        missing = False
        while pending:
            comp = pending.pop()
            if comp == "..":
                if current != self.root:
                    current = os.path.dirname(current)
                continue
            candidate = os.path.join(current, comp)
            try:
                st = os.lstat(candidate)
            except FileNotFoundError:
                current = candidate
                missing = True
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_SYMLINK_HOPS:
                    raise LayerApplyError(f"too many symlinks resolving {rel!r}")
                target = os.readlink(candidate)
                if target.startswith("/"):
                    current = self.root
                extra = [c for c in target.split("/") if c and c != "."]
                pending.extend(reversed(extra))
                continue
            current = candidate
        # Only what exists is cached: an entry can then change a cached resolution only by
        # replacing one of its components, which goes through _remove (it clears the cache).
        if not missing:
            self._resolved[rel] = current
        return current

    def _host_path(self, rel: str) -> str:
        if not rel:
            return self.root
        parent, base = posixpath.split(rel)
        return os.path.join(self._resolve_dir(parent), base)

    def _remove(self, path: str) -> None:
        self._resolved.clear()
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def _ensure_parents(self, path: str) -> None:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            # Missing parents are created 0755 root-owned, as containerd does.
            os.makedirs(parent, mode=0o755, exist_ok=True)

    # -- entries -------------------------------------------------------------------------------

    def apply(self, tar: tarfile.TarFile) -> None:
        for member in tar:
            self.entries += 1
            self._entry(tar, member)
            if self.progress is not None:
                self.progress()
        for path, member in reversed(self._dirs):
            self._set_times(path, member)

    def _entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = _clean_name(member.name)
        base = posixpath.basename(rel)
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(rel, base)
            return
        path = self._host_path(rel)
        if member.isreg():
            self._write_file(tar, member, path)
            self.unpacked.add(path)
            return
        if member.isdir():
            if not self._create(path, lambda: os.mkdir(path, 0o700), keep_dir=True)[0]:
                # A directory over a directory: what a merged (overlayfs) view shows is the
                # upper directory's own attributes, so stale xattrs go (umoci does the same).
                self._clear_xattrs(path, member)
        elif member.issym():
            self._create(path, lambda: os.symlink(member.linkname, path))
        elif member.islnk():
            target = self._host_path(_clean_name(member.linkname, f"hard link {member.name!r} to"))
            if not os.path.lexists(target):
                raise LayerApplyError(
                    f"hard link {member.name!r} -> {member.linkname!r}: target does not exist")
            self._create(path, lambda: os.link(target, path, follow_symlinks=False))
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            device = os.makedev(member.devmajor, member.devminor)
            self._create(path, lambda: os.mknod(path, kind | 0o600, device))
        elif member.isfifo():
            self._create(path, lambda: os.mkfifo(path, 0o600))
        else:
            raise LayerApplyError(f"entry {member.name!r}: unsupported tar type {member.type!r}")
        self.unpacked.add(path)
        if member.islnk():
            return  # a hard link shares the target's inode: its metadata is the target's
        os.lchown(path, member.uid, member.gid)
        self._set_xattrs(path, member)
        if not member.issym():
            os.chmod(path, member.mode & 0o7777)
        if member.isdir():
            self._dirs.append((path, member))
        else:
            self._set_times(path, member)

    def _create(self, path: str, make: Callable[[], T], keep_dir: bool = False) -> tuple[bool, T | None]:
        """(True, make()) after replacing whatever is at `path`, or (False, None) when `keep_dir`
        and a directory is there already. Most entries are new: try first, look later."""
        try:
            return True, make()
        except FileExistsError:
            if keep_dir and stat.S_ISDIR(os.lstat(path).st_mode):
                return False, None
            if path == self.root:
                raise LayerApplyError("an entry would replace the root directory") from None
            self._remove(path)
        except FileNotFoundError:
            self._ensure_parents(path)
        return True, make()

    def _write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        source = tar.extractfile(member)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        _, fd = self._create(path, lambda: os.open(path, flags, 0o600))
        try:
            if source is not None:
                remaining = member.size
                while remaining > 0:
                    chunk = source.read(min(_COPY_CHUNK, remaining))
                    if not chunk:
                        raise LayerApplyError(f"entry {member.name!r}: tar data ends early")
                    view = memoryview(chunk)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    remaining -= len(chunk)
                    self.bytes_written += len(chunk)
            if member.size >= _WRITEBACK_MIN:
                _start_writeback(fd)
            # Metadata through the descriptor: no path lookups. Same order as for the others:
            # owner (which clears setuid and capabilities), xattrs, mode, times.
            os.fchown(fd, member.uid, member.gid)
            self._set_xattrs(fd, member)
            os.fchmod(fd, member.mode & 0o7777)
            self._set_times(fd, member)
        finally:
            os.close(fd)

    def _whiteout(self, rel: str, base: str) -> None:
        parent_rel = posixpath.dirname(rel)
        victim = base[len(WHITEOUT_PREFIX) :]
        if victim in ("", ".", ".."):
            # `.wh..` would name the directory holding it (at the top: the root's parent).
            raise LayerApplyError(f"whiteout {rel!r} names no entry ({victim or 'empty'!r})")
        if base != OPAQUE_WHITEOUT and base.startswith(WHITEOUT_PREFIX * 2):
            return  # other .wh..wh. names are aufs metadata (hard-link dirs): nothing to remove
        parent = self._resolve_dir(parent_rel)
        if base == OPAQUE_WHITEOUT:
            if not os.path.isdir(parent):
                return
            for name in os.listdir(parent):
                child = os.path.join(parent, name)
                if child not in self.unpacked:
                    self._remove(child)
            return
        self._remove(os.path.join(parent, victim))

    @staticmethod
    def _xattrs(member: tarfile.TarInfo) -> Iterator[tuple[str, bytes]]:
        for key, value in member.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                yield key[len("SCHILY.xattr.") :], value.encode("utf-8", "surrogateescape")
            elif key.startswith("LIBARCHIVE.xattr."):
                name = urllib.parse.unquote(key[len("LIBARCHIVE.xattr.") :])
                yield name, base64.b64decode(value + "=" * (-len(value) % 4))

    def _clear_xattrs(self, path: str, member: tarfile.TarInfo) -> None:
        keep = {name for name, _ in self._xattrs(member)}
        for name in os.listxattr(path, follow_symlinks=False):
            if name not in keep and not name.startswith("security."):
                with contextlib.suppress(OSError):
                    os.removexattr(path, name, follow_symlinks=False)

    def _set_xattrs(self, target: str | int, member: tarfile.TarInfo) -> None:
        """On a path (never following a symlink) or an open descriptor."""
        for name, value in self._xattrs(member):
            try:
                if isinstance(target, int):
                    os.setxattr(target, name, value)
                else:
                    os.setxattr(target, name, value, follow_symlinks=False)
            except OSError as exc:
                # containerd skips attributes the filesystem does not support; user.* cannot be
                # set on symlinks and device nodes (EPERM), which it tolerates too.
                if exc.errno in (errno.ENOTSUP, errno.EPERM) and (
                    exc.errno == errno.ENOTSUP or (not member.isreg() and not member.isdir())
                ):
                    continue
                raise LayerApplyError(
                    f"entry {member.name!r}: cannot set xattr {name!r}: {exc.strerror}"
                ) from exc

    @staticmethod
    def _set_times(target: str | int, member: tarfile.TarInfo) -> None:
        # PAX times are decimal strings with up to nanosecond digits; a float (what tarfile
        # makes of them) keeps only ~240 ns at today's dates, so they are parsed exactly.
        mtime_ns = _pax_time_ns(member.pax_headers.get("mtime"))
        if mtime_ns is None:
            mtime_ns = int(member.mtime) * 1_000_000_000
        atime_ns = _pax_time_ns(member.pax_headers.get("atime"))
        if atime_ns is None:
            atime_ns = mtime_ns
        with contextlib.suppress(OSError):  # times outside ext4's range are not fatal
            if isinstance(target, int):
                os.utime(target, ns=(atime_ns, mtime_ns))
            else:
                os.utime(target, ns=(atime_ns, mtime_ns), follow_symlinks=False)


_PAX_TIME = re.compile(r"^(-?)(\d+)(?:\.(\d*))?$")


def _pax_time_ns(value: str | None) -> int | None:
    """A PAX time ("1796234804.576088959", "-5.25", "17") in nanoseconds, exactly; None if
    absent or malformed."""
    found = _PAX_TIME.match(value.strip()) if value else None
    if found is None:
        return None
    sign, seconds, fraction = found.groups()
    ns = int(seconds) * 1_000_000_000 + int(((fraction or "") + "000000000")[:9])
    return -ns if sign else ns


def apply_layer(root: Path, blob: Path | BlobTap, media_type: str,
                expected_diff_id: str | None = None, name: str | None = None,
                progress: Callable[[int], None] | None = None) -> ApplyStats:
    """Apply the layer blob (a file, or a download in progress) onto `root`; check the
    uncompressed digest against `expected_diff_id`. `progress` is told how many more bytes of
    the (compressed) blob have been consumed."""
    label = name or (blob.name if isinstance(blob, Path) else "blob")
    compression = compression_of(media_type)
    raw_holder: list[Callable[[], int]] = []
    consumed = 0

    def report() -> None:
        nonlocal consumed
        if progress is not None and raw_holder:
            position = raw_holder[0]()
            if position > consumed:
                progress(position - consumed)
                consumed = position

    applier = LayerApplier(root, report)
    try:
        with open_uncompressed(blob, compression, raw_holder) as stream:
            with tarfile.open(fileobj=_ForwardReader(stream), mode="r:",  # type: ignore[arg-type]
                              tarinfo=_TarInfo) as tar:
                applier.apply(tar)
            stream.drain()  # the end-of-archive padding is part of the diff_id too
            hasher = stream.hasher
            report()
    except LayerApplyError as exc:
        raise LayerApplyError(f"layer {label}: {exc}") from None
    except (tarfile.TarError, EOFError, isal_zlib.error, gzip.BadGzipFile,
            zstandard.ZstdError) as exc:
        raise LayerApplyError(f"layer {label}: corrupt archive: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise LayerApplyError(f"layer {label}: the filesystem is full") from exc
        raise LayerApplyError(f"layer {label}: {exc}") from exc
    diff_id = "sha256:" + hasher.hexdigest()
    if expected_diff_id and diff_id != expected_diff_id:
        raise LayerApplyError(
            f"layer {label}: uncompressed content has digest {diff_id}, the image config says "
            f"{expected_diff_id}"
        )
    return ApplyStats(diff_id, applier.entries, applier.bytes_written)

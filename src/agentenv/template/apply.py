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
"""

from __future__ import annotations

import base64
import contextlib
import errno
import gzip
import hashlib
import io
import os
import posixpath
import shutil
import stat
import subprocess
import tarfile
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard

from agentenv.template.blobtap import BlobTap
from agentenv.template.errors import LayerApplyError, UnsupportedImageError

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_COPY_CHUNK = 1 << 20
# tarfile's stream reader copies its whole remaining buffer on every read: big enough to cut
# the number of reads for large files, small enough not to dominate for many small ones.
_TAR_BUFSIZE = 64 << 10
_MAX_SYMLINK_HOPS = 255

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


class _HashingReader(io.RawIOBase):
    """Reads a binary stream while hashing it; counts bytes."""

    def __init__(self, inner: BinaryIO) -> None:
        self.inner = inner
        self.hasher = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.hasher.update(data)
        self.count += n
        return n


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
    with open(blob, "rb") as raw:
        head = os.pread(raw.fileno(), 4, 0)  # leaves the file offset at 0 for a child reader
        yield raw, head, lambda: os.lseek(raw.fileno(), 0, os.SEEK_CUR)


@contextlib.contextmanager
def open_uncompressed(blob: Path | BlobTap, compression: str,
                      position_holder: list[Callable[[], int]] | None = None) -> Iterator[BinaryIO]:
    """The layer's tar stream. The compression named by the media type must match the bytes."""
    with _open_source(blob) as (raw, head, position):
        if position_holder is not None:
            position_holder.append(position)
        actual = "gzip" if head[:2] == _GZIP_MAGIC else "zstd" if head == _ZSTD_MAGIC else ""
        if compression and actual != compression:
            raise LayerApplyError(f"media type says {compression} but the blob is not "
                                  f"{compression} data")
        tool = _DECOMPRESSORS.get(actual)
        if tool and shutil.which(tool[0]):
            # Decompress in a child process: it runs on another core while this one applies.
            with _child_decompressor(tool, raw, actual) as stream:
                yield stream
        elif actual == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield stream  # type: ignore[misc]
        elif actual == "zstd":
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(raw, read_across_frames=True) as stream:
                yield stream  # type: ignore[misc]
        else:
            yield raw


_DECOMPRESSORS = {"gzip": ("gzip", "-dc"), "zstd": ("zstd", "-dcq")}


def _feed(source: BinaryIO, sink: BinaryIO, failure: list[BaseException]) -> None:
    try:
        while chunk := source.read(_COPY_CHUNK):
            sink.write(chunk)
    except BrokenPipeError:
        pass  # the reader gave up first; its error is the one that matters
    except BaseException as exc:
        failure.append(exc)
    finally:
        with contextlib.suppress(OSError):
            sink.close()


@contextlib.contextmanager
def _child_decompressor(tool: tuple[str, ...], raw: BinaryIO, name: str) -> Iterator[BinaryIO]:
    has_fd = True
    try:
        raw.fileno()
    except (OSError, io.UnsupportedOperation):
        has_fd = False
    child = subprocess.Popen(tool, stdin=raw if has_fd else subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    feeder: threading.Thread | None = None
    failure: list[BaseException] = []
    if not has_fd:
        assert child.stdin is not None
        feeder = threading.Thread(target=_feed, args=(raw, child.stdin, failure), daemon=True)
        feeder.start()
    try:
        yield child.stdout  # type: ignore[misc]
        # The tar reader stops at the end-of-archive blocks: the rest must still decompress.
        while child.stdout.read(_COPY_CHUNK):
            pass
        child.stdout.close()
        if feeder is not None:
            feeder.join()
        if failure:
            raise failure[0]
        errors = child.stderr.read().decode(errors="replace").strip()
        if child.wait() != 0:
            raise LayerApplyError(f"corrupt archive: {name} data does not decompress "
                                  f"({errors.splitlines()[-1] if errors else 'exit ' + str(child.returncode)})")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if feeder is not None:
            feeder.join(timeout=30)
        child.stdout.close()
        child.stderr.close()


def _clean_name(name: str) -> str:
    """Relative path inside the root, with `..` clamped at the root ('' is the root itself)."""
    return posixpath.normpath("/" + name).lstrip("/")


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
        if path != self.root:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None and not (stat.S_ISDIR(st.st_mode) and member.isdir()):
                self._remove(path)
            self._ensure_parents(path)
        if member.isdir():
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
            else:
                # A directory over a directory: what a merged (overlayfs) view shows is the
                # upper directory's own attributes, so stale xattrs go (umoci does the same).
                self._clear_xattrs(path, member)
        elif member.isreg():
            self._write_file(tar, member, path)
        elif member.issym():
            os.symlink(member.linkname, path)
            self._resolved.clear()
        elif member.islnk():
            target = self._host_path(_clean_name(member.linkname))
            try:
                os.link(target, path, follow_symlinks=False)
            except FileNotFoundError:
                raise LayerApplyError(
                    f"hard link {member.name!r} -> {member.linkname!r}: target does not exist"
                ) from None
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            os.mkfifo(path, 0o600)
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

    def _write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        source = tar.extractfile(member)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
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
        finally:
            os.close(fd)

    def _whiteout(self, rel: str, base: str) -> None:
        parent_rel = posixpath.dirname(rel)
        parent = self._resolve_dir(parent_rel)
        if base == OPAQUE_WHITEOUT:
            if not os.path.isdir(parent):
                return
            for name in os.listdir(parent):
                child = os.path.join(parent, name)
                if child not in self.unpacked:
                    self._remove(child)
            return
        self._remove(os.path.join(parent, base[len(WHITEOUT_PREFIX) :]))

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

    def _set_xattrs(self, path: str, member: tarfile.TarInfo) -> None:
        for name, value in self._xattrs(member):
            try:
                os.setxattr(path, name, value, follow_symlinks=False)
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
    def _set_times(path: str, member: tarfile.TarInfo) -> None:
        mtime_ns = int(member.mtime * 1_000_000_000)
        atime = member.pax_headers.get("atime")
        try:
            atime_ns = int(float(atime) * 1_000_000_000) if atime else mtime_ns
        except ValueError:
            atime_ns = mtime_ns
        with contextlib.suppress(OSError):  # times outside ext4's range are not fatal
            os.utime(path, ns=(atime_ns, mtime_ns), follow_symlinks=False)


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
            hashing = _HashingReader(stream)
            buffered = io.BufferedReader(hashing, buffer_size=_COPY_CHUNK)
            with tarfile.open(fileobj=buffered, mode="r|", bufsize=_TAR_BUFSIZE) as tar:
                applier.apply(tar)
            while buffered.read(_COPY_CHUNK):
                pass  # hash the end-of-archive padding too: it is part of the diff_id
            report()
    except LayerApplyError as exc:
        raise LayerApplyError(f"layer {label}: {exc}") from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as exc:
        raise LayerApplyError(f"layer {label}: corrupt archive: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise LayerApplyError(f"layer {label}: the filesystem is full") from exc
        raise LayerApplyError(f"layer {label}: {exc}") from exc
    diff_id = "sha256:" + hashing.hasher.hexdigest()
    if expected_diff_id and diff_id != expected_diff_id:
        raise LayerApplyError(
            f"layer {label}: uncompressed content has digest {diff_id}, the image config says "
            f"{expected_diff_id}"
        )
    return ApplyStats(diff_id, applier.entries, applier.bytes_written)

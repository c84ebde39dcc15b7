"""A volume's files on the node: every operation of the volume content API on one directory,
with paths that cannot leave it.

A volume's authoritative content is a plain directory (`<state>/volumes/<id>/data`). Paths come
from the client (`?path=`): they are split into names, `..` is refused, and every name is
opened relative to the directory above it (`openat`-style, `dir_fd`) with `O_NOFOLLOW`, so
neither a symbolic link inside the volume nor an absolute path reaches anything outside it. A
symbolic link is never followed: one in the middle of a path is a 400, one at its end is
stat'ed, listed and removed as a link, never read or written through. Nothing here runs a
shell or touches a path by its full name.

What a volume holds is charged in 4 KiB blocks (`charge`): a regular file its size rounded up
to a block (at least one), a directory or a link one block; the volume's size bounds the sum.

These are blocking calls: volumes.py runs them in a thread, one mutation of a volume at a time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentenv.api.errors import ApiError, BadRequest, Conflict, NotFound

BLOCK = 4096
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
#: names a path has at most: a deeper tree outruns Python's recursion (shutil.rmtree,
#: os.fwalk) and would leave a volume that cannot be counted, removed or deleted
MAX_DEPTH_NAMES = 256
#: entries one listing returns at most (E2B's listing has no pages)
MAX_LIST_ENTRIES = 100_000
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
MAX_ID = 2**32 - 2  # uid/gid: (uid_t)-1 means "unchanged" to chown

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TooLarge(ApiError):
    """The volume's size would be passed (413)."""

    status = 413


def parse_path(raw: str | None) -> tuple[str, ...]:
    """The names of a client's path, from the volume's root (`/` and `` are the root)."""
    if raw is None:
        raise BadRequest("the path query parameter is required")
    if "\0" in raw:
        raise BadRequest("a path must not contain a NUL byte")
    if len(raw.encode()) > MAX_PATH_BYTES:
        raise BadRequest(f"path longer than {MAX_PATH_BYTES} bytes")
    parts = tuple(p for p in raw.split("/") if p not in ("", "."))
    if len(parts) > MAX_DEPTH_NAMES:
        raise BadRequest(f"path {raw[:60]!r}... has {len(parts)} names, more than "
                         f"{MAX_DEPTH_NAMES}")
    if ".." in parts:
        raise BadRequest(f"path {raw!r} must not contain '..': paths are inside the volume")
    for part in parts:
        if len(part.encode()) > MAX_NAME_BYTES:
            raise BadRequest(f"a name in path {raw!r} is longer than {MAX_NAME_BYTES} bytes")
    return parts


def shown(parts: tuple[str, ...]) -> str:
    return "/" + "/".join(parts)


def file_charge(size: int) -> int:
    """Bytes a regular file of `size` bytes counts against its volume's size."""
    return max(-(-size // BLOCK), 1) * BLOCK


def charge(st: os.stat_result) -> int:
    """Bytes an entry counts against its volume's size."""
    return file_charge(st.st_size) if stat.S_ISREG(st.st_mode) else BLOCK


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat()


def entry(parts: tuple[str, ...], st: os.stat_result, target: str | None = None) -> dict[str, Any]:
    """E2B's VolumeEntryStat of the entry at `parts`."""
    kind = ("directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "unknown")
    out: dict[str, Any] = {
        "name": parts[-1] if parts else "/", "type": kind, "path": shown(parts),
        "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
        "gid": st.st_gid, "atime": _time(st.st_atime), "mtime": _time(st.st_mtime),
        "ctime": _time(st.st_ctime)}
    if target is not None:
        out["target"] = target
    return out


def check_ids(uid: int | None, gid: int | None, mode: int | None) -> None:
    for name, value in (("uid", uid), ("gid", gid)):
        if value is not None and not 0 <= value <= MAX_ID:
            raise BadRequest(f"{name} must be between 0 and {MAX_ID}, got {value}")
    if mode is not None and not 0 <= mode <= 0o7777:
        raise BadRequest(f"mode must be between 0 and 0o7777 (4095), got {mode}")


class VolumeFiles:
    """The content of one volume: the directory `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # --- walking -------------------------------------------------------------------------------

    def _open_root(self) -> int:
        return os.open(self.root, _DIR)

    def _step(self, fd: int, name: str, parts: tuple[str, ...]) -> int:
        """The directory `name` in directory `fd` (whose path is `parts`), opened."""
        try:
            return os.open(name, _DIR, dir_fd=fd)
        except FileNotFoundError:
            raise NotFound(f"path {shown((*parts, name))} not found") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise BadRequest(f"path {shown((*parts, name))} is a symbolic link: links in "
                                 "a volume are never followed") from None
            raise Conflict(f"path {shown((*parts, name))} is not a directory") from None

    @contextlib.contextmanager
    def _dir(self, parts: tuple[str, ...]) -> Iterator[int]:
        """The directory at `parts`, opened one name at a time without following links."""
        fd = self._open_root()
        try:
            for i, name in enumerate(parts):
                nxt = self._step(fd, name, parts[:i])
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def _existing(self, parts: tuple[str, ...]) -> tuple[int, int]:
        """(fd, k): the deepest directory of `parts` that exists, opened, and how many names
        of `parts` it is (the caller closes fd)."""
        fd = self._open_root()
        try:
            for i, name in enumerate(parts):
                try:
                    nxt = self._step(fd, name, parts[:i])
                except NotFound:
                    return fd, i
                os.close(fd)
                fd = nxt
            return fd, len(parts)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _lstat(fd: int, name: str, parts: tuple[str, ...]) -> os.stat_result:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotFound(f"path {shown(parts)} not found") from None

    # --- reading -------------------------------------------------------------------------------

    def stat(self, parts: tuple[str, ...]) -> dict[str, Any]:
        if not parts:
            with self._dir(()) as fd:
                return entry(parts, os.fstat(fd))
        with self._dir(parts[:-1]) as parent:
            st = self._lstat(parent, parts[-1], parts)
            target = os.readlink(parts[-1], dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
            return entry(parts, st, target)

    def list(self, parts: tuple[str, ...], depth: int) -> list[dict[str, Any]]:
        """The entries under the directory `parts`, `depth` levels down (links not followed)."""
        found: list[dict[str, Any]] = []

        def walk(fd: int, at: tuple[str, ...], level: int) -> None:
            with os.scandir(fd) as entries:
                names = sorted(e.name for e in entries)
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile
                if len(found) >= MAX_LIST_ENTRIES:
                    raise BadRequest(f"directory {shown(parts)} holds more than "
                                     f"{MAX_LIST_ENTRIES} entries at depth {depth}: list its "
                                     "subdirectories")
                link = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
                found.append(entry((*at, name), st, link))
                if level < depth and stat.S_ISDIR(st.st_mode):
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        sub = os.open(name, _DIR, dir_fd=fd)
                        try:
                            walk(sub, (*at, name), level + 1)
                        finally:
                            os.close(sub)

        with self._dir(parts) as fd:
            walk(fd, parts, 1)
        return found

    def open_file(self, parts: tuple[str, ...]) -> tuple[int, int]:
        """(fd, size) of the regular file at `parts`, open for reading (the caller closes)."""
        if not parts:
            raise BadRequest("path / is a directory, not a file")
        with self._dir(parts[:-1]) as parent:
            # O_PATH first: a device node or FIFO (a commit's archive may hold one) is never
            # opened on the host, where the open alone can act (a watchdog, a tape, a pipe's
            # writer released); only a regular file is then opened for reading, that inode
            try:
                entry_fd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   dir_fd=parent)
            except FileNotFoundError:
                raise NotFound(f"path {shown(parts)} not found") from None
        try:
            st = os.fstat(entry_fd)
            if stat.S_ISLNK(st.st_mode):
                raise BadRequest(f"path {shown(parts)} is a symbolic link: links in a volume "
                                 "are never followed")
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise BadRequest(f"path {shown(parts)} is {kind}")
            fd = os.open(f"/proc/self/fd/{entry_fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(entry_fd)
        return fd, st.st_size

    def usage(self) -> int:
        """Bytes the whole volume counts against its size."""
        with self._dir(()) as fd:
            return _tree_charge(fd)

    # --- changing ------------------------------------------------------------------------------

    def make_dir(self, parts: tuple[str, ...], uid: int | None, gid: int | None,
                 mode: int | None, force: bool, room: int) -> tuple[dict[str, Any], int]:
        """Create the directory `parts` (with `force`, its missing parents too; an existing
        directory is then no error). `room`: bytes the volume may still take. Returns its
        entry and the bytes charged."""
        check_ids(uid, gid, mode)
        if not parts:
            if force:
                return self.stat(parts), 0
            raise Conflict("path / already exists")
        fd, k = self._existing(parts)
        try:
            if k == len(parts):
                if force:
                    return entry(parts, os.fstat(fd)), 0
                raise Conflict(f"path {shown(parts)} already exists")
            if k < len(parts) - 1 and not force:
                raise NotFound(f"path {shown(parts[:k + 1])} not found (force creates the "
                               "parents)")
            # (a file or a link in the way made _existing raise already)
            made = (len(parts) - k) * BLOCK
            if made > room:
                raise TooLarge(f"no room in the volume for {len(parts) - k} more "
                               f"director{'y' if made == BLOCK else 'ies'}")
            for i in range(k, len(parts)):
                try:
                    os.mkdir(parts[i], 0o700, dir_fd=fd)
                except FileExistsError:
                    raise Conflict(f"path {shown(parts[:i + 1])} already exists") from None
                nxt = os.open(parts[i], _DIR, dir_fd=fd)
                os.close(fd)
                fd = nxt
                _own(fd, uid, gid, DEFAULT_DIR_MODE if mode is None else mode)
            return entry(parts, os.fstat(fd)), made
        finally:
            os.close(fd)

    def receive(self, tmp_dir: Path, uid: int | None, gid: int | None,
                mode: int | None) -> tuple[int, str]:
        """(fd, name) of a new file in `tmp_dir` for an upload, owned and moded as asked."""
        check_ids(uid, gid, mode)
        name = f"upload-{os.urandom(8).hex()}"
        fd = os.open(tmp_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            _own(fd, uid, gid, DEFAULT_FILE_MODE if mode is None else mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp_dir / name)
            raise
        return fd, name

    def _replaced(self, parent: int, parts: tuple[str, ...], force: bool) -> int:
        """What the entry an upload to `parts` replaces counts (0: none); 409 when it may not
        be replaced."""
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if stat.S_ISDIR(st.st_mode):
            raise Conflict(f"path {shown(parts)} is a directory")
        if not force:
            raise Conflict(f"path {shown(parts)} already exists (force replaces it)")
        return charge(st)

    def check_target(self, parts: tuple[str, ...], force: bool) -> int:
        """Refuse an upload to `parts` before its bytes are received: no parent directory,
        or an entry there that may not be replaced. What the entry it replaces counts."""
        if not parts:
            raise BadRequest("path / is a directory, not a file")
        with self._dir(parts[:-1]) as parent:
            return self._replaced(parent, parts, force)

    def place(self, tmp_dir: Path, tmp_name: str, parts: tuple[str, ...], force: bool,
              room: int) -> tuple[dict[str, Any], int]:
        """Move a received upload to `parts` (replacing a file there only with `force`). The
        parent must exist. Returns the entry and the change of the volume's charge."""
        if not parts:
            raise BadRequest("path / is a directory, not a file")
        tmp_fd = os.open(tmp_dir, _DIR)
        try:
            new = os.stat(tmp_name, dir_fd=tmp_fd, follow_symlinks=False)
            with self._dir(parts[:-1]) as parent:
                grows = charge(new) - self._replaced(parent, parts, force)
                if grows > room:
                    raise TooLarge(f"no room in the volume for {shown(parts)} "
                                   f"({new.st_size} bytes)")
                os.rename(tmp_name, parts[-1], src_dir_fd=tmp_fd, dst_dir_fd=parent)
                os.fsync(parent)
                return entry(parts, new), grows
        finally:
            os.close(tmp_fd)

    def update(self, parts: tuple[str, ...], uid: int | None, gid: int | None,
               mode: int | None) -> dict[str, Any]:
        """chown/chmod the entry at `parts` (a link itself, never what it names)."""
        check_ids(uid, gid, mode)
        if not parts:
            with self._dir(()) as fd:
                _own(fd, uid, gid, mode)
            return self.stat(parts)
        with self._dir(parts[:-1]) as parent:
            st = self._lstat(parent, parts[-1], parts)
            if mode is not None and stat.S_ISLNK(st.st_mode):
                raise BadRequest(f"path {shown(parts)} is a symbolic link, which has no mode")
            if uid is not None or gid is not None:
                os.chown(parts[-1], -1 if uid is None else uid, -1 if gid is None else gid,
                         dir_fd=parent, follow_symlinks=False)
            if mode is not None:
                # chmod has no no-follow form on Linux: through an O_PATH descriptor of the
                # entry itself (checked above not to be a link, and opened without following)
                fd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                try:
                    os.chmod(f"/proc/self/fd/{fd}", mode)
                finally:
                    os.close(fd)
        return self.stat(parts)

    def remove(self, parts: tuple[str, ...]) -> int:
        """Remove the entry at `parts` (a directory with everything in it); the bytes freed."""
        if not parts:
            raise BadRequest("the volume's root cannot be removed: remove what is in it")
        with self._dir(parts[:-1]) as parent:
            name = parts[-1]
            st = self._lstat(parent, name, parts)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)
                return charge(st)
            sub = os.open(name, _DIR, dir_fd=parent)
            try:
                freed = BLOCK + _tree_charge(sub)
            finally:
                os.close(sub)
            shutil.rmtree(name, dir_fd=parent)  # descriptor-based: never follows a link
            return freed


def _entries(fd: int) -> Iterator[tuple[int, str, os.stat_result, int]]:
    """(directory fd, name, lstat, depth) of everything under the open directory `fd`
    (depth 1: its own entries), links not followed. Iterative: a tree of any depth is walked
    (os.fwalk recurses, and a deep tree raised RecursionError)."""
    stack = [(os.dup(fd), 1)]
    try:
        while stack:
            dir_fd, depth = stack.pop()
            try:
                with os.scandir(dir_fd) as found:
                    names = [e.name for e in found]
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed meanwhile
                    yield dir_fd, name, st, depth
                    if stat.S_ISDIR(st.st_mode):
                        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                            stack.append((os.open(name, _DIR, dir_fd=dir_fd), depth + 1))
            finally:
                os.close(dir_fd)
    finally:
        for dir_fd, _ in stack:
            os.close(dir_fd)


def unfit_entry(root: Path) -> str | None:
    """Why the tree `root` (a commit's unpacked archive) cannot be a volume's content, or None:
    a device node or socket (on the host it would be the host's), or names nested deeper than
    MAX_DEPTH_NAMES."""
    fd = os.open(root, _DIR)
    try:
        for _, name, st, depth in _entries(fd):
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                return f"{name} is a device node or socket, which a volume cannot hold"
            if depth > MAX_DEPTH_NAMES:
                return f"its directories nest deeper than {MAX_DEPTH_NAMES} levels"
    finally:
        os.close(fd)
    return None


def _own(fd: int, uid: int | None, gid: int | None, mode: int | None) -> None:
    if uid is not None or gid is not None:
        os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
    if mode is not None:
        os.fchmod(fd, mode)  # after chown, which clears setuid/setgid


def _tree_charge(fd: int) -> int:
    """What everything under the open directory `fd` counts (not the directory itself)."""
    return sum(charge(st) for _, _, st, _ in _entries(fd))

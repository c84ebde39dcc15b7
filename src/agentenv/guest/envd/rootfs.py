"""The guest's root filesystem as envd sees it: users from its /etc/passwd, paths inside it.

In the VM the root is `/`. `aenv envd --root DIR` serves DIR as the root instead, so paths are
mapped into DIR and symlinks are followed as if DIR were `/` (an absolute link target starts at
DIR, `..` stops at DIR), which keeps every path inside DIR.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import threading
from collections import deque
from dataclasses import dataclass

from agentenv.guest.envd.rpc import RpcError

MAX_SYMLINK_HOPS = 40
FIRST_REGULAR_UID = 1000


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str
    groups: tuple[int, ...]


class UnknownUser(Exception):
    pass


class RootFs:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.is_host_root = self.root == "/"
        self._lock = threading.Lock()
        self._passwd_cache: tuple[float, list[list[str]]] | None = None
        self._group_cache: tuple[float, list[list[str]]] | None = None

    # ---- paths ------------------------------------------------------------------------------

    def host_path(self, guest_path: str, follow_final: bool = True) -> str:
        """Where an absolute guest path lives on this machine, symlinks resolved inside the root."""
        if "\x00" in guest_path:
            raise RpcError("invalid_argument", "path contains a NUL byte")
        if self.is_host_root:
            return guest_path
        return self.root + self.resolve(guest_path, follow_final)

    def resolve(self, guest_path: str, follow_final: bool = True) -> str:
        """The guest path with symlinks resolved against the root (all but the last component
        unless follow_final)."""
        pending = deque(guest_path.split("/"))
        resolved: list[str] = []
        hops = 0
        while pending:
            part = pending.popleft()
            if part in ("", "."):
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            is_last = not any(p not in ("", ".") for p in pending)
            if not is_last or follow_final:
                candidate = self.root + "/" + "/".join([*resolved, part])
                try:
                    is_link = stat.S_ISLNK(os.lstat(candidate).st_mode)
                except OSError:
                    is_link = False
                if is_link:
                    hops += 1
                    if hops > MAX_SYMLINK_HOPS:
                        raise RpcError("invalid_argument", f"too many symlinks in {guest_path}")
                    target = os.readlink(candidate)
                    if target.startswith("/"):
                        resolved = []
                    pending.extendleft(reversed(target.split("/")))
                    continue
            resolved.append(part)
        return "/" + "/".join(resolved)

    def guest_path_of(self, host_path: str) -> str:
        if self.is_host_root:
            return host_path
        rel = os.path.relpath(host_path, self.root)
        return "/" if rel == "." else "/" + rel

    @staticmethod
    def expand(path: str, user: User, default_dir: str | None = None) -> str:
        """A request path as an absolute, normalised guest path: `~` is the user's home, a
        relative path starts at the default directory (or the home)."""
        if path == "~" or path.startswith("~/"):
            path = user.home + path[1:]
        elif not path.startswith("/"):
            path = posixpath.join(default_dir or user.home, path)
        normalised = posixpath.normpath(path)
        # posixpath keeps a leading "//"; the guest has a single root.
        return "/" + normalised.lstrip("/")

    # ---- users and groups -------------------------------------------------------------------

    def _read_db(self, name: str, cache_attr: str) -> list[list[str]]:
        path = self.host_path(f"/etc/{name}")
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return []
        cached = getattr(self, cache_attr)
        if cached and cached[0] == mtime:
            return cached[1]
        rows: list[list[str]] = []
        with open(path, encoding="utf-8", errors="replace") as db:
            for line in db:
                line = line.rstrip("\n")
                if line and not line.startswith("#"):
                    rows.append(line.split(":"))
        setattr(self, cache_attr, (mtime, rows))
        return rows

    def _passwd(self) -> list[list[str]]:
        return [row for row in self._read_db("passwd", "_passwd_cache") if len(row) >= 7]

    def _group(self) -> list[list[str]]:
        return [row for row in self._read_db("group", "_group_cache") if len(row) >= 3]

    def lookup_user(self, name: str) -> User:
        for row in self._passwd():
            if row[0] == name:
                try:
                    uid, gid = int(row[2]), int(row[3])
                except ValueError:
                    continue
                groups = {gid}
                for group in self._group():
                    if len(group) >= 4 and name in group[3].split(","):
                        with contextlib.suppress(ValueError):
                            groups.add(int(group[2]))
                return User(name, uid, gid, row[5] or "/", row[6] or "/bin/sh", tuple(sorted(groups)))
        if name == "root":
            # An image without /etc/passwd (hello-world) still has a superuser.
            return User("root", 0, 0, "/root", "/bin/sh", (0,))
        raise UnknownUser(name)

    def user_name(self, uid: int) -> str:
        for row in self._passwd():
            if row[2] == str(uid):
                return row[0]
        return "root" if uid == 0 else str(uid)

    def group_name(self, gid: int) -> str:
        for row in self._group():
            if row[2] == str(gid):
                return row[0]
        return "root" if gid == 0 else str(gid)

    def ensure_user(self, name: str) -> User:
        """The user, created (passwd, group, shadow, home) when the image has no such account."""
        with self._lock:
            try:
                return self.lookup_user(name)
            except UnknownUser:
                pass
            if os.geteuid() != 0:
                raise UnknownUser(name)
            taken_uids = {int(r[2]) for r in self._passwd() if r[2].isdigit()}
            taken_gids = {int(r[2]) for r in self._group() if r[2].isdigit()}
            uid = FIRST_REGULAR_UID
            while uid in taken_uids or uid in taken_gids:
                uid += 1
            home = f"/home/{name}"
            shell = next(
                (s for s in ("/bin/bash", "/bin/sh") if os.path.exists(self.host_path(s))),
                "/bin/sh",
            )
            etc = self.host_path("/etc")
            os.makedirs(etc, exist_ok=True)
            _append_line(os.path.join(etc, "passwd"), f"{name}:x:{uid}:{uid}::{home}:{shell}")
            _append_line(os.path.join(etc, "group"), f"{name}:x:{uid}:")
            if os.path.exists(os.path.join(etc, "shadow")):
                _append_line(os.path.join(etc, "shadow"), f"{name}:!:19000:0:99999:7:::")
            host_home = self.host_path(home)
            os.makedirs(host_home, mode=0o755, exist_ok=True)
            os.chown(host_home, uid, uid)
            self._passwd_cache = self._group_cache = None
            return self.lookup_user(name)


def _append_line(path: str, line: str) -> None:
    prefix = ""
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as existing:
            existing.seek(-1, os.SEEK_END)
            if existing.read(1) != b"\n":
                prefix = "\n"
    with open(path, "a", encoding="utf-8") as db:
        db.write(f"{prefix}{line}\n")

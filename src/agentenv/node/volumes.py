"""Volumes: E2B's named, persistent storage of a team, kept on the node (docs/volumes.md).

A volume is a record in the node's store (name per team, size) and a directory,
`<state>/volumes/<id>/data`, holding its content: the volume content API (node/volume_api.py)
edits that directory through node/volume_files.py, which keeps every path inside it.
Uploads are received in `<state>/volumes/<id>/tmp` and moved into place once complete, so a
reader never sees half a file and an upload that fails leaves nothing.

Every team sees only its own volumes (another team's is not found, by id or by name). The
content API takes the volume's bearer token instead of the API key: an HMAC of the volume id
with the node's token seed (security.TokenIssuer), so it survives restarts without being
stored.

Sizes (read when the node starts):

| variable | default | what |
|---|---|---|
| `AENV_VOLUME_SIZE_MB` | 1024 | a new volume's size when the request names none |
| `AENV_VOLUME_MAX_SIZE_MB` | 16384 | the largest size a request may name (`sizeMB`, our extension) |
| `AENV_VOLUME_MAX_MOUNTS` | 4 | volumes one sandbox mounts at most (the machine has VOLUME_SLOTS disks for them) |

A write past a volume's size is a 413 naming it; a write that would leave the state
filesystem with less free than the node's reserve is a 507 (admission.space_reserve).

Mounting (docs/volumes.md §6): a sandbox mounts a sealed version of a volume, an overlaybd
layer holding an ext4 of the content (`<state>/volumes/layers/<id>-v<N>.layer`, made from the
directory with `mkfs.ext4 -d` and `import_raw`, as the built-in template's root is). A create
that mounts a volume whose content changed since its last seal seals it first; the others reuse
the sealed layer. Old versions stay while a sandbox or snapshot uses them (node/gc.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.api.auth import same_secret
from agentenv.api.errors import ApiError, BadRequest, Conflict, NotFound, Unauthorized
from agentenv.api.volume_models import TOKEN_NEEDED
from agentenv.errors import AgentEnvError
from agentenv.fsutil import InsufficientSpace, SpaceGuard, private_dir, require_free_space
from agentenv.guest.build.rootfs import make_rootfs_image
from agentenv.node.records import MountRecord, VolumeRecord
from agentenv.node.security import TokenIssuer
from agentenv.node.shared_fs import SharedFilesystem, SharedFsError
from agentenv.node.store import NameTaken, Store
from agentenv.node.volume_files import TooLarge, VolumeFiles, file_charge, unfit_entry
from agentenv.relay.concurrency import whole_number_setting
from agentenv.snapshot.record import VOLUME_DISK_BYTES
from agentenv.storage.export import import_raw
from agentenv.template.apply import LayerApplyError, apply_layer

log = logging.getLogger("agentenv.node.volumes")

PLAIN_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYERS = "layers"  # <state>/volumes/layers/: sealed versions
WORK = "work"  # <state>/volumes/work/: seals under way
SIZE_SETTING = "AENV_VOLUME_SIZE_MB"
MAX_SIZE_SETTING = "AENV_VOLUME_MAX_SIZE_MB"
DEFAULT_SIZE_MB = 1024
DEFAULT_MAX_SIZE_MB = 16 << 10
#: E2B's NewVolume name pattern; the length bound is ours
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
MAX_MOUNTS_SETTING = "AENV_VOLUME_MAX_MOUNTS"
SHARED_RW_SETTING = "AENV_VOLUME_SHARED_RW"
#: a shared volume whose root was root's is given to the guest's `user` (uid and gid 1000)
SHARED_DEFAULT_OWNER = 1000
SHARED_ONLY = ("volume {name!r} is shared read-write (it lives on its own file system, "
               "written live by its sandboxes): it is mounted 'rw-shared' only")
#: volume disks every VM has (runtime: RuntimeConfig.volume_slots)
VOLUME_SLOTS = 4
#: the file system of a volume's layer: its size plus room for ext4's own (inode tables,
#: journal, directories), within the fixed size of a volume disk
FS_SPARE_BYTES = 64 << 20
#: mount modes (our extension: E2B's mounts have none); the name may carry one as `name:mode`
MODES = ("ro", "cow", "rw", "rw-shared")
SHARED = "rw-shared"  # shared read-write over NFS (docs/volumes.md §7.1)
DEFAULT_MODE = "ro"
#: where a volume may not be mounted: these and anything under them ...
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/run", "/etc", "/usr", "/bin", "/sbin", "/lib",
                "/lib32", "/lib64", "/libx32", "/boot", "/agentenv")
#: ... and these themselves (hiding what the image keeps there)
SYSTEM_DIRS = ("/", "/var", "/tmp", "/home", "/root", "/opt", "/srv", "/mnt", "/media")
MAX_MOUNT_PATH = 1024


def fs_bytes(size_bytes: int) -> int:
    """The size of the ext4 file system holding a volume of `size_bytes`."""
    return -(-(size_bytes + size_bytes // 8 + FS_SPARE_BYTES) >> 20) << 20


#: the largest volume whose file system fits a volume disk
MAX_SIZE_MB = ((VOLUME_DISK_BYTES - FS_SPARE_BYTES) * 8 // 9) >> 20


@dataclass(frozen=True)
class VolumeLimits:
    default_size_mb: int = DEFAULT_SIZE_MB
    max_size_mb: int = DEFAULT_MAX_SIZE_MB
    max_mounts: int = VOLUME_SLOTS
    #: the rw-shared mode offered (AENV_VOLUME_SHARED_RW; off by default, docs/security.md)
    shared_rw: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> VolumeLimits:
        limits = cls(whole_number_setting(env, SIZE_SETTING, DEFAULT_SIZE_MB),
                     whole_number_setting(env, MAX_SIZE_SETTING, DEFAULT_MAX_SIZE_MB),
                     whole_number_setting(env, MAX_MOUNTS_SETTING, VOLUME_SLOTS),
                     whole_number_setting(env, SHARED_RW_SETTING, 0) == 1)
        if not 1 <= limits.max_size_mb <= MAX_SIZE_MB:
            raise ValueError(f"{MAX_SIZE_SETTING}={limits.max_size_mb} must be between 1 and "
                             f"{MAX_SIZE_MB} (a volume disk is {VOLUME_DISK_BYTES >> 30} GiB)")
        if not 1 <= limits.default_size_mb <= limits.max_size_mb:
            raise ValueError(f"{SIZE_SETTING}={limits.default_size_mb} must be at least 1 and "
                             f"at most {MAX_SIZE_SETTING}={limits.max_size_mb}")
        if whole_number_setting(env, SHARED_RW_SETTING, 0) > 1:
            raise ValueError(f"{SHARED_RW_SETTING} must be 0 or 1")
        if limits.max_mounts > VOLUME_SLOTS:
            raise ValueError(f"{MAX_MOUNTS_SETTING}={limits.max_mounts} must be at most "
                             f"{VOLUME_SLOTS} (the volume disks of a machine)")
        return limits

    def size_bytes(self, size_mb: int | None) -> int:
        if size_mb is None:
            return self.default_size_mb << 20
        if not 1 <= size_mb <= self.max_size_mb:
            raise BadRequest(f"sizeMB must be between 1 and {self.max_size_mb} (the node's "
                             f"{MAX_SIZE_SETTING}), got {size_mb}")
        return size_mb << 20


class Volumes:
    """The node's volumes: records, directories, tokens and every content operation."""

    def __init__(self, store: Store, state_dir: Path, tokens: TokenIssuer,
                 limits: VolumeLimits, space_reserve: Callable[[], tuple[int, str]],
                 sealed: Callable[[], None] = lambda: None,
                 writers: Callable[[], dict[str, str]] = dict,
                 sharers: Callable[[], dict[str, list[str]]] = dict) -> None:
        """`sealed`: called when a volume got a new version or was deleted (a garbage
        collection may free older versions no sandbox or snapshot uses). `writers`: the
        volumes a sandbox mounts read-write (its own, exclusively), to which sandbox."""
        self.store = store
        self._sealed = sealed
        self._writers = writers
        #: the sandboxes mounting each volume shared read-write (rw-shared), by volume id
        self._sharers = sharers
        self.dir = state_dir / "volumes"
        self.tokens = tokens
        self.limits = limits
        self._space_reserve = space_reserve
        self.records: dict[str, VolumeRecord] = {}
        #: one change of a volume's content at a time (reads need none)
        self._locks: dict[str, asyncio.Lock] = {}
        #: what each volume's content counts, learnt at its first change
        self._used: dict[str, int] = {}
        #: bytes of uploads being received, per volume: they count before they are placed
        self._receiving: dict[str, int] = {}

    # --- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        private_dir(self.dir)
        await asyncio.to_thread(shutil.rmtree, self.dir / WORK, True)  # seals cut short
        for rec in await self.store.load_volumes():
            self.records[rec.volume_id] = rec
            if self._shared_fs(rec).exists():  # its own file system, mounted again
                try:
                    await asyncio.to_thread(self._shared_fs(rec).mount)
                except SharedFsError as exc:
                    log.error("a shared volume's file system did not mount",
                              extra={"volume_id": rec.volume_id, "error": str(exc)})
                    continue
            # uploads a stopped node was receiving are incomplete: dropped
            await asyncio.to_thread(shutil.rmtree, self._tmp(rec), True)
            self._tmp(rec).mkdir(exist_ok=True)

    # --- records -------------------------------------------------------------------------------

    def _shared_fs(self, rec: VolumeRecord) -> SharedFilesystem:
        """A volume mounted rw-shared once lives on a file system of its own from then on
        (docs/volumes.md §7.1): <id>/shared/fs/data (exported) and fs/tmp (uploads)."""
        return SharedFilesystem(self.dir / rec.volume_id / "shared")

    def is_shared(self, rec: VolumeRecord) -> bool:
        return self._shared_fs(rec).exists()

    def _data(self, rec: VolumeRecord) -> Path:
        fs = self._shared_fs(rec)
        if fs.exists():
            return fs.mountpoint / "data"
        return self.dir / rec.volume_id / "data"

    def _tmp(self, rec: VolumeRecord) -> Path:
        fs = self._shared_fs(rec)
        if fs.exists():
            return fs.mountpoint / "tmp"
        return self.dir / rec.volume_id / "tmp"

    def files(self, rec: VolumeRecord) -> VolumeFiles:
        return VolumeFiles(self._data(rec))

    def token(self, rec: VolumeRecord) -> str:
        return self.tokens.volume_token(rec.volume_id)

    def of_team(self, team: str) -> list[VolumeRecord]:
        return sorted((r for r in self.records.values() if r.team == team),
                      key=lambda r: (r.created_at, r.volume_id))

    def get(self, team: str, volume_id: str) -> VolumeRecord:
        """The team's volume `volume_id` (another team's is not found)."""
        rec = self.records.get(volume_id)
        if rec is None or rec.team != team:
            raise NotFound(f"volume {volume_id!r} not found")
        return rec

    def named(self, team: str, name: str) -> VolumeRecord:
        for rec in self.records.values():
            if rec.team == team and rec.name == name:
                return rec
        raise NotFound(f"volume {name!r} not found")

    def authorized(self, volume_id: str, authorization: str | None) -> VolumeRecord:
        """The volume a content request names, if it carries that volume's token. A token that
        does not fit is a 401 whether the volume exists or not (ids are not probed)."""
        given = None
        if authorization and authorization.startswith("Bearer "):
            given = authorization[len("Bearer "):].strip()
        if not same_secret(given, self.tokens.volume_token(volume_id)):
            raise Unauthorized(TOKEN_NEEDED)
        rec = self.records.get(volume_id)
        if rec is None:
            raise NotFound(f"volume {volume_id!r} not found")
        return rec

    async def create(self, team: str, name: str, size_mb: int | None) -> VolumeRecord:
        if not NAME.match(name):
            raise BadRequest(f"volume name {name!r} must be 1-128 characters of letters, "
                             "digits, '_' and '-'")
        size = self.limits.size_bytes(size_mb)
        if any(r.team == team and r.name == name for r in self.records.values()):
            raise Conflict(f"the team already has a volume named {name!r}")
        rec = VolumeRecord(volume_id=str(uuid.uuid4()), team=team, name=name, size_bytes=size)
        home = self.dir / rec.volume_id
        try:
            private_dir(home)
            self._data(rec).mkdir(mode=0o755)
            os.chmod(self._data(rec), 0o755)
            self._tmp(rec).mkdir(mode=0o700)
            await self.store.put_volume(rec)
        except NameTaken:
            await asyncio.to_thread(shutil.rmtree, home, True)
            raise Conflict(f"the team already has a volume named {name!r}") from None
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, home, True)
            raise
        self.records[rec.volume_id] = rec
        self._used[rec.volume_id] = 0
        log.info("volume created", extra={"volume_id": rec.volume_id, "team": team,
                                          "volume": name, "size_bytes": size})
        return rec

    async def delete(self, team: str, volume_id: str) -> None:
        rec = self.get(team, volume_id)
        async with self._lock(rec):
            users = self._sharers().get(rec.volume_id)
            if users:
                raise Conflict(f"volume {rec.name!r} is mounted shared read-write by sandbox "
                               f"{', '.join(users)}: kill or pause them first")
            try:
                await asyncio.to_thread(self._shared_fs(rec).unmount, True)
            except SharedFsError as exc:
                raise Conflict(f"volume {rec.name!r}: its file system is in use ({exc})") from None
            await self.store.delete_volume(rec.volume_id)
            self.records.pop(rec.volume_id, None)
            self._used.pop(rec.volume_id, None)
            await asyncio.to_thread(shutil.rmtree, self.dir / rec.volume_id, True)
        self._locks.pop(rec.volume_id, None)
        log.info("volume deleted", extra={"volume_id": rec.volume_id, "team": team})
        self._sealed()  # its versions go once no sandbox or snapshot uses them

    # --- content -------------------------------------------------------------------------------

    def _lock(self, rec: VolumeRecord) -> asyncio.Lock:
        return self._locks.setdefault(rec.volume_id, asyncio.Lock())

    def _live(self, rec: VolumeRecord) -> None:
        """After waiting for the lock: the volume may have been deleted meanwhile."""
        if rec.volume_id not in self.records:
            raise NotFound(f"volume {rec.volume_id!r} not found")

    def _not_written(self, rec: VolumeRecord) -> None:
        """409 while a sandbox mounts the volume read-write: it is that sandbox's to change."""
        writer = self._writers().get(rec.volume_id)
        if writer is not None:
            raise Conflict(f"volume {rec.name!r} is mounted read-write by sandbox {writer}: "
                           "it changes through that sandbox (and a commit) until it ends")

    async def _usage(self, rec: VolumeRecord) -> int:
        """What the volume's content counts (under its lock; walked once, then kept; a shared
        volume's at every change: its sandboxes write it too)."""
        if rec.volume_id not in self._used or self.is_shared(rec):
            self._used[rec.volume_id] = await asyncio.to_thread(self.files(rec).usage)
        return self._used[rec.volume_id]

    async def _room(self, rec: VolumeRecord) -> int:
        """Bytes the volume may still take (under its lock), uploads being received counted."""
        return (rec.size_bytes - await self._usage(rec)
                - self._receiving.get(rec.volume_id, 0))

    async def _change(self, rec: VolumeRecord, work: Callable[[int], tuple[Any, int]]) -> Any:
        """Run `work(room)` (returning (answer, bytes it added)) as the volume's one change."""
        async with self._lock(rec):
            self._live(rec)
            self._not_written(rec)
            if not rec.dirty:  # recorded before the change: a crash in between only reseals
                rec.dirty = True
                await self.store.put_volume(rec)
            answer, grew = await asyncio.to_thread(work, await self._room(rec))
            self._used[rec.volume_id] += grew
            return answer

    async def make_dir(self, rec: VolumeRecord, parts: tuple[str, ...], uid: int | None,
                       gid: int | None, mode: int | None, force: bool) -> dict[str, Any]:
        files = self.files(rec)
        return await self._change(
            rec, lambda room: files.make_dir(parts, uid, gid, mode, force, room))

    async def update(self, rec: VolumeRecord, parts: tuple[str, ...], uid: int | None,
                     gid: int | None, mode: int | None) -> dict[str, Any]:
        files = self.files(rec)
        return await self._change(rec, lambda room: (files.update(parts, uid, gid, mode), 0))

    async def remove(self, rec: VolumeRecord, parts: tuple[str, ...]) -> None:
        files = self.files(rec)
        await self._change(rec, lambda room: (None, -files.remove(parts)))

    async def write(self, rec: VolumeRecord, parts: tuple[str, ...],
                    body: AsyncIterator[bytes], length: int | None, uid: int | None,
                    gid: int | None, mode: int | None, force: bool) -> dict[str, Any]:
        """Receive an upload into the volume's tmp directory, then move it to `parts`."""
        files = self.files(rec)
        # refused before a byte is received; what it replaces is room it may take
        self._not_written(rec)
        replaced = await asyncio.to_thread(files.check_target, parts, force)
        reserve, setting = self._space_reserve()
        what = f"a write to volume {rec.name!r}"
        async with self._lock(rec):
            self._live(rec)
            room = await self._room(rec) + replaced
        if length is not None:
            if file_charge(length) > room:
                raise self._too_large(rec, length)
            try:
                require_free_space(self.dir, length, what, reserve=reserve, setting=setting)
            except InsufficientSpace as exc:
                raise ApiError(str(exc), status=507) from None
        tmp = self._tmp(rec)
        fd, name = await asyncio.to_thread(files.receive, tmp, uid, gid, mode)
        received = 0
        guard = SpaceGuard(self.dir, what, reserve=reserve, setting=setting)
        try:
            try:
                async for chunk in body:
                    received += len(chunk)
                    self._receiving[rec.volume_id] = (
                        self._receiving.get(rec.volume_id, 0) + len(chunk))
                    if self._used.get(rec.volume_id, 0) + self._receiving[rec.volume_id] \
                            > rec.size_bytes + replaced:
                        raise self._too_large(rec, received)
                    try:
                        guard.wrote(len(chunk))
                    except InsufficientSpace as exc:
                        raise ApiError(str(exc), status=507) from None
                    await asyncio.to_thread(_write_all, fd, chunk)
                await asyncio.to_thread(os.fsync, fd)
            finally:
                os.close(fd)
                self._receiving[rec.volume_id] = (
                    self._receiving.get(rec.volume_id, 0) - received)
            result: dict[str, Any] = await self._change(
                rec, lambda room: files.place(tmp, name, parts, force, room))
            return result
        except TooLarge:
            raise self._too_large(rec, received) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp / name)

    def _too_large(self, rec: VolumeRecord, size: int) -> TooLarge:
        return TooLarge(f"volume {rec.name!r} is full: its size is {rec.size_bytes >> 20} MiB "
                        f"and it has no room for {size} more bytes (remove files, or make a "
                        "larger volume: sizeMB, up to the node's "
                        f"{MAX_SIZE_SETTING}={self.limits.max_size_mb})")

    async def read(self, rec: VolumeRecord, parts: tuple[str, ...]) -> tuple[int, int]:
        """(fd, size) of a file to send (the caller closes fd)."""
        return await asyncio.to_thread(self.files(rec).open_file, parts)

    async def replace_content(self, rec: VolumeRecord, archive: Path, what: str) -> None:
        """The volume's content becomes the tar `archive` (a sandbox's commit, §8): unpacked
        by the template applier (untrusted archives: nothing lands outside the new directory)
        into a directory of its own, checked against the volume's size, then swapped in."""
        if self.is_shared(rec):
            raise BadRequest(f"{what}: volume {rec.name!r} is shared read-write: its sandboxes "
                             "write it in place, there is nothing to commit")
        async with self._lock(rec):
            self._live(rec)
            home = self.dir / rec.volume_id
            new, old = home / "data.new", home / "data.old"
            await asyncio.to_thread(_remove_tree, new)
            new.mkdir(mode=0o755)
            try:
                await asyncio.to_thread(apply_layer, new, archive, PLAIN_TAR, None, name=what)
                # the guest's device nodes would be the host's in the volume's directory (the
                # content API's reads, the seal), and a tree deeper than the API makes could
                # not be counted or removed: neither is taken
                unfit = await asyncio.to_thread(unfit_entry, new)
                if unfit is not None:
                    raise BadRequest(f"{what}: {unfit} (change the mount first)")
                used = await asyncio.to_thread(VolumeFiles(new).usage)
                if used > rec.size_bytes:
                    raise TooLarge(f"{what}: {used} bytes do not fit volume {rec.name!r} of "
                                   f"{rec.size_bytes >> 20} MiB")
                rec.dirty = True
                await self.store.put_volume(rec)
                await asyncio.to_thread(_swap, self._data(rec), new, old)
            except LayerApplyError as exc:
                raise ApiError(f"{what}: {exc}", status=500) from None
            finally:
                await asyncio.to_thread(_remove_tree, new)
            self._used[rec.volume_id] = used
        log.info("volume content replaced", extra={"volume_id": rec.volume_id, "what": what,
                                                   "bytes": used})

    # --- mounting (docs/volumes.md §6) ---------------------------------------------------------

    def current_layers(self) -> set[Path]:
        """The latest sealed version of every volume (the garbage collector keeps them)."""
        return {Path(r.layer) for r in self.records.values() if r.layer}

    async def seal(self, rec: VolumeRecord) -> str:
        """The layer of the volume's current content: the last one, or a new version when the
        content changed since (no change is made while it is sealed)."""
        async with self._lock(rec):
            self._live(rec)
            if self.is_shared(rec):
                # Its tree is written live by guests over NFS: a walk of it as root (mkfs -d
                # follows what it finds between its checks and its opens) would read what a
                # guest swaps in, host files included.
                raise Conflict(SHARED_ONLY.format(name=rec.name))
            if not rec.dirty and rec.layer and os.path.exists(rec.layer):
                return rec.layer
            version = rec.version + 1
            layer = self.dir / LAYERS / f"{rec.volume_id}-v{version}.layer"
            t0 = time.monotonic()
            data = self._data(rec)
            st = await asyncio.to_thread(os.stat, data)
            # the raw image and the layer each hold about the content
            need = 2 * await self._usage(rec)
            reserve, setting = self._space_reserve()
            what = f"sealing volume {rec.name!r} for a mount"
            try:
                require_free_space(self.dir, need, what, reserve=reserve, setting=setting)
                await asyncio.to_thread(
                    seal_directory, data, layer, fs_bytes(rec.size_bytes),
                    (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)), self.dir / WORK)
            except InsufficientSpace as exc:
                raise ApiError(str(exc), status=507) from None
            except (AgentEnvError, OSError) as exc:
                raise ApiError(f"{what} failed: {exc}", status=500) from exc
            rec.layer, rec.version, rec.dirty = str(layer), version, False
            await self.store.put_volume(rec)
        log.info("volume sealed", extra={"volume_id": rec.volume_id, "version": version,
                                         "seconds": round(time.monotonic() - t0, 2),
                                         "layer_bytes": layer.stat().st_size})
        self._sealed()  # the previous version may be unused now
        return str(layer)

    def plan_mounts(self, team: str, wanted: list[tuple[str, str, str | None]],
                    inherited: list[MountRecord], free_slots: list[int] | None,
                    backend: str) -> list[PlannedMount]:
        """The mounts a create asks for, as (name, path, mode), checked before anything is
        made: at most AENV_VOLUME_MAX_MOUNTS with those the source snapshot has already,
        paths a volume may take, the team's volumes (another team's is not found), and a free
        volume disk each (`free_slots`; None: the backend mounts no volumes). 4xx naming the
        problem."""
        total = len(wanted) + len(inherited)
        if total > self.limits.max_mounts:
            raise BadRequest(f"volumeMounts: {total} volumes"
                             f"{f' ({len(inherited)} of them from the snapshot)' if inherited else ''}"
                             f" is more than the node's {MAX_MOUNTS_SETTING}="
                             f"{self.limits.max_mounts}")
        paths = [m.path for m in inherited]
        planned: list[PlannedMount] = []
        writers = self._writers()
        sharers = self._sharers()
        for index, (raw_name, raw_path, raw_mode) in enumerate(wanted):
            what = f"volumeMounts[{index}]"
            name, mode = _name_and_mode(raw_name, raw_mode, what)
            path = check_mount_path(raw_path, what)
            for other in paths:
                if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                    raise BadRequest(f"{what}: path {path} overlaps the mount at {other}")
            paths.append(path)
            try:
                volume = self.named(team, name)
            except NotFound:
                raise NotFound(f"{what}: volume {name!r} not found") from None
            if mode in ("rw", SHARED):
                if volume.volume_id in writers:
                    raise Conflict(f"{what}: volume {name!r} is mounted read-write by sandbox "
                                   f"{writers[volume.volume_id]} (one sandbox at a time)")
                if any(p.volume is volume and p.mode in ("rw", SHARED) for p in planned):
                    raise BadRequest(f"{what}: volume {name!r} is mounted read-write twice")
            if mode == "rw" and volume.volume_id in sharers:
                raise Conflict(f"{what}: volume {name!r} is mounted shared read-write by "
                               f"sandbox {', '.join(sharers[volume.volume_id])}")
            if mode == SHARED and not self.limits.shared_rw:
                raise BadRequest(f"{what}: mode 'rw-shared' is off on this node "
                                 f"({SHARED_RW_SETTING}; docs/volumes.md §7.1)")
            if mode != SHARED and self.is_shared(volume):
                raise Conflict(f"{what}: " + SHARED_ONLY.format(name=name))
            planned.append(PlannedMount(volume, path, mode, -1))
        if free_slots is None:
            raise BadRequest(f"volumeMounts: the {backend} backend does not mount volumes (the "
                             "VM backend does)")
        disks = [p for p in planned if p.mode != SHARED]  # a shared mount takes no disk
        if len(disks) > len(free_slots):
            raise BadRequest(f"volumeMounts: the template has {len(free_slots)} free volume "
                             f"disks for {len(disks)} volumes (a template built before volumes "
                             "has none: build it again)")
        slots = dict(zip((id(p) for p in disks), free_slots, strict=False))
        return [p if p.mode == SHARED else dataclasses.replace(p, slot=slots[id(p)])
                for p in planned]

    async def make_shared(self, rec: VolumeRecord) -> Path:
        """The volume on a file system of its own, mounted (docs/volumes.md §7.1): made at its
        first shared mount from its directory (content, owners, modes), which it replaces for
        good. Returns the directory the NFS server exports."""
        fs = self._shared_fs(rec)
        async with self._lock(rec):
            self._live(rec)
            if not fs.exists():
                home = self.dir / rec.volume_id
                stage = home / "shared-stage"
                await asyncio.to_thread(_remove_tree, stage)
                stage.mkdir(mode=0o700)
                # mkfs -d copies the tree: `data` moves under the stage (a rename), back if
                # the file system cannot be made
                os.rename(home / "data", stage / "data")
                # The image is allocated whole (shared_fs.create): room for it above the
                # reserve, or a 507 naming the setting.
                reserve, setting = self._space_reserve()
                try:
                    require_free_space(self.dir, fs_bytes(rec.size_bytes),
                                       f"volume {rec.name!r}'s shared file system",
                                       reserve=reserve, setting=setting)
                except InsufficientSpace as exc:
                    os.rename(stage / "data", home / "data")
                    raise ApiError(str(exc), status=507) from None
                root = os.lstat(stage / "data")
                if root.st_uid == 0 or root.st_gid == 0:
                    # sandboxes act as the root's owner (shared_owner): not root, E2B's
                    # `user` instead (the tree is not exported yet: no guest writes it)
                    os.chown(stage / "data", SHARED_DEFAULT_OWNER, SHARED_DEFAULT_OWNER,
                             follow_symlinks=False)
                try:
                    await asyncio.to_thread(fs.create, stage, fs_bytes(rec.size_bytes),
                                            (0, 0, 0o755))
                except SharedFsError as exc:
                    os.rename(stage / "data", home / "data")
                    raise ApiError(f"volume {rec.name!r}: making its shared file system "
                                   f"failed: {exc}", status=500) from None
                await asyncio.to_thread(fs.mount)
                (fs.mountpoint / "tmp").mkdir(mode=0o700, exist_ok=True)
                await asyncio.to_thread(_remove_tree, stage)
                await asyncio.to_thread(_remove_tree, home / "tmp")
                self._used.pop(rec.volume_id, None)
                log.info("volume made shared", extra={"volume_id": rec.volume_id})
            else:
                await asyncio.to_thread(fs.mount)
        return self._data(rec)

    def shared_dir(self, rec: VolumeRecord) -> Path:
        """The directory a shared volume's export serves (the content API's too)."""
        return self._data(rec)

    def shared_owner(self, rec: VolumeRecord) -> tuple[int, int]:
        """Whom every sandbox acts as in a shared volume: the owner of its root directory,
        never root (the NFS server acts as that owner on the host's files: as root it would
        pass every permission check of the volume's file system, its upload area's too)."""
        st = os.stat(self._data(rec))
        if st.st_uid == 0 or st.st_gid == 0:
            raise Conflict(f"volume {rec.name!r}: its root directory is owned by "
                           f"{st.st_uid}:{st.st_gid}; sandboxes of a shared volume act as that "
                           "owner on the node, which must not be root: set another (PATCH "
                           "its path / with uid and gid)")
        return st.st_uid, st.st_gid

    async def mount(self, planned: PlannedMount) -> MountRecord:
        """A planned mount with the volume's sealed layer (sealed now if it changed); a shared
        one with none (the volume on its own file system, exported over NFS)."""
        if planned.mode == SHARED:
            await self.make_shared(planned.volume)
            return MountRecord(name=planned.volume.name, volume_id=planned.volume.volume_id,
                               path=planned.path, mode=SHARED, slot=-1, layer="")
        layer = await self.seal(planned.volume)
        return MountRecord(name=planned.volume.name, volume_id=planned.volume.volume_id,
                           path=planned.path, mode=planned.mode, slot=planned.slot, layer=layer)


@dataclass(frozen=True)
class PlannedMount:
    volume: VolumeRecord
    path: str
    mode: str
    slot: int


def _name_and_mode(raw: str, mode: str | None, what: str) -> tuple[str, str]:
    """A mount's volume name and mode: E2B's name, optionally `name:mode` (so that the SDK's
    `volume_mounts={"/path": "name:cow"}` chooses one), and our `mode` field."""
    name, _, suffix = raw.partition(":")
    if suffix and mode and suffix != mode:
        raise BadRequest(f"{what}: the name says mode {suffix!r} and mode says {mode!r}")
    chosen = suffix or mode or DEFAULT_MODE
    if chosen not in MODES:
        raise BadRequest(f"{what}: mode must be 'ro' (read-only, shared), 'cow' "
                         "(copy-on-write, the sandbox's own), 'rw' (read-write, one sandbox "
                         "at a time) or 'rw-shared' (read-write, shared over NFS), got "
                         f"{chosen!r}")
    return name, chosen


def check_mount_path(raw: str, what: str) -> str:
    """A mount path in the guest: absolute, normalised, and not a system directory."""
    if not raw.startswith("/") or len(raw) > MAX_MOUNT_PATH or \
            any(not c.isprintable() for c in raw):
        raise BadRequest(f"{what}: path must be an absolute path of at most {MAX_MOUNT_PATH} "
                         f"printable characters, got {raw!r}")
    path = raw.rstrip("/") or "/"
    if any(part in (".", "..") for part in path.split("/")) or "//" in path:
        raise BadRequest(f"{what}: path {raw!r} must be normalised (no '.', '..' or '//')")
    if path in SYSTEM_DIRS or any(path == top or path.startswith(top + "/")
                                  for top in SYSTEM_TREES):
        raise BadRequest(f"{what}: a volume cannot be mounted at {path}: it is a system "
                         "directory of the sandbox (mount it at /mnt/<name>, /data...)")
    return path


def _remove_tree(path: Path) -> None:
    """Remove a commit's unpacked tree, however deep the guest made it (shutil.rmtree
    recurses once per level and raised RecursionError past ~1000)."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False,
                   stdin=subprocess.DEVNULL, capture_output=True)


def _swap(data: Path, new: Path, old: Path) -> None:
    """`new` becomes `data`; the former content goes."""
    shutil.rmtree(old, ignore_errors=True)
    os.rename(data, old)
    os.rename(new, data)
    shutil.rmtree(old, ignore_errors=True)


def seal_directory(data: Path, layer: Path, size: int, root: tuple[int, int, int],
                   work: Path) -> None:
    """An overlaybd layer holding an ext4 of `size` bytes with `data`'s content, made as the
    built-in template's root disk is (rootfs.make_rootfs_image, then import_raw), its virtual
    disk VOLUME_DISK_BYTES: a volume disk of any machine."""
    work.mkdir(parents=True, exist_ok=True)
    raw = work / f"{layer.stem}.raw"
    try:
        make_rootfs_image(data, raw, size, label="aenv-volume", root=root,
                          inodes=max(size // 16384, 16384))
        os.truncate(raw, VOLUME_DISK_BYTES)
        layer.parent.mkdir(parents=True, exist_ok=True)
        import_raw(raw, layer)
    finally:
        raw.unlink(missing_ok=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

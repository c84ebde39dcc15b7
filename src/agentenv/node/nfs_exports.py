"""Who may mount which shared volume over NFS, and the node's NFS server that serves them
(node/nfs.py; docs/volumes.md §7.1).

The node has one `SharedExports`. Its server (one nfs-ganesha, files under <state>/nfs) starts at
the first `attach` (a sandbox that mounts a shared volume starts or resumes), is watched and
started again with the same exports when it dies (`supervise`), and stops with the node
(`close`). Each shared volume is one export, `/volumes/<volume id>`, whose `CLIENT` list is the
guest addresses of the running sandboxes that mount it: `attach` (before the guest runs or its
/init mounts: a client not listed is refused) adds a sandbox's address, `detach` (kill, pause,
a failed start) takes it out. An export without clients is left out of the configuration.

Export ids are part of every file handle a guest holds: a volume keeps its id for good (kept in
<state>/nfs/export-ids.json), so a handle stays valid across restarts of the server and of the
node. The clients are kept too (<state>/nfs/clients.json): a node that starts again ends the
server the previous run left (`reap_leftover`) and serves the sandboxes it adopted
(`resume_clients`) before their guests notice more than a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.node.nfs import GANESHA, NfsError, NfsExport, NfsServer
from agentenv.runtime.nfs_net import NfsNet

log = logging.getLogger("agentenv.node.nfs")

SUPERVISE_INTERVAL = 2.0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


@dataclass(frozen=True)
class SharedVolume:
    """A shared volume as its export: the directory served (the root of the volume's own file
    system, never a directory of the node's state file system: §7.1 "Found") and the owner
    every client acts as."""

    volume_id: str
    path: Path
    uid: int
    gid: int

    @property
    def pseudo(self) -> str:
        return f"/volumes/{self.volume_id}"


class SharedExports:
    def __init__(self, state_dir: Path, port: int, *, binary: str = GANESHA,
                 whole_file_systems: bool = True, network: NfsNet | None = None) -> None:
        self.state_dir = Path(state_dir)
        # Each export the root of its volume's own file system (node/shared_fs.py), checked;
        # ganesha in its own network namespace (`network`; the node's always is).
        self.server = NfsServer(self.state_dir, bind_addr="0.0.0.0", port=port, binary=binary,
                                whole_file_systems=whole_file_systems, network=network)
        self._ids_path = self.state_dir / "export-ids.json"
        self._clients_path = self.state_dir / "clients.json"
        self._ids: dict[str, int] | None = None
        #: sandbox id -> (its guest address, the shared volumes it mounts)
        self._clients: dict[str, tuple[str, tuple[SharedVolume, ...]]] = {}
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self.restarts = 0

    # -- export ids --------------------------------------------------------------------------

    def _load_ids(self) -> dict[str, int]:
        if self._ids is None:
            try:
                raw = json.loads(self._ids_path.read_text())
                self._ids = {str(k): int(v) for k, v in raw.items()}
            except FileNotFoundError:
                self._ids = {}
        return self._ids

    def export_id(self, volume_id: str) -> int:
        ids = self._load_ids()
        if volume_id not in ids:
            used = set(ids.values())
            new = next((i for i in range(1, 65536) if i not in used), None)
            if new is None:
                raise NfsError("no NFS export id left (65535 shared volumes)")
            ids[volume_id] = new
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp = self._ids_path.with_name(self._ids_path.name + ".tmp")
            tmp.write_text(json.dumps(ids, sort_keys=True))
            os.replace(tmp, self._ids_path)
        return ids[volume_id]

    def _save_clients(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        raw = {sid: {"address": address,
                     "volumes": [{"volume_id": v.volume_id, "path": str(v.path), "uid": v.uid,
                                  "gid": v.gid} for v in vols]}
               for sid, (address, vols) in self._clients.items()}
        tmp = self._clients_path.with_name(self._clients_path.name + ".tmp")
        tmp.write_text(json.dumps(raw, sort_keys=True))
        os.replace(tmp, self._clients_path)

    def reap_leftover(self) -> bool:
        """Blocking: end the server a previous node run left (its pid file, if that process is
        still a ganesha of this configuration). True when one was ended."""
        try:
            pid = int(self.server.pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return False
        if not cmdline or not cmdline[0].endswith(b"ganesha.nfsd") or \
                str(self.server.config_path).encode() not in cmdline:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.info("NFS server of the previous run ended", extra={"pid": pid})
        return True

    async def resume_clients(self, alive: set[str]) -> list[str]:
        """After a node restart: the kept clients of the sandboxes in `alive` (adopted, still
        running) are served again; the others are dropped. Returns the sandboxes served."""
        try:
            raw = json.loads(self._clients_path.read_text())
        except (OSError, ValueError):
            return []
        async with self._lock:
            for sid, entry in raw.items():
                if sid in alive:
                    self._clients[sid] = (entry["address"], tuple(
                        SharedVolume(v["volume_id"], Path(v["path"]), int(v["uid"]), int(v["gid"]))
                        for v in entry["volumes"]))
            self._save_clients()
            await self._apply()
            return sorted(self._clients)

    # -- what the server exports -------------------------------------------------------------

    def exports(self) -> list[NfsExport]:
        volumes: dict[str, SharedVolume] = {}
        clients: dict[str, list[str]] = {}
        for address, mounted in self._clients.values():
            for vol in mounted:
                volumes.setdefault(vol.volume_id, vol)
                if address not in clients.setdefault(vol.volume_id, []):
                    clients[vol.volume_id].append(address)
        return [NfsExport(self.export_id(vid), vol.path, vol.pseudo,
                          tuple(sorted(clients[vid])), vol.uid, vol.gid)
                for vid, vol in sorted(volumes.items())]

    def clients_of(self, volume_id: str) -> list[str]:
        """The sandboxes that mount `volume_id` now (running)."""
        return sorted(sid for sid, (_, vols) in self._clients.items()
                      if any(v.volume_id == volume_id for v in vols))

    async def _apply(self) -> None:
        exports = self.exports()
        if not self.server.running():
            if not exports:
                return
            await asyncio.to_thread(self.server.start, exports)
            log.info("NFS server started", extra={"pid": self.server.pid,
                                                  "port": self.server.port})
            return
        await asyncio.to_thread(self.server.update, exports)

    async def attach(self, sandbox_id: str, address: str,
                     volumes: tuple[SharedVolume, ...]) -> None:
        """Let `sandbox_id` (at `address`) mount `volumes`; starts the server if needed. On
        failure the sandbox is not listed."""
        if not volumes:
            return
        async with self._lock:
            # An address is one sandbox's: whoever held it before (a start that failed after
            # its attach, a detach lost) is out of every export before this one is in, so the
            # next holder of a slot never inherits another sandbox's volumes.
            for other, (held, _) in list(self._clients.items()):
                if held == address and other != sandbox_id:
                    log.warning("NFS client address taken over: the earlier sandbox is out",
                                extra={"sandbox_id": other, "by": sandbox_id})
                    del self._clients[other]
            before = self._clients.get(sandbox_id)
            self._clients[sandbox_id] = (address, tuple(volumes))
            try:
                await self._apply()
            except BaseException:
                if before is None:
                    self._clients.pop(sandbox_id, None)
                else:
                    self._clients[sandbox_id] = before
                with contextlib.suppress(NfsError):
                    await self._apply()
                raise
            finally:
                self._save_clients()

    async def detach(self, sandbox_id: str) -> None:
        """`sandbox_id` no longer runs (killed, paused): its address leaves every export."""
        async with self._lock:
            if self._clients.pop(sandbox_id, None) is None:
                return
            self._save_clients()
            if self.server.running():
                await self._apply()
            else:  # dead, between two checks: its binds of volumes no one mounts now go
                await asyncio.to_thread(self.server.unpublish, self.exports())

    # -- supervision -------------------------------------------------------------------------

    async def check(self) -> bool:
        """Start the server again (same exports) if it died while it had some. True when it
        was restarted. Its clients' hard mounts wait meanwhile; their open files' state is
        lost (no grace period: `Graceless`), new opens work."""
        async with self._lock:
            if self.server.running() or not self.exports():
                return False
            log.error("NFS server died: starting it again",
                      extra={"log_tail": self.server._log_text()[-500:]})
            self.server.stop()  # reap it
            await self._apply()
            self.restarts += 1
            return True

    def supervise(self, interval: float = SUPERVISE_INTERVAL) -> None:
        async def watch() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.check()
                except NfsError as exc:
                    log.error("NFS server could not be started again", extra={"error": str(exc)})

        if self._watch is None:
            self._watch = asyncio.create_task(watch())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        async with self._lock:
            await asyncio.to_thread(self.server.stop)

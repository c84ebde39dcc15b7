"""The VM backend's link to blockd: which blockd (the one at $AENV_BLOCKD_SOCKET, else a private
`aenv blockd` child under <state>/vm-backend/blockd/, reused when it outlived a crashed node),
its supervision (node/blockd_supervisor.py), and what the node asks of it.

A dead blockd is started again at once (the private one, or the one `make up` starts:
AENV_BLOCKD_STATE_DIR); /health answers 503 with the reason while it is down; creates, resumes
and forks wait for it up to AENV_BLOCKD_WAIT seconds (15) and then answer 503; a new blockd
process is checked at once for every running VM's devices (missing ones are reported on /health
and in the log, the sandbox is not deleted), and a ready-pool VM's disks are checked before it
is handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.blockd import memfs
from agentenv.blockd.client import AsyncBlockdClient, BlockdClient, DeviceInfo
from agentenv.blockd.errors import BlockdUnavailable
from agentenv.node.backend import BackendError
from agentenv.node.blockd_supervisor import BlockdLaunch, BlockdSupervisor
from agentenv.runtime.vm import VM
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.vm_backend")

# How long a create, resume or fork waits for a blockd that is down (restarting) before it
# answers 503 (AENV_BLOCKD_WAIT).
BLOCKD_WAIT = 15.0


def live_blockd(root: Path) -> int | None:
    """The pid of the private blockd an earlier node started in `root`, if it still runs and
    answers on its socket (blockd outlives a node killed with SIGKILL)."""
    try:
        pid = int((root / "blockd.pid").read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if str(root / "blockd.sock").encode() not in f.read():
                return None
        with BlockdClient(root / "blockd.sock", timeout=5) as client:
            client.ping()
    except (OSError, ValueError, BlockdUnavailable):
        return None
    return pid


def blockd_launch(socket: Path | None, private_root: Path) -> BlockdLaunch | None:
    """How the supervisor starts blockd again: the private one (no `socket`), or the one
    `make up` starts (AENV_BLOCKD_STATE_DIR names its state directory); None: only watched."""
    settings = get_settings()
    if socket is None:
        return BlockdLaunch(private_root / "state", private_root / "blockd.sock",
                            private_root / "blockd.log", private_root / "blockd.pid")
    state = settings.blockd_state_dir
    if not state:
        return None
    home = state.parent
    return BlockdLaunch(state, socket, settings.blockd_log or home / "blockd.log",
                        settings.blockd_pidfile or home / "blockd.pid")


@dataclass
class RestartCheck:
    """What a new blockd process brought back."""

    #: sandboxes whose disks it serves (their manifests must name the new blockd)
    kept: list[str] = field(default_factory=list)
    #: ready-pool VMs whose disks it does not serve (to be ended)
    pooled_lost: list[VM] = field(default_factory=list)


class BlockdLink:
    def __init__(self, base: Path, socket: Path | None) -> None:
        """`base`: the backend's directory; `socket`: a shared blockd's (None: a private one)."""
        self.private_root = base / "blockd"
        #: the socket blockd answers on (set in start() for a private blockd)
        self.socket = socket
        self.private = socket is None
        #: watches blockd, starts it again when it dies
        self.supervisor: BlockdSupervisor | None = None
        self.client: AsyncBlockdClient | None = None
        #: {"pid", "start"} of the blockd that serves the running VMs' disks
        self.identity: dict[str, Any] | None = None
        #: running sandboxes whose disks a restarted blockd did not bring back, with why
        self.lost: dict[str, str] = {}
        #: a private blockd that outlived the last node (found by find_previous)
        self.previous_pid: int | None = None

    def find_previous(self) -> int | None:
        """Blocking: the private blockd of the previous run, when it still runs (reused)."""
        if self.private:
            self.previous_pid = live_blockd(self.private_root)
        return self.previous_pid

    def find_memfs(self) -> int | None:
        """Blocking: the memfs process of the private blockd (it serves the RAM of restored
        VMs, blockd/memfs.py, and outlives a killed blockd): never a leftover."""
        launch = blockd_launch(self.socket, self.private_root)
        return memfs.live_pid(launch.state_dir) if launch is not None else None

    async def start(self, on_new_blockd: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Watch blockd (starting the private one when there is none); the node cannot start
        without it (503)."""
        launch = blockd_launch(self.socket, self.private_root)
        if self.socket is None:
            self.private_root.mkdir(parents=True, exist_ok=True)
            self.socket = self.private_root / "blockd.sock"
            if self.previous_pid is not None:
                log.info("reusing the private blockd of the previous run",
                         extra={"pid": self.previous_pid})
        self.supervisor = BlockdSupervisor(self.socket, launch=launch,
                                           on_new_blockd=on_new_blockd)
        await self.supervisor.start()
        if self.supervisor.problem() is not None:
            raise BackendError(f"the node cannot start without blockd: "
                               f"{self.supervisor.problem()}", unavailable=True)
        self.client = AsyncBlockdClient(self.socket)
        self.identity = self.supervisor.identity

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
            self.client = None
        if self.supervisor is not None:
            await self.supervisor.close()
            if self.private:
                # The node's own blockd goes with it (a shared one, as `make up` starts, stays).
                await asyncio.to_thread(self.supervisor.stop_blockd)
            self.supervisor = None
        self.previous_pid = None

    def problem(self) -> str | None:
        """Why the node cannot serve sandboxes fully right now (for /health); None: fine."""
        if self.supervisor is not None and (problem := self.supervisor.problem()):
            return problem
        if self.lost:
            return "; ".join(f"sandbox {sid}: {why}" for sid, why in sorted(self.lost.items()))
        return None

    async def wait(self) -> None:
        """Wait (briefly) for blockd; a create must never get a VM whose disks are gone."""
        if self.supervisor is None:
            return
        wait = get_settings().blockd_wait
        if not await self.supervisor.wait_up(wait):
            raise BackendError(f"blockd is unavailable (waited {wait:g} s): "
                               f"{self.supervisor.problem()}", unavailable=True)

    async def devices(self) -> list[DeviceInfo]:
        """blockd's devices; empty without a blockd."""
        return [] if self.client is None else list(await self.client.list())

    async def release(self, device_id: str) -> None:
        if self.client is not None:
            await self.client.release(device_id)

    async def disks_missing(self, vm: VM) -> list[str]:
        """The blockd devices of `vm` the current blockd does not serve."""
        wanted = {d.device_id for d in vm.disks if d.device_id}
        if not wanted or self.client is None:
            return []
        try:
            served = {d.id for d in await self.client.list()}
        except Exception as exc:
            return [f"blockd cannot list its devices: {exc}"]
        return sorted(wanted - served)

    async def check_restart(self, identity: dict[str, Any], sandboxes: Mapping[str, VM],
                            pooled: list[VM]) -> RestartCheck:
        """A new blockd process answers (it died and was started again): did it bring back
        every running VM's disks? Sandboxes whose disks are missing are reported (health, logs,
        the sandbox's lost reason), never silently deleted."""
        self.identity = identity
        check = RestartCheck()
        for sid, vm in list(sandboxes.items()):
            missing = await self.disks_missing(vm)
            if missing:
                self.lost[sid] = (f"blockd restarted (pid {identity.get('pid')}) without its "
                                  f"disks {missing}: its disk I/O fails once QEMU stops waiting")
                log.error("sandbox lost its disks in a blockd restart",
                          extra={"sandbox_id": sid, "missing": missing})
            else:
                check.kept.append(sid)
        for vm in pooled:
            if await self.disks_missing(vm):
                log.warning("ready-pool VM lost its disks in a blockd restart: ended",
                            extra={"vm": vm.id})
                check.pooled_lost.append(vm)
        return check

"""Watches the node's blockd and starts it again when it dies.

The node cannot work without blockd (every VM disk is one of its devices), and a blockd that
died must come back quickly: QEMU holds a disk's I/O while it reconnects (runtime/qemu.py,
NBD_RECONNECT_DELAY), and blockd reopens every device at the same socket from its records.

- Every `interval` seconds the supervisor pings blockd. A ping that fails makes the node
  unhealthy at once (`problem()`, shown by /health) with the reason.
- When the node knows how blockd is started (`BlockdLaunch`: the private blockd of the VM
  backend, or the one `make up` starts, named by AENV_BLOCKD_STATE_DIR) and the blockd process
  is gone, it is started again (same state directory and socket), detached from the node so
  that it outlives a node restart like the first one. Restarts back off (1 s doubling to 30 s)
  while blockd keeps failing.
- A blockd that is alive but does not answer is reported, not killed (a long snapshot can hold
  its loop for a while).
- Whenever a different blockd process answers than before (restarted by us or by anybody), the
  `on_new_blockd` callback runs: the backend checks that every VM's devices came back.
- `wait_up(timeout)` lets a create wait through a short outage instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.blockd.launch import BlockdProcess
from agentenv.fsutil import atomic_write
from agentenv.runtime.adopt import process_start_time

log = logging.getLogger("agentenv.node.blockd_supervisor")

PING_TIMEOUT = 3.0
START_TIMEOUT = 60.0
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class BlockdLaunch:
    """How to start this node's blockd: on STATE, serving SOCKET (blockd/launch.py)."""

    state_dir: Path
    socket: Path
    log_file: Path
    pidfile: Path

    def process(self) -> BlockdProcess:
        # Its own session: it outlives the node, as the blockd `make up` starts does.
        return BlockdProcess(self.state_dir, self.socket, self.log_file, fuse=False, detach=True)


def _alive(pid: int) -> bool:
    """True while `pid` runs and is not a zombie (a zombie's cmdline reads empty)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read())
    except OSError:
        return False


def _pid_from(pidfile: Path, socket: Path) -> int | None:
    """The pid in `pidfile` when that process is a blockd serving `socket`."""
    try:
        pid = int(pidfile.read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
    except (OSError, ValueError):
        return None
    return pid if str(socket).encode() in argv and b"blockd" in argv else None


class BlockdSupervisor:
    def __init__(
        self,
        socket: Path,
        *,
        launch: BlockdLaunch | None = None,
        interval: float = 1.0,
        on_new_blockd: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        self.socket = Path(socket)
        self.launch = launch
        self.interval = interval
        self.on_new_blockd = on_new_blockd
        #: {"pid", "start"} of the blockd that answered last
        self.identity: dict[str, Any] | None = None
        self.restarts = 0
        self.state = "unknown"  # "up", "down" (not answering), "restarting"
        self.reason: str | None = None
        self.down_since: float | None = None
        self._up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._backoff = 1.0
        self._next_start = 0.0

    # --- what the node asks -------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why blockd cannot serve the node right now; None while it answers."""
        return None if self.state == "up" else (self.reason or "blockd not checked yet")

    @property
    def pid(self) -> int | None:
        return None if self.identity is None else int(self.identity["pid"])

    async def wait_up(self, timeout: float) -> bool:
        if self._up.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)
        return self._up.is_set()

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Check once (starting blockd when it is ours and absent), then watch."""
        await self.check()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    def stop_blockd(self, timeout: float = 20.0) -> None:
        """SIGTERM the blockd this supervisor watches (the node's private one), wait for it."""
        pid = self.pid
        if pid is None and self.launch is not None:
            pid = _pid_from(self.launch.pidfile, self.launch.socket)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            if self._child is not None:
                self._child.poll()  # reap our own child, else it stays a zombie
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if self._child is not None:
            with contextlib.suppress(Exception):
                self._child.wait(5)
            self._child = None
        if self.launch is not None:
            self.launch.pidfile.unlink(missing_ok=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval if self.state == "up" else min(self.interval, 0.5))
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("blockd check failed")

    async def check(self) -> None:
        identity, error = await self._ping()
        if identity is not None:
            self._mark_up(identity)
            if self._changed(identity):
                previous, self.identity = self.identity, identity
                if previous is not None:
                    log.warning("a new blockd process serves the node",
                                extra={"old_pid": previous.get("pid"), "pid": identity["pid"]})
                    if self.on_new_blockd is not None:
                        await self.on_new_blockd(identity)
            return
        self._mark_down(f"blockd at {self.socket} does not answer: {error}")
        if self.launch is None:
            return
        pid = self.pid if self.pid is not None and _alive(self.pid) else None
        if pid is None:
            pid = _pid_from(self.launch.pidfile, self.launch.socket)
        if self._child is not None and self._child.poll() is not None:
            self._child = None
        if pid is not None:
            return  # alive but silent: reported, not killed
        if time.monotonic() < self._next_start:
            return
        await self._restart()

    def _changed(self, identity: dict[str, Any]) -> bool:
        return self.identity is None or identity != self.identity

    def _mark_up(self, identity: dict[str, Any]) -> None:
        if self.state != "up" and self.down_since is not None:
            log.info("blockd answers again", extra={
                "pid": identity["pid"], "down_s": round(time.monotonic() - self.down_since, 2)})
        self.state, self.reason, self.down_since = "up", None, None
        self._backoff = 1.0
        self._up.set()

    def _mark_down(self, reason: str) -> None:
        if self.state == "up":
            log.error("blockd is down", extra={"reason": reason})
        if self.down_since is None:
            self.down_since = time.monotonic()
        if self.state != "restarting":
            self.state = "down"
        self.reason = reason
        self._up.clear()

    async def _ping(self) -> tuple[dict[str, Any] | None, str]:
        client = AsyncBlockdClient(self.socket)
        try:
            answer = await asyncio.wait_for(client.call("ping"), PING_TIMEOUT)
            pid = int(answer["pid"])
        except TimeoutError:
            return None, f"no answer within {PING_TIMEOUT:g} s"
        except Exception as exc:
            return None, str(exc)
        finally:
            await client.close()
        return {"pid": pid, "start": process_start_time(pid)}, ""

    async def _restart(self) -> None:
        assert self.launch is not None
        launch = self.launch
        self.state = "restarting"
        again = self.identity is not None  # it ran before: this is a restart, not a first start
        self.reason = (f"blockd (socket {self.socket}) is not running: starting it"
                       + (f" again (restart {self.restarts + 1})" if again else ""))
        log.error("blockd is not running: starting it", extra={"socket": str(self.socket),
                                                                "state_dir": str(launch.state_dir)})
        began = time.monotonic()
        process = launch.process()
        self._child = process.spawn()
        atomic_write(launch.pidfile, f"{self._child.pid}\n", mode=0o644)
        if again:
            self.restarts += 1
        if await process.wait_ready_async(START_TIMEOUT):
            log.info("blockd started again", extra={
                "pid": self._child.pid, "seconds": round(time.monotonic() - began, 2)})
            self.state = "down"  # check() marks it up and runs on_new_blockd
            await self.check()
            return
        self.state = "down"
        tail = ""
        with contextlib.suppress(OSError):
            tail = launch.log_file.read_text(errors="replace")[-400:]
        self.reason = f"blockd could not be started again (see {launch.log_file}): {tail}"
        log.error("blockd restart failed", extra={"log_tail": tail})
        self._next_start = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)

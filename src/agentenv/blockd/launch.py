"""The one way to start a blockd process and wait until it answers.

Everyone who starts a blockd of its own goes through `BlockdProcess`: the node's supervisor (its
private blockd, or the one `make up` started, when it died), a pull without a daemon
(template/convert.py), the runtime's and blockd's tests and the benches. The process runs
`python -m agentenv.blockd` (blockd/__main__.py, the same command as `aenv blockd`), so no layer
below the CLI starts the CLI. `make up` starts blockd with `aenv blockd` (scripts/up.sh).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from agentenv.blockd import memfs
from agentenv.blockd.client import AsyncBlockdClient, BlockdClient
from agentenv.blockd.errors import BlockdError

#: how long one ping may take while waiting for a starting blockd
PING_TIMEOUT = 5.0


class BlockdStartFailed(BlockdError):
    """A blockd process that exited, or did not answer in time, while starting."""


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the starter dies, so no private blockd is left behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class BlockdProcess:
    """A blockd on `state_dir` serving its control socket at `socket`, its output appended to
    `log_file`.

    fuse: devices as FUSE files too (`--no-fuse` otherwise). extra_args: more `aenv blockd`
    options. detach: its own session, so that it outlives its starter (the node's blockd, as
    the one `make up` starts). die_with_parent: SIGTERM when its starter dies (a blockd started
    for one pull)."""

    def __init__(self, state_dir: Path, socket: Path, log_file: Path, *, fuse: bool = True,
                 extra_args: Sequence[str] = (), detach: bool = False,
                 die_with_parent: bool = False) -> None:
        self.state_dir = state_dir
        self.socket = socket
        self.log_file = log_file
        self.fuse = fuse
        self.extra_args = list(extra_args)
        self.detach = detach
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "agentenv.blockd", "--state-dir", str(self.state_dir),
                "--socket", str(self.socket), *([] if self.fuse else ["--no-fuse"]),
                *self.extra_args]

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process; `wait_ready` (or `start`, both at once) waits until it answers."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                start_new_session=self.detach,
                preexec_fn=_die_with_parent if self.die_with_parent else None)
        return self.proc

    def start(self, timeout: float = 30.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Return once blockd answers a ping; BlockdStartFailed (with the end of its log) when
        it exits first or `timeout` seconds pass (the process is stopped then)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(BlockdError, OSError), \
                    BlockdClient(self.socket, timeout=PING_TIMEOUT) as client:
                client.ping()
                return
            if self.proc.poll() is not None:
                raise BlockdStartFailed(f"blockd exited with {self.proc.returncode}: "
                                        + self.log_tail())
            if time.monotonic() > deadline:
                self.stop()
                raise BlockdStartFailed(f"blockd did not answer within {timeout:g} s: "
                                        + self.log_tail())
            time.sleep(0.05)

    async def wait_ready_async(self, timeout: float) -> bool:
        """True once blockd answers a ping; False when it exits first or `timeout` passes."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            client = AsyncBlockdClient(self.socket)
            try:
                await asyncio.wait_for(client.call("ping"), PING_TIMEOUT)
                return True
            except Exception:
                if self.proc.poll() is not None:
                    return False
            finally:
                await client.close()
        return False

    def log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_file.read_text(errors="replace").strip().splitlines()[-lines:])
        return ""

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (blockd stops gracefully: devices recorded, FUSE unmounted, its memfs
        ended), SIGKILL when it takes longer than `timeout`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        memfs.stop(self.state_dir)  # a blockd killed on the way leaves its memfs running

    def kill9(self) -> None:
        """SIGKILL, as a crash: nothing is cleaned up."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

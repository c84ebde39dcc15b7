"""Running the egress proxy as a child process (what the node and the tests do)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from agentenv.network.control import EgressControlClient, EgressControlError


class EgressProxyProcess:
    """`python -m agentenv.network.egress` as a child: start() returns once its control socket
    answers ping; stop() ends it (SIGTERM, then SIGKILL). Its stderr (JSON log lines) goes to
    `log_path` when given. start(adopt=True) takes over a proxy already answering on the control
    socket (left running by a node that crashed or restarted: its live connections survive;
    the node then sends `sync`). `launcher` is put before the command (it must exec it: a
    test's `unshare --mount` that gives the proxy its own /etc/hosts)."""

    def __init__(self, control_path: Path | str, port: int, *, bind: str = "0.0.0.0",
                 metrics_port: int | None = None, log_path: Path | str | None = None,
                 extra_args: tuple[str, ...] = (), start_timeout: float = 15.0,
                 launcher: tuple[str, ...] = ()) -> None:
        self.control_path = Path(control_path)
        self.port, self.bind, self.metrics_port = port, bind, metrics_port
        self.log_path = Path(log_path) if log_path is not None else None
        self.extra_args = extra_args
        self.launcher = launcher
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.adopted_pid: int | None = None
        self.client = EgressControlClient(self.control_path)
        self._log: IO[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        argv = [*self.launcher, sys.executable, "-m", "agentenv.network.egress", "--control",
                str(self.control_path), "--port", str(self.port), "--bind", self.bind]
        if self.metrics_port is not None:
            argv += ["--metrics-port", str(self.metrics_port)]
        return argv + list(self.extra_args)

    def is_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.adopted_pid is not None and _is_egress_proxy(self.adopted_pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.adopted_pid

    async def _adopt(self) -> dict[str, Any] | None:
        if not self.control_path.exists():
            return None
        probe = EgressControlClient(self.control_path, timeout=2.0)
        try:
            answer = await probe.ping()
        except EgressControlError:
            return None
        finally:
            await probe.close()
        pid = answer.get("pid")
        if not isinstance(pid, int) or not _is_egress_proxy(pid) or \
                (self.port and answer.get("port") != self.port):
            return None
        self.adopted_pid = pid
        return answer

    async def start(self, adopt: bool = False) -> dict[str, Any]:
        """Start it and wait until it answers; returns the first ping's answer (`port` is the
        listening port, useful with port 0; `pid`). With `adopt`, a proxy already answering on
        the control socket (same port) is taken over instead. Raises EgressControlError if it
        does not come up."""
        if self.is_alive():
            raise EgressControlError("the egress proxy is already running")
        if adopt and (answer := await self._adopt()) is not None:
            return answer
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()  # a stale socket must not answer for the new process
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        last: Exception | None = None
        while loop.time() < deadline:
            if self.proc.poll() is not None:
                raise EgressControlError(
                    f"the egress proxy exited with status {self.proc.returncode} at start"
                    + (f" (log: {self.log_path})" if self.log_path else ""))
            if self.control_path.exists():
                try:
                    return await self.client.ping()
                except EgressControlError as exc:
                    last = exc
            await asyncio.sleep(0.02)
        await self.stop()
        raise EgressControlError(f"the egress proxy did not answer within "
                                 f"{self.start_timeout} s: {last}")

    async def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        await self.client.close()
        proc, self.proc = self.proc, None
        code: int | None = None
        adopted, self.adopted_pid = self.adopted_pid, None
        if adopted is not None and _is_egress_proxy(adopted):
            # Not our child: signal it and watch it go (its parent or init reaps it).
            with contextlib.suppress(ProcessLookupError):
                os.kill(adopted, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while _is_egress_proxy(adopted) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            if _is_egress_proxy(adopted):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(adopted, signal.SIGKILL)
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout
                while proc.poll() is None and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                if proc.poll() is None:
                    proc.kill()
                    await asyncio.to_thread(proc.wait)
            code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


def running_for(control_path: Path | str) -> list[int]:
    """Live egress proxies started with this control socket (left by a node that crashed)."""
    needle = b"\0--control\0" + str(control_path).encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in argv and _is_egress_proxy(int(entry)):
            found.append(int(entry))
    return found


def _is_egress_proxy(pid: int) -> bool:
    """A live (not zombie) process running the egress proxy module."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and b"agentenv.network.egress" in cmdline

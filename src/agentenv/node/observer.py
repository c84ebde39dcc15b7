"""What the node keeps of each sandbox's life: metric samples and output lines.

Every `interval` seconds (AENV_METRICS_INTERVAL, default 5; 0 turns sampling off) the observer
samples each running sandbox: the backend's host-side figures (CPU of its VM or processes,
their resident memory, disk used) and envd's `/metrics`, the guest's own memory view. E2B's
`memUsed`/`memCache` are the guest's when envd answered (else the host-side figure);
`memUsedHost` is always the host-side one. It also reads what the sandbox's log files
(SandboxLogs: the VM's serial console, or the process backend's envd output) gained since the
last look, stamped with the time they were read.

Kept per sandbox, in memory and bounded: the last AENV_METRICS_MAX_SAMPLES samples and the last
AENV_LOGS_MAX_BYTES of lines, through its whole life (paused included) and for
AENV_METRICS_GRACE seconds after it is gone, then dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.node.backend import BackendError, MetricSample
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import State
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.observer")

LEVELS = ("debug", "info", "warn", "error")
#: bytes read from one log file per look: a guest flooding its console cannot stall the node
MAX_READ = 256 * 1024


def _guest_bytes(value: object) -> int:
    """A byte count the guest reported (whatever answers on envd's port is the guest's):
    ValueError unless it is a whole number from 0 to 2**63 - 1 (JSON's 1e400 is a float
    infinity, whose int() is an OverflowError, and negative or huge figures mean nothing)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a byte count: {value!r:.40}")
    number = int(value)
    if not 0 <= number < 1 << 63:
        raise ValueError(f"byte count out of range: {str(number)[:40]}")
    return number


@dataclass(frozen=True)
class ObserverConfig:
    interval: float = 5.0
    grace: float = 600.0
    max_samples: int = 2880  # 4 h at the default interval
    max_log_bytes: int = 256 * 1024

    @classmethod
    def from_env(cls) -> ObserverConfig:
        s = get_settings()
        return cls(interval=s.metrics_interval, grace=s.metrics_grace,
                   max_samples=s.metrics_max_samples, max_log_bytes=s.logs_max_bytes)


@dataclass(frozen=True)
class Sample:
    metric: MetricSample  # E2B's fields (guest memory when envd answered)
    mem_used_host: int


@dataclass(frozen=True)
class LogLine:
    timestamp: float
    source: str
    level: str
    text: str


@dataclass
class History:
    team: str
    samples: deque[Sample]
    lines: deque[LogLine] = field(default_factory=deque)
    line_bytes: int = 0
    ended_at: float | None = None
    #: per log file: (inode, offset read up to)
    read_to: dict[Path, tuple[int, int]] = field(default_factory=dict)


def level_of(text: str) -> str:
    """A JSON line's own level (envd logs JSON), else info."""
    if text.startswith("{"):
        with contextlib.suppress(ValueError, AttributeError):
            raw = str(json.loads(text).get("level", "info")).lower()
            raw = {"warning": "warn", "fatal": "error", "panic": "error"}.get(raw, raw)
            if raw in LEVELS:
                return raw
    return "info"


class Observer:
    def __init__(self, orchestrator: Orchestrator, config: ObserverConfig) -> None:
        self.orchestrator = orchestrator
        #: the backend the host-side samples come from
        self.backend = orchestrator.backend
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        self.config = config
        self.histories: dict[str, History] = {}
        #: sandboxes being looked at now, with when that look ends (a request's look and the
        #: interval's never overlap: both would read the same new log bytes)
        self._busy: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.config.interval > 0:
            self._task = asyncio.create_task(self._observe_forever(), name="observer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _observe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.observe_once()
            except Exception:
                log.exception("observer pass failed")

    def usage(self) -> tuple[float, int] | None:
        """(CPUs busy, resident bytes) of the running sandboxes by their latest host-side
        samples; None when sampling is off."""
        if self.config.interval <= 0:
            return None
        cpus, resident = 0.0, 0
        for rec in self.orchestrator.all_sandboxes():
            history = self.histories.get(rec.sandbox_id)
            if rec.state == State.RUNNING and history is not None and history.samples:
                last = history.samples[-1]
                cpus += last.metric.cpu_used_pct * last.metric.cpu_count / 100
                resident += last.mem_used_host
        return cpus, resident

    def of(self, sandbox_id: str, team: str) -> History | None:
        history = self.histories.get(sandbox_id)
        return history if history is not None and history.team == team else None

    async def observe_once(self) -> None:
        """One look at every sandbox; ended ones past the grace are forgotten."""
        now = time.time()
        for sid, history in list(self.histories.items()):
            if self.orchestrator.sandbox(sid) is None and history.ended_at is None:
                history.ended_at = now
            if history.ended_at is not None and now - history.ended_at > self.config.grace:
                del self.histories[sid]
        running = [r for r in self.orchestrator.all_sandboxes()
                   if r.state == State.RUNNING and r.placement is not None]
        await asyncio.gather(*(self.observe(r.sandbox_id) for r in running))

    async def observe(self, sandbox_id: str) -> None:
        """Sample one running sandbox and read its new log lines. A look already under way
        (the interval's, when a request asks) is waited for: its sample is this one's, and a
        request returning before it would answer with none."""
        under_way = self._busy.get(sandbox_id)
        if under_way is not None:
            await asyncio.shield(under_way)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy[sandbox_id] = done
        try:
            await self._observe(sandbox_id)
        finally:
            del self._busy[sandbox_id]
            done.set_result(None)

    async def _observe(self, sandbox_id: str) -> None:
        rec = self.orchestrator.sandbox(sandbox_id)
        if rec is None or rec.state != State.RUNNING or rec.placement is None:
            return
        history = self.histories.get(sandbox_id)
        if history is None:
            history = History(rec.team, deque(maxlen=self.config.max_samples))
            self.histories[sandbox_id] = history
        try:
            host = await self.backend.metrics(sandbox_id, rec.placement)
        except BackendError as exc:
            log.debug("metrics failed", extra={"sandbox_id": sandbox_id, "error": str(exc)})
            return
        metric = host
        http = self.orchestrator.http
        if http is not None:
            envd = EnvdClient(rec.placement.envd_url,
                              rec.envd_access_token if rec.secure else None, http=http)
            with contextlib.suppress(EnvdClientError, KeyError, TypeError, ValueError,
                                     OverflowError):
                guest = await envd.metrics()
                metric = replace(host, mem_used=_guest_bytes(guest["mem_used"]),
                                 mem_cache=_guest_bytes(guest["mem_cache"]))
        history.samples.append(Sample(metric, host.mem_used))
        logs = self.capabilities.logs
        if logs is not None:
            files = logs.log_files(sandbox_id)
            lines = await asyncio.to_thread(self._read_new, history, files)
            self._keep(history, lines)

    @staticmethod
    def _read_new(history: History, files: list[tuple[str, Path]]) -> list[LogLine]:
        """Complete lines each file gained since the last look (blocking: run in a thread).
        A file that was replaced or truncated (the serial log's rotation) is read from 0."""
        now = time.time()
        out: list[LogLine] = []
        for source, path in files:
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    inode, offset = history.read_to.get(path, (st.st_ino, 0))
                    if inode != st.st_ino or st.st_size < offset:
                        offset = 0
                    f.seek(offset)
                    chunk = f.read(MAX_READ)
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1
            if end == 0 and len(chunk) < MAX_READ:
                continue  # no complete line yet
            if end == 0:
                end = len(chunk)
            history.read_to[path] = (st.st_ino, offset + end)
            for raw in chunk[:end].splitlines():
                text = raw.decode(errors="replace").rstrip("\r")
                if text:
                    out.append(LogLine(now, source, level_of(text), text))
        return out

    def _keep(self, history: History, lines: list[LogLine]) -> None:
        for line in lines:
            history.lines.append(line)
            history.line_bytes += len(line.text)
        while history.line_bytes > self.config.max_log_bytes and history.lines:
            history.line_bytes -= len(history.lines.popleft().text)

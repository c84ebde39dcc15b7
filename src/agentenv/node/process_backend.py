"""The development backend: every sandbox is an envd process on this host, no VM.

A sandbox is a directory copied from its template (`cp -a --reflink=auto`) and one
`python -m agentenv.guest.envd --port P --root DIR` process; as root, envd chroots the processes
it starts into DIR. It is honest about what it cannot do:

- Pause stops every process of the sandbox and keeps only its files ("filesystem" pause).
  Resume starts a new envd on the same directory: files are back, processes are not.
  The VM backend does real pauses (memory kept).
- Snapshot and fork copy the directory while the sandbox runs: files only, no processes.
- There is no network isolation: every port of a sandbox is a port of this host. The proxy
  relays a sandbox port only to a listening socket one of the sandbox's own processes holds
  (`port_problem`), never to another service of the host (the node's API, Redis, blockd),
  except ports the operator opens to every sandbox (AENV_PROCESS_BACKEND_HOST_PORTS); a
  node of a cluster refuses this backend unless AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER=1
  (node/server.py).

Each running sandbox writes `sandboxes/<id>/run.json` (pid, port); after a node restart
adopt() finds the envd processes that still run from those files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agentenv.node.backend import (
    ENVD_PORT,
    BackendError,
    CrashRecovery,
    DefaultTemplate,
    ForkOutcome,
    MetricSample,
    PauseResult,
    Placement,
    SandboxBackend,
    SandboxSpec,
    SnapshotRef,
    TemplateBuilding,
    TemplateRef,
)
from agentenv.node.host_template import build_host_rootfs
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.process_backend")

ENVD_MODULE = "agentenv.guest.envd"
START_TIMEOUT = 60.0  # a Python envd starting on a loaded 2-core host can be slow
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _envd_version() -> str | None:
    try:
        # optional: a host install may lack the guest's envd (None: version unknown)
        from agentenv.guest.envd import ENVD_VERSION
    except ImportError:
        return None
    return str(ENVD_VERSION)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, utime + stime in clock ticks) for every process."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def _descendants(pid: int, table: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _chrooted_into(root: Path) -> list[int]:
    """Processes whose root directory is `root`: catches daemons that left envd's tree."""
    real = os.path.realpath(root)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/root") == real:
                    pids.append(int(entry))
    return pids


def _is_envd(pid: int, root: Path) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return ENVD_MODULE.encode() in argv and str(root).encode() in argv


_TCP_LISTEN = "0A"
_V4_ANY = "00000000"
_V6_ANY = "0" * 32


def _listeners(host: str, port: int) -> set[str]:
    """Socket inodes that accept a connection to host:port (an IPv4 address): the sockets
    bound to that very address if any, else the wildcard ones (/proc/net/tcp, tcp6)."""
    exact_v4 = socket.inet_aton(host)[::-1].hex().upper()
    exact = {exact_v4, "0000000000000000FFFF0000" + exact_v4}
    bound: dict[bool, set[str]] = {True: set(), False: set()}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] != _TCP_LISTEN or int(hex_port, 16) != port:
                continue
            if address in exact:
                bound[True].add(fields[9])
            elif address in (_V4_ANY, _V6_ANY):
                bound[False].add(fields[9])
    return bound[True] or bound[False]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def _copy_tree(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["cp", "-a", "--reflink=auto", str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        raise BackendError(f"copying {src} to {dst} failed: {result.stderr.strip()}")


def _dir_usage(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


HOST_PORTS_ENV = "AENV_PROCESS_BACKEND_HOST_PORTS"


def host_ports_from_env() -> frozenset[int]:
    """AENV_PROCESS_BACKEND_HOST_PORTS: ports of this host every process sandbox may reach
    as if its own (`A-B` ranges and single ports, comma-separated; default none). For
    development: a server run on the host standing in for one in a sandbox."""
    raw = get_settings().process_backend_host_ports.strip()
    ports: set[int] = set()
    for item in filter(None, (part.strip() for part in raw.split(","))):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or \
                not 0 < int(low) <= int(high or low) < 65536:
            raise BackendError(f"{HOST_PORTS_ENV}={raw!r}: {item!r} is no port or A-B range")
        ports.update(range(int(low), int(high or low) + 1))
    return frozenset(ports)


class ProcessBackend(SandboxBackend, CrashRecovery, TemplateBuilding):
    """Capabilities: crash recovery, and template builds from another template (the build
    sandbox's files become the template's; no network policies, image builds, layer-aware
    collection, ready pools; the orchestrator checks envd's readiness itself), and a guard on
    the ports the proxy relays to (SharedHostPorts)."""

    name = "process"
    builds_from_images = False  # no VM to boot an image's layers in

    def __init__(
        self, state_dir: Path, host: str = "127.0.0.1", python: str = sys.executable
    ) -> None:
        self.base = state_dir / "process-backend"
        self.host = host
        self.python = python
        self.host_ports = host_ports_from_env()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cpu_seen: dict[str, tuple[float, int]] = {}
        #: adopt() takes every envd that still runs: no sandbox is refused for a reason of its own
        self.adopt_failures: dict[str, str] = {}

    # --- paths -------------------------------------------------------------------------------

    def _sandbox_dir(self, sandbox_id: str) -> Path:
        return self.base / "sandboxes" / sandbox_id

    def _root(self, sandbox_id: str) -> Path:
        return self._sandbox_dir(sandbox_id) / "root"

    def _owned(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.base.resolve())
        except ValueError:
            return False
        return True

    # --- lifecycle of the backend ------------------------------------------------------------

    async def start(self) -> None:
        for sub in ("sandboxes", "snapshots", "templates"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        self._procs.clear()  # the processes keep running; adopt() finds them again

    async def default_templates(self) -> list[DefaultTemplate]:
        root = await asyncio.to_thread(build_host_rootfs, self.base / "templates" / "base")
        return [
            DefaultTemplate(
                name="base",
                ref=TemplateRef(kind="template", data={"dir": str(root)}),
                cpu_count=min(2, os.cpu_count() or 1),
                memory_mb=512,
                disk_size_mb=1024,
                envd_version=_envd_version(),
            )
        ]

    # --- envd processes ----------------------------------------------------------------------

    async def _spawn(self, spec: SandboxSpec) -> Placement:
        sid = spec.sandbox_id
        root = self._root(sid)
        sdir = self._sandbox_dir(sid)
        last_error = ""
        for _ in range(3):  # the free port may be taken between probe and bind: try another
            port = _free_port(self.host)
            log_file = open(sdir / "envd.log", "ab")  # noqa: SIM115 - handed to the child
            try:
                proc = subprocess.Popen(
                    [
                        self.python,
                        "-m",
                        ENVD_MODULE,
                        "--host",
                        self.host,
                        "--port",
                        str(port),
                        "--root",
                        str(root),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    start_new_session=True,  # survives the node: adopt() takes it back
                    cwd=str(sdir),
                )
            finally:
                log_file.close()
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection((self.host, port), timeout=0.5),
                ):
                    self._procs[sid] = proc
                    placement = Placement(
                        host=self.host,
                        envd_port=port,
                        handle={
                            "pid": proc.pid,
                            "cpu_count": spec.cpu_count,
                            "memory_mb": spec.memory_mb,
                            "disk_size_mb": spec.disk_size_mb,
                        },
                        envd_version=_envd_version(),
                    )
                    (sdir / "run.json").write_text(json.dumps(placement.to_json()))
                    return placement
                await asyncio.sleep(0.02)
            if proc.poll() is None:
                self._signal_all(proc.pid, root)
                await asyncio.to_thread(proc.wait)
            tail = (sdir / "envd.log").read_bytes()[-800:].decode(errors="replace")
            last_error = f"envd exited with {proc.returncode}: {tail.strip()}"
        raise BackendError(f"envd for {sid} did not start: {last_error}")

    def _signal_all(self, pid: int | None, root: Path) -> None:
        """SIGKILL envd, everything it started, and anything else chrooted into its root."""
        targets: set[int] = set(_chrooted_into(root))
        if pid is not None and _is_envd(pid, root):
            targets.add(pid)
            targets.update(_descendants(pid, _proc_table()))
        for target in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signal.SIGKILL)

    async def _stop(self, sandbox_id: str, placement: Placement | None) -> None:
        root = self._root(sandbox_id)
        pid = placement.handle.get("pid") if placement else None
        if pid is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = json.loads((self._sandbox_dir(sandbox_id) / "run.json").read_text())[
                    "handle"
                ]["pid"]
        await asyncio.to_thread(self._signal_all, pid, root)
        proc = self._procs.pop(sandbox_id, None)
        if proc is not None:
            await asyncio.to_thread(proc.wait)
        elif pid is not None:
            for _ in range(100):  # not our child (adopted): wait until it is gone
                if not _is_envd(pid, root):
                    break
                await asyncio.sleep(0.01)
        with contextlib.suppress(FileNotFoundError):
            (self._sandbox_dir(sandbox_id) / "run.json").unlink()
        self._cpu_seen.pop(sandbox_id, None)

    def port_problem(self, sandbox_id: str, placement: Placement, port: int) -> str | None:
        """A sandbox port is relayed to this host's `port` only when every socket listening
        there is held by a process of the sandbox (envd's children, or processes chrooted into
        its root): no other service of the host is reachable through the proxy."""
        if port == ENVD_PORT:
            return None
        if port == placement.envd_port:
            return f"envd is reached as port {ENVD_PORT}"
        if port in self.host_ports:
            return None
        listeners = _listeners(placement.host, port)
        if not listeners:
            return f"nothing listens on port {port}"
        root = self._root(sandbox_id)
        envd = placement.handle.get("pid")
        pids = set(_chrooted_into(root))
        if isinstance(envd, int) and _is_envd(envd, root):
            pids.update(_descendants(envd, _proc_table()))
        held: set[str] = set()
        for pid in pids:
            held |= _socket_inodes(pid)
        if not listeners <= held:
            return f"port {port} is not listened on by a process of sandbox {sandbox_id}"
        return None

    # --- the backend port --------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> Placement:
        src = Path(spec.source.data["dir"])
        if not src.is_dir():
            raise BackendError(f"template directory {src} is missing", retryable=False)
        sdir = self._sandbox_dir(spec.sandbox_id)
        sdir.mkdir(parents=True, exist_ok=False)
        await asyncio.to_thread(_copy_tree, src, self._root(spec.sandbox_id))
        return await self._spawn(spec)

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        await self._stop(sandbox_id, placement)
        ref = TemplateRef(kind="paused", data={"dir": str(self._root(sandbox_id))})
        return PauseResult(snapshot=ref, memory=False)

    async def recover_pause(
        self, sandbox_id: str, placement: Placement, since: float
    ) -> PauseResult | None:
        """A node that died while pausing `sandbox_id`: its files are its paused state, so the
        pause is finished (envd stopped if it still runs). None when the files are gone."""
        if not self._root(sandbox_id).is_dir():
            return None
        return await self.pause(sandbox_id, placement, memory=False)

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef,
                     memory: bool = True) -> Placement:
        # Every pause here keeps files only: a resume always starts envd afresh.
        if not self._root(spec.sandbox_id).is_dir():
            raise BackendError(f"files of paused sandbox {spec.sandbox_id} are missing")
        return await self._spawn(spec)

    async def snapshot(
        self, sandbox_id: str, placement: Placement, snapshot_id: str
    ) -> SnapshotRef:
        dest = self.base / "snapshots" / snapshot_id
        await asyncio.to_thread(_copy_tree, self._root(sandbox_id), dest)
        return TemplateRef(kind="snapshot", data={"dir": str(dest)})

    async def fork(
        self, spec: SandboxSpec, placement: Placement, children: list[SandboxSpec]
    ) -> list[ForkOutcome]:
        async def one(child: SandboxSpec) -> ForkOutcome:
            try:
                self._sandbox_dir(child.sandbox_id).mkdir(parents=True)
                await asyncio.to_thread(
                    _copy_tree, self._root(spec.sandbox_id), self._root(child.sandbox_id)
                )
                return ForkOutcome(child.sandbox_id, placement=await self._spawn(child))
            except (BackendError, OSError) as exc:
                shutil.rmtree(self._sandbox_dir(child.sandbox_id), ignore_errors=True)
                return ForkOutcome(child.sandbox_id, error=str(exc))

        return list(await asyncio.gather(*(one(c) for c in children)))

    # --- template builds (node/template_api.py) ----------------------------------------------

    async def boot_image(self, sandbox_id: str, lowers: list[Path], disk_bytes: int,
                         cpu_count: int, memory_mb: int) -> Placement:
        raise BackendError("the process backend builds templates from another template only "
                           "(fromTemplate); a build from an image needs the VM backend",
                           retryable=False)

    async def capture_template(self, sandbox_id: str) -> TemplateRef:
        """The build sandbox's files become the template's (its processes end, as in every
        pause of this backend); delete_snapshot removes them."""
        await self._stop(sandbox_id, None)
        dest = self.base / "snapshots" / f"template-{sandbox_id}"
        await asyncio.to_thread(os.rename, self._root(sandbox_id), dest)
        await asyncio.to_thread(shutil.rmtree, self._sandbox_dir(sandbox_id), True)
        return TemplateRef(kind="template", data={"dir": str(dest)})

    async def kill(self, sandbox_id: str, placement: Placement | None) -> None:
        await self._stop(sandbox_id, placement)
        await asyncio.to_thread(shutil.rmtree, self._sandbox_dir(sandbox_id), True)

    async def discard_paused(self, sandbox_id: str, snapshot: SnapshotRef) -> None:
        await self.kill(sandbox_id, None)

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        path = Path(ref.data.get("dir", ""))
        if path.name and self._owned(path):
            await asyncio.to_thread(shutil.rmtree, path, True)
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.name + ".version").unlink()

    async def adopt(self) -> dict[str, Placement]:
        found: dict[str, Placement] = {}
        for run in (self.base / "sandboxes").glob("*/run.json"):
            sid = run.parent.name
            try:
                placement = Placement.from_json(json.loads(run.read_text()))
            except (OSError, ValueError, KeyError):
                continue
            if _is_envd(int(placement.handle.get("pid", 0)), self._root(sid)):
                found[sid] = placement
        return found

    def log_files(self, sandbox_id: str) -> list[tuple[str, Path]]:
        """envd's own output (the process backend has no console)."""
        return [("envd", self._sandbox_dir(sandbox_id) / "envd.log")]

    async def metrics(self, sandbox_id: str, placement: Placement) -> MetricSample:
        return await asyncio.to_thread(self._sample, sandbox_id, placement)

    def _sample(self, sandbox_id: str, placement: Placement) -> MetricSample:
        root = self._root(sandbox_id)
        pid = int(placement.handle.get("pid", 0))
        table = _proc_table()
        pids = {pid, *_descendants(pid, table)} if pid in table else set()
        ticks = sum(table[p][1] for p in pids if p in table)
        rss = 0
        for p in pids:
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{p}/statm") as f,
            ):
                rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        now = time.time()
        cpu_count = int(placement.handle.get("cpu_count", 1))
        prev = self._cpu_seen.get(sandbox_id)
        self._cpu_seen[sandbox_id] = (now, ticks)
        pct = 0.0
        if prev and now > prev[0]:
            pct = max(0.0, (ticks - prev[1]) / CLK_TCK / (now - prev[0]) / cpu_count * 100)
        disk = os.statvfs(root)
        return MetricSample(
            timestamp=now,
            cpu_count=cpu_count,
            cpu_used_pct=round(pct, 2),
            mem_used=rss,
            mem_total=int(placement.handle.get("memory_mb", 512)) * 1024 * 1024,
            mem_cache=0,
            disk_used=_dir_usage(root),
            disk_total=min(
                disk.f_blocks * disk.f_frsize,
                int(placement.handle.get("disk_size_mb", 1024)) * 1024 * 1024,
            ),
        )

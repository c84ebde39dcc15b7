"""Processes started through `process.Process`: spawn (pipes or a PTY, as a user, chrooted when
the root is not `/`), fan-out of their output to any number of streams, stdin, signals, resize.

A process belongs to envd, not to the stream that started it: it outlives a client disconnect and
is killed only by a signal or when its lifetime (Connect-Timeout-Ms of Start) runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from agentenv.guest.envd.rootfs import RootFs, User
from agentenv.guest.envd.rpc import RpcError, encode_bytes

log = logging.getLogger("envd.process")

CHUNK_BYTES = 32 * 1024
# A stream that falls this many chunks behind pauses reading the process's output (the process
# then blocks on a full pipe) instead of buffering without bound.
PAUSE_AT_CHUNKS = 64
RESUME_AT_CHUNKS = 16
# After the process exits, wait this long for its output pipes to close; a background child that
# inherited them would otherwise hold the stream open forever.
EOF_GRACE_SECONDS = 0.25
RETAINED_EXITED = 256
SHELL_NAMES = frozenset({"bash", "sh", "ash", "dash", "zsh", "ksh"})
SIGNAL_NAMES: dict[int, str] = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}


@dataclass
class ProcessSpec:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    pty_size: tuple[int, int] | None  # (cols, rows)
    stdin: bool
    user: User
    lifetime_seconds: float | None


class Subscriber:
    """One stream's view of a process: a queue of ProcessEvent messages."""

    def __init__(self, process: ManagedProcess) -> None:
        self.process = process
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def events(self, keepalive_seconds: float) -> AsyncIterator[dict[str, Any]]:
        """ProcessEvent messages up to and including `end`; keepalives during silence."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), keepalive_seconds)
                except TimeoutError:
                    yield {"keepalive": {}}
                    continue
                if self.queue.qsize() <= RESUME_AT_CHUNKS:
                    self.process.resume_reading()
                yield event
                if "end" in event:
                    return
        finally:
            self.process.unsubscribe(self)


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    loop: asyncio.AbstractEventLoop
    on_exit: Callable[[ManagedProcess], None]
    stdin_fd: int | None = None
    pty_fd: int | None = None
    output_fds: dict[int, str] = field(default_factory=dict)  # fd -> "stdout" | "stderr" | "pty"
    subscribers: set[Subscriber] = field(default_factory=set)
    end_event: dict[str, Any] | None = None
    exit_status: int | None = None  # os.waitpid status
    timed_out: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    _pidfd: int | None = None
    _paused: bool = False
    _grace_timer: asyncio.TimerHandle | None = None
    _lifetime_timer: asyncio.TimerHandle | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.end_event is None

    def info(self) -> dict[str, Any]:
        config: dict[str, Any] = {"cmd": self.spec.cmd}
        if self.spec.args:
            config["args"] = self.spec.args
        if self.spec.envs:
            config["envs"] = self.spec.envs
        if self.spec.cwd is not None:
            config["cwd"] = self.spec.cwd
        info: dict[str, Any] = {"config": config, "pid": self.pid}
        if self.spec.tag is not None:
            info["tag"] = self.spec.tag
        return info

    # ---- wiring -----------------------------------------------------------------------------

    def attach(self) -> None:
        for fd in self.output_fds:
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._on_output, fd)
        self._pidfd = os.pidfd_open(self.pid)
        self.loop.add_reader(self._pidfd, self._on_exit)
        if self.spec.lifetime_seconds:
            self._lifetime_timer = self.loop.call_later(
                self.spec.lifetime_seconds, self._on_lifetime_over
            )

    def subscribe(self) -> Subscriber:
        subscriber = Subscriber(self)
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)
        self.resume_reading()

    def _publish(self, event: dict[str, Any]) -> None:
        for subscriber in self.subscribers:
            subscriber.queue.put_nowait(event)
            if subscriber.queue.qsize() >= PAUSE_AT_CHUNKS and not self._paused:
                self._pause_reading()

    def _pause_reading(self) -> None:
        self._paused = True
        for fd in self.output_fds:
            self.loop.remove_reader(fd)

    def resume_reading(self) -> None:
        if not self._paused:
            return
        if any(s.queue.qsize() > RESUME_AT_CHUNKS for s in self.subscribers):
            return
        self._paused = False
        for fd in self.output_fds:
            self.loop.add_reader(fd, self._on_output, fd)

    def _on_output(self, fd: int) -> None:
        kind = self.output_fds[fd]
        try:
            data = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            # A PTY master reads EIO once the last slave descriptor is closed.
            if exc.errno != errno.EIO:
                log.warning("reading output failed", extra={"pid": self.pid, "error": str(exc)})
            data = b""
        if data:
            self._publish({"data": {kind: encode_bytes(data)}})
            return
        self._close_output(fd)
        self._maybe_finish()

    def _close_output(self, fd: int) -> None:
        if not self._paused:
            self.loop.remove_reader(fd)
        del self.output_fds[fd]
        os.close(fd)

    def _on_exit(self) -> None:
        assert self._pidfd is not None
        self.loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            status = 255 << 8
        self.exit_status = status
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        if self._lifetime_timer:
            self._lifetime_timer.cancel()
        self._maybe_finish()
        if self.end_event is None:
            self._grace_timer = self.loop.call_later(EOF_GRACE_SECONDS, self._on_grace_over)

    def _on_grace_over(self) -> None:
        if self.end_event is not None:
            return
        if self._paused:
            # A slow stream still has output to take; the pipes are drained once it catches up.
            self._grace_timer = self.loop.call_later(EOF_GRACE_SECONDS, self._on_grace_over)
            return
        for fd in list(self.output_fds):
            self._drain(fd)
            if fd in self.output_fds:
                self._close_output(fd)
        self._maybe_finish()

    def _drain(self, fd: int) -> None:
        while fd in self.output_fds:
            try:
                data = os.read(fd, CHUNK_BYTES)
            except OSError:
                return
            if not data:
                self._close_output(fd)
                return
            self._publish({"data": {self.output_fds[fd]: encode_bytes(data)}})

    def _maybe_finish(self) -> None:
        if self.exit_status is None or self.output_fds or self.end_event is not None:
            return
        if self._grace_timer:
            self._grace_timer.cancel()
        self.end_event = {"end": end_event_fields(self.exit_status)}
        self._close_stdin_fds()
        self._publish(self.end_event)
        self.exited.set()
        self.on_exit(self)

    def _close_stdin_fds(self) -> None:
        for attr in ("stdin_fd", "pty_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)

    def _on_lifetime_over(self) -> None:
        if self.running:
            log.info("process lifetime over, killing", extra={"pid": self.pid})
            self.timed_out = True
            self.signal(signal.SIGKILL)

    # ---- control ----------------------------------------------------------------------------

    def signal(self, signum: int) -> None:
        # The process leads its own session; signal the whole group so its children go too.
        try:
            os.killpg(self.pid, signum)
        except OSError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def write_input(self, data: bytes, to_pty: bool) -> None:
        if to_pty:
            if self.spec.pty_size is None:
                raise RpcError("invalid_argument", f"process {self.pid} has no PTY")
            fd = self.pty_fd
        else:
            if self.spec.pty_size is not None:
                # A PTY process reads its stdin from the terminal.
                fd = self.pty_fd
            elif self.stdin_fd is None:
                raise RpcError("internal", f"stdin of process {self.pid} is not open")
            else:
                fd = self.stdin_fd
        if fd is None:
            raise RpcError("internal", f"input of process {self.pid} is closed")
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                await _wait_writable(self.loop, fd)
                continue
            except OSError as exc:
                raise RpcError("internal", f"writing to process {self.pid}: {exc.strerror}") from None
            view = view[written:]

    def close_stdin(self) -> None:
        if self.spec.pty_size is not None:
            raise RpcError("failed_precondition", f"process {self.pid} uses a PTY; stdin cannot be closed")
        if self.stdin_fd is None:
            return
        os.close(self.stdin_fd)
        self.stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if self.pty_fd is None:
            raise RpcError("invalid_argument", f"process {self.pid} has no PTY")
        set_window_size(self.pty_fd, cols, rows)


async def _wait_writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready = loop.create_future()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)


def end_event_fields(status: int) -> dict[str, Any]:
    """EndEvent the way Go envd words it (Go's ProcessState.String())."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        text = f"signal: {SIGNAL_NAMES.get(signum, f'signal {signum}')}"
        return {"exitCode": -1, "status": text, "error": text}
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255
    text = f"exit status {code}"
    if code == 0:
        return {"exited": True, "status": text}
    return {"exitCode": code, "exited": True, "status": text, "error": text}


def set_window_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class ProcessManager:
    def __init__(
        self,
        rootfs: RootFs,
        env_vars: Callable[[], dict[str, str]],
        path_env: str,
        shell_fallback: str | None,
        busybox: str | None = None,
    ) -> None:
        self.rootfs = rootfs
        self.env_vars = env_vars
        self.path_env = path_env
        self.shell_fallback = shell_fallback
        self.busybox = busybox if busybox and busybox_can_switch_user(busybox) else None
        self.running: dict[int, ManagedProcess] = {}
        self.exited: OrderedDict[int, ManagedProcess] = OrderedDict()
        self.started_total = 0
        self._can_switch_user = os.geteuid() == 0

    def find(self, pid: int | None, tag: str | None) -> ManagedProcess:
        """A process by pid or tag; exited ones are kept for a while so Connect can get the end."""
        if pid is not None:
            process = self.running.get(pid) or self.exited.get(pid)
            if process is None:
                raise RpcError("not_found", f"process with pid {pid} not found")
            return process
        for process in [*self.running.values(), *reversed(self.exited.values())]:
            if process.spec.tag == tag:
                return process
        raise RpcError("not_found", f"process with tag {tag} not found")

    def find_running(self, pid: int | None, tag: str | None) -> ManagedProcess:
        process = self.find(pid, tag)
        if not process.running:
            what = f"pid {pid}" if pid is not None else f"tag {tag}"
            raise RpcError("not_found", f"process with {what} not found")
        return process

    def _on_exit(self, process: ManagedProcess) -> None:
        self.running.pop(process.pid, None)
        self.exited[process.pid] = process
        while len(self.exited) > RETAINED_EXITED:
            self.exited.popitem(last=False)
        log.debug("process exited", extra={"pid": process.pid, "status": process.end_event})

    def _resolve_cmd(self, cmd: str) -> str:
        if not cmd:
            raise RpcError("invalid_argument", "process cmd is empty")
        if (
            self.shell_fallback
            and cmd.startswith("/")
            and os.path.basename(cmd) in SHELL_NAMES
            and not os.path.exists(self.rootfs.host_path(cmd))
        ):
            return self.shell_fallback
        return cmd

    def _resolve_cwd(self, spec: ProcessSpec, default_workdir: str | None) -> str:
        if spec.cwd:
            cwd = self.rootfs.expand(spec.cwd, spec.user)
            if not os.path.isdir(self.rootfs.host_path(cwd)):
                raise RpcError("invalid_argument", f"cwd '{cwd}' does not exist")
            return cwd
        for candidate in (default_workdir, spec.user.home):
            if candidate and os.path.isdir(self.rootfs.host_path(candidate)):
                return candidate
        return "/"

    def _environment(self, spec: ProcessSpec) -> dict[str, str]:
        env = {
            "PATH": self.path_env,
            "HOME": spec.user.home,
            "USER": spec.user.name,
            "LOGNAME": spec.user.name,
        }
        env.update(self.env_vars())
        env.update(spec.envs)
        return env

    def start(self, spec: ProcessSpec, default_workdir: str | None) -> tuple[ManagedProcess, Subscriber]:
        """Spawn the process; the returned subscriber sees all of its output from the start."""
        cmd = self._resolve_cmd(spec.cmd)
        cwd = self._resolve_cwd(spec, default_workdir)
        env = self._environment(spec)
        chroot = None if self.rootfs.is_host_root else self.rootfs.root
        switch_user = self._can_switch_user and (spec.user.uid != os.geteuid() or chroot)
        if chroot and not self._can_switch_user:
            # Without root there is no chroot: run on the host in the mapped directory.
            chroot = None
            cwd = self.rootfs.host_path(cwd)

        child_fds: list[int] = []
        parent: dict[str, int] = {}
        output_fds: dict[int, str] = {}
        try:
            if spec.pty_size is not None:
                master, slave = os.openpty()
                set_window_size(master, *spec.pty_size)
                child_fds.append(slave)
                parent["pty"] = master
                output_fds[master] = "pty"
                stdin = stdout = stderr = slave
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                child_fds += [out_w, err_w]
                output_fds[out_r] = "stdout"
                output_fds[err_r] = "stderr"
                parent["stdout"], parent["stderr"] = out_r, err_r
                stdout, stderr = out_w, err_w
                if spec.stdin:
                    in_r, in_w = os.pipe()
                    child_fds.append(in_r)
                    parent["stdin"] = in_w
                    os.set_blocking(in_w, False)
                    stdin = in_r
                else:
                    stdin = subprocess.DEVNULL
            argv = self._fast_spawn_argv(cmd, spec, chroot, cwd, switch_user)
            if argv is not None:
                # Python forks (not vforks) for a user switch or a preexec hook; busybox
                # nsenter does the switch after a cheap vfork+exec instead.
                chroot = None
                cwd = None
                switch_user = False
            preexec = _child_setup(
                chroot=chroot,
                cwd=cwd if chroot else None,
                user=spec.user if (switch_user and chroot) else None,
                controlling_tty=spec.pty_size is not None,
            )
            popen_kwargs: dict[str, Any] = {}
            if switch_user and not chroot:
                popen_kwargs = {
                    "user": spec.user.uid,
                    "group": spec.user.gid,
                    "extra_groups": list(spec.user.groups),
                }
            try:
                popen = subprocess.Popen(
                    argv or [cmd, *spec.args],
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    cwd=None if chroot else cwd,
                    env=env,
                    start_new_session=True,
                    preexec_fn=preexec,
                    close_fds=True,
                    **popen_kwargs,
                )
            except FileNotFoundError:
                raise RpcError("invalid_argument", f"executable '{cmd}' not found") from None
            except PermissionError as exc:
                raise RpcError("permission_denied", f"cannot execute '{cmd}': {exc.strerror}") from None
            except (OSError, subprocess.SubprocessError) as exc:
                raise RpcError("internal", f"error starting process '{cmd}': {exc}") from None
        except BaseException:
            for fd in [*child_fds, *parent.values()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        for fd in child_fds:
            os.close(fd)

        process = ManagedProcess(
            spec=spec,
            popen=popen,
            loop=asyncio.get_running_loop(),
            on_exit=self._on_exit,
            stdin_fd=parent.get("stdin"),
            pty_fd=parent.get("pty"),
            output_fds=output_fds,
        )
        if process.pty_fd is not None:
            # The PTY master is both the output and the input; keep a separate descriptor for input
            # so that closing output at EOF does not close input.
            process.pty_fd = os.dup(parent["pty"])
            os.set_blocking(process.pty_fd, False)
        subscriber = process.subscribe()
        process.attach()
        self.running[process.pid] = process
        self.started_total += 1
        log.debug("process started", extra={"pid": process.pid, "cmd": cmd, "cwd": cwd})
        return process, subscriber

    def _fast_spawn_argv(
        self, cmd: str, spec: ProcessSpec, chroot: str | None, cwd: str, switch_user: bool
    ) -> list[str] | None:
        """`busybox nsenter -F -S uid -G gid [-r root] -w cwd -- cmd args`, when it does exactly
        what the slow path would: no PTY (that needs a controlling-terminal hook), no
        supplementary groups (nsenter clears them), and a command that exists, so that a missing
        one still gets envd's own error."""
        if self.busybox is None or not (switch_user or chroot) or spec.pty_size is not None:
            return None
        if set(spec.user.groups) - {spec.user.gid} or not cmd.startswith("/"):
            return None
        host_cmd = self.rootfs.host_path(cmd)
        if not (os.path.isfile(host_cmd) and os.access(host_cmd, os.X_OK)):
            return None
        argv = [self.busybox, "nsenter", "-F", "-S", str(spec.user.uid), "-G", str(spec.user.gid)]
        if chroot:
            argv += ["-r" + chroot, "-w" + self.rootfs.host_path(cwd)]
        else:
            argv.append("-w" + cwd)
        return [*argv, "--", cmd, *spec.args]

    async def shutdown(self) -> None:
        for process in list(self.running.values()):
            process.signal(signal.SIGKILL)
        deadline = time.monotonic() + 2
        for process in list(self.running.values()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.exited.wait(), max(0.01, deadline - time.monotonic()))


def _child_setup(
    chroot: str | None, cwd: str | None, user: User | None, controlling_tty: bool
) -> Callable[[], None] | None:
    """What the child does between fork and exec that Popen cannot do in C: chroot (before the
    user switch, which Popen would do first), and taking its PTY as the controlling terminal."""
    if not chroot and not controlling_tty:
        return None

    def setup() -> None:
        if chroot:
            os.chroot(chroot)
            os.chdir(cwd or "/")
        if user is not None:
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
        if controlling_tty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    return setup


def busybox_can_switch_user(busybox: str) -> bool:
    """Whether this busybox has an nsenter that sets uid, gid, root and working directory."""
    try:
        result = subprocess.run(
            [busybox, "nsenter", "--help"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    usage = result.stdout + result.stderr
    return all(flag in usage for flag in ("-S UID", "-G GID", "-r[DIR]", "-w[DIR]", "-F"))

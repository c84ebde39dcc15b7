"""A Jupyter kernel (ipykernel's Kernel base class) that runs its cells in one long-lived child
process, so that state (variables, functions, the working directory) stays between cells: the
base of the Bash and JavaScript kernels of the code-interpreter server.

The child's stdout and stderr are pipes that are streamed to the client as they arrive (whole
lines, or what is there after a short pause); how a cell is sent and how its end is seen is the
subclass's (`send_cell`, `poll_end`). The child runs in its own session: Jupyter's interrupt
(SIGINT to the kernel's process group) reaches this process only, which passes it on to the
child's group once, and if the child does not finish the cell in INTERRUPT_GRACE_SECONDS it is
killed and started again (its state is lost; the cell reports that).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import os
import selectors
import signal
import subprocess
import time
from typing import Any

from ipykernel.kernelbase import Kernel

PARTIAL_FLUSH_SECONDS = 0.1  # output without a newline is sent after this long without more
INTERRUPT_GRACE_SECONDS = 5.0
READ_BYTES = 65536

# The variables the code-interpreter server sets for its kernels that a user's process should
# not see (the server's own import path on the tools disk).
PRIVATE_ENV = ("PYTHONPATH",)


def _child_setup() -> None:
    """In the child, before exec: SIGINT back to its default (ipykernel ignores it between
    cells, and an ignored signal stays ignored in bash and its commands); SIGKILL when the
    kernel dies (Jupyter kills a kernel's process group, and the child has its own)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildDied(Exception):
    """The child process exited in the middle of a cell."""


class Stream:
    """One output pipe of the child: undecoded bytes in, text out in whole lines where
    possible."""

    def __init__(self, name: str, fd: int) -> None:
        self.name = name
        self.fd = fd
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""  # text after the last newline, not sent yet
        self.last_data = 0.0

    def feed(self, data: bytes) -> str:
        """Decodes data; returns the complete lines it finishes."""
        self.last_data = time.monotonic()
        text = self.held + self.decoder.decode(data)
        cut = text.rfind("\n") + 1
        self.held = text[cut:]
        return text[:cut]

    def take_held(self, keep: int = 0) -> str:
        """The held partial line, less its last `keep` characters."""
        cut = max(0, len(self.held) - keep)
        out, self.held = self.held[:cut], self.held[cut:]
        return out


class ChildKernel(Kernel):
    implementation = "agentenv"
    implementation_version = "1"
    banner = ""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.child: subprocess.Popen[bytes] | None = None
        self.streams: dict[int, Stream] = {}
        self.selector = selectors.DefaultSelector()
        self.interrupted_at: float | None = None
        self.control_pending = b""  # read from the control channel, no whole line yet
        self.start_child()

    # -- what a subclass says ---------------------------------------------------------------

    def child_argv(self) -> list[str]:
        raise NotImplementedError

    def child_extra_fds(self) -> tuple[int, ...]:
        """Descriptors the child inherits besides its stdio."""
        return ()

    def after_start(self) -> None:
        """Runs once the child is started (setup, waiting for it to be ready)."""

    def send_cell(self, code: str) -> None:
        raise NotImplementedError

    def poll_end(self, ready: set[int]) -> dict[str, Any] | None:
        """Called after each wait with the descriptors that were readable (besides the output
        pipes, which the base reads): the cell's outcome once it is over, else None. The
        outcome: {"status": "ok", "data": {mime: value} | None} or {"status": "error",
        "ename", "evalue", "traceback": [lines]}."""
        raise NotImplementedError

    def control_fds(self) -> tuple[int, ...]:
        """Descriptors besides the output pipes to wait on during a cell."""
        return ()

    def read_control(self) -> bytes:
        """What the child's control channel (a subclass's line protocol beside the output
        pipes) has now: BlockingIOError when nothing, b"" once it is closed."""
        raise NotImplementedError

    # -- a control channel of whole lines (the JavaScript and Java kernels) ------------------

    def control_line(self) -> bytes | None:
        """The control channel's next whole line, None if none has come whole yet (ChildDied
        once the channel is closed)."""
        while b"\n" not in self.control_pending:
            try:
                data = self.read_control()
            except BlockingIOError:
                return None
            if not data:
                raise ChildDied()
            self.control_pending += data
        line, self.control_pending = self.control_pending.split(b"\n", 1)
        return line

    def wait_control_line(self, timeout: float, timed_out: str) -> bytes:
        """The control channel's next line, the child's output read (not sent) meanwhile;
        RuntimeError(timed_out) when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.control_line()
            if line is not None:
                return line
            if time.monotonic() > deadline:
                raise RuntimeError(timed_out)
            for fd in self.wait_ready(self.control_fds(), 0.5):
                if fd in self.streams:
                    self.read_output(fd, silent=True)

    def on_stalled_interrupt(self) -> None:
        """The child has not ended the cell a while after SIGINT (a hook: the Bash kernel asks
        again for the end marker, which an interrupt may have swallowed)."""

    def hold_back(self, stream: Stream) -> int:
        """How many characters at the end of a stream's held partial line not to flush yet
        (the Bash kernel keeps what could be the start of its end marker)."""
        return 0

    # -- the child process ------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}

    def start_child(self) -> None:
        self.child = subprocess.Popen(
            self.child_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=self.child_env(), start_new_session=True,
            pass_fds=self.child_extra_fds(), preexec_fn=_child_setup)
        assert self.child.stdout is not None and self.child.stderr is not None
        self.streams = {}
        for name, pipe in (("stdout", self.child.stdout), ("stderr", self.child.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.streams[pipe.fileno()] = Stream(name, pipe.fileno())
        self.after_start()

    def kill_child(self) -> None:
        if self.child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait()
        for pipe in (self.child.stdin, self.child.stdout, self.child.stderr):
            if pipe is not None:
                pipe.close()
        self.child = None

    def restart_child(self) -> None:
        self.kill_child()
        self.start_child()

    def write_stdin(self, data: bytes) -> None:
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.write(data)
        self.child.stdin.flush()

    # -- running a cell ---------------------------------------------------------------------

    def wait_ready(self, fds: tuple[int, ...], timeout: float) -> set[int]:
        """The descriptors among the output pipes and `fds` that become readable in
        `timeout` seconds (an empty set if none)."""
        wanted = [*self.streams, *fds]
        for fd in wanted:
            self.selector.register(fd, selectors.EVENT_READ)
        try:
            return {key.fd for key, _ in self.selector.select(timeout)}
        except InterruptedError:
            return set()
        finally:
            for fd in wanted:
                self.selector.unregister(fd)

    def read_output(self, fd: int, silent: bool) -> None:
        """Reads what a pipe has and sends its complete lines; ChildDied at EOF on stdout."""
        stream = self.streams[fd]
        while True:
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not data:
                if stream.name == "stdout":
                    raise ChildDied()
                return
            self.emit(stream, self.filter_output(stream, stream.feed(data)), silent)

    def filter_output(self, stream: Stream, text: str) -> str:
        """Subclasses take their own markers out of the output here."""
        return text

    def emit(self, stream: Stream, text: str, silent: bool) -> None:
        if text and not silent:
            self.send_response(self.iopub_socket, "stream", {"name": stream.name, "text": text})

    def flush_partial(self, silent: bool, idle_only: bool) -> None:
        now = time.monotonic()
        for stream in self.streams.values():
            if idle_only and now - stream.last_data < PARTIAL_FLUSH_SECONDS:
                continue
            self.emit(stream, stream.take_held(self.hold_back(stream)), silent)

    def drain(self, silent: bool) -> None:
        """Everything already in the pipes (written before the child reported the cell's end)."""
        for fd in list(self.streams):
            self.read_output(fd, silent)
        self.flush_partial(silent, idle_only=False)

    def _forward_interrupt(self, signum: int, frame: Any) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGINT)

    def run_cell(self, code: str, silent: bool) -> dict[str, Any]:
        try:
            self.send_cell(code)
            return self.pump(silent)
        except ChildDied:
            status = self.child.wait() if self.child is not None else None
            self.flush_partial(silent, idle_only=False)
            self.restart_child()
            return self.error_outcome(
                "KernelRestarted",
                f"the process exited (status {status}) and was started again (its state is lost)")

    def pump(self, silent: bool) -> dict[str, Any]:
        """Streams the child's output until it reports the end of the cell (ChildDied if it
        exits first); SIGINT meanwhile is passed on to the child."""
        self.interrupted_at = None
        previous = signal.signal(signal.SIGINT, self._forward_interrupt)
        nudged = False
        try:
            while True:
                ready = self.wait_ready(self.control_fds(), PARTIAL_FLUSH_SECONDS)
                for fd in ready & set(self.streams):
                    self.read_output(fd, silent)
                outcome = self.poll_end(ready - set(self.streams))
                if outcome is not None:
                    self.drain(silent)
                    return outcome
                self.flush_partial(silent, idle_only=True)
                if self.interrupted_at is not None:
                    waited = time.monotonic() - self.interrupted_at
                    if waited > INTERRUPT_GRACE_SECONDS / 2 and not nudged:
                        nudged = True
                        self.on_stalled_interrupt()
                    if waited > INTERRUPT_GRACE_SECONDS:
                        self.restart_child()
                        return self.error_outcome(
                            "KernelRestarted",
                            "the cell did not stop on the interrupt: the process was killed and "
                            "started again (its state is lost)")
        finally:
            signal.signal(signal.SIGINT, previous)

    @staticmethod
    def error_outcome(name: str, value: str, traceback: list[str] | None = None
                      ) -> dict[str, Any]:
        return {"status": "error", "ename": name, "evalue": value,
                "traceback": traceback if traceback is not None else [f"{name}: {value}"]}

    def do_execute(self, code: str, silent: bool, store_history: bool = True,
                   user_expressions: Any = None, allow_stdin: bool = False, **kwargs: Any
                   ) -> dict[str, Any]:
        outcome = self.run_cell(code, silent)
        if outcome["status"] == "error":
            error = {k: outcome[k] for k in ("ename", "evalue", "traceback")}
            if not silent:
                self.send_response(self.iopub_socket, "error", error)
            return {"status": "error", "execution_count": self.execution_count, **error}
        if outcome.get("data") and not silent:
            self.send_response(self.iopub_socket, "execute_result", {
                "execution_count": self.execution_count, "data": outcome["data"],
                "metadata": {}})
        return {"status": "ok", "execution_count": self.execution_count, "payload": [],
                "user_expressions": {}}

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self.kill_child()
        return {"status": "ok", "restart": restart}

"""The Java kernel of the code-interpreter server: one JVM per context, running our JShell runner
(JShellRunner.java beside this file: from the jar and class archive javaprep.py made in the
template, else by Java's single-file source launcher) over Debian's OpenJDK. Debian packages
no Jupyter kernel for Java; this one answers as E2B's (IJava) does: an expression's value as
its toString() in text/plain, each write to System.out/System.err as its own stream message, a
failure as an error output (the exception's class name, its message, the stack of the cell's
frames), and env vars as system properties (`System.getProperty`), which is how E2B's server
hands them to its Java kernel.

Cells and answers go over two pipes (see the runner for the protocol). The hidden cells that set
and put back env vars are our own commands (kernels.JAVA_ENV_SET_PREFIX...), not Java: they
need no compile.

    python3 -m agentenv.guest.codeint.javakernel -f <connection file>
"""

from __future__ import annotations

import base64
import codecs
import json
import os
from typing import Any

from agentenv.guest.codeint import javaprep
from agentenv.guest.codeint.childkernel import ChildDied, ChildKernel
from agentenv.guest.codeint.kernels import (
    JAVA_ENV_APPLY_PREFIX,
    JAVA_ENV_RESTORE,
    JAVA_ENV_SET_PREFIX,
)

START_SECONDS = 300.0  # a JVM, javac for the runner and JShell's first snippet: slow under TCG


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


class JavaKernel(ChildKernel):
    implementation = "agentenv-java"
    language_info = {"name": "java", "mimetype": "text/x-java-source",
                     "file_extension": ".jshell"}

    def __init__(self, **kwargs: Any) -> None:
        self.requests_w: int | None = None
        self.replies_r: int | None = None
        self.child_fds: tuple[int, ...] = ()
        self.silent = False
        self.decoders: dict[str, Any] = {}
        super().__init__(**kwargs)

    def child_argv(self) -> list[str]:
        return javaprep.java_argv()

    def child_extra_fds(self) -> tuple[int, ...]:
        return self.child_fds

    def child_env(self) -> dict[str, str]:
        request_fd, reply_fd = self.child_fds
        return {**super().child_env(), "AENV_JAVA_REQUEST_FD": str(request_fd),
                "AENV_JAVA_REPLY_FD": str(reply_fd)}

    def start_child(self) -> None:
        for fd in (self.requests_w, self.replies_r):
            if fd is not None:
                os.close(fd)
        requests_r, self.requests_w = os.pipe()
        self.replies_r, replies_w = os.pipe()
        os.set_blocking(self.replies_r, False)
        self.child_fds = (requests_r, replies_w)
        self.control_pending = b""
        try:
            super().start_child()
        finally:
            os.close(requests_r)
            os.close(replies_w)

    def after_start(self) -> None:
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.close()  # a cell that reads System.in finds it empty, not our pipe
        self.child.stdin = None
        line = self.wait_control_line(START_SECONDS, "the Java runner did not start in time")
        if line != b"READY":
            raise RuntimeError(f"the Java runner did not start: {line.decode()!r}")

    def read_control(self) -> bytes:
        assert self.replies_r is not None
        return os.read(self.replies_r, 65536)

    def control_fds(self) -> tuple[int, ...]:
        assert self.replies_r is not None
        return (self.replies_r,)

    def _request(self, line: str) -> None:
        assert self.requests_w is not None
        data = (line + "\n").encode()
        try:
            while data:
                data = data[os.write(self.requests_w, data):]
        except BrokenPipeError:
            raise ChildDied() from None

    def run_cell(self, code: str, silent: bool) -> dict[str, Any]:
        self.silent = silent
        self.decoders = {}
        return super().run_cell(code, silent)

    def send_cell(self, code: str) -> None:
        if code.startswith((JAVA_ENV_SET_PREFIX, JAVA_ENV_APPLY_PREFIX)):
            kind = "S" if code.startswith(JAVA_ENV_SET_PREFIX) else "A"
            env = json.loads(code.split(" ", 1)[1])
            fields = [f"{_b64(k)} {_b64(v)}" for k, v in env.items()]
            self._request(" ".join([kind, *fields]))
        elif code.strip() == JAVA_ENV_RESTORE:
            self._request("U")
        else:
            self._request(f"X {_b64(code)}")

    def poll_end(self, ready: set[int]) -> dict[str, Any] | None:
        while True:
            raw = self.control_line()
            if raw is None:
                return None
            kind, _, rest = raw.decode().partition(" ")
            if kind in ("O", "E"):
                name = "stdout" if kind == "O" else "stderr"
                decoder = self.decoders.setdefault(
                    name, codecs.getincrementaldecoder("utf-8")(errors="replace"))
                text = decoder.decode(base64.b64decode(rest))
                if text and not self.silent:
                    self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})
            elif kind == "D":
                data = {"text/plain": _unb64(rest)} if rest else None
                return {"status": "ok", "data": data}
            elif kind == "F":
                name, value, trace = (_unb64(x) for x in rest.split(" "))
                return self.error_outcome(name, value, trace.splitlines() or None)

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        reply = super().do_shutdown(restart)
        for fd in (self.requests_w, self.replies_r):
            if fd is not None:
                os.close(fd)
        self.requests_w = self.replies_r = None
        return reply


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=JavaKernel)

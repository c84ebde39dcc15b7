"""The JavaScript kernel of the code-interpreter server: one Node.js process per context,
running our evaluator (jsevaluator.js beside this file), to which cells go over a socket (the
descriptor named by AENV_CONTROL_FD in its environment), one JSON line each way (see the evaluator for the protocol and the cell semantics).

    python3 -m agentenv.guest.codeint.jskernel -f <connection file>
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from agentenv.guest.codeint.childkernel import ChildKernel

EVALUATOR = Path(__file__).resolve().parent / "jsevaluator.js"
START_SECONDS = 30.0


class JavaScriptKernel(ChildKernel):
    implementation = "agentenv-javascript"
    language_info = {"name": "javascript", "mimetype": "application/javascript",
                     "file_extension": ".js"}
    start_seconds = START_SECONDS

    def __init__(self, **kwargs: Any) -> None:
        self.control: socket.socket | None = None
        self.child_end: socket.socket | None = None
        super().__init__(**kwargs)

    def child_argv(self) -> list[str]:
        return ["node", str(EVALUATOR)]

    def child_extra_fds(self) -> tuple[int, ...]:
        assert self.child_end is not None
        return (self.child_end.fileno(),)

    def child_env(self) -> dict[str, str]:
        assert self.child_end is not None
        return {**super().child_env(), "AENV_CONTROL_FD": str(self.child_end.fileno())}

    def start_child(self) -> None:
        if self.control is not None:
            self.control.close()
        self.control, self.child_end = socket.socketpair()
        self.control.setblocking(False)
        self.control_pending = b""
        try:
            super().start_child()
        finally:
            self.child_end.close()

    def after_start(self) -> None:
        reply = json.loads(self.wait_control_line(self.start_seconds,
                                                  "no answer from the JavaScript evaluator"))
        if reply.get("status") != "ready":
            raise RuntimeError(f"the JavaScript evaluator did not start: {reply}")

    def read_control(self) -> bytes:
        assert self.control is not None
        return self.control.recv(65536)

    def _reply(self) -> dict[str, Any] | None:
        line = self.control_line()
        if line is None:
            return None
        reply: dict[str, Any] = json.loads(line)
        return reply

    def control_fds(self) -> tuple[int, ...]:
        assert self.control is not None
        return (self.control.fileno(),)

    def send_cell(self, code: str) -> None:
        assert self.control is not None
        self.control.setblocking(True)
        try:
            self.control.sendall(json.dumps({"code": code}).encode() + b"\n")
        finally:
            self.control.setblocking(False)

    def poll_end(self, ready: set[int]) -> dict[str, Any] | None:
        if not ready and b"\n" not in self.control_pending:
            return None
        return self._reply()

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        reply = super().do_shutdown(restart)
        if self.control is not None:
            self.control.close()
        return reply


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=JavaScriptKernel)

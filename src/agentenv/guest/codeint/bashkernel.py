"""The Bash kernel of the code-interpreter server: one interactive `bash` per context.

Interactive, because that is the mode in which bash, on SIGINT, abandons the command line it
is running and reads the next one, keeping its variables, functions and working directory (a
non-interactive bash exits, or goes on with the next command). Each cell is one input line,
`eval $'<the cell>' </dev/null` (its stdin is not the kernel's command pipe), followed by a line
that prints an end marker with the cell's number and exit status to stdout; the marker is taken
out of the output. A cell whose status is not 0 is reported as an error (its value the status),
as E2B's Bash kernel does.

    python3 -m agentenv.guest.codeint.bashkernel -f <connection file>
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from agentenv.guest.codeint.childkernel import ChildKernel, Stream

START_SECONDS = 30.0
STDERR_TAIL_CHARS = 2000
INTERRUPTED = 130  # bash's status for a command line cut by SIGINT


def ansi_c_quote(text: str) -> str:
    """text as one line of bash: $'...' with backslash escapes for what would end the line or
    the quote."""
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


class BashKernel(ChildKernel):
    implementation = "agentenv-bash"
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh",
                     "codemirror_mode": "shell"}

    def __init__(self, **kwargs: Any) -> None:
        self.token = f"__AENV_END_{secrets.token_hex(8)}__"
        self.seq = 0
        self.end: int | None = None  # the exit status once the current cell's marker came
        self.stderr_tail = ""
        super().__init__(**kwargs)

    def child_argv(self) -> list[str]:
        return ["bash", "--noprofile", "--norc", "--noediting", "-i"]

    def after_start(self) -> None:
        # No prompts (they go to stderr), no history expansion of `!` or history file, no mail
        # checks; then the marker function, whose first command reads the cell's status.
        setup = (
            "PS1='' PS2='' PS0='' PROMPT_COMMAND=''; set +H +o history; unset MAILCHECK\n"
            f"__aenv_end() {{ local s=$?; printf '%s %s %s\\n' {self.token} \"$1\" \"$s\"; }}\n"
        )
        self.write_stdin(setup.encode())
        self._send_marker()
        deadline = time.monotonic() + START_SECONDS
        while self.end is None:  # the job-control warnings and the first prompt: dropped
            if time.monotonic() > deadline:
                raise RuntimeError("bash did not start")
            ready = self.wait_ready((), 0.5)
            for fd in ready:
                self.read_output(fd, silent=True)
        self.drain(silent=True)  # the first prompt, written before bash read the setup

    def _send_marker(self) -> None:
        self.write_stdin(f"__aenv_end {self.seq}\n".encode())

    def send_cell(self, code: str) -> None:
        self.seq += 1
        self.end = None
        self.stderr_tail = ""
        self.write_stdin(f"eval {ansi_c_quote(code)} </dev/null\n".encode())
        self._send_marker()

    def on_stalled_interrupt(self) -> None:
        # A SIGINT that came as bash read the marker line can have dropped it: ask again (an
        # extra marker of the same cell is ignored).
        self._send_marker()

    def poll_end(self, ready: set[int]) -> dict[str, Any] | None:
        if self.end is None:
            return None
        status = self.end
        if status == 0:
            return {"status": "ok", "data": None}
        if status == INTERRUPTED and self.interrupted_at is not None:
            return self.error_outcome("KeyboardInterrupt", "interrupted")
        lines = self.stderr_tail.splitlines()
        return self.error_outcome("CommandExitError", str(status),
                                  [*lines[-20:], f"exit status {status}"])

    def filter_output(self, stream: Stream, text: str) -> str:
        if stream.name == "stderr":
            self.stderr_tail = (self.stderr_tail + text)[-STDERR_TAIL_CHARS:]
            return text
        if self.token not in text:
            return text
        kept = []
        for line in text.splitlines(keepends=True):
            at = line.find(self.token)
            if at < 0:
                kept.append(line)
                continue
            kept.append(line[:at])
            fields = line[at + len(self.token):].split()
            if len(fields) == 2 and fields[0] == str(self.seq) and self.end is None:
                self.end = int(fields[1])
        return "".join(kept)

    def hold_back(self, stream: Stream) -> int:
        if stream.name != "stdout":
            return 0
        for keep in range(min(len(stream.held), len(self.token) - 1), 0, -1):
            if self.token.startswith(stream.held[-keep:]):
                return keep
        return 0


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=BashKernel)

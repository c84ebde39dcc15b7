"""pty.* of the official e2b SDK: an interactive shell on a pseudo-terminal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize

pytestmark = pytest.mark.root


class PtyReader:
    def __init__(self, handle) -> None:
        self.output = bytearray()
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(handle,), daemon=True)
        self.thread.start()

    def _read(self, handle) -> None:
        try:
            for _stdout, _stderr, pty in handle:
                if pty:
                    with self.lock:
                        self.output += pty
        except BaseException as exc:  # the stream ends with the kill
            self.error = exc

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                text = self.output.decode(errors="replace")
            if predicate(text):
                return text
            time.sleep(0.05)
        raise AssertionError(f"PTY output never matched; got {text!r}")


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80), envs={"MARK": "pty-env"})
    reader = PtyReader(handle)
    sbx.pty.send_stdin(handle.pid, b"echo x$((40+2)) $MARK\n")
    reader.wait_for(lambda text: "x42 pty-env" in text)
    sbx.pty.send_stdin(handle.pid, b"stty size; tty\n")
    reader.wait_for(lambda text: "24 80" in text)
    sbx.pty.resize(handle.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(handle.pid, b"stty size\n")
    reader.wait_for(lambda text: "40 120" in text)
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    assert sbx.pty.kill(handle.pid) is True
    reader.thread.join(10)
    assert not reader.thread.is_alive()
    assert reader.error is None
    assert sbx.pty.kill(handle.pid) is False
    # envd keeps the end of an exited process for a while: reconnecting gets it.
    with pytest.raises(CommandExitException) as info:
        sbx.commands.connect(handle.pid).wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"


def test_pty_exit_ends_the_stream(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(handle.pid, b"exit 0\n")
    result = handle.wait()
    assert result.exit_code == 0


def test_pty_close_stdin_is_refused(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    try:
        with pytest.raises(Exception, match="PTY"):
            sbx.commands.close_stdin(handle.pid)
    finally:
        sbx.pty.kill(handle.pid)

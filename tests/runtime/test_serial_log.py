"""agentenv.logs.trim_log (runtime/serial.py's serial log, the egress proxy's log): a log past
half its cap moves its tail to <name>.1 and starts again from empty; a writer appending (as
QEMU's chardev does, append=on) writes on at the new end, not past a hole."""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.logs import trim_log
from agentenv.runtime.serial import ROTATED_LOG


def test_trim_keeps_the_tail_and_appends_go_on_at_the_start(tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, b"a" * 3000 + b"b" * 1000)
        assert not trim_log(log, 10_000)  # under half the cap: left alone
        assert trim_log(log, 2000)
        assert (tmp_path / ROTATED_LOG).read_bytes() == b"b" * 1000
        assert log.stat().st_size == 0
        os.write(fd, b"after")
        assert log.read_bytes() == b"after"
    finally:
        os.close(fd)


def test_a_missing_log_is_not_an_error(tmp_path: Path) -> None:
    assert not trim_log(tmp_path / "gone.log", 100)


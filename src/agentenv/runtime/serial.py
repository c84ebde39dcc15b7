"""The serial console log of a VM, kept within a size.

QEMU writes the guest's ttyS0 to `serial.log` in the VM's workdir (a `file` chardev opened for
appending), and a guest writes to ttyS0 as much as it likes. The runtime looks at every VM's
log a few times a second (agentenv.logs.trim_log): once the log holds more than half the cap,
its last half-cap bytes move to `serial.log.1` and the log is emptied; QEMU appends, so it
writes on from the new end. Both files together stay within the cap plus what the guest wrote since the last
look (a UART moves a few MB/s at most). Bytes written between the copy and the truncation are
lost: this is a console log, not a record.

QEMU's stderr (`qemu.stderr`, opened for appending) is kept the same way: a guest can make QEMU
log device errors without end, and RLIMIT_FSIZE alone would leave each VM's log at that limit
(64 MiB by default), outside the node's disk reserve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from agentenv.logs import trim_log

log = logging.getLogger("agentenv.runtime")

SERIAL_LOG = "serial.log"
ROTATED_LOG = "serial.log.1"
#: seconds between two looks at the VMs' serial logs
CHECK_INTERVAL = 0.25


async def keep_serial_logs_trimmed(logs: Callable[[], list[Path]], cap: int) -> None:
    """Look at the serial logs `logs` names every CHECK_INTERVAL, trimming each within `cap`
    bytes; runs until cancelled."""

    def trim_all(paths: list[Path]) -> list[Path]:
        return [log_path for log_path in paths if trim_log(log_path, cap)]

    while True:
        try:
            for rotated in await asyncio.to_thread(trim_all, logs()):
                log.debug("serial log rotated", extra={"vm": rotated.parent.name})
        except OSError as exc:  # a full disk, say: tried again at the next look
            log.warning("serial log not trimmed", extra={"error": str(exc)})
        await asyncio.sleep(CHECK_INTERVAL)

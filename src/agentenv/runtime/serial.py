"""The serial console log of a VM, kept within a size.

QEMU writes the guest's ttyS0 to `serial.log` in the VM's workdir (a `file` chardev opened for
appending), and a guest writes to ttyS0 as much as it likes. The runtime looks at every VM's
log a few times a second (`trim_serial_log`): once the log holds more than half the cap, its last
half-cap bytes move to `serial.log.1` and the log is emptied; QEMU appends, so it writes on from
the new end. Both files together stay within the cap plus what the guest wrote since the last
look (a UART moves a few MB/s at most). Bytes written between the copy and the truncation are
lost: this is a console log, not a record.
"""

from __future__ import annotations

import os
from pathlib import Path

SERIAL_LOG = "serial.log"
ROTATED_LOG = "serial.log.1"
#: seconds between two looks at the VMs' serial logs
CHECK_INTERVAL = 0.25


def trim_serial_log(log: Path, max_bytes: int) -> bool:
    """Keep `log` and its rotated tail within `max_bytes` (see the module doc); True if it was
    rotated. A missing log (the VM went away) is not an error."""
    keep = max(max_bytes // 2, 1)
    try:
        with open(log, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= keep:
                return False
            f.seek(size - keep)
            tail = f.read(keep)
            rotated = log.with_name(ROTATED_LOG)
            partial = log.with_name(ROTATED_LOG + ".new")
            partial.write_bytes(tail)
            os.replace(partial, rotated)
            f.truncate(0)
    except FileNotFoundError:
        return False
    return True

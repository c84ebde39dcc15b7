"""The serial console log of a VM, kept within a size.

QEMU writes the guest's ttyS0 to `serial.log` in the VM's workdir (a `file` chardev opened for
appending), and a guest writes to ttyS0 as much as it likes. The runtime looks at every VM's
log a few times a second (agentenv.logs.trim_log): once the log holds more than half the cap,
its last half-cap bytes move to `serial.log.1` and the log is emptied; QEMU appends, so it
writes on from the new end. Both files together stay within the cap plus what the guest wrote since the last
look (a UART moves a few MB/s at most). Bytes written between the copy and the truncation are
lost: this is a console log, not a record.
"""

from __future__ import annotations

SERIAL_LOG = "serial.log"
ROTATED_LOG = "serial.log.1"
#: seconds between two looks at the VMs' serial logs
CHECK_INTERVAL = 0.25

"""The node's disk budget: writable uppers never take the state filesystem below a reserve.

Each disk's cap (Image.upper_limit) bounds one sandbox; this bounds them all together. While
the budget is on (`configure`, done once by blockd), an upper grows only within a grant: a
grant is `grant` bytes of growth (or the request, if larger), given only while the upper's
filesystem keeps `reserve` bytes free after every grant still outstanding. So the filesystem
is asked (fstatvfs) once per grant, not per write, and a write that cannot be granted fails
with ENOSPC (`NodeDiskFull`): the guest sees a full disk, the host filesystem stays at or above
the reserve. Other writers on that filesystem (the node's memory layers, pulls, uploads) check
the same reserve themselves before they write (fsutil.require_free_space).

One budget per process. The native core (storage/_native.cpp, `Engine::take_grant`) keeps the
same rules for the uppers it serves; `Upper` asks `take` here on the Python path.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from typing import Protocol

#: bytes of growth per grant: one fstatvfs per this much written; also what each upper may
#: hold ungranted-to-others at most (the reserve absorbs it)
GRANT = 1 << 20


class NodeDiskFull(OSError):
    """A write would take the state filesystem below the node's reserve (errno ENOSPC)."""

    def __init__(self, free: int, need: int, reserve: int) -> None:
        super().__init__(errno.ENOSPC,
                         f"the node's disk is full: its state filesystem has {free} bytes "
                         f"free, a write needs {need} more, and {reserve} must stay free "
                         "(AENV_DISK_RESERVE)")
        self.free, self.need, self.reserve = free, need, reserve


class Holder(Protocol):
    """What holds grants: an open upper."""

    data_fd: int
    grant_left: int


class _Budget:
    def __init__(self, reserve: int, grant: int) -> None:
        self.reserve = reserve
        self.grant = grant
        self.lock = threading.Lock()
        self.holders: weakref.WeakSet[Holder] = weakref.WeakSet()


_budget: _Budget | None = None


def configure(reserve: int | None, grant: int = GRANT) -> None:
    """Turn the budget on for the Python path's uppers of this process (None: off); the
    native core's too is native.configure_disk_budget (which calls this)."""
    global _budget
    _budget = None if reserve is None else _Budget(reserve, grant)


def take(holder: Holder, need: int) -> None:
    """Grant `holder` room for `need` more bytes (and some ahead), or raise NodeDiskFull."""
    budget = _budget
    if budget is None:
        return
    with budget.lock:
        budget.holders.add(holder)
        st = os.fstatvfs(holder.data_fd)
        free = st.f_bavail * st.f_frsize
        outstanding = sum(h.grant_left for h in budget.holders if h is not holder)
        room = free - outstanding - budget.reserve
        if room < need:
            holder.grant_left = 0
            raise NodeDiskFull(free, need, budget.reserve)
        holder.grant_left = min(max(budget.grant, need), room) - need

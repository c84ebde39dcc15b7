"""Fair shares of the proxy's connections: each known slot may hold an equal share of
max_connections (at most max_per_slot), and when all are taken a slot over its share gives
one back to a slot under it."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from agentenv.logs import PerKeyLimit
from agentenv.network.egress.conn import Slot
from agentenv.network.egress.limits import MIN_SLOT_SHARE
from agentenv.network.egress.metrics import Counters


def slot_share(max_connections: int, max_per_slot: int, slots: int) -> int:
    """How many egress connections one slot may hold: an equal share of max_connections
    among the known slots (at least MIN_SLOT_SHARE), at most max_per_slot. So a few guests
    holding connections open cannot take the capacity every other slot needs."""
    share = max(MIN_SLOT_SHARE, max_connections // max(1, slots))
    return min(max_per_slot, share)


def evict_over_share(slots: Iterable[Slot], share: int, wanted_by: str, counters: Counters,
                     events: PerKeyLimit) -> bool:
    """All egress connections are taken and a slot under its share wants one: the slot
    holding the most beyond the share (it opened them while it had the proxy to itself)
    gives back its longest idle one. False when no slot is over its share."""
    hog = max(slots, key=lambda s: len(s.conns), default=None)
    if hog is None or len(hog.conns) <= share:
        return False
    victim = min(hog.conns, key=lambda c: c.last_active)
    counters.evicted += 1
    events.log(wanted_by, "evicted", logging.INFO, "egress connection evicted", {
        "event": "evicted", "reason": "over its fair share while another slot needs one",
        "slot_total": len(hog.conns), "slot_share": share, "wanted_by": wanted_by,
        **victim.describe()})
    victim.reset()
    return True

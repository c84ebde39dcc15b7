"""Idle pause (docs/e2b-api.md §4.1): a sandbox with no traffic for its `idlePauseAfter`
seconds is paused by the node, and the next request of any kind resumes it.

`IdleTracker` says how long each sandbox has been idle. It is touched only where an exchange
with the sandbox begins and ends (the proxy: every envd call, command stream, file transfer,
proxied port and WebSocket), never per byte: an exchange that is open keeps its sandbox busy
however long it lasts (a command that streams for an hour, a WebSocket left open), so the
cost is two dictionary operations per request. The orchestrator's reaper reads it once a
second for the sandboxes that have the setting.

Where the setting comes from, first found wins (`idle_setting`): the create body's
`idlePauseAfter` (an extension an unchanged SDK never sends), the metadata key
`aenv.idlePauseAfter` (what an unchanged SDK can send), the template's default, the node's
(`aenv serve --idle-pause-after`, AENV_IDLE_PAUSE_AFTER; 0: off, E2B's behaviour).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from agentenv.api.errors import BadRequest

#: the metadata key that sets a sandbox's idle pause from an unchanged SDK
IDLE_PAUSE_METADATA = "aenv.idlePauseAfter"
#: `eventData.reason` of the paused event, and `SandboxRecord.pause_reason`, of an idle pause
IDLE_REASON = "idle"


class IdleTracker:
    """Per sandbox: how many exchanges with it are open, and when the last one ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def opened(self, sandbox_id: str) -> None:
        """An exchange begins: the sandbox is busy until it ends (registered before the
        request is admitted, so no pause can start between its admission and its relay)."""
        self._open[sandbox_id] = self._open.get(sandbox_id, 0) + 1

    def closed(self, sandbox_id: str, active: bool) -> None:
        """An exchange ended; `active`: it reached the sandbox (a refused request, such as a
        stranger's without the token, is not activity and keeps nothing awake)."""
        left = self._open.get(sandbox_id, 0) - 1
        if left > 0:
            self._open[sandbox_id] = left
        else:
            self._open.pop(sandbox_id, None)
        if active:
            self._last[sandbox_id] = self._clock()

    def touch(self, sandbox_id: str) -> None:
        """Activity that is not an exchange (an SDK connect to a running sandbox)."""
        self._last[sandbox_id] = self._clock()

    def idle_for(self, sandbox_id: str) -> float:
        """Seconds since the sandbox's last activity, 0 while an exchange is open. The first
        question about a sandbox that runs starts its clock."""
        if sandbox_id in self._open:
            return 0.0
        now = self._clock()
        return now - self._last.setdefault(sandbox_id, now)

    def restart(self, sandbox_id: str) -> None:
        """The sandbox stopped running: its clock starts again when it next runs. Exchanges
        still open stay counted (they were admitted while it ran, or wait for its resume)."""
        self._last.pop(sandbox_id, None)

    def retain(self, sandbox_ids: Collection[str]) -> None:
        """Forget clocks of sandboxes that are gone (an exchange that ended after its sandbox
        was killed left one behind)."""
        if len(self._last) > len(sandbox_ids):
            for sid in [s for s in self._last if s not in sandbox_ids]:
                del self._last[sid]


def parse_seconds(raw: object, what: str, maximum: int) -> int:
    """A whole number of seconds, 0 (off) to `maximum`, or 400 naming `what`."""
    value: object = raw
    if isinstance(raw, str):
        text = raw.strip()
        # ASCII digits only, few of them: str.isdigit holds for '²' (int() refuses it) and
        # int() refuses more than 4300 digits; either would be a 500
        value = int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise BadRequest(f"{what} must be a whole number of seconds from 0 (off) to {maximum}, "
                         f"got {str(raw)[:40]!r}")
    return value


def idle_setting(body: int | None, metadata: Mapping[str, str], template: int | None,
                 node: int, maximum: int) -> int:
    """A new sandbox's idlePauseAfter: the create body's, else its metadata's, else its
    template's, else the node's."""
    if body is not None:
        return parse_seconds(body, "idlePauseAfter", maximum)
    if IDLE_PAUSE_METADATA in metadata:
        return parse_seconds(metadata[IDLE_PAUSE_METADATA], f"metadata {IDLE_PAUSE_METADATA}",
                             maximum)
    return template if template is not None else node

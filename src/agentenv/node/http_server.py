"""The node's HTTP/1.1 protocol and request-target rule: they live in agentenv.relay.server,
shared with the gateway; these names stay importable from here."""

from agentenv.relay.server import (
    StreamAborted,
    hardened_protocol,
    quiet_stream_aborts,
    request_target,
    target_problem,
)

__all__ = [
    "StreamAborted",
    "hardened_protocol",
    "quiet_stream_aborts",
    "request_target",
    "target_problem",
]

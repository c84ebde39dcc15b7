"""Errors blockd reports to its clients and users."""

from __future__ import annotations

from agentenv.errors import AgentEnvError


class BlockdError(AgentEnvError):
    """A blockd request that cannot be done (bad arguments, unknown device, ...)."""


class BlockdUnavailable(BlockdError):
    """The daemon's socket cannot be reached."""


class NotFound(BlockdError):
    """The request names a device the daemon does not have."""

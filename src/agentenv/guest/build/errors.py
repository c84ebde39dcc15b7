from __future__ import annotations

from agentenv.errors import AgentEnvError


class GuestBuildError(AgentEnvError):
    """Building the guest kernel, initramfs, tools disk or a test root failed."""

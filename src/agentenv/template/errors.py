"""Errors of conversion; those of fetching an image are in registry/errors.py."""

from __future__ import annotations

from agentenv.registry.errors import PullError


class LayerApplyError(PullError):
    """A layer tarball that is corrupt or cannot be applied onto the filesystem."""

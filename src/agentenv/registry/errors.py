"""Errors of fetching images from a registry; every one is fit to show a user as it is."""

from __future__ import annotations

from agentenv.errors import AgentEnvError


class PullError(AgentEnvError):
    """Base of every error raised while pulling or converting an image."""


class ReferenceFormatError(PullError):
    """An image reference that cannot be parsed."""


class RegistryError(PullError):
    """The registry refused a request or answered something unusable."""


class NotFoundError(RegistryError):
    """A repository, tag, manifest or blob the registry does not have."""


class AuthError(RegistryError):
    """The registry wants credentials we do not have, or rejected the ones we sent."""


class DigestMismatchError(PullError):
    """Downloaded bytes whose sha256 differs from the digest that named them."""


class UnsupportedImageError(PullError):
    """A manifest, media type or platform this converter cannot handle."""

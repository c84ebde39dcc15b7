"""Image references: `[registry[:port]/]repository[:tag][@sha256:digest]`, read as Docker does."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentenv.registry.errors import ReferenceFormatError

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST_RE = re.compile(r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port] as written (docker.io for Docker Hub)
    repository: str  # e.g. library/debian
    tag: str | None
    digest: str | None

    @property
    def api_host(self) -> str:
        """The host[:port] that serves the v2 API for this registry."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def selector(self) -> str:
        """What to ask the manifests endpoint for: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def leaf(self) -> str:
        """The last path component of the repository: the default local name."""
        return self.repository.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> Reference:
    """Parse a reference; a name without a registry means Docker Hub, `library/` for one component."""
    original = text
    if not text or text != text.strip():
        raise ReferenceFormatError(f"invalid image reference {original!r}: empty or padded")
    digest: str | None = None
    if "@" in text:
        text, digest = text.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise ReferenceFormatError(
                f"invalid image reference {original!r}: digest must be sha256: and 64 hex digits"
            )
    tag: str | None = None
    last_slash = text.rfind("/")
    colon = text.rfind(":")
    if colon > last_slash:
        text, tag = text[:colon], text[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise ReferenceFormatError(f"invalid image reference {original!r}: bad tag {tag!r}")
    first, _, rest = text.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, repository = first, rest
        if not _HOST_RE.match(registry):
            raise ReferenceFormatError(
                f"invalid image reference {original!r}: bad registry host {registry!r}"
            )
    else:
        registry, repository = DOCKER_HUB, text
    if registry in (DOCKER_HUB, "index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
        if "/" not in repository:
            repository = f"library/{repository}"
    if not _REPOSITORY_RE.match(repository):
        raise ReferenceFormatError(
            f"invalid image reference {original!r}: repository {repository!r} must be lowercase "
            "letters, digits and separators"
        )
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry=registry, repository=repository, tag=tag, digest=digest)

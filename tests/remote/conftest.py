"""The template tests' real registry (Debian's docker-registry on loopback) and its helpers."""

from tests.template.conftest import no_docker_config, registry

__all__ = ["no_docker_config", "registry"]

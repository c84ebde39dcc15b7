"""Registry credentials from a Docker config file, read the way the docker CLI reads it.

`$DOCKER_CONFIG/config.json` (else `~/.docker/config.json`), `auths` keyed by registry: either a
base64 `auth` of `user:password`, or `username` and `password`. Keys may carry a scheme and a
path (`https://index.docker.io/v1/`); they are matched by host[:port]. Credential helpers
(`credsStore`, `credHelpers`) are not run.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path

from agentenv.template.errors import AuthError
from agentenv.template.reference import DOCKER_HUB

_DOCKER_HUB_KEYS = ("docker.io", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def __repr__(self) -> str:  # never print the password
        return f"Credentials(username={self.username!r}, password=***)"


def default_docker_config() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def _normalize_key(key: str) -> str:
    host = key.strip()
    for prefix in ("https://", "http://"):
        if host.startswith(prefix):
            host = host[len(prefix) :]
    host = host.split("/", 1)[0]
    return DOCKER_HUB if host in _DOCKER_HUB_KEYS else host


def credentials_for(registry: str, config_path: Path | None = None) -> Credentials | None:
    """Credentials for `registry` (host[:port], docker.io for Docker Hub), or None."""
    path = config_path or default_docker_config()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AuthError(f"cannot read docker config {path}: {exc.strerror}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AuthError(f"docker config {path} is not valid JSON: {exc}") from exc
    auths = config.get("auths") if isinstance(config, dict) else None
    if not isinstance(auths, dict):
        return None
    wanted = _normalize_key(registry)
    for key, entry in auths.items():
        if _normalize_key(key) != wanted or not isinstance(entry, dict):
            continue
        if entry.get("auth"):
            try:
                decoded = base64.b64decode(entry["auth"], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError) as exc:
                raise AuthError(
                    f"docker config {path}: auths[{key!r}].auth is not base64 of user:password"
                ) from exc
            user, sep, password = decoded.partition(":")
            if not sep:
                raise AuthError(
                    f"docker config {path}: auths[{key!r}].auth does not hold user:password"
                )
            return Credentials(user, password)
        if entry.get("username") and "password" in entry:
            return Credentials(str(entry["username"]), str(entry["password"]))
    return None

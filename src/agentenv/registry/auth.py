"""Registry credentials from a Docker config file, read the way the docker CLI reads it.

`$DOCKER_CONFIG/config.json` (else `~/.docker/config.json`). Like docker/cli's config loader:
a credential helper named in `credHelpers[<registry>]` wins over the default `credsStore`, which
wins over the file's own `auths`; once a helper is configured for a registry its answer is final
(no fallback to `auths`). The registry is named as docker names it: `host[:port]`, and
`https://index.docker.io/v1/` for Docker Hub.

`auths` entries hold a base64 `auth` of `user:password`, or `username` and `password`, or an
`identitytoken`. Their keys may carry a scheme and a path (`https://index.docker.io/v1/`); they
are matched by host[:port].

A helper is the program `docker-credential-<name>` on PATH, run as `<program> get` with the
server address on stdin; it prints `{"ServerURL", "Username", "Secret"}`. Username `<token>`
means Secret is an identity token (an OAuth refresh token), which the registry client trades
at a bearer token server (docker's refresh-token POST); a registry wanting basic auth cannot
use it, and the client says so.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.registry.errors import AuthError
from agentenv.registry.reference import DOCKER_HUB

_DOCKER_HUB_KEYS = ("docker.io", "index.docker.io", "registry-1.docker.io")
# What docker passes to a helper (and uses as the config key) for Docker Hub.
DOCKER_HUB_SERVER_ADDRESS = "https://index.docker.io/v1/"
HELPER_PREFIX = "docker-credential-"
IDENTITY_TOKEN_USERNAME = "<token>"
# docker-credential-helpers' errCredentialsNotFoundMessage, printed with a non-zero exit.
_NOT_FOUND_MESSAGE = "credentials not found in native keychain"
HELPER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str
    # An OAuth refresh token (docker's IdentityToken); username and password are then empty.
    identity_token: str | None = None

    def __repr__(self) -> str:  # never print a secret
        token = ", identity_token=***" if self.identity_token else ""
        return f"Credentials(username={self.username!r}, password=***{token})"


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


def server_address(registry: str) -> str:
    """The name docker gives `registry` in its config and sends to credential helpers."""
    wanted = _normalize_key(registry)
    return DOCKER_HUB_SERVER_ADDRESS if wanted == DOCKER_HUB else wanted


def credentials_for(registry: str, config_path: Path | None = None) -> Credentials | None:
    """Credentials for `registry` (host[:port], docker.io for Docker Hub), or None.

    Runs a credential helper when the config names one for this registry."""
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
    if not isinstance(config, dict):
        raise AuthError(f"docker config {path} is not a JSON object")
    helper = _configured_helper(config, registry, path)
    if helper is not None:
        return run_credential_helper(helper, server_address(registry))
    return _from_auths(config.get("auths"), registry, path)


def _configured_helper(config: dict[str, Any], registry: str, path: Path) -> str | None:
    helpers = config.get("credHelpers")
    if helpers is not None and not isinstance(helpers, dict):
        raise AuthError(f"docker config {path}: credHelpers is not an object")
    address = server_address(registry)
    wanted = _normalize_key(registry)
    name: object = None
    if helpers:
        # Docker looks the exact server address up; also accept the other spellings of the
        # same host (`docker.io`, `https://reg:5000`), as the `auths` lookup does.
        if address in helpers:
            name = helpers[address]
        else:
            name = next((v for k, v in helpers.items() if _normalize_key(k) == wanted), None)
        if name is not None and (not isinstance(name, str) or not name):
            raise AuthError(f"docker config {path}: credHelpers[{address!r}] is not a helper name")
    if name is None:
        name = config.get("credsStore")
        if name is not None and not isinstance(name, str):
            raise AuthError(f"docker config {path}: credsStore is not a helper name")
    return name or None


def run_credential_helper(name: str, address: str,
                          timeout: float = HELPER_TIMEOUT_S) -> Credentials | None:
    """`docker-credential-<name> get` for `address`; None when the helper has none for it."""
    program = HELPER_PREFIX + name
    if "/" in name or not name.strip():
        raise AuthError(f"credential helper name {name!r} is not a program suffix")
    executable = shutil.which(program)
    if executable is None:
        raise AuthError(f"credential helper {program} (from the docker config) is not on PATH")
    try:
        result = subprocess.run([executable, "get"], input=address.encode(), capture_output=True,
                                timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AuthError(f"credential helper {program} did not answer for {address} within "
                        f"{timeout:g} s") from exc
    except OSError as exc:
        raise AuthError(f"credential helper {program} cannot run: {exc.strerror}") from exc
    stdout = result.stdout.decode(errors="replace").strip()
    if result.returncode != 0:
        if stdout == _NOT_FOUND_MESSAGE or stdout.startswith("credentials not found"):
            return None
        stderr = result.stderr.decode(errors="replace").strip()
        detail = (stderr or stdout)[-500:] or "no output"
        raise AuthError(f"credential helper {program} failed for {address} "
                        f"(exit {result.returncode}): {detail}")
    try:
        reply = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise AuthError(f"credential helper {program} answered {address} with something that is "
                        f"not JSON ({exc.msg})") from exc
    if not isinstance(reply, dict) or not isinstance(reply.get("Secret", ""), str) \
            or not isinstance(reply.get("Username", ""), str):
        raise AuthError(f"credential helper {program} answered {address} without string "
                        "Username and Secret fields")
    username, secret = reply.get("Username", ""), reply.get("Secret", "")
    if username == IDENTITY_TOKEN_USERNAME:
        return Credentials("", "", identity_token=secret) if secret else None
    if not username and not secret:
        return None
    return Credentials(username, secret)


def _from_auths(auths: object, registry: str, path: Path) -> Credentials | None:
    if not isinstance(auths, dict):
        return None
    wanted = _normalize_key(registry)
    for key, entry in auths.items():
        if _normalize_key(key) != wanted or not isinstance(entry, dict):
            continue
        token = str(entry["identitytoken"]) if entry.get("identitytoken") else None
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
            return Credentials(user, password, token)
        if entry.get("username") and "password" in entry:
            return Credentials(str(entry["username"]), str(entry["password"]), token)
        if token:
            return Credentials("", "", identity_token=token)
    return None

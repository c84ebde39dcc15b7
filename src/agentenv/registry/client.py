"""A client of the OCI distribution (registry v2) API: manifests, indexes and blobs.

Speaks http or https; answers a 401 with basic auth or a bearer token (the Docker token flow:
a GET to the realm, or with an identity token docker's OAuth refresh-token POST),
using credentials from a Docker config file (looked up, and any credential helper run, only
when the registry first asks for them). Every manifest and blob is checked against the
sha256 digest that names it; blobs stream to disk and only a verified file gets its final name.

Where it connects (the registry, a redirect, a token realm) is named by whoever chose the image,
and it connects from the node's network: every connection is checked when it is made, against
the address it is made to (resolved once, and that address is the one connected to, so a name
that resolves again to something else is not followed). Loopback, link-local, private (RFC
1918, IPv6 ULA), shared (100.64/10) and other special-purpose addresses are refused unless the
host is listed in AENV_REGISTRY_ALLOW_PRIVATE ("host" or "host:port", comma-separated): an
operator's registry on a private network. Error bodies are shown only as a short, sanitized
line.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import httpx

from agentenv import boundedjson
from agentenv.fsutil import SpaceGuard
from agentenv.registry.auth import Credentials, credentials_for
from agentenv.registry.blobtap import BlobTap
from agentenv.registry.errors import (
    AuthError,
    DigestMismatchError,
    NotFoundError,
    RegistryError,
    UnsupportedImageError,
)
from agentenv.registry.reference import Reference
from agentenv.settings import get_settings, setting_text

log = logging.getLogger(__name__)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
MAX_MANIFEST_BYTES = 4 << 20
MAX_TOKEN_BYTES = 1 << 20  # a token server's answer (a JWT is a few KiB)
MAX_ERROR_BYTES = 64 << 10  # an error body: only its sanitized error messages are shown
MAX_INDEX_DEPTH = 4
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK = 1 << 20
_RETRIES = 3
# The client_id docker sends in the OAuth refresh-token grant (registry.AuthClientID).
OAUTH_CLIENT_ID = "docker"

ProgressCallback = Callable[[int], None]


@dataclass(frozen=True)
class Platform:
    os: str = "linux"
    architecture: str = "amd64"
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise UnsupportedImageError(f"platform {text!r} is not os/arch[/variant]")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    def matches(self, entry: dict[str, Any]) -> bool:
        if entry.get("os") != self.os or entry.get("architecture") != self.architecture:
            return False
        return self.variant is None or entry.get("variant") == self.variant

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Descriptor:
        if not isinstance(obj, dict):
            raise RegistryError(f"{where}: descriptor is not an object")
        digest, size = obj.get("digest"), obj.get("size")
        if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
            raise UnsupportedImageError(f"{where}: digest {digest!r} is not a sha256 digest")
        if not isinstance(size, int) or size < 0:
            raise RegistryError(f"{where}: size {size!r} is not a byte count")
        annotations = obj.get("annotations") or {}
        return cls(str(obj.get("mediaType", "")), digest, size, dict(annotations))


@dataclass(frozen=True)
class Manifest:
    """An image manifest (never an index), with the digest of its exact bytes."""

    digest: str
    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    raw: bytes


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


ALLOW_PRIVATE_ENV = "AENV_REGISTRY_ALLOW_PRIVATE"
_MAX_DETAIL = 200


class ForbiddenAddressError(RegistryError):
    """A registry, redirect or token realm on an address the node must not reach."""


def private_allowed(host: str, port: int, env: str | None = None) -> bool:
    """Whether the operator allows connections to `host` (any port) or `host:port` on
    private addresses (AENV_REGISTRY_ALLOW_PRIVATE)."""
    raw = setting_text(ALLOW_PRIVATE_ENV) if env is None else env
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    host = host.strip("[]").lower()
    return host in names or f"{host}:{port}" in names or f"[{host}]:{port}" in names


def address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why the node must not connect to `address` on a team's behalf, or None."""
    if isinstance(address, ipaddress.IPv6Address):
        # IPv6 forms that carry an IPv4 address a translator or relay delivers to: judged by
        # that address (NAT64's 64:ff9b::a9fe:a9fe is 169.254.169.254 in an IPv6-only network)
        embedded = address.ipv4_mapped or address.sixtofour or (
            address.teredo[1] if address.teredo else None) or (
            ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else None)
        if embedded is not None and address_problem(embedded) is not None:
            return address_problem(embedded)
        if address in _LOCAL_NAT64 or address.is_site_local:
            return "a private address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata lives there)"
    if address in _SHARED_V4:
        return "a shared (CGNAT, 100.64.0.0/10) address"
    if address.is_private:
        return "a private address"
    if address.is_multicast or address.is_unspecified or address.is_reserved \
            or not address.is_global:
        return "a special-purpose address"
    return None


_SHARED_V4 = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the low 32 bits are the IPv4
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: a network's own translators


class _GuardedBackend(httpcore.SyncBackend):
    """Connects only to addresses address_problem() allows (or hosts the operator listed),
    to the very address it checked: no second lookup between the check and the connect."""

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        if private_allowed(host, port):
            return super().connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0])
                                       for info in infos))
        for address in addresses:
            problem = address_problem(address)
            if problem is not None:
                raise ForbiddenAddressError(
                    f"refused to connect to {host}:{port}: it resolves to {address}, {problem}; "
                    f"a registry on a private network must be allowed by the operator "
                    f"({ALLOW_PRIVATE_ENV})")
        last: Exception | None = None
        for address in addresses:
            try:
                return super().connect_tcp(str(address), port, timeout, local_address,
                                           socket_options)
            except httpcore.ConnectError as exc:
                last = exc
        raise last or httpcore.ConnectError(f"{host} has no address")


def _guarded_transport(verify: bool | ssl.SSLContext) -> httpx.HTTPTransport:
    transport = httpx.HTTPTransport(verify=verify)
    pool = transport._pool
    assert isinstance(pool, httpcore.ConnectionPool)
    # httpx has no parameter for it: the same pool, with the checking network backend
    transport._pool = httpcore.ConnectionPool(
        ssl_context=pool._ssl_context, max_connections=100, max_keepalive_connections=20,
        keepalive_expiry=5.0, network_backend=_GuardedBackend())  # httpx's default limits
    return transport


def sanitized(text: str, limit: int = _MAX_DETAIL) -> str:
    """A registry's text as it may be shown: printable ASCII, one line, short."""
    clean = "".join(c if 32 <= ord(c) < 127 else " " for c in text)
    clean = " ".join(clean.split())
    return clean if len(clean) <= limit else clean[:limit - 3] + "..."


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_capped(response: httpx.Response, limit: int, what: str, *, truncate: bool = False) -> bytes:
    """A response body read while it streams, refused (or, with `truncate`, cut) as soon as
    it passes `limit` bytes, before the rest is fetched. Counts decoded bytes, so a
    compressed body cannot inflate past the limit either."""
    length = response.headers.get("content-length", "")
    if not truncate and length.isdigit() and int(length) > limit:
        raise RegistryError(f"{what}: {int(length)} bytes is more than the {limit} allowed")
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_bytes(_CHUNK):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                if truncate:
                    break
                raise RegistryError(f"{what}: more than the {limit} bytes allowed; stopped reading")
    except httpx.TransportError as exc:
        raise RegistryError(f"{what}: reading the answer failed: {exc}") from exc
    return b"".join(chunks)[:limit] if truncate else b"".join(chunks)


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class RegistryClient:
    """Talks to one registry. Not thread-safe for auth; blob downloads may run in threads."""

    def __init__(
        self,
        registry: str,
        *,
        api_host: str | None = None,
        credentials: Credentials | None = None,
        docker_config: Path | None = None,
        use_docker_config: bool = True,
        insecure: bool | None = None,
        ca_file: Path | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.registry = registry
        self.host = api_host or registry
        self._credentials = credentials
        # without the docker config (a team's build): only the credentials given, else none
        self._credentials_resolved = credentials is not None or not use_docker_config
        self._docker_config = docker_config
        env_insecure = {h.strip() for h in get_settings().insecure_registries.split(",")}
        # Docker's rule: loopback registries (and ones listed as insecure) may speak plain http.
        self.insecure = (
            insecure if insecure is not None else (_is_loopback(self.host) or self.host in env_insecure)
        )
        verify: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        )
        if self.insecure:
            verify = False
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=10.0), follow_redirects=True,
            transport=_guarded_transport(verify))
        self._scheme: str | None = None
        self._tokens: dict[str, str] = {}  # scope -> bearer token
        self._basic = False
        self._refresh_token: str | None = None  # a rotated identity token, kept in memory only
        self.request_count = 0

    @property
    def credentials(self) -> Credentials | None:
        """The explicit credentials, else the docker config's: resolved on first use, so a
        public registry never runs a credential helper (which may prompt or fail)."""
        if not self._credentials_resolved:
            self._credentials = credentials_for(self.registry, self._docker_config)
            self._credentials_resolved = True
        return self._credentials

    def _password_credentials(self) -> Credentials | None:
        credentials = self.credentials
        if credentials is not None and not credentials.username and credentials.identity_token:
            raise AuthError(
                f"registry {self.registry} needs credentials and the docker config (or its "
                "credential helper) holds only an identity token (OAuth refresh token) for it, "
                "which only a bearer token server can use and this registry asks for basic auth; "
                "log in with a username and password or access token"
            )
        return credentials

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------

    def _base(self) -> str:
        if self._scheme is None:
            self._scheme = self._probe_scheme()
        return f"{self._scheme}://{self.host}"

    def _probe_scheme(self) -> str:
        schemes = ["https", "http"] if self.insecure else ["https"]
        last: Exception | None = None
        for scheme in schemes:
            try:
                self.request_count += 1
                self._http.get(f"{scheme}://{self.host}/v2/")
                return scheme
            except httpx.TransportError as exc:
                last = exc
        raise RegistryError(f"cannot reach registry {self.host}: {last}")

    def _auth_header(self, scope: str) -> dict[str, str]:
        if scope in self._tokens:
            return {"Authorization": f"Bearer {self._tokens[scope]}"}
        if self._basic and self._credentials:
            pair = f"{self._credentials.username}:{self._credentials.password}".encode()
            return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        return {}

    def _authenticate(self, response: httpx.Response, scope: str) -> None:
        header = response.headers.get("www-authenticate", "")
        scheme, params = _parse_challenge(header)
        if scheme == "basic":
            credentials = self._password_credentials()
            if not credentials:
                raise AuthError(
                    f"registry {self.registry} needs credentials (basic auth); none found in the "
                    "docker config"
                )
            if self._basic:
                raise AuthError(f"registry {self.registry} rejected the credentials for "
                                f"{credentials.username!r}")
            self._basic = True
            return
        if scheme == "bearer" and params.get("realm"):
            # A cached token that is refused has expired: get a new one (the caller allows
            # one such round per request, so a registry that refuses every token ends it).
            self._tokens.pop(scope, None)
            realm, service = params["realm"], params.get("service", "")
            wanted_scope = params.get("scope", scope)
            credentials = self.credentials
            if credentials is not None and credentials.identity_token:
                # Docker prefers an identity token over a password when it holds both.
                token = self._token_by_refresh(realm, service, wanted_scope, credentials)
            else:
                token = self._token_by_get(realm, service, wanted_scope, credentials)
            self._tokens[scope] = token
            return
        raise AuthError(f"registry {self.registry} wants unsupported authentication {sanitized(header)!r}")

    def _token_by_get(self, realm: str, service: str, scope: str,
                      credentials: Credentials | None) -> str:
        """The token flow's GET: anonymous, or with basic auth of the username and password."""
        query = {"service": service} if service else {}
        query["scope"] = scope
        auth = (credentials.username, credentials.password) if credentials else None
        status, body = self._token_call(realm, "GET", params=query, auth=auth)
        if status in (401, 403):
            raise AuthError(f"token server of {self.registry} refused access to {scope} "
                            f"(HTTP {status})")
        if status != 200:
            raise AuthError(f"token server of {self.registry} answered HTTP {status}")
        return self._token_from(body)

    def _token_call(self, realm: str, method: str, **kwargs: Any) -> tuple[int, bytes]:
        """(status, body) of a token-server request, the body read up to MAX_TOKEN_BYTES
        while it streams (a hostile server cannot make us buffer more)."""
        try:
            self.request_count += 1
            with self._http.stream(method, realm, **kwargs) as reply:
                if reply.status_code != 200:
                    return reply.status_code, b""
                return 200, read_capped(reply, MAX_TOKEN_BYTES,
                                        f"token server answer from {sanitized(realm)}")
        except httpx.TransportError as exc:
            raise AuthError(f"token server {sanitized(realm)} unreachable: {exc}") from exc

    def _token_by_refresh(self, realm: str, service: str, scope: str,
                          credentials: Credentials) -> str:
        """OAuth2 refresh-token grant, as docker's token handler does with an identity token:
        a form POST to the realm. Like docker, no fallback to the GET flow: a token server
        that does not speak OAuth cannot use the identity token anyway."""
        refresh_token = self._refresh_token or credentials.identity_token or ""
        form = {"grant_type": "refresh_token", "refresh_token": refresh_token,
                "client_id": OAUTH_CLIENT_ID, "scope": scope}
        if service:
            form["service"] = service
        status, body = self._token_call(realm, "POST", data=form)
        if status in (401, 403):
            raise AuthError(f"token server of {self.registry} refused the identity token (OAuth "
                            f"refresh token) from the docker config for {scope} "
                            f"(HTTP {status}); log in to {self.registry} again")
        if status in (404, 405):
            raise AuthError(f"token server of {self.registry} does not accept OAuth refresh "
                            f"tokens (HTTP {status} to the POST), so the identity "
                            "token from the docker config cannot be used; log in with a "
                            "username and password or access token")
        if status != 200:
            raise AuthError(f"token server of {self.registry} answered HTTP {status} "
                            "to the identity-token exchange")
        token = self._token_from(body)
        rotated = json.loads(body).get("refresh_token")
        if isinstance(rotated, str) and rotated:
            # Docker keeps a rotated refresh token for the rest of the session (in memory).
            self._refresh_token = rotated
        return token

    def _token_from(self, raw: bytes) -> str:
        try:
            body = boundedjson.loads(raw, "the token server's answer")
            token = body.get("access_token") or body.get("token")
        except (ValueError, AttributeError):
            token = None
        if not token or not isinstance(token, str):
            raise AuthError(f"token server of {self.registry} returned no token")
        return token

    def _request(self, method: str, path: str, repository: str, *, headers: dict[str, str] | None = None,
                 stream: bool = False, actions: str = "pull") -> httpx.Response:
        """One API request with auth and retries; the caller closes a streamed response.
        `actions`: what a bearer token must allow on the repository ("pull", "pull,delete")."""
        scope = f"repository:{repository}:{actions}"
        url = self._base() + path
        attempt = 0
        auth_rounds = 0
        while True:
            all_headers = {**(headers or {}), **self._auth_header(scope)}
            try:
                self.request_count += 1
                request = self._http.build_request(method, url, headers=all_headers)
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                attempt += 1
                if attempt >= _RETRIES:
                    raise RegistryError(f"{method} {url} failed: {exc}") from exc
                time.sleep(0.3 * attempt)
                continue
            if response.status_code == 401 and auth_rounds < 2:
                response.close()  # its body is of no use; closing drops the connection
                auth_rounds += 1
                self._authenticate(response, scope)
                continue
            if response.status_code in (429, 500, 502, 503, 504) and attempt + 1 < _RETRIES:
                response.close()
                attempt += 1
                time.sleep(0.5 * attempt)
                continue
            return response

    def _fail(self, response: httpx.Response, what: str) -> None:
        status = response.status_code
        if status < 300:
            return
        try:
            body = read_capped(response, MAX_ERROR_BYTES, what, truncate=True).decode(
                errors="replace")
            # only the registry's error codes and messages, never a body as it came
            errors = boundedjson.loads(body, "the registry's error").get("errors", [])
            detail = sanitized("; ".join(f"{e.get('code')}: {e.get('message')}"
                                         for e in errors)) or ""
        except (json.JSONDecodeError, AttributeError, httpx.StreamError, httpx.TransportError,
                RegistryError):
            detail = ""
        finally:
            response.close()
        suffix = f" ({detail})" if detail else ""
        if status == 404:
            raise NotFoundError(f"{what}: not found in {self.registry}{suffix}")
        if status in (401, 403):
            raise AuthError(f"{what}: access denied by {self.registry} (HTTP {status}){suffix}")
        raise RegistryError(f"{what}: registry {self.registry} answered HTTP {status}{suffix}")

    # -- manifests -----------------------------------------------------------------------------

    def get_manifest_bytes(self, repository: str, selector: str) -> tuple[str, bytes, str]:
        """(media type, exact bytes, digest) of a manifest or index, verified when pinned."""
        what = f"manifest {repository}:{selector}" if not selector.startswith("sha256:") else \
            f"manifest {repository}@{selector}"
        response = self._request("GET", f"/v2/{repository}/manifests/{selector}", repository,
                                 headers={"Accept": ACCEPT}, stream=True)
        try:
            self._fail(response, what)
            data = read_capped(response, MAX_MANIFEST_BYTES, what)
        finally:
            response.close()
        digest = sha256_digest(data)
        if selector.startswith("sha256:") and digest != selector:
            raise DigestMismatchError(f"{what}: content has digest {digest}")
        header_digest = response.headers.get("docker-content-digest")
        if header_digest and header_digest.startswith("sha256:") and header_digest != digest:
            raise DigestMismatchError(
                f"{what}: registry says digest {header_digest} but the content has {digest}"
            )
        media_type = response.headers.get("content-type", "").split(";")[0].strip()
        try:
            parsed = boundedjson.loads(data, what)
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{what}: not valid JSON ({exc})") from exc
        if isinstance(parsed, dict) and parsed.get("mediaType"):
            media_type = parsed["mediaType"]
        elif isinstance(parsed, dict) and media_type not in (*INDEX_TYPES, *MANIFEST_TYPES):
            # OCI allows mediaType to be absent; tell an index from a manifest by its fields.
            media_type = OCI_INDEX if "manifests" in parsed else OCI_MANIFEST
        return media_type, data, digest

    def delete_manifest(self, repository: str, selector: str) -> str | None:
        """Delete the manifest a tag (or a digest) names, as the OCI distribution API deletes
        one: by its digest (a HEAD of the tag tells it; a GET when the registry's answer
        lacks it), `DELETE /v2/<repository>/manifests/<digest>`. Every tag of `repository`
        naming that same manifest goes with it. Only the manifest goes: its blobs stay in the
        registry until its own garbage collection frees those no manifest names.

        Returns the digest deleted, or None when the tag (or the manifest) is gone already.
        A registry that does not allow deletes (405, or its UNSUPPORTED error) raises a
        RegistryError saying so; a refusal of the credentials, an AuthError."""
        actions = "pull,delete"
        what = (f"manifest {repository}@{selector}" if selector.startswith("sha256:")
                else f"manifest {repository}:{selector}")
        digest = selector if _DIGEST_RE.match(selector) else None
        if digest is None:
            response = self._request("HEAD", f"/v2/{repository}/manifests/{selector}",
                                     repository, headers={"Accept": ACCEPT}, actions=actions)
            response.close()
            if response.status_code == 404:
                return None
            if response.status_code >= 300:
                # a HEAD has no body: the status says what is wrong
                self._fail(response, what)
            header = response.headers.get("docker-content-digest", "")
            if _DIGEST_RE.match(header):
                digest = header
            else:
                try:
                    _media_type, _data, digest = self.get_manifest_bytes(repository, selector)
                except NotFoundError:
                    return None
        response = self._request("DELETE", f"/v2/{repository}/manifests/{digest}", repository,
                                 actions=actions)
        status = response.status_code
        if status in (200, 202, 204):
            response.close()
            return digest
        if status == 404:
            response.close()
            return None
        if status == 405 or (status == 400 and self._error_codes(response) & {"UNSUPPORTED"}):
            response.close()
            raise RegistryError(
                f"{what}: not deleted: the registry {self.registry} refuses deletes (HTTP "
                f"{status}; distribution's registry needs storage.delete.enabled: true in its "
                "configuration)")
        self._fail(response, f"deleting {what}")
        return digest  # not reached: _fail raised

    def _error_codes(self, response: httpx.Response) -> set[str]:
        """The error codes of a registry's error body (read, capped)."""
        try:
            body = read_capped(response, MAX_ERROR_BYTES, "an error", truncate=True)
            errors = boundedjson.loads(body, "the registry's error").get("errors", [])
            return {str(e.get("code")) for e in errors if isinstance(e, dict)}
        except (json.JSONDecodeError, AttributeError, httpx.StreamError, httpx.TransportError,
                RegistryError):
            return set()

    def resolve_manifest(self, reference: Reference, platform: Platform | None = None) -> Manifest:
        """Follow indexes (platform selection) down to one image manifest."""
        platform = platform or Platform()
        repository = reference.repository
        selector = reference.selector
        for _depth in range(MAX_INDEX_DEPTH + 1):
            media_type, data, digest = self.get_manifest_bytes(repository, selector)
            body = boundedjson.loads(data, f"manifest of {reference}")
            if media_type in INDEX_TYPES:
                selector = self._select_platform(body, platform, f"{reference}")
                continue
            if media_type not in MANIFEST_TYPES:
                raise UnsupportedImageError(
                    f"{reference}: manifest media type {media_type!r} is not supported (docker v2 "
                    "and OCI manifests and indexes are)"
                )
            where = f"{reference} manifest {digest}"
            if not isinstance(body, dict) or not isinstance(body.get("layers"), list):
                raise RegistryError(f"{where}: no layers list")
            config = Descriptor.from_json(body.get("config"), f"{where} config")
            layers = tuple(
                Descriptor.from_json(layer, f"{where} layer {i}") for i, layer in enumerate(body["layers"])
            )
            return Manifest(digest, media_type, config, layers, data)
        raise UnsupportedImageError(f"{reference}: more than {MAX_INDEX_DEPTH} nested indexes")

    @staticmethod
    def _select_platform(index: Any, platform: Platform, where: str) -> str:
        entries = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(entries, list):
            raise RegistryError(f"{where}: index has no manifests list")
        seen: list[str] = []
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            plat = entry.get("platform") or {}
            seen.append("/".join(str(p) for p in (plat.get("os"), plat.get("architecture"),
                                                   plat.get("variant")) if p))
            if platform.matches(plat):
                digest = entry.get("digest")
                if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
                    raise UnsupportedImageError(f"{where}: index entry digest {digest!r} unusable")
                return digest
        raise UnsupportedImageError(
            f"{where}: no image for platform {platform} (index has: {', '.join(seen) or 'none'})"
        )

    # -- blobs ---------------------------------------------------------------------------------

    def get_blob_bytes(self, repository: str, descriptor: Descriptor, limit: int = 16 << 20) -> bytes:
        """A small blob (an image config) in memory, verified."""
        if descriptor.size > limit:
            raise RegistryError(f"blob {descriptor.digest} of {descriptor.size} bytes is too large")
        what = f"blob {repository}@{descriptor.digest}"
        response = self._request("GET", f"/v2/{repository}/blobs/{descriptor.digest}", repository,
                                 stream=True)
        try:
            self._fail(response, what)
            # The descriptor says the size: more than that is wrong whatever the digest.
            data = read_capped(response, descriptor.size, what)
        finally:
            response.close()
        digest = sha256_digest(data)
        if digest != descriptor.digest:
            raise DigestMismatchError(
                f"blob {repository}@{descriptor.digest}: downloaded content has digest {digest}"
            )
        return data

    def blob_exists(self, repository: str, digest: str) -> bool:
        """Whether the registry shows this client the blob in `repository` (HEAD, 200); a
        404, 401 or 403 is False, other failures raise."""
        response = self._request("HEAD", f"/v2/{repository}/blobs/{digest}", repository)
        response.close()
        if response.status_code in (401, 403, 404):
            return False
        self._fail(response, f"blob {repository}@{digest}")
        return True

    def get_blob_range(self, repository: str, digest: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a blob with an HTTP Range request; exactly that many or an
        error. Not verified here: the caller checks what it gets (blockd/remote)."""
        what = f"blob {repository}@{digest} bytes {start}-{end - 1}"
        response = self._request("GET", f"/v2/{repository}/blobs/{digest}", repository,
                                 headers={"Range": f"bytes={start}-{end - 1}"}, stream=True)
        try:
            self._fail(response, what)
            want = end - start
            if response.status_code == 206:
                data = read_capped(response, want, what)
            else:
                # A registry that ignores Range sends the whole blob: skip to the range and
                # stop reading once it is in.
                parts: list[bytes] = []
                pos = got = 0
                for chunk in self._iter_body(response, what):
                    lo, hi = max(start - pos, 0), min(end - pos, len(chunk))
                    if lo < hi:
                        parts.append(chunk[lo:hi])
                        got += hi - lo
                    pos += len(chunk)
                    if pos >= end:
                        break
                data = b"".join(parts)
        finally:
            response.close()
        if len(data) != end - start:
            raise RegistryError(f"{what}: got {len(data)} bytes")
        return data

    def download_blob(self, repository: str, descriptor: Descriptor, dest: Path,
                      progress: ProgressCallback | None = None, tap: BlobTap | None = None,
                      reserve: tuple[int, str] | None = None) -> Path:
        """Stream a blob to `dest` (written as dest.partial, renamed once verified). A `tap`
        lets a reader follow the download; it learns the outcome when the download ends.
        `reserve` (bytes, the setting naming it; default AENV_DISK_RESERVE) stays free on
        dest's filesystem while it is written, else InsufficientSpace and nothing is kept."""
        what = f"blob {repository}@{descriptor.digest}"
        bytes_reserve, setting = reserve or (None, "AENV_DISK_RESERVE")
        guard = SpaceGuard(dest.parent, f"the download of {what}", reserve=bytes_reserve,
                           setting=setting)
        partial = dest.with_name(dest.name + f".partial.{os.getpid()}.{threading.get_ident()}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            response = self._request("GET", f"/v2/{repository}/blobs/{descriptor.digest}",
                                     repository, stream=True)
        except BaseException as exc:
            if tap is not None:
                tap.finish(exc)
            raise
        try:
            self._fail(response, what)
            hasher = hashlib.sha256()
            size = 0
            with open(partial, "wb", buffering=0) as out:
                if tap is not None:
                    tap.start(partial)
                for chunk in self._iter_body(response, what):
                    hasher.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[out.write(view) or 0:]
                    size += len(chunk)
                    guard.wrote(len(chunk))
                    if size > descriptor.size:
                        raise DigestMismatchError(f"{what}: more than the {descriptor.size} bytes "
                                                  "the manifest says; download stopped")
                    if progress:
                        progress(len(chunk))
                    if tap is not None:
                        tap.advance(len(chunk))
            digest = "sha256:" + hasher.hexdigest()
            if digest != descriptor.digest:
                raise DigestMismatchError(
                    f"{what}: downloaded {size} bytes with digest {digest}"
                )
            if size != descriptor.size:
                raise DigestMismatchError(f"{what}: {size} bytes, manifest says {descriptor.size}")
            os.replace(partial, dest)
        except BaseException as exc:
            partial.unlink(missing_ok=True)
            if tap is not None:
                tap.finish(exc)
            raise
        finally:
            response.close()
        if tap is not None:
            tap.finish(None)
        return dest

    @staticmethod
    def _iter_body(response: httpx.Response, what: str) -> Iterable[bytes]:
        try:
            yield from response.iter_raw(_CHUNK)
        except httpx.TransportError as exc:
            raise RegistryError(f"{what}: download interrupted: {exc}") from exc

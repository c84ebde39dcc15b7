"""The keys of a cluster, all derived from its secret (HMAC-SHA256, each with a context of its
own so no key is another's):

- a node's key, `node_key(secret, node id)`: the only credential a node of a cluster holds
  (`aenv node-key --node-id ID` prints it). The gateway derives the key of the node it relays
  to and sends it (so what a node receives is good for that node only), and the node's token
  for the scheduler is derived from it (the scheduler derives the same from the secret). A
  node taken over can act as that node, never as the gateway to another node, nor as another
  node to the scheduler.
- a node's peer serving key, `peer_serve_key(node key)`: what its blockd checks the
  credentials of nodes asking it for layer chunks with. The scheduler, which authenticates
  every node, issues node X a credential for holder P with every Holders answer:
  `peer_credential(serve key of P, X, expires)`, naming X and good for P alone until it
  expires. X cannot make one for another id or another peer (it holds neither P's node key
  nor the secret), and a node the scheduler no longer counts gets no new one
  (docs/security.md §5).
- what X sends P is never that credential: it is a bearer secret (whoever holds it is X at P
  until it expires), and the node network may be plaintext. X sends, per request,
  `r2/<X>/<expiry>/<time>/<nonce>/<MAC>`, an HMAC keyed with the credential's MAC over the
  time X made it, a fresh random nonce and `peer_request` (the request's method, path, Range
  and chunk claim), `peer_request_credential`. P derives the credential's MAC from its
  serving key and checks the request's, that the time is within MAX_SKEW_S of its own clock,
  and that it has not taken this (node, nonce) before (blockd/remote/nonces.py): a copy seen
  on the wire is refused, even for the very request it came with. `r1/` (no nonce nor time:
  could be replayed until the issued credential expired) is refused, naming why.
(Static peers without a scheduler use no key of the cluster's: each blockd has its own key
pair, blockd/remote/identity.py.)

Only the gateway and the scheduler hold the cluster secret itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import AgentEnvError
from agentenv.settings import setting_text

_NODE_KEY_CONTEXT = b"agentenv node key v1\0"
_PEER_SERVE_CONTEXT = b"agentenv peer serve v1"
_PEER_CREDENTIAL_CONTEXT = b"agentenv peer credential v1\0"
_PEER_REQUEST_CONTEXT = b"agentenv peer request v1\0"
_PEER_REQUEST_MAC_CONTEXT = b"agentenv peer request credential r2\0"
#: `Authorization: AenvPeer <credential>`: the scheduler issues `v1/<node id>/<expiry>/<mac>`,
#: a node presents `r2/<node id>/<expiry>/<time>/<nonce>/<request mac>` made from it per
#: request
PEER_SCHEME = "AenvPeer"
_PEER_ID = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
#: a request credential's nonce: NONCE_BYTES random bytes, base64url without padding
NONCE_BYTES = 16
NONCE_RE = r"[A-Za-z0-9_-]{22}"
#: how far the time a request credential was made may be from the serving peer's clock, either
#: way (docs/security.md §5): a credential is taken once, so this bounds only how long the
#: serving peer remembers its nonce (and so the record's size), not what a copy can do
MAX_SKEW_S = 60
_PEER_CREDENTIAL_RE = re.compile(rf"v1/({_PEER_ID})/(\d{{1,12}})/([0-9a-f]{{64}})")
_PEER_REQUEST_RE = re.compile(
    rf"r2/({_PEER_ID})/(\d{{1,12}})/(\d{{1,12}})/({NONCE_RE})/([0-9a-f]{{64}})")
ISSUED_PREFIX = "v1/"
REQUEST_PREFIX = "r2/"
#: the per-request form of before: bound to its request, but neither a nonce nor a time
REPLAYABLE_PREFIX = "r1/"
#: what a derived key looks like (hex HMAC-SHA256)
KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def node_key(cluster_secret: str, node_id: str) -> str:
    return hmac.new(cluster_secret.encode(), _NODE_KEY_CONTEXT + node_id.encode(),
                    hashlib.sha256).hexdigest()


def peer_serve_key(node_key: str) -> str:
    return hmac.new(node_key.encode(), _PEER_SERVE_CONTEXT, hashlib.sha256).hexdigest()


def _peer_mac(serve_key: str, node_id: str, expires: int) -> str:
    message = _PEER_CREDENTIAL_CONTEXT + node_id.encode() + b"\0" + str(expires).encode()
    return hmac.new(serve_key.encode(), message, hashlib.sha256).hexdigest()


def peer_credential(serve_key: str, node_id: str, expires: int) -> str:
    """What node `node_id` presents to the peer whose serving key is `serve_key`, until
    `expires` (unix seconds)."""
    return f"v1/{node_id}/{expires}/{_peer_mac(serve_key, node_id, expires)}"


def peer_request(method: str, path: str, byte_range: str | None, claim: str | None) -> bytes:
    """What a peer credential is bound to (the 32 bytes both ends compute from the request):
    the SHA-256 of the request's method, path (the blob), `Range` header and chunk claim
    (`X-Chunk-SHA256`), each length-prefixed (latin-1, as the HTTP server decodes them)."""
    digest = hashlib.sha256(_PEER_REQUEST_CONTEXT)
    for part in (method, path, byte_range or "", claim or ""):
        data = part.encode("latin-1", "replace")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.digest()


@dataclass(frozen=True)
class PeerRequestAuth:
    """What a request's verified credential proves: the node that made it (as the credential
    names it), its nonce (the bytes, not their text: one nonce has several base64 spellings),
    when a record of it may be dropped (unix seconds: after that the credential is refused
    anyway, for its time or its expiry), and the time it was made (the asking node's clock)."""

    node: str
    nonce: bytes
    until: float
    made: int


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def nonce_text(nonce: bytes) -> str:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    return base64.urlsafe_b64encode(nonce).rstrip(b"=").decode()


def parse_nonce(text: str) -> bytes | None:
    """A nonce's bytes from its text (NONCE_RE), or None."""
    try:
        nonce = base64.urlsafe_b64decode(text + "==")
    except (ValueError, binascii.Error):
        return None
    return nonce if len(nonce) == NONCE_BYTES else None


def request_time_refusal(made: int, now: float, max_skew: float = MAX_SKEW_S) -> str:
    """Why a request credential made at `made` (the asking node's clock, unix seconds) is not
    taken at `now` (this node's), or ""."""
    if made < now - max_skew:
        return (f"made more than {max_skew:g} s ago (a credential is made for each request "
                "and taken once; or the two nodes' clocks disagree)")
    if made > now + max_skew:
        return (f"made more than {max_skew:g} s ahead of this peer's clock (the two nodes' "
                "clocks disagree)")
    return ""


def _request_mac(issued_mac: str, made: int, nonce: bytes, request: bytes) -> str:
    if len(nonce) != NONCE_BYTES or len(request) != 32:
        raise ValueError("a nonce is 16 bytes, a request peer_request's 32")
    message = _PEER_REQUEST_MAC_CONTEXT + f"{made}\0".encode() + nonce + request
    return hmac.new(issued_mac.encode(), message, hashlib.sha256).hexdigest()


def peer_request_credential(credential: str, request: bytes, now: float | None = None,
                            nonce: bytes | None = None) -> str:
    """What a node sends a peer for one request (`request`: peer_request), made from the
    credential the scheduler issued it for that peer (which is never sent itself), at `now`
    with `nonce` (a fresh random one unless given: each request, a retry too, has its own)."""
    match = _PEER_CREDENTIAL_RE.fullmatch(credential)
    if match is None:
        raise ValueError("not a peer credential issued by the scheduler (v1/...)")
    node_id, expires, mac = match.groups()
    made = int(time.time() if now is None else now)
    nonce = new_nonce() if nonce is None else nonce
    return (f"{REQUEST_PREFIX}{node_id}/{expires}/{made}/{nonce_text(nonce)}/"
            f"{_request_mac(mac, made, nonce, request)}")


def check_peer_credential(serve_key: str, credential: str, now: float, request: bytes,
                          max_skew: float = MAX_SKEW_S) -> tuple[PeerRequestAuth | None, str]:
    """(what a request's credential proves, "") when it was made from a credential issued
    with `serve_key`, for this very request (`request`: peer_request), within `max_skew` of
    `now` (unix seconds), and the issued credential has not expired; else (None, why not).
    Whether its nonce was taken before is the caller's to check (after this: only a verified
    credential may be recorded, so a forged one burns nothing)."""
    if credential.startswith(ISSUED_PREFIX):
        return None, ("an issued credential sent as it is (v1, a bearer token) is not taken: "
                      "a node sends one made for its request (r2; the asking blockd is older "
                      "than this peer's)")
    if credential.startswith(REPLAYABLE_PREFIX):
        return None, ("a request credential without a nonce (r1: it could be sent again until "
                      "it expired) is not taken: a node sends one made for its request and "
                      "taken once (r2; the asking blockd is older than this peer's)")
    match = _PEER_REQUEST_RE.fullmatch(credential)
    if match is None:
        return None, "not a peer credential"
    node_id, expires, made = match.group(1), int(match.group(2)), int(match.group(3))
    nonce = parse_nonce(match.group(4))
    if nonce is None:
        return None, "not a peer credential"
    issued = _peer_mac(serve_key, node_id, expires)
    if not hmac.compare_digest(match.group(5), _request_mac(issued, made, nonce, request)):
        return None, "not issued for this peer, or made for another request"
    if expires <= now:
        return None, "expired"
    why = request_time_refusal(made, now, max_skew)
    if why:
        return None, why
    return PeerRequestAuth(node_id, nonce, min(expires, made + max_skew), made), ""


def read_credential(path: Path | None, env_var: str, what: str) -> tuple[str, str] | None:
    """(value, where it came from) from `path`, else from the environment variable `env_var`,
    else None; a file that cannot be read is an error naming it."""
    if path is not None:
        try:
            return path.read_text().strip(), str(path)
        except OSError as exc:
            raise AgentEnvError(f"cannot read the {what} file {path}: {exc}") from exc
    value = setting_text(env_var).strip()
    return (value, env_var) if value else None


def load_key(path: Path | None, env_var: str, what: str) -> str | None:
    """A derived key from `path`, else from the environment variable `env_var`, else None."""
    found = read_credential(path, env_var, what)
    if found is None:
        return None
    key, source = found
    if not KEY_RE.match(key):
        raise AgentEnvError(f"the {what} from {source} is not 64 hex digits (print it with "
                            f"`aenv {what.replace(' ', '-')}`)")
    return key


#: what a cluster secret (and an API key) may be made of
SECRET_RE = re.compile(r"^[A-Za-z0-9._~-]{16,256}$")


def load_cluster_secret(path: Path | None) -> str | None:
    """The cluster secret from `path`, else AENV_CLUSTER_SECRET, else None (no cluster: the
    node's own API key guards it). With one, a node serves only requests that carry it."""
    found = read_credential(path, "AENV_CLUSTER_SECRET", "cluster secret")
    if found is None:
        return None
    secret, source = found
    if not SECRET_RE.match(secret) or len(secret) < 32:
        raise AgentEnvError(f"cluster secret from {source} must be 32-256 chars of "
                            "[A-Za-z0-9._~-]")
    return secret

"""Static peers' per-node keys (docs/remote-layers.md §4, docs/security.md §5): without a
scheduler, each blockd has an Ed25519 key pair of its own, and trusts the public keys of the
nodes listed in its peer trust file.

- The key pair: generated on first start under blockd's state (`peer-identity.key`, PEM,
  0600); `aenv peer-key` prints its trust line, `<node id> ed25519:<public key>`. The node id
  is `--peer-node-id` when given, else derived from the public key (`node-<20 hex digits of
  its SHA-256>`): unique per key pair, stable while the key file is, and not the host name
  (hosts cloned from one image share one).
- The trust file (`--peer-trust-file`, `AENV_PEER_TRUST_FILE`): one node a line,
  `<node id> ed25519:<public key> [http://host:port]` (`#` starts a comment). A node listed is
  served on its own signed credentials; the address of its chunk server tells a node which id
  a static peer (`--peer http://host:port`, which must be listed) has, so it signs for it. The
  same file may go to every node. Edited, it is read again within a second: removing a line
  revokes that node. It is read without following a symlink, and only when it is a regular
  file of blockd's user (or root) that nobody else may write; else, as when it is broken, no
  node is trusted (logged, naming why).
- A request carries
  `Authorization: AenvPeer s3/<node id>/<target node id>/<time>/<nonce>/<sig>`, the Ed25519
  signature of the requesting node over (node id, target, the time it made it, a fresh random
  nonce, the request: cluster_keys.peer_request, its method, path, Range and chunk claim): it
  names the node that asks (limits and logs are per node), is good at that one target for that
  one request, once (the serving peer records the (node, nonce) it took until the credential's
  time is past: blockd/remote/nonces.py; a copy taken off the wire is refused, even with the
  request it came with), and only within cluster_keys.MAX_SKEW_S of the target's clock.
  Checked: the node is in the trust file, the target is this node, the time, and the
  signature is the node's key's over this request; then (the caller) the nonce was not taken.
  The forms of before get 401 naming why: `s1/` (a bearer token until it expired) and `s2/`
  (bound to its request, but no nonce: a copy repeated that request until it expired).
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agentenv.cluster_keys import (
    MAX_SKEW_S,
    NONCE_BYTES,
    NONCE_RE,
    PeerRequestAuth,
    new_nonce,
    nonce_text,
    parse_nonce,
    request_time_refusal,
)

#: the key pair's file under blockd's state directory
IDENTITY_FILE = "peer-identity.key"
#: signed credentials: `s3/` bound to their request and taken once; `s1/` (not bound) and
#: `s2/` (bound, no nonce) are refused, naming why
SIGNED_PREFIX = "s3/"
UNBOUND_PREFIX = "s1/"
REPLAYABLE_PREFIX = "s2/"
_CONTEXT = b"agentenv static peer request v3\0"
_ID = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
NODE_ID_RE = re.compile(_ID)
_CREDENTIAL_RE = re.compile(
    rf"s3/({_ID})/({_ID})/(\d{{1,12}})/({NONCE_RE})/([A-Za-z0-9_-]{{86}})")
#: a node id made from a public key (the default): its SHA-256's first 20 hex digits
DERIVED_ID_PREFIX = "node-"
_KEY_PREFIX = "ed25519:"

log = logging.getLogger("agentenv.blockd.remote")


class PeerKeyError(ValueError):
    pass


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _KEY_PREFIX + _b64(raw)


def parse_public_key(text: str) -> Ed25519PublicKey:
    if not text.startswith(_KEY_PREFIX):
        raise PeerKeyError(f"{text!r} is not a peer public key (ed25519:<base64url>, as "
                           "`aenv peer-key` prints)")
    try:
        raw = _unb64(text[len(_KEY_PREFIX):])
        if len(raw) != 32:
            raise ValueError("not 32 bytes")
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error) as exc:
        raise PeerKeyError(f"{text!r} is not a peer public key: {exc}") from None


def _message(node_id: str, target: str, made: int, nonce: bytes, request: bytes) -> bytes:
    if len(request) != 32 or len(nonce) != NONCE_BYTES:
        raise ValueError("a request is cluster_keys.peer_request's 32 bytes, a nonce 16")
    return _CONTEXT + f"{node_id}\0{target}\0{made}\0".encode() + nonce + request


def check_node_id(node_id: str) -> str:
    if not NODE_ID_RE.fullmatch(node_id):
        raise PeerKeyError(f"peer node id {node_id!r}: 1-128 of [A-Za-z0-9._:-], starting "
                           "with a letter or digit")
    return node_id


def derived_node_id(key: Ed25519PublicKey) -> str:
    """The default node id of the node with public key `key`: unique per key pair (two hosts
    cloned from one image make their own keys on first start), stable while the key file is."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return DERIVED_ID_PREFIX + hashlib.sha256(raw).hexdigest()[:20]


@dataclass
class NodeIdentity:
    """This blockd's node id and private key: it signs what it presents to each peer."""

    node_id: str
    private_key: Ed25519PrivateKey

    @property
    def public_key(self) -> str:
        return public_key_text(self.private_key.public_key())

    def trust_line(self) -> str:
        return f"{self.node_id} {self.public_key}"

    def sign(self, target: str, made: int, request: bytes, nonce: bytes) -> str:
        """A credential for one request (cluster_keys.peer_request) to peer `target`, made at
        `made` (unix seconds) with `nonce`."""
        sig = self.private_key.sign(_message(self.node_id, target, made, nonce, request))
        return f"{SIGNED_PREFIX}{self.node_id}/{target}/{made}/{nonce_text(nonce)}/{_b64(sig)}"

    def credential_for(self, target: str, request: bytes, now: float | None = None,
                       nonce: bytes | None = None) -> str:
        """The credential for one request to peer `target`: made now, with a fresh random
        nonce unless one is given (each request, a retry too, gets its own: a peer takes a
        nonce once)."""
        now = time.time() if now is None else now
        return self.sign(target, int(now), request, new_nonce() if nonce is None else nonce)


def load_identity(state_dir: Path, node_id: str | None = None) -> NodeIdentity:
    """The key pair under `state_dir` (made, 0600, when there is none), with node id `node_id`
    or, when none is given, the one derived from its public key."""
    if node_id:
        check_node_id(node_id)
    path = Path(state_dir) / IDENTITY_FILE
    try:
        pem = _read_private(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)  # a concurrent first start: one key wins, both use it
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        try:
            pem = _read_private(path)
        except OSError as exc:
            raise PeerKeyError(f"cannot read the peer key {path}: {exc}") from exc
    except OSError as exc:
        raise PeerKeyError(f"cannot read the peer key {path}: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except ValueError as exc:
        raise PeerKeyError(f"the peer key {path} is not a PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PeerKeyError(f"the peer key {path} is not an Ed25519 key")
    return NodeIdentity(node_id or derived_node_id(key.public_key()), key)


def _read_private(path: Path) -> bytes:
    """The key file's bytes, read from the file itself (no symlink followed) and only when it
    is this process's user's and nobody else's (checked on the descriptor read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise PeerKeyError(f"the peer key {path} belongs to uid {st.st_uid}, not to this "
                               f"process's ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise PeerKeyError(f"the peer key {path} is readable by others than its owner "
                               f"(chmod 600 {path})")
        return f.read()


def _check_trust_dirs(path: Path) -> None:
    """Every directory the trust file's path goes through belongs to this process's user or
    root, and nobody else may write it unless it is sticky (as /tmp: others may not rename or
    remove what is not theirs there): whoever may write a directory on the path may put
    another file in the trust file's place (ssh's StrictModes, with the sticky exception)."""
    directory = Path(os.path.realpath(Path(path).parent))
    for each in (directory, *directory.parents):
        st = os.stat(each)
        if st.st_uid not in (os.geteuid(), 0):
            raise PeerKeyError(f"the peer trust file {path} is in {each}, which belongs to "
                               f"uid {st.st_uid}, neither this process's ({os.geteuid()}) nor "
                               "root's: its owner could put another file in its place")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PeerKeyError(f"the peer trust file {path} is in {each}, which others than "
                               f"its owner may write (mode {stat.S_IMODE(st.st_mode):o}; "
                               f"chmod go-w {each}): they could put another file in its place")


def read_trust_file(path: Path) -> str:
    """The trust file's text, read from the file itself (no symlink followed, no FIFO waited
    on) and only when it is a regular file of this process's user or root that nobody else
    may write (checked on the descriptor read), in directories nobody else may write
    (`_check_trust_dirs`): whoever may write it decides which nodes are served."""
    _check_trust_dirs(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PeerKeyError(f"the peer trust file {path} is a symlink (not followed: "
                               "give the file itself)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PeerKeyError(f"the peer trust file {path} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise PeerKeyError(f"the peer trust file {path} belongs to uid {st.st_uid}, "
                               f"neither this process's ({os.geteuid()}) nor root's")
        if st.st_mode & 0o022:
            raise PeerKeyError(f"the peer trust file {path} may be written by others than its "
                               f"owner (mode {stat.S_IMODE(st.st_mode):o}; chmod go-w {path})")
        try:
            return f.read().decode()
        except UnicodeDecodeError as exc:
            raise PeerKeyError(f"the peer trust file {path} is not UTF-8 text: {exc}") from None


@dataclass(frozen=True)
class TrustEntry:
    node_id: str
    key: Ed25519PublicKey
    address: str | None  # http://host:port of its chunk server, when it is a peer to ask


def normalise_address(address: str) -> str:
    address = address.strip().rstrip("/")
    return address if address.startswith(("http://", "https://")) else "http://" + address


def parse_trust(text: str, source: str) -> dict[str, TrustEntry]:
    entries: dict[str, TrustEntry] = {}
    keys: dict[bytes, str] = {}  # one key, one node: two ids of one key would get two shares
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{source}:{number}"
        if len(parts) not in (2, 3):
            raise PeerKeyError(f"{where}: want `<node id> ed25519:<key> [http://host:port]`")
        try:
            node_id = check_node_id(parts[0])
            key = parse_public_key(parts[1])
        except PeerKeyError as exc:
            raise PeerKeyError(f"{where}: {exc}") from None
        if node_id in entries:
            raise PeerKeyError(f"{where}: node {node_id} is listed twice")
        raw_key = key.public_bytes_raw()
        if raw_key in keys:
            raise PeerKeyError(f"{where}: node {node_id} has the key of node {keys[raw_key]} "
                               "(one key names one node)")
        keys[raw_key] = node_id
        address = normalise_address(parts[2]) if len(parts) == 3 else None
        entries[node_id] = TrustEntry(node_id, key, address)
    return entries


class TrustedPeers:
    """The nodes of a trust file (read again when it changes, at most once a second)."""

    RECHECK_S = 1.0

    def __init__(self, path: Path | None = None, text: str | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._stamp: tuple[int, int, int] | None = None
        if text is not None:
            self.entries = parse_trust(text, "trust")
        else:
            if path is None:
                raise ValueError("a trust file's path or text")
            self._stamp = self._stat()
            self.entries = self._read()

    def _stat(self) -> tuple[int, ...]:
        """What changes when the file does: its content, or who may write it (a chmod or
        chown moves the ctime), or what the path is (a symlink put in its place: lstat)."""
        assert self.path is not None
        st = self.path.lstat()
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid,
                st.st_gid)

    def _read(self) -> dict[str, TrustEntry]:
        assert self.path is not None
        try:
            return parse_trust(read_trust_file(self.path), str(self.path))
        except OSError as exc:
            raise PeerKeyError(f"cannot read the peer trust file {self.path}: {exc}") from exc

    def current(self) -> dict[str, TrustEntry]:
        if self.path is None or time.monotonic() - self._checked < self.RECHECK_S:
            return self.entries
        with self._lock:
            self._checked = time.monotonic()
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    self.entries, self._stamp = self._read(), stamp
            except (OSError, PeerKeyError) as exc:
                # Removed, unreadable or broken: no node is trusted until it reads right again
                # (revocation fails closed: an operator deleting the file or making a typo while
                # taking a node out must not leave every earlier node in). Write it with a
                # rename (os.replace) so no reader sees it half-written.
                if self.entries:
                    log.error("the peer trust file cannot be read: every node is refused until "
                              "it can", extra={"path": str(self.path), "error": str(exc)})
                self.entries, self._stamp = {}, None
        return self.entries

    def node_at(self, address: str) -> str | None:
        """The node whose chunk server `address` (http://host:port) is, per the file."""
        address = normalise_address(address)
        for entry in self.current().values():
            if entry.address == address:
                return entry.node_id
        return None


def check_signed_credential(trust: TrustedPeers, own_id: str, credential: str, now: float,
                            request: bytes, max_skew: float = MAX_SKEW_S
                            ) -> tuple[PeerRequestAuth | None, str]:
    """(what a signed credential proves, "") when a trusted node signed it for `own_id` and
    this very request (`request`: cluster_keys.peer_request), made within `max_skew` of `now`;
    else (None, why not). Whether its nonce was taken before is the caller's to check (after
    this: only a verified credential may be recorded, so a forged one burns nothing)."""
    if credential.startswith(UNBOUND_PREFIX):
        return None, ("a signed credential not bound to its request (s1, a bearer token) is "
                      "not taken: a node signs each request (s3; the asking blockd is older "
                      "than this peer's)")
    if credential.startswith(REPLAYABLE_PREFIX):
        return None, ("a signed credential without a nonce (s2: it could be sent again until "
                      "it expired) is not taken: a node signs each request, taken once (s3; "
                      "the asking blockd is older than this peer's)")
    match = _CREDENTIAL_RE.fullmatch(credential)
    if match is None:
        return None, "not a signed peer credential"
    node_id, target, made = match.group(1), match.group(2), int(match.group(3))
    nonce = parse_nonce(match.group(4))
    if nonce is None:
        return None, "not a signed peer credential"
    entry = trust.current().get(node_id)
    if entry is None:
        return None, f"node {node_id} is not in the peer trust file"
    if not hmac.compare_digest(target.encode(), own_id.encode()):
        return None, "made for another peer"
    why = request_time_refusal(made, now, max_skew)
    if why:
        return None, why
    try:
        entry.key.verify(_unb64(match.group(5)), _message(node_id, target, made, nonce,
                                                          request))
    except (InvalidSignature, ValueError, binascii.Error):
        return None, f"not signed with node {node_id}'s key for this request"
    return PeerRequestAuth(node_id, nonce, made + max_skew, made), ""

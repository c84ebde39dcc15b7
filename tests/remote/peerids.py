"""Static peers' key pairs for tests (blockd/remote/identity.py): nodes with keys made as
blockd makes them, and a trust file listing them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER
from agentenv.blockd.remote.identity import NodeIdentity, TrustedPeers, load_identity
from agentenv.cluster_keys import PEER_SCHEME, peer_request


def identities(root: Path, *names: str) -> dict[str, NodeIdentity]:
    """A key pair per node, each under its own state directory (root/<name>-state), named
    `name`."""
    return {name: load_identity(root / f"{name}-state", name) for name in names}


def trust_text(nodes: dict[str, NodeIdentity], addresses: dict[str, str] | None = None) -> str:
    """A trust file's lines for `nodes` (with the chunk server address of those given)."""
    lines = ["# node id, public key, chunk server"]
    for name, identity in nodes.items():
        address = (addresses or {}).get(name)
        lines.append(identity.trust_line() + (f" http://{address}" if address else ""))
    return "\n".join(lines) + "\n"


def trusting(nodes: dict[str, NodeIdentity]) -> TrustedPeers:
    return TrustedPeers(text=trust_text(nodes))


def request_of(path: str, headers: Mapping[str, str | bytes] | None = None,
               method: str = "GET") -> bytes:
    """What a credential for the request (`method` `path` with `headers`) is made for."""
    def text(name: str) -> str | None:
        value = (headers or {}).get(name)
        return value.decode("latin-1") if isinstance(value, bytes) else value

    return peer_request(method, path, text("Range"), text(PROOF_HEADER))


def signed(identity: NodeIdentity, target: str, request: bytes) -> str:
    """The Authorization header node `identity` presents to peer `target` for `request`
    (request_of)."""
    return f"{PEER_SCHEME} {identity.credential_for(target, request)}"


#: a node "asker" that the chunk servers of tests trust with ASKER_TRUST (node id "server")
ASKER = NodeIdentity("asker", Ed25519PrivateKey.generate())
ASKER_TRUST = trusting({"asker": ASKER})


def asker(path: str, headers: Mapping[str, str | bytes] | None = None,
          target: str = "server") -> str:
    """The Authorization header of node "asker" for `path` with `headers` at the chunk server
    `target`."""
    return signed(ASKER, target, request_of(path, headers))

"""The keys of a cluster, all derived from its secret (HMAC-SHA256, each with a context of its
own so no key is another's):

- a node's key, `node_key(secret, node id)`: the only credential a node of a cluster holds
  (`aenv node-key --node-id ID` prints it). The gateway derives the key of the node it relays
  to and sends it (so what a node receives is good for that node only), and the node's token
  for the scheduler is derived from it (the scheduler derives the same from the secret). A
  node taken over can act as that node, never as the gateway to another node, nor as another
  node to the scheduler.
- the layer peers' key, `peer_key(secret)`: what blockds present to each other for layer
  chunks (`aenv peer-key`); it opens nothing else.

Only the gateway and the scheduler hold the cluster secret itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

from agentenv.errors import AgentEnvError

_NODE_KEY_CONTEXT = b"agentenv node key v1\0"
_PEER_KEY_CONTEXT = b"agentenv layer peer v1"
#: what a derived key looks like (hex HMAC-SHA256)
KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def node_key(cluster_secret: str, node_id: str) -> str:
    return hmac.new(cluster_secret.encode(), _NODE_KEY_CONTEXT + node_id.encode(),
                    hashlib.sha256).hexdigest()


def peer_key(cluster_secret: str) -> str:
    return hmac.new(cluster_secret.encode(), _PEER_KEY_CONTEXT, hashlib.sha256).hexdigest()


def read_credential(path: Path | None, env_var: str, what: str) -> tuple[str, str] | None:
    """(value, where it came from) from `path`, else from the environment variable `env_var`,
    else None; a file that cannot be read is an error naming it."""
    if path is not None:
        try:
            return path.read_text().strip(), str(path)
        except OSError as exc:
            raise AgentEnvError(f"cannot read the {what} file {path}: {exc}") from exc
    value = os.environ.get(env_var, "").strip()
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

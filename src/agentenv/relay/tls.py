"""TLS on the gateway -> node hop, where the operator configures it (docs/security.md §2).

Every request the gateway relays carries the node's key and the team's sandbox tokens; on a
node network others can see, that hop is TLS:

- a node with `AENV_NODE_TLS_CERT` and `AENV_NODE_TLS_KEY` (PEM files; the certificate names the
  address the node advertises, as an IP or DNS alternative name) speaks TLS only;
- a gateway with `AENV_NODE_TLS_CA` (the CA that signed the nodes' certificates) speaks TLS to
  every node and checks the certificate against the node's address: a node without TLS, or
  with a certificate from another CA or for another address, is unreachable, never plaintext.
  A node that serves TLS reads the same setting to let its blockd ask it for layer holders.

Files are read and checked when the process starts: a bad file stops it, not a request.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import AgentEnvError
from agentenv.fsutil import read_pem
from agentenv.settings import setting_text

CERT_ENV = "AENV_NODE_TLS_CERT"
KEY_ENV = "AENV_NODE_TLS_KEY"
CA_ENV = "AENV_NODE_TLS_CA"


def _pem_file(value: str, setting: str) -> Path:
    read_pem(value, setting)
    return Path(value)


@dataclass(frozen=True)
class NodeTls:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeTls:
        cert, key, ca = (setting_text(name, env).strip() for name in (CERT_ENV, KEY_ENV, CA_ENV))
        if bool(cert) != bool(key):
            raise AgentEnvError(f"{CERT_ENV} and {KEY_ENV} go together: set both or neither")
        tls = cls(_pem_file(cert, CERT_ENV) if cert else None,
                  _pem_file(key, KEY_ENV) if key else None,
                  _pem_file(ca, CA_ENV) if ca else None)
        if tls.serves:
            tls.server_context()  # a key that does not match its certificate fails here
        return tls

    @property
    def serves(self) -> bool:
        """The node listens with TLS."""
        return self.cert is not None

    @property
    def scheme(self) -> str:
        """How a client of nodes (the gateway) reaches them."""
        return "https" if self.ca is not None else "http"

    def server_context(self) -> ssl.SSLContext:
        assert self.cert is not None and self.key is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise AgentEnvError(f"{CERT_ENV}/{KEY_ENV}: {exc}") from exc
        return context

    def client_context(self) -> ssl.SSLContext | None:
        """What a client of nodes verifies them with (None: plain HTTP)."""
        if self.ca is None:
            return None
        context = ssl.create_default_context(cafile=str(self.ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

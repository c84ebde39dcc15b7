"""IDs, the node's API key, and per-sandbox tokens.

IDs look like E2B's: short, lowercase alphanumeric, no `-` or `.` (a sandbox id is a DNS label
inside `{port}-{id}.{domain}`). Tokens are derived from a per-node seed with HMAC-SHA256, so they
survive pause, resume and node restarts without being stored in the clear elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import string
from pathlib import Path

from agentenv.cluster_keys import SECRET_RE
from agentenv.errors import AgentEnvError
from agentenv.fsutil import private_dir, write_private
from agentenv.settings import get_settings

_ALPHABET = string.ascii_lowercase + string.digits
ID_RE = re.compile(r"^[a-z0-9]{1,63}$")
SEED_BYTES = 32  # HMAC-SHA256 key for the sandbox tokens: at least its output size


def new_id(prefix: str = "i", length: int = 20) -> str:
    """A random id: `prefix` then lowercase letters and digits, `length` characters in all."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length - len(prefix)))


def _read_or_create_secret(path: Path, make: str) -> str:
    """The secret in `path` (mode 0600, directory 0700), created atomically and durably
    (fsynced file and directory) when missing. A secret file others could read is made
    private again."""
    private_dir(path.parent)
    try:
        st = path.stat()
    except FileNotFoundError:
        write_private(path, (make + "\n").encode(), exclusive=True)  # a racing creator wins
        st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o600)
    return path.read_text().strip()


def secure_state_dir(state_dir: Path) -> None:
    """The node's state directory (node.db with tokens, snapshots, uppers) is private."""
    private_dir(state_dir)


def load_api_key(state_dir: Path) -> str:
    """AENV_API_KEY if set, else `state/secrets/api-key`, generated as `e2b_` + 40 hex digits.

    The `e2b_<hex>` form is what Python SDK 2.25-2.45 insist on before sending anything.
    """
    from_env = get_settings().api_key.strip()
    key = from_env or _read_or_create_secret(
        state_dir / "secrets" / "api-key", "e2b_" + secrets.token_hex(20)
    )
    if not SECRET_RE.match(key):
        source = "AENV_API_KEY" if from_env else str(state_dir / "secrets" / "api-key")
        raise AgentEnvError(f"API key from {source} must be 16-256 chars of [A-Za-z0-9._~-]")
    return key


def api_key_path(state_dir: Path) -> Path:
    return state_dir / "secrets" / "api-key"


class TokenIssuer:
    """Derives the envd access token and the traffic token of a sandbox, and the content token
    of a volume, from the node's seed."""

    def __init__(self, state_dir: Path) -> None:
        path = state_dir / "secrets" / "sandbox-token-seed"
        text = _read_or_create_secret(path, secrets.token_hex(SEED_BYTES))
        try:
            seed = bytes.fromhex(text)
        except ValueError:
            raise AgentEnvError(f"token seed in {path} is not hex digits; remove it to have a "
                                "new one made (every sandbox token changes)") from None
        if len(seed) < SEED_BYTES:
            raise AgentEnvError(f"token seed in {path} has {len(seed)} bytes, fewer than "
                                f"{SEED_BYTES}: tokens derived from it could be guessed; remove "
                                "it to have a new one made (every sandbox token changes)")
        self._seed = seed

    def envd_token(self, sandbox_id: str) -> str:
        return hmac.new(self._seed, sandbox_id.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def fresh_envd_token() -> str:
        """A random envd token (a rollback re-keys a sandbox: its first token stops working),
        shaped as the derived ones."""
        return secrets.token_hex(32)

    def traffic_token(self, sandbox_id: str) -> str:
        return hmac.new(
            self._seed, b"sandbox-traffic-" + sandbox_id.encode(), hashlib.sha256
        ).hexdigest()

    def volume_token(self, volume_id: str) -> str:
        """The bearer token of a volume's content API (E2B hands it out with the volume)."""
        return hmac.new(self._seed, b"volume-" + volume_id.encode(), hashlib.sha256).hexdigest()

    def instance_token(self, sandbox_id: str) -> str:
        """What the metadata service tells the guest as its instance token."""
        return hmac.new(
            self._seed, b"sandbox-instance-" + sandbox_id.encode(), hashlib.sha256
        ).hexdigest()

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
import string
from pathlib import Path

from agentenv.errors import AgentEnvError

_ALPHABET = string.ascii_lowercase + string.digits
ID_RE = re.compile(r"^[a-z0-9]{1,63}$")
API_KEY_RE = re.compile(r"^[A-Za-z0-9._~-]{16,256}$")


def new_id(prefix: str = "i", length: int = 20) -> str:
    """A random id: `prefix` then lowercase letters and digits, `length` characters in all."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length - len(prefix)))


def _read_or_create_secret(path: Path, make: str) -> str:
    """The secret in `path` (mode 0600, directory 0700), created atomically when missing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(make + "\n")
    try:
        os.link(tmp, path)  # fails if another process created it first: keep theirs
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def load_api_key(state_dir: Path) -> str:
    """AENV_API_KEY if set, else `state/secrets/api-key`, generated as `e2b_` + 40 hex digits.

    The `e2b_<hex>` form is what Python SDK 2.25-2.45 insist on before sending anything.
    """
    from_env = os.environ.get("AENV_API_KEY", "").strip()
    key = from_env or _read_or_create_secret(
        state_dir / "secrets" / "api-key", "e2b_" + secrets.token_hex(20)
    )
    if not API_KEY_RE.match(key):
        source = "AENV_API_KEY" if from_env else str(state_dir / "secrets" / "api-key")
        raise AgentEnvError(f"API key from {source} must be 16-256 chars of [A-Za-z0-9._~-]")
    return key


def api_key_path(state_dir: Path) -> Path:
    return state_dir / "secrets" / "api-key"


class TokenIssuer:
    """Derives the envd access token and the traffic token of a sandbox from the node's seed."""

    def __init__(self, state_dir: Path) -> None:
        self._seed = bytes.fromhex(
            _read_or_create_secret(
                state_dir / "secrets" / "sandbox-token-seed", secrets.token_hex(32)
            )
        )

    def envd_token(self, sandbox_id: str) -> str:
        return hmac.new(self._seed, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def traffic_token(self, sandbox_id: str) -> str:
        return hmac.new(
            self._seed, b"sandbox-traffic-" + sandbox_id.encode(), hashlib.sha256
        ).hexdigest()

    def instance_token(self, sandbox_id: str) -> str:
        """What the metadata service tells the guest as its instance token."""
        return hmac.new(
            self._seed, b"sandbox-instance-" + sandbox_id.encode(), hashlib.sha256
        ).hexdigest()


def same_secret(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())

"""The node's secrets and state directory: private, durable, and a weak token seed refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agentenv.errors import AgentEnvError
from agentenv.node.security import TokenIssuer, load_api_key, secure_state_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_created_private_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_API_KEY", raising=False)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    secure_state_dir(state)
    assert _mode(state) == 0o700
    key = load_api_key(state)
    issuer = TokenIssuer(state)
    secrets_dir = state / "secrets"
    assert _mode(secrets_dir) == 0o700
    for name in ("api-key", "sandbox-token-seed"):
        assert _mode(secrets_dir / name) == 0o600, name
    assert len(bytes.fromhex((secrets_dir / "sandbox-token-seed").read_text().strip())) == 32
    assert sorted(p.name for p in secrets_dir.iterdir()) == ["api-key", "sandbox-token-seed"]
    # Read back, not regenerated; a secret file others could read is made private again.
    os.chmod(secrets_dir / "api-key", 0o644)
    assert load_api_key(state) == key
    assert _mode(secrets_dir / "api-key") == 0o600
    assert TokenIssuer(state).envd_token("sbx") == issuer.envd_token("sbx")


@pytest.mark.parametrize(("seed", "message"), [
    ("", "has 0 bytes, fewer than 32"),
    ("ab" * 16, "has 16 bytes, fewer than 32"),
    ("zz" * 32, "is not hex digits"),
])
def test_weak_or_broken_token_seed_is_refused(tmp_path: Path, seed: str, message: str) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "sandbox-token-seed").write_text(seed + "\n")
    with pytest.raises(AgentEnvError, match=message):
        TokenIssuer(tmp_path)


def test_write_private_is_atomic_and_exclusive(tmp_path: Path) -> None:
    from agentenv.hostfs import write_private

    target = tmp_path / "secret"
    assert write_private(target, b"first", exclusive=True)
    assert not write_private(target, b"second", exclusive=True)  # a racing creator wins
    assert target.read_bytes() == b"first"
    assert write_private(target, b"third")
    assert target.read_bytes() == b"third" and _mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temp file left

"""npm packages pinned by a package-lock.json beside a test (tests/node/ts for the `e2b`
TypeScript SDK, tests/node/ts-code-interpreter for `@e2b/code-interpreter`), installed with
`npm ci` into /var/cache/aenv-test/node-ts/<hash of the lock and package.json>/ and reused
across runs (a fresh machine installs them on first use)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CACHE_ROOT = Path("/var/cache/aenv-test/node-ts")


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not on PATH: the JS SDK tests need Node.js 20+ and npm")
    return found


def install(package_dir: Path, probe: str, fallback: Path) -> Path:
    """A directory whose node_modules holds `package_dir`'s pinned packages, keyed by its lock
    file's hash; `probe` is a package whose package.json shows the install is complete."""
    lock = (package_dir / "package-lock.json").read_bytes()
    key = hashlib.sha256(lock + (package_dir / "package.json").read_bytes()).hexdigest()[:16]
    try:
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        root = CACHE_ROOT
    except OSError:  # not root: the cache is a speed-up only
        root = fallback
    target = root / key
    marker = Path("node_modules", probe, "package.json")
    if (target / marker).is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        for name in ("package.json", "package-lock.json"):
            shutil.copy(package_dir / name, staging / name)
        done = subprocess.run(
            [tool("npm"), "ci", "--prefix", str(staging), "--no-audit", "--no-fund",
             "--loglevel=error"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci of {package_dir.name} ({probe}) failed:\n{done.stderr[-3000:]}")
        try:
            staging.rename(target)
        except OSError:  # another run finished first; use its copy
            if not (target / marker).is_file():
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return target


def sdk_env(url: str, api_key: str, modules: Path) -> dict[str, str]:
    """The environment of a node script using the SDK: pointed at the node as a user would
    (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; no other E2B_* of ours), the SDK's modules."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
        "E2B_API_URL": url,
        "E2B_SANDBOX_URL": url,
        "E2B_API_KEY": api_key,
        "AENV_TS_MODULES": str(modules),
    }

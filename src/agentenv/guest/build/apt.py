"""Debian packages for the guest: resolved with apt-cache, fetched with `apt-get download` into a
cache keyed by file name and checked against the archive's SHA256, unpacked with `dpkg-deb -x`.
Nothing is installed on the host."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentenv.guest.build.errors import GuestBuildError


@dataclass(frozen=True)
class DebPackage:
    name: str
    version: str
    sha256: str
    filename: str  # basename of the archive's Filename field, e.g. libc6_2.36-9+deb12u14_amd64.deb
    depends: str

    def pinned(self) -> str:
        return f"{self.name}={self.version}"


def run(cmd: list[str], *, what: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        input_bytes: bytes | None = None) -> str:
    """Runs a tool; a failure becomes a GuestBuildError naming the step and the tool's stderr."""
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, input=input_bytes, capture_output=True, check=False)
    except FileNotFoundError as exc:
        raise GuestBuildError(f"{what}: {cmd[0]} is not installed (bash scripts/install-system.sh)") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise GuestBuildError(f"{what}: {' '.join(cmd[:3])} failed ({done.returncode}): {' | '.join(tail)}")
    return done.stdout.decode(errors="replace")


def _parse_records(text: str) -> list[dict[str, str]]:
    records: list[dict[str, str]] = []
    current: dict[str, str] = {}
    last_key = ""
    for line in text.splitlines():
        if not line.strip():
            if current:
                records.append(current)
            current, last_key = {}, ""
        elif line[0] in " \t" and last_key:
            current[last_key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            current[key] = value.strip()
            last_key = key
    if current:
        records.append(current)
    return records


def resolve(names: list[str]) -> dict[str, DebPackage]:
    """The candidate version of each package, as apt would install it (pins and priorities apply)."""
    out = run(["apt-cache", "show", "--no-all-versions", *names], what="resolving Debian packages")
    # A name may carry a release, "pkg/bookworm-backports"; results are keyed by the bare name.
    bare = [n.split("/")[0] for n in names]
    found: dict[str, DebPackage] = {}
    for record in _parse_records(out):
        name = record.get("Package", "")
        if name in bare and name not in found:
            found[name] = DebPackage(
                name=name,
                version=record["Version"],
                sha256=record["SHA256"],
                filename=Path(record["Filename"]).name,
                depends=record.get("Depends", ""),
            )
    missing = [n for n, b in zip(names, bare, strict=True) if b not in found]
    if missing:
        raise GuestBuildError(f"Debian packages not known to apt: {', '.join(missing)} (run apt-get update?)")
    return found


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(packages: list[DebPackage], cache_dir: Path) -> dict[str, Path]:
    """Paths of the .deb files, downloading those not yet in the cache (one apt-get call)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = {p.name: cache_dir / p.filename for p in packages}
    wanted = [p for p in packages if not paths[p.name].is_file()]
    if wanted:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            # _apt must be able to write here, else apt warns and downloads unsandboxed anyway.
            os.chmod(tmp, 0o777)
            try:
                run(["apt-get", "download", "-q", *[p.pinned() for p in wanted]],
                    what="downloading Debian packages", cwd=Path(tmp))
            except GuestBuildError:
                # Stale package lists (the archive dropped the version): refresh once and retry.
                run(["apt-get", "update", "-q"], what="apt-get update")
                run(["apt-get", "download", "-q", *[p.pinned() for p in wanted]],
                    what="downloading Debian packages", cwd=Path(tmp))
            for pkg in wanted:
                got = list(Path(tmp).glob(f"{pkg.name}_*.deb"))
                if len(got) != 1:
                    raise GuestBuildError(f"apt-get download left no single .deb for {pkg.name}")
                shutil.move(got[0], paths[pkg.name])
    for pkg in packages:
        actual = sha256_file(paths[pkg.name])
        if actual != pkg.sha256:
            paths[pkg.name].unlink()
            raise GuestBuildError(
                f"{paths[pkg.name].name}: sha256 {actual} does not match the archive's {pkg.sha256}; "
                "removed it from the cache, run the build again")
    return paths


def extract(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", str(deb), str(dest)], what=f"unpacking {deb.name}")

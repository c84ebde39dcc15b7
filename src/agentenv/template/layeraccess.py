"""Which team may use which blob the node holds (docs/remote-layers.md §7).

The layer cache (template/layercache.py), the downloads in flight beside it, snapshot parts and
blockd's chunk cache hold blobs by digest, for every team of the node. Knowing a digest is no
right to its bytes: a team's manifest (in a registry the team controls) can name any digest.
The rule is containerd's: content is shared only where the caller has proven access. A team
may use the node's copy of a blob, through the repository its pull names, when

(a) it has a grant for the blob: it proved access before (kept here, per team, with the
    repositories it proved it in);
(b) that repository is one the node got the blob from (a *source*), and the registry answers a
    HEAD of the blob there, asked with the team's credentials, 200; or
(c) it downloads the blob whole from its repository, verified against the digest (it has the
    bytes), which also makes the repository a source.

A HEAD is trusted only in a source: a registry that never served the blob (a team's own one)
would answer 200 for any digest. (b) and (c) leave a grant, so a team's next pull of the same
layers asks nothing. A pull of the node's operator (`aenv pull`, no team) is not checked; every
pull records the repositories it got blobs from. Built-in templates are made on the node, not
taken from these caches by digest.

    <layer cache>/access/sources/<digest hex>          repositories the blob came from, a line each
    <layer cache>/access/grants/<team key>/<digest hex> repositories the team proved it in

Lines are appended (O_APPEND, one write each), so concurrent pulls never lose one.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from agentenv.registry.errors import PullError

log = logging.getLogger("agentenv.template.layeraccess")

ACCESS_DIR = "access"


class LayerAccessError(PullError):
    """A team named a blob the node holds and could not show it may read it."""


def _hex(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    if algorithm != "sha256" or len(value) != 64 or not all(c in "0123456789abcdef" for c in value):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return value


def _team_key(team: str) -> str:
    return hashlib.sha256(team.encode()).hexdigest()[:32]


def _read_lines(path: Path) -> set[str]:
    try:
        return {line for line in path.read_text().splitlines() if line}
    except FileNotFoundError:
        return set()


def _append_line(path: Path, line: str) -> None:
    if line in _read_lines(path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class LayerAccess:
    def __init__(self, layer_cache_root: Path) -> None:
        self.root = Path(layer_cache_root) / ACCESS_DIR

    def sources(self, digest: str) -> set[str]:
        return _read_lines(self.root / "sources" / _hex(digest))

    def add_source(self, digest: str, repository: str) -> None:
        _append_line(self.root / "sources" / _hex(digest), repository)

    def held(self, digest: str) -> bool:
        """Whether the node has had the blob (from any repository, for anyone)."""
        return bool(self.sources(digest))

    def granted(self, team: str, digest: str) -> bool:
        return bool(_read_lines(self.root / "grants" / _team_key(team) / _hex(digest)))

    def grant(self, team: str | None, digest: str, repository: str) -> None:
        if team is not None:
            _append_line(self.root / "grants" / _team_key(team) / _hex(digest), repository)

    def fetched(self, team: str | None, digest: str, repository: str) -> None:
        """The node got the blob from `repository` for `team` (a download, or a remote
        layer recorded): the repository is a source and the team may use the blob."""
        self.add_source(digest, repository)
        self.grant(team, digest, repository)

    def claim(self, team: str | None, digest: str, repository: str, what: str,
              head: Callable[[], bool], prove: Callable[[], None]) -> str:
        """Let `team` use the node's copy of `digest` through `repository` (module doc), or
        raise LayerAccessError naming `what`. `head`: whether the registry shows the blob to
        the team there; `prove`: download it whole from there, verified (raises when it
        cannot). Returns how: "operator", "granted", "head" or "proved"."""
        if team is None:
            return "operator"
        if self.granted(team, digest):
            return "granted"
        if repository in self.sources(digest):
            try:
                shown = head()
            except PullError as exc:
                log.info("layer access HEAD failed", extra={"digest": digest,
                                                             "repository": repository,
                                                             "error": str(exc)})
                shown = False
            if shown:
                self.grant(team, digest, repository)
                return "head"
        try:
            prove()
        except PullError as exc:
            raise LayerAccessError(
                f"{what} {digest}: this node holds it, and {repository} did not show this "
                f"team that it may read it ({exc})") from exc
        self.fetched(team, digest, repository)
        return "proved"

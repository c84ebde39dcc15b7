"""Build uploads (`template-files`), kept per team and used only once verified.

A COPY step's `filesHash` is the E2B SDK's `calculate_files_hash`: sha256 over
`COPY <src> <dest>`, then for every copied path (in the order the archive holds them) its path
relative to the build context, its `st_mode`, its size (not for a directory) and its content
(a symlink's target). It names the step as much as the files, so an upload cannot be checked
when it arrives (the URL names the hash, not the step); it is checked against the step that
names it when the build is started, before the build is accepted, by reading the archive
again: what the client uploaded must be what its hash says.

Layout under <state>/template-files/: one directory per team (`team-<sha256 of the team>`),
in it `<hash>.new`, an upload not verified yet (a newer upload replaces it), and `<hash>`, a
verified one. A verified file is never replaced (what its hash names cannot change), and
`present` is answered only for a verified file of the asking team: a team never learns
whether another team uploaded something, nor uses what another team uploaded.

What a team holds here (verified, unverified and being written) is bounded by
AENV_TEAM_TEMPLATE_FILES_MB (`team_files_budget`): one team's uploads cannot take the node's
disk from the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tarfile
from pathlib import Path

from agentenv.api.errors import BadRequest
from agentenv.node.admission import QuotaExceeded, env_number

UNVERIFIED_SUFFIX = ".new"
#: bytes of file content read to verify one archive (a gzip bomb stops here)
MAX_VERIFIED_BYTES = 32 << 30
_CHUNK = 1 << 20
#: the least one file counts for (a block): a flood of empty uploads costs too
_MIN_FILE_BYTES = 4096
BUDGET_SETTING = "AENV_TEAM_TEMPLATE_FILES_MB"
DEFAULT_BUDGET_MB = 16 << 10  # two of the largest uploads (template_api.MAX_UPLOAD_BYTES)

_TYPE_BITS = {
    tarfile.REGTYPE: stat.S_IFREG, tarfile.AREGTYPE: stat.S_IFREG,
    tarfile.CONTTYPE: stat.S_IFREG, tarfile.LNKTYPE: stat.S_IFREG,
    tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK,
    tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK,
    tarfile.FIFOTYPE: stat.S_IFIFO,
}


def team_files_budget() -> int:
    """Bytes of build files one team may hold on a node, verified or not
    (AENV_TEAM_TEMPLATE_FILES_MB, default 16 GiB; 0: no limit). Read per upload."""
    return int(env_number(None, BUDGET_SETTING, DEFAULT_BUDGET_MB) or 0) << 20


class FilesMismatch(BadRequest):
    """An upload whose content is not what its hash names (400)."""


def team_dir(files_dir: Path, team: str) -> Path:
    """The directory of `team`'s uploads (named by a digest: any team name is a safe name)."""
    return files_dir / ("team-" + hashlib.sha256(team.encode()).hexdigest()[:32])


def archive_files_hash(archive: Path, src: str, dest: str,
                       max_bytes: int = MAX_VERIFIED_BYTES) -> str:
    """The E2B files hash of a COPY of `src` to `dest` whose files are `archive` (a tar,
    gzipped or not). Raises FilesMismatch when the archive cannot be read as one."""
    digest = hashlib.sha256(f"COPY {src} {dest}".encode())
    read = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                type_bits = _TYPE_BITS.get(member.type)
                if type_bits is None:
                    raise FilesMismatch(f"the archive holds {member.name!r} of tar type "
                                        f"{member.type!r}, which a COPY does not make")
                digest.update(member.name.encode())
                digest.update(str(type_bits | member.mode).encode())
                if member.issym():
                    target = member.linkname.encode()
                    digest.update(str(len(target)).encode())
                    digest.update(target)
                    continue
                if member.isdir():
                    continue
                if not (member.isfile() or member.islnk()):  # a device or fifo: no content
                    digest.update(str(member.size).encode())
                    continue
                size = _target(tar, member).size if member.islnk() else member.size
                digest.update(str(size).encode())
                content = tar.extractfile(member)  # a hard link reads its target's bytes
                assert content is not None
                while chunk := content.read(_CHUNK):
                    read += len(chunk)
                    if read > max_bytes:
                        raise FilesMismatch(f"the archive holds more than {max_bytes} bytes")
                    digest.update(chunk)
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as exc:
        raise FilesMismatch(f"the uploaded files are not a readable tar archive: {exc}") from None
    return digest.hexdigest()


def _target(tar: tarfile.TarFile, member: tarfile.TarInfo) -> tarfile.TarInfo:
    """The member a hard link names (what extractfile reads for it)."""
    return tar._find_link_target(member)


class TeamFiles:
    """One team's uploads on this node."""

    def __init__(self, files_dir: Path, team: str) -> None:
        self.dir = team_dir(files_dir, team)

    def verified(self, files_hash: str) -> Path:
        return self.dir / files_hash

    def unverified(self, files_hash: str) -> Path:
        return self.dir / (files_hash + UNVERIFIED_SUFFIX)

    def present(self, files_hash: str) -> bool:
        return self.verified(files_hash).is_file()

    def uploaded(self, files_hash: str) -> bool:
        return self.present(files_hash) or self.unverified(files_hash).is_file()

    def held_bytes(self, skip: tuple[Path, ...] = ()) -> int:
        """Disk the team's files take (every name in its directory, a hard-linked file once),
        but for `skip`."""
        skipped = {os.path.abspath(p) for p in skip}
        seen: set[int] = set()
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if entry.path in skipped or st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                    total += max(st.st_blocks * 512, _MIN_FILE_BYTES)
        return total

    def check_budget(self, held: int, adding: int) -> None:
        """429 (QuotaExceeded) when holding `held` bytes the team may not add `adding`."""
        budget = team_files_budget()
        if budget and held + adding > budget:
            raise QuotaExceeded(
                f"team quota reached: {budget >> 20} MiB of template build files on this node "
                f"(the team holds {held >> 20} MiB, {adding >> 20} MiB more sent; "
                f"{BUDGET_SETTING}). Unused uploads are removed after AENV_TEMPLATE_FILES_TTL; "
                f"or ask the operator for a higher quota", "template_files")

    def store(self, received: Path, files_hash: str) -> bool:
        """Give a received upload its name (atomically); False (and `received` removed) when
        a verified file is there already: it cannot be replaced."""
        if self.present(files_hash):
            received.unlink(missing_ok=True)
            return False
        os.replace(received, self.unverified(files_hash))
        return True

    def verify(self, files_hash: str, src: str, dest: str, what: str) -> None:
        """Make the upload for a step verified, or raise FilesMismatch (and drop it)."""
        if self.present(files_hash):
            return
        pending = self.unverified(files_hash)
        # The check reads a private link: an upload replacing `pending` meanwhile is not what
        # gets its verified name.
        checking = self.dir / f".{files_hash}.verify.{os.getpid()}.{id(self)}"
        try:
            os.link(pending, checking)
        except FileNotFoundError:
            raise BadRequest(f"the files of {what} (hash {files_hash}) were not uploaded"
                             ) from None
        os.utime(checking)  # fresh: the garbage collector leaves it alone (node/gc.py)
        try:
            try:
                actual = archive_files_hash(checking, src, dest)
            except FilesMismatch as exc:
                raise FilesMismatch(f"the files uploaded for {what} do not match their hash "
                                    f"{files_hash}: {exc.message}; they were dropped, upload "
                                    "them again") from None
            if actual != files_hash:
                raise FilesMismatch(f"the files uploaded for {what} do not match their hash: "
                                    f"they hash to {actual}, not {files_hash}; they were "
                                    "dropped, upload them again")
            with_name = self.verified(files_hash)
            with contextlib.suppress(FileExistsError):  # never replaces a verified file
                os.link(checking, with_name)
            _unlink_if_same(pending, checking)
        except FilesMismatch:
            _unlink_if_same(pending, checking)
            raise
        finally:
            checking.unlink(missing_ok=True)


def _unlink_if_same(path: Path, twin: Path) -> None:
    """Remove `path` if it is still the file `twin` links (not a newer upload)."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.samefile(path, twin):
            path.unlink()

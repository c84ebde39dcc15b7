"""Per-chunk SHA-256 digests of a blob: what lets a node take a chunk from a peer.

A peer is not trusted with content: the ZFile CRC-32C a chunk is checked with is no MAC (a
hostile node can craft blocks with valid CRCs and other content), and the blob's sha256 is
known only once every chunk is in. So a peer's chunk is used only when its SHA-256 equals
the digest of that chunk in a table from the blob's trusted source: computed where the blob
is pushed (snapshot/repository.py) and published with the layer's descriptor in the
manifest, as the layer annotation ANNOTATION, so it reaches the node by the same path (and
with the same trust) as the blob's digest. A blob without a table (or with one for another
chunk size) is fetched from its registry only.

Wire form: `<chunk size>:<base64 of the concatenated 32-byte digests>` (a 1 GiB layer in
1 MiB chunks: 43 KiB of annotation).

The table is also what a node shows a peer to be given chunks (PROOF_HEADER): the SHA-256 of
each whole chunk it asks for. A peer credential names no team, so a node taken over could
otherwise read any chunk a peer holds by its blob digest; with the proof it gets only chunks
whose table it already has, which came with a manifest from a registry that let it pull the
blob. Only whole chunks are proven (a short piece's hash could be guessed byte by byte).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass

ANNOTATION = "io.agentenv.chunk-sha256"
PROOF_HEADER = "X-Chunk-SHA256"
TABLE_CHUNK_SIZE = 1 << 20  # what pushes compute with (the chunk cache's default chunk size)
_DIGEST = 32


class ChunkDigestsError(ValueError):
    """A table that does not fit its blob (the message says how)."""


@dataclass(frozen=True)
class ChunkDigests:
    chunk_size: int
    digests: bytes  # 32 bytes per chunk, in order

    @property
    def count(self) -> int:
        return len(self.digests) // _DIGEST

    def matches(self, idx: int, data: bytes | memoryview) -> bool:
        """Whether `data` is chunk `idx` (its whole length) as the table says."""
        if not 0 <= idx < self.count:
            return False
        want = self.digests[idx * _DIGEST : (idx + 1) * _DIGEST]
        return hashlib.sha256(data).digest() == want

    def encode(self) -> str:
        return f"{self.chunk_size}:{base64.b64encode(self.digests).decode()}"

    @classmethod
    def decode(cls, text: str, blob_size: int) -> ChunkDigests:
        """The table in `text`, checked to cover exactly a blob of `blob_size` bytes."""
        size_text, sep, body = text.partition(":")
        if not sep or not size_text.isdigit() or int(size_text) <= 0:
            raise ChunkDigestsError("not <chunk size>:<base64 digests>")
        chunk_size = int(size_text)
        try:
            digests = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ChunkDigestsError("the digests are not base64") from None
        want = -(-blob_size // chunk_size)
        if len(digests) != want * _DIGEST:
            raise ChunkDigestsError(f"{len(digests) // _DIGEST} digests for a blob of "
                                    f"{blob_size} bytes in {chunk_size}-byte chunks ({want})")
        return cls(chunk_size, digests)

    @classmethod
    def compute(cls, read: Callable[[int], bytes], size: int,
                chunk_size: int = TABLE_CHUNK_SIZE) -> tuple[ChunkDigests, str]:
        """The table of a blob read in order with `read(n)` (a file's read), and the blob's
        own sha256 digest from the same pass."""
        whole = hashlib.sha256()
        out = bytearray()
        left = size
        while left:
            data = read(min(chunk_size, left))
            if not data:
                raise ChunkDigestsError(f"the blob ended {left} bytes early")
            while len(data) < min(chunk_size, left):  # a short read: the rest of the chunk
                more = read(min(chunk_size, left) - len(data))
                if not more:
                    raise ChunkDigestsError(f"the blob ended {left - len(data)} bytes early")
                data += more
            whole.update(data)
            out += hashlib.sha256(data).digest()
            left -= len(data)
        return cls(chunk_size, bytes(out)), "sha256:" + whole.hexdigest()


def proof(digests: ChunkDigests, start: int, end: int) -> str:
    """PROOF_HEADER's value for the whole chunks [start, end) of a blob: their SHA-256 digests
    from its table, in hex, comma-separated."""
    cs = digests.chunk_size
    return ",".join(digests.digests[i * _DIGEST : (i + 1) * _DIGEST].hex()
                    for i in range(start // cs, (end - 1) // cs + 1))


_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def claimed_digests(claimed: str, start: int, end: int, chunk_size: int) -> bytes | None:
    """The digests PROOF_HEADER claims for the chunks of bytes [start, end) (whole chunks: the
    range starts at a chunk, one digest per chunk it touches), concatenated; None when the
    claim cannot be right whatever is held. Decided from the request alone (not the blob's
    size nor whether it is held), so such a claim gets the answer, and the time, of a range
    not held (a non-ASCII one made compare_digest raise on held bytes only: an oracle)."""
    if end <= start or start % chunk_size:
        return None
    parts = [part.strip().lower() for part in claimed.split(",")]
    if len(parts) != -(-(end - start) // chunk_size) \
            or not all(_HEX_DIGEST.fullmatch(part) for part in parts):
        return None
    return bytes.fromhex("".join(parts))


def claim_matches(table: ChunkDigests | None, start: int, claimed: bytes) -> bool:
    """Whether `claimed` (claimed_digests) names the table's digests of the chunks from the
    one at `start`: one constant-time compare of as many bytes whether or not the table is
    known here or covers the range, so the time says nothing of what this node holds."""
    want = b""
    if table is not None:
        first = start // table.chunk_size * _DIGEST
        want = table.digests[first : first + len(claimed)]
    known = len(want) == len(claimed)
    if not known:
        want = bytes(len(claimed))
    return hmac.compare_digest(want, claimed) and known

"""Red-team checks of the P2P chunk proof (blockd/remote/p2p.py, chunkdigests.py `proven`):
a node with a peer's trust (its signed credential) and a blob's digest, but not its chunk table, learns nothing of
the chunks a peer holds, not even whether it holds them. A real peer server and store."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from tests.remote.peerids import ASKER_TRUST, asker
from tests.remote.test_chunk_cache import CHUNK, _ref, hello  # noqa: F401 (fixture)
from tests.template.conftest import Registry


@dataclass
class Holder:
    get: Any  # get(start, end, claimed, blob=digest) -> the peer's answer
    digest: str
    data: bytes
    store: RemoteStore
    server: PeerServer


@pytest.fixture
def holder(tmp_path: Path, registry: Registry,
           hello: tuple[str, bytes]) -> Iterator[Holder]:  # noqa: F811
    """A peer holding the whole `hello` blob (and its chunk table)."""
    digest, data = hello
    store = RemoteStore(RemoteConfig(tmp_path / "holder", capacity=64 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=5))
    server = PeerServer(store, "127.0.0.1:0", node_id="server", trust=ASKER_TRUST)
    server.start()
    try:
        source = store.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        base = f"http://{server.address}/blobs/"

        def get(start: int, end: int, claimed: str, blob: str = digest) -> httpx.Response:
            headers: dict[str, str | bytes] = {"Range": f"bytes={start}-{end - 1}",
                                               PROOF_HEADER: claimed.encode("latin-1")}
            headers["Authorization"] = asker("/blobs/" + blob, headers)
            with httpx.Client(timeout=30) as client:
                return client.get(base + blob, headers=headers)

        yield Holder(get, digest, data, store, server)
    finally:
        server.stop()
        store.close()


def test_a_claim_of_any_shape_says_nothing_of_what_is_held(holder: Holder) -> None:
    """A claim that cannot be right (not hex, non-ASCII, too few or too many digests) is
    answered as one that is wrong: 404 whether or not the range is held. A non-ASCII claim made
    hmac.compare_digest raise after the held bytes were read and hashed: the connection was
    dropped for a held range and 404 came for another, an exact oracle of what a peer holds."""
    get, digest, data = holder.get, holder.digest, holder.data
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    unheld = "sha256:" + hashlib.sha256(b"not held").hexdigest()
    right = proof(table, 0, 2 * CHUNK)
    for claimed in ("\xe9" * 64, "\xe9" * 64 + "," + "0" * 64, "z" * 64 + "," + "0" * 64,
                    right.split(",")[0], right + "," + "0" * 64, right + ",", ""):
        for blob in (digest, unheld):
            reply = get(0, 2 * CHUNK, claimed, blob)
            assert reply.status_code == 404, (claimed, blob, reply.status_code)
            assert reply.content == b"not held (or not verified) here\n"
    assert get(0, 2 * CHUNK, right.upper()).status_code == 206  # hex in either case


def test_a_wrong_claim_costs_the_same_whether_held_or_not(holder: Holder) -> None:
    """The timing oracle (red team of 2026-12-06): a held range was read and hashed before a
    wrong claim was refused, a range not held was not, so the time of a 404 told a keyed node
    without the blob's table what a peer holds. Now the claim is compared with the peer's own
    table first: a wrong claim, held or not, reads nothing and takes none of the byte budget;
    only a right one is read."""
    get, digest, data = holder.get, holder.digest, holder.data
    store, budget = holder.store, holder.server.server.budget
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    reads: list[tuple[str, int, int]] = []
    taken: list[int] = []
    real_read, real_take = store.serve_range, budget.take

    def read(hex_: str, start: int, end: int) -> bytes | None:
        reads.append((hex_, start, end))
        return real_read(hex_, start, end)

    def take(amount: int, timeout: float) -> bool:
        taken.append(amount)
        return real_take(amount, timeout)

    store.serve_range = read  # type: ignore[method-assign]
    budget.take = take  # type: ignore[method-assign]
    unheld = "sha256:" + hashlib.sha256(b"not held").hexdigest()
    right = proof(table, 0, 2 * CHUNK)
    guesses = [",".join(["0" * 64] * 2), ",".join(reversed(right.split(","))),
               proof(table, 2 * CHUNK, 4 * CHUNK)]
    for claimed in guesses:
        for blob in (digest, unheld):
            assert get(0, 2 * CHUNK, claimed, blob).status_code == 404
    assert reads == [] and taken == []  # no read, no budget, for a held range or not
    assert get(0, 2 * CHUNK, right).content == data[: 2 * CHUNK]
    assert reads == [(digest.split(":", 1)[1], 0, 2 * CHUNK)] and taken == [2 * CHUNK]

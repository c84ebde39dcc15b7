"""The remote store: remote blobs read through the node's chunk cache, fetched from peers and
registries (docs/remote-layers.md).

One store per process (blockd's, or a private one elsewhere). It owns the HTTP connection
pools (one httpx client for peers, one RegistryClient per registry), the fetch threads and
the background completer, so a device going away never touches another's connections.

A read of an absent chunk fetches it once however many readers want it (requests in flight
are shared), from the peers first (spread by chunk), then the registry; every answer is
checked before it is stored or used (layout.py), and a bad or failed answer moves on to the
next source. A read that no source can serve within `timeout` seconds fails with EIO.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import shutil
import ssl
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentenv.blockd.remote.cache import UNVERIFIED, VERIFIED, BlobState, ChunkCache
from agentenv.blockd.remote.chunkdigests import (
    PROOF_HEADER,
    ChunkDigests,
    ChunkDigestsError,
    proof,
)
from agentenv.blockd.remote.identity import NodeIdentity, TrustedPeers
from agentenv.blockd.remote.layout import Layout, parse
from agentenv.cluster_keys import PEER_SCHEME, peer_request, peer_request_credential
from agentenv.fsutil import atomic_write
from agentenv.registry.client import RegistryClient
from agentenv.registry.errors import PullError
from agentenv.settings import get_settings
from agentenv.storage.blob import BlobLocation, RemoteLayerRef, WouldBlock, blocking_allowed
from agentenv.storage.errors import LayerFormatError

log = logging.getLogger("agentenv.blockd.remote")

DEFAULT_CHUNK = 1 << 20
DEFAULT_TIMEOUT = 30.0
PEER_BACKOFF_S = 5.0
HOLDERS_TTL_S = 5.0  # how long a resolver's answer is used before asking again
HOLDERS_RETRY_S = 1.0  # ... an empty or failed one (a holder may register any moment)
RESOLVER_TIMEOUT_S = 2.0


@dataclass
class RemoteConfig:
    """Settings of the remote store (the `aenv blockd` options and env variables)."""

    cache_dir: Path
    capacity: int = 20 << 30
    chunk_size: int = DEFAULT_CHUNK
    high: float = 0.95
    low: float = 0.85
    timeout: float = DEFAULT_TIMEOUT  # a guest read fails with EIO after this long
    request_timeout: float = 10.0  # one HTTP request to one source
    peers: list[str] = field(default_factory=list)  # http://host:port of other nodes' blockd
    # static peers (identity.py): this node's key pair, and the nodes it trusts (the address
    # listed with a node names the node a static peer's credential is signed for)
    identity: NodeIdentity | None = None
    trust: TrustedPeers | None = None
    p2p_listen: str | None = None  # host:port to serve chunks to peers
    background_bw: int = 32 << 20  # bytes/s for completing blobs in use; 0: off
    fetch_threads: int = 8
    docker_config: Path | None = None
    eviction: str = "2q"  # the chunk cache's policy (cache.POLICIES)


@dataclass
class Resolver:
    """Where blockd asks which peers hold a blob: `GET url?digest=sha256:...` answers
    {"holders": [{"address": "host:port", "complete": bool}, ...]} (the node's
    /cluster/holders, which asks its scheduler; docs/remote-layers.md §4)."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    ca: str | None = None  # PEM file the node's certificate is checked with (https)


class RemoteUnavailable(OSError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class SourceError(Exception):
    pass


@dataclass
class BlobInfo:
    ref: RemoteLayerRef
    hex: str
    state: BlobState
    layout: Layout
    # The per-chunk SHA-256 table from the blob's manifest (chunkdigests.py), when it has one
    # for the cache's chunk size: only then are chunks (and metadata) taken from peers.
    digests: ChunkDigests | None = None
    users: int = 0
    # Readahead (docs/remote-layers.md §2): the last chunk read and the current window,
    # grown while misses follow each other, reset by a jump.
    last_idx: int = -10
    prev_miss: int = -10
    window: int = 0


class Stats:
    """Counters for metrics and the `remote_stats` RPC."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fetched: dict[str, int] = {}  # bytes per source kind (peer, registry)
        self.requests: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.eio = 0
        self.coalesced = 0
        self.background_bytes = 0

    def add(self, table: str, key: str, amount: int = 1) -> None:
        with self.lock:
            d: dict[str, int] = getattr(self, table)
            d[key] = d.get(key, 0) + amount


class RemoteBlob:
    """A BlobSource over the chunk cache: what `open_layer` reads a remote layer through."""

    def __init__(self, store: RemoteStore, info: BlobInfo) -> None:
        self.store = store
        self.info = info
        self.size = info.ref.size
        self._closed = False

    def pread(self, length: int, offset: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        cs = self.store.cache.chunk_size
        idx = offset // cs
        if length and (offset + length - 1) // cs == idx \
                and self.info.layout.meta_read(offset, length) is None:
            # Inside one chunk (a ZFile block read): straight from the cache file when held.
            data = self.store.cache.pread(self.info.state, idx, offset - idx * cs, length)
            if data is not None:
                self.info.last_idx = idx
                return data
        buf = bytearray(length)
        n = self.readinto(offset, memoryview(buf))
        return bytes(buf[:n])

    def readinto(self, offset: int, buf: memoryview) -> int:
        n = max(0, min(len(buf), self.size - offset))
        if n == 0:
            return 0
        meta = self.info.layout.meta_read(offset, n)
        if meta is not None:
            buf[:n] = meta
            return n
        store = self.store
        cache = store.cache
        info = self.info
        state = info.state
        cs = cache.chunk_size
        pos, out = offset, 0
        missing: list[tuple[int, int, int, int]] = []
        while out < n:
            idx = pos // cs
            co = pos - idx * cs
            take = min(n - out, state.chunk_len(idx) - co)
            if not cache.read(state, idx, co, buf[out : out + take]):
                if not blocking_allowed():
                    raise WouldBlock(f"chunk {idx} of {info.ref.digest} is not local")
                missing.append((idx, co, take, out))
            info.last_idx = idx
            out += take
            pos += take
        if missing:
            # Every chunk the read misses is fetched at once, plus a readahead window when
            # the misses run sequentially.
            first = missing[0][0]
            futures = [store.chunk_future(info, idx) for idx, _, _, _ in missing]
            store.read_ahead(info, first, missing[-1][0])
            for (idx, co, take, at), future in zip(missing, futures, strict=True):
                data = store.wait_chunk(info, idx, future)
                buf[at : at + take] = data[co : co + take]
        return n

    def native_view(self) -> tuple[Any, int, int] | None:
        """(chunk map, cache data fd, chunk size) for the native core, which reads present
        chunks itself and calls `readinto` for misses only; None without a ChunkMap (the
        extension is not built)."""
        state = self.info.state
        if not hasattr(state.present, "take_hits"):
            return None
        return state.present, state.fd, self.store.cache.chunk_size

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.store.release(self.info)


class RemoteStore:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.cache = ChunkCache(config.cache_dir, config.capacity, chunk_size=config.chunk_size,
                                high=config.high, low=config.low, policy=config.eviction)
        self.cache.on_complete = self._on_complete
        self.stats = Stats()
        self.peers: list[str] = [p.rstrip("/") for p in config.peers]
        self._peer_down: dict[str, float] = {}
        # Where to ask which peers hold a blob (the node, which asks its scheduler), and the
        # answers: hex -> (expires at, [(http://host:port, whole?)]).
        self.resolver: Resolver | None = None
        self._holders: dict[str, tuple[float, list[tuple[str, bool]]]] = {}
        self._holders_lock = threading.Lock()
        self._holders_asking: dict[str, threading.Event] = {}
        self._resolver_failing = False
        # This node's own chunk server, never asked (a resolver may not know us apart).
        self.own_addresses: set[str] = set()
        self._lock = threading.Lock()
        self._infos: dict[str, BlobInfo] = {}
        # The chunk tables of the blobs opened here (kept beside their layouts, so a restart
        # knows them): what a peer's claim is compared with before anything is read.
        self._tables: dict[str, ChunkDigests] = self._load_tables()
        # The credential the scheduler issued this node for each peer (Holders answers)
        self._peer_credentials: dict[str, str] = {}
        self._inflight: dict[tuple[str, int], Future[bytes]] = {}
        self._registries: dict[tuple[str, str | None, bool | None], RegistryClient] = {}
        self._registry_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.fetch_threads, thread_name_prefix="remote-fetch")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="remote-digest")
        self._peer_http = httpx.Client(timeout=httpx.Timeout(config.request_timeout, connect=3.0),
                                       trust_env=False,
                                       limits=httpx.Limits(max_connections=64))
        # The resolver (this node's API) gets its own headers, never the cluster secret's.
        self._resolver_http = httpx.Client(timeout=RESOLVER_TIMEOUT_S, trust_env=False)
        self._stop = threading.Event()
        self._background: threading.Thread | None = None
        if config.background_bw > 0:
            self._background = threading.Thread(target=self._complete_in_background,
                                                name="remote-background", daemon=True)
            self._background.start()

    # -- opening ---------------------------------------------------------------------------

    def open_blob(self, ref: RemoteLayerRef) -> RemoteBlob:
        """The remote opener (storage/blob.py): the layout is read once per blob (from the
        cache's metadata when it has it, else from the sources)."""
        hex_ = ref.digest.split(":", 1)[1]
        with self._lock:
            info = self._infos.get(hex_)
            if info is not None:
                self._merge_sources(info, ref)
                info.users += 1
                info.state.users += 1
                return RemoteBlob(self, info)
        digests = self._chunk_digests(ref)
        if digests is not None:
            self._remember_table(hex_, ref.size, digests)
        state = self.cache.blob(hex_, ref.size)
        meta_path = self.cache.meta_path(hex_)
        layout = Layout.load(meta_path, ref.size)
        if layout is None:
            layout = self._fetch_layout(ref, hex_, digests)
            layout.save(meta_path)
        with self._lock:
            info = self._infos.get(hex_)
            if info is None:
                info = self._infos[hex_] = BlobInfo(ref, hex_, state, layout, digests)
            else:
                self._merge_sources(info, ref)
            info.users += 1
            info.state.users += 1
        log.info("remote blob opened", extra={"blob": ref.digest, "size": ref.size,
                                              "layout": layout.kind,
                                              "cached_chunks": state.count})
        return RemoteBlob(self, info)

    def _merge_sources(self, info: BlobInfo, ref: RemoteLayerRef) -> None:
        for src in ref.sources:
            if src not in info.ref.sources:
                info.ref.sources.append(src)
        if info.digests is None and ref.chunk_sha256 is not None:
            info.digests = self._chunk_digests(ref)
            if info.digests is not None:
                self._remember_table(info.hex, ref.size, info.digests)

    def _chunk_digests(self, ref: RemoteLayerRef) -> ChunkDigests | None:
        """The blob's chunk table if it has a usable one (its descriptor carries what its
        manifest published); else None: its chunks come from its registries only."""
        if ref.chunk_sha256 is None:
            return None
        try:
            digests = ChunkDigests.decode(ref.chunk_sha256, ref.size)
        except ChunkDigestsError as exc:
            log.warning("a remote blob's chunk table is unusable: peers are not asked for it",
                        extra={"blob": ref.digest, "error": str(exc)})
            return None
        if digests.chunk_size != self.cache.chunk_size:
            log.info("a remote blob's chunk table is for another chunk size: peers are not "
                     "asked for it", extra={"blob": ref.digest, "table": digests.chunk_size,
                                            "cache": self.cache.chunk_size})
            return None
        return digests

    def _remember_table(self, hex_: str, size: int, digests: ChunkDigests) -> None:
        if hex_ in self._tables:
            return
        try:
            atomic_write(self.cache.root / "meta" / f"{hex_}.chunks",
                         f"{size}\n{digests.encode()}", mode=0o600)
        except OSError as exc:  # peers are then served this blob until a restart only
            log.warning("cannot keep a blob's chunk table", extra={"blob": hex_,
                                                                    "error": str(exc)})
        self._tables[hex_] = digests

    def _load_tables(self) -> dict[str, ChunkDigests]:
        tables: dict[str, ChunkDigests] = {}
        for path in (self.cache.root / "meta").glob("*.chunks"):
            try:
                size, text = path.read_text().split("\n", 1)
                table = ChunkDigests.decode(text.strip(), int(size))
            except (OSError, ValueError) as exc:
                log.warning("a kept chunk table is unreadable, dropped",
                            extra={"path": str(path), "error": str(exc)})
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if table.chunk_size == self.cache.chunk_size:
                tables[path.stem] = table
        return tables

    def chunk_table(self, hex_: str) -> ChunkDigests | None:
        """The chunk table of a blob opened here (now or before a restart), if it has one."""
        return self._tables.get(hex_)

    def release(self, info: BlobInfo) -> None:
        with self._lock:
            info.users -= 1
            info.state.users -= 1

    def _fetch_layout(self, ref: RemoteLayerRef, hex_: str,
                      digests: ChunkDigests | None) -> Layout:
        deadline = time.monotonic() + self.config.timeout
        problems: list[str] = []
        while True:
            for name, fetch in self._sources_for(ref, hex_, 0, digests):
                def read(length: int, offset: int, fetch: Any = fetch, name: str = name) -> bytes:
                    if name.startswith("peer ") and digests is not None:
                        return self._peer_checked_read(fetch, name, digests, ref.size,
                                                       offset, length)
                    data: bytes = fetch(offset, offset + length)
                    self.stats.add("fetched", _kind(name), len(data))
                    return data
                try:
                    return parse(read, ref.size, ref.digest)
                except SourceError as exc:
                    problems.append(f"{name}: {exc}")
                except LayerFormatError as exc:
                    self.stats.add("corrupt", _kind(name))
                    problems.append(f"{name}: {exc}")
                    log.warning("remote blob metadata rejected",
                                extra={"blob": ref.digest, "source": name, "error": str(exc)})
            if time.monotonic() >= deadline:
                raise LayerFormatError(ref.path or ref.digest, None,
                                       "cannot read the remote layer's metadata: "
                                       + ("; ".join(problems[-4:]) or "no source"))
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # -- sources ---------------------------------------------------------------------------

    def set_peers(self, peers: list[str]) -> None:
        self.peers = [p.rstrip("/") for p in peers]

    def set_resolver(self, resolver: Resolver | None) -> None:
        if resolver is not None and resolver.ca:
            try:
                verify = ssl.create_default_context(cafile=resolver.ca)
            except (OSError, ssl.SSLError) as exc:
                raise SourceError(f"resolver CA {resolver.ca}: {exc}") from exc
            # the old client is left to the collector: a fetch thread may be using it
            self._resolver_http = httpx.Client(timeout=RESOLVER_TIMEOUT_S, trust_env=False,
                                               verify=verify)
        self.resolver = resolver
        with self._holders_lock:
            self._holders.clear()

    def holders(self, hex_: str) -> list[tuple[str, bool]]:
        """The peers the resolver names for a blob, (http://host:port, whole?), asked at
        most once per HOLDERS_TTL_S (HOLDERS_RETRY_S after an empty or failed answer), by one
        fetch thread at a time: the others use the last answer, or wait for the first."""
        resolver = self.resolver
        if resolver is None:
            return []
        now = time.monotonic()
        with self._holders_lock:
            cached = self._holders.get(hex_)
            if cached is not None and cached[0] > now:
                return cached[1]
            asking = self._holders_asking.get(hex_)
            if asking is None:
                self._holders_asking[hex_] = threading.Event()
        if asking is not None:
            if cached is None:
                asking.wait(RESOLVER_TIMEOUT_S + 0.5)
            with self._holders_lock:
                latest = self._holders.get(hex_)
            return latest[1] if latest is not None else []
        found: list[tuple[str, bool]] = []
        try:
            found = self._ask_resolver(resolver, hex_)
        finally:  # whatever happened, the next question may go out
            ttl = HOLDERS_TTL_S if found else HOLDERS_RETRY_S
            with self._holders_lock:
                if len(self._holders) > 4096:  # old answers of blobs no longer read
                    self._holders = {k: v for k, v in self._holders.items() if v[0] > now}
                self._holders[hex_] = (time.monotonic() + ttl, found)
                self._holders_asking.pop(hex_).set()
        return found

    def _ask_resolver(self, resolver: Resolver, hex_: str) -> list[tuple[str, bool]]:
        found: list[tuple[str, bool]] = []
        try:
            self.stats.add("requests", "resolver")
            reply = self._resolver_http.get(resolver.url, params={"digest": "sha256:" + hex_},
                                            headers=resolver.headers)
            if reply.status_code != 200:
                raise SourceError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            for holder in reply.json()["holders"]:
                address = str(holder["address"]).rstrip("/")
                if not address.startswith(("http://", "https://")):
                    address = "http://" + address
                found.append((address, bool(holder.get("complete"))))
                credential = holder.get("credential")
                if isinstance(credential, str) and credential:
                    # this node's for that peer, whatever the blob (the newest lasts longest)
                    self._peer_credentials[address] = credential
            self._resolver_failing = False
        except (httpx.HTTPError, httpx.InvalidURL, SourceError, ValueError, KeyError,
                TypeError, AttributeError) as exc:
            self.stats.add("failures", "resolver")
            if not self._resolver_failing:  # once per outage, not once a second per blob
                log.warning("cannot ask which peers hold a blob; the registry serves it",
                            extra={"blob": "sha256:" + hex_, "resolver": resolver.url,
                                   "error": str(exc)})
            self._resolver_failing = True
            return []
        return [(a, c) for a, c in found if a not in self.own_addresses]

    def _peer_order(self, hex_: str, idx: int) -> list[str]:
        """The peers to ask for chunk `idx`, each list rotated to start at one picked by
        hashing (blob, chunk), so that requests spread: the holders of the whole blob, the
        static peers, then the holders of some of its chunks (they may answer 404)."""
        now = time.monotonic()
        holders = self.holders(hex_)
        whole = [a for a, complete in holders if complete]
        partial = [a for a, complete in holders if not complete]
        turn = zlib.crc32(f"{hex_}:{idx}".encode())
        out: list[str] = []
        for group in (whole, self.peers, partial):
            group = [p for p in group if self._peer_down.get(p, 0) <= now and p not in out
                     and p not in self.own_addresses]
            if group:
                first = turn % len(group)
                out += group[first:] + group[:first]
        return out

    def _peer_checked_read(self, fetch: Any, name: str, digests: ChunkDigests, size: int,
                           offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) from a peer, read as the whole chunks holding them,
        each checked against the blob's chunk table (a metadata read at open)."""
        cs = digests.chunk_size
        first, last = offset // cs, (offset + length - 1) // cs
        lo, hi = first * cs, min(size, (last + 1) * cs)
        data: bytes = fetch(lo, hi)
        self.stats.add("fetched", _kind(name), len(data))
        for idx in range(first, last + 1):
            if not digests.matches(idx, data[idx * cs - lo : min(size, (idx + 1) * cs) - lo]):
                raise LayerFormatError(name, idx * cs, "a chunk does not match the blob's "
                                                       "chunk table")
        return data[offset - lo : offset - lo + length]

    def _sources_for(self, ref: RemoteLayerRef, hex_: str, idx: int,
                     digests: ChunkDigests | None) -> Iterator[tuple[str, Any]]:
        """(name, fetch(start, end)) in the order to try: peers first (only for blobs with a
        chunk table: what a peer sends is checked against it, and it is asked for whole chunks
        only, with their proof; _peer_order), then every registry location."""
        if digests is not None:
            for peer in self._peer_order(hex_, idx):
                yield f"peer {peer}", lambda a, b, peer=peer: self._peer_get(
                    peer, ref.digest, a, b, digests)
        for loc in ref.sources:
            yield (f"registry {loc.registry}/{loc.repository}",
                   lambda a, b, loc=loc: self._registry_get(loc, ref.digest, a, b))

    def _peer_get(self, peer: str, digest: str, start: int, end: int,
                  digests: ChunkDigests) -> bytes:
        self.stats.add("requests", "peer")
        path = f"/blobs/{digest}"
        byte_range, claim = f"bytes={start}-{end - 1}", proof(digests, start, end)
        headers = {"Range": byte_range, PROOF_HEADER: claim}
        # The credential is made for this request (cluster_keys.peer_request), now, with a
        # fresh nonce (each call, a retry too: the peer takes a nonce once, so a copy taken off
        # the wire is refused there).
        request = peer_request("GET", path, byte_range, claim)
        credential = None
        issued = self._peer_credentials.get(peer)
        if issued is not None:  # a holder the scheduler named: from what it issued this node
            with contextlib.suppress(ValueError):  # (not one: sent without, 401)
                credential = peer_request_credential(issued, request)
        else:  # a static peer's: signed
            identity, trust = self.config.identity, self.config.trust
            target = trust.node_at(peer) if trust is not None else None
            if identity is not None and target is not None:
                credential = identity.credential_for(target, request)
        if credential is not None:
            headers["Authorization"] = f"{PEER_SCHEME} {credential}"
        try:
            reply = self._peer_http.get(peer + path, headers=headers)
        except httpx.HTTPError as exc:
            self._peer_down[peer] = time.monotonic() + PEER_BACKOFF_S
            self.stats.add("failures", "peer")
            raise SourceError(f"unreachable: {exc}") from exc
        if reply.status_code == 404:
            raise SourceError("does not hold it")
        if reply.status_code != 206 or len(reply.content) != end - start:
            self._peer_down[peer] = time.monotonic() + PEER_BACKOFF_S
            self.stats.add("failures", "peer")
            raise SourceError(f"answered HTTP {reply.status_code} with {len(reply.content)} bytes")
        return reply.content

    def _registry_get(self, loc: BlobLocation, digest: str, start: int, end: int) -> bytes:
        self.stats.add("requests", "registry")
        client = self._registry(loc)
        try:
            return bytes(client.get_blob_range(loc.repository, digest, start, end))
        except (PullError, httpx.HTTPError, OSError) as exc:
            self.stats.add("failures", "registry")
            raise SourceError(str(exc)) from exc

    def _registry(self, loc: BlobLocation) -> RegistryClient:
        key = (loc.registry, loc.api_host, loc.insecure)
        with self._registry_lock:
            client = self._registries.get(key)
            if client is None:
                client = RegistryClient(loc.registry, api_host=loc.api_host,
                                        insecure=loc.insecure,
                                        docker_config=self.config.docker_config,
                                        timeout=self.config.request_timeout)
                self._registries[key] = client
            return client

    # -- chunks ----------------------------------------------------------------------------

    def chunk_future(self, info: BlobInfo, idx: int) -> Future[bytes]:
        """The fetch of chunk `idx`, started unless one is in flight already (shared)."""
        key = (info.hex, idx)
        with self._lock:
            future = self._inflight.get(key)
            if future is not None:
                self.stats.coalesced += 1
                return future
            future = Future()
            self._inflight[key] = future
        self._pool.submit(self._fetch_into, info, idx, future)
        return future

    def read_ahead(self, info: BlobInfo, first_miss: int, last_miss: int) -> None:
        """Sequential misses (this one within the window past the last) grow the readahead
        window (2, 4, ... 32 chunks); a jump resets it. Random reads fetch nothing extra."""
        state = info.state
        sequential = 0 < first_miss - info.prev_miss <= max(2, info.window + 1)
        info.window = min(max(2, info.window * 2), 32) if sequential else 0
        info.prev_miss = last_miss
        for idx in range(last_miss + 1, min(last_miss + 1 + info.window, state.nchunks)):
            if not state.present[idx] and (info.hex, idx) not in self._inflight:
                self.chunk_future(info, idx)

    def get_chunk(self, info: BlobInfo, idx: int, *, background: bool = False) -> bytes:
        """Chunk `idx`'s bytes, fetched (once, for every reader that wants it) and checked.
        Raises RemoteUnavailable (EIO) when no source served it within the timeout."""
        return self.wait_chunk(info, idx, self.chunk_future(info, idx), background=background)

    def wait_chunk(self, info: BlobInfo, idx: int, future: Future[bytes], *,
                   background: bool = False) -> bytes:
        # A fetch still queued (behind readahead, say) is run here, by the reader that
        # needs it: the timeout bounds a fetch, never a wait in the pool's queue.
        self._fetch_into(info, idx, future)
        try:
            return future.result(timeout=self.config.timeout)
        except FutureTimeout:
            message = (f"remote read of {info.ref.digest} chunk {idx} not served within "
                       f"{self.config.timeout:g} s (registry and peers unreachable?)")
        except RemoteUnavailable as exc:
            message = str(exc.strerror)
        if not background:
            self.stats.eio += 1
            log.error("remote read failed: the guest gets EIO",
                      extra={"blob": info.ref.digest, "chunk": idx, "error": message})
        raise RemoteUnavailable(message)

    def _fetch_into(self, info: BlobInfo, idx: int, future: Future[bytes]) -> None:
        """Fetch chunk `idx` into `future` unless a pool thread or a reader already took it."""
        with self._lock:
            if future.running() or future.done():
                return
            future.set_running_or_notify_cancel()
        try:
            future.set_result(self._fetch_chunk(info, idx))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            with self._lock:
                self._inflight.pop((info.hex, idx), None)

    def _fetch_chunk(self, info: BlobInfo, idx: int) -> bytes:
        cache = self.cache
        cs = cache.chunk_size
        start = idx * cs
        end = start + info.state.chunk_len(idx)
        layout = info.layout
        lo, hi = layout.fetch_range(start, end)
        deadline = time.monotonic() + self.config.timeout
        problems: list[str] = []
        delay = 0.2
        while not self._stop.is_set():
            digests = info.digests
            for name, fetch in self._sources_for(info.ref, info.hex, idx, digests):
                # with a chunk table, the chunk alone (what a peer's proof covers, and what the
                # table checks); without, the whole ZFile blocks around it, for their CRCs
                a, b = (lo, hi) if digests is None else (start, end)
                try:
                    data = fetch(a, b)
                except SourceError as exc:
                    problems.append(f"{name}: {exc}")
                    continue
                self.stats.add("fetched", _kind(name), len(data))
                wrong = None
                if digests is not None:
                    # The trusted table decides (a CRC can be forged; a SHA-256 cannot).
                    if not digests.matches(idx, data[start - a : end - a]):
                        wrong = "the chunk does not match the blob's chunk table (SHA-256)"
                elif layout.checkable:
                    wrong = layout.check(start, end, data, a)
                if wrong is not None:
                    self.stats.add("corrupt", _kind(name))
                    problems.append(f"{name}: {wrong}")
                    log.warning("remote chunk failed its check; trying another source",
                                extra={"blob": info.ref.digest, "chunk": idx, "source": name,
                                       "problem": wrong})
                    continue
                chunk = data[start - a : end - a]
                checked = layout.checkable or digests is not None
                cache.insert(info.state, idx, chunk, VERIFIED if checked else UNVERIFIED)
                return chunk
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)
        raise RemoteUnavailable(
            f"no source served {info.ref.digest} chunk {idx}: "
            + ("; ".join(problems[-4:]) or "no sources (no registry recorded, no peers)"))

    # -- whole blobs -----------------------------------------------------------------------

    def _on_complete(self, state: BlobState) -> None:
        self._verifier.submit(self._verify, state)

    def _verify(self, state: BlobState) -> None:
        if self.cache.verify_digest(state):
            log.info("remote blob complete and verified", extra={"blob": "sha256:" + state.hex})

    def _complete_in_background(self) -> None:
        """Fetch the missing chunks of blobs in use, one at a time at `background_bw` bytes/s,
        when the blob fits comfortably in the cache (half of its low watermark)."""
        bw = self.config.background_bw
        while not self._stop.wait(0.5):
            for info in list(self._infos.values()):
                state = info.state
                if info.users <= 0 or state.complete or state.size > self.cache.low_bytes // 2:
                    continue
                for idx in range(state.nchunks):
                    if self._stop.is_set() or info.users <= 0:
                        break
                    if state.present[idx]:
                        continue
                    t0 = time.monotonic()
                    try:
                        data = self.get_chunk(info, idx, background=True)
                    except OSError:
                        break  # sources down: try again later
                    self.stats.background_bytes += len(data)
                    pause = len(data) / bw - (time.monotonic() - t0)
                    if pause > 0 and self._stop.wait(pause):
                        return

    # -- serving peers ---------------------------------------------------------------------

    def blob_size(self, hex_: str) -> int:
        state = self.cache.find(hex_)
        if state is not None:
            return state.size
        info = self._infos.get(hex_)
        return info.ref.size if info is not None else 0

    def serve_range(self, hex_: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of a blob if every one of them is verified here, else None."""
        info = self._infos.get(hex_)
        if info is not None:
            meta = info.layout.meta_read(start, end - start)
            if meta is not None:
                return meta
        state = self.cache.find(hex_)
        keys = self.cache.pin_servable(state, start, end) if state is not None else None
        if state is None or keys is None:
            return None
        try:
            data = os.pread(state.fd, end - start, start)
        finally:
            self.cache.unpin(keys)
        return data if len(data) == end - start else None

    # -- introspection ---------------------------------------------------------------------

    def held(self) -> list[dict[str, Any]]:
        """The blobs this node can serve to peers (some verified chunks, or all of them)."""
        out = []
        for state in self.cache.blobs():
            if state.count:
                out.append({"digest": "sha256:" + state.hex, "size": state.size,
                            "chunks": state.count, "complete": state.complete,
                            # chunks a peer is given (unchecked ones only once complete)
                            "servable": state.complete or VERIFIED in state.present})
        return out

    def snapshot_stats(self) -> dict[str, Any]:
        self.cache.fold_native_hits()
        cs = self.cache.stats
        with self.stats.lock:
            return {
                "cache_bytes": self.cache.size, "capacity": self.cache.capacity,
                "chunk_size": self.cache.chunk_size, "hits": cs.hits, "misses": cs.misses,
                "evictions": cs.evictions, "evicted_bytes": cs.evicted_bytes,
                "digest_failures": cs.digest_failures, "fetched_bytes": dict(self.stats.fetched),
                "requests": dict(self.stats.requests), "corrupt": dict(self.stats.corrupt),
                "source_failures": dict(self.stats.failures), "eio": self.stats.eio,
                "coalesced": self.stats.coalesced, "background_bytes": self.stats.background_bytes,
                "peers": list(self.peers), "blobs": self.held(),
                "resolver": self.resolver.url if self.resolver else None,
            }

    def close(self) -> None:
        self._stop.set()
        if self._background is not None:
            self._background.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._verifier.shutdown(wait=True, cancel_futures=True)
        self._peer_http.close()
        self._resolver_http.close()
        for client in self._registries.values():
            with contextlib.suppress(Exception):
                client.close()
        self.cache.close()


def _kind(source_name: str) -> str:
    return source_name.split(" ", 1)[0]


_private: RemoteStore | None = None
_private_lock = threading.Lock()


def private_store() -> RemoteStore:
    """A store for a process that is not blockd (the CLI, tests): its own cache in a
    temporary directory, removed at exit; no peers, no background completion."""
    global _private
    with _private_lock:
        if _private is None:
            root = Path(tempfile.mkdtemp(prefix="aenv-remote-"))
            capacity = get_settings().private_chunk_cache
            _private = RemoteStore(RemoteConfig(root, capacity=capacity, background_bw=0))

            def cleanup(store: RemoteStore = _private, root: Path = root) -> None:
                with contextlib.suppress(Exception):
                    store.close()
                shutil.rmtree(root, ignore_errors=True)

            atexit.register(cleanup)
        return _private

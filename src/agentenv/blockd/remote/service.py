"""blockd's remote-layer service: settings, start and stop, metrics and RPC operations
(the daemon keeps only small hooks to this module; docs/remote-layers.md §5)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.blockd.errors import BlockdError
from agentenv.blockd.remote.cache import POLICIES
from agentenv.blockd.remote.identity import (
    PeerKeyError,
    TrustedPeers,
    load_identity,
)
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import (
    RemoteConfig,
    RemoteStore,
    Resolver,
    SourceError,
)
from agentenv.cluster_keys import KEY_RE
from agentenv.settings import get_settings
from agentenv.storage import blob

log = logging.getLogger("agentenv.blockd.remote")


#: memfs's chunk store writes its counters here (under blockd's state dir) every few seconds
MEMFS_STATS = "memfs-remote.json"


def memfs_remote_stats(state_dir: Path) -> dict[str, Any] | None:
    """The counters of memfs's chunk store (blockd/memfs.py), None without one."""
    try:
        doc = json.loads((state_dir / MEMFS_STATS).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def parse_size(text: str) -> int:
    """Bytes from "1048576", "512M", "10G" (binary units)."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    mult = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = int(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M, G or T)") from None
    if value < 0:
        raise ValueError(f"{text!r}: a size cannot be negative")
    return value * mult


def removed_peer_key(option_given: bool = False) -> str | None:
    """Why blockd will not start, when the removed shared peer key is still configured."""
    settings = get_settings()
    given = [name for name, value in (("--peer-key-file", option_given),
                                      ("AENV_PEER_KEY", settings.peer_key),
                                      ("AENV_PEER_KEY_FILE", settings.peer_key_file)) if value]
    if not given:
        return None
    return (f"{' and '.join(given)}: the shared peer key was removed. Each blockd has its own "
            "key pair (`aenv peer-key` prints its line) and serves the nodes of its peer trust "
            "file (--peer-trust-file / AENV_PEER_TRUST_FILE, lines `<node id> ed25519:<key> "
            "[http://host:port]`; node id --peer-node-id / AENV_PEER_NODE_ID); in a cluster "
            "the scheduler's per-node credentials need neither (docs/remote-layers.md §4)")


def config_from_env(state_dir: Path, **overrides: Any) -> RemoteConfig:
    """Settings from the environment (AENV_CHUNK_CACHE_* (_DIR, _SIZE, _EVICTION), AENV_REMOTE_*, AENV_PEERS,
    AENV_P2P_LISTEN, AENV_PEER_TRUST_FILE, AENV_PEER_NODE_ID), then the given overrides (not
    None). This node's peer key pair is made under `state_dir` on first start."""
    settings = get_settings()
    removed = removed_peer_key()
    if removed:
        raise ValueError(removed)
    trust_file = overrides.pop("trust_file", None) or settings.peer_trust_file
    # (none given: the id derived from this node's public key, identity.derived_node_id)
    node_id = overrides.pop("node_id", None) or settings.peer_node_id or None
    try:
        identity = load_identity(state_dir, node_id)
        trust = TrustedPeers(Path(trust_file)) if trust_file else None
    except PeerKeyError as exc:
        raise ValueError(str(exc)) from None
    config = RemoteConfig(
        cache_dir=settings.chunk_cache_dir or Path(state_dir) / "chunk-cache",
        capacity=parse_size(settings.chunk_cache_size),
        chunk_size=parse_size(settings.chunk_size),
        timeout=settings.remote_timeout,
        peers=[p.strip() for p in settings.peers.split(",") if p.strip()],
        identity=identity,
        trust=trust,
        p2p_listen=settings.p2p_listen or None,
        background_bw=parse_size(settings.remote_background_bw),
        eviction=settings.chunk_cache_eviction,
    )
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    if config.timeout <= 0:
        raise ValueError(f"remote timeout must be positive, got {config.timeout}")
    if config.eviction not in POLICIES:
        raise ValueError(f"unknown chunk cache eviction policy {config.eviction!r} "
                         f"(AENV_CHUNK_CACHE_EVICTION: one of {', '.join(POLICIES)})")
    config.request_timeout = min(config.request_timeout, config.timeout)
    for peer in config.peers:
        if trust is None or trust.node_at(peer) is None:
            raise ValueError(
                f"static peer {peer} is not in the peer trust file: a peer serves only nodes "
                "it trusts, and this node signs for the node listed with that address (add "
                f"`<its node id> <its key> {peer}` to --peer-trust-file / AENV_PEER_TRUST_FILE "
                "on both; `aenv peer-key` on it prints its id and key)")
    return config


@dataclass
class RemoteService:
    store: RemoteStore
    peer_server: PeerServer | None
    state_dir: Path | None = None  # blockd's: where memfs writes its chunk store's counters

    def stop(self) -> None:
        blob.set_remote_opener(None)
        if self.peer_server is not None:
            self.peer_server.stop()
        self.store.close()

    # RPC operations (blockd/daemon.py dispatches them)

    async def op_stats(self) -> dict[str, Any]:
        stats = self.store.snapshot_stats()
        stats["p2p"] = self.peer_server.address if self.peer_server else None
        if self.state_dir is not None:
            # Remote memory layers are read by memfs's own store (blockd/memfs.py).
            stats["memory"] = memfs_remote_stats(self.state_dir)
        return stats

    async def op_peers(self, peers: list[str] | None = None,
                       resolver: dict[str, Any] | None = None,
                       clear_resolver: bool = False,
                       serve_key: str | None = None) -> dict[str, Any]:
        """Replace the static peer list, and/or set where to ask which peers hold a blob
        (`resolver` {url, headers?, ca?}: the node, which asks its scheduler;
        store.Resolver), and/or the key the chunk server checks the credentials the
        scheduler issues with (`serve_key`: cluster_keys.peer_serve_key of the node's key).
        A static peer is asked with a credential signed for the node the trust file lists at
        its address (none listed: it will answer 401, said in the log)."""
        if serve_key is not None:
            if not isinstance(serve_key, str) or not KEY_RE.fullmatch(serve_key):
                raise BlockdError("serve_key must be 64 hex digits (cluster_keys.peer_serve_key)")
            if self.peer_server is not None:
                self.peer_server.set_serve_key(serve_key)
        if peers is not None:
            if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
                raise BlockdError("peers must be a list of http://host:port strings")
            self.store.set_peers(peers)
            trust = self.store.config.trust
            unknown = [p for p in peers if trust is None or trust.node_at(p) is None]
            if unknown:
                log.warning("static peers not in the peer trust file are asked without a "
                            "credential (they answer 401)", extra={"peers": unknown})
        if resolver is not None:
            url = resolver.get("url") if isinstance(resolver, dict) else None
            headers = resolver.get("headers") or {} if isinstance(resolver, dict) else None
            ca = resolver.get("ca") if isinstance(resolver, dict) else None
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise BlockdError("resolver.url must be an http(s):// URL")
            if not isinstance(headers, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
                raise BlockdError("resolver.headers must map header names to strings")
            if ca is not None and not isinstance(ca, str):
                raise BlockdError("resolver.ca must be the path of a PEM file")
            current = self.store.resolver
            if current is None or (current.url, current.headers, current.ca) != (url, headers, ca):
                try:
                    self.store.set_resolver(Resolver(url, dict(headers), ca))
                except SourceError as exc:
                    raise BlockdError(str(exc)) from exc
                log.info("peers of a blob are asked from a resolver", extra={"url": url})
        elif clear_resolver:
            self.store.set_resolver(None)
        current = self.store.resolver
        return {"peers": list(self.store.peers), "resolver": current.url if current else None}

    async def op_held(self) -> dict[str, Any]:
        """What a node's heartbeat reports: the chunk server's address and the blobs it
        can serve, whole and in part."""
        # only blobs whose chunk table is known here: a peer serves no other (p2p.py)
        held = sorted((b for b in self.store.held()
                       if self.store.chunk_table(str(b["digest"])[7:]) is not None),
                      key=lambda b: str(b["digest"]))  # same set, same list
        return {
            "p2p": self.peer_server.address if self.peer_server else None,
            "blobs": [b["digest"] for b in held if b["complete"]],
            "partial": [b["digest"] for b in held if b["servable"] and not b["complete"]],
        }

    def handlers(self) -> dict[str, Any]:
        return {"remote_stats": self.op_stats, "remote_peers": self.op_peers,
                "remote_held": self.op_held}


def start(config: RemoteConfig, metrics_registry: Any = None,
          state_dir: Path | None = None) -> RemoteService:
    # One line per ranged GET would drown blockd's log; failures are logged by the store.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    store = RemoteStore(config)
    server = None
    try:
        if config.p2p_listen:
            server = PeerServer(
                store, config.p2p_listen, trust=config.trust,
                node_id=config.identity.node_id if config.identity else None)
            server.start()
            store.own_addresses.add(f"http://{server.address}")
    except BaseException:
        store.close()
        raise
    blob.set_remote_opener(store.open_blob)
    if metrics_registry is not None:
        metrics_registry.register(_Collector(store))
    log.info("remote layers ready", extra={
        "cache": str(config.cache_dir), "capacity": config.capacity,
        "chunk_size": config.chunk_size, "peers": config.peers, "timeout_s": config.timeout,
        "p2p": server.address if server else None,
        "node_id": config.identity.node_id if config.identity else None,
        "trusted_peers": sorted(config.trust.current()) if config.trust else None})
    return RemoteService(store, server, state_dir)


class _Collector:
    """Prometheus metrics of the chunk cache and the remote fetches."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.store.snapshot_stats()
        yield GaugeMetricFamily("aenv_chunk_cache_bytes", "bytes of chunks stored",
                                value=s["cache_bytes"])
        yield GaugeMetricFamily("aenv_chunk_cache_capacity_bytes", "chunk cache capacity",
                                value=s["capacity"])
        for name, help_, key in (("hits", "chunk reads served from the cache", "hits"),
                                 ("misses", "chunk reads that had to fetch", "misses"),
                                 ("evictions", "chunks evicted", "evictions"),
                                 ("eio", "remote reads failed with EIO", "eio"),
                                 ("coalesced", "fetches shared by concurrent readers",
                                  "coalesced")):
            yield CounterMetricFamily(f"aenv_chunk_cache_{name}", help_, value=s[key])
        for name, help_, key in (("fetched_bytes", "bytes fetched per source", "fetched_bytes"),
                                 ("corrupt", "answers that failed their check, per source",
                                  "corrupt"),
                                 ("source_failures", "failed requests per source",
                                  "source_failures")):
            family = CounterMetricFamily(f"aenv_remote_{name}", help_, labels=["source"])
            for source, value in sorted(s[key].items()):
                family.add_metric([source], value)
            yield family

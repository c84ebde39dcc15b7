"""blockd's remote-layer service: settings, start and stop, metrics and RPC operations
(the daemon keeps only small hooks to this module; docs/remote-layers.md §5)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.blockd.errors import BlockdError
from agentenv.blockd.remote.cache import POLICIES
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import DEFAULT_CHUNK, DEFAULT_TIMEOUT, RemoteConfig, RemoteStore
from agentenv.storage import blob

log = logging.getLogger("agentenv.blockd.remote")


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


def config_from_env(state_dir: Path, **overrides: Any) -> RemoteConfig:
    """Settings from the environment (AENV_CHUNK_CACHE_* (_DIR, _SIZE, _EVICTION), AENV_REMOTE_*, AENV_PEERS,
    AENV_P2P_LISTEN, AENV_CLUSTER_SECRET[_FILE]), then the given overrides (not None)."""
    env = os.environ
    secret = env.get("AENV_CLUSTER_SECRET") or None
    secret_file = env.get("AENV_CLUSTER_SECRET_FILE")
    if secret_file and not secret:
        secret = Path(secret_file).read_text().strip() or None
    config = RemoteConfig(
        cache_dir=Path(env.get("AENV_CHUNK_CACHE_DIR") or Path(state_dir) / "chunk-cache"),
        capacity=parse_size(env.get("AENV_CHUNK_CACHE_SIZE", "10G")),
        chunk_size=parse_size(env.get("AENV_CHUNK_SIZE", str(DEFAULT_CHUNK))),
        timeout=float(env.get("AENV_REMOTE_TIMEOUT", str(DEFAULT_TIMEOUT))),
        peers=[p.strip() for p in env.get("AENV_PEERS", "").split(",") if p.strip()],
        secret=secret,
        p2p_listen=env.get("AENV_P2P_LISTEN") or None,
        background_bw=parse_size(env.get("AENV_REMOTE_BACKGROUND_BW", "32M")),
        eviction=env.get("AENV_CHUNK_CACHE_EVICTION", "2q"),
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
    return config


@dataclass
class RemoteService:
    store: RemoteStore
    peer_server: PeerServer | None

    def stop(self) -> None:
        blob.set_remote_opener(None)
        if self.peer_server is not None:
            self.peer_server.stop()
        self.store.close()

    # RPC operations (blockd/daemon.py dispatches them)

    async def op_stats(self) -> dict[str, Any]:
        stats = self.store.snapshot_stats()
        stats["p2p"] = self.peer_server.address if self.peer_server else None
        return stats

    async def op_peers(self, peers: list[str] | None = None) -> dict[str, Any]:
        """Replace the peer list (a control plane passes the nodes that hold the blobs)."""
        if peers is not None:
            if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
                raise BlockdError("peers must be a list of http://host:port strings")
            self.store.set_peers(peers)
        return {"peers": list(self.store.peers)}

    def handlers(self) -> dict[str, Any]:
        return {"remote_stats": self.op_stats, "remote_peers": self.op_peers}


def start(config: RemoteConfig, metrics_registry: Any = None) -> RemoteService:
    # One line per ranged GET would drown blockd's log; failures are logged by the store.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    store = RemoteStore(config)
    server = None
    try:
        if config.p2p_listen:
            server = PeerServer(store, config.p2p_listen, config.secret or "")
            server.start()
    except BaseException:
        store.close()
        raise
    blob.set_remote_opener(store.open_blob)
    if metrics_registry is not None:
        metrics_registry.register(_Collector(store))
    log.info("remote layers ready", extra={
        "cache": str(config.cache_dir), "capacity": config.capacity,
        "chunk_size": config.chunk_size, "peers": config.peers, "timeout_s": config.timeout,
        "p2p": server.address if server else None})
    return RemoteService(store, server)


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

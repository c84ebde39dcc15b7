"""`aenv blockd`: the daemon's command line, also `python -m agentenv.blockd` (blockd/__main__.py,
how blockd/launch.py starts it); cli/blockd.py adds it to `aenv` beside the disk commands."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import click

from agentenv import logs
from agentenv.blockd.client import default_socket, default_state_dir
from agentenv.fsutil import DEFAULT_RESERVE
from agentenv.settings import get_settings, warn_unknown

#: a writable disk's upper may take this share of the state filesystem unless told otherwise
DEFAULT_UPPER_LIMIT = "25%"

socket_option = click.option(
    "--socket", "socket_path", type=click.Path(path_type=Path), default=default_socket,
    show_default="$AENV_BLOCKD_SOCKET, else $AENV_HOME/blockd/blockd.sock (as make up starts it;"
                 " AENV_HOME defaults to /var/lib/aenv)",
    help="blockd control socket.",
)


@click.command("blockd")
@click.option("--state-dir", type=click.Path(path_type=Path), default=default_state_dir,
              show_default="$AENV_HOME/blockd/state",
              help="Where device records, NBD sockets, uppers and the FUSE mount live.")
@socket_option
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--metrics-bind", default=lambda: get_settings().blockd_metrics_bind,
              show_default="$AENV_BLOCKD_METRICS_BIND or 127.0.0.1",
              help="Address of the metrics port (env AENV_BLOCKD_METRICS_BIND); another than "
                   "loopback shows every node's devices and traffic to its network.")
@click.option("--no-fuse", is_flag=True, help="Do not expose devices as FUSE files.")
@click.option("--inline-max", type=int, default=None,
              help="Largest read/write done on the event loop; larger ones go to I/O threads.")
@click.option("--upper-limit", default=lambda: get_settings().disk_upper_limit,
              show_default=f"$AENV_DISK_UPPER_LIMIT or {DEFAULT_UPPER_LIMIT}",
              help="Default cap on a disk's upper growth: bytes, with a K/M/G/T suffix, or N% of "
                   "the size of the state directory's filesystem; 0: none. Writes past it get "
                   "ENOSPC. Env: AENV_DISK_UPPER_LIMIT.")
@click.option("--disk-reserve", default=lambda: get_settings().disk_reserve or None,
              show_default="256M",
              help="Bytes the uppers' filesystem keeps free (bytes, or K/M/G/T): a write that "
                   "would take it lower gets ENOSPC, whichever disk it is for (the node's disk "
                   "budget). Env: AENV_DISK_RESERVE, as the node's own free-space checks.")
@click.option("--chunk-cache-dir", type=click.Path(path_type=Path), default=None,
              help="Chunk cache of remote layers (default STATE/chunk-cache; env "
                   "AENV_CHUNK_CACHE_DIR).")
@click.option("--chunk-cache-size", default=None,
              help="Chunk cache capacity (bytes or K/M/G/T; default 10G; env AENV_CHUNK_CACHE_SIZE).")
@click.option("--chunk-cache-eviction", type=click.Choice(["2q", "lru"]), default=None,
              help="Which chunks the chunk cache evicts first: 2q (default: scan resistant, a "
                   "chunk read once goes before chunks read again) or lru; env "
                   "AENV_CHUNK_CACHE_EVICTION.")
@click.option("--remote-timeout", type=float, default=None,
              help="Seconds before a remote read nobody can serve fails with EIO (default 30; "
                   "env AENV_REMOTE_TIMEOUT).")
@click.option("--peer", "peers", multiple=True,
              help="http://host:port of another node's chunk server, repeatable (env AENV_PEERS, "
                   "comma-separated).")
@click.option("--p2p-listen", default=None,
              help="host:port to serve verified chunks to peers on (env AENV_P2P_LISTEN).")
@click.option("--peer-trust-file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              default=None,
              help="Static peers (no scheduler): the nodes this chunk server serves, one a line, "
                   "`<node id> ed25519:<key> [http://host:port]` (`aenv peer-key` on each prints "
                   "its id and key); each --peer must be listed with its address (this node signs "
                   "for that id). Read again when it changes; only a file of blockd's user (or "
                   "root) nobody else may write, in directories nobody else may write, not a symlink. "
                   "Env AENV_PEER_TRUST_FILE.")
@click.option("--peer-node-id", default=None,
              help="This node's id in its peers' trust files (env AENV_PEER_NODE_ID; default "
                   "node-<20 hex digits of its public key's SHA-256>, as `aenv peer-key` "
                   "prints). Its key pair is STATE/peer-identity.key, made on first start.")
@click.option("--peer-key-file", default=None, hidden=True,
              help="Removed: the shared peer key (see --peer-trust-file).")
@click.option("--remote-background-bw", default=None,
              help="Bytes/s for completing remote blobs in use in the background; 0: off "
                   "(default 32M; env AENV_REMOTE_BACKGROUND_BW).")
@click.option("--log-level", default="info", show_default=True)
def blockd_command(state_dir: Path, socket_path: Path, metrics_port: int | None,
                   metrics_bind: str, no_fuse: bool, inline_max: int | None,
                   upper_limit: str, disk_reserve: str | None, chunk_cache_dir: Path | None, chunk_cache_size: str | None,
                   chunk_cache_eviction: str | None, remote_timeout: float | None, peers: tuple[str, ...], p2p_listen: str | None,
                   peer_trust_file: Path | None, peer_node_id: str | None,
                   peer_key_file: str | None, remote_background_bw: str | None,
                   log_level: str) -> None:
    """Run the block daemon in the foreground: every disk over NBD (and FUSE)."""
    from agentenv.blockd.daemon import Blockd
    from agentenv.blockd.device import INLINE_MAX
    from agentenv.blockd.remote.service import config_from_env, parse_size, removed_peer_key

    logs.setup(log_level)
    warn_unknown("blockd")  # a mistyped AENV_ name would be ignored silently
    try:
        limit = upper_limit_bytes(upper_limit, state_dir)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--upper-limit / AENV_DISK_UPPER_LIMIT") from None
    try:
        reserve = parse_size(disk_reserve) if disk_reserve else DEFAULT_RESERVE
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--disk-reserve / AENV_DISK_RESERVE") from None
    removed = removed_peer_key(option_given=peer_key_file is not None)
    if removed:
        raise click.UsageError(removed)
    try:
        remote = config_from_env(
            state_dir, cache_dir=chunk_cache_dir,
            capacity=parse_size(chunk_cache_size) if chunk_cache_size else None,
            eviction=chunk_cache_eviction, timeout=remote_timeout, peers=list(peers) or None, p2p_listen=p2p_listen,
            trust_file=peer_trust_file, node_id=peer_node_id,
            background_bw=parse_size(remote_background_bw) if remote_background_bw else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="remote layer settings") from None
    daemon = Blockd(state_dir, socket_path, fuse=not no_fuse, metrics_port=metrics_port,
                    metrics_bind=metrics_bind, inline_max=INLINE_MAX if inline_max is None else inline_max,
                    upper_limit=limit or None, disk_reserve=reserve, remote=remote)
    asyncio.run(daemon.run())


def upper_limit_bytes(text: str, state_dir: Path) -> int:
    """--upper-limit in bytes: a size, or "N%" of the filesystem holding `state_dir` (the
    uppers live beside it): one guest filling its disk cannot fill the host's."""
    from agentenv.blockd.remote.service import parse_size

    raw = text.strip()
    if not raw.endswith("%"):
        return parse_size(raw)
    try:
        percent = float(raw[:-1])
    except ValueError:
        raise ValueError(f"{text!r} is not a size or a percentage") from None
    if not 0 <= percent <= 100:
        raise ValueError(f"{text!r}: a percentage is between 0 and 100")
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return int(shutil.disk_usage(existing).total * percent / 100)

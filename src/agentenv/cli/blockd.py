"""`aenv` commands of the blockd subsystem: the daemon, disks on it, and a one-off NBD server."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import click

from agentenv.blockd.client import BlockdClient, default_socket, default_state_dir

#: a writable disk's upper may take this share of the state filesystem unless told otherwise
DEFAULT_UPPER_LIMIT = "25%"

_socket_option = click.option(
    "--socket", "socket_path", type=click.Path(path_type=Path), default=default_socket,
    show_default="$AENV_BLOCKD_SOCKET, else $AENV_HOME/blockd/blockd.sock (as make up starts it;"
                 " AENV_HOME defaults to /var/lib/aenv)",
    help="blockd control socket.",
)


@click.command("blockd")
@click.option("--state-dir", type=click.Path(path_type=Path), default=default_state_dir,
              show_default="$AENV_HOME/blockd/state",
              help="Where device records, NBD sockets, uppers and the FUSE mount live.")
@_socket_option
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--metrics-bind", default="127.0.0.1", show_default=True, envvar="AENV_BLOCKD_METRICS_BIND",
              help="Address of the metrics port (env AENV_BLOCKD_METRICS_BIND); another than "
                   "loopback shows every node's devices and traffic to its network.")
@click.option("--no-fuse", is_flag=True, help="Do not expose devices as FUSE files.")
@click.option("--inline-max", type=int, default=None,
              help="Largest read/write done on the event loop; larger ones go to I/O threads.")
@click.option("--upper-limit", envvar="AENV_DISK_UPPER_LIMIT", default=DEFAULT_UPPER_LIMIT,
              show_default=True,
              help="Default cap on a disk's upper growth: bytes, with a K/M/G/T suffix, or N% of "
                   "the size of the state directory's filesystem; 0: none. Writes past it get "
                   "ENOSPC. Env: AENV_DISK_UPPER_LIMIT.")
@click.option("--disk-reserve", envvar="AENV_DISK_RESERVE", default=None,
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
@click.option("--peer-key-file", type=click.Path(path_type=Path, exists=True), default=None,
              help="The key layer peers present to each other (`aenv peer-key`; env "
                   "AENV_PEER_KEY[_FILE]).")
@click.option("--remote-background-bw", default=None,
              help="Bytes/s for completing remote blobs in use in the background; 0: off "
                   "(default 32M; env AENV_REMOTE_BACKGROUND_BW).")
@click.option("--log-level", default="info", show_default=True)
def blockd_command(state_dir: Path, socket_path: Path, metrics_port: int | None,
                   metrics_bind: str, no_fuse: bool, inline_max: int | None,
                   upper_limit: str, disk_reserve: str | None, chunk_cache_dir: Path | None, chunk_cache_size: str | None,
                   chunk_cache_eviction: str | None, remote_timeout: float | None, peers: tuple[str, ...], p2p_listen: str | None,
                   peer_key_file: Path | None, remote_background_bw: str | None,
                   log_level: str) -> None:
    """Run the block daemon in the foreground: every disk over NBD (and FUSE)."""
    from agentenv import logs
    from agentenv.blockd.daemon import Blockd
    from agentenv.blockd.device import INLINE_MAX
    from agentenv.blockd.remote.service import config_from_env, parse_size
    from agentenv.cluster_keys import load_key
    from agentenv.fsutil import DEFAULT_RESERVE

    logs.setup(log_level)
    try:
        limit = upper_limit_bytes(upper_limit, state_dir)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--upper-limit / AENV_DISK_UPPER_LIMIT") from None
    try:
        reserve = parse_size(disk_reserve) if disk_reserve else DEFAULT_RESERVE
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--disk-reserve / AENV_DISK_RESERVE") from None
    try:
        remote = config_from_env(
            state_dir, cache_dir=chunk_cache_dir,
            capacity=parse_size(chunk_cache_size) if chunk_cache_size else None,
            eviction=chunk_cache_eviction, timeout=remote_timeout, peers=list(peers) or None, p2p_listen=p2p_listen,
            secret=load_key(peer_key_file, "AENV_PEER_KEY", "peer key") if peer_key_file else None,
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


@click.group("disk")
def disk_group() -> None:
    """Disks served by blockd."""


@disk_group.command("create")
@click.option("--image", type=click.Path(path_type=Path), default=None,
              help="Image config JSON or layer to stack the new disk on.")
@click.option("--size", type=int, default=None, help="Disk size in bytes (required without --image).")
@click.option("--upper", type=click.Path(path_type=Path), default=None,
              help="Directory for the writable upper (default: one the daemon owns).")
@click.option("--readonly", is_flag=True, help="Export the image read-only (shared, refcounted).")
@_socket_option
def disk_create(image: Path | None, size: int | None, upper: Path | None, readonly: bool,
                socket_path: Path) -> None:
    """Create a disk and print it as JSON (id, nbd socket, export name, FUSE file, size)."""
    if image is None and size is None:
        raise click.UsageError("give --image, or --size for a blank disk")
    with BlockdClient(socket_path) as client:
        info = client.create(image=image.resolve() if image else None,
                             upper_dir=upper.resolve() if upper else None, size=size,
                             readonly=readonly)
    click.echo(json.dumps(info.to_json()))


@disk_group.command("snapshot")
@click.argument("device_id")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Path for the sealed layer (default: beside the upper).")
@_socket_option
def disk_snapshot(device_id: str, output: Path | None, socket_path: Path) -> None:
    """Seal the disk's upper into a read-only layer in place; print the layer's path."""
    with BlockdClient(socket_path) as client:
        click.echo(str(client.snapshot(device_id, output.resolve() if output else None)))


@disk_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
@_socket_option
def disk_ls(as_json: bool, socket_path: Path) -> None:
    """List disks with their counters."""
    with BlockdClient(socket_path) as client:
        devices = client.list()
    if as_json:
        for info in devices:
            click.echo(json.dumps(info.to_json()))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "kind", "size", "ro", "conns", "reads", "writes", "errors", "nbd")
    for info in devices:
        s = info.stats
        table.add_row(info.id, info.kind, str(info.size), "yes" if info.readonly else "",
                      str(s.get("connections", 0)), str(s.get("reads", 0)),
                      str(s.get("writes", 0)), str(s.get("errors", 0)), info.uri)
    Console().print(table)


@disk_group.command("rm")
@click.argument("device_id")
@_socket_option
def disk_rm(device_id: str, socket_path: Path) -> None:
    """Release a disk (read-only shared disks: drop one reference)."""
    with BlockdClient(socket_path) as client:
        remaining = client.release(device_id)
    click.echo(json.dumps({"released": device_id, "refcount": remaining}))


@click.group("nbd")
def nbd_group() -> None:
    """NBD without the daemon."""


@nbd_group.command("serve")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), required=True,
              help="Unix socket to listen on.")
@click.option("--export", "export_name", default="disk", show_default=True,
              help="Export name (the empty name selects it too).")
@click.option("--readonly", is_flag=True, help="Refuse writes (an image config with an upper).")
@click.option("--upper", "upper_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Make a layer (or a read-only image) writable: writes go to a new upper in "
                   "this empty directory (an existing upper there is reopened); the source is "
                   "never written.")
@click.option("--log-level", default="info", show_default=True)
def nbd_serve(source: Path, socket_path: Path, export_name: str, readonly: bool,
              upper_dir: Path | None, log_level: str) -> None:
    """Serve one image over NBD until interrupted.

    SOURCE is an image config JSON (writable when it has an upper, unless --readonly) or a
    layer file. A layer, or an image without an upper, is exported READ-ONLY: writes fail.
    Give --upper DIR to make it writable (writes stay in DIR). The start log says which."""
    from agentenv import logs
    from agentenv.blockd.serve import serve_image

    if upper_dir is not None and readonly:
        raise click.UsageError("--upper makes the export writable; it cannot go with --readonly")
    logs.setup(log_level)
    asyncio.run(serve_image(source, socket_path, readonly=readonly, export_name=export_name,
                            upper_dir=upper_dir))


COMMANDS: list[click.Command] = [blockd_command, disk_group, nbd_group]

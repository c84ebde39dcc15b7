"""`aenv` commands of the blockd subsystem: the daemon, disks on it, and a one-off NBD server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from agentenv import logs
from agentenv.blockd.client import BlockdClient, default_state_dir
from agentenv.blockd.command import blockd_command, socket_option
from agentenv.settings import get_settings


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
@socket_option
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
@socket_option
def disk_snapshot(device_id: str, output: Path | None, socket_path: Path) -> None:
    """Seal the disk's upper into a read-only layer in place; print the layer's path."""
    with BlockdClient(socket_path) as client:
        click.echo(str(client.snapshot(device_id, output.resolve() if output else None)))


@disk_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
@socket_option
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
@socket_option
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
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.blockd.serve import serve_image

    if upper_dir is not None and readonly:
        raise click.UsageError("--upper makes the export writable; it cannot go with --readonly")
    logs.setup(log_level)
    asyncio.run(serve_image(source, socket_path, readonly=readonly, export_name=export_name,
                            upper_dir=upper_dir))


@click.command("peer-key")
@click.option("--state-dir", type=click.Path(path_type=Path), default=default_state_dir,
              show_default="$AENV_HOME/blockd/state", help="blockd's state directory.")
@click.option("--peer-node-id", default=None,
              help="This node's id (as blockd's --peer-node-id; env AENV_PEER_NODE_ID, else "
                   "node-<20 hex digits of its public key's SHA-256>, as blockd's).")
@click.option("--address", default=None,
              help="http://host:port of this node's chunk server (its --p2p-listen), added to "
                   "the line: the other nodes then ask it too.")
def peer_key_command(state_dir: Path, peer_node_id: str | None, address: str | None) -> None:
    """Print this node's line for its static peers' trust files (--peer-trust-file):
    `<node id> ed25519:<public key> [address]`. The key pair is blockd's
    (STATE/peer-identity.key, 0600), made now if blockd has not started yet; the private key
    never leaves it."""
    # lazy: `aenv --help` does not load cryptography (cli/main.py imports this module)
    from agentenv.blockd.remote.identity import (
        PeerKeyError,
        load_identity,
        normalise_address,
    )

    # none given: the id derived from the node's public key, as blockd's
    node_id = peer_node_id or get_settings().peer_node_id or None
    try:
        identity = load_identity(state_dir, node_id)
    except PeerKeyError as exc:
        raise click.ClickException(str(exc)) from None
    line = identity.trust_line()
    click.echo(f"{line} {normalise_address(address)}" if address else line)


COMMANDS: list[click.Command] = [blockd_command, disk_group, nbd_group, peer_key_command]

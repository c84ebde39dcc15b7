"""`aenv` commands of the guest subsystem: `aenv guest build`, `aenv guest info`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from agentenv.guest.build import build_assets, load_manifest

DEFAULT_STATE_DIR = Path("/var/lib/aenv")


@click.group("guest")
def guest() -> None:
    """The guest kernel, initramfs and tools disk every sandbox VM boots."""


@guest.command("build")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              show_default=True, help="state directory; assets go to STATE_DIR/guest/")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="where downloaded .debs are kept (default STATE_DIR/guest/cache)")
@click.option("--kernel-suite", default=None, metavar="SUITE",
              help="take the kernel from this Debian release (default bookworm-backports, 6.12 with vmgenid; "
                   "bookworm gives 6.1)")
@click.option("--quiet", "-q", is_flag=True, help="no progress display")
def build(state_dir: Path, cache_dir: Path | None, kernel_suite: str | None, quiet: bool) -> None:
    """Build (or bring up to date) the guest assets; only what changed is rebuilt."""
    assets = build_assets(state_dir, progress=not quiet, cache_dir=cache_dir, kernel_suite=kernel_suite)
    manifest = json.loads(assets.manifest.read_text())
    click.echo(f"kernel     {assets.kernel}  ({manifest['kernel']['release']})")
    click.echo(f"initramfs  {assets.initramfs}  ({len(manifest['initramfs']['modules'])} modules)")
    click.echo(f"tools disk {assets.tools_image}  ({manifest['tools']['size'] >> 20} MiB, "
               f"python {manifest['tools']['python']}, busybox {manifest['tools']['busybox']})")
    click.echo(f"manifest   {assets.manifest}")
    click.echo(f"rebuilt: {', '.join(assets.built) or 'nothing, up to date'}")


@guest.command("info")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR,
              show_default=True)
def info(state_dir: Path) -> None:
    """Print the manifest of the built guest assets."""
    click.echo(json.dumps(load_manifest(state_dir), indent=2, sort_keys=True))


COMMANDS: list[click.Command] = [guest]

"""`aenv layer ...` and `aenv image ...`: inspect, export, import and commit overlaybd layers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from agentenv.storage.builder import commit_sealed, commit_upper
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.export import export_raw, import_raw
from agentenv.storage.image import Image
from agentenv.storage.layer import inspect_layer
from agentenv.storage.upper import Upper, is_upper_path

_COMPRESS = click.Choice(["zstd", "lz4"])


@contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (hidden when stderr is not a terminal)."""
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                  disable=not os.isatty(2)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


@click.group("layer")
def layer_group() -> None:
    """Inspect and commit overlaybd layers."""


@layer_group.command("inspect")
@click.argument("file", type=click.Path(path_type=Path))
def layer_inspect(file: Path) -> None:
    """Print JSON facts about a layer (sealed, ZFile, tar-wrapped, or an upper dir/upper.data)."""
    click.echo(json.dumps(inspect_layer(file), indent=2))


@layer_group.command("commit")
@click.argument("upper_dir", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--compress", type=_COMPRESS, default=None, help="ZFile compression")
@click.option("--tar", "tar_", is_flag=True, help="wrap in the overlaybd tar wrapper")
@click.option("--uuid", default=None, help="uuid of the new layer")
@click.option("--parent-uuid", default=None, help="parent uuid (default: the upper's parent)")
@click.option("-m", "--message", default="", help="commit message (user_tag, <= 256 bytes)")
def layer_commit(upper_dir: Path, out: Path, compress: str | None, tar_: bool, uuid: str | None,
                 parent_uuid: str | None, message: str) -> None:
    """Commit (compact) a writable upper, or re-compact a sealed layer, into OUT."""
    tag = message.encode()
    if not upper_dir.exists():
        raise LayerFormatError(upper_dir, None, "no such upper directory or layer file")
    if is_upper_path(upper_dir):
        directory = upper_dir if upper_dir.is_dir() else upper_dir.parent
        up = Upper.open(directory, writable=False)
        total = up.data_size
        up.close()
        with _progress("commit", total) as advance:
            commit_upper(directory, out, compress=compress, tar=tar_,  # type: ignore[arg-type]
                         uuid=uuid, parent_uuid=parent_uuid, user_tag=tag, progress=advance)
    else:
        with _progress("commit", os.path.getsize(upper_dir)) as advance:
            commit_sealed(upper_dir, out, compress=compress, tar=tar_,  # type: ignore[arg-type]
                          uuid=uuid, parent_uuid=parent_uuid, user_tag=tag, progress=advance)
    click.echo(str(out))


@click.group("image")
def image_group() -> None:
    """Export and import whole virtual disks."""


@image_group.command("export")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
def image_export(source: Path, out: Path) -> None:
    """Write the virtual disk of SOURCE (image config JSON or a layer) as a sparse raw file."""
    with Image.open(source, writable=False) as image:
        total = sum(n for _, n, data in image.extents() if data)
        with _progress("export", total) as advance:
            export_raw(image, out, progress=advance)
    click.echo(str(out))


@image_group.command("import")
@click.argument("raw", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--compress", type=_COMPRESS, default=None, help="ZFile compression")
@click.option("--tar", "tar_", is_flag=True, help="wrap in the overlaybd tar wrapper")
@click.option("--uuid", default=None, help="uuid of the new layer")
def image_import(raw: Path, out: Path, compress: str | None, tar_: bool, uuid: str | None) -> None:
    """Make a committed layer from a raw disk, skipping holes and all-zero blocks."""
    with _progress("import", os.path.getsize(raw)) as advance:
        import_raw(raw, out, compress=compress, tar=tar_, uuid=uuid,  # type: ignore[arg-type]
                   progress=advance)
    click.echo(str(out))


COMMANDS: list[click.Command] = [layer_group, image_group]

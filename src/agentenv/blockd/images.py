"""How blockd opens and creates images: on the native core (agentenv.storage.native.NativeImage)
unless it is switched off (AENV_BLOCKD_NATIVE=0) or not built; else agentenv.storage.image.Image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv.blockd.device import ImageLike
from agentenv.blockd.errors import BlockdError
from agentenv.storage import native
from agentenv.storage.image import Image


def _image_class() -> Any:
    return native.NativeImage if native.enabled() else Image


def open_image(source: Path, *, writable: bool) -> ImageLike:
    image: ImageLike = _image_class().open(Path(source), writable=writable)
    return image


def create_image(lowers: Sequence[Path], upper_dir: Path, virtual_size: int | None) -> ImageLike:
    image: ImageLike = _image_class().create(
        [Path(p) for p in lowers], Path(upper_dir), virtual_size
    )
    return image


def lowers_of(source: Path) -> list[Path]:
    """The read-only layers of an image (config JSON or a single layer), bottom first."""
    image = _image_class().open(Path(source), writable=False)
    try:
        if image.upper_dir is not None:
            # Stacking a new upper on this image would silently drop what its upper holds.
            raise BlockdError(
                f"{source} has a writable upper ({image.upper_dir}); snapshot it into a layer "
                "first, or export it read-only"
            )
        return [Path(p) for p in image.lowers]
    finally:
        image.close()


def config_path(upper_dir: Path) -> Path:
    """Where Image.create leaves the image config of an upper."""
    return Path(upper_dir) / "image.json"

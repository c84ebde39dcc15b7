"""Serve one image over NBD without the daemon (`aenv nbd serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.blockd import images, nbd
from agentenv.blockd.device import Device, DeviceRecord, ImageLike, tune_allocator

log = logging.getLogger("agentenv.blockd.serve")


async def serve_image(
    source: Path,
    socket_path: Path,
    *,
    readonly: bool = False,
    export_name: str = "disk",
    ready: asyncio.Event | None = None,
    upper_dir: Path | None = None,
) -> None:
    """Serve `source` until SIGTERM/SIGINT. An image config with an upper is writable (unless
    `readonly`); a layer or an image without an upper is read-only, unless `upper_dir` is given:
    then writes go to an upper there (made on first use, reopened after)."""
    tune_allocator()
    executor = ThreadPoolExecutor(8, thread_name_prefix="nbd-io")

    def open_it() -> ImageLike:
        if upper_dir is None:
            return images.open_image(source, writable=not readonly)
        if images.config_path(upper_dir).exists():
            return images.open_image(images.config_path(upper_dir), writable=True)
        return images.create_image(images.lowers_of(source), upper_dir, None)

    image = await asyncio.get_running_loop().run_in_executor(executor, open_it)
    record = DeviceRecord(
        id=export_name, kind="disk", socket=str(socket_path), source=str(source),
        upper_dir=None, owns_upper=False, readonly=readonly or image.readonly,
        size=image.virtual_size,
    )
    device = Device(record, image, executor)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server = await nbd.start_unix_server(str(socket_path), nbd.SingleExportTable(export_name, device))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Say plainly whether writes work: a layer alone is served read-only.
    mode = "read-only" if device.readonly else "writable"
    why = ("" if not device.readonly else
           " (--readonly)" if readonly else
           " (a layer or an image without an upper: give --upper DIR to make it writable)")
    log.info(f"serving {mode}{why}",
             extra={"source": str(source), "socket": str(socket_path), "export": export_name,
                    "size": device.size, "readonly": device.readonly,
                    "upper_dir": str(upper_dir) if upper_dir else None})
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        server.close()
        await device.close_image()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        executor.shutdown()

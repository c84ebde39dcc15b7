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
from agentenv.blockd.device import Device, DeviceRecord, tune_allocator

log = logging.getLogger("agentenv.blockd.serve")


async def serve_image(
    source: Path,
    socket_path: Path,
    *,
    readonly: bool = False,
    export_name: str = "disk",
    ready: asyncio.Event | None = None,
) -> None:
    """Serve `source` (an image config, or a layer: always read-only) until SIGTERM/SIGINT."""
    tune_allocator()
    executor = ThreadPoolExecutor(8, thread_name_prefix="nbd-io")
    image = await asyncio.get_running_loop().run_in_executor(
        executor, lambda: images.open_image(source, writable=not readonly)
    )
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
    log.info("serving", extra={"source": str(source), "socket": str(socket_path),
                               "export": export_name, "size": device.size,
                               "readonly": device.readonly})
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

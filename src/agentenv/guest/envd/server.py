"""Running envd: bind, serve envd's ASGI app over HTTP/1.1, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket

from agentenv.guest.envd import ENVD_VERSION
from agentenv.guest.envd.app import Envd, EnvdConfig
from agentenv.guest.envd.httpserver import HttpServer

log = logging.getLogger("envd")

SHELL_FALLBACK_ENV = "AENV_ENVD_SHELL_FALLBACK"
PATH_ENV = "AENV_ENVD_PATH"
BUSYBOX_ENV = "AENV_ENVD_BUSYBOX"


def config_from_environment(root: str, system_changes: bool) -> EnvdConfig:
    config = EnvdConfig(root=root, system_changes=system_changes)
    config.shell_fallback = os.environ.get(SHELL_FALLBACK_ENV) or None
    if os.environ.get(PATH_ENV):
        config.path_env = os.environ[PATH_ENV]
    # Set to the tools disk's busybox in the VM; unset means "busybox on PATH", empty means none.
    busybox = os.environ.get(BUSYBOX_ENV)
    config.busybox = shutil.which("busybox") if busybox is None else (busybox or None)
    return config


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


async def serve(config: EnvdConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM; running processes are killed on the way out."""
    if not os.path.isdir(config.root):
        raise FileNotFoundError(f"root directory {config.root!r} does not exist")
    listener = bind(host, port)
    app = Envd(config)
    server = HttpServer(app)
    await server.start(listener)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "envd listening",
        extra={"host": host, "port": port, "root": app.rootfs.root, "version": ENVD_VERSION},
    )
    try:
        await stop.wait()
        log.info("envd stopping")
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        # Kill the processes first: their streams then end and the connections can close.
        await app.shutdown()
        await server.close()

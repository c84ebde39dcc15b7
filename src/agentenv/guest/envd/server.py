"""Running envd: uvicorn (pure-Python h11 protocol, plain asyncio loop) around the ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentenv.guest.envd import ENVD_VERSION
from agentenv.guest.envd.app import Envd, EnvdConfig

log = logging.getLogger("envd")

SHELL_FALLBACK_ENV = "AENV_ENVD_SHELL_FALLBACK"
PATH_ENV = "AENV_ENVD_PATH"
BUSYBOX_ENV = "AENV_ENVD_BUSYBOX"


class LowLatencyH11Protocol(H11Protocol):
    """h11 without Nagle and with immediate ACKs. A response goes out as several writes (headers,
    then each body chunk or envelope); with Nagle on, every write after the first waits for the
    client's delayed ACK, about 40 ms per request. asyncio sets TCP_NODELAY only on sockets whose
    proto field says TCP, which a pre-bound listener's accepted sockets do not."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport.get_extra_info("socket")
        if self._socket is not None and self._socket.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self._socket = None
        self._quick_ack()
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        # Linux drops out of quick-ACK mode on its own; re-arm it after every read.
        self._quick_ack()
        super().data_received(data)

    def _quick_ack(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


class EnvdServer(uvicorn.Server):
    """uvicorn, with envd's own shutdown order and signal handling."""

    def __init__(self, config: uvicorn.Config, envd: Envd) -> None:
        super().__init__(config)
        self.envd = envd

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal once it has stopped, so the process would die of it;
        # envd exits normally (status 0) instead. A second signal forces the exit.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_exit_signal)
        try:
            yield
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    def _on_exit_signal(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Kill the processes first: their streams then end, and the connections can close.
        await self.envd.shutdown()
        await super().shutdown(sockets)


def config_from_environment(root: str, system_changes: bool) -> EnvdConfig:
    config = EnvdConfig(root=root, system_changes=system_changes)
    config.shell_fallback = os.environ.get(SHELL_FALLBACK_ENV) or None
    if os.environ.get(PATH_ENV):
        config.path_env = os.environ[PATH_ENV]
    # Set to the tools disk's busybox in the VM; unset means "busybox on PATH", empty means none.
    busybox = os.environ.get(BUSYBOX_ENV)
    config.busybox = shutil.which("busybox") if busybox is None else (busybox or None)
    return config


async def serve(config: EnvdConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn handles them); running processes are killed on the way out."""
    if not os.path.isdir(config.root):
        raise SystemExit(f"envd: root directory {config.root!r} does not exist")
    app = Envd(config)
    server = EnvdServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            loop="asyncio",
            http=LowLatencyH11Protocol,
            ws="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            date_header=False,
            timeout_keep_alive=75,
            # Shutdown kills the processes first, so their streams end well within this.
            timeout_graceful_shutdown=2,
        ),
        app,
    )
    # Bind here, so that a port in use is an OSError for the caller rather than uvicorn's exit.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(False)
    log.info(
        "envd listening",
        extra={"host": host, "port": port, "root": app.rootfs.root, "version": ENVD_VERSION},
    )
    try:
        await server.serve(sockets=[listener])
    finally:
        with contextlib.suppress(Exception):
            await app.shutdown()

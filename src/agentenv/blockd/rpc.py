"""blockd's control transport: JSON lines on a unix socket, dispatched to an operation table.

Each request is one line `{"op": NAME, ...arguments}`; each answer one line,
`{"ok": true, "result": ...}` or `{"ok": false, "error": MESSAGE, "type": KIND}` with KIND
"invalid" (bad request or arguments), "not_found" (no such device) or "failed" (the operation
ran and failed). A connection may carry any number of requests, answered in order.

The transport knows nothing about devices: it calls `handlers[op](**arguments)`, turns the
typed record it returns into JSON (results.to_wire) and maps exceptions to error kinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from agentenv.blockd.errors import BlockdError, NotFound
from agentenv.blockd.results import to_wire
from agentenv.errors import AgentEnvError

log = logging.getLogger("agentenv.blockd")

MAX_RPC_LINE = 1024 * 1024

Handler = Callable[..., Awaitable[Any]]


class RpcServer:
    """Serves `handlers` on a unix socket (mode 0600) until closed; `stopping()` true ends each
    connection after its current answer (the daemon's shutdown)."""

    def __init__(self, socket_path: Path, handlers: Mapping[str, Handler],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.socket_path = socket_path
        self.handlers = handlers
        self._stopping = stopping
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.socket_path), limit=MAX_RPC_LINE)
        os.chmod(self.socket_path, 0o600)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """Stop accepting and remove the socket."""
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:
                    writer.write(error_line("invalid", "request line too long"))
                    break
                if not line:
                    break
                writer.write(await self.dispatch(line))
                await writer.drain()
                if self._stopping():
                    break
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def dispatch(self, line: bytes) -> bytes:
        """One request line in, one answer line out (never raises)."""
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                raise BlockdError('a request is a JSON object with an "op" string')
        except (ValueError, BlockdError) as exc:
            return error_line("invalid", f"bad request: {exc}")
        op = request.pop("op")
        handler = self.handlers.get(op)
        if handler is None:
            return error_line("invalid", f"unknown op {op!r}; known: {', '.join(self.handlers)}")
        try:
            result = to_wire(await handler(**request))
        except TypeError as exc:
            return error_line("invalid", f"{op}: {exc}")
        except NotFound as exc:
            return error_line("not_found", str(exc))
        except BlockdError as exc:
            return error_line("invalid", str(exc))
        except (AgentEnvError, OSError) as exc:
            log.warning("operation failed", extra={"op": op, "error": str(exc)})
            return error_line("failed", f"{op}: {exc}")
        except Exception as exc:
            log.exception("operation crashed", extra={"op": op})
            return error_line("failed", f"{op}: internal error: {exc!r}")
        return (json.dumps({"ok": True, "result": result}) + "\n").encode()


def error_line(kind: str, message: str) -> bytes:
    return (json.dumps({"ok": False, "type": kind, "error": message}) + "\n").encode()

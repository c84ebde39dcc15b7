"""An asyncio client of the QEMU Machine Protocol (QMP) over a unix socket.

One reader task reads every line; replies are matched to commands by `id`, events go to
subscribers' queues. When the connection closes (QEMU exited), every pending command fails
with QMPError and `closed` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from pathlib import Path
from typing import Any

from agentenv.runtime.errors import QMPError


class QMPClient:
    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._event_queues: list[asyncio.Queue[dict[str, Any]]] = []
        self._reader_task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()
        self.greeting: dict[str, Any] = {}

    @classmethod
    async def connect(cls, path: Path, timeout: float = 10.0) -> QMPClient:
        """Connect (retrying while QEMU creates the socket) and negotiate capabilities."""
        client = cls()
        deadline = time.monotonic() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    raise QMPError(f"QMP socket {path} did not come up in {timeout:.0f} s") from exc
                await asyncio.sleep(0.005)
        client._reader, client._writer = reader, writer
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        except TimeoutError:
            writer.close()
            raise QMPError(f"QEMU sent no QMP greeting on {path} within {timeout:.1f} s") from None
        if not line:
            raise QMPError(f"QMP socket {path} closed before the greeting")
        client.greeting = json.loads(line)
        client._reader_task = asyncio.create_task(client._read_loop())
        await client.execute("qmp_capabilities")
        return client

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                message = json.loads(line)
                if "event" in message:
                    for queue in self._event_queues:
                        queue.put_nowait(message)
                    continue
                future = self._pending.pop(str(message.get("id")), None)
                if future is None or future.done():
                    continue
                if "error" in message:
                    err = message["error"]
                    future.set_exception(QMPError(f"QMP: {err.get('class')}: {err.get('desc')}"))
                else:
                    future.set_result(message.get("return"))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(QMPError("QMP connection closed (QEMU exited)"))
            self._pending.clear()

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 60.0
    ) -> Any:
        if self._writer is None or self.closed.is_set():
            raise QMPError(f"QMP {command}: connection is closed")
        cmd_id = str(next(self._ids))
        message: dict[str, Any] = {"execute": command, "id": cmd_id}
        if arguments:
            message["arguments"] = arguments
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[cmd_id] = future
        try:
            self._writer.write(json.dumps(message).encode() + b"\n")
            await self._writer.drain()
        except ConnectionError as exc:
            # QEMU died before the reader saw the end of the stream (EPIPE/ECONNRESET on
            # the write): the connection is as closed as after an EOF.
            self._pending.pop(cmd_id, None)
            self.closed.set()
            raise QMPError(f"QMP {command}: connection lost ({exc})") from exc
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            self._pending.pop(cmd_id, None)
            raise QMPError(f"QMP {command}: no answer in {timeout:.0f} s") from exc

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._event_queues.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        with contextlib.suppress(ValueError):
            self._event_queues.remove(queue)

    async def wait_event(
        self, queue: asyncio.Queue[dict[str, Any]], name: str, timeout: float,
        match: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QMPError(f"QMP event {name} did not arrive in {timeout:.0f} s")
            get = asyncio.ensure_future(queue.get())
            closed = asyncio.ensure_future(self.closed.wait())
            done, _ = await asyncio.wait(
                {get, closed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            closed.cancel()
            if get not in done:
                get.cancel()
                if self.closed.is_set():
                    raise QMPError(f"QMP connection closed while waiting for {name}")
                continue
            event = get.result()
            if event.get("event") != name:
                continue
            data = event.get("data", {})
            if match and any(data.get(k) != v for k, v in match.items()):
                continue
            return event

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task

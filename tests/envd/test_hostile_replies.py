"""The host's envd client against a server that is not envd (what root in a guest can put on
envd's port): an endless answer, one that drips a byte at a time, one that announces gigabytes,
a compressed one, a Connect stream message of 4 GiB. Each ends with GuestReplyError within its
deadline, the client holding no more than the limit (a real server on loopback)."""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from agentenv.envd_client import (
    EnvdClient,
    EnvdClientError,
    GuestReplyError,
    GuestReplyTimeout,
    read_reply,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMIT = 1 << 20


async def _head(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
    chunk = b"x" * 65536
    while True:
        writer.write(chunk)
        await writer.drain()


async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n")
    while True:
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.05)


async def announces_gigabytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4000000000\r\n\r\n{")
    await writer.drain()
    await asyncio.sleep(60)


async def gzip_bomb(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    body = gzip.compress(bytes(64 << 20))
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n"
                 % len(body) + body)
    await writer.drain()


async def huge_envelope(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/connect+json\r\n\r\n")
    start = json.dumps({"event": {"start": {"pid": 7}}}).encode()
    writer.write(struct.pack(">BI", 0, len(start)) + start)
    writer.write(struct.pack(">BI", 0, 0xFFFFFFF0))
    chunk = b"y" * 65536
    while True:
        writer.write(chunk)
        await writer.drain()


async def _serve(handler: Handler) -> AsyncIterator[str]:
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


@pytest.fixture(autouse=True)
def _small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_ENVD_MAX_REPLY_BYTES", str(LIMIT))


@pytest.mark.parametrize(("handler", "error", "message"), [
    (endless, GuestReplyError, f"over the limit of {LIMIT} bytes"),
    (drip, GuestReplyTimeout, "no complete answer within 2 s"),
    (announces_gigabytes, GuestReplyError, "announces 4000000000 bytes"),
    (gzip_bomb, GuestReplyError, "Content-Encoding 'gzip'"),
])
def test_unary_answers_are_bounded(handler: Handler, error: type[Exception],
                                   message: str) -> None:
    async def main() -> None:
        async for url in _serve(handler):
            async with httpx.AsyncClient() as http:
                t0 = time.monotonic()
                with pytest.raises(error, match=message):
                    await read_reply(http, "POST", url + "/init", what="envd /init",
                                     timeout=2.0)
                assert time.monotonic() - t0 < 10
            client = EnvdClient(url, timeout=2.0)
            try:
                with pytest.raises(error, match=message):
                    await client.init(env_vars={"A": "1"})
            finally:
                await client.close()

    asyncio.run(main())


def test_a_stream_message_over_the_limit_ends_the_call() -> None:
    async def main() -> None:
        async for url in _serve(huge_envelope):
            client = EnvdClient(url)
            try:
                with pytest.raises(GuestReplyError, match=f"stream message of {0xFFFFFFF0} "
                                   f"bytes, over the limit of {LIMIT}"):
                    await asyncio.wait_for(client.run("true", []), 30)
            finally:
                await client.close()

    asyncio.run(main())


async def silent_after_start(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A start event, then nothing at all (no keepalive, whatever was asked)."""
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/connect+json\r\n\r\n")
    start = json.dumps({"event": {"start": {"pid": 9}}}).encode()
    writer.write(struct.pack(">BI", 0, len(start)) + start)
    await writer.drain()
    while True:
        writer.write(b"")
        await asyncio.sleep(1)


def test_a_process_stream_ends_at_its_timeout_whatever_the_guest_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """envd enforces Connect-Timeout-Ms; a server that ignores it is cut
    PROCESS_DEADLINE_GRACE_SECONDS (30 s) later by the host (here: a start event, then
    keepalive-free silence would hang without the deadline). The grace is shortened to 1 s
    for the test: what it checks is that the host ends the call, not the constant."""
    import agentenv.envd_client as envd_client

    assert envd_client.PROCESS_DEADLINE_GRACE_SECONDS == 30.0
    monkeypatch.setattr(envd_client, "PROCESS_DEADLINE_GRACE_SECONDS", 1.0)

    async def main() -> None:
        async for url in _serve(silent_after_start):
            client = EnvdClient(url)
            try:
                t0 = time.monotonic()
                with pytest.raises(GuestReplyError, match=r"did not end within 1\.5 s"):
                    # bounded here too: without the host's deadline the call never ends
                    await asyncio.wait_for(client.run("sleep", ["1"], timeout=0.5), 60)
                assert time.monotonic() - t0 < 60
            finally:
                await client.close()

    asyncio.run(main())


def test_a_process_stream_without_a_timeout_ends_when_the_guest_goes_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with no timeout (a start command followed for its output) asks envd for
    keepalives; a stream that brings none for IDLE_READ_SECONDS ends instead of waiting
    forever (a build guest can go silent)."""
    import agentenv.envd_client as envd_client

    monkeypatch.setattr(envd_client, "IDLE_READ_SECONDS", 1.0)

    async def main() -> None:
        async for url in _serve(silent_after_start):
            client = EnvdClient(url)
            try:
                with pytest.raises(GuestReplyTimeout, match="not even a keepalive, for 1 s"):
                    # bounded here too: the old client waited forever
                    await asyncio.wait_for(client.run("sleep", ["infinity"]), 60)
            finally:
                await client.close()

    asyncio.run(main())


NESTED = b"[" * 100_000 + b"]" * 100_000


async def nested_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                 b"\r\n" % len(NESTED) + NESTED)
    await writer.drain()


async def nested_envelope(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/connect+json\r\n\r\n")
    writer.write(struct.pack(">BI", 0, len(NESTED)) + NESTED)
    await writer.drain()
    await asyncio.sleep(60)


def test_deeply_nested_json_is_an_error_of_that_call() -> None:
    """`[[[[...]]]]` 100,000 deep from the guest made the stdlib parser raise RecursionError,
    which no `except ValueError` around a parse catches: the call fails with a clear error."""

    async def main() -> None:
        async for url in _serve(nested_answer):
            client = EnvdClient(url, timeout=10.0)
            try:
                with pytest.raises(EnvdClientError, match="deeper than 64 levels"):
                    await client.make_dir("/tmp/x")
            finally:
                await client.close()
        async for url in _serve(nested_envelope):
            client = EnvdClient(url)
            try:
                with pytest.raises(GuestReplyError, match="deeper than 64 levels"):
                    await asyncio.wait_for(client.run("true", []), 30)
            finally:
                await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("handler", [endless, announces_gigabytes])
def test_the_ready_pool_s_warm_up_reads_within_the_bounds(handler: Handler,
                                                          tmp_path: Path) -> None:
    """A pooled VM restored from a user's snapshot runs whatever that guest left on envd's
    port: the pool's warm-up calls (node/ready_pool.py) read its answers as every envd call
    does, never whole (they read an endless answer until the node's memory ran out)."""
    from types import SimpleNamespace

    from agentenv.node.ready_pool import ReadyPool, ReadyPoolConfig

    async def main() -> None:
        async for url in _serve(handler):
            pool = ReadyPool(None, ReadyPoolConfig(low=0, high=0), tmp_path)
            try:
                with pytest.raises(GuestReplyError):
                    await asyncio.wait_for(
                        pool._warm(SimpleNamespace(envd_url=url), None, None), 30)
            finally:
                await pool._http.aclose()

    asyncio.run(main())


def test_a_filesystem_only_pause_s_sync_reads_within_the_bounds() -> None:
    """`/aenv/sync` before a filesystem-only pause, through the envd client."""
    async def main() -> None:
        async for url in _serve(endless):
            client = EnvdClient(url)
            try:
                with pytest.raises(GuestReplyError, match="over the limit"):
                    await client.sync(timeout=5.0)
            finally:
                await client.close()

    asyncio.run(main())

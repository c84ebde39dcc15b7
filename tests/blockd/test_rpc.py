"""The control transport in-process: typed records out as JSON, errors as their kinds, and the
clients reading the records back (the daemon's own operations are tested end to end in
test_lifecycle.py and test_disk_cap.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agentenv.blockd.client import AsyncBlockdClient, BlockdClient
from agentenv.blockd.errors import BlockdError, NotFound
from agentenv.blockd.results import DeviceInfo, Released
from agentenv.blockd.rpc import MAX_RPC_LINE, RpcServer

INFO = DeviceInfo(id="d1", nbd="/s/d1.sock", export="d1", file=None, size=4096, readonly=False,
                  upper_limit=8192, upper_used=512, stats={"reads": 3})


async def _create(size: int, readonly: bool = False) -> DeviceInfo:
    return INFO


async def _release(id: str) -> Released:
    if id != "d1":
        raise NotFound(f"no device with id {id!r}")
    return Released(released=id, refcount=0)


async def _list() -> list[DeviceInfo]:
    return [INFO, INFO]


async def _refuse() -> None:
    raise BlockdError("size must be positive")


async def _fail() -> None:
    raise OSError(28, "No space left on device")


async def _crash() -> None:
    raise KeyError("bug")


async def _nothing() -> None:
    return None


HANDLERS = {"create": _create, "release": _release, "list": _list, "refuse": _refuse,
            "fail": _fail, "crash": _crash, "nothing": _nothing}


def answer(line: bytes | str) -> dict[str, object]:
    server = RpcServer(Path("/nonexistent"), HANDLERS)
    raw = line.encode() if isinstance(line, str) else line
    out: dict[str, object] = json.loads(asyncio.run(server.dispatch(raw)))
    return out


def test_records_and_errors_on_the_wire() -> None:
    created = answer('{"op": "create", "size": 1}')
    assert created == {"ok": True, "result": INFO.to_json()}
    assert created["result"]["upper_used"] == 512  # type: ignore[index]
    assert answer('{"op": "list"}')["result"] == [INFO.to_json()] * 2
    assert answer('{"op": "nothing"}') == {"ok": True, "result": {}}
    assert answer('{"op": "release", "id": "d1"}')["result"] == {"released": "d1", "refcount": 0}
    kinds = {
        '{"op": "release", "id": "d9"}': "not_found",
        '{"op": "refuse"}': "invalid",
        '{"op": "create", "bogus": 1}': "invalid",  # unknown argument
        '{"op": "create"}': "invalid",  # missing argument
        '{"op": "teleport"}': "invalid",
        '["create"]': "invalid",
        "not json": "invalid",
        '{"op": "fail"}': "failed",
        '{"op": "crash"}': "failed",
    }
    for line, kind in kinds.items():
        got = answer(line)
        assert got["ok"] is False and got["type"] == kind, (line, got)
    assert "known: create, release" in str(answer('{"op": "teleport"}')["error"])
    assert "No space left" in str(answer('{"op": "fail"}')["error"])


def test_clients_read_the_records_back(short_tmp: Path) -> None:
    sock = short_tmp / "ctl.sock"

    async def scenario() -> None:
        server = RpcServer(sock, HANDLERS)
        await server.start()
        assert sock.stat().st_mode & 0o777 == 0o600
        client = AsyncBlockdClient(sock)
        try:
            assert await client.create(size=1) == INFO
            try:
                await client.create_blank(1)
            except BlockdError as exc:
                assert "unknown op 'create_blank'" in str(exc)
            else:
                raise AssertionError("create_blank is not an operation of this server")
            assert await client.list() == [INFO, INFO]
            assert await client.release("d1") == 0
            try:
                await client.release("d9")
            except BlockdError as exc:
                assert "no device with id 'd9'" in str(exc)
            else:
                raise AssertionError("d9 does not exist")
            # A line longer than the limit is refused and the connection closed.
            reader, writer = await asyncio.open_unix_connection(str(sock), limit=MAX_RPC_LINE * 2)
            writer.write(b"x" * (MAX_RPC_LINE + 10) + b"\n")
            await writer.drain()
            assert json.loads(await reader.readline())["error"] == "request line too long"
            assert await reader.readline() == b""
            writer.close()
            # The synchronous client, on a thread (the loop keeps serving).
            def sync() -> list[DeviceInfo]:
                with BlockdClient(sock, timeout=10) as blocking:
                    return blocking.list()

            assert await asyncio.to_thread(sync) == [INFO, INFO]
            await client.close()
        finally:
            server.close()
        assert not sock.exists()

    asyncio.run(scenario())


def test_a_newer_daemons_extra_fields_are_ignored() -> None:
    data = {**INFO.to_json(), "added_later": True}
    assert DeviceInfo.from_json(data) == INFO
    assert INFO.uri == "nbd+unix:///d1?socket=/s/d1.sock"

"""envd on the wire: Connect framing, content types, end-of-stream and errors for malformed input."""

from __future__ import annotations

import json
import struct

import httpx
import pytest

pytestmark = pytest.mark.root

UNARY = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def envelope(message: object, flags: int = 0) -> bytes:
    payload = message if isinstance(message, bytes) else json.dumps(message).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def envelopes(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, length = struct.unpack_from(">BI", body)
        out.append((flags, json.loads(body[5 : 5 + length])))
        body = body[5 + length :]
    return out


@pytest.fixture()
def client(envd) -> httpx.Client:
    with httpx.Client(base_url=envd.url, timeout=30) as http:
        yield http


def test_start_stream_shape(client: httpx.Client) -> None:
    reply = client.post(
        "/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; exit 2"]}, "stdin": False}),
        headers={**STREAM, "Authorization": "Basic cm9vdDo="},
    )
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/connect+json"
    assert "content-encoding" not in reply.headers
    frames = envelopes(reply.content)
    assert frames[0][1]["event"]["start"]["pid"] > 0
    assert frames[1] == (0, {"event": {"data": {"stdout": "aGkK"}}})
    assert frames[2] == (0, {"event": {"end": {"exitCode": 2, "exited": True, "status": "exit status 2", "error": "exit status 2"}}})
    assert frames[3] == (2, {})
    assert len(frames) == 4


def test_tag_selector_and_stream_input(client: httpx.Client) -> None:
    start = client.build_request(
        "POST",
        "/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/cat"}, "tag": "my-cat"}),
        headers=STREAM,
    )
    stream = client.send(start, stream=True)
    try:
        chunks = stream.iter_bytes()
        first = next(chunks)
        pid = envelopes(first[: 5 + struct.unpack_from(">I", first, 1)[0]])[0][1]["event"]["start"]["pid"]
        listed = client.post("/process.Process/List", json={}, headers=UNARY).json()["processes"]
        assert {"config": {"cmd": "/bin/cat"}, "pid": pid, "tag": "my-cat"} in listed
        # StreamInput: a client stream with no end-of-stream envelope of its own.
        body = envelope({"start": {"process": {"tag": "my-cat"}}}) + envelope(
            {"data": {"input": {"stdin": "cGluZwo="}}}
        ) + envelope({"keepalive": {}})
        reply = client.post("/process.Process/StreamInput", content=body, headers=STREAM)
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/connect+json"
        assert envelopes(reply.content) == [(0, {}), (2, {})]
        assert client.post("/process.Process/CloseStdin", json={"process": {"tag": "my-cat"}}, headers=UNARY).status_code == 200
        rest = first + b"".join(chunks)
    finally:
        stream.close()
    frames = envelopes(rest)
    assert (0, {"event": {"data": {"stdout": "cGluZwo="}}}) in frames
    assert frames[-2] == (0, {"event": {"end": {"exited": True, "status": "exit status 0"}}})
    assert frames[-1] == (2, {})


def test_unknown_rpc(client: httpx.Client) -> None:
    reply = client.post("/process.Process/Nope", json={}, headers=UNARY)
    assert reply.status_code == 404
    assert reply.json()["code"] == "unimplemented"
    reply = client.post("/nosuch.Service/Start", content=envelope({}), headers=STREAM)
    assert reply.status_code == 200
    assert envelopes(reply.content) == [(2, {"error": {"code": "unimplemented", "message": "unknown procedure /nosuch.Service/Start"}})]
    assert client.get("/no/such/route").status_code == 404


def test_malformed_json(client: httpx.Client) -> None:
    reply = client.post("/filesystem.Filesystem/Stat", content=b"{not json", headers=UNARY)
    assert reply.status_code == 400
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/filesystem.Filesystem/Stat", content=b"[1,2]", headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/filesystem.Filesystem/Stat", json={"path": 5}, headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/process.Process/Start", content=envelope(b"{oops"), headers=STREAM)
    assert reply.status_code == 200
    [(flags, eos)] = envelopes(reply.content)
    assert flags == 2 and eos["error"]["code"] == "invalid_argument"
    truncated = envelope({"process": {"cmd": "/bin/true"}})[:-3]
    reply = client.post("/process.Process/Start", content=truncated, headers=STREAM)
    assert envelopes(reply.content)[0][1]["error"]["code"] == "invalid_argument"
    reply = client.post("/process.Process/Start", content=envelope({"process": {"cmd": "/bin/true", "args": "no"}}), headers=STREAM)
    assert envelopes(reply.content)[0][1]["error"]["code"] == "invalid_argument"


def test_wrong_content_type(client: httpx.Client) -> None:
    reply = client.post("/filesystem.Filesystem/Stat", content=b'{"path":"/"}', headers={"Content-Type": "text/plain"})
    assert reply.status_code == 415
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/process.Process/Start", json={"process": {"cmd": "/bin/true"}}, headers=UNARY)
    assert reply.status_code == 415
    reply = client.post("/filesystem.Filesystem/Stat", content=envelope({"path": "/"}), headers=STREAM)
    assert reply.status_code == 200
    assert envelopes(reply.content)[0][1]["error"]["code"] == "invalid_argument"
    reply = client.get("/filesystem.Filesystem/Stat")
    assert reply.status_code == 405


def test_signals_and_bad_selectors(client: httpx.Client) -> None:
    reply = client.post("/process.Process/SendSignal", json={"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}, headers=UNARY)
    assert (reply.status_code, reply.json()["code"]) == (404, "not_found")
    assert reply.json()["message"] == "process with pid 999999 not found"
    reply = client.post("/process.Process/SendSignal", json={"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"}, headers=UNARY)
    assert (reply.status_code, reply.json()["code"]) == (501, "unimplemented")
    reply = client.post("/process.Process/SendInput", json={"process": {}}, headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/process.Process/Connect", content=envelope({"process": {"tag": "never"}}), headers=STREAM)
    assert envelopes(reply.content) == [(2, {"error": {"code": "not_found", "message": "process with tag never not found"}})]


def test_bad_paths(client: httpx.Client) -> None:
    reply = client.post("/filesystem.Filesystem/Stat", json={"path": "/a\u0000b"}, headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/filesystem.Filesystem/Stat", json={}, headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/filesystem.Filesystem/Remove", json={"path": "/"}, headers=UNARY)
    assert reply.json()["code"] == "invalid_argument"
    reply = client.post("/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": "nope"}, headers=UNARY)
    assert (reply.status_code, reply.json()["code"]) == (404, "not_found")
    reply = client.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers={**UNARY, "Authorization": "Basic bm9ib2R5Og=="})
    assert (reply.status_code, reply.json()["code"]) == (401, "unauthenticated")


def test_files_http_errors(client: httpx.Client) -> None:
    reply = client.get("/files")
    assert reply.status_code == 400 and reply.json()["code"] == 400
    reply = client.post("/files", params={"path": "/data/x"}, content=b"x", headers={"Content-Type": "text/plain"})
    assert reply.status_code == 400
    reply = client.post("/files", content=b"x", headers={"Content-Type": "application/octet-stream"})
    assert reply.status_code == 400 and "path" in reply.json()["message"]
    files = [("file", ("/data/dup.txt", b"1")), ("file", ("/data/dup.txt", b"2"))]
    reply = client.post("/files", files=files)
    assert reply.status_code == 400 and "multiple files" in reply.json()["message"]
    reply = client.post("/files", params={"path": "/data/gz"}, content=b"not gzip", headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert reply.status_code == 400
    reply = client.post("/files", params={"username": "nobody"}, files={"file": ("/data/u.txt", b"1")})
    assert reply.status_code == 401
    # Other form fields are ignored; the file keeps its full path.
    reply = client.post("/files", data={"note": "ignored"}, files={"file": ("/data/deep/er/f.txt", b"1")})
    assert reply.status_code == 200
    assert reply.json() == [{"name": "f.txt", "type": "file", "path": "/data/deep/er/f.txt"}]
    reply = client.get("/files", params={"path": "/data/deep/er/f.txt"})
    assert reply.content == b"1"
    assert reply.headers["content-type"] == "text/plain"


def test_keepalive_during_silence(client: httpx.Client) -> None:
    reply = client.post(
        "/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 2.5; echo late"]}}),
        headers={**STREAM, "Keepalive-Ping-Interval": "1"},
    )
    events = [frame[1].get("event", {}) for frame in envelopes(reply.content)]
    assert list(events[0]) == ["start"]
    assert sum("keepalive" in e for e in events) >= 2
    assert {"data": {"stdout": "bGF0ZQo="}} in events


def test_download_refuses_devices_and_fifos(client: httpx.Client, envd) -> None:
    import os
    import stat as stat_module

    os.mkfifo(envd.root / "data" / "fifo")
    os.mknod(envd.root / "data" / "zero", stat_module.S_IFCHR | 0o666, os.makedev(1, 5))
    for name in ("fifo", "zero"):
        reply = client.get("/files", params={"path": f"/data/{name}"}, timeout=10)
        assert reply.status_code == 400
        assert "not a regular file" in reply.json()["message"]


def test_keep_alive_connection_survives_streams_and_downloads(envd) -> None:
    """Requests after a stream or a download reuse the same connection, and envd logs no error."""
    log_before = envd.log_path.read_text()
    with httpx.Client(base_url=envd.url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        http.post("/files", params={"path": "/data/ka.txt"}, content=b"keep", headers={"Content-Type": "application/octet-stream"})
        for _ in range(3):
            reply = http.post("/process.Process/Start", content=envelope({"process": {"cmd": "/bin/true"}}), headers=STREAM)
            assert envelopes(reply.content)[-1] == (2, {})
            assert http.get("/files", params={"path": "/data/ka.txt"}).content == b"keep"
            assert http.post("/filesystem.Filesystem/Stat", json={"path": "/data"}, headers=UNARY).status_code == 200
    new_log = envd.log_path.read_text()[len(log_before):]
    assert "connection failed" not in new_log
    assert "Traceback" not in new_log


def test_garbage_http_gets_400_and_envd_keeps_serving(envd) -> None:
    import socket

    host, port = envd.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400")
    assert b'"code":400' in answer
    assert httpx.get(f"{envd.url}/health").status_code == 204


def test_burst_of_connections_all_served(envd) -> None:
    """envd accepts one connection per wake-up of its listener: a burst of 300 connections at
    once (some dropped by the client before envd gets to them) is served in full."""
    import asyncio
    import socket

    host, port = envd.url.removeprefix("http://").split(":")
    for _ in range(20):  # opened and dropped at once: envd must shrug these off
        socket.create_connection((host, int(port)), timeout=10).close()

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=envd.url, timeout=60, limits=limits) as http:
            replies = await asyncio.gather(*[http.get("/health") for _ in range(300)])
        return [reply.status_code for reply in replies]

    assert asyncio.run(burst()) == [204] * 300
    assert "Traceback" not in envd.log_path.read_text()

"""The cap on concurrent requests of a server (relay/concurrency.py), on a real uvicorn with the
node's hardened settings: requests past the cap get an immediate 503 naming the setting (a
WebSocket a 1013 close), and are served again once the ones in progress end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from agentenv.relay.concurrency import ConcurrencyCap, max_concurrent
from agentenv.relay.server import hardened_config
from tests.control.helpers import wait_for
from tests.node.conftest import free_port

pytestmark = pytest.mark.timeout(120)


#: the body of /big: a client that does not read it fills its socket buffers in a few answers
BIG = b"x" * (1 << 20)


class Held:
    """An app whose /hold requests wait until released, /big answers `BIG`, a POST reads its
    body (after the wait) and answers its size, others "ok"."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/hold":
            self.waiting += 1
            while not self.release.is_set():
                await asyncio.sleep(0.02)
            self.waiting -= 1
        body = BIG if scope["path"] == "/big" else b"ok"
        if scope["method"] == "POST":
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                size += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
            body = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def served() -> Iterator[tuple[str, Held, ConcurrencyCap]]:
    app = Held()
    capped = ConcurrencyCap(app, 2, "the node")
    port = free_port()
    server = uvicorn.Server(hardened_config(capped, "127.0.0.1", port, 64 << 10, 30, 1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the server", lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{port}", app, capped
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(30)


def test_requests_past_the_cap_get_503_naming_it(served: tuple[str, Held, ConcurrencyCap]
                                                 ) -> None:
    url, app, capped = served
    held: list[threading.Thread] = []
    answers: list[int] = []
    for _ in range(2):
        thread = threading.Thread(target=lambda: answers.append(
            httpx.get(url + "/hold", timeout=60, trust_env=False).status_code))
        thread.start()
        held.append(thread)
    wait_for("two requests in progress", lambda: app.waiting == 2, timeout=30)
    refused = httpx.get(url + "/other", timeout=30, trust_env=False)
    assert refused.status_code == 503
    assert "AENV_MAX_CONCURRENT_REQUESTS" in refused.json()["message"]
    assert "the node is serving its limit of 2" in refused.json()["message"]
    assert capped.refused.count == 1
    app.release.set()
    for thread in held:
        thread.join(30)
    assert answers == [200, 200]
    assert httpx.get(url + "/other", timeout=30, trust_env=False).status_code == 200


def test_the_setting() -> None:
    assert max_concurrent({}) == 4096
    assert max_concurrent({"AENV_MAX_CONCURRENT_REQUESTS": "0"}) == 0
    for bad in ("many", "-1"):
        with pytest.raises(ValueError, match="AENV_MAX_CONCURRENT_REQUESTS"):
            max_concurrent({"AENV_MAX_CONCURRENT_REQUESTS": bad})

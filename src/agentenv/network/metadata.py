"""The metadata service at http://169.254.169.254/ (the reference's MMDS role).

Every guest's TCP to 169.254.169.254:80 is redirected to the node's egress proxy, which knows
the caller by its slot's source address and answers that slot's identity, never another's.

Paths (GET or HEAD; HTTP/1.1 keep-alive):
  /  and  /v1/identity     application/json
      {"sandboxId", "templateId", "snapshotId", "envdAccessTokenSha256", "instanceToken"}
      (snapshotId and envdAccessTokenSha256 are null when the sandbox has none)
  /v1/identity/<field>     text/plain, the field's value (one of the keys above); 404 when null
  anything else            404 (JSON error); other methods 405
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from agentenv.network.control import SlotIdentity
from agentenv.network.httphead import HttpError, Incomplete, NotHttp, parse_request_head

METADATA_ADDRESS = "169.254.169.254"
METADATA_PORT = 80
IDLE_TIMEOUT = 30.0
MAX_REQUESTS = 1000  # per connection


def identity_document(identity: SlotIdentity) -> dict[str, str | None]:
    return {
        "sandboxId": identity.sandbox_id,
        "templateId": identity.template_id,
        "snapshotId": identity.snapshot_id,
        "envdAccessTokenSha256": identity.envd_token_sha256,
        "instanceToken": identity.instance_token,
    }


def answer(method: str, target: str, identity: SlotIdentity) -> tuple[int, str, bytes]:
    """(status, content type, body) for one request."""
    path = target.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return 405, "application/json", b'{"error": "only GET and HEAD"}\n'
    document = identity_document(identity)
    if path in ("/", "/v1/identity", "/v1/identity/"):
        return 200, "application/json", json.dumps(document).encode() + b"\n"
    prefix = "/v1/identity/"
    if path.startswith(prefix) and path[len(prefix):] in document:
        value = document[path[len(prefix):]]
        if value is not None:
            return 200, "text/plain; charset=utf-8", value.encode()
        return 404, "application/json", b'{"error": "not set for this sandbox"}\n'
    return 404, "application/json", json.dumps({"error": f"no such path {path[:200]!r}"}).encode()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                lookup: Callable[[], SlotIdentity | None]) -> int:
    """Answer requests on one guest connection until it closes; `lookup` gives the caller's
    identity at each request (None once its slot is gone: the connection ends). Returns the
    number of requests answered."""
    buf = b""
    served = 0
    while served < MAX_REQUESTS:
        try:
            head = parse_request_head(buf)
        except Incomplete:
            try:
                async with asyncio.timeout(IDLE_TIMEOUT):
                    chunk = await reader.read(16384)
            except TimeoutError:
                return served
            if not chunk:
                return served
            buf += chunk
            continue
        except (NotHttp, HttpError) as exc:
            await _respond(writer, 400, "application/json",
                           json.dumps({"error": str(exc)}).encode(), close=True)
            return served
        identity = lookup()
        if identity is None:
            return served
        buf = buf[head.length:]
        status, ctype, body = answer(head.method, head.target, identity)
        connection = ",".join(head.get_all("connection")).lower()
        close = "close" in connection or (head.version == "HTTP/1.0" and "keep-alive" not in connection)
        # A request body is not expected; one announced closes the connection after answering.
        if head.get_all("content-length") not in ([], ["0"]) or head.get_all("transfer-encoding"):
            close = True
        await _respond(writer, status, ctype, b"" if head.method == "HEAD" else body, close=close,
                       length=len(body))
        served += 1
        if close:
            return served
    return served


async def _respond(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes, *,
                   close: bool, length: int | None = None) -> None:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body) if length is None else length}\r\n"
            "Cache-Control: no-store\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()

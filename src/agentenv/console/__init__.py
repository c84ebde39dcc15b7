"""The web console (docs/console.md): static files served at /console by the node and the
gateway, a client of the same E2B API every SDK calls, with the key the user types.

The console adds no route of its own beyond its files: the browser sends the API key as
X-API-KEY to the JSON API, and reaches envd (the terminal) through the sandbox proxy with the
sandbox's envd token, as an SDK does. The files are read once from the package (a fixed table:
a request path is looked up, never joined to a file system path) and carry a strict
Content-Security-Policy: scripts and styles from this origin only, nothing inline, no framing.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

PREFIX = "/console"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
#: no inline script or style, nothing from another origin, never in a frame
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def _load() -> dict[str, tuple[bytes, bytes]]:
    """URL path -> (content type, bytes) of every file in static/; index.html is /console."""
    files: dict[str, tuple[bytes, bytes]] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            path = PREFIX if entry.name == "index.html" else f"{PREFIX}/{entry.name}"
            files[path] = (_TYPES[suffix].encode(), entry.read_bytes())
    return files


def claims(path: str) -> bool:
    """Whether a (decoded, already checked) request path is the console's."""
    return path == PREFIX or path.startswith(PREFIX + "/")


class Console:
    """ASGI handler of the console's paths (those `claims`); anything else of them is 404."""

    def __init__(self) -> None:
        self.files = _load()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        found = self.files.get(scope["path"])
        if scope["method"] not in ("GET", "HEAD"):
            status, ctype, body = 405, b"application/json", self._error(
                405, f"method {scope['method']} not allowed on {scope['path']}")
        elif found is None:
            status, ctype, body = 404, b"application/json", self._error(
                404, f"route not found: {scope['method']} {scope['path']}")
        else:
            status, (ctype, body) = 200, found
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                   *SECURITY_HEADERS]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body",
                    "body": b"" if scope["method"] == "HEAD" else body})

    @staticmethod
    def _error(status: int, message: str) -> bytes:
        # the API's error shape (docs/e2b-api.md §1.2)
        return json.dumps({"code": status, "message": message}).encode()

"""A hostile registry and token server: bodies that never end are cut off while they stream
(manifests, configs, blobs longer than their descriptor, token answers, error bodies)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.registry.client import MAX_MANIFEST_BYTES, Descriptor, RegistryClient
from agentenv.registry.errors import DigestMismatchError, RegistryError

CHUNK = 64 << 10
ENDLESS = 512 << 20  # what the server would send if the client let it


class _Hostile(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sent: dict[str, int] = {}

    def log_message(self, *args: object) -> None:
        pass

    def _endless(self, status: int, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        body = b"{" + b" " * (CHUNK - 1)
        total = 0
        try:
            while total < ENDLESS:
                self.wfile.write(b"%x\r\n" % len(body) + body + b"\r\n")
                total += len(body)
                body = b" " * CHUNK
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.sent[self.path.split("?")[0]] = total

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/v2/":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path.startswith("/v2/tok/"):
            # Every registry request needs a token; the token server never stops talking.
            if self.headers.get("Authorization"):
                self._endless(200, "application/json")
                return
            realm = f"http://{self.headers['Host']}/token"
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="{realm}",service="x"')
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/token":
            self._endless(200, "application/json")
        elif "/manifests/" in path:
            self._endless(200, "application/vnd.oci.image.manifest.v1+json")
        elif path.endswith("/blobs/" + _BLOB.digest):
            self._endless(200, "application/octet-stream")
        else:
            self._endless(404, "application/json")


_BLOB = Descriptor("application/octet-stream", "sha256:" + "ab" * 32, 1 << 20)


@pytest.fixture
def hostile() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hostile.sent.clear()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _sent(path: str) -> int:
    import time

    deadline = time.monotonic() + 10
    while path not in _Hostile.sent and time.monotonic() < deadline:
        time.sleep(0.05)
    return _Hostile.sent[path]


def test_endless_manifest_is_cut_off_while_streaming(hostile: str, no_docker_config: Path) -> None:
    with RegistryClient(hostile) as client, pytest.raises(RegistryError, match="allowed"):
        client.get_manifest_bytes("x", "latest")
    # Stopped near the cap, not after the server's 512 MiB (socket buffers hold a few MiB).
    assert _sent("/v2/x/manifests/latest") < MAX_MANIFEST_BYTES + (32 << 20)


def test_config_and_blob_longer_than_their_descriptor(hostile: str, tmp_path: Path,
                                                      no_docker_config: Path) -> None:
    with RegistryClient(hostile) as client:
        with pytest.raises(RegistryError, match="allowed"):
            client.get_blob_bytes("x", _BLOB)
        assert _sent(f"/v2/x/blobs/{_BLOB.digest}") < (40 << 20)
        _Hostile.sent.clear()
        with pytest.raises(DigestMismatchError, match="download stopped"):
            client.download_blob("x", _BLOB, tmp_path / "blob")
        assert _sent(f"/v2/x/blobs/{_BLOB.digest}") < (40 << 20)
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_endless_token_answer_and_error_body(hostile: str, no_docker_config: Path) -> None:
    with RegistryClient(hostile) as client:
        with pytest.raises(RegistryError, match=r"token server answer .* allowed"):
            client.get_manifest_bytes("tok/x", "latest")
        assert _sent("/token") < (40 << 20)
        missing = "sha256:" + "cd" * 32
        with pytest.raises(RegistryError, match="not found in"):
            client.get_blob_bytes("x", Descriptor("application/json", missing, 10))
        assert _sent(f"/v2/x/blobs/{missing}") < (40 << 20)  # the endless error body too

"""GET and POST /files: file download and upload (multipart or raw octet-stream, optionally gzip)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import mimetypes
import os
import stat
import time
import zlib
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from agentenv.guest.envd.asgi import (
    Request,
    Send,
    send_http_error,
    send_json,
    wait_disconnect,
)
from agentenv.guest.envd.filesystem import ensure_dirs, replace_metadata
from agentenv.guest.envd.multipart import (
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    boundary_of,
)
from agentenv.guest.envd.rootfs import RootFs, User
from agentenv.guest.envd.rpc import RpcError, same_secret

log = logging.getLogger("envd.files")

READ_CHUNK_BYTES = 1024 * 1024
MAX_METADATA_VALUE_BYTES = 64 * 1024


class HttpError(Exception):
    """A plain-HTTP error answer: status and message, sent as {"code": status, "message": ...}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def signature_for(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    import hashlib  # here: it maps OpenSSL's libcrypto, which envd otherwise does without

    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def write_error(exc: OSError, guest_path: str) -> HttpError:
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return HttpError(507, f"not enough disk space to write '{guest_path}'")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HttpError(403, f"cannot write '{guest_path}': {exc.strerror}")
    if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EINVAL):
        return HttpError(400, f"cannot write '{guest_path}': {exc.strerror}")
    return HttpError(500, f"cannot write '{guest_path}': {exc.strerror or exc}")


def content_disposition(name: str) -> str:
    """`inline; filename="..."`, plus the RFC 5987 form when the name is not plain ASCII."""
    if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name:
        return f'inline; filename="{name}"'
    fallback = "".join(ch if ch.isascii() and ch.isprintable() and ch not in '"\\' else "_" for ch in name)
    return f"inline; filename=\"{fallback}\"; filename*=UTF-8''{quote(name)}"


@dataclass
class OpenUpload:
    guest_path: str
    host_path: str
    fd: int


class _Defaults(Protocol):
    """envd's current token and defaults (app.py's EnvdState)."""

    access_token: str | None
    default_user: str
    default_workdir: str | None


class Envd(Protocol):
    """What the file routes need of envd (app.py's Envd, which serves them)."""

    state: _Defaults
    rootfs: RootFs

    def token_ok(self, request: Request) -> bool: ...

    def user(self, name: str, error: Exception) -> User: ...


class FilesApi:
    def __init__(self, envd: Envd) -> None:
        self.envd = envd

    def _authorize(self, request: Request, operation: str) -> None:
        """An access token, when one is set, or else a valid v1 signature of this path."""
        token = self.envd.state.access_token
        if token is None or (
            "x-access-token" in request.headers and self.envd.token_ok(request)
        ):
            return
        if "x-access-token" in request.headers:
            raise HttpError(401, "unauthorized access, please provide a valid access token")
        signature = request.param("signature")
        if not signature:
            raise HttpError(401, "unauthorized access, please provide a valid access token or signature")
        expiration_raw = request.param("signature_expiration")
        expiration = None
        if expiration_raw:
            try:
                expiration = int(expiration_raw)
            except ValueError:
                raise HttpError(401, "malformed signature_expiration") from None
            if expiration < time.time():
                raise HttpError(401, "the signature has expired")
        expected = signature_for(
            request.param("path") or "", operation, request.param("username") or "", token, expiration
        )
        if not same_secret(signature, expected):
            raise HttpError(401, "invalid signature")

    def _user(self, request: Request) -> User:
        name = request.param("username") or self.envd.state.default_user
        return self.envd.user(name, HttpError(401, f"invalid username: '{name}'"))

    # ---- download ---------------------------------------------------------------------------

    async def download(self, request: Request, send: Send) -> None:

        try:
            self._authorize(request, "read")
            user = self._user(request)
            raw_path = request.param("path")
            if not raw_path:
                raise HttpError(400, "the path query parameter is required")
            guest = self.envd.rootfs.expand(raw_path, user, self.envd.state.default_workdir)
            host = self.envd.rootfs.host_path(guest)
            try:
                # O_NONBLOCK: opening a FIFO must not block the server (it is refused below).
                fd = os.open(host, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                raise HttpError(404, f"path '{guest}' does not exist") from None
            except NotADirectoryError:
                raise HttpError(404, f"path '{guest}' does not exist") from None
            except PermissionError as exc:
                raise HttpError(403, f"cannot read '{guest}': {exc.strerror}") from None
        except (HttpError, RpcError) as exc:
            status, message = (exc.status, exc.message) if isinstance(exc, HttpError) else (exc.http_status, exc.message)
            await send_http_error(send, status, message)
            return
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                await send_http_error(send, 400, f"path '{guest}' is a directory")
                return
            if not stat.S_ISREG(st.st_mode):
                # A device or FIFO may never end (/dev/zero); only files are served.
                await send_http_error(send, 400, f"path '{guest}' is not a regular file")
                return
            os.set_blocking(fd, True)
            await self._send_file(request, send, fd, guest, st.st_size)
        finally:
            os.close(fd)

    @staticmethod
    async def _send_file(request: Request, send: Send, fd: int, guest: str, size: int) -> None:

        name = os.path.basename(guest)
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        headers = [
            (b"content-type", content_type.encode()),
            (b"content-disposition", content_disposition(name).encode()),
        ]
        # Files of /proc and the like claim size 0 and still have content: send those chunked.
        if size:
            headers.append((b"content-length", str(size).encode()))
        disconnected = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            remaining = size if size else None
            while not disconnected.done():
                want = READ_CHUNK_BYTES if remaining is None else min(READ_CHUNK_BYTES, remaining)
                chunk = os.read(fd, want) if want else b""
                if not chunk:
                    break
                if remaining is not None:
                    remaining -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if remaining:
                # The file shrank while being sent: the promised length cannot be met.
                raise ConnectionError(f"'{guest}' shrank during the download")
            await send({"type": "http.response.body", "body": b""})
        finally:
            disconnected.cancel()
            # Wait for the cancel to land: the connection reads its next request right after.
            with contextlib.suppress(asyncio.CancelledError):
                await disconnected

    # ---- upload -----------------------------------------------------------------------------

    async def upload(self, request: Request, send: Send) -> None:

        try:
            self._authorize(request, "write")
            user = self._user(request)
            metadata = self._metadata(request)
            content_type = request.headers.get("content-type", "")
            media_type = content_type.split(";")[0].strip().lower()
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", "", "gzip"):
                raise HttpError(400, f"unsupported content encoding {encoding!r}; use gzip or identity")
            if media_type == "application/octet-stream":
                entries = await self._upload_raw(request, user, metadata, encoding == "gzip")
            elif media_type.startswith("multipart/"):
                entries = await self._upload_multipart(request, user, metadata, content_type, encoding == "gzip")
            else:
                raise HttpError(
                    400,
                    f"unsupported content type {content_type or '(none)'!r}; "
                    "expected multipart/form-data or application/octet-stream",
                )
        except (HttpError, RpcError) as exc:
            status, message = (exc.status, exc.message) if isinstance(exc, HttpError) else (exc.http_status, exc.message)
            await send_http_error(send, status, message)
            return
        await send_json(send, 200, entries)

    def _metadata(self, request: Request) -> dict[str, str]:
        metadata: dict[str, str] = {}
        for key, value in request.headers.items():
            if key.startswith("x-metadata-") and len(key) > len("x-metadata-"):
                if len(value) > MAX_METADATA_VALUE_BYTES:
                    raise HttpError(400, f"metadata value of {key} is too large")
                metadata[key[len("x-metadata-") :].lower()] = value
        return metadata

    def _open_target(self, raw_path: str, user: User, seen: set[str]) -> OpenUpload:
        guest = self.envd.rootfs.expand(raw_path, user, self.envd.state.default_workdir)
        if guest in seen:
            raise HttpError(400, f"you cannot upload multiple files to the same path '{guest}' in one request")
        seen.add(guest)
        host = self.envd.rootfs.host_path(guest)
        try:
            if os.path.isdir(host):
                raise HttpError(400, f"path '{guest}' is a directory")
            ensure_dirs(os.path.dirname(host), user)
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_error(exc, guest) from None
        return OpenUpload(guest, host, fd)

    def _finish(self, upload: OpenUpload, user: User, metadata: dict[str, str]) -> dict[str, Any]:
        try:
            if os.geteuid() == 0:
                os.fchown(upload.fd, user.uid, user.gid)
            replace_metadata(upload.fd, metadata)
        except OSError as exc:
            raise write_error(exc, upload.guest_path) from None
        finally:
            os.close(upload.fd)
        entry: dict[str, Any] = {"name": os.path.basename(upload.guest_path), "type": "file", "path": upload.guest_path}
        if metadata:
            entry["metadata"] = metadata
        return entry

    @staticmethod
    def _write(upload: OpenUpload, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(upload.fd, view) :]
            except OSError as exc:
                raise write_error(exc, upload.guest_path) from None

    async def _upload_raw(self, request: Request, user: User, metadata: dict[str, str], gzipped: bool) -> list[dict[str, Any]]:
        raw_path = request.param("path")
        if not raw_path:
            raise HttpError(400, "the path query parameter is required for an octet-stream upload")
        upload = self._open_target(raw_path, user, set())
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
        try:
            async for chunk in request.body_chunks():
                if inflater is not None:
                    try:
                        chunk = inflater.decompress(chunk)
                    except zlib.error as exc:
                        raise HttpError(400, f"malformed gzip body: {exc}") from None
                self._write(upload, chunk)
            if inflater is not None and not inflater.eof:
                raise HttpError(400, "malformed gzip body: it ends early")
        except BaseException:
            os.close(upload.fd)
            raise
        return [self._finish(upload, user, metadata)]

    async def _upload_multipart(
        self, request: Request, user: User, metadata: dict[str, str], content_type: str, gzipped: bool
    ) -> list[dict[str, Any]]:
        try:
            parser = MultipartParser(boundary_of(content_type))
        except MultipartError as exc:
            raise HttpError(400, str(exc)) from None
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
        query_path = request.param("path")
        entries: list[dict[str, Any]] = []
        seen: set[str] = set()
        current: OpenUpload | None = None
        try:
            async for chunk in request.body_chunks():
                if inflater is not None:
                    try:
                        chunk = inflater.decompress(chunk)
                    except zlib.error as exc:
                        raise HttpError(400, f"malformed gzip body: {exc}") from None
                try:
                    events = list(parser.feed(chunk))
                except MultipartError as exc:
                    raise HttpError(400, str(exc)) from None
                for event in events:
                    if isinstance(event, PartStart):
                        if event.headers.name != "file":
                            continue  # other form fields are ignored
                        target = query_path or event.headers.filename
                        if not target:
                            raise HttpError(400, "a file part needs a filename (its target path) or the path parameter")
                        current = self._open_target(target, user, seen)
                    elif isinstance(event, PartData):
                        if current is not None:
                            self._write(current, event.data)
                    elif isinstance(event, PartEnd) and current is not None:
                        upload, current = current, None
                        entries.append(self._finish(upload, user, metadata))
            if not parser.finished:
                raise HttpError(400, "malformed multipart body: it ends before the closing boundary")
        finally:
            if current is not None:
                with contextlib.suppress(OSError):
                    os.close(current.fd)
        return entries

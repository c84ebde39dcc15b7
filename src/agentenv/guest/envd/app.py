"""The envd HTTP server: an ASGI app serving Connect RPC (`process.Process`,
`filesystem.Filesystem`) and the plain routes /health, /init, /envs, /metrics and /files."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs

from agentenv.guest.envd import ACCESS_TOKEN_DIGEST_FILE, ENVD_VERSION, mounts
from agentenv.guest.envd.asgi import (
    Receive,
    Request,
    Scope,
    Send,
    send_empty,
    send_http_error,
    send_json,
    wait_disconnect,
)
from agentenv.guest.envd.files import FilesApi, HttpError
from agentenv.guest.envd.filesystem import FilesystemService
from agentenv.guest.envd.process import ProcessManager, ProcessSpec
from agentenv.guest.envd.reclaim import Reclaim, ReclaimError
from agentenv.guest.envd.rootfs import RootFs, UnknownUser, User
from agentenv.guest.envd.rpc import (
    FLAG_END_STREAM,
    EnvelopeDecoder,
    RpcError,
    as_bool,
    as_object,
    as_str,
    as_str_map,
    as_uint,
    decode_bytes,
    encode_envelope,
    end_of_stream,
    parse_message,
    same_secret,
)
from agentenv.guest.envd.rpc import (
    field as msg_field,
)

log = logging.getLogger("envd")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_KEEPALIVE_SECONDS = 90.0
MAX_UNARY_BYTES = 16 * 1024 * 1024
SIGKILL_WAIT_SECONDS = 2.0
DEFAULT_PTY_SIZE = (80, 24)
CLOCK_BEHIND_TOLERANCE = 0.05
CLOCK_AHEAD_TOLERANCE = 1.5
#: Where /aenv/sync leaves envd's defaults for the next boot of the same disk (a filesystem-
#: only pause cold-boots it): root-only, on the user disk, without the access token.
DEFAULTS_FILE = "/var/lib/aenv/envd-defaults.json"
_RPC_PATH = re.compile(r"^/([A-Za-z_][\w.]*)\.([A-Za-z_]\w*)/([A-Za-z_]\w*)$")


def token_digest(token: str) -> str:
    """SHA-256 (hex) of an access token, by Python's own SHA-256 where there is one: hashlib
    would map OpenSSL's libcrypto into envd at every secure sandbox's first /init."""
    try:
        from _sha256 import sha256  # the tools disk's Python 3.11
    except ImportError:
        from hashlib import sha256
    return sha256(token.encode()).hexdigest()


@dataclass
class EnvdConfig:
    root: str = "/"
    shell_fallback: str | None = None
    path_env: str = DEFAULT_PATH
    # Setting the clock and the hostname from /init changes the whole machine: right in the VM,
    # wrong on a host; it is done only when this is on and the root is `/`.
    system_changes: bool = True
    default_user: str = "user"
    # A busybox whose nsenter starts user processes faster than Python's fork can (see process.py).
    busybox: str | None = None


@dataclass
class EnvdState:
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    default_user: str = "user"
    default_workdir: str | None = None
    #: the last cold-memory setting applied (POST /aenv/reclaim), saved with the defaults
    cold_memory: dict[str, Any] | None = None


class RpcContext:
    def __init__(self, envd: Envd, request: Request) -> None:
        self.envd = envd
        self.request = request

    @property
    def timeout_seconds(self) -> float | None:
        raw = self.request.headers.get("connect-timeout-ms")
        if not raw:
            return None
        if not raw.isdigit() or len(raw) > 10:
            raise RpcError("invalid_argument", f"malformed Connect-Timeout-Ms {raw!r}")
        return int(raw) / 1000 or None

    @property
    def keepalive_seconds(self) -> float:
        raw = self.request.headers.get("keepalive-ping-interval", "")
        try:
            value = float(raw)
        except ValueError:
            return DEFAULT_KEEPALIVE_SECONDS
        return value if value > 0 else DEFAULT_KEEPALIVE_SECONDS

    def user(self) -> User:
        """The user named in `Authorization: Basic base64(user:)`, else the default user."""
        name = self.envd.state.default_user
        header = self.request.headers.get("authorization")
        if header:
            scheme, _, credentials = header.partition(" ")
            if scheme.lower() != "basic":
                raise RpcError("unauthenticated", "authorization must use the Basic scheme")
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise RpcError("unauthenticated", "malformed Basic credentials") from None
            name = decoded.partition(":")[0] or name
        return self.envd.user(name, RpcError("unauthenticated", f"invalid username: '{name}'"))


UnaryHandler = Callable[[RpcContext, dict[str, Any]], Awaitable[dict[str, Any]]]
StreamHandler = Callable[[RpcContext, dict[str, Any]], AsyncIterator[dict[str, Any]]]


class Envd:
    """The ASGI application."""

    def __init__(self, config: EnvdConfig) -> None:
        self.config = config
        self.state = EnvdState(default_user=config.default_user)
        self.rootfs = RootFs(config.root)
        # Only an envd that owns the whole machine (root `/`, in a VM) may set its clock and name.
        self.system_changes = config.system_changes and self.rootfs.is_host_root
        self.reclaim = Reclaim()
        self._load_defaults()
        self.processes = ProcessManager(
            self.rootfs,
            lambda: self.state.env_vars,
            config.path_env,
            config.shell_fallback,
            config.busybox,
        )
        self.fs = FilesystemService(self.rootfs)
        self.files = FilesApi(self)
        self.requests_total = 0
        self._cpu_sample: tuple[float, float] | None = None
        self.unary: dict[str, UnaryHandler] = {
            "process.Process/List": self.rpc_list,
            "process.Process/SendInput": self.rpc_send_input,
            "process.Process/SendSignal": self.rpc_send_signal,
            "process.Process/Update": self.rpc_update,
            "process.Process/CloseStdin": self.rpc_close_stdin,
            "filesystem.Filesystem/Stat": self._fs(self.fs.stat),
            "filesystem.Filesystem/MakeDir": self._fs(self.fs.make_dir),
            "filesystem.Filesystem/Move": self._fs(self.fs.move),
            "filesystem.Filesystem/ListDir": self._fs(self.fs.list_dir),
            "filesystem.Filesystem/Remove": self._fs(self.fs.remove),
            "filesystem.Filesystem/CreateWatcher": self._fs(self.fs.create_watcher),
            "filesystem.Filesystem/GetWatcherEvents": self._fs_no_user(self.fs.get_watcher_events),
            "filesystem.Filesystem/RemoveWatcher": self._fs_no_user(self.fs.remove_watcher),
        }
        self.server_streams: dict[str, StreamHandler] = {
            "process.Process/Start": self.rpc_start,
            "process.Process/Connect": self.rpc_connect,
            "filesystem.Filesystem/WatchDir": self.rpc_watch_dir,
        }
        self.client_streams = {"process.Process/StreamInput"}

    # ---- shared helpers ---------------------------------------------------------------------

    def user(self, name: str, error: Exception) -> User:
        try:
            if name == self.state.default_user:
                return self.rootfs.ensure_user(name)
            return self.rootfs.lookup_user(name)
        except UnknownUser:
            raise error from None
        except OSError as exc:
            raise RpcError("internal", f"creating user '{name}': {exc}") from None

    def token_ok(self, request: Request) -> bool:
        token = self.state.access_token
        if token is None:
            return True
        given = request.headers.get("x-access-token", "")
        return same_secret(given, token)

    def _fs(self, method: Callable[[dict[str, Any], User], dict[str, Any]]) -> UnaryHandler:
        async def handler(ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
            return method(message, ctx.user())

        return handler

    def _fs_no_user(self, method: Callable[[dict[str, Any]], dict[str, Any]]) -> UnaryHandler:
        async def handler(ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
            return method(message)

        return handler

    # ---- ASGI entry -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.requests_total += 1
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            headers[key.decode("latin-1").lower()] = value.decode("latin-1")
        query = scope.get("query_string", b"")
        request = Request(
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(query.decode("latin-1"), keep_blank_values=True) if query else {},
            headers=headers,
            receive=receive,
        )
        try:
            await self._route(request, send)
        except ConnectionError:
            pass
        except Exception:
            log.exception("request failed", extra={"path": request.path})
            with contextlib.suppress(Exception):
                await send_http_error(send, 500, "internal error")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def shutdown(self) -> None:
        self.fs.close()
        await self.processes.shutdown()

    async def _route(self, request: Request, send: Send) -> None:
        path, method = request.path, request.method
        version_header = [(b"x-envd-version", ENVD_VERSION.encode())]
        if path == "/health":
            if method not in ("GET", "HEAD"):
                await send_http_error(send, 405, f"method {method} not allowed on {path}")
                return
            await send_empty(send, 204, version_header)
            return
        if path == "/init":
            if method != "POST":
                await send_http_error(send, 405, f"method {method} not allowed on {path}")
                return
            await self.handle_init(request, send)
            return
        if path == "/files":
            if method == "GET":
                await self.files.download(request, send)
            elif method == "POST":
                await self.files.upload(request, send)
            else:
                await send_http_error(send, 405, f"method {method} not allowed on {path}")
            return
        if not self.token_ok(request):
            await send_http_error(send, 401, "unauthorized access, please provide a valid access token")
            return
        if path == "/aenv/sync":
            if method != "POST":
                await send_http_error(send, 405, f"method {method} not allowed on {path}")
                return
            await self.handle_sync(send)
            return
        if path == "/aenv/reclaim":
            if method == "GET":
                await send_json(send, 200, self._reclaim_status())
            elif method == "POST":
                await self.handle_reclaim(request, send)
            else:
                await send_http_error(send, 405, f"method {method} not allowed on {path}")
            return
        if path == "/envs" and method == "GET":
            await send_json(send, 200, self.state.env_vars)
            return
        if path == "/metrics" and method == "GET":
            await send_json(send, 200, await self.metrics())
            return
        match = _RPC_PATH.match(path)
        if match:
            await self.handle_rpc(request, send, path[1:])
            return
        await send_http_error(send, 404, f"no route {method} {path}")

    # ---- plain routes -----------------------------------------------------------------------

    async def handle_init(self, request: Request, send: Send) -> None:
        extra = [(b"x-envd-version", ENVD_VERSION.encode())]
        try:
            raw = await request.body(MAX_UNARY_BYTES)
            body = json.loads(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (ValueError, RpcError) as exc:
            await send_json(send, 400, {"code": 400, "message": f"malformed /init body: {exc}"}, extra)
            return
        new_token = body.get("accessToken")
        if self.state.access_token is not None and not (
            self.token_ok(request) or (isinstance(new_token, str) and same_secret(new_token, self.state.access_token))
        ):
            await send_json(send, 401, {"code": 401, "message": "unauthorized access: /init needs the current access token"}, extra)
            return
        try:
            env_vars = as_str_map(body.get("envVars"), "envVars")
            default_user = as_str(body.get("defaultUser"), "defaultUser")
            default_workdir = as_str(body.get("defaultWorkdir"), "defaultWorkdir")
            hostname = as_str(body.get("hostname"), "hostname")
            if new_token is not None and not isinstance(new_token, str):
                raise RpcError("invalid_argument", "accessToken must be a string")
            try:
                volume_mounts = mounts.parse(body.get("volumeMounts"))
            except ValueError as exc:
                raise RpcError("invalid_argument", str(exc)) from None
            if volume_mounts and not self.system_changes:
                raise RpcError("invalid_argument", "volumeMounts: this envd does not run in a "
                               "VM, it mounts nothing")
        except RpcError as exc:
            await send_json(send, 400, {"code": 400, "message": exc.message}, extra)
            return
        if new_token and not (self.state.access_token is not None
                              and same_secret(new_token, self.state.access_token)):
            # Before the token takes effect: a code-interpreter server that could not learn it
            # would run anyone's code, so a failure fails the /init (and the create).
            try:
                self._publish_token(new_token)
            except (OSError, RpcError) as exc:
                log.error("publishing the access token failed", extra={"error": str(exc)})
                await send_json(send, 500, {"code": 500, "message": "publishing the access "
                                            f"token for the code interpreter: {exc}"}, extra)
                return
        self.state.env_vars.update(env_vars)
        if new_token:
            self.state.access_token = new_token
        if default_user:
            self.state.default_user = default_user
        if default_workdir:
            self.state.default_workdir = default_workdir
        timestamp = body.get("timestamp")
        if timestamp and self.system_changes:
            self._set_clock(timestamp)
        if hostname and self.system_changes:
            try:
                socket.sethostname(hostname)
            except OSError as exc:
                log.warning("setting the hostname failed", extra={"error": str(exc)})
        if volume_mounts:  # before the answer: the sandbox is handed over with them in place
            try:
                await asyncio.to_thread(mounts.mount_all, volume_mounts)
            except mounts.MountError as exc:
                log.error("volume mount failed", extra={"error": str(exc)})
                # 400: this guest cannot mount it at all (no NFS client), not a failure
                status = 400 if isinstance(exc, mounts.NoNfsClient) else 500
                await send_json(send, status, {"code": status, "message": str(exc)}, extra)
                return
        # Answer first: the runtime waits for this on every resume and fork; the console is slow.
        try:
            await send_empty(send, 204, extra)
        finally:
            log.info("init", extra={"env_vars": len(env_vars), "token_set": bool(new_token)})

    async def handle_sync(self, send: Send) -> None:
        """Before a filesystem-only snapshot (not in E2B's envd): write the defaults /init gave
        (user, workdir, env vars) where the next start of envd on this disk reads them, and
        flush the guest's filesystems, so the disk alone holds what the sandbox wrote."""
        try:
            await asyncio.to_thread(self._save_defaults)
        except OSError as exc:
            await send_json(send, 500, {"code": 500, "message": f"saving envd's defaults: {exc}"})
            return
        if self.rootfs.is_host_root:
            await asyncio.to_thread(os.sync)
        await send_empty(send, 204)

    def _reclaim_status(self) -> dict[str, Any]:
        if not self.system_changes:
            return {"available": False}
        return self.reclaim.status()

    async def handle_reclaim(self, request: Request, send: Send) -> None:
        """Cold memory back to the host (not in E2B's envd; reclaim.py): the guest kernel's
        DAMON pageout scheme. 501 where it cannot be (a kernel without DAMON; an envd that does
        not own the machine)."""
        try:
            body = json.loads(await request.body(MAX_UNARY_BYTES) or b"null")
        except (ValueError, RpcError) as exc:
            await send_http_error(send, 400, f"malformed /aenv/reclaim body: {exc}")
            return
        if not self.system_changes:
            await send_http_error(send, 501, "cold-memory reclaim needs an envd that owns the "
                                             "machine (a VM), not one serving a directory")
            return
        try:
            status = await asyncio.to_thread(self.reclaim.apply, body)
        except ReclaimError as exc:
            await send_http_error(send, exc.status, exc.message)
            return
        self.state.cold_memory = body
        log.info("cold-memory reclaim set", extra={"setting": body})
        await send_json(send, 200, status)

    def _save_defaults(self) -> None:
        path = self.rootfs.host_path(DEFAULTS_FILE)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        saved: dict[str, Any] = {"defaultUser": self.state.default_user,
                                 "defaultWorkdir": self.state.default_workdir,
                                 "envVars": self.state.env_vars}
        if self.state.cold_memory is not None:
            saved["coldMemory"] = self.state.cold_memory
        body = json.dumps(saved)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)

    def _publish_token(self, token: str) -> None:
        """The token's SHA-256 where the code-interpreter server reads it (envd's
        ACCESS_TOKEN_DIGEST_FILE): that server is another process (root's in
        code-interpreter-v1) on a world-readable file, so it gets a digest to check
        X-Access-Token against, not the token. Replaced whole (a reader sees the old
        digest or the new one)."""
        path = self.rootfs.host_path(ACCESS_TOKEN_DIGEST_FILE)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # whatever the umask
            f.write(token_digest(token) + "\n")
        os.replace(tmp, path)

    def _load_defaults(self) -> None:
        """The defaults an earlier envd saved on this disk (/aenv/sync), if any."""
        try:
            path = self.rootfs.host_path(DEFAULTS_FILE)
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            env_vars = as_str_map(saved.get("envVars"), "envVars")
            user = as_str(saved.get("defaultUser"), "defaultUser")
            workdir = as_str(saved.get("defaultWorkdir"), "defaultWorkdir")
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError, RpcError) as exc:
            log.warning("ignoring unreadable saved defaults", extra={"error": str(exc)})
            return
        self.state.env_vars.update(env_vars)
        if user:
            self.state.default_user = user
        if workdir:
            self.state.default_workdir = workdir
        log.info("defaults of the previous boot loaded", extra={"env_vars": len(env_vars)})
        # A cold boot of a filesystem-only pause: the kernel starts without the sandbox's
        # setting, which lived in the memory the pause did not keep.
        cold_memory = saved.get("coldMemory")
        if cold_memory is not None and self.system_changes:
            try:
                self.reclaim.apply(cold_memory)
                self.state.cold_memory = cold_memory
            except ReclaimError as exc:
                log.warning("saved cold-memory setting not applied", extra={"error": exc.message})

    @staticmethod
    def _set_clock(timestamp: Any) -> None:
        try:
            wanted = parse_timestamp(timestamp)
        except ValueError:
            log.warning("ignoring malformed /init timestamp", extra={"timestamp": timestamp})
            return
        drift = wanted - time.time()
        # Catch up whenever behind (after a resume the guest clock lags by the paused time); go
        # back only for a clear error, since the sender's timestamp may be truncated to seconds.
        if drift > CLOCK_BEHIND_TOLERANCE or drift < -CLOCK_AHEAD_TOLERANCE:
            try:
                time.clock_settime(time.CLOCK_REALTIME, wanted)
            except OSError as exc:
                log.warning("setting the clock failed", extra={"error": str(exc)})

    async def metrics(self) -> dict[str, Any]:
        def cpu_times() -> tuple[float, float]:
            with open("/proc/stat") as stat_file:
                values = [float(v) for v in stat_file.readline().split()[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            return sum(values), idle

        previous = self._cpu_sample
        if previous is None:
            previous = cpu_times()
            await asyncio.sleep(0.1)
        current = cpu_times()
        self._cpu_sample = current
        total, idle = current[0] - previous[0], current[1] - previous[1]
        cpu_used_pct = round(100.0 * (1 - idle / total), 2) if total > 0 else 0.0
        meminfo: dict[str, int] = {}
        with open("/proc/meminfo") as mem_file:
            for line in mem_file:
                key, _, rest = line.partition(":")
                meminfo[key] = int(rest.split()[0]) * 1024
        mem_total = meminfo.get("MemTotal", 0)
        mem_available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
        mem_cache = meminfo.get("Cached", 0) + meminfo.get("Buffers", 0)
        mem_used = mem_total - mem_available
        disk = os.statvfs(self.rootfs.root)
        disk_total = disk.f_blocks * disk.f_frsize
        disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": cpu_used_pct,
            "mem_total": mem_total,
            "mem_used": mem_used,
            "mem_cache": mem_cache,
            "mem_total_mib": mem_total // (1024 * 1024),
            "mem_used_mib": mem_used // (1024 * 1024),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }

    # ---- Connect RPC ------------------------------------------------------------------------

    async def handle_rpc(self, request: Request, send: Send, procedure: str) -> None:
        content_type = request.headers.get("content-type", "")
        media_type = content_type.split(";")[0].strip().lower()
        is_stream_request = media_type.startswith("application/connect+")
        if request.method != "POST":
            await send_json(send, 405, {"code": "unimplemented", "message": f"{request.method} is not supported; use POST"}, [(b"allow", b"POST")])
            return
        ctx = RpcContext(self, request)
        if procedure in self.unary:
            if media_type != "application/json":
                await self._unsupported_media(send, content_type, "application/json", is_stream_request)
                return
            await self._serve_unary(ctx, send, self.unary[procedure])
        elif procedure in self.server_streams:
            if media_type != "application/connect+json":
                await self._unsupported_media(send, content_type, "application/connect+json", is_stream_request)
                return
            await self._serve_server_stream(ctx, send, procedure)
        elif procedure in self.client_streams:
            if media_type != "application/connect+json":
                await self._unsupported_media(send, content_type, "application/connect+json", is_stream_request)
                return
            await self._serve_stream_input(ctx, send)
        else:
            error = RpcError("unimplemented", f"unknown procedure /{procedure}")
            if is_stream_request:
                await self._send_stream_error(send, error)
            else:
                await send_json(send, 404, error.to_json())

    async def _unsupported_media(self, send: Send, got: str, expected: str, as_stream: bool) -> None:
        error = RpcError("invalid_argument", f"unsupported content type {got or '(none)'!r}; expected {expected}")
        if as_stream and got.split(";")[0].strip().lower() == "application/connect+json":
            await self._send_stream_error(send, error)
            return
        await send_json(send, 415, error.to_json(), [(b"accept-post", expected.encode())])

    async def _send_stream_error(self, send: Send, error: RpcError) -> None:
        await self._stream_start(send)
        await send({"type": "http.response.body", "body": end_of_stream(error)})

    @staticmethod
    async def _stream_start(send: Send) -> None:
        # Exactly this content type: the Python client rejects a charset parameter on streams.
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/connect+json")],
            }
        )

    async def _serve_unary(self, ctx: RpcContext, send: Send, handler: UnaryHandler) -> None:
        try:
            encoding = ctx.request.headers.get("content-encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise RpcError("unimplemented", f"request compression {encoding!r} is not supported")
            message = parse_message(await ctx.request.body(MAX_UNARY_BYTES))
            response = await handler(ctx, message)
        except RpcError as exc:
            await send_json(send, exc.http_status, exc.to_json())
            return
        except OSError as exc:
            error = RpcError("internal", f"{exc.strerror or exc}")
            await send_json(send, error.http_status, error.to_json())
            return
        await send_json(send, 200, response)

    async def _read_single_envelope(self, ctx: RpcContext) -> dict[str, Any]:
        encoding = ctx.request.headers.get("connect-content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise RpcError("unimplemented", f"request compression {encoding!r} is not supported")
        decoder = EnvelopeDecoder(MAX_UNARY_BYTES)
        messages: list[bytes] = []
        async for chunk in ctx.request.body_chunks():
            for flags, payload in decoder.feed(chunk):
                if not flags & FLAG_END_STREAM:
                    messages.append(payload)
        if decoder.pending:
            raise RpcError("invalid_argument", "request body ends inside an envelope")
        if len(messages) != 1:
            raise RpcError("invalid_argument", f"expected one request message, got {len(messages)}")
        return parse_message(messages[0])

    async def _serve_server_stream(self, ctx: RpcContext, send: Send, procedure: str) -> None:
        try:
            message = await self._read_single_envelope(ctx)
        except RpcError as exc:
            await self._send_stream_error(send, exc)
            return
        handler = self.server_streams[procedure]
        await self._stream_start(send)
        # Start's deadline is the process's lifetime, enforced by the process itself.
        deadline = None if procedure == "process.Process/Start" else ctx.timeout_seconds

        async def pump() -> bytes:
            try:
                async with asyncio.timeout(deadline):
                    async for response in handler(ctx, message):
                        await send({"type": "http.response.body", "body": encode_envelope(response), "more_body": True})
            except RpcError as exc:
                return end_of_stream(exc)
            except TimeoutError:
                return end_of_stream(RpcError("deadline_exceeded", "the stream reached its timeout"))
            except Exception as exc:
                log.exception("stream failed", extra={"procedure": procedure})
                return end_of_stream(RpcError("internal", f"internal error: {exc}"))
            return end_of_stream()

        pump_task = asyncio.ensure_future(pump())
        disconnect_task = asyncio.ensure_future(wait_disconnect(ctx.request.receive))
        done, _ = await asyncio.wait({pump_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            # Wait for the cancel to land: the connection reads its next request right after.
            await _cancel(disconnect_task)
            await send({"type": "http.response.body", "body": pump_task.result()})
        else:
            # The client went away: stop streaming; the process itself keeps running.
            await _cancel(pump_task)

    async def _serve_stream_input(self, ctx: RpcContext, send: Send) -> None:
        error: RpcError | None = None
        try:
            decoder = EnvelopeDecoder(MAX_UNARY_BYTES)
            process = None
            async for chunk in ctx.request.body_chunks():
                for flags, payload in decoder.feed(chunk):
                    if flags & FLAG_END_STREAM:
                        continue
                    message = parse_message(payload)
                    if "start" in message:
                        start = as_object(message["start"], "start")
                        pid, tag = _selector(msg_field(start, "process"))
                        process = self.processes.find_running(pid, tag)
                    elif "data" in message:
                        if process is None:
                            raise RpcError("failed_precondition", "the first StreamInput message must be start")
                        data = as_object(message["data"], "data")
                        await _write_input(process, as_object(msg_field(data, "input"), "input"))
                    elif "keepalive" in message:
                        continue
                    else:
                        raise RpcError("invalid_argument", "StreamInput message has no event")
            if decoder.pending:
                raise RpcError("invalid_argument", "request body ends inside an envelope")
        except RpcError as exc:
            error = exc
        await self._stream_start(send)
        body = end_of_stream(error) if error else encode_envelope({}) + end_of_stream()
        await send({"type": "http.response.body", "body": body})

    # ---- process.Process --------------------------------------------------------------------

    async def rpc_start(self, ctx: RpcContext, message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        config = as_object(msg_field(message, "process"), "process")
        args = msg_field(config, "args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RpcError("invalid_argument", "process.args must be a list of strings")
        cwd = msg_field(config, "cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise RpcError("invalid_argument", "process.cwd must be a string")
        pty_size = None
        pty = msg_field(message, "pty")
        if pty is not None:
            size = as_object(msg_field(as_object(pty, "pty"), "size"), "pty.size")
            cols = as_uint(msg_field(size, "cols"), "pty.size.cols") or DEFAULT_PTY_SIZE[0]
            rows = as_uint(msg_field(size, "rows"), "pty.size.rows") or DEFAULT_PTY_SIZE[1]
            pty_size = (cols, rows)
        tag = msg_field(message, "tag")
        if tag is not None and not isinstance(tag, str):
            raise RpcError("invalid_argument", "tag must be a string")
        stdin = msg_field(message, "stdin")
        spec = ProcessSpec(
            cmd=as_str(msg_field(config, "cmd"), "process.cmd"),
            args=args,
            envs=as_str_map(msg_field(config, "envs"), "process.envs"),
            cwd=cwd,
            tag=tag,
            pty_size=pty_size,
            # Absent means on, for clients older than the field.
            stdin=True if stdin is None else as_bool(stdin, "stdin"),
            user=ctx.user(),
            lifetime_seconds=ctx.timeout_seconds,
        )
        process, subscriber = self.processes.start(spec, self.state.default_workdir)
        try:
            yield {"event": {"start": {"pid": process.pid}}}
            async for event in subscriber.events(ctx.keepalive_seconds):
                yield {"event": event}
        finally:
            process.unsubscribe(subscriber)
        if process.timed_out:
            raise RpcError("deadline_exceeded", f"process {process.pid} ran past its timeout and was killed")

    async def rpc_connect(self, ctx: RpcContext, message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        pid, tag = _selector(msg_field(message, "process"))
        process = self.processes.find(pid, tag)
        if not process.running:
            yield {"event": {"start": {"pid": process.pid}}}
            yield {"event": process.end_event}
            return
        subscriber = process.subscribe()
        try:
            yield {"event": {"start": {"pid": process.pid}}}
            async for event in subscriber.events(ctx.keepalive_seconds):
                yield {"event": event}
        finally:
            process.unsubscribe(subscriber)

    async def rpc_list(self, ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
        processes = [p.info() for p in self.processes.running.values()]
        return {"processes": processes} if processes else {}

    async def rpc_send_input(self, ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
        pid, tag = _selector(msg_field(message, "process"))
        process = self.processes.find_running(pid, tag)
        await _write_input(process, as_object(msg_field(message, "input"), "input"))
        return {}

    async def rpc_send_signal(self, ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
        pid, tag = _selector(msg_field(message, "process"))
        raw = msg_field(message, "signal")
        signals = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM, 9: signal.SIGKILL, 15: signal.SIGTERM}
        if raw in (None, 0, "SIGNAL_UNSPECIFIED"):
            raise RpcError("unimplemented", "signal is unspecified")
        if raw not in signals:
            raise RpcError("invalid_argument", f"unsupported signal {raw!r}")
        process = self.processes.find_running(pid, tag)
        signum = signals[raw]
        process.signal(signum)
        if signum == signal.SIGKILL:
            # Once a kill returns the process is gone: listed no more, a second kill finds nothing.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.exited.wait(), SIGKILL_WAIT_SECONDS)
        return {}

    async def rpc_update(self, ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
        pid, tag = _selector(msg_field(message, "process"))
        process = self.processes.find_running(pid, tag)
        pty = msg_field(message, "pty")
        if pty is not None:
            size = as_object(msg_field(as_object(pty, "pty"), "size"), "pty.size")
            cols = as_uint(msg_field(size, "cols"), "pty.size.cols")
            rows = as_uint(msg_field(size, "rows"), "pty.size.rows")
            if not cols or not rows:
                raise RpcError("invalid_argument", "pty size needs cols and rows")
            process.resize(cols, rows)
        return {}

    async def rpc_close_stdin(self, ctx: RpcContext, message: dict[str, Any]) -> dict[str, Any]:
        pid, tag = _selector(msg_field(message, "process"))
        self.processes.find_running(pid, tag).close_stdin()
        return {}

    # ---- filesystem.Filesystem streams ------------------------------------------------------

    async def rpc_watch_dir(self, ctx: RpcContext, message: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        watcher = self.fs.open_watcher(message, ctx.user())
        async for event in watcher.stream(ctx.keepalive_seconds):
            yield event


def parse_timestamp(value: Any) -> float:
    """An RFC 3339 time as sent in /init (nanoseconds, `Z`), in seconds since the epoch.
    Raises ValueError when malformed."""
    text = str(value).replace("Z", "+00:00")
    # Python 3.11 parses at most microseconds; Go sends nanoseconds. Cut with string operations:
    # a regex here would be compiled on the first /init after every restore (see httpserver.py).
    head, dot, tail = text.partition(".")
    digits = len(tail) - len(tail.lstrip("0123456789"))
    if dot and digits > 6:
        text = f"{head}.{tail[:6]}{tail[digits:]}"
    return datetime.fromisoformat(text).timestamp()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _selector(value: Any) -> tuple[int | None, str | None]:
    selector = as_object(value, "process")
    if "pid" in selector:
        return as_uint(selector["pid"], "process.pid"), None
    if "tag" in selector:
        return None, as_str(selector["tag"], "process.tag")
    raise RpcError("invalid_argument", "process selector needs a pid or a tag")


async def _write_input(process: Any, process_input: dict[str, Any]) -> None:
    if "pty" in process_input:
        await process.write_input(decode_bytes(process_input["pty"], "input.pty"), to_pty=True)
    elif "stdin" in process_input:
        await process.write_input(decode_bytes(process_input["stdin"], "input.stdin"), to_pty=False)
    else:
        raise RpcError("invalid_argument", "input needs stdin or pty bytes")


__all__ = ["Envd", "EnvdConfig", "HttpError"]

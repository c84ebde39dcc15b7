"""The host's client of envd (the E2B envd protocol, Connect JSON codec): every call the host
makes to a guest's envd goes through here.

- `/health` and `/init` (env vars, access token, default user, the host's clock): the node
  after it starts a sandbox (node/orchestrator.py), template builds (template/build.py), and,
  for the body and headers of `/init`, the VM runtime (runtime/vm.py, which sends it itself
  because it races the request against its QEMU's exit).
- `/aenv/sync` (a filesystem-only pause: node/vm_backend) and the ready pools' warm-up calls
  (node/ready_pool.py: `/health`, a `Stat`, a command).
- `/aenv/reclaim`: a template's cold-memory setting (`ColdMemory`: a DAMON scheme in the guest
  kernel that pages out what no one touches; guest/envd/reclaim.py), set by template builds
  before their snapshot.
- what the SDKs speak (docs/e2b-api.md §3), for template builds and the CLI:
  `process.Process/Start` as a server stream of envelopes, unary `process.Process/List` and
  `filesystem.Filesystem/MakeDir`, `POST /files` (a file streamed as application/octet-stream).
  Users are chosen per call with `Authorization: Basic base64(user:)`, as the SDKs do.

Whatever answers on a guest's envd port is the guest's: root in the VM can replace envd with a
server of its own. So no answer is ever read whole: `read_reply` reads at most
AENV_ENVD_MAX_REPLY_BYTES within a total deadline (a reply of endless bytes, or one dripping
a byte a second, ends with GuestReplyError), and a Connect envelope is refused past the same
size before its payload is buffered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentenv import boundedjson
from agentenv.errors import AgentEnvError
from agentenv.settings import setting_text

FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
_UPLOAD_CHUNK = 1 << 20
#: bytes the host reads of one envd answer, or of one envelope of a stream (default 4 MiB)
MAX_REPLY_BYTES_ENV = "AENV_ENVD_MAX_REPLY_BYTES"
#: where envd takes its identity (env vars, token, defaults, clock); only the host may call it
INIT_PATH = "/init"
#: seconds of silence after which envd sends a process stream a keepalive (asked per call)
KEEPALIVE_SECONDS = 30
#: seconds a process stream may bring nothing, not even a keepalive: the guest stopped answering
IDLE_READ_SECONDS = 120.0
#: seconds past a process's own timeout (which envd enforces) after which the host ends its
#: stream whatever the guest says
PROCESS_DEADLINE_GRACE_SECONDS = 30.0


def init_body(*, env_vars: dict[str, str] | None = None, access_token: str | None = None,
              default_user: str | None = None, default_workdir: str | None = None,
              now: float | None = None,
              volume_mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON body of `POST /init`; the timestamp (ms) sets the guest's clock, which stood
    still while a snapshot slept. `volume_mounts` (our extension, docs/volumes.md §6): the
    volume disks envd mounts before it answers, `[{serial, path, readOnly}]`."""
    now = time.time() if now is None else now
    body: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        + f".{int(now * 1000) % 1000:03d}Z",
    }
    if env_vars:
        body["envVars"] = env_vars
    if access_token:
        body["accessToken"] = access_token
    if default_user:
        body["defaultUser"] = default_user
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    if volume_mounts:
        body["volumeMounts"] = volume_mounts
    return body


class Watermarks(BaseModel):
    """Free memory (per mille of the guest's RAM) between which the reclaim works: it stops
    above `high` and below `low` (where the kernel's own reclaim is at work), and starts again
    once free memory falls under `mid`. The default keeps it always on: the point is the host's
    memory, not the guest's pressure."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    high: int = Field(default=1000, ge=0, le=1000)
    mid: int = Field(default=999, ge=0, le=1000)
    low: int = Field(default=0, ge=0, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> Watermarks:
        if not self.high >= self.mid >= self.low:
            raise ValueError(f"watermarks must be high >= mid >= low, got {self.high}, "
                             f"{self.mid}, {self.low}")
        return self


class ColdMemory(BaseModel):
    """A template's cold-memory setting: a DAMON scheme in the guest kernel pages out memory no
    one touched for `minAgeSeconds` (page cache; anonymous memory when the guest has swap) and
    free-page reporting returns the freed pages to the host (docs/templates.md, "Cold
    memory"). Set in the template's VM before its snapshot, so every sandbox restored from it
    runs with it. `reclaim: false` keeps every page the guest cached (a workload that needs
    its cache hot)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    reclaim: bool = True
    minAgeSeconds: float = Field(default=30.0, ge=1, le=86400)
    #: at most this much memory paged out per second...
    quotaMBPerSecond: int = Field(default=256, ge=1, le=65536)
    #: ...and at most this much guest CPU time spent on it per second (ms; DAMON turns it
    #: into a size quota from the throughput it measures)
    quotaCpuMsPerSecond: int = Field(default=100, ge=1, le=1000)
    watermarks: Watermarks = Field(default_factory=Watermarks)
    #: how often DAMON checks a region for access, and how often it ages and re-splits them.
    #: Each sample wakes the guest: an idle TCG guest's QEMU uses 1.4-1.7% of a core without
    #: reclaim, 2.4-2.6% at 100/2000 ms, 3.4-3.7% at 50/1000, 9.2% at DAMON's 5/100
    #: (bench/RESULTS.md).
    sampleMs: int = Field(default=100, ge=1, le=60_000)
    aggregationMs: int = Field(default=2000, ge=1, le=600_000)

    @model_validator(mode="after")
    def _intervals(self) -> ColdMemory:
        if self.aggregationMs < self.sampleMs:
            raise ValueError(f"aggregationMs ({self.aggregationMs}) must be at least sampleMs "
                             f"({self.sampleMs})")
        if self.minAgeSeconds * 1000 < self.aggregationMs:
            raise ValueError(f"minAgeSeconds ({self.minAgeSeconds:g}) must be at least one "
                             f"aggregation interval ({self.aggregationMs} ms)")
        return self

    @classmethod
    def off(cls) -> ColdMemory:
        return cls(reclaim=False)

    def wire(self) -> dict[str, Any]:
        """The body of envd's `POST /aenv/reclaim`."""
        return {"enabled": self.reclaim, "minAgeSeconds": self.minAgeSeconds,
                "quotaMBPerSecond": self.quotaMBPerSecond,
                "quotaCpuMsPerSecond": self.quotaCpuMsPerSecond,
                "watermarks": self.watermarks.model_dump(), "sampleMs": self.sampleMs,
                "aggregationMs": self.aggregationMs}


def init_headers(current_token: str | None) -> dict[str, str]:
    """Once envd holds a token, `/init` needs it (a new token in the body alone is refused
    unless it is the same one)."""
    return {"X-Access-Token": current_token} if current_token else {}


def output_limit() -> int:
    """Characters of a process's stdout (and of its stderr) kept: the last ones. A build step
    may print gigabytes; its end is what explains a failure. AENV_BUILD_OUTPUT_TAIL, 1 MiB."""
    raw = setting_text("AENV_BUILD_OUTPUT_TAIL")
    try:
        value = int(raw) if raw else 1 << 20
    except ValueError:
        raise EnvdClientError(f"AENV_BUILD_OUTPUT_TAIL must be a number of characters, "
                              f"got {raw!r}") from None
    return max(value, 1)


class _Tail:
    """The last `limit` characters of a stream of text."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0

    def append(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)
        while self.size - len(self.parts[0]) >= self.limit:
            self.size -= len(self.parts.pop(0))

    def text(self) -> str:
        return "".join(self.parts)[-self.limit:]


class EnvdClientError(AgentEnvError):
    """envd refused a call or the connection to it broke."""


class EnvdUnsupported(EnvdClientError):
    """envd cannot do what was asked: 501 (e.g. its kernel lacks it) or 404 (an older envd)."""


class GuestReplyError(EnvdClientError):
    """What answered on the guest's envd port broke a bound: an answer too large, not over in
    time, or in an encoding the host did not ask for."""


class GuestReplyTimeout(GuestReplyError):
    """No complete answer within the call's total time (a poll may try again)."""


def reply_limit() -> int:
    """Bytes of one envd answer (and of one stream envelope) the host reads at most."""
    raw = setting_text(MAX_REPLY_BYTES_ENV)
    try:
        value = int(raw) if raw else 4 << 20
    except ValueError:
        raise EnvdClientError(f"{MAX_REPLY_BYTES_ENV} must be a number of bytes, "
                              f"got {raw!r}") from None
    if value <= 0:
        raise EnvdClientError(f"{MAX_REPLY_BYTES_ENV} must be positive, got {raw!r}")
    return value


@dataclass(frozen=True)
class Reply:
    """An envd answer read within its bounds."""

    status_code: int
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return boundedjson.loads(self.content, "envd's answer")


async def _read_limited(answer: httpx.Response, what: str, limit: int) -> bytes:
    """The raw body of `answer`, refused past `limit` bytes (before they are all held)."""
    encoding = answer.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):
        raise GuestReplyError(f"{what}: the answer came with Content-Encoding {encoding!r} "
                              "(only identity was accepted)")
    declared = answer.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise GuestReplyError(f"{what}: the answer announces {declared} bytes, over the "
                              f"limit of {limit} ({MAX_REPLY_BYTES_ENV})")
    body = bytearray()
    async for chunk in answer.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise GuestReplyError(f"{what}: the answer is over the limit of {limit} bytes "
                                  f"({MAX_REPLY_BYTES_ENV})")
    return bytes(body)


async def read_reply(http: httpx.AsyncClient, method: str, url: str, *, what: str,
                     timeout: float, connect_timeout: float = 5.0,
                     headers: dict[str, str] | None = None, **kwargs: Any) -> Reply:
    """`method url` answered and read whole, but never more than reply_limit() bytes and never
    longer than `timeout` seconds in all (a per-read timeout alone lets a slow drip go on
    forever). Raises GuestReplyError naming `what` when a bound is hit, httpx.HTTPError when
    the connection fails; nothing is held once it returns or raises."""
    limit = reply_limit()
    headers = {**(headers or {}), "Accept-Encoding": "identity"}
    per_read = httpx.Timeout(timeout, connect=min(connect_timeout, timeout))
    try:
        async with asyncio.timeout(timeout):
            async with http.stream(method, url, headers=headers, timeout=per_read,
                                   **kwargs) as answer:
                return Reply(answer.status_code, await _read_limited(answer, what, limit))
    except TimeoutError:
        raise GuestReplyTimeout(f"{what}: no complete answer within {timeout:g} s") from None


@dataclass
class ProcessResult:
    pid: int
    exit_code: int
    exited: bool  # False: killed by a signal
    status: str
    stdout: str
    stderr: str


def _envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


def _basic(user: str | None) -> dict[str, str]:
    if not user:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


class _Envelopes:
    """Splits a byte stream into (flags, JSON message) envelopes."""

    def __init__(self, limit: int) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, chunk: bytes) -> list[tuple[int, dict[str, Any]]]:
        self._buffer += chunk
        out: list[tuple[int, dict[str, Any]]] = []
        while len(self._buffer) >= _HEADER.size:
            flags, size = _HEADER.unpack_from(self._buffer)
            if size > self._limit:
                # refused from its header: the payload is never gathered
                raise GuestReplyError(f"envd sent a stream message of {size} bytes, over the "
                                      f"limit of {self._limit} ({MAX_REPLY_BYTES_ENV})")
            if len(self._buffer) < _HEADER.size + size:
                break
            payload = bytes(self._buffer[_HEADER.size:_HEADER.size + size])
            del self._buffer[:_HEADER.size + size]
            message: Any = {}
            if payload:
                try:
                    message = boundedjson.loads(payload, "envd's stream message")
                except ValueError as exc:
                    raise GuestReplyError(f"envd sent a stream message that is not JSON: "
                                          f"{str(exc)[:200]}") from exc
                if not isinstance(message, dict):
                    raise GuestReplyError("envd sent a stream message that is not a JSON "
                                          "object")
            out.append((flags, message))
        return out


class EnvdClient:
    """One envd (a VM's `http://<guest>:49983`), optionally with an access token."""

    def __init__(self, base_url: str, access_token: str | None = None,
                 timeout: float = 30.0, headers: dict[str, str] | None = None, *,
                 http: httpx.AsyncClient | None = None) -> None:
        """`headers` go with every request (e.g. E2b-Sandbox-Id through a node's proxy);
        `http`: a client shared with other calls (not closed by close())."""
        self.base_url = base_url.rstrip("/")
        self.access_token = access_token
        self.extra_headers = dict(headers or {})
        self.timeout = timeout
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),
                                               trust_env=False)

    async def close(self) -> None:
        if self._own_http:
            await self._http.aclose()

    def _headers(self, user: str | None = None) -> dict[str, str]:
        headers = {**self.extra_headers, **_basic(user)}
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        return headers

    async def _reply(self, method: str, path: str, *, timeout: float,
                     headers: dict[str, str], **kwargs: Any) -> Reply:
        """`method path` read within read_reply's bounds; a connection that fails is an
        EnvdClientError naming the path."""
        try:
            return await read_reply(self._http, method, self.base_url + path,
                                    what=f"envd {path}", timeout=timeout, headers=headers,
                                    **kwargs)
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"envd {path} failed: {exc!r}") from exc

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Return once `/health` answers (polled quickly at first: a sandbox's envd is usually
        up within milliseconds); EnvdClientError with the last problem after `timeout`."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        last = "no answer"
        while True:
            try:
                answer = await read_reply(self._http, "GET", self.base_url + "/health",
                                          what="envd /health", timeout=2.0,
                                          headers=self.extra_headers)
                if answer.is_success:
                    return
                last = f"HTTP {answer.status_code}"
            except (httpx.HTTPError, GuestReplyTimeout) as exc:
                last = str(exc) or type(exc).__name__
            if time.monotonic() > deadline:
                raise EnvdClientError(f"envd at {self.base_url} is not healthy: {last}")
            await asyncio.sleep(delay)
            # At most 25 ms between polls: a local /health is cheap, and with steps of up to
            # 200 ms an envd ready a few ms later cost a create a whole step (bench/RESULTS.md).
            delay = min(delay * 1.5, 0.025)

    async def health(self, timeout: float = 5.0) -> None:
        """One `GET /health`; EnvdClientError unless it answers 2xx."""
        answer = await self._reply("GET", "/health", timeout=timeout, headers=self.extra_headers)
        if not answer.is_success:
            raise EnvdClientError(f"envd /health answered {answer.status_code}")

    async def sync(self, timeout: float) -> None:
        """`POST /aenv/sync`: envd flushes the guest's file systems (before a filesystem-only
        pause); EnvdClientError unless it answers 204 within `timeout`."""
        answer = await self._reply("POST", "/aenv/sync", timeout=timeout, headers=self._headers())
        if answer.status_code != 204:
            raise EnvdClientError(f"envd answered /aenv/sync with {answer.status_code}: "
                                  f"{answer.text[:200]}")

    async def init(self, *, env_vars: dict[str, str] | None = None,
                   access_token: str | None = None, default_user: str | None = None,
                   default_workdir: str | None = None) -> None:
        """`POST /init`; `access_token` becomes envd's token (the client's own one, if any,
        authorises the call)."""
        body = init_body(env_vars=env_vars, access_token=access_token,
                         default_user=default_user, default_workdir=default_workdir)
        headers = {**self.extra_headers, **init_headers(self.access_token)}
        answer = await self._reply("POST", INIT_PATH, timeout=self.timeout, json=body,
                                   headers=headers)
        if not answer.is_success:
            raise EnvdClientError(f"envd /init answered {answer.status_code}: {answer.text[:300]}")

    async def set_cold_memory(self, setting: ColdMemory) -> dict[str, Any]:
        """`POST /aenv/reclaim`: the guest kernel's reclaim of cold memory as `setting` says;
        returns the kernel's view (the scheme, what it reclaimed so far). EnvdUnsupported when
        the guest cannot (a kernel without DAMON, an envd that is not in a VM, or one from
        before the route: a template built from an old template)."""
        return await self._reclaim("POST", setting.wire())

    async def cold_memory(self) -> dict[str, Any]:
        """`GET /aenv/reclaim`: the reclaim scheme and its counters in the guest."""
        return await self._reclaim("GET", None)

    async def _reclaim(self, method: str, body: dict[str, Any] | None) -> dict[str, Any]:
        answer = await self._reply(method, "/aenv/reclaim", timeout=self.timeout, json=body,
                                   headers=self._headers())
        if answer.status_code in (404, 501):  # 404: an envd older than the route
            raise EnvdUnsupported(f"envd /aenv/reclaim answered {answer.status_code}: "
                                  f"{answer.text[:300]}")
        if not answer.is_success:
            raise EnvdClientError(f"envd /aenv/reclaim answered {answer.status_code}: "
                                  f"{answer.text[:300]}")
        return _json_object(answer, "envd /aenv/reclaim")

    async def metrics(self, timeout: float = 2.0) -> dict[str, Any]:
        """envd's `GET /metrics`: the guest's own view (memory used and cached, its disk)."""
        answer = await self._reply("GET", "/metrics", timeout=timeout, headers=self._headers())
        if not answer.is_success:
            raise EnvdClientError(f"envd /metrics answered {answer.status_code}")
        return _json_object(answer, "envd /metrics")

    async def send_pty(self, pid: int, data: bytes) -> None:
        """Type `data` into the terminal of process `pid` (started with a pty)."""
        await self._unary("process.Process/SendInput",
                          {"process": {"pid": pid},
                           "input": {"pty": base64.b64encode(data).decode()}}, None)

    async def _unary(self, procedure: str, message: dict[str, Any], user: str | None
                     ) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Connect-Protocol-Version": "1",
                   **self._headers(user)}
        try:
            answer = await read_reply(self._http, "POST", f"{self.base_url}/{procedure}",
                                      what=f"envd {procedure}", timeout=self.timeout,
                                      content=json.dumps(message), headers=headers)
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"envd {procedure} failed: {exc}") from exc
        try:
            body = answer.json()
        except ValueError as exc:
            if answer.status_code == 200:
                raise EnvdClientError(f"envd {procedure}: the answer is not JSON: "
                                      f"{str(exc)[:200]}") from exc
            body = {"message": answer.text[:300]}
        if answer.status_code != 200:
            if not isinstance(body, dict):
                body = {"message": answer.text[:300]}
            raise EnvdClientError(f"envd {procedure}: {body.get('code', answer.status_code)}: "
                                  f"{body.get('message', '')}")
        return body if isinstance(body, dict) else {}

    async def stat(self, path: str, user: str | None = None) -> dict[str, Any]:
        """`filesystem.Filesystem/Stat` of `path`: its entry as envd describes it."""
        return await self._unary("filesystem.Filesystem/Stat", {"path": path}, user)

    async def make_dir(self, path: str, user: str | None = None) -> bool:
        """True if the directory was made, False if it existed."""
        try:
            await self._unary("filesystem.Filesystem/MakeDir", {"path": path}, user)
        except EnvdClientError as exc:
            if "already_exists" in str(exc):
                return False
            raise
        return True

    async def running_pids(self) -> set[int]:
        body = await self._unary("process.Process/List", {}, None)
        return {int(p.get("pid", 0)) for p in body.get("processes", [])}

    async def upload(self, path: str, data: bytes, user: str | None = None) -> None:
        """Write `data` to `path` in the guest (POST /files, multipart)."""
        params = {"path": path}
        if user:
            params["username"] = user
        try:
            answer = await read_reply(self._http, "POST", self.base_url + "/files",
                                      what=f"uploading {path}", timeout=300.0, params=params,
                                      files={"file": ("upload", data)}, headers=self._headers())
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"uploading {path}: {exc}") from exc
        if not answer.is_success:
            raise EnvdClientError(f"uploading {path}: envd answered {answer.status_code}: "
                                  f"{answer.text[:300]}")

    async def upload_file(self, path: str, source: Path, user: str | None = None) -> None:
        """Stream the host file `source` to `path` in the guest (octet-stream POST /files),
        1 MiB at a time: an archive of any size costs the node no more memory than that."""
        size = source.stat().st_size
        params = {"path": path}
        if user:
            params["username"] = user

        async def chunks() -> AsyncIterator[bytes]:
            with open(source, "rb") as f:
                while block := await asyncio.to_thread(f.read, _UPLOAD_CHUNK):
                    yield block

        headers = {**self._headers(), "Content-Type": "application/octet-stream",
                   "Content-Length": str(size)}
        try:
            # the whole exchange within a deadline: 300 s, plus a second per 256 KiB sent
            answer = await read_reply(self._http, "POST", self.base_url + "/files",
                                      what=f"uploading {path}", timeout=300.0 + (size >> 18),
                                      params=params, content=chunks(), headers=headers)
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"uploading {path}: {exc}") from exc
        if not answer.is_success:
            raise EnvdClientError(f"uploading {path}: envd answered {answer.status_code}: "
                                  f"{answer.text[:300]}")

    async def download_file(self, path: str, dest: Path, limit: int,
                            user: str | None = None) -> int:
        """Stream the guest file `path` (GET /files) into the host file `dest`; its size.
        What the guest sends is bounded: past `limit` bytes the download stops
        (EnvdClientError), and it ends within a deadline (300 s plus a second per 256 KiB of
        `limit`) whatever the guest does."""
        params = {"path": path, **({"username": user} if user else {})}
        size = 0
        try:
            async with asyncio.timeout(300.0 + (limit >> 18)), self._http.stream(
                    "GET", self.base_url + "/files", params=params, headers=self._headers(),
                    timeout=httpx.Timeout(None, read=IDLE_READ_SECONDS, connect=5.0)) as answer:
                if answer.status_code != 200:
                    text = (await _read_limited(answer, f"downloading {path}", 4096)).decode(
                        errors="replace")
                    raise EnvdClientError(f"downloading {path}: envd answered "
                                          f"{answer.status_code}: {text[:300]}")
                with open(dest, "wb") as out:
                    async for chunk in answer.aiter_bytes():  # counted as decoded
                        size += len(chunk)
                        if size > limit:
                            raise EnvdClientError(f"downloading {path}: more than {limit} bytes")
                        await asyncio.to_thread(out.write, chunk)
        except TimeoutError:
            raise GuestReplyError(f"downloading {path} did not end in time") from None
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"downloading {path}: {exc}") from exc
        return size

    async def run(
        self,
        cmd: str,
        args: list[str],
        *,
        user: str | None = None,
        cwd: str | None = None,
        envs: dict[str, str] | None = None,
        timeout: float | None = None,
        on_output: Callable[[str, str], None] | None = None,
        tag: str | None = None,
        background: bool = False,
        pty_size: tuple[int, int] | None = None,
        on_pty: Callable[[bytes], None] | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> ProcessResult:
        """Start a process and (unless `background`) follow it to its end.

        `on_output(stream, text)` gets stdout/stderr chunks as they arrive. With `background`,
        returns right after the start event (exit_code -1, exited False); the process keeps
        running in the guest after the stream is closed. With `pty_size` (cols, rows) the
        process gets a terminal: `on_pty` receives its raw output, `send_pty` feeds it and
        `on_start(pid)` says which pid to feed."""
        process: dict[str, Any] = {"cmd": cmd, "args": args, "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        message: dict[str, Any] = {"process": process, "stdin": False}
        if tag:
            message["tag"] = tag
        if pty_size:
            message["pty"] = {"size": {"cols": pty_size[0], "rows": pty_size[1]}}
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                   "Connect-Content-Encoding": "identity",
                   "Connect-Accept-Encoding": "identity", "Accept-Encoding": "identity",
                   **self._headers(user)}
        if timeout:
            headers["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        pid = 0
        # Only the tail of each stream is kept (on_output sees everything as it comes).
        out, err = _Tail(output_limit()), _Tail(output_limit())
        end: dict[str, Any] | None = None
        decoder = _Envelopes(reply_limit())
        # A process may print nothing for hours (a build step, a terminal): envd sends a
        # keepalive every KEEPALIVE_SECONDS of silence, so a stream with nothing for
        # IDLE_READ_SECONDS is a guest that stopped answering, and no call waits on it forever.
        headers["Keepalive-Ping-Interval"] = str(KEEPALIVE_SECONDS)
        stream_timeout = httpx.Timeout(None, read=IDLE_READ_SECONDS, connect=5.0)
        # envd ends the process at Connect-Timeout-Ms; the host does not take its word for it
        deadline = timeout + PROCESS_DEADLINE_GRACE_SECONDS if timeout else None
        try:
            async with asyncio.timeout(deadline), self._http.stream("POST", f"{self.base_url}/process.Process/Start",
                                         content=_envelope(message), headers=headers,
                                         timeout=stream_timeout) as answer:
                if answer.status_code != 200:
                    text = (await _read_limited(answer, "envd Start", reply_limit())).decode(
                        errors="replace")
                    raise EnvdClientError(f"envd Start answered {answer.status_code}: {text[:300]}")
                encoding = answer.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("identity", ""):
                    raise GuestReplyError(f"envd Start answered with Content-Encoding "
                                          f"{encoding!r} (only identity was accepted)")
                async for chunk in answer.aiter_raw():
                    for flags, msg in decoder.feed(chunk):
                        if flags & FLAG_END_STREAM:
                            error = msg.get("error")
                            if error:
                                raise EnvdClientError(f"{error.get('code')}: {error.get('message')}")
                            continue
                        event = msg.get("event") or {}
                        if "start" in event:
                            pid = int(event["start"].get("pid", 0))
                            if on_start is not None:
                                on_start(pid)
                            if background:
                                return ProcessResult(pid, -1, False, "running", "", "")
                        elif "data" in event and "pty" in event["data"]:
                            if on_pty is not None:
                                on_pty(base64.b64decode(event["data"]["pty"]))
                        elif "data" in event:
                            for stream, sink in (("stdout", out), ("stderr", err)):
                                raw = event["data"].get(stream)
                                if raw:
                                    text = base64.b64decode(raw).decode(errors="replace")
                                    sink.append(text)
                                    if on_output is not None:
                                        on_output(stream, text)
                        elif "end" in event:
                            end = event["end"]
        except httpx.ReadTimeout:
            raise GuestReplyTimeout(f"process {pid}: envd sent nothing, not even a keepalive, "
                                    f"for {IDLE_READ_SECONDS:g} s") from None
        except httpx.HTTPError as exc:
            raise EnvdClientError(f"envd Start failed: {exc}") from exc
        except TimeoutError:
            raise GuestReplyError(f"process {pid} did not end within {deadline:g} s "
                                  f"(its timeout was {timeout:g} s)") from None
        if end is None:
            raise EnvdClientError(f"process {pid} ended without an end event")
        return ProcessResult(pid, int(end.get("exitCode", end.get("exit_code", 0)) or 0),
                             bool(end.get("exited", False)), str(end.get("status", "")),
                             out.text(), err.text())


def _json_object(answer: httpx.Response, what: str) -> dict[str, Any]:
    """The JSON object an envd route answered, else an error naming the route."""
    try:
        body = answer.json()
    except ValueError as exc:
        raise EnvdClientError(f"{what} answered no JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise EnvdClientError(f"{what} answered no object")
    return body

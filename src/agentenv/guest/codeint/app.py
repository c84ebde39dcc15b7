"""The code-interpreter protocol as an ASGI app (served by envd's HttpServer):

    GET    /health                   200 once the default contexts are up
    POST   /aenv/warm                204 after a hidden cell in each default context (ours, not
                                     E2B's: the node's ready pool calls it on a restored VM, so
                                     that a create's first run_code does not fault in the
                                     server's and the kernels' memory)
    POST   /execute                  {code, language?, context_id?, env_vars?, timeout?}:
                                     NDJSON lines stdout/stderr/result/error/
                                     number_of_executions, then end_of_execution
    POST   /contexts                 {language?, cwd?} -> {id, language, cwd}
    GET    /contexts                 [{id, language, cwd}...]
    POST   /contexts/{id}/restart
    DELETE /contexts/{id}

A cell is interrupted when its `timeout` (seconds) runs out or the client goes away (the SDKs
close the connection at their own execution timeout); the context stays usable.

In a secure sandbox (envd has an access token) the server takes envd's token too, in
X-Access-Token: /execute and /aenv/warm need it (401 without); the context routes check one
that is given but let a request without it through, since the E2B Code Interpreter SDKs send
it with run_code only; GET /health is open. The server learns the token as a SHA-256 envd
writes at /init (envd.ACCESS_TOKEN_DIGEST_FILE), read at each request: a fork's or a
snapshot's new token holds from its /init on.

The sandbox's own env vars (Sandbox.create's `envs`, which envd holds from /init) are set in a
context's kernel before its first cell, as E2B's server does: read from envd's GET /envs with
the caller's X-Access-Token, once per kernel (the default kernels are started in the template,
before any sandbox's envs exist). A per-call env var of the same name is put back to the
sandbox's value after its cell.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from agentenv.guest.codeint.kernels import LANGUAGES, Context, dumps, normalize_language
from agentenv.guest.envd import ACCESS_TOKEN_DIGEST_FILE
from agentenv.guest.envd import DEFAULT_PORT as ENVD_PORT

log = logging.getLogger("codeint")

MAX_BODY_BYTES = 16 << 20
DEFAULT_LANGUAGE = "python"
# Started with the server, before its port opens (so they are warm in the template's snapshot).
# TypeScript, R and Java start on their first cell (docs/templates.md §6 has their start times).
WARM_LANGUAGES = ("python", "javascript", "bash")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: contexts a client may create (each is a kernel process): the context routes take no token
#: from the SDKs, so without a cap anyone who knows a sandbox id could fill its memory
MAX_CONTEXTS = 64
#: (method, path) that run code: a secure sandbox's token is required there
TOKEN_REQUIRED = {("POST", "/execute"), ("POST", "/aenv/warm")}
UNAUTHORIZED = "unauthorized access, please provide a valid access token (X-Access-Token)"
#: envd's route for the sandbox's env vars (in the same guest)
ENVD_ENVS_URL = f"http://127.0.0.1:{ENVD_PORT}/envs"
ENVD_ENVS_TIMEOUT = 5.0


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json(receive: Receive) -> Any:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(400, "client went away")
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise HttpError(413, "request body too large")
        if not message.get("more_body", False):
            break
    if not body.strip():
        return {}
    try:
        return json.loads(body)
    except ValueError as exc:
        raise HttpError(400, f"invalid JSON: {exc}") from exc


async def respond(send: Send, status: int, payload: Any = None) -> None:
    body = b"" if payload is None else json.dumps(payload).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    if payload is not None:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AccessToken:
    """envd's access token as this server checks it: by the SHA-256 envd writes at /init."""

    def __init__(self, digest_file: str) -> None:
        self.digest_file = digest_file

    def digest(self) -> bytes | None:
        """The token's SHA-256, None when the sandbox has none (no file). Read each time: a
        tmpfs file of 65 bytes, and /init may change it under a running server."""
        try:
            with open(self.digest_file, encoding="ascii") as f:
                text = f.read(200).strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            # there is a token but it cannot be known: refuse rather than run anyone's code
            log.error("access token digest unreadable: %s", exc)
            raise HttpError(503, "the access token cannot be checked") from None
        try:
            digest = bytes.fromhex(text)
        except ValueError:
            digest = b""
        if len(digest) != hashlib.sha256().digest_size:
            log.error("access token digest malformed in %s", self.digest_file)
            raise HttpError(503, "the access token cannot be checked")
        return digest

    def check(self, given: list[bytes], required: bool) -> bool:
        """Whether a request with these X-Access-Token values may go on: with no token set,
        always; else with exactly one value, the token (a missing one only if not required)."""
        digest = self.digest()
        if digest is None or (not given and not required):
            return True
        if len(given) != 1:
            return False
        return hmac.compare_digest(hashlib.sha256(given[0]).digest(), digest)


def read_sandbox_env(url: str, token: bytes | None) -> dict[str, str] | None:
    """envd's GET /envs, as the caller's token lets it; None when it cannot be read (the
    cell runs without them, a later one tries again)."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("X-Access-Token", token.decode("latin-1"))
    try:
        with urllib.request.urlopen(request, timeout=ENVD_ENVS_TIMEOUT) as answer:
            envs = json.loads(answer.read(1 << 20))
    except (OSError, ValueError) as exc:  # urllib.error.URLError is an OSError
        log.warning("the sandbox's env vars could not be read from envd: %s", exc)
        return None
    if not isinstance(envs, dict):
        log.warning("envd's /envs is not an object: %r", type(envs))
        return None
    return {str(k): str(v) for k, v in envs.items()}


def language_of(body: dict[str, Any]) -> str:
    try:
        return normalize_language(body.get("language") or DEFAULT_LANGUAGE)
    except ValueError as exc:
        raise HttpError(400, str(exc)) from exc


class CodeApp:
    def __init__(self, default_cwd: str, prepare_java: bool = False) -> None:
        self.default_cwd = default_cwd
        self.prepare_java = prepare_java
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, Context] = {}  # language -> its default context
        # one start of a default context at a time per language (TypeScript, R and Java start
        # on first use, which two concurrent calls must not both do)
        self.default_locks: dict[str, asyncio.Lock] = {}
        self.access = AccessToken(ACCESS_TOKEN_DIGEST_FILE)
        self.envd_envs_url = ENVD_ENVS_URL

    async def start(self) -> None:
        java = asyncio.create_task(self._prepare_java()) if self.prepare_java else None
        contexts = await asyncio.gather(*(self._default(lang) for lang in WARM_LANGUAGES))
        await asyncio.gather(*(ctx.warm() for ctx in contexts))
        if java is not None:
            await java

    async def _prepare_java(self) -> None:
        """The Java kernel's jar and class archive (javaprep.py), made in the template so that
        a sandbox's first Java cell starts its JVM from them; a failure is logged (the kernel
        then compiles its runner at each start)."""
        t0 = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agentenv.guest.codeint.javaprep",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            output, _ = await process.communicate()
        except OSError as exc:
            log.warning("the Java runner was not prepared: %s", exc)
            return
        text = output.decode(errors="replace").strip()[-2000:]
        if process.returncode == 0:
            log.info("%s (%.1f s)", text, time.monotonic() - t0)
        else:
            log.warning("the Java runner was not prepared (status %s): %s",
                        process.returncode, text)

    async def close(self) -> None:
        for ctx in list(self.contexts.values()):
            with contextlib.suppress(Exception):
                await ctx.shutdown()

    async def _new_context(self, language: str, cwd: str, context_id: str | None = None) -> Context:
        try:
            ctx = Context(language, cwd, context_id)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from exc
        try:
            await ctx.start()
        except OSError as exc:
            # e.g. a cwd that does not exist, or one the server's user cannot enter (the
            # template runs it as root, as E2B's does): an answer that says so, not a dropped
            # connection (which the node reports as the port not answering)
            log.warning("context %s in %s not started: %s", language, cwd, exc)
            with contextlib.suppress(Exception):
                await ctx.shutdown()
            raise HttpError(400, f"the {language} context could not be started in {cwd!r}: "
                                 f"{exc.strerror or exc}") from exc
        self.contexts[ctx.id] = ctx
        return ctx

    async def _default(self, language: str) -> Context:
        ctx = self.defaults.get(language)
        if ctx is not None:
            return ctx
        async with self.default_locks.setdefault(language, asyncio.Lock()):
            ctx = self.defaults.get(language)
            if ctx is None:
                ctx = self.defaults[language] = await self._new_context(
                    language, self.default_cwd, language)
        return ctx

    def _context(self, context_id: str) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise HttpError(404, f"context {context_id} not found")
        return ctx

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        given = [v for k, v in scope["headers"] if k.lower() == b"x-access-token"]
        try:
            if (method, path) != ("GET", "/health") and \
                    not self.access.check(given, (method, path) in TOKEN_REQUIRED):
                # envd's answer to the same refusal, so a client reads one shape
                await respond(send, 401, {"code": 401, "message": UNAUTHORIZED})
                return
            await self._route(method, path, receive, send, given[0] if given else None)
        except HttpError as exc:
            await respond(send, exc.status, {"error": str(exc)})

    async def _route(self, method: str, path: str, receive: Receive, send: Send,
                     token: bytes | None) -> None:
        parts = path.strip("/").split("/")
        if path == "/health" and method == "GET":
            await respond(send, 200, {"status": "ok"})
        elif path == "/aenv/warm" and method == "POST":
            await asyncio.gather(*(ctx.warm() for ctx in list(self.defaults.values())))
            await respond(send, 204)
        elif path == "/execute" and method == "POST":
            await self._execute(await read_json(receive), receive, send, token)
        elif path == "/contexts" and method == "POST":
            body = await read_json(receive)
            if len(self.contexts) >= MAX_CONTEXTS:
                raise HttpError(429, f"{len(self.contexts)} contexts exist, at most "
                                     f"{MAX_CONTEXTS}: remove one first")
            ctx = await self._new_context(language_of(body), body.get("cwd") or self.default_cwd)
            await respond(send, 200, ctx.describe())
        elif path == "/contexts" and method == "GET":
            await respond(send, 200, [c.describe() for c in self.contexts.values()])
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" \
                and method == "POST":
            await self._context(parts[1]).restart()
            await respond(send, 204)
        elif len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            ctx = self._context(parts[1])
            del self.contexts[ctx.id]
            self.defaults = {k: v for k, v in self.defaults.items() if v is not ctx}
            await ctx.shutdown()
            await respond(send, 204)
        else:
            raise HttpError(404, f"no route for {method} {path}")

    async def _execute(self, body: dict[str, Any], receive: Receive, send: Send,
                       token: bytes | None) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise HttpError(400, "code must be a string")
        if body.get("context_id") and body.get("language"):
            raise HttpError(400, "give context_id or language, not both")
        if body.get("context_id"):
            ctx = self._context(body["context_id"])
        else:
            ctx = await self._default(language_of(body))
        env_vars = body.get("env_vars") or None
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
                raise HttpError(400, "env_vars must map names to strings")
            try:
                LANGUAGES[ctx.language].check_env(env_vars)
            except ValueError as exc:
                raise HttpError(400, str(exc)) from exc
        timeout = body.get("timeout")
        sandbox_env = None
        if not ctx.sandbox_env_applied:
            sandbox_env = await asyncio.to_thread(read_sandbox_env, self.envd_envs_url, token)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})

        async def pump() -> None:
            async for line in ctx.execute(code, env_vars, sandbox_env):
                await send({"type": "http.response.body", "body": dumps(line), "more_body": True})

        running = asyncio.create_task(pump())
        gone = asyncio.create_task(receive())  # completes when the client disconnects
        try:
            done, _ = await asyncio.wait({running, gone}, timeout=timeout or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if running not in done:
                # Timed out or the client left: interrupt the cell, and let it run to the
                # kernel's idle so the context is ready for the next one.
                log.info("interrupting a cell (%s)", "client gone" if gone in done else "timeout")
                await ctx.interrupt()
            await running
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        await send({"type": "http.response.body", "body": dumps({"type": "end_of_execution"}),
                    "more_body": False})

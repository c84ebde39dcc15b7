"""Contexts: one Jupyter kernel each, run through jupyter_client, and the translation of a cell's
kernel messages into the code-interpreter protocol's output lines."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jupyter_client.manager import AsyncKernelManager

KERNEL_READY_SECONDS = 120.0
# Which kernel runs each language this server offers.
KERNELS = {"python": "python3"}

# MIME type of a display bundle -> the key the SDK's Result reads it from.
MIME_KEYS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf",
    "text/latex": "latex", "application/json": "json", "application/javascript": "javascript",
}

# Per-call environment variables: set before the cell, put back after it (hidden executions,
# not in the history or the execution count).
ENV_SET = """import os as _aenv_os
_aenv_saved_env = {{k: _aenv_os.environ.get(k) for k in {names!r}}}
_aenv_os.environ.update({values!r})
"""
ENV_RESTORE = """for _aenv_k, _aenv_v in _aenv_saved_env.items():
    if _aenv_v is None:
        _aenv_os.environ.pop(_aenv_k, None)
    else:
        _aenv_os.environ[_aenv_k] = _aenv_v
del _aenv_saved_env
"""


def now_ns() -> int:
    return time.time_ns()


def result_line(content: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in (content.get("data") or {}).items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        else:
            out[key] = value
    if extra:
        out["extra"] = extra
    return out


class Context:
    """A kernel with its own state and working directory. One cell runs at a time (`lock`)."""

    def __init__(self, language: str, cwd: str, context_id: str | None = None) -> None:
        if language not in KERNELS:
            raise ValueError(f"language {language!r} is not supported (supported: "
                             f"{', '.join(sorted(KERNELS))})")
        self.id = context_id or str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self.manager = AsyncKernelManager(kernel_name=KERNELS[language])
        self.client: Any = None

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        # The server's own PYTHONPATH (the tools disk) is not the user's.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        # ipykernel imports debugpy, which warns on stderr about frozen modules at each start
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        await self.manager.start_kernel(cwd=self.cwd, env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        await self.client.wait_for_ready(timeout=KERNEL_READY_SECONDS)

    async def restart(self) -> None:
        async with self.lock:
            await self.manager.restart_kernel(now=True)
            await self.client.wait_for_ready(timeout=KERNEL_READY_SECONDS)

    async def shutdown(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
        await self.manager.shutdown_kernel(now=True)

    async def interrupt(self) -> None:
        await self.manager.interrupt_kernel()

    async def _messages(self, msg_id: str) -> AsyncIterator[dict[str, Any]]:
        """The iopub messages of one request, up to its `idle` status (excluded)."""
        while True:
            msg = await self.client.get_iopub_msg()
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue  # another request's (an earlier interrupted cell's late output)
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return
            yield msg

    async def _hidden(self, code: str) -> None:
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        async for _ in self._messages(msg_id):
            pass

    async def execute(self, code: str, env_vars: dict[str, str] | None = None
                      ) -> AsyncIterator[dict[str, Any]]:
        """Runs a cell; yields the protocol's lines (without the closing end_of_execution).
        Must be consumed to its end (the lock is held until the kernel is idle again)."""
        async with self.lock:
            if env_vars:
                await self._hidden(ENV_SET.format(names=list(env_vars), values=dict(env_vars)))
            try:
                msg_id = self.client.execute(code, allow_stdin=False, stop_on_error=False)
                async for msg in self._messages(msg_id):
                    line = translate(msg)
                    if line is not None:
                        yield line
            finally:
                if env_vars:
                    await self._hidden(ENV_RESTORE)


def translate(msg: dict[str, Any]) -> dict[str, Any] | None:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        return {"type": "stdout" if content.get("name") == "stdout" else "stderr",
                "text": content.get("text", ""), "timestamp": now_ns()}
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    if kind == "execute_result":
        return result_line(content, main=True)
    if kind == "display_data":
        return result_line(content, main=False)
    if kind == "error":
        return {"type": "error", "name": content.get("ename", ""),
                "value": content.get("evalue", ""),
                "traceback": "\n".join(content.get("traceback") or [])}
    return None


def dumps(line: dict[str, Any]) -> bytes:
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()

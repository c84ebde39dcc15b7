"""Contexts: one Jupyter kernel each, run through jupyter_client, and the translation of a cell's
kernel messages into the code-interpreter protocol's output lines.

The languages and their kernels (specs made here, not looked up in Jupyter's kernel dirs):
python is IPython (ipykernel, the image's), with pystartup.py run at its start (the chart
format); r is the image's IRkernel; bash, javascript, typescript and java are our own kernels
(bashkernel.py, jskernel.py, tskernel.py, javakernel.py), run from the tools disk with the
image's python3 and ipykernel."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

KERNEL_READY_SECONDS = 300.0  # (a JVM and JShell under TCG: the Java kernel's first start)
HERE = Path(__file__).resolve().parent
TOOLS_PYTHON = str(HERE.parents[2])  # the directory that holds the agentenv package

# MIME type of a display bundle -> the key the SDK's Result reads it from.
MIME_KEYS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf",
    "text/latex": "latex", "application/json": "json", "application/javascript": "javascript",
    "e2b/chart": "chart", "e2b/data": "data",
}

# Per-call environment variables: set before the cell, put back after it (hidden executions,
# not in the history or the execution count), in each language's own terms.
PYTHON_ENV_SET = """import os as _aenv_os
_aenv_saved_env = {{k: _aenv_os.environ.get(k) for k in {names!r}}}
_aenv_os.environ.update({values!r})
"""
PYTHON_ENV_RESTORE = """for _aenv_k, _aenv_v in _aenv_saved_env.items():
    if _aenv_v is None:
        _aenv_os.environ.pop(_aenv_k, None)
    else:
        _aenv_os.environ[_aenv_k] = _aenv_v
del _aenv_saved_env
"""
JS_ENV_SET = """(() => {{ const values = {values};
  globalThis[Symbol.for('agentenv.env')] = Object.fromEntries(
    Object.keys(values).map((k) => [k, process.env[k]]));
  Object.assign(process.env, values); }})()"""
JS_ENV_RESTORE = """(() => { const saved = globalThis[Symbol.for('agentenv.env')] || {};
  for (const [k, v] of Object.entries(saved)) {
    if (v === undefined) delete process.env[k]; else process.env[k] = v; }
  delete globalThis[Symbol.for('agentenv.env')]; })()"""
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The sandbox's own env vars (Sandbox.create's envs, envd's GET /envs): set for good in a
# context before its first cell, as E2B's server does (its kernels, like ours, are started in
# the template, before any sandbox's envs exist).
PYTHON_ENV_APPLY = "__import__('os').environ.update({values!r})"
JS_ENV_APPLY = "Object.assign(process.env, {values}), undefined"


def bash_env_set(env: dict[str, str]) -> str:
    lines = []
    for i, (name, value) in enumerate(env.items()):
        lines.append(f"__aenv_had_{i}=${{{name}+1}} __aenv_old_{i}=${{{name}-}}; "
                     f"export {name}={shlex.quote(value)}")
    return "\n".join(lines)


def bash_env_restore(env: dict[str, str]) -> str:
    return "\n".join(
        f'if [ -n "$__aenv_had_{i}" ]; then export {name}="$__aenv_old_{i}"; '
        f"else unset {name}; fi; unset __aenv_had_{i} __aenv_old_{i}"
        for i, name in enumerate(env))


def bash_env_apply(env: dict[str, str]) -> str:
    # a name bash cannot take is left out (it cannot be a shell variable)
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items()
                     if SHELL_NAME.fullmatch(name))


def r_string(text: str) -> str:
    """text as an R string literal (non-ASCII as \\U{...} escapes: R's locale may not be
    UTF-8)."""
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20 or ord(ch) >= 0x7f:
            out.append(f"\\U{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def r_setenv(env: dict[str, str]) -> str:
    pairs = ", ".join(f"{r_string(k)} = {r_string(v)}" for k, v in env.items())
    return f"invisible(Sys.setenv({pairs}))"


def r_env_set(env: dict[str, str]) -> str:
    names = ", ".join(r_string(k) for k in env)
    return (f".aenv_saved_env <- Sys.getenv(c({names}), unset = NA, names = TRUE)\n"
            + r_setenv(env))


R_ENV_RESTORE = """local(for (k in names(.aenv_saved_env)) {
  v <- .aenv_saved_env[[k]]
  if (is.na(v)) Sys.unsetenv(k) else do.call(Sys.setenv, structure(list(v), names = k))
})
rm(.aenv_saved_env)"""


# The Java kernel's (javakernel.py) own commands for env vars, which E2B's server gives its Java
# kernel as system properties: run by the kernel, not compiled as Java.
JAVA_ENV_SET_PREFIX = "%aenv-properties-set "
JAVA_ENV_RESTORE = "%aenv-properties-restore"
JAVA_ENV_APPLY_PREFIX = "%aenv-properties-apply "


def check_shell_names(env: dict[str, str]) -> None:
    bad = [name for name in env if not SHELL_NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"env var names not usable in bash: {', '.join(map(repr, bad))}")


@dataclass(frozen=True)
class Language:
    name: str
    argv: tuple[str, ...]  # {connection_file} is Jupyter's
    env_set: Callable[[dict[str, str]], str]
    env_restore: Callable[[dict[str, str]], str]
    env_apply: Callable[[dict[str, str]], str]  # set for good: the sandbox's env vars
    # a hidden cell run once the kernel is up: a kernel's first cell pays for what its
    # language loads lazily (IPython's compiler and display formatters), and the template's
    # snapshot is better taken after that than before
    warm_code: str
    ours: bool = False  # our own kernel module: run with the tools disk on PYTHONPATH
    check_env: Callable[[dict[str, str]], None] = lambda env: None

    @property
    def kernel_name(self) -> str:
        # (not the language: jupyter_client renames a kernel named "python" to "python3")
        return f"aenv-{self.name}"

    def spec(self) -> KernelSpec:
        return KernelSpec(argv=list(self.argv), display_name=self.name, language=self.name,
                          resource_dir=str(HERE),
                          env={"PYTHONPATH": TOOLS_PYTHON} if self.ours else {})


def _our_kernel(module: str) -> tuple[str, ...]:
    return (sys.executable, "-m", f"agentenv.guest.codeint.{module}", "-f", "{connection_file}")


LANGUAGES = {
    "python": Language(
        "python",
        (sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
         f"--IPKernelApp.exec_files={HERE / 'pystartup.py'}"),
        lambda env: PYTHON_ENV_SET.format(names=list(env), values=dict(env)),
        lambda env: PYTHON_ENV_RESTORE,
        lambda env: PYTHON_ENV_APPLY.format(values=dict(env)),
        "get_ipython().display_formatter.format(1 + 1)"),
    "javascript": Language(
        "javascript", _our_kernel("jskernel"),
        lambda env: JS_ENV_SET.format(values=json.dumps(env)), lambda env: JS_ENV_RESTORE,
        lambda env: JS_ENV_APPLY.format(values=json.dumps(env)),
        "1 + 1", ours=True),
    "bash": Language("bash", _our_kernel("bashkernel"), bash_env_set, bash_env_restore,
                     bash_env_apply, "true", ours=True, check_env=check_shell_names),
    "typescript": Language(
        "typescript", _our_kernel("tskernel"),
        lambda env: JS_ENV_SET.format(values=json.dumps(env)), lambda env: JS_ENV_RESTORE,
        lambda env: JS_ENV_APPLY.format(values=json.dumps(env)),
        "1 + 1", ours=True),
    # Debian's IRkernel (its kernel spec's command); the env vars are R's Sys.setenv
    "r": Language("r", ("R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"),
                  r_env_set, lambda env: R_ENV_RESTORE, r_setenv, "invisible(NULL)"),
    # our JShell kernel (Debian has no Jupyter kernel for Java): env vars as system properties
    "java": Language("java", _our_kernel("javakernel"),
                     lambda env: JAVA_ENV_SET_PREFIX + json.dumps(env),
                     lambda env: JAVA_ENV_RESTORE,
                     lambda env: JAVA_ENV_APPLY_PREFIX + json.dumps(env), "0", ours=True),
}
# Other names the SDKs and E2B's server accept for a language.
ALIASES = {"js": "javascript", "ts": "typescript"}


def normalize_language(language: str | None) -> str:
    """The language a request names (python when none), ValueError for one not served."""
    name = (language or "python").strip().lower()
    name = ALIASES.get(name, name)
    if name not in LANGUAGES:
        raise ValueError(f"language {language!r} is not supported (supported: "
                         f"{', '.join(sorted([*LANGUAGES, *ALIASES]))})")
    return name


class Specs(KernelSpecManager):  # type: ignore[misc]
    """Kernel specs from LANGUAGES, whatever Jupyter kernels the image has installed."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return LANGUAGES[kernel_name.removeprefix("aenv-")].spec()


def now_ns() -> int:
    return time.time_ns()


def unquote(text: str) -> str:
    """A string's repr as the string, as E2B's server gives it ('a' -> a)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result_line(content: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in (content.get("data") or {}).items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        else:
            out[key] = unquote(value) if key == "text" else value
    if extra:
        out["extra"] = extra
    return out


class Context:
    """A kernel with its own state and working directory. One cell runs at a time (`lock`)."""

    def __init__(self, language: str, cwd: str, context_id: str | None = None) -> None:
        self.language = normalize_language(language)
        self.id = context_id or str(uuid.uuid4())
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self.manager = AsyncKernelManager(kernel_name=LANGUAGES[self.language].kernel_name,
                                          kernel_spec_manager=Specs())
        self.client: Any = None
        # whether the sandbox's env vars are set in the kernel (before its first cell; again
        # after a restart, which starts a new kernel)
        self.sandbox_env_applied = False

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
            self.sandbox_env_applied = False

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

    async def warm(self) -> None:
        async with self.lock:
            await self._hidden(LANGUAGES[self.language].warm_code)

    async def _hidden(self, code: str) -> None:
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        async for _ in self._messages(msg_id):
            pass

    async def execute(self, code: str, env_vars: dict[str, str] | None = None,
                      sandbox_env: dict[str, str] | None = None
                      ) -> AsyncIterator[dict[str, Any]]:
        """Runs a cell; yields the protocol's lines (without the closing end_of_execution).
        `sandbox_env`, the sandbox's env vars, is set for good first unless it already is
        (None: not known, set by a later cell). Must be consumed to its end (the lock is held
        until the kernel is idle again)."""
        language = LANGUAGES[self.language]
        async with self.lock:
            if sandbox_env is not None and not self.sandbox_env_applied:
                if sandbox_env:
                    await self._hidden(language.env_apply(sandbox_env))
                self.sandbox_env_applied = True
            if env_vars:
                await self._hidden(language.env_set(env_vars))
            try:
                msg_id = self.client.execute(code, allow_stdin=False, stop_on_error=False)
                async for msg in self._messages(msg_id):
                    line = translate(msg)
                    if line is not None:
                        yield line
            finally:
                if env_vars:
                    await self._hidden(language.env_restore(env_vars))


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

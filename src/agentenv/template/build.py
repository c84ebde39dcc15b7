"""Template builds: the E2B step language run inside a build VM through its envd.

A build (driven by node/template_api.py) boots a temporary VM from an image or another template,
then `StepRunner` runs the steps through envd, exactly as a sandbox user would:

| step | args | effect |
|---|---|---|
| RUN | [cmd] or [cmd, user] | `/bin/bash -l -c cmd` (envd runs the tools disk's busybox sh, /agentenv/bin/sh, when the image has no /bin/bash) as the build user, in the workdir, with the build env; a non-zero exit fails the build with the exit code and the output's tail |
| ENV, ARG | [k1, v1, k2, v2, ...] | added to the build env (kept in sandboxes made from the template) |
| WORKDIR | [path] | relative paths join the previous workdir (else `/`); created, owned by the build user, when missing |
| USER | [name] | later steps and the template's sandboxes run as `name` (created when the image has no such user) |
| COPY, ADD | [src, dest, owner?, mode?] + filesHash | files uploaded beforehand (a tar, maybe gzipped, named by filesHash) copied to dest with Docker semantics: a directory's contents, a trailing `/` or several sources make dest a directory; relative dest joins the workdir; owner defaults to the build user |
| EXPOSE, VOLUME, LABEL | ... | recorded in the log only |

Then the start command (if any) is spawned in the background and the ready command polled until
it exits 0 (`sleep 20` when only a start command is given; docs/templates.md §3); envd takes the
final user, workdir and env as its defaults, and the caller pauses the VM into the template's
boot snapshot, so every sandbox made from the template wakes up with the start process running.
The template's cold-memory setting (`BuildContext.cold_memory`) is set in the guest kernel
before the first step, so the snapshot carries it.

The E2B defaults: the build user is `user` (home /home/user), unless the image's config names one.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.envd_client import ColdMemory, EnvdClient, EnvdClientError, EnvdUnsupported
from agentenv.errors import AgentEnvError

DEFAULT_USER = "user"
DEFAULT_READY_CMD = "sleep 20"
READY_POLL_SECONDS = 1.0
READY_TIMEOUT_SECONDS = 600.0
STEP_TIMEOUT_SECONDS = 3600.0
#: the build's own commands in the guest (a user switch, a WORKDIR) take a moment; the guest is
#: the team's, so one that never answers fails its step instead of holding the build VM
GUEST_CALL_TIMEOUT_SECONDS = 30.0
#: a COPY unpacks an upload (up to gigabytes) in the guest
COPY_TIMEOUT_SECONDS = 600.0
OUTPUT_TAIL = 2000  # characters of output quoted in a failed step's reason
BUSYBOX = "/agentenv/bin/busybox"  # on the tools disk of every VM: works in any image
TOOLS_SHELL = "/agentenv/bin/sh"

BASE_STEP = "base"  # the SDK maps these step names to the calls that made them
FINALIZE_STEP = "finalize"

STEP_TYPES = {"RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY", "ADD", "EXPOSE", "VOLUME", "LABEL"}
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}\$?$|^root$", re.IGNORECASE)
_FILES_HASH = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class BuildSpecError(AgentEnvError):
    """A build request with a step or field that cannot be run."""


class BuildFailed(AgentEnvError):
    """A build step failed; `step` names it the way the SDK expects ("base", "3", "finalize")."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


@dataclass(frozen=True)
class Step:
    type: str  # upper case
    args: list[str]
    files_hash: str | None = None
    force: bool = False

    def describe(self) -> str:
        if self.type == "RUN":
            return f"RUN {self.args[0]}"
        return " ".join([self.type, *self.args]).strip()


def parse_steps(raw: Any) -> list[Step]:
    """Validated steps of a build request (`TemplateStep {type, args, filesHash, force}`)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BuildSpecError("steps must be a list")
    steps = []
    for i, item in enumerate(raw, start=1):
        where = f"step {i}"
        if not isinstance(item, dict):
            raise BuildSpecError(f"{where} must be an object")
        kind = item.get("type")
        if not isinstance(kind, str) or kind.upper() not in STEP_TYPES:
            raise BuildSpecError(f"{where}: unknown step type {kind!r} "
                                 f"(known: {', '.join(sorted(STEP_TYPES))})")
        kind = kind.upper()
        args = item.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise BuildSpecError(f"{where} ({kind}): args must be a list of strings")
        files_hash = item.get("filesHash")
        if files_hash is not None and (not isinstance(files_hash, str)
                                       or not _FILES_HASH.match(files_hash)):
            raise BuildSpecError(f"{where} ({kind}): filesHash {files_hash!r} is not a hash")
        if kind == "RUN":
            if not 1 <= len(args) <= 2 or not args[0].strip():
                raise BuildSpecError(f"{where} (RUN): args must be [command] or [command, user]")
            if len(args) == 2 and args[1] and not _USER.match(args[1]):
                raise BuildSpecError(f"{where} (RUN): {args[1]!r} is not a user name")
        elif kind in ("ENV", "ARG"):
            if len(args) % 2 or not args:
                raise BuildSpecError(f"{where} ({kind}): args must be key, value pairs")
            for key in args[::2]:
                if not _ENV_KEY.match(key):
                    raise BuildSpecError(f"{where} ({kind}): {key!r} is not a variable name")
        elif kind == "WORKDIR":
            if len(args) != 1 or not args[0].strip():
                raise BuildSpecError(f"{where} (WORKDIR): args must be [path]")
        elif kind == "USER":
            if len(args) != 1 or not _USER.match(args[0]):
                raise BuildSpecError(f"{where} (USER): args must be [user name]")
        elif kind in ("COPY", "ADD"):
            if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
                raise BuildSpecError(f"{where} ({kind}): args must be [src, dest, owner?, mode?]")
            if not files_hash:
                raise BuildSpecError(f"{where} ({kind}): filesHash is required (upload the files "
                                     "with GET /templates/{id}/files/{hash} first)")
            if len(args) > 3 and args[3] and not re.fullmatch(r"[0-7]{3,4}", args[3]):
                raise BuildSpecError(f"{where} ({kind}): mode {args[3]!r} is not octal")
            if posixpath.isabs(args[0]) or ".." in args[0].split("/"):
                raise BuildSpecError(f"{where} ({kind}): src {args[0]!r} must be relative to "
                                     "the build context")
        steps.append(Step(kind, list(args), files_hash, bool(item.get("force"))))
    return steps


@dataclass
class BuildContext:
    """What a template hands on to sandboxes and to templates built from it."""

    user: str = DEFAULT_USER
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_cmd: str | None = None
    ready_cmd: str | None = None
    #: the guest kernel's cold-memory reclaim (None: a template built before it was kept)
    cold_memory: ColdMemory | None = None

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "workdir": self.workdir, "env": self.env,
                "startCmd": self.start_cmd, "readyCmd": self.ready_cmd,
                "coldMemory": self.cold_memory.model_dump() if self.cold_memory else None}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BuildContext:
        cold = raw.get("coldMemory")
        return cls(user=str(raw.get("user") or DEFAULT_USER), workdir=raw.get("workdir"),
                   env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
                   start_cmd=raw.get("startCmd"), ready_cmd=raw.get("readyCmd"),
                   cold_memory=ColdMemory.model_validate(cold) if cold else None)

    @classmethod
    def from_image_config(cls, config: dict[str, Any]) -> BuildContext:
        """The OCI config's Env and WorkingDir; its User when it names one (else E2B's `user`)."""
        env: dict[str, str] = {}
        for item in config.get("env") or config.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and _ENV_KEY.match(key):
                env[key] = value
        user = str(config.get("user") or config.get("User") or "").strip()
        if not user or not _USER.match(user.split(":")[0]) or user.split(":")[0].isdigit():
            user = DEFAULT_USER  # numeric uids are not names envd can select
        else:
            user = user.split(":")[0]
        workdir = str(config.get("workingDir") or config.get("WorkingDir") or "") or None
        return cls(user=user, workdir=workdir, env=env)


def home_of(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


Log = Callable[[str, str, str | None], None]  # (level, message, step)

# Copies the uploaded files (extracted under a staging dir) to dest with Docker's COPY rules.
# $1 archive  $2 tar flags  $3 src (may be a glob)  $4 dest (absolute)  $5 owner  $6 mode
_COPY_SCRIPT = r"""
set -e
bb=/agentenv/bin/busybox
archive=$1; flags=$2; src=$3; dest=$4; owner=$5; mode=$6
tmp=$($bb mktemp -d /tmp/.aenv-copy.XXXXXX)
trap '$bb rm -rf "$tmp" "$archive"' EXIT
$bb tar "$flags" "$archive" -C "$tmp"
cd "$tmp"
set -- $src
dir_dest=0
case "$dest" in */) dir_dest=1 ;; esac
[ $# -gt 1 ] && dir_dest=1
[ -d "$dest" ] && dir_dest=1
for m in "$@"; do
	if [ ! -e "$m" ] && [ ! -L "$m" ]; then
		echo "COPY: $m is not among the uploaded files" >&2
		exit 1
	fi
	if [ -n "$owner" ]; then $bb chown -R -h "$owner" "$m"; fi
	if [ -n "$mode" ]; then $bb find "$m" -type f -exec $bb chmod "$mode" {} +; fi
	if [ -d "$m" ] && [ ! -L "$m" ]; then
		made=0; [ -d "$dest" ] || { $bb mkdir -p "$dest"; made=1; }
		$bb cp -a "$m/." "$dest/"
		if [ "$made" = 1 ] && [ -n "$owner" ]; then $bb chown "$owner" "$dest"; fi
	elif [ "$dir_dest" = 1 ]; then
		made=0; [ -d "$dest" ] || { $bb mkdir -p "$dest"; made=1; }
		$bb cp -a "$m" "$dest/"
		if [ "$made" = 1 ] && [ -n "$owner" ]; then $bb chown "$owner" "$dest"; fi
	else
		$bb mkdir -p "$($bb dirname "$dest")"
		$bb cp -a "$m" "$dest"
	fi
done
"""

# $1 directory  $2 owner: made (owned by owner) when missing.
_WORKDIR_SCRIPT = r"""
set -e
bb=/agentenv/bin/busybox
[ -d "$1" ] && exit 0
$bb mkdir -p "$1"
$bb chown "$2" "$1"
"""


class StepRunner:
    """Runs a build's steps in one VM through its envd (see the module docstring)."""

    def __init__(self, envd: EnvdClient, context: BuildContext, log: Log,
                 files_dir: Path) -> None:
        self.envd = envd
        self.context = context
        self.log = log
        self.files_dir = files_dir
        self._start_task: asyncio.Task[Any] | None = None
        self._start_pid: int | None = None

    # --- helpers -----------------------------------------------------------------------------

    def _output_logger(self, step: str) -> Callable[[str, str], None]:
        pending = {"stdout": "", "stderr": ""}

        def emit(stream: str, text: str) -> None:
            lines = (pending[stream] + text).split("\n")
            pending[stream] = lines.pop()
            for line in lines:
                self.log("info" if stream == "stdout" else "warn", line.rstrip("\r"), step)
            if len(pending[stream]) > 8192:  # a very long line without a newline
                self.log("info", pending[stream], step)
                pending[stream] = ""

        emit.flush = lambda: [self.log("info", p, step) for p in pending.values() if p]  # type: ignore[attr-defined]
        return emit

    async def _root_script(self, script: str, args: list[str], step: str, what: str,
                           timeout: float) -> None:
        try:
            result = await self.envd.run(TOOLS_SHELL, ["-c", script, "aenv-build", *args],
                                         user="root", cwd="/", timeout=timeout)
        except EnvdClientError as exc:
            raise BuildFailed(f"{what} failed: {exc}", step) from exc
        if result.exit_code != 0 or not result.exited:
            output = (result.stdout + result.stderr).strip()[-OUTPUT_TAIL:]
            raise BuildFailed(f"{what} failed with exit code {result.exit_code}: {output}", step)

    async def _materialize_user(self, user: str, step: str) -> None:
        """envd creates its default user on first use; make `user` the default and use it."""
        what = f"step {step}: cannot switch to user {user!r}"
        try:
            await self.envd.init(default_user=user)
            result = await self.envd.run(TOOLS_SHELL, ["-c", ":"], user=user, cwd="/",
                                         timeout=GUEST_CALL_TIMEOUT_SECONDS)
        except EnvdClientError as exc:
            raise BuildFailed(f"{what}: {exc}", step) from exc
        if result.exit_code != 0 or not result.exited:
            raise BuildFailed(f"{what}: `{TOOLS_SHELL} -c :` ended with "
                              f"{result.status or result.exit_code} (its timeout is "
                              f"{GUEST_CALL_TIMEOUT_SECONDS:g} s): {result.stderr.strip()}", step)

    def _owner(self, user: str) -> str:
        return user if user == "root" else f"{user}:{user}"

    # --- the steps ---------------------------------------------------------------------------

    async def prepare(self) -> None:
        await self._set_cold_memory()
        await self._materialize_user(self.context.user, BASE_STEP)

    async def _set_cold_memory(self) -> None:
        """The template's cold-memory setting into the guest kernel: from here on it reclaims
        (the build's own cold page cache too), and the snapshot carries it to every sandbox."""
        setting = self.context.cold_memory
        if setting is None:
            return
        try:
            await self.envd.set_cold_memory(setting)
        except EnvdUnsupported as exc:  # no DAMON in the kernel, no VM, or an older envd
            self.log("warn", f"cold memory stays in the guest: {exc}", BASE_STEP)
            return
        except EnvdClientError as exc:
            raise BuildFailed(f"setting the cold-memory reclaim failed: {exc}", BASE_STEP) from exc
        self.log("info", "cold memory: " + (
            f"pages untouched for {setting.minAgeSeconds:g} s go back to the host"
            if setting.reclaim else "reclaim off (the guest keeps its page cache)"), BASE_STEP)

    async def run_steps(self, steps: list[Step]) -> None:
        for index, step in enumerate(steps, start=1):
            name = str(index)
            self.log("info", f"[{index}/{len(steps)}] {step.describe()}", name)
            t0 = time.monotonic()
            await self._run_step(step, name)
            self.log("debug", f"step {index} done in {time.monotonic() - t0:.1f} s", name)

    async def _run_step(self, step: Step, name: str) -> None:
        ctx = self.context
        if step.type == "RUN":
            user = step.args[1] if len(step.args) > 1 and step.args[1] else ctx.user
            emit = self._output_logger(name)
            try:
                result = await self.envd.run("/bin/bash", ["-l", "-c", step.args[0]], user=user,
                                             cwd=ctx.workdir, envs=ctx.env,
                                             timeout=STEP_TIMEOUT_SECONDS, on_output=emit)
            except EnvdClientError as exc:
                raise BuildFailed(f"{step.describe()} could not run: {exc}", name) from exc
            emit.flush()  # type: ignore[attr-defined]
            if result.exit_code != 0 or not result.exited:
                output = (result.stdout + result.stderr).strip()[-OUTPUT_TAIL:]
                raise BuildFailed(
                    f"{step.describe()} failed with exit code {result.exit_code} "
                    f"({result.status}): {output}", name)
        elif step.type in ("ENV", "ARG"):
            for key, value in zip(step.args[::2], step.args[1::2], strict=True):
                ctx.env[key] = value
        elif step.type == "WORKDIR":
            path = posixpath.normpath(posixpath.join(ctx.workdir or "/", step.args[0]))
            await self._root_script(_WORKDIR_SCRIPT, [path, self._owner(ctx.user)], name,
                                    f"WORKDIR {path}", GUEST_CALL_TIMEOUT_SECONDS)
            ctx.workdir = path
        elif step.type == "USER":
            ctx.user = step.args[0]
            await self._materialize_user(ctx.user, name)
        elif step.type in ("COPY", "ADD"):
            await self._copy(step, name)
        else:
            self.log("info", f"{step.type} is recorded only", name)

    async def _copy(self, step: Step, name: str) -> None:
        assert step.files_hash is not None
        archive = self.files_dir / step.files_hash
        if not archive.is_file():
            raise BuildFailed(f"the files of {step.describe()} (hash {step.files_hash}) were "
                              "never uploaded", name)
        src, dest = step.args[0], step.args[1]
        owner_arg = step.args[2] if len(step.args) > 2 else ""
        mode = step.args[3] if len(step.args) > 3 else ""
        base = self.context.workdir or home_of(self.context.user)
        absolute = posixpath.normpath(posixpath.join(base, dest))
        if dest.endswith("/"):
            absolute += "/"
        owner = owner_arg or self._owner(self.context.user)
        if owner_arg and ":" not in owner_arg and owner_arg != "root":
            owner = f"{owner_arg}:{owner_arg}"
        with open(archive, "rb") as f:
            flags = "-xzf" if f.read(2) == b"\x1f\x8b" else "-xf"
        remote = f"/tmp/.aenv-copy-{step.files_hash[:32]}.tar"
        try:
            # Streamed from the upload's file: never whole in the node's memory.
            await self.envd.upload_file(remote, archive, user="root")
        except EnvdClientError as exc:
            raise BuildFailed(f"uploading the files of {step.describe()} failed: {exc}",
                              name) from exc
        await self._root_script(_COPY_SCRIPT, [remote, flags, src, absolute, owner, mode],
                                name, step.describe(), COPY_TIMEOUT_SECONDS)

    # --- start, ready, finish ----------------------------------------------------------------

    async def start_and_wait_ready(self, start_cmd: str | None, ready_cmd: str | None,
                                   timeout: float = READY_TIMEOUT_SECONDS) -> None:
        ctx = self.context
        ctx.start_cmd, ctx.ready_cmd = start_cmd or None, ready_cmd or None
        if not start_cmd and not ready_cmd:
            return
        if start_cmd:
            ready_cmd = ready_cmd or DEFAULT_READY_CMD
            self.log("info", f"start command: {start_cmd}", FINALIZE_STEP)
            # Followed for its output and its end; the stream is dropped before the snapshot
            # (the process keeps running).
            self._start_task = asyncio.create_task(self.envd.run(
                "/bin/bash", ["-l", "-c", start_cmd], user=ctx.user, cwd=ctx.workdir,
                envs=ctx.env, on_output=self._output_logger(FINALIZE_STEP), tag="aenv-start-cmd"))
        assert ready_cmd is not None
        self.log("info", f"waiting for the ready command: {ready_cmd}", FINALIZE_STEP)
        deadline = time.monotonic() + timeout
        attempts = 0
        while True:
            attempts += 1
            await self._check_start_process()
            try:
                result = await self.envd.run("/bin/bash", ["-l", "-c", ready_cmd], user=ctx.user,
                                             cwd=ctx.workdir, envs=ctx.env, timeout=60)
            except EnvdClientError as exc:
                raise BuildFailed(f"the ready command could not run: {exc}", FINALIZE_STEP) from exc
            if result.exit_code == 0 and result.exited:
                break
            if time.monotonic() > deadline:
                output = (result.stdout + result.stderr).strip()[-OUTPUT_TAIL:]
                raise BuildFailed(f"the ready command did not succeed within {timeout:.0f} s "
                                  f"(last exit code {result.exit_code}): {output}", FINALIZE_STEP)
            await asyncio.sleep(READY_POLL_SECONDS)
        await self._check_start_process()
        self.log("info", f"ready after {attempts} check(s)", FINALIZE_STEP)

    async def _check_start_process(self) -> None:
        """A start process that exited non-zero fails the build (exit 0 is fine)."""
        task = self._start_task
        if task is None or not task.done():
            return
        try:
            result = task.result()
        except EnvdClientError as exc:
            raise BuildFailed(f"the start command could not run: {exc}", FINALIZE_STEP) from exc
        if result.exit_code != 0 or not result.exited:
            output = (result.stdout + result.stderr).strip()[-OUTPUT_TAIL:]
            raise BuildFailed(f"the start command exited with code {result.exit_code}: {output}",
                              FINALIZE_STEP)

    async def finish(self) -> None:
        """Drop the start command's stream and hand envd the template's defaults."""
        await self.detach()
        ctx = self.context
        try:
            await self.envd.init(env_vars=ctx.env, default_user=ctx.user,
                                 default_workdir=ctx.workdir)
        except EnvdClientError as exc:
            raise BuildFailed(f"setting the sandbox defaults failed: {exc}", FINALIZE_STEP) from exc

    async def detach(self) -> None:
        task, self._start_task = self._start_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

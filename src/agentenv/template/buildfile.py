"""The build file of `aenv template build`: a Dockerfile subset, turned into an E2B build request.

    # comments and blank lines are ignored; a trailing backslash continues a line
    FROM debian:bookworm                 an image (pulled from its registry)
    FROM template base                   or another template
    RUN apt-get update && apt-get install -y curl
    ENV KEY=value OTHER="two words"      (or ENV KEY value)
    ARG KEY=value                        like ENV
    WORKDIR /app
    USER user
    COPY [--chown=user[:group]] [--chmod=0755] src... dest     (src relative to the context dir)
    START python -m http.server 8000     the start command (CMD/ENTRYPOINT in shell or JSON form too)
    READY curl -fs localhost:8000        the ready command

Each COPY source is uploaded once, as a gzipped tar named by a hash of its path, destination
and files (`files_hash`), like the E2B SDKs do.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv import boundedjson
from agentenv.errors import AgentEnvError


class BuildFileError(AgentEnvError):
    """A build file line that cannot be understood."""


@dataclass
class CopySource:
    src: str  # relative to the context directory
    dest: str
    owner: str = ""
    mode: str = ""


@dataclass
class BuildPlan:
    from_image: str | None = None
    from_template: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    copies: dict[int, CopySource] = field(default_factory=dict)  # step index -> source
    start_cmd: str | None = None
    ready_cmd: str | None = None

    def add(self, kind: str, args: list[str]) -> None:
        self.steps.append({"type": kind, "args": args, "force": False})

    def add_copy(self, copy: CopySource) -> None:
        self.copies[len(self.steps)] = copy
        self.add("COPY", [copy.src, copy.dest, copy.owner, copy.mode])

    def request(self, context: Path) -> dict[str, Any]:
        """The `POST /v2/templates/{id}/builds/{id}` body (COPY steps get their filesHash)."""
        steps = []
        for i, step in enumerate(self.steps):
            step = dict(step)
            if i in self.copies:
                step["filesHash"] = files_hash(context, self.copies[i])
            steps.append(step)
        body: dict[str, Any] = {"steps": steps, "force": True}
        if self.from_template:
            body["fromTemplate"] = self.from_template
        elif self.from_image:
            body["fromImage"] = self.from_image
        if self.start_cmd:
            body["startCmd"] = self.start_cmd
        if self.ready_cmd:
            body["readyCmd"] = self.ready_cmd
        return body


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = number
        else:
            line = line.lstrip()
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append((start, (pending + line).strip()))
        pending = ""
    if pending:
        out.append((start, pending.strip()))
    return out


def _command(rest: str) -> str:
    """Shell form as written; JSON (exec) form joined into a shell command."""
    if rest.startswith("["):
        try:
            parts = boundedjson.loads(rest, "the exec form")
        except json.JSONDecodeError as exc:
            raise BuildFileError(f"{rest!r} is not a JSON list: {exc}") from exc
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise BuildFileError(f"{rest!r} must be a list of strings")
        return shlex.join(parts)
    return rest


def _pairs(rest: str, where: str) -> list[str]:
    words = shlex.split(rest)
    if len(words) >= 2 and "=" not in words[0]:
        return [words[0], " ".join(words[1:])]
    args: list[str] = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise BuildFileError(f"{where}: {word!r} must look like KEY=value")
        args += [key, value]
    if not args:
        raise BuildFileError(f"{where}: nothing to set")
    return args


def parse_build_file(text: str, plan: BuildPlan | None = None) -> BuildPlan:
    plan = plan or BuildPlan()
    for number, line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        keyword, rest = word.upper(), rest.strip()
        where = f"line {number} ({keyword})"
        if not rest:
            raise BuildFileError(f"{where}: missing arguments")
        if keyword == "FROM":
            words = rest.split()
            if words[0] in ("template", "--template") and len(words) == 2:
                plan.from_template, plan.from_image = words[1], None
            elif len(words) == 1:
                plan.from_image, plan.from_template = words[0], None
            else:
                raise BuildFileError(f"{where}: use 'FROM <image>' or 'FROM template <name>'")
        elif keyword == "RUN":
            plan.add("RUN", [_command(rest)])
        elif keyword in ("ENV", "ARG"):
            plan.add(keyword, _pairs(rest, where))
        elif keyword == "WORKDIR":
            plan.add("WORKDIR", [rest])
        elif keyword == "USER":
            plan.add("USER", [rest])
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(rest)
            owner = mode = ""
            while words and words[0].startswith("--"):
                flag = words.pop(0)
                if flag.startswith("--chown="):
                    owner = flag.split("=", 1)[1]
                elif flag.startswith("--chmod="):
                    mode = flag.split("=", 1)[1]
                else:
                    raise BuildFileError(f"{where}: unknown option {flag}")
            if len(words) < 2:
                raise BuildFileError(f"{where}: needs at least a source and a destination")
            dest = words[-1]
            if len(words) > 2 and not dest.endswith("/"):
                dest += "/"  # several sources: dest is a directory, as in Docker
            for src in words[:-1]:
                plan.add_copy(CopySource(src, dest, owner, mode))
        elif keyword in ("START", "CMD", "ENTRYPOINT"):
            plan.start_cmd = _command(rest)
        elif keyword == "READY":
            plan.ready_cmd = _command(rest)
        elif keyword in ("EXPOSE", "VOLUME", "LABEL"):
            plan.add(keyword, shlex.split(rest))
        else:
            raise BuildFileError(f"line {number}: unknown instruction {word!r}")
    return plan


def _sources(context: Path, src: str) -> list[Path]:
    if os.path.isabs(src) or ".." in Path(src).parts:
        raise BuildFileError(f"COPY source {src!r} must be inside the context directory")
    matches = sorted(context.glob(src)) if any(c in src for c in "*?[") else [context / src]
    found = [m for m in matches if m.exists() or m.is_symlink()]
    if not found:
        raise BuildFileError(f"COPY source {src!r} not found in {context}")
    return found


def _walk(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        out.append(path)
        if path.is_dir() and not path.is_symlink():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                for name in sorted(dirnames + filenames):
                    out.append(Path(dirpath) / name)
    return out


def files_hash(context: Path, copy: CopySource) -> str:
    """The E2B SDK's files hash (the node verifies the archive against it): sha256 over the
    step and every path's relative name, st_mode, size (not a directory's) and content."""
    digest = hashlib.sha256(f"COPY {copy.src} {copy.dest}".encode())
    for path in _walk(_sources(context, copy.src)):
        st = path.lstat()
        digest.update(str(path.relative_to(context)).encode())
        digest.update(str(st.st_mode).encode())
        if not stat.S_ISDIR(st.st_mode):
            digest.update(str(st.st_size).encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def files_archive(context: Path, copy: CopySource) -> bytes:
    """A gzipped tar of the source(s), paths relative to the context directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in _walk(_sources(context, copy.src)):
            tar.add(path, arcname=str(path.relative_to(context)), recursive=False)
    return buffer.getvalue()

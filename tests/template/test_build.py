"""Template build steps without a VM: the request checks, the build file, and StepRunner driving a
real envd (a subprocess chrooted into a busybox root with the tools-disk paths a VM has)."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.envd_client import EnvdClient
from agentenv.template.build import (
    BuildContext,
    BuildFailed,
    BuildSpecError,
    StepRunner,
    parse_steps,
)
from agentenv.template.buildfile import (
    BuildFileError,
    CopySource,
    files_archive,
    files_hash,
    parse_build_file,
)
from tests.envd.conftest import EnvdProcess, make_busybox_root, start_envd

# --- request validation ------------------------------------------------------------------------


def test_parse_steps_accepts_the_sdk_shapes() -> None:
    steps = parse_steps([
        {"type": "run", "args": ["echo hi"], "force": False},
        {"type": "RUN", "args": ["whoami", "root"]},
        {"type": "ENV", "args": ["A", "1", "B", "two words"]},
        {"type": "WORKDIR", "args": ["app"]},
        {"type": "USER", "args": ["root"]},
        {"type": "COPY", "args": ["src", "/dst/", "", "0755"], "filesHash": "ab" * 32},
        {"type": "LABEL", "args": ["k", "v"]},
    ])
    assert [s.type for s in steps] == ["RUN", "RUN", "ENV", "WORKDIR", "USER", "COPY", "LABEL"]
    assert steps[0].describe() == "RUN echo hi"
    assert steps[5].files_hash == "ab" * 32


@pytest.mark.parametrize(("step", "problem"), [
    ({"type": "FETCH", "args": []}, "unknown step type"),
    ({"type": "RUN", "args": []}, "RUN"),
    ({"type": "RUN", "args": ["x", "bad user!"]}, "not a user name"),
    ({"type": "ENV", "args": ["A"]}, "key, value"),
    ({"type": "ENV", "args": ["1A", "x"]}, "not a variable name"),
    ({"type": "WORKDIR", "args": ["/a", "/b"]}, "WORKDIR"),
    ({"type": "USER", "args": ["a b"]}, "USER"),
    ({"type": "COPY", "args": ["a", "/b"]}, "filesHash is required"),
    ({"type": "COPY", "args": ["../a", "/b"], "filesHash": "ab"}, "relative"),
    ({"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": "ab"}, "octal"),
    ({"type": "COPY", "args": ["a", "/b"], "filesHash": "a/b"}, "not a hash"),
    ({"type": "RUN", "args": "echo"}, "list of strings"),
])
def test_parse_steps_rejects_bad_steps(step: dict, problem: str) -> None:
    with pytest.raises(BuildSpecError, match=problem):
        parse_steps([step])


def test_context_from_image_config() -> None:
    ctx = BuildContext.from_image_config(
        {"env": ["PATH=/usr/bin", "EMPTY=", "bad"], "user": "0:0", "workingDir": "/srv"})
    assert ctx.env == {"PATH": "/usr/bin", "EMPTY": ""}
    assert ctx.user == "user"  # numeric users cannot be selected by name: E2B's default
    assert ctx.workdir == "/srv"
    assert BuildContext.from_image_config({"User": "app:app"}).user == "app"
    restored = BuildContext.from_json(ctx.to_json())
    assert restored == ctx


# --- the build file ----------------------------------------------------------------------------


def test_build_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "c").write_text("c")
    plan = parse_build_file(
        "# a comment\n"
        "FROM debian:bookworm\n"
        "RUN apt-get update && \\\n    apt-get install -y curl\n"
        "ENV A=1 B=\"two words\"\n"
        "ENV C three words\n"
        "ARG STAGE=build\n"
        "WORKDIR /app\n"
        "USER root\n"
        "COPY --chown=user --chmod=0755 a.txt b.txt /dst\n"
        "COPY dir /app/dir\n"
        'CMD ["python3", "-m", "http.server"]\n'
        "READY curl -fs localhost:8000\n")
    assert plan.from_image == "debian:bookworm" and plan.from_template is None
    body = plan.request(tmp_path)
    types = [s["type"] for s in body["steps"]]
    assert types == ["RUN", "ENV", "ENV", "ARG", "WORKDIR", "USER", "COPY", "COPY", "COPY"]
    assert body["steps"][0]["args"] == ["apt-get update && apt-get install -y curl"]
    assert body["steps"][1]["args"] == ["A", "1", "B", "two words"]
    assert body["steps"][2]["args"] == ["C", "three words"]
    assert body["steps"][3]["args"] == ["STAGE", "build"]
    assert body["steps"][6]["args"] == ["a.txt", "/dst/", "user", "0755"]
    assert body["startCmd"] == "python3 -m http.server"
    assert body["readyCmd"] == "curl -fs localhost:8000"
    hashes = [s["filesHash"] for s in body["steps"] if s["type"] == "COPY"]
    assert len(set(hashes)) == 3
    # The hash follows the content; the archive holds paths relative to the context.
    before = files_hash(tmp_path, CopySource("dir", "/app/dir"))
    (tmp_path / "dir" / "c").write_text("changed")
    assert files_hash(tmp_path, CopySource("dir", "/app/dir")) != before
    with tarfile.open(fileobj=io.BytesIO(files_archive(tmp_path, CopySource("dir", "/x")))) as tar:
        assert sorted(tar.getnames()) == ["dir", "dir/c"]
    template = parse_build_file("FROM template base\nRUN true\n")
    assert template.from_template == "base" and template.from_image is None


@pytest.mark.parametrize(("text", "problem"), [
    ("FROM a b c\n", "FROM"),
    ("RUN\n", "missing arguments"),
    ("ENV novalue=\nENV =x\n", "KEY=value"),
    ("COPY onlyone\n", "source and a destination"),
    ("COPY --owner=x a b\n", "unknown option"),
    ("SHELL bash\n", "unknown instruction"),
    ('CMD ["unterminated"\n', "JSON"),
])
def test_build_file_errors(text: str, problem: str) -> None:
    with pytest.raises(BuildFileError, match=problem):
        parse_build_file(text)


def test_copy_source_must_exist_inside_the_context(tmp_path: Path) -> None:
    with pytest.raises(BuildFileError, match="not found"):
        files_hash(tmp_path, CopySource("missing", "/x"))
    with pytest.raises(BuildFileError, match="inside the context"):
        files_hash(tmp_path, CopySource("../etc", "/x"))


# --- StepRunner against a real envd ------------------------------------------------------------


@pytest.fixture(scope="module")
def envd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvdProcess]:
    if os.geteuid() != 0:
        pytest.skip("envd chroots into its root and switches users: run as root")
    root = make_busybox_root(tmp_path_factory.mktemp("guest") / "root")
    # The tools-disk paths a VM's envd has (/agentenv/bin/busybox, /agentenv/bin/sh).
    tools = root / "agentenv" / "bin"
    tools.mkdir(parents=True)
    shutil.copy2(root / "bin" / "busybox", tools / "busybox")
    (tools / "sh").symlink_to("busybox")
    (root / "home").chmod(0o755)
    server = start_envd(root, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _tar(files: dict[str, bytes], gz: bool) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_step_runner_runs_steps_start_and_ready(envd: EnvdProcess, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "h1").write_bytes(_tar({"conf/app.ini": b"[app]\n", "conf/extra/x": b"x"}, gz=True))
    (files / "h2").write_bytes(_tar({"single.txt": b"one file"}, gz=False))
    logs: list[tuple[str, str, str | None]] = []
    steps = parse_steps([
        {"type": "RUN", "args": ["echo hello-from-run; echo to-stderr >&2"]},
        {"type": "ENV", "args": ["GREETING", "hi there"]},
        {"type": "ARG", "args": ["STAGE", "build"]},
        {"type": "WORKDIR", "args": ["/srv/app"]},
        {"type": "RUN", "args": ['pwd > where.txt; printf "%s/%s" "$GREETING" "$STAGE" > env.txt;'
                                 ' id -un > who']},
        {"type": "COPY", "args": ["conf", "settings/"], "filesHash": "h1"},
        {"type": "COPY", "args": ["single.txt", "/opt/renamed.txt", "root", "0640"],
         "filesHash": "h2"},
        {"type": "USER", "args": ["worker"]},
        {"type": "RUN", "args": ["id -un > /tmp/worker-was-here"]},
    ])

    async def scenario() -> dict[str, str]:
        client = EnvdClient(envd.url)
        runner = StepRunner(client, BuildContext(), lambda *e: logs.append(e), files)
        try:
            await runner.prepare()
            await runner.run_steps(steps)
            await runner.start_and_wait_ready(
                "echo started > /tmp/started; exec sleep 300", "test -f /tmp/started")
            await runner.finish()
            pids = await client.running_pids()
            out = await client.run("/bin/sh", ["-c", (
                "cat where.txt env.txt who; echo; pwd; id -un; echo $GREETING;"
                " cat settings/app.ini settings/extra/x; echo;"
                " stat -c '%U %a' settings settings/app.ini /opt/renamed.txt /srv/app;"
                " cat /tmp/worker-was-here")])
            return {"out": out.stdout + out.stderr, "pids": " ".join(map(str, pids))}
        finally:
            await client.close()

    result = asyncio.run(scenario())
    lines = result["out"].splitlines()
    assert lines == [
        "/srv/app", "hi there/build" + "user", "", "/srv/app", "worker", "hi there", "[app]", "x",
        "user 755", "user 644", "root 640", "user 755", "worker",
    ], result["out"]
    assert result["pids"], "the start command does not run any more"
    messages = [m for _, m, _ in logs]
    assert "hello-from-run" in messages and "to-stderr" in messages
    assert ("warn", "to-stderr", "1") in logs
    assert any(step == "finalize" and "ready" in m for _, m, step in logs)


def test_step_runner_failures(envd: EnvdProcess, tmp_path: Path) -> None:
    async def run(steps: list[dict], start: str | None = None, ready: str | None = None,
                  timeout: float = 10) -> BuildFailed:
        client = EnvdClient(envd.url)
        runner = StepRunner(client, BuildContext(user="root"), lambda *e: None, tmp_path)
        try:
            with pytest.raises(BuildFailed) as raised:
                await runner.prepare()
                await runner.run_steps(parse_steps(steps))
                await runner.start_and_wait_ready(start, ready, timeout=timeout)
            return raised.value
        finally:
            await runner.detach()
            await client.close()

    failed = asyncio.run(run([{"type": "RUN", "args": ["true"]},
                              {"type": "RUN", "args": ["echo partial output; exit 7"]}]))
    assert failed.step == "2"
    assert "exit code 7" in failed.message and "partial output" in failed.message
    missing = asyncio.run(run([{"type": "COPY", "args": ["a", "/a"], "filesHash": "nothere"}]))
    assert missing.step == "1" and "never uploaded" in missing.message
    (tmp_path / "h").write_bytes(_tar({"other": b""}, gz=False))
    absent = asyncio.run(run([{"type": "COPY", "args": ["wanted", "/w"], "filesHash": "h"}]))
    assert "not among the uploaded files" in absent.message
    unknown_user = asyncio.run(run([{"type": "RUN", "args": ["true", "nobody-here"]}]))
    assert unknown_user.step == "1"
    crashed = asyncio.run(run([], start="echo dying; exit 3", ready="false"))
    assert crashed.step == "finalize" and "exited with code 3" in crashed.message
    never = asyncio.run(run([], start=None, ready="exit 1", timeout=1.5))
    assert never.step == "finalize" and "did not succeed" in never.message


def test_a_guest_that_never_ends_the_user_switch_fails_its_step(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The team's RUN steps run as root: they can replace the tools' shell with one whose
    `-c :` (the user switch) never ends. The switch has a deadline of its own."""
    if os.geteuid() != 0:
        pytest.skip("envd chroots into its root and switches users: run as root")
    import agentenv.template.build as build

    monkeypatch.setattr(build, "GUEST_CALL_TIMEOUT_SECONDS", 2.0)
    root = make_busybox_root(tmp_path_factory.mktemp("silent") / "root")
    tools = root / "agentenv" / "bin"
    tools.mkdir(parents=True)
    shutil.copy2(root / "bin" / "busybox", tools / "busybox")
    (tools / "sh").write_text('#!/agentenv/bin/busybox sh\n'
                              'if [ "$*" = "-c :" ]; then exec /agentenv/bin/busybox sleep 100000; fi\n'
                              'exec /agentenv/bin/busybox sh "$@"\n')
    (tools / "sh").chmod(0o755)
    (root / "home").chmod(0o755)
    server = start_envd(root, tmp_path_factory.mktemp("silent-logs"))

    async def scenario() -> BuildFailed:
        client = EnvdClient(server.url)
        runner = StepRunner(client, BuildContext(user="root"), lambda *e: None, tmp_path_factory.mktemp("f"))
        try:
            # Bounded here too, so the old code fails instead of hanging the run.
            async with asyncio.timeout(60):
                with pytest.raises(BuildFailed) as raised:
                    await runner.run_steps(parse_steps([{"type": "USER", "args": ["worker"]}]))
            return raised.value
        finally:
            await client.close()

    try:
        failed = asyncio.run(scenario())
    finally:
        server.stop()
    assert failed.step == "1"
    assert "step 1: cannot switch to user 'worker'" in failed.message, failed.message

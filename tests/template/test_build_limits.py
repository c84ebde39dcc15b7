"""Build steps against a real envd (chrooted, as in test_build): a COPY archive streamed to the
guest without being read whole into the node's memory, and a RUN step's output kept as a
bounded tail."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import tarfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.envd_client import EnvdClient
from agentenv.template.build import BuildContext, BuildFailed, StepRunner, parse_steps
from tests.envd.conftest import EnvdProcess, make_busybox_root, start_envd

MiB = 1 << 20


@pytest.fixture(scope="module")
def envd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvdProcess]:
    if os.geteuid() != 0:
        pytest.skip("envd chroots into its root and switches users: run as root")
    root = make_busybox_root(tmp_path_factory.mktemp("guest") / "root")
    tools = root / "agentenv" / "bin"
    tools.mkdir(parents=True)
    shutil.copy2(root / "bin" / "busybox", tools / "busybox")
    (tools / "sh").symlink_to("busybox")
    (root / "home").chmod(0o755)
    server = start_envd(root, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def test_copy_archive_is_streamed_not_read_whole(envd: EnvdProcess, tmp_path: Path) -> None:
    payload = os.urandom(48 * MiB)  # incompressible: the archive is as big
    files = tmp_path / "files"
    files.mkdir()
    with tarfile.open(files / "big", "w") as tar:
        info = tarfile.TarInfo("blob.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    del payload
    steps = parse_steps([{"type": "COPY", "args": ["blob.bin", "/opt/blob.bin"],
                          "filesHash": "big"}])
    expected = hashlib.sha256((files / "big").read_bytes()[512:512 + 48 * MiB]).hexdigest()

    async def scenario() -> tuple[int, str]:
        client = EnvdClient(envd.url)
        runner = StepRunner(client, BuildContext(user="root"), lambda *e: None, files)
        try:
            await runner.prepare()
            tracemalloc.start()
            await runner.run_steps(steps)
            _current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            out = await client.run("/bin/sh", ["-c", "sha256sum /opt/blob.bin"], user="root")
            return peak, out.stdout
        finally:
            await runner.detach()
            await client.close()

    peak, out = asyncio.run(scenario())
    assert out.split()[0] == expected
    # Before: the archive was read whole (48 MiB) and copied into a multipart body.
    assert peak < 12 * MiB, f"COPY held {peak / MiB:.1f} MiB of Python memory"


def test_run_output_is_kept_as_a_bounded_tail(envd: EnvdProcess, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_BUILD_OUTPUT_TAIL", str(64 * 1024))
    logged: list[int] = []

    async def scenario() -> tuple[str, BuildFailed]:
        client = EnvdClient(envd.url)
        runner = StepRunner(client, BuildContext(user="root"),
                            lambda level, message, step: logged.append(len(message)), tmp_path)
        try:
            result = await client.run("/bin/sh", ["-c", "i=0; while [ $i -lt 40000 ]; do "
                                      "echo line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; "
                                      "i=$((i+1)); done"], user="root")
            with pytest.raises(BuildFailed) as failed:
                await runner.run_steps(parse_steps([{"type": "RUN", "args": [
                    "yes 0123456789abcdef | head -c 4000000; echo; echo the-end; exit 3"]}]))
            return result.stdout, failed.value
        finally:
            await runner.detach()
            await client.close()

    stdout, failed = asyncio.run(scenario())
    assert len(stdout) == 64 * 1024  # ~1.7 MB printed, the last 64 KiB kept
    assert stdout.endswith("line-39999-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n")
    assert "exit code 3" in failed.message and "the-end" in failed.message
    assert sum(logged) > 3_000_000  # the live log saw all of it as it came


def test_build_record_keeps_the_log_tail_with_stable_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentenv.node.build_records import BuildRecord

    monkeypatch.setenv("AENV_BUILD_LOG_TAIL", str(64 * 1024))
    rec = BuildRecord("t", "b", "n", 1, 512, "building", 0.0, 0.0)
    first = [e["message"] for e in rec.logs_from(0, 100)]
    assert first == []
    for i in range(20_000):
        rec.log("info", f"line {i:05d} " + "x" * 90)
    assert rec.logs_bytes <= 64 * 1024
    assert rec.logs[-1]["message"].startswith("line 19999")
    assert rec.logs_dropped + len(rec.logs) == 20_000
    # A client that read up to entry 19,990 continues exactly there.
    assert [e["message"][:10] for e in rec.logs_from(19_990, 3)] == [
        "line 19990", "line 19991", "line 19992"]
    # One that fell behind the tail gets the oldest entry kept.
    assert rec.logs_from(5, 1)[0] is rec.logs[0]

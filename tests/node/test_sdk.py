"""The official e2b Python SDK (2.63) against the node, configured only by environment."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import threading
import time
from collections.abc import Iterator

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from tests.node.conftest import NodeProcess


@pytest.fixture(scope="module")
def sbx(sdk_env: NodeProcess) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(
        template="base", timeout=300, metadata={"suite": "sdk", "who": "a b&c"}, envs={"FOO": "bar"}
    )
    yield sandbox
    sandbox.kill()


def test_create_returns_a_running_sandbox_with_metadata(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "sdk", "who": "a b&c"}
    assert info.template_id == "base"
    assert info.end_at > info.started_at
    assert sbx.is_running()
    assert "-" not in sbx.sandbox_id and "." not in sbx.sandbox_id


def test_env_vars_and_foreground_commands(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo $FOO; echo err >&2")
    assert result.stdout == "bar\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0
    assert sbx.commands.run("echo $X", envs={"X": "per-call"}).stdout == "per-call\n"
    with pytest.raises(CommandExitException) as exc_info:
        sbx.commands.run("exit 3")
    assert exc_info.value.exit_code == 3


def test_streaming_output_arrives_in_order(sbx: Sandbox) -> None:
    seen: list[str] = []
    result = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=seen.append
    )
    assert "".join(seen) == "line1\nline2\nline3\n" == result.stdout
    big = sbx.commands.run("head -c 200000 /dev/zero | tr '\\0' 'x'")
    assert len(big.stdout) == 200000


def test_background_command_list_and_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 30", background=True)
    assert any(p.pid == handle.pid for p in sbx.commands.list())
    assert sbx.commands.kill(handle.pid)
    assert not sbx.commands.kill(handle.pid)


def test_stdin(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "hello stdin\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello stdin\n"


def test_command_timeout(sbx: Sandbox) -> None:
    began = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 5", timeout=1)
    assert time.monotonic() - began < 10  # the 5 s sleep was cut short


def test_files_write_read_list_missing(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/dir/a.txt", "alpha")
    sbx.files.write("/home/user/dir/b.bin", b"\x00\x01beta")
    assert sbx.files.read("/home/user/dir/a.txt") == "alpha"
    assert sbx.files.read("/home/user/dir/b.bin", format="bytes") == b"\x00\x01beta"
    names = sorted(e.name for e in sbx.files.list("/home/user/dir"))
    assert names == ["a.txt", "b.bin"]
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/dir/missing")
    sbx.files.write("/home/user/gz.txt", io.BytesIO(b"zipped" * 1000), gzip=True)
    assert sbx.files.read("/home/user/gz.txt") == "zipped" * 1000


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "x")
        deadline = time.monotonic() + 20
        names: set[str] = set()
        while time.monotonic() < deadline and "new.txt" not in names:
            names.update(e.name for e in handle.get_new_events())
            time.sleep(0.1)
        assert "new.txt" in names
    finally:
        handle.stop()


def test_50_mib_up_and_down(sbx: Sandbox) -> None:
    data = os.urandom(1 << 20) * 50
    digest = hashlib.sha256(data).hexdigest()
    began = time.monotonic()
    sbx.files.write("/tmp/big.bin", io.BytesIO(data))  # octet-stream, chunked through the proxy
    up = time.monotonic() - began
    assert sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest
    began = time.monotonic()
    back = sbx.files.read("/tmp/big.bin", format="bytes")
    down = time.monotonic() - began
    assert hashlib.sha256(back).hexdigest() == digest
    print(f"50 MiB upload {up:.2f}s, download {down:.2f}s")


def test_list_filters_and_paging(sdk_env: NodeProcess, sbx: Sandbox) -> None:
    other = Sandbox.create(template="base", timeout=120, metadata={"suite": "sdk", "who": "z"})
    try:
        mine = Sandbox.list(query=SandboxQuery(metadata={"who": "a b&c"})).next_items()
        assert [s.sandbox_id for s in mine] == [sbx.sandbox_id]
        paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk"}), limit=1)
        first = paginator.next_items()
        assert len(first) == 1 and paginator.has_next
        second = paginator.next_items()
        assert len(second) == 1 and not paginator.has_next
        assert {first[0].sandbox_id, second[0].sandbox_id} == {sbx.sandbox_id, other.sandbox_id}
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert all(s.state == SandboxState.PAUSED for s in paused)
        assert sbx.sandbox_id not in {s.sandbox_id for s in paused}
    finally:
        other.kill()
    ids = {
        s.sandbox_id
        for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk"})).next_items()
    }
    assert ids == {sbx.sandbox_id}


def test_set_timeout_and_expiry_kills(sdk_env: NodeProcess) -> None:
    sandbox = Sandbox.create(template="base", timeout=300)
    sandbox.set_timeout(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sandbox.is_running():
        time.sleep(0.2)
    assert not sandbox.is_running()
    with pytest.raises(SandboxNotFoundException):
        sandbox.get_info()
    assert Sandbox.kill(sandbox.sandbox_id) is False


def test_kill_then_is_running_false(sdk_env: NodeProcess) -> None:
    sandbox = Sandbox.create(template="base")
    assert sandbox.kill() is True
    assert sandbox.is_running() is False
    assert sandbox.kill() is False


def test_errors_map_to_sdk_exceptions(sdk_env: NodeProcess) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("inosuchsandbox000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("inosuchsandbox000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout("inosuchsandbox000000", 10)
    assert Sandbox.kill("inosuchsandbox000000") is False
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(template="no-such-template")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "0" * 40).next_items()


def test_concurrent_commands_share_the_proxy(sbx: Sandbox) -> None:
    outputs: list[str] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            outputs.append(sbx.commands.run(f"sleep 0.2; echo {i}").stdout.strip())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(outputs, key=int) == [str(i) for i in range(8)]


def test_async_sdk_streams_and_watch(sdk_env: NodeProcess) -> None:
    from e2b import AsyncSandbox

    async def scenario() -> None:
        sandbox = await AsyncSandbox.create(template="base", timeout=60)
        try:
            events: list[str] = []
            handle = await sandbox.files.watch_dir(
                "/home/user", on_event=lambda e: events.append(e.name)
            )
            await sandbox.files.write("/home/user/async.txt", "a")
            for _ in range(200):
                if "async.txt" in events:
                    break
                await asyncio.sleep(0.1)
            await handle.stop()
            assert "async.txt" in events
            result = await sandbox.commands.run("echo async-ok")
            assert result.stdout == "async-ok\n"
        finally:
            await sandbox.kill()

    asyncio.run(scenario())

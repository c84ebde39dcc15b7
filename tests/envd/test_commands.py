"""commands.* of the official e2b SDK against envd: foreground, background, streaming, stdin,
timeouts, kill, users, cwd and env."""

from __future__ import annotations

import threading
import time

import pytest
from e2b import CommandExitException, NotFoundException, Sandbox, TimeoutException
from e2b.exceptions import InvalidArgumentException

pytestmark = pytest.mark.root


def test_run_foreground_stdout_stderr(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo hi; echo oops >&2")
    assert result.stdout == "hi\n"
    assert result.stderr == "oops\n"
    assert result.exit_code == 0
    assert result.error is None


def test_exit_code_raises_command_exit(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n"
    assert info.value.error == "exit status 3"


def test_default_user_is_created_and_root_on_request(sbx: Sandbox, envd) -> None:
    # The busybox root has no `user` account: envd creates it on first use.
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("echo $HOME; pwd").stdout == "/home/user\n/home/user\n"
    assert "user:x:1000:1000::/home/user:" in (envd.root / "etc" / "passwd").read_text()
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"


def test_chroot_cwd_and_envs(sbx: Sandbox) -> None:
    result = sbx.commands.run("pwd; echo $FOO-$USER; ls /", cwd="/data", envs={"FOO": "bar"})
    lines = result.stdout.splitlines()
    assert lines[0] == "/data"
    assert lines[1] == "bar-user"
    assert "busybox" not in lines[2:]  # the listing is of the chroot, not of the host
    assert {"bin", "etc", "data", "tmp"} <= set(lines[2:])


def test_missing_cwd_is_invalid_argument(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="cwd '/nope' does not exist"):
        sbx.commands.run("true", cwd="/nope")


def test_streaming_callbacks_arrive_while_running(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    result = sbx.commands.run(
        "echo one; sleep 1; echo two; echo three >&2",
        on_stdout=lambda line: seen.append((time.monotonic() - started, line)),
        on_stderr=lambda line: seen.append((time.monotonic() - started, "err:" + line)),
    )
    assert [line for _, line in seen] == ["one\n", "two\n", "err:three\n"]
    assert seen[0][0] < seen[1][0] - 0.5  # "one" came a second before "two", not at the end
    assert result.stdout == "one\ntwo\n"


def test_large_output_with_multibyte_characters(sbx: Sandbox) -> None:
    # 200 000 bytes of a 3-byte character: many 32 KiB chunks, characters split across them.
    result = sbx.commands.run("yes € | head -c 200000; echo")
    assert len(result.stdout.encode()) > 32 * 1024 * 5
    assert set(result.stdout.replace("\n", "")) <= {"€", "\ufffd"}
    assert result.stdout.count("€") >= 49_000


def test_background_list_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 30", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].cmd == "/bin/bash"
    assert listed[handle.pid].args[-1] == "sleep 30"
    assert sbx.commands.kill(handle.pid) is True
    assert sbx.commands.kill(handle.pid) is False
    assert handle.pid not in {p.pid for p in sbx.commands.list()}
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"


def test_stdin_send_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "hello ")
    sbx.commands.send_stdin(handle.pid, "stdin\n")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "hello stdin\n"


def test_stream_input(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, iter([b"a", b"b", "c\n"]))
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "abc\n"


def test_stdin_off_reads_eof(sbx: Sandbox) -> None:
    assert sbx.commands.run("cat; echo done").stdout == "done\n"
    with pytest.raises(Exception, match="not open"):
        handle = sbx.commands.run("sleep 5", background=True)
        try:
            sbx.commands.send_stdin(handle.pid, "x")
        finally:
            handle.kill()


def test_timeout_kills_the_process(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("echo started; sleep 20", timeout=1)
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    assert not [p for p in sbx.commands.list() if p.args and p.args[-1].endswith("sleep 20")]


def test_connect_reattaches_and_disconnect_keeps_running(sbx: Sandbox) -> None:
    handle = sbx.commands.run(
        "for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.3; done", background=True
    )
    handle.disconnect()
    time.sleep(0.5)
    assert handle.pid in {p.pid for p in sbx.commands.list()}  # survived the disconnect
    again = sbx.commands.connect(handle.pid)
    result = again.wait()
    assert result.exit_code == 0
    assert "tick6\n" in result.stdout
    assert "tick1\n" not in result.stdout  # live output only, no replay
    # Connecting to a process that already ended gets its end.
    assert sbx.commands.connect(handle.pid).wait().exit_code == 0


def test_connect_unknown_pid_is_not_found(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999)
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(999_999, "x")


def test_concurrent_commands(sbx: Sandbox) -> None:
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = sbx.commands.run(f"sleep 0.2; echo {i}").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {i: f"{i}\n" for i in range(8)}


def test_background_grandchild_does_not_hold_the_stream(sbx: Sandbox) -> None:
    started = time.monotonic()
    result = sbx.commands.run("sleep 3 & echo parent done")
    assert result.stdout == "parent done\n"
    assert time.monotonic() - started < 2


def test_missing_shell_without_fallback(fresh_envd) -> None:
    server = fresh_envd(AENV_ENVD_SHELL_FALLBACK="")
    sandbox = server.sandbox()
    with pytest.raises(InvalidArgumentException, match="/bin/bash"):
        sandbox.commands.run("true")


def test_spawn_without_busybox_and_with_supplementary_groups(fresh_envd) -> None:
    """The Python spawn path (no busybox helper) behaves like the fast one, and a user with
    supplementary groups keeps them (the helper would drop them, so it is not used then)."""
    server = fresh_envd(AENV_ENVD_BUSYBOX="")
    sandbox = server.sandbox()
    assert sandbox.commands.run("whoami; pwd; echo $HOME").stdout == "user\n/home/user\n/home/user\n"
    assert sandbox.commands.run("id -u; pwd", user="root", cwd="/data").stdout == "0\n/data\n"
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("true", cwd="/missing")

    fast = fresh_envd()
    fast_sandbox = fast.sandbox()
    assert fast_sandbox.commands.run("id -G").stdout == "1000\n"
    with open(fast.root / "etc" / "group", "a") as group:
        group.write("extra:x:2000:user\n")
    assert fast_sandbox.commands.run("id -G").stdout == "1000 2000\n"


def test_a_quiet_process_outlives_the_idle_bound_thanks_to_keepalives(
        envd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's client ends a stream silent for IDLE_READ_SECONDS; it asks envd for a
    keepalive every KEEPALIVE_SECONDS, so a process quiet for longer is still followed."""
    import asyncio

    import agentenv.envd_client as envd_client

    monkeypatch.setattr(envd_client, "KEEPALIVE_SECONDS", 1)
    monkeypatch.setattr(envd_client, "IDLE_READ_SECONDS", 3.0)

    async def main() -> envd_client.ProcessResult:
        client = envd_client.EnvdClient(envd.url)
        try:
            return await client.run("/bin/sh", ["-c", "sleep 6; echo done"], user="root")
        finally:
            await client.close()

    result = asyncio.run(main())
    assert result.exit_code == 0 and result.stdout == "done\n"

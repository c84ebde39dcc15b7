"""E2B parity through the official SDK on the VM backend: a filesystem-only pause and its
connect (a cold boot from the disk: files kept, boot id changed, the sandbox's identity back;
it survives a node restart), connect with on_resume="reboot", the timeout auto-pause in that mode, the base template's sudo,
python, pip --user and apt, metadata cleared on overwrite, and fork counts above the node's
limit."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.node import conftest
from tests.node.conftest import NodeProcess

pytestmark = [pytest.mark.qemu, pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module")
def parity_node(shared_vm_node: NodeProcess) -> Iterator[NodeProcess]:
    """The session's shared VM node (conftest.shared_vm_node: no ready pool), SDK pointed at it."""
    with conftest.sdk_pointed_at(shared_vm_node):
        yield shared_vm_node


def _run(sbx: Any, cmd: str, **kwargs: Any) -> Any:
    """commands.run, retried while a freshly started guest settles (TCG, a loaded host)."""
    from e2b.exceptions import SandboxNotRunningException
    from e2b.sandbox.commands.command_handle import CommandExitException

    for attempt in range(20):
        try:
            return sbx.commands.run(cmd, timeout=120, **kwargs)
        except Exception as exc:
            if isinstance(exc, CommandExitException | SandboxNotRunningException) or \
                    attempt == 19:
                raise
            time.sleep(1)
    raise AssertionError("unreachable")


def _boot_id(sbx: Any) -> str:
    return str(_run(sbx, "cat /proc/sys/kernel/random/boot_id").stdout.strip())


def _pause_record(node: NodeProcess, sandbox_id: str) -> dict[str, Any]:
    """The snapshot record of a paused sandbox's pause (the node's SQLite row names it)."""
    import sqlite3

    conn = sqlite3.connect(node.state_dir / "node.db")
    try:
        [(doc,)] = conn.execute("SELECT doc FROM sandboxes WHERE id = ?", (sandbox_id,))
    finally:
        conn.close()
    record_dir = Path(json.loads(doc)["pause_snapshot"]["data"]["record_dir"])
    record = json.loads((record_dir / "snapshot.json").read_text())
    record["files"] = sorted(p.name for p in record_dir.iterdir())
    return record


def test_filesystem_pause_then_connect_cold_boots(parity_node: NodeProcess) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxNotRunningException

    sbx = Sandbox.create(timeout=600, envs={"PARITY": "kept"})
    try:
        boot_before = _boot_id(sbx)
        sbx.files.write("/home/user/kept.txt", "written before the pause")
        _run(sbx, "sleep 1000", background=True)
        assert sbx.pause(keep_memory=False) is True
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state.value == "paused"
        with parity_node.client() as api:
            assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["pauseMode"] == "filesystem"
        record = _pause_record(parity_node, sbx.sandbox_id)
        assert record["memory"] is False and record["memory_layers"] == []
        assert "memory.layer" not in record["files"] and "devstate.bin" not in record["files"]
        assert any(d["name"] == "rootfs" and d["layers"] for d in record["disks"])
        with pytest.raises(SandboxNotRunningException):  # no auto-resume by traffic
            sbx.commands.run("true", timeout=30)

        # persisted like any paused sandbox: a node restart keeps it
        parity_node.stop()
        parity_node.start()

        t0 = time.monotonic()
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        print(f"\ncold-boot connect: {time.monotonic() - t0:.1f} s")
        boot_after = _boot_id(again)
        assert boot_after != boot_before  # a cold boot, not a memory restore
        assert again.files.read("/home/user/kept.txt") == "written before the pause"
        # the identity /init gives: env vars, E2B's variables, the default user, the token
        # (the old object still works: the token did not change)
        out = _run(sbx, "echo $PARITY $E2B_SANDBOX_ID; whoami").stdout.split()
        assert out == ["kept", sbx.sandbox_id, "user"]
        assert _run(again, "pgrep -fx 'sleep 1000' || echo none").stdout.strip() == "none"

        # a memory pause of the cold-booted sandbox restores it: same boot id
        assert again.pause() is True
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert _boot_id(back) == boot_after
        with parity_node.client() as api:
            assert "pauseMode" not in api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        # on_resume="reboot" (connect with memory false) cold-boots even a memory pause
        assert back.pause() is True
        rebooted = Sandbox.connect(sbx.sandbox_id, timeout=600, on_resume="reboot")
        assert _boot_id(rebooted) != boot_after
        assert rebooted.files.read("/home/user/kept.txt") == "written before the pause"
    finally:
        sbx.kill()


def test_timeout_auto_pause_filesystem_only(parity_node: NodeProcess) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600, lifecycle={"on_timeout": {"action": "pause",
                                                                "keep_memory": False}})
    try:
        boot_before = _boot_id(sbx)
        sbx.files.write("/home/user/auto.txt", "auto")
        # The timeout runs out soon after the test's own calls, however long they took (a
        # short create timeout would be a race with them on a loaded host).
        sbx.set_timeout(2)
        deadline = time.monotonic() + 120
        while Sandbox.get_info(sbx.sandbox_id).state.value != "paused":
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(1)
        with parity_node.client() as api:
            detail = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
            while "pauseMode" not in detail:  # listed as paused while the pause runs
                time.sleep(0.5)
                detail = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert detail["pauseMode"] == "filesystem"
        assert _pause_record(parity_node, sbx.sandbox_id)["memory"] is False
        again = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert _boot_id(again) != boot_before
        assert again.files.read("/home/user/auto.txt") == "auto"
    finally:
        sbx.kill()


def _wheel(name: str, value: str) -> bytes:
    """A pure-Python wheel made here (the guest has no internet to pip install from)."""
    files = {f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
             f"{name}-0.1.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{name}-0.1.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: aenv-test\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{name}-0.1.dist-info/RECORD,,")
    files[f"{name}-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return buf.getvalue()


def test_base_template_has_what_e2b_base_has(parity_node: NodeProcess) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=900)
    try:
        assert _run(sbx, "whoami; sudo -n true && echo sudo-ok").stdout.split() == \
            ["user", "sudo-ok"]
        assert _run(sbx, "sudo -n whoami").stdout.strip() == "root"
        _run(sbx, "python -c 1")
        assert _run(sbx, "python --version").stdout.startswith("Python 3.")
        for tool in ("git", "curl", "wget", "jq", "unzip", "pip", "ps", "ip", "less", "vi"):
            _run(sbx, f"command -v {tool}")
        assert "apt " in _run(sbx, "apt-get --version", user="root").stdout
        assert _run(sbx, "dpkg -l sudo | tail -1", user="root").stdout.startswith("ii")
        wheel = "/tmp/parity_probe-0.1-py3-none-any.whl"
        sbx.files.write(wheel, _wheel("parity_probe", "from a local wheel"))
        _run(sbx, f"pip install --user --no-index {wheel}")
        assert _run(sbx, "python -c 'import parity_probe; print(parity_probe.VALUE)'"
                    ).stdout.strip() == "from a local wheel"
        assert _run(sbx, "ls ~/.local/lib/python3*/site-packages").stdout.count("parity_probe")
    finally:
        sbx.kill()


def test_overwrite_clears_metadata_and_fork_limit(parity_node: NodeProcess) -> None:
    from e2b import Sandbox
    from e2b.exceptions import InvalidArgumentException

    sbx = Sandbox.create(timeout=900)
    try:
        sbx.files.write("/home/user/m.txt", "one", metadata={"owner": "alice", "v": "1"})
        assert sbx.files.get_info("/home/user/m.txt").metadata == {"owner": "alice", "v": "1"}
        sbx.files.write("/home/user/m.txt", "two", metadata={"v": "2"})
        assert sbx.files.get_info("/home/user/m.txt").metadata == {"v": "2"}
        sbx.files.write("/home/user/m.txt", "three")
        assert not sbx.files.get_info("/home/user/m.txt").metadata
        # The SDK refuses counts above its own bound before sending (20 in e2b 2.63); the
        # node's limit is E2B's API limit, 100 (the seed's 16 was the floor): ask it directly.
        refused = httpx.post(f"{parity_node.url}/sandboxes/{sbx.sandbox_id}/fork",
                             json={"count": 101}, headers={"X-API-Key": parity_node.api_key},
                             verify=parity_node.verify, timeout=60)
        assert refused.status_code == 400, refused.text
        assert "100" in refused.text and "limit" in refused.text
        with pytest.raises(InvalidArgumentException):
            sbx.fork(count=101)
    finally:
        sbx.kill()

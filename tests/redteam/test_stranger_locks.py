"""A stranger on the node (a local user who is neither root nor the node) against the runtime's
host-wide locks.

The slot lock (taken around every slot's address check and creation) and the claim of a
network prefix (held for a runtime's life) must not be places a stranger can reach: before the
red team of 2026-12-07 the first was a file in the world-writable /run/lock, named after the
network namespace's inode (which anyone can stat), and the second an abstract unix socket,
which any process of the namespace may bind. `nobody` pre-created the lock file and held a
flock on it (every slot creation of the node then waited forever: no VM was created), or
bound the prefix's name first (the VM backend refused to start, naming "another runtime").
On a host without `fs.protected_symlinks`, the lock file could also be a symlink: root then
created a file of its choice anywhere.

Each test makes a network namespace of its own, so the node's and the other tests' locks are
never touched.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, a second uid)")
    name = f"rt24-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _in_netns(netns: str, code: str, *, user: int | None = None,
              timeout: float = 20) -> subprocess.CompletedProcess[str]:
    argv = ["ip", "netns", "exec", netns]
    if user is not None:
        argv += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    return subprocess.run([*argv, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                          cwd="/")


@contextlib.contextmanager
def _stranger(netns: str, code: str) -> Iterator[subprocess.Popen[str]]:
    """`code` run by nobody in `netns`; it prints "ready" once it holds what it takes."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
         "--clear-groups", sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_stranger_cannot_hold_the_slot_lock(netns: str) -> None:
    """nobody makes the slot lock's file (for the namespace's inode) and holds a flock on it:
    the runtime still takes its slot lock within seconds."""
    inode = os.stat(f"/run/netns/{netns}").st_ino
    stranger = f"""
import fcntl, os
for d in ("/run/lock", "/tmp"):
    if os.path.isdir(d):
        break
try:
    fd = os.open(f"{{d}}/agentenv-slots-{inode}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
except OSError:
    pass
print("ready", flush=True)
import time; time.sleep(120)
"""
    made: list[Path] = [Path(d) / f"agentenv-slots-{inode}.lock" for d in ("/run/lock", "/tmp")]
    try:
        with _stranger(netns, stranger):
            took = _in_netns(netns, "import os\n"
                             "from agentenv.runtime.network import _host_slot_lock\n"
                             "os.close(_host_slot_lock()); print('locked')", timeout=15)
            assert took.returncode == 0 and "locked" in took.stdout, took.stderr[-2000:]
    except subprocess.TimeoutExpired:
        pytest.fail("a stranger holding the slot lock's file stopped the runtime's slot lock")
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                if path.lstat().st_uid == NOBODY:
                    path.unlink()


def test_a_stranger_cannot_plant_the_slot_lock_as_a_symlink(netns: str, tmp_path: Path) -> None:
    """nobody puts a symlink where the slot lock's file goes: root does not create the file it
    names."""
    inode = os.stat(f"/run/netns/{netns}").st_ino
    target = Path("/run") / f"rt24-planted-{uuid.uuid4().hex[:8]}"
    links = [Path(d) / f"agentenv-slots-{inode}.lock" for d in ("/run/lock", "/tmp")]
    try:
        planted = _in_netns(netns, "import os\n" + "".join(
            f"os.symlink({str(target)!r}, {str(link)!r})\n" for link in links
            if link.parent.is_dir()), user=NOBODY)
        assert planted.returncode == 0, planted.stderr
        took = _in_netns(netns, "import os\n"
                         "from agentenv.runtime.network import _host_slot_lock\n"
                         "os.close(_host_slot_lock()); print('locked')", timeout=15)
        assert took.returncode == 0, took.stderr[-2000:]
        assert not target.exists(), f"root created {target} through a stranger's symlink"
    finally:
        for path in [*links, target]:
            with contextlib.suppress(OSError):
                if path.lstat().st_uid in (NOBODY, 0) and (path == target or path.is_symlink()):
                    path.unlink()


def test_a_stranger_cannot_claim_a_runtimes_prefix(netns: str) -> None:
    """nobody takes the prefix's name first: the runtime still claims its prefix."""
    prefix = "rt24p"
    stranger = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\\0agentenv-runtime-{prefix}")
print("ready", flush=True)
import time; time.sleep(120)
"""
    with _stranger(netns, stranger):
        claimed = _in_netns(netns, "from agentenv.runtime.network import claim_prefix\n"
                            f"claim_prefix({prefix!r}).close(); print('claimed')")
    assert claimed.returncode == 0 and "claimed" in claimed.stdout, claimed.stderr[-2000:]


def test_the_prefix_is_still_one_runtimes(netns: str) -> None:
    """What the claim is for still holds: a second claim of a held prefix is refused, naming
    the holder; once it is let go, it can be claimed again."""
    holder = _in_netns(netns, """
from agentenv.runtime.network import claim_prefix, NetworkError
first = claim_prefix("rt24q")
try:
    claim_prefix("rt24q")
except NetworkError as exc:
    print("refused:", exc)
first.close()
claim_prefix("rt24q").close()
print("again")
""")
    assert holder.returncode == 0, holder.stderr[-2000:]
    assert "refused:" in holder.stdout and "pid " in holder.stdout, holder.stdout
    assert "again" in holder.stdout

"""A jail per VM (runtime/jail.py) against a QEMU taken over by its guest: with the first VM's
QEMU credentials (its uid, gid and groups; on the host, and inside its jail), nothing of a
second VM (its memory through /proc/PID/mem, its files and sockets, signals) nor of the
runtime's state can be reached; the jail sees only its own process; QEMU's environment holds
nothing of the node's; uids are per VM and reused only after the VM is gone."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.runtime.memory import find_ram_mapping
from agentenv.runtime.vm import VM
from agentenv.snapshot.record import SnapshotRecord

from .conftest import Env

pytestmark = [pytest.mark.qemu, pytest.mark.root]

CANARY = "AENV_TEST_JAIL_CANARY"
SYSTEM_PYTHON = "/usr/bin/python3"  # in every jail (/usr is bound read-only)

# Runs as the attacker: tries each probe and reports what happened (stdlib only).
PROBE = r"""
import json, os, socket, sys
probes = json.loads(sys.argv[1])
out = {}
for name, (kind, arg) in probes.items():
    try:
        if kind == "mem":
            path, addr = arg
            with open(path, "rb") as f:
                f.seek(addr)
                f.read(4096)
        elif kind == "read":
            with open(arg, "rb") as f:
                f.read(1)
        elif kind == "list":
            os.listdir(arg)
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(arg)
            s.close()
        elif kind == "signal":
            os.kill(arg, 0)
        elif kind == "write-open":
            os.close(os.open(arg, os.O_RDWR))
        elif kind == "exists":
            if not os.path.lexists(arg):
                raise FileNotFoundError(arg)
        out[name] = "ok"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


@dataclass
class Credentials:
    uid: int
    gid: int
    groups: list[int]


def credentials(pid: int) -> Credentials:
    ids: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            ids[key] = [int(x) for x in value.split()]
    return Credentials(ids["Uid"][0], ids["Gid"][0], ids.get("Groups", []))


def _as_qemu(pid: int) -> list[str]:
    """setpriv to exactly the credentials of QEMU `pid`, without capabilities."""
    creds = credentials(pid)
    groups = (["--groups", ",".join(map(str, creds.groups))] if creds.groups
              else ["--clear-groups"])
    return ["/usr/bin/setpriv", "--reuid", str(creds.uid), "--regid", str(creds.gid), *groups,
            "--inh-caps=-all", "--bounding-set=-all", "--"]


def as_qemu_on_host(pid: int, probes: dict[str, tuple[str, object]]) -> dict[str, str]:
    out = subprocess.run([*_as_qemu(pid), SYSTEM_PYTHON, "-c", PROBE, json.dumps(probes)],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def inside_jail(pid: int, argv: list[str]) -> str:
    """`argv` in QEMU `pid`'s mount and PID namespaces, with its credentials."""
    out = subprocess.run(["nsenter", "--target", str(pid), "--mount", "--pid", "--",
                          *_as_qemu(pid), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def nbd_socket(vm: VM) -> str:
    found = re.search(r"server\.path=([^,\s]+\.sock)", (vm.workdir / "argv").read_text())
    assert found, "the VM's argv names no NBD socket"
    return found.group(1)


@pytest.fixture(scope="module")
def two_vms(env: Env, counting: SnapshotRecord) -> Iterator[tuple[VM, VM]]:
    # What the node's environment holds (its secrets among it) must not reach QEMU.
    os.environ[CANARY] = "node-secret"
    try:
        first = env.loop.run(env.runtime.restore(counting))
        second = env.loop.run(env.runtime.restore(counting))
    finally:
        os.environ.pop(CANARY, None)
    try:
        yield first, second
    finally:
        for vm in (first, second):
            env.loop.run(env.runtime.kill(vm))


def test_a_qemu_cannot_read_or_signal_another_qemu(env: Env, two_vms: tuple[VM, VM]) -> None:
    first, second = two_vms
    addr = find_ram_mapping(second.pid, str(second.mem_path), second.machine.memory_bytes)
    result = as_qemu_on_host(first.pid, {
        "memory": ("mem", [f"/proc/{second.pid}/mem", addr]),
        "signal": ("signal", second.pid),
    })
    assert result == {"memory": "PermissionError", "signal": "PermissionError"}


def test_a_qemu_cannot_reach_another_vms_files_or_the_runtimes_state(
        env: Env, counting: SnapshotRecord, two_vms: tuple[VM, VM]) -> None:
    first, second = two_vms
    state = env.runtime.config.state_dir
    probes: dict[str, tuple[str, object]] = {
        "serial log": ("read", str(second.workdir / "serial.log")),
        "device state": ("read", str(second.workdir / "devstate.in")),
        "workdir": ("list", str(second.workdir)),
        "nbd socket": ("connect", nbd_socket(second)),
        "qmp socket": ("connect", str(second.workdir / "qmp.sock")),
        "memory layer": ("read", counting.memory_layers[0].path),
        "snapshot device state": ("read", counting.device_state),
        "snapshots": ("list", str(env.runtime.config.snapshot_dir)),
        "state dir": ("list", str(state)),
        "blockd records": ("list", str(state / "devices")),
        "lease of the uids": ("list", str(getattr(env.runtime.config, "vm_uid_lease_dir",
                                                  "/run/aenv/vm-uids"))),
    }
    # On the host with its credentials, and from inside its jail (where it really runs).
    on_host = as_qemu_on_host(first.pid, probes)
    assert not [name for name, outcome in on_host.items() if outcome == "ok"], on_host
    # In the jail the state directory's path exists only as the way to its own files.
    del probes["state dir"]
    in_jail = json.loads(inside_jail(first.pid, [SYSTEM_PYTHON, "-c", PROBE,
                                                 json.dumps(probes)]))
    assert not [name for name, outcome in in_jail.items() if outcome == "ok"], in_jail
    shown = inside_jail(first.pid, ["/usr/bin/ls", "-A", str(state)]).split()
    assert set(shown) <= {"vms", "nbd", "memfs", "memory"}, shown
    # ...while its own files are there for it.
    own = json.loads(inside_jail(first.pid, [SYSTEM_PYTHON, "-c", PROBE, json.dumps({
        "own serial log": ("read", str(first.workdir / "serial.log")),
        "own nbd socket": ("connect", nbd_socket(first)),
        "ram file": ("read", str(first.mem_path)),
    })]))
    assert set(own.values()) == {"ok"}, own


def test_the_jail_sees_only_its_own_qemu(env: Env, two_vms: tuple[VM, VM]) -> None:
    first, second = two_vms
    listing = inside_jail(first.pid, ["/usr/bin/ls", "/proc"]).split()
    pids = sorted(int(x) for x in listing if x.isdigit())
    # QEMU as PID 1 and the `ls` itself.
    assert pids[0] == 1 and len(pids) == 2, listing
    qemu = inside_jail(first.pid, ["/usr/bin/cat", "/proc/1/cmdline"])
    assert f"{first.workdir}/serial.log" in qemu
    mounts = inside_jail(first.pid, ["/usr/bin/cat", "/proc/self/mounts"])
    assert str(second.workdir) not in mounts
    assert f" {env.runtime.config.state_dir} " not in mounts


def test_qemus_environment_names_nothing_of_the_node(two_vms: tuple[VM, VM]) -> None:
    for vm in two_vms:
        environ = Path(f"/proc/{vm.pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
        assert CANARY not in names
        # and the library that opens its RAM file read-only, and that file's name
        assert names <= {"PATH", "LANG", "LD_PRELOAD", "AENV_RAM_FILE"}, names


def _ram_descriptors(vm: VM) -> list[int]:
    """The access modes (O_RDONLY...) of QEMU's descriptors of its RAM file."""
    ram = os.path.realpath(vm.mem_path)
    modes = []
    for fd in os.listdir(f"/proc/{vm.pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{vm.pid}/fd/{fd}") == ram:
                flags = Path(f"/proc/{vm.pid}/fdinfo/{fd}").read_text().split("flags:")[1]
                modes.append(int(flags.split()[0], 8) & os.O_ACCMODE)
    return modes


def test_no_qemu_holds_or_gets_a_writable_ram_file(env: Env, two_vms: tuple[VM, VM]) -> None:
    """A RAM file is shared (by every VM of a snapshot, by every boot of a size): QEMU holds
    it read-only, though free-page reporting runs (`readonly=off`), and cannot open it for
    writing (red team of 2026-12-07; tests/redteam/test_memfs_shared_pages.py for the write
    itself)."""
    booted = env.boot()
    try:
        for vm in (*two_vms, booted):
            assert "readonly=off" in (vm.workdir / "argv").read_text()
            assert _ram_descriptors(vm) == [os.O_RDONLY], vm.mem_path
            probe = {"ram file": ("write-open", str(vm.mem_path))}
            assert as_qemu_on_host(vm.pid, probe)["ram file"] != "ok"
            in_jail = json.loads(inside_jail(vm.pid, [SYSTEM_PYTHON, "-c", PROBE,
                                                      json.dumps(probe)]))
            assert in_jail["ram file"] != "ok", in_jail
    finally:
        env.loop.run(env.runtime.kill(booted))


def test_each_vm_has_its_own_uid_given_back_when_it_is_gone(
        env: Env, counting: SnapshotRecord, two_vms: tuple[VM, VM]) -> None:
    first, second = two_vms
    one, two = credentials(first.pid), credentials(second.pid)
    assert one.uid != two.uid and one.gid != two.gid
    uids = env.runtime.uids
    assert uids.contains(one.uid) and uids.contains(two.uid)
    assert {one.uid, two.uid} <= uids.leased()
    third = env.loop.run(env.runtime.restore(counting))
    uid = credentials(third.pid).uid
    assert uid not in (one.uid, two.uid)
    env.loop.run(env.runtime.kill(third))
    assert uid not in uids.leased()
    assert {one.uid, two.uid} <= uids.leased()


def test_uid_pool_reuses_a_uid_only_after_its_vm_is_gone(tmp_path: Path) -> None:
    from agentenv.runtime.jail import UidPool

    pool = UidPool(300000, 300002, tmp_path / "leases")
    taken = [pool.allocate("vm") for _ in range(3)]
    assert sorted(taken) == [300000, 300001, 300002]
    with pytest.raises(Exception, match="no free VM uid"):
        pool.allocate("vm")
    pool.release(300001)
    assert pool.allocate("vm") == 300001
    # A restarted runtime (a new pool over the same leases) keeps the lease of a uid that
    # still runs a process (a QEMU it adopts) and drops those of VMs that are gone.
    for uid in taken:
        (tmp_path / "leases" / str(uid)).write_text("999999999 vm\n")  # a dead runtime
    sleeper = subprocess.Popen(["setpriv", "--reuid", "300000", "--regid", "300000",
                                "--clear-groups", "sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{sleeper.pid}").stat().st_uid != 300000:
            assert time.monotonic() < deadline, "setpriv did not switch to uid 300000"
            time.sleep(0.01)
        again = UidPool.parse("300000-300002", tmp_path / "leases")
        assert sorted(again.sweep()) == [300001, 300002]
        assert again.leased() == {300000}
        assert again.allocate("vm") == 300001
    finally:
        sleeper.kill()
        sleeper.wait()


def test_uid_range_must_be_valid(tmp_path: Path) -> None:
    from agentenv.runtime.jail import UidPool

    for bad in ("0-10", "10-5", "a-b"):
        with pytest.raises(Exception, match="VM uid range"):
            UidPool.parse(bad, tmp_path)
    # A range holding a host user (here root's group 0 is excluded; the first user is 1).
    with pytest.raises(Exception, match="holds user"):
        UidPool.parse("1-1000", tmp_path)


# Runs under the jailed filter (as root, so only the filter can refuse): what it lets through.
FILTERED = r"""
import ctypes, errno, json, threading
libc = ctypes.CDLL(None, use_errno=True)
def call(fn, *args):
    return "ok" if fn(*args) == 0 else errno.errorcode[ctypes.get_errno()]
out = {
    "user namespace": call(libc.unshare, 0x10000000),
    "mount namespace": call(libc.unshare, 0x00020000),
    "mount": call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None),
    "clone3": errno.errorcode.get(ctypes.get_errno(), "ok")
              if libc.syscall(435, None, 0) == -1 else "ok",
}
ran = []
thread = threading.Thread(target=lambda: ran.append(1))
thread.start()
thread.join()
out["thread"] = "ok" if ran else "no"
print(json.dumps(out))
"""


SHARED_MAP = r"""
import json, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
out = {}
for name, flags in (("shared", mmap.MAP_SHARED), ("private", mmap.MAP_PRIVATE)):
    try:
        mapped = mmap.mmap(fd, 4096, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mapped[:4] = b"evil"
        out[name] = "ok"
    except OSError as exc:
        out[name] = os.strerror(exc.errno)
print(json.dumps(out))
"""


@pytest.mark.parametrize("punch_hole, jailed", [(True, False), (False, True), (True, True)])
def test_qemus_filter_allows_no_shared_mapping(tmp_path: Path, punch_hole: bool,
                                               jailed: bool) -> None:
    """A QEMU taken over maps the snapshot's memory file (opened read-write for free-page
    reporting) shared and writable, and its writes change the page cache every VM restored
    from that snapshot reads: the red team poisoned siblings and new sandboxes this way. Under
    QEMU's filter a shared mapping fails; the private one guest RAM uses works."""
    from agentenv.runtime.qemu import _preexec, qemu_filter

    target = tmp_path / "ram"
    target.write_bytes(b"\0" * 4096)
    out = subprocess.run([SYSTEM_PYTHON, "-c", SHARED_MAP, str(target)], capture_output=True,
                         text=True, timeout=60,
                         preexec_fn=_preexec(None, die_with_parent=False,
                                             seccomp=qemu_filter(punch_hole, jailed)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"shared": "Operation not permitted", "private": "ok"}
    assert target.read_bytes()[:4] == b"\0" * 4


def test_jailed_filter_refuses_namespaces_and_mounts_but_not_threads() -> None:
    from agentenv.runtime.qemu import _preexec, qemu_filter

    out = subprocess.run([SYSTEM_PYTHON, "-c", FILTERED], capture_output=True, text=True,
                         timeout=60, preexec_fn=_preexec(None, die_with_parent=False,
                                                         seccomp=qemu_filter(False, True)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"user namespace": "EPERM", "mount namespace": "EPERM",
                                      "mount": "EPERM", "clone3": "ENOSYS", "thread": "ok"}

"""QEMU's resource limits (runtime/jail.py ProcessLimits): a QEMU taken over cannot fill the
host's disk through the files it holds open (its stderr, serial log, device state: write or
`fallocate` past RLIMIT_FSIZE fails with EFBIG and does not kill it; `fallocate` that allocates
inside a sparse file, such as the RAM file, is refused by its filter), holds a fixed number of
descriptors and dumps no core. A real QEMU runs with them, its serial log stops at the limit
while the guest floods ttyS0, and it still pauses and resumes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from agentenv.runtime.jail import ProcessLimits
from agentenv.snapshot.record import SnapshotRecord
from agentenv.testing.harness import sh

from .conftest import Env, count

SYSTEM_PYTHON = "/usr/bin/python3"
LIMIT = 1 << 20

# Runs with QEMU's preexec (limits, maybe its filter): what each attempt to grow a file gives.
GROW = r"""
import ctypes, errno, json, os, resource, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
def err(call):
    try:
        call()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def falloc(fd, mode, offset, length):
    if libc.fallocate(fd, mode, offset, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")
path, limit = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
out = {"write past": err(lambda: [os.write(fd, b"x" * 65536) for _ in range(limit // 65536 + 2)])}
out["size"] = os.fstat(fd).st_size
out["fallocate past"] = err(lambda: falloc(fd, 0, 0, 2 * limit))
out["fallocate inside"] = err(lambda: (os.ftruncate(fd, 0), falloc(fd, 0, 0, limit // 2)))
out["punch"] = err(lambda: falloc(fd, 3, 0, 4096))
opened = []
out["descriptors"] = err(lambda: [opened.append(os.open("/dev/null", os.O_RDONLY))
                                  for _ in range(400)])
out["core"] = resource.getrlimit(resource.RLIMIT_CORE)[1]
print(json.dumps(out))
"""


@pytest.mark.parametrize("filtered", [False, True])
def test_files_cannot_grow_past_the_limit(tmp_path: Path, filtered: bool) -> None:
    from agentenv.runtime.qemu import _preexec, qemu_filter

    preexec = _preexec(None, die_with_parent=False,
                       seccomp=qemu_filter(True, True) if filtered else None,
                       limits=ProcessLimits(file_size=LIMIT, open_files=256))
    out = subprocess.run([SYSTEM_PYTHON, "-c", GROW, str(tmp_path / "qemu.stderr"), str(LIMIT)],
                         capture_output=True, text=True, timeout=60, preexec_fn=preexec)
    assert out.returncode == 0, out.stderr  # not killed by SIGXFSZ
    result = json.loads(out.stdout)
    assert result["write past"] == "EFBIG"
    assert result["size"] == LIMIT
    # under the filter an allocating fallocate is refused (EOPNOTSUPP, named ENOTSUP) before the limit counts
    assert result["fallocate past"] == ("ENOTSUP" if filtered else "EFBIG")
    assert result["fallocate inside"] == ("ENOTSUP" if filtered else "ok")
    assert result["descriptors"] == "EMFILE"
    assert result["core"] == 0
    assert (tmp_path / "qemu.stderr").stat().st_size <= LIMIT


def _limits(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name = line[:26].strip()
        out[name] = line[26:].split()[0]
    return out


def test_a_qemu_flooding_its_serial_log_stops_at_the_limit_and_still_pauses(
        env: Env, counting: SnapshotRecord) -> None:
    config = env.runtime.config
    saved = config.qemu_max_file_bytes, config.serial_log_max_bytes
    # the trimmer keeps its cap (4 MiB: it rotates past 2 MiB); QEMU's own limit is 1 MiB
    config.qemu_max_file_bytes, config.serial_log_max_bytes = LIMIT, 0
    try:
        vm = env.loop.run(env.runtime.restore(counting))
    finally:
        config.qemu_max_file_bytes, config.serial_log_max_bytes = saved
    try:
        limits = _limits(vm.pid)
        assert limits["Max file size"] == str(LIMIT), limits
        assert limits["Max open files"] == str(config.qemu_max_open_files), limits
        assert limits["Max core file size"] == "0", limits
        serial = vm.workdir / "serial.log"
        flood = LIMIT + LIMIT // 2  # past the limit, short of the trimmer's threshold
        env.loop.run(sh(vm, f"head -c {flood} /dev/zero | tr '\\0' x > /dev/ttyS0; echo done",
                        timeout=600))
        assert serial.stat().st_size <= LIMIT
        # the VM runs on, and pauses and resumes
        first = count(env, vm)
        time.sleep(0.5)
        assert count(env, vm) > first
        record = env.loop.run(env.runtime.pause(vm))
        vm = env.loop.run(env.runtime.restore(record))
        first = count(env, vm)
        time.sleep(0.5)
        assert count(env, vm) > first
    finally:
        env.loop.run(env.runtime.kill(vm))


def test_qemus_stderr_is_appended_to_and_kept_within_the_serial_logs_cap(
        env: Env, counting: SnapshotRecord) -> None:
    """A guest can make QEMU log device errors without end: its stderr is trimmed as the
    serial log is (runtime/serial.py), which needs QEMU to append (writing on at the new end,
    not past a hole at its old offset)."""
    vm = env.loop.run(env.runtime.restore(counting))
    try:
        stderr = vm.process.stderr_log
        for fd in ("1", "2"):
            flags = Path(f"/proc/{vm.pid}/fdinfo/{fd}").read_text().split("flags:")[1]
            assert int(flags.split()[0], 8) & os.O_APPEND, (fd, flags)
            assert os.readlink(f"/proc/{vm.pid}/fd/{fd}") == str(stderr)
        cap = env.runtime.config.serial_log_max_bytes
        # what QEMU's error lines would do, written the way it writes them (appending)
        with open(stderr, "ab") as f:
            f.write(b"qemu-system-x86_64: a device error a guest provoked\n" * (cap // 40))
        rotated = stderr.with_name(stderr.name + ".1")
        deadline = time.monotonic() + 60  # looked at every 0.25 s, while the loop runs
        while not rotated.exists():
            assert time.monotonic() < deadline, "qemu.stderr was never trimmed"
            env.loop.run(asyncio.sleep(0.25))
        assert stderr.stat().st_size + rotated.stat().st_size <= cap
        first = count(env, vm)  # the VM runs on
        time.sleep(0.5)
        assert count(env, vm) > first
    finally:
        env.loop.run(env.runtime.kill(vm))

"""Helpers shared by the runtime's tests and benchmarks: a blockd process, an ext4 rootfs
layer, a runtime on a private event loop, running shell commands in the test guest, and the
project's real guest (its disks, root shell commands through its envd)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from agentenv.blockd.launch import BlockdProcess
from agentenv.envd_client import EnvdClient
from agentenv.guest.build.assets import GuestAssets
from agentenv.guest.build.rootfs import busybox_root, make_rootfs_image
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import VM, DiskSource, Runtime
from agentenv.storage.export import import_raw

T = TypeVar("T")


def blockd_in(root: Path, *, fuse: bool = False) -> BlockdProcess:
    """A real blockd with its state, socket and log under `root`; fuse: disks as FUSE files
    too (memory devices have their own mount)."""
    return BlockdProcess(root / "state", root / "blockd.sock", root / "blockd.log", fuse=fuse)


def make_ext4_layer(out: Path, size: int) -> Path:
    """An empty ext4 filesystem of `size` bytes as a sealed overlaybd layer."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        raw = Path(tmp) / "rootfs.raw"
        with open(raw, "wb") as f:
            f.truncate(size)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                        str(raw)], check=True, capture_output=True)
        return import_raw(raw, out)


def real_guest_disks(assets: GuestAssets, work: Path, size: int,
                     populate: Callable[[Path], None] | None = None) -> list[DiskSource]:
    """The real guest's disks: the tools disk and a user root of `size` bytes (busybox only,
    sparse) as a sealed overlaybd layer made under `work`; `populate` adds files to the root's
    tree before the image is made (written by the host, not by a TCG guest)."""
    root = busybox_root(work / "bbroot")
    if populate is not None:
        populate(root)
    raw = make_rootfs_image(root, work / "user.ext4", size)
    layer = import_raw(raw, work / "user.layer")
    raw.unlink()
    return [DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                       file=assets.tools_image),
            DiskSource("rootfs", size, layers=[layer])]


async def guest_sh(vm: VM, script: str, timeout: float = 300) -> str:
    """A root shell command in the real guest (through its envd, with the tools disk's shell);
    its stdout. A command that fails raises AssertionError with its output."""
    envd = EnvdClient(vm.envd_url)
    try:
        result = await envd.run("/agentenv/bin/sh", ["-c", script], user="root", timeout=timeout)
    finally:
        await envd.close()
    if result.exit_code != 0:
        raise AssertionError(f"{script!r} exited {result.exit_code}: "
                             f"{(result.stdout + result.stderr)[-2000:]}")
    return result.stdout


class LoopThread:
    """One event loop kept across tests (runtime objects are bound to their loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


def close_runtime(loop: LoopThread, runtime: Runtime | None, prefix: str,
                  blockd: BlockdProcess | None = None) -> None:
    """The one teardown of a runtime made on `loop`: the runtime and its blockd client, the
    host's network set-up of `prefix` (also when the runtime never started), the loop, then
    the blockd process."""
    if runtime is not None:
        loop.run(runtime.close())
        if runtime.blockd is not None:
            loop.run(runtime.blockd.close())
    loop.run(teardown_host(prefix))
    loop.close()
    if blockd is not None:
        blockd.stop()


async def sh(vm: VM, script: str, timeout: float = 60, attempts: int = 3) -> str:
    """Run a shell script in the test guest (its /cgi-bin/run endpoint); returns the output.
    Connection failures are retried: busybox httpd under TCG on a loaded host sometimes
    resets a connection before running the script."""
    async with httpx.AsyncClient(timeout=timeout) as client:
        for attempt in range(attempts):
            try:
                answer = await client.post(vm.envd_url + "/cgi-bin/run", content=script)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)
                continue
            answer.raise_for_status()
            return answer.text
    raise AssertionError("unreachable")


def pss_kib(pid: int) -> dict[str, int]:
    """Rss, Pss, Shared_Clean, Private_Dirty, Private_Clean, Anonymous (KiB) of a process."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Shared_Clean", "Private_Dirty", "Private_Clean",
                       "Anonymous"):
                out[key] = int(rest.split()[0])
    return out


def mapping_kib(pid: int, path: Path | str) -> dict[str, int]:
    """Rss, Pss, Shared_Clean, Private_Dirty, Private_Clean (KiB) of a process's mappings of
    one file (e.g. QEMU's guest RAM file)."""
    want = os.path.realpath(path)
    out = {"Rss": 0, "Pss": 0, "Shared_Clean": 0, "Private_Dirty": 0, "Private_Clean": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) == 6 and head[5].strip().removesuffix(" (deleted)") == want
                continue
            key, _, rest = line.partition(":")
            if inside and key in out:
                out[key] += int(rest.split()[0])
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

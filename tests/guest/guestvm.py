"""A QEMU guest for the tests: the built kernel, initramfs and tools disk plus a user root disk,
with QEMU user networking forwarding a free loopback port to envd in the guest.

slirp's network is 169.254.0.16/29 with itself at 169.254.0.22, so the guest keeps the production
addresses (169.254.0.21/30, gateway .22) from the kernel command line; restrict=on keeps the
guest off every network but the forwarded port."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentenv.guest.build import ENVD_PORT, GuestAssets

SLIRP_DNS = "169.254.0.19"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, timeout: float, alive: subprocess.Popen[bytes] | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 204:
                return True
        time.sleep(0.05)
    return False


@dataclass
class Guest:
    url: str
    console_path: Path
    process: subprocess.Popen[bytes]
    boot_seconds: float

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")

    def sandbox(self):  # -> e2b.Sandbox; the SDK talks straight to envd (debug mode)
        from e2b import Sandbox

        return Sandbox.connect("debug", debug=True, sandbox_url=self.url)


@contextlib.contextmanager
def boot(assets: GuestAssets, user_disk: Path, work: Path, *, hostname: str = "aenv-test",
         dns: str | None = None, memory_mib: int = 512, timeout: float = 240.0) -> Iterator[Guest]:
    port = free_port()
    console = work / "console.log"
    cmdline = assets.cmdline(hostname=hostname, dns=dns)
    cmd = [
        "qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-cpu", "max", "-m", str(memory_mib),
        "-smp", "1", "-nodefaults", "-no-reboot", "-display", "none",
        "-kernel", str(assets.kernel), "-initrd", str(assets.initramfs), "-append", cmdline,
        "-drive", f"file={assets.tools_image},if=none,id=vda,format=raw,readonly=on",
        "-device", "virtio-blk-pci,drive=vda,addr=0x4",
        "-drive", f"file={user_disk},if=none,id=vdb,format=raw",
        "-device", "virtio-blk-pci,drive=vdb,addr=0x5",
        "-netdev", "user,id=n0,restrict=on,net=169.254.0.16/29,host=169.254.0.22,"
                   f"dhcpstart=169.254.0.17,dns={SLIRP_DNS},"
                   f"hostfwd=tcp:127.0.0.1:{port}-169.254.0.21:{ENVD_PORT}",
        "-device", "virtio-net-pci,netdev=n0,addr=0x6,romfile=",
        "-device", "virtio-balloon-pci,addr=0x7",
        "-device", "vmgenid",
        "-serial", f"file:{console}",
    ]
    log = (work / "qemu.log").open("wb")
    started = time.monotonic()
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_health(url, timeout, process):
            text = console.read_text(errors="replace") if console.exists() else ""
            raise AssertionError(f"envd did not become healthy in {timeout}s; console:\n{text[-4000:]}\n"
                                 f"qemu: {(work / 'qemu.log').read_text()[-2000:]}")
        yield Guest(url, console, process, time.monotonic() - started)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()

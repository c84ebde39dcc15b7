"""One QEMU process: its command line, its QMP connection, its exit.

Device layout (identical for a boot and for every restore of its snapshots, which the
migration stream requires):

- `-M q35` with the accelerator, `-cpu max` (TCG) or `host` (KVM), guest RAM from
  `memory-backend-file,share=off,readonly=on,rom=off` whose mem-path is a read-only file
  (an empty sparse file for a boot, the snapshot's materialised memory file for a restore):
  pages are read lazily from the shared page cache and copied into private memory on write.
- virtio-blk disks at fixed PCI addresses, each `raw` format node over a swappable file child
  (`<name>-file`), so a pre-spawned QEMU can get its real disk (NBD from blockd) with
  `blockdev-add` + `blockdev-reopen` when it is taken from the pool.
- virtio-net on `tap0` (QEMU runs inside the network slot's namespace), no option ROM.
- virtio-balloon with free-page reporting; vmgenid with a fresh GUID for every process.
- `-kernel`/`-initrd`/`-append` only for a boot: a restore (`-incoming defer`) has no use for
  them and QEMU would keep both files in private memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.runtime.errors import QMPError, VMDiedError
from agentenv.runtime.qmp import QMPClient
from agentenv.snapshot.record import MachineConfig

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
SPAWN_TRIES = 3
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_THP_DISABLE = 41

DISK_PCI_BASE = 0x10
NET_PCI_ADDR = 0x08
BALLOON_PCI_ADDR = 0x09


@dataclass
class DiskAttachment:
    """Where a disk's data comes from for one process: an NBD export or a local file."""

    name: str
    read_only: bool
    nbd_socket: str | None = None
    nbd_export: str | None = None
    file: str | None = None

    def file_node(self, node_name: str) -> dict[str, Any]:
        if self.nbd_socket:
            return {
                "driver": "nbd", "node-name": node_name,
                "server": {"type": "unix", "path": self.nbd_socket},
                "export": self.nbd_export or "", "read-only": self.read_only,
            }
        if self.file:
            return {
                "driver": "file", "node-name": node_name, "filename": self.file,
                "read-only": self.read_only,
            }
        raise ValueError(f"disk {self.name}: neither an NBD export nor a file")


def _blockdev_arg(node: dict[str, Any]) -> str:
    """Render a flat blockdev dict in QEMU's key=value syntax (nested keys dotted)."""
    parts: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, bool):
            parts.append(f"{prefix}={'on' if value else 'off'}")
        else:
            parts.append(f"{prefix}={str(value).replace(',', ',,')}")

    walk("", node)
    return ",".join(parts)


def build_argv(
    machine: MachineConfig,
    *,
    mem_path: str,
    qmp_socket: Path,
    serial_log: Path,
    disks: list[DiskAttachment] | None,
    vmgenid: str,
    incoming: bool,
    qemu_binary: str = "qemu-system-x86_64",
    tb_size_mib: int = 64,
) -> list[str]:
    """The QEMU command line. With disks=None every disk starts on a null placeholder of
    the right size (for warm processes that get their real disks over QMP later)."""
    cpu = machine.cpu_model if machine.accel == "tcg" else "host"
    size = machine.memory_bytes
    # TCG's translation cache is private memory of every VM: a bounded buffer keeps it small
    # (a restored test guest answering /init fills ~18 MiB; a full buffer is flushed).
    accel = f"tcg,tb-size={tb_size_mib}" if machine.accel == "tcg" else "kvm"
    argv = [
        qemu_binary,
        "-accel", accel,
        "-M", f"{machine.machine_type},memory-backend=ram0",
        "-cpu", cpu,
        "-smp", str(machine.vcpus),
        "-m", f"{machine.memory_mib}M",
        "-object",
        f"memory-backend-file,id=ram0,size={size},mem-path={mem_path},"
        "share=off,readonly=on,rom=off,prealloc=off",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-chardev", f"socket,id=qmp,path={qmp_socket},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-chardev", f"file,id=serial0,path={serial_log}",
        "-serial", "chardev:serial0",
        "-device", f"vmgenid,id=vmgenid0,guid={vmgenid}",
        "-device",
        f"virtio-balloon-pci,id=balloon0,free-page-reporting=on,deflate-on-oom=on,"
        f"addr={BALLOON_PCI_ADDR:#x}",
    ]
    if not incoming:
        # Only a boot needs the kernel: QEMU reads it and the initramfs into private memory
        # for fw_cfg (13 MiB per process here) that a restored guest never reads again. The
        # device state has no RAM section, so the option ROM -kernel adds is not missed.
        argv += ["-kernel", machine.kernel, "-append", machine.cmdline]
        if machine.initramfs:
            argv += ["-initrd", machine.initramfs]
    if machine.network:
        argv += [
            "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off",
            "-device",
            f"virtio-net-pci,id=nic0,netdev=net0,mac={machine.mac},romfile=,addr={NET_PCI_ADDR:#x}",
        ]
    for index, disk in enumerate(machine.disks):
        file_node_name = f"{disk.name}-file0"
        if disks is None:
            file_node = {
                "driver": "null-co", "node-name": file_node_name, "size": disk.size,
                "read-zeroes": True,
            }
        else:
            file_node = disks[index].file_node(file_node_name)
        argv += [
            "-blockdev", _blockdev_arg(file_node),
            "-blockdev",
            _blockdev_arg({"driver": "raw", "node-name": disk.name, "file": file_node_name,
                           "read-only": disk.read_only}),
            "-device",
            f"virtio-blk-pci,id=dev-{disk.name},drive={disk.name},"
            f"addr={DISK_PCI_BASE + index:#x}",
        ]
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def _preexec(netns: str | None, die_with_parent: bool = True, thp: bool = True) -> Any:
    def run() -> None:
        os.setsid()
        if die_with_parent:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if not thp:
            # QEMU asks for huge pages on its TCG code buffer, so each part of it a vCPU
            # thread starts writing costs 2 MiB; 4 KiB pages make the cache cost what it uses.
            _libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
        if netns:
            fd = os.open(netns, os.O_RDONLY)
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                os._exit(121)
            os.close(fd)

    return run


@dataclass
class QemuProcess:
    """A running QEMU; `died` is set when it exits (for whatever reason)."""

    machine: MachineConfig
    workdir: Path
    process: asyncio.subprocess.Process
    qmp: QMPClient
    netns: str | None
    vmgenid: str
    stderr_log: Path
    died: asyncio.Event = field(default_factory=asyncio.Event)
    expected_exit: bool = False
    _watch: asyncio.Task[None] | None = None
    disk_generation: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def spawn(
        cls,
        machine: MachineConfig,
        workdir: Path,
        *,
        mem_path: str,
        disks: list[DiskAttachment] | None,
        incoming: bool,
        netns: str | None = None,
        qemu_binary: str = "qemu-system-x86_64",
        die_with_parent: bool = True,
        tb_size_mib: int = 64,
        thp: bool = True,
    ) -> QemuProcess:
        """die_with_parent=False: QEMU outlives a crash of this process, so a restarted node
        can take it over again (agentenv.runtime.adopt)."""
        workdir.mkdir(parents=True, exist_ok=True)
        qmp_socket = workdir / "qmp.sock"
        with contextlib.suppress(FileNotFoundError):
            qmp_socket.unlink()
        vmgenid = str(uuid.uuid4())
        argv = build_argv(
            machine, mem_path=mem_path, qmp_socket=qmp_socket,
            serial_log=workdir / "serial.log", disks=disks, vmgenid=vmgenid,
            incoming=incoming, qemu_binary=qemu_binary, tb_size_mib=tb_size_mib,
        )
        (workdir / "argv").write_text("\n".join(argv) + "\n")
        stderr_log = workdir / "qemu.stderr"
        for attempt in range(SPAWN_TRIES):
            try:
                with open(stderr_log, "wb") as err:
                    process = await asyncio.create_subprocess_exec(
                        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err,
                        preexec_fn=_preexec(netns, die_with_parent, thp),
                    )
                break
            except subprocess.SubprocessError as exc:
                # The child failed in _preexec (setsid or entering the slot's namespace; seen
                # about once in 500 spawns on a loaded host, cause not found) before exec:
                # nothing was started, so another try is clean.
                log.warning("QEMU spawn failed in preexec, trying again",
                            extra={"workdir": str(workdir), "error": str(exc)})
                if attempt == SPAWN_TRIES - 1:
                    raise
        try:
            qmp = await _connect_or_fail(qmp_socket, process, stderr_log)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        vm = cls(machine, workdir, process, qmp, netns, vmgenid, stderr_log)
        vm._watch = asyncio.create_task(vm._watch_exit())
        return vm

    async def _watch_exit(self) -> None:
        await self.process.wait()
        self.died.set()

    def exit_reason(self) -> str:
        try:
            tail = self.stderr_log.read_text(errors="replace").strip()[-500:]
        except OSError:
            tail = ""
        code = self.process.returncode
        return f"QEMU pid {self.pid} exited with status {code}" + (f": {tail}" if tail else "")

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 60.0) -> Any:
        try:
            return await self.qmp.execute(command, arguments, timeout=timeout)
        except QMPError:
            if self.died.is_set() or self.qmp.closed.is_set():
                await asyncio.wait_for(self.died.wait(), 5)
                raise VMDiedError(self.exit_reason()) from None
            raise

    async def attach_disks(self, disks: list[DiskAttachment]) -> None:
        """Swap each placeholder disk child for its real backend (warm processes)."""
        for disk_cfg, attach in zip(self.machine.disks, disks, strict=True):
            generation = self.disk_generation.get(disk_cfg.name, 0) + 1
            new_node = f"{disk_cfg.name}-file{generation}"
            await self.execute("blockdev-add", attach.file_node(new_node))
            await self.execute("blockdev-reopen", {"options": [{
                "driver": "raw", "node-name": disk_cfg.name, "file": new_node,
                "read-only": disk_cfg.read_only,
            }]})
            await self.execute("blockdev-del", {"node-name": f"{disk_cfg.name}-file{generation - 1}"})
            self.disk_generation[disk_cfg.name] = generation

    async def stop_process(self, timeout: float = 3.0) -> None:
        """Quit QEMU (quit over QMP, then SIGKILL) and wait for it."""
        self.expected_exit = True
        if self.process.returncode is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.qmp.execute("quit"), 1.0)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        await self.qmp.close()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch


async def _connect_or_fail(
    qmp_socket: Path, process: asyncio.subprocess.Process, stderr_log: Path
) -> QMPClient:
    deadline = time.monotonic() + 10
    while True:
        if process.returncode is not None:
            tail = stderr_log.read_text(errors="replace").strip()[-800:]
            raise VMDiedError(f"QEMU exited at start with status {process.returncode}: {tail}")
        if qmp_socket.exists():
            try:
                return await QMPClient.connect(qmp_socket, timeout=5)
            except QMPError:
                if process.returncode is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                    continue
                raise
        if time.monotonic() > deadline:
            raise QMPError("QEMU did not open its QMP socket within 10 s")
        await asyncio.sleep(0.002)

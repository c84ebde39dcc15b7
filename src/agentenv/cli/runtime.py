"""`aenv` commands of the runtime subsystem: `aenv vm accel|snapshot-info|smoke`."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import click

from agentenv.runtime.accel import resolve_accel
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.network import teardown_host
from agentenv.runtime.vm import BootSpec, Runtime
from agentenv.snapshot.record import SnapshotRecord


@click.group("vm")
def vm_group() -> None:
    """QEMU VMs: accelerator detection, snapshots, a boot/pause/restore smoke test."""


@vm_group.command("accel")
@click.option("--kernel", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Probe KVM by booting this kernel (otherwise only host checks).")
@click.option("--setting", type=click.Choice(["auto", "kvm", "tcg"]), default="auto",
              show_default=True)
def accel_command(kernel: str | None, setting: str) -> None:
    """Print the accelerator a standard guest runs under here (kvm or tcg)."""
    click.echo(resolve_accel(setting, kernel))


@vm_group.command("snapshot-info")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
def snapshot_info(path: Path) -> None:
    """Show a snapshot record (a snapshot directory or its snapshot.json) and check its files."""
    record = SnapshotRecord.load(path)
    record.check_files()
    click.echo(json.dumps({
        "id": record.id, "mode": record.mode, "vcpus": record.machine.vcpus,
        "memory_mib": record.machine.memory_mib,
        "memory_layers": [x.path for x in record.memory_layers],
        "disks": {d.name: [x.path for x in d.layers] for d in record.disks},
        "device_state": record.device_state, "qemu": record.qemu_version,
    }, indent=2))


@vm_group.command("smoke")
@click.option("--memory-mib", type=int, default=256, show_default=True)
def smoke(memory_mib: int) -> None:
    """Boot the busybox test guest, pause it, restore it, fork it twice; print timings."""
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.testing.guest import build_test_guest
    from agentenv.testing.harness import sh  # lazy: as above

    async def run() -> None:
        guest = build_test_guest()
        with tempfile.TemporaryDirectory(prefix="aenv-smoke", dir="/tmp") as tmp:
            rt = Runtime(RuntimeConfig(state_dir=Path(tmp), network_prefix="aes",
                                       envd_init_path="/cgi-bin/init", slot_pool_low=1))
            try:
                await rt.start(kernel_for_probe=guest.kernel)
                t0 = time.perf_counter()
                vm = await rt.boot(BootSpec(kernel=guest.kernel, initramfs=guest.initramfs,
                                            cmdline=guest.cmdline_base, memory_mib=memory_mib))
                click.echo(f"accel {rt.accel}; boot {time.perf_counter() - t0:.2f} s")
                await sh(vm, "echo before-pause > /tmp/mark")
                t0 = time.perf_counter()
                record = await rt.pause(vm)
                click.echo(f"pause {(time.perf_counter() - t0) * 1e3:.0f} ms")
                t0 = time.perf_counter()
                vm = await rt.restore(record)
                click.echo(f"restore {(time.perf_counter() - t0) * 1e3:.0f} ms "
                           f"({', '.join(f'{k} {v:.0f}' for k, v in vm.timings.items())})")
                click.echo(f"guest says: {(await sh(vm, 'cat /tmp/mark')).strip()}")
                t0 = time.perf_counter()
                _, children = await rt.fork(vm, 2)
                click.echo(f"fork x2 {(time.perf_counter() - t0) * 1e3:.0f} ms")
                for child in children:
                    click.echo(f"child {child.id}: {(await sh(child, 'cat /tmp/mark')).strip()}")
            finally:
                await rt.close()
                await teardown_host("aes")

    asyncio.run(run())


COMMANDS: list[click.Command] = [vm_group]

"""A minimal busybox guest for runtime tests and benchmarks.

The project's real guest (kernel + initramfs + tools disk + envd) is built by
`agentenv.guest.build`. The runtime must be testable on its own, so this module builds a tiny
stand-in from Debian packages: the Debian cloud kernel (unpacked, not installed) and an
initramfs holding busybox-static, the virtio modules, and an init that

- configures eth0 from `aenv.ip=` / `aenv.gw=` on the kernel command line (the same ABI as the
  real guest init),
- mounts /dev/vdb (ext4) at /mnt/disk when present,
- serves HTTP on port 49983 (the envd port): `GET /health` answers, `POST /cgi-bin/run` runs
  the request body with /bin/sh and returns its output (stdout+stderr), and `POST /init`
  (the envd call the runtime makes after a restore) is accepted.

Everything is cached under a directory keyed by the kernel package (KERNEL_SUITE, default
bookworm-backports: the 6.12 kernel with the vmgenid driver, like the real guest).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import AgentEnvError
from agentenv.guest.build import apt
from agentenv.guest.build import kernel as guest_kernel
from agentenv.guest.build.errors import GuestBuildError

DEFAULT_CACHE = Path("/var/cache/aenv-test/runtime")
# The same kernel as the real guest's default (agentenv.guest.build.kernel.DEFAULT_SUITE):
# bookworm-backports' 6.12 cloud kernel has the vmgenid driver built in, bookworm's 6.1 none.
KERNEL_SUITE = "bookworm-backports"

# Modules the test guest loads (with their dependencies, from modules.dep); whichever the
# kernel builds in are skipped.
_MODULES = ["virtio_pci", "virtio_net", "virtio_blk", "virtio_scsi", "sd_mod", "virtio_balloon",
            "vmgenid"]


def _module_order(modules_dir: Path, wanted: tuple[str, ...] = tuple(_MODULES),
                  skip: tuple[str, ...] = ()) -> list[str]:
    """Paths (relative to modules_dir) of `wanted` and their dependencies, dependencies first,
    leaving out those in `skip`."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        module, _, rest = line.partition(":")
        deps[module] = rest.split()
        by_name[Path(module).name.split(".ko")[0].replace("-", "_")] = module
    order: list[str] = []

    def visit(module: str) -> None:
        if module not in order and module not in skip:
            for dep in deps.get(module, []):
                visit(dep)
            order.append(module)

    for name in wanted:
        if name in by_name:
            visit(by_name[name])
    return order

_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $(cat /modules.order); do insmod /modules/$m || echo "insmod $m failed"; done
n=0; while [ ! -e /sys/class/net/eth0 ] && [ $n -lt 100 ]; do sleep 0.05; n=$((n+1)); done
ip=""; gw=""; hn="aenv"
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    aenv.ip=*) ip="${arg#aenv.ip=}";;
    aenv.gw=*) gw="${arg#aenv.gw=}";;
    aenv.hostname=*) hn="${arg#aenv.hostname=}";;
  esac
done
hostname "$hn"
ip link set lo up
if [ -n "$ip" ]; then
  ip addr add "$ip" dev eth0
  ip link set eth0 up
  [ -n "$gw" ] && ip route add default via "$gw"
fi
mkdir -p /mnt/disk
[ -b /dev/vdb ] && mount -t ext4 /dev/vdb /mnt/disk
httpd -p 49983 -h /www
echo AENV-GUEST-READY > /dev/ttyS0
while true; do sleep 3600; done
"""

_RUN_CGI = r"""#!/bin/sh
echo "Content-Type: text/plain"
echo ""
if [ "$REQUEST_METHOD" = POST ]; then
  head -c "$CONTENT_LENGTH" > /tmp/.cgi.$$
  sh /tmp/.cgi.$$ 2>&1
  rm -f /tmp/.cgi.$$
fi
"""

_INIT_CGI = r"""#!/bin/sh
echo "Content-Type: text/plain"
echo ""
[ "$REQUEST_METHOD" = POST ] && head -c "$CONTENT_LENGTH" > /tmp/.envd-init.json
echo ok
"""


class TestGuestError(AgentEnvError):
    pass


@dataclass(frozen=True)
class TestGuest:
    kernel: Path
    initramfs: Path
    cmdline_base: str = "console=ttyS0 panic=-1 quiet reboot=k mitigations=off"


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestGuestError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def build_test_guest(cache_dir: Path = DEFAULT_CACHE, kernel_suite: str | None = KERNEL_SUITE,
                     extra_modules: tuple[str, ...] = ()) -> TestGuest:
    """Build (or reuse) the busybox test guest; returns paths to kernel and initramfs.
    kernel_suite None takes the host's default release (bookworm's 6.1). `extra_modules`
    (with their dependencies) are put in /modules too but not loaded at boot: /modules.extra
    lists them in load order, for a test to insmod (the NFS client: `nfsv4`)."""
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        raise TestGuestError("busybox-static is not installed (/bin/busybox missing)")
    meta = guest_kernel.KERNEL_METAPACKAGE + (f"/{kernel_suite}" if kernel_suite else "")
    try:
        package = guest_kernel.kernel_package(
            apt.resolve([meta])[guest_kernel.KERNEL_METAPACKAGE], kernel_suite)
    except GuestBuildError as exc:
        raise TestGuestError(f"cannot resolve the guest kernel {meta}: {exc}") from exc
    key = hashlib.sha256(
        (package.sha256 + _INIT + _RUN_CGI + _INIT_CGI + ",".join(_MODULES) + str(busybox.stat().st_size)
         + ("+" + ",".join(extra_modules) if extra_modules else "")).encode()
    ).hexdigest()[:16]
    out_dir = cache_dir / f"guest-{key}"
    kernel, initramfs = out_dir / "vmlinuz", out_dir / "initramfs.cpio"
    if kernel.exists() and initramfs.exists():
        return TestGuest(kernel, initramfs)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp_name:
        tmp = Path(tmp_name)
        try:
            deb = apt.fetch([package], cache_dir / "debs")[package.name]
            tree = guest_kernel.unpack_kernel(deb, tmp / "kernel")
        except GuestBuildError as exc:
            raise TestGuestError(f"cannot fetch the guest kernel {package.pinned()}: {exc}") from exc
        vmlinuz = tree.vmlinuz
        order = _module_order(tree.modules_dir)
        root = tmp / "root"
        for sub in ("bin", "proc", "sys", "dev", "tmp", "modules", "www/cgi-bin", "mnt"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy2(busybox, root / "bin" / "busybox")
        names = []
        for rel in order:
            name = Path(rel).name.split(".ko")[0] + ".ko"
            (root / "modules" / name).write_bytes(guest_kernel._module_bytes(tree.modules_dir / rel))
            names.append(name)
        (root / "modules.order").write_text("\n".join(names) + "\n")
        extra = []
        for rel in _module_order(tree.modules_dir, extra_modules, skip=tuple(order)):
            name = Path(rel).name.split(".ko")[0] + ".ko"
            (root / "modules" / name).write_bytes(guest_kernel._module_bytes(tree.modules_dir / rel))
            extra.append(name)
        (root / "modules.extra").write_text("".join(f"{n}\n" for n in extra))
        (root / "init").write_text(_INIT)
        (root / "www" / "health").write_text("ok\n")
        (root / "www" / "cgi-bin" / "run").write_text(_RUN_CGI)
        (root / "www" / "cgi-bin" / "init").write_text(_INIT_CGI)
        for script in ("init", "www/cgi-bin/run", "www/cgi-bin/init"):
            os.chmod(root / script, 0o755)
        files = _run(["find", ".", "-print0"], cwd=root)
        cpio = subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet"],
            cwd=root, input=files.encode(), capture_output=True,
        )
        if cpio.returncode != 0:
            raise TestGuestError(f"cpio failed: {cpio.stderr.decode()[-400:]}")
        staged = tmp / "out"
        staged.mkdir()
        (staged / "initramfs.cpio").write_bytes(cpio.stdout)
        shutil.copy2(vmlinuz, staged / "vmlinuz")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staged.rename(out_dir)
    return TestGuest(kernel, initramfs)

"""The guest kernel (Debian's linux-image-cloud-amd64, unpacked, never installed) and the small
initramfs that loads its virtio modules and hands over to the tools disk's init."""

from __future__ import annotations

import gzip
import io
import lzma
import shutil
from dataclasses import dataclass
from pathlib import Path

import zstandard

from agentenv.guest.build import apt, cpio
from agentenv.guest.build.errors import GuestBuildError

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
# The release the kernel comes from by default. bookworm-backports' 6.12 cloud kernel builds in
# the vmgenid driver (a restored fork reseeds its RNG: "crng reseeded due to virtual machine
# fork"); bookworm's 6.1 cloud kernel has none. Measured under TCG here: both boot to envd in
# ~6.2 s and restore the same. "bookworm" selects the 6.1 kernel.
DEFAULT_SUITE = "bookworm-backports"

# Modules stage 1 loads. Required ones must exist as a module or be built in.
REQUIRED_MODULES = ("virtio_pci", "virtio_blk", "virtio_net")
OPTIONAL_MODULES = (
    "virtio_balloon",  # free page reporting gives guest memory back to the host
    "virtio_rng",  # entropy from the host at boot
    "vmgenid",  # a restored fork reseeds its RNG (built into 6.12, absent from 6.1)
    "vmw_vsock_virtio_transport",  # host<->guest sockets without the network
    "crc32c_intel",  # fast checksums for ext4 metadata_csum
    "overlay",  # read-only roots with a tmpfs upper
    # The root disk on virtio-scsi (AENV_DISK_BUS=virtio-scsi, /dev/sda): ENOSPC at the disk cap.
    "virtio_scsi",
    "sd_mod",
)

#: Modules not loaded at boot: on the tools disk (modules/, in load order in modules/nfs.order),
#: loaded by envd before their first use (guest/envd/mounts.py `load_nfs_modules`). The NFSv4
#: client (with sunrpc, lockd, grace, netfs, dns_resolver) for shared read-write volumes
#: (docs/volumes.md §7.1): loaded at boot it cost every cold boot 2.8-5.5 s under TCG
#: (bench/nfs_modules_boot_bench.py, bench/RESULTS.md), for the few sandboxes that mount one.
ON_DEMAND_MODULES: tuple[str, ...] = ("nfsv4",)

INIT_DIR = Path(__file__).resolve().parent.parent / "init"
STAGE1_INIT = INIT_DIR / "initramfs-init"


@dataclass(frozen=True)
class KernelTree:
    root: Path  # where the .deb was unpacked
    release: str  # uname -r, e.g. 6.1.0-57-cloud-amd64

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules_dir(self) -> Path:
        return self.root / "lib" / "modules" / self.release


def kernel_package(meta: apt.DebPackage, suite: str | None = None) -> apt.DebPackage:
    """The versioned linux-image package the cloud metapackage depends on right now."""
    for alternative in meta.depends.split(","):
        name = alternative.strip().split()[0]
        if name.startswith("linux-image-"):
            return apt.resolve([f"{name}/{suite}" if suite else name])[name]
    raise GuestBuildError(f"{KERNEL_METAPACKAGE} {meta.version} depends on no linux-image package: {meta.depends}")


def unpack_kernel(deb: Path, dest: Path) -> KernelTree:
    """Unpacks the kernel package and generates modules.dep (Debian runs depmod at install time)."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    apt.extract(deb, tmp)
    releases = [p.name for p in (tmp / "lib" / "modules").iterdir() if p.is_dir()]
    if len(releases) != 1:
        raise GuestBuildError(f"{deb.name}: expected one kernel release under lib/modules, found {releases}")
    apt.run(["depmod", "-b", str(tmp), releases[0]], what="generating modules.dep")
    tmp.rename(dest)
    return KernelTree(dest, releases[0])


def _uncompressed(path: str) -> str:
    """Module path as stored in the initramfs: busybox insmod takes plain .ko files only."""
    for suffix in (".xz", ".zst", ".gz"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".zst"):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    return data


def _module_name(path: str) -> str:
    return Path(path).name.split(".ko")[0].replace("-", "_")


def module_load_order(tree: KernelTree, optional: tuple[str, ...] = OPTIONAL_MODULES
                      ) -> tuple[list[str], list[str]]:
    """Module paths (relative to lib/modules/RELEASE) in load order, dependencies first, and the
    wanted modules the kernel has neither as module nor built in (REQUIRED_MODULES and
    `optional`)."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (tree.modules_dir / "modules.dep").read_text().splitlines():
        module, _, rest = line.partition(":")
        deps[module] = rest.split()
        by_name[_module_name(module)] = module
    builtin = {_module_name(line) for line in (tree.modules_dir / "modules.builtin").read_text().split()}

    order: list[str] = []

    def visit(module: str) -> None:
        if module in order:
            return
        for dep in deps.get(module, []):
            visit(dep)
        order.append(module)

    absent: list[str] = []
    for name in (*REQUIRED_MODULES, *optional):
        if name in by_name:
            visit(by_name[name])
        elif name not in builtin:
            if name in REQUIRED_MODULES:
                raise GuestBuildError(f"kernel {tree.release} has no {name} module and does not build it in")
            absent.append(name)
    return order, absent


def on_demand_modules(tree: KernelTree, wanted: tuple[str, ...] = ON_DEMAND_MODULES
                      ) -> list[tuple[str, bytes]]:
    """The modules `wanted` needs that stage 1 does not load, in load order: (file name, the
    uncompressed .ko)."""
    boot, _ = module_load_order(tree)
    full, absent = module_load_order(tree, (*OPTIONAL_MODULES, *wanted))
    missing = [name for name in wanted if name in absent]
    if missing:
        raise GuestBuildError(f"kernel {tree.release} has no module {', '.join(missing)}")
    return [(Path(_uncompressed(m)).name, _module_bytes(tree.modules_dir / m))
            for m in full if m not in boot]


def build_initramfs(tree: KernelTree, busybox: Path, out: Path,
                    optional: tuple[str, ...] = OPTIONAL_MODULES) -> list[str]:
    """Writes a gzip newc initramfs: static busybox, the modules in load order, stage-1 /init.
    Returns the module paths it holds."""
    order, _absent = module_load_order(tree, optional)
    mod_root = f"lib/modules/{tree.release}"
    entries: list[cpio.Entry] = [
        cpio.directory("bin"),
        cpio.regular("bin/busybox", busybox.read_bytes(), 0o755),
        cpio.symlink("bin/sh", "busybox"),
        cpio.directory("dev"),
        cpio.chardev("dev/console", 5, 1),
        cpio.chardev("dev/null", 1, 3, 0o666),
        cpio.directory("proc"),
        cpio.directory("sys"),
        cpio.directory("tools"),
        cpio.directory("newroot"),
        cpio.directory("lib"),
        cpio.directory("lib/modules"),
        cpio.directory(mod_root),
    ]
    made_dirs = {mod_root}
    for module in order:
        parts = Path(module).parts[:-1]
        for i in range(1, len(parts) + 1):
            d = f"{mod_root}/{'/'.join(parts[:i])}"
            if d not in made_dirs:
                entries.append(cpio.directory(d))
                made_dirs.add(d)
        entries.append(cpio.regular(f"{mod_root}/{_uncompressed(module)}",
                                    _module_bytes(tree.modules_dir / module)))
    # modules.dep restricted to what is inside, so busybox modprobe works when debugging.
    dep_lines = []
    for line in (tree.modules_dir / "modules.dep").read_text().splitlines():
        if line.partition(":")[0] in order:
            dep_lines.append(" ".join(_uncompressed(word) for word in line.split()))
    plain = [_uncompressed(m) for m in order]
    entries.append(cpio.regular(f"{mod_root}/modules.dep", ("\n".join(dep_lines) + "\n").encode()))
    entries.append(cpio.regular(f"{mod_root}/load-order", ("\n".join(plain) + "\n").encode()))
    entries.append(cpio.regular("init", STAGE1_INIT.read_bytes(), 0o755))

    raw = io.BytesIO()
    cpio.write(raw, entries)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(raw.getvalue())
    tmp.rename(out)
    return plain

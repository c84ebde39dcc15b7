"""The VM backend's built-in templates:

- `base`: Debian bookworm with what E2B's base image has (rootfs.BASE_PACKAGES: python, pip,
  sudo, git, curl...) and the `user` account with sudo;
- `code-interpreter-v1`: base plus Debian's Jupyter kernel, data stack, Node.js, TypeScript, R
  (IRkernel) and OpenJDK (CODE_INTERPRETER_PACKAGES), with the code-interpreter server
  (agentenv.guest.codeint, from the tools disk) started and its default Python, JavaScript and
  Bash kernels warm before the snapshot, so that the E2B Code Interpreter SDK's first run_code
  pays no kernel start.

Each is built once per node and cached under <state>/templates/<name>/:

    Debian root (debootstrap, cached tarball)  ->  ext4 image (sparse, BASE_DISK_BYTES)
    ->  overlaybd layer (import_raw)  ->  cold boot through the runtime
    ->  (start command, until its health answers)  ->  pause  ->  the boot snapshot every
    `create` restores.

template.json records the boot snapshot's directory and a key of everything the snapshot
depends on (guest assets, accelerator, machine size, package list, start command, cold-memory
setting); a restart with the same key reuses the snapshot, a different key rebuilds it.

The node's cold-memory setting (`default_cold_memory`, AENV_RECLAIM_MIN_AGE_SECONDS) is set in
the template's guest before the pause, so sandboxes of the built-in templates give their cold
page cache back to the host (docs/templates.md §7); templates built through the API take it
when their request names none.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

import httpx

from agentenv.envd_client import ColdMemory, EnvdClient, EnvdUnsupported
from agentenv.fsutil import atomic_write_json
from agentenv.guest.build import GuestAssets
from agentenv.guest.build.rootfs import (
    BASE_PACKAGES,
    BASE_USER,
    add_base_user,
    debian_root,
    make_rootfs_image,
)
from agentenv.node.backend import CODE_INTERPRETER_PORT
from agentenv.relay.concurrency import whole_number_setting
from agentenv.runtime.vm import BootSpec, DiskSource, Runtime
from agentenv.snapshot.record import SnapshotRecord
from agentenv.storage.export import import_raw

log = logging.getLogger("agentenv.node.base_template")

# 2: the `user` account with sudo, pip.conf (rootfs.add_base_user); 3: the machine has volume
# disks (docs/volumes.md §6)
TEMPLATE_FORMAT = 3
BASE_DISK_BYTES = 4 << 30  # virtual size; the image file and the layer stay sparse
BASE_INODES = 262_144  # room for pip installs (mkfs -d would size inodes to the tree only)
BASE_VCPUS = 2
BASE_MEMORY_MIB = 512

# What the code-interpreter-v1 image has on top of base: Debian's Jupyter kernel and the data
# stack a user of E2B's code-interpreter template reaches for first.
CODE_INTERPRETER_PACKAGES = (
    "python3-ipykernel", "python3-jupyter-client", "python3-numpy", "python3-pandas",
    "python3-matplotlib", "python3-scipy", "python3-sklearn", "python3-seaborn",
    "python3-openpyxl", "python3-bs4", "python3-requests", "python3-sympy", "python3-pil",
    # the JavaScript kernel's runtime (Debian's Node.js 18; its parser, node-acorn, comes with
    # it as a dependency of libnode)
    "nodejs",
    # the TypeScript kernel's transpiler (the JavaScript kernel with TypeScript's
    # transpileModule in front), the R kernel (IRkernel; pulls r-base-core) and the JDK whose
    # jshell our Java kernel drives
    "node-typescript", "r-cran-irkernel", "openjdk-17-jdk-headless",
    # debootstrap does not resolve virtual packages: the real providers of what pyzmq
    # (python3-cffi-backend-api-*) and gdb, via ipykernel's debugpy (libboost-regex...-icu72),
    # depend on
    "python3-cffi-backend", "libboost-regex1.74.0",
)
CODE_INTERPRETER_START = (
    f"cd /home/user && PYTHONPATH=/agentenv/python exec python3 -m agentenv.guest.codeint"
    f" --port {CODE_INTERPRETER_PORT} --cwd /home/user >>/tmp/.aenv-codeint.log 2>&1"
)
READY_TIMEOUT_SECONDS = 600.0  # (the server prepares the Java runner before its port opens)
#: seconds a page must sit untouched before the guest gives it back (0: keep it; docs/templates.md)
RECLAIM_ENV = "AENV_RECLAIM_MIN_AGE_SECONDS"
RECLAIM_DEFAULT_SECONDS = 30


def default_cold_memory(env: Mapping[str, str] | None = None) -> ColdMemory:
    """The node's cold-memory setting: for the built-in templates and for builds whose request
    names none. ValueError naming the variable when it is not a whole number."""
    seconds = whole_number_setting(env, RECLAIM_ENV,
                                   RECLAIM_DEFAULT_SECONDS)
    if not seconds:
        return ColdMemory.off()
    try:
        return ColdMemory(minAgeSeconds=seconds)
    except ValueError as exc:  # pydantic's, e.g. shorter than DAMON's aggregation interval
        raise ValueError(f"{RECLAIM_ENV}={seconds}: {exc}") from None


@dataclass(frozen=True)
class BuiltinSpec:
    """What a built-in template is made of."""

    name: str
    packages: tuple[str, ...]
    memory_mib: int
    vcpus: int = BASE_VCPUS
    start_cmd: str | None = None  # run (bash -l) in the booted VM before the pause
    ready_port: int | None = None  # its GET /health must answer 200 before the pause
    start_user: str = BASE_USER  # the guest user start_cmd runs as


BASE = BuiltinSpec("base", BASE_PACKAGES, BASE_MEMORY_MIB)
# The server and its kernels run as root, as E2B's template runs Jupyter (a systemd service with
# no User=): run_code and a context's cells are root's in /home/user, a context may be in /root,
# and what a cell writes is root's. The sandbox's commands and files stay `user`'s, and `user`
# has passwordless sudo anyway: root in the guest is the sandbox owner's already.
CODE_INTERPRETER = BuiltinSpec(
    "code-interpreter-v1", BASE_PACKAGES + CODE_INTERPRETER_PACKAGES, 1024,
    start_cmd=CODE_INTERPRETER_START, ready_port=CODE_INTERPRETER_PORT, start_user="root")


@dataclass(frozen=True)
class BaseTemplate:
    record_dir: Path  # the boot snapshot's directory (snapshot.json)
    layers: tuple[str, ...]  # layer files the snapshot needs
    vcpus: int
    memory_mib: int
    disk_bytes: int


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def template_key(assets: GuestAssets, accel: str, dns: IPv4Address | None = None,
                 spec: BuiltinSpec = BASE, cold_memory: ColdMemory | None = None) -> str:
    parts = [
        str(TEMPLATE_FORMAT), accel, ",".join(sorted(spec.packages)), str(BASE_DISK_BYTES),
        str(spec.vcpus), str(spec.memory_mib),
        # (base's key has no such part, so that its existing builds stay valid)
        *([f"start={spec.start_cmd}", f"ready={spec.ready_port}"] if spec.start_cmd else []),
        *([f"start-user={spec.start_user}"]
          if spec.start_cmd and spec.start_user != BASE_USER else []),
        _file_key(assets.kernel), _file_key(assets.initramfs), _file_key(assets.tools_image),
        assets.cmdline_base,
        # the boot snapshot keeps the resolv.conf of its boot (restores do not boot)
        *([f"dns={dns}"] if dns else []),
        # ...and its kernel's cold-memory reclaim
        *([f"cold={cold_memory.model_dump_json()}"] if cold_memory else []),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def snapshot_layers(record: SnapshotRecord) -> tuple[str, ...]:
    paths = [x.path for x in record.memory_layers]
    for disk in record.disks:
        paths.extend(x.path for x in disk.layers)
    return tuple(paths)


def load_cached(template_dir: Path, key: str) -> BaseTemplate | None:
    meta_path = template_dir / "template.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        return None
    record_dir = Path(meta["record_dir"])
    try:
        record = SnapshotRecord.load(record_dir)
        record.check_files()
    except Exception as exc:  # any damage means: rebuild
        log.warning("cached built-in template unusable, rebuilding",
                    extra={"dir": str(template_dir), "error": str(exc)})
        return None
    return BaseTemplate(record_dir, snapshot_layers(record), record.machine.vcpus,
                        record.machine.memory_mib, BASE_DISK_BYTES)


async def build_base_template(
    runtime: Runtime, assets: GuestAssets, template_dir: Path, *, debian_cache: Path,
    on_progress: Callable[[str], None] | None = None, spec: BuiltinSpec = BASE,
    cold_memory: ColdMemory | None = None, shared_cache: Path | None = None,
) -> BaseTemplate:
    """Builds (or reuses) a built-in template's boot snapshot (`base` unless `spec` says);
    `cold_memory` is set in its guest before the pause (None: the node's default).
    `shared_cache` (AENV_VM_TEMPLATE_CACHE): the host's cache of built-in templates, shared by
    its nodes; a build there is used in place (the node never deletes it)."""
    assert runtime.accel is not None
    cold_memory = cold_memory or default_cold_memory()
    key = template_key(assets, runtime.accel, runtime.config.guest_dns, spec, cold_memory)
    cached = load_cached(template_dir, key)
    if cached is not None:
        log.info(f"{spec.name} template reused", extra={"record_dir": str(cached.record_dir)})
        return cached
    if shared_cache is None:
        return await _build(runtime, assets, template_dir, key, debian_cache, on_progress, spec,
                            cold_memory)
    # One build per key on the host: the other nodes wait for it, then use its files in place.
    entry = shared_cache / f"{spec.name}-{key}"
    async with _host_lock(shared_cache / f".{spec.name}-{key}.lock"):
        shared = load_cached(entry, key)
        if shared is None:
            built = await _build(runtime, assets, template_dir, key, debian_cache, on_progress,
                                 spec, cold_memory)
            shared = await asyncio.to_thread(publish, built, template_dir, key, entry)
            log.info(f"{spec.name} template shared", extra={"entry": str(entry)})
        else:
            log.info(f"{spec.name} template taken from the host's cache",
                     extra={"entry": str(entry)})
    template_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(template_dir / "template.json",
                      {"format": TEMPLATE_FORMAT, "key": key, "record_dir": str(shared.record_dir),
                       "shared": str(entry), "built_at": time.time()}, indent=1)
    return shared


@contextlib.asynccontextmanager
async def _host_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive lock on `path` across the host's processes (flock, freed if we die)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a layer cache: root's only
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def publish(built: BaseTemplate, template_dir: Path, key: str, entry: Path) -> BaseTemplate:
    """Moves a node's fresh build into the host's cache as `entry`: the base rootfs layer and
    the boot snapshot's own files (not the guest assets it names, which are shared already),
    the record rewritten to name them there. The node's emptied snapshot directory goes."""
    record = SnapshotRecord.load(built.record_dir)
    base_layer = template_dir / f"rootfs-{key}.layer"
    staging = entry.with_name(entry.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    moved: dict[Path, Path] = {}

    def move(raw: str) -> str:
        path = Path(raw)
        if path.parent != built.record_dir and path != base_layer:
            return raw
        if path not in moved:
            if (staging / path.name).exists():
                raise RuntimeError(f"publishing {entry}: two files named {path.name}")
            shutil.move(path, staging / path.name)
            moved[path] = entry / path.name
        return str(moved[path])

    for ref in record.memory_layers:
        ref.path = move(ref.path)
    for disk in record.disks:
        for ref in disk.layers:
            ref.path = move(ref.path)
    record.device_state = move(record.device_state)
    record.save(staging)
    atomic_write_json(staging / "template.json",
                      {"format": TEMPLATE_FORMAT, "key": key, "record_dir": str(entry),
                       "layer": str(moved.get(base_layer, "")), "built_at": time.time()},
                      indent=1)
    shutil.rmtree(entry, ignore_errors=True)  # a damaged entry load_cached refused
    os.rename(staging, entry)
    shutil.rmtree(built.record_dir, ignore_errors=True)
    return BaseTemplate(entry, snapshot_layers(record), built.vcpus, built.memory_mib,
                        built.disk_bytes)


async def _build(runtime: Runtime, assets: GuestAssets, template_dir: Path, key: str,
                 debian_cache: Path, on_progress: Callable[[str], None] | None,
                 spec: BuiltinSpec, cold_memory: ColdMemory) -> BaseTemplate:
    def step(message: str) -> None:
        log.info(f"{spec.name} template: " + message)
        if on_progress is not None:
            on_progress(message)

    t0 = time.monotonic()
    template_dir.mkdir(parents=True, exist_ok=True)
    work = template_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    step(f"unpacking a Debian bookworm root with {', '.join(spec.packages)}"
         " (debootstrap on first use: 1-5 min)")
    root = await asyncio.to_thread(debian_root, work / "root", spec.packages,
                                   cache_dir=debian_cache)
    await asyncio.to_thread(add_base_user, root)
    step(f"making a {BASE_DISK_BYTES >> 30} GiB sparse ext4 image")
    raw = await asyncio.to_thread(make_rootfs_image, root, work / "rootfs.ext4", BASE_DISK_BYTES,
                                  inodes=BASE_INODES)
    await asyncio.to_thread(shutil.rmtree, root, True)
    step("importing the image as an overlaybd layer")
    layer = template_dir / f"rootfs-{key}.layer"
    await asyncio.to_thread(import_raw, raw, layer)
    raw.unlink()
    step("booting the template VM (under TCG this takes a while)")
    vm = await runtime.boot(BootSpec(
        kernel=assets.kernel, initramfs=assets.initramfs, cmdline=assets.cmdline_base,
        vcpus=spec.vcpus, memory_mib=spec.memory_mib, outbound=True,
        disks=[DiskSource("tools", assets.tools_image.stat().st_size, read_only=True,
                          file=assets.tools_image),
               DiskSource("rootfs", BASE_DISK_BYTES, layers=[layer])]))
    try:
        if spec.start_cmd:
            step(f"starting {spec.start_cmd!r} and waiting for its health")
            await start_and_wait(vm.envd_url, vm.envd_url.rsplit(":", 1)[0], spec)
        await set_cold_memory(vm.envd_url, cold_memory)
        step("pausing it into the boot snapshot")
        record = await runtime.pause(vm, wait_teardown=True)
    except BaseException:
        await runtime.kill(vm)
        raise
    record_dir = Path(record.device_state).parent
    meta = {"format": TEMPLATE_FORMAT, "key": key, "record_dir": str(record_dir),
            "layer": str(layer), "built_at": time.time()}
    atomic_write_json(template_dir / "template.json", meta, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    # Older rootfs layers stay: paused sandboxes and snapshots made from an earlier build of
    # the template name them in their records.
    step(f"{spec.name} template ready in {time.monotonic() - t0:.0f} s")
    return BaseTemplate(record_dir, snapshot_layers(record), record.machine.vcpus,
                        record.machine.memory_mib, BASE_DISK_BYTES)


async def start_and_wait(envd_url: str, guest_url: str, spec: BuiltinSpec) -> None:
    """Starts spec.start_cmd in the guest (through envd, as spec.start_user, left running)
    and waits until http://guest:ready_port/health answers 200."""
    assert spec.start_cmd is not None and spec.ready_port is not None
    envd = EnvdClient(envd_url)
    try:
        await envd.wait_healthy()
        await envd.run("/bin/bash", ["-l", "-c", spec.start_cmd], user=spec.start_user,
                       cwd=f"/home/{BASE_USER}", background=True, tag="aenv-start-cmd")
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        last = "no answer yet"
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                try:
                    answer = await http.get(f"{guest_url}:{spec.ready_port}/health")
                    if answer.status_code == 200:
                        return
                    last = f"status {answer.status_code}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                await asyncio.sleep(0.5)
        log_tail = await envd.run("/bin/sh", ["-c", "tail -c 3000 /tmp/.aenv-codeint.log"],
                                  user="root", timeout=10)
        raise RuntimeError(f"{spec.name}: port {spec.ready_port} not healthy after "
                           f"{READY_TIMEOUT_SECONDS:.0f} s ({last}): {log_tail.stdout}")
    finally:
        await envd.close()


async def set_cold_memory(envd_url: str, setting: ColdMemory) -> None:
    """The cold-memory setting into a built-in template's guest kernel before its snapshot."""
    envd = EnvdClient(envd_url)
    try:
        await envd.wait_healthy()
        await envd.set_cold_memory(setting)
    except EnvdUnsupported as exc:  # a guest kernel without DAMON: it still works
        log.warning("built-in template keeps its cold memory", extra={"error": str(exc)})
    finally:
        await envd.close()


def load_previous(template_dir: Path) -> dict[str, object] | None:
    try:
        raw = json.loads((template_dir / "template.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None

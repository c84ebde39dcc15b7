"""blockd keeps sandbox disks private: state directories 0700 (the VM user's group may only
search the way to the NBD sockets), upper files 0600, FUSE files 0600 checked by the kernel
(default_permissions) although the mount allows other users."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from agentenv.blockd.access import vm_gid as _vm_gid

from .conftest import Daemon, Stack


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *args],
                          capture_output=True, text=True, timeout=30)


def test_state_dirs_uppers_and_fuse_files_are_private(daemon: Daemon, stack: Stack, short_tmp: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to try the files as another user")
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers)
        shared = client.create(image=stack.lowers[0], readonly=True)
    state = daemon.state_dir
    # The VM user's group (when that user exists, as after install-system.sh) may search the
    # way to the NBD sockets, and nothing more; everything else is the owner's alone.
    vm_gid = _vm_gid()
    searchable = 0o710 if vm_gid is not None else 0o700
    for folder in (state, state / "nbd"):
        assert _mode(folder) == searchable, folder
        if vm_gid is not None:
            assert folder.stat().st_gid == vm_gid, folder
    for folder in (state / "devices", state / "uppers"):
        assert _mode(folder) == 0o700, folder
    assert info.upper_dir is not None
    upper = Path(info.upper_dir)
    assert _mode(upper) == 0o700
    for name in ("upper.data", "upper.index"):
        assert _mode(upper / name) == 0o600, name
    assert info.file is not None and shared.file is not None
    fuse_file = Path(info.file)
    st = fuse_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert _mode(Path(shared.file)) == 0o400
    # Open the way to the mount for this check alone: the FUSE file's own mode must stop
    # another user (before, allow_other without default_permissions let anyone read it).
    os.chmod(short_tmp, 0o755)
    os.chmod(state, 0o755)
    try:
        listing = _as_nobody("ls", str(fuse_file.parent))
        assert info.id in listing.stdout, listing
        read = _as_nobody("head", "-c", "16", str(fuse_file))
        assert read.returncode != 0 and "Permission denied" in read.stderr, read
        write = _as_nobody("sh", "-c", f"echo x > {fuse_file}")
        assert write.returncode != 0 and "Permission denied" in write.stderr, write
    finally:
        os.chmod(state, searchable)
    # The owner (root here) still reads and writes it.
    with open(fuse_file, "r+b") as f:
        f.write(b"mine")
        f.seek(0)
        assert f.read(4) == b"mine"
    # A restart takes back what a loosened state directory gave to others.
    os.chmod(state, 0o755)
    daemon.stop()
    daemon.start()
    assert _mode(state) == searchable


def test_group_search_granted_by_the_privilege_setup_is_kept(tmp_path: Path) -> None:
    from agentenv.fsutil import private_dir

    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    private_dir(d)
    assert _mode(d) == 0o700
    os.chown(d, -1, 65534)
    os.chmod(d, 0o715)  # g+x given to the VM user's group, o+rx left over
    private_dir(d)
    assert _mode(d) == 0o710
    new = private_dir(tmp_path / "a" / "b")
    assert _mode(new) == 0o700


def test_an_owned_disk_socket_is_its_owners_alone_from_the_start(daemon: Daemon,
                                                                  stack: Stack) -> None:
    """A jailed QEMU's writable disk: blockd answers the create with the socket already that
    uid's alone (0600), so no other VM of the group can connect in between, and makes it so again
    after a restart, from the device record. A read-only device is shared: no owner."""
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the socket")
    owner = 212345
    with daemon.client() as client:
        info = client.create(lowers=stack.lowers, owner=owner)
        plain = client.create(lowers=stack.lowers)
        with pytest.raises(Exception, match="only for a writable device"):
            client.create(image=stack.lowers[0], readonly=True, owner=owner)
    sock = Path(info.nbd)
    assert (sock.stat().st_uid, sock.stat().st_gid, _mode(sock)) == (owner, owner, 0o600)
    assert _mode(Path(plain.nbd)) == (0o660 if _vm_gid() is not None else 0o600)
    daemon.stop()
    daemon.start()
    assert (sock.stat().st_uid, sock.stat().st_gid, _mode(sock)) == (owner, owner, 0o600)

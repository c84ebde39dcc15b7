"""Building, pushing and unpacking test images; comparing file trees."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import zstandard

from tests.conftest import HELLO_WORLD

FIXTURE = HELLO_WORLD
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LAYER_TYPES = {
    "": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class BuiltImage:
    manifest: bytes
    media_type: str
    blobs: dict[str, bytes] = field(default_factory=dict)
    layer_tars: list[bytes] = field(default_factory=list)  # uncompressed, bottom first

    @property
    def digest(self) -> str:
        return digest_of(self.manifest)

    def replace_layer_blob(self, index: int, blob: bytes) -> None:
        """Serve `blob` (e.g. a corrupt one) as layer `index`: manifest digest and size follow."""
        body = json.loads(self.manifest)
        del self.blobs[body["layers"][index]["digest"]]
        body["layers"][index].update(digest=digest_of(blob), size=len(blob))
        self.blobs[digest_of(blob)] = blob
        self.manifest = json.dumps(body).encode()


def fixture_image(tag: str) -> BuiltImage:
    """An image of the hello-world OCI layout, by its ref.name annotation."""
    index = json.loads((FIXTURE / "index.json").read_text())
    entry = next(m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    blob = lambda d: (FIXTURE / "blobs" / "sha256" / d.split(":")[1]).read_bytes()  # noqa: E731
    manifest = blob(entry["digest"])
    body = json.loads(manifest)
    image = BuiltImage(manifest, entry["mediaType"])
    for desc in [body["config"], *body["layers"]]:
        image.blobs[desc["digest"]] = blob(desc["digest"])
    for desc in body["layers"]:
        data = image.blobs[desc["digest"]]
        image.layer_tars.append(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    return image


def compress(tar_bytes: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(tar_bytes, compresslevel=1, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(tar_bytes)
    return tar_bytes


def build_image(layer_tars: list[bytes], compressions: list[str] | None = None,
                config_extra: dict[str, Any] | None = None) -> BuiltImage:
    """An OCI image of the given uncompressed layer tarballs."""
    compressions = compressions or ["gzip"] * len(layer_tars)
    blobs: dict[str, bytes] = {}
    layers = []
    for tar_bytes, comp in zip(layer_tars, compressions, strict=True):
        data = compress(tar_bytes, comp)
        blobs[digest_of(data)] = data
        layers.append({"mediaType": LAYER_TYPES[comp], "digest": digest_of(data), "size": len(data)})
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/root",
                   "User": "0:0", **(config_extra or {})},
        "rootfs": {"type": "layers", "diff_ids": [digest_of(t) for t in layer_tars]},
    }
    config_bytes = json.dumps(config).encode()
    blobs[digest_of(config_bytes)] = config_bytes
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": digest_of(config_bytes), "size": len(config_bytes)},
        "layers": layers,
    }).encode()
    return BuiltImage(manifest, OCI_MANIFEST, blobs, list(layer_tars))


def push_image(host: str, repository: str, tag: str, image: BuiltImage,
               auth: tuple[str, str] | None = None, scheme: str = "http",
               bearer: str | None = None) -> str:
    """Push with plain registry v2 calls (monolithic blob uploads); returns the manifest digest."""
    base = f"{scheme}://{host}/v2/{repository}"
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    with httpx.Client(auth=auth, timeout=60, verify=False, headers=headers) as http:
        for digest, data in image.blobs.items():
            if http.head(f"{base}/blobs/{digest}").status_code == 200:
                continue
            start = http.post(f"{base}/blobs/uploads/")
            assert start.status_code == 202, start.text
            location = start.headers["location"]
            if location.startswith("/"):
                location = f"{scheme}://{host}{location}"
            sep = "&" if "?" in location else "?"
            put = http.put(f"{location}{sep}digest={digest}", content=data,
                           headers={"Content-Type": "application/octet-stream"})
            assert put.status_code == 201, put.text
        reply = http.put(f"{base}/manifests/{tag}", content=image.manifest,
                         headers={"Content-Type": image.media_type})
        assert reply.status_code == 201, reply.text
    return image.digest


def push_index(host: str, repository: str, tag: str, entries: list[tuple[BuiltImage, dict[str, str]]],
               auth: tuple[str, str] | None = None) -> str:
    """Push an OCI index of already pushed images with the given platforms."""
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": img.media_type, "digest": img.digest, "size": len(img.manifest),
         "platform": plat} for img, plat in entries]}).encode()
    with httpx.Client(auth=auth, timeout=30) as http:
        reply = http.put(f"http://{host}/v2/{repository}/manifests/{tag}", content=index,
                         headers={"Content-Type": OCI_INDEX})
        assert reply.status_code == 201, reply.text
    return digest_of(index)


# -- tarball construction ---------------------------------------------------------------------

class TarBuilder:
    """Writes a PAX tarball entry by entry."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115

    def _info(self, name: str, kind: bytes, mode: int, uid: int, gid: int, mtime: int,
              xattrs: dict[str, bytes] | None) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = mode
        info.uid, info.gid = uid, gid
        info.uname = info.gname = ""
        info.mtime = mtime
        if xattrs:
            info.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                                for k, v in xattrs.items()}
        return info

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = 1_600_000_000,
            xattrs: dict[str, bytes] | None = None) -> TarBuilder:
        self.tar.addfile(self._info(name, tarfile.DIRTYPE, mode, uid, gid, mtime, xattrs))
        return self

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0,
             mtime: int = 1_600_000_000, xattrs: dict[str, bytes] | None = None) -> TarBuilder:
        info = self._info(name, tarfile.REGTYPE, mode, uid, gid, mtime, xattrs)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str, uid: int = 0, gid: int = 0) -> TarBuilder:
        info = self._info(name, tarfile.SYMTYPE, 0o777, uid, gid, 1_600_000_000, None)
        info.linkname = target
        self.tar.addfile(info)
        return self

    def hardlink(self, name: str, target: str) -> TarBuilder:
        info = self._info(name, tarfile.LNKTYPE, 0o644, 0, 0, 1_600_000_000, None)
        info.linkname = target
        self.tar.addfile(info)
        return self

    def device(self, name: str, kind: str, major: int, minor: int, mode: int = 0o660,
               uid: int = 0, gid: int = 0) -> TarBuilder:
        types = {"chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}
        info = self._info(name, types[kind], mode, uid, gid, 1_600_000_000, None)
        info.devmajor, info.devminor = major, minor
        self.tar.addfile(info)
        return self

    def whiteout(self, path: str) -> TarBuilder:
        parent, _, base = path.rstrip("/").rpartition("/")
        return self.file(f"{parent + '/' if parent else ''}.wh.{base}", b"", mode=0o600)

    def opaque(self, directory: str) -> TarBuilder:
        return self.file(f"{directory.rstrip('/')}/.wh..wh..opq", b"", mode=0o600)

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


def tar_directory(root: Path) -> bytes:
    """A PAX tarball of a directory tree (numeric owners, xattrs), sorted."""
    out = subprocess.run(
        ["tar", "--create", "--format=pax", "--numeric-owner", "--xattrs", "--xattrs-include=*",
         "--sort=name", "-C", str(root), "."],
        check=True, capture_output=True,
    )
    return out.stdout


# -- reference unpacking and tree comparison --------------------------------------------------

def reference_unpack(image: BuiltImage, dest: Path, work: Path) -> Path:
    """Unpack with umoci from an OCI layout; returns the rootfs. umoci 0.4 knows no zstd, and
    the tree does not depend on compression: it gets the same tarballs uncompressed."""
    image = build_image(image.layer_tars, [""] * len(image.layer_tars))
    layout = work / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    for digest, data in [*image.blobs.items(), (image.digest, image.manifest)]:
        (layout / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": image.media_type, "digest": image.digest, "size": len(image.manifest),
         "annotations": {"org.opencontainers.image.ref.name": "test"}}]}))
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:test", str(dest)], check=True,
                   capture_output=True)
    return dest / "rootfs"


def entries_of(root: Path, skip: Iterable[str] = ()) -> dict[str, tuple[Any, ...]]:
    """path -> (type, mode, uid, gid, size, sha256 | link target | rdev, xattrs, link group,
    mtime). The mtime (ns) is that of files, links and nodes: a directory's is "now" whenever a
    later layer's whiteout or new entry changed it, in any unpacker (containerd, umoci, ours)."""
    skipped = set(skip)
    result: dict[str, tuple[Any, ...]] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            if rel in skipped:
                if name in dirnames:
                    dirnames.remove(name)
                continue
            st = os.lstat(full)
            kind = stat.S_IFMT(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                detail: Any = hashlib.sha256(full.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                detail = os.readlink(full)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                detail = (os.major(st.st_rdev), os.minor(st.st_rdev))
            else:
                detail = None
            try:
                names = sorted(n for n in os.listxattr(full, follow_symlinks=False)
                               if not n.startswith("security.selinux"))
                xattrs = tuple((n, os.getxattr(full, n, follow_symlinks=False)) for n in names)
            except OSError:
                xattrs = ()
            group = None
            if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                group = (st.st_dev, st.st_ino)
                inodes.setdefault(group, []).append(rel)
            size = st.st_size if stat.S_ISREG(st.st_mode) else None
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            result[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, size, detail,
                           xattrs, group, mtime)
    # Name each hard-link group by its smallest path, so trees compare regardless of walk order.
    for rel, entry in result.items():
        if entry[7] is not None:
            result[rel] = (*entry[:7], min(inodes[entry[7]]), entry[8])
    return result


def assert_same_tree(actual_root: Path, expected_root: Path, skip_actual: Iterable[str] = ("lost+found",)) -> None:
    actual = entries_of(actual_root, skip_actual)
    expected = entries_of(expected_root)
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    differ = sorted(p for p in set(actual) & set(expected) if actual[p] != expected[p])
    details = [f"{p}: got {actual[p]} want {expected[p]}" for p in differ[:10]]
    assert not (missing or extra or differ), (
        f"missing {missing[:10]} extra {extra[:10]} differ {details}"
    )


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- the test images --------------------------------------------------------------------------

def busybox_layer() -> bytes:
    """A busybox rootfs: the static binary and a symlink per applet, a few directories."""
    busybox = Path("/bin/busybox").read_bytes()
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    t = TarBuilder()
    for d in ("bin", "etc", "root", "tmp", "usr", "usr/bin", "var"):
        t.dir(d, mode=0o1777 if d == "tmp" else 0o700 if d == "root" else 0o755)
    t.file("bin/busybox", busybox, mode=0o755)
    for applet in sorted(set(applets) - {"busybox"}):
        t.symlink(f"bin/{applet}", "busybox")
    t.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    t.file("etc/group", b"root:x:0:\n")
    return t.bytes()


def debian_like_layers() -> tuple[bytes, bytes]:
    """Two layers; the second deletes, replaces and hides things of the first."""
    base = TarBuilder()
    base.dir("./", mode=0o755)
    for d in ("bin", "etc", "etc/apt", "etc/apt/sources.list.d", "usr", "usr/lib", "usr/share",
              "usr/share/doc", "usr/share/doc/pkg", "var", "var/cache", "var/cache/apt", "dev",
              "opt", "home", "home/user"):
        base.dir(d)
    base.dir("home/user", mode=0o750, uid=1000, gid=1000)
    base.file("bin/tool", b"\x7fELF" + os.urandom(70_000), mode=0o4755)  # setuid
    base.hardlink("bin/tool-alias", "bin/tool")
    base.file("etc/os-release", b"ID=debian\nVERSION_ID=12\n")
    base.file("etc/shadow", b"root:*:19000:0:99999:7:::\n", mode=0o640, gid=42)
    base.file("etc/apt/sources.list.d/old.list", b"deb http://old stable main\n")
    base.file("usr/lib/libfoo.so.1.2", os.urandom(200_000), mode=0o755)
    base.symlink("usr/lib/libfoo.so.1", "libfoo.so.1.2")
    base.symlink("usr/lib/libfoo.so", "/usr/lib/libfoo.so.1")
    base.file("usr/share/doc/pkg/README", b"docs " * 3000, mtime=1_500_000_000)
    base.file("usr/share/doc/pkg/changelog", b"log " * 1000)
    base.file("var/cache/apt/pkgcache.bin", os.urandom(300_000))
    base.file("var/cache/apt/srcpkgcache.bin", os.urandom(100_000))
    base.file("opt/caps", b"cap", mode=0o755,
              xattrs={"user.comment": b"a comment", "trusted.blob": bytes(range(256))})
    base.file("opt/keeps-xattrs", b"k", xattrs={"user.k": b"v", "trusted.t": b"\x00\x01"})
    base.dir("opt/xdir", mode=0o2775, uid=10, gid=20, xattrs={"user.dirattr": b"yes"})
    base.device("dev/null", "chr", 1, 3, mode=0o666)
    base.device("dev/sda", "blk", 8, 0, mode=0o660, gid=6)
    base.device("dev/initctl", "fifo", 0, 0, mode=0o600)
    base.file("home/user/.profile", b"export A=1\n", mode=0o600, uid=1000, gid=1000)
    base.file("home/user/sparse-ish", bytes(1 << 20), uid=1000, gid=1000)
    base.file("zero-length", b"")
    base.file("name with spaces & ünïcode", b"odd name\n", mode=0o000)
    base.file("a" * 200, b"long name")

    top = TarBuilder()
    top.whiteout("etc/apt/sources.list.d/old.list")
    top.file("etc/apt/sources.list.d/new.list", b"deb http://new bookworm main\n")
    top.file("etc/os-release", b"ID=debian\nVERSION_ID=12.5\n")  # replaced
    top.whiteout("usr/share/doc/pkg")  # a whole directory
    top.dir("var/cache/apt")
    top.opaque("var/cache/apt")  # emptied, then refilled
    top.file("var/cache/apt/fresh.bin", b"fresh")
    top.whiteout("bin/tool-alias")  # one of two hard links
    top.file("usr/lib/libfoo.so.1.2", os.urandom(150_000), mode=0o755)  # replaced, links kept
    top.dir("opt/xdir", mode=0o700, uid=11, gid=21)  # dir over dir: metadata changes
    top.file("opt/caps", b"now a file without xattrs", mode=0o600)
    top.symlink("opt/link-to-dir", "xdir")
    top.file("opt/link-to-dir/through-symlink", b"written through a symlinked parent")
    top.hardlink("opt/tool-hard", "bin/tool")  # hard link to a lower layer's file
    top.dir("home/user")  # a directory replaced by a file next
    top.whiteout("home/user/.profile")
    top.whiteout("zero-length")
    top.dir("zero-length", mode=0o711)  # a file replaced by a directory
    top.file("dev/null", b"not a device any more")  # device replaced by a file
    return base.bytes(), top.bytes()


# -- a team's own registry ----------------------------------------------------------------------

@dataclass
class TeamRegistry:
    """A registry a team controls, on loopback: serves the manifests and blobs it is given, and
    answers HEAD of any other blob 200 (it lies, as a hostile one would). A real registry
    refuses a manifest naming blobs its repository lacks; this one serves it."""

    server: ThreadingHTTPServer
    manifests: dict[str, bytes] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


def start_team_registry() -> TeamRegistry:
    """A TeamRegistry serving in a thread; stop it with `.server.shutdown()`."""
    holder: list[TeamRegistry] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: bool) -> None:
            reg = holder[0]
            reg.hits.append(f"{self.command} {self.path}")
            status, headers, data = 404, {}, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}'
            if self.path == "/v2/":
                status, data = 200, b"{}"
            elif "/manifests/" in self.path:
                tag = self.path.rsplit("/", 1)[1]
                if tag in reg.manifests:
                    status, data = 200, reg.manifests[tag]
                    headers["Content-Type"] = json.loads(data).get("mediaType", OCI_MANIFEST)
            elif "/blobs/" in self.path:
                digest = self.path.rsplit("/", 1)[1]
                if digest in reg.blobs:
                    status, data = 200, reg.blobs[digest]
                elif self.command == "HEAD":
                    status, data = 200, b""  # "yes, this team may read that blob"
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(True)

        def do_HEAD(self) -> None:
            self._answer(False)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(TeamRegistry(server))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return holder[0]

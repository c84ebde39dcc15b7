"""Snapshot repositories: publish a snapshot with every file it needs, fetch it on another node.

A snapshot (a template build, a pause, an API snapshot) is its record plus files in several
directories (its own, the snapshots it grew from, the image layers under its disks). Pushing
collects them all as *parts*; the record travels with its paths replaced by part names, and a
node that fetches it writes the parts into one new snapshot directory and the record with
local paths again (`SnapshotRecord.check_files` then holds as on the source node).

Two kinds of repository, one artifact layout:

- an OCI registry (`host[:port]/repo:tag`, optionally `oci://`): an OCI image manifest with
  `artifactType` application/vnd.aenv.snapshot.v1, the portable record as its config blob
  (CONFIG_TYPE) and one blob per part (PART_TYPES, `org.opencontainers.image.title` = the
  part's name). Blobs are content-addressed, so parts shared by snapshots (the base
  template's memory, an image's disk layers) are uploaded once (HEAD first) and stored once;
- a shared directory (`dir:///mnt/shared/snapshots/NAME` or an absolute path), e.g. NFS:
  `blobs/sha256/<hex>` (shared by every snapshot of the repository) and `NAME/manifest.json`
  in the same layout.

Fetching from a registry is lazy by default: the memory and disk layers are not downloaded
but written as remote layers' descriptors (storage/blob.py: digest, size, this registry and
repository), so blockd reads them through its chunk cache (blockd/remote/) and a restore
fetches only the chunks it touches, first in the order of the startup pack (part role "pack",
runtime/memdev.py) when the snapshot has one; the background completer fetches the rest.
The device state, the startup pack and raw disk files are small and downloaded whole (all
verified against their digests). `lazy=False` (`aenv snapshot pull --download`) downloads
every part, as does a shared directory (it is local). A lazily pulled snapshot can be pushed
again: its remote parts are read through the chunk store (or found in the target already).

`meta` carries what the node needs to register the snapshot as a template (names, sizes,
envd version, and the envd token the snapshot's guest holds, needed for its first /init).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv import boundedjson
from agentenv.blockd.remote.chunkdigests import ANNOTATION as CHUNK_SHA256
from agentenv.blockd.remote.chunkdigests import ChunkDigests
from agentenv.errors import AgentEnvError
from agentenv.fsutil import atomic_write, fsync_dir
from agentenv.registry.client import Descriptor, RegistryClient
from agentenv.registry.reference import parse_reference
from agentenv.snapshot.record import RECORD_NAME, SnapshotRecord
from agentenv.storage import blob
from agentenv.template.layeraccess import LayerAccess

ARTIFACT_TYPE = "application/vnd.aenv.snapshot.v1"
CONFIG_TYPE = "application/vnd.aenv.snapshot.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
PART_TYPES = {
    "memory": "application/vnd.aenv.snapshot.memory.layer.v1",
    "disk": "application/vnd.aenv.snapshot.disk.layer.v1",
    "file": "application/vnd.aenv.snapshot.disk.file.v1",
    "devstate": "application/vnd.aenv.snapshot.devstate.v1",
    "pack": "application/vnd.aenv.snapshot.startup-pack.v1+json",
}
TITLE = "org.opencontainers.image.title"
PACK_NAME = "startup-pack.json"  # runtime/memdev.py's sidecar
_CHUNK = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class RepositoryError(AgentEnvError):
    pass


LAZY_ROLES = ("memory", "disk")  # parts a lazy fetch leaves in the registry
#: in a snapshot directory: the identity (`_identity`) of the artifact it was fetched from or
#: pushed as; a fetch finds an existing directory of the same id usable only with this
IDENTITY_FILE = ".artifact-identity"


def _identity(manifest: dict[str, Any]) -> str:
    """What an artifact holds: its config (the record) and every part's name and digest."""
    parts = sorted(((d.get("annotations") or {}).get(TITLE, ""), d.get("digest", ""))
                   for d in manifest.get("layers", []))
    doc = {"config": manifest.get("config", {}).get("digest", ""), "parts": parts}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass
class Part:
    role: str
    name: str  # file name inside a fetched snapshot directory
    path: Path  # local file, or a remote layer's descriptor (`remote`)
    size: int
    digest: str = ""
    remote: Any = None  # the RemoteLayerRef of a part pulled lazily
    chunk_sha256: str | None = None  # its per-chunk SHA-256 table (blockd/remote/chunkdigests)

    def descriptor(self) -> dict[str, Any]:
        annotations = {TITLE: self.name}
        if self.chunk_sha256 is not None:
            annotations[CHUNK_SHA256] = self.chunk_sha256
        return {"mediaType": PART_TYPES[self.role], "digest": self.digest, "size": self.size,
                "annotations": annotations}


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _digest_and_chunk_table(path: Path, size: int) -> tuple[str, str]:
    """A layer file's digest and its chunk table (chunkdigests.py), from one read of it."""
    with open(path, "rb") as f:
        table, digest = ChunkDigests.compute(f.read, size)
    return digest, table.encode()


def collect(record_dir: Path) -> tuple[SnapshotRecord, list[Part], dict[str, Any]]:
    """The snapshot's parts and its portable record (paths replaced by part names)."""
    record = SnapshotRecord.load(record_dir)
    if not record.memory:
        raise RepositoryError(f"snapshot {record.id} is filesystem-only: only snapshots with "
                              "memory can be published")
    try:
        record.check_files()
    except AgentEnvError as exc:
        raise RepositoryError(f"snapshot {record.id} cannot be published: {exc}") from exc
    parts: list[Part] = []
    portable = json.loads(record.model_dump_json())

    def add(role: str, name: str, path: str) -> str:
        p = Path(path)
        with open(p, "rb") as f:
            head = f.read(512)
        if blob.is_descriptor(head):  # pulled lazily: the blob is known by its digest
            ref = blob.load_descriptor(p)
            parts.append(Part(role, name, p, ref.size, ref.digest, ref))
        else:
            parts.append(Part(role, name, p, p.stat().st_size))
        return name

    def add_layer(entry: dict[str, Any], role: str, name: str) -> None:
        entry["path"] = add(role, name, entry["path"])
        entry["size"] = parts[-1].size  # a remote layer's: its blob's, not its descriptor's

    for i, layer in enumerate(portable["memory_layers"]):
        add_layer(layer, "memory", f"memory-{i:03d}.layer")
    portable["device_state"] = add("devstate", "devstate.bin", record.device_state)
    for d, disk in enumerate(record.disks):
        for i, layer in enumerate(portable["disks"][d]["layers"]):
            add_layer(layer, "disk", f"disk-{disk.name}-{i:03d}.layer")
        if disk.file:
            portable["disks"][d]["file"] = add("file", f"disk-{disk.name}.file", disk.file)
    pack = Path(record.device_state).parent / PACK_NAME
    if pack.is_file():
        add("pack", PACK_NAME, str(pack))
    return record, parts, portable


def localise(portable: dict[str, Any], directory: Path,
             found: dict[str, Path] | None = None) -> SnapshotRecord:
    """The record of a fetched snapshot, its part names made paths in `directory` (or the
    node's own copy of a part, `found`)."""
    doc = json.loads(json.dumps(portable))
    found = found or {}

    def local(name: str) -> str:
        if not _NAME.match(name):
            raise RepositoryError(f"snapshot artifact names a bad part {name!r}")
        return str(found.get(name) or directory / name)

    for layer in doc["memory_layers"]:
        layer["path"] = local(layer["path"])
    doc["device_state"] = local(doc["device_state"])
    for disk in doc.get("disks", []):
        for layer in disk["layers"]:
            layer["path"] = local(layer["path"])
        if disk.get("file"):
            disk["file"] = local(disk["file"])
    return SnapshotRecord.model_validate(doc)


# --- references ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepoRef:
    kind: str  # "oci" or "dir"
    location: str  # registry reference (host/repo:tag) or directory path
    text: str


def parse_ref(text: str) -> RepoRef:
    text = text.strip()
    if text.startswith("dir://"):
        path = text.removeprefix("dir://")
        if not path.startswith("/"):
            raise RepositoryError(f"{text!r}: a directory repository is dir:///ABSOLUTE/PATH/NAME")
        return RepoRef("dir", path, text)
    if text.startswith("/"):
        return RepoRef("dir", text, text)
    location = text.removeprefix("oci://")
    try:
        parse_reference(location)
    except AgentEnvError as exc:
        raise RepositoryError(f"{text!r} is neither a registry reference nor an absolute "
                              f"directory: {exc}") from exc
    return RepoRef("oci", location, text)


# --- push ----------------------------------------------------------------------------------


def _manifest(parts: list[Part], config: bytes, meta: dict[str, Any]) -> bytes:
    doc = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                   "size": len(config)},
        "layers": [p.descriptor() for p in parts],
        "annotations": {"io.agentenv.snapshot.meta": json.dumps(meta, sort_keys=True)},
    }
    return json.dumps(doc, indent=2).encode()


def push(record_dir: Path, ref: str, meta: dict[str, Any], *, team: str | None = None,
         access: LayerAccess | None = None, **registry_options: Any) -> dict[str, Any]:
    """Publish the snapshot in `record_dir` under `ref`; returns what was sent. `access`
    records that `team` may use the parts pushed (template/layeraccess.py)."""
    repo = parse_ref(ref)
    t0 = time.monotonic()
    record, parts, portable = collect(record_dir)
    for part in parts:
        if part.remote is not None:
            part.chunk_sha256 = part.remote.chunk_sha256  # as its own manifest published it
        elif part.role in LAZY_ROLES:
            # Published with the layer so that nodes can take its chunks from each other.
            part.digest, part.chunk_sha256 = _digest_and_chunk_table(part.path, part.size)
        else:
            part.digest = file_digest(part.path)
    config = json.dumps({"record": portable}, sort_keys=True).encode()
    manifest = _manifest(parts, config, meta)
    sent = (_push_dir(repo, parts, config, manifest) if repo.kind == "dir"
            else _push_oci(repo, parts, config, manifest, **registry_options))
    atomic_write(record_dir / IDENTITY_FILE, _identity(json.loads(manifest)) + "\n", mode=0o600)
    if access is not None and repo.kind == "oci":
        reference = parse_reference(repo.location)
        for part in parts:  # the registry holds them now: a source, and the team's
            access.fetched(team, part.digest, f"{reference.registry}/{reference.repository}")
    return {"ref": repo.text, "snapshot": record.id, "parts": len(parts),
            "bytes": sum(p.size for p in parts), "bytes_sent": sent,
            "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            "seconds": round(time.monotonic() - t0, 2)}


def _push_dir(repo: RepoRef, parts: list[Part], config: bytes, manifest: bytes) -> int:
    target = Path(repo.location)
    root = target.parent
    if not _NAME.match(target.name):
        raise RepositoryError(f"{repo.text!r}: the snapshot's name must be letters, digits, _.-")
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    sent = 0

    def put(digest: str, source: Path | bytes) -> int:
        dest = blobs / digest.removeprefix("sha256:")
        if dest.exists():
            return 0
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        if isinstance(source, bytes):
            tmp.write_bytes(source)
        else:
            shutil.copyfile(source, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        return dest.stat().st_size

    sent += put("sha256:" + hashlib.sha256(config).hexdigest(), config)
    for part in parts:
        if part.remote is not None and not (blobs / part.digest.removeprefix("sha256:")).exists():
            with _materialised(part) as local:
                sent += put(part.digest, local)
        else:
            sent += put(part.digest, part.path)
    fsync_dir(blobs)
    target.mkdir(parents=True, exist_ok=True)
    atomic_write(target / "manifest.json", manifest, mode=0o644)
    return sent


def _push_oci(repo: RepoRef, parts: list[Part], config: bytes, manifest: bytes,
              **options: Any) -> int:
    reference = parse_reference(repo.location)
    with _Pusher(reference, **options) as pusher:
        sent = pusher.blob("sha256:" + hashlib.sha256(config).hexdigest(), config)
        for part in parts:
            if part.remote is not None:
                if pusher.has(part.digest):
                    continue
                with _materialised(part) as local:
                    sent += pusher.blob(part.digest, local)
            else:
                sent += pusher.blob(part.digest, part.path)
        pusher.manifest(reference.tag or reference.selector, manifest)
    return sent


def delete(ref: str, **registry_options: Any) -> dict[str, Any]:
    """Delete the artifact a registry reference names: its manifest (registry/client.py
    `delete_manifest`; the blobs stay until the registry's own garbage collection frees the
    ones no manifest names any more). A shared directory's artifacts are not deleted here.
    Returns {ref, digest, deleted}: `deleted` false when it was gone already."""
    repo = parse_ref(ref)
    if repo.kind != "oci":
        raise RepositoryError(f"{ref!r}: only a registry's references are deleted (a shared "
                              "directory's are files of the directory)")
    reference = parse_reference(repo.location)
    with RegistryClient(reference.registry, api_host=reference.api_host,
                        **registry_options) as client:
        digest = client.delete_manifest(reference.repository, reference.selector)
    return {"ref": repo.text, "digest": digest, "deleted": digest is not None}


class _Pusher:
    """Blob and manifest uploads (OCI distribution spec: POST + monolithic PUT, HEAD to skip
    what the registry holds), on the pull client's transport and auth."""

    def __init__(self, reference: Any, **options: Any) -> None:
        self.reference = reference
        self.repository = reference.repository
        self.client = RegistryClient(reference.registry, api_host=reference.api_host, **options)
        self.scope = f"repository:{self.repository}:pull,push"

    def __enter__(self) -> _Pusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _send(self, method: str, url: str, *, content: Callable[[], Any] | None = None,
              headers: dict[str, str] | None = None) -> Any:
        import httpx

        c = self.client
        if not url.startswith("http"):
            url = c._base() + url
        for _round in range(3):
            body = content() if content is not None else None
            try:
                response = c._http.request(method, url, content=body,
                                           headers={**(headers or {}), **c._auth_header(self.scope)})
            except httpx.TransportError as exc:
                raise RepositoryError(f"{method} {url} failed: {exc}") from exc
            finally:
                if hasattr(body, "close"):
                    body.close()
            if response.status_code == 401:
                c._authenticate(response, self.scope)
                continue
            return response
        raise RepositoryError(f"{method} {url}: registry {c.registry} keeps refusing our credentials")

    def _check(self, response: Any, what: str) -> None:
        if response.status_code >= 300:
            raise RepositoryError(f"{what}: registry {self.client.registry} answered HTTP "
                                  f"{response.status_code} {response.text[:300]}")

    def has(self, digest: str) -> bool:
        return bool(self._send("HEAD", f"/v2/{self.repository}/blobs/{digest}").status_code == 200)

    def blob(self, digest: str, source: Path | bytes) -> int:
        base = f"/v2/{self.repository}/blobs"
        if self.has(digest):
            return 0
        start = self._send("POST", f"{base}/uploads/")
        self._check(start, f"starting the upload of {digest}")
        location = start.headers.get("location", "")
        if not location:
            raise RepositoryError(f"registry {self.client.registry} gave no upload location")
        if location.startswith("/"):
            location = self.client._base() + location
        sep = "&" if "?" in location else "?"
        size = len(source) if isinstance(source, bytes) else source.stat().st_size

        def body() -> Any:
            return source if isinstance(source, bytes) else open(source, "rb")

        done = self._send("PUT", f"{location}{sep}digest={digest}", content=body,
                          headers={"Content-Type": "application/octet-stream",
                                   "Content-Length": str(size)})
        self._check(done, f"uploading blob {digest}")
        return size

    def manifest(self, tag: str, data: bytes) -> None:
        answer = self._send("PUT", f"/v2/{self.repository}/manifests/{tag}", content=lambda: data,
                            headers={"Content-Type": OCI_MANIFEST})
        self._check(answer, f"putting the manifest {self.repository}:{tag}")


@contextlib.contextmanager
def _materialised(part: Part) -> Iterator[Path]:
    """A lazily pulled part as a temporary local file, read through the remote layer reader
    (its chunks checked as blockd's remote reads are) and verified against its digest."""
    fd, name = tempfile.mkstemp(prefix=".aenv-part-", dir=part.path.parent)
    tmp = Path(name)
    try:
        source = blob.open_remote(part.remote)
        try:
            with os.fdopen(fd, "wb") as out:
                pos = 0
                while pos < part.size:
                    data = source.pread(min(_CHUNK * 8, part.size - pos), pos)
                    if not data:
                        raise RepositoryError(f"part {part.name} ({part.digest}) ended at {pos} "
                                              f"of {part.size} bytes")
                    out.write(data)
                    pos += len(data)
        finally:
            source.close()
        if file_digest(tmp) != part.digest:
            raise RepositoryError(f"part {part.name} read back from its registry does not "
                                  f"match {part.digest}")
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


# --- fetch ---------------------------------------------------------------------------------


@dataclass
class Fetched:
    record: SnapshotRecord
    meta: dict[str, Any]
    directory: Path
    bytes_fetched: int
    seconds: float
    existed: bool = False
    bytes_total: int = 0  # of every part
    lazy_parts: int = 0  # parts left in the registry (remote layers)


_digests: dict[tuple[str, int, int], str] = {}


def _local_copies(files: list[Path], descs: list[dict[str, Any]]) -> dict[str, Path]:
    """digest -> one of `files` with that content, for the raw-file parts `descs` (a node's
    tools disk is the same file on every node running the same guest assets)."""
    sizes = {int(d["size"]) for d in descs}
    out: dict[str, Path] = {}
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_size not in sizes:
            continue
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _digests:
            _digests[key] = file_digest(path)
        out[_digests[key]] = path
    return out


def fetch(ref: str, snapshots_root: Path, *, lazy: bool = True,
          local_files: list[Path] | None = None, team: str | None = None,
          access: LayerAccess | None = None, **registry_options: Any) -> Fetched:
    """Fetch the snapshot named by `ref` into `snapshots_root/<id>`: from a registry with
    `lazy`, its memory and disk layers as remote layers (module doc), else every part whole;
    everything downloaded is verified against its digest. A raw disk file part with the
    content of one of `local_files` (the node's tools disk) is not fetched: the record names
    the local file, as the records of the node's own snapshots do.

    `team` and `access`: a team's pull (template/layeraccess.py). A part the node holds
    already (by digest: blockd's chunk caches, another snapshot) is left remote only when the
    team may use the node's copy (else it is downloaded whole from the team's repository,
    which fails for a blob it cannot read); a snapshot directory of the same id is reused only
    when it holds this very artifact and the team may use every part of it."""
    repo = parse_ref(ref)
    local = list(local_files or [])
    t0 = time.monotonic()
    if repo.kind == "dir":
        manifest_bytes = _read(Path(repo.location) / "manifest.json", repo.text)
        blobs = Path(repo.location).parent / "blobs" / "sha256"

        def get_bytes(desc: dict[str, Any]) -> bytes:
            data = _read(blobs / desc["digest"].removeprefix("sha256:"), repo.text)
            _verify_bytes(data, desc)
            return data

        def get_file(desc: dict[str, Any], dest: Path) -> None:
            src = blobs / desc["digest"].removeprefix("sha256:")
            tmp = dest.with_name(dest.name + ".partial")
            try:
                shutil.copyfile(src, tmp)
            except OSError as exc:
                raise RepositoryError(f"{repo.text}: part {desc['digest']}: {exc}") from exc
            if file_digest(tmp) != desc["digest"] or tmp.stat().st_size != desc["size"]:
                tmp.unlink(missing_ok=True)
                raise RepositoryError(f"{repo.text}: part {desc['digest']} is damaged")
            os.replace(tmp, dest)

        return _fetch(repo, manifest_bytes, get_bytes, get_file, snapshots_root, t0, None, local,
                      None)

    reference = parse_reference(repo.location)
    with RegistryClient(reference.registry, api_host=reference.api_host, **registry_options) as client:
        _, manifest_bytes, _ = client.get_manifest_bytes(reference.repository, reference.selector)

        def descriptor(desc: dict[str, Any]) -> Any:
            return Descriptor.from_json(desc, "snapshot artifact")

        def get_bytes_oci(desc: dict[str, Any]) -> bytes:
            return bytes(client.get_blob_bytes(reference.repository, descriptor(desc)))

        repository = f"{reference.registry}/{reference.repository}"

        def get_file_oci(desc: dict[str, Any], dest: Path) -> None:
            client.download_blob(reference.repository, descriptor(desc), dest)
            if access is not None:
                access.fetched(team, desc["digest"], repository)

        def claim(desc: dict[str, Any], prove: Callable[[], None]) -> str:
            """Let the team use the node's copy of a part (LayerAccess.claim)."""
            assert access is not None
            name = (desc.get("annotations") or {}).get(TITLE, "")
            return access.claim(team, desc["digest"], repository, f"snapshot part {name}",
                                lambda: client.blob_exists(reference.repository, desc["digest"]),
                                prove)

        def reuse(desc: dict[str, Any]) -> None:
            def prove() -> None:
                with tempfile.TemporaryDirectory(dir=snapshots_root.parent) as tmp:
                    client.download_blob(reference.repository, descriptor(desc), Path(tmp) / "p")
            claim(desc, prove)

        location = blob.BlobLocation(reference.registry, reference.repository,
                                     client.host if client.host != reference.registry else None,
                                     client.insecure)

        def describe(desc: dict[str, Any], dest: Path) -> int:
            d = descriptor(desc)
            if access is not None and team is not None and access.held(d.digest) and \
                    claim(desc, lambda: get_file_oci(desc, dest)) == "proved":
                return d.size  # downloaded whole to show it could be: used as it is
            blob.RemoteLayerRef(d.digest, d.size, [location], d.media_type,
                                chunk_sha256=d.annotations.get(CHUNK_SHA256)).save(dest)
            if access is not None:
                access.fetched(team, d.digest, repository)
            return 0

        checked = access is not None and team is not None
        return _fetch(repo, manifest_bytes, get_bytes_oci, get_file_oci, snapshots_root, t0,
                      describe if lazy else None, local, reuse if checked else None)


def _fetch(repo: RepoRef, manifest_bytes: bytes, get_bytes: Callable[[dict[str, Any]], bytes],
           get_file: Callable[[dict[str, Any], Path], None], snapshots_root: Path, t0: float,
           describe: Callable[[dict[str, Any], Path], int] | None,
           local_files: list[Path], reuse: Callable[[dict[str, Any]], None] | None) -> Fetched:
    """`describe`: write a lazy part's descriptor (returns 0), or download it whole (returns
    its size); `reuse`: when given, raises unless the team may use a part the node holds."""
    try:
        manifest = boundedjson.loads(manifest_bytes, "the manifest")
    except ValueError as exc:
        raise RepositoryError(f"{repo.text}: the manifest is not JSON: {exc}") from exc
    if manifest.get("artifactType") != ARTIFACT_TYPE or \
            manifest.get("config", {}).get("mediaType") != CONFIG_TYPE:
        raise RepositoryError(f"{repo.text} is not an agentenv snapshot (artifactType "
                              f"{manifest.get('artifactType')!r})")
    meta = boundedjson.loads(manifest.get("annotations", {}).get("io.agentenv.snapshot.meta", "{}"),
                             "the snapshot's annotation")
    config = boundedjson.loads(get_bytes(manifest["config"]), "the snapshot's config")
    portable = config["record"]
    snapshot_id = str(portable.get("id", ""))
    if not _NAME.match(snapshot_id):
        raise RepositoryError(f"{repo.text}: bad snapshot id {snapshot_id!r}")
    final = snapshots_root / snapshot_id
    identity = _identity(manifest)
    if (final / RECORD_NAME).is_file():
        if reuse is not None:
            # The id is the artifact's word: the directory may be another snapshot's.
            try:
                held = (final / IDENTITY_FILE).read_text().strip()
            except FileNotFoundError:
                held = ""
            if held != identity:
                raise RepositoryError(f"{repo.text}: snapshot {snapshot_id} is on this node "
                                      "already, and not as this artifact")
            for desc in manifest.get("layers", []):
                reuse(desc)
        record = SnapshotRecord.load(final)
        return Fetched(record, meta, final, 0, round(time.monotonic() - t0, 2), existed=True)
    # Beside the snapshot root, not in it: the node's GC sweeps what no record marks there.
    work = snapshots_root.parent / ".incoming-snapshots" / f"{snapshot_id}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    snapshots_root.mkdir(parents=True, exist_ok=True)
    fetched = total = remote = 0
    lazy_types = {PART_TYPES[r] for r in LAZY_ROLES}
    descs = list(manifest.get("layers", []))
    copies = _local_copies(local_files, [d for d in descs
                                         if d.get("mediaType") == PART_TYPES["file"]])
    found: dict[str, Path] = {}
    try:
        for desc in descs:
            name = (desc.get("annotations") or {}).get(TITLE, "")
            if not _NAME.match(name) or desc.get("mediaType") not in PART_TYPES.values():
                raise RepositoryError(f"{repo.text}: bad part {name!r} ({desc.get('mediaType')})")
            total += int(desc["size"])
            if describe is not None and desc["mediaType"] in lazy_types:
                whole = describe(desc, work / name)
                if not whole:
                    remote += 1
                    continue
                fetched += whole
            elif desc["mediaType"] == PART_TYPES["file"] and desc.get("digest") in copies:
                found[name] = copies[desc["digest"]]
                continue
            else:
                get_file(desc, work / name)
                fetched += int(desc["size"])
            if desc["mediaType"] in lazy_types and _is_descriptor_file(work / name):
                # it would open whatever blob it names through the node's chunk caches
                raise RepositoryError(f"{repo.text}: part {name} is a remote layer "
                                      "descriptor, not a layer")
        record = localise(portable, final, found)
        atomic_write(work / IDENTITY_FILE, identity + "\n", mode=0o600)
        # Written with the final paths, then the directory moves into place in one rename.
        record.save(work)
        fsync_dir(work)
        os.replace(work, final)
        fsync_dir(snapshots_root)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    record.check_files()
    return Fetched(record, meta, final, fetched, round(time.monotonic() - t0, 2),
                   bytes_total=total, lazy_parts=remote)


def _is_descriptor_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return blob.is_descriptor(f.read(512))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise RepositoryError(f"{what}: {path} not found") from exc
    except OSError as exc:
        raise RepositoryError(f"{what}: {path}: {exc}") from exc


def _verify_bytes(data: bytes, desc: dict[str, Any]) -> None:
    if "sha256:" + hashlib.sha256(data).hexdigest() != desc["digest"] or len(data) != desc["size"]:
        raise RepositoryError(f"blob {desc['digest']} is damaged")

"""`aenv pull`: fetch an OCI image and record it as a template-ready overlaybd image.

Plain images: every tar layer is converted (see convert.py) into one overlaybd layer, cached by
its chain ID, so layers shared with images pulled before are neither downloaded nor converted
again. The stack starts with a shared base layer (an empty 64 GiB ext4, made once per host and
byte-reproducible), so `lowers` = [base, layer 0, ..., layer N-1]. Downloads run ahead in
threads, and a layer still downloading is converted from the bytes as they arrive; nothing is
published before its digest checks. overlaybd-format images (layers annotated `containerd.io/snapshot/overlaybd/...`) are
used as they are: each blob is a layer.

The result is a directory `<state>/images/<name>/` holding `image.json` (an overlaybd image
config: `lowers` bottom to top, plus the image's name, digests and run settings) and
`config.json` (the image's OCI config, byte for byte). It appears only once complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from agentenv import boundedjson
from agentenv.blockd.client import BlockdClient
from agentenv.blockd.remote.chunkdigests import ANNOTATION as CHUNK_SHA256_ANNOTATION
from agentenv.fsutil import require_free_space
from agentenv.registry.auth import Credentials
from agentenv.registry.blobtap import BlobTap
from agentenv.registry.client import Descriptor, Manifest, Platform, RegistryClient
from agentenv.registry.errors import (
    DigestMismatchError,
    PullError,
    RegistryError,
    UnsupportedImageError,
)
from agentenv.registry.reference import Reference, parse_reference
from agentenv.storage.blob import BlobLocation, RemoteLayerRef, load_descriptor
from agentenv.storage.layer import (
    describe_layer,
    inspect_layer,
    is_remote,
    load_sealed,
    open_stream,
)
from agentenv.template.apply import compression_of, open_uncompressed
from agentenv.template.convert import (
    BASE_KEY,
    BASE_MKFS_ARGS,
    VIRTUAL_SIZE,
    blockd_socket,
    convert_tar_layer,
    make_base_layer,
)
from agentenv.template.layeraccess import LayerAccess, LayerAccessError
from agentenv.template.layercache import (
    BASE_KIND,
    CONVERTER_KIND,
    LAYER_FILE,
    NATIVE_KIND,
    REMOTE_KIND,
    LayerCache,
    chain_ids,
    converted_key,
    file_digest,
)

log = logging.getLogger("agentenv.template.pull")

DEFAULT_STATE_DIR = Path("/var/lib/aenv")
OVERLAYBD_DIGEST_ANNOTATION = "containerd.io/snapshot/overlaybd/blob-digest"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class PulledImage:
    name: str
    path: Path  # the image directory
    reference: str
    manifest_digest: str
    lowers: list[Path]
    config: dict[str, Any]  # the OCI config's "config" section (Env, Cmd, WorkingDir, User, ...)
    format: str  # "converted" (tar layers made into ext4) or "overlaybd" (used as pulled)
    layers_cached: int = 0
    layers_converted: int = 0  # tar layers made into overlaybd layers by this pull
    layers_fetched: int = 0  # overlaybd layers downloaded by this pull and used as they are
    bytes_downloaded: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def image_json(self) -> Path:
        return self.path / "image.json"


class _Reporter:
    """Rich progress bars when enabled, else nothing."""

    def __init__(self, enabled: bool, console: Console | None) -> None:
        self.progress: Progress | None = None
        if enabled:
            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeElapsedColumn(),
                console=console or Console(stderr=True), transient=False,
            )

    def __enter__(self) -> _Reporter:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress:
            self.progress.stop()

    def task(self, description: str, total: int | None) -> TaskID | None:
        return self.progress.add_task(description, total=total) if self.progress else None

    def advancer(self, task: TaskID | None) -> Callable[[int], None] | None:
        if self.progress is None or task is None:
            return None
        progress = self.progress
        return lambda n: progress.advance(task, n)

    def done(self, task: TaskID | None, description: str | None = None) -> None:
        if self.progress is not None and task is not None:
            total = self.progress.tasks[task].total
            self.progress.update(task, completed=total, description=description or
                                 self.progress.tasks[task].description)


def _short(digest: str) -> str:
    return digest.split(":", 1)[-1][:12]


def _run_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("config") or {}
    return {
        "env": list(inner.get("Env") or []),
        "entrypoint": list(inner.get("Entrypoint") or []),
        "cmd": list(inner.get("Cmd") or []),
        "workingDir": inner.get("WorkingDir") or "",
        "user": inner.get("User") or "",
        "exposedPorts": sorted((inner.get("ExposedPorts") or {}).keys()),
        "labels": dict(inner.get("Labels") or {}),
    }


def _is_overlaybd(manifest: Manifest) -> bool:
    flags = [OVERLAYBD_DIGEST_ANNOTATION in layer.annotations for layer in manifest.layers]
    if any(flags) and not all(flags):
        raise UnsupportedImageError(
            f"manifest {manifest.digest} mixes overlaybd and tar layers; that is not supported"
        )
    return bool(flags) and all(flags)


class _Puller:
    def __init__(self, ref: Reference, client: RegistryClient, cache: LayerCache,
                 reporter: _Reporter, team: str | None,
                 reserve: tuple[int, str] | None = None) -> None:
        self.ref = ref
        self.client = client
        self.cache = cache
        self.reporter = reporter
        self.team = team
        self.access = LayerAccess(cache.root)
        self.repository = f"{ref.registry}/{ref.repository}"
        self.bytes_downloaded = 0
        self.downloaded_blobs: set[Path] = set()
        self.reserve = reserve

    def require_space(self, need: int, what: str) -> None:
        """InsufficientSpace unless `need` bytes fit in the layer cache with the reserve left."""
        reserve, setting = self.reserve or (None, "AENV_DISK_RESERVE")
        require_free_space(self.cache.root, need, what, reserve=reserve, setting=setting)

    def fetched(self, layer: Descriptor) -> None:
        """This pull got `layer` from its repository: a source, and the team's."""
        self.access.fetched(self.team, layer.digest, self.repository)

    def download_whole(self, layer: Descriptor) -> Path:
        """Download an overlaybd blob whole into the layer cache (`overlaybd/`), checked; the
        caller holds its entry lock."""
        with self.cache.workspace() as work:
            staged = work / "entry"
            staged.mkdir()
            task = self.reporter.task(f"download {_short(layer.digest)}", layer.size)
            self.client.download_blob(self.ref.repository, layer, staged / LAYER_FILE,
                                      self.reporter.advancer(task), reserve=self.reserve)
            self.bytes_downloaded += layer.size
            if is_remote(staged / LAYER_FILE):
                # A blob that reads as a remote layer's descriptor would open whatever
                # digest it names through the node's chunk cache.
                raise UnsupportedImageError(f"layer {layer.digest} is a remote layer "
                                            "descriptor, not a layer")
            inspect_layer(staged / LAYER_FILE)  # raises a LayerFormatError naming the problem
            path = self.cache.publish(NATIVE_KIND, layer.digest, staged, {
                "kind": "overlaybd-blob", "sourceDigest": layer.digest, "size": layer.size,
                "mediaType": layer.media_type, "annotations": layer.annotations,
            })
        self.fetched(layer)
        return path

    def claim(self, layer: Descriptor, media_type_diff_id: tuple[str, str] | None = None,
              whole: bool = False) -> Path | None:
        """Let this pull's team use the node's copy of `layer` (template/layeraccess.py), else
        raise naming the layer. `media_type_diff_id`: the layer is used as a converted layer
        made from another blob; the team's own blob must then decompress to that diff_id.
        `whole`: an overlaybd blob the node holds as a remote layer; when the team shows it by
        downloading it, the download becomes the whole blob in the cache, returned, and the
        pull uses it (what other pulls put in the chunk caches under this digest, with chunk
        tables of their manifests, is then never read for this team)."""
        kept: list[Path] = []

        def head() -> bool:
            return self.client.blob_exists(self.ref.repository, layer.digest)

        def prove() -> None:
            if whole:
                with self.cache.entry_lock(NATIVE_KIND, layer.digest):
                    if self.cache.lookup(NATIVE_KIND, layer.digest) is None:
                        kept.append(self.download_whole(layer))
                        return
            with self.cache.workspace() as work:
                self.client.download_blob(self.ref.repository, layer, work / "proof",
                                          reserve=self.reserve)
                self.bytes_downloaded += layer.size
                if media_type_diff_id is not None:
                    media_type, diff_id = media_type_diff_id
                    actual = _diff_id_of(work / "proof", media_type)
                    if actual != diff_id:
                        raise DigestMismatchError(f"its uncompressed content has digest {actual}, "
                                                  f"the image config says {diff_id}")

        if media_type_diff_id is not None and self.team is not None:
            # A grant of this blob says nothing of the converted layer made from another one.
            try:
                prove()
            except PullError as exc:
                raise LayerAccessError(
                    f"layer {layer.digest}: this node holds a layer of the content its image "
                    f"config names, and {self.repository} did not give this team that content "
                    f"({exc})") from exc
            self.fetched(layer)
            return None
        how = self.access.claim(self.team, layer.digest, self.repository, "layer", head, prove)
        if how != "operator":
            log.info("cached layer claimed", extra={"digest": layer.digest, "team": self.team,
                                                    "repository": self.repository, "how": how})
        return kept[0] if kept else None

    def download(self, layer: Descriptor, kind: str | None, key: str,
                 tap: BlobTap | None = None) -> Path | None:
        """The blob on disk (None if the entry got cached meanwhile); one download at a time.
        kind None: fetch even if the cache entry exists. `tap` follows the download."""
        path = self.cache.blob_path(layer.digest)
        with self.cache.blob_lock(layer.digest):
            if kind is not None and self.cache.lookup(kind, key) is not None:
                if tap is not None:
                    tap.finish(None)
                return None
            if path.exists():  # another pull's download
                self.claim(layer)
                if tap is not None:
                    tap.start(path)
                    tap.advance(path.stat().st_size)
                    tap.finish(None)
                return path
            task = self.reporter.task(f"download {_short(layer.digest)}", layer.size)
            self.client.download_blob(self.ref.repository, layer, path,
                                      self.reporter.advancer(task), tap, reserve=self.reserve)
            self.fetched(layer)
            self.downloaded_blobs.add(path)
            self.bytes_downloaded += layer.size
            self.reporter.done(task)
            return path

    def cleanup_blobs(self) -> None:
        for path in self.downloaded_blobs:
            path.unlink(missing_ok=True)


def _diff_id_of(blob: Path, media_type: str) -> str:
    """The sha256 of a tar layer blob's uncompressed stream."""
    hasher = hashlib.sha256()
    with open_uncompressed(blob, compression_of(media_type)) as stream:
        while data := stream.read(1 << 20):
            hasher.update(data)
    return "sha256:" + hasher.hexdigest()


def _claim_converted(puller: _Puller, layer: Descriptor, key: str, diff_id: str) -> None:
    """Let the team use the cached converted layer `key` for its `layer`: the layer must be
    the blob it was made from, or decompress to the same diff_id (template/layeraccess.py).
    Once shown, the team holds a grant of the converted layer itself (by its key)."""
    if puller.team is None or puller.access.granted(puller.team, key):
        return
    made_from = puller.cache.meta(CONVERTER_KIND, key).get("sourceDigest")
    puller.claim(layer, None if made_from == layer.digest else (layer.media_type, diff_id))
    puller.access.grant(puller.team, key, puller.repository)


def _validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise PullError(f"image name {name!r} must be letters, digits, '.', '_' or '-' "
                        "(starting with a letter or digit)")
    return name


@contextlib.contextmanager
def _executor(workers: int) -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(workers, thread_name_prefix="aenv-pull")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def pull_image(
    ref: str,
    *,
    name: str | None = None,
    state_dir: Path = DEFAULT_STATE_DIR,
    cache_dir: Path | None = None,
    platform: str = "linux/amd64",
    docker_config: Path | None = None,
    use_docker_config: bool = True,
    credentials: Credentials | None = None,
    blockd: Path | None = None,
    insecure: bool | None = None,
    ca_file: Path | None = None,
    progress: bool = False,
    console: Console | None = None,
    lazy: bool = True,
    team: str | None = None,
    reserve: tuple[int, str] | None = None,
) -> PulledImage:
    """Pull `ref` and record it under `state_dir/images/<name or sha256-HEX>/`.

    `blockd`: the control socket of the block daemon to convert with (default: the host's
    daemon if it answers, else a private one for this pull). `credentials`: used instead of the
    docker config's, kept in memory only; without `use_docker_config` (a team's build) no
    credentials are looked up: only `credentials`, else anonymous. `insecure`: allow plain http and
    unverified TLS (default: only for loopback registries and AENV_INSECURE_REGISTRIES).
    `lazy`: an overlaybd image's layers stay in the registry (remote layers, read on demand
    through blockd's chunk cache; docs/remote-layers.md); only their metadata is fetched.
    False downloads them whole, as does a pull with explicit `credentials`. Tar-layer images are
    always downloaded and converted. `team`: the pull is a team's (a template build): a layer
    the node already holds is used only when the team may (template/layeraccess.py).
    `reserve`: (bytes, setting) the pull must leave free instead of AENV_DISK_RESERVE (a
    team's build: what the node needs to admit creates, node/template_api.py).
    """
    started = time.perf_counter()
    if credentials is not None:
        # Credentials of this pull only stay in this process: blockd, which reads remote
        # layers later, could not authenticate with them. Download the layers whole.
        lazy = False
    reference = parse_reference(ref)
    if name is not None:
        _validate_name(name)
    wanted_platform = Platform.parse(platform)
    cache = LayerCache(cache_dir or Path(state_dir) / "layer-cache")
    cache.clean_stale_work()
    images_dir = Path(state_dir) / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    with RegistryClient(reference.registry, api_host=reference.api_host, docker_config=docker_config,
                        use_docker_config=use_docker_config, credentials=credentials,
                        insecure=insecure, ca_file=ca_file) as client, \
            _Reporter(progress, console) as reporter:
        manifest = client.resolve_manifest(reference, wanted_platform)
        config_bytes = client.get_blob_bytes(reference.repository, manifest.config)
        try:
            config = boundedjson.loads(config_bytes, "the image config")
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{reference}: image config {manifest.config.digest} is not JSON") from exc
        if not isinstance(config, dict):
            raise RegistryError(f"{reference}: image config is not a JSON object")
        timings["resolve"] = time.perf_counter() - started
        puller = _Puller(reference, client, cache, reporter, team, reserve)
        try:
            # counts: (cached, converted, fetched as they are)
            if _is_overlaybd(manifest):
                lowers, (cached, fetched) = _pull_overlaybd(manifest, puller, lazy)
                counts = (cached, 0, fetched)
                image_format = "overlaybd"
            else:
                lowers, (cached, converted) = _pull_and_convert(
                    manifest, config, puller, blockd, timings)
                counts = (cached, converted, 0)
                image_format = "converted"
        finally:
            puller.cleanup_blobs()

    name = name or manifest.digest.replace(":", "-")
    record = {
        # overlaybd's `digest` names a blob by its bytes; a converted layer is named by the
        # OCI chain ID it was made from instead (its bytes are local, never fetched remotely).
        "lowers": [_lower_record(path, digest) for path, digest in lowers],
        "name": name,
        "reference": str(reference),
        "manifestDigest": manifest.digest,
        "configDigest": manifest.config.digest,
        "platform": str(wanted_platform),
        "format": image_format,
        "virtualSize": VIRTUAL_SIZE if image_format == "converted" else None,
        "config": _run_config(config),
        "pulledAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    final = images_dir / name
    staged = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=images_dir))
    try:
        (staged / "image.json").write_text(json.dumps(record, indent=2) + "\n")
        (staged / "config.json").write_bytes(config_bytes)
        os.chmod(staged, 0o755)
        with cache.lock(f"image-{name}"):  # one writer of images/<name> at a time
            old = None
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=images_dir))
                os.replace(final, old)
            os.replace(staged, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return PulledImage(
        name=name, path=final, reference=str(reference), manifest_digest=manifest.digest,
        lowers=[path for path, _ in lowers], config=dict(config.get("config") or {}),
        format=image_format, layers_cached=counts[0], layers_converted=counts[1],
        layers_fetched=counts[2],
        bytes_downloaded=puller.bytes_downloaded, seconds=time.perf_counter() - started,
        timings=timings,
    )


CONVERT_SPACE_FACTOR = 4  # blob + converted layer, per compressed byte (estimate)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _lower_record(path: Path, digest: str) -> dict[str, Any]:
    kind = path.parent.parent.name
    if kind == REMOTE_KIND:
        ref = load_descriptor(path)
        return {"file": str(path), "size": ref.size, "digest": digest, "remote": True}
    # overlaybd's `digest` names a blob by its bytes; a converted layer is named by the
    # OCI chain ID it was made from instead (its bytes are local, never fetched remotely).
    return {"file": str(path), "size": path.stat().st_size,
            ("chainId" if kind == CONVERTER_KIND else "digest"): digest}


def _pull_overlaybd(manifest: Manifest, puller: _Puller,
                    lazy: bool = True) -> tuple[list[tuple[Path, str]], tuple[int, int]]:
    if lazy:
        return _pull_remote(manifest, puller)
    lowers: list[tuple[Path, str]] = []
    cached = fetched = 0
    need = sum(layer.size for layer in manifest.layers
               if puller.cache.lookup(NATIVE_KIND, layer.digest) is None)
    puller.require_space(need, f"pulling {puller.ref} ({_mib(need)} of layers)")
    for layer in manifest.layers:
        with puller.cache.entry_lock(NATIVE_KIND, layer.digest):
            found = puller.cache.lookup(NATIVE_KIND, layer.digest)
            if found is not None:
                puller.claim(layer)
                cached += 1
                lowers.append((found, layer.digest))
                continue
            path = puller.download_whole(layer)
            fetched += 1
            lowers.append((path, layer.digest))
    return lowers, (cached, fetched)


def _pull_remote(manifest: Manifest,
                 puller: _Puller) -> tuple[list[tuple[Path, str]], tuple[int, int]]:
    """Record each overlaybd blob as a remote layer: a descriptor naming the blob and this
    registry, plus the layer's facts, read from the few byte ranges that hold its metadata
    (wrappers, ZFile jump table, LSMT header, index and trailer). A blob already whole in the
    cache is used as it is."""
    # lazy: keeps `aenv --help` fast (cli/template.py imports this module)
    from agentenv.blockd.remote.layout import MetaReader

    lowers: list[tuple[Path, str]] = []
    cached = fetched = 0
    client, repo = puller.client, puller.ref.repository
    location = BlobLocation(puller.ref.registry, repo, client.host if client.host !=
                            puller.ref.registry else None, client.insecure)
    for layer in manifest.layers:
        whole = puller.cache.lookup(NATIVE_KIND, layer.digest)
        if whole is not None:
            puller.claim(layer)
            cached += 1
            lowers.append((whole, layer.digest))
            continue
        with puller.cache.entry_lock(REMOTE_KIND, layer.digest):
            found = puller.cache.lookup(REMOTE_KIND, layer.digest)
            if found is not None or puller.access.held(layer.digest):
                # blockd's chunk cache may hold its chunks even where no descriptor is left
                proved = puller.claim(layer, whole=True)
                if proved is not None:
                    fetched += 1
                    lowers.append((proved, layer.digest))
                    continue
            if found is not None:
                ref = load_descriptor(found)
                if location not in ref.sources:  # one more place to fetch it from
                    ref.sources.append(location)
                    ref.save(found)
                cached += 1
                lowers.append((found, layer.digest))
                continue

            def fetch(length: int, offset: int, digest: str = layer.digest) -> bytes:
                data: bytes = client.get_blob_range(repo, digest, offset, offset + length)
                puller.bytes_downloaded += len(data)
                return data

            reader = MetaReader(fetch, layer.size)
            label = f"{puller.ref.registry}/{repo}@{layer.digest}"
            opened = load_sealed(Path(label), open_stream(Path(label), reader))
            facts = describe_layer(opened, label)
            facts.pop("path", None)
            with puller.cache.workspace() as work:
                staged = work / "entry"
                staged.mkdir()
                RemoteLayerRef(layer.digest, layer.size, [location], layer.media_type,
                               facts, chunk_sha256=layer.annotations.get(CHUNK_SHA256_ANNOTATION)
                               ).save(staged / LAYER_FILE)
                path = puller.cache.publish(REMOTE_KIND, layer.digest, staged, {
                    "kind": "overlaybd-remote", "sourceDigest": layer.digest,
                    "size": layer.size, "mediaType": layer.media_type,
                    "annotations": layer.annotations, "metadataBytes": reader.fetched,
                })
            puller.fetched(layer)
            fetched += 1
            lowers.append((path, layer.digest))
    return lowers, (cached, fetched)


def _base_layer(cache: LayerCache) -> tuple[Path, str]:
    """The shared empty-ext4 base layer (made on first use) and its digest."""
    with cache.entry_lock(BASE_KIND, BASE_KEY):
        found = cache.lookup(BASE_KIND, BASE_KEY)
        if found is None:
            with cache.workspace() as work:
                staged = work / "entry"
                staged.mkdir()
                make_base_layer(work, staged / LAYER_FILE)
                digest = file_digest(staged / LAYER_FILE)
                found = cache.publish(BASE_KIND, BASE_KEY, staged, {
                    "kind": "ext4-base", "digest": digest, "virtualSize": VIRTUAL_SIZE,
                    "mkfs": list(BASE_MKFS_ARGS)})
        return found, str(cache.meta(BASE_KIND, BASE_KEY)["digest"])


def _pull_and_convert(
    manifest: Manifest, config: dict[str, Any], puller: _Puller, blockd: Path | None,
    timings: dict[str, float],
) -> tuple[list[tuple[Path, str]], tuple[int, int]]:
    layers = list(manifest.layers)
    for layer in layers:
        compression_of(layer.media_type)  # unsupported media types fail before any download
    diff_ids = (config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise UnsupportedImageError(
            f"manifest {manifest.digest}: image config lists {len(diff_ids or [])} diff_ids for "
            f"{len(layers)} layers"
        )
    chains = chain_ids([str(d) for d in diff_ids])
    cache = puller.cache
    base = _base_layer(cache)
    keys = [converted_key(base[1], chain) for chain in chains]
    missing = [i for i, key in enumerate(keys) if cache.lookup(CONVERTER_KIND, key) is None]
    lowers: list[tuple[Path, str]] = [base]
    # Checked before any download: the blobs, plus the converted layers (the uncompressed
    # files in ext4; a gzip layer inflates about 3x).
    download = sum(layers[i].size for i in missing)
    puller.require_space(download * CONVERT_SPACE_FACTOR,
                         f"pulling {puller.ref} ({_mib(download)} to download and convert)")
    if not missing:
        for layer, key, diff_id in zip(layers, keys, diff_ids, strict=True):
            _claim_converted(puller, layer, key, str(diff_id))
        return [base] + [(cache.lookup(CONVERTER_KIND, k), c) for k, c in zip(keys, chains, strict=True)], \
            (len(chains), 0)  # type: ignore[list-item]
    converted = 0
    taps = {i: BlobTap() for i in missing}
    with contextlib.ExitStack() as stack:
        for tap in taps.values():
            stack.callback(tap.close)
        pool = stack.enter_context(_executor(3))
        scratch = stack.enter_context(cache.workspace())
        socket = stack.enter_context(blockd_socket(blockd, scratch))
        bd = stack.enter_context(BlockdClient(socket, timeout=600))
        downloads: dict[int, Future[Path | None]] = {
            i: pool.submit(puller.download, layers[i], CONVERTER_KIND, keys[i], taps[i])
            for i in missing
        }
        convert_seconds = 0.0
        for i, (layer, chain, key) in enumerate(zip(layers, chains, keys, strict=True)):
            with cache.entry_lock(CONVERTER_KIND, key):
                found = cache.lookup(CONVERTER_KIND, key)
                if found is not None:
                    _claim_converted(puller, layer, key, str(diff_ids[i]))
                    lowers.append((found, chain))
                    continue
                future = downloads.get(i)
                source: Path | BlobTap
                if future is not None and not future.done():
                    source = taps[i]  # convert while it downloads; publish only once verified
                else:
                    blob = future.result() if future is not None else None
                    if blob is None or not blob.exists():  # cached, then lost: fetch it now
                        blob = puller.download(layer, None, key) or cache.blob_path(layer.digest)
                    source = blob
                task = puller.reporter.task(f"convert  {_short(layer.digest)}", layer.size)
                t0 = time.perf_counter()
                with cache.workspace() as work:
                    staged = work / "entry"
                    staged.mkdir()
                    try:
                        stats = convert_tar_layer(
                            bd, [p for p, _ in lowers], source, layer.media_type,
                            str(diff_ids[i]), work, staged / LAYER_FILE,
                            label=_short(layer.digest), progress=puller.reporter.advancer(task),
                        )
                    except BaseException:
                        # A failed download explains a failed apply better than the apply does.
                        if isinstance(source, BlobTap) and future is not None:
                            download_error = future.exception()
                            if download_error is not None:
                                raise download_error from None
                        raise
                    if future is not None:
                        future.result()  # the bytes applied are the verified ones
                    puller.access.grant(puller.team, key, puller.repository)  # its own
                    path = cache.publish(CONVERTER_KIND, key, staged, {
                        "kind": "oci-layer", "chainId": chain, "diffId": stats.diff_id,
                        "baseDigest": base[1],
                        "sourceDigest": layer.digest, "mediaType": layer.media_type,
                        "converter": CONVERTER_KIND, "virtualSize": VIRTUAL_SIZE,
                        "parentChainId": chains[i - 1] if i else None,
                        "entries": stats.entries, "bytesWritten": stats.bytes_written,
                        "phases": stats.phases,
                    })
                convert_seconds += time.perf_counter() - t0
                puller.reporter.done(task)
                cache.blob_path(layer.digest).unlink(missing_ok=True)
                converted += 1
                lowers.append((path, chain))
        timings["convert"] = convert_seconds
    return lowers, (len(chains) - converted, converted)

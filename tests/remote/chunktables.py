"""Test images with per-chunk SHA-256 tables (blockd/remote/chunkdigests.py) in their
manifests, as agentenv's own pushes publish them: what lets nodes read their chunks from
peers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import BinaryIO

from agentenv.blockd.remote.chunkdigests import ANNOTATION, TABLE_CHUNK_SIZE, ChunkDigests


def annotate(manifest: bytes, open_blob: Callable[[str], BinaryIO],
             chunk_size: int = TABLE_CHUNK_SIZE) -> bytes:
    """`manifest` with every layer annotated with its chunk table."""
    doc = json.loads(manifest)
    for layer in doc["layers"]:
        with open_blob(layer["digest"]) as f:
            table, digest = ChunkDigests.compute(f.read, layer["size"], chunk_size)
        assert digest == layer["digest"], (digest, layer["digest"])
        layer.setdefault("annotations", {})[ANNOTATION] = table.encode()
    return json.dumps(doc, indent=2).encode()

"""The layer cache: chain IDs, stale scratch space."""

from __future__ import annotations

from pathlib import Path


def test_stale_work_of_a_dead_puller_is_cleaned(tmp_path: Path) -> None:
    import os
    import time

    from agentenv.template.layercache import LayerCache, chain_ids

    cache = LayerCache(tmp_path / "cache")
    with cache.workspace() as live:
        stale = cache.root / "work" / "tmpdead"
        stale.mkdir()
        (stale / ".in-use").touch()
        (stale / "upper").mkdir()
        old = time.time() - 3600
        for p in (stale, live):
            os.utime(p, (old, old))
        partial = cache.root / "blobs" / f"{'a' * 64}.partial.999999999.1"
        partial.touch()
        assert cache.clean_stale_work() == [stale]
        assert live.exists() and not stale.exists() and not partial.exists()
    # OCI chain IDs (image-spec's definition).
    a, b = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    import hashlib
    assert chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]

"""Remote layers in blockd: the node-wide chunk cache, fetching from peers and registries,
and serving verified chunks to peers (docs/remote-layers.md)."""

from __future__ import annotations

from agentenv.storage import blob


def install_private_store() -> None:
    """Let this process (not blockd: the CLI, the node, tests) read remote layers through a
    private chunk store, made at its first remote read (reads fetch on demand, nothing shared
    with the node's cache). Cheap: the store's modules load only then."""

    def private_opener() -> blob.RemoteOpener:
        from agentenv.blockd.remote.store import private_store

        return private_store().open_blob

    blob.set_default_remote_opener(private_opener)

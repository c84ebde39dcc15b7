"""Remote layers in blockd: the node-wide chunk cache, fetching from peers and registries,
and serving verified chunks to peers (docs/remote-layers.md)."""

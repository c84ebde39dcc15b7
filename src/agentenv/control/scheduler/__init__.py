"""The scheduler: placement, the sandbox -> node binding table (Redis), node heartbeats and
discovery (docs/control-plane.md). Importing this package imports nothing else: the node's
heartbeat sender uses client.py alone."""

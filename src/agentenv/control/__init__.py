"""Reserved for a multi-node control plane (gateway and scheduler); not built yet."""

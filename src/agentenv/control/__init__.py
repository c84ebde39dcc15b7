"""Multi-node control plane: gateway and scheduler."""

"""The multi-node control plane: the scheduler (scheduler/) and the gateway, each a room of its
own; proto/ holds the gRPC contract and its generated code (docs/control-plane.md)."""

"""The multi-node control plane: the scheduler (scheduler/) and the gateway, each a room of its
own; the scheduler's gRPC contract and client are agentenv.scheduling (docs/control-plane.md)."""

# grpc's fork support off before anything of the control plane imports grpc (the reason is in
# agentenv/scheduling/__init__.py).
import agentenv.scheduling  # noqa: F401

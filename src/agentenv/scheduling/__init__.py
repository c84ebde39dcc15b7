"""The scheduler's contract: its gRPC messages (proto/) and the client that nodes and gateways
call it with (client.py). Below both the node and the control plane, so a node reaches the
scheduler without importing the control plane (docs/control-plane.md)."""

import os

# grpcio (>= 1.80, fork support on in its wheels) runs its fork handlers in a child forked while
# a channel is busy, and the child can abort before exec ("epoll_wait error: Bad file
# descriptor", grpc/grpc#43055; 49 of 300 `subprocess.run` children here). Every importer of
# the scheduler's contract (a node with its heartbeat channel, the gateway, the scheduler,
# tests) starts subprocesses, QEMU among them, and no child uses gRPC. Set before grpc is
# imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

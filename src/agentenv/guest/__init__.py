"""Everything that runs inside a sandbox VM. Nothing here imports host-side modules."""

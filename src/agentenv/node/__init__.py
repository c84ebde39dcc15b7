"""Node server: E2B-compatible API, envd proxy, orchestrator, SQLite persistence.

Modules, outside in:

- `server`: builds the parts and runs uvicorn (`aenv serve`, `python -m agentenv.node`).
- `api`: `NodeApp`, the ASGI entry: control-plane routes (docs/e2b-api.md §1) and, for
  requests carrying `E2b-Sandbox-Id` or a `{port}-{id}.{domain}` Host, the `proxy`.
- `proxy`: streams HTTP (and WebSocket) traffic to a sandbox port without buffering.
- `orchestrator`: the state machine (creating, running, pausing, paused, resuming,
  snapshotting, forking, branching, rolling-back, killing), the reaper, restarts and adoption.
- `store`: SQLite records (sandboxes, templates/snapshots, names, layer references).
- `backend`: the port a sandbox runtime implements (`SandboxBackend`); `process_backend` is the
  VM-less implementation (envd processes on this host), the VM runtime is the other one.
- `models`, `records`, `security`, `errors`, `metrics`, `host_template`: wire shapes, records,
  ids and tokens, API errors, Prometheus metrics, the process backend's base root filesystem.
"""

"""Node server: E2B-compatible API, orchestrator, persistence."""

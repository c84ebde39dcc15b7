"""envd: the in-guest agent that speaks the E2B envd protocol (Connect RPC + plain HTTP).

This package runs inside the VM from the tools disk, so it imports nothing from the host side of
agentenv: only `agentenv.guest.envd.*`, the standard library and the pure-Python packages listed in
requirements.txt.
"""

from __future__ import annotations

ENVD_VERSION = "0.6.4"
"""The envd version this agent implements, as the E2B SDKs gate features on it (docs/e2b-api.md §3.6):
default user handled here, stdin control, close_stdin, octet-stream and gzip uploads, file
metadata (xattrs), watch events with entries and the network-mount flag."""

DEFAULT_PORT = 49983

ACCESS_TOKEN_DIGEST_FILE = "/run/aenv/envd-token.sha256"
"""Where /init leaves the SHA-256 (hex) of the access token, for the code-interpreter server
(agentenv.guest.codeint, port 49999), which takes the same token: world-readable, on the guest's
/run tmpfs, so it never outlives the boot or the memory snapshot that holds the token. No file:
no token (a sandbox created with secure=False)."""

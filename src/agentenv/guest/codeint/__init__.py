"""The code-interpreter server: E2B's code-interpreter protocol on port 49999 in the guest of the
`code-interpreter-v1` template, over Jupyter kernels.

It runs inside the VM on the user image's own python3 (which has Debian's jupyter-client and
ipykernel), from the tools disk (/agentenv/python), with envd's HTTP server and h11 from there.
So it imports nothing from the host side of agentenv: only this package, `agentenv.guest.envd`'s
HTTP server, the standard library and jupyter_client.
"""

from __future__ import annotations

DEFAULT_PORT = 49999

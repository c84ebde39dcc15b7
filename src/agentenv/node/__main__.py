"""`python -m agentenv.node [--state-dir DIR] [--host H] [--port P]`: the same as `aenv serve`."""

from __future__ import annotations

from agentenv.cli.node import serve_command

if __name__ == "__main__":
    serve_command(prog_name="python -m agentenv.node")

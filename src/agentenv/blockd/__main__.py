"""`python -m agentenv.blockd ARGS`: the daemon, as `aenv blockd ARGS`, without the rest of the
CLI above it (blockd/launch.py starts blockd so)."""

from __future__ import annotations

import sys

from agentenv.blockd.command import blockd_command
from agentenv.blockd.remote import install_private_store
from agentenv.errors import AgentEnvError


def main() -> None:
    install_private_store()  # as `aenv` does: remote layers read before the daemon's own store
    try:
        blockd_command.main(prog_name="aenv blockd")
    except (AgentEnvError, OSError) as exc:
        # As `aenv` reports them (cli/main.py): one line, no traceback.
        print(f"aenv: error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

"""`python3 -m agentenv.guest.envd [--port 49983] [--root DIR]`: the in-guest envd."""

from __future__ import annotations

import argparse
import asyncio

from agentenv.guest.envd import DEFAULT_PORT, ENVD_VERSION
from agentenv.guest.envd.log import setup
from agentenv.guest.envd.server import config_from_environment, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="envd", description="E2B-compatible envd agent")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--root", default="/", help="the directory serving as the guest's root")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-system-changes",
        action="store_true",
        help="ignore the clock and hostname sent to /init (always ignored unless --root is /)",
    )
    parser.add_argument("--version", action="version", version=ENVD_VERSION)
    args = parser.parse_args(argv)
    setup(args.log_level)
    config = config_from_environment(args.root, system_changes=not args.no_system_changes)
    asyncio.run(serve(config, args.host, args.port))


if __name__ == "__main__":
    main()

"""`python3 -m agentenv.guest.envd [--port 49983] [--root DIR]`: the in-guest envd."""

from __future__ import annotations

import sys

# envd serves plain HTTP only. Without this, importing asyncio loads OpenSSL: 6 MB of RSS in
# every VM for nothing.
sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]

import argparse  # noqa: E402
import asyncio  # noqa: E402

from agentenv.guest.envd import DEFAULT_PORT, ENVD_VERSION  # noqa: E402
from agentenv.guest.envd.log import setup  # noqa: E402
from agentenv.guest.envd.server import config_from_environment, serve  # noqa: E402


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
    try:
        asyncio.run(serve(config, args.host, args.port))
    except OSError as exc:
        sys.exit(f"envd: cannot serve {args.root!r} on {args.host}:{args.port}: {exc.strerror or exc}")


if __name__ == "__main__":
    main()

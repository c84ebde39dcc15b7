"""python3 -m agentenv.guest.codeint [--port N] [--cwd DIR]: the code-interpreter server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

# envd's pinned pure-Python dependencies (h11) on the tools disk; appended, so that the image's
# own packages win for everything else.
TOOLS_SITE = "/agentenv/site-packages"
if os.path.isdir(TOOLS_SITE) and TOOLS_SITE not in sys.path:
    sys.path.append(TOOLS_SITE)

from agentenv.guest.codeint import DEFAULT_PORT  # noqa: E402
from agentenv.guest.codeint.app import CodeApp  # noqa: E402
from agentenv.guest.envd.httpserver import HttpServer  # noqa: E402


async def serve(port: int, cwd: str) -> None:
    app = CodeApp(default_cwd=cwd, prepare_java=True)
    # The default Python context is started before the port opens: /health answering means
    # the first run_code pays no kernel start (the template snapshot is taken after it).
    await app.start()
    listener = socket.create_server(("0.0.0.0", port), reuse_port=False, backlog=128)
    server = HttpServer(app)
    await server.start(listener)
    logging.getLogger("codeint").info("serving on port %d", port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
        await app.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="agentenv.guest.codeint")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--cwd", default=os.path.expanduser("~"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="codeint: %(levelname)s %(message)s")
    asyncio.run(serve(args.port, args.cwd))


if __name__ == "__main__":
    main()

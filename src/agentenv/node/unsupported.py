"""E2B routes the SDK can call that this node does not serve: each answers 501 naming what is
not supported and why, never a fake success (tests/node/test_sdk_routes.py walks the SDK's
generated client and checks every route is served or here)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentenv.node.api import error

VOLUMES = ("volumes (persistent storage shared between sandboxes) are not supported on this "
           "node yet: keep data in a sandbox and pause it, or snapshot it")
SECRETS = ("secrets (E2B's header injection into a sandbox's egress requests) are not "
           "supported: this node does not rewrite egress requests; pass values as envVars")
DEFAULT_TEMPLATES = ("default templates are not supported: this node has no public template "
                     "gallery; GET /templates lists the ones you can use")
TEMPLATE_PATCH = ("updating a template (its public flag) is not supported: templates are "
                  "private to their team on this node")


def _answer(message: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return error(501, message)

    return endpoint


def routes() -> list[Route]:
    table = [
        ("/volumes", ["GET", "POST"], VOLUMES),
        ("/volumes/{volume_id}", ["GET", "DELETE"], VOLUMES),
        ("/secrets", ["GET", "POST"], SECRETS),
        ("/secrets/{secret_id}", ["GET", "POST", "DELETE"], SECRETS),
        ("/default-templates", ["GET"], DEFAULT_TEMPLATES),
        ("/templates/{template_id}", ["PATCH"], TEMPLATE_PATCH),
        ("/v2/templates/{template_id}", ["PATCH"], TEMPLATE_PATCH),
    ]
    return [Route(path, _answer(message), methods=methods) for path, methods, message in table]

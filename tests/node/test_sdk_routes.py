"""Every route the official Python SDK's generated client can call (its
`e2b/api/client/api/` modules) is served by the node, or answers 501 saying what is not
supported; and the SDK's get_metrics returns real numbers."""

from __future__ import annotations

import re
from pathlib import Path

import e2b
import httpx
from e2b import Sandbox

from tests.node.conftest import NodeProcess

CLIENT_API = Path(e2b.__file__).parent / "api" / "client" / "api"
#: what this node answers 501 to, on purpose (the message says why)
UNSUPPORTED = ("/secrets", "/default-templates", "/templates/x", "/v2/templates/x")


def sdk_routes() -> list[tuple[str, str]]:
    """(method, path with `x` for each parameter) of every generated operation."""
    found = []
    for module in sorted(CLIENT_API.rglob("*.py")):
        text = module.read_text()
        method = re.search(r'"method": "(\w+)"', text)
        url = re.search(r'"url": f?"([^"]+)"', text)
        if method and url:
            found.append((method.group(1).upper(), re.sub(r"\{[^}]+\}", "x", url.group(1))))
    return found


def test_the_sdk_client_has_the_routes_we_expect() -> None:
    routes = sdk_routes()
    assert len(routes) >= 49, routes
    assert ("GET", "/v2/sandboxes/x/logs") in routes and ("GET", "/sandboxes/metrics") in routes


def test_every_sdk_route_is_served_or_says_it_is_not(node: NodeProcess) -> None:
    with node.client() as api:
        check_every_sdk_route(api)


def check_every_sdk_route(api: httpx.Client) -> None:
    """Each route of the SDK's client is served, or answers 501 naming it unsupported: never
    "route not found", 405 or another 5xx (a node's or a gateway's `api`)."""
    missing, unsupported = [], []
    for method, path in sdk_routes():
        answer = api.request(method, path, json={} if method in ("POST", "PATCH", "PUT")
                             else None)
        body = answer.json() if answer.content else {}
        if answer.status_code == 501:
            assert path.startswith(UNSUPPORTED), (method, path, body)
            assert "not supported" in body["message"] and body["code"] == 501, body
            unsupported.append((method, path))
        elif answer.status_code == 405 or (answer.status_code == 404 and str(
                body.get("message", "")).startswith("route not found")):
            missing.append((method, path, answer.status_code))
        assert answer.status_code < 500 or answer.status_code == 501, (method, path, body)
    assert missing == [], "\n".join(map(str, missing))
    # 5 secret routes, default templates, PATCH of a template (v1, v2)
    assert len(unsupported) == 8, unsupported


def test_sdk_get_metrics_returns_real_numbers(sdk_env: NodeProcess) -> None:
    sbx = Sandbox.create(template="base", timeout=120)
    try:
        (metric, *_) = sbx.get_metrics()
        assert metric.cpu_count >= 1 and metric.mem_total > 0 and metric.mem_used > 0
        assert metric.disk_total > 0 and metric.timestamp is not None
    finally:
        sbx.kill()

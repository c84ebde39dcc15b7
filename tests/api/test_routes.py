"""The route table of agentenv.api is the one both servers serve: every operation has its
handler on the node and on the gateway (or is node-only, or answered 501 by both), in the
table's order; and the OpenAPI document is generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.routing import Route

from agentenv.api.openapi import openapi_document
from agentenv.api.routes import ROUTES, Auth
from agentenv.api.serve import bind, openapi_path, path_pattern, starlette_path
from agentenv.control.gateway.app import GatewayApp
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.node.server import ServeOptions, build_app
from agentenv.scheduling.client import Credentials
from tests.control.helpers import SECRET


def test_operations_are_named_once() -> None:
    ids = [op.operation_id for op in ROUTES]
    assert len(ids) == len(set(ids))
    pairs = [(op.method, openapi_path(op.path)) for op in ROUTES]
    assert len(pairs) == len(set(pairs))


def test_the_node_serves_every_operation_in_the_tables_order(tmp_path: Path) -> None:
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process"))
    assert app.unserved == []
    served = [(r.path, sorted(r.methods or ())) for r in app.api.routes if isinstance(r, Route)]
    expected = [(starlette_path(op.path), sorted({op.method.upper(), "HEAD"} if op.method ==
                                                 "get" else {op.method.upper()}))
                for op in ROUTES]
    assert served == expected


def test_the_gateway_serves_every_operation_but_the_nodes_own() -> None:
    app = GatewayApp(SchedulerLink("127.0.0.1:9", Credentials.gateway(SECRET)),
                     GatewayStore("redis://127.0.0.1:9/0"), SECRET)
    assert app.dispatch.unserved == []
    routed = [op.operation_id for op, _, _ in app.dispatch.routes]
    assert routed == [op.operation_id for op in ROUTES if not op.node_only]
    # the node-only ones are a node's cluster-internal routes and its local `aenv` routes
    assert {op.auth for op in ROUTES if op.node_only} <= {Auth.NODE, Auth.API_KEY}


@pytest.mark.parametrize(("path", "sample", "groups"), [
    ("/sandboxes/{sandboxID}/logs", "/sandboxes/abc/logs", ("abc",)),
    ("/templates/{templateID:path}", "/templates/team/name:tag", ("team/name:tag",)),
    ("/snapshots/{snapshotID:path}/fork", "/snapshots/a/b/fork", ("a/b",)),
    ("/volumecontent/{volumeID}/file", "/volumecontent/v1/file", ("v1",)),
])
def test_table_paths_as_each_server_routes_them(path: str, sample: str,
                                                groups: tuple[str, ...]) -> None:
    match = path_pattern(path).fullmatch(sample)
    assert match is not None and match.groups() == groups
    assert path_pattern(path).fullmatch(sample + "/more") is None or ":path" in path
    assert "ID" not in starlette_path(path) and "{" in starlette_path(path)


def test_the_document_describes_the_documented_operations() -> None:
    doc = openapi_document()
    documented = {(op.method, openapi_path(op.path)) for op in ROUTES if op.documented}
    described = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert described == documented
    assert all(":path" not in p for p in doc["paths"])
    # who may call: the table's auth kinds
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["paths"]["/volumecontent/{volumeID}/file"]["get"]["security"] == [
        {"VolumeToken": []}]


def test_a_handler_for_no_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="no operation"):
        bind({"noSuchOperation": object()}, node=True)

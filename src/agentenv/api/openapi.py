"""The OpenAPI 3.1 document of the E2B contract, served at `GET /openapi.json` by the node
and the gateway: generated from the route table (api/routes.py).

Every schema is generated from the pydantic models (`models.py`, `template_models.py`, ...):
request bodies from those the API validates with, responses from the `Response` models the
bodies are built through, so the document and the code cannot drift apart.
tests/node/test_openapi.py checks every answer of a live node against the document, and
tests/control/test_gateway_openapi.py a gateway's (schemathesis). Sandbox traffic (envd behind
the proxy) is not described: it is the envd protocol (docs/e2b-api.md §3), not REST.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, JsonSchemaValue, models_json_schema

from agentenv import __version__
from agentenv.api.routes import ROUTES, Auth, Body, One, Operation
from agentenv.api.serve import openapi_path, path_params

REF = "#/components/schemas/{model}"
_STR = {"type": "string"}
#: (model, "validation" for a request or "serialization" for a response) -> its $ref
Refs = dict[tuple[Any, JsonSchemaMode], JsonSchemaValue]
DOCUMENTED = [op for op in ROUTES if op.documented]


def _one_schema(body: One, refs: Refs) -> dict[str, Any]:
    return ({"type": "array", "items": refs[(body[0], "serialization")]}
            if isinstance(body, list) else refs[(body, "serialization")])


def _models(body: Body) -> list[type[BaseModel]]:
    """The models a response body is made of."""
    ones = body if isinstance(body, tuple) else () if body is None else (body,)
    return [one[0] if isinstance(one, list) else one for one in ones]


def _response(status: int, body: Body, headers: list[str], refs: Refs) -> dict[str, Any]:
    out: dict[str, Any] = {"description": str(status)}
    if body is not None:
        schema = ({"oneOf": [_one_schema(one, refs) for one in body]}
                  if isinstance(body, tuple) else _one_schema(body, refs))
        out["content"] = {"application/json": {"schema": schema}}
    if headers:
        out["headers"] = {h: {"schema": _STR} for h in headers}
    return out


def _operation(op: Operation, refs: Refs) -> dict[str, Any]:
    params = list(op.query)
    for name in path_params(op.path):
        params.append(
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": {"type": "string", "minLength": 1},
            }
        )
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "responses": {
            str(status): _response(status, body, op.headers.get(status, []), refs)
            for status, body in sorted(op.responses.items())
        },
    }
    if params:
        out["parameters"] = params
    if op.auth in (Auth.PUBLIC, Auth.SIGNED):
        out["security"] = []
    if op.auth == Auth.VOLUME_TOKEN:
        out["security"] = [{"VolumeToken": []}]
    if op.raw_answer is not None:
        out["responses"]["200"]["content"] = {
            op.raw_answer: {"schema": {"type": "string", "format": "binary"}}}
    if op.raw_body is not None:
        out["requestBody"] = {
            "required": True,
            "content": {op.raw_body: {"schema": {"type": "string", "format": "binary"}}},
        }
    if op.body is not None:
        out["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
        }
    return out


def _schemas() -> tuple[Refs, dict[str, Any]]:
    """Every model the routes name, with the models they nest, as components/schemas (one
    pydantic run, so that a nested model is one schema however many bodies use it)."""
    used: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}  # ordered set
    for op in DOCUMENTED:
        if op.body is not None:
            used[(op.body, "validation")] = None
        for body in op.responses.values():
            for model in _models(body):
                used[(model, "serialization")] = None
    refs, top = models_json_schema(list(used), ref_template=REF)
    return dict(refs), dict(top.get("$defs", {}))


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    refs, schemas = _schemas()
    paths: dict[str, dict[str, Any]] = {}
    for op in DOCUMENTED:
        paths.setdefault(openapi_path(op.path), {})[op.method] = _operation(op, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentenv node API (E2B-compatible control plane)",
            "version": __version__,
            "description": (
                "Every non-2xx answer is JSON {code, message} with code equal to the HTTP status. "
                "Sandbox traffic (requests with an E2b-Sandbox-Id header) goes to envd instead."
            ),
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-KEY"},
                "VolumeToken": {"type": "http", "scheme": "bearer"},
            },
            "schemas": schemas,
        },
    }

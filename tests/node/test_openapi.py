"""The node's OpenAPI document against the live node, with schemathesis.

Every operation in `GET /openapi.json` gets a bounded number of generated requests (valid and
invalid ones) with the API key. Checked on every answer: no 5xx; every non-2xx has the JSON body
`{code, message}` with `code` equal to the status (spec/e2b-compat.md 1.2); the status is one the
document declares and the body matches the declared schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from agentenv.node.openapi import openapi_document
from tests.node.conftest import NodeProcess

EXAMPLES_PER_OPERATION = 10


@pytest.fixture(scope="module")
def openapi_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node of its own: the fuzzer creates sandboxes other tests must not see."""
    base = tmp_path_factory.mktemp("openapi-node")
    node = NodeProcess(base / "state", base / "node.log")
    node.start()
    yield node
    node.cleanup()


# Loaded from the module the node serves; test_openapi_document_is_served checks they are equal.
schema = schemathesis.openapi.from_dict(openapi_document())


def _error_body_matches_status(response: schemathesis.Response) -> None:
    if response.status_code < 300:
        return
    try:
        body = response.json()
    except ValueError as exc:
        raise AssertionError(
            f"{response.status_code} answer is not JSON: {response.content[:200]!r}"
        ) from exc
    assert isinstance(body, dict), f"{response.status_code} error body is not an object: {body!r}"
    assert body.get("code") == response.status_code, f"code != status: {body!r}"
    assert isinstance(body.get("message"), str) and body["message"], f"no message: {body!r}"


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_openapi_document(
    case: schemathesis.Case, openapi_node: NodeProcess
) -> None:
    response = case.call(base_url=openapi_node.url, headers={"X-API-KEY": openapi_node.api_key})
    assert response.status_code < 500, (
        f"server error {response.status_code} for {case.method} {case.formatted_path}: "
        f"{response.text[:500]}\nrepro: {case.as_curl_command()}"
    )
    _error_body_matches_status(response)
    case.validate_response(
        response,
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
    )


def test_openapi_document_is_served_and_covers_the_sdk_routes(openapi_node: NodeProcess) -> None:
    answer = httpx.get(openapi_node.url + "/openapi.json", timeout=10, trust_env=False)
    assert answer.status_code == 200
    doc = answer.json()
    assert doc == openapi_document()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for method, path in [
        ("post", "/v2/sandboxes"),
        ("post", "/sandboxes"),
        ("get", "/v2/sandboxes"),
        ("get", "/sandboxes/{sandboxID}"),
        ("delete", "/sandboxes/{sandboxID}"),
        ("post", "/sandboxes/{sandboxID}/timeout"),
        ("post", "/sandboxes/{sandboxID}/pause"),
        ("post", "/v2/sandboxes/{sandboxID}/connect"),
        ("get", "/sandboxes/{sandboxID}/metrics"),
        ("post", "/sandboxes/{sandboxID}/fork"),
    ]:
        assert method in paths.get(path, {}), f"{method.upper()} {path} missing"
    assert doc["components"]["securitySchemes"]["ApiKeyAuth"]["name"] == "X-API-KEY"


def test_node_log_has_no_unexpected_errors(openapi_node: NodeProcess) -> None:
    # Runs after the fuzzing (file order): the 500 handler logs "unexpected error".
    log = Path(openapi_node.log_path).read_text(errors="replace")
    assert "unexpected error" not in log, log[-3000:]

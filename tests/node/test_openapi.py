"""The node's OpenAPI document against the live node, with schemathesis.

Every operation in `GET /openapi.json` gets a bounded number of generated requests (valid and
invalid ones) with the API key. Checked on every answer: no 5xx; every non-2xx has the JSON body
`{code, message}` with `code` equal to the status (docs/e2b-api.md §1.2); the status is one the
document declares and the body matches the declared schema.
"""

from __future__ import annotations

import os
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

from agentenv.api.openapi import openapi_document
from tests.node.conftest import NodeProcess

# AENV_OPENAPI_EXAMPLES raises the budget for a deeper run than CI's.
EXAMPLES_PER_OPERATION = int(os.environ.get("AENV_OPENAPI_EXAMPLES", "8"))
EXAMPLES_PER_CREATE = int(os.environ.get("AENV_OPENAPI_CREATE_EXAMPLES", "6"))


@pytest.fixture(scope="module")
def openapi_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node of its own: the fuzzer creates sandboxes other tests must not see."""
    base = tmp_path_factory.mktemp("openapi-node")
    node = NodeProcess(base / "state", base / "node.log")
    node.start()
    yield node
    node.cleanup()


class LiveSandbox:
    """A sandbox for the fuzzer to aim at, so per-sandbox routes answer 2xx too, not only 404.
    The fuzzer may kill it (DELETE) or pause it; a new one is made when it is gone."""

    def __init__(self, node: NodeProcess) -> None:
        self.node = node
        self.sandbox_id: str | None = None
        self.uses = 0

    def current(self) -> str:
        with self.node.client() as api:
            if self.sandbox_id and api.get(f"/sandboxes/{self.sandbox_id}").status_code == 200:
                return self.sandbox_id
            created = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            assert created.status_code == 201, created.text
            self.sandbox_id = created.json()["sandboxID"]
            return self.sandbox_id


@pytest.fixture(scope="module")
def live_sandbox(openapi_node: NodeProcess) -> LiveSandbox:
    return LiveSandbox(openapi_node)


class LiveVolume:
    """A volume for the fuzzer to aim at, with its content token: the content API answers
    2xx too (and takes made-up paths, owners and bodies), not only 401."""

    def __init__(self, node: NodeProcess) -> None:
        self.node = node
        self.volume: dict[str, str] | None = None
        self.uses = 0

    def current(self) -> dict[str, str]:
        with self.node.client() as api:
            if self.volume and api.get(f"/volumes/{self.volume['volumeID']}").status_code == 200:
                return self.volume
            created = api.post("/volumes", json={"name": f"fuzz-{self.uses}"})
            assert created.status_code == 201, created.text
            self.volume = created.json()
            return self.volume


@pytest.fixture(scope="module")
def live_volume(openapi_node: NodeProcess) -> LiveVolume:
    return LiveVolume(openapi_node)


# Loaded from the module the node serves; test_openapi_document_is_served checks they are equal.
schema = schemathesis.openapi.from_dict(openapi_document())
# Each create starts a sandbox (a copied root and an envd process): fewer examples for those.
CREATE_OPERATIONS = ["createSandboxV2", "createSandbox"]
# A webhook the fuzzer registered would be posted to at the next lifecycle event: to a made-up
# host, outside loopback. tests/node/test_events.py covers these two routes.
WEBHOOK_WRITES = ["createWebhook", "updateWebhook"]
# operationId -> statuses seen, for the coverage check at the end of the module.
SEEN: dict[str, set[int]] = {}


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


def _check(case: schemathesis.Case, node: NodeProcess, live: LiveSandbox | None = None,
           volume: LiveVolume | None = None) -> None:
    params = case.path_parameters or {}
    headers = {"X-API-KEY": node.api_key}
    if live is not None and "sandboxID" in params:
        live.uses += 1
        if live.uses % 2:  # every other example aims at a real sandbox
            params["sandboxID"] = live.current()
    if volume is not None and "volumeID" in params:
        volume.uses += 1
        if volume.uses % 2:  # every other example aims at a real volume, with its token
            real = volume.current()
            params["volumeID"] = real["volumeID"]
            headers["Authorization"] = f"Bearer {real['token']}"
    response = case.call(base_url=node.url, headers=headers)
    if response.status_code == 501 and "not supported" in response.json()["message"]:
        return  # a route the SDK knows and the node refuses on purpose (api/routes.py, `unsupported`)
    assert response.status_code < 500, (
        f"server error {response.status_code} for {case.method} {case.formatted_path}: "
        f"{response.text[:500]}\nrepro: {case.as_curl_command()}"
    )
    SEEN.setdefault(case.operation.definition.raw["operationId"], set()).add(response.status_code)
    _error_body_matches_status(response)
    case.validate_response(
        response,
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
    )


def _bounded(examples: int, explicit: bool = True) -> settings:
    """`explicit` adds schemathesis' coverage examples (boundary and invalid values of every
    field), dozens per operation beyond `examples`."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate] if explicit else [Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


@schema.exclude(operation_id=CREATE_OPERATIONS + WEBHOOK_WRITES).parametrize()
@_bounded(EXAMPLES_PER_OPERATION)
def test_api_conforms_to_its_openapi_document(
    case: schemathesis.Case, openapi_node: NodeProcess, live_sandbox: LiveSandbox,
    live_volume: LiveVolume
) -> None:
    _check(case, openapi_node, live_sandbox, live_volume)


@schema.include(operation_id=CREATE_OPERATIONS).parametrize()
@_bounded(EXAMPLES_PER_CREATE, explicit=False)
def test_create_conforms_to_its_openapi_document(
    case: schemathesis.Case, openapi_node: NodeProcess
) -> None:
    _check(case, openapi_node)


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
        # the template build API (SDK Template.build / Template.exists)
        ("post", "/v3/templates"),
        ("get", "/templates/{templateID}/files/{hash}"),
        ("post", "/v2/templates/{templateID}/builds/{buildID}"),
        ("get", "/templates/{templateID}/builds/{buildID}/status"),
        ("get", "/templates/aliases/{alias}"),
        ("get", "/templates/{templateID}/tags"),
        ("post", "/templates/tags"),
        ("delete", "/templates/tags"),
        ("get", "/templates"),
        ("get", "/v2/templates"),
        ("get", "/templates/{templateID}"),
        ("delete", "/templates/{templateID}"),
        # the volume API (SDK Volume) and its content API
        ("get", "/volumes"),
        ("post", "/volumes"),
        ("get", "/volumes/{volumeID}"),
        ("delete", "/volumes/{volumeID}"),
        ("get", "/volumecontent/{volumeID}/path"),
        ("put", "/volumecontent/{volumeID}/file"),
    ]:
        assert method in paths.get(path, {}), f"{method.upper()} {path} missing"
    assert doc["components"]["securitySchemes"]["ApiKeyAuth"]["name"] == "X-API-KEY"


def test_fuzzing_reached_success_answers() -> None:
    """The fuzz above (same module, runs first) got 2xx answers on the per-sandbox routes, not
    only 404s for made-up ids, so their success bodies were checked against the schemas."""
    print({op: sorted(codes) for op, codes in sorted(SEEN.items())})
    succeeded = {op for op, codes in SEEN.items() if any(c < 300 for c in codes)}
    for op in ("getSandbox", "killSandbox", "pauseSandbox", "connectSandboxV2", "listSandboxesV2",
               "getVolume", "listVolumeDir", "makeVolumeDir", "statVolumePath"):
        assert op in succeeded, f"{op} never answered 2xx: {SEEN.get(op)}"


def test_node_log_has_no_unexpected_errors(openapi_node: NodeProcess) -> None:
    # Runs after the fuzzing (file order): the 500 handler logs "unexpected error".
    log = Path(openapi_node.log_path).read_text(errors="replace")
    assert "unexpected error" not in log, log[-3000:]

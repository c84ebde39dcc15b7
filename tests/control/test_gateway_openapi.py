"""schemathesis against the gateway's OpenAPI document (the node's, served by the gateway) on a
one-node cluster of its own: generated requests, valid and invalid, with a team's key; no
answer may be a 5xx, and every error is the JSON `{code, message}` with code = status."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from agentenv.api.openapi import openapi_document
from tests.control.cluster import LocalCluster

EXAMPLES = int(os.environ.get("AENV_GATEWAY_OPENAPI_EXAMPLES", "5"))
CREATE_OPERATIONS = ["createSandboxV2", "createSandbox"]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # every create is killed again (_check), and the node offers plenty of vCPUs, so the fuzzer
    # never meets a full cluster (503 there is the right answer, but not this test's subject)
    made = LocalCluster(tmp_path_factory.mktemp("fuzz-cluster"), nodes=1,
                        node_env={"AENV_NODE_VCPUS": "4096", "AENV_MEMORY_BUDGET_MB": "1000000",
                                  "AENV_MEMORY_RESERVE_MB": "0"})
    try:
        made.start()
        made.team("fuzz")
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="module")
def live_id(fuzzed: LocalCluster) -> str:
    created = httpx.post(f"{fuzzed.url}/v2/sandboxes", json={"templateID": "base",
                                                             "timeout": 600},
                         headers={"X-API-KEY": fuzzed.keys["fuzz"]}, timeout=60)
    assert created.status_code == 201, created.text
    return str(created.json()["sandboxID"])


schema = schemathesis.openapi.from_dict(openapi_document())
USES = [0]


def _check(case: schemathesis.Case, cluster: LocalCluster, live: str | None) -> None:
    params = case.path_parameters or {}
    if live is not None and "sandboxID" in params:
        USES[0] += 1
        if USES[0] % 2:
            params["sandboxID"] = live
    key = {"X-API-KEY": cluster.keys["fuzz"]}
    response = case.call(base_url=cluster.url, headers=key, timeout=120)
    if response.status_code == 201 and case.method == "POST" and case.path.endswith("sandboxes"):
        killed = httpx.delete(f"{cluster.url}/sandboxes/{response.json()['sandboxID']}",
                              headers=key, timeout=60)
        # 404: a create with a timeout of a second or so may be gone already
        assert killed.status_code in (204, 404), killed.text
    if response.status_code == 501 and "not supported" in response.json()["message"]:
        return  # a route the SDK knows and nothing serves, on purpose (api/routes.py)
    assert response.status_code < 500, (
        f"server error {response.status_code} for {case.method} {case.formatted_path}: "
        f"{response.text[:500]}\nrepro: {case.as_curl_command()}"
    )
    if response.status_code >= 300:
        body = response.json()
        assert body.get("code") == response.status_code, body
        assert body.get("message"), body


def _bounded(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


@schema.exclude(operation_id=CREATE_OPERATIONS).parametrize()
@_bounded(EXAMPLES)
def test_gateway_gives_no_5xx(case: schemathesis.Case, fuzzed: LocalCluster,
                              live_id: str) -> None:
    _check(case, fuzzed, live_id)


@schema.include(operation_id=CREATE_OPERATIONS).parametrize()
@_bounded(3)
def test_gateway_create_gives_no_5xx(case: schemathesis.Case, fuzzed: LocalCluster) -> None:
    _check(case, fuzzed, None)


def test_gateway_log_has_no_unexpected_errors(fuzzed: LocalCluster) -> None:
    log = (fuzzed.root / "gateway.log").read_text()
    assert "unexpected error" not in log and "Exception in ASGI" not in log, log[-3000:]

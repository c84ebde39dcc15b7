"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import agentenv.control  # noqa: F401  (first: it turns grpc's fork handlers off, see there)
from agentenv.blockd.remote import install_private_store

# In-process tests read remote layers as the CLI and the node do (a private chunk store).
install_private_store()

# The test registries run on loopback, which a registry client refuses unless the operator
# allows it (registry/client.py): allowed by name, as an operator would. Nodes the tests
# start inherit it. The hostile-registry tests narrow it to the one registry they serve.
os.environ.setdefault("AENV_REGISTRY_ALLOW_PRIVATE", "127.0.0.1,localhost,::1")

# The suite's host is shared and its CPU often saturated (TCG guests, other runs: PSI cpu some
# avg10 at 97% was measured while the suite ran on a 2-core machine), so the node's CPU pressure
# floor would refuse creates by what the neighbours do. Off for every node the tests start, in
# process or not; the floor's own tests set it (tests/node/test_admission.py).
os.environ.setdefault("AENV_CPU_PRESSURE_MAX", "0")

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
#: Test data kept in the repository: an OCI image layout of hello-world (docker and OCI manifests,
#: an index, an arm64 variant and an overlaybd-converted `amd64-converted`); see
#: docs/overlaybd.md §11 and docs/templates.md §1.
FIXTURES = TESTS / "fixtures"
HELLO_WORLD = FIXTURES / "oci" / "hello-world"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The folder that holds `fixtures/` (the name predates the fixtures' move into tests/)."""
    if not (HELLO_WORLD / "index.json").is_file():
        pytest.fail(f"{HELLO_WORLD} is missing or incomplete: the test fixtures are part of the "
                    "repository (tests/fixtures)")
    return TESTS

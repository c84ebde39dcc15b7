"""Shared test fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
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


def _slot_routes() -> set[str]:
    """Routes inside the slots' range (10.12/16) in this network namespace, every table."""
    if shutil.which("ip") is None:
        return set()
    out = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all", "to", "root",
                          "10.12.0.0/16"], capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


_LEFT_ROUTES: list[str] = []
_MODULE_ROUTES: dict[str, set[str]] = {}  # the routes before each test module's first test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test (with its module's fixtures, torn down when the module ends) that leaves slot
    routes in the host's namespace is named at the end of the run: another runtime's leftover
    /31 takes the addresses a later slot gets (the network lab's slots 2 and 3 once lost their
    replies so on CI, cause not seen)."""
    module = item.nodeid.split("::")[0]
    if module not in _MODULE_ROUTES:
        _MODULE_ROUTES[module] = _slot_routes()
    yield
    if nextitem is None or nextitem.nodeid.split("::")[0] != module:
        left = _slot_routes() - _MODULE_ROUTES[module]
        if left:
            _LEFT_ROUTES.append(f"{module}: {sorted(left)}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFT_ROUTES:
        # A session-scoped node's slot pool shows here too: it lives until the session ends.
        terminalreporter.section("slot routes a test module left in the host namespace")
        for line in _LEFT_ROUTES:
            terminalreporter.write_line(line)
        still = _slot_routes() - next(iter(_MODULE_ROUTES.values()), set())
        terminalreporter.write_line(f"still there at the end: {sorted(still) or 'none'}")

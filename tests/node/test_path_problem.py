"""The path check of the node and the gateway (relay/server.py `path_problem`): what makes one
path mean two things to two parsers is refused, what apps and the SDKs send passes."""

from __future__ import annotations

import pytest

from agentenv.relay.server import path_problem


@pytest.mark.parametrize("target", [
    b"/", b"/sandboxes", b"/v2/sandboxes/iabc/connect",
    b"/files?path=/home/user/../x&signature=v1_x", b"/a/...", b"/a/.b", b"/%7Euser",
    b"/templates/name:tag", b"/a%2520b",
])
def test_ordinary_paths_pass(target: bytes) -> None:
    assert path_problem(target) is None


@pytest.mark.parametrize(("target", "kind"), [
    (b"/./init", "dot segment"), (b"/a/..", "dot segment"), (b"/a/../b", "dot segment"),
    (b"/%2e/init", "dot segment"), (b"/%2E%2e/x", "dot segment"), (b"/.%2E/x", "dot segment"),
    (b"/%252e%252e/x", "dot segment"), (b"/%25252e/x", "dot segment"),
    (b"/a//b", "empty segment"), (b"/a/", "empty segment"), (b"/a/b//", "empty segment"),
    (b"/x%2fy", "encoded '/'"), (b"/x%2Fy", "encoded '/'"), (b"/x%5cy", "encoded '/'"),
    (b"/x\\y", "encoded '/'"), (b"/x%00y", "encoded '/'"), (b"/x%252fy", "encoded '/'"),
])
def test_two_way_paths_are_refused_naming_why(target: bytes, kind: str) -> None:
    problem = path_problem(target)
    assert problem is not None and kind in problem, (target, problem)


def test_sandbox_traffic_may_end_in_a_slash_but_nothing_else() -> None:
    assert path_problem(b"/docs/", trailing_slash=True) is None
    assert path_problem(b"/docs//", trailing_slash=True) is not None
    assert path_problem(b"/docs/../", trailing_slash=True) is not None
    assert path_problem(b"/./", trailing_slash=True) is not None

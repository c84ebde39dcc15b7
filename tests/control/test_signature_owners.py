"""The gateway's memory of signed file URL owners (control/gateway/signed.py) and the create
lease setting, in-process: what a key covers, expiry, the bound, and bad settings."""

from __future__ import annotations

import time

import pytest

from agentenv.control.gateway.create import CREATE_LEASE_SECONDS, create_lease_seconds
from agentenv.control.gateway.signed import SignatureOwners, signature_key
from agentenv.errors import AgentEnvError


def scope(method: str, query: str) -> dict[str, object]:
    return {"method": method, "path": "/files", "query_string": query.encode()}


def test_key_covers_what_the_signature_signs() -> None:
    key, expiration = signature_key(scope("GET", "path=%2Fa&signature=v1_x&username=user"))
    same, _ = signature_key(scope("GET", "username=user&signature=v1_x&path=%2Fa&extra=1"))
    assert key == same and expiration is None
    for other in (scope("POST", "path=%2Fa&signature=v1_x&username=user"),
                  scope("GET", "path=%2Fb&signature=v1_x&username=user"),
                  scope("GET", "path=%2Fa&signature=v1_x&username=root"),
                  scope("GET", "path=%2Fa&signature=v1_y&username=user"),
                  scope("GET", "path=%2Fa&signature=v1_x&username=user&signature_expiration=9")):
        assert signature_key(other)[0] != key
    assert signature_key(scope("GET", "signature=v1_x&signature_expiration=123"))[1] == 123.0
    assert signature_key(scope("GET", "signature=v1_x&signature_expiration=soon"))[1] is None


def test_entries_expire_with_their_signature_or_ttl_and_stay_bounded() -> None:
    owners = SignatureOwners(max_entries=3, ttl=0.2)
    keys = [signature_key(scope("GET", f"signature=v1_{i}"))[0] for i in range(5)]
    owners.put(keys[0], "node0", "sb0", None)
    owners.put(keys[1], "node1", "sb1", time.time() + 60)
    owners.put(keys[2], "node2", "sb2", time.time() - 1)  # expired already: not kept
    assert owners.get(keys[2]) is None and len(owners) == 2
    found = owners.get(keys[0])
    assert found is not None and (found.node_id, found.sandbox_id) == ("node0", "sb0")
    time.sleep(0.25)
    assert owners.get(keys[0]) is None  # no expiration: the TTL
    assert owners.get(keys[1]) is not None  # its signature's expiration
    for i in (2, 3, 4):
        owners.put(keys[i], f"node{i}", f"sb{i}", None)
    assert len(owners) == 3 and owners.get(keys[1]) is None  # least recently used went first
    owners.drop(keys[4])
    assert owners.get(keys[4]) is None and owners.get(keys[3]) is not None


def test_create_lease_setting() -> None:
    assert create_lease_seconds({}) == CREATE_LEASE_SECONDS
    assert create_lease_seconds({"AENV_GATEWAY_CREATE_LEASE": "4.5"}) == 4.5
    for bad in ("0.5", "301", "soon"):
        with pytest.raises(AgentEnvError, match="AENV_GATEWAY_CREATE_LEASE must be 1-300"):
            create_lease_seconds({"AENV_GATEWAY_CREATE_LEASE": bad})

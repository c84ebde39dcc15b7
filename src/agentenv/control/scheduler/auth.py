"""Who may call the scheduler: a server interceptor in front of every RPC.

Each call carries an identity and its token (call metadata, control/scheduler/client.py):
`gateway`, or `node:ID`, with HMAC-SHA256(cluster secret, identity). The interceptor derives the
token of the identity named, compares in constant time, and then applies the identity's rights:

- the gateway: Schedule, RecordAssignment, Release, Lookup, ListNodes;
- a node: Heartbeat and Holders, and only for its own id (the request's `node_id` must be the
  identity's), so no caller can move another node's address or bindings.

A method missing from RULES is refused to everyone (a new RPC is closed until given a rule).
No credential or a wrong one: UNAUTHENTICATED; a right the identity does not have:
PERMISSION_DENIED. A verified token is remembered per identity, so a call costs a dict lookup
and one compare_digest, no HMAC.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from agentenv.control.proto import scheduler_pb2 as pb
from agentenv.control.scheduler.client import (
    GATEWAY_IDENTITY,
    IDENTITY_KEY,
    NODE_IDENTITY_PREFIX,
    TOKEN_KEY,
    derive_token,
)

log = logging.getLogger("agentenv.control.scheduler.auth")

SERVICE = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
#: identities verified at most this many (then forgotten and verified again): a node id is
#: part of the identity, and clusters have hundreds of nodes, not tens of thousands
MAX_REMEMBERED = 10_000
MAX_IDENTITY = 200


@dataclass(frozen=True)
class Rule:
    gateway: bool = False
    #: the request field that names the calling node; None: nodes may not call the method
    node_field: str | None = None


RULES: dict[str, Rule] = {
    f"/{SERVICE}/Schedule": Rule(gateway=True),
    f"/{SERVICE}/RecordAssignment": Rule(gateway=True),
    f"/{SERVICE}/Release": Rule(gateway=True),
    f"/{SERVICE}/Lookup": Rule(gateway=True),
    f"/{SERVICE}/ListNodes": Rule(gateway=True),
    f"/{SERVICE}/Heartbeat": Rule(node_field="node_id"),
    f"/{SERVICE}/Holders": Rule(node_field="node_id"),
}

Handler = grpc.RpcMethodHandler
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]


def _refusal(code: grpc.StatusCode, message: str) -> Handler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(refuse)


NO_CREDENTIAL = _refusal(
    grpc.StatusCode.UNAUTHENTICATED,
    f"no credential: every call needs {IDENTITY_KEY} and {TOKEN_KEY} metadata derived from the "
    "cluster secret",
)
WRONG_CREDENTIAL = _refusal(
    grpc.StatusCode.UNAUTHENTICATED,
    f"wrong credential: {TOKEN_KEY} is not the token of the identity in {IDENTITY_KEY} "
    "(another cluster secret?)",
)


def _own_node_only(handler: Handler, method: str, node_id: str, field: str) -> Handler:
    """`handler`, refusing a request whose `field` names another node than the caller."""
    inner = handler.unary_unary

    async def checked(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        claimed = getattr(request, field)
        if claimed != node_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {node_id!r} may not call {method} for node {claimed!r}",
            )
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        checked, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ClusterAuth(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._verified: dict[str, bytes] = {}  # identity -> its token, once a call proved it
        self.refused = 0  # calls with a wrong credential (logged the first, then every 1000th)

    def _valid(self, identity: str, token: str) -> bool:
        given = token.encode("utf-8", "surrogateescape")
        known = self._verified.get(identity)
        if known is not None:
            return hmac.compare_digest(given, known)
        if len(identity) > MAX_IDENTITY:
            return False
        expected = derive_token(self._secret, identity).encode()
        if not hmac.compare_digest(given, expected):
            return False
        # only proven identities are kept: a stranger's guesses never fill the table
        if len(self._verified) >= MAX_REMEMBERED:
            self._verified.clear()
        self._verified[identity] = expected
        return True

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> Handler:
        identity = token = None
        for key, value in details.invocation_metadata or ():
            if key == IDENTITY_KEY:
                identity = value
            elif key == TOKEN_KEY:
                token = value
        if not isinstance(identity, str) or not isinstance(token, str):
            return NO_CREDENTIAL
        if not self._valid(identity, token):
            self.refused += 1
            if self.refused % 1000 == 1:  # a stranger's flood is not a flood of logs
                log.warning("refused a call with a wrong credential",
                            extra={"method": details.method, "refused": self.refused,
                                   "identity": identity[:MAX_IDENTITY]})
            return WRONG_CREDENTIAL
        method = details.method
        rule = RULES.get(method)
        if rule is not None and identity == GATEWAY_IDENTITY and rule.gateway:
            return await continuation(details)
        if (rule is not None and rule.node_field is not None
                and identity.startswith(NODE_IDENTITY_PREFIX)):
            handler = await continuation(details)
            return _own_node_only(handler, method.rpartition("/")[2],
                                  identity[len(NODE_IDENTITY_PREFIX):], rule.node_field)
        return _refusal(grpc.StatusCode.PERMISSION_DENIED,
                        f"{identity!r} may not call {method}")

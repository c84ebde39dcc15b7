"""Who may call the scheduler: a check inside every method handler.

Each call carries an identity and its token (one call metadata entry, "IDENTITY TOKEN",
scheduling/client.py):
`gateway`, with HMAC-SHA256(cluster secret, identity), or `node:ID`, with HMAC-SHA256(the node's
key, identity) where the node's key is itself derived from the cluster secret and ID
(agentenv.cluster_keys): the scheduler holds the secret and derives both, a node holds only its
own key. The check compares in constant time and then applies the identity's rights:

- the gateway: Schedule, RecordAssignment, Release, Lookup, ListNodes;
- a node: Heartbeat and Holders, and only for its own id (the request's `node_id` must be the
  identity's), so no caller can move another node's address or bindings.

A method missing from RULES is refused to everyone (a new RPC is closed until given a rule).
No credential or a wrong one: UNAUTHENTICATED; a right the identity does not have:
PERMISSION_DENIED. A verified token is remembered per identity, so a call costs a dict lookup
and one compare_digest, no HMAC.

`ClusterAuth.install(server, servicer)` wraps each of the servicer's methods once, when the
server is built: the check runs in the handler itself. (A grpc.aio server interceptor did the same at
~30 us per call of grpc's machinery against 0.6 us for the check: Lookup lost 12-15%.) The
handlers take the request's bytes unparsed: a caller's message is parsed only once its
credential passed (a stranger's costs no protobuf parse; grpc still receives it, at most the
server's max receive message size, control/scheduler/server.py). Bytes that do not parse:
INVALID_ARGUMENT.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from agentenv.cluster_keys import node_key
from agentenv.logs import Sampled
from agentenv.scheduling.client import (
    CREDENTIAL_KEY,
    GATEWAY_IDENTITY,
    NODE_IDENTITY_PREFIX,
    derive_token,
)
from agentenv.scheduling.proto import scheduler_pb2 as pb
from agentenv.scheduling.proto import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("agentenv.control.scheduler.auth")

SERVICE = pb.DESCRIPTOR.services_by_name["Scheduler"]
#: identities verified at most this many (then forgotten and verified again): a node id is
#: part of the identity, and clusters have hundreds of nodes, not tens of thousands
MAX_REMEMBERED = 10_000
MAX_IDENTITY = 200

NO_CREDENTIAL = (f"no credential: every call needs {CREDENTIAL_KEY} metadata, an identity and "
                 "its token derived from the cluster secret")
WRONG_CREDENTIAL = (f"wrong credential: the token in {CREDENTIAL_KEY} is not the token of its "
                    "identity (another cluster secret, or another node's key?)")


@dataclass(frozen=True)
class Rule:
    gateway: bool = False
    #: the request field that names the calling node; None: nodes may not call the method
    node_field: str | None = None


RULES: dict[str, Rule] = {
    f"/{SERVICE.full_name}/Schedule": Rule(gateway=True),
    f"/{SERVICE.full_name}/RecordAssignment": Rule(gateway=True),
    f"/{SERVICE.full_name}/Release": Rule(gateway=True),
    f"/{SERVICE.full_name}/Lookup": Rule(gateway=True),
    f"/{SERVICE.full_name}/ListNodes": Rule(gateway=True),
    f"/{SERVICE.full_name}/Heartbeat": Rule(node_field="node_id"),
    f"/{SERVICE.full_name}/Holders": Rule(node_field="node_id"),
}

Context = grpc.aio.ServicerContext[Any, Any]
Method = Callable[[Any, Context], Awaitable[Any]]
Parse = Callable[[bytes], Any]


#: what is told of every call: (method, gRPC status code name, service time in seconds of a
#: call that passed the check, else None)
Observe = Callable[[str, str, "float | None"], None]


def _ignore(method: str, code: str, seconds: float | None) -> None:
    pass


class ClusterAuth:
    def __init__(self, secret: str, observe: Observe | None = None) -> None:
        self._secret = secret
        self._observe = observe or _ignore
        self._verified: dict[str, bytes] = {}  # identity -> its token, once a call proved it
        self.refused = Sampled()  # calls with a wrong credential

    def expected_token(self, identity: str) -> str:
        """The token `identity` must present: a node's is derived from its node key."""
        if identity.startswith(NODE_IDENTITY_PREFIX):
            key = node_key(self._secret, identity[len(NODE_IDENTITY_PREFIX):])
            return derive_token(key, identity)
        return derive_token(self._secret, identity)

    def _valid(self, identity: str, token: str) -> bool:
        given = token.encode("utf-8", "surrogateescape")
        known = self._verified.get(identity)
        if known is not None:
            return hmac.compare_digest(given, known)
        if len(identity) > MAX_IDENTITY:
            return False
        expected = self.expected_token(identity).encode()
        if not hmac.compare_digest(given, expected):
            return False
        # only proven identities are kept: a stranger's guesses never fill the table
        if len(self._verified) >= MAX_REMEMBERED:
            self._verified.clear()
        self._verified[identity] = expected
        return True

    def _authenticate(self, metadata: Any, method: str) -> str | None:
        """The identity that proved itself with this call's metadata; None: refused (why:
        `_refusal`). Synchronous: a call that passes costs no extra coroutine."""
        credential = None
        for key, value in metadata or ():  # a loop, not next() over a generator: ~3x less
            if key == CREDENTIAL_KEY:
                credential = value
                break
        if credential is None:
            return None
        identity, _, token = credential.rpartition(" ")  # a token is hex: no space in it
        if not identity:
            return None
        if self._valid(identity, token):
            return identity
        if self.refused.tick():
            log.warning("refused a call with a wrong credential",
                        extra={"method": method, "refused": self.refused.count,
                               "identity": identity[:MAX_IDENTITY]})
        return None

    @staticmethod
    def _refusal(metadata: Any) -> str:
        given = any(key == CREDENTIAL_KEY for key, _ in metadata or ())
        return WRONG_CREDENTIAL if given else NO_CREDENTIAL

    def _checked(self, name: str, inner: Method, parse: Parse) -> Method:
        """`inner` behind the check of method `name`'s rule; the request (bytes) is parsed
        with `parse` once the caller is known."""
        method = f"/{SERVICE.full_name}/{name}"
        rule = RULES.get(method)
        authenticate = self._authenticate

        async def refuse(context: Context, metadata: Any, identity: str | None) -> None:
            if identity is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal(metadata))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{identity!r} may not call {method}")

        observe = self._observe
        perf_counter = time.perf_counter

        async def refused(context: Context, metadata: Any, identity: str | None) -> None:
            observe(name, "UNAUTHENTICATED" if identity is None else "PERMISSION_DENIED", None)
            await refuse(context, metadata, identity)

        if rule is None:
            async def closed(raw: bytes, context: Context) -> Any:
                metadata = context.invocation_metadata()
                await refused(context, metadata, authenticate(metadata, method))

            return closed
        gateway, field = rule.gateway, rule.node_field

        # One coroutine per call: the check, the parse and the timing inline (three chained
        # coroutines and prometheus_client's locked counters cost ~13 us a call more;
        # bench/RESULTS.md, 2026-12-06).
        async def checked(raw: bytes, context: Context) -> Any:
            metadata = context.invocation_metadata()
            identity = authenticate(metadata, method)
            if identity is None or not (
                    (gateway and identity == GATEWAY_IDENTITY)
                    or (field is not None and identity.startswith(NODE_IDENTITY_PREFIX))):
                await refused(context, metadata, identity)
            try:
                request = parse(raw)
            except DecodeError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a {name} request message")
            if identity != GATEWAY_IDENTITY or not gateway:
                node_id = identity[len(NODE_IDENTITY_PREFIX):]
                claimed = getattr(request, field)  # type: ignore[arg-type]
                if claimed != node_id:
                    observe(name, "PERMISSION_DENIED", None)
                    await context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"node {node_id!r} may not call {name} for node {claimed!r}")
            began = perf_counter()
            try:
                answer = await inner(request, context)
            except BaseException:
                code = context.code()
                observe(name, code.name if code is not None else "UNKNOWN",
                        perf_counter() - began)
                raise
            observe(name, "OK", perf_counter() - began)
            return answer

        return checked

    def install(self, server: grpc.aio.Server, servicer: pb_grpc.SchedulerServicer) -> None:
        """Serve the service's methods (every method of the proto) on `server`: each checks
        the caller first and only then parses the request. Registered as the generated
        `add_SchedulerServicer_to_server` registers them (registered methods, and the generic
        handler beside them)."""
        handlers = {}
        for method in SERVICE.methods:
            request = getattr(pb, method.input_type.name)
            response = getattr(pb, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._checked(method.name, getattr(servicer, method.name), request.FromString),
                request_deserializer=None,  # the bytes as they came: parsed after the check
                response_serializer=response.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        server.add_registered_method_handlers(SERVICE.full_name, handlers)

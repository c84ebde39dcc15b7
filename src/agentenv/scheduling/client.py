"""A typed asyncio client for the scheduler (scheduler.proto), used by the gateway and the node.

It imports nothing of agentenv but the generated code and the common error, so the node's
heartbeat sender can use it without pulling in the rest of the control plane.

    async with SchedulerClient("127.0.0.1:9090", Credentials.gateway(secret)) as scheduler:
        placement = await scheduler.schedule(template_id="base", vcpus=2, memory_mib=512)
        ...create the sandbox on placement.node_address...
        await scheduler.record_assignment(sandbox_id, placement.node_id, team_id="t1")
        where = await scheduler.lookup(sandbox_id)   # None: no binding

Every failure raises `SchedulerError` with the gRPC status (`code`) and the scheduler's message:
INVALID_ARGUMENT (bad input), NOT_FOUND (no such source sandbox, snapshot or node),
RESOURCE_EXHAUSTED (no node has room), UNAVAILABLE (no node up, the scheduler or its Redis
unreachable), PERMISSION_DENIED (a node not allowed to register, or a caller asking for what its
identity may not do), UNAUTHENTICATED (no or a wrong credential).

Every call carries the caller's `Credentials`: an identity (`gateway`, or `node:ID`) and a token
for that identity (HMAC-SHA256 of the cluster secret for the gateway, of the node's own key for
a node), which the scheduler checks (control/scheduler/auth.py). No key goes over the wire.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from agentenv.errors import AgentEnvError
from agentenv.fsutil import read_pem
from agentenv.scheduling.proto import scheduler_pb2 as pb
from agentenv.scheduling.proto import scheduler_pb2_grpc as pb_grpc
from agentenv.settings import setting_text

__all__ = [
    "ClientTls",
    "Credentials",
    "Holder",
    "Location",
    "NodeInfo",
    "Placement",
    "SchedulerClient",
    "SchedulerError",
    "pb",
]

DEFAULT_TIMEOUT_S = 5.0
#: call metadata: who is calling and the token that proves it, "IDENTITY TOKEN" in one entry
#: (each metadata entry costs grpc ~10 us a call on each side: two entries cost the scheduler 5%
#: of its calls; bench/RESULTS.md, 2026-12-07)
CREDENTIAL_KEY = "x-aenv-credential"
GATEWAY_IDENTITY = "gateway"
NODE_IDENTITY_PREFIX = "node:"
#: keeps these tokens apart from anything else ever derived from the cluster secret
_TOKEN_CONTEXT = b"agentenv scheduler call v1\0"


def derive_token(secret: str, identity: str) -> str:
    """The token of `identity`: HMAC-SHA256(key, context + identity), hex; the key is the cluster
    secret for the gateway, the node's key for a node."""
    return hmac.new(secret.encode(), _TOKEN_CONTEXT + identity.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Credentials:
    """Who a client calls the scheduler as. The gateway's identity may place, record, release,
    look up and list; a node's (`node:ID`) may only heartbeat and ask for blob holders, each for
    its own id."""

    identity: str
    token: str

    @classmethod
    def gateway(cls, secret: str) -> Credentials:
        return cls(GATEWAY_IDENTITY, derive_token(secret, GATEWAY_IDENTITY))

    @classmethod
    def node(cls, key: str, node_id: str) -> Credentials:
        """`key`: the node's own key (agentenv.cluster_keys.node_key), not the cluster secret."""
        identity = NODE_IDENTITY_PREFIX + node_id
        return cls(identity, derive_token(key, identity))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CREDENTIAL_KEY, f"{self.identity} {self.token}"),)

    @functools.cached_property
    def call_metadata(self) -> grpc.aio.Metadata:
        """The same, built once: grpc.aio makes a Metadata of a tuple on every call."""
        return grpc.aio.Metadata(*self.metadata)


#: the settings of TLS to the scheduler (files, PEM): what its clients trust, and what they show
TLS_CA_ENV = "AENV_SCHEDULER_TLS_CA"
TLS_CLIENT_CERT_ENV = "AENV_SCHEDULER_TLS_CLIENT_CERT"
TLS_CLIENT_KEY_ENV = "AENV_SCHEDULER_TLS_CLIENT_KEY"
#: the name the scheduler's certificate is checked against when it is not the target's host
TLS_SERVER_NAME_ENV = "AENV_SCHEDULER_TLS_SERVER_NAME"


@dataclass(frozen=True)
class ClientTls:
    """TLS to the scheduler: the CA its certificate is checked against, and for a scheduler
    that wants one (mTLS), the client's certificate and key."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientTls | None:
        """From AENV_SCHEDULER_TLS_CA (+ _CLIENT_CERT and _CLIENT_KEY, _SERVER_NAME); None
        without a CA: plaintext."""
        ca, cert, key = (setting_text(name, env).strip() for name in (
            TLS_CA_ENV, TLS_CLIENT_CERT_ENV, TLS_CLIENT_KEY_ENV))
        if bool(cert) != bool(key):
            raise AgentEnvError(f"{TLS_CLIENT_CERT_ENV} and {TLS_CLIENT_KEY_ENV} go together")
        if not ca:
            if cert:
                raise AgentEnvError(f"{TLS_CLIENT_CERT_ENV} needs {TLS_CA_ENV} (the CA of the "
                                    "scheduler's certificate)")
            return None
        return cls(read_pem(ca, TLS_CA_ENV),
                   read_pem(cert, TLS_CLIENT_CERT_ENV) if cert else None,
                   read_pem(key, TLS_CLIENT_KEY_ENV) if key else None,
                   setting_text(TLS_SERVER_NAME_ENV, env).strip() or None)


#: trailing metadata of a Schedule no node could take (server.py sends them): resource=nodes,...
#: and the size asked, for a caller that may not pass the message on (it names other teams' load)
REFUSED_KEY = "x-aenv-refused"
REQUEST_KEY = "x-aenv-request"


class SchedulerError(AgentEnvError):
    """`refused` (a Schedule no node could take): resource (cpu, memory, disk, sandboxes,
    down, tried) -> how many nodes refused for it; `request` the size that was asked."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str,
                 refused: dict[str, int] | None = None, request: str = "") -> None:
        super().__init__(f"scheduler {method}: {code.name}: {message}")
        self.code = code
        self.details = message
        self.method = method
        self.refused = refused or {}
        self.request = request

    @property
    def unavailable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Placement:
    node_id: str
    node_address: str
    reason: str
    #: the room held on the node: name it in record_assignment, or cancel it with
    #: release(reservation=...) when no sandbox will use it
    reservation: str = ""


@dataclass(frozen=True)
class Location:
    """Where a sandbox is bound. `node_up` false: its node missed its heartbeats (answer 503)."""

    sandbox_id: str
    node_id: str
    node_address: str
    node_up: bool
    team_id: str


@dataclass(frozen=True)
class Holder:
    """A node that serves a blob to its peers: whole (`complete`) or some of its chunks."""

    node_id: str
    layer_address: str
    complete: bool
    #: what the asking node presents to this holder (agentenv.cluster_keys.peer_credential)
    credential: str = ""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    up: bool
    down_reason: str
    last_heartbeat_unix_ms: int
    discovered_by: tuple[str, ...]
    status: pb.NodeStatus


class SchedulerClient:
    """One channel to the scheduler; `target` is host:port (or any gRPC target, e.g. unix:PATH).
    Every call carries `credentials` (a heartbeat may name others: tools acting for nodes).
    `tls`: given, else from the environment (ClientTls.from_env); none there: plaintext."""

    def __init__(self, target: str, credentials: Credentials,
                 timeout: float = DEFAULT_TIMEOUT_S, tls: ClientTls | None = None) -> None:
        if not target:
            raise AgentEnvError("no scheduler address (host:port)")
        self.target = target
        self.credentials = credentials
        self.timeout = timeout
        # No proxy: the scheduler is always reached directly (the environment's proxy variables
        # are for the sandboxes' traffic).
        options: list[tuple[str, str | int]] = [("grpc.enable_http_proxy", 0)]
        tls = tls or ClientTls.from_env()
        if tls is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(
                root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert),
                options=options)
        self.stub = pb_grpc.SchedulerStub(self.channel)

    async def __aenter__(self) -> SchedulerClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method: str, request: object, timeout: float | None,
                    credentials: Credentials | None = None) -> object:
        try:
            return await getattr(self.stub, method)(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=(credentials or self.credentials).call_metadata,
            )
        except grpc.aio.AioRpcError as exc:
            trailing = dict(exc.trailing_metadata() or ())
            refused: dict[str, int] = {}
            for item in str(trailing.get(REFUSED_KEY, "")).split(","):
                name, _, count = item.partition("=")
                if name and count.isdigit():
                    refused[name] = int(count)
            raise SchedulerError(exc.code(), exc.details() or "", method, refused,
                                 str(trailing.get(REQUEST_KEY, ""))) from None

    async def schedule(
        self,
        *,
        template_id: str = "",
        snapshot_id: str = "",
        vcpus: int = 0,
        memory_mib: int = 0,
        source_sandbox_id: str = "",
        team_id: str = "",
        strategy: str = "",
        layers: Sequence[str] = (),
        exclude_nodes: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Placement:
        answer = await self._call(
            "Schedule",
            pb.ScheduleRequest(
                template_id=template_id,
                snapshot_id=snapshot_id,
                vcpus=vcpus,
                memory_mib=memory_mib,
                source_sandbox_id=source_sandbox_id,
                team_id=team_id,
                strategy=strategy,
                layers=list(layers),
                exclude_nodes=list(exclude_nodes),
            ),
            timeout,
        )
        assert isinstance(answer, pb.ScheduleResponse)
        return Placement(answer.node_id, answer.node_address, answer.reason, answer.reservation)

    async def record_assignment(
        self,
        sandbox_id: str,
        node_id: str,
        *,
        team_id: str = "",
        vcpus: int = 0,
        memory_mib: int = 0,
        reservation: str = "",
        timeout: float | None = None,
    ) -> None:
        await self._call(
            "RecordAssignment",
            pb.Assignment(
                sandbox_id=sandbox_id, node_id=node_id, team_id=team_id, vcpus=vcpus,
                memory_mib=memory_mib, reservation=reservation,
            ),
            timeout,
        )

    async def release(self, sandbox_id: str = "", *, reservation: str = "",
                      timeout: float | None = None) -> None:
        """Remove a binding; with `reservation` (and no sandbox), give a Schedule answer's
        room back (its create failed)."""
        await self._call("Release", pb.ReleaseRequest(sandbox_id=sandbox_id,
                                                      reservation=reservation), timeout)

    async def lookup(self, sandbox_id: str, *, timeout: float | None = None) -> Location | None:
        answer = await self._call("Lookup", pb.LookupRequest(sandbox_id=sandbox_id), timeout)
        assert isinstance(answer, pb.LookupResponse)
        if not answer.found:
            return None
        return Location(
            sandbox_id, answer.node_id, answer.node_address, answer.node_up, answer.team_id
        )

    async def heartbeat(self, status: pb.NodeStatus, *, timeout: float | None = None,
                        credentials: Credentials | None = None) -> float:
        """Send one NodeStatus; returns the interval (seconds) the scheduler asks for.
        `credentials`: other than the client's (the node the status is for)."""
        answer = await self._call("Heartbeat", status, timeout, credentials)
        assert isinstance(answer, pb.HeartbeatResponse)
        return answer.interval_ms / 1000

    async def holders(
        self, digests: Sequence[str], *, node_id: str = "", limit: int = 0,
        timeout: float | None = None, credentials: Credentials | None = None,
    ) -> dict[str, list[Holder]]:
        """digest -> the up nodes serving it (whole holders first), `node_id` (the asking node,
        whose credentials these must be) left out."""
        answer = await self._call(
            "Holders", pb.HoldersRequest(digests=list(digests), node_id=node_id, limit=limit),
            timeout, credentials,
        )
        assert isinstance(answer, pb.HoldersResponse)
        return {
            b.digest: [Holder(h.node_id, h.layer_address, h.complete, h.credential)
                          for h in b.holders]
            for b in answer.blobs
        }

    async def list_nodes(self, *, timeout: float | None = None) -> list[NodeInfo]:
        answer = await self._call("ListNodes", pb.Empty(), timeout)
        assert isinstance(answer, pb.NodeList)
        return [_node_info(n) for n in answer.nodes]


def _node_info(info: pb.NodeInfo) -> NodeInfo:
    sources: Iterable[str] = info.discovered_by.split(",") if info.discovered_by else ()
    return NodeInfo(
        node_id=info.status.node_id,
        address=info.status.address,
        up=info.up,
        down_reason=info.down_reason,
        last_heartbeat_unix_ms=info.last_heartbeat_unix_ms,
        discovered_by=tuple(sources),
        status=info.status,
    )

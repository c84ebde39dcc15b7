"""The node's side of sandbox egress policies (E2B `network`, `allow_internet_access`).

- Parsing: the create body's `network` and `PUT /sandboxes/{id}/network` go through
  EgressPolicy.from_wire; a bad entry is a 400 naming it, before anything is stored or applied.
- Storage: `SandboxRecord.network` holds the create's ingress options (allowPublicTraffic,
  maskRequestHost, httpsPorts) and the egress policy in its normalised wire form, secrets
  included (an egress proxy's password: the policy is re-applied after a node restart).
  `public_network` is what `GET /sandboxes/{id}` shows: no password, no CA certificate.
- Identity: what the metadata service (169.254.169.254, in the egress proxy) tells a guest.
  The instance token is derived from the node's token seed (TokenIssuer), so it needs no
  storage and stays the same across pause/resume and node restarts; fork children get their own.
- Enforcement is the backend's (`enforces_network_policy`): the VM backend's network slots and
  egress proxy. The process backend cannot isolate a host process, so a non-default policy is
  refused there (400) rather than silently not enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
from pathlib import Path
from typing import Any

from agentenv.api.errors import BadRequest
from agentenv.network.control import EgressControlError, SlotEntry, SlotIdentity
from agentenv.network.policy import ALL_TRAFFIC, EgressPolicy, PolicyError
from agentenv.node.records import SandboxRecord
from agentenv.node.security import TokenIssuer
from agentenv.runtime.network import parse_open_ranges, walls
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.network_policy")

#: Options of `network` about inbound traffic to the sandbox (kept as given, not egress).
INGRESS_KEYS = ("allowPublicTraffic", "maskRequestHost", "httpsPorts")
#: Egress options; an update replaces all of them (omitted ones are cleared).
EGRESS_KEYS = ("allowOut", "denyOut", "dnsServers", "egressProxy", "rules")


def parse(network: Any, allow_internet_access: bool | None) -> EgressPolicy:
    """The policy a create or update asks for; BadRequest naming the bad entry."""
    if network is not None and not isinstance(network, dict):
        raise BadRequest("network must be an object")
    try:
        policy = EgressPolicy.from_wire(network, allow_internet_access)
    except PolicyError as exc:
        raise BadRequest(f"invalid network policy: {exc}") from exc
    proxy = policy.egress_proxy
    if proxy is not None:
        try:
            address = ipaddress.IPv4Network(proxy.host)
        except ValueError:
            address = None  # a name: the egress proxy refuses it if it resolves into a wall
        if address is not None and any(address.subnet_of(w) for w in _walls()):
            raise BadRequest(f"invalid network policy: egressProxy.address {proxy.host!r} is in "
                             "a private or internal range guests may not reach")
    return policy


def _walls() -> list[ipaddress.IPv4Network]:
    """The ranges walled off from guests (runtime/network.py), minus the operator's openings
    (AENV_NET_OPEN_RANGES, as the VM backend reads it)."""
    try:
        opened = parse_open_ranges(get_settings().net_open_ranges)
    except Exception:  # the backend refuses a bad setting at start
        opened = ()
    return walls(opened)


def stored(network: dict[str, Any] | None, policy: EgressPolicy) -> dict[str, Any] | None:
    """What the record keeps: the ingress options as given plus the policy's wire form."""
    kept = {k: network[k] for k in INGRESS_KEYS if network and k in network}
    kept.update(policy.to_wire(secrets=True))
    return kept or (None if network is None else {})


def policy_of(rec: SandboxRecord) -> EgressPolicy:
    """The record's policy. Records hold what parse() accepted; one that does not parse (kept
    from before policies were validated) fails closed: nothing goes out."""
    egress = {k: v for k, v in (rec.network or {}).items() if k in EGRESS_KEYS}
    try:
        return EgressPolicy.from_wire(egress, rec.allow_internet_access)
    except PolicyError:
        log.error("stored network policy is invalid: the sandbox gets no outbound traffic",
                  extra={"sandbox_id": rec.sandbox_id})
        return EgressPolicy(deny_nets=(ALL_TRAFFIC,))


def public_network(network: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record's `network` as `GET /sandboxes/{id}` shows it (no secrets)."""
    if network is None:
        return None
    out = {k: v for k, v in network.items() if k not in EGRESS_KEYS}
    try:
        egress = EgressPolicy.from_wire({k: v for k, v in network.items() if k in EGRESS_KEYS})
    except PolicyError:  # a record from before policies were validated: show what is safe
        return {k: v for k, v in network.items() if k in ("allowOut", "denyOut", *INGRESS_KEYS)}
    out.update(egress.to_wire(secrets=False))
    return out


def updated(rec: SandboxRecord, body: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                              bool | None, EgressPolicy]:
    """An update body applied to a record: (its new `network`, `allow_internet_access`,
    policy). Every egress field is replaced (omitted ones cleared), ingress options stay."""
    allow = body.get("allow_internet_access")
    if allow is not None and not isinstance(allow, bool):
        raise BadRequest("allow_internet_access must be true, false or null")
    egress = {k: body[k] for k in EGRESS_KEYS if body.get(k) is not None}
    policy = parse(egress, allow)
    return stored(rec.network or {}, policy), allow, policy


def identity_of(rec: SandboxRecord, tokens: TokenIssuer) -> SlotIdentity:
    """`snapshot_id`: the snapshot (POST /sandboxes/{id}/snapshots) the sandbox was created
    from, None for a template's sandbox."""
    return SlotIdentity(
        sandbox_id=rec.sandbox_id,
        template_id=rec.template_id,
        snapshot_id=rec.template_id if rec.source.kind == "snapshot" else None,
        envd_token_sha256=(hashlib.sha256(rec.envd_access_token.encode()).hexdigest()
                           if rec.secure and rec.envd_access_token else None),
        instance_token=tokens.instance_token(rec.sandbox_id),
    )


class EgressProxySupervisor:
    """The node-wide egress proxy process (agentenv.network: name filtering on TCP the host
    redirects to it, the metadata service at 169.254.169.254) kept running: when it dies it
    is started again on the same port and told the whole slot table (`sync`).

    At start, a proxy that a crashed node left running on the same control socket (and port,
    when one is configured) is adopted, not replaced: the guests' live connections through it
    go on, and its table (kept from the previous run) serves the adopted sandboxes until the
    node has set their entries again and calls `resync()`, which drops the rest.

    It holds the table the node last sent (`entries`, by slot source address). A failed
    request to the proxy is logged, never raised: the proxy fails closed (a source it does
    not know gets nothing), and the next restart syncs the table again."""

    def __init__(self, control_path: Path, port: int = 0, log_path: Path | None = None,
                 check_interval: float = 1.0, open_ranges: tuple[str, ...] = ()) -> None:
        self.control_path = control_path
        self.open_ranges = open_ranges
        self.port = port
        self.log_path = log_path
        self.check_interval = check_interval
        self.entries: dict[str, SlotEntry] = {}
        self.restarts = 0
        self.adopted = False  # the running proxy was taken over from a previous node run
        self._proc: Any = None  # agentenv.network.process.EgressProxyProcess
        self._watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self) -> int:
        """Adopt the proxy a previous run left, or start one; returns its port. Raises
        EgressControlError when it cannot run."""
        # optional: a build may leave the egress proxy out (node/vm_backend/egress.py)
        from agentenv.network.process import running_for

        leftovers = await asyncio.to_thread(running_for, self.control_path)
        await self._spawn(adopt=bool(leftovers))
        for pid in leftovers:
            if pid != self.pid:  # not adoptable (another port, no answer): it must not linger
                log.warning("ending an egress proxy left by a previous run", extra={"pid": pid})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._watch = asyncio.create_task(self._watch_forever(), name="egress-proxy-watch")
        return self.port

    async def _spawn(self, adopt: bool = False) -> None:
        # optional: a build may leave the egress proxy out (node/vm_backend/egress.py)
        from agentenv.network.process import EgressProxyProcess

        self.control_path.parent.mkdir(parents=True, exist_ok=True)
        extra = tuple(arg for net in self.open_ranges for arg in ("--open-range", net))
        proc = EgressProxyProcess(self.control_path, self.port, log_path=self.log_path,
                                  extra_args=extra)
        answer = await proc.start(adopt=adopt)
        self.port = int(answer.get("port") or self.port)
        self._proc = proc
        self.adopted = proc.adopted_pid is not None
        log.info("egress proxy adopted" if self.adopted else "egress proxy running",
                 extra={"pid": proc.pid, "port": self.port, "slots": answer.get("slots")})

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            if self._proc is not None and self._proc.is_alive():
                continue
            log.error("the egress proxy died: starting it again",
                      extra={"pid": self.pid, "slots": len(self.entries)})
            try:
                if self._proc is not None:
                    await self._proc.stop()
                await self._spawn()
                self.restarts += 1
                await self._proc.client.sync(list(self.entries.values()))
            except Exception as exc:  # retried at the next check
                log.error("egress proxy restart failed", extra={"error": str(exc)})

    async def resync(self) -> None:
        """Replace the proxy's table with the node's (after a start that adopted a proxy and
        set the adopted sandboxes' entries again): entries of VMs that did not survive go;
        connections that the entries still allow are kept."""
        if self._proc is None:
            return
        try:
            await self._proc.client.sync(list(self.entries.values()))
        except EgressControlError as exc:
            log.error("egress proxy did not take the slot table", extra={"error": str(exc)})

    async def set(self, entry: SlotEntry) -> None:
        self.entries[entry.source] = entry
        if self._proc is not None:
            try:
                await self._proc.client.set_slot(entry)
            except EgressControlError as exc:
                log.error("egress proxy did not take a slot's policy",
                          extra={"sandbox_id": entry.identity.sandbox_id, "error": str(exc)})

    async def remove(self, source: str) -> None:
        if self.entries.pop(source, None) is not None and self._proc is not None:
            try:
                await self._proc.client.remove_slot(source)
            except EgressControlError as exc:
                log.error("egress proxy did not drop a slot", extra={"error": str(exc)})

    async def ping(self) -> dict[str, Any]:
        if self._proc is None:
            raise EgressControlError("the egress proxy is not running")
        return dict(await self._proc.client.ping())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
            self._watch = None
        if self._proc is not None:
            await self._proc.stop()
            self._proc = None

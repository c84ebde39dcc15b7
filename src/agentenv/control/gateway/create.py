"""Creates through the gateway: placement (the scheduler's choice, the next node's when one
refuses for room), the team's quota, and a create's Idempotency-Key claimed in Redis as a lease,
so that retries through any gateway make one sandbox (or one batch); batch creates and forks
(`count` sandboxes, a result each, spilling over to other nodes: batch.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
from starlette.requests import Request

from agentenv.control.gateway.batch import Answer, Batches
from agentenv.control.gateway.limits import GatewayQuotas
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import (
    GatewayError,
    NodeLink,
    bare_name,
    json_body,
    send_answer,
)
from agentenv.control.gateway.placement import (
    Node,
    Placed,
    PlacementFailure,
    SchedulerLink,
)
from agentenv.control.gateway.store import PENDING, GatewayStore
from agentenv.errors import AgentEnvError
from agentenv.node.admission import REFUSED_HEADER
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Send
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.control.gateway")

#: how long a retry waits for a create under way with its Idempotency-Key (a create on a
#: loaded host with the VM backend takes up to a minute or two) before it answers 409
CREATE_PENDING_SECONDS = 300.0
#: the lease of a create on its Idempotency-Key: renewed every third of it while the create is
#: in flight, so a retry takes the key over this long after its gateway died (kill -9)
CREATE_LEASE_SECONDS = 15.0
CREATE_LEASE_ENV = "AENV_GATEWAY_CREATE_LEASE"


def create_lease_seconds(env: Mapping[str, str] | None = None) -> float:
    raw = setting_text(CREATE_LEASE_ENV, env)
    if not raw:
        return CREATE_LEASE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 300:
        raise AgentEnvError(f"{CREATE_LEASE_ENV} must be 1-300 seconds, got {raw!r}")
    return value


class Creates:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore,
                 quotas: GatewayQuotas, metrics: GatewayMetrics) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store
        self.quotas = quotas
        self.metrics = metrics
        self.create_lease = create_lease_seconds()
        self.batches = Batches(link, scheduler, store, quotas, metrics)

    async def create(self, request: Request, send: Send, team: str) -> None:
        raw = await self.link.body(request)
        key = self._key(request)
        if key is None:
            await self._create(request, send, team, raw, None)
            return
        await self._once(send, team, key, lambda mark: self._create(request, send, team, raw,
                                                                    key, mark))

    @staticmethod
    def _key(request: Request) -> str | None:
        keys = request.headers.getlist("idempotency-key")
        if not keys:
            return None
        if len(keys) > 1 or not 1 <= len(keys[0]) <= 255:
            raise GatewayError(400, "Idempotency-Key must appear once, 1-255 characters")
        return keys[0]

    async def _once(self, send: Send, team: str, key: str,
                    run: Callable[[str], Awaitable[bool]]) -> None:
        """`run(mark)` once for `team`'s Idempotency-Key `key`; a retry gets its answer."""
        # A retry of a create (same team, same key) gets the first one's sandbox wherever the
        # scheduler would place the retry: the key is claimed in Redis, so concurrent duplicates
        # through any gateway make one sandbox and the others wait for its answer.
        mark = secrets.token_hex(8)
        deadline = time.monotonic() + CREATE_PENDING_SECONDS
        while True:
            found = await self.store.claim_create(team, key, mark, self.create_lease)
            if found is None:
                break
            if not found.startswith(PENDING):
                await send_json(send, 201, self._domained(json.loads(found)))
                return
            if time.monotonic() > deadline:
                raise GatewayError(409, "a create with this Idempotency-Key is still under way")
            await asyncio.sleep(0.05)
        # the claim is a lease: a gateway that dies mid-create holds the key only until it
        # lapses, then a retry takes it over (and goes to the same node: _create)
        renewer = asyncio.create_task(self._renew_lease(team, key, mark))
        done = False
        try:
            done = await run(mark)
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if not done:  # failed: nothing was made, a retry may try again
                await self.store.unclaim_create(team, key, mark)

    def _domained(self, answer: Any) -> Any:
        """A sandbox, or a batch's results, as this gateway's clients reach them."""
        if isinstance(answer, list):
            for r in answer:
                if isinstance(r, dict) and r.get("sandbox"):
                    self.link.with_domain(r["sandbox"])
            return answer
        return self.link.with_domain(answer)

    async def _renew_lease(self, team: str, key: str, mark: str) -> None:
        while True:
            await asyncio.sleep(self.create_lease / 3)
            try:
                if not await self.store.renew_create(team, key, mark, self.create_lease):
                    log.warning("create lost its Idempotency-Key lease (the gateway stalled "
                                "longer than the lease)", extra={"team": team})
                    return
            except Exception as exc:  # the next renewal may get through in time
                log.warning("cannot renew a create's lease: %s", exc)

    async def _settled(self, team: str, key: str, mark: str, node: Node,
                       created: dict[str, Any]) -> dict[str, Any]:
        """The answer of a keyed create that made `created`: its own, unless its lease lapsed
        and another create's answer holds the key (then ours is a duplicate: removed)."""
        deadline = time.monotonic() + CREATE_PENDING_SECONDS
        while True:
            held = await self.store.finish_create(team, key, mark, json.dumps(created))
            if held is None:
                return created
            if not held.startswith(PENDING):
                theirs: dict[str, Any] = json.loads(held)
                mine = created["sandboxID"]
                if theirs.get("sandboxID") != mine:
                    log.warning("removing a duplicate of a keyed create", extra={
                        "sandbox_id": mine, "node": node.node_id})
                    with contextlib.suppress(httpx.HTTPError):
                        await self.link.http.delete(f"{node.url}/sandboxes/{mine}", timeout=60,
                                               headers=self.link.node_headers(node, team))
                    await self.scheduler.release(mine)
                    await self.store.forget_sandbox(mine)
                return theirs
            # a retry took the key over and is creating: it went to our node, whose memory of
            # the key gives it our sandbox; wait for its answer
            if time.monotonic() > deadline:
                return created
            await asyncio.sleep(0.05)

    async def _create(self, request: Request, send: Send, team: str, raw: bytes,
                      key: str | None, mark: str = "") -> bool:
        """Place and create; True once a sandbox was made (and recorded under `key`)."""
        body = json_body(raw)
        template = body.get("templateID") if isinstance(body, dict) else None
        if not isinstance(template, str) or not template:
            # the node names what is wrong with the body
            await send_answer(send, await self.link.call(await self.link.any_node(), request,
                                                         team, raw))
            return False
        bare = template.split(":")[0]
        owned = (await self.store.owned("snapshot", bare, team)
                 or await self.store.owned("template", bare, team))
        if owned is not None and owned.team != team:
            raise GatewayError(404, f"template '{template}' not found")
        # else a built-in template, or nothing of this team's: the node resolves the name in
        # the team's scope (another team's of that name is not found)
        node = None
        if owned is not None:
            node = await self.link.node_by_id(owned.node)
        elif key is not None:
            # a create that took over a lapsed lease goes where the dead gateway's went: that
            # node's memory of the key answers with its sandbox, even one still being made
            before = await self.store.create_node(team, key)
            node = next((n for n in await self.link.up_nodes() if n.node_id == before), None)
        if isinstance(body, dict) and body.get("volumeMounts"):
            node = await self._with_volumes(node, template, team)
        # a node fixed by the template or the key is the only one; else the scheduler's
        # choice, and the next one's when it refuses for room
        placed = (Placed(node) if node is not None
                  else await self.scheduler.schedule(template=template, team=team))
        if isinstance(body, dict) and body.get("count") is not None:  # a batch (an extension)
            async with self.placing(placed):
                if owned is not None and owned.kind == "snapshot":  # spills as a snapshot's
                    answer = await self.batches.from_snapshot(request, team, placed.node,
                                                              owned.id, raw)
                else:
                    answer = await self.batches.from_template(
                        request, team, placed, raw, template if node is None else None)
            return await self._batch_answer(send, team, answer, key, mark)
        headers = None
        sent_to = None
        if key is not None:
            # the node's own Idempotency-Key memory has no teams: a key of the team's own
            digest = hashlib.sha256(f"{team}\0{key}".encode()).hexdigest()
            headers = [(b"idempotency-key", digest.encode())]
            keyed: str = key

            async def sent_to(node: Node) -> None:
                await self.store.create_sent_to(team, keyed, node.node_id)
        async with self.placing(placed), self.quotas.new_sandboxes(team, 1) as made:
            placed, answer = await self.place(request, team, raw, placed,
                                               template if node is None else None, headers,
                                               sent_to)
            made.answer(answer)
        if answer.status_code != 201:
            await send_answer(send, answer)
            return False
        created = answer.json()
        sandbox_id = created["sandboxID"]
        await self.store.own_sandboxes(team, [sandbox_id])
        await self.scheduler.record(sandbox_id, placed.node, team, placed.reservation)
        if key is not None:
            created = await self._settled(team, key, mark, placed.node, created)
        await send_json(send, 201, self.link.with_domain(created))
        return True

    async def _with_volumes(self, node: Node | None, template: str, team: str) -> Node | None:
        """Where a sandbox that mounts volumes is made: on the node of the team's volumes (a
        sandbox mounts its own node's only; control/gateway/volumes.py), which must be the
        template's if that is fixed. A team without volumes: as before (the node says which
        volume is not found)."""
        home = await self.link.volume_home(team)
        if home is None or node is None or node.node_id == home.node_id:
            return home or node
        raise GatewayError(409, f"the template '{template}' is on node {node.node_id} and the "
                           f"team's volumes on node {home.node_id}: a sandbox mounts the "
                           "volumes of its own node only; build the template again (it is "
                           "then placed by the scheduler) or mount no volumes")

    @contextlib.asynccontextmanager
    async def placing(self, placed: Placed) -> AsyncIterator[None]:
        """A placement whose create failed before any node answered (the team's quota, the node
        unreachable) gives its room back at once (else it would count for 60 s)."""
        try:
            yield
        except BaseException:
            await self.scheduler.cancel(placed.reservation)
            raise

    async def place(self, request: Request, team: str, raw: bytes, placed: Placed,
                     template: str | None, headers: list[tuple[bytes, bytes]] | None = None,
                     sent_to: Callable[[Node], Awaitable[None]] | None = None
                     ) -> tuple[Placed, httpx.Response]:
        """Send a create to its node; the node's answer and where it went. A node
        that refuses it for room (429 naming the resource: its own admission, which may see
        more than its last heartbeat said) when the scheduler chose it (`template` given) hands
        it on: the scheduler names the next node, the refusing ones left out, until one takes
        it; with none left, the last refusal is the answer. A placement that made nothing gives
        its room back."""
        tried: list[str] = []
        while True:
            try:
                if sent_to is not None:
                    await sent_to(placed.node)
                answer = await self.link.call(placed.node, request, team, raw, headers=headers)
            except BaseException:
                await self.scheduler.cancel(placed.reservation)  # a later node's
                raise
            if answer.status_code == 201:
                return placed, answer
            await self.scheduler.cancel(placed.reservation)
            resource = answer.headers.get(REFUSED_HEADER)
            if template is None or answer.status_code != 429 or not resource:
                return placed, answer
            tried.append(placed.node.node_id)
            self.metrics.placement_retries.labels(resource).inc()
            try:
                placed = await self.scheduler.schedule(template=template, team=team,
                                                       exclude=tuple(tried))
            except PlacementFailure as exc:
                log.info("no other node for a refused create: %s", exc.detail,
                         extra={"tried": tried})
                self.metrics.capacity_refusals.labels(resource).inc()
                return placed, answer

    async def fork(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        """A fork on its source's node (its memory and disk are there), running or paused; a
        paused one's children that node has no room for spill over (batch.py)."""
        binding = await self.link.own_binding(sandbox_id, team)
        raw = await self.link.body(request)

        async def run(mark: str) -> bool:
            answer = await self.batches.fork(request, team, binding.node, sandbox_id, raw)
            return await self._batch_answer(send, team, answer, key, mark)

        key = self._key(request)
        if key is None:
            await run("")
            return
        key = f"fork:{sandbox_id}\0{key}"  # not a create's key of the same name
        await self._once(send, team, key, run)

    async def snapshot_fork(self, request: Request, send: Send, team: str, ref: str) -> None:
        """A batch create from a snapshot, on the node that holds it (its layers are there);
        the children it has no room for spill over (batch.py)."""
        home = await self.link.snapshot_node(ref, team)
        raw = await self.link.body(request)
        owned = await self.store.owned("snapshot", bare_name(ref), team)
        snapshot = owned.id if owned is not None else bare_name(ref)

        async def run(mark: str) -> bool:
            answer = await self.batches.from_snapshot(request, team, home, snapshot, raw)
            return await self._batch_answer(send, team, answer, key, mark)

        key = self._key(request)
        if key is None:
            await run("")
            return
        key = f"snapshot-fork:{snapshot}\0{key}"
        await self._once(send, team, key, run)

    async def _batch_answer(self, send: Send, team: str, answer: Answer, key: str | None,
                            mark: str) -> bool:
        """Send a batch's answer (recorded under `key` when it made children); True when it
        made some."""
        if isinstance(answer, httpx.Response):
            await send_answer(send, answer)
            return False
        if key is not None:
            answer = await self._settled_batch(team, key, mark, answer)
        await send_json(send, 201, self._domained(answer))
        return True

    async def _settled_batch(self, team: str, key: str, mark: str,
                             results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A keyed batch's answer: its own, unless its lease lapsed and another batch's
        answer holds the key (then its children are duplicates: removed)."""
        held = await self.store.finish_create(team, key, mark, json.dumps(results))
        if held is None or held.startswith(PENDING):
            return results
        theirs: list[dict[str, Any]] = json.loads(held)
        for r in results:
            sandbox = r.get("sandbox") if isinstance(r, dict) else None
            if not sandbox:
                continue
            child = sandbox["sandboxID"]
            binding = await self.scheduler.lookup(child)
            log.warning("removing a duplicate child of a keyed batch",
                        extra={"sandbox_id": child})
            if binding is not None:
                with contextlib.suppress(httpx.HTTPError):
                    await self.link.http.delete(f"{binding.node.url}/sandboxes/{child}",
                                                timeout=60,
                                                headers=self.link.node_headers(binding.node,
                                                                               team))
            await self.scheduler.release(child)
            await self.store.forget_sandbox(child)
        return theirs

"""Batches through the gateway: a create with `count` (an extension), `POST /snapshots/{id}/fork`
and `POST /sandboxes/{id}/fork`. The answer is one list, a SandboxForkResult per child in the
order asked (its sandbox or its own error), as a node answers; the children a node refused for
room (its admission's 429, per child or for the whole request) are asked of other nodes
("spill-over") until all are placed or no node has room:

- a create from a template: the next node the scheduler offers, the full ones left out;
- a fork from a snapshot: another node can only restore a snapshot of
  the cluster's snapshot repository (AENV_SNAPSHOT_REPOSITORY, a registry prefix): the holding
  node pushes it there once (`/aenv/snapshots/push`, to PREFIX/<team>/spill:<id>), the others
  pull it lazily (`/aenv/snapshots/pull`: its layers come as the restore touches them) and
  make the refused children from their copy. When the team deletes the snapshot, the copies
  go and a node deletes the tag from the repository (`drop_copies`; the registry frees the
  blobs in its own garbage collection).
  Without the setting the refused children stay 429, their message naming it;
- a fork of a running sandbox does not spill: its memory is live on its node; nor does a fork
  of a paused one, nor a create with settings of its own (network, envVars, metadata, ...) from
  a snapshot: a copy's children are made with a count and a timeout only, so they would lack
  the parent's network policy and traffic token, or the body's settings (found by the red
  team). Their refused children stay 429, saying so.

The team's quota holds a place for every child while the batch is under way; those made keep
theirs, the refused ones give theirs back (GatewayQuotas). Every child made is the team's and
bound to its node; a node that fails after some children were made leaves them made and the
rest with its error: nothing is made that the answer does not name."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request

from agentenv.control.gateway.limits import GatewayQuotas, NewItems, fork_count
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import GatewayError, NodeLink, json_body
from agentenv.control.gateway.placement import Node, Placed, PlacementFailure, SchedulerLink
from agentenv.control.gateway.store import PREFIX, GatewayStore
from agentenv.node.admission import REFUSED_HEADER
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.control.gateway.batch")

REPOSITORY_ENV = "AENV_SNAPSHOT_REPOSITORY"
SPILL_HINT = (f"spilling a batch over to other nodes needs the cluster's snapshot repository "
              f"({REPOSITORY_ENV} on the gateway)")
#: the field of that memory naming the node that pushed the snapshot (it deletes the tag)
PUSHED_BY = "pushed_by"
#: what a batch from a snapshot may carry and still spill (a copy's children get only these)
SPILLABLE_FIELDS = frozenset({"count", "timeout", "templateID"})
NOT_SPILLABLE = ("not spilled over to other nodes: children made there from a copy of the "
                 "snapshot would not carry {what}")

#: a batch's answer: its results (201), or a node's answer as it is (an error before any
#: child was made)
Answer = list[dict[str, Any]] | httpx.Response


def repository(env: dict[str, str] | None = None) -> str:
    return setting_text(REPOSITORY_ENV, env).strip().rstrip("/")


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message}}


def _refused(result: dict[str, Any] | None) -> bool:
    error = result.get("error") if isinstance(result, dict) else None
    return isinstance(error, dict) and error.get("code") == 429


def message_of(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text[:500]
    return str(body.get("message", "")) if isinstance(body, dict) else answer.text[:500]


@dataclass
class Children:
    """The children of one batch, in the order asked; None: not asked of any node yet."""

    results: list[dict[str, Any] | None]
    #: the last refusal of a whole request for room (a node with no room for any)
    refusal: httpx.Response | None = None
    #: the last failure of a node asked for children that are still pending
    failure: dict[str, Any] | None = None
    spilled: int = 0
    nodes: list[str] = field(default_factory=list)

    @property
    def pending(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r is None or _refused(r)]

    @property
    def made(self) -> bool:
        return any(isinstance(r, dict) and r.get("sandbox") for r in self.results)

    def fill(self, error: dict[str, Any]) -> None:
        for i in self.pending:
            if self.results[i] is None:
                self.results[i] = error

    def noted(self, note: str) -> None:
        """The refused children's messages say why they were not asked elsewhere."""
        for r in self.results:
            if _refused(r) and r is not None:
                r["error"]["message"] = f"{r['error'].get('message', '')}; {note}"


#: asks `node` for `n` children: its answer
Ask = Callable[[Node, int], Awaitable[httpx.Response]]
#: the next node to ask, none of those tried (None: no node has room)
NextNode = Callable[[list[str]], Awaitable[Placed | None]]


class Batches:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore,
                 quotas: GatewayQuotas, metrics: GatewayMetrics) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store
        self.quotas = quotas
        self.metrics = metrics

    # --- the three kinds ------------------------------------------------------------------

    async def from_template(self, request: Request, team: str, placed: Placed, raw: bytes,
                            template: str | None) -> Answer:
        """A create with `count` on the placed node; when the scheduler placed it
        (`template` given) the children refused for room go to the next nodes it offers."""
        async def ask(node: Node, n: int) -> httpx.Response:
            return await self.link.call(node, request, team, _with_count(raw, n))

        async def next_node(tried: list[str]) -> Placed | None:
            if template is None:  # fixed by the template's owner: its node only
                return None
            return await self._schedule(template, team, tried)

        async with self.quotas.new_sandboxes(team, fork_count(raw)) as made:
            children = Children([None] * fork_count(raw))
            first = await self._spread(team, children, placed, ask, next_node, made, "template")
        return first if first is not None else self._finish(children, "template")

    async def from_snapshot(self, request: Request, team: str, home: Node, snapshot: str,
                            raw: bytes) -> Answer:
        """`POST /snapshots/{id}/fork`: on the node holding the snapshot, the refused children
        through the repository on others."""
        count = fork_count(raw)

        async def ask(node: Node, n: int) -> httpx.Response:
            return await self.link.call(node, request, team, _with_count(raw, n))

        async with self.quotas.new_sandboxes(team, count) as made:
            children = Children([None] * count)
            first = await self._spread(team, children, Placed(home), ask, _nowhere, made,
                                       "snapshot")
            if first is not None:
                return first
            if children.pending:
                extra = sorted(set(_body(raw)) - SPILLABLE_FIELDS)
                if extra:
                    self._note(children, NOT_SPILLABLE.format(
                        what="the request's " + ", ".join(extra)))
                else:
                    await self._through_repository(team, children, home, snapshot, raw, made)
        return self._finish(children, "snapshot")

    async def fork(self, request: Request, team: str, home: Node, sandbox_id: str,
                   raw: bytes) -> Answer:
        """`POST /sandboxes/{id}/fork` on the sandbox's node. A paused sandbox's children that
        node refused for room go through the repository to others; a running one's cannot."""
        count = fork_count(raw)

        async def ask(node: Node, n: int) -> httpx.Response:
            return await self.link.call(node, request, team, _with_count(raw, n))

        async with self.quotas.new_sandboxes(team, count) as made:
            children = Children([None] * count)
            first = await self._spread(team, children, Placed(home), ask, _nowhere, made, "fork")
            if first is not None:
                return first
            if children.pending and await self._paused(home, sandbox_id, team):
                self._note(children, NOT_SPILLABLE.format(
                    what="the paused sandbox's network policy, tokens and settings"))
        return self._finish(children, "fork")

    # --- the spreading ---------------------------------------------------------------------

    async def _spread(self, team: str, children: Children, placed: Placed | None, ask: Ask,
                      next_node: NextNode, made: NewItems, kind: str, *,
                      spill: bool = False) -> httpx.Response | None:
        """Ask node after node for the children still pending. An answer returned is the
        first node's error before any child was made (not a refusal for room): the client
        gets it as it is. A later node's failure leaves the children as they were (refused)
        and the next node is asked; `spill`: every node asked is a later one."""
        tried: list[str] = []
        while placed is not None:
            pending = children.pending
            node = placed.node
            first = not spill and not tried
            try:
                answer = await ask(node, len(pending))
            except Exception as exc:
                await self.scheduler.cancel(placed.reservation)
                if first:
                    raise
                log.warning("a node failed a batch's spill-over", extra={
                    "kind": kind, "team": team, "node": node.node_id, "error": str(exc)})
                children.failure = _error(503, str(exc))
                answer = None
            except BaseException:
                await self.scheduler.cancel(placed.reservation)
                raise
            body = answer.json() if answer is not None and answer.status_code == 201 else None
            if answer is None:
                pass
            elif isinstance(body, list) and len(body) == len(pending):
                ids = await self._keep(team, node, placed.reservation, pending, body, children,
                                       made)
                if (tried or spill) and ids:
                    self._spilled(kind, team, node, ids, children)
            else:
                await self.scheduler.cancel(placed.reservation)
                resource = answer.headers.get(REFUSED_HEADER)
                if answer.status_code == 429 and resource:
                    children.refusal = answer
                elif first:
                    return answer
                else:
                    log.warning("a node failed a batch's spill-over", extra={
                        "kind": kind, "team": team, "node": node.node_id,
                        "status": answer.status_code, "error": message_of(answer)})
                    children.failure = _error(answer.status_code, message_of(answer))
            if not children.pending:
                break
            tried.append(node.node_id)
            placed = await next_node(tried)
            if placed is not None and answer is not None and answer.status_code == 429:
                # handed on, as a create a node refused for room
                self.metrics.placement_retries.labels(
                    answer.headers.get(REFUSED_HEADER, "sandboxes")).inc()
        return None

    async def _keep(self, team: str, node: Node, reservation: str, pending: list[int],
                    body: list[Any], children: Children, made: NewItems) -> list[str]:
        """A node's results: in their places; the sandboxes the team's, bound to the node."""
        ids: list[str] = []
        for i, result in zip(pending, body, strict=True):
            if isinstance(result, dict) and isinstance(result.get("sandbox"), dict):
                ids.append(result["sandbox"]["sandboxID"])
            if not (_refused(children.results[i]) and _refused(result)):
                children.results[i] = result  # else the first refusal's words stay
        made.ids += ids  # they keep their quota places from now on, whatever follows
        await self.store.own_sandboxes(team, ids)
        for child in ids:  # the placement's room becomes the first child
            try:
                await self.scheduler.record(child, node, team, reservation)
            except PlacementFailure as exc:
                # made and the team's (own_sandboxes): the node's next heartbeat binds it, so
                # the answer names it rather than failing the batch over it
                log.warning("a batch's child not recorded: %s", exc.detail, extra={
                    "sandbox_id": child, "node": node.node_id})
            reservation = ""
        await self.scheduler.cancel(reservation)
        if ids:
            children.nodes.append(node.node_id)
        return ids

    def _spilled(self, kind: str, team: str, node: Node, ids: list[str],
                 children: Children) -> None:
        children.spilled += len(ids)
        self.metrics.batch_spilled.labels(kind).inc(len(ids))
        log.info("batch spilled over", extra={"kind": kind, "team": team, "node": node.node_id,
                                              "children": len(ids), "sandbox_ids": ids,
                                              "batch": len(children.results)})

    async def _schedule(self, template: str, team: str, tried: list[str]) -> Placed | None:
        try:
            return await self.scheduler.schedule(template=template, team=team,
                                                 exclude=tuple(tried))
        except PlacementFailure as exc:
            log.info("no other node for a batch's refused children: %s", exc.detail,
                     extra={"tried": tried})
            return None

    def _finish(self, children: Children, kind: str) -> Answer:
        """The answer: every node refused the whole batch: the last refusal as it is; else
        the results, those never asked with that refusal's words."""
        if children.refusal is not None and not any(children.results):
            self.metrics.capacity_refusals.labels(
                children.refusal.headers.get(REFUSED_HEADER, "capacity")).inc()
            return children.refusal
        if children.refusal is not None:
            children.fill(_error(429, message_of(children.refusal)))
        elif children.failure is not None:
            children.fill(children.failure)
        if children.pending:
            resource = (children.refusal.headers.get(REFUSED_HEADER, "capacity")
                        if children.refusal is not None else "capacity")
            self.metrics.capacity_refusals.labels(resource).inc()
        return [r if r is not None else _error(500, "not made") for r in children.results]

    # --- through the snapshot repository ---------------------------------------------------

    async def _through_repository(self, team: str, children: Children, home: Node,
                                  snapshot: str, raw: bytes, made: NewItems) -> None:
        """The pending children on other nodes, from `snapshot` pushed to the repository by
        `home` (once: a snapshot does not change). Without a repository, or when the push
        fails, they stay refused and say why."""
        prefix = repository()
        if not prefix:
            self._note(children, SPILL_HINT)
            return
        try:
            ref = await self._pushed(team, home, snapshot, prefix)
        except Exception as exc:  # the children made on `home` are the answer still
            why = exc.message if isinstance(exc, GatewayError) else f"{type(exc).__name__}"
            log.warning("batch not spilled: the push failed", extra={
                "team": team, "snapshot": snapshot, "node": home.node_id, "error": str(exc)})
            self._note(children, f"spill-over to other nodes failed: {why}")
            return
        timeout = _timeout(raw)

        async def ask(node: Node, n: int) -> httpx.Response:
            copy = await self._pulled(team, node, ref, snapshot)
            answer = await self._post(node, f"/snapshots/{copy}/fork", team,
                                      {"count": n, **timeout})
            if answer.status_code == 404:  # the copy is gone: pull it again
                await self._forget_copy(team, snapshot, node)
                copy = await self._pulled(team, node, ref, snapshot)
                answer = await self._post(node, f"/snapshots/{copy}/fork", team,
                                          {"count": n, **timeout})
            return answer

        async def next_node(tried: list[str]) -> Placed | None:
            return await self._schedule(snapshot, team, [home.node_id, *tried])

        placed = await next_node([])
        if placed is None:
            return
        await self._spread(team, children, placed, ask, next_node, made, "snapshot", spill=True)

    def _note(self, children: Children, note: str) -> None:
        children.noted(note)
        if children.refusal is not None:
            answer = children.refusal
            body = {"code": answer.status_code, "message": f"{message_of(answer)}; {note}"}
            children.refusal = httpx.Response(answer.status_code, headers={
                k: v for k, v in answer.headers.items()
                if k.lower() not in ("content-length", "content-encoding")}, json=body)

    async def _post(self, node: Node, path: str, team: str, body: dict[str, Any]
                    ) -> httpx.Response:
        try:
            return await self.link.http.post(node.url + path, json=body, timeout=600,
                                              headers=self.link.node_headers(node, team))
        except httpx.HTTPError as exc:
            raise GatewayError(503, f"node unavailable: {node.node_id}: {exc}") from exc

    def _memory(self, team: str, snapshot: str) -> str:
        return f"{PREFIX}spill:{team}:{snapshot}"

    async def _pushed(self, team: str, home: Node, name: str, prefix: str) -> str:
        """The repository reference of snapshot `name`, pushed by `home` once."""
        key = self._memory(team, name)
        known = await self.store._call(self.store.redis.hget(key, "ref"))
        if known:
            return str(known)
        ref = f"{prefix}/{team}/spill:{name}"
        answer = await self._post(home, "/aenv/snapshots/push", team,
                                  {"snapshot": name, "ref": ref})
        if answer.status_code != 200:
            raise GatewayError(answer.status_code, message_of(answer))
        log.info("snapshot pushed for a batch's spill-over", extra={
            "team": team, "snapshot": name, "node": home.node_id, "ref": ref})
        # Kept as long as the snapshot (no expiry): the tag is deleted from the repository
        # when the team deletes the snapshot (drop_copies), first by the node that pushed it.
        await self.store._call(self.store.redis.hset(key, "ref", ref))
        await self.store._call(self.store.redis.hset(key, PUSHED_BY, home.node_id))
        return ref

    async def _pulled(self, team: str, node: Node, ref: str, snapshot: str) -> str:
        """The id of `node`'s copy of `ref` (pulled lazily: its layers come as restores touch
        them), remembered per snapshot."""
        key = self._memory(team, snapshot)
        known = await self.store._call(self.store.redis.hget(key, f"node:{node.node_id}"))
        if known:
            return str(known)
        answer = await self._post(node, "/aenv/snapshots/pull", team, {"ref": ref})
        if answer.status_code != 201:
            raise GatewayError(answer.status_code, message_of(answer))
        copy = str(answer.json()["templateID"])
        await self.store._call(self.store.redis.hset(key, f"node:{node.node_id}", copy))
        return copy

    async def drop_copies(self, team: str, snapshot: str) -> None:
        """`snapshot` is gone (its team deleted it): the nodes' copies pulled for its spill-overs
        go too, its tag in the repository (`_drop_ref`), and what the gateway remembered of
        them. A node that cannot be asked keeps its copy (its own snapshot, deletable by the
        team like any)."""
        key = self._memory(team, snapshot)
        held = await self.store._call(self.store.redis.hgetall(key)) or {}
        for field_name, copy in held.items():
            if not field_name.startswith("node:"):
                continue
            node_id = field_name.removeprefix("node:")
            try:
                node = await self.link.node_by_id(node_id)
                answer = await self.link.http.delete(
                    f"{node.url}/templates/{copy}", timeout=60,
                    headers=self.link.node_headers(node, team))
                problem = (None if answer.status_code in (204, 404)
                           else {"status": answer.status_code})
            except (GatewayError, httpx.HTTPError) as exc:
                problem = {"error": str(exc)}
            if problem is not None:
                log.warning("a spill-over copy not removed", extra={
                    "team": team, "snapshot": snapshot, "node": node_id, "copy": copy,
                    **problem})
        if held.get("ref"):
            await self._drop_ref(team, snapshot, held["ref"], held.get(PUSHED_BY, ""))
        await self.store._call(self.store.redis.delete(key))

    async def _drop_ref(self, team: str, snapshot: str, ref: str, pushed_by: str) -> None:
        """The spill-over's tag deleted from the repository by a node (the one that pushed
        it, else the first up; `/aenv/snapshots/delete`, as the team: a node deletes only
        under the team's part of a repository). When none can, a warning names the ref: it
        stays in the registry (the operator deletes it) and the gateway forgets it all the
        same. The registry frees the blobs only in its own garbage collection."""
        problem: dict[str, Any] | None = None
        candidates: list[Node] = []
        with contextlib.suppress(GatewayError):
            if pushed_by:
                candidates.append(await self.link.node_by_id(pushed_by))
        with contextlib.suppress(Exception):
            candidates += [n for n in await self.link.up_nodes()
                           if n.node_id not in {c.node_id for c in candidates}]
        if not candidates:
            problem = {"error": "no node is up to delete it"}
        for node in candidates[:2]:  # the pusher, and one other if it fails
            try:
                answer = await self.link.http.post(
                    f"{node.url}/aenv/snapshots/delete", json={"ref": ref}, timeout=60,
                    headers=self.link.node_headers(node, team))
            except httpx.HTTPError as exc:
                problem = {"node": node.node_id, "error": f"node unavailable: {exc}"}
                continue
            if answer.status_code == 200:
                log.info("a spill-over's tag deleted from the snapshot repository", extra={
                    "team": team, "snapshot": snapshot, "ref": ref, "node": node.node_id})
                return
            problem = {"node": node.node_id, "status": answer.status_code,
                       "error": message_of(answer)}
            if answer.status_code == 403:
                break  # the tenancy rule's answer: another node gives the same
        log.warning("a spill-over's tag not deleted from the snapshot repository: %s", ref,
                    extra={"team": team, "snapshot": snapshot, "ref": ref, **(problem or {})})

    async def _forget_copy(self, team: str, snapshot: str, node: Node) -> None:
        await self.store._call(self.store.redis.hdel(self._memory(team, snapshot),
                                                     f"node:{node.node_id}"))

    async def _paused(self, node: Node, sandbox_id: str, team: str) -> bool:
        """Whether the sandbox is paused (False: running, or not known)."""
        with contextlib.suppress(GatewayError, ValueError):
            answer = await self.link.get(node, f"/sandboxes/{sandbox_id}", team)
            return answer.status_code == 200 and answer.json().get("state") == "paused"
        return False


async def _nowhere(tried: list[str]) -> Placed | None:
    return None


def _with_count(raw: bytes, count: int) -> bytes:
    """The request's body asking for `count` children (the rest of it as it was); as it came
    when that is what it asks (the node judges a bad count)."""
    if fork_count(raw) == count:
        return raw
    body = json_body(raw)
    if not isinstance(body, dict):
        return raw  # the node names what is wrong
    return json.dumps({**body, "count": count}).encode()


def _timeout(raw: bytes) -> dict[str, Any]:
    timeout = _body(raw).get("timeout")
    return {} if timeout is None else {"timeout": timeout}


def _body(raw: bytes) -> dict[str, Any]:
    body = json_body(raw)
    return body if isinstance(body, dict) else {}

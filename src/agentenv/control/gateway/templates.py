"""Template routes through the gateway: a new template is built next to the team's others (or
where the scheduler places it) and recorded as the team's, on that node; every later route of
it goes there. Built-in templates (no team's) are on every node; no team may claim, change or
delete them. A build's signed file upload URL needs no API key: it is relayed as exactly what
the node signed, for the template's team."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from starlette.requests import Request

from agentenv import boundedjson
from agentenv.api.template_models import FILES_HASH, UPLOAD_PREFIX
from agentenv.control.gateway.limits import GatewayQuotas, NewItems, TeamShares
from agentenv.control.gateway.nodes import (
    GatewayError,
    NodeLink,
    bare_name,
    json_body,
    send_answer,
)
from agentenv.control.gateway.placement import Node, SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.relay.stream import Send

log = logging.getLogger("agentenv.control.gateway.templates")

#: a build file upload: exactly what the node's signed URL names (template id, hash)
_UPLOAD_ID = re.compile(r"[a-z0-9]{1,63}")


class Templates:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore,
                 quotas: GatewayQuotas, team_shares: TeamShares,
                 snapshot_deleted: Callable[[str, str], Awaitable[None]] | None = None) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store
        self.quotas = quotas
        self.team_shares = team_shares
        #: (team, snapshot id) after a team deleted a snapshot: its spill-over copies go
        self.snapshot_deleted = snapshot_deleted

    async def build_template(self, request: Request, send: Send, team: str) -> None:
        raw = await self.link.body(request)
        body = json_body(raw)
        name = ""
        if isinstance(body, dict):
            name = str(body.get("name") or body.get("alias") or "").split(":")[0]
        owned = await self.store.owned("template", name, team) if name else None
        new_template = False
        if owned is not None and owned.team == team:
            node = await self.link.node_by_id(owned.node)  # a rebuild: where the template is
        elif name:
            # names are per team (the nodes keep them so): only a built-in's is no team's
            await self._refuse_shared_name(name, team)
            node = await self._new_build_node(name, team, body)
            new_template = True
        else:  # the node names what is wrong with the body
            node = await self.link.any_node()
        # a new template holds a place of the team's quota from before the node is asked
        async with (self.quotas.new_item(team, "templates") if new_template
                    else contextlib.nullcontext(NewItems())) as made:
            answer = await self.link.call(node, request, team, raw)
            if answer.status_code in (200, 201, 202):
                template_id = answer.json().get("templateID")
                if template_id:
                    await self.store.own("template", template_id, team, node.node_id,
                                         [name] if name else [])
                    await self.store.note_build_node(team, node.node_id)
                    made.ids.append(template_id)
        await send_answer(send, answer)

    async def _new_build_node(self, name: str, team: str, body: dict[str, Any]) -> Node:
        """Where a new template of `team` is built: next to the team's templates (the node it
        last built one on that is up and has room), as the build's base (`fromTemplate`, sent
        only later, in build_start) is most likely one of them; else the scheduler's choice."""
        vcpus, memory = body.get("cpuCount") or 2, body.get("memoryMB") or 1024  # node defaults
        if not isinstance(vcpus, int) or not isinstance(memory, int):
            vcpus, memory = 2, 1024  # the node names what is wrong with them
        homes = await self.store.build_nodes(team)
        if homes:
            nodes = {n.node_id: n for n in await self.scheduler.nodes()}
            for node_id in homes:
                node = nodes.get(node_id)
                if node is not None and node.up and not self.scheduler.misfit(node_id, vcpus,
                                                                                memory):
                    return node
        placed = await self.scheduler.schedule(template=name, team=team)
        # a build is no sandbox of the node's: its VM shows in the node's own figures
        await self.scheduler.cancel(placed.reservation)
        return placed.node

    async def build_start(self, request: Request, send: Send, team: str, template_id: str,
                          build_id: str) -> None:
        """The trigger of a build (after the file uploads): its body names the base."""
        node = await self.link.template_node(template_id, team)
        raw = await self.link.body(request)
        await self._check_build_base(raw, node, team)
        await send_answer(send, await self.link.call(node, request, team, raw))

    async def _check_build_base(self, raw: bytes, node: Node, team: str) -> None:
        """Refuse, before the node starts anything, a base (`fromTemplate`) the node building
        the template cannot have: another team's template (400 as the node's "not found"), or
        one of the team's own that sits on another node (409: a template's builds stay on the
        node the build was placed on when the base was not known yet)."""
        try:
            body = boundedjson.loads(raw or b"{}", "the request body")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return  # the node names what is wrong with the body
        base = body.get("fromTemplate") if isinstance(body, dict) else None
        if not isinstance(base, str) or not base:
            return
        bare = bare_name(base)
        for kind in ("template", "snapshot"):
            owned = await self.store.owned(kind, bare, team)
            if owned is None:
                continue
            if owned.team != team:
                raise GatewayError(400, f"template '{base}' not found")
            if owned.node != node.node_id:
                # the team's next new template goes next to this base (build it again there)
                await self.store.note_build_node(team, owned.node)
                raise GatewayError(409, (
                    f"the base template '{base}' is on node {owned.node}, but this build was "
                    f"placed on node {node.node_id} (a build is placed before its base is "
                    f"known: node {owned.node} was down or full then) and a node builds only "
                    f"from the templates it holds. Delete this template and build it again "
                    f"once node {owned.node} is up with room (a new template of the team goes "
                    f"to it), or build from a template on node {node.node_id}"))
            return
        # else a built-in, or not the team's: the node resolves it in the team's scope

    async def _refuse_shared_name(self, name: str, team: str) -> None:
        """400 for the name of a template no team built (a node's `base`): no team may claim it,
        not even for the moment the node takes to refuse the build."""
        node = await self.link.any_node()
        probe = await self.link.get(node, f"/templates/aliases/{quote(name, safe='')}", team)
        if probe.status_code == 200:
            template_id = str(probe.json().get("templateID", ""))
            if not await self.store.owned_ids("template", [template_id]):
                raise GatewayError(400, f"the template name {name!r} is a built-in template's")

    async def template_forward(self, request: Request, send: Send, team: str, ref: str,
                               *_: str) -> None:
        node = await self.link.template_node(ref, team)
        await self.link.forward(node, request, send, team)

    async def template_files(self, request: Request, send: Send, team: str, template_id: str,
                             files_hash: str) -> None:
        """A signed upload URL (no API key: the node checks the signature; the file may be
        large), relayed as exactly the `/template-files/{templateID}/{hash}` it was matched
        as, for the team whose template it is."""
        if not (_UPLOAD_ID.fullmatch(template_id) and FILES_HASH.fullmatch(files_hash)):
            # exactly what the node's signed URL names, nothing else is relayed
            raise GatewayError(404, f"route not found: {request.method} {request.url.path}")
        owned = await self.store.owned("template", template_id)
        if owned is None:
            raise GatewayError(404, f"template '{template_id}' not found")
        node = await self.link.node_by_id(owned.node)
        with self.team_shares.hold(owned.team):
            await self.link.relay_to(node, request, send, owned.team, template_id,
                                     f"{UPLOAD_PREFIX}{template_id}/{files_hash}")

    async def tags_change(self, request: Request, send: Send, team: str) -> None:
        raw = await self.link.body(request)
        body = json_body(raw)
        target = ""
        if isinstance(body, dict):
            target = str(body.get("target") or body.get("name") or "")
        # tags of shared templates are no team's to change
        node = (await self.link.template_node(target, team, own_only=True) if target
                else await self.link.any_node())
        await send_answer(send, await self.link.call(node, request, team, raw))

    async def template_alias(self, request: Request, send: Send, team: str, alias: str) -> None:
        node = await self.link.template_node(alias, team)
        await send_answer(send, await self.link.call(node, request, team))

    async def delete_template(self, request: Request, send: Send, team: str, ref: str) -> None:
        bare = bare_name(ref)
        owned = await self.store.owned("template", bare, team)
        if owned is None:
            owned = await self.store.owned("snapshot", bare, team)
        if owned is None or owned.team != team:
            # shared templates are not any team's to delete
            raise GatewayError(404, f"template '{ref}' not found")
        node = await self.link.node_by_id(owned.node)
        answer = await self.link.call(node, request, team)
        if answer.status_code == 204:
            await self.store.disown(owned.kind, owned.id, team, [bare])
            if owned.kind == "snapshot" and self.snapshot_deleted is not None:
                try:
                    await self.snapshot_deleted(team, owned.id)
                except Exception as exc:  # the delete itself is done: the answer says so
                    log.warning("spill-over copies of a deleted snapshot not removed",
                                extra={"team": team, "snapshot": owned.id, "error": str(exc)})
        await send_answer(send, answer)

"""The tag routes of the template build API (E2B template versions; the tag rules are
node/template_tags.py's): a template's tags, and moving or removing them."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api import models
from agentenv.api.bodies import read_model
from agentenv.api.errors import BadRequest, NotFound
from agentenv.api.template_models import (
    AssignTemplateTagsRequest,
    DeleteTemplateTagsRequest,
)
from agentenv.api.tenancy import scope_team
from agentenv.node.build_records import BuildRecords
from agentenv.node.records import DEFAULT_TAG, TemplateRecord
from agentenv.node.template_tags import normalize_tags, split_tag

log = logging.getLogger("agentenv.node.template_api")


class TagRoutes:
    def __init__(self, records: BuildRecords) -> None:
        self.records = records
        self.catalogue = records.catalogue

    async def _tagged_template(self, id_or_name: str, team: str,
                               change: bool = True) -> TemplateRecord:
        """A registered template built through this API (its tag records made if it predates
        them). Snapshots and built-in templates have no tags: 400 when `change`-ing them."""
        tpl = self.records.registered(id_or_name, team)
        if tpl is None:
            pending = self.records.pending(id_or_name, team)
            if pending is not None:
                raise NotFound(f"template '{id_or_name}' has no ready build yet ({pending.build_id}"
                               f" is {pending.status}): tags name ready builds")
            raise NotFound(f"template '{id_or_name}' not found")
        if not change and (tpl.kind != "template" or self.records.builtin(tpl)):
            return tpl
        if tpl.kind != "template":
            raise BadRequest(f"'{id_or_name}' is a sandbox snapshot, not a template: "
                             "snapshots have no tags")
        if self.records.builtin(tpl):
            raise BadRequest(f"template '{id_or_name}' is built into this node: it has no tags")
        await self.catalogue.tags.adopt_untagged(
            tpl.template_id, self.records.newest_ready(tpl.template_id))
        return self.catalogue.templates[tpl.template_id]

    async def tags(self, request: Request) -> Response:
        self.records.load()
        id_or_name = request.path_params["template_id"]
        if ":" in id_or_name:
            raise BadRequest(f"give a template id or name without a tag, not {id_or_name!r}")
        tpl = await self._tagged_template(split_tag(id_or_name)[0], scope_team(request.scope), change=False)
        return JSONResponse([
            {"tag": t.tag, "buildID": t.build_id, "createdAt": models.iso(t.assigned_at)}
            for t in self.catalogue.tags.of(tpl.template_id)])

    async def assign_tags(self, request: Request) -> Response:
        self.records.load()
        body = await read_model(request, AssignTemplateTagsRequest)
        name, source = split_tag(body.target)
        if not name:
            raise BadRequest("target must be 'name:tag' (or 'name' for its default build)")
        if not body.tags:
            raise BadRequest("tags must name at least one tag to assign")
        tags = normalize_tags(body.tags)
        source = DEFAULT_TAG if source is None or not source.strip() else source
        tpl = await self._tagged_template(name, scope_team(request.scope))
        build = await self.catalogue.tags.assign(tpl.template_id, source, tags)
        log.info("template tags assigned", extra={"template_id": tpl.template_id,
                                                  "build_id": build.build_id, "tags": tags})
        return JSONResponse({"tags": tags, "buildID": build.build_id}, status_code=201)

    async def remove_tags(self, request: Request) -> Response:
        self.records.load()
        body = await read_model(request, DeleteTemplateTagsRequest)
        name, tag = split_tag(body.name)
        if tag is not None:
            raise BadRequest(f"name is a template name without a tag, not {body.name!r}; "
                             "list the tags to remove in tags")
        if not body.tags:
            raise BadRequest("tags must name at least one tag to remove")
        tags = normalize_tags(body.tags)
        tpl = await self._tagged_template(name, scope_team(request.scope))
        await self.catalogue.tags.remove(tpl.template_id, tags)
        log.info("template tags removed", extra={"template_id": tpl.template_id, "tags": tags})
        return Response(status_code=204)

"""The template catalogue: every template and snapshot the node knows, by id and by name.

Templates (built, or provided by the backend) and snapshots (taken of sandboxes) are one kind of
record (node/records.py `TemplateRecord`): a snapshot id works as a templateID. The catalogue
keeps them in memory and in the store, keeps names unique, resolves "name:tag" through the tags
(node/template_tags.py) and deletes a template's data when the template goes.

Each record is of a team (api/tenancy.py), and names are per team: the same name in two teams
names two things. A team sees its own records and the built-in templates (tenancy.SHARED, every
team's), by id and by name; nobody's name may be a built-in's. The sandbox state
machine (node/orchestrator.py) resolves templates here and registers the snapshots it takes; the
API (node/api.py) and the template service (node/template_api.py) use it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from agentenv.api.errors import BadRequest, Conflict, NotFound
from agentenv.api.tenancy import SHARED
from agentenv.node.backend import BackendError, DefaultTemplate, SandboxBackend, TemplateRef
from agentenv.node.records import TemplateRecord
from agentenv.node.store import Store
from agentenv.node.template_tags import TemplateTags

log = logging.getLogger("agentenv.node.catalogue")


class TemplateCatalogue:
    """Templates and snapshots by id and by name, with their tags."""

    def __init__(self, store: Store, backend: SandboxBackend,
                 collect_soon: Callable[[], None] = lambda: None) -> None:
        """`collect_soon` asks for a garbage collection pass (node/gc.py) after data went."""
        self.store = store
        self.backend = backend
        self.collect_soon = collect_soon
        self.templates: dict[str, TemplateRecord] = {}
        #: ids of the templates the backend provides itself (never deleted through the API)
        self.builtin_templates: set[str] = set()
        #: tags of the templates (E2B "name:tag")
        self.tags = TemplateTags(self)
        #: (team, name) -> id
        self._names: dict[tuple[str, str], str] = {}

    # --- loading -----------------------------------------------------------------------------

    async def load(self, defaults: list[DefaultTemplate], default_envd_version: str) -> None:
        """Read the stored templates and tags; register the backend's templates when missing."""
        for tpl in await self.store.load_templates():
            self._add(tpl)
        await self.tags.load()
        for default in defaults:
            existing = self.templates.get(default.name)
            if existing is None and any(name == default.name for _, name in self._names):
                continue  # the name was given to another template: that one wins
            if existing is not None:
                self.builtin_templates.add(existing.template_id)
                if existing.team != SHARED:  # recorded before teams were: every team's
                    existing.team = SHARED
                    await self.save(existing)
                sizes = (default.cpu_count, default.memory_mb, default.disk_size_mb)
                if sizes != (existing.cpu_count, existing.memory_mb, existing.disk_size_mb):
                    # A rebuild with other sizes: the record must say what the VM gets.
                    existing.cpu_count, existing.memory_mb, existing.disk_size_mb = sizes
                    existing.ref = default.ref
                    existing.updated_at = time.time()
                    await self.save(existing)
                continue
            now = time.time()
            self.builtin_templates.add(default.name)
            await self.save(
                TemplateRecord(
                    template_id=default.name,
                    kind="template",
                    names=[default.name],
                    ref=default.ref,
                    cpu_count=default.cpu_count,
                    memory_mb=default.memory_mb,
                    disk_size_mb=default.disk_size_mb,
                    envd_version=default.envd_version or default_envd_version,
                    created_at=now,
                    updated_at=now,
                    team=SHARED,
                )
            )

    # --- lookups -----------------------------------------------------------------------------

    def get(self, template_id: str) -> TemplateRecord | None:
        return self.templates.get(template_id)

    def __contains__(self, template_id: object) -> bool:
        return template_id in self.templates

    def of_kind(self, kind: str, team: str) -> list[TemplateRecord]:
        """The templates ("template") or the snapshots ("snapshot") `team` sees."""
        return [t for t in self.templates.values() if t.kind == kind and self.visible(t, team)]

    @staticmethod
    def visible(tpl: TemplateRecord, team: str) -> bool:
        """Whether `team` may see and use `tpl`: its own, or a built-in."""
        return tpl.team in (team, SHARED)

    def refs(self) -> Iterator[TemplateRef]:
        """The data of every template, snapshot and tagged build (what gc must keep)."""
        for tpl in self.templates.values():
            yield tpl.ref
        for build in self.tags.builds.values():
            yield build.ref

    def name_owner(self, name: str, team: str) -> str | None:
        """The id of the template or snapshot called `name` that `team` sees, if any."""
        return self._names.get((team, name)) or self._names.get((SHARED, name))

    def is_builtin(self, template_id: str) -> bool:
        return template_id in self.builtin_templates

    def resolve(self, id_or_name: str, team: str) -> TemplateRecord:
        """A template or snapshot `team` sees, by id, name or "name:tag"; NotFound names what
        was asked (another team's is not found either)."""
        tpl = self.templates.get(id_or_name)
        if tpl is not None and not self.visible(tpl, team):
            tpl = None
        if tpl is None:
            owner = self.name_owner(id_or_name, team)
            tpl = self.templates.get(owner) if owner is not None else None
        if tpl is None and ":" in id_or_name:  # "name:tag": that build of the template
            base, tag = id_or_name.rsplit(":", 1)
            return self.tags.resolve(self.resolve(base, team), tag, base)
        if tpl is None:
            raise NotFound(f"template '{id_or_name}' not found")
        return tpl

    # --- changes -----------------------------------------------------------------------------

    async def save(self, tpl: TemplateRecord) -> None:
        """Store `tpl` (replacing the record of its id) with its layer references; the caller
        has checked its names (the store refuses a taken one with NameTaken)."""
        await self.store.put_template(tpl)
        old = self.templates.get(tpl.template_id)
        if old:
            for name in old.names:
                self._names.pop((old.team, name), None)
        self._add(tpl)
        await self.store.set_layer_refs(tpl.kind, tpl.template_id, list(tpl.ref.layers))

    async def register(self, tpl: TemplateRecord) -> None:
        """Add or replace a template (template builds call this); its names must be free."""
        for name in tpl.names:
            owner = self.name_owner(name, tpl.team)
            if owner is not None and owner != tpl.template_id:
                raise Conflict(f"name {name!r} is already used by {owner}")
        await self.save(tpl)

    async def delete(self, id_or_name: str, team: str) -> None:
        """Delete a template or snapshot of `team` with its tagged builds and their data."""
        tpl = self.resolve(id_or_name, team)
        if tpl.template_id in self.builtin_templates:
            raise BadRequest(
                f"template '{id_or_name}' is built into this node and cannot be deleted"
            )
        await self.store.delete_template(tpl.template_id)
        await self.store.set_layer_refs(tpl.kind, tpl.template_id, [])
        self.templates.pop(tpl.template_id, None)
        for name in tpl.names:
            self._names.pop((tpl.team, name), None)
        refs = [tpl.ref]
        for build in self.tags.forget(tpl.template_id):
            if build.ref not in refs:
                refs.append(build.ref)
        for ref in refs:
            try:
                await self.backend.delete_snapshot(ref)
            except BackendError as exc:
                log.warning(
                    "template data not deleted",
                    extra={"template_id": tpl.template_id, "error": str(exc)},
                )
        self.collect_soon()

    def _add(self, tpl: TemplateRecord) -> None:
        self.templates[tpl.template_id] = tpl
        for name in tpl.names:
            self._names[(tpl.team, name)] = tpl.template_id

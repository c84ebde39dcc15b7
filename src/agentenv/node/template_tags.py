"""Template tags (E2B's "name:tag" template versions), kept by the template catalogue.

A tag names one build of a template. "default" is what a bare name means: a build requested
without tags gets it, so it moves to the newest such build; a build requested with tags gets
only those (as E2B does), except a template's first build, which always gets "default" too (a
template name must mean something). The template record's own snapshot (`TemplateRecord.ref`)
is always the "default" build's; the other tagged builds are kept as `BuildSnapshot`s.

A build that loses its last tag is released: its row and layer references go, and its
snapshot is deleted unless it is the template's current one (sandboxes started from it keep
their files, see node/gc.py). Tags follow E2B's rules (infra `id.ValidateAndDeduplicateTags`):
trimmed and lower-cased, `[a-z0-9._-]`, at most 128 characters, never a UUID.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
import uuid
from typing import Protocol

from agentenv.api.errors import BadRequest, NotFound
from agentenv.node.backend import BackendError, SandboxBackend
from agentenv.node.records import DEFAULT_TAG, BuildSnapshot, TagAssignment, TemplateRecord
from agentenv.node.store import Store

log = logging.getLogger("agentenv.node.template_tags")

TAG_MAX_LENGTH = 128
MAX_TAGS_PER_TEMPLATE = 100
_TAG = re.compile(r"^[a-z0-9._-]+$")


def normalize_tag(raw: str) -> str:
    """E2B's tag rules; BadRequest names the tag and what is wrong with it."""
    tag = raw.strip().lower()
    if not tag:
        raise BadRequest(f"invalid tag {raw!r}: a tag cannot be empty")
    if len(tag) > TAG_MAX_LENGTH:
        raise BadRequest(f"invalid tag {raw[:40]!r}...: longer than {TAG_MAX_LENGTH} characters")
    if not _TAG.match(tag):
        raise BadRequest(f"invalid tag {raw!r}: use lower-case letters, digits, '.', '_' and '-'")
    with contextlib.suppress(ValueError):
        uuid.UUID(tag)
        raise BadRequest(f"invalid tag {raw!r}: a tag cannot be a UUID (build ids look like that)")
    return tag


def normalize_tags(raw: list[str]) -> list[str]:
    """Validated, de-duplicated, in the order given."""
    out: list[str] = []
    for item in raw:
        if not isinstance(item, str):
            raise BadRequest(f"invalid tag {item!r}: tags are strings")
        tag = normalize_tag(item)
        if tag not in out:
            out.append(tag)
    return out


def split_tag(name: str) -> tuple[str, str | None]:
    """"team/name:tag" -> ("name", "tag"); the team namespace is dropped (one team per node)."""
    base, sep, tag = name.partition(":")
    if "/" in base:
        base = base.rsplit("/", 1)[1]
    return base, (tag if sep else None)


class Templates(Protocol):
    """What the tags need of the template catalogue (node/catalogue.py), which holds them."""

    store: Store
    backend: SandboxBackend
    templates: dict[str, TemplateRecord]
    builtin_templates: set[str]

    async def register(self, tpl: TemplateRecord) -> None: ...

    def collect_soon(self) -> None: ...


class TemplateTags:
    """The tags and tagged builds of every template, in memory and in the store."""

    def __init__(self, catalogue: Templates) -> None:
        self.catalogue = catalogue
        self.builds: dict[str, BuildSnapshot] = {}
        self.tags: dict[str, dict[str, TagAssignment]] = {}  # template id -> tag -> assignment
        self.lock = asyncio.Lock()

    async def load(self) -> None:
        builds, tags = await self.catalogue.store.load_tags()
        self.builds = {b.build_id: b for b in builds}
        self.tags = {}
        for t in tags:
            self.tags.setdefault(t.template_id, {})[t.tag] = t

    # --- lookups -----------------------------------------------------------------------------

    def of(self, template_id: str) -> list[TagAssignment]:
        return sorted(self.tags.get(template_id, {}).values(), key=lambda t: (t.assigned_at, t.tag))

    def build_of(self, template_id: str, tag_or_build_id: str) -> BuildSnapshot | None:
        """The build a tag (or a build id, E2B's "name:<buildID>") of the template names."""
        assignment = self.tags.get(template_id, {}).get(tag_or_build_id.strip().lower())
        if assignment is not None:
            return self.builds.get(assignment.build_id)
        build = self.builds.get(tag_or_build_id.strip().lower())
        return build if build is not None and build.template_id == template_id else None

    def resolve(self, tpl: TemplateRecord, tag: str, shown_name: str) -> TemplateRecord:
        """The template as its tag `tag` means it (a copy with that build's snapshot)."""
        if tag.strip().lower() == DEFAULT_TAG and DEFAULT_TAG not in self.tags.get(
                tpl.template_id, {}):
            return tpl  # templates without tag records: the record is the default
        build = self._build_or_not_found(tpl.template_id, tag, shown_name)
        if build.build_id == tpl.build_id:
            return tpl
        return _as_build(tpl, build)

    def _build_or_not_found(self, template_id: str, tag: str, shown_name: str) -> BuildSnapshot:
        build = self.build_of(template_id, tag)
        if build is None:
            known = ", ".join(t.tag for t in self.of(template_id)) or "none"
            raise NotFound(f"tag '{tag}' of template '{shown_name}' not found (its tags: {known})")
        return build

    # --- changes -----------------------------------------------------------------------------

    async def adopt_untagged(self, template_id: str, build_id: str | None) -> None:
        """A template built before tags were kept has no tag records: its current snapshot
        becomes the "default" build (under `build_id`, its newest ready build, if known)."""
        tpl = self.catalogue.templates.get(template_id)
        if tpl is None or tpl.kind != "template" or self.tags.get(template_id) or \
                template_id in self.catalogue.builtin_templates or tpl.ref.data.get("builtin"):
            return
        build_id = tpl.build_id or build_id or str(uuid.uuid4())
        build = BuildSnapshot(
            build_id=build_id, template_id=template_id, ref=tpl.ref, cpu_count=tpl.cpu_count,
            memory_mb=tpl.memory_mb, disk_size_mb=tpl.disk_size_mb,
            envd_version=tpl.envd_version, created_at=tpl.updated_at)
        assignment = TagAssignment(template_id, DEFAULT_TAG, build_id, tpl.updated_at)
        await self.catalogue.store.update_tags([build], [assignment], [], [])
        self.builds[build_id] = build
        self.tags.setdefault(template_id, {})[DEFAULT_TAG] = assignment
        if tpl.build_id != build_id:
            await self.catalogue.register(dataclasses.replace(tpl, build_id=build_id))

    async def publish(self, tpl: TemplateRecord, build: BuildSnapshot, tags: list[str]) -> None:
        """A build is ready: register it and point `tags` at it. `tpl` is the template record
        it would make as the default build. Raises before changing anything on failure."""
        catalogue = self.catalogue
        async with self.lock:
            self.check_room(tpl.template_id, tags)
            old = catalogue.templates.get(tpl.template_id)
            if old is not None:
                await self.adopt_untagged(old.template_id, None)
            if old is None and DEFAULT_TAG not in tags:
                tags = [DEFAULT_TAG, *tags]
            if DEFAULT_TAG in tags or old is None:
                await catalogue.register(dataclasses.replace(
                    tpl, ref=build.ref, build_id=build.build_id))
            await self._point(tpl.template_id, build, tags)

    async def assign(self, template_id: str, source: str, tags: list[str]) -> BuildSnapshot:
        """Point `tags` at the build tag (or build id) `source` names."""
        async with self.lock:
            await self.adopt_untagged(template_id, None)
            tpl = self.catalogue.templates[template_id]
            self.check_room(template_id, tags)
            build = self._build_or_not_found(
                template_id, source, tpl.names[0] if tpl.names else template_id)
            if DEFAULT_TAG in tags and build.build_id != tpl.build_id:
                await self.catalogue.register(
                    dataclasses.replace(_as_build(tpl, build), updated_at=time.time()))
            await self._point(template_id, build, tags)
            return build

    async def remove(self, template_id: str, tags: list[str]) -> None:
        """Remove tags (an absent one is no error, as in E2B); "default" cannot go."""
        if DEFAULT_TAG in tags:
            raise BadRequest(f"the '{DEFAULT_TAG}' tag cannot be removed: assign it to another "
                             "build instead")
        async with self.lock:
            current = self.tags.get(template_id, {})
            gone = [(template_id, t) for t in tags if t in current]
            orphans = self._orphans(template_id, {t for _, t in gone}, {})
            await self.catalogue.store.update_tags([], [], gone, [b.build_id for b in orphans])
            for _, tag in gone:
                current.pop(tag, None)
            await self._release(orphans)

    def forget(self, template_id: str) -> list[BuildSnapshot]:
        """The template is deleted (the store drops its rows): its builds, to delete."""
        self.tags.pop(template_id, None)
        builds = [b for b in self.builds.values() if b.template_id == template_id]
        for b in builds:
            self.builds.pop(b.build_id, None)
        return builds

    # --- internals ---------------------------------------------------------------------------

    def check_room(self, template_id: str, tags: list[str]) -> None:
        current = self.tags.get(template_id, {})
        if len(set(current) | set(tags) | {DEFAULT_TAG}) > MAX_TAGS_PER_TEMPLATE:
            raise BadRequest(f"a template has at most {MAX_TAGS_PER_TEMPLATE} tags; remove some "
                             "first")

    async def _point(self, template_id: str, build: BuildSnapshot, tags: list[str]) -> None:
        self.check_room(template_id, tags)
        now = time.time()
        assignments = [TagAssignment(template_id, t, build.build_id, now) for t in tags]
        moved = {a.tag: a for a in assignments}
        orphans = [b for b in self._orphans(template_id, set(), moved)
                   if b.build_id != build.build_id]
        await self.catalogue.store.update_tags(
            [build], assignments, [], [b.build_id for b in orphans])
        self.builds[build.build_id] = build
        self.tags.setdefault(template_id, {}).update(moved)
        await self._release(orphans)

    def _orphans(self, template_id: str, removed: set[str],
                 moved: dict[str, TagAssignment]) -> list[BuildSnapshot]:
        """The template's builds no tag names once `removed` are gone and `moved` are set."""
        after = {tag: a.build_id for tag, a in self.tags.get(template_id, {}).items()
                 if tag not in removed}
        after.update({tag: a.build_id for tag, a in moved.items()})
        named = set(after.values())
        return [b for b in self.builds.values()
                if b.template_id == template_id and b.build_id not in named]

    async def _release(self, builds: list[BuildSnapshot]) -> None:
        catalogue = self.catalogue
        for build in builds:
            self.builds.pop(build.build_id, None)
            tpl = catalogue.templates.get(build.template_id)
            if tpl is not None and tpl.ref == build.ref:
                continue
            try:
                await catalogue.backend.delete_snapshot(build.ref)
            except BackendError as exc:
                log.warning("snapshot of an untagged build not deleted",
                            extra={"build_id": build.build_id, "error": str(exc)})
            log.info("template build released (no tag names it)",
                     extra={"template_id": build.template_id, "build_id": build.build_id})
        if builds:
            catalogue.collect_soon()


def _as_build(tpl: TemplateRecord, build: BuildSnapshot) -> TemplateRecord:
    """The template record as that build of it (its snapshot and sizes)."""
    return dataclasses.replace(
        tpl, ref=build.ref, cpu_count=build.cpu_count, memory_mb=build.memory_mb,
        disk_size_mb=build.disk_size_mb, envd_version=build.envd_version,
        build_id=build.build_id)

"""Template tags (E2B "name:tag" versions) through the official e2b SDK against a VM-backend
node: two builds of a tiny template (FROM the built-in base, each writing its own file
content), sandboxes started from each tag really run that build, Template.assign_tags /
remove_tags / get_tags end to end, bad input answered 4xx, the tags surviving a node restart
whose startup garbage collection (grace 0) must keep every tagged build's snapshot, and a
template delete removing its tags, tagged builds and their snapshots.

The store's migration and the tag tables are checked without a VM at the end."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import conftest
from .conftest import NodeProcess

NET_PREFIX = "att"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 30501
CACHE = Path("/var/cache/aenv-test/template-tags")



@pytest.fixture(scope="module")
def tag_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("tagnode")
    CACHE.mkdir(parents=True, exist_ok=True)
    # Grace 0: a startup collection takes whatever is not marked, so a tagged build's
    # snapshot survives the restart below only if gc.py marks it.
    node = conftest.vm_node_process(base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT, {
        "AENV_LAYER_CACHE": str(CACHE / "layer-cache"), "AENV_GC_GRACE_SECONDS": "0",
        **conftest.NO_READY_POOLS})
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


def _build(name: str, content: str, tags: list[str] | None = None, base: str = "base",
           append: bool = False) -> Any:
    from e2b import Template

    template = Template().from_template(base).run_cmd(
        f"printf {content} {'>>' if append else '>'} /home/user/which-build.txt")
    t0 = time.monotonic()
    info = Template.build(template, name, tags=tags, cpu_count=1, memory_mb=512,
                          skip_cache=True)
    print(f"\nbuild {name} {tags}: {time.monotonic() - t0:.1f} s")
    return info


@pytest.fixture(scope="module")
def builds(tag_node: NodeProcess) -> dict[str, str]:
    """Build 1 with tags=["v1"] (a first build also gets "default"), then build 2 without
    tags: "default" moves to it, "v1" stays on build 1."""
    name = f"tags-{uuid.uuid4().hex[:8]}"
    first = _build(name, "one", ["v1"])
    assert sorted(first.tags) == ["default", "v1"]
    second = _build(name, "two")
    assert second.template_id == first.template_id and second.build_id != first.build_id
    assert second.tags == ["default"]
    return {"name": name, "template_id": first.template_id, "b1": first.build_id,
            "b2": second.build_id}


def _which(template: str) -> str:
    """The build a sandbox of `template` runs (the file each build wrote)."""
    from e2b import Sandbox

    sbx = Sandbox.create(template=template, timeout=60)
    try:
        for attempt in range(10):
            try:
                return str(sbx.commands.run("cat /home/user/which-build.txt").stdout.strip())
            except Exception:
                if attempt == 9:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")
    finally:
        sbx.kill()


def _tags(template: str) -> dict[str, str]:
    from e2b import Template

    return {t.tag: t.build_id for t in Template.get_tags(template)}


def _snapshot_dirs(node: NodeProcess) -> set[str]:
    snaps = node.state_dir / "vm-backend" / "runtime" / "snapshots"
    return {p.name for p in snaps.iterdir()} if snaps.is_dir() else set()


def _db_rows(node: NodeProcess, sql: str, *args: object) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(node.state_dir / "node.db")
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _listed_builds(node: NodeProcess, template: str) -> set[str]:
    with node.client() as api:
        detail = api.get(f"/templates/{template}").json()
    assert detail["buildCount"] == len(detail["builds"])
    return {b["buildID"] for b in detail["builds"]}


def _build_record_dir(node: NodeProcess, build_id: str) -> str:
    [(doc,)] = _db_rows(node, "SELECT doc FROM template_builds WHERE build_id = ?", build_id)
    return Path(json.loads(doc)["ref"]["data"]["record_dir"]).name


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_tags_select_builds_and_survive_restart(tag_node: NodeProcess,
                                                builds: dict[str, str]) -> None:
    from e2b import Template
    from e2b.exceptions import TemplateException

    name, tid, b1, b2 = builds["name"], builds["template_id"], builds["b1"], builds["b2"]
    assert _tags(tid) == {"default": b2, "v1": b1}
    assert _tags(name) == {"default": b2, "v1": b1}  # by name too
    assert _which(name) == "two"
    assert _which(f"{name}:v1") == "one"
    assert _which(f"{name}:default") == "two"
    assert _which(f"{name}:{b1}") == "one"  # E2B's "name:<buildID>"

    # assign: from "name:v1" (normalized like E2B: trimmed, lower-cased); from "name" = default
    assigned = Template.assign_tags(f"{name}:v1", ["prod", " Canary "])
    assert assigned.build_id == b1 and sorted(assigned.tags) == ["canary", "prod"]
    assert Template.assign_tags(name, "stable").build_id == b2
    assert _tags(tid) == {"default": b2, "v1": b1, "prod": b1, "canary": b1, "stable": b2}
    Template.remove_tags(name, ["v1", "canary", "never-assigned"])  # absent tags: no error
    assert _tags(tid) == {"default": b2, "prod": b1, "stable": b2}
    b1_dir = _build_record_dir(tag_node, b1)
    assert b1_dir in _snapshot_dirs(tag_node)

    # the restart: tags come back from SQLite, and the startup collection (grace 0) keeps
    # build 1's snapshot because the "prod" tag still names it
    tag_node.stop()
    tag_node.start()
    assert _tags(tid) == {"default": b2, "prod": b1, "stable": b2}
    assert b1_dir in _snapshot_dirs(tag_node)
    assert _which(f"{name}:prod") == "one"
    assert _which(name) == "two"

    # moving "default" back to build 1 through assign_tags; then build 2 keeps only "stable"
    Template.assign_tags(f"{name}:prod", "default")
    assert _which(name) == "one"
    assert _tags(tid) == {"default": b1, "prod": b1, "stable": b2}
    b2_dir = _build_record_dir(tag_node, b2)
    assert _listed_builds(tag_node, name) == {b1, b2}
    Template.remove_tags(name, "stable")  # build 2: no tag left -> its snapshot is released
    assert _tags(tid) == {"default": b1, "prod": b1}
    assert _listed_builds(tag_node, name) == {b1}  # GET /templates/{id} lists kept builds only
    assert b2_dir not in _snapshot_dirs(tag_node)
    assert _db_rows(tag_node, "SELECT build_id FROM template_builds WHERE template_id = ?",
                    tid) == [(b1,)]
    assert _db_rows(tag_node, "SELECT COUNT(*) FROM layer_refs WHERE owner_kind = 'build' "
                    "AND owner_id = ?", b2) == [(0,)]
    with pytest.raises(TemplateException, match="default"):
        Template.remove_tags(name, "default")
    assert _which(f"{name}:prod") == "one"


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_bad_tags_and_unknown_ones(tag_node: NodeProcess, builds: dict[str, str]) -> None:
    """Clear 4xx answers naming the problem, never a 5xx."""
    from e2b import Sandbox, Template
    from e2b.exceptions import NotFoundException, SandboxException, TemplateException

    name = builds["name"]
    with pytest.raises((NotFoundException, SandboxException)) as raised:
        Sandbox.create(template=f"{name}:nope", timeout=30)
    assert "tag 'nope'" in str(raised.value)
    with pytest.raises(TemplateException, match="not found"):
        Template.assign_tags(f"{name}:nope", "x")
    with pytest.raises(TemplateException, match="not found"):
        Template.assign_tags("no-such-template:default", "x")
    with pytest.raises(TemplateException, match="not found"):
        Template.remove_tags("no-such-template", "x")
    with pytest.raises(TemplateException, match="not found"):
        Template.get_tags("no-such-template")
    with pytest.raises(TemplateException, match="invalid tag"):
        Template.assign_tags(name, "bad tag!")
    with httpx.Client(base_url=tag_node.url, headers={"X-API-KEY": tag_node.api_key},
                      timeout=30, trust_env=False) as api:
        cases = [
            ("post", "/templates/tags", {"target": name, "tags": [str(uuid.uuid4())]}, 400,
             "UUID"),
            ("post", "/templates/tags", {"target": name, "tags": ["x" * 129]}, 400, "128"),
            ("post", "/templates/tags", {"target": name, "tags": []}, 400, "at least one"),
            ("post", "/templates/tags", {"target": name, "tags": [""]}, 400, "empty"),
            ("post", "/templates/tags", {"target": name}, 422, "tags"),
            ("delete", "/templates/tags", {"name": f"{name}:prod", "tags": ["x"]}, 400,
             "without a tag"),
            ("post", "/v3/templates", {"name": f"{name}:Bad!"}, 400, "invalid tag"),
            ("post", "/v3/templates", {"name": name, "tags": ["ok", "no/slash"]}, 400,
             "invalid tag"),
            ("post", "/v3/templates", {"name": name, "tags": "v1"}, 422, "tags"),
        ]
        for method, path, body, status, words in cases:
            answer = api.request(method, path, json=body)
            assert answer.status_code == status, (body, answer.text)
            assert answer.json()["code"] == status and words in answer.json()["message"], (
                body, answer.text)
        missing = api.post("/v2/sandboxes", json={"templateID": f"{name}:nope"})
        assert missing.status_code == 404 and "tag 'nope'" in missing.json()["message"]
        assert api.post("/v2/sandboxes", json={"templateID": "base:v9"}).status_code == 404
        snapshot_tags = api.get("/templates/base/tags")
        assert snapshot_tags.status_code == 200 and snapshot_tags.json() == []


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_build_with_a_tag_keeps_default(tag_node: NodeProcess, builds: dict[str, str]) -> None:
    """E2B: a build given tags gets only those ("default" stays where it was); a template
    built FROM "name:tag" starts from that build."""
    name, tid = builds["name"], builds["template_id"]
    before = _tags(tid)
    third = _build(f"{name}:V3", "three")
    assert third.template_id == tid and third.tags == ["v3"]
    assert _tags(tid) == {**before, "v3": third.build_id}
    assert _which(f"{name}:v3") == "three"
    assert _which(name) == _which(f"{name}:{before['default']}")
    child = _build(f"{name}-child", "+child", base=f"{name}:v3", append=True)
    assert child.template_id != tid
    assert _which(f"{name}-child") == "three+child"
    assert _tags(child.template_id) == {"default": child.build_id}


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_untagging_a_build_while_a_sandbox_starts_from_it(tag_node: NodeProcess,
                                                          builds: dict[str, str]) -> None:
    """The last tag of a build removed while a create restores from it: the create still
    gets its snapshot (the backend counts it in use), which goes once the sandbox ends."""
    from concurrent.futures import ThreadPoolExecutor

    from e2b import Template

    name = builds["name"]
    race = _build(f"{name}:race", "race")
    race_dir = _build_record_dir(tag_node, race.build_id)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(_which, f"{name}:race")  # a cold restore: ~0.5-2 s
        time.sleep(0.1)  # resolved by then (the request takes < 50 ms); 0.05-0.15 s failed
        Template.remove_tags(name, "race")  # without the backend counting it in use
        assert started.result(timeout=120) == "race"
    deadline = time.monotonic() + 30
    while race_dir in _snapshot_dirs(tag_node) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert race_dir not in _snapshot_dirs(tag_node)


@pytest.mark.qemu
@pytest.mark.root
@pytest.mark.slow
def test_delete_template_removes_tags_and_builds(tag_node: NodeProcess,
                                                 builds: dict[str, str]) -> None:
    from e2b import Sandbox, Template
    from e2b.exceptions import TemplateException

    tid, name = builds["template_id"], builds["name"]
    build_ids = [b for (b,) in _db_rows(
        tag_node, "SELECT build_id FROM template_builds WHERE template_id = ?", tid)]
    v3 = _tags(tid)["v3"]
    assert v3 in build_ids and len(build_ids) == 2  # build 1 (default, prod) and build 3
    dirs = {b: _build_record_dir(tag_node, b) for b in build_ids}
    assert set(dirs.values()) <= _snapshot_dirs(tag_node)
    assert Sandbox.delete_snapshot(tid) is True  # DELETE /templates/{id}
    with pytest.raises(TemplateException, match="not found"):
        Template.get_tags(name)
    for table in ("template_tags", "template_builds"):
        assert _db_rows(tag_node, f"SELECT COUNT(*) FROM {table} WHERE template_id = ?",
                        tid) == [(0,)]
    for build_id in build_ids:
        assert _db_rows(tag_node, "SELECT COUNT(*) FROM layer_refs WHERE owner_kind = 'build' "
                        "AND owner_id = ?", build_id) == [(0,)]
    left = _snapshot_dirs(tag_node)
    [other] = [b for b in build_ids if b != v3]
    assert dirs[other] not in left
    # build 3's snapshot holds layers the "-child" template (built FROM name:v3) stands on:
    # released, and gone with the child
    v3_dir = tag_node.state_dir / "vm-backend" / "runtime" / "snapshots" / dirs[v3]
    assert (v3_dir / ".released").exists()
    child = Template.get_tags(f"{name}-child")[0]
    with httpx.Client(base_url=tag_node.url, headers={"X-API-KEY": tag_node.api_key},
                      timeout=30, trust_env=False) as api:
        child_id = api.get(f"/templates/aliases/{name}-child").json()["templateID"]
        assert api.delete(f"/templates/{child_id}").status_code == 204
    assert child.tag == "default"
    assert not v3_dir.exists()


def test_store_migration_and_tag_tables(tmp_path: Path) -> None:
    """A version-2 database (before tags) migrates; tags and builds round-trip, a build's
    layers are referenced, and a template delete takes its tags, builds and references."""
    from agentenv.node.backend import TemplateRef
    from agentenv.node.records import BuildSnapshot, TagAssignment, TemplateRecord
    from agentenv.node.store import MIGRATIONS, SCHEMA_VERSION, Store

    db = tmp_path / "node.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for step in MIGRATIONS[:2]:
        conn.executescript(step)
    conn.execute("INSERT INTO schema_version VALUES (2)")
    conn.commit()
    conn.close()

    async def run() -> None:
        store = Store(db)
        await store.open()
        try:
            assert await store.schema_version() == SCHEMA_VERSION >= 3
            ref = TemplateRef("template", {"record_dir": "/x"}, ("layer-a",))
            tpl = TemplateRecord("t1", "template", ["n1"], ref, 1, 512, 1024, "0.1", 1.0, 1.0,
                                 build_id="b1")
            await store.put_template(tpl)
            b1 = BuildSnapshot("b1", "t1", ref, 1, 512, 1024, "0.1", 1.0)
            b2 = BuildSnapshot("b2", "t1", TemplateRef("template", {}, ("layer-b",)), 2, 1024,
                               1024, "0.1", 2.0)
            await store.update_tags([b1, b2], [TagAssignment("t1", "default", "b1", 1.0),
                                               TagAssignment("t1", "v2", "b2", 2.0)], [], [])
            builds, tags = await store.load_tags()
            assert {b.build_id: b for b in builds} == {"b1": b1, "b2": b2}
            assert sorted((t.tag, t.build_id) for t in tags) == [("default", "b1"), ("v2", "b2")]
            assert (await store.load_templates())[0].build_id == "b1"
            assert await store.layer_ref_counts() == {"layer-a": 1, "layer-b": 1}
            await store.update_tags([], [], [("t1", "v2")], ["b2"])
            builds, tags = await store.load_tags()
            assert [b.build_id for b in builds] == ["b1"] and len(tags) == 1
            assert await store.layer_ref_counts() == {"layer-a": 1}
            await store.delete_template("t1")
            assert await store.load_tags() == ([], [])
            assert await store.layer_ref_counts() == {}
        finally:
            await store.close()

    asyncio.run(run())

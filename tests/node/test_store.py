"""SQLite persistence: migrations, round trips, names, layer references."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pytest

from agentenv.node.backend import Placement, TemplateRef
from agentenv.node.records import SandboxRecord, State, TemplateRecord
from agentenv.node.store import SCHEMA_VERSION, NameTaken, Store, StoreError


def record(sid: str = "iabc") -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        sandbox_id=sid,
        template_id="base",
        alias="base",
        state=State.RUNNING,
        started_at=now,
        end_at=now + 60,
        metadata={"a": "b"},
        env_vars={"X": "1"},
        auto_pause=True,
        auto_pause_memory=False,
        auto_resume=False,
        cpu_count=2,
        memory_mb=512,
        disk_size_mb=1024,
        envd_version="0.6.4",
        envd_access_token="tok",
        traffic_access_token=None,
        secure=True,
        allow_internet_access=False,
        network=None,
        source=TemplateRef("template", {"dir": "/x"}, ("layer1",)),
        placement=Placement("127.0.0.1", 1234, {"pid": 5}),
    )


def template(tid: str, names: list[str]) -> TemplateRecord:
    now = time.time()
    return TemplateRecord(
        template_id=tid,
        kind="snapshot",
        names=names,
        ref=TemplateRef("snapshot", {"dir": "/s"}, ("l1", "l2")),
        cpu_count=1,
        memory_mb=128,
        disk_size_mb=1024,
        envd_version="0.6.4",
        created_at=now,
        updated_at=now,
    )


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = Store(tmp_path / "node.db")
        await store.open()
        assert await store.schema_version() == SCHEMA_VERSION
        rec = record()
        await store.put_sandbox(rec)
        rec.state = State.PAUSED
        rec.placement = None
        await store.put_sandbox(rec)
        await store.put_template(template("s1", ["snap"]))
        await store.close()

        again = Store(tmp_path / "node.db")
        await again.open()
        (loaded,) = await again.load_sandboxes()
        assert loaded == rec
        (tpl,) = await again.load_templates()
        assert tpl.names == ["snap"] and tpl.ref.layers == ("l1", "l2")
        await again.delete_sandbox(rec.sandbox_id)
        assert await again.load_sandboxes() == []
        await again.close()

    asyncio.run(scenario())


def test_names_are_unique_and_layer_refs_count_owners(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = Store(tmp_path / "node.db")
        await store.open()
        await store.put_template(template("s1", ["a"]))
        with pytest.raises(NameTaken):
            await store.put_template(template("s2", ["a"]))
        await store.put_template(template("s2", ["b"]))
        await store.set_layer_refs("snapshot", "s1", ["l1", "l2"])
        await store.set_layer_refs("sandbox", "i1", ["l1"])
        assert await store.layer_ref_counts() == {"l1": 2, "l2": 1}
        await store.set_layer_refs("snapshot", "s1", [])
        assert await store.layer_ref_counts() == {"l1": 1}
        await store.delete_template("s1")
        await store.put_template(template("s3", ["a"]))  # the name is free again
        await store.close()

    asyncio.run(scenario())


def test_migrates_an_empty_database_and_refuses_a_newer_one(tmp_path: Path) -> None:
    path = tmp_path / "node.db"
    sqlite3.connect(path).close()  # version 0: no tables at all

    async def open_close() -> None:
        store = Store(path)
        await store.open()
        await store.close()

    asyncio.run(open_close())
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="upgrade"):
        asyncio.run(open_close())


def test_migrates_version_1_forward_and_keeps_its_rows(tmp_path: Path) -> None:
    """A database of the first schema (before pending operations) opens with its rows intact."""
    from agentenv.node.store import MIGRATIONS

    path = tmp_path / "node.db"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (1)")
    conn.execute("INSERT INTO sandboxes (id, state, doc) VALUES ('iold', 'paused', ?)",
                 (json.dumps(record("iold").to_row()),))
    conn.commit()
    conn.close()

    async def scenario() -> None:
        store = Store(path)
        await store.open()
        assert await store.schema_version() == SCHEMA_VERSION >= 2
        assert [r.sandbox_id for r in await store.load_sandboxes()] == ["iold"]
        assert await store.load_pending() == {}
        await store.close()

    asyncio.run(scenario())


def test_migrates_version_3_to_teams_the_old_rows_are_the_local_teams(tmp_path: Path) -> None:
    """Schema 4 (tenancy): a template, its name and a sandbox written before teams were are the
    API key holder's (`local`); after it, names are per team."""
    from dataclasses import replace

    from agentenv.api.tenancy import LOCAL_TEAM, SHARED
    from agentenv.node.store import MIGRATIONS

    path = tmp_path / "node.db"
    conn = sqlite3.connect(path)
    for step in MIGRATIONS[:3]:
        conn.executescript(step)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (3)")
    old = template("sold", ["kept"])
    conn.execute("INSERT INTO templates (id, kind, source_sandbox_id, created_at, doc) "
                 "VALUES ('sold', 'snapshot', NULL, 1.0, ?)",
                 (json.dumps({"names": ["kept"], "ref": old.ref.to_json(), "cpu_count": 1,
                              "memory_mb": 128, "disk_size_mb": 1024, "envd_version": "0.6.4",
                              "updated_at": 1.0}),))
    conn.execute("INSERT INTO template_names (name, template_id) VALUES ('kept', 'sold')")
    row = record("iold").to_row()
    del row["team"]
    conn.execute("INSERT INTO sandboxes (id, state, doc) VALUES ('iold', 'running', ?)",
                 (json.dumps(row),))
    conn.commit()
    conn.close()

    async def scenario() -> None:
        store = Store(path)
        await store.open()
        assert await store.schema_version() == SCHEMA_VERSION >= 4
        (tpl,) = await store.load_templates()
        assert (tpl.template_id, tpl.names, tpl.team) == ("sold", ["kept"], LOCAL_TEAM)
        assert [r.team for r in await store.load_sandboxes()] == [LOCAL_TEAM]
        with pytest.raises(NameTaken):  # the name is still the local team's
            await store.put_template(template("snew", ["kept"]))
        # another team's of that name is another thing; a built-in's name is nobody's
        await store.put_template(replace(template("sother", ["kept"]), team="beta"))
        await store.put_template(replace(template("base", ["base"]), team=SHARED))
        with pytest.raises(NameTaken):
            await store.put_template(replace(template("smine", ["base"]), team="beta"))
        teams = {t.template_id: t.team for t in await store.load_templates()}
        assert teams == {"sold": LOCAL_TEAM, "sother": "beta", "base": SHARED}
        await store.close()

    asyncio.run(scenario())


def test_pending_pause_and_its_finish_are_one_transaction(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = Store(tmp_path / "node.db")
        await store.open()
        rec = record("ip")
        rec.state = State.PAUSING
        await store.put_sandbox(rec)
        await store.put_pending("ip", "pause", 123.5, {"memory": True})
        await store.close()

        store = Store(tmp_path / "node.db")  # as a restarted node sees it
        await store.open()
        pending = await store.load_pending()
        assert list(pending) == ["ip"]
        assert (pending["ip"].op, pending["ip"].started_at) == ("pause", 123.5)
        assert pending["ip"].doc == {"memory": True}
        rec.state = State.PAUSED
        rec.placement = None
        rec.pause_snapshot = TemplateRef("paused", {"record_dir": "/snap"}, ("m1",))
        await store.finish_pause(rec, ["layer1", "m1"])
        assert await store.load_pending() == {}
        (loaded,) = await store.load_sandboxes()
        assert loaded.state == State.PAUSED and loaded.pause_snapshot == rec.pause_snapshot
        assert await store.layer_ref_counts() == {"layer1": 1, "m1": 1}
        await store.put_pending("ix", "pause", 1.0, {})
        await store.delete_pending("ix")
        assert await store.load_pending() == {}
        await store.close()

    asyncio.run(scenario())

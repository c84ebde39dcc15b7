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


EVENT_TYPES = ["sandbox.lifecycle.created", "sandbox.lifecycle.paused",
               "sandbox.lifecycle.killed", "template.build.started"]


def _events_store(tmp_path: Path) -> tuple[Path, list[tuple[int, str, str, str]]]:
    """A store with 3000 events of three teams, four types, forty sandboxes; (its file, every
    event's (seq, team, type, sandbox))."""
    path = tmp_path / "node.db"

    async def fill() -> list[int]:
        store = Store(path)
        await store.open()
        try:
            return await store.add_events([
                (1000.0 + i, EVENT_TYPES[(i * 7) % 4] if i % 97 else "sandbox.lifecycle.failed",
                 f"team{i % 3}", f"sb{i % 40}", json.dumps({"i": i})) for i in range(3000)])
        finally:
            await store.close()

    seqs = asyncio.run(fill())
    rows = [(seq, f"team{i % 3}",
             EVENT_TYPES[(i * 7) % 4] if i % 97 else "sandbox.lifecycle.failed", f"sb{i % 40}")
            for i, seq in enumerate(seqs)]
    return path, rows


FILTERS: list[dict[str, object]] = [
    {},
    {"sandbox_id": "sb7"},
    {"types": ["sandbox.lifecycle.failed"]},
    {"types": ["sandbox.lifecycle.failed", "template.build.started"]},
    {"types": ["sandbox.lifecycle.paused", "sandbox.lifecycle.killed",
               "sandbox.lifecycle.failed"]},
    {"sandbox_id": "sb3", "types": ["sandbox.lifecycle.killed"]},
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "-".join(map(str, f)) or "team")
def test_event_filters_are_answered_off_an_index(tmp_path: Path,
                                                 filters: dict[str, object]) -> None:
    """Every filter of `GET /events/sandboxes` is a SEARCH of an index that holds the team and
    the filter's column (type, sandbox): SQLite reads only the matching rows, never the
    team's every event (before migration 7 a type filter walked all of them)."""
    from agentenv.node.store import events_sql

    path, _ = _events_store(tmp_path)
    conn = sqlite3.connect(path)
    for ascending in (False, True):
        sql, args = events_sql("team1", sandbox_id=filters.get("sandbox_id"),  # type: ignore
                               types=filters.get("types", []),  # type: ignore[arg-type]
                               exclude_prefix="template.", after=5, before=2900, offset=3,
                               limit=10, ascending=ascending)
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args)]
        reads = [p for p in plan if p.startswith(("SEARCH events", "SCAN events"))]
        assert reads, plan
        for read in reads:
            assert read.startswith("SEARCH events USING INDEX"), plan
            assert "team=?" in read, plan
            if "sandbox_id" in filters:
                assert "events_team_sandbox" in read and "sandbox_id=?" in read, plan
            elif filters.get("types"):
                assert "events_team_type" in read and "type=?" in read, plan
        if len(set(filters.get("types", []))) > 1:  # type: ignore[arg-type]
            assert len(reads) == len(filters["types"])  # type: ignore[arg-type]
    conn.close()


def test_event_filters_and_paging_answer_what_a_scan_would(tmp_path: Path) -> None:
    """The index plans give the rows and order a plain filter of every event gives, for every
    filter, order and page (offset, `after`, `before`): pages walked by cursor meet end to
    end."""
    path, rows = _events_store(tmp_path)

    def naive(team: str, filters: dict[str, object], after: int, before: int | None,
              ascending: bool) -> list[int]:
        types = filters.get("types") or []
        found = [seq for seq, t, kind, sb in rows
                 if t == team and seq > after and (before is None or seq < before)
                 and ("sandbox_id" not in filters or sb == filters["sandbox_id"])
                 and (kind in types if types else not kind.startswith("template."))]
        return sorted(found, reverse=not ascending)

    async def check() -> None:
        store = Store(path)
        await store.open()
        try:
            for filters in FILTERS:
                for ascending in (False, True):
                    for after, before, offset, limit in ((0, None, 0, 100), (200, 2500, 7, 13),
                                                         (2990, None, 0, 5), (0, 3, 0, 10)):
                        got = await store.query_events(
                            "team2", sandbox_id=filters.get("sandbox_id"),  # type: ignore
                            types=filters.get("types", []),  # type: ignore[arg-type]
                            exclude_prefix="template.", after=after, before=before,
                            offset=offset, limit=limit, ascending=ascending)
                        want = naive("team2", filters, after, before, ascending)
                        assert [s for s, _ in got] == want[offset:offset + limit], filters
                    # paging by cursor: each page starts past the last one's last seq
                    walked: list[int] = []
                    while True:
                        last = walked[-1] if walked else None
                        page = await store.query_events(
                            "team2", sandbox_id=filters.get("sandbox_id"),  # type: ignore
                            types=filters.get("types", []),  # type: ignore[arg-type]
                            exclude_prefix="template.",
                            after=last if ascending and last else 0,
                            before=None if ascending or last is None else last,
                            offset=0, limit=37, ascending=ascending)
                        walked += [s for s, _ in page]
                        if len(page) < 37:
                            break
                    assert walked == naive("team2", filters, 0, None, ascending), filters
        finally:
            await store.close()

    asyncio.run(check())

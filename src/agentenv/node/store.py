"""SQLite persistence for the node: sandboxes, templates/snapshots, names, layer references,
operations in flight.

All SQL runs on one dedicated thread (sqlite3 connections are not shared across threads), so
the event loop never blocks on disk. Every write commits at once; WAL mode keeps the database
consistent when the node is killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agentenv.api.tenancy import SHARED
from agentenv.errors import AgentEnvError
from agentenv.node.backend import TemplateRef
from agentenv.node.records import (
    BuildSnapshot,
    SandboxRecord,
    TagAssignment,
    TemplateRecord,
    VolumeRecord,
)

T = TypeVar("T")

#: Forward-only migrations; index i brings the schema from version i to i + 1.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE TABLE templates (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        source_sandbox_id TEXT,
        created_at REAL NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE TABLE template_names (
        name TEXT PRIMARY KEY,
        template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE
    );
    CREATE TABLE layer_refs (
        layer_id TEXT NOT NULL,
        owner_kind TEXT NOT NULL,
        owner_id TEXT NOT NULL,
        PRIMARY KEY (layer_id, owner_kind, owner_id)
    );
    CREATE INDEX layer_refs_owner ON layer_refs(owner_kind, owner_id);
    """,
    # 2: operations whose result the backend writes before the node records it (a pause
    # snapshot): written before the backend starts, so a node killed in between can find the
    # result again at its next start (node/recovery.py).
    """
    CREATE TABLE pending_ops (
        sandbox_id TEXT PRIMARY KEY,
        op TEXT NOT NULL,
        started_at REAL NOT NULL,
        doc TEXT NOT NULL
    );
    """,
    # 3: template tags (E2B "name:tag"): the builds some tag points at, and the tags. Both go
    # with their template (ON DELETE CASCADE); a build no tag names is deleted with its snapshot.
    """
    CREATE TABLE template_builds (
        build_id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX template_builds_template ON template_builds(template_id);
    CREATE TABLE template_tags (
        template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL REFERENCES template_builds(build_id) ON DELETE CASCADE,
        assigned_at REAL NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    """,
    # 4: tenancy (api/tenancy.py): the team of each template and snapshot, and names per team
    # (the same name in two teams names two things). What was there is the API key holder's.
    """
    ALTER TABLE templates ADD COLUMN team TEXT NOT NULL DEFAULT 'local';
    CREATE TABLE team_template_names (
        team TEXT NOT NULL,
        name TEXT NOT NULL,
        template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
        PRIMARY KEY (team, name)
    );
    INSERT INTO team_template_names (team, name, template_id)
        SELECT 'local', name, template_id FROM template_names;
    DROP TABLE template_names;
    """,
    # 5: lifecycle events (node/events.py) with their node-wide order (seq), the teams'
    # webhooks (node/webhooks.py) and one row per delivery attempt. Events and attempts past
    # the retention are pruned.
    """
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        type TEXT NOT NULL,
        team TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX events_team ON events(team, seq);
    CREATE INDEX events_sandbox ON events(sandbox_id, seq);
    CREATE INDEX events_ts ON events(ts);
    CREATE TABLE webhooks (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE TABLE webhook_attempts (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        webhook_id TEXT NOT NULL,
        ts REAL NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE INDEX webhook_attempts_hook ON webhook_attempts(webhook_id, seq);
    CREATE INDEX webhook_attempts_ts ON webhook_attempts(ts);
    """,
    # 6: volumes (node/volumes.py), named per team (the same name in two teams names two)
    """
    CREATE TABLE volumes (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        name TEXT NOT NULL,
        created_at REAL NOT NULL,
        doc TEXT NOT NULL,
        UNIQUE (team, name)
    );
    """,
    # 7: each filter of the events has an index that leads with the team (every query names
    # one) and ends with seq, so a page comes in order off the index: a type filter reads only
    # that type's rows (team, type, seq), a sandbox's events only the sandbox's (team,
    # sandbox_id, seq). The old (sandbox_id, seq) is the second's tail
    """
    CREATE INDEX events_team_type ON events(team, type, seq);
    CREATE INDEX events_team_sandbox ON events(team, sandbox_id, seq);
    DROP INDEX events_sandbox;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class PendingOp:
    """An operation the node started on a sandbox and had not finished recording."""

    sandbox_id: str
    op: str
    started_at: float
    doc: dict[str, Any]


class StoreError(AgentEnvError):
    pass


class NameTaken(StoreError):
    pass


def _template_doc(rec: TemplateRecord) -> str:
    return json.dumps(
        {
            "names": rec.names,
            "ref": rec.ref.to_json(),
            "cpu_count": rec.cpu_count,
            "memory_mb": rec.memory_mb,
            "disk_size_mb": rec.disk_size_mb,
            "envd_version": rec.envd_version,
            "updated_at": rec.updated_at,
            "spawn_count": rec.spawn_count,
            "last_spawned_at": rec.last_spawned_at,
            "build_status": rec.build_status,
            "build_id": rec.build_id,
            "idle_pause_after": rec.idle_pause_after,
        }
    )


def _template_from(row: sqlite3.Row) -> TemplateRecord:
    doc = json.loads(row["doc"])
    return TemplateRecord(
        template_id=row["id"],
        kind=row["kind"],
        names=list(doc["names"]),
        ref=TemplateRef.from_json(doc["ref"]),
        cpu_count=doc["cpu_count"],
        memory_mb=doc["memory_mb"],
        disk_size_mb=doc["disk_size_mb"],
        envd_version=doc["envd_version"],
        created_at=row["created_at"],
        updated_at=doc["updated_at"],
        source_sandbox_id=row["source_sandbox_id"],
        spawn_count=doc.get("spawn_count", 0),
        last_spawned_at=doc.get("last_spawned_at"),
        build_status=doc.get("build_status", "ready"),
        build_id=doc.get("build_id"),
        team=row["team"],
        idle_pause_after=doc.get("idle_pause_after"),
    )


class Store:
    """Async facade over one SQLite database file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-store")
        self._conn: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._conn is not None, "store is not open"
            return fn(self._conn)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def open(self) -> None:
        def do_open() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {version}; this node knows up to "
                    f"{SCHEMA_VERSION}: upgrade agentenv"
                )
            for step in range(version, SCHEMA_VERSION):
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in MIGRATIONS[step].split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute("DELETE FROM schema_version")
                    conn.execute("INSERT INTO schema_version VALUES (?)", (step + 1,))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            self._conn = conn

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, do_open)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    async def close(self) -> None:
        def do_close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, do_close)
        self._executor.shutdown(wait=True)

    async def schema_version(self) -> int:
        return await self._run(
            lambda c: c.execute("SELECT version FROM schema_version").fetchone()[0]
        )

    # --- sandboxes ---------------------------------------------------------------------------

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        doc = json.dumps(rec.to_row())
        state = rec.state.value
        sid = rec.sandbox_id

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO sandboxes (id, state, doc) VALUES (?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET state = excluded.state, doc = excluded.doc",
                (sid, state, doc),
            )

        await self._run(write)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._run(lambda c: c.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,)))

    async def load_sandboxes(self) -> list[SandboxRecord]:
        rows = await self._run(lambda c: c.execute("SELECT doc FROM sandboxes").fetchall())
        return [SandboxRecord.from_row(json.loads(r["doc"])) for r in rows]

    # --- templates and snapshots -------------------------------------------------------------

    async def put_template(self, rec: TemplateRecord) -> None:
        doc = _template_doc(rec)

        def write(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                for name in rec.names:
                    # a name is the team's own, and no team's may be a built-in's
                    owner = c.execute(
                        "SELECT template_id FROM team_template_names WHERE name = ? AND "
                        "team IN (?, ?) AND template_id != ?",
                        (name, rec.team, SHARED, rec.template_id)).fetchone()
                    if owner:
                        raise NameTaken(f"name {name!r} is already used by {owner[0]}")
                c.execute(
                    "INSERT INTO templates (id, kind, source_sandbox_id, created_at, doc, team) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET doc = excluded.doc, "
                    "team = excluded.team",
                    (rec.template_id, rec.kind, rec.source_sandbox_id, rec.created_at, doc,
                     rec.team),
                )
                c.execute("DELETE FROM team_template_names WHERE template_id = ?",
                          (rec.template_id,))
                c.executemany(
                    "INSERT INTO team_template_names (team, name, template_id) VALUES (?, ?, ?)",
                    [(rec.team, n, rec.template_id) for n in rec.names],
                )
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

        await self._run(write)

    async def delete_template(self, template_id: str) -> None:
        """The template, its names, its tags and tagged builds (and their layer references)."""

        def write(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute(
                    "DELETE FROM layer_refs WHERE owner_kind = 'build' AND owner_id IN "
                    "(SELECT build_id FROM template_builds WHERE template_id = ?)",
                    (template_id,),
                )
                c.execute("DELETE FROM team_template_names WHERE template_id = ?",
                          (template_id,))
                c.execute("DELETE FROM templates WHERE id = ?", (template_id,))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

        await self._run(write)

    async def load_templates(self) -> list[TemplateRecord]:
        rows = await self._run(
            lambda c: c.execute(
                "SELECT id, kind, source_sandbox_id, created_at, doc, team FROM templates"
            ).fetchall()
        )
        return [_template_from(r) for r in rows]

    # --- template tags -----------------------------------------------------------------------

    async def update_tags(
        self,
        put_builds: list[BuildSnapshot],
        put_tags: list[TagAssignment],
        delete_tags: list[tuple[str, str]],
        delete_builds: list[str],
    ) -> None:
        """One change of a template's tags in one transaction: builds added (with their layer
        references), tags set, tags (template_id, tag) removed, then builds no tag names."""

        def write(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                for build in put_builds:
                    c.execute(
                        "INSERT INTO template_builds (build_id, template_id, created_at, doc) "
                        "VALUES (?, ?, ?, ?) ON CONFLICT(build_id) DO UPDATE SET doc = excluded.doc",
                        (build.build_id, build.template_id, build.created_at,
                         json.dumps(build.to_json())),
                    )
                    c.execute("DELETE FROM layer_refs WHERE owner_kind = 'build' AND owner_id = ?",
                              (build.build_id,))
                    c.executemany(
                        "INSERT OR IGNORE INTO layer_refs (layer_id, owner_kind, owner_id) "
                        "VALUES (?, 'build', ?)",
                        [(layer, build.build_id) for layer in build.ref.layers],
                    )
                c.executemany(
                    "INSERT INTO template_tags (template_id, tag, build_id, assigned_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT(template_id, tag) DO UPDATE SET "
                    "build_id = excluded.build_id, assigned_at = excluded.assigned_at",
                    [(t.template_id, t.tag, t.build_id, t.assigned_at) for t in put_tags],
                )
                c.executemany("DELETE FROM template_tags WHERE template_id = ? AND tag = ?",
                              delete_tags)
                for build_id in delete_builds:
                    c.execute("DELETE FROM template_builds WHERE build_id = ?", (build_id,))
                    c.execute("DELETE FROM layer_refs WHERE owner_kind = 'build' AND owner_id = ?",
                              (build_id,))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

        await self._run(write)

    async def load_tags(self) -> tuple[list[BuildSnapshot], list[TagAssignment]]:
        def read(c: sqlite3.Connection) -> tuple[list[sqlite3.Row], list[sqlite3.Row]]:
            builds = c.execute(
                "SELECT build_id, template_id, created_at, doc FROM template_builds"
            ).fetchall()
            tags = c.execute(
                "SELECT template_id, tag, build_id, assigned_at FROM template_tags"
            ).fetchall()
            return builds, tags

        builds, tags = await self._run(read)
        return (
            [BuildSnapshot.from_row(r["build_id"], r["template_id"], r["created_at"],
                                    json.loads(r["doc"])) for r in builds],
            [TagAssignment(r["template_id"], r["tag"], r["build_id"], r["assigned_at"])
             for r in tags],
        )

    # --- layer references --------------------------------------------------------------------

    async def set_layer_refs(self, owner_kind: str, owner_id: str, layers: list[str]) -> None:
        """Replace the layers `owner` pins (a sandbox, template or snapshot)."""

        def write(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute(
                    "DELETE FROM layer_refs WHERE owner_kind = ? AND owner_id = ?",
                    (owner_kind, owner_id),
                )
                c.executemany(
                    "INSERT OR IGNORE INTO layer_refs (layer_id, owner_kind, owner_id) "
                    "VALUES (?, ?, ?)",
                    [(layer, owner_kind, owner_id) for layer in layers],
                )
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

        await self._run(write)

    async def layer_ref_counts(self) -> dict[str, int]:
        """How many owners pin each layer; a layer missing here may be garbage-collected."""
        rows = await self._run(
            lambda c: c.execute(
                "SELECT layer_id, COUNT(*) FROM layer_refs GROUP BY layer_id"
            ).fetchall()
        )
        return {r[0]: r[1] for r in rows}

    # --- operations in flight ----------------------------------------------------------------

    async def put_pending(
        self, sandbox_id: str, op: str, started_at: float, doc: dict[str, Any]
    ) -> None:
        """Remember that `op` on the sandbox has started and may leave a result on disk."""
        raw = json.dumps(doc)
        await self._run(
            lambda c: c.execute(
                "INSERT INTO pending_ops (sandbox_id, op, started_at, doc) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(sandbox_id) DO UPDATE SET op = excluded.op, "
                "started_at = excluded.started_at, doc = excluded.doc",
                (sandbox_id, op, started_at, raw),
            )
        )

    async def delete_pending(self, sandbox_id: str) -> None:
        await self._run(
            lambda c: c.execute("DELETE FROM pending_ops WHERE sandbox_id = ?", (sandbox_id,))
        )

    async def load_pending(self) -> dict[str, PendingOp]:
        rows = await self._run(
            lambda c: c.execute("SELECT sandbox_id, op, started_at, doc FROM pending_ops").fetchall()
        )
        return {
            r["sandbox_id"]: PendingOp(r["sandbox_id"], r["op"], r["started_at"], json.loads(r["doc"]))
            for r in rows
        }

    async def finish_pause(self, rec: SandboxRecord, layers: list[str]) -> None:
        """The paused record, its layer references and the end of the pending pause, in one
        transaction: after a crash either all of it or none of it is there."""
        doc = json.dumps(rec.to_row())
        sid = rec.sandbox_id
        state = rec.state.value

        def write(c: sqlite3.Connection) -> None:
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute(
                    "INSERT INTO sandboxes (id, state, doc) VALUES (?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET state = excluded.state, doc = excluded.doc",
                    (sid, state, doc),
                )
                c.execute(
                    "DELETE FROM layer_refs WHERE owner_kind = 'sandbox' AND owner_id = ?", (sid,)
                )
                c.executemany(
                    "INSERT OR IGNORE INTO layer_refs (layer_id, owner_kind, owner_id) "
                    "VALUES (?, 'sandbox', ?)",
                    [(layer, sid) for layer in layers],
                )
                c.execute("DELETE FROM pending_ops WHERE sandbox_id = ?", (sid,))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

        await self._run(write)

    # --- volumes (node/volumes.py) -------------------------------------------------------------

    async def put_volume(self, rec: VolumeRecord) -> None:
        """Insert or update a volume; NameTaken when its team has another of its name."""
        doc = json.dumps(rec.to_doc())

        def write(c: sqlite3.Connection) -> None:
            try:
                c.execute(
                    "INSERT INTO volumes (id, team, name, created_at, doc) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET doc = excluded.doc",
                    (rec.volume_id, rec.team, rec.name, rec.created_at, doc))
            except sqlite3.IntegrityError:
                raise NameTaken(f"volume name {rec.name!r} is already used") from None

        await self._run(write)

    async def delete_volume(self, volume_id: str) -> None:
        await self._run(lambda c: c.execute("DELETE FROM volumes WHERE id = ?", (volume_id,)))

    async def load_volumes(self) -> list[VolumeRecord]:
        rows = await self._run(lambda c: c.execute(
            "SELECT id, team, name, created_at, doc FROM volumes").fetchall())
        return [VolumeRecord.from_row(r["id"], r["team"], r["name"], r["created_at"],
                                      json.loads(r["doc"])) for r in rows]

    # --- lifecycle events and webhooks (node/events.py, node/webhooks.py) ---------------------

    async def add_events(self, rows: list[tuple[float, str, str, str, str]]) -> list[int]:
        """Append (ts, type, team, sandbox_id, doc) rows in one transaction; their seqs."""

        def write(c: sqlite3.Connection) -> list[int]:
            c.execute("BEGIN IMMEDIATE")
            try:
                seqs = [c.execute("INSERT INTO events (ts, type, team, sandbox_id, doc) "
                                  "VALUES (?, ?, ?, ?, ?)", row).lastrowid or 0 for row in rows]
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            return seqs

        return await self._run(write)

    async def query_events(self, team: str, *, sandbox_id: str | None, types: list[str],
                           exclude_prefix: str | None, after: int, offset: int, limit: int,
                           ascending: bool, before: int | None = None
                           ) -> list[tuple[int, str]]:
        """(seq, doc) of the team's events, in seq order, filtered and paged (events_sql)."""
        sql, args = events_sql(team, sandbox_id=sandbox_id, types=types,
                               exclude_prefix=exclude_prefix, after=after, before=before,
                               offset=offset, limit=limit, ascending=ascending)
        rows = await self._run(lambda c: c.execute(sql, args).fetchall())
        return [(r["seq"], r["doc"]) for r in rows]

    async def events_after(self, after: int, limit: int) -> tuple[list[tuple[int, str]], int]:
        """(seq, doc) of every team's events after `after`, in seq order, at most `limit`; and
        the last seq this store ever gave (AUTOINCREMENT: never reused, even once pruned), so a
        reader whose cursor is past it knows the store was made anew."""

        def read(c: sqlite3.Connection) -> tuple[list[tuple[int, str]], int]:
            rows = c.execute("SELECT seq, doc FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                             (after, limit)).fetchall()
            last = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
            return [(r["seq"], r["doc"]) for r in rows], int(last["seq"]) if last else 0

        return await self._run(read)

    async def prune_events(self, before: float) -> int:
        """Delete events and webhook attempts older than `before`; how many events went."""

        def write(c: sqlite3.Connection) -> int:
            gone = c.execute("DELETE FROM events WHERE ts < ?", (before,)).rowcount
            c.execute("DELETE FROM webhook_attempts WHERE ts < ?", (before,))
            return gone

        return await self._run(write)

    async def put_webhook(self, webhook_id: str, team: str, doc: dict[str, Any]) -> None:
        text = json.dumps(doc)
        await self._run(lambda c: c.execute(
            "INSERT INTO webhooks (id, team, doc) VALUES (?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET doc = excluded.doc", (webhook_id, team, text)))

    async def delete_webhook(self, webhook_id: str) -> None:
        def write(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
            c.execute("DELETE FROM webhook_attempts WHERE webhook_id = ?", (webhook_id,))

        await self._run(write)

    async def load_webhooks(self) -> list[dict[str, Any]]:
        rows = await self._run(lambda c: c.execute("SELECT doc FROM webhooks").fetchall())
        return [json.loads(r["doc"]) for r in rows]

    async def add_webhook_attempt(self, webhook_id: str, ts: float, doc: dict[str, Any]) -> None:
        text = json.dumps(doc)
        await self._run(lambda c: c.execute(
            "INSERT INTO webhook_attempts (webhook_id, ts, doc) VALUES (?, ?, ?)",
            (webhook_id, ts, text)))

    async def webhook_attempts(self, webhook_id: str, limit: int) -> list[dict[str, Any]]:
        """The webhook's newest attempts first."""
        rows = await self._run(lambda c: c.execute(
            "SELECT doc FROM webhook_attempts WHERE webhook_id = ? ORDER BY seq DESC LIMIT ?",
            (webhook_id, limit)).fetchall())
        return [json.loads(r["doc"]) for r in rows]


def events_sql(team: str, *, sandbox_id: str | None, types: list[str],
               exclude_prefix: str | None, after: int, before: int | None, offset: int,
               limit: int, ascending: bool) -> tuple[str, list[Any]]:
    """The SELECT of Store.query_events, written so that SQLite answers it off an index
    (migration 7; tests/node/test_store.py checks the plans): the team's events after seq
    `after` (and before `before`), of `types` (else all but `exclude_prefix`'s), of one
    sandbox, `offset` and `limit` in seq order.

    One type: that type's index range, read in order. Several: one range per type, each read
    in order and cut at offset + limit, then merged (UNION ALL, ordered): a filter for a rare
    type among many events reads only that type's rows. A sandbox's events go by its own index
    whatever types are asked (`+type`: SQLite uses no index for a term so written): a sandbox
    has few events."""
    order = "ASC" if ascending else "DESC"
    where, args = ["team = ?", "seq > ?"], [team, after]
    if before is not None:
        where.append("seq < ?")
        args.append(before)
    if sandbox_id is not None:
        where.append("sandbox_id = ?")
        args.append(sandbox_id)
        if types:
            where.append(f"+type IN ({', '.join('?' * len(types))})")
            args.extend(types)
    elif len(set(types)) > 1:
        parts, part_args = [], []
        for kind in dict.fromkeys(types):
            parts.append(f"SELECT * FROM (SELECT seq, doc FROM events "
                         f"WHERE {' AND '.join(where)} AND type = ? "
                         f"ORDER BY seq {order} LIMIT ?)")
            part_args += [*args, kind, offset + limit]
        return (f"{' UNION ALL '.join(parts)} ORDER BY seq {order} LIMIT ? OFFSET ?",
                [*part_args, limit, offset])
    elif types:
        where.append("type = ?")
        args.append(types[0])
    if not types and exclude_prefix:
        where.append("type NOT LIKE ?")
        args.append(exclude_prefix + "%")
    return (f"SELECT seq, doc FROM events WHERE {' AND '.join(where)} "
            f"ORDER BY seq {order} LIMIT ? OFFSET ?", [*args, limit, offset])

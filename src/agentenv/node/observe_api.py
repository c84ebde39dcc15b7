"""E2B's metrics and logs routes over what node/observer.py keeps: `GET
/sandboxes/{id}/metrics`, `GET /sandboxes/metrics?sandbox_ids=`, `GET /sandboxes/{id}/logs`
and `GET /v2/sandboxes/{id}/logs`. A sandbox gone within the grace period still answers."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv.api import models
from agentenv.api.bodies import Endpoint
from agentenv.api.errors import BadRequest, sandbox_not_found
from agentenv.api.event_models import MAX_METRICS_BATCH
from agentenv.api.tenancy import scope_team
from agentenv.node import views
from agentenv.node.events_api import query_int
from agentenv.node.observer import LEVELS, History, LogLine, Observer, Sample
from agentenv.node.records import State

MAX_LOGS = 1000


def metric_json(sample: Sample) -> dict[str, Any]:
    return views.metric_json(sample.metric, sample.mem_used_host)


def _entry(line: LogLine) -> dict[str, Any]:
    return {"timestamp": models.iso(line.timestamp), "message": line.text, "level": line.level,
            "fields": {"source": line.source}}


class ObserveApi:
    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def handlers(self) -> dict[str, Endpoint]:
        """The operations of the route table (agentenv.api.routes) this serves."""
        return {"getSandboxesMetrics": self.batch_metrics, "getSandboxMetrics": self.metrics,
                "getSandboxLogs": self.logs_v1, "getSandboxLogsV2": self.logs_v2}

    async def _history(self, request: Request) -> History:
        """The sandbox's history, freshly sampled when it runs and the last sample is older
        than half the interval (the SDK asks right after a create); 404 if not the team's."""
        sid = request.path_params["sandbox_id"]
        team = scope_team(request.scope)
        rec = self.observer.orchestrator.sandbox(sid)
        if rec is not None and rec.team == team and rec.state == State.RUNNING:
            history = self.observer.histories.get(sid)
            last = history.samples[-1].metric.timestamp if history and history.samples else 0
            if time.time() - last > self.observer.config.interval / 2:
                await self.observer.observe(sid)
        history = self.observer.of(sid, team)
        if history is None:
            if rec is None or rec.team != team:
                raise sandbox_not_found(sid)
            return History(team, deque())  # paused before its first sample
        return history

    async def metrics(self, request: Request) -> Response:
        bounds: list[float | None] = []
        for name in ("start", "end"):
            raw = request.query_params.get(name)
            try:
                bounds.append(float(raw) if raw else None)
            except ValueError as exc:
                raise BadRequest(f"{name} must be a unix time in seconds, got {raw!r}") from exc
        start, end = bounds
        history = await self._history(request)
        return JSONResponse([
            metric_json(s) for s in history.samples
            if (start is None or s.metric.timestamp >= start)
            and (end is None or s.metric.timestamp <= end)])

    async def batch_metrics(self, request: Request) -> Response:
        """Each named sandbox's latest sample; ids without one (unknown, another team's,
        never sampled) are left out, as E2B does."""
        raw = request.query_params.get("sandbox_ids")
        if not raw:
            raise BadRequest("sandbox_ids is required: comma-separated sandbox ids")
        ids = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
        if len(ids) > MAX_METRICS_BATCH:
            raise BadRequest(f"at most {MAX_METRICS_BATCH} sandbox_ids, got {len(ids)}")
        team = scope_team(request.scope)
        out = {}
        for sid in ids:
            history = self.observer.of(sid, team)
            if history is not None and history.samples:
                out[sid] = metric_json(history.samples[-1])
        return JSONResponse({"sandboxes": out})

    async def logs_v1(self, request: Request) -> Response:
        """Lines from `start` (unix ms), oldest first, at most `limit`."""
        start = query_int(request, "start", 0, 0, 2**62) / 1000
        limit = query_int(request, "limit", MAX_LOGS, 0, MAX_LOGS)
        lines = [x for x in (await self._history(request)).lines if x.timestamp >= start][:limit]
        return JSONResponse({
            "logs": [{"timestamp": models.iso(x.timestamp), "line": x.text} for x in lines],
            "logEntries": [_entry(x) for x in lines]})

    async def logs_v2(self, request: Request) -> Response:
        """From `cursor` (unix ms) forward (oldest first) or backward (newest first, the
        default cursor then being now), at or above `level`, containing `search`."""
        direction = request.query_params.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise BadRequest(f"direction must be forward or backward, got {direction!r}")
        level = request.query_params.get("level", "debug")
        if level not in LEVELS:
            raise BadRequest(f"level must be one of {list(LEVELS)}, got {level!r}")
        search = request.query_params.get("search", "")
        if len(search) > 256:
            raise BadRequest("search is at most 256 characters")
        forward = direction == "forward"
        default = 0 if forward else int(time.time() * 1000) + 1
        cursor = query_int(request, "cursor", default, 0, 2**62) / 1000
        limit = query_int(request, "limit", MAX_LOGS, 0, MAX_LOGS)
        floor = LEVELS.index(level)
        lines = list((await self._history(request)).lines)
        if not forward:
            lines.reverse()
        picked = [x for x in lines
                  if (x.timestamp >= cursor if forward else x.timestamp <= cursor)
                  and LEVELS.index(x.level) >= floor and search in x.text][:limit]
        return JSONResponse({"logs": [_entry(x) for x in picked]})

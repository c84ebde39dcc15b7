"""Errors the orchestrator raises; each carries the HTTP status the API answers with."""

from __future__ import annotations

from agentenv.errors import AgentEnvError


class ApiError(AgentEnvError):
    status = 500
    #: headers the answer carries besides the JSON body's (e.g. an admission refusal's)
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class Internal(ApiError):
    status = 500


class Unavailable(ApiError):
    status = 503


def sandbox_not_found(sandbox_id: str) -> NotFound:
    # E2B's wording; the TS SDK decides by body.code, Python by status.
    return NotFound(f"sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it")

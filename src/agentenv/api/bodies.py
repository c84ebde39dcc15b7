"""Request bodies and error answers of the E2B contract (docs/e2b-api.md §1.2): every non-2xx
answer is JSON `{"code": <status>, "message": ...}`; bodies are read within MAX_BODY_BYTES,
parsed with their nesting bounded and validated with the api's models (422 naming each
problem)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentenv import boundedjson
from agentenv.api.errors import ApiError, BadRequest

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 1 << 20
#: what serves an operation of the route table on a node (a Starlette endpoint)
Endpoint = Callable[[Request], Awaitable[Response]]


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


async def read_model(request: Request, model: type[M], *, optional: bool = False) -> M:
    """Parse and validate the JSON body; empty bodies count as `{}` when `optional`."""
    return parse_model(model, await read_json(request, optional=optional))


def parse_model(model: type[M], data: Any) -> M:
    """`data` (parsed JSON) validated as `model`: 422 naming each problem."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise ApiError(f"invalid request body: {problems}", status=422) from exc


async def read_json(request: Request, *, optional: bool = False) -> Any:
    """The JSON body, read up to MAX_BODY_BYTES and parsed with its nesting bounded
    (boundedjson); empty bodies count as `{}` when `optional`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if not optional:
            raise ApiError("request body is required", status=400)
        data: Any = {}
    else:
        try:
            data = boundedjson.loads(raw, "the request body")
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    return data

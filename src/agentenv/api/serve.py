"""Serving the route table (api/routes.py): a server maps operationIds to its own handlers,
and gets back what to route, in the table's order.

The node (node/api.py) makes Starlette routes of it, the gateway (control/gateway/dispatch.py)
regular expressions; both answer the `unsupported` operations with 501 themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

from agentenv.api.routes import ROUTES, Operation

H = TypeVar("H")
_PARAM = re.compile(r"\{([A-Za-z]+)(:path)?\}")


def path_params(path: str) -> list[str]:
    """The names of a table path's parameters, in OpenAPI's spelling (`sandboxID`)."""
    return [m.group(1) for m in _PARAM.finditer(path)]


def openapi_path(path: str) -> str:
    """A table path as the OpenAPI document writes it (no `:path` marks)."""
    return _PARAM.sub(r"{\1}", path)


def param_key(name: str) -> str:
    """The key a handler finds a path parameter under: `sandboxID` -> `sandbox_id`."""
    return re.sub(r"ID$", "_id", name).lower() if name.endswith("ID") else name


def starlette_path(path: str) -> str:
    """A table path as a Starlette route's (`{sandbox_id}`, `{template_id:path}`)."""
    return _PARAM.sub(lambda m: "{" + param_key(m.group(1)) + (m.group(2) or "") + "}", path)


def path_pattern(path: str) -> re.Pattern[str]:
    """A table path as a regular expression whose groups are its parameters, in order."""
    parts = _PARAM.split(path)  # text, name, mark, text, name, mark, ..., text
    out = re.escape(parts[0])
    for i in range(1, len(parts), 3):
        out += ("(.+)" if parts[i + 1] else "([^/]+)") + re.escape(parts[i + 2])
    return re.compile(out)


def bind(handlers: Mapping[str, H], *, node: bool) -> tuple[list[tuple[Operation, H | None]],
                                                            list[Operation]]:
    """The operations a server serves, in the table's order, each with its handler (None for
    an `unsupported` one, which the server answers with 501 itself); and the operations it
    should serve and has no handler for. A handler no operation names is a mistake."""
    known = {op.handler for op in ROUTES}
    stray = sorted(set(handlers) - known)
    if stray:
        raise ValueError(f"handlers for no operation of the route table: {stray}")
    served: list[tuple[Operation, H | None]] = []
    missing = []
    for op in ROUTES:
        if op.node_only and not node:
            continue
        if op.unsupported is not None:
            served.append((op, None))
        elif op.handler in handlers:
            served.append((op, handlers[op.handler]))
        else:
            missing.append(op)
    return served, missing

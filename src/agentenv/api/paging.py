"""E2B's paging (`limit`, `nextToken` in, `X-Next-Token` out): items ordered by (time, id), and
a cursor naming the last one sent. A node pages its own items; the gateway pages what every
node answered, merged, with the same cursors."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from agentenv import boundedjson
from agentenv.api.errors import BadRequest

MAX_PAGE = 100
T = TypeVar("T")
Key = tuple[float, str]


def encode_cursor(key: Key) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def decode_cursor(token: str) -> Key:
    try:
        ts, item_id = boundedjson.loads(base64.urlsafe_b64decode(token.encode()))
        return float(ts), str(item_id)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise BadRequest(f"invalid next token: {token!r}") from exc


def page_limit(query: Mapping[str, str]) -> int:
    """The `limit` of a request's query (1-MAX_PAGE, MAX_PAGE when absent)."""
    raw = query.get("limit")
    if raw is None:
        return MAX_PAGE
    try:
        value = int(raw)
    except ValueError as exc:
        raise BadRequest(f"limit must be an integer, got {raw!r}") from exc
    if not 1 <= value <= MAX_PAGE:
        raise BadRequest(f"limit must be between 1 and {MAX_PAGE}, got {value}")
    return value


def page(items: list[T], key: Callable[[T], Key], token: str | None, limit: int,
         descending: bool) -> tuple[list[T], str | None]:
    """One page of items ordered by key, after the cursor `token`; and the next token."""
    ordered = sorted(items, key=key, reverse=descending)
    if token:
        cursor = decode_cursor(token)
        ordered = [i for i in ordered if (key(i) < cursor if descending else key(i) > cursor)]
    chunk = ordered[:limit]
    more = len(ordered) > limit
    return chunk, (encode_cursor(key(chunk[-1])) if more and chunk else None)


def iso_ts(value: Any) -> float:
    """An RFC 3339 time of an answer's JSON as unix seconds (0 when it is none)."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def merged_page(items: list[dict[str, Any]], time_field: str, id_field: str,
                token: str | None, limit: int, descending: bool
                ) -> tuple[list[dict[str, Any]], str | None]:
    """One page of JSON items from all nodes, ordered by (time, id) across them."""
    return page(items, lambda i: (iso_ts(i.get(time_field)), str(i.get(id_field))), token,
                limit, descending)

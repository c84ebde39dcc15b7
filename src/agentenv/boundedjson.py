"""JSON from whoever may be hostile (a guest's envd port, an API client, a registry), parsed
with its nesting bounded.

The standard parser recurses once per `[` or `{`: `[[[[...]]]]` 100,000 deep raises
RecursionError, which is not a ValueError, so it went past every `except ValueError` and
`except json.JSONDecodeError` around a parse (a 500, or a task of the node ended by the guest's
reply). Nesting that parses but is deep still breaks what recurses over the value later
(`json.dumps`, validation). `loads` answers both with `JSONTooDeep`, a JSONDecodeError (so a
ValueError) that says what was too deep; no JSON this project reads nests past MAX_DEPTH.
"""

from __future__ import annotations

import json
from typing import Any

#: levels of arrays and objects a document may nest (the deepest the project reads is ~6)
MAX_DEPTH = 64


class JSONTooDeep(json.JSONDecodeError):
    def __init__(self, what: str, max_depth: int) -> None:
        message = f"{what} nests arrays or objects deeper than {max_depth} levels"
        super().__init__(message, "", 0)
        self.args = (message,)


def loads(data: str | bytes | bytearray, what: str = "the JSON document",
          max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing nesting deeper than `max_depth` with JSONTooDeep."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise JSONTooDeep(what, max_depth) from None
    pending: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > max_depth:
            raise JSONTooDeep(what, max_depth)
        pending.extend((child, depth + 1) for child in children
                       if isinstance(child, dict | list))
    return value

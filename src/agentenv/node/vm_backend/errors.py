"""The one translation of the VM runtime's failures into the node's BackendError."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from agentenv.node.backend import BackendError
from agentenv.runtime.errors import RuntimeError_


@contextlib.contextmanager
def vm_errors(what: str, *, retryable: bool | Callable[[], bool] = True) -> Iterator[None]:
    """Raise the runtime's errors (RuntimeError_, OSError) in the block as
    BackendError("<what>: <error>"). `retryable` may be a callable: it is asked after the
    failure (whether the VM still runs is only known then)."""
    try:
        yield
    except (RuntimeError_, OSError) as exc:
        intact = retryable() if callable(retryable) else retryable
        raise BackendError(f"{what}: {exc}", retryable=intact) from exc

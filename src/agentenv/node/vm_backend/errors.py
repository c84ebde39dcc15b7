"""The one translation of the VM runtime's failures into the node's BackendError."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from agentenv.node.backend import BackendError
from agentenv.runtime.errors import GuestRefusedError, RuntimeError_


@contextlib.contextmanager
def vm_errors(what: str, *, retryable: bool | Callable[[], bool] = True) -> Iterator[None]:
    """Raise the runtime's errors (RuntimeError_, OSError) in the block as
    BackendError("<what>: <error>"). `retryable` may be a callable: it is asked after the
    failure (whether the VM still runs is only known then)."""
    try:
        yield
    except (RuntimeError_, OSError) as exc:
        intact = retryable() if callable(retryable) else retryable
        # envd's 400: the guest cannot do what was asked (a shared volume without its NFS
        # client: a template built before them)
        refused = isinstance(exc, GuestRefusedError) and exc.status == 400
        # (a bare TimeoutError, an OSError since 3.11, has no text: name its type then)
        why = str(exc) or type(exc).__name__
        raise BackendError(f"{what}: {why}", retryable=intact, bad_request=refused) from exc

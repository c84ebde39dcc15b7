"""Which nodes serve which blobs to their peers: digest -> holders, from the heartbeats.

Every heartbeat carries the blob digests its node's chunk cache holds whole (`blobs`) and in
part (`partial_blobs`). The index is kept in memory (rebuilt from the stored statuses at start,
like the node views) and updated by difference, so a heartbeat whose lists did not change costs
one tuple comparison, and a Holders question costs a dict lookup per digest however many nodes
and digests there are. Liveness is not kept here: the caller filters the holders by it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

DEFAULT_LIMIT = 8


class HolderIndex:
    def __init__(self) -> None:
        # digest -> node -> True (whole) / False (some chunks)
        self._by_digest: dict[str, dict[str, bool]] = {}
        # node -> (its report as last sent, the same as digest -> whole?)
        self._by_node: dict[str, tuple[tuple[tuple[str, ...], tuple[str, ...]],
                                       dict[str, bool]]] = {}
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self._by_digest)

    def update(self, node_id: str, whole: Iterable[str], partial: Iterable[str]) -> None:
        """Replace what `node_id` holds (a whole blob listed in both counts as whole)."""
        report = (tuple(whole), tuple(partial))
        old = self._by_node.get(node_id)
        if old is not None and old[0] == report:
            return
        new: dict[str, bool] = dict.fromkeys(report[1], False)
        new.update(dict.fromkeys(report[0], True))
        before = old[1] if old is not None else {}
        for digest in before.keys() - new.keys():
            holders = self._by_digest.get(digest)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self._by_digest[digest]
        for digest, complete in new.items():
            if before.get(digest) is not complete:
                self._by_digest.setdefault(digest, {})[node_id] = complete
        if new:
            self._by_node[node_id] = (report, new)
        else:
            self._by_node.pop(node_id, None)

    def forget(self, node_id: str) -> None:
        self.update(node_id, (), ())

    def holders(self, digest: str, *, exclude: str = "", limit: int = DEFAULT_LIMIT,
                usable: Callable[[str], bool] = lambda node_id: True) -> list[tuple[str, bool]]:
        """Up to `limit` (node, whole?) holding `digest`, whole holders first. Each answer
        starts at a different place in the list, so many askers spread over the holders."""
        held = self._by_digest.get(digest)
        if not held:
            return []
        nodes = [(n, c) for n, c in held.items() if n != exclude and usable(n)]
        if not nodes:
            return []
        shift = next(self._turn) % len(nodes)
        nodes = nodes[shift:] + nodes[:shift]
        nodes.sort(key=lambda item: not item[1])  # stable: whole first, rotation kept
        return nodes[: max(1, limit)]

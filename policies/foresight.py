"""Belady's eviction: the block whose content is needed again farthest ahead goes first.

It reads the future, so no cache can run it: `kvctl bench replay --policy belady` replays a trace
with it, as the mark of what eviction alone could add on that trace beside lru, cost, lfu or
priority (a policy within a few points of it leaves memory, not ordering, to buy). kvd refuses it
as a setting (`make_eviction_policy` does not know it).

The future comes as two callables, in one unit (the replay's: requests in arrival order):
`next_use(block_id)`, when the block's content is next asked for after the horizon (math.inf:
never again), and `horizon()`, how far the replay has come. A block's next use is asked as it
becomes evictable; one whose next use the horizon has since passed (that request came and did not
take it: its chain broke before it, or it was turned away) is asked again before the next victim
is chosen. Blocks needed at the same time, or never again, go in the order they became evictable:
a released sequence's deepest block first, as the pool pushes them, so that a surviving prefix is
always usable. (A block's use is a use of every block before it in its chain, so a root is never
needed later than its leaves.)

O(log n) a push and a victim; each use of a key passed by the horizon is looked at once.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Iterable, Sequence

NextUse = Callable[[int], float]


class FarthestNextUseEviction:
    """The evictable block needed again farthest ahead goes first (see the module's doc)."""

    name = "belady"

    def __init__(self, next_use: NextUse, horizon: Callable[[], float]) -> None:
        self._next_use, self._horizon = next_use, horizon
        self._live: dict[int, int] = {}  # evictable block -> serial of its entry in the heaps
        self._farthest: list[tuple[float, int, int]] = []  # (-next use, serial, block): the victim on top
        self._soonest: list[tuple[float, int, int]] = []  # (next use, serial, block): the first to go stale
        self._serial = 0

    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None:
        pass  # a block's worth is its next use, asked as it becomes evictable

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None:
        pass

    def push(self, block_ids: Iterable[int], now: float) -> None:
        for block_id in block_ids:
            self._add(block_id, self._next_use(block_id))

    def _add(self, block_id: int, when: float) -> None:
        self._serial += 1
        self._live[block_id] = self._serial
        heapq.heappush(self._farthest, (-when, self._serial, block_id))
        if when != math.inf:
            heapq.heappush(self._soonest, (when, self._serial, block_id))
        if len(self._farthest) > 1024 and len(self._farthest) > 2 * len(self._live):
            self._compact()

    def _compact(self) -> None:
        """The heaps without the entries of blocks no longer evictable (or asked again since)."""
        live = self._live
        self._farthest = [e for e in self._farthest if live.get(e[2]) == e[1]]
        self._soonest = [e for e in self._soonest if live.get(e[2]) == e[1]]
        heapq.heapify(self._farthest)
        heapq.heapify(self._soonest)

    def _refresh(self) -> None:
        """Ask again the next use of each block whose recorded one the horizon has reached."""
        horizon, soonest, live = self._horizon(), self._soonest, self._live
        while soonest and soonest[0][0] <= horizon:
            _, serial, block_id = heapq.heappop(soonest)
            if live.get(block_id) == serial:
                self._add(block_id, self._next_use(block_id))

    def remove(self, block_id: int) -> None:
        del self._live[block_id]  # (its heap entries are skipped when met)

    def pop(self, now: float) -> int:
        return self.pop_many(1, now)[0]

    def pop_many(self, count: int, now: float) -> list[int]:
        if count > len(self._live):
            raise LookupError(f"asked for {count} victims, {len(self._live)} evictable")
        self._refresh()
        farthest, live, victims = self._farthest, self._live, []
        while len(victims) < count:
            _, serial, block_id = heapq.heappop(farthest)
            if live.get(block_id) == serial:
                del live[block_id]
                victims.append(block_id)
        return victims

    def forget(self, block_id: int) -> None:
        self._live.pop(block_id, None)

    def reprioritise(self, change: Callable[[int], int]) -> int:
        return 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def order(self) -> list[int]:
        """Evictable blocks, next victim first (their next uses as last asked)."""
        live = self._live
        return [b for _, serial, b in sorted(self._farthest) if live.get(b) == serial]

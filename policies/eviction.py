"""Eviction policies: which cached block goes first when the pool needs room.

A policy orders the *evictable* blocks of one pool: blocks whose reference count
is zero, that still hold indexed content, and that are not pinned. The pool owns
the blocks; a policy only sees plain integers (block ids), a depth (the block's
position in its prefix chain, 0 = root) and a clock value passed in by the
caller. Policies never read the wall clock, so a replay is deterministic.

Life of a block as a policy sees it::

    on_insert([b, ...], [depth, ...], now, priority)
                                  the blocks now hold indexed content (written by a
                                  request of that priority: the engine's, higher first)
    record_hits([b, ...], now, priority)
                                  a lookup (a request of that priority) reused it
                                  (it may be in use or evictable)
    push([b, ...], now)           it became evictable (ref count fell to zero)
    remove(b)                     a hit took it back before it was evicted   O(1)
    pop(now) -> b                 it is the victim; the policy forgets it
    pop_many(n, now) -> [b, ...]  the next n victims, in order
    forget(b)                     its content was dropped some other way
    reprioritise(change) -> n     each held block's priority moves by change(b) (an operator
                                  changed its tenant's): policies without priorities ignore it

Adding a policy: implement `EvictionPolicy` and register it in `make_eviction_policy`.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable, Iterable, Protocol, Sequence


class EvictionPolicy(Protocol):
    """Orders evictable blocks. Every method is O(1) or O(log n) amortised."""

    name: str

    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None: ...

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None: ...

    def push(self, block_ids: Iterable[int], now: float) -> None: ...

    def remove(self, block_id: int) -> None: ...

    def pop(self, now: float) -> int: ...

    def pop_many(self, count: int, now: float) -> list[int]:
        """The next `count` victims in order (the caller checked there are that many)."""
        ...

    def forget(self, block_id: int) -> None: ...

    def reprioritise(self, change: Callable[[int], int]) -> int:
        """Move each held block's priority by `change(block_id)`; how many moved (0: no priorities)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, block_id: int) -> bool: ...

    def order(self) -> list[int]:
        """Evictable block ids, next victim first (for operators and tests)."""
        ...


class LRUEviction:
    """Least recently released goes first.

    The queue is an `OrderedDict` (a hash map threaded on a doubly linked list),
    so removal from the middle on a cache hit is O(1). Callers push a finished
    sequence's blocks tail-first, so a prefix's deepest block is evicted before
    its root and a surviving prefix is always usable.
    """

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None:
        pass

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None:
        pass

    def push(self, block_ids: Iterable[int], now: float) -> None:
        queue = self._queue
        for block_id in block_ids:
            queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self, now: float) -> int:
        if not self._queue:
            raise LookupError("no evictable block")
        return self._queue.popitem(last=False)[0]

    def pop_many(self, count: int, now: float) -> list[int]:
        if count > len(self._queue):
            raise LookupError(f"asked for {count} victims, {len(self._queue)} evictable")
        popitem = self._queue.popitem
        return [popitem(False)[0] for _ in range(count)]

    def forget(self, block_id: int) -> None:
        self._queue.pop(block_id, None)

    def reprioritise(self, change: Callable[[int], int]) -> int:
        return 0

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def order(self) -> list[int]:
        return list(self._queue)


class CostAwareEviction:
    """Evict the block whose keeping is worth least per byte.

    score = reuse estimate x prefill tokens saved / bytes

    The reuse estimate is the block's use count (its first fill plus every hit)
    decayed exponentially with `half_life` clock units. Within one pool every
    block saves `block_tokens` prefill tokens and costs `block_bytes`, so those
    factors scale every score alike; `score()` includes them so that scores
    compare across pools and tiers.

    Exponential decay keeps the order time-invariant: at any time t,
    log2(score) = log2(uses at t0) - (t - t0) / half_life + log2(saved / bytes),
    and the `- t / half_life` term is shared by every block. So each block keeps
    one anchored priority ``p = log2(uses at t0) + t0 / half_life`` and nothing
    is ever re-sorted.

    Order (the contract tests check): lowest p first; among equal p, the blocks
    released earlier first; within one release, in the order the caller gave
    (tail-first, so a prefix's deepest block goes before its root).

    Structure: a heap of *runs*, one per stretch of equal p within a release
    (a finished sequence's unhit blocks share one p, so a release is usually one
    or two heap entries). Evicting walks the top run in O(1) per block. Removal
    is lazy: `remove` forgets the block's run in O(1); the walk skips it, and
    runs are rebuilt when stale entries outnumber live ones.
    """

    name = "cost"

    def __init__(self, *, half_life: float = 600.0, block_tokens: int = 1, block_bytes: int = 1) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life!r}")
        self.half_life = float(half_life)
        self._value = max(block_tokens, 1) / max(block_bytes, 1)
        self._priority: dict[int, float] = {}  # block id -> anchored priority p
        # heap of (p, run serial, run); a run is [next index, block ids...]
        self._heap: list[tuple[float, int, list]] = []
        self._live: dict[int, int] = {}  # evictable block id -> serial of the run holding it
        self._stored = 0  # block ids held in runs, live or stale
        self._serial = 0

    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None:
        fresh = now / self.half_life  # log2(1 use) + now / half_life
        anchored = self._priority
        for block_id in block_ids:
            anchored[block_id] = fresh

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None:
        anchored, shift = self._priority, now / self.half_life  # (a request's priority plays no part)
        for block_id in block_ids:
            p = anchored.get(block_id)
            if p is not None:
                # uses(now) = 2 ** (p - shift); one more use, re-anchored at now
                anchored[block_id] = math.log2(2.0 ** (p - shift) + 1.0) + shift

    def score(self, block_id: int, now: float) -> float:
        """The block's current score: decayed uses x tokens saved / bytes."""
        return 2.0 ** (self._priority[block_id] - now / self.half_life) * self._value

    def push(self, block_ids: Iterable[int], now: float) -> None:
        priority, live = self._priority, self._live
        default = self._unknown(now)
        run: list | None = None
        run_p = 0.0
        for block_id in block_ids:
            p = priority.get(block_id, default)
            if run is None or p != run_p:
                if run is not None:
                    self._add_run(run_p, run)
                run, run_p = [1], p
                self._serial += 1
            run.append(block_id)
            live[block_id] = self._serial
        if run is not None:
            self._add_run(run_p, run)

    def _unknown(self, now: float) -> float:
        """The priority of a block pushed that was never inserted (one use, now)."""
        return now / self.half_life

    def _add_run(self, p: float, run: list) -> None:
        heapq.heappush(self._heap, (p, self._serial, run))
        self._stored += len(run) - 1

    def remove(self, block_id: int) -> None:
        del self._live[block_id]
        if self._stored > 1024 and self._stored > 2 * len(self._live):
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live blocks: each keeps its release (its run's serial) and its
        place in it, at its priority now (a run splits where `reprioritise` moved some of it)."""
        live, held = self._live, self._priority
        heap: list[tuple[float, int, list]] = []
        stored = 0
        for run_p, serial, run in self._heap:
            current, current_p = None, None
            for block_id in run[run[0]:]:
                if live.get(block_id) != serial:
                    continue
                p = held.get(block_id, run_p)
                if current is None or p != current_p:
                    current, current_p = [1], p
                    heap.append((p, serial, current))
                current.append(block_id)
                stored += 1
        heapq.heapify(heap)
        self._heap, self._stored = heap, stored

    def pop(self, now: float) -> int:
        return self.pop_many(1, now)[0]

    def pop_many(self, count: int, now: float) -> list[int]:
        if count > len(self._live):
            raise LookupError(f"asked for {count} victims, {len(self._live)} evictable")
        heap, live, priority = self._heap, self._live, self._priority
        victims: list[int] = []
        while len(victims) < count:
            _, serial, run = heap[0]
            cursor, end = run[0], len(run)
            while cursor < end and len(victims) < count:
                block_id = run[cursor]
                cursor += 1
                if live.get(block_id) == serial:
                    del live[block_id]
                    priority.pop(block_id, None)
                    victims.append(block_id)
            self._stored -= cursor - run[0]
            run[0] = cursor
            if cursor >= end:
                heapq.heappop(heap)
        return victims

    def forget(self, block_id: int) -> None:
        self._live.pop(block_id, None)
        self._priority.pop(block_id, None)

    def reprioritise(self, change: Callable[[int], int]) -> int:
        return 0  # scores are reuse estimates; a request's priority plays no part

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def order(self) -> list[int]:
        live = self._live
        return [b for _, serial, run in sorted(self._heap, key=lambda e: (e[0], e[1]))
                for b in run[run[0]:] if live.get(b) == serial]


class LFUEviction(CostAwareEviction):
    """Least frequently used goes first (SGLang's `lfu`): fewest uses (its first fill plus every
    hit, never decayed); among equal uses, released earlier first; within one release, in the
    order the caller gave (a prefix's deepest block before its root).

    That is the cost order with an infinite half-life: the same heap of runs, O(log n) a release.
    A hit on a block is a hit on every block before it in its chain, so a root has at least its
    leaves' uses and goes after them. Unlike `cost`, old popularity never fades: a prefix hot
    yesterday outranks one warming up today."""

    name = "lfu"

    def __init__(self, *, block_tokens: int = 1, block_bytes: int = 1) -> None:
        super().__init__(half_life=math.inf, block_tokens=block_tokens, block_bytes=block_bytes)


class PriorityEviction(CostAwareEviction):
    """The blocks of the least important requests go first (SGLang's `priority`): a block keeps
    the highest priority of the requests that wrote or reused it (the engine's priority, higher
    first: kvd's `tenant_priorities` and a request's own `priority`, which run first in the queue,
    keep their prefixes longest); among equal priorities, released earlier first (LRU); within
    one release, in the order the caller gave (a prefix's deepest block before its root).

    A block's priority never falls below its descendants': a hit on a block is a hit on every
    block before it, so a prefix's root goes after its leaves. With every request at priority 0
    (a FIFO queue) this is `lru`. The same heap of runs as `cost`, with the priority as p."""

    name = "priority"

    def __init__(self) -> None:
        super().__init__(half_life=math.inf)

    def on_insert(self, block_ids: Sequence[int], depths: Sequence[int], now: float, priority: int = 0) -> None:
        held = self._priority
        for block_id in block_ids:
            held[block_id] = priority

    def record_hits(self, block_ids: Sequence[int], now: float, priority: int = 0) -> None:
        held = self._priority
        for block_id in block_ids:
            p = held.get(block_id)
            if p is not None and priority > p:
                held[block_id] = priority

    def _unknown(self, now: float) -> float:
        return 0

    def reprioritise(self, change: Callable[[int], int]) -> int:
        """Move each held block's priority by `change(block_id)` (its tenant's `tenant_priorities`
        changed: every block of the tenant moves alike, so a prefix's root still ranks at or above
        its leaves). Among equal priorities the blocks keep their release order. Returns how many
        moved. O(n log n): a reload's cost, never a request's."""
        held, moved = self._priority, 0
        for block_id, p in held.items():
            delta = change(block_id)
            if delta:
                held[block_id] = p + delta
                moved += 1
        if moved:
            self._compact()  # the runs again, split where their blocks' priorities now differ
        return moved

    def score(self, block_id: int, now: float) -> float:
        """The block's priority: the highest of the requests that wrote or reused it."""
        return self._priority[block_id]


EVICTION_POLICIES = ("lru", "cost", "lfu", "priority")


def make_eviction_policy(name: str, *, block_tokens: int = 1, block_bytes: int = 1,
                         half_life: float = 600.0) -> EvictionPolicy:
    """Build a policy by name (`lru`, `cost`, `lfu` or `priority`); unknown names raise ValueError naming them."""
    if name == "lru":
        return LRUEviction()
    if name == "cost":
        return CostAwareEviction(half_life=half_life, block_tokens=block_tokens, block_bytes=block_bytes)
    if name == "lfu":
        return LFUEviction(block_tokens=block_tokens, block_bytes=block_bytes)
    if name == "priority":
        return PriorityEviction()
    raise ValueError(f"eviction policy: unknown value {name!r}; choose one of {', '.join(EVICTION_POLICIES)}")

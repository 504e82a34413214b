"""Queue order: which waiting request the engine tries to admit first.

    fifo      first come, first served
    priority  by priority (vLLM's: lower first), first come, first served within one
    lpm       longest prefix match first (SGLang's default schedule policy): the waiting
              requests whose prompts the device cache holds most of go first, first come, first
              served among equals. Under load, requests that share a prefix run while it is
              still cached, instead of after other prompts have evicted it; each computes less,
              so the queue drains sooner.
    priority+lpm  by priority first, as `priority`; within one priority, lpm's order, as SGLang
              orders its queue with priority scheduling and the lpm policy together: an operator's
              places hold, and the requests of one place that share a cached prefix run while it is
              still cached.

Two bounds keep `lpm` cheap and fair (and each place's order under `priority+lpm`):

- Patience: a request without a queue wait limit (its tenant's own, tenant_queue_waits, else
  max_queue_wait) that has waited LPM_PATIENCE_SECONDS goes before every one that has not
  (oldest first; under priority+lpm, every one of its place), so a prompt nobody shares is not
  held back without end by a stream of ones that hit. For a request with a limit, that limit
  bounds its wait instead: a
  prompt lpm holds back past it is turned away (queue_timeout), and kvd router takes it to a
  replica that would start it in time. A shorter patience gave back most of what lpm gains: on
  the Mooncake trace, one replica of 16 running with a 30 s limit, lpm without one cached 15.6% of
  prompt tokens and served 3,530 requests, first come, first served 5.2% and 3,496, and a patience
  of 15 s 8.5% and 3,460 (docs/results/2026-12-05-lpm-queue-order-replay.md).
- A request admitted once and preempted since (which no max_queue_wait turns away) counts as
  having waited without end: it goes first, as under first come, first served.
- Size: beyond LPM_MAX_WAITING waiting requests the queue keeps its arrival order (priority+lpm:
  priority's order), as SGLang falls back to first come, first served: ordering costs a cache
  lookup per waiting request at every admission pass.

`longest_prefix_first` reads no state: callers pass the queue, what the cache holds of each
request and which have waited their patience. kvd's engine and the trace replay both order by it.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, TypeVar

QUEUE_ORDERS = ("fifo", "priority", "lpm", "priority+lpm")
LPM_MAX_WAITING = 128  # waiting requests beyond which lpm keeps the arrival order (SGLang's bound too)
LPM_PATIENCE_SECONDS = 30.0  # without a max_queue_wait, a request waiting this long goes first, whatever it shares

Waiting = TypeVar("Waiting")


def check_queue_order(value: str, allowed: Sequence[str] = QUEUE_ORDERS) -> str:
    """`value` if it names a queue order of `allowed`; else ValueError naming queue_order."""
    if value not in allowed:
        raise ValueError(f"queue_order: unknown value {value!r}; use {', '.join(allowed[:-1])} or {allowed[-1]}")
    return value


def by_priority(order: str) -> bool:
    """Whether queue order `order` puts a better place first (priority, priority+lpm)."""
    return order in ("priority", "priority+lpm")


def by_prefix(order: str) -> bool:
    """Whether queue order `order` puts the longest cached prefix first (lpm; priority+lpm within a place)."""
    return order in ("lpm", "priority+lpm")


def lpm_patience(max_queue_wait: float) -> float:
    """Seconds after which a waiting request goes first under lpm: LPM_PATIENCE_SECONDS without a
    `max_queue_wait` (0), and never with one (the limit bounds the wait). A request's own limit
    (its tenant's, where tenants have their own) decides for it."""
    return math.inf if max_queue_wait > 0 else LPM_PATIENCE_SECONDS


def tried_before(cached_blocks: int, overdue: bool, newcomer_blocks: int) -> bool:
    """Whether lpm tries a waiting request that holds `cached_blocks` before a newcomer holding
    `newcomer_blocks`: it is `overdue` (it has waited its patience, or was preempted), or it holds
    as many blocks or more (arrival order among equals). What a predicted wait counts."""
    return overdue or cached_blocks >= newcomer_blocks


def goes_before(place: int, newcomer_place: int | None, cached_blocks: Callable[[], int],
                overdue: Callable[[], bool], newcomer_blocks: int | None) -> bool:
    """Whether a waiting request at `place` (lower first) goes before a newcomer at `newcomer_place`
    (None: places are not compared) whose prompt holds `newcomer_blocks` cached blocks (None: the
    longest prefix does not order the queue), as the queue orders them: a better place first, then,
    at one place, lpm's `tried_before` (its `cached_blocks` and whether it is `overdue`, read only
    where needed), else arrival order. What a predicted wait counts, in kvd and in the replay."""
    if newcomer_place is not None and place != newcomer_place:
        return place < newcomer_place
    return newcomer_blocks is None or overdue() or tried_before(cached_blocks(), False, newcomer_blocks)


def longest_prefix_first(waiting: Sequence[Waiting], cached_blocks: Callable[[Waiting], int],
                         overdue: Callable[[Waiting], bool], max_waiting: int = LPM_MAX_WAITING,
                         place: Callable[[Waiting], int] | None = None) -> list[Waiting]:
    """`waiting`, given in queue order, in lpm's order: the `overdue` ones first (those that have
    waited their patience), in queue order; then the rest by `cached_blocks` (leading prompt blocks
    the cache holds), most first, in queue order among equals. With `place` (priority+lpm: lower
    first), that order within each place, the places in turn. Beyond `max_waiting`, queue order
    as given (and no lookups): the caller's queue is in place order already."""
    if len(waiting) > max_waiting:
        return list(waiting)
    ranked = []
    for position, item in enumerate(waiting):
        where = place(item) if place is not None else 0
        rank = (where, 0, 0) if overdue(item) else (where, 1, -cached_blocks(item))
        ranked.append((rank, position, item))
    ranked.sort(key=lambda entry: entry[:2])
    return [item for _, _, item in ranked]

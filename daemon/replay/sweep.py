"""Replay one trace over a grid of block sizes, capacities, policies, lower-tier sizes, queue
orders and output reservations.

Keys are hashed once per block size and shared by every run at that size; the
unbounded-cache maximum is computed once per block size too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Sequence

from kvctl.policies.eviction import EVICTION_POLICIES
from kvctl.policies.tiering import WRITE_POLICIES
from kvctl.policies.reservation import parse_reservation
from kvctl.policies.queue_order import QUEUE_ORDERS, by_priority, check_queue_order
from kvctl.policies.routing import ROUTING_POLICIES, check_queue_limits, make_router

from .fleet import (RECORDED, FleetResult, check_queue_waits, check_speeds, limit_choices, placement_figures,
                    places_new_prefixes, replay_fleet)
from .foresight import POLICY as FORESIGHT
from .simulator import ReplayResult, ReplaySettings, max_hit_blocks, replay
from .trace import TraceKeyer, TraceRequest
from kvctl.daemon.cache.keys import validate_block_size

REPLAY_POLICIES = (*EVICTION_POLICIES, FORESIGHT)  # kvd's, and the mark that reads the trace's future


def validate_grid(block_sizes: Sequence[int], capacities: Sequence[int], policies: Sequence[str],
                  base: ReplaySettings, replicas: int = 1, routings: Sequence[str] = (),
                  balance_seconds: float = 2.0, new_prefix: str = "home", tier_tokens: Sequence[int] = (0,),
                  placements: int = 1, queue_limits: Sequence[str] = ("heed",),
                  speeds: Sequence[float] | None = None, queue_waits: Sequence[float] | None = None,
                  queue_orders: Sequence[str] = ("fifo",), reservations: Sequence[str] | None = None,
                  trace_priorities: bool | None = False, max_runnings: Sequence[int] | None = None) -> None:
    """Raise ValueError naming the first bad field and value, before any work starts.
    `reservations`: the output reservations compared (None: the base's alone); `trace_priorities`:
    whether the trace's requests carry priorities of their own (None: not read yet); `max_runnings`:
    the requests in service at once compared (None: the base's alone)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas: must be an integer >= 1, got {replicas!r}")
    if not isinstance(placements, int) or isinstance(placements, bool) or placements < 1:
        raise ValueError(f"placements: must be an integer >= 1, got {placements!r}")
    if not tier_tokens:
        raise ValueError("tier_tokens: give at least one size (0: no lower tier)")
    for size in tier_tokens:
        if size < 0 or (0 < size < max(block_sizes or [0])):
            raise ValueError(f"tier_tokens: {size} is neither 0 (no lower tier) nor a block of "
                             f"{max(block_sizes or [0])} tokens or more")
    if base.tier_write not in WRITE_POLICIES:
        raise ValueError(f"tier_write: unknown value {base.tier_write!r}; choose {', '.join(WRITE_POLICIES)}")
    if not base.restore_rate > 0:
        raise ValueError(f"restore_rate: must be > 0, got {base.restore_rate!r}")
    if not queue_orders:
        raise ValueError("queue_order: give fifo, priority, lpm, priority+lpm, or several to compare")
    for order in queue_orders:
        check_queue_order(order, REPLAY_QUEUE_ORDERS)
        if base.sequential and order != "fifo":
            raise ValueError(f"queue_order: {order} orders a queue, and --sequential has none (one request at a time)")
    ranked = next((order for order in queue_orders if by_priority(order)), None)
    if ranked and not base.tenant_priorities and trace_priorities is False:
        raise ValueError(f"queue_order: {ranked} orders the queue by the tenants' priorities and the requests' "
                         "own; give the tenants' (--tenant-priorities, e.g. quiet=-10), or a trace whose lines "
                         "carry priorities")
    if replicas > 1:
        if base.sequential:
            raise ValueError("replicas: a fleet replays in concurrent mode only (drop --sequential)")
        if not routings:
            raise ValueError("routing: give at least one routing policy")
        for routing in routings:
            if routing not in (*ROUTING_POLICIES, RECORDED):
                raise ValueError(f"routing: unknown value {routing!r}; choose from "
                                 f"{', '.join((*ROUTING_POLICIES, RECORDED))}")
        make_router("prefix", balance_seconds=balance_seconds, new_prefix=new_prefix)  # its own checks
        if not queue_limits:
            raise ValueError("queue_limits: give heed, ignore or both")
        for value in queue_limits:
            check_queue_limits(value)
        check_speeds(speeds, replicas)
        check_queue_waits(queue_waits, replicas)
    elif speeds is not None:
        raise ValueError("replica_speeds: speeds are for a fleet (--replicas N)")
    elif queue_waits is not None:
        raise ValueError("replica_queue_waits: waits are for a fleet (--replicas N)")
    if not block_sizes:
        raise ValueError("block_sizes: give at least one block size")
    for size in block_sizes:
        validate_block_size(size)
    if not capacities:
        raise ValueError("capacity_tokens: give at least one capacity")
    for capacity in capacities:
        if capacity < max(block_sizes):
            raise ValueError(f"capacity_tokens: {capacity} is smaller than one block of "
                             f"{max(block_sizes)} tokens")
    for policy in policies:
        if policy not in REPLAY_POLICIES:
            raise ValueError(f"policy: unknown value {policy!r}; choose from {', '.join(REPLAY_POLICIES)}")
    if FORESIGHT in policies:  # it reads the trace's future in arrival order (daemon/replay/foresight.py)
        if replicas > 1:
            raise ValueError("policy: belady reads one cache's future in the trace's order; a fleet's router decides "
                             "which replica meets each request (replay it without --replicas)")
        if any(order != "fifo" for order in queue_orders):
            raise ValueError("policy: belady reads the trace's future in arrival order, the order a FIFO queue starts "
                             "requests in; replay it with --queue-order fifo")
    if reservations is not None and not reservations:
        raise ValueError("reservation: give at least one output reservation (fixed:N, fraction:F or p95)")
    for spec in (base.reservation,) if reservations is None else reservations:
        parse_reservation(spec)  # (its error names the output reservation and the value)
    for name in ("prefill_rate", "decode_rate", "time_scale"):
        if not getattr(base, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(base, name)!r}")
    for name in ("decode_batch_cost", "decode_context_cost", "prefill_overhead", "prefill_context_cost"):
        if not 0 <= getattr(base, name) < float("inf"):
            raise ValueError(f"{name}: must be a number >= 0 (0: none), got {getattr(base, name)!r}")
    if base.max_tokens is not None and base.max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {base.max_tokens!r}")
    for name in ("max_running", "max_queue"):
        if getattr(base, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(base, name)!r}")
    if max_runnings is not None and not max_runnings:
        raise ValueError("max_running: give at least one count of requests in service at once")
    for count in max_runnings or ():
        if count < 1:
            raise ValueError(f"max_running: must be >= 1, got {count!r}")
    if not base.max_queue_wait >= 0:
        raise ValueError(f"max_queue_wait: must be a number of seconds >= 0 (0: no limit), got {base.max_queue_wait!r}")


# the replay's queue orders: kvd's (priority: by tenant_priorities; a trace's requests carry none of their own)
REPLAY_QUEUE_ORDERS = QUEUE_ORDERS  # (every order kvd has)


def _grid(requests: Sequence[TraceRequest], block_sizes: Sequence[int], capacities: Sequence[int],
          policies: Sequence[str], base: ReplaySettings, tier_tokens: Sequence[int] = (0,),
          queue_orders: Sequence[str] = ("fifo",), reservations: Sequence[str] | None = None,
          max_runnings: Sequence[int] | None = None) -> Iterator[tuple[ReplaySettings, list, list[int], list]]:
    """(settings, prompt keys, unbounded-cache hits, output keys) for each point of the grid, hashing
    each block size once."""
    for block_size in block_sizes:
        keyer = TraceKeyer(block_size)
        keys = [keyer.keys(request) for request in requests]
        outputs = [keyer.output_keys(request, index, keys[index]) for index, request in enumerate(requests)]
        max_hits = max_hit_blocks(requests, keys, block_size, outputs)
        for capacity in capacities:
            for tier in tier_tokens:
                for policy in policies:
                    # with tenant shares, each policy without them and with them: the comparison they are for
                    for shares in ((), base.tenant_shares) if base.tenant_shares else ((),):
                        for order in queue_orders:
                            for reservation in reservations or (base.reservation,):
                                for running in max_runnings or (base.max_running,):
                                    yield (replace(base, block_size=block_size, capacity_tokens=capacity,
                                                   policy=policy, tenant_shares=shares, tier_tokens=tier,
                                                   queue_order=order, reservation=reservation,
                                                   max_running=running), keys, max_hits, outputs)
        del keys, keyer, outputs


def sweep(requests: Sequence[TraceRequest], block_sizes: Sequence[int], capacities: Sequence[int],
          policies: Sequence[str], base: ReplaySettings,
          progress: Callable[[int], None] | None = None,
          on_result: Callable[[ReplayResult], None] | None = None,
          tier_tokens: Sequence[int] = (0,), queue_orders: Sequence[str] = ("fifo",),
          reservations: Sequence[str] | None = None, max_runnings: Sequence[int] | None = None) -> list[ReplayResult]:
    """Replay every point of the grid (block sizes x capacities x lower-tier sizes x policies, with
    and without tenant shares x queue orders x output reservations x requests in service at once,
    None: the base's) through one cache each."""
    validate_grid(block_sizes, capacities, policies, base, tier_tokens=tier_tokens, queue_orders=queue_orders,
                  reservations=reservations, trace_priorities=any(r.priority for r in requests),
                  max_runnings=max_runnings)
    results: list[ReplayResult] = []
    for settings, keys, max_hits, outputs in _grid(requests, block_sizes, capacities, policies, base, tier_tokens,
                                                   queue_orders, reservations, max_runnings):
        results.append(replay(settings, requests, keys, max_hits, progress, outputs=outputs))
        if on_result:
            on_result(results[-1])
    return results


def sweep_fleet(requests: Sequence[TraceRequest], block_sizes: Sequence[int], capacities: Sequence[int],
                policies: Sequence[str], replicas: int, routings: Sequence[str], base: ReplaySettings,
                balance_seconds: float = 2.0, progress: Callable[[int], None] | None = None,
                on_result: Callable[[FleetResult], None] | None = None,
                new_prefix: str = "home", tier_tokens: Sequence[int] = (0,),
                placements: int = 1, queue_limits: Sequence[str] = ("heed",),
                reroute: bool = True, speeds: Sequence[float] | None = None,
                queue_waits: Sequence[float] | None = None, queue_orders: Sequence[str] = ("fifo",),
                reservations: Sequence[str] | None = None, max_runnings: Sequence[int] | None = None
                ) -> list[FleetResult]:
    """`sweep` for a fleet of `replicas` (each with a cache of each capacity, sharing a lower tier of
    each `tier_tokens`), once per routing and per `queue_limits` value (heed, ignore: once for a
    routing that reads no load); a routing that sends new prefixes home by a hash is replayed
    `placements` times, each placing them anew (FleetResult.placements). `reroute`: queue timeouts
    go to another replica (`replay_fleet`); `speeds`, `queue_waits`: each replica's speed and
    max_queue_wait (`replay_fleet`); `reservations`, `max_runnings`: the output reservations and the
    requests in service at once compared (None: the base's)."""
    validate_grid(block_sizes, capacities, policies, base, replicas, routings, balance_seconds, new_prefix,
                  tier_tokens, placements, queue_limits, speeds, queue_waits, queue_orders, reservations,
                  any(r.priority for r in requests), max_runnings)
    results: list[FleetResult] = []
    for settings, keys, max_hits, outputs in _grid(requests, block_sizes, capacities, policies, base, tier_tokens,
                                                   queue_orders, reservations, max_runnings):
        for routing in routings:
            for limits in limit_choices(routing, queue_limits):
                draws = placements if placements > 1 and places_new_prefixes(routing, new_prefix) else 1
                runs = [replay_fleet(settings, replicas, routing, requests, keys, max_hits, progress,
                                     balance_seconds=balance_seconds, new_prefix=new_prefix, placement=placement,
                                     queue_limits=limits, reroute=reroute, speeds=speeds, queue_waits=queue_waits,
                                     outputs=outputs)
                        for placement in range(draws)]
                if draws > 1:
                    runs[0].placements = [placement_figures(run, placement) for placement, run in enumerate(runs)]
                results.append(runs[0])
                if on_result:
                    on_result(results[-1])
    return results

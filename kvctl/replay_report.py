"""`kvctl bench replay`'s report: the sweep run under a progress bar, and the tables and lines
that compare its runs (imported when the command runs, so that kvctl starts without the replay stack)."""

from __future__ import annotations

import statistics
from typing import Sequence

from rich.console import Console
from rich.text import Text

from kvctl.daemon.replay.fleet import RECORDED, FleetResult, limit_choices, places_new_prefixes, reads_load
from kvctl.daemon.replay.foresight import reads_the_future
from kvctl.daemon.replay.simulator import ReplayResult, ReplaySettings
from kvctl.daemon.replay.sweep import sweep, sweep_fleet
from kvctl.trace_stats import fleet_figures, live_cached_ratio

from .tables import compact_table, keep_whole


def run_with_progress(console: Console, requests, sizes, capacities, policies,
                       base: ReplaySettings, fleet: dict | None = None, tiers: Sequence[int] = (0,),
                       orders: Sequence[str] = ("fifo",), reservations: Sequence[str] | None = None,
                       runnings: Sequence[int] | None = None) -> list:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs = 1 if fleet is None else sum((fleet["placements"] if places_new_prefixes(r, fleet["new_prefix"]) else 1)
                                       * len(limit_choices(r, fleet["queue_limits"])) for r in fleet["routing"])
    total = len(requests) * len(sizes) * len(capacities) * len(policies) * runs \
        * (2 if base.tenant_shares else 1) * len(tiers) * len(orders) * len(reservations or (None,)) \
        * len(runnings or (None,))
    with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("replay", total=total)
        pending = 0

        def tick(n: int) -> None:
            nonlocal pending
            pending += n
            if pending >= 256:
                progress.advance(task, pending)
                pending = 0

        if fleet is None:
            return sweep(requests, sizes, capacities, policies, base, progress=tick, tier_tokens=tiers,
                         queue_orders=orders, reservations=reservations, max_runnings=runnings)
        return sweep_fleet(requests, sizes, capacities, policies, fleet["replicas"], fleet["routing"], base,
                           fleet["balance_seconds"], progress=tick, new_prefix=fleet["new_prefix"],
                           tier_tokens=tiers, placements=fleet["placements"], queue_limits=fleet["queue_limits"],
                           reroute=fleet["reroute"], speeds=fleet["replica_speeds"],
                           queue_waits=fleet["replica_queue_waits"], queue_orders=orders,
                           reservations=reservations, max_runnings=runnings)


def compares_service(results: list[ReplayResult] | list[FleetResult]) -> bool:
    """Whether the runs compare output reservations or requests in service at once (longer policy names)."""
    return len({r.reservation for r in results}) > 1 or len({r.max_running for r in results}) > 1


def policy_names(results: list[ReplayResult] | list[FleetResult]):
    """How tables and lines name a run's policy: with its output reservation where several were
    replayed (`--reserve fraction:1.0,p95`): `lru p95`; and its requests in service at once where
    several were (`--max-running 16,64`): `lru x16`."""
    reservations = len({r.reservation for r in results}) > 1
    runnings = len({r.max_running for r in results}) > 1

    def name(result: ReplayResult | FleetResult) -> str:
        return (result.policy + (f" {result.reservation}" if reservations else "")
                + (f" x{result.max_running}" if runnings else ""))

    return name


def live_timing_line(live: dict) -> str:
    """kvd's own timings in the trace (`live_timings`), in the words of the runs' lines."""
    line = (f"kvd's own account in the trace ({live['requests']:,} requests): cached {live['cached_token_ratio']:.1%}; "
            f"first token p50/p95 {_short(live['ttft_p50_s'])}/{_short(live['ttft_p95_s'])} s, end to end "
            f"{_short(live['e2e_p50_s'])}/{_short(live['e2e_p95_s'])} s")
    if live["itl_p50_s"] is not None:
        line += f"; a token {live['itl_p50_s'] * 1000:.0f}/{live['itl_p95_s'] * 1000:.0f} ms"
    return line


def preemption_lines(results: list[ReplayResult] | list[FleetResult], label=None,
                     live: dict | None = None) -> list[Text]:
    """Where output reservations or requests in service at once were compared, a run preempted, or
    the trace says how kvd served it (`live`: `live_timings`, its line first): each run's preemptions
    and the tokens they computed again, its unused reservation, and its first-token, end-to-end and
    per-output-token times in the service model: what a shorter reservation or a bigger batch
    trades, and what to set beside kvd's."""
    name = policy_names(results)
    if not compares_service(results) and not any(r.preemptions for r in results) and live is None:
        return []
    lines = [] if live is None else [Text(live_timing_line(live))]
    for r in results:
        where = f"block {r.block_size}, capacity {r.capacity_tokens:,}, {name(r)}"
        where = f"{label(r)} ({where})" if label else where
        parts = [f"{r.preemptions:,} preempted" + (f" ({r.recomputed_after_preemption:,} tokens computed again)"
                                                    if r.preemptions else "")]
        if isinstance(r, ReplayResult):
            parts.append(f"reserved unused {r.reservation_waste:.1%}")
        if r.ttft_p50_s is not None and r.e2e_p50_s is not None:
            parts.append(f"first token p50/p95 {_short(r.ttft_p50_s)}/{_short(r.ttft_p95_s)} s, "
                         f"end to end {_short(r.e2e_p50_s)}/{_short(r.e2e_p95_s)} s")
        if r.itl_p50_s is not None:
            parts.append(f"a token {r.itl_p50_s * 1000:.0f}/{r.itl_p95_s * 1000:.0f} ms")
        lines.append(Text(f"{where}: " + "; ".join(parts)))
    return lines


def replay_tables(results: list[ReplayResult], trace_name: str, requests: int, live: dict | None = None) -> list:
    """What decides (hit, recomputation, evictions, fragmentation, occupancy, rejections) in a
    table that fits 80 columns; the unbounded cache's hit ratio by block size in a line; and what
    the cache core itself cost in the replay (allocation latency, block operations per second)."""
    name = policy_names(results)
    # a lower tier replayed: its size and what came back from it, in place of evictions and
    # fragmentation (which block size decides), so that the table still fits 80 columns
    tiered = any(r.tier_tokens for r in results)
    middle = ["restored", "recomputed", "occupancy"] if tiered else ["recomputed", "evictions", "frag", "occupancy"]
    if compares_service(results):  # the policy names their reservations or batches: no room for frag
        middle = [m for m in middle if m != "frag"]
    decision = compact_table("block", "capacity", *(["tier"] if tiered else []), "policy", "hit", *middle,
                             "rejected", title=f"replay of {trace_name} ({requests} requests)")
    for column in decision.columns:
        if column.header != "policy":
            column.justify = "right"
    for r in results:
        figures = {"restored": f"{r.restored_ratio:.1%}", "recomputed": f"{r.recomputed_tokens:,}",
                   "evictions": f"{r.evictions:,}", "frag": f"{r.fragmentation:.2%}",
                   "occupancy": f"{r.peak_occupancy:.0%}/{r.mean_occupancy:.0%}"}
        decision.add_row(str(r.block_size), f"{r.capacity_tokens:,}", *([f"{r.tier_tokens:,}"] if tiered else []),
                         name(r), f"{r.hit_ratio:.1%}", *(figures[m] for m in middle), str(r.rejections))
    unbounded = {r.block_size: r.max_hit_ratio for r in results}
    ceiling = Text("hit with an unbounded cache: " + ", ".join(
        f"block {size} {ratio:.1%}" for size, ratio in unbounded.items()) + "; occupancy is peak/mean")
    cost = compact_table("block", "capacity", *(["tier"] if tiered else []), "policy", "alloc µs p50/p99",
                         "block ops/s", "seconds", title="cost of the cache core in the replay")
    for column in cost.columns:
        if column.header != "policy":
            column.justify = "right"
    for r in results:
        cost.add_row(str(r.block_size), f"{r.capacity_tokens:,}", *([f"{r.tier_tokens:,}"] if tiered else []),
                     name(r), f"{r.alloc_us_p50:.1f}/{r.alloc_us_p99:.1f}",
                     f"{r.block_ops_per_second:,.0f}", f"{r.seconds:.2f}")
    parts = [decision, ceiling, *foresight_lines(results), *rejection_lines(results), *first_token_lines(results),
             *preemption_lines(results, live=live), Text(""), cost]
    tenants = sorted({t for r in results for t in r.tenant_hit_ratio})
    if tenants:  # a trace that names tenants: what each kept, which is what shares are for
        by_tenant = compact_table("block", "capacity", "policy", *tenants, title="hit by tenant")
        for index in (0, 1, *range(3, 3 + len(tenants))):
            by_tenant.columns[index].justify = "right"
        for r in results:
            by_tenant.add_row(str(r.block_size), f"{r.capacity_tokens:,}", name(r),
                              *(f"{r.tenant_hit_ratio[t]:.1%}" if t in r.tenant_hit_ratio else "-" for t in tenants))
        evicted = compact_table("block", "capacity", "policy", *tenants, title="evicted to make room, by tenant")
        for index in (0, 1, *range(3, 3 + len(tenants))):
            evicted.columns[index].justify = "right"
        for r in results:
            evicted.add_row(str(r.block_size), f"{r.capacity_tokens:,}", name(r),
                            *(f"{r.tenant_evicted_blocks[t]:,}" if t in r.tenant_evicted_blocks else "-"
                              for t in tenants))
        parts += [Text(""), by_tenant, Text(""), evicted]
        if any(r.tenant_ttft_p50_s for r in results):  # concurrent mode: whom the queue made wait
            parts += [Text(""), _tenant_first_token_table(results, tenants)]
    return parts


def _tenant_first_token_table(results: list[ReplayResult], tenants: list[str]):
    """Each tenant's time to first token p50/p95 in the service model, with its requests turned
    away (of any reason) and preempted where there were some: what a priority queue order moves."""
    name = policy_names(results)
    table = compact_table("block", "capacity", "policy", *tenants,
                          title="first token p50/p95 (s), by tenant")
    for index in (0, 1, *range(3, 3 + len(tenants))):
        table.columns[index].justify = "right"
    for r in results:
        cells = []
        for tenant in tenants:
            times, rejected = tenant_first_tokens(r, tenant), r.tenant_rejected.get(tenant, 0)
            rej = f"(rej {rejected:,})" if rejected else ""
            preempted = r.tenant_preemptions.get(tenant, 0)
            pre = f"(pre {preempted:,})" if preempted else ""
            cells.append(" ".join(part for part in (times, rej, pre) if part) or "-")
        table.add_row(str(r.block_size), f"{r.capacity_tokens:,}", name(r), *cells)
    return table


def foresight_lines(results: list[ReplayResult]) -> list[Text]:
    """Where `belady` ran (--policy ...,belady): beside its hit, the best of the policies kvd can run
    on the same cache, so that the gap says what eviction order alone could still add (the
    unbounded cache's line says what memory could)."""
    def point(r: ReplayResult) -> tuple:
        return (r.block_size, r.capacity_tokens, r.tier_tokens, r.reservation, r.max_running, "+shares" in r.policy)

    lines = []
    for bound in (r for r in results if reads_the_future(r.policy)):
        others = [r for r in results if point(r) == point(bound) and r is not bound]
        best = max(others, key=lambda r: r.hit_ratio, default=None)
        beside = f", the best kvd can run {best.hit_ratio:.1%} ({best.policy})" if best is not None else ""
        lines.append(Text(f"belady evicts knowing the trace's future, as no cache can: at block {bound.block_size}, "
                          f"capacity {bound.capacity_tokens:,}, hit {bound.hit_ratio:.1%}{beside}"))
    return lines


def rejection_lines(results: list[ReplayResult]) -> list[Text]:
    """A line per run that rejected requests: why, by reason (queue_timeout where max_queue_wait
    turned them away, queue_full, never_fits, cache_full)."""
    name = policy_names(results)
    return [Text(f"rejected at block {r.block_size}, capacity {r.capacity_tokens:,}, {name(r)}: " + ", ".join(
        f"{reason} {count:,}" for reason, count in sorted(r.reject_reasons.items())))
        for r in results if r.reject_reasons]


def first_token_lines(results: list[ReplayResult]) -> list[Text]:
    """With queue orders compared (--queue-order fifo,lpm): each run's time to first token in the
    service model, which the order moves most (by tenant too: `_tenant_first_token_table`)."""
    name = policy_names(results)
    if len({r.queue_order for r in results}) < 2 or results[0].ttft_p50_s is None:
        return []
    return [Text(f"time to first token p50/p95/p99 at block {r.block_size}, capacity {r.capacity_tokens:,}, "
                 f"{name(r)}: {r.ttft_p50_s:.2f}/{r.ttft_p95_s:.2f}/{r.ttft_p99_s:.2f} s") for r in results]


def _short(value: float) -> str:
    """Three significant figures at most: 0.08, 1.83, 46.2, 110."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _millions(tokens: int) -> str:
    """1048576 -> 1.05M; below a million as it is, with separators."""
    return f"{tokens / 1e6:.2f}M" if tokens >= 10**6 else f"{tokens:,}"


def fleet_tables(results: list[FleetResult], trace_name: str, requests: int, replicas: int,
                  live: dict | None = None) -> list:
    """Per routing policy: the hit ratio the fleet keeps, first-token times in the service model,
    how unevenly it loads the replicas, rejections; the ceiling (one unbounded cache) in a line."""
    name = policy_names(results)
    tiered = any(r.tier_tokens for r in results)  # a shared tier: its size and what came back from it
    tight = False
    if tiered:  # two more columns: token counts in millions, shorter headers (80 columns)
        table = compact_table("block", "capacity", "tier", "policy", "routing", "hit", "restored", "TTFT s",
                              "imbal", "rejected", title=f"replay of {trace_name} ({requests} requests) on "
                              f"{replicas} replicas, capacity per replica, one tier shared by them (tokens)")
    else:  # with reservations compared (longer policy names), the tiered table's short headers
        tight = compares_service(results)
        table = compact_table("block", "capacity", "policy", "routing", "hit",
                              "TTFT s" if tight else "TTFT p50/p95", "imbal" if tight else "imbalance",
                              "rejected", title=f"replay of {trace_name} ({requests} requests) on {replicas} "
                                                "replicas, capacity per replica")
    for column in table.columns:
        if column.header not in ("policy", "routing"):
            column.justify = "right"
    label = routing_labels(results)
    for r in results:
        if tiered:
            ttft = "-" if r.ttft_p50_s is None else f"{_short(r.ttft_p50_s)}/{_short(r.ttft_p95_s)}"
            table.add_row(str(r.block_size), _millions(r.capacity_tokens), _millions(r.tier_tokens), name(r),
                          label(r), f"{r.hit_ratio:.1%}", f"{r.restored_ratio:.1%}", ttft, f"{r.imbalance:.2f}",
                          str(r.rejections))
            continue
        ttft = "-" if r.ttft_p50_s is None else f"{_short(r.ttft_p50_s)}/{_short(r.ttft_p95_s)}" if tight \
            else f"{r.ttft_p50_s:.2f}/{r.ttft_p95_s:.2f} s"
        table.add_row(str(r.block_size), f"{r.capacity_tokens:,}", name(r), label(r), f"{r.hit_ratio:.1%}",
                      ttft, f"{r.imbalance:.2f}", str(r.rejections))
    if tiered:
        keep_whole(table, 4, 7)  # the routing's name and the times: the title wraps instead
    short = tiered or tight
    ceiling = {r.block_size: r.max_hit_ratio for r in results}
    return [table, Text("hit with one unbounded cache for the fleet: " + ", ".join(
        f"block {size} {ratio:.1%}" for size, ratio in ceiling.items())
        + ("; imbal (imbalance)" if short else "; imbalance") + " is the busiest replica's requests over the mean"
        + ("; TTFT p50/p95" if short else "")
        + ("; heed/ignore: whether the router passed over replicas predicted past their max_queue_wait"
           if any(label(r) != r.routing for r in results) else ""))] \
        + [Text(placement_spread(r)) for r in results if r.placements] + fleet_rejection_lines(results, label) \
        + replica_lines(results, label) + fleet_tenant_lines(results, label) \
        + preemption_lines(results, label, live)


def tenant_first_tokens(result: ReplayResult | FleetResult, tenant: str) -> str | None:
    """`tenant`'s first-token p50/p95 in seconds, `0.44/1.37`; None where none of its requests started."""
    if tenant not in result.tenant_ttft_p50_s:
        return None
    return f"{_short(result.tenant_ttft_p50_s[tenant])}/{_short(result.tenant_ttft_p95_s[tenant])}"


def fleet_tenant_lines(results: list[FleetResult], label) -> list[Text]:
    """With a trace that names tenants: a line per fleet run of each tenant's first-token p50/p95
    and its requests turned away (what a priority queue moves, and where routing sends it)."""
    name = policy_names(results)
    lines = []
    for r in results:
        tenants = sorted({*r.tenant_ttft_p50_s, *r.tenant_rejected})
        if not tenants:
            continue
        parts = [f"{tenant} " + (f"{times} s" if (times := tenant_first_tokens(r, tenant)) else "-")
                 + (f" ({r.tenant_rejected[tenant]:,} rejected)" if r.tenant_rejected.get(tenant) else "")
                 + (f" ({r.tenant_preemptions[tenant]:,} preempted)" if r.tenant_preemptions.get(tenant) else "")
                 for tenant in tenants]
        lines.append(Text(f"first token p50/p95 by tenant, {label(r)} (block {r.block_size}, capacity "
                          f"{r.capacity_tokens:,}, {name(r)}): " + ", ".join(parts)))
    return lines


def routing_labels(results: list[FleetResult]):
    """How the fleet table names a row's routing: with `, heed` or `, ignore` where both were
    replayed (`--queue-limits heed,ignore`), for the policies that read load."""
    compared = len({r.queue_limits for r in results if reads_load(r.routing)}) > 1

    def label(result: FleetResult) -> str:
        if compared and reads_load(result.routing):
            return f"{result.routing}, {result.queue_limits}"
        return result.routing

    return label


def replica_lines(results: list[FleetResult], label) -> list[Text]:
    """With replicas that differ (speeds, max_queue_wait): where each run sent its requests,
    replica by replica."""
    name = policy_names(results)
    if not results or not (results[0].speeds or results[0].queue_waits):
        return []
    differ = "; ".join(([f"speeds {'/'.join(f'{speed:g}' for speed in results[0].speeds)}"] if results[0].speeds
                        else []) + ([f"max_queue_wait {'/'.join(f'{wait:g}' for wait in results[0].queue_waits)} s"]
                                    if results[0].queue_waits else []))
    return [Text(f"requests per replica ({differ}), {label(r)} (block {r.block_size}, capacity "
                 f"{r.capacity_tokens:,}, {name(r)}): " + "/".join(f"{n:,}" for n in r.requests_per_replica))
            for r in results]


def fleet_rejection_lines(results: list[FleetResult], label) -> list[Text]:
    """A line per fleet run that rejected or re-routed requests: rejections by reason, and the
    queue timeouts and refusals by a full queue that the router took to another replica."""
    name = policy_names(results)
    lines = []
    for r in results:
        if not (r.reject_reasons or r.rerouted or r.rerouted_full):
            continue
        parts = [f"rejected {', '.join(f'{why} {n:,}' for why, n in sorted(r.reject_reasons.items()))}"] \
            if r.reject_reasons else []
        if r.rerouted:
            parts.append(f"re-routed {r.rerouted:,} after a queue timeout")
        if r.rerouted_full:
            parts.append(f"re-routed {r.rerouted_full:,} after a full queue (429)")
        lines.append(Text(f"{label(r)} (block {r.block_size}, capacity {r.capacity_tokens:,}, {name(r)}): "
                          + "; ".join(parts)))
    return lines


def live_beside_recorded(requests, results: list[FleetResult]) -> dict | None:
    """For a fleet's trace kvd router saved (lines that name their replica and say how kvd served
    them): the live fleet's cached-token ratio, in all and per replica, beside each replay routed
    as recorded, in all and per replica. Where the two part, the replay's cache model does, not
    its routing. None for a trace that does not say."""
    fleet, live = fleet_figures(requests), live_cached_ratio(requests)
    if fleet is None or live is None:
        return None
    names = list(dict.fromkeys(r.replica for r in requests if r.replica is not None))  # as `recorded` numbers them
    return {"cached_token_ratio": live,
            "replicas": {name: fleet["replicas"][name]["cached_token_ratio"] for name in names},
            "recorded": [{"block_size": r.block_size, "capacity_tokens": r.capacity_tokens, "policy": r.policy,
                          "hit_ratio": r.hit_ratio, "replicas": dict(zip(names, r.hit_ratio_per_replica))}
                         for r in results if r.routing == RECORDED]}


def live_lines(live: dict) -> str:
    """The live fleet's figures and the recorded replays', a line each."""
    def each(ratios: dict) -> str:
        return ", ".join(f"{name} {'-' if ratio is None else f'{ratio:.1%}'}" for name, ratio in ratios.items())

    lines = [f"live fleet (kvd's own account in the trace): cached {live['cached_token_ratio']:.1%} "
             f"({each(live['replicas'])})"]
    lines += [f"replayed as recorded (block {r['block_size']}, {r['capacity_tokens']:,} tokens, {r['policy']}): "
              f"hit {r['hit_ratio']:.1%} ({each(r['replicas'])})" for r in live["recorded"]]
    return "\n".join(lines)


def placement_spread(result: FleetResult) -> str:
    """One line on what the placements of new prefixes gave a row (the table shows placement 0)."""
    hits = sorted(p["hit_ratio"] for p in result.placements)
    imbalances = sorted(p["imbalance"] for p in result.placements)
    where = f"block {result.block_size}, {result.capacity_tokens:,} tokens" + (
        f", tier {result.tier_tokens:,}" if result.tier_tokens else "")
    return (f"{result.routing} ({result.policy}, {where}) over {len(hits)} placements of new prefixes: hit "
            f"{hits[0]:.1%} to {hits[-1]:.1%}, median {statistics.median(hits):.1%}; imbalance "
            f"{imbalances[0]:.2f} to {imbalances[-1]:.2f}")

"""`kvctl bench replay`: replay a request trace through the cache core and compare settings."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.console import Console
from rich.text import Text

from kvctl.daemon.replay.fleet import RECORDED, FleetResult, limit_choices, places_new_prefixes, reads_load
from kvctl.daemon.replay.service_rates import measured_rates
from kvctl.trace_stats import (batch_cost_text, coarse_ids, fleet_figures, live_cached_ratio, live_timings,
                               prefill_cost_text)
from kvctl.daemon.replay.simulator import ReplayResult, ReplaySettings
from kvctl.daemon.replay.sweep import sweep, sweep_fleet, validate_grid
from kvctl.daemon.replay.trace import generate_trace, read_trace
from kvctl.policies.tenant_map import any_queue_wait, parse_tenant_map, priority_of, queue_wait_of
from kvctl.policies.tenant_shares import parse_shares

from .errors import UserError
from .replay_slo import parse_slo, pick, slo_line
from .tables import compact_table, keep_whole

DEFAULT_BLOCK_SIZES = "16,32,64,128,256,512"
DEFAULT_CAPACITY_TOKENS = 262_144
DEMO_REQUESTS = 600


def parse_int_list(field: str, values: list[str]) -> list[int]:
    """Accept repeated options and comma-separated lists: `--x 1,2 --x 3`."""
    out: list[int] = []
    for value in values:
        for part in value.split(","):
            part = part.strip().replace("_", "")
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise UserError(f"{field}: expected integers, got {part!r}") from None
    return out


def parse_float_list(field: str, value: str) -> list[float]:
    """`1,1,0.5` as numbers; a part that is not one is a UserError naming the field."""
    out = []
    for part in value.split(","):
        try:
            out.append(float(part.strip()))
        except ValueError:
            raise UserError(f"{field}: expected numbers, got {part.strip()!r}") from None
    return out


def parse_names(field: str, values: list[str]) -> list[str]:
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    if not names:
        raise UserError(f"{field}: give at least one value")
    return names


def replay_command(
    ctx: typer.Context,
    trace: Optional[Path] = typer.Argument(
        None, help="Mooncake-format JSONL trace; omit to replay a generated demo trace."),
    block_sizes: list[str] = typer.Option(
        [DEFAULT_BLOCK_SIZES], "--block-sizes", help="Block sizes in tokens (comma-separated)."),
    capacity_tokens: list[str] = typer.Option(
        [str(DEFAULT_CAPACITY_TOKENS)], "--capacity-tokens",
        help="Cache capacity in tokens; repeat or comma-separate for several."),
    policy: list[str] = typer.Option(["lru,cost"], "--policy", help="Eviction policies: lru, cost, lfu, priority "
                                     "(with --tenant-priorities)."),
    queue_order: list[str] = typer.Option(["fifo"], "--queue-order",
                                          help="Admission queue order, as kvd's queue_order: fifo, priority (by "
                                               "--tenant-priorities; rows 'lru+prio'), lpm (the longest cached "
                                               "prefix first; rows 'lru+lpm'), priority+lpm (lpm within each "
                                               "priority; 'lru+prio+lpm'), or several to compare (fifo,lpm)."),
    reserve: list[str] = typer.Option(["fraction:1.0"], "--reserve",
                                      help="Output reservation: fixed:N, fraction:F or p95, or several to compare "
                                           "(fraction:1.0,p95). Short of an output, a request grows as it decodes "
                                           "and preempts as kvd's does."),
    sequential: bool = typer.Option(False, "--sequential", help="One request at a time."),
    prefill_rate: float = typer.Option(20_000.0, help="Service model: prefill tokens per second (with no context, "
                                       "with --prefill-context-cost)."),
    prefill_overhead: float = typer.Option(0.0, help="Service model: seconds each prompt's computation takes beyond "
                                           "its tokens' (the step it runs in); 0: none."),
    prefill_context_cost: float = typer.Option(
        0.0, help="Service model: each 1,024 tokens before a prompt token (cached or computed) make it this fraction "
                  "longer to compute, as its attention reads them; 0: none."),
    decode_rate: float = typer.Option(40.0, help="Service model: output tokens per second per request (alone, with "
                                      "--decode-batch-cost)."),
    decode_batch_cost: float = typer.Option(
        0.0, help="Service model: each other request in service lengthens a decode step by this fraction of a lone "
                  "request's, as a batched step grows (0.02: 64 running decode at 1/2.26 of the rate alone); "
                  "0: none."),
    decode_context_cost: float = typer.Option(
        0.0, help="Service model: each 1,024 tokens of context the requests in service hold (prompt and output "
                  "made) lengthen a decode step by this fraction of a lone request's with none, as a step reads "
                  "every request's KV; 0: none."),
    rates_from_trace: bool = typer.Option(False, "--rates-from-trace",
                                          help="Service model: the prefill and decode rates at which the replay's "
                                               "totals equal kvd's, and the decode batch and context costs its "
                                               "requests show, "
                                               "from the trace's own timings (traces kvd saves say how it served "
                                               "each request)."),
    slo: list[str] = typer.Option([], "--slo", help="An objective every run is held to, written as a rollout's stop "
                                  "conditions are (itl_p95_s <= 0.05, ttft_p95_s <= 2; repeat for several): which "
                                  "runs meet them all, and the pick among those (the highest hit, then the lowest "
                                  "first-token p95). Exit 3 when no run does."),
    max_running: list[str] = typer.Option(["64"], "--max-running",
                                          help="Service model: requests in service at once (kvd's max_running), or "
                                               "several to compare (16,32,64; rows 'lru x32'): with "
                                               "--decode-batch-cost, more at once decode each more slowly."),
    max_queue: int = typer.Option(4096, help="Admission queue bound; arrivals beyond it are rejected."),
    max_queue_wait: float = typer.Option(0.0, help="Seconds a request may wait to start before it is rejected "
                                         "(kvd's max_queue_wait, queue_timeout); 0: no limit."),
    tenant_queue_waits: Optional[str] = typer.Option(
        None, "--tenant-queue-waits", help="Tenants' own queue wait limits in seconds, as kvd's --tenant-queue-waits "
                                           "(e.g. noisy=120,quiet=10; 0: none), in place of --max-queue-wait's."),
    time_scale: float = typer.Option(1.0, help="Multiply trace timestamps by this."),
    max_tokens: Optional[int] = typer.Option(
        None, help="max_tokens clients ask for (never below a request's output) where a trace line does not say "
                   "its own (traces kvd saves do); default: its output."),
    replicas: int = typer.Option(1, "--replicas", help="A fleet of this many replicas, each with the given "
                                 "capacity, behind a router."),
    routing: list[str] = typer.Option(["round_robin,least_loaded,prefix,ttft"], "--routing",
                                      help="With --replicas: routing policies to compare (round_robin, "
                                           "least_loaded, prefix, ttft; recorded: where the live router sent each "
                                           "request, in a fleet's trace kvd router saved)."),
    balance_seconds: float = typer.Option(2.0, help="prefix routing: the extra wait it accepts for a "
                                          "replica that caches more."),
    new_prefix: str = typer.Option("home", help="prefix routing: where a prompt no replica holds goes: home (by "
                                   "a hash of its opening) or least_loaded."),
    replica_speeds: Optional[str] = typer.Option(
        None, "--replica-speeds", help="With --replicas: each replica's prefill and decode speed as a multiple of "
                                       "--prefill-rate and --decode-rate, comma-separated (a fleet of mixed GPUs, "
                                       "e.g. 1,1,1,0.5); default: all 1."),
    replica_queue_waits: Optional[str] = typer.Option(
        None, "--replica-queue-waits", help="With --replicas: each replica's max_queue_wait in seconds, "
                                            "comma-separated (0: none), in place of --max-queue-wait's one for "
                                            "all (replicas configured apart, e.g. 30,30,30,5)."),
    queue_limits: list[str] = typer.Option(["heed"], "--queue-limits",
                                           help="With --replicas and --max-queue-wait: heed (as kvd router's "
                                                "default: least_loaded, prefix and ttft pass over a replica "
                                                "predicted to wait past it), ignore, or heed,ignore to compare."),
    reroute: bool = typer.Option(True, "--reroute/--no-reroute",
                                 help="With --replicas and --max-queue-wait: a request a replica turns away "
                                      "(queue_timeout) goes to a replica not yet tried, as kvd router takes a 503 "
                                      "there; --no-reroute for a fleet that streams its answers (a stream's "
                                      "timeout reaches its client)."),
    placements: int = typer.Option(1, help="prefix routing, new prefixes home: replay it this many times, each "
                                   "placing new prefixes by another hash (as replicas named otherwise would), "
                                   "and show the spread of hit ratios; with few prefixes, where they land "
                                   "decides much."),
    limit: Optional[int] = typer.Option(None, help="Replay only the first N requests."),
    demo_requests: int = typer.Option(DEMO_REQUESTS, help="Size of the generated demo trace."),
    seed: int = typer.Option(0, help="Seed of the generated demo trace."),
    noisy_fraction: float = typer.Option(0.0, help="Generated trace: this fraction of requests are a noisy "
                                         "tenant's one-off documents (kvctl trace generate --noisy-fraction)."),
    tier_tokens: list[str] = typer.Option(
        ["0"], "--tier-tokens", help="A lower tier under the device of this many tokens (host, disk or Redis; "
                                     "LRU): evicted blocks go down, and come back instead of being prefilled. "
                                     "With --replicas, one tier shared by the fleet (a shared Redis). "
                                     "Comma-separate to compare, e.g. 0,4194304 (0: none)."),
    restore_rate: float = typer.Option(200_000.0, help="Service model: tokens a second restored from the lower tier."),
    tier_write: str = typer.Option("write_back", help="What goes down to the lower tier: write_back (what the "
                                   "device evicts), write_through (every prompt block as it is computed) or "
                                   "write_through_selective (a block when a prompt first reuses it), as kvd's "
                                   "write_policy."),
    tenant_shares: Optional[str] = typer.Option(
        None, "--tenant-shares", help="Also replay each policy with these tenant cache shares (as kvd's "
                                      "--tenant-cache-shares, e.g. noisy=0.25): rows 'lru' and 'lru+shares'."),
    tenant_priorities: Optional[str] = typer.Option(
        None, "--tenant-priorities", help="Tenants' priorities as kvd's --tenant-priorities (lower first, e.g. "
                                          "quiet=-10; 0 for a tenant not named): --policy priority keeps their "
                                          "prefixes, --queue-order priority orders the queue by them."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG file (.png): hit rate and "
                                        "fragmentation against block size."),
    save: bool = typer.Option(False, "--save", help="Store the result so an ADR can cite it (run:ID)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the store lives (KVD_STATE_DIR)."),
) -> None:
    """Replay a request trace through the cache core and compare block sizes and policies.

    With --replicas, a fleet of such caches behind each routing policy.

    Example: kvctl bench replay ../shared/traces/mooncake_synthetic_trace.jsonl --block-sizes 16 --json
    """
    sizes = parse_int_list("block_sizes", block_sizes)
    capacities = parse_int_list("capacity_tokens", capacity_tokens)
    policies = parse_names("policy", policy)
    routings = parse_names("routing", routing)
    limits = parse_names("queue_limits", queue_limits)
    orders = parse_names("queue_order", queue_order)
    reservations = parse_names("reservation", reserve)
    runnings = parse_int_list("max_running", max_running)
    try:
        objectives = parse_slo(slo)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    speeds = None if replica_speeds is None else parse_float_list("replica_speeds", replica_speeds)
    waits = None if replica_queue_waits is None else parse_float_list("replica_queue_waits", replica_queue_waits)
    if waits is not None and max_queue_wait:
        raise UserError(f"replica_queue_waits: {replica_queue_waits!r} gives each replica its own max_queue_wait; "
                        f"drop --max-queue-wait {max_queue_wait:g} (the same for all)")
    try:
        own_waits = () if tenant_queue_waits is None else parse_tenant_map(
            tenant_queue_waits, queue_wait_of, "seconds", noun="queue wait")
    except ValueError as exc:
        raise UserError(f"tenant_queue_waits: invalid value {tenant_queue_waits!r}: {exc}") from None
    if len(set(limits)) > 1 and not any_queue_wait(max([max_queue_wait, *(waits or ())]), own_waits):
        raise UserError(f"queue_limits: {','.join(limits)} compares nothing without --max-queue-wait: a router "
                        "heeds the replicas' limits, and there are none")
    base = ReplaySettings(block_size=sizes[0] if sizes else 16,
                          capacity_tokens=capacities[0] if capacities else 0,
                          reservation=reservations[0], sequential=sequential, prefill_rate=prefill_rate,
                          prefill_overhead=prefill_overhead, prefill_context_cost=prefill_context_cost,
                          decode_rate=decode_rate, decode_batch_cost=decode_batch_cost,
                          decode_context_cost=decode_context_cost, max_running=runnings[0] if runnings else 64,
                          max_queue=max_queue,
                          max_queue_wait=max_queue_wait, time_scale=time_scale, max_tokens=max_tokens, restore_rate=restore_rate,
                          tier_write=tier_write, tenant_queue_waits=own_waits)
    tiers = parse_int_list("tier_tokens", tier_tokens) or [0]
    if tenant_shares is not None:
        try:
            base = replace(base, tenant_shares=parse_shares(tenant_shares))
        except ValueError as exc:
            raise UserError(f"tenant_shares: invalid value {tenant_shares!r}: {exc}") from None
    if tenant_priorities is not None:
        if "priority" not in policies and "priority" not in orders:
            raise UserError(f"tenant_priorities: {tenant_priorities!r} are read by the priority eviction policy and "
                            "the priority queue order only; add one (e.g. --policy lru,priority or --queue-order "
                            "fifo,priority)")
        try:
            base = replace(base, tenant_priorities=parse_tenant_map(tenant_priorities, priority_of, "priority"))
        except ValueError as exc:
            raise UserError(f"tenant_priorities: invalid value {tenant_priorities!r}: {exc}") from None
    if not 0 <= noisy_fraction < 1:
        raise UserError(f"noisy_fraction: must be in [0, 1), got {noisy_fraction}")
    if limit is not None and limit < 1:
        raise UserError(f"limit: must be >= 1, got {limit}")
    if plot is not None and replicas > 1:
        raise UserError("plot: the plot compares block sizes of one cache; drop --plot with --replicas")
    if plot is not None:
        from .replay_plot import check_plot_path

        check_plot_path(plot)  # before the replay, which can take minutes
    try:
        validate_grid(sizes, capacities, policies, base, replicas, routings, balance_seconds, new_prefix, tiers,
                      placements, limits, speeds, waits, orders, reservations, trace_priorities=None,
                      max_runnings=runnings)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if placements > 1 and (replicas == 1 or not any(places_new_prefixes(r, new_prefix) for r in routings)):
        raise UserError(f"placements: {placements} needs --replicas and prefix routing with --new-prefix home "
                        f"(where a hash places new prefixes)")  # before the trace is read, which can take long
    err = Console(stderr=True)
    if trace is None:
        requests = generate_trace(demo_requests, seed=seed, noisy_fraction=noisy_fraction)[:limit]
        trace_name = f"generated:{demo_requests}:seed={seed}" + (f":noisy={noisy_fraction}" if noisy_fraction else "")
        if not as_json:
            err.print(f"No trace given: replaying a generated trace of {len(requests)} requests "
                      f"(seed {seed}). Pass a Mooncake-format JSONL file to replay your own.")
    else:
        requests = read_trace(trace, limit)
        trace_name = str(trace)
    if "priority" in orders and not base.tenant_priorities and not any(r.priority for r in requests):
        try:  # (the one check that needs the trace: whether its lines carry priorities of their own)
            validate_grid(sizes, capacities, policies, base, replicas, routings, balance_seconds, new_prefix, tiers,
                          placements, limits, speeds, waits, orders, reservations, trace_priorities=False,
                          max_runnings=runnings)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    measured = None
    if rates_from_trace:
        try:
            measured = measured_rates(requests)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        base = replace(base, prefill_rate=measured.prefill_rate or base.prefill_rate,
                       decode_rate=measured.decode_rate or base.decode_rate,
                       decode_batch_cost=base.decode_batch_cost if measured.decode_batch_cost is None
                       else measured.decode_batch_cost,
                       decode_context_cost=base.decode_context_cost if measured.decode_context_cost is None
                       else measured.decode_context_cost,
                       prefill_overhead=base.prefill_overhead if measured.prefill_overhead is None
                       else measured.prefill_overhead,
                       prefill_context_cost=base.prefill_context_cost if measured.prefill_context_cost is None
                       else measured.prefill_context_cost)
        if not as_json:
            err.print(f"service model from the trace's own timings ({measured.requests:,} requests): prefill "
                      + (f"{measured.prefill_rate:,.0f}" if measured.prefill_rate else f"{base.prefill_rate:,.0f} "
                         "(none to measure it on: --prefill-rate's)")
                      + " tokens/s" + prefill_cost_text(measured.prefill_overhead, measured.prefill_context_cost)
                      + ", decode "
                      + (f"{measured.decode_rate:,.0f}" if measured.decode_rate else f"{base.decode_rate:,.0f} "
                         "(no request made two tokens: --decode-rate's)")
                      + " tokens/s a request"
                      + batch_cost_text(measured.decode_batch_cost, measured.decode_context_cost))

    fleet = None if replicas == 1 else {"replicas": replicas, "routing": routings, "balance_seconds": balance_seconds,
                                        "new_prefix": new_prefix, "placements": placements,
                                        "queue_limits": limits, "reroute": reroute, "replica_speeds": speeds,
                                        "replica_queue_waits": waits}
    results = _run_with_progress(err, requests, sizes, capacities, policies, base, fleet, tiers, orders,
                                 reservations, runnings)
    document = {
        "trace": trace_name,
        "requests": len(requests),
        "settings": {
            "mode": "sequential" if sequential else "concurrent", "reservation": ",".join(reservations),
            "prefill_rate": base.prefill_rate, "prefill_overhead": base.prefill_overhead,
            "prefill_context_cost": base.prefill_context_cost, "decode_rate": base.decode_rate,
            "decode_batch_cost": base.decode_batch_cost, "decode_context_cost": base.decode_context_cost,
            "max_running": runnings[0] if len(runnings) == 1 else runnings,  # (several: compared)
            "rates_from_trace": None if measured is None else {
                "requests": measured.requests, "prefill_rate": measured.prefill_rate,
                "decode_rate": measured.decode_rate, "decode_batch_cost": measured.decode_batch_cost,
                "decode_context_cost": measured.decode_context_cost, "prefill_overhead": measured.prefill_overhead,
                "prefill_context_cost": measured.prefill_context_cost},
            "max_queue": max_queue, "max_queue_wait": max_queue_wait, "time_scale": time_scale, "max_tokens": max_tokens,
            "tenant_queue_waits": dict(own_waits) or None,
            "tenant_shares": dict(base.tenant_shares) or None, "tier_tokens": tiers,
            "tenant_priorities": dict(base.tenant_priorities) or None,
            "restore_rate": restore_rate, "tier_write": tier_write, "queue_order": orders,
        },
        "runs": [r.as_dict() for r in results],
        # kvd cached more of a saved trace's prompts than a replay of its ids can: ids too coarse
        "coarse_ids": coarse_ids(requests[0].block_tokens, live_cached_ratio(requests),
                                 max(r.max_hit_ratio for r in results)),
        # kvd's own timings, where the trace says how it served each request: to set beside the runs'
        "live_timings": live_timings(requests),
    }
    if fleet is not None:
        document["fleet"] = fleet
        document["live"] = live_beside_recorded(requests, results)
    if objectives:
        met, best = pick(results, objectives)
        document["slo"] = {"conditions": [objective.text for objective in objectives], "met": met, "pick": best}
        for index, run in enumerate(document["runs"]):
            run["meets_slo"] = index in met
    if save:
        from .records_cmd import save_run

        save_run(ctx, state_dir, "bench_replay", document)
    if plot is not None:
        from .replay_plot import write_plot  # matplotlib only when asked

        write_plot(plot, results, trace_name)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
    else:
        out = Console()
        live = None if sequential else document["live_timings"]  # (the runs' times beside kvd's own)
        parts = _tables(results, trace_name, len(requests), live) if fleet is None else \
            _fleet_tables(results, trace_name, len(requests), replicas, live)
        for part in parts:
            out.print(part)
        if document.get("live"):
            out.print(Text(live_lines(document["live"])))
        if objectives:
            name, label = policy_names(results), routing_labels(results) if fleet is not None else None
            picked = document["slo"]["met"], document["slo"]["pick"]
            out.print(slo_line(results, objectives, picked, lambda r: f"block {r.block_size}, capacity "
                               f"{r.capacity_tokens:,}, {name(r)}" + (f", {label(r)}" if label else "")))
        if document["coarse_ids"]:
            err.print(f"[yellow]{document['coarse_ids']}[/yellow]")
        if plot is not None:
            err.print(f"plot written to {plot}")
        if save and document["run_id"] is not None:
            err.print(f"stored as run {document['run_id']} (cite it as run:{document['run_id']})")
    if objectives and document["slo"]["pick"] is None:
        raise typer.Exit(3)  # no run meets the objectives (said above)


def _run_with_progress(console: Console, requests, sizes, capacities, policies,
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


def _tables(results: list[ReplayResult], trace_name: str, requests: int, live: dict | None = None) -> list:
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
    parts = [decision, ceiling, *rejection_lines(results), *first_token_lines(results),
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


def _fleet_tables(results: list[FleetResult], trace_name: str, requests: int, replicas: int,
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

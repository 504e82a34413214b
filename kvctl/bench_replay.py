"""`kvctl bench replay`: replay a request trace through the cache core and compare settings.

The replay stack is imported when the command runs (`replay_report` and the simulator), not when
kvctl starts: every other command would pay for it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from .errors import UserError
from .option_lists import parse_float_list, parse_int_list, parse_names

DEFAULT_BLOCK_SIZES = "16,32,64,128,256,512"
DEFAULT_CAPACITY_TOKENS = 262_144
DEMO_REQUESTS = 600


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
                                     "(with --tenant-priorities); belady evicts knowing the trace's future: the "
                                     "mark of what eviction order could add."),
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
    from kvctl.daemon.replay.fleet import places_new_prefixes
    from kvctl.daemon.replay.service_rates import measured_rates
    from kvctl.daemon.replay.simulator import ReplaySettings
    from kvctl.daemon.replay.sweep import validate_grid
    from kvctl.daemon.replay.trace import generate_trace, read_trace
    from kvctl.policies.tenant_map import any_queue_wait, parse_tenant_map, priority_of, queue_wait_of
    from kvctl.policies.tenant_shares import parse_shares
    from kvctl.trace_stats import (batch_cost_text, coarse_ids, live_cached_ratio, live_timings,
                                   prefill_cost_text)

    from .replay_report import (fleet_tables, live_beside_recorded, live_lines, policy_names, replay_tables,
                                routing_labels, run_with_progress)
    from .replay_slo import parse_slo, pick, slo_line

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
    results = run_with_progress(err, requests, sizes, capacities, policies, base, fleet, tiers, orders,
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
        parts = replay_tables(results, trace_name, len(requests), live) if fleet is None else \
            fleet_tables(results, trace_name, len(requests), replicas, live)
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

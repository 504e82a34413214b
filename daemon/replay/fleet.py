"""Replay a trace through a fleet: N replicas, each with a cache core of its own, behind a
router (kvctl.policies.routing). Each replica runs the single-replica service model of
`simulator` (its own slots, queue and cache); at each arrival the router sees, per replica,
how many of the prompt's leading tokens its cache holds (or will, once the requests queued there
are computed: what `kvd router --view events` counts) and its predicted wait, and picks one. A
prompt no replica holds goes home as with a live router (its first block's hash id stands for the
prompt's opening; the replicas are named replica-0, replica-1, ...). Where each new prefix goes
home is one draw of a hash: another `placement` draws again, as a fleet whose replicas were named
otherwise would. With few prefixes that draw can decide much (two replicas, six system prompts:
four and two on a replica, or five and one), so `sweep_fleet` can replay `prefix` routing over
several placements and report their spread.

What it answers: how much of the hit rate a fleet keeps when its traffic is spread (one
unbounded cache for the whole fleet is the ceiling, `max_hit_ratio`), and what each routing
policy trades between reuse and queueing (first-token times, and how unevenly it loads the
replicas).

With `tier_tokens`, the replicas share one lower tier of that many tokens, as daemons pointing at
one Redis do: what one replica's device evicts, any replica restores, and the router counts it
as held by every replica (priced at `restore_rate`).

With `max_queue_wait`, each replica turns away a request that waits that long to start
(queue_timeout), and the router takes it to a replica it has not tried yet, as kvd router does with
a 503 (`reroute`; a streamed request's timeout reaches its client instead, so a fleet that streams
every answer is replayed without it). Its wait there starts anew; its time to first token counts
from its first arrival. The routers see each replica's limit; heeding them (`queue_limits`, as
kvd router's), they pass over a replica predicted past its limit, and send a timed-out request on
only to a replica predicted to start it in time (else the timeout is its answer).

A replica whose queue is full refuses a request (queue_full), and the router takes it to the best
replica it has not tried, as kvd router does with a 429, streamed or not (nothing has reached the
client yet); one that every replica refuses is a queue_full rejection.

With `speeds`, the replicas differ: each one's prefill and decode rates are the settings' times its
speed (a fleet of mixed GPUs: 1 for an H100, 0.5 for one half as fast), and the routers see each
replica's own prefill rate, as kvd's route-facts say what each has measured. With `queue_waits`,
each replica has a max_queue_wait of its own (0: none), as replicas configured apart do.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

from kvctl.daemon.cache.keys import BlockKey
from kvctl.daemon.stats import percentile
from kvctl.policies.routing import ReplicaFacts, make_router, none_in_time
from kvctl.policies.tenant_map import any_queue_wait

from .simulator import ReplaySettings, ReplicaRun, tenant_percentiles
from .trace import TraceRequest


@dataclass(slots=True)
class FleetResult:
    routing: str
    replicas: int
    block_size: int
    capacity_tokens: int  # per replica
    policy: str
    requests: int
    admitted: int
    prompt_tokens: int
    hit_tokens: int
    hit_ratio: float  # hit tokens / prompt tokens of admitted requests, fleet-wide
    max_hit_ratio: float  # the same with one unbounded cache for the whole fleet
    recomputed_tokens: int  # prompt tokens that cache would have served
    evictions: int
    rejections: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    requests_per_replica: list[int]  # admitted
    hit_ratio_per_replica: list[float]  # each replica's hit tokens / its admitted prompt tokens
    imbalance: float  # the busiest replica's admitted requests / the mean
    seconds: float
    reject_reasons: dict[str, int] = field(default_factory=dict)
    queue_limits: str = "heed"  # whether the router passed over replicas predicted past their max_queue_wait
    speeds: list[float] = field(default_factory=list)  # each replica's prefill and decode speed (empty: all 1)
    rerouted: int = 0  # queue timeouts the router took to another replica (each try after the first)
    rerouted_full: int = 0  # refusals by a full queue (429) the router took to another replica (each try after)
    queue_waits: list[float] = field(default_factory=list)  # each replica's max_queue_wait (empty: the settings')
    queue_order: str = "fifo"  # each replica's: fifo, priority (by tenant_priorities), or lpm (longest cached prefix)
    # per tenant, when the trace names tenants: first-token p50/p95 fleet-wide, and requests turned away
    tenant_ttft_p50_s: dict[str, float] = field(default_factory=dict)
    tenant_ttft_p95_s: dict[str, float] = field(default_factory=dict)
    tenant_rejected: dict[str, int] = field(default_factory=dict)
    tier_tokens: int = 0  # the shared lower tier's size (0: none)
    restored_tokens: int = 0  # prompt tokens restored from it instead of prefilled, fleet-wide
    restored_ratio: float = 0.0
    # with several placements of new prefixes (prefix routing, new_prefix home): each one's figures,
    # this result's (placement 0) first
    placements: list[dict] = field(default_factory=list)
    reservation: str = "fraction:1.0"  # each replica's output reservation spec
    preemptions: int = 0  # fleet-wide, and the tokens they computed again (ReplayResult's)
    recomputed_after_preemption: int = 0
    e2e_p50_s: float | None = None  # the service model's arrival to last token, fleet-wide
    e2e_p95_s: float | None = None
    tenant_preemptions: dict[str, int] = field(default_factory=dict)  # per tenant, fleet-wide (ReplayResult's)
    max_running: int = 64  # each replica's requests in service at once
    itl_p50_s: float | None = None  # seconds an output token after the first, fleet-wide (ReplayResult's)
    itl_p95_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def replay_fleet(settings: ReplaySettings, replicas: int, routing: str, requests: Sequence[TraceRequest],
                 keys: Sequence[list[BlockKey]], max_hits: Sequence[int],
                 progress: Callable[[int], None] | None = None, audit: bool = False,
                 balance_seconds: float = 2.0, new_prefix: str = "home", placement: int = 0,
                 queue_limits: str = "heed", reroute: bool = True,
                 speeds: Sequence[float] | None = None, queue_waits: Sequence[float] | None = None,
                 outputs: Sequence[list[BlockKey]] | None = None) -> FleetResult:
    """Replay `requests` over `replicas` replicas of `settings`, routed by `routing`, new prefixes
    placed by the hash `placement` draws (`trace_affinity`); queue timeouts re-routed unless
    `reroute` is False, and refusals by a full queue always (but not with routing `recorded`: the
    trace says where each was served). `speeds`: each replica's rates as a multiple of the
    settings' (`check_speeds`); None: all alike. `queue_waits`: each replica's max_queue_wait in
    seconds, 0 for none (`check_queue_waits`); None: the settings' for all. `audit=True` reconciles
    every replica's books at the end (tests turn it on). `outputs`: each request's output blocks' keys
    (TraceKeyer.output_keys; None: each its own)."""
    if settings.sequential:
        raise ValueError("replicas: a fleet replays in concurrent mode only (drop --sequential)")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas: must be an integer >= 1, got {replicas!r}")
    if settings.num_blocks < 1:
        raise ValueError(f"capacity_tokens: {settings.capacity_tokens} holds no block of "
                         f"{settings.block_size} tokens")
    recorded = recorded_replicas(requests, replicas) if routing == RECORDED else None  # the live router's choices
    router = None if recorded is not None else make_router(routing, prefill_rate=settings.prefill_rate,
                                                           balance_seconds=balance_seconds, new_prefix=new_prefix,
                                                           queue_limits=queue_limits)
    shared = OrderedDict() if settings.tier_tokens else None  # one tier for the fleet: a shared Redis
    check_speeds(speeds, replicas)
    check_queue_waits(queue_waits, replicas)
    runs = [ReplicaRun(replica_settings(settings, speed, wait), requests, keys, max_hits, tier=shared,
                       outputs=outputs)
            for speed, wait in zip(speeds or [1.0] * replicas, queue_waits or [None] * replicas)]
    names = [f"replica-{i}" for i in range(replicas)]  # where a new prefix goes home, as a live router names them
    tick = progress or (lambda _n: None)
    size = settings.block_size
    every = list(range(replicas))
    timed_out: list[tuple[float, int, int]] = []  # (when, request, replica) of the queue timeouts to re-route
    tried: dict[int, set[int]] = {}  # request -> the replicas that timed it out or refused it (queue full)
    rerouted, rerouted_full, gave_up = 0, 0, 0
    gave_up_by: Counter[str] = Counter()  # tenant -> its requests every replica turned away
    rerouting = reroute and recorded is None and any(
        any_queue_wait(run.settings.max_queue_wait, run.settings.tenant_queue_waits) for run in runs)
    if rerouting:
        for number, run in enumerate(runs):
            run.on_timeout = lambda index, when, number=number: timed_out.append((when, index, number))

    def route(index: int, arrival: float, among: list[int], origin: float | None = None) -> None:
        """Send request `index` to the replica the router chooses of `among`. One whose queue is full
        refuses it (429) and the router chooses again of the rest, as kvd router does, until one
        queues it or none is left (then a queue_full rejection, counted by the last)."""
        nonlocal rerouted_full
        request = requests[index]
        affinity = trace_affinity(request, placement) if request.hash_ids else None
        left = list(among)
        while True:
            facts = [_facts(runs[i], index, names[i], size) for i in left]
            number = left[router.choose(request.input_length, facts, affinity).replica]
            if runs[number].arrive(index, arrival, tick, origin, passed_on=len(left) > 1) or len(left) == 1:
                return
            rerouted_full += 1
            tried.setdefault(index, set()).add(number)  # as kvd router's tries: not asked again for it
            left.remove(number)

    def reroute_until(until: float) -> None:
        """Take each request that times out by `until` to a replica that has not turned it away,
        in time order (every replica at that time); one that every replica turned away is rejected."""
        nonlocal rerouted, gave_up
        while rerouting and (when := min(run.next_deadline() for run in runs)) <= until and when != float("inf"):
            for run in runs:
                run.finish_until(when, tick)
                run.advance(when)
                run.expire_waiting(tick)
            while timed_out:  # (taken whole: a timeout noted while these are routed waits its turn)
                batch = sorted(timed_out)
                timed_out.clear()
                for _, index, number in batch:
                    tried.setdefault(index, set()).add(number)
                    left = [i for i in every if i not in tried[index]]
                    if left and none_in_time(router, (_facts(runs[i], index, names[i], size) for i in left)):
                        left = []  # none would start it in time: the timeout is its answer
                    if not left:
                        gave_up += 1
                        if requests[index].tenant is not None:
                            gave_up_by[requests[index].tenant] += 1
                        tick(1)
                        continue
                    rerouted += 1
                    route(index, when, left, runs[0].arrival_of(requests[index]))

    started = time.perf_counter()
    for index, request in enumerate(requests):
        arrival = runs[0].arrival_of(request)
        reroute_until(arrival)
        for run in runs:
            run.finish_until(arrival, tick)
            run.advance(arrival)
        if recorded is not None:
            runs[recorded[index]].arrive(index, arrival, tick)
        else:
            route(index, arrival, every)
    reroute_until(float("inf"))
    for run in runs:
        run.drain(tick)
    seconds = time.perf_counter() - started
    if audit:
        for run in runs:
            run.manager.audit()
            if run.manager.num_sequences:
                raise AssertionError(f"{run.manager.num_sequences} sequences left after the replay")
    result = _result(settings, routing, runs, len(requests), seconds)
    result.queue_limits, result.rerouted = limit_choices(routing, (queue_limits,))[0], rerouted
    result.rerouted_full = rerouted_full
    result.speeds, result.queue_waits = list(speeds or []), list(queue_waits or [])
    if gave_up:
        result.reject_reasons["queue_timeout"] = result.reject_reasons.get("queue_timeout", 0) + gave_up
        result.rejections += gave_up
        for tenant, count in gave_up_by.items():
            result.tenant_rejected[tenant] = result.tenant_rejected.get(tenant, 0) + count
    return result


RECORDED = "recorded"  # a replay's routing: each request to the replica its fleet trace names


def check_speeds(speeds: Sequence[float] | None, replicas: int) -> None:
    """ValueError naming `speeds` unless it gives each replica a finite speed > 0 (None: all 1)."""
    _check_per_replica("replica_speeds", "speeds", speeds, replicas, lambda speed: speed > 0,
                       "a number > 0 (1: the given rates)")


def check_queue_waits(waits: Sequence[float] | None, replicas: int) -> None:
    """ValueError naming `waits` unless it gives each replica a finite number of seconds >= 0 (0:
    no limit; None: the settings' max_queue_wait for all)."""
    _check_per_replica("replica_queue_waits", "waits", waits, replicas, lambda wait: wait >= 0,
                       "a number of seconds >= 0 (0: no limit)")


def _check_per_replica(name: str, noun: str, values: Sequence[float] | None, replicas: int,
                       allowed: Callable[[float], bool], rule: str) -> None:
    if values is None:
        return
    if len(values) != replicas:
        raise ValueError(f"{name}: {len(values)} {noun} for {replicas} replicas; give one per replica")
    for value in values:
        if not (isinstance(value, (int, float)) and value < float("inf") and allowed(value)):
            raise ValueError(f"{name}: each must be {rule}, got {value!r}")


def replica_settings(settings: ReplaySettings, speed: float = 1.0, queue_wait: float | None = None) -> ReplaySettings:
    """One replica's settings: at `speed` times the prefill and decode rates (a lower tier's
    restores are the tier's, not the GPU's: unchanged), with `queue_wait` as its max_queue_wait
    where given. At speed 1 and no wait of its own, the settings themselves: bit for bit."""
    if speed != 1:
        settings = replace(settings, prefill_rate=settings.prefill_rate * speed,
                           decode_rate=settings.decode_rate * speed)
    return settings if queue_wait is None else replace(settings, max_queue_wait=queue_wait)


def recorded_replicas(requests: Sequence[TraceRequest], replicas: int) -> list[int]:
    """The replica index of each request, as its line's `replica` names it (numbered in order of
    first appearance): the live router's decisions, to replay a fleet's cache apart from routing."""
    numbers: dict[str, int] = {}
    for position, request in enumerate(requests):
        if request.replica is None:
            raise ValueError(f"routing: recorded needs each request's replica, and request {position + 1} names none "
                             f"(a fleet's trace that kvd router saved names them)")
        numbers.setdefault(request.replica, len(numbers))
    if len(numbers) > replicas:
        raise ValueError(f"replicas: the trace's requests were served by {len(numbers)} replicas; "
                         f"--replicas {replicas} is fewer")
    return [numbers[request.replica] for request in requests]


def _facts(run: ReplicaRun, index: int, name: str, size: int) -> ReplicaFacts:
    """One replica as the router sees it for request `index`: what its device holds (or will), what
    the shared tier holds after that and what restoring it costs, and how busy it is."""
    held = run.held_blocks(index)
    restorable = run.restorable_blocks(index, held) * size
    tenant = run.requests[index].tenant or "default"
    return ReplicaFacts(held * size, run.wait_seconds(held, tenant, run.requests[index].priority),
                        len(run.running) + len(run.waiting),
                        prefill_rate=run.settings.prefill_rate, restorable_tokens=restorable,
                        restore_seconds=restorable / run.settings.restore_rate if restorable else 0.0, name=name,
                        max_wait_seconds=run.queue_wait_limit(tenant) or None)


def trace_affinity(request: TraceRequest, placement: int = 0) -> bytes:
    """A trace request's `prompt_affinity`: its first block's hash id stands for its opening. Each
    `placement` gives every opening another affinity, so new prefixes go home elsewhere."""
    drawn = f"/{placement}".encode() if placement else b""
    return hashlib.sha256(b"kvctl/affinity/trace/v1" + drawn + b"\0" + str(request.hash_ids[0]).encode()).digest()


def reads_load(routing: str) -> bool:
    """Whether `routing` weighs the replicas' load (and so their queue limits): not round_robin,
    nor recorded (the live router's choices)."""
    return routing not in ("round_robin", RECORDED)


def limit_choices(routing: str, queue_limits: Sequence[str]) -> Sequence[str]:
    """The `queue_limits` values a routing is replayed with: one that reads no load, once, as
    "ignore"."""
    return queue_limits if reads_load(routing) else ("ignore",)


def places_new_prefixes(routing: str, new_prefix: str) -> bool:
    """Whether `routing` sends a new prefix home by its hash (where placements differ)."""
    return routing == "prefix" and new_prefix == "home"


def placement_figures(result: FleetResult, placement: int) -> dict:
    """What one placement of new prefixes gave, for FleetResult.placements."""
    return {"placement": placement, "hit_ratio": result.hit_ratio, "imbalance": result.imbalance,
            "ttft_p50_s": result.ttft_p50_s, "requests_per_replica": result.requests_per_replica}


def _result(settings: ReplaySettings, routing: str, runs: list[ReplicaRun], requests: int, seconds: float) -> FleetResult:
    prompt = sum(r.prompt_tokens for r in runs)
    hit = sum(r.hit_tokens for r in runs)
    ttft = sorted(t for r in runs for t in r.ttft)
    e2e = sorted(t for r in runs for t in r.e2e)
    itl = sorted(t for r in runs for t in r.itl)
    reasons: dict[str, int] = {}
    for run in runs:
        for reason, count in run.rejections.items():
            reasons[reason] = reasons.get(reason, 0) + count
    admitted = [r.admitted for r in runs]
    mean = sum(admitted) / len(admitted)
    by_tenant: dict[str, list[float]] = {}  # tenant -> its first-token times on every replica
    for run in runs:
        for tenant, times in run.tenant_ttft.items():
            by_tenant.setdefault(tenant, []).extend(times)
    rejected = sum((run.tenant_rejected for run in runs), Counter())
    preempted = sum((run.tenant_preempted for run in runs), Counter())
    tenants = sorted({*by_tenant, *rejected, *(t for run in runs for t in run.tenant_tokens)})
    return FleetResult(
        routing=routing, replicas=len(runs), block_size=settings.block_size,
        capacity_tokens=settings.capacity_tokens, policy=settings.policy_label, requests=requests,
        admitted=sum(admitted), prompt_tokens=prompt, hit_tokens=hit,
        hit_ratio=hit / prompt if prompt else 0.0,
        max_hit_ratio=sum(r.max_hit_tokens for r in runs) / prompt if prompt else 0.0,
        recomputed_tokens=sum(r.recomputed for r in runs),
        evictions=sum(r.manager.pool.evictions for r in runs),
        rejections=sum(reasons.values()),
        ttft_p50_s=percentile(ttft, 0.50), ttft_p95_s=percentile(ttft, 0.95), ttft_p99_s=percentile(ttft, 0.99),
        requests_per_replica=admitted, imbalance=max(admitted) / mean if mean else 0.0,
        hit_ratio_per_replica=[r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for r in runs],
        seconds=seconds, reject_reasons=reasons, tier_tokens=settings.tier_tokens,
        restored_tokens=sum(r.restored_tokens for r in runs),
        restored_ratio=sum(r.restored_tokens for r in runs) / prompt if prompt else 0.0,
        queue_order=settings.queue_order,
        tenant_ttft_p50_s=tenant_percentiles(by_tenant, 0.50), tenant_ttft_p95_s=tenant_percentiles(by_tenant, 0.95),
        tenant_rejected={t: rejected[t] for t in tenants}, reservation=settings.reservation,
        preemptions=sum(r.preemptions for r in runs),
        recomputed_after_preemption=sum(r.recomputed_after_preemption for r in runs),
        e2e_p50_s=percentile(e2e, 0.50), e2e_p95_s=percentile(e2e, 0.95), max_running=settings.max_running,
        itl_p50_s=percentile(itl, 0.50), itl_p95_s=percentile(itl, 0.95),
        tenant_preemptions={t: preempted[t] for t in tenants})

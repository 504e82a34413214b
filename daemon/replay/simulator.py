"""Replay a request trace through the real cache core, with no model.

Each request looks up its prefix, is admitted with its prompt plus the output
reservation, writes its prompt (prefill) and then its output, and is released.

Concurrent mode (the default) overlaps requests by a simple service-time model:
a request admitted at t finishes at

    t + uncached prompt tokens / prefill_rate + output tokens / decode_rate

with `prefill_overhead`, `prefill_context_cost` and `decode_batch_cost` 0 (the defaults). A prompt's
computation takes `prefill_overhead` seconds more, and each of its tokens (1 + p * its context /
1024) times 1 / prefill_rate, its context the tokens before it (`prefill_seconds`: at their mean).
With a cost c, a request decodes at decode_rate / (1 + c * (n - 1)) tokens a second while n
requests are in service, as a batched decode step grows with its batch: each admission, finish and
preemption changes every running request's pace from then on (processor sharing, recomputed at
each event). With a context cost k as well, decode_rate / (1 + c * (n - 1) + k * X / 1024), X the
context the n hold: each one's prompt and the output it made, as a decode step reads every
request's KV. X is taken at each event, each decoding request counted at the midpoint of what it
has left to make. `kvctl bench replay --rates-from-trace` fits the costs and rates from kvd's own
timings (service_rates.py). Either way, at most `max_running` requests at once and an admission
queue of at most `max_queue` waiting requests, first come first served; with `queue_order`
priority by the tenants' `tenant_priorities` (lower first), or with lpm the longest
cached prefix first, or with priority+lpm lpm's order within each place, as kvd's
(policies.queue_order).
A request that does not fit waits for a finish; one that can never fit, or
that finds the queue full, is rejected, and so is one that waits
`max_queue_wait` seconds without starting (kvd's queue_timeout), where that is set, or its
tenant's own limit (`tenant_queue_waits`, as kvd's).
Sequential mode runs one request at a time. Either way a request's full prompt
blocks are indexed as soon as they are written, as in a real engine.

An output reservation short of the output (`--reserve p95`, `fraction:0.5`) makes a request
grow block by block as it decodes in the service model. One that cannot grow preempts, as kvd
does: the running request last in kvd's order (under queue_order priority its tenant's place
first, then the latest arrival; it may be the one growing) gives back its blocks, its cached prompt
stays, and it goes back to the head of the queue, never timed out there. Restarted, it computes
again its prompt and the output it had made, less what the cache still holds of them, then
decodes the rest (`recomputed_after_preemption`). A request whose prompt and max_tokens could never
fit the cache is turned away on arrival, as kvd does, whatever its reservation.

As in kvd, the cache keeps a request's output blocks too: each whole block of its prompt and output
is indexed once written, and stays cached (evictable) after the request finishes or is preempted,
so outputs take cache room as they do in kvd, and a restart finds what is left of its own. Their
keys come from the trace line's `output_hash_ids` where it has them (kvd's saved traces: a chat's
next turn then hits the answer it repeats, as in kvd), else they are the request's own, hit by no
other (`trace.own_output_keys`), and only where the prompt has a whole block. The last output token
is never written (no step computes it), as in kvd.

Allocator figures time only the calls into the cache core (admit, append,
release); key hashing is done before the clock starts.

With `tier_tokens`, a lower tier (host memory, disk or Redis, as kvd's) of that many tokens
sits below the device, least recently used out first. What goes down to it (`tier_write`, kvd's
write_policy names): every block the device evicts (write_back, kvd's default), every prompt
block as it is computed (write_through), or a block when a prompt first reuses it
(write_through_selective). The blocks of a prompt it holds right after the device's hits are
restored instead of prefilled, at `restore_rate` tokens a second in the service model.
Compressed tiers (`tier_compress`) hold about twice the tokens in the same bytes: replay both
sizes.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

from kvctl.daemon.cache.errors import CacheFull
from kvctl.daemon.cache.keys import BlockKey
from kvctl.daemon.cache.manager import KVCacheManager
from kvctl.daemon.stats import percentile
from kvctl.policies.admission import blocks_for_tokens
from kvctl.policies.foresight import FarthestNextUseEviction
from kvctl.policies.queue_order import (LPM_MAX_WAITING, by_prefix, by_priority, goes_before, longest_prefix_first,
                                       lpm_patience)
from kvctl.policies.reservation import parse_reservation

from .foresight import POLICY as FORESIGHT, TraceFuture
from .service_rates import CONTEXT_UNIT
from .trace import TraceRequest, own_output_keys


QUEUE_ORDER_LABELS = {"fifo": "", "priority": "+prio", "lpm": "+lpm", "priority+lpm": "+prio+lpm"}  # policy_label's


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    block_size: int
    capacity_tokens: int  # pool size in tokens; the pool holds capacity_tokens // block_size blocks
    policy: str = "lru"
    reservation: str = "fraction:1.0"  # output reservation spec (see policies.reservation)
    sequential: bool = False
    prefill_rate: float = 20_000.0  # uncached prompt tokens per second (each with no context, with the two below)
    # each 1,024 tokens before a prompt token (cached, or computed before it) make it this fraction longer
    # to compute, as its attention reads them (0: none)
    prefill_context_cost: float = 0.0
    prefill_overhead: float = 0.0  # seconds each prompt's computation takes more, whatever its length
    decode_rate: float = 40.0  # output tokens per second per request (alone, with decode_batch_cost)
    # each other request in service lengthens a decode step by this fraction of a lone request's (0: none)
    decode_batch_cost: float = 0.0
    # each 1,024 tokens of context in service lengthen a decode step by this fraction of a lone request's
    # with none (0: none)
    decode_context_cost: float = 0.0
    max_running: int = 64  # requests in service at once
    max_queue: int = 4096  # requests waiting for admission before new ones are rejected
    max_queue_wait: float = 0.0  # seconds a request may wait to start before it is rejected (queue_timeout); 0: no limit
    # (tenant, seconds) pairs as kvd's tenant_queue_waits: tenants' own limits (0: none) in place of max_queue_wait
    tenant_queue_waits: tuple[tuple[str, float], ...] = ()
    time_scale: float = 1.0  # multiply trace timestamps by this
    # max_tokens clients ask for (at least the output) where a trace line does not say its own; None: the output
    max_tokens: int | None = None
    # (tenant, fraction) pairs as kvd's tenant_cache_shares; () for none
    tenant_shares: tuple[tuple[str, float], ...] = ()
    # (tenant, priority) pairs as kvd's tenant_priorities (lower first; 0 for a tenant not named): what
    # the `priority` eviction policy keeps, and with queue_order priority the order of the queue
    tenant_priorities: tuple[tuple[str, int], ...] = ()
    tier_tokens: int = 0  # a lower tier under the device of this many tokens (LRU); 0: none
    restore_rate: float = 200_000.0  # tokens a second restored from it (service model)
    tier_write: str = "write_back"  # or write_through, write_through_selective: kvd's write_policy names
    # or "priority" (by tenant_priorities) or "lpm" (the longest cached prefix first) or "priority+lpm",
    # as kvd's queue_order
    queue_order: str = "fifo"

    @property
    def policy_label(self) -> str:
        """The eviction policy as reports name it: with shares, `lru+shares`; with queue_order
        lpm, `lru+lpm`, and priority, `lru+prio`."""
        return self.policy + ("+shares" if self.tenant_shares else "") + QUEUE_ORDER_LABELS[self.queue_order]

    @property
    def num_blocks(self) -> int:
        return self.capacity_tokens // self.block_size


@dataclass(slots=True)
class ReplayResult:
    block_size: int
    capacity_tokens: int
    policy: str
    mode: str
    requests: int
    admitted: int
    prompt_tokens: int
    hit_tokens: int
    hit_ratio: float  # hit tokens / prompt tokens of admitted requests
    max_hit_ratio: float  # the same with an unbounded cache (same requests, arrival order)
    recomputed_tokens: int  # prompt tokens an unbounded cache would have served
    evictions: int
    fragmentation: float  # unused slots in tail blocks / allocated slots, at each finish
    reservation_waste: float  # reserved blocks never written / allocated slots, at each finish
    peak_occupancy: float  # blocks held by requests or pins / all blocks, at its peak
    mean_occupancy: float  # the same, time-weighted (per request when sequential)
    rejections: int
    preemptions: int
    alloc_us_p50: float
    alloc_us_p99: float
    block_ops: int
    block_ops_per_second: float
    requests_per_second: float
    seconds: float
    reject_reasons: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float | None = None  # the service model's time to first token (concurrent mode)
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    # per tenant, when the trace names tenants: hit tokens / prompt tokens of its admitted requests
    tenant_hit_ratio: dict[str, float] = field(default_factory=dict)
    # and its cached blocks evicted to make room (kvd's evicted_blocks per tenant): whose blocks pay
    tenant_evicted_blocks: dict[str, int] = field(default_factory=dict)
    tier_tokens: int = 0  # the lower tier's size (0: none)
    restored_tokens: int = 0  # prompt tokens restored from it instead of prefilled
    restored_ratio: float = 0.0  # restored tokens / prompt tokens of admitted requests
    queue_order: str = "fifo"  # which waiting request went first: fifo, priority, or lpm (the longest cached prefix)
    # per tenant, when the trace names tenants (concurrent mode): the service model's time to first
    # token of its admitted requests, and its requests turned away, by any reason
    tenant_ttft_p50_s: dict[str, float] = field(default_factory=dict)
    tenant_ttft_p95_s: dict[str, float] = field(default_factory=dict)
    tenant_rejected: dict[str, int] = field(default_factory=dict)
    reservation: str = "fraction:1.0"  # the output reservation spec it ran with
    # tokens computed again after preemptions (prompt and output so far, less the cache's hits), as kvd counts them
    recomputed_after_preemption: int = 0
    e2e_p50_s: float | None = None  # the service model's arrival to last token (concurrent mode)
    e2e_p95_s: float | None = None
    # per tenant, when the trace names tenants: its requests preempted (each time), whom preemption takes
    tenant_preemptions: dict[str, int] = field(default_factory=dict)
    max_running: int = 64  # requests in service at once
    # the service model's seconds an output token after the first, each request's mean (first token to
    # last, stalls of preemption included), where it made two or more (concurrent mode)
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def max_hit_blocks(requests: Sequence[TraceRequest], keys: Sequence[Sequence[BlockKey]],
                   block_size: int, outputs: Sequence[Sequence[BlockKey]] | None = None) -> list[int]:
    """Hit blocks per request with an unbounded cache in arrival order (the theoretical maximum);
    `outputs`: each request's output blocks' keys (TraceKeyer.output_keys), cached after it too."""
    seen: set[BlockKey] = set()
    out: list[int] = []
    for index, (request, request_keys) in enumerate(zip(requests, keys)):
        limit = max(request.input_length - 1, 0) // block_size
        hits = 0
        for key in request_keys[:limit]:
            if key not in seen:
                break
            hits += 1
        out.append(hits)
        seen.update(request_keys)
        if outputs is not None:
            seen.update(outputs[index])
    return out


class ReplicaRun:
    """One replica's cache core and service model through a replay: `replay` drives one,
    `fleet.replay_fleet` several behind a router."""

    def __init__(self, settings: ReplaySettings, requests: Sequence[TraceRequest],
                 keys: Sequence[list[BlockKey]], max_hits: Sequence[int],
                 tier: OrderedDict | None = None, outputs: Sequence[list[BlockKey]] | None = None) -> None:
        """`tier`: the lower tier's keys, when several replicas share one (a fleet's Redis); `outputs`:
        each request's output blocks' keys (TraceKeyer.output_keys; None: each its own)."""
        self.settings = settings
        self.requests, self.keys, self.max_hits, self.given_outputs = requests, keys, max_hits, outputs
        self.now = 0.0
        # `belady` reads the trace's future (foresight.py): each block's next use after the latest request started
        self.future = TraceFuture(requests, keys, settings.block_size) if settings.policy == FORESIGHT else None
        policy = settings.policy if self.future is None else FarthestNextUseEviction(
            lambda block_id: self.future.next_use(self.manager.pool.blocks[block_id].key), lambda: self.future.horizon)
        self.manager = KVCacheManager(settings.num_blocks, settings.block_size, policy=policy, clock=lambda: self.now)
        self.manager.set_tenant_shares(settings.tenant_shares)
        self.priorities = dict(settings.tenant_priorities)  # tenant -> kvd's place (lower first)
        self.tenant_waits = dict(settings.tenant_queue_waits)  # tenant -> its own queue wait limit (0: none)
        self.deadlines: list[tuple[float, int]] = []  # with tenant_waits: (deadline, request), a heap (stale kept)
        self.tier: OrderedDict[BlockKey, None] = OrderedDict() if tier is None else tier  # least recent first
        self.tier_blocks = settings.tier_tokens // settings.block_size
        if self.tier_blocks and settings.tier_write == "write_back":
            self.manager.pool.on_evict = self._demote
        self.restored: dict[int, int] = {}  # request in service -> prompt tokens it restored
        self.restored_tokens = 0
        self.tenant_tokens: dict[str, list[int]] = {}  # tenant -> [hit tokens, prompt tokens], admitted
        self.tenant_evicted: Counter[str | None] = Counter()  # tenant -> its blocks evicted to make room
        self.manager.pool.on_tenant_evictions = self.tenant_evicted.update
        self.reservation = parse_reservation(settings.reservation)
        self.call_ns: list[int] = []
        self.block_ops = 0
        self.hit_tokens = self.prompt_tokens = self.recomputed = self.max_hit_tokens = 0
        self.admitted = self.preemptions = 0
        self.rejections: dict[str, int] = {}
        self.slots_allocated = self.slots_tail_unused = self.slots_reserve_unused = 0
        self.peak_used = 0
        self.used_area = 0.0  # integral of used blocks over time (concurrent mode)
        self.used_samples = 0.0  # sum of used blocks at each admission (sequential mode)
        self.last_event = 0.0
        # concurrent mode: requests in service, waiting ones, and their first-token times
        self.running: list[tuple[float, int]] = []  # (finish time, request index)
        self.waiting: deque[int] = deque()
        self.arrivals: dict[int, float] = {}  # waiting request -> its arrival
        self.queued_work: dict[int, float] = {}  # waiting request -> its service estimate at arrival
        self.queued_seconds = 0.0  # their sum
        self.queued_keys: dict[BlockKey, int] = {}  # block key -> waiting requests whose prompt has it
        self.ttft: list[float] = []
        self.tenant_ttft: dict[str, list[float]] = {}  # tenant -> its first-token times, when the trace names it
        self.tenant_rejected: Counter[str] = Counter()
        self.tenant_preempted: Counter[str] = Counter()  # tenant -> its requests preempted (each time)
        # a fleet that re-routes a queue timeout, as kvd router does: called with (request, the time it
        # timed out) instead of counting a rejection; and where such a request first arrived (its TTFT's start)
        self.on_timeout: Callable[[int, float], None] | None = None
        self.origins: dict[int, float] = {}
        # output growth and preemption, when a reservation falls short of an output (see the module's doc)
        self.growing: list[tuple[float, int]] = []  # (when it needs its next block, request), a heap
        self.decoding: dict[int, tuple[float, float, int, int]] = {}  # running request -> (prefill start,
        # first token, output tokens made before this run, prompt tokens the cache or tier gave this run)
        self.arrived: dict[int, float] = {}  # running request -> when it arrived (at the fleet): its e2e's start
        self.orders: dict[int, int] = {}  # request -> its place in arrival order here (kvd's request.order)
        self.preempted: dict[int, tuple[float, int]] = {}  # waiting after a preemption -> (arrival, output made)
        self.first_out: set[int] = set()  # preempted after its first token (not counted again)
        self.pending_ttft: dict[int, float] = {}  # running request -> the first-token time counted for it
        self.recomputed_after_preemption = 0
        self.e2e: list[float] = []
        self.first_tokens: dict[int, float] = {}  # running request -> when its first token came (or comes)
        self.itl: list[float] = []  # each finished request's mean seconds an output token after the first
        # the pace of decoding, with decode_batch_cost: every running request's now (decode_rate_at), and
        # for a request that decoded at another pace before, (when it changed, output tokens made by then)
        self.rate = settings.decode_rate
        self.anchors: dict[int, tuple[float, float]] = {}

    # ---- core calls, timed -----------------------------------------------------------------
    def used_blocks(self) -> int:
        pool = self.manager.pool
        return pool.num_blocks - pool.num_free - pool.num_evictable

    def _demote(self, blocks) -> None:
        """Blocks the device evicts go down to the lower tier (write_back)."""
        self._store([block.key for block in blocks])

    def _store(self, keys: Sequence[BlockKey]) -> None:
        """Blocks written to the lower tier, its least recent out when full."""
        tier = self.tier
        for key in keys:
            tier[key] = None
            tier.move_to_end(key)
        while len(tier) > self.tier_blocks:
            tier.popitem(last=False)

    def _restore(self, keys: Sequence[BlockKey], hit_blocks: int, prompt_tokens: int, touch: bool = True) -> int:
        """Blocks of the prompt the lower tier holds right after the device's hits (touched, as a
        read: unless `touch` is False, for a router's question)."""
        tier, limit = self.tier, min(self.manager.cacheable_blocks(prompt_tokens), len(keys))
        count = 0
        while hit_blocks + count < limit and keys[hit_blocks + count] in tier:
            if touch:
                tier.move_to_end(keys[hit_blocks + count])
            count += 1
        return count

    def restorable_blocks(self, index: int, held: int) -> int:
        """Blocks of request `index`'s prompt after the `held` ones that the lower tier holds."""
        if not self.tier_blocks:
            return 0
        return self._restore(self.keys[index], held, self.requests[index].input_length, touch=False)

    def reject(self, reason: str, index: int) -> None:
        """Count request `index` turned away, for `reason` (and against its tenant, if named)."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        tenant = self.requests[index].tenant
        if tenant is not None:
            self.tenant_rejected[tenant] += 1

    def start(self, index: int) -> bool:
        """Admit and prefill request `index`; False when it does not fit now. A preempted one is
        admitted again with its prompt and the output it had made, and reserves for the rest."""
        request, manager = self.requests[index], self.manager
        made = self.preempted[index][1] if index in self.preempted else 0
        tokens = request.input_length + made
        reserve = self.reserve_tokens(request, made)
        seq_id = str(index)
        # its prompt's keys and its output's, the whole blocks of what it holds now (a restart's output
        # made) at admission, the rest as it writes them
        output = self.output_keys(index)
        known = tokens // self.settings.block_size - len(self.keys[index])
        keys, later = (self.keys[index] + output[:known], output[known:]) if output else (self.keys[index], [])
        # what the lower tier holds after the device's hits is read before the admission makes
        # room (as kvd's prefetch does), so blocks it demotes cannot push them out first
        restored = self._restore(keys, manager.lookup(keys, tokens), tokens) if self.tier_blocks else 0
        future = self.future
        if future is not None:  # (its hits are taken now: the uses after it are what its admission may evict for)
            horizon, future.horizon = future.horizon, max(future.horizon, index)
        t0 = time.perf_counter_ns()
        try:
            tenant = request.tenant or "default"
            admission = manager.admit(seq_id, keys, tokens, reserve, tenant=tenant,
                                      priority=-self.request_place(index))  # the engine's: higher first
        except CacheFull:
            self.call_ns.append(time.perf_counter_ns() - t0)
            if future is not None:  # not started: it still asks for its keys (an admission that fails evicts nothing)
                future.horizon = horizon
            return False
        t1 = time.perf_counter_ns()
        manager.append(seq_id, tokens - admission.hit_tokens, later)
        t2 = time.perf_counter_ns()
        self.call_ns.append(t1 - t0)
        self.call_ns.append(t2 - t1)
        if future is not None and index in self.preempted:  # (outside the cache core's timed calls)
            future.restarted(self.keys[index] + output)
        self.block_ops += min(admission.hit_blocks + 1, len(keys)) + admission.reserved_blocks
        if self.tier_blocks and self.settings.tier_write == "write_through":  # what it computed goes down now
            self._store(keys[admission.hit_blocks + restored:])
        elif self.tier_blocks and self.settings.tier_write == "write_through_selective":  # what proved reusable
            self._store(keys[:admission.hit_blocks])
        self.restored[index] = restored * self.settings.block_size
        if index in self.preempted:  # a restart: what it computes again (its figures count its first admission)
            self.recomputed_after_preemption += tokens - admission.hit_tokens - restored * self.settings.block_size
        else:
            self._count_admission(index, admission.hit_tokens, admission.hit_blocks, restored)
        used = self.used_blocks()
        self.peak_used = max(self.peak_used, used)
        self.used_samples += used
        return True

    def output_keys(self, index: int) -> list[BlockKey]:
        """Keys of the blocks request `index`'s output makes whole, written: those given, else its own."""
        if self.given_outputs is not None:
            return self.given_outputs[index]
        return own_output_keys(self.requests[index], index, self.keys[index], self.settings.block_size)

    def _count_admission(self, index: int, hit_tokens: int, hit_blocks: int, restored: int) -> None:
        """A request's first admission in the run's figures: its prompt, hits and what an unbounded cache gives."""
        request = self.requests[index]
        self.admitted += 1
        self.restored_tokens += restored * self.settings.block_size
        self.prompt_tokens += request.input_length
        self.hit_tokens += hit_tokens
        if request.tenant is not None:
            tokens = self.tenant_tokens.setdefault(request.tenant, [0, 0])
            tokens[0] += hit_tokens
            tokens[1] += request.input_length
        self.max_hit_tokens += self.max_hits[index] * self.settings.block_size
        self.recomputed += max(self.max_hits[index] - hit_blocks - restored, 0) * self.settings.block_size

    def finish(self, index: int) -> None:
        """Write the rest of the output, account the slots, release every block."""
        request, manager = self.requests[index], self.manager
        seq_id = str(index)
        t0 = time.perf_counter_ns()
        try:
            manager.append(seq_id, request.input_length + request.output_length - manager.sequence(seq_id).num_tokens)
        except CacheFull:
            # (sequential mode: one request, short of room only where pins hold it) counted; it finishes short
            self.preemptions += 1
        t1 = time.perf_counter_ns()
        seq = manager.sequence(seq_id)
        size = self.settings.block_size
        self.slots_allocated += (len(seq.table) + len(seq.reserve)) * size
        self.slots_tail_unused += len(seq.table) * size - seq.num_tokens
        self.slots_reserve_unused += len(seq.reserve) * size
        t2 = time.perf_counter_ns()
        # (its last token is sampled, never computed: its output keys stop short of the block it would
        # fill, so that block is not cached, as in kvd)
        released = manager.release(seq_id)
        t3 = time.perf_counter_ns()
        self.restored.pop(index, None)
        self.call_ns.append(t1 - t0)
        self.call_ns.append(t3 - t2)
        self.block_ops += released
        self.reservation.observe(request.output_length)

    def max_tokens(self, request: TraceRequest) -> int:
        """The max_tokens the client asked: its trace line's (kvd's trace says), else the settings'
        (`--max-tokens`), never less than it produced."""
        asked = request.max_tokens if request.max_tokens is not None else self.settings.max_tokens
        return max(request.output_length, asked or 0)

    def reserve_tokens(self, request: TraceRequest, made: int = 0) -> int:
        """Output reservation for the rest of the max_tokens the client asked, `made` already made
        (kvd's: its policy's reserve of max_tokens less the output so far)."""
        return self.reservation.reserve(self.max_tokens(request) - made)

    def never_fits(self, index: int) -> bool:
        """Whether the request's prompt and max_tokens could never fit the cache, as kvd refuses it
        (whatever its reservation: it could never finish)."""
        request = self.requests[index]  # (a reservation never exceeds max_tokens)
        return blocks_for_tokens(request.input_length + self.max_tokens(request),
                                 self.settings.block_size) > self.settings.num_blocks

    # ---- the two modes ---------------------------------------------------------------------
    def run_sequential(self, progress: Callable[[int], None]) -> None:
        for index in range(len(self.requests)):
            self.now = float(index)
            if self.never_fits(index):
                self.reject("never_fits", index)
            elif not self.start(index):
                self.reject("cache_full", index)  # only pins can hold blocks between requests
            else:
                self.finish(index)
            progress(1)

    def advance(self, to: float) -> None:
        """Move simulated time forward, integrating occupancy."""
        if to > self.last_event:
            self.used_area += self.used_blocks() * (to - self.last_event)
            self.last_event = to
        self.now = max(self.now, to)

    def service_seconds(self, index: int, uncached: int) -> float:
        request = self.requests[index]
        return self.prefill_seconds(uncached, request.input_length - uncached) + request.output_length / self.rate

    def prefill_seconds(self, uncached: int, cached: int) -> float:
        """Seconds to compute `uncached` prompt tokens after `cached` ones: at prefill_rate, each
        token longer by prefill_context_cost for each 1,024 tokens before it (at their mean, the
        cached ones and half the new), and prefill_overhead once."""
        s = self.settings
        if not s.prefill_context_cost and not s.prefill_overhead:
            return uncached / s.prefill_rate  # (the model before them, bit for bit)
        return s.prefill_overhead + uncached / s.prefill_rate * (
            1.0 + s.prefill_context_cost * (cached + uncached / 2) / CONTEXT_UNIT)

    def wait_seconds(self, held_blocks: int | None = None, tenant: str | None = None, priority: int = 0) -> float:
        """Predicted wait before a request arriving now would start: none while a slot is free
        and nobody queues; else the work ahead of it (what the running requests have left, and
        the queue's estimates) shared by the slots. Under queue_order lpm, for a prompt holding
        `held_blocks`: only the waiting requests lpm would try first; under priority, for a
        request of `tenant` deferring itself by `priority`: only those at its place or a better one;
        under priority+lpm, those at a better place and those lpm tries first at its own; as kvd's
        route-facts count (policies.queue_order.goes_before)."""
        if len(self.running) < self.settings.max_running and not self.waiting:
            return 0.0
        left = sum(done for done, _ in self.running) - len(self.running) * self.now
        queued, order = self.queued_seconds, self.settings.queue_order
        place = self.place(tenant) + priority if tenant is not None and by_priority(order) else None
        blocks = held_blocks if by_prefix(order) and len(self.waiting) <= LPM_MAX_WAITING else None
        if place is not None or blocks is not None:
            lookup, keys, requests, overdue = self.manager.lookup, self.keys, self.requests, self.lpm_overdue
            queued = sum(self.queued_work[w] for w in self.waiting if goes_before(
                self.request_place(w) if place is not None else 0, place,
                lambda w=w: lookup(keys[w], requests[w].input_length), lambda w=w: overdue(w), blocks))
        return (left + queued) / self.settings.max_running

    def queue_wait_limit(self, tenant: str | None) -> float:
        """Seconds a request of `tenant` may wait to start (0: no limit): its tenant's own
        (tenant_queue_waits), else max_queue_wait; None: the default tenant."""
        return self.tenant_waits.get(tenant or "default", self.settings.max_queue_wait)

    def lpm_overdue(self, index: int) -> bool:
        """Whether waiting request `index` has waited lpm's patience (that of its queue wait limit),
        or was preempted (lpm takes those first, as kvd's)."""
        return index in self.preempted or \
            self.now - self.arrivals[index] >= lpm_patience(self.queue_wait_limit(self.requests[index].tenant))

    def expire_waiting(self, progress: Callable[[int], None]) -> None:
        """Reject the waiting requests that have waited their limit or longer (kvd's queue_timeout,
        checked before each admission pass as kvd's engine does), each at its deadline, before any
        event that could start it. With one limit for all (max_queue_wait), the queue is in arrival
        order, so they are at its head; with tenants' own limits, the earliest deadlines go first."""
        if self.tenant_waits:
            self._expire_by_deadline(progress)
            return
        limit = self.settings.max_queue_wait
        if not limit > 0:
            return
        while (index := self._first_timed()) is not None and self.now >= self.arrivals[index] + limit:
            self._dequeue(index)  # (as next_deadline reckons it)
            self._timed_out(index, self._unqueue(index) + limit, progress)

    def _first_timed(self) -> int | None:
        """The waiting request whose queue wait limit comes first, with one limit for all: the
        earliest arrival, after any preempted ones (at the head, and never timed out). None: none."""
        waiting, preempted = self.waiting, self.preempted
        if not preempted:
            return waiting[0] if waiting else None
        return next((index for index in waiting if index not in preempted), None)

    def _expire_by_deadline(self, progress: Callable[[int], None]) -> None:
        """expire_waiting's way with tenants' own limits: the heap of deadlines, earliest first."""
        deadlines = self.deadlines
        while (when := self.next_deadline()) <= self.now:
            _, index = heapq.heappop(deadlines)
            self._dequeue(index)
            self._unqueue(index)
            self._timed_out(index, when, progress)

    def _timed_out(self, index: int, deadline: float, progress: Callable[[int], None]) -> None:
        """Request `index`, taken out of the queue, timed out at `deadline`: re-routed (a fleet
        that does) or rejected."""
        if self.on_timeout is not None:
            self.on_timeout(index, deadline)
            return
        self.origins.pop(index, None)
        self.reject("queue_timeout", index)
        progress(1)

    def next_deadline(self) -> float:
        """When the next waiting request times out (its queue wait limit), unless it starts
        first; inf with no limit or no queue."""
        if self.tenant_waits:
            deadlines, arrivals, preempted = self.deadlines, self.arrivals, self.preempted
            # (started, or timed out already; or started, preempted and waiting again: never timed out)
            while deadlines and (deadlines[0][1] not in arrivals or deadlines[0][1] in preempted):
                heapq.heappop(deadlines)
            return deadlines[0][0] if deadlines else float("inf")
        limit = self.settings.max_queue_wait
        index = self._first_timed() if limit > 0 else None
        return float("inf") if index is None else self.arrivals[index] + limit

    def admit_waiting(self, progress: Callable[[int], None]) -> None:
        """Start waiting requests in queue order while they fit and a slot is free (those past
        max_queue_wait rejected first): arrival order, or priority's or lpm's, taken once a pass as
        kvd does."""
        self.expire_waiting(progress)
        waiting = self.waiting
        order = self._queue_order()
        while waiting and len(self.running) < self.settings.max_running:
            index = waiting[0] if order is None else next(order, None)
            if index is None:
                break
            if self.never_fits(index):
                self._dequeue(index)
                self._unqueue(index)
                self.origins.pop(index, None)
                self.reject("never_fits", index)
                progress(1)
                continue
            if not self.start(index):
                break
            request = self.requests[index]
            joining = request.input_length + (request.output_length + self.preempted.get(index, (0.0, 0))[1]) / 2
            self._rerate(len(self.running) + 1, joining)
            self._dequeue(index)
            # (unqueued either way) its first token counts from its arrival, a re-routed one's first arrival
            arrival = self.origins.pop(index, self._unqueue(index))
            arrival, made = self.preempted.pop(index, (arrival, 0))
            s = self.settings
            restored = self.restored[index]
            seq = self.manager.sequence(str(index))
            uncached = request.input_length + made - seq.hit_tokens - restored
            first = self.now + (restored / s.restore_rate if restored else 0.0)  # no term without a tier: bit for bit
            prefill = self.prefill_seconds(uncached, seq.hit_tokens + restored)
            # summed left to right, as the replay always has: its finish times stay bit for bit
            heapq.heappush(self.running, (first + prefill + (request.output_length - made) / self.rate, index))
            self.arrived[index] = arrival
            self.decoding[index] = (first, first + prefill, made, seq.hit_tokens + restored)
            self._grow_later(index)
            if index in self.first_out:
                continue  # its first token came before it was preempted
            self.ttft.append(first - arrival + prefill)
            self.first_tokens[index] = first + prefill
            self.pending_ttft[index] = self.ttft[-1]
            if request.tenant is not None:
                self.tenant_ttft.setdefault(request.tenant, []).append(self.ttft[-1])

    # ---- output growth and preemption ---------------------------------------------------------
    def _grow_later(self, index: int) -> None:
        """Schedule when running request `index` makes the output token its blocks (table and
        reservation) have no slot for; none when they hold its whole output."""
        request, seq = self.requests[index], self.manager.sequence(str(index))
        slots = (len(seq.table) + len(seq.reserve)) * self.settings.block_size
        if slots >= request.input_length + request.output_length:
            return
        _, first_token, made, _ = self.decoding[index]
        since, made = self.anchors.get(index, (first_token, made))
        token = slots + 1 - request.input_length  # the output token (1 is the first) with no slot
        heapq.heappush(self.growing, (since + (token - made) / self.rate, index))

    def decode_rate_at(self, running: int, context: float = 0.0) -> float:
        """Output tokens a second each request makes while `running` are in service holding `context`
        tokens (decode_batch_cost, decode_context_cost)."""
        s = self.settings
        if not s.decode_batch_cost and not s.decode_context_cost:
            return s.decode_rate
        return s.decode_rate / (1.0 + s.decode_batch_cost * max(running - 1, 0)
                                + s.decode_context_cost * context / CONTEXT_UNIT)

    def context_ahead(self, index: int) -> float:
        """The context running request `index` holds on average from now to its finish: its prompt
        and the midpoint of the output it has made and the output it will have."""
        request, (_, first_token, made, _) = self.requests[index], self.decoding[index]
        since, made = self.anchors.get(index, (first_token, made))
        if self.now > since:
            made += (self.now - since) * self.rate
        return request.input_length + (made + request.output_length) / 2

    def _rerate(self, running: int, joining: float = 0.0) -> None:
        """`running` requests are in service from now: with decode_batch_cost or decode_context_cost,
        every running request decodes at their pace from now on, and its finish and next growth move
        to match. `joining`: the context of a request being admitted, not running yet."""
        context = joining + sum(self.context_ahead(index) for _, index in self.running) \
            if self.settings.decode_context_cost else 0.0
        rate, old = self.decode_rate_at(running, context), self.rate
        if rate == old:
            return
        now, requests = self.now, self.requests
        self.rate = rate
        running_now = []
        for _, index in self.running:
            _, first_token, made, _ = self.decoding[index]
            since, made = self.anchors.get(index, (first_token, made))
            if now > since:  # decoding: what it made at the old pace
                since, made = now, made + (now - since) * old
                self.anchors[index] = since, made
            running_now.append((since + (requests[index].output_length - made) / rate, index))
        heapq.heapify(running_now)
        self.running = running_now
        growing, self.growing = self.growing, []
        for _, index in growing:
            self._grow_later(index)

    def grow(self, index: int) -> None:
        """Running request `index` made an output token its blocks have no slot for: it takes a
        block (the cache evicts to make room), or preempts the running request last in kvd's order
        until one is free, itself perhaps (`preempt`)."""
        seq_id, size = str(index), self.settings.block_size
        seq = self.manager.sequence(seq_id)
        wanted = (len(seq.table) + len(seq.reserve)) * size + 1 - seq.num_tokens
        while True:
            t0 = time.perf_counter_ns()
            try:
                self.manager.append(seq_id, wanted)
            except CacheFull:
                self.call_ns.append(time.perf_counter_ns() - t0)
                victim = max((i for _, i in self.running), key=self._rank)
                self.preempt(victim)
                if victim == index:
                    return
                continue
            self.call_ns.append(time.perf_counter_ns() - t0)
            self.block_ops += 1
            self._grow_later(index)
            return

    def _rank(self, index: int) -> tuple[int, int]:
        """kvd's order of a request (the larger, the later): under queue_order priority its
        tenant's place first; then its arrival here. Preemption takes the last."""
        place = self.request_place(index) if by_priority(self.settings.queue_order) else 0
        return place, self.orders[index]

    def preempt(self, index: int) -> None:
        """Running request `index` gives back its blocks (what it computed of its prompt stays
        cached) and goes back to the head of the queue with the output it made, as kvd's engine
        preempts. Preempted before its first token, that token counts when it comes."""
        request, now = self.requests[index], self.now
        prefill_start, first_token, made, cached = self.decoding.pop(index)
        if now < first_token:  # still computing its prompt: only what it computed is cached
            computed = cached + self._prefilled(now - prefill_start, first_token - prefill_start,
                                                request.input_length + made - cached)
            written = min(computed, request.input_length + made)
        else:  # what it made by now, no more than its blocks have slots for
            seq = self.manager.sequence(str(index))
            slots = (len(seq.table) + len(seq.reserve)) * self.settings.block_size - request.input_length
            if index in self.anchors:  # (it decoded at another pace before)
                since, made_then = self.anchors[index]
                progress = int(made_then + (now - since) * self.rate) - made
            else:
                progress = int((now - first_token) * self.rate)
            made = min(request.output_length, slots, made + progress)
            # its blocks hold what it made (their whole ones cached, as kvd's), its last token never computed
            missing = request.input_length + made - seq.num_tokens
            if missing > 0:
                self.manager.append(str(index), missing)  # (within its slots: takes no block)
            written = request.input_length + max(made - 1, 0)
        self.anchors.pop(index, None)
        if self.future is not None:  # (before its blocks become evictable: what it asks again is asked next)
            self.future.asked_again(self.keys[index] + self.output_keys(index))
        t0 = time.perf_counter_ns()
        self.manager.release(str(index), written_tokens=written)
        self.call_ns.append(time.perf_counter_ns() - t0)
        self.running = [entry for entry in self.running if entry[1] != index]
        heapq.heapify(self.running)
        self.growing = [entry for entry in self.growing if entry[1] != index]
        heapq.heapify(self.growing)
        self._rerate(len(self.running))
        self.restored.pop(index, None)
        if index in self.pending_ttft:
            ttft = self.pending_ttft.pop(index)
            if now < first_token:  # its first token had not come: it counts when it does
                self.first_tokens.pop(index, None)
                self.ttft.remove(ttft)
                if request.tenant is not None:
                    self.tenant_ttft[request.tenant].remove(ttft)
            else:
                self.first_out.add(index)
        self.preemptions += 1
        if request.tenant is not None:
            self.tenant_preempted[request.tenant] += 1
        self.preempted[index] = (self.arrived.pop(index), made)
        cached_now = self.manager.lookup(self.keys[index], request.input_length + made) * self.settings.block_size
        estimate = self.prefill_seconds(request.input_length + made - cached_now, cached_now) \
            + (request.output_length - made) / self.rate
        self.arrivals[index], self.queued_work[index] = now, estimate
        self.queued_seconds += estimate
        for key in self.keys[index]:
            self.queued_keys[key] = self.queued_keys.get(key, 0) + 1
        self.waiting.appendleft(index)  # before every later arrival, as kvd ranks it (see the module's doc)

    def _prefilled(self, elapsed: float, whole: float, uncached: int) -> int:
        """Prompt tokens of `uncached` computed `elapsed` seconds into a prefill of `whole` seconds (at
        an even pace after prefill_overhead, with the model's costs)."""
        s = self.settings
        if not s.prefill_context_cost and not s.prefill_overhead:
            return max(int(elapsed * s.prefill_rate), 0)  # (bit for bit, as before them)
        work = whole - s.prefill_overhead
        return 0 if work <= 0 else min(uncached, max(int((elapsed - s.prefill_overhead) / work * uncached), 0))

    def _queue_order(self) -> Iterator[int] | None:
        """The waiting requests in the order of queue_order: under priority, by their places (their
        tenants' priorities, deferred by their own; lower first), in arrival order within one, as
        kvd's; under lpm,
        `longest_prefix_first` (what the device holds of each prompt, and how long each has waited);
        under priority+lpm, that within each place. None for arrival order (fifo, or a queue past
        LPM_MAX_WAITING, where lpm keeps it too; priority+lpm keeps priority's)."""
        waiting, order = self.waiting, self.settings.queue_order
        if len(waiting) < 2 or order == "fifo":
            return None
        if not by_prefix(order) or len(waiting) > LPM_MAX_WAITING:
            return iter(sorted(waiting, key=self.request_place)) if by_priority(order) else None
        lookup, keys, requests = self.manager.lookup, self.keys, self.requests
        return iter(longest_prefix_first(waiting, lambda i: lookup(keys[i], requests[i].input_length),
                                         self.lpm_overdue, place=self.request_place if by_priority(order) else None))

    def place(self, tenant: str | None) -> int:
        """A tenant's place in a priority queue (tenant_priorities; lower first, 0 for one not named);
        None: the default tenant."""
        return self.priorities.get(tenant or "default", 0)

    def request_place(self, index: int) -> int:
        """Request `index`'s place: its tenant's, deferred by its own priority (a trace line's, as kvd's
        request field), as kvd places it."""
        request = self.requests[index]
        return self.place(request.tenant) + request.priority

    def _dequeue(self, index: int) -> None:
        if self.waiting[0] == index:
            self.waiting.popleft()
        else:
            self.waiting.remove(index)

    def held_blocks(self, index: int) -> int:
        """Leading blocks of request `index`'s prompt this replica holds, or will once the
        requests waiting in its queue are computed: what a router following its event feed
        counts (it counts what it sent there as held until the feed confirms it)."""
        keys, tokens = self.keys[index], self.requests[index].input_length
        held = self.manager.lookup(keys, tokens)
        limit = self.manager.cacheable_blocks(tokens)
        while held < limit and keys[held] in self.queued_keys:
            held += 1
        return held

    def _unqueue(self, index: int) -> float:
        queued = self.queued_keys
        for key in self.keys[index]:
            if queued[key] == 1:
                del queued[key]
            else:
                queued[key] -= 1
        self.queued_seconds -= self.queued_work.pop(index)
        if not self.waiting:
            self.queued_seconds = 0.0  # no drift from the running sum
        return self.arrivals.pop(index)

    def finish_until(self, limit: float, progress: Callable[[int], None]) -> None:
        """Finish every request done by `limit`, admitting waiting ones as slots free."""
        while self.running:
            # (a growth at a finish's time goes first: a last output token may need a block)
            if self.growing and self.growing[0][0] <= self.running[0][0]:
                when, index = self.growing[0]
                if when > limit:
                    break
                heapq.heappop(self.growing)
                self.advance(when)
                self.grow(index)
                self.admit_waiting(progress)
                continue
            done, index = self.running[0]
            if done > limit:
                break
            heapq.heappop(self.running)
            self.advance(done)
            self.anchors.pop(index, None)
            self._rerate(len(self.running))
            self.finish(index)
            self.e2e.append(done - self.arrived.pop(index))
            first_token = self.first_tokens.pop(index, None)
            output = self.requests[index].output_length
            if first_token is not None and output > 1:
                self.itl.append((done - first_token) / (output - 1))
            self.decoding.pop(index, None)
            self.pending_ttft.pop(index, None)
            self.first_out.discard(index)
            progress(1)
            self.admit_waiting(progress)

    def arrive(self, index: int, arrival: float, progress: Callable[[int], None],
               origin: float | None = None, passed_on: bool = False) -> bool:
        """Request `index` arrives now: queued, then started if it can be; or refused when the queue
        is full (False), a queue_full rejection unless `passed_on` (a router takes it to another
        replica, as kvd router does a 429). `origin`: when it first arrived at the fleet, for a
        request a router re-routed here (its wait for max_queue_wait starts now, its time to first
        token then)."""
        self.expire_waiting(progress)  # those that timed out before now hold no place in the queue
        if len(self.waiting) >= self.settings.max_queue:
            if not passed_on:
                self.reject("queue_full", index)
                progress(1)
            return False
        if origin is not None:
            self.origins[index] = origin
        self.orders[index] = len(self.orders)
        request = self.requests[index]
        cached = self.manager.lookup(self.keys[index], request.input_length) * self.settings.block_size
        estimate = self.service_seconds(index, request.input_length - cached)
        self.arrivals[index], self.queued_work[index] = arrival, estimate
        self.queued_seconds += estimate
        if self.tenant_waits and (limit := self.queue_wait_limit(request.tenant)) > 0:
            heapq.heappush(self.deadlines, (arrival + limit, index))
        for key in self.keys[index]:
            self.queued_keys[key] = self.queued_keys.get(key, 0) + 1
        self.waiting.append(index)
        self.admit_waiting(progress)
        return True

    def drain(self, progress: Callable[[int], None]) -> None:
        self.finish_until(float("inf"), progress)
        while self.waiting:  # only requests blocked by pins can remain
            index = self.waiting.popleft()
            self._unqueue(index)
            self.origins.pop(index, None)
            self.preempted.pop(index, None)
            self.reject("cache_full", index)
            progress(1)

    def arrival_of(self, request: TraceRequest) -> float:
        return request.timestamp_ms / 1000.0 * self.settings.time_scale

    def run_concurrent(self, progress: Callable[[int], None]) -> None:
        for index, request in enumerate(self.requests):
            arrival = self.arrival_of(request)
            self.finish_until(arrival, progress)
            self.advance(arrival)
            self.arrive(index, arrival, progress)
        self.drain(progress)

    def result(self, seconds: float) -> ReplayResult:
        s = self.settings
        calls = sorted(self.call_ns)
        alloc_seconds = sum(calls) / 1e9
        if s.sequential:
            mean_used = self.used_samples / max(self.admitted, 1)
        else:
            mean_used = self.used_area / self.last_event if self.last_event > 0 else 0.0
        return ReplayResult(
            block_size=s.block_size, capacity_tokens=s.capacity_tokens, policy=s.policy_label,
            mode="sequential" if s.sequential else "concurrent",
            requests=len(self.requests), admitted=self.admitted,
            prompt_tokens=self.prompt_tokens, hit_tokens=self.hit_tokens,
            hit_ratio=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            max_hit_ratio=self.max_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            recomputed_tokens=self.recomputed,
            evictions=self.manager.pool.evictions,
            fragmentation=self.slots_tail_unused / self.slots_allocated if self.slots_allocated else 0.0,
            reservation_waste=(self.slots_reserve_unused / self.slots_allocated
                               if self.slots_allocated else 0.0),
            peak_occupancy=self.peak_used / s.num_blocks,
            mean_occupancy=mean_used / s.num_blocks,
            rejections=sum(self.rejections.values()),
            preemptions=self.preemptions,
            alloc_us_p50=(percentile(calls, 0.50) or 0) / 1000.0,
            alloc_us_p99=(percentile(calls, 0.99) or 0) / 1000.0,
            block_ops=self.block_ops,
            block_ops_per_second=self.block_ops / alloc_seconds if alloc_seconds else 0.0,
            requests_per_second=len(self.requests) / seconds if seconds else 0.0,
            seconds=seconds, reject_reasons=dict(self.rejections),
            ttft_p50_s=None if s.sequential else percentile(sorted(self.ttft), 0.50),
            ttft_p95_s=None if s.sequential else percentile(sorted(self.ttft), 0.95),
            ttft_p99_s=None if s.sequential else percentile(sorted(self.ttft), 0.99),
            tenant_hit_ratio={tenant: hit / prompt if prompt else 0.0
                              for tenant, (hit, prompt) in sorted(self.tenant_tokens.items())},
            tenant_evicted_blocks={tenant: self.tenant_evicted[tenant] for tenant in sorted(self.tenant_tokens)},
            tier_tokens=s.tier_tokens, restored_tokens=self.restored_tokens,
            restored_ratio=self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            queue_order=s.queue_order,
            tenant_ttft_p50_s={} if s.sequential else tenant_percentiles(self.tenant_ttft, 0.50),
            tenant_ttft_p95_s={} if s.sequential else tenant_percentiles(self.tenant_ttft, 0.95),
            tenant_rejected={tenant: self.tenant_rejected[tenant]
                             for tenant in sorted({*self.tenant_tokens, *self.tenant_rejected})},
            reservation=s.reservation, recomputed_after_preemption=self.recomputed_after_preemption,
            e2e_p50_s=None if s.sequential else percentile(sorted(self.e2e), 0.50),
            e2e_p95_s=None if s.sequential else percentile(sorted(self.e2e), 0.95),
            tenant_preemptions={tenant: self.tenant_preempted[tenant]
                                for tenant in sorted({*self.tenant_tokens, *self.tenant_rejected})},
            max_running=s.max_running,
            itl_p50_s=None if s.sequential else percentile(sorted(self.itl), 0.50),
            itl_p95_s=None if s.sequential else percentile(sorted(self.itl), 0.95),
        )


def tenant_percentiles(times: dict[str, list[float]], q: float) -> dict[str, float]:
    """Each tenant's q-th percentile of its `times` (first-token seconds), by tenant name."""
    return {tenant: percentile(sorted(values), q) for tenant, values in sorted(times.items())}


def replay(settings: ReplaySettings, requests: Sequence[TraceRequest], keys: Sequence[list[BlockKey]],
           max_hits: Sequence[int], progress: Callable[[int], None] | None = None,
           audit: bool = False, outputs: Sequence[list[BlockKey]] | None = None) -> ReplayResult:
    """Replay `requests` (with their precomputed prompt keys, and output keys where given: `ReplicaRun`)
    under `settings`.

    `audit=True` reconciles the cache's books at the end (tests turn it on).
    """
    if settings.num_blocks < 1:
        raise ValueError(f"capacity_tokens: {settings.capacity_tokens} holds no block of "
                         f"{settings.block_size} tokens")
    run = ReplicaRun(settings, requests, keys, max_hits, outputs=outputs)
    tick = progress or (lambda _n: None)
    started = time.perf_counter()
    if settings.sequential:
        run.run_sequential(tick)
    else:
        run.run_concurrent(tick)
    seconds = time.perf_counter() - started
    if audit:
        run.manager.audit()
        if run.manager.num_sequences:
            raise AssertionError(f"{run.manager.num_sequences} sequences left after the replay")
    return run.result(seconds)

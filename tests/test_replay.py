"""Trace replay on small generated traces whose figures are worked out by hand."""

from __future__ import annotations


import json
import re
from collections import OrderedDict
from dataclasses import replace

import pytest

from kvctl.daemon.replay.simulator import ReplaySettings, max_hit_blocks, replay
from kvctl.daemon.replay.trace import (TraceError, TraceKeyer, TraceRequest, generate_trace,
                                       read_trace, write_trace)


def req(t_ms, input_length, ids, output=0):
    return TraceRequest(float(t_ms), input_length, output, tuple(ids))


def run(requests, block_size, capacity_tokens, policy="lru", **kwargs):
    keyer = TraceKeyer(block_size)
    keys = [keyer.keys(r) for r in requests]
    settings = ReplaySettings(block_size=block_size, capacity_tokens=capacity_tokens, policy=policy,
                              **kwargs)
    return replay(settings, requests, keys, max_hit_blocks(requests, keys, block_size), audit=True)


# r1 extends r0; r2 is r0's first 512 tokens; r3 shares nothing.
PREFIX_TRACE = [req(0, 1024, [1, 2]), req(1000, 1324, [1, 2, 3]), req(2000, 512, [1]),
                req(3000, 700, [4, 5])]


def test_trace_keys_split_512_token_blocks_and_skip_partial_ones():
    keyer = TraceKeyer(256)
    k0, k1, k2 = (keyer.keys(r) for r in PREFIX_TRACE[:3])
    assert len(k0) == 4 and len(k1) == 5 and len(k2) == 2  # 300-token tail of id 3: one sub-block
    assert k1[:4] == k0 and k2 == k0[:2]
    assert keyer.keys(PREFIX_TRACE[3]) == keyer.keys(req(0, 512, [4]))  # the 188-token tail: none


def test_unbounded_sequential_hits_at_block_256():
    result = run(PREFIX_TRACE, 256, 1 << 20, sequential=True)
    # r1 hits four blocks (1024 tokens); r2 may reuse one of its two (its last token is computed).
    assert result.hit_tokens == 1024 + 256
    assert result.prompt_tokens == 1024 + 1324 + 512 + 700
    assert result.hit_ratio == pytest.approx(1280 / 3560)
    assert result.max_hit_ratio == pytest.approx(1280 / 3560)
    assert (result.recomputed_tokens, result.evictions, result.rejections) == (0, 0, 0)


def test_unbounded_sequential_hits_at_block_512():
    result = run(PREFIX_TRACE, 512, 1 << 20, sequential=True)
    assert result.hit_tokens == 1024  # r1 only; r2's single block holds its last token


# A shared system prompt (id 1) asked twice, then fresh traffic, then the system prompt again.
SYSTEM_TRACE = [req(0, 1024, [1, 10]), req(1, 1024, [1, 11]), req(2, 1024, [20, 21]),
                req(3, 1024, [22, 23]), req(4, 1024, [1, 12])]


def test_lru_forgets_the_system_prompt_under_pressure():
    result = run(SYSTEM_TRACE, 256, 6 * 256, "lru", sequential=True)
    assert result.hit_tokens == 512  # only r1
    assert result.recomputed_tokens == 512  # r4 recomputes the system prompt
    assert result.evictions == 4 + 4 + 4


def test_cost_keeps_the_reused_system_prompt():
    result = run(SYSTEM_TRACE, 256, 6 * 256, "cost", sequential=True)
    assert result.hit_tokens == 512 + 512  # r1 and r4
    assert result.recomputed_tokens == 0
    assert result.evictions == 4 + 4 + 2


OVERLAP_TRACE = [req(0, 1024, [1, 2], output=10), req(1000, 1024, [3, 4], output=10),
                 req(2000, 3000, [5, 6, 7, 8, 9, 10], output=10)]


def test_concurrent_replay_queues_then_rejects_what_never_fits():
    result = run(OVERLAP_TRACE, 256, 8 * 256, prefill_rate=1e12, decode_rate=1.0)
    # r0 holds 5 of 8 blocks until t=10; r1 waits, then evicts one of r0's cached blocks;
    # r2 (12 blocks) can never fit.
    assert (result.admitted, result.rejections, result.reject_reasons) == (2, 1, {"never_fits": 1})
    assert result.evictions == 1
    assert result.peak_occupancy == pytest.approx(5 / 8)
    assert result.mean_occupancy == pytest.approx(5 / 8)
    assert result.fragmentation == pytest.approx((1280 - 1034) * 2 / (1280 * 2))
    assert result.reservation_waste == 0.0


def test_concurrent_replay_rejects_when_the_queue_is_full():
    result = run(OVERLAP_TRACE, 256, 8 * 256, prefill_rate=1e12, decode_rate=1.0, max_queue=1)
    assert result.reject_reasons == {"queue_full": 1}


def test_concurrent_replay_rejects_what_waits_past_max_queue_wait_as_kvd_does():
    # one at a time, each 10 s of decode; three arrive at once: the second starts at 10 s, the
    # third would at 20 s
    trace = [req(0, 256, [n], output=10) for n in (1, 2, 3)]
    settings = dict(prefill_rate=1e12, decode_rate=1.0, max_running=1)
    assert run(trace, 256, 1 << 16, **settings).reject_reasons == {}
    result = run(trace, 256, 1 << 16, max_queue_wait=15.0, **settings)
    assert (result.admitted, result.reject_reasons) == (2, {"queue_timeout": 1})  # the third waited past 15 s
    assert result.ttft_p95_s == pytest.approx(10.0)  # the times of the requests that started
    result = run(trace, 256, 1 << 16, max_queue_wait=10.0, **settings)
    assert (result.admitted, result.reject_reasons) == (1, {"queue_timeout": 2})  # 10 s is the limit: not started
    # a request that timed out holds no place: the next arrival is queued, not refused as queue_full
    # (with room for one waiting: the third is refused at 0 s, the second times out at 5 s, the
    # fourth comes at 6 s and starts at 10 s)
    later = trace + [req(6_000, 256, [4], output=1)]
    result = run(later, 256, 1 << 16, max_queue_wait=5.0, max_queue=1, **settings)
    assert result.reject_reasons == {"queue_full": 1, "queue_timeout": 1}
    assert result.admitted == 2 and result.ttft_p95_s == pytest.approx(4.0)


def test_reservation_waste_counts_reserved_blocks_never_written():
    trace = [req(0, 512, [1], output=0), req(1, 512, [2], output=256)]
    result = run(trace, 256, 1 << 16, reservation="fixed:512", max_tokens=512, sequential=True)
    # Each reserves 512 output tokens: 2 prompt blocks + 2 reserved. The first writes none of its
    # reserved blocks, the second one of them: 3 of 8 blocks never written.
    assert result.reservation_waste == pytest.approx(3 / 8)
    assert result.fragmentation == 0.0


def test_a_trace_line_s_own_max_tokens_is_what_its_output_reservation_reserves_for():
    """As the test above, reserving all of max_tokens, each line saying 512 (as kvd's trace does):
    the same waste with no --max-tokens, and a line's own wins over --max-tokens (2,048 would leave
    15 of 20 blocks unwritten); a line that does not say takes --max-tokens, else its output."""
    trace = [TraceRequest(0.0, 512, 0, (1,), max_tokens=512), TraceRequest(1.0, 512, 256, (2,), max_tokens=512)]
    for max_tokens in (None, 2048):
        result = run(trace, 256, 1 << 16, reservation="fraction:1.0", max_tokens=max_tokens, sequential=True)
        assert result.reservation_waste == pytest.approx(3 / 8)
    unsaid = [replace(r, max_tokens=None) for r in trace]
    assert run(unsaid, 256, 1 << 16, reservation="fraction:1.0", max_tokens=2048,
               sequential=True).reservation_waste == pytest.approx(15 / 20)
    assert run(unsaid, 256, 1 << 16, reservation="fraction:1.0", sequential=True).reservation_waste == 0.0


def test_every_request_comes_back_and_the_books_balance_on_a_generated_trace():
    trace = generate_trace(300, seed=3)
    for policy in ("lru", "cost", "lfu"):
        for sequential in (False, True):
            result = run(trace, 32, 16_384, policy, sequential=sequential)  # audit=True inside
            assert result.admitted + result.rejections == 300
            assert 0 < result.hit_ratio <= result.max_hit_ratio <= 1


def test_generated_traces_are_deterministic_and_round_trip(tmp_path):
    assert generate_trace(50, seed=1) == generate_trace(50, seed=1)
    assert generate_trace(50, seed=1) != generate_trace(50, seed=2)
    path = tmp_path / "t.jsonl"
    write_trace(path, generate_trace(50, seed=1))
    assert read_trace(path) == generate_trace(50, seed=1)


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
     "t.jsonl line 2: field 'input_length' must be an integer >= 1, got 0"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "t.jsonl line 2: field 'timestamp' must be a number >= 0, got -5"),
    # Python's json reads NaN and Infinity: a NaN passed `< 0` and was replayed (and counted) as a time
    ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "t.jsonl line 2: field 'timestamp' must be a number >= 0, got nan"),
    ('{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "t.jsonl line 2: field 'timestamp' must be a number >= 0, got inf"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     "t.jsonl line 2: field 'hash_ids' has 1 ids but input_length 600 needs 2 (one per 512 tokens)"),
    ('{"timestamp": 0, "input_length": 6', "t.jsonl line 2: not valid JSON"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                    + line + "\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(info.value).startswith(message)


# ---- a fleet behind a router --------------------------------------------------------------------
def fleet(requests, replicas, routing, block_size=512, capacity_tokens=1024, **kwargs):
    from kvctl.daemon.replay.fleet import replay_fleet

    keyer = TraceKeyer(block_size)
    keys = [keyer.keys(r) for r in requests]
    balance = kwargs.pop("balance_seconds", None)
    placement = kwargs.pop("placement", 0)
    routed = {name: kwargs.pop(name) for name in ("queue_limits", "reroute", "speeds", "queue_waits")
              if name in kwargs}
    settings = ReplaySettings(block_size=block_size, capacity_tokens=capacity_tokens, **kwargs)
    return replay_fleet(settings, replicas, routing, requests, keys, max_hit_blocks(requests, keys, block_size),
                        audit=True, placement=placement, **routed,
                        **({} if balance is None else {"balance_seconds": balance}))


# two system prompts (hash ids 1 and 2), each asked twice in a row, a second apart; each replica
# caches two blocks of 512: one request, so a replica serving the other prompt forgets this one
GROUPS = [req(1000 * i, 1024, [group, 100 + i]) for i, group in enumerate([1, 1, 2, 2, 1, 1, 2, 2])]


@pytest.mark.parametrize("routing, hits, per_replica", [
    ("round_robin", 0, [4, 4]),  # each replica sees the prompts alternate and keeps neither
    ("least_loaded", 0, [4, 4]),  # idle replicas: spread in turn, blind to the cache
    ("prefix", 6 * 512, [4, 4]),  # each prompt stays where it was first computed
    ("ttft", 6 * 512, [4, 4]),  # a cached prefix is the shorter first token
])
def test_routing_decides_how_much_of_the_ceiling_a_fleet_keeps(routing, hits, per_replica):
    result = fleet(GROUPS, 2, routing)
    assert (result.hit_tokens, result.requests_per_replica) == (hits, per_replica)
    assert result.prompt_tokens == 8 * 1024 and result.max_hit_ratio == 6 * 512 / (8 * 1024)
    assert result.recomputed_tokens == 6 * 512 - hits and result.rejections == 0 and result.imbalance == 1.0
    # no queueing: a first token costs the uncached prompt at 20,000 tokens/s
    assert result.ttft_p99_s == pytest.approx(1024 / 20_000)
    assert result.ttft_p50_s == pytest.approx((512 if hits else 1024) / 20_000)


@pytest.mark.parametrize("tier_write, restored", [
    (None, 0),
    # what a replica evicts: r2 and r3 push r0's and r1's prompt down; r4 to r7 find theirs there
    ("write_back", 4 * 512),
    # every prompt block as it is computed: from r1 on, each request finds its system prompt
    ("write_through", 6 * 512),
    # a block when a prompt first reuses it: no device hit, so nothing is ever written
    ("write_through_selective", 0),
])
def test_replicas_sharing_a_tier_restore_what_another_computed(tier_write, restored):
    tier = {} if tier_write is None else {"tier_tokens": 16 * 512, "tier_write": tier_write}
    result = fleet(GROUPS, 2, "round_robin", restore_rate=100_000.0, **tier)
    assert result.hit_tokens == 0 and result.requests_per_replica == [4, 4]  # no device hit: as without a tier
    assert (result.tier_tokens, result.restored_tokens) == (tier.get("tier_tokens", 0), restored)
    assert result.restored_ratio == pytest.approx(restored / (8 * 1024))
    assert result.recomputed_tokens == 6 * 512 - restored
    if restored:  # a restoring request's first token: the restore, then the rest of its prompt
        assert result.ttft_p50_s == pytest.approx(512 / 100_000 + 512 / 20_000)


def test_a_router_counts_the_shared_tier_as_held_by_every_replica():
    from kvctl.daemon.replay.fleet import _facts
    from kvctl.daemon.replay.simulator import ReplicaRun

    keyer = TraceKeyer(512)
    keys = [keyer.keys(r) for r in GROUPS]
    settings = ReplaySettings(block_size=512, capacity_tokens=1024, tier_tokens=8192, restore_rate=100_000.0)
    shared = OrderedDict()
    runs = [ReplicaRun(settings, GROUPS, keys, [0] * 8, tier=shared) for _ in range(2)]
    shared[keys[0][0]] = None  # the system prompt's block, written by either
    facts = [_facts(run, 1, f"replica-{i}", 512) for i, run in enumerate(runs)]
    assert [(f.cached_tokens, f.restorable_tokens, f.restore_seconds) for f in facts] == [(0, 512, 512 / 100_000)] * 2
    assert list(shared) == [keys[0][0]]  # asking does not touch it


# one slot, prompts computed at once, a token a second: r0 holds the slot 4 s; r1 (a prompt nobody
# shares) and r2 (opening with r0's first block) wait for it
LPM_TRACE = [req(0, 1024, [1, 10], output=4), req(1000, 1024, [2, 20], output=1), req(2000, 1024, [1, 11], output=1)]
ONE_SLOT = dict(max_running=1, prefill_rate=1e12, decode_rate=1.0)


@pytest.mark.parametrize("order, max_queue_wait, ttft, turned_away", [
    ("fifo", 0.0, (3.0, 3.0), {}),  # r1 starts at 4 s, r2 at 5 s
    ("lpm", 0.0, (2.0, 4.0), {}),  # r2 (a cached block) at 4 s, r1 at 5 s
    ("lpm", 4.5, (2.0, 4.0), {}),
    # r1 has waited the 4 s limit by the time the slot frees again: lpm turned it away (fifo would
    # have started it at 4 s)
    ("lpm", 4.0, (0.0, 2.0), {"queue_timeout": 1}),
    ("fifo", 4.0, (3.0, 3.0), {}),
])
def test_lpm_replays_the_longest_cached_prefix_first_as_kvd_orders_its_queue(order, max_queue_wait, ttft,
                                                                             turned_away):
    result = run(LPM_TRACE, 512, 8192, queue_order=order, max_queue_wait=max_queue_wait, **ONE_SLOT)
    assert (result.policy, result.queue_order) == ("lru+lpm" if order == "lpm" else "lru", order)
    assert (result.ttft_p50_s, result.ttft_p95_s) == (pytest.approx(ttft[0], abs=1e-6), pytest.approx(ttft[1]))
    assert (result.hit_tokens, result.admitted, result.reject_reasons) == (512, 3 - len(turned_away), turned_away)
    one = fleet(LPM_TRACE, 1, "prefix", capacity_tokens=8192, queue_order=order, max_queue_wait=max_queue_wait,
                **ONE_SLOT)
    assert (one.policy, one.queue_order, one.ttft_p50_s, one.ttft_p95_s) == (
        result.policy, order, result.ttft_p50_s, result.ttft_p95_s)


# one slot: noisy's r0 holds it until 4 s; noisy's r1 (1 s) and r2 (2 s), then quiet's r3 (3 s) queue
PRIORITY_TRACE = [TraceRequest(0.0, 512, 4, (1,), "noisy"), TraceRequest(1000.0, 512, 1, (2,), "noisy"),
                  TraceRequest(2000.0, 512, 1, (3,), "noisy"), TraceRequest(3000.0, 512, 1, (4,), "quiet")]


@pytest.mark.parametrize("order, max_queue_wait, noisy_ttft, quiet_ttft, noisy_rejected", [
    ("fifo", 0.0, (3.0, 3.0), 3.0, 0),  # r1 starts at 4 s, r2 at 5 s, r3 at 6 s: 3 s each
    ("priority", 0.0, (4.0, 4.0), 1.0, 0),  # r3 at 4 s, then r1 at 5 s and r2 at 6 s
    ("fifo", 3.5, (3.0, 3.0), 3.0, 0),
    # r3 at 4 s; at 5 s r1 has waited past 3.5 s (turned away at 4.5 s), r2 starts (3 s)
    ("priority", 3.5, (0.0, 3.0), 1.0, 1),
])
def test_priority_replays_the_tenants_queue_order_as_kvd_orders_its_queue(order, max_queue_wait, noisy_ttft,
                                                                          quiet_ttft, noisy_rejected):
    """quiet at -10 (tenant_priorities): under queue_order priority its request goes before noisy's
    earlier ones; first come, first served waits its turn. Each tenant's first-token times and
    rejections are reported."""
    result = run(PRIORITY_TRACE, 512, 8192, queue_order=order, max_queue_wait=max_queue_wait,
                 tenant_priorities=(("quiet", -10),), **ONE_SLOT)
    assert (result.policy, result.queue_order) == ("lru+prio" if order == "priority" else "lru", order)
    assert result.tenant_ttft_p50_s == {"noisy": pytest.approx(noisy_ttft[0], abs=1e-6),
                                        "quiet": pytest.approx(quiet_ttft, abs=1e-6)}
    assert result.tenant_ttft_p95_s == {"noisy": pytest.approx(noisy_ttft[1], abs=1e-6),
                                        "quiet": pytest.approx(quiet_ttft, abs=1e-6)}
    assert result.tenant_rejected == {"noisy": noisy_rejected, "quiet": 0}
    assert result.reject_reasons == ({"queue_timeout": 1} if noisy_rejected else {})
    one = fleet(PRIORITY_TRACE, 1, "least_loaded", capacity_tokens=8192, queue_order=order,
                max_queue_wait=max_queue_wait, tenant_priorities=(("quiet", -10),), **ONE_SLOT)
    assert (one.policy, one.ttft_p50_s, one.ttft_p95_s, one.rejections) == (
        result.policy, result.ttft_p50_s, result.ttft_p95_s, result.rejections)
    assert (one.tenant_ttft_p50_s, one.tenant_ttft_p95_s, one.tenant_rejected) == (
        result.tenant_ttft_p50_s, result.tenant_ttft_p95_s, result.tenant_rejected)


@pytest.mark.parametrize("order, waits, noisy_ttft, quiet_ttft, rejected", [
    # quiet may wait 0.5 s, noisy 3 s: quiet's r3 times out at 3.5 s although noisy's r1 and r2 came
    # first and still wait; r1 at 4 s, as the slot frees; r2 starts then (2 s)
    ("fifo", (("noisy", 3.0), ("quiet", 0.5)), (0.0, 2.0), None, {"noisy": 1, "quiet": 1}),
    # noisy may wait 10 s, quiet max_queue_wait's 3.5 s: under priority none times out
    ("priority", (("noisy", 10.0),), (4.0, 4.0), 1.0, {"noisy": 0, "quiet": 0}),
])
def test_tenants_own_queue_wait_limits_turn_their_requests_away_by_their_own_deadlines(order, waits, noisy_ttft,
                                                                                     quiet_ttft, rejected):
    """PRIORITY_TRACE on one slot with max_queue_wait 3.5 s and tenants' own limits, as kvd's
    tenant_queue_waits: each request times out at its own deadline, in deadline order, not the
    queue's; a fleet of one, which re-routes timeouts, gives the same."""
    settings = dict(queue_order=order, max_queue_wait=3.5, tenant_priorities=(("quiet", -10),),
                    tenant_queue_waits=waits, **ONE_SLOT)
    result = run(PRIORITY_TRACE, 512, 8192, **settings)
    expected = {"noisy": pytest.approx(noisy_ttft[0], abs=1e-6)}
    if quiet_ttft is not None:
        expected["quiet"] = pytest.approx(quiet_ttft, abs=1e-6)
    assert result.tenant_ttft_p50_s == expected
    assert result.tenant_ttft_p95_s["noisy"] == pytest.approx(noisy_ttft[1], abs=1e-6)
    assert result.tenant_rejected == rejected
    assert result.reject_reasons == ({"queue_timeout": sum(rejected.values())} if sum(rejected.values()) else {})
    one = fleet(PRIORITY_TRACE, 1, "least_loaded", capacity_tokens=8192, **settings)
    assert (one.tenant_ttft_p50_s, one.tenant_ttft_p95_s, one.tenant_rejected, one.rejections) == (
        result.tenant_ttft_p50_s, result.tenant_ttft_p95_s, result.tenant_rejected, result.rejections)


def test_under_lpm_a_tenant_s_own_queue_wait_limit_stands_for_max_queue_wait():
    """LPM_TRACE's requests are the default tenant's: its own limit of 4 s gives what
    max_queue_wait 4 s does (r1 turned away, lpm's patience none), and its own 0 what no limit does."""
    by_own, by_all = (run(LPM_TRACE, 512, 8192, queue_order="lpm", **ONE_SLOT, **limit)
                      for limit in ({"tenant_queue_waits": (("default", 4.0),)}, {"max_queue_wait": 4.0}))
    assert (by_own.ttft_p50_s, by_own.ttft_p95_s, by_own.reject_reasons) == (
        by_all.ttft_p50_s, by_all.ttft_p95_s, by_all.reject_reasons) == (pytest.approx(0.0, abs=1e-6),
                                                                          pytest.approx(2.0), {"queue_timeout": 1})
    unlimited = run(LPM_TRACE, 512, 8192, queue_order="lpm", max_queue_wait=4.0,
                    tenant_queue_waits=(("default", 0.0),), **ONE_SLOT)
    assert (unlimited.ttft_p50_s, unlimited.ttft_p95_s, unlimited.reject_reasons) == (
        pytest.approx(2.0), pytest.approx(4.0), {})


def test_a_priority_queue_needs_the_tenants_priorities_and_a_queue():
    from kvctl.daemon.replay.sweep import validate_grid

    with pytest.raises(ValueError, match=r"^queue_order: priority orders the queue by the tenants' priorities and "
                                         r"the requests' own; give the tenants' \(--tenant-priorities, e.g. "
                                         r"quiet=-10\), or a trace whose lines carry priorities$"):
        validate_grid([16], [4096], ["lru"], ReplaySettings(block_size=16, capacity_tokens=4096),
                      queue_orders=["fifo", "priority"])
    with pytest.raises(ValueError, match=r"^queue_order: priority orders a queue, and --sequential has none"):
        validate_grid([16], [4096], ["lru"], ReplaySettings(block_size=16, capacity_tokens=4096, sequential=True,
                                                            tenant_priorities=(("quiet", -10),)),
                      queue_orders=["priority"])


def replica_after(trace, arrived: int, settings: ReplaySettings):
    """One replica of the fleet replay once the first `arrived` requests of `trace` have come, for
    asking it what a router would see of the rest."""
    from kvctl.daemon.replay.simulator import ReplicaRun

    keyer = TraceKeyer(settings.block_size)
    keys = [keyer.keys(r) for r in trace]
    replica = ReplicaRun(settings, trace, keys, [0] * len(trace))
    for index in range(arrived):
        arrival = replica.arrival_of(trace[index])
        replica.finish_until(arrival, lambda n: None)
        replica.advance(arrival)
        replica.arrive(index, arrival, lambda n: None)
    return replica


@pytest.mark.parametrize("order, waits", [("fifo", (4.0, 4.0)), ("lpm", (3.0, 4.0))])
def test_a_router_sees_the_wait_lpm_would_give_each_prompt(order, waits):
    """At 2 s in LPM_TRACE, r0 has 2 s left and r1 and r2 wait (1 s of work each; r2 holds r0's
    first block). A prompt opening with that block waits for r0 and r2 under lpm, not r1, as
    kvd's route-facts count it; one holding nothing waits for all, as first come, first served."""
    from kvctl.daemon.replay.fleet import _facts

    trace = LPM_TRACE + [req(2000, 1024, [1, 12], output=1), req(2000, 1024, [5, 50], output=1)]
    replica = replica_after(trace, 3, ReplaySettings(block_size=512, capacity_tokens=8192, queue_order=order,
                                                     **ONE_SLOT))
    assert list(replica.waiting) == [1, 2]
    sharing, fresh = (_facts(replica, index, "replica-0", 512) for index in (3, 4))
    assert (sharing.cached_tokens, fresh.cached_tokens) == (512, 0)
    assert (sharing.wait_seconds, fresh.wait_seconds) == (pytest.approx(waits[0]), pytest.approx(waits[1]))


@pytest.mark.parametrize("order, waits", [("fifo", (4.0, 4.0, 4.0, 4.0, 4.0)),
                                         ("priority", (2.0, 4.0, 4.0, 2.0, 4.0))])
def test_a_router_sees_the_wait_a_priority_queue_would_give_each_tenant(order, waits):
    """At 3 s in PRIORITY_TRACE, r0 has 1 s left and noisy's r1 and r2 and quiet's r3 wait (1 s of
    work each). A quiet request waits for r0 and r3 under priority, not noisy's, as kvd's
    route-facts count it; a noisy one, or one of a tenant not named (at 0), waits for all. A quiet
    one deferring itself by 5 (at -5) waits as quiet's; by 10 (at 0), for all."""
    from kvctl.daemon.replay.fleet import _facts

    trace = PRIORITY_TRACE + [TraceRequest(3000.0, 512, 1, (5,), tenant) for tenant in ("quiet", "noisy", None)] \
        + [TraceRequest(3000.0, 512, 1, (5,), "quiet", priority=deferral) for deferral in (5, 10)]
    replica = replica_after(trace, 4, ReplaySettings(block_size=512, capacity_tokens=8192, queue_order=order,
                                                     tenant_priorities=(("quiet", -10),), **ONE_SLOT))
    assert list(replica.waiting) == [1, 2, 3]
    assert tuple(_facts(replica, index, "replica-0", 512).wait_seconds for index in range(4, 9)) == tuple(
        pytest.approx(wait) for wait in waits)


# one slot: noisy's r0 holds it until 4 s; then noisy's r1 (nobody's prompt), r2 (opening with r0's
# first block, deferring itself by 5) and r3 (the same opening), and quiet's r4 (nobody's) queue; quiet at -10
MIXED_TRACE = [TraceRequest(0.0, 1024, 4, (1, 10), "noisy"), TraceRequest(1000.0, 1024, 1, (2, 20), "noisy"),
               TraceRequest(1500.0, 1024, 1, (1, 12), "noisy", priority=5),
               TraceRequest(2500.0, 1024, 1, (1, 11), "noisy"), TraceRequest(3000.0, 1024, 1, (3, 30), "quiet")]
MIXED_PLACES = (("quiet", -10),)


@pytest.mark.parametrize("order, ttft", [
    ("fifo", [0.0, 3.0, 3.5, 3.5, 4.0]),  # r1 at 4 s, r2 at 5, r3 at 6, r4 at 7
    ("priority", [0.0, 1.0, 4.0, 3.5, 5.5]),  # r4, r1, r3, r2
    ("lpm", [0.0, 2.5, 2.5, 5.0, 4.0]),  # r2 and r3 (a cached block), then r1, r4
    ("priority+lpm", [0.0, 1.0, 2.5, 5.0, 5.5]),  # r4 (quiet's place), r3 (place 0, cached), r1, r2 (place 5)
])
def test_priority_lpm_replays_each_place_by_its_longest_cached_prefix_as_kvd_orders_its_queue(order, ttft):
    from kvctl.daemon.replay.simulator import ReplicaRun

    keyer = TraceKeyer(512)
    keys = [keyer.keys(r) for r in MIXED_TRACE]
    settings = ReplaySettings(block_size=512, capacity_tokens=8192, queue_order=order, tenant_priorities=MIXED_PLACES,
                              **ONE_SLOT)
    replica = ReplicaRun(settings, MIXED_TRACE, keys, max_hit_blocks(MIXED_TRACE, keys, 512))
    replica.run_concurrent(lambda _n: None)
    assert replica.ttft == [pytest.approx(t, abs=1e-6) for t in ttft]  # in the order they started
    result = run(MIXED_TRACE, 512, 8192, queue_order=order, tenant_priorities=MIXED_PLACES, **ONE_SLOT)
    assert result.policy == "lru" + {"fifo": "", "priority": "+prio", "lpm": "+lpm", "priority+lpm": "+prio+lpm"}[order]


def test_a_router_sees_the_wait_priority_lpm_would_give_each_tenant_s_prompt():
    """At 3 s in MIXED_TRACE, r0 has 1 s left and r1 to r4 wait (1 s of work each). Under priority+lpm a
    noisy prompt opening with r0's first block waits for r0, quiet's r4 and r3 (as many blocks at its
    place); one holding nothing, for r1 too; a quiet one for r0 and r4; a noisy one opening with that
    block and deferring itself by 5, for all (r2 holds as much at its place, and came first)."""
    from kvctl.daemon.replay.fleet import _facts

    trace = MIXED_TRACE + [TraceRequest(3000.0, 1024, 1, ids, tenant, priority=deferral) for ids, tenant, deferral in (
        ((1, 13), "noisy", 0), ((4, 40), "noisy", 0), ((5, 50), "quiet", 0), ((1, 14), "noisy", 5))]
    replica = replica_after(trace, 5, ReplaySettings(block_size=512, capacity_tokens=8192, queue_order="priority+lpm",
                                                     tenant_priorities=MIXED_PLACES, **ONE_SLOT))
    assert list(replica.waiting) == [1, 2, 3, 4]
    assert tuple(_facts(replica, index, "replica-0", 512).wait_seconds for index in range(5, 9)) == tuple(
        pytest.approx(wait) for wait in (3.0, 4.0, 2.0, 5.0))


def test_a_fleet_of_one_is_the_single_replica_replay():
    trace = generate_trace(120, seed=3)
    one = fleet(trace, 1, "prefix", block_size=64, capacity_tokens=65_536)
    single = run(trace, 64, 65_536)
    assert (one.hit_tokens, one.prompt_tokens, one.evictions, one.rejections, one.admitted) == (
        single.hit_tokens, single.prompt_tokens, single.evictions, single.rejections, single.admitted)
    assert (one.ttft_p50_s, one.ttft_p95_s) == (single.ttft_p50_s, single.ttft_p95_s)


def test_prefix_affinity_gives_way_to_load_beyond_its_balance():
    # one slot per replica and 10 s per request: the second request of a prompt finds its
    # replica busy for 9 s more
    busy = [req(0, 1024, [1, 100], output=400), req(1000, 1024, [1, 101], output=400)]
    patient = fleet(busy, 2, "prefix", capacity_tokens=2048, max_running=1, balance_seconds=20.0)
    assert sorted(patient.requests_per_replica) == [0, 2] and patient.hit_tokens == 512  # both where the first went
    first_done = 1024 / 20_000 + 400 / 40
    assert patient.ttft_p99_s == pytest.approx(first_done - 1.0 + 512 / 20_000)  # it queued behind the first
    hasty = fleet(busy, 2, "prefix", capacity_tokens=2048, max_running=1, balance_seconds=2.0)
    assert hasty.requests_per_replica == [1, 1] and hasty.hit_tokens == 0
    assert hasty.ttft_p99_s == pytest.approx(1024 / 20_000)


# one slot per replica, a token a second, prompts computed at once: r0 holds a replica 20 s; r1 the
# other 3 s; r2, a second later, shares r0's prompt (hash id 1)
HELD_UP = [req(0, 1024, [1, 10], output=20), req(0, 1024, [2, 20], output=3), req(1000, 1024, [1, 11], output=1)]
SLOW_SERVICE = dict(capacity_tokens=4096, max_running=1, prefill_rate=1e12, decode_rate=1.0, max_queue_wait=5.0)


def test_a_fleet_router_passes_over_a_replica_predicted_past_its_queue_limit():
    """prefix routing sends r2 to the replica caching its prompt, 19 s behind, unless it heeds
    that replica's 5 s max_queue_wait: then to the other, where it starts at 3 s."""
    heed = fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, **SLOW_SERVICE)
    assert (heed.queue_limits, heed.rerouted, heed.reject_reasons) == ("heed", 0, {})
    assert sorted(heed.requests_per_replica) == [1, 2] and heed.hit_tokens == 0
    assert heed.ttft_p99_s == pytest.approx(2.0)  # arrived at 1 s, started at 3 s
    # blind to the limit: r2 waits its 5 s there, is turned away, and the router takes it to the
    # other replica (free since 3 s): its first token 5 s after it first arrived
    blind = fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_limits="ignore", **SLOW_SERVICE)
    assert (blind.queue_limits, blind.rerouted, blind.reject_reasons) == ("ignore", 1, {})
    assert sorted(blind.requests_per_replica) == [1, 2] and blind.admitted == 3
    assert blind.ttft_p99_s == pytest.approx(5.0)
    # not re-routed (a streamed request): the timeout is its answer
    streamed = fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_limits="ignore", reroute=False,
                     **SLOW_SERVICE)
    assert (streamed.rerouted, streamed.reject_reasons, streamed.admitted) == (0, {"queue_timeout": 1}, 2)
    # without a limit both are the same replay
    free = {**SLOW_SERVICE, "max_queue_wait": 0.0}
    unlimited = [fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_limits=q, **free) for q in ("heed", "ignore")]
    assert [(r.requests_per_replica, r.hit_tokens, r.ttft_p99_s) for r in unlimited] == [
        (unlimited[0].requests_per_replica, 512, pytest.approx(19.0))] * 2  # behind r0, its prompt cached


def test_a_fleet_turns_a_request_away_once_every_replica_has():
    """round_robin, 5 s limit, both replicas held 10 s: r2 and r3 time out at 5 s, each goes to
    the replica the other left, and times out there at 10 s, as the slot frees (kvd checks the
    queue's limit before it admits): a rejection each, after one re-route each."""
    trace = [req(0, 256, [n], output=out) for n, out in ((1, 10), (2, 10), (3, 1), (4, 1))]
    result = fleet(trace, 2, "round_robin", block_size=256, **SLOW_SERVICE)
    assert (result.queue_limits, result.rerouted, result.reject_reasons) == ("ignore", 2, {"queue_timeout": 2})
    assert (result.admitted, result.rejections, result.requests_per_replica) == (2, 2, [1, 1])
    # one more second of limit: each starts at 10 s where it was re-routed, 10 s after it came
    result = fleet(trace, 2, "round_robin", block_size=256, **{**SLOW_SERVICE, "max_queue_wait": 6.0})
    assert (result.rerouted, result.reject_reasons, result.requests_per_replica) == (2, {}, [2, 2])
    assert result.ttft_p99_s == pytest.approx(10.0)
    # a router heeding the limits sends a timed-out request on only where it is predicted to start in
    # time: at 5 s the other replica is 5 s from a free slot, with 1 s queued (6 s, past 5 s), so both
    # are turned away at once; at 6 s it is 4 s away (the queued one has just timed out): both go on
    heeding = fleet(trace, 2, "least_loaded", block_size=256, **SLOW_SERVICE)
    assert (heeding.queue_limits, heeding.rerouted, heeding.reject_reasons) == ("heed", 0, {"queue_timeout": 2})
    blind = fleet(trace, 2, "least_loaded", block_size=256, queue_limits="ignore", **SLOW_SERVICE)
    assert (blind.rerouted, blind.reject_reasons) == (2, {"queue_timeout": 2})  # another 5 s each, for nothing
    later = fleet(trace, 2, "least_loaded", block_size=256, **{**SLOW_SERVICE, "max_queue_wait": 6.0})
    assert (later.rerouted, later.reject_reasons, later.admitted) == (2, {}, 4)


def test_each_replica_of_a_fleet_may_have_a_queue_limit_of_its_own():
    """HELD_UP with the 5 s limit on one replica only. On the replica where r0 (20 s) runs, the
    prefix router heeding it sends r2 to the other (first token at 3 s); blind, r2 waits 5 s there
    and is re-routed. On the other replica only, r2 stays with its prefix and waits 19 s (no limit
    where it waits), heeding or not."""
    free = {**SLOW_SERVICE, "max_queue_wait": 0.0}
    where = fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, **free).requests_per_replica
    home = where.index(2)  # r0's replica (r2 shares its prompt)
    waits = [[5.0 if i == home else 0.0 for i in range(2)], [0.0 if i == home else 5.0 for i in range(2)]]
    heed, blind = (fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_waits=waits[0], queue_limits=q, **free)
                   for q in ("heed", "ignore"))
    assert (heed.queue_waits, heed.rerouted, heed.reject_reasons, heed.hit_tokens) == (waits[0], 0, {}, 0)
    assert heed.requests_per_replica[home] == 1 and heed.ttft_p99_s == pytest.approx(2.0)
    assert (blind.rerouted, blind.reject_reasons, blind.requests_per_replica[home]) == (1, {}, 1)
    assert blind.ttft_p99_s == pytest.approx(5.0)
    for queue_limits in ("heed", "ignore"):
        other = fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_waits=waits[1], queue_limits=queue_limits,
                      **free)
        assert (other.requests_per_replica, other.rerouted, other.reject_reasons) == (where, 0, {})
        assert (other.hit_tokens, other.ttft_p99_s) == (512, pytest.approx(19.0))
    # each replica's own limit in place of the settings': 5 s everywhere is SLOW_SERVICE's replay, bit for bit
    assert fleet(HELD_UP, 2, "prefix", balance_seconds=100.0, queue_waits=[5.0, 5.0], **free).as_dict() | {
        "seconds": 0, "queue_waits": []} == fleet(HELD_UP, 2, "prefix", balance_seconds=100.0,
                                                  **SLOW_SERVICE).as_dict() | {"seconds": 0}
    with pytest.raises(ValueError, match=r"^replica_queue_waits: 3 waits for 2 replicas; give one per replica$"):
        fleet(HELD_UP, 2, "prefix", queue_waits=[5.0, 5.0, 5.0], **free)
    with pytest.raises(ValueError, match=r"^replica_queue_waits: each must be a number of seconds >= 0 "
                                         r"\(0: no limit\), got -1\.0$"):
        fleet(HELD_UP, 2, "prefix", queue_waits=[5.0, -1.0], **free)


# every request shares one prompt (hash id 1); one slot and a queue of one per replica
FULL_QUEUES = [req(0, 1024, [1, 10], output=20), req(1000, 1024, [1, 11], output=1),
               req(2000, 1024, [1, 12], output=5), req(3000, 1024, [1, 13], output=1),
               req(4000, 1024, [1, 14], output=1)]


@pytest.mark.parametrize("reroute", [True, False])
def test_a_full_queue_s_refusal_goes_to_the_next_replica_as_kvd_router_takes_a_429(reroute):
    """prefix routing keeps every request with the replica caching the prompt (20 s behind is well
    within a 100 s balance). r1 queues behind r0; r2 finds that queue full and goes to the other
    replica (its second choice), where it starts at once; r3, with both caching the prompt, goes
    to the sooner, the other, and waits for r2 (4 s); r4 finds both queues full: a queue_full
    rejection after one re-route. Streamed or not: a 429 comes before any byte of an answer."""
    result = fleet(FULL_QUEUES, 2, "prefix", balance_seconds=100.0, reroute=reroute, max_queue=1,
                   **{**SLOW_SERVICE, "max_queue_wait": 0.0})
    assert (result.rerouted_full, result.rerouted, result.reject_reasons) == (2, 0, {"queue_full": 1})
    assert (result.admitted, sorted(result.requests_per_replica)) == (4, [2, 2])
    assert result.hit_tokens == 2 * 512  # r1 behind r0, r3 behind r2
    assert result.ttft_p99_s == pytest.approx(19.0)  # r1; r3's is 4 s, r0's and r2's none
    # a queue long enough: every request waits with its prefix
    long_queue = fleet(FULL_QUEUES, 2, "prefix", balance_seconds=100.0, **{**SLOW_SERVICE, "max_queue_wait": 0.0})
    assert (long_queue.rerouted_full, long_queue.reject_reasons, sorted(long_queue.requests_per_replica)) == (
        0, {}, [0, 5])


def test_a_fleet_of_mixed_speeds_runs_each_replica_at_its_own_rate_and_routers_see_it():
    """Replica 1 at a quarter of the speed (an older GPU): a prompt of 1,024 tokens takes it 4.096 s
    to compute against 1.024 s. ttft routing sees each replica's own prefill rate (as kvd's
    route-facts report what each measured) and keeps every request on the fast one, where the
    second waits behind the first; round_robin, blind, sends half to the slow one."""
    trace = [req(0, 1024, [1], output=1), req(0, 1024, [2], output=1), req(10_000, 1024, [3], output=1),
             req(20_000, 1024, [4], output=1)]
    service = dict(block_size=256, capacity_tokens=1 << 14, max_running=1, prefill_rate=1000.0, decode_rate=1e6)
    mixed = fleet(trace, 2, "ttft", speeds=[1.0, 0.25], **service)
    assert (mixed.requests_per_replica, mixed.speeds) == ([4, 0], [1.0, 0.25])
    assert mixed.ttft_p99_s == pytest.approx(2.048, abs=1e-5)  # the second, behind the first
    blind = fleet(trace, 2, "round_robin", speeds=[1.0, 0.25], **service)
    assert blind.requests_per_replica == [2, 2] and blind.ttft_p99_s == pytest.approx(4.096)
    alike = fleet(trace, 2, "ttft", **service)
    assert (alike.requests_per_replica, alike.speeds) == ([2, 2], []) and alike.ttft_p99_s == pytest.approx(1.024)
    assert fleet(trace, 2, "ttft", speeds=[1.0, 1.0], **service).as_dict() | {"seconds": 0, "speeds": []} == \
        alike.as_dict() | {"seconds": 0}  # speed 1 is the given rates, bit for bit
    with pytest.raises(ValueError, match=r"^replica_speeds: 1 speeds for 2 replicas; give one per replica$"):
        fleet(trace, 2, "ttft", speeds=[1.0], **service)
    with pytest.raises(ValueError, match=r"^replica_speeds: each must be a number > 0 \(1: the given rates\), got 0$"):
        fleet(trace, 2, "ttft", speeds=[1.0, 0], **service)


def test_a_fleet_refuses_sequential_mode_and_bad_counts_by_name():
    with pytest.raises(ValueError, match=r"replicas: a fleet replays in concurrent mode only \(drop --sequential\)"):
        fleet(GROUPS, 2, "prefix", sequential=True)
    with pytest.raises(ValueError, match="replicas: must be an integer >= 1, got 0"):
        fleet(GROUPS, 0, "prefix")
    with pytest.raises(ValueError, match="routing: unknown value 'random'"):
        fleet(GROUPS, 2, "random")


def test_a_prompt_queued_on_a_replica_draws_the_next_one_sharing_its_prefix():
    """Both replicas busy (one slot each); a new prompt queues on one. The next request sharing
    its prefix goes there too, as a router following the replicas' feeds counts what it sent
    there as held: it waits behind the first and finds the prefix cached."""
    burst = [req(0, 1024, [9, 90], output=400), req(0, 1024, [8, 80], output=400),
             req(100, 1024, [1, 100], output=10), req(200, 1024, [1, 101], output=10)]
    result = fleet(burst, 2, "prefix", capacity_tokens=4096, max_running=1, balance_seconds=100.0)
    assert result.requests_per_replica in ([3, 1], [1, 3])  # the two sharing prefix 1 went together
    assert result.hit_tokens == 512  # the second of them found the first's prefix


# The system prompt (id 1, two blocks of 256) of tenant "quiet", asked twice; then tenant "noisy"'s two
# fresh documents; then the system prompt again. Six blocks of cache.
TENANT_TRACE = [TraceRequest(0, 1024, 0, (1, 10), "quiet"), TraceRequest(1, 1024, 0, (1, 11), "quiet"),
                TraceRequest(2, 1024, 0, (20, 21), "noisy"), TraceRequest(3, 1024, 0, (22, 23), "noisy"),
                TraceRequest(4, 1024, 0, (1, 12), "quiet")]


def test_tenant_shares_keep_part_of_a_quiet_tenant_s_prefix_through_a_noisy_burst():
    plain = run(TENANT_TRACE, 256, 6 * 256, sequential=True)
    assert plain.policy == "lru" and plain.hit_tokens == 512  # the second request only: LRU took it all
    assert plain.tenant_hit_ratio == {"noisy": 0.0, "quiet": pytest.approx(512 / 3072)}
    # whose blocks paid: quiet's two extensions for the first document, then its system prompt and two
    # of that document's for the second, and the second's for quiet's last request
    assert plain.tenant_evicted_blocks == {"noisy": 6, "quiet": 6}
    shared = run(TENANT_TRACE, 256, 6 * 256, sequential=True, tenant_shares=(("noisy", 1 / 6),))
    # the second noisy document takes the first's three blocks beyond noisy's one-block share, then
    # one by LRU (the system prompt's second block): the last request still hits the first
    assert shared.policy == "lru+shares" and shared.hit_tokens == 512 + 256 and shared.evictions == 11
    assert shared.tenant_hit_ratio == {"noisy": 0.0, "quiet": pytest.approx(768 / 3072)}
    assert shared.tenant_evicted_blocks == {"noisy": 6, "quiet": 5}  # quiet keeps its system prompt's first block


def test_the_priority_policy_keeps_the_quiet_tenant_s_whole_prefix_through_the_noisy_burst():
    """quiet at -10 (kvd's tenant_priorities): the noisy documents evict quiet's own extensions
    (LRU among equals), then each other, and the system prompt stays; without priorities it is lru."""
    kept = run(TENANT_TRACE, 256, 6 * 256, "priority", sequential=True, tenant_priorities=(("quiet", -10),))
    assert kept.policy == "priority" and kept.hit_tokens == 512 + 512 and kept.evictions == 4 + 4 + 2
    assert kept.tenant_hit_ratio == {"noisy": 0.0, "quiet": pytest.approx(1024 / 3072)}
    assert kept.tenant_evicted_blocks == {"noisy": 6, "quiet": 4}  # quiet's two extensions only
    equal = run(TENANT_TRACE, 256, 6 * 256, "priority", sequential=True)
    plain = run(TENANT_TRACE, 256, 6 * 256, "lru", sequential=True)
    assert (equal.hit_tokens, equal.evictions) == (plain.hit_tokens, plain.evictions) == (512, 12)


def test_tenants_never_share_trace_blocks_and_a_trace_without_tenants_keys_as_before(tmp_path):
    keyer = TraceKeyer(256)
    quiet, noisy, anyone = (keyer.keys(TraceRequest(0, 1024, 0, (1, 2), tenant)) for tenant in ("quiet", "noisy", None))
    assert not set(quiet) & set(noisy) and not set(quiet) & set(anyone)
    assert anyone == TraceKeyer(256).keys(req(0, 1024, [1, 2]))
    trace = generate_trace(200, seed=3, noisy_fraction=0.4)
    assert {r.tenant for r in trace} == {"quiet", "noisy"}
    assert all(r.hash_ids[0] not in {q.hash_ids[0] for q in trace[:i]} for i, r in enumerate(trace) if r.tenant == "noisy")
    assert [r.tenant for r in generate_trace(20, seed=3)] == [None] * 20
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "tenant": "a b"}\n')
    with pytest.raises(TraceError, match=r"line 1: field 'tenant' must be a tenant name \(letters, digits, \. _ -\), "
                                         r"got 'a b'"):
        read_trace(path)


# ---- a lower tier under the device ---------------------------------------------------------------
@pytest.mark.parametrize("tier_blocks, restored", [(0, 0), (2, 0), (4, 512)])
def test_a_lower_tier_takes_what_the_device_evicts_and_gives_back_the_system_prompt(tier_blocks, restored):
    """SYSTEM_TRACE at 6 device blocks of 256: r2 evicts r0's and r1's own blocks, r3 the system
    prompt's two (hit by r1, so released later) and two of r2's. A tier of 4 blocks still holds the
    system prompt when r4 comes; a tier of 2 holds only r2's two."""
    result = run(SYSTEM_TRACE, 256, 6 * 256, "lru", sequential=True, tier_tokens=tier_blocks * 256)
    assert result.hit_tokens == 512  # the device's own hits are the same: r1's
    assert (result.tier_tokens, result.restored_tokens) == (tier_blocks * 256, restored)
    assert result.restored_ratio == pytest.approx(restored / (5 * 1024))
    assert result.recomputed_tokens == 512 - restored  # r4's system prompt: restored or prefilled


def test_write_through_selective_writes_down_what_a_prompt_reused():
    """SYSTEM_TRACE at 6 device blocks: r1 reuses the system prompt, which goes down then; r4 finds
    it in the tier after r2 and r3 evicted it. Nothing else is ever written down."""
    result = run(SYSTEM_TRACE, 256, 6 * 256, "lru", sequential=True, tier_tokens=2 * 256,
                 tier_write="write_through_selective")
    assert (result.hit_tokens, result.restored_tokens, result.recomputed_tokens) == (512, 512, 0)


def test_restored_tokens_cost_the_restore_rate_in_the_first_token_time():
    spaced = [req(i * 10_000, 1024, r.hash_ids) for i, r in enumerate(SYSTEM_TRACE)]  # one at a time
    settings = dict(max_running=1, prefill_rate=20_000.0, restore_rate=100_000.0)
    without = run(spaced, 256, 6 * 256, "lru", **settings)
    tiered = run(spaced, 256, 6 * 256, "lru", tier_tokens=4 * 256, **settings)
    assert tiered.restored_tokens == 512 and without.restored_tokens == 0
    # TTFTs: r0, r2, r3 prefill 1024; r1 512 (a device hit); r4 512, plus 512 restored in the tier run
    assert sorted([1024 / 20_000] * 3 + [512 / 20_000] * 2)[2] == pytest.approx(without.ttft_p50_s)
    assert tiered.ttft_p50_s == pytest.approx(1024 / 20_000)
    assert tiered.ttft_p95_s == pytest.approx(without.ttft_p95_s)


@pytest.mark.parametrize("tiers, replicas, message", [
    ([-1], 1, "tier_tokens: -1 is neither 0 (no lower tier) nor a block of 256 tokens or more"),
    ([100], 1, "tier_tokens: 100 is neither 0"),
    ([], 1, "tier_tokens: give at least one size"),
])
def test_bad_tier_sizes_are_refused_naming_the_field(tiers, replicas, message):
    from kvctl.daemon.replay.sweep import validate_grid

    base = ReplaySettings(block_size=256, capacity_tokens=4096)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_grid([256], [4096], ["lru"], base, replicas, ["prefix"], tier_tokens=tiers)
    with pytest.raises(ValueError, match="tier_write: unknown value 'sometimes'; choose write_back, write_through, write_through_selective"):
        validate_grid([256], [4096], ["lru"], ReplaySettings(block_size=256, capacity_tokens=4096, tier_write="sometimes"))
    with pytest.raises(ValueError, match="restore_rate: must be > 0, got 0.0"):
        validate_grid([256], [4096], ["lru"], ReplaySettings(block_size=256, capacity_tokens=4096, restore_rate=0.0))


# four system prompts (hash ids 1 to 4), each asked four times, in turn, a second apart
FOUR_GROUPS = [req(1000 * i, 1024, [1 + i % 4, 100 + i]) for i in range(16)]


def test_each_placement_sends_new_prefixes_home_by_a_hash_of_its_own():
    import hashlib

    from kvctl.daemon.replay.fleet import trace_affinity
    from kvctl.policies.routing import home_order

    assert trace_affinity(FOUR_GROUPS[0]) == trace_affinity(FOUR_GROUPS[0], 0) == hashlib.sha256(
        b"kvctl/affinity/trace/v1\0" + b"1").digest()  # placement 0: the replay's placement as before
    assert trace_affinity(FOUR_GROUPS[0], 1) != trace_affinity(FOUR_GROUPS[0], 2) != trace_affinity(FOUR_GROUPS[0])
    for placement in range(6):  # with room for all, every prompt stays at its prefix's home
        homes = [home_order(trace_affinity(r, placement), ["replica-0", "replica-1"])[0] for r in FOUR_GROUPS[:4]]
        result = fleet(FOUR_GROUPS, 2, "prefix", capacity_tokens=16 * 1024, placement=placement)
        assert result.requests_per_replica == [4 * homes.count(0), 4 * homes.count(1)]
        assert result.hit_tokens == 12 * 512


def test_a_sweep_replays_prefix_routing_over_placements_and_keeps_each_one_s_figures():
    from kvctl.daemon.replay.sweep import sweep_fleet

    settings = ReplaySettings(block_size=512, capacity_tokens=2048)
    [rr, prefix] = sweep_fleet(FOUR_GROUPS, [512], [2048], ["lru"], 2, ["round_robin", "prefix"], settings,
                               placements=8)
    assert rr.placements == []  # blind to prefixes: one placement is all there is
    assert [p["placement"] for p in prefix.placements] == list(range(8))
    assert (prefix.placements[0]["hit_ratio"], prefix.placements[0]["requests_per_replica"]) == (
        prefix.hit_ratio, prefix.requests_per_replica)  # the row is placement 0's
    again = fleet(FOUR_GROUPS, 2, "prefix", capacity_tokens=2048, placement=5)
    assert (prefix.placements[5]["hit_ratio"], prefix.placements[5]["imbalance"]) == (again.hit_ratio, again.imbalance)
    by_split = {}
    for p in prefix.placements:  # two prompts a replica fit its four blocks; three or four do not
        by_split.setdefault(tuple(sorted(p["requests_per_replica"])), set()).add(p["hit_ratio"])
    assert (8, 8) in by_split and len(by_split) > 1
    assert by_split[(8, 8)] == {12 * 512 / (16 * 1024)}  # every request after a prompt's first hits it
    assert all(max(hits) < 12 * 512 / (16 * 1024) for split, hits in by_split.items() if split != (8, 8))
    with pytest.raises(ValueError, match="placements: must be an integer >= 1, got 0"):
        sweep_fleet(FOUR_GROUPS, [512], [2048], ["lru"], 2, ["prefix"], settings, placements=0)


def test_kvctl_bench_replay_shows_the_spread_of_placements_and_refuses_them_where_none_differ(tmp_path, capsys):
    import json
    import statistics

    from kvctl.daemon.replay.trace import write_trace

    from .test_cli import cli

    path = tmp_path / "four.jsonl"
    write_trace(path, FOUR_GROUPS)
    args = ["bench", "replay", str(path), "--block-sizes", "512", "--capacity-tokens", "2048", "--policy", "lru",
            "--replicas", "2", "--routing", "round_robin,prefix", "--placements", "8"]
    status, printed, _ = cli(capsys, *args, "--json")
    document = json.loads(printed)
    assert status == 0 and document["fleet"]["placements"] == 8
    prefix = document["runs"][1]
    hits = sorted(p["hit_ratio"] for p in prefix["placements"])
    imbalances = sorted(p["imbalance"] for p in prefix["placements"])
    status, printed, _ = cli(capsys, *args)
    assert status == 0 and " ".join(printed.split()).endswith(
        f"prefix (lru, block 512, 2,048 tokens) over 8 placements of new prefixes: hit {hits[0]:.1%} to "
        f"{hits[-1]:.1%}, median {statistics.median(hits):.1%}; imbalance {imbalances[0]:.2f} to {imbalances[-1]:.2f}")
    status, _, err = cli(capsys, "bench", "replay", str(path), "--replicas", "2", "--routing", "round_robin",
                         "--placements", "8")
    assert status == 2 and " ".join(err.split()) == ("error: placements: 8 needs --replicas and prefix routing with "
                                                    "--new-prefix home (where a hash places new prefixes)")
    status, _, err = cli(capsys, "bench", "replay", str(path), "--placements", "0")
    assert status == 2 and "placements: must be an integer >= 1, got 0" in err


# ---- finer trace blocks (`block_tokens`, kvctl's extension) ----------------------------------------
def fine(t_ms, input_length, ids, block_tokens=64):
    return TraceRequest(float(t_ms), input_length, 0, tuple(ids), None, block_tokens)


# two prompts sharing 600 tokens, then apart: at 64 tokens an id, nine whole ids alike (576 tokens),
# the tenth covers tokens 576 to 639, where they differ
SHARED_600 = [fine(0, 700, list(range(11))), fine(1000, 700, list(range(9)) + [20, 21])]


@pytest.mark.parametrize("block_size, shared_blocks", [(16, 36), (32, 18), (64, 9), (128, 4), (512, 1)])
def test_finer_trace_ids_keep_a_prefix_shared_to_its_last_whole_block(block_size, shared_blocks):
    keyer = TraceKeyer(block_size)
    a, b = (keyer.keys(r) for r in SHARED_600)
    assert len(a) == len(b) == 700 // block_size  # only whole replay blocks, of several ids too
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    assert common == shared_blocks
    at_512 = TraceKeyer(block_size).keys  # the same prompts in 512-token ids share their first 512 only
    coarse = [req(0, 700, [0, 1]), req(1000, 700, [0, 2])]
    x, y = at_512(coarse[0]), at_512(coarse[1])
    assert next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) == 512 // block_size
    result = run(SHARED_600, block_size, 8192, sequential=True)
    assert result.hit_tokens == shared_blocks * block_size


def test_a_trace_line_says_its_block_size_and_a_trace_keeps_one(tmp_path):
    from kvctl.daemon.replay.trace import parse_request

    assert SHARED_600[0].to_object()["block_tokens"] == 64 and "block_tokens" not in req(0, 10, [1]).to_object()
    assert parse_request(SHARED_600[0].to_object(), "x") == SHARED_600[0]
    with pytest.raises(TraceError) as refused:
        parse_request({**SHARED_600[0].to_object(), "block_tokens": 100}, "t.jsonl line 1")
    assert str(refused.value) == ("t.jsonl line 1: field 'block_tokens' must be one of 16, 32, 64, 128, 256, 512, "
                                  "got 100")
    with pytest.raises(TraceError) as refused:
        parse_request({**SHARED_600[0].to_object(), "block_tokens": 512}, "t.jsonl line 1")
    assert str(refused.value) == ("t.jsonl line 1: field 'hash_ids' has 11 ids but input_length 700 needs 2 "
                                  "(one per 512 tokens)")
    path = tmp_path / "mixed.jsonl"
    write_trace(path, [SHARED_600[0], req(500, 700, [0, 1])])
    with pytest.raises(TraceError) as refused:
        read_trace(path)
    assert str(refused.value) == ("mixed.jsonl line 2: field 'block_tokens' is 512 where the first line's is 64; "
                                  "a trace keeps one size")
    write_trace(path, SHARED_600)
    assert read_trace(path) == SHARED_600


# ---- the service model from a trace's own timings (`served`, in the lines kvd saves) --------------
def served_line(t_ms, input_length, output, cached, prefill_ms, decode_ms, ids=(1, 2)):
    from kvctl.daemon.replay.trace import Served

    return TraceRequest(float(t_ms), input_length, output, tuple(ids), None, 512,
                        Served(0.5, prefill_ms, decode_ms, cached))


def test_the_rates_that_make_the_replay_s_totals_kvd_s_come_from_the_trace_s_timings():
    from kvctl.daemon.replay.service_rates import MeasuredRates, measured_rates

    trace = [served_line(0, 1000, 11, 0, 100.0, 200.0), served_line(10, 1000, 1, 900, 20.0, 0.0),
             req(20, 1000, [1, 3])]  # turned away: says nothing of the rates
    assert measured_rates(trace) == MeasuredRates(2, 1100 / 0.12, 10 / 0.2)
    one_token = [served_line(0, 1000, 1, 0, 50.0, 0.0)]
    assert measured_rates(one_token) == MeasuredRates(1, 1000 / 0.05, None)  # no second token to time
    with pytest.raises(TraceError) as refused:
        measured_rates([req(0, 1000, [1, 2])])
    assert str(refused.value).startswith("rates_from_trace: no line of the trace says how it was served")


def test_a_served_field_round_trips_and_bad_ones_are_named(tmp_path):
    from kvctl.daemon.replay.trace import parse_request

    line = served_line(0, 1000, 11, 64, 100.0, 200.0)
    assert line.to_object()["served"] == {"queued_ms": 0.5, "prefill_ms": 100.0, "decode_ms": 200.0,
                                          "cached_tokens": 64}
    assert parse_request(line.to_object(), "x") == line and "served" not in req(0, 10, [1]).to_object()
    for served, message in [({"queued_ms": 0, "prefill_ms": -1, "decode_ms": 0, "cached_tokens": 0},
                             "field 'served.prefill_ms' must be a number >= 0, got -1"),
                            ({"queued_ms": 0, "prefill_ms": 1, "decode_ms": 0, "cached_tokens": 1001},
                             "field 'served.cached_tokens' must be an integer from 0 to input_length 1000, got 1001"),
                            ([1, 2], "field 'served' must be an object, got [1, 2]")]:
        with pytest.raises(TraceError) as refused:
            parse_request({**line.to_object(), "served": served}, "t.jsonl line 3")
        assert str(refused.value) == f"t.jsonl line 3: {message}"


def test_kvctl_bench_replay_takes_its_rates_from_the_trace_when_asked(tmp_path, capsys):
    import json

    from .test_cli import cli

    path = tmp_path / "served.jsonl"
    write_trace(path, [served_line(0, 1000, 11, 0, 100.0, 200.0), served_line(10, 1000, 1, 900, 20.0, 0.0)])
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru",
                             "--rates-from-trace", "--json")
    settings = json.loads(printed)["settings"]
    assert status == 0 and (settings["prefill_rate"], settings["decode_rate"]) == (1100 / 0.12, 50.0)
    assert settings["rates_from_trace"] == {"requests": 2, "prefill_rate": 1100 / 0.12, "decode_rate": 50.0,
                                           "decode_batch_cost": None, "decode_context_cost": None,
                                           "prefill_overhead": None, "prefill_context_cost": None}  # two: no line
    [run] = json.loads(printed)["runs"]  # the first request computes its 1,000 tokens at the trace's rate
    assert run["ttft_p95_s"] == pytest.approx(1000 / (1100 / 0.12))
    status, _, err = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru",
                         "--rates-from-trace")
    assert status == 0 and " ".join(err.split()) == ("service model from the trace's own timings (2 requests): "
                                                     "prefill 9,167 tokens/s, decode 50 tokens/s a request")
    write_trace(path, [req(0, 1000, [1, 2])])
    status, _, err = cli(capsys, "bench", "replay", str(path), "--rates-from-trace")
    assert status == 2 and "rates_from_trace: no line of the trace says how it was served" in err
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--json")
    assert status == 0 and json.loads(printed)["settings"]["rates_from_trace"] is None


# ---- the live router's own decisions (`replica` on a fleet trace's lines) --------------------------
def test_recorded_routing_sends_each_request_where_its_line_says_the_live_router_did():
    from dataclasses import replace

    served_by = ["/run/kvd-b.sock", "/run/kvd-b.sock", "/run/kvd-a.sock", "/run/kvd-a.sock"] * 2
    trace = [replace(r, replica=name) for r, name in zip(GROUPS, served_by)]
    # prompt 1 always went to kvd-b (replica 0: named first), prompt 2 to kvd-a: both kept
    result = fleet(trace, 2, "recorded")
    assert result.requests_per_replica == [4, 4] and result.hit_tokens == 6 * 512
    assert result.hit_ratio_per_replica == [3 * 512 / 4096] * 2
    crossed = [replace(r, replica=name) for r, name in zip(GROUPS, ["a", "b"] * 4)]  # each prompt on both
    crossed_result = fleet(crossed, 2, "recorded")
    assert crossed_result.hit_tokens == 0 and crossed_result.hit_ratio_per_replica == [0.0, 0.0]  # as round robin
    with pytest.raises(ValueError) as refused:
        fleet(trace[:3] + GROUPS[3:], 2, "recorded")
    assert str(refused.value) == ("routing: recorded needs each request's replica, and request 4 names none (a "
                                  "fleet's trace that kvd router saved names them)")
    with pytest.raises(ValueError) as refused:
        fleet([replace(r, replica=f"r{i % 3}") for i, r in enumerate(GROUPS)], 2, "recorded")
    assert str(refused.value) == "replicas: the trace's requests were served by 3 replicas; --replicas 2 is fewer"


def test_a_line_names_its_replica_and_kvctl_bench_replay_routes_as_recorded(tmp_path, capsys):
    import json
    from dataclasses import replace

    from kvctl.daemon.replay.trace import parse_request

    from .test_cli import cli

    line = replace(GROUPS[0], replica="/run/kvd-0/kvd.sock")
    assert line.to_object()["replica"] == "/run/kvd-0/kvd.sock" and parse_request(line.to_object(), "x") == line
    with pytest.raises(TraceError) as refused:
        parse_request({**line.to_object(), "replica": 7}, "t.jsonl line 2")
    assert str(refused.value) == "t.jsonl line 2: field 'replica' must be a replica's name (a socket or URL), got 7"
    path = tmp_path / "fleet.jsonl"
    write_trace(path, [replace(r, replica=f"r{i % 2}") for i, r in enumerate(GROUPS)])
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "512", "--capacity-tokens",
                             "1024", "--policy", "lru", "--replicas", "2", "--routing", "recorded,prefix", "--json")
    runs = json.loads(printed)["runs"]
    assert status == 0 and [(r["routing"], r["hit_tokens"]) for r in runs] == [("recorded", 0), ("prefix", 6 * 512)]


def test_bench_replay_sets_the_live_fleet_beside_its_recorded_replay_per_replica(tmp_path, capsys):
    """A fleet's trace says how kvd served each request on which replica: bench replay prints the
    live fleet's cached-token ratio, in all and per replica, beside the replay routed as recorded,
    so a gap shows on the replica where the replay's cache model parts from kvd's (here kvd-b gave
    the sixth request nothing, where the replay, with room for the prompt, hits)."""
    import json
    from dataclasses import replace

    from kvctl.daemon.replay.trace import Served

    from .test_cli import cli

    served_by = ["kvd-b", "kvd-b", "kvd-a", "kvd-a"] * 2
    cached = [0, 512, 0, 512, 512, 0, 512, 512]
    trace = [replace(r, replica=name, served=Served(1.0, 5.0, 10.0, c)) for r, name, c in zip(GROUPS, served_by, cached)]
    path = tmp_path / "fleet.jsonl"
    write_trace(path, trace)
    args = ["bench", "replay", str(path), "--block-sizes", "512", "--capacity-tokens", "1024", "--policy", "lru",
            "--replicas", "2", "--routing", "recorded,round_robin"]
    status, printed, _ = cli(capsys, *args, "--json")
    assert status == 0 and json.loads(printed)["live"] == {
        "cached_token_ratio": 2560 / 8192, "replicas": {"kvd-b": 0.25, "kvd-a": 0.375},
        "recorded": [{"block_size": 512, "capacity_tokens": 1024, "policy": "lru", "hit_ratio": 0.375,
                      "replicas": {"kvd-b": 0.375, "kvd-a": 0.375}}]}
    status, printed, _ = cli(capsys, *args)
    text = " ".join(printed.split())
    assert status == 0 and ("live fleet (kvd's own account in the trace): cached 31.2% (kvd-b 25.0%, kvd-a 37.5%) "
                            "replayed as recorded (block 512, 1,024 tokens, lru): hit 37.5% (kvd-b 37.5%, kvd-a "
                            "37.5%)") in text
    write_trace(path, trace[:4] + [replace(r, replica=None) for r in trace[4:]])  # lines named in part: no recorded
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "512", "--replicas", "2",
                             "--routing", "round_robin", "--json")
    assert status == 0 and json.loads(printed)["live"]["replicas"] == {"kvd-b": 0.25, "kvd-a": 0.25}
    write_trace(path, GROUPS)  # not a fleet's trace: nothing to set beside
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "512", "--replicas", "2",
                             "--routing", "round_robin", "--json")
    assert status == 0 and json.loads(printed)["live"] is None


# ---- output growth and preemption under a short output reservation ----------------------------------
# Two requests of 2 blocks' prompt and 40 output tokens (block 16) in a cache of 6 blocks, nothing
# reserved: each takes a block for its 1st and its 17th output token. At 1.8 s the first needs its
# 4th block and none is free: the later arrival, 16 tokens made, gives back its blocks (its prompt's
# stay cached) and waits at the head of the queue.
PREEMPT_TRACE = [TraceRequest(0.0, 32, 40, (1,), "noisy"), TraceRequest(50.0, 32, 40, (2,), "quiet")]
PREEMPT_SETTINGS = dict(capacity_tokens=96, reservation="fixed:0", prefill_rate=320.0, decode_rate=10.0)


def replica_run(trace, **kwargs):
    from kvctl.daemon.replay.simulator import ReplicaRun

    keyer = TraceKeyer(16)
    keys = [keyer.keys(r) for r in trace]
    replica = ReplicaRun(ReplaySettings(block_size=16, **kwargs), trace, keys, max_hit_blocks(trace, keys, 16))
    replica.run_concurrent(lambda _n: None)
    replica.manager.audit()
    assert replica.manager.num_sequences == 0
    return replica


def test_a_request_short_of_its_reservation_grows_as_it_decodes_and_preempts_the_latest_arrival():
    replica = replica_run(PREEMPT_TRACE, **PREEMPT_SETTINGS)
    # The second restarts when the first finishes (4.1 s): its prompt's first block is still cached
    # (the first's last block evicted the other at 3.4 s), so it computes 48 - 16 = 32 tokens again
    # (0.1 s) and decodes its last 24 tokens by 6.6 s. Its first token came before the preemption.
    assert (replica.preemptions, replica.recomputed_after_preemption) == (1, 32)
    assert replica.ttft == [0.1, 0.1]
    assert replica.e2e == [4.1, 6.6 - 0.05]
    result = replica.result(1.0)
    # the first's two whole output blocks stay cached after it finishes, as kvd's do: the second's restart and
    # growth evict three of its blocks, after the one at 3.4 s (its restart's hit is not a hit)
    assert (result.admitted, result.evictions, result.hit_tokens) == (2, 4, 0)
    assert result.reservation == "fixed:0"
    assert (result.e2e_p50_s, result.e2e_p95_s) == (4.1, 6.55)
    # reserving whole outputs (5 blocks each) in a cache of 10 blocks, neither waits nor preempts
    whole = run(PREEMPT_TRACE, 16, 160, reservation="fraction:1.0", prefill_rate=320.0, decode_rate=10.0)
    assert (whole.preemptions, whole.recomputed_after_preemption) == (0, 0)
    assert whole.e2e_p95_s == pytest.approx(4.1)


def test_a_request_preempted_in_its_prefill_counts_its_first_token_when_it_comes():
    # The second (64 tokens, 2 s of prefill from 1.5 s) is preempted at 2.7 s, 38 tokens computed: its
    # first two blocks stay cached, the third (not whole) does not. It restarts when the first
    # finishes (5.0 s), computes its last 32 tokens again (1 s): first token 6.0 - 1.5 = 4.5 s after it
    # arrived. Its one output token takes a block at its finish (6.1 s), before it finishes.
    trace = [TraceRequest(0.0, 32, 40, (1,)), TraceRequest(1500.0, 64, 1, (2,))]
    replica = replica_run(trace, capacity_tokens=112, reservation="fixed:0", prefill_rate=32.0, decode_rate=10.0)
    assert (replica.preemptions, replica.recomputed_after_preemption) == (1, 32)
    assert replica.ttft == [1.0, 4.5]
    assert replica.e2e == [5.0, 4.6]


def test_under_a_priority_queue_preemption_takes_the_worse_placed_tenant_first(tmp_path, capsys):
    fifo = replica_run(PREEMPT_TRACE, **PREEMPT_SETTINGS)
    assert sorted(fifo.e2e) == [4.1, 6.55]  # quiet, the later arrival, was preempted
    assert fifo.result(1.0).tenant_preemptions == {"noisy": 0, "quiet": 1}
    prio = replica_run(PREEMPT_TRACE, **PREEMPT_SETTINGS, queue_order="priority",
                       tenant_priorities=(("quiet", -10),))
    # noisy, growing at 1.8 s, preempts itself; restarted at once on its cached prompt, it is preempted
    # again by quiet's growth at 1.85 s, and finishes last; quiet runs as if alone
    assert (prio.preemptions, prio.recomputed_after_preemption) == (2, 16 + 32)
    assert prio.e2e == [pytest.approx(4.1), pytest.approx(6.65)]
    assert prio.e2e[0] == pytest.approx(0.15 + 40 / 10.0 - 0.05)  # quiet: arrival 0.05, finish 4.15
    assert prio.result(1.0).tenant_preemptions == {"noisy": 2, "quiet": 0}
    one = fleet(PREEMPT_TRACE, 1, "least_loaded", block_size=16, **PREEMPT_SETTINGS, queue_order="priority",
                tenant_priorities=(("quiet", -10),))
    assert one.tenant_preemptions == {"noisy": 2, "quiet": 0}  # and a fleet sums its replicas'
    from kvctl.replay_report import fleet_tenant_lines

    [line] = fleet_tenant_lines([one], lambda r: r.routing)
    assert line.plain == ("first token p50/p95 by tenant, least_loaded (block 16, capacity 96, lru+prio): noisy "
                          "0.10/0.10 s (2 preempted), quiet 0.10/0.10 s")
    from .test_cli import cli

    write_trace(tmp_path / "preempt.jsonl", PREEMPT_TRACE)
    status, printed, _ = cli(capsys, "bench", "replay", str(tmp_path / "preempt.jsonl"), "--block-sizes", "16",
                             "--capacity-tokens", "96", "--policy", "lru", "--reserve", "fixed:0", "--prefill-rate",
                             "320", "--decode-rate", "10", "--queue-order", "priority", "--tenant-priorities",
                             "quiet=-10")
    assert status == 0
    text = " ".join(printed.split())
    assert "16 96 lru+prio 0.10/0.10 (pre 2) 0.10/0.10" in text  # the table by tenant


def test_a_prompt_and_max_tokens_that_could_never_fit_are_turned_away_whatever_the_reservation():
    trace = [TraceRequest(0.0, 32, 80, (1,)), TraceRequest(10.0, 32, 8, (2,))]  # 7 blocks, and 3
    for reservation in ("fixed:0", "fraction:1.0"):
        result = run(trace, 16, 96, reservation=reservation)
        assert (result.admitted, result.reject_reasons) == (1, {"never_fits": 1})
    asked = run(trace[1:], 16, 96, reservation="fixed:0", max_tokens=80)  # max_tokens, not the output, counts
    assert asked.reject_reasons == {"never_fits": 1}


def test_a_fleet_counts_its_replicas_preemptions():
    one = fleet(PREEMPT_TRACE, 1, "least_loaded", block_size=16, **PREEMPT_SETTINGS)
    assert (one.preemptions, one.recomputed_after_preemption, one.reservation) == (1, 32, "fixed:0")
    assert (one.e2e_p50_s, one.e2e_p95_s) == (4.1, 6.55)
    two = fleet(PREEMPT_TRACE, 2, "least_loaded", block_size=16, **PREEMPT_SETTINGS)
    assert (two.preemptions, two.e2e_p95_s) == (0, pytest.approx(4.1))  # one each: room to grow


def test_a_sweep_compares_output_reservations_and_kvctl_prints_what_each_trades(tmp_path, capsys):
    import json

    from .test_cli import cli

    path = tmp_path / "preempt.jsonl"
    write_trace(path, PREEMPT_TRACE)
    args = ["bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "96", "--policy", "lru",
            "--prefill-rate", "320", "--decode-rate", "10", "--reserve", "fraction:1.0,fixed:0"]
    status, printed, _ = cli(capsys, *args, "--json")
    document = json.loads(printed)
    assert status == 0 and document["settings"]["reservation"] == "fraction:1.0,fixed:0"
    runs = [(r["reservation"], r["preemptions"], r["recomputed_after_preemption"], r["e2e_p95_s"])
            for r in document["runs"]]
    # all reserved, the second waits for the first's 5 blocks (6 in all): it starts at 4.1 s
    assert runs == [("fraction:1.0", 0, 0, pytest.approx(4.1 + 4.1 - 0.05)), ("fixed:0", 1, 32, 6.55)]
    status, printed, _ = cli(capsys, *args)
    text = " ".join(printed.split())
    assert status == 0 and "16 96 lru fixed:0 " in text
    assert ("block 16, capacity 96, lru fixed:0: 1 preempted (32 tokens computed again); reserved unused 0.0%; "
            "first token p50/p95 0.10/0.10 s, end to end 4.10/6.55 s") in text
    status, _, err = cli(capsys, "bench", "replay", str(path), "--reserve", "p95,fraction:2")
    assert status == 2 and "error: output reservation: invalid value 'fraction:2'" in err



# r0 holds the one slot for 4 s; r1 defers itself (its own priority 5, a trace line's), r2 does not
DEFER_TRACE = [TraceRequest(0.0, 512, 4, (1,)), TraceRequest(1000.0, 512, 1, (2,), priority=5),
               TraceRequest(2000.0, 512, 1, (3,))]


@pytest.mark.parametrize("order, ttft", [("fifo", (3.0, 3.0)), ("priority", (2.0, 4.0))])
def test_a_priority_queue_replays_a_request_s_own_priority_behind_its_tenant_s_place(order, ttft):
    """Under priority r2 starts at 4 s before r1 (first tokens 2 s and 4 s after they came), with no
    tenant priorities given: the trace's own say enough; first come, first served ignores them."""
    from kvctl.daemon.replay.sweep import sweep

    [result] = sweep(DEFER_TRACE, [512], [8192], ["lru"], ReplaySettings(block_size=512, capacity_tokens=8192,
                                                                         **ONE_SLOT), queue_orders=[order])
    assert (result.ttft_p50_s, result.ttft_p95_s) == (pytest.approx(ttft[0]), pytest.approx(ttft[1]))


def test_a_trace_line_s_own_priority_round_trips_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "deferred.jsonl"
    write_trace(path, DEFER_TRACE)
    lines = path.read_text().splitlines()
    assert '"priority"' not in lines[0] and lines[1].endswith('"priority": 5}')
    assert read_trace(path) == DEFER_TRACE
    for bad in (-1, True, 1.5, "5"):
        path.write_text(lines[0][:-1] + f', "priority": {json.dumps(bad)}}}\n')
        with pytest.raises(TraceError, match=rf"line 1: field 'priority' must be an integer >= 0 \(how far the "
                                             rf"request deferred itself behind its tenant's place\), got "
                                             rf"{re.escape(repr(bad))}$"):
            read_trace(path)


def test_a_trace_line_s_own_max_tokens_round_trips_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "asked.jsonl"
    asked = [TraceRequest(0.0, 512, 4, (1,), max_tokens=64), TraceRequest(1.0, 512, 4, (2,))]
    write_trace(path, asked)
    lines = path.read_text().splitlines()
    assert lines[0].endswith('"max_tokens": 64}') and '"max_tokens"' not in lines[1]
    assert read_trace(path) == asked
    for bad in (0, 3, -1, True, 8.5):  # below its output of 4, or not a whole number
        path.write_text(lines[1][:-1] + f', "max_tokens": {json.dumps(bad)}}}\n')
        with pytest.raises(TraceError, match=rf"line 1: field 'max_tokens' must be an integer >= 1 and >= "
                                             rf"output_length 4, got {re.escape(repr(bad))}$"):
            read_trace(path)

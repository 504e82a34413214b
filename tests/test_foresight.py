"""`belady`: the eviction policy that knows the trace's future (policies/foresight.py), what it
reads of a replay (daemon/replay/foresight.py), and how `kvctl bench replay` shows it: a mark
beside the policies kvd runs, never one kvd takes or a replay's pick."""

from __future__ import annotations

import math

import pytest

from kvctl.daemon.replay.foresight import TraceFuture
from kvctl.daemon.replay.simulator import ReplaySettings
from kvctl.daemon.replay.sweep import validate_grid
from kvctl.daemon.replay.trace import TraceKeyer
from kvctl.policies.foresight import FarthestNextUseEviction

from .test_replay import req, run


def policy_over(next_use: dict[int, float], horizon: list[int]) -> FarthestNextUseEviction:
    return FarthestNextUseEviction(lambda block_id: next_use[block_id], lambda: horizon[0])


def test_the_block_needed_farthest_ahead_goes_first_and_ties_in_the_order_they_became_evictable():
    next_use, horizon = {0: 5, 1: math.inf, 2: 9, 3: 9, 4: 2, 5: math.inf}, [0]
    policy = policy_over(next_use, horizon)
    policy.push([3, 2, 1], 0.0)  # a released sequence, deepest block first
    policy.push([5, 0, 4], 0.0)
    assert policy.order() == [1, 5, 3, 2, 0, 4]  # never again first, in push order; then 9 (3 before 2), 5, 2
    assert policy.pop_many(3, 0.0) == [1, 5, 3]
    policy.remove(2)  # a hit took it back
    assert (2 in policy, 0 in policy, len(policy)) == (False, True, 2)
    with pytest.raises(LookupError, match="asked for 3 victims, 2 evictable"):
        policy.pop_many(3, 0.0)
    policy.forget(0)
    assert policy.order() == [4] and policy.reprioritise(lambda b: 1) == 0


def test_a_next_use_the_horizon_passed_is_asked_again_before_a_victim_is_chosen():
    next_use, horizon = {0: 5, 1: 2}, [0]
    policy = policy_over(next_use, horizon)
    policy.push([0, 1], 0.0)
    assert policy.order() == [0, 1]
    # request 2 came and did not take block 1 (its chain broke before it): asked again, it is next
    # needed at request 20, after block 0's 5
    next_use[1], horizon[0] = 20, 2
    assert policy.pop(0.0) == 1 and policy.pop(0.0) == 0


def test_many_pushes_and_hits_leave_the_order_whole():
    next_use = {b: float(b % 97) for b in range(5000)}
    policy = policy_over(next_use, [-1])
    for start in range(0, 5000, 100):
        policy.push(range(start, start + 100), 0.0)
        for b in range(start, start + 90):  # most of them hit again before anything is evicted
            policy.remove(b)
    kept = [b for start in range(0, 5000, 100) for b in range(start + 90, start + 100)]
    assert sorted(policy.order()) == kept and len(policy) == 500
    assert policy.pop_many(500, 0.0) == sorted(kept, key=lambda b: (-next_use[b], kept.index(b)))


def test_a_keys_next_use_is_the_first_request_after_the_horizon_that_could_hit_it():
    trace = [req(0, 1024, [1, 2]), req(1, 1024, [1, 3]), req(2, 600, [1])]
    keyer = TraceKeyer(256)
    keys = [keyer.keys(r) for r in trace]
    future = TraceFuture(trace, keys, 256)
    first, last = keys[0][0], keys[0][3]  # id 1's first block; r0's last block holds its last token
    assert [future.next_use(first) for future.horizon in (-1, 0, 1, 2)] == [0, 1, 2, math.inf]
    future.horizon = -1
    assert future.next_use(keys[0][2]) == 0 and future.next_use(last) == math.inf  # (no hit serves a last token)
    assert future.next_use(keys[1][2]) == 1 and future.next_use(None) == math.inf


def test_a_preempted_requests_keys_are_asked_for_next_until_it_starts_again():
    trace = [req(0, 1024, [1, 2]), req(1, 1024, [3, 4]), req(2, 1024, [1, 5])]
    keyer = TraceKeyer(256)
    keys = [keyer.keys(r) for r in trace]
    future = TraceFuture(trace, keys, 256)
    future.horizon = 1  # r1 started; r0 was preempted and waits at the head of the queue
    mine, shared = keys[1][0], keys[0][0]
    assert (future.next_use(mine), future.next_use(shared)) == (math.inf, 2)
    future.asked_again(keys[1])
    future.asked_again(keys[0])  # (r0's keys, which r2 asks for too)
    assert (future.next_use(mine), future.next_use(shared)) == (1.5, 1.5)  # next, before r2
    future.restarted(keys[1])
    assert (future.next_use(mine), future.next_use(shared)) == (math.inf, 1.5)
    future.restarted(keys[0])
    assert future.next_use(shared) == 2 and not future.again


# three prefixes in turn, a cache that holds two: least recently used evicts each one just before
# it comes back; knowing the future keeps what comes back next
CYCLE = [req(i * 1000, 1024, [[1, 2], [3, 4], [5, 6]][i % 3]) for i in range(6)]


@pytest.mark.parametrize("sequential", [True, False])
def test_on_a_cycle_that_defeats_lru_belady_keeps_what_comes_back_next(sequential):
    lru = run(CYCLE, 256, 8 * 256, "lru", sequential=sequential)
    assert (lru.hit_tokens, lru.evictions) == (0, 16)
    bound = run(CYCLE, 256, 8 * 256, "belady", sequential=sequential)
    # r2 evicts r0's and r1's last blocks (needed never) and r1's 2 deepest hit blocks (needed at r4,
    # after r0's at r3); r3 hits r0's 3 blocks, r4 r1's first, r5 r2's 3: 7 blocks of 256
    assert (bound.hit_tokens, bound.evictions, bound.policy) == (7 * 256, 4 + 1 + 3 + 1, "belady")


def test_belady_is_a_replays_mark_and_not_a_setting_of_kvd():
    from kvctl.daemon.config import ConfigError, resolve

    base = ReplaySettings(block_size=16, capacity_tokens=4096)
    validate_grid([16], [4096], ["lru", "belady"], base)
    with pytest.raises(ValueError, match="^policy: belady reads one cache's future in the trace's order; a fleet's "
                                         r"router decides which replica meets each request \(replay it without "
                                         r"--replicas\)$"):
        validate_grid([16], [4096], ["belady"], base, replicas=2, routings=["prefix"])
    with pytest.raises(ValueError, match="^policy: belady reads the trace's future in arrival order, the order a "
                                         "FIFO queue starts requests in; replay it with --queue-order fifo$"):
        validate_grid([16], [4096], ["belady"], base, queue_orders=["fifo", "lpm"])
    with pytest.raises(ValueError, match="^policy: unknown value 'opt'; choose from lru, cost, lfu, priority, "
                                         "belady$"):
        validate_grid([16], [4096], ["opt"], base)
    with pytest.raises(ConfigError, match="eviction: invalid value 'belady'"):
        resolve({"eviction": "belady"}, env={})


def test_kvctl_bench_replay_shows_belady_beside_the_best_kvd_runs_and_never_picks_it():
    from kvctl.replay_report import foresight_lines
    from kvctl.replay_slo import parse_slo, pick, slo_line

    results = [run(CYCLE, 256, 8 * 256, policy, sequential=True) for policy in ("lru", "cost", "belady")]
    assert [line.plain for line in foresight_lines(results)] == [
        "belady evicts knowing the trace's future, as no cache can: at block 256, capacity 2,048, hit 29.2%, "
        "the best kvd can run 0.0% (lru)"]
    objectives = parse_slo(["hit_ratio >= 0"])
    met, best = pick(results, objectives)
    assert (met, best) == ([0, 1], 0)  # belady's run meets it and is no candidate
    assert slo_line(results, objectives, (met, best), lambda r: r.policy).plain.startswith(
        "SLO hit_ratio >= 0: 2 of 2 runs meet it; the pick (the highest hit, then the lowest first-token p95): lru")

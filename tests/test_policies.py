"""Policies on plain data: eviction strategies, output reservation, admission arithmetic."""

from __future__ import annotations

import pytest

from kvctl.policies.admission import Verdict, blocks_needed, decide
from kvctl.policies.eviction import CostAwareEviction, LRUEviction, make_eviction_policy
from kvctl.policies.reservation import PercentileReservation, parse_reservation


def test_lru_queue_order_and_middle_removal():
    lru = LRUEviction()
    lru.push([3, 1, 4], now=0)
    lru.push([5, 9], now=1)
    lru.remove(4)
    assert lru.order() == [3, 1, 5, 9]
    assert lru.pop_many(2, now=2) == [3, 1]
    assert lru.pop(now=2) == 5 and len(lru) == 1
    with pytest.raises(LookupError):
        lru.pop_many(2, now=3)


def test_cost_prefers_to_keep_frequently_hit_blocks_and_decays_old_hits():
    cost = CostAwareEviction(half_life=10.0)
    cost.on_insert([1, 2], [0, 0], now=0.0)
    cost.record_hits([1], now=0.0)  # block 1: two uses at t=0
    cost.on_insert([3], [0], now=15.0)  # block 3: one use at t=15
    cost.push([1, 2, 3], now=15.0)
    # At t=15 block 1 is worth 2 * 2**-1.5 = 0.71 uses, block 2 0.35, block 3 1.0.
    assert cost.order() == [2, 1, 3]
    assert cost.score(1, 15.0) == pytest.approx(2 * 2 ** -1.5)
    # Thirty time units later the order is the same: decay never reorders.
    assert cost.pop_many(3, now=45.0) == [2, 1, 3]


def test_cost_ties_leave_in_release_order_and_within_a_release_in_given_order():
    cost = CostAwareEviction()
    cost.on_insert([10, 11, 12, 20, 21], [0, 1, 2, 0, 1], now=5.0)
    cost.push([12, 11, 10], now=6.0)  # one release, tail first
    cost.push([21, 20], now=7.0)
    cost.remove(11)
    assert cost.order() == [12, 10, 21, 20]
    assert cost.pop_many(3, now=8.0) == [12, 10, 21]


def test_cost_policy_compacts_stale_entries_without_changing_order():
    cost = CostAwareEviction()
    ids = list(range(3000))
    cost.on_insert(ids, [0] * len(ids), now=0.0)
    cost.push(ids, now=0.0)
    for block_id in ids[:2500]:
        cost.remove(block_id)
    assert cost._stored < 3000  # compacted
    assert cost.order() == ids[2500:]
    assert cost.pop_many(2, now=1.0) == [2500, 2501]


def test_unknown_policy_names_the_value():
    with pytest.raises(ValueError, match="eviction policy: unknown value 'mru'; choose one of lru, cost, lfu, "
                                         "priority"):
        make_eviction_policy("mru")


def test_lfu_evicts_the_fewest_uses_first_then_the_earliest_released_deepest_first():
    lfu = make_eviction_policy("lfu")
    assert lfu.name == "lfu"
    # chain A: 0 -> 1 -> 2; chain B: 3 -> 4. A's root hit twice, its middle once; B's root once.
    lfu.on_insert([0, 1, 2, 3, 4], [0, 1, 2, 0, 1], now=0.0)
    lfu.record_hits([0, 1], now=1.0)
    lfu.record_hits([0], now=2.0)
    lfu.record_hits([3], now=3.0)
    lfu.push([2, 1, 0], now=4.0)  # tail first, as the pool releases a sequence
    lfu.push([4, 3], now=5.0)
    assert lfu.order() == [2, 4, 1, 3, 0]  # 1 use: 2 then 4 (released later); 2 uses: 1, then 3; 0 has 3
    assert [lfu.score(b, now=1e9) for b in (2, 1, 0)] == [1.0, 2.0, 3.0]  # never decayed
    lfu.remove(1)  # a hit took it back
    lfu.record_hits([1], now=6.0)
    lfu.push([1], now=6.0)
    assert lfu.pop_many(3, now=7.0) == [2, 4, 3]
    assert lfu.order() == [0, 1] and len(lfu) == 2  # three uses each now: 0 was released first


def test_lfu_keeps_yesterday_s_hot_block_where_cost_lets_it_fade():
    """The one difference from `cost`: uses never decay."""
    orders = {}
    for name in ("lfu", "cost"):
        policy = make_eviction_policy(name, half_life=600.0)
        policy.on_insert([0], [0], now=0.0)
        policy.record_hits([0], now=0.0)
        policy.record_hits([0], now=0.0)  # three uses, long ago
        policy.on_insert([1], [0], now=10_000.0)
        policy.record_hits([1], now=10_000.0)  # two uses, just now
        policy.push([0, 1], now=10_000.0)
        orders[name] = policy.order()
    assert orders == {"lfu": [1, 0], "cost": [0, 1]}


def test_priority_evicts_the_least_important_requests_blocks_first_then_the_earliest_released():
    """A block keeps the highest priority (the engine's, higher first) of the requests that wrote
    or reused it; lower goes first; ties in release order, tail first within a release."""
    policy = make_eviction_policy("priority")
    assert policy.name == "priority"
    # chain A 0 -> 1 -> 2 written at priority 5; chain B 3 -> 4 and block 5 at 0
    policy.on_insert([0, 1, 2], [0, 1, 2], now=0.0, priority=5)
    policy.on_insert([3, 4], [0, 1], now=1.0, priority=0)
    policy.on_insert([5], [0], now=2.0, priority=0)
    policy.record_hits([3], now=3.0, priority=5)  # a priority-5 request reused B's root
    policy.record_hits([1, 0], now=3.0, priority=-3)  # a less important one takes nothing from A
    policy.push([2, 1, 0], now=4.0)
    policy.push([4, 3], now=5.0)
    policy.push([5], now=6.0)
    assert policy.order() == [4, 5, 2, 1, 0, 3]
    assert [policy.score(b, now=7.0) for b in (4, 1, 3)] == [0, 5, 5]
    for block in (4, 3):  # a priority-9 request takes chain B back (as the pool does a hit) and releases it
        policy.remove(block)
    policy.record_hits([3, 4], now=8.0, priority=9)
    policy.push([4, 3], now=9.0)
    assert policy.pop_many(4, now=10.0) == [5, 2, 1, 0]
    assert policy.order() == [4, 3] and len(policy) == 2 and policy.score(3, now=10.0) == 9


def test_reprioritised_blocks_rank_at_their_new_priority_and_keep_their_release_order():
    """An operator moves a tenant (tenant_priorities on a reload): the policy moves that tenant's
    blocks, idle or in use, by the change; among equal priorities, release order stays."""
    tenant = {0: "acme", 1: "acme", 2: "acme", 3: "globex", 4: "globex", 5: "acme", 6: "globex"}
    policy = make_eviction_policy("priority")
    policy.on_insert([0, 1, 2], [0, 1, 2], now=0.0, priority=10)  # acme's chain, acme first in the queue
    policy.on_insert([3, 4], [0, 1], now=1.0, priority=0)  # globex's
    policy.on_insert([5], [0], now=2.0, priority=10)  # acme's, still in use
    policy.on_insert([6], [0], now=2.0, priority=0)
    policy.push([2, 1, 0], now=3.0)
    policy.push([4, 3], now=4.0)
    policy.push([6], now=5.0)
    assert policy.order() == [4, 3, 6, 2, 1, 0]
    moved = policy.reprioritise(lambda b: -20 if tenant[b] == "acme" else 0)
    assert moved == 4  # 0, 1, 2 and the block in use
    assert policy.order() == [2, 1, 0, 4, 3, 6]  # acme's now go first, tail first; globex's keep their order
    assert [policy.score(b, now=6.0) for b in (0, 5, 3)] == [-10, -10, 0]
    policy.push([5], now=6.0)  # released: at its new priority, after acme's earlier release
    assert policy.pop_many(5, now=7.0) == [2, 1, 0, 5, 4]
    assert policy.reprioritise(lambda b: 0) == 0 and policy.order() == [3, 6]
    for name in ("lru", "cost", "lfu"):  # no priorities to move: their order stays
        other = make_eviction_policy(name)
        other.on_insert([0, 1], [0, 1], now=0.0, priority=10)
        other.push([1, 0], now=1.0)
        assert other.reprioritise(lambda b: -20) == 0 and other.order() == [1, 0]


def test_tenant_shares_pass_a_reprioritisation_to_the_policy_they_wrap():
    from kvctl.policies.tenant_shares import TenantShares

    tenant = {0: "acme", 1: "acme", 2: "globex"}
    shares = TenantShares(make_eviction_policy("priority"), tenant.get, {"acme": 4, "globex": 4})
    shares.on_insert([0, 1], [0, 1], now=0.0, priority=5)
    shares.on_insert([2], [0], now=0.0, priority=0)
    shares.push([1, 0], now=1.0)
    shares.push([2], now=2.0)
    assert shares.order() == [2, 1, 0]
    assert shares.reprioritise(lambda b: -10 if tenant[b] == "acme" else 0) == 2
    assert shares.order() == [1, 0, 2] and shares.problems() == []


def test_priority_with_every_request_at_0_is_lru():
    """With a FIFO queue every request is at priority 0: the same victims as lru, in the same order."""
    import random

    rng = random.Random(7)
    lru, priority = make_eviction_policy("lru"), make_eviction_policy("priority")
    evictable: set[int] = set()
    indexed: set[int] = set()
    for step in range(2000):
        now = float(step)
        action = rng.random()
        if action < 0.4:  # index and release a new run
            run = [b for b in rng.sample(range(200), 4) if b not in indexed]
            for policy in (lru, priority):
                policy.on_insert(run, list(range(len(run))), now)
                policy.push(run[::-1], now)
            indexed.update(run)
            evictable.update(run)
        elif action < 0.7 and evictable:  # a hit takes one back, then it is released again
            block = rng.choice(sorted(evictable))
            for policy in (lru, priority):
                policy.remove(block)
                policy.record_hits([block], now)
                policy.push([block], now)
        elif evictable:
            count = rng.randint(1, min(3, len(evictable)))
            victims = lru.pop_many(count, now)
            assert priority.pop_many(count, now) == victims
            evictable.difference_update(victims)
            indexed.difference_update(victims)
        assert priority.order() == lru.order()


@pytest.mark.parametrize("spec, max_tokens, expected", [
    ("fixed:16", 100, 16), ("fixed:16", 8, 8), ("fraction:0.5", 101, 51), ("fraction:1", 7, 7),
])
def test_reservation_specs(spec, max_tokens, expected):
    assert parse_reservation(spec).reserve(max_tokens) == expected


def test_p95_reservation_uses_max_tokens_until_it_has_seen_enough():
    policy = PercentileReservation(0.95, min_samples=20)
    assert policy.reserve(500) == 500
    for length in range(1, 101):  # 1..100
        policy.observe(length)
    assert policy.reserve(500) == 95
    assert policy.reserve(60) == 60
    assert parse_reservation("p95").reserve(33) == 33


def test_p95_window_forgets_old_outputs():
    policy = PercentileReservation(0.95, window=20, min_samples=20)
    for _ in range(20):
        policy.observe(1000)
    for _ in range(20):
        policy.observe(10)
    assert policy.reserve(5000) == 10


@pytest.mark.parametrize("spec", ["fixed:-1", "fraction:0", "fraction:1.5", "p0", "p101", "lots", "fixed:"])
def test_bad_reservation_specs_name_the_value(spec):
    with pytest.raises(ValueError) as info:
        parse_reservation(spec)
    assert str(info.value).startswith(f"output reservation: invalid value {spec!r}")


def test_blocks_needed_counts_prompt_minus_hits_plus_reservation():
    assert blocks_needed(prompt_tokens=33, hit_blocks=2, reserve_tokens=16, block_size=16) == 2
    assert blocks_needed(prompt_tokens=32, hit_blocks=1, reserve_tokens=0, block_size=16) == 1


def test_decide_verdicts_and_reasons():
    admit = decide(request="r", needed_blocks=3, available_blocks=3, total_blocks=10, hit_blocks=2)
    assert admit.verdict is Verdict.ADMIT and admit.reason == ""
    wait = decide(request="r", needed_blocks=4, available_blocks=3, total_blocks=10, hit_blocks=0)
    assert wait.verdict is Verdict.QUEUE
    assert wait.reason == "request r: needs 4 new blocks, 3 available"
    full = decide(request="r", needed_blocks=4, available_blocks=3, total_blocks=10, hit_blocks=0,
                  queue_length=8, queue_limit=8)
    assert full.verdict is Verdict.REJECT
    assert full.reason == "request r: admission queue full (8 of 8 waiting)"


# ---- routing ------------------------------------------------------------------------------------
def test_routers_choose_by_turn_load_prefix_and_predicted_first_token():
    from kvctl.policies.routing import ReplicaFacts as F
    from kvctl.policies.routing import make_router

    fleet = [F(cached_tokens=0, wait_seconds=0.5), F(cached_tokens=4096, wait_seconds=1.0),
             F(cached_tokens=1024, wait_seconds=0.0)]
    turns = make_router("round_robin")
    assert [turns.choose(8192, fleet).replica for _ in range(4)] == [0, 1, 2, 0]
    assert make_router("least_loaded").choose(8192, fleet) == make_router("least_loaded").choose(8192, fleet)
    assert make_router("least_loaded").choose(8192, fleet).replica == 2
    prefix = make_router("prefix", balance_seconds=2.0)
    route = prefix.choose(8192, fleet)
    assert (route.replica, route.reason) == (1, "caches 4096 of its 8192 tokens")
    # affinity bounded by load: the caching replica waits 1.0 s more than the idle one
    route = make_router("prefix", balance_seconds=0.5).choose(8192, fleet)
    assert route.replica == 2 and route.reason.startswith("the replica caching most waits 1.00 s")
    cold = [F(0, 0.3), F(0, 0.1)]
    assert make_router("prefix").choose(100, cold).replica == 1  # nothing cached anywhere: shortest wait
    # ttft at 4,096 tokens/s: 0.5 + 2.0 = 2.5 s; 1.0 + 1.0 = 2.0 s; 0.0 + 1.75 = 1.75 s
    ttft = make_router("ttft", prefill_rate=4096.0)
    route = ttft.choose(8192, fleet)
    assert (route.replica, route.reason) == (2, "first token in 1.75 s (1024 tokens cached)")
    # at 1,024 tokens/s the cached prefix is worth more than the wait: 1.0 + 4.0 s < 0.0 + 7.0 s
    assert make_router("ttft", prefill_rate=1024.0).choose(8192, fleet).replica == 1


def test_a_new_prefix_goes_home_from_any_router_within_a_load_bound():
    """Routers whose own books differ (what each sent where) send a prompt no replica holds to
    the same replica, its home; a home loaded beyond the bound is passed for the next in the
    prompt's order; without names or an affinity it is the least loaded, as before."""
    from kvctl.policies.routing import ReplicaFacts as F
    from dataclasses import replace

    from kvctl.policies.routing import PrefixAffinity, Route, cold_home, home_order, make_router, prompt_affinity

    names = ["/run/kvd-0/kvd.sock", "/run/kvd-1/kvd.sock", "/run/kvd-2/kvd.sock"]
    system = "You are the support assistant of a serving fleet. " * 6
    affinity = prompt_affinity(system + "How do I pin a prefix?")
    assert affinity == prompt_affinity(system + "Why did my prefix miss?")  # the opening names it
    assert prompt_affinity("short prompt, one") != prompt_affinity("short prompt, two")
    assert prompt_affinity([1, 2, 3]) != prompt_affinity("1,2,3") and len(affinity) == 32
    order = home_order(affinity, names)
    assert sorted(order) == [0, 1, 2]
    idle = [F(0, 0.0, name=n) for n in names]
    one, two = make_router("prefix"), make_router("prefix")
    two.choose(100, idle)  # the second router has sent elsewhere before: its books differ
    two.choose(100, idle, prompt_affinity("another prompt entirely"))
    assert one.choose(512, idle, affinity).replica == two.choose(512, idle, affinity).replica == order[0]
    assert one.choose(512, idle, affinity).reason == ("no replica caches its prefix: its home (the first by its "
                                                      "hash within the load bound)")
    # bounded: a home that waits more than the band over the least loaded, or has many more
    # requests in flight than the mean, is passed for the next in the order
    slow = [F(0, 0.5 if i == order[0] else 0.0, name=n) for i, n in enumerate(names)]
    assert cold_home(slow, affinity, 0.25) == order[1] and cold_home(slow, affinity, 1.0) == order[0]
    crowded = [F(0, 0.0, in_flight=6 if i == order[0] else 0, name=n) for i, n in enumerate(names)]
    assert cold_home(crowded, affinity, 0.25) == order[1]  # 6 > ceil(1.25 x 2) + 1
    assert cold_home(idle, None, 0.25) is None and cold_home([F(0, 0.0)] * 3, affinity, 0.25) is None
    assert make_router("prefix").choose(512, [F(0, 0.3), F(0, 0.1)], affinity).replica == 1  # unnamed: least loaded
    # a replica that caches NEW_PREFIX_SLACK_TOKENS (128) more of the prompt than its home wins over it
    warm = [F(128 if i == order[2] else 0, 0.0, name=n) for i, n in enumerate(names)]
    assert make_router("prefix").choose(512, warm, affinity) == Route(order[2], "caches 128 of its 512 tokens")
    # less is the opening every prompt shares (a chat template's): the prompt goes home
    opening = [F(112 if i == order[2] else 16, 0.0, name=n) for i, n in enumerate(names)]
    assert make_router("prefix").choose(512, opening, affinity) == Route(order[0], (
        "its home (the first by its hash within the load bound), which caches 16 of its tokens: no replica caches "
        "128 more"))
    # the home itself caches the most: the usual reason; and no slack at all is the rule before homes
    home_warm = [F(64 if i == order[0] else 16, 0.0, name=n) for i, n in enumerate(names)]
    assert make_router("prefix").choose(512, home_warm, affinity) == Route(order[0], "caches 64 of its 512 tokens")
    # with --new-prefix least_loaded, the same slack: the opening does not draw it from the least loaded
    busy = [replace(f, wait_seconds=0.0 if i == order[1] else 0.5) for i, f in enumerate(opening)]
    assert make_router("prefix", new_prefix="least_loaded").choose(512, busy, affinity) == Route(order[1], (
        "the least loaded, which caches 16 of its tokens: no replica caches 128 more"))
    # no slack at all is the rule before: any replica holding more wins
    assert PrefixAffinity(new_prefix_slack=0).choose(512, opening, affinity).replica == order[2]
    assert make_router("prefix", new_prefix="least_loaded", new_prefix_slack=0).choose(
        512, busy, affinity).replica == order[2]
    with pytest.raises(ValueError, match=r"^new_prefix_slack: must be a whole number of tokens >= 0, got -1$"):
        PrefixAffinity(new_prefix_slack=-1)


def test_a_prompts_home_moves_only_when_its_replica_leaves_and_a_new_replica_takes_a_fair_share():
    from kvctl.policies.routing import home_order, prompt_affinity

    names = [f"/run/kvd-{i}/kvd.sock" for i in range(4)]
    prompts = [prompt_affinity(f"system prompt number {i} " * 12) for i in range(2000)]
    before = [names[home_order(a, names)[0]] for a in prompts]
    assert all(300 < before.count(n) < 700 for n in names)  # spread about evenly
    fewer = names[:2] + names[3:]  # kvd-2 leaves: only its prompts move
    after = [fewer[home_order(a, fewer)[0]] for a in prompts]
    assert all(b == a for b, a in zip(before, after) if b != names[2])
    more = names + ["/run/kvd-4/kvd.sock"]  # one joins: it takes about a fifth, from every other
    joined = [more[home_order(a, more)[0]] for a in prompts]
    moved = [(b, j) for b, j in zip(before, joined) if b != j]
    assert all(j == more[4] for _, j in moved) and 300 < len(moved) < 500


def test_routers_pass_over_a_replica_predicted_past_its_max_queue_wait():
    """A replica whose predicted wait is past its own max_queue_wait would hold the request that
    long, then turn it away: least_loaded, prefix and ttft choose among the others while one would
    start it in time, and say whom they passed over; when none would, they choose as before.
    round_robin stays blind, and queue_limits="ignore" is the behaviour without limits."""
    from kvctl.policies.routing import ReplicaFacts as F
    from kvctl.policies.routing import Route, facts_from_answer, make_router

    # a holds the prompt but is 12 s behind with a 10 s limit; b is 4 s behind with a 5 s limit;
    # c is 6 s behind with no limit
    fleet = [F(4096, 12.0, name="a", max_wait_seconds=10.0), F(0, 4.0, name="b", max_wait_seconds=5.0),
             F(1024, 6.0, name="c")]
    assert [f.past_limit for f in fleet] == [True, False, False]
    passed = "; passed over a (predicted wait 12.00 s, past its max_queue_wait 10 s)"
    # prefix: the replica caching most is passed over; c caches the most of the rest, within the balance
    assert make_router("prefix", balance_seconds=2.0).choose(8192, fleet) == Route(
        2, "caches 1024 of its 8192 tokens" + passed)
    assert make_router("prefix", balance_seconds=100.0, queue_limits="ignore").choose(8192, fleet) == Route(
        0, "caches 4096 of its 8192 tokens")
    # ttft at 1,024 tokens/s: a 12 + 4 = 16 s is passed over; b 4 + 8 = 12 s, c 6 + 7 = 13 s
    assert make_router("ttft", prefill_rate=1024.0).choose(8192, fleet) == Route(
        1, "first token in 12.00 s (0 tokens cached)" + passed)
    # least_loaded: b is already least loaded; with b's wait past its limit too, c (no limit) is
    assert make_router("least_loaded").choose(8192, fleet).replica == 1
    late_b = [fleet[0], F(0, 5.5, name="b", max_wait_seconds=5.0), fleet[2]]
    route = make_router("least_loaded").choose(8192, late_b)
    assert route == Route(2, "shortest wait (6.00 s); passed over a (predicted wait 12.00 s, past its "
                             "max_queue_wait 10 s), b (predicted wait 5.50 s, past its max_queue_wait 5 s)")
    assert route.passed_over == (0, 1)  # (the router counts them: kvd_router_passed_over_total)
    assert make_router("least_loaded", queue_limits="ignore").choose(8192, late_b).replica == 1
    # every replica past its limit: the choice is as without limits, and the reason says so
    all_late = [F(4096, 12.0, name="a", max_wait_seconds=10.0), F(0, 5.5, name="b", max_wait_seconds=5.0)]
    assert make_router("prefix", balance_seconds=100.0).choose(8192, all_late) == Route(
        0, "caches 4096 of its 8192 tokens; every replica's predicted wait is past its max_queue_wait")
    # a wait of the limit exactly is past it: kvd turns away a request that has waited as long
    assert F(0, 10.0, max_wait_seconds=10.0).past_limit and not F(0, 9.9, max_wait_seconds=10.0).past_limit
    turns = make_router("round_robin")
    assert [turns.choose(8192, fleet).replica for _ in range(3)] == [0, 1, 2]
    # a prompt's home past its limit: the next in its order that is in time, the order unchanged
    from kvctl.policies.routing import cold_home, home_order, prompt_affinity

    affinity = prompt_affinity("a new system prompt " * 10)
    names = ["r0", "r1", "r2"]
    order = home_order(affinity, names)
    homes = [F(0, 0.0, name=n, max_wait_seconds=1.0) for n in names]
    homes[order[0]] = F(0, 1.5, name=names[order[0]], max_wait_seconds=1.0)
    assert make_router("prefix").choose(512, homes, affinity).replica == order[1]
    assert cold_home(homes, affinity, 10.0) == order[0] and cold_home(homes, affinity, 10.0, [order[2]]) == order[2]
    # the replica's answer carries its limit (kvd's route-facts: max_queue_wait_seconds; null: none;
    # absent from an older kvd)
    answer = {"cached_tokens": 0, "predicted_wait_seconds": 3.0, "running": 1, "waiting": 2,
              "prefill_tokens_per_second": 900.0, "oldest_age_seconds": 1.0}
    assert facts_from_answer({**answer, "max_queue_wait_seconds": 2.5}).max_wait_seconds == 2.5
    assert facts_from_answer({**answer, "max_queue_wait_seconds": None}).max_wait_seconds is None
    assert facts_from_answer(answer).past_limit is False
    with pytest.raises(ValueError, match=r"^queue_limits: unknown value 'obey'; choose from heed, ignore$"):
        make_router("prefix", queue_limits="obey")


def test_routers_refuse_bad_settings_by_name():
    from kvctl.policies.routing import make_router

    with pytest.raises(ValueError, match="routing: unknown value 'random'; choose from round_robin, "
                                         "least_loaded, prefix, ttft"):
        make_router("random")
    with pytest.raises(ValueError, match="prefill_rate: must be > 0, got 0"):
        make_router("ttft", prefill_rate=0)
    with pytest.raises(ValueError, match="balance_seconds: must be >= 0, got -1"):
        make_router("prefix", balance_seconds=-1)
    with pytest.raises(ValueError, match="new_prefix: unknown value 'random'; choose from home, least_loaded"):
        make_router("prefix", new_prefix="random")


def test_equal_replicas_are_taken_in_turn_so_new_prefixes_spread():
    from kvctl.policies.routing import ReplicaFacts as F
    from kvctl.policies.routing import make_router

    idle = [F(0, 0.0), F(0, 0.0), F(0, 0.0)]
    for name in ("least_loaded", "prefix", "ttft"):
        router = make_router(name)
        assert [router.choose(512, idle).replica for _ in range(4)] == [0, 1, 2, 0], name
    # requests in flight count before what the router sent: a replica busy with others' requests waits its turn
    router = make_router("least_loaded")
    assert router.choose(512, [F(0, 0.0, in_flight=3), F(0, 0.0, in_flight=1)]).replica == 1


def test_ttft_prices_each_replica_at_its_own_measured_prefill_rate():
    from kvctl.policies.routing import ReplicaFacts as F
    from kvctl.policies.routing import make_router

    router = make_router("ttft", prefill_rate=1000.0)
    # a: 2,000 uncached tokens at its 8,000 tokens/s = 0.25 s; b: 1,000 at the default 1,000/s = 1.0 s
    fleet = [F(0, 0.0, prefill_rate=8000.0), F(1000, 0.0)]
    route = router.choose(2000, fleet)
    assert (route.replica, route.reason) == (0, "first token in 0.25 s (0 tokens cached)")


def test_a_prefix_in_a_replicas_lower_tiers_counts_as_held_and_ttft_prices_its_restore():
    from kvctl.policies.routing import ReplicaFacts as F
    from kvctl.policies.routing import facts_from_answer, make_router
    from kvctl.policies.tiering import restore_seconds

    # a: 1,024 on its device; b: 512 on its device and 3,072 more on its host tier (0.05 s to restore)
    fleet = [F(1024, 0.0), F(512, 0.0, restorable_tokens=3072, restore_seconds=0.05)]
    route = make_router("prefix").choose(8192, fleet)
    assert (route.replica, route.reason) == (1, "caches 512 of its 8192 tokens and 3072 more in a lower tier")
    # equal in all tiers: more on the device first
    assert make_router("prefix").choose(8192, [F(0, 0.0, restorable_tokens=1024), F(1024, 0.0)]).replica == 1
    # ttft at 1,024 tokens/s: a = 7,168 / 1,024 = 7.0 s; b = 0.05 + 4,608 / 1,024 = 4.55 s
    route = make_router("ttft", prefill_rate=1024.0).choose(8192, fleet)
    assert (route.replica, route.reason) == (1, "first token in 4.55 s (512 tokens cached, 3072 in a lower tier)")
    # a restore slower than computing is not taken: b = min(9.0, 3.0) + 4.5 = 7.5 s against a's 7.0 s
    slow = [fleet[0], F(512, 0.0, restorable_tokens=3072, restore_seconds=9.0)]
    assert make_router("ttft", prefill_rate=1024.0).choose(8192, slow).replica == 0

    answer = {"cached_tokens": 512, "predicted_wait_seconds": 0.0, "oldest_age_seconds": 0.0, "waiting": 0,
              "running": 0, "prefill_tokens_per_second": None, "lower_tier_tokens": {"host": 1024, "disk": 2048},
              "restore_seconds": 0.05}
    assert facts_from_answer(answer) == F(512, 0.0, 0, None, 3072, 0.05)
    # restore time: each tier's latency, then its bytes at its rate; a tier with no rate is left out
    rates = {"host": {"bytes_per_second": 1e9, "latency_seconds": 0.001},
             "disk": {"bytes_per_second": 1e8, "latency_seconds": 0.01}}
    assert restore_seconds({"host": 64, "disk": 128, "remote": 5}, 2**20, rates) == pytest.approx(
        0.001 + 64 * 2**20 / 1e9 + 0.01 + 128 * 2**20 / 1e8)


def test_a_tenant_at_its_limit_of_requests_in_flight_is_told_so():
    from kvctl.policies.admission import tenant_limit_reason

    assert tenant_limit_reason("req-1", "acme", 3, None) is None  # no limit
    assert tenant_limit_reason("req-1", "acme", 2, 3) is None
    assert tenant_limit_reason("req-1", "acme", 3, 3) == (
        "request req-1: tenant 'acme' has 3 requests in flight (max_tenant_requests 3)")


def test_a_request_the_pins_leave_too_few_blocks_is_told_how_many_and_what_to_do():
    from kvctl.policies.admission import pinned_out_reason

    assert pinned_out_reason("req-1", 3, 5, 8, 3) is None  # exactly the room beside the pins
    assert pinned_out_reason("req-1", 4, 5, 8, 3) == (
        "request req-1: needs 4 blocks but pins hold 5 of the cache's 8 outside its prefix, leaving 3; it could "
        "never finish: unpin some (kvctl pins, kvctl unpin) or lower max_tokens")
    assert pinned_out_reason("req-1", 4, 5, 8, 3, queued=True).startswith(
        "request req-1: needs 4 blocks but pins hold 5 of the cache's 8 and nothing runs that could give one back, "
        "leaving 3;")


def test_a_rate_meter_ignores_a_measurement_whose_fixed_part_is_all_of_it():
    from kvctl.policies.tiering import RateMeter

    meter = RateMeter(rate=1e9, latency=1e-3)
    meter.observe(1 << 20, 0.002, fixed=0.003)  # the fixed part cannot exceed the whole
    meter.observe(0, 0.5)
    assert (meter.samples, meter.rate, meter.latency) == (0, 1e9, 1e-3)
    meter.observe(1 << 20, 0.003, fixed=0.002)
    assert meter.samples == 1 and meter.rate == pytest.approx((1 << 20) / 0.001) and meter.latency == 0.002



def test_a_lookup_that_found_nothing_measures_latency_and_a_read_is_priced_net_of_it():
    from kvctl.policies.tiering import RateMeter

    meter = RateMeter(rate=1e9)
    meter.observe_latency(0.002)  # a round trip that brought nothing
    assert (meter.latency, meter.latency_samples, meter.samples) == (0.002, 1, 0)
    meter.observe_latency(0.004)
    assert meter.latency == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    meter.observe_latency(0.0)  # nothing measured
    assert meter.latency_samples == 2
    latency = meter.latency
    meter.observe_net_of_latency(1_000_000, 0.0124)  # 1 MB: the round trip, then 10 ms of transfer
    assert meter.rate == pytest.approx(1_000_000 / (0.0124 - latency)) and meter.samples == 1
    small = RateMeter(rate=1e9, latency=0.002, latency_samples=1)
    small.observe_net_of_latency(18_000, 0.0025)  # mostly round trip: at most half of it is taken off
    assert small.rate == pytest.approx(18_000 / 0.00125)


def test_fetches_are_made_until_a_tier_is_measured_and_probed_when_its_rate_has_grown_old():
    """One probe a period however many requests come, and none while a probe's reading is awaited."""
    from kvctl.policies.tiering import MEASURED_READS, PROBE_AFTER_S, RateMeter, TieringPolicy

    policy = TieringPolicy(prefill=RateMeter(rate=60_000.0))  # a small model: 1,024 tokens in 17 ms
    slow = RateMeter(rate=1e6)  # 1 MB/s: 288 KB would take 288 ms
    tokens, nbytes = 1024, 288_000
    assert not policy.should_restore(tokens, nbytes, slow)
    assert [policy.should_fetch(tokens, nbytes, slow, t) for t in (0.0, 0.1)] == [True, True]  # not measured yet
    for at in (0.5, 1.0, 1.5):
        slow.observe(1_000_000, 1.0, at=at)  # three readings, the last at t = 1.5
    assert slow.samples == MEASURED_READS and slow.measured_at == 1.5
    times = [1.5 + k for k in range(0, 100)]  # a request a second
    probes = [t for t in times if policy.should_fetch(tokens, nbytes, slow, t)]
    assert probes == [1.5 + PROBE_AFTER_S, 1.5 + 2 * PROBE_AFTER_S, 1.5 + 3 * PROBE_AFTER_S]
    fast = RateMeter(rate=1e9, samples=MEASURED_READS, measured_at=0.0)
    assert all(policy.should_fetch(tokens, nbytes, fast, t) for t in (1.0, 2.0, 3.0))
    assert not policy.should_fetch(0, 0, fast, 4.0)


def test_lpm_orders_by_cached_prefix_with_patience_and_a_size_bound():
    from kvctl.policies.queue_order import (LPM_PATIENCE_SECONDS, check_queue_order, longest_prefix_first,
                                           lpm_patience, tried_before)

    # (name, cached blocks, seconds waited), in queue order
    queue = [("a", 0, 1.0), ("b", 3, 0.5), ("c", 1, 6.0), ("d", 3, 0.2), ("e", 0, 5.0), ("f", 2, 0.1)]
    looked = []

    def cached(item):
        looked.append(item[0])
        return item[1]

    def overdue(item):  # a patience of 5 s
        return item[2] >= 5.0

    order = longest_prefix_first(queue, cached, overdue)
    # c and e have waited 5 s or more: first, in queue order (not looked up); then most cached first
    assert [item[0] for item in order] == ["c", "e", "b", "d", "f", "a"]
    assert looked == ["a", "b", "d", "f"]
    looked.clear()
    assert longest_prefix_first(queue, cached, overdue, max_waiting=5) == queue
    assert looked == []  # beyond the bound: queue order, and no lookups
    assert (lpm_patience(0.0), lpm_patience(4.0), LPM_PATIENCE_SECONDS) == (30.0, float("inf"), 30.0)
    # a newcomer holding 2 blocks: after those holding 2 or more, and those that have waited 5 s
    assert [tried_before(item[1], overdue(item), 2) for item in queue] == [False, True, True, True, True, True]
    assert [tried_before(item[1], overdue(item), 3) for item in queue] == [False, True, True, True, True, False]
    assert check_queue_order("lpm") == "lpm"
    with pytest.raises(ValueError,
                       match=r"^queue_order: unknown value 'sjf'; use fifo, priority, lpm or priority\+lpm$"):
        check_queue_order("sjf")
    with pytest.raises(ValueError, match=r"^queue_order: unknown value 'priority'; use fifo or lpm$"):
        check_queue_order("priority", ("fifo", "lpm"))


def test_priority_lpm_orders_each_place_by_lpm_and_counts_what_goes_before_a_newcomer():
    from kvctl.policies.queue_order import by_prefix, by_priority, goes_before, longest_prefix_first

    assert [(by_priority(o), by_prefix(o)) for o in ("fifo", "priority", "lpm", "priority+lpm")] == [
        (False, False), (True, False), (False, True), (True, True)]
    # (name, place, cached blocks, overdue), in queue order (the engine's: by place already)
    queue = [("a", -1, 0, False), ("b", -1, 2, False), ("c", 0, 0, True), ("d", 0, 1, False), ("e", 0, 3, False),
             ("f", 4, 5, False)]
    order = longest_prefix_first(queue, lambda item: item[2], lambda item: item[3], place=lambda item: item[1])
    # place -1: b (2 blocks) before a; place 0: c (overdue) first, then e (3), d (1); place 4 last,
    # whatever it holds
    assert [item[0] for item in order] == ["b", "a", "c", "e", "d", "f"]
    looked = []

    def before(item, newcomer_place, newcomer_blocks):
        def cached():
            looked.append(item[0])
            return item[2]
        return goes_before(item[1], newcomer_place, cached, lambda: item[3], newcomer_blocks)

    # a newcomer at place 0 holding 2 blocks: a, b (a better place), c (overdue) and e (3 blocks)
    assert [before(item, 0, 2) for item in queue] == [True, True, True, False, True, False]
    assert looked == ["d", "e"]  # blocks read only at its own place
    # places not compared (lpm): by blocks alone; blocks not compared (priority): by place, then arrival
    assert [before(item, None, 2) for item in queue] == [False, True, True, False, True, True]
    assert [before(item, 0, None) for item in queue] == [True, True, True, True, True, False]
    assert [before(item, None, None) for item in queue] == [True] * 6  # fifo

"""Eviction order is a contract: exact orders on a ten-block pool (block size 4)."""

from __future__ import annotations

import pytest

from kvctl.daemon.cache import CacheFull, Namespace, chain_keys

from .conftest import FakeClock, make_manager, run_prompt

A = list(range(100, 112))  # three full blocks
C = A[:8] + [200, 201, 202, 203]  # shares A's first two blocks, then its own
D = list(range(300, 308))  # two full blocks, unrelated
NS = Namespace(block_size=4)


def _scenario(policy: str):
    clock = FakeClock()
    m = make_manager(policy=policy, clock=clock)
    run_prompt(m, "A", A)
    assert m.block_table("A") == [0, 1, 2]
    m.release("A")
    clock.advance(1)
    admission = run_prompt(m, "C", C)
    assert (admission.hit_blocks, admission.hit_tokens) == (2, 8)
    assert m.block_table("C") == [0, 1, 3]
    m.release("C")
    clock.advance(1)
    run_prompt(m, "D", D)
    assert m.block_table("D") == [4, 5]
    m.release("D")
    m.audit()
    return m, clock


def test_lru_order_is_release_order_tail_first():
    m, _ = _scenario("lru")
    # A went back as 2,1,0; C's hit took 0 and 1 out of the middle; C went back as 3,1,0.
    assert m.pool.policy.order() == [2, 3, 1, 0, 5, 4]
    assert m.state_counts() == {"free": 4, "reserved": 0, "active": 0, "shared": 0,
                                "cached": 6, "pinned": 0}


def test_cost_order_keeps_the_reused_prefix_longest():
    m, _ = _scenario("cost")
    # Blocks 0 and 1 were used twice; everything else once, oldest release first.
    assert m.pool.policy.order() == [2, 3, 5, 4, 1, 0]


@pytest.mark.parametrize("policy, victims", [("lru", [2, 3, 1]), ("cost", [2, 3, 5])])
def test_allocation_uses_free_blocks_then_evicts_in_policy_order(policy, victims):
    m, _ = _scenario(policy)
    run_prompt(m, "E", list(range(400, 428)))  # seven new blocks: four free, three evicted
    assert m.block_table("E") == [6, 7, 8, 9] + victims
    assert m.pool.evictions == 3
    m.audit()


def test_lru_evicts_a_prefix_deepest_block_first_so_the_root_still_hits():
    m, _ = _scenario("lru")
    run_prompt(m, "E", list(range(400, 428)))  # evicts A's block 2, C's block 3, then block 1
    # A's root block (0) survives, its second (1) is gone: a lookup hits exactly one block.
    assert m.lookup(chain_keys(NS, A)) == 1
    assert m.lookup(chain_keys(NS, D)) == 2


def test_hit_removes_from_the_middle_of_the_queue():
    m, _ = _scenario("lru")
    run_prompt(m, "D2", D + [1, 2, 3, 4, 5])  # reuses D's blocks 4 and 5 (the queue's tail)
    assert m.pool.policy.order() == [2, 3, 1, 0]
    assert m.state_counts()["active"] == 4  # blocks 4, 5 and two new ones
    m.audit()


@pytest.mark.parametrize("policy", ["lru", "cost", "lfu"])
def test_pinned_blocks_leave_the_queue_and_return_at_its_end(policy):
    m, _ = _scenario(policy)
    result = m.pin(NS, A[:8], owner="ops", note="system prompt")
    assert (result.cached_blocks, result.pending_blocks) == (2, 0)
    assert 0 not in m.pool.policy.order() and 1 not in m.pool.policy.order()
    assert m.state_counts()["pinned"] == 2
    assert m.pool.policy.order() == {"lru": [2, 3, 5, 4], "cost": [2, 3, 5, 4], "lfu": [2, 3, 5, 4]}[policy]
    m.audit()


def test_pins_are_never_evicted_even_under_pressure():
    m, _ = _scenario("lru")
    m.pin(NS, A[:8])
    with pytest.raises(CacheFull) as info:
        run_prompt(m, "E", list(range(400, 440)))
    assert "needs 10 new blocks but only 8 of 10" in str(info.value)
    run_prompt(m, "F", list(range(500, 532)))  # exactly the 8 unpinned blocks
    assert sorted(m.block_table("F")) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert m.lookup(chain_keys(NS, A)) == 2  # the pinned prefix still hits
    m.release("F")
    pin_id = m.pins.all()[0].pin_id
    m.unpin(pin_id)
    order = m.pool.policy.order()
    assert order[-2:] == [1, 0]  # unpinned: evictable again, after everything released before
    m.audit()

"""The cache manager: admission, growth, forks and copy-on-write, release, pins, audit."""

from __future__ import annotations

import pytest

from kvctl.daemon.cache import (AuditFailure, CacheFull, DuplicateSequence, InvalidRequest, Namespace,
                                PinBudgetExceeded, UnknownPin, UnknownSequence, chain_keys)
from kvctl.policies.admission import Verdict

from .conftest import make_manager, run_prompt

NS = Namespace(block_size=4)
PROMPT = list(range(10, 20))  # 10 tokens: two full blocks and a partial one


def snapshot(m):
    return (m.state_counts(), {s: m.block_table(s) for s in sorted(m._seqs)},
            m.pool.policy.order(), m.pool.num_indexed)


def test_admission_reserves_prompt_and_output_blocks():
    m = make_manager()
    admission = m.admit_tokens("r1", NS, PROMPT, reserve_tokens=7)  # 17 tokens -> 5 blocks
    assert (admission.hit_blocks, admission.reserved_blocks) == (0, 5)
    assert m.state_counts() == {"free": 5, "reserved": 5, "active": 0, "shared": 0,
                                "cached": 0, "pinned": 0}
    m.append("r1", 10)  # prefill
    assert m.block_table("r1") == [0, 1, 2]
    assert m.state_counts()["reserved"] == 2 and m.state_counts()["active"] == 3
    assert m.pool.num_indexed == 2  # only the two full blocks
    m.audit()


def test_prefix_hit_reuses_blocks_and_shares_them():
    m = make_manager()
    run_prompt(m, "r1", PROMPT)
    admission = run_prompt(m, "r2", PROMPT[:8] + [99, 98, 97])
    assert (admission.hit_blocks, admission.hit_tokens) == (2, 8)
    assert m.block_table("r2")[:2] == m.block_table("r1")[:2]
    assert m.state_counts()["shared"] == 2
    m.audit()


def test_a_prompt_of_exact_full_blocks_recomputes_its_last_block():
    m = make_manager()
    run_prompt(m, "r1", PROMPT[:8])
    m.release("r1")
    assert run_prompt(m, "r2", PROMPT[:8]).hit_blocks == 1
    assert run_prompt(m, "r3", PROMPT[:9]).hit_blocks == 2


def test_failed_admission_changes_nothing_and_names_the_numbers():
    m = make_manager(num_blocks=7)
    run_prompt(m, "r1", PROMPT, reserve=10)  # 20 tokens -> 5 blocks
    m.release("r1")  # two blocks cached, three free
    run_prompt(m, "r2", list(range(50, 62)))  # three of the five free blocks
    before = snapshot(m)
    decision = m.can_admit(chain_keys(NS, list(range(70, 90))), 20, 0, request="r3")
    assert decision.verdict is Verdict.QUEUE
    assert (decision.needed_blocks, decision.available_blocks) == (5, 4)
    with pytest.raises(CacheFull) as info:
        m.admit_tokens("r3", NS, list(range(70, 90)), 0)
    assert str(info.value) == "request r3: needs 5 new blocks but only 4 of 7 are free or evictable"
    assert snapshot(m) == before
    assert "r3" not in m
    m.audit()


def test_request_that_can_never_fit_is_rejected_by_can_admit():
    m = make_manager()
    decision = m.can_admit([], 40, 5, request="big")
    assert decision.verdict is Verdict.REJECT
    assert decision.reason == "request big: needs 12 blocks in all but the pool has 10; it can never fit"


def test_hit_blocks_are_not_counted_as_available_for_the_same_request():
    m = make_manager(num_blocks=4)
    run_prompt(m, "r1", PROMPT[:9])  # 3 blocks, two full ones indexed
    m.release("r1")  # 2 cached + 2 free
    decision = m.can_admit(chain_keys(NS, PROMPT[:9]), 9, 4, request="r2")  # 13 tokens: 4 blocks
    assert decision.verdict is Verdict.ADMIT
    assert (decision.needed_blocks, decision.available_blocks) == (2, 2)
    decision = m.can_admit(chain_keys(NS, PROMPT[:9]), 9, 8, request="r3")  # 17 tokens: 5 blocks
    assert decision.verdict is Verdict.REJECT


def test_append_draws_on_the_reservation_then_the_pool():
    m = make_manager()
    run_prompt(m, "r1", PROMPT, reserve=2)  # 12 tokens -> 3 blocks, all used by the prompt
    assert m.sequence("r1").reserve == []
    m.append("r1", 2)
    assert m.block_table("r1") == [0, 1, 2]
    m.append("r1", 1)  # 13th token needs a fourth block from the pool
    assert m.block_table("r1") == [0, 1, 2, 3]
    m.audit()


def test_append_that_cannot_grow_raises_and_changes_nothing():
    m = make_manager(num_blocks=3)
    run_prompt(m, "r1", PROMPT)
    before = snapshot(m)
    with pytest.raises(CacheFull) as info:
        m.append("r1", 3)
    assert str(info.value) == "request r1: needs 1 new blocks but only 0 of 3 are free or evictable"
    assert snapshot(m) == before and m.sequence("r1").num_tokens == 10


def test_fork_shares_blocks_and_copies_the_shared_partial_block_on_write():
    m = make_manager()
    run_prompt(m, "parent", PROMPT)  # blocks 0, 1 full; 2 partial (2 tokens)
    m.fork("parent", "child", reserve_tokens=4)
    assert m.block_table("child") == [0, 1, 2]
    assert [m.pool.blocks[b].ref_count for b in (0, 1, 2)] == [2, 2, 2]
    assert m.state_counts()["shared"] == 3
    copies = m.append_tokens("child", [1, 2])
    assert copies == [(2, 3)]  # the engine copies block 2 into block 3 before writing
    assert m.block_table("child") == [0, 1, 3]
    assert m.pool.blocks[2].ref_count == 1
    assert m.append_tokens("parent", [5]) == []  # the parent now owns block 2 alone
    m.audit()


def test_forked_full_blocks_are_never_copied():
    m = make_manager()
    run_prompt(m, "parent", PROMPT[:8])
    m.fork("parent", "child")
    assert m.append_tokens("child", [1]) == []
    assert m.append_tokens("parent", [1]) == []
    assert m.block_table("child")[:2] == m.block_table("parent")[:2]
    assert m.block_table("child")[2] != m.block_table("parent")[2]
    m.audit()


def test_decoded_blocks_are_indexed_and_reused():
    m = make_manager()
    run_prompt(m, "r1", PROMPT)
    m.append_tokens("r1", [1, 2, 3, 4, 5, 6])  # 16 tokens -> four full blocks
    m.release("r1")
    assert m.lookup(chain_keys(NS, PROMPT + [1, 2, 3, 4, 5, 6])) == 4


def test_release_is_idempotent_and_tail_first():
    m = make_manager()
    run_prompt(m, "r1", PROMPT, reserve=6)
    assert m.release("r1") == 4
    assert m.release("r1") == 0
    assert m.pool.policy.order() == [1, 0]
    assert m.state_counts() == {"free": 8, "reserved": 0, "active": 0, "shared": 0,
                                "cached": 2, "pinned": 0}
    with pytest.raises(UnknownSequence) as info:
        m.append("r1", 1)
    assert str(info.value) == "unknown sequence 'r1'"
    m.audit()


def test_errors_name_the_field_and_value():
    m = make_manager()
    with pytest.raises(InvalidRequest, match=r"request r1: prompt_tokens must be >= 1, got 0"):
        m.admit("r1", [], 0, 0)
    with pytest.raises(InvalidRequest, match=r"request r1: reserve_tokens must be >= 0, got -2"):
        m.admit("r1", [], 4, -2)
    run_prompt(m, "r1", PROMPT)
    with pytest.raises(DuplicateSequence, match="sequence 'r1' already exists"):
        m.admit("r1", [], 4, 0)
    with pytest.raises(InvalidRequest, match="namespace.block_size: 8 does not match"):
        m.admit_tokens("r2", Namespace(block_size=8), PROMPT, 0)
    assert m.admit_tokens("r3", NS, PROMPT, 0).hit_tokens == 8
    with pytest.raises(InvalidRequest, match="8 of 10 prompt tokens written"):
        m.append_tokens("r3", [1])
    m.audit()


def test_tenants_never_share_blocks():
    m = make_manager()
    run_prompt(m, "a", PROMPT, namespace=Namespace(block_size=4, tenant="acme"))
    m.release("a")
    other = run_prompt(m, "b", PROMPT, namespace=Namespace(block_size=4, tenant="globex"))
    assert other.hit_blocks == 0
    same = run_prompt(m, "c", PROMPT, namespace=Namespace(block_size=4, tenant="acme"))
    assert same.hit_blocks == 2


def test_a_tenant_whose_cached_blocks_all_went_leaves_the_books():
    """kvd may see tenants without end (one per end user): one with no block cached keeps no entry."""
    m = make_manager(num_blocks=4)
    run_prompt(m, "a", PROMPT[:8], namespace=Namespace(block_size=4, tenant="acme"))
    m.release("a")
    assert dict(m.pool.tenant_blocks) == {"acme": 2}
    run_prompt(m, "b", list(range(30, 46)), namespace=Namespace(block_size=4, tenant="globex"))  # all 4 blocks
    assert dict(m.pool.tenant_blocks) == {"globex": 4}  # acme's two blocks were evicted for room
    m.release("b")
    m.evict_where(lambda key, root, tenant: True)
    assert dict(m.pool.tenant_blocks) == {}


def test_pin_budget_is_enforced_per_tenant_in_distinct_blocks(clock):
    m = make_manager(clock=clock, pin_budget_blocks=3)
    acme = Namespace(block_size=4, tenant="acme")
    m.pin(acme, PROMPT[:8])  # 2 blocks
    m.pin(acme, PROMPT[:4])  # the same root block: still 2 distinct
    assert m.pins.used("acme") == 2
    with pytest.raises(PinBudgetExceeded) as info:
        m.pin(acme, list(range(60, 68)))
    assert str(info.value) == "tenant 'acme': pin budget is 3 blocks, 2 already pinned, this pin adds 2"
    assert len(m.pins.all()) == 2  # nothing half-added
    m.pin(Namespace(block_size=4, tenant="globex"), list(range(60, 72)))  # its own budget
    m.audit()


def test_pin_before_cache_pins_blocks_when_they_fill(clock):
    m = make_manager(clock=clock)
    result = m.pin(NS, PROMPT[:8], owner="ops", note="system prompt", ttl=30)
    assert (result.cached_blocks, result.pending_blocks, result.refreshed) == (0, 2, False)
    run_prompt(m, "r1", PROMPT)
    m.release("r1")
    assert m.state_counts()["pinned"] == 2 and m.pool.policy.order() == []
    first_expiry = result.pin.expires_at
    again = m.pin(NS, PROMPT[:8], owner="ops2", ttl=60)
    assert again.refreshed and again.pin.pin_id == result.pin.pin_id and again.pin.owner == "ops2"
    assert again.was == {"owner": "ops", "note": "system prompt", "expires_at": first_expiry} and result.was is None
    clock.advance(59)
    assert m.expire_pins() == []
    clock.advance(1)
    lapsed = m.expire_pins()
    assert [p.pin_id for p in lapsed] == [result.pin.pin_id]
    assert m.pool.policy.order() == [1, 0]
    m.audit()


def test_pin_errors():
    m = make_manager()
    with pytest.raises(InvalidRequest, match=r"token_ids: 3 tokens is less than one block \(4 tokens\)"):
        m.pin(NS, [1, 2, 3])
    with pytest.raises(InvalidRequest, match="ttl: must be a finite number of seconds > 0, got 0"):
        m.pin(NS, PROMPT, ttl=0)
    with pytest.raises(InvalidRequest, match="ttl: must be a finite number of seconds > 0, got inf"):
        m.pin(NS, PROMPT, ttl=float("inf"))
    with pytest.raises(UnknownPin, match="unknown pin 'pin-nope'"):
        m.unpin("pin-nope")


def test_evict_prefix_drops_only_idle_unpinned_blocks():
    m = make_manager()
    run_prompt(m, "r1", PROMPT)
    m.release("r1")
    run_prompt(m, "r2", list(range(40, 48)))
    report = m.evict_prefix(chain_keys(NS, list(range(40, 48))))
    assert (report.evicted_blocks, report.skipped) == (0, {"in_use": 2})
    m.pin(NS, PROMPT[:4])
    report = m.evict_prefix(chain_keys(NS, PROMPT + [0, 0]))
    assert (report.evicted_blocks, report.skipped) == (1, {"pinned": 1, "not_cached": 1})
    assert m.lookup(chain_keys(NS, PROMPT)) == 1
    m.audit()


def test_audit_reports_every_mismatch():
    m = make_manager()
    run_prompt(m, "r1", PROMPT)
    m.pool.blocks[0].ref_count = 3
    m.num_reserved += 1
    with pytest.raises(AuditFailure) as info:
        m.audit()
    text = str(info.value)
    assert "block 0: ref_count 3 but 1 live holders" in text
    assert "num_reserved is 1, counted 0" in text


def test_audit_catches_a_leaked_block():
    m = make_manager()
    run_prompt(m, "r1", PROMPT)
    m._seqs["r1"].table.pop()  # the engine "forgets" a block: its reference now leaks
    m._seqs["r1"].num_tokens = 8
    with pytest.raises(AuditFailure, match="block 2: ref_count 1 but 0 live holders"):
        m.audit()


def test_what_is_known_of_prefix_trees_stays_bounded_by_the_pool(monkeypatch):
    """A root's record (tenant, hits, last use) outlives its blocks only until there are more
    than twice the pool's blocks plus a margin of them; then the ones with no block go."""
    import kvctl.daemon.cache.manager as manager_module

    monkeypatch.setattr(manager_module, "ROOTS_MARGIN", 8)
    m = make_manager(num_blocks=4)
    for i in range(200):  # 200 distinct one-block prompts through a 4-block pool
        run_prompt(m, f"r{i}", [i, i, i, i, 7])
        m.release(f"r{i}")
    assert len(m.roots) <= 2 * 4 + 8 + 1
    cached = {b.root for b in m.pool.blocks if b.key is not None}
    assert cached and cached <= set(m.roots)  # every root still cached here is known
    for i in range(200, 230):  # a running sequence's root is kept while it runs, hits and all
        m.admit_tokens(f"r{i}", NS, [i, i, i, i, 7], 0)
        assert m.roots[m.sequence(f"r{i}").keys[0]].tenant == NS.tenant
        m.release(f"r{i}")
    m.audit()


def test_a_tree_records_the_block_space_it_was_hashed_in():
    """A prompt's tree records its namespace's block space (not its tenant's or adapter's part of
    it), so a listing can tell the trees of scales since replaced; a restored tree takes the space
    its tier holds it in; keys admitted without their hasher leave it unknown."""
    from dataclasses import replace

    m = make_manager()
    new_scales, tenant_b = replace(NS, scale_version="cal-2"), replace(NS, tenant="b", adapter_id="lora1")
    spaces = {}
    for seq, namespace in (("old", NS), ("new", new_scales), ("b", tenant_b)):
        m.admit_tokens(seq, namespace, PROMPT, 0)
        spaces[seq] = m.roots[m.sequence(seq).keys[0]].space
        m.release(seq)
    assert spaces == {"old": NS.space_key(), "new": new_scales.space_key(), "b": NS.space_key()}
    assert NS.space_key() != new_scales.space_key()
    keys = chain_keys(replace(NS, tenant="c"), PROMPT)
    m.admit("bare", keys, len(PROMPT), 0, tenant="c")
    assert m.roots[keys[0]].space is None
    m.release("bare")
    restored = chain_keys(replace(NS, tenant="d"), PROMPT)
    assert m.install(restored, 0, 2, "d", lambda keys, ids: None, space=new_scales.space_key()) == 2
    assert (m.roots[restored[0]].tenant, m.roots[restored[0]].space) == ("d", new_scales.space_key())


def test_new_scales_drop_the_trees_of_the_old_space_but_pinned_blocks():
    """Under `lfu` a hot tree hashed under the old scales would outlive every fresh block; kvd drops
    the old space's unpinned blocks instead, as `space` evictions (the eviction log, the counter),
    deepest first, and a pin's blocks stay."""
    from dataclasses import replace

    from .conftest import FakeClock

    m = make_manager(num_blocks=12, policy="lfu", clock=FakeClock())
    hot, pinned, fresh = PROMPT, [7] * 10, [9] * 10  # two full blocks each
    for i in range(5):  # hot: five uses
        run_prompt(m, f"hot{i}", hot)
        m.release(f"hot{i}")
    run_prompt(m, "pinned", pinned)
    m.release("pinned")
    m.pin(NS, pinned)
    new = replace(NS, scale_version="cal-2")
    run_prompt(m, "fresh", fresh, namespace=new)
    m.release("fresh")
    hot_keys, pinned_keys = chain_keys(NS, hot), chain_keys(NS, pinned)
    fresh_keys = chain_keys(new, fresh)
    by_key = {m.pool.blocks[b].key: b for b in m.pool.policy.order()}
    assert m.pool.policy.order()[:2] == [by_key[fresh_keys[1]], by_key[fresh_keys[0]]]  # lfu: fresh goes first
    report = m.evict_stale(new.space_key())
    assert (report.evicted_blocks, report.skipped) == (2, {"pinned": 2})
    assert [m.pool.block_of(k) is None for k in hot_keys + pinned_keys + fresh_keys] == [
        True, True, False, False, False, False]
    assert [m.pool.eviction_log[k][1] for k in hot_keys] == ["space", "space"]
    assert (m.pool.space_evictions, m.pool.operator_evictions, m.pool.evictions) == (2, 0, 0)
    assert m.evict_stale(new.space_key()).evicted_blocks == 0
    assert m.evict_stale(NS.space_key()).evicted_blocks == 2  # the other way round: fresh's two
    m.audit()


def test_the_priority_policy_keeps_an_important_request_s_prefix_through_a_burst_lru_gives_up():
    """Blocks carry the priority of the requests that wrote or reused them (forks too): a burst of
    priority-0 prompts evicts each other and leaves the priority-10 prefix; `lru` evicts it first."""
    from .conftest import FakeClock

    gold, batch = list(range(100, 113)), [[200 + i] * 13 for i in range(4)]  # 3 full blocks and 1 token each
    kept = {}
    for name in ("lru", "priority"):
        clock = FakeClock()
        m = make_manager(num_blocks=12, policy=name, clock=clock)
        run_prompt(m, "gold", gold, priority=10)
        m.fork("gold", "gold-2")  # a second sample of it: the same priority
        assert m.sequence("gold-2").priority == 10
        m.release("gold-2")
        m.release("gold")
        for i, prompt in enumerate(batch):
            clock.advance(1)
            run_prompt(m, f"batch{i}", prompt)
            m.release(f"batch{i}")
        kept[name] = [m.pool.block_of(k) is not None for k in chain_keys(NS, gold)]
        if name == "priority":  # the burst's oldest blocks went, deepest first, and the order says why
            evicted = [key for key, (_, reason) in m.pool.eviction_log.items() if reason == "priority"]
            assert evicted == chain_keys(NS, batch[0])[::-1] + chain_keys(NS, batch[1])[2:]
            assert sorted(m.pool.policy.score(b, clock()) for b in m.pool.policy.order()) == [0] * 8 + [10] * 3
        m.audit()
    assert kept == {"lru": [False, False, False], "priority": [True, True, True]}


def test_blocks_restored_from_a_lower_tier_take_the_priority_of_the_request_they_come_back_for():
    """A deferred request (engine priority -5) restoring its prefix leaves it at -5, below what a
    neutral request's blocks keep; the next request to reuse them raises them to its own."""
    m = make_manager(num_blocks=8, policy="priority")
    keys = chain_keys(NS, PROMPT)
    assert m.install(keys, 0, 2, NS.tenant, lambda keys, ids: None, priority=-5) == 2
    restored = [m.pool.block_of(k) for k in keys]
    assert m.pool.policy.order() == restored[::-1]  # released tail first, as a sequence is
    assert [m.pool.policy.score(b, 0.0) for b in restored] == [-5, -5]
    run_prompt(m, "r1", list(range(50, 60)))  # priority 0: its blocks go after the restored ones
    m.release("r1")
    assert m.pool.policy.order()[:2] == restored[::-1]
    run_prompt(m, "r2", PROMPT, priority=3)
    m.release("r2")
    assert [m.pool.policy.score(b, 0.0) for b in restored] == [3, 3]
    assert m.pool.policy.order()[-2:] == restored[::-1]
    m.audit()

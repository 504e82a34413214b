"""Tenant shares of the cache: the policy on plain block ids, then the pool and manager (eviction
reasons, audit, live changes), then kvd (status, metrics, explain, reload)."""

from __future__ import annotations

import pytest

from kvctl.policies.eviction import CostAwareEviction, LRUEviction
from kvctl.policies.tenant_shares import TenantShares, parse_shares, share_blocks

OWNER = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "b", 6: "c", 7: "c"}


def shares(inner, **blocks):
    return TenantShares(inner, OWNER.get, {k.replace("others", "*"): v for k, v in blocks.items()})


def test_a_tenant_over_its_share_loses_its_own_oldest_blocks_before_anyone_else_s():
    plain, shared = LRUEviction(), shares(LRUEviction(), a=2)
    for policy in (plain, shared):
        policy.push([4, 5], now=0)  # b released first: plain LRU would take them first
        policy.push([0, 1, 2, 3], now=1)  # then a's burst
    assert plain.pop_many(3, now=2) == [4, 5, 0]
    assert shared.order() == [0, 1, 4, 5, 2, 3]
    assert shared.pop_many(3, now=2) == [0, 1, 4]  # a's two over its share, then the LRU order
    assert shared.evicted_for_share == {0: "a", 1: "a"}
    assert shared.idle_blocks() == {"a": 2, "b": 1} and shared.over_share() == []
    assert shared.pop_many(2, now=3) == [5, 2] and shared.evicted_for_share == {}
    assert len(shared) == 1 and shared.problems() == []


def test_the_most_over_goes_first_and_star_is_the_share_of_every_tenant_not_named():
    policy = shares(LRUEviction(), others=1)
    policy.push([6, 7, 0, 1, 2, 3, 4, 5], now=0)
    assert policy.over_share() == [("a", 3), ("b", 1), ("c", 1)]
    assert policy.pop_many(4, now=1) == [0, 1, 2, 4]  # a's three, then b (before c: by name)
    assert policy.pop_many(2, now=1) == [6, 7]  # c's one over, then the LRU order


def test_a_hit_takes_a_block_back_out_of_its_tenant_s_count():
    policy = shares(LRUEviction(), a=1)
    policy.push([0, 1, 2], now=0)
    policy.remove(0)  # a hit on block 0
    policy.forget(1)  # dropped some other way
    assert policy.idle_blocks() == {"a": 1} and policy.over_share() == [] and policy.problems() == []
    policy.push([0], now=1)  # released again: now a's newest
    assert policy.over_share() == [("a", 1)] and policy.pop_many(1, now=2) == [2]


def test_shares_wrap_the_cost_policy_and_leave_its_order_for_the_rest():
    inner = CostAwareEviction(half_life=10)
    policy = shares(inner, a=1)
    inner.on_insert([0, 1, 4, 5], [0, 1, 0, 1], now=0)
    inner.record_hits([4], now=0)
    inner.record_hits([4], now=0)  # block 4 is worth keeping
    policy.push([4, 5, 0, 1], now=0)
    assert policy.pop_many(3, now=0) == [0, 5, 1]  # a's oldest for its share, then the lowest scores
    assert list(policy.evicted_for_share) == [0]


def test_no_share_means_the_inner_order_and_nothing_evicted_for_a_share():
    policy = shares(LRUEviction())
    policy.push([0, 1, 4], now=0)
    assert policy.pop_many(2, now=1) == [0, 1] and policy.evicted_for_share == {}


@pytest.mark.parametrize("text, message", [
    ("acme=0", r"share of 'acme' must be in \(0, 1\], got '0'"),
    ("acme=1.5", r"share of 'acme' must be in \(0, 1\], got '1.5'"),
    ("acme", "expected TENANT=FRACTION, got 'acme'"),
    ("=0.5", "a share names its tenant"),
    ("acme=0.2,acme=0.3", "tenant 'acme' is given twice"),
])
def test_bad_shares_are_refused_naming_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_shares(text)


def test_shares_parse_from_text_or_a_mapping_and_become_blocks():
    assert parse_shares("acme=0.25, *=0.5") == parse_shares({"acme": 0.25, "*": 0.5}) == (("*", 0.5), ("acme", 0.25))
    assert share_blocks((("acme", 0.25), ("tiny", 0.0001)), 1000) == {"acme": 250, "tiny": 1}


# ---- the pool and the manager --------------------------------------------------------------------
def test_a_noisy_tenant_churns_its_own_share_and_the_quiet_tenant_s_prefix_survives():
    from kvctl.daemon.cache import Namespace, chain_keys
    from kvctl.daemon.cache.events import EventLog

    from .conftest import FakeClock, make_manager, run_prompt

    def scenario(with_shares: bool):
        clock = FakeClock()
        m = make_manager(num_blocks=10, block_size=4, clock=clock)
        m.pool.events = EventLog()
        if with_shares:
            m.set_tenant_shares((("noisy", 0.4),))  # 4 of 10 blocks
        quiet = Namespace(block_size=4, tenant="quiet")
        run_prompt(m, "q", list(range(100, 112)), namespace=quiet)  # three blocks, released first
        m.release("q")
        for i in range(5):  # the noisy tenant's burst: five prompts of two blocks, each new
            clock.advance(1)
            run_prompt(m, f"n{i}", list(range(200 + 10 * i, 208 + 10 * i)), namespace=Namespace(block_size=4,
                                                                                                  tenant="noisy"))
            m.release(f"n{i}")
        m.audit()
        return m, chain_keys(quiet, list(range(100, 112)))

    plain, quiet_keys = scenario(False)
    assert plain.lookup(quiet_keys) == 0  # LRU took the quiet tenant's prefix for the burst
    shared, quiet_keys = scenario(True)
    assert shared.lookup(quiet_keys) == 3  # the burst evicted the noisy tenant's own blocks
    assert shared.pool.share_evictions == shared.pool.evictions == 3
    assert [reason for _, reason in shared.pool.eviction_log.values()] == ["tenant_share"] * 3
    assert shared.pool.events.blocks[("removed", "device", "tenant_share")] == 3
    assert ("removed", "device", "capacity") not in shared.pool.events.blocks
    # idle room is lent: the noisy tenant holds more than its share until someone needs the room
    assert shared.tenant_shares() == {"noisy": {"idle_blocks": 7, "share_blocks": 4},
                                      "quiet": {"idle_blocks": 3, "share_blocks": None}}


def test_shares_set_on_a_pool_in_use_adopt_its_idle_blocks_and_can_be_taken_away():
    from kvctl.daemon.cache import Namespace

    from .conftest import make_manager, run_prompt

    m = make_manager(num_blocks=10, block_size=4)
    run_prompt(m, "x", list(range(8)), namespace=Namespace(block_size=4, tenant="t1"))
    m.release("x")
    run_prompt(m, "y", list(range(50, 54)), namespace=Namespace(block_size=4, tenant="t2"))
    m.set_tenant_shares((("t1", 0.1),))
    assert m.tenant_shares() == {"t1": {"idle_blocks": 2, "share_blocks": 1}}  # t2's block is in use
    m.audit()
    m.set_tenant_shares((("t1", 0.5), ("*", 0.2)))
    assert m.tenant_shares()["t1"]["share_blocks"] == 5 and m.policy_name == "lru"
    m.release("y")
    assert m.tenant_shares()["t2"] == {"idle_blocks": 1, "share_blocks": 2}
    m.set_tenant_shares(())
    assert m.tenant_shares() is None and isinstance(m.pool.policy, LRUEviction)
    m.audit()


# ---- kvd -----------------------------------------------------------------------------------------
def cached_tokens(app, token: str, prompt: list[int]) -> int:
    """Complete `prompt` as the token's tenant (one greedy token); the prompt tokens it got from the cache."""
    from .daemon_fixtures import call

    response = call(app, "POST", "/v1/completions", headers={"Authorization": f"Bearer {token}"},
                    json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_kvd_keeps_a_quiet_tenant_s_prefix_through_a_noisy_tenant_s_burst_and_says_why(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from dataclasses import replace

    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, apps, blocks_all_back, call, start_service, token_table

    service = start_service(tmp_path, num_blocks=24, tenant_cache_shares="acme=0.25")  # acme: 6 blocks
    try:
        unix, tcp = apps(service, token_table(tmp_path))

        def complete(token, prompt):
            return cached_tokens(tcp, token, prompt)

        quiet = list(range(1, 50))  # three full blocks and one token
        complete(GLOBEX_TOKEN, quiet)
        burst = [[200 + i] + list(range(1, 49)) for i in range(8)]  # each its own chain from the first block
        for prompt in burst:  # 8 x 4 blocks through a 24-block cache
            complete(USER_TOKEN, prompt)
        assert complete(GLOBEX_TOKEN, quiet) == 48  # globex's prefix was not taken for acme's burst
        status = call(unix, "GET", "/admin/status").json()
        assert status["tenant_shares"]["acme"]["share_blocks"] == 6
        assert status["evictions"]["tenant_share"] == status["evictions"]["capacity"] > 0
        metrics = call(unix, "GET", "/metrics").text
        assert 'kvd_tenant_share_blocks{tenant="acme"} 6.0' in metrics
        assert f'kvd_evicted_blocks_total{{reason="tenant_share"}} {status["evictions"]["tenant_share"]}.0' in metrics
        first_miss = call(unix, "POST", "/admin/explain", json={"tokens": burst[0], "tenant": "acme"}).json()
        assert first_miss["first_miss"]["evicted_by"] == "tenant_share"
        assert "its tenant held more idle blocks than its cache share" in first_miss["first_miss"]["detail"]
        result = service.reload(replace(service.config, tenant_cache_shares=()))
        assert result["changed"] == {"tenant_cache_shares": ()} and result["needs_restart"] == []
        assert call(unix, "GET", "/admin/status").json()["tenant_shares"] is None
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_kvctl_tenants_splits_tokens_hits_blocks_and_pins_by_tenant(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, apps, call, start_service, token_table
    from .test_router import _kvctl_prints

    service = start_service(tmp_path, num_blocks=48, tenant_cache_shares="acme=0.25")
    try:
        unix, tcp = apps(service, token_table(tmp_path))

        def complete(token, prompt):
            response = call(tcp, "POST", "/v1/completions", headers={"Authorization": f"Bearer {token}"},
                            json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            return response.json()["usage"]

        system = list(range(1, 33))  # two full blocks
        first = complete(USER_TOKEN, system + [40, 41, 42])
        second = complete(USER_TOKEN, system + [50, 51, 52])  # hits the two blocks
        other = complete(GLOBEX_TOKEN, list(range(100, 140)))
        never = call(tcp, "POST", "/v1/completions", headers={"Authorization": f"Bearer {GLOBEX_TOKEN}"},
                     json={"prompt": list(range(200)) * 4, "max_tokens": 1})  # 50 blocks of a 48-block cache
        assert never.status_code == 400 and never.json()["error"]["code"] == "cache_capacity_exceeded"
        assert call(unix, "POST", "/admin/pins", json={"tokens": system + [7], "tenant": "acme"}).status_code == 200
        body = call(unix, "GET", "/admin/tenants").json()
        rows = {row["tenant"]: row for row in body["tenants"]}
        acme, globex = rows["acme"], rows["globex"]
        # (the pin found its two blocks cached: no warm-up request)
        assert acme["prompt_tokens"] == first["prompt_tokens"] + second["prompt_tokens"] == 70
        assert acme["hit_tokens"] == second["prompt_tokens_details"]["cached_tokens"] == 32
        assert (globex["prompt_tokens"], globex["hit_tokens"], globex["hit_ratio"]) == (other["prompt_tokens"], 0, 0.0)
        with service.lock:
            indexed = dict(service.engine.cache.pool.tenant_blocks)
        # acme's two prompts share their two full blocks (the system prompt), which the pin holds
        assert (acme["cached_blocks"], globex["cached_blocks"]) == (indexed["acme"], indexed["globex"]) == (2, 2)
        assert (acme["share_blocks"], acme["idle_blocks"]) == (12, 0)
        assert (globex["share_blocks"], globex["idle_blocks"]) == (None, 2)
        assert (acme["pinned_blocks"], acme["pin_budget_blocks"], globex["pinned_blocks"]) == (2, 24, 0)
        assert acme["running"] == acme["waiting"] == 0 and body["shares"] and body["blocks"] == 48
        assert (acme["rejected"], globex["rejected"]) == (0, 1)  # a turned-away prompt counts no tokens
        # TTFT percentiles of each tenant's client requests (acme's two, globex's one)
        assert 0 < acme["ttft_p50_s"] <= acme["ttft_p95_s"] and globex["ttft_p50_s"] == globex["ttft_p95_s"] > 0
        assert 'kvd_tenant_ttft_seconds_count{tenant="acme"} 2.0' in call(unix, "GET", "/metrics").text
        shown = _kvctl_prints(["tenants"], body).splitlines()
        assert shown[0].split() == ["tenant", "prompt", "hit", "recomp", "run/wait", "rej", "cached", "idle/share",
                                    "pins", "TTFT", "ms"]
        ttft = [f"{row['ttft_p50_s'] * 1e3:.0f}/{row['ttft_p95_s'] * 1e3:.0f}" for row in (acme, globex)]
        assert shown[1].split() == ["acme", "70", "45.7%", "0", "0/0", "0", "2", "0/12", "2/24", ttft[0]]
        assert shown[2].split() == ["globex", "40", "0.0%", "0", "0/0", "1", "2", "2/-", "0/24", ttft[1]]
        assert (acme["evicted_blocks"], globex["evicted_blocks"]) == (0, 0)
        assert not any(line.startswith("evicted to make room") for line in shown)  # nothing was
    finally:
        service.shutdown(1)


def test_the_router_sums_each_tenant_over_the_replicas():
    from kvctl.daemon.server.fleet_admin import merge_tenant_lists

    def row(tenant, prompt, hit, share=None, idle=None, ttft=None):
        return {"tenant": tenant, "prompt_tokens": prompt, "hit_tokens": hit, "hit_ratio": 0.0, "recomputed_tokens": 1,
                "running": 1, "waiting": 0, "rejected": 2, "cached_blocks": 3, "evicted_blocks": 5, "idle_blocks": idle,
                "share_blocks": share, "pinned_blocks": 0, "pin_budget_blocks": 10,
                "ttft_p50_s": ttft, "ttft_p95_s": None if ttft is None else 2 * ttft}

    status, body = merge_tenant_lists(["r0", "r1", "r2"], [
        (200, {"tenants": [row("acme", 100, 50, 8, 2, 0.05), row("globex", 10, 0)], "shares": True, "blocks": 64}),
        (200, {"tenants": [row("acme", 300, 50, 8, 9, 0.02)], "shares": True, "blocks": 64}),
        (None, {"error": "connection refused"})])
    assert status == 200 and body["blocks"] == 128 and body["shares"]
    acme, globex = body["tenants"]
    assert (acme["prompt_tokens"], acme["hit_tokens"], acme["hit_ratio"], acme["running"]) == (400, 100, 0.25, 2)
    assert (acme["rejected"], acme["evicted_blocks"]) == (4, 10)
    assert (acme["ttft_p50_s"], acme["ttft_p95_s"]) == (0.05, 0.1)  # the slowest's
    assert globex["ttft_p50_s"] is None
    assert (acme["share_blocks"], acme["idle_blocks"], acme["pin_budget_blocks"]) == (16, 11, 20)
    assert (globex["share_blocks"], globex["idle_blocks"], globex["cached_blocks"]) == (None, None, 3)
    assert body["message"] == "not listed: r2 (connection refused)"


# ---- the host tier -------------------------------------------------------------------------------
def _host_with(shares, entries):
    """A 6-slot host tier holding `entries` (tenant, name) in that order (least recently used first)."""
    torch = pytest.importorskip("torch")
    from kvctl.daemon.cache.events import EventLog
    from kvctl.daemon.cache.tiers import BlockLayout, BlockMeta, HostTier

    from .tier_fixtures import block_key, content

    layout = BlockLayout((torch.float16,), 4, 1, 4, "")
    host = HostTier(6 * layout.block_bytes, layout)
    host.events = EventLog()
    host.set_tenant_shares(shares)
    keys = {}
    for i, (tenant, name) in enumerate(entries):  # (not hash(name): it changes per process, and two could meet)
        key = keys[name] = block_key(i + 1)
        slots, _, _ = host.take_slots(1)
        host.fill(slots, [BlockMeta(key, key, 0, None, tenant)], content(layout, key))
    return host, keys


def test_a_host_tier_with_shares_takes_room_from_the_tenant_over_its_share_first():
    entries = [("quiet", "q0"), ("quiet", "q1"), ("noisy", "n0"), ("noisy", "n1"), ("noisy", "n2"), ("noisy", "n3")]
    plain, keys = _host_with((), entries)
    assert plain.take_slots(2, tenants=["noisy", "noisy"])[1] == [keys["q0"], keys["q1"]]  # LRU: quiet's go
    host, keys = _host_with((("noisy", 0.5),), entries)  # noisy: 3 slots, holds 4
    assert host.share_of("noisy") == 3 and host.share_of("quiet") is None
    _, evicted, kept = host.take_slots(2, tenants=["quiet", "quiet"])
    assert (evicted, kept) == ([keys["n0"], keys["q0"]], [0, 1])  # noisy's one over its share, then LRU
    assert dict(host.tenant_blocks) == {"quiet": 1, "noisy": 3} and host.share_evictions == 1
    removed = [(e.keys, e.reason) for e in host.events.since(0, kinds=("removed",)).events]
    assert removed == [((keys["n0"],), "tenant_share"), ((keys["q0"],), "capacity")]
    host.drop(keys["n3"])
    assert dict(host.tenant_blocks) == {"quiet": 1, "noisy": 2}


def test_a_tenant_at_its_host_share_recycles_its_own_entries_and_never_pushes_out_others():
    entries = [("quiet", "q0"), ("quiet", "q1"), ("quiet", "q2"), ("quiet", "q3"), ("noisy", "n0"), ("noisy", "n1")]
    host, keys = _host_with((("noisy", 0.34),), entries)  # noisy: 2 slots, holds 2
    slots, evicted, kept = host.take_slots(3, tenants=["noisy"] * 3)
    assert (evicted, kept, len(slots)) == ([keys["n0"], keys["n1"]], [0, 1], 2)  # the third gets no slot
    assert dict(host.tenant_blocks) == {"quiet": 4} and host.share_evictions == 2
    busy, keys = _host_with((("noisy", 0.34),), entries)
    busy.busy[keys["n0"]] = 1  # a restore reads it
    assert busy.take_slots(3, tenants=["noisy"] * 3)[1:] == ([keys["n1"]], [0])


def test_host_shares_never_take_an_entry_a_transfer_reads_and_star_covers_the_others():
    entries = [("a", "a0"), ("a", "a1"), ("b", "b0"), ("b", "b1"), ("b", "b2"), ("c", "c0")]
    host, keys = _host_with((("*", 0.34),), entries)  # every tenant: 2 slots
    host.busy[keys["b0"]] = 1  # being read by a restore
    _, evicted, kept = host.take_slots(2, tenants=[None, None])
    assert (evicted, kept) == ([keys["b1"], keys["a0"]], [0, 1])  # b is one over: its oldest idle entry, then LRU
    assert host.share_evictions == 1


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("with_shares", [False, True])
def test_a_noisy_tenant_s_flood_leaves_the_quiet_tenant_s_prefix_in_a_lower_tier(tmp_path, with_shares, tier):
    """Device and the tier both full of a noisy tenant's one-off prompts: with shares, the quiet
    tenant's prefix, pushed off the device, is still in host memory (or on disk) and comes back
    from there."""
    pytest.importorskip("torch")
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    from .tier_engine import GREEDY, TEXT_A, engine_with

    demo = load_model(ensure_demo_checkpoint(tmp_path / "state"))
    shares = (("noisy", 0.25),) if with_shares else ()
    room = {"host": dict(host_bytes=10 * 16 * 2 * 64 * 4 * 2),  # 10 blocks of the demo model
            "disk": dict(disk_bytes=12 * 16_622, disk_path=tmp_path / "d")}[tier]  # 12 of its payloads
    engine, tiered = engine_with(demo, num_blocks=12, settings={"tenant_cache_shares": shares}, **room)
    if tier == "host":
        assert tiered.host.num_slots == 10 and tiered.host.share_of("noisy") == (2 if with_shares else None)
    else:
        assert tiered.layout.payload_bytes == 16_622
    quiet = demo.tokenizer.encode(TEXT_A)
    blocks = (len(quiet) - 1) // 16
    cold = engine.add_request(quiet, GREEDY, tenant="quiet")
    engine.run_until_done()
    for i in range(8):  # one-off documents, each its own chain
        engine.add_request(demo.tokenizer.encode(f"noisy document {i}: " + "x" * 90), GREEDY, tenant="noisy")
        engine.run_until_done()
        tiered.flush()
    warm = engine.add_request(quiet, GREEDY, tenant="quiet")
    engine.run_until_done()
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    if with_shares:  # all of it from the cache: what the device lost, back from the tier
        assert warm.metrics.cached_tokens == blocks * 16 and warm.metrics.restored_tokens >= 4 * 16
    else:  # the flood took it from both
        assert warm.metrics.cached_tokens == warm.metrics.restored_tokens == 0
    assert (getattr(tiered, tier).share_evictions > 0) == with_shares
    engine.cache.audit()
    tiered.close()


def test_kvd_shows_each_tenant_s_host_slots_against_its_share_and_reloads_the_host_s_shares(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from dataclasses import replace

    from rich.console import Console

    from kvctl.daemon.server.fleet_admin import merge_tenant_lists
    from kvctl.requests_cmd import render_tenants
    from kvctl.tiers_cmd import render_tiers

    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, apps, call, start_service, token_table

    block_bytes = 16 * 2 * 64 * 4 * 2  # the demo model's
    service = start_service(tmp_path, num_blocks=12, host_cache_bytes=str(8 * block_bytes), tiering="always",
                            tenant_cache_shares="acme=0.25")  # acme: 2 of the host's 8 slots
    try:
        unix, tcp = apps(service, token_table(tmp_path))

        def complete(token, prompt):
            return cached_tokens(tcp, token, prompt)

        quiet = list(range(1, 50))  # three full blocks
        complete(GLOBEX_TOKEN, quiet)
        for i in range(6):  # acme's one-off prompts: 30 blocks through the 12-block device
            complete(USER_TOKEN, [200 + i] + list(range(1, 80)))
        service.tiers.flush()
        rows = {row["tenant"]: row for row in call(unix, "GET", "/admin/tenants").json()["tenants"]}
        host = service.tiers.host
        assert (rows["acme"]["host_blocks"], rows["acme"]["host_share_blocks"]) == (host.tenant_blocks["acme"], 2)
        # idle room is lent: nobody else wanted the host's slots, so acme's blocks hold all 8
        assert rows["acme"]["host_blocks"] == 8 and rows["globex"]["host_share_blocks"] is None
        assert rows["globex"]["host_blocks"] == host.tenant_blocks.get("globex", 0)
        console = Console(width=160, record=True)
        console.print(render_tenants({"tenants": list(rows.values()), "shares": True, "blocks": 12}))
        text = console.export_text()
        assert " host " in text.splitlines()[0] and " 8/2 " in text
        tiers = call(unix, "GET", "/admin/tiers").json()
        assert tiers["tiers"]["host"]["share_evictions"] == host.share_evictions > 0
        console = Console(width=160, record=True)
        render_tiers(tiers, console)
        assert "share evictions" in console.export_text()
        assert complete(GLOBEX_TOKEN, quiet) == 48  # back from host memory
        _, merged = merge_tenant_lists(["r0", "r1"], [(200, {"tenants": [rows["acme"]], "blocks": 12}),
                                                      (200, {"tenants": [rows["acme"]], "blocks": 12})])
        assert (merged["tenants"][0]["host_blocks"], merged["tenants"][0]["host_share_blocks"]) == \
            (2 * rows["acme"]["host_blocks"], 4)
        service.reload(replace(service.config, tenant_cache_shares=()))
        assert host.shares == {} and call(unix, "GET", "/admin/tenants").json()["tenants"][0]["host_share_blocks"] is None
    finally:
        service.shutdown(1)


# ---- the disk tier ------------------------------------------------------------------------------
def _disk_cache(tmp_path, shares, capacity_blocks=40):
    """A TieredCache with only a disk tier of `capacity_blocks` whole payloads of a small layout."""
    torch = pytest.importorskip("torch")
    from kvctl.daemon.cache.events import EventLog
    from kvctl.daemon.cache.tiers import BlockLayout, DiskTier, TieredCache

    layout = BlockLayout((torch.float16,), 16, 1, 8, "")
    disk = DiskTier(tmp_path / "d", capacity_blocks * layout.payload_bytes, layout, b"S" * 32)
    disk.events = EventLog(1000)
    disk.set_tenant_shares(shares)
    return TieredCache([], layout, b"S" * 32, disk=disk), layout


def _write(tiered, layout, tenants: list[str], tag: int) -> list[bytes]:
    """One group of blocks, the i-th of tenant tenants[i], written to disk; their keys."""
    import torch

    from kvctl.daemon.cache.tiers import BlockMeta

    from .tier_fixtures import block_key

    metas = [BlockMeta(block_key(tag * 100 + i), block_key(tag * 100 + i), 0, None, t) for i, t in enumerate(tenants)]
    k = torch.zeros(len(metas), 16, 1, 8, dtype=torch.float16)
    tiered.copy_to("disk", metas, [(k, k)], src="device")
    return [m.key for m in metas]


@pytest.mark.parametrize("with_shares", [False, True])
def test_a_noisy_tenant_flooding_the_disk_recycles_its_own_segments(tmp_path, with_shares):
    tiered, layout = _disk_cache(tmp_path, (("noisy", 0.25),) if with_shares else ())
    disk = tiered.disk
    quiet = _write(tiered, layout, ["quiet"] * 8, tag=0)
    noisy = [_write(tiered, layout, ["noisy"] * 8, tag=g) for g in range(1, 11)]  # 80 blocks into 40
    held = {k for k in disk.index}
    if with_shares:
        assert disk.shares == {"noisy": 10 * layout.payload_bytes}
        assert set(quiet) <= held  # untouched: noisy, over its share, gave up its own oldest
        assert held == set(quiet) | {k for group in noisy[-4:] for k in group}  # idle room is still lent
        assert disk.share_evictions == 6 * 8
        assert dict(disk.tenant_bytes) == {"quiet": 8 * layout.payload_bytes, "noisy": 32 * layout.payload_bytes}
        removed = disk.events.since(0, kinds=("removed",)).events
        assert {e.reason for e in removed} == {"tenant_share"}
        assert [k for e in removed for k in e.keys] == [k for group in noisy[:6] for k in group]
        assert tiered.report()["tiers"]["disk"]["share_evictions"] == 48
    else:
        assert not set(quiet) & held  # plain LRU: the quiet tenant's segment went first
        assert "share_evictions" not in tiered.report()["tiers"]["disk"]
    # the quiet tenant writes again: the tenant over its share makes the room
    _write(tiered, layout, ["quiet"] * 8, tag=50)
    if with_shares:
        assert set(quiet) <= set(disk.index) and not set(noisy[6]) & set(disk.index)
    tiered.close()


def test_with_disk_shares_a_mixed_group_becomes_one_segment_per_tenant_and_a_restart_knows_whose(tmp_path):
    from kvctl.daemon.cache.tiers import DiskTier

    tiered, layout = _disk_cache(tmp_path, (("a", 0.5),))
    keys = _write(tiered, layout, ["a", "b", "a", None], tag=1)
    disk = tiered.disk
    assert sorted((s.tenant, len(s.keys)) for s in disk.segments.values()) == [("", 1), ("a", 2), ("b", 1)]
    assert dict(disk.tenant_bytes) == {"a": 2 * layout.payload_bytes, "b": layout.payload_bytes,
                                       "": layout.payload_bytes}
    tiered.close()
    again = DiskTier(tmp_path / "d", 40 * layout.payload_bytes, layout, b"S" * 32)
    again.scan()
    assert set(again.index) == set(keys) and dict(again.tenant_bytes) == dict(disk.tenant_bytes)
    again.close()
    plain, _ = _disk_cache(tmp_path / "plain", ())
    _write(plain, layout, ["a", "b", "a", None], tag=1)
    assert [s.tenant for s in plain.disk.segments.values()] == [None]  # no shares: one segment, mixed
    plain.close()


def test_kvd_gives_its_disk_tier_the_shares_and_a_reload_changes_them(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from dataclasses import replace

    from kvctl.daemon.server.fleet_admin import merge_tenant_lists

    from .daemon_fixtures import USER_TOKEN, apps, call, start_service, token_table

    service = start_service(tmp_path, disk_cache_bytes="4MiB", tenant_cache_shares="acme=0.25",
                            write_policy="write_through", tiering="always")
    try:
        assert service.tiers.disk.shares == {"acme": 2**20}
        unix, tcp = apps(service, token_table(tmp_path))
        cached_tokens(tcp, USER_TOKEN, list(range(1, 50)))  # three full blocks, written through to disk
        assert service.tiers.flush(timeout=30)
        payload = service.tiers.layout.payload_bytes
        assert dict(service.tiers.disk.tenant_bytes) == {"acme": 3 * payload}
        rows = {row["tenant"]: row for row in call(unix, "GET", "/admin/tenants").json()["tenants"]}
        assert {k: rows["acme"][k] for k in ("disk_bytes", "disk_share_bytes", "remote_bytes", "remote_share_bytes")} \
            == {"disk_bytes": 3 * payload, "disk_share_bytes": 2**20, "remote_bytes": None, "remote_share_bytes": None}
        metrics = call(unix, "GET", "/metrics").text
        assert f'kvd_tenant_tier_bytes{{tenant="acme",tier="disk"}} {float(3 * payload)}' in metrics
        from rich.console import Console

        from kvctl.requests_cmd import render_tenants
        from kvctl.tables import size

        console = Console(width=80, record=True)
        console.print(render_tenants({"tenants": list(rows.values()), "shares": True, "blocks": 64}))
        text = " ".join(console.export_text().split())
        assert f"disk: acme {size(3 * payload)} of its 1.0 MiB share" in text and "Redis:" not in text
        _, merged = merge_tenant_lists(["r0", "r1"], [(200, {"tenants": [rows["acme"]], "blocks": 64})] * 2)
        assert (merged["tenants"][0]["disk_bytes"], merged["tenants"][0]["disk_share_bytes"]) == (6 * payload, 2**21)
        service.reload(replace(service.config, tenant_cache_shares=(("acme", 0.5), ("*", 0.25))))
        assert service.tiers.disk.shares == {"acme": 2 * 2**20, "*": 2**20}
        service.reload(replace(service.config, tenant_cache_shares=()))
        assert service.tiers.disk.shares == {}
        assert call(unix, "GET", "/admin/tenants").json()["tenants"][0]["disk_share_bytes"] is None
    finally:
        service.shutdown(deadline=2)


def test_kvctl_tenants_names_the_tenants_holding_most_of_each_lower_tier():
    from kvctl.requests_cmd import _lower_tier_line

    rows = [{"tenant": f"t{i}", "remote_bytes": i * 2**20, "remote_share_bytes": 4 * 2**20 if i == 6 else None,
             "disk_bytes": None} for i in range(8)]
    assert _lower_tier_line(rows, "remote", "Redis") == (
        "Redis: t7 7.0 MiB, t6 6.0 MiB of its 4.0 MiB share, t5 5.0 MiB, t4 4.0 MiB, t3 3.0 MiB, and 2 more")
    assert _lower_tier_line(rows, "disk", "disk") is None  # no disk tier there
    assert _lower_tier_line([{"tenant": "a", "disk_bytes": 0}], "disk", "disk") is None  # it holds nothing

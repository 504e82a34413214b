"""The live hit curve (daemon/cache/hit_curve.py) against an LRU prefix cache simulated block by block."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import pytest

from kvctl.daemon.cache.hit_curve import MAX_ALONE, SPACE, HitCurve, alone_tenants, sizes_for


def key(name) -> bytes:
    return hashlib.sha256(str(name).encode()).digest()


class LruPrefixCache:
    """What the curve models, the slow way: an LRU cache of `capacity` blocks that a prompt is
    served from up to the first block it lacks; every block used goes to the front."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.blocks, self.hits = capacity, OrderedDict(), 0

    def look(self, keys) -> None:
        served = True
        for k in keys:
            served = served and k in self.blocks
            self.hits += served
            self.use(k)

    def use(self, k) -> None:
        self.blocks[k] = None
        self.blocks.move_to_end(k)
        if self.capacity is not None and len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def touch(self, keys) -> None:
        for k in keys:
            self.use(k)


def chains(rng: random.Random, prompts: int, prefixes: int = 12, tails: int = 40):
    """Prompts that share system prompts (chains of 1-6 blocks) and end in a tail of their own."""
    roots = [[key(("p", p, i)) for i in range(rng.randint(1, 6))] for p in range(prefixes)]
    for n in range(prompts):
        prefix = roots[min(int(rng.paretovariate(1.2)) - 1, prefixes - 1)]
        tail = [key(("t", rng.randrange(tails), i)) for i in range(rng.randint(0, 3))]
        reply = [key(("r", n, i)) for i in range(rng.randint(0, 2))]
        yield prefix + tail, reply


def test_hit_blocks_match_an_lru_cache_of_every_size_exactly_while_every_key_is_tracked():
    sizes = [("a", 1), ("b", 2), ("c", 5), ("d", 13), ("e", 40), ("f", 200), ("inf", None)]
    curve, caches = HitCurve(sizes, exact_keys=10_000), [LruPrefixCache(blocks) for _, blocks in sizes]
    looked = 0
    for prompt, reply in chains(random.Random(7), 600):
        curve.look(prompt, prompt_tokens=16 * len(prompt) + 5)
        curve.touch(reply)
        looked += len(prompt)
        for cache in caches:
            cache.look(prompt)
            cache.touch(reply)
    assert curve.rate == 1.0
    assert curve.hit_blocks == [float(cache.hits) for cache in caches]
    assert curve.looked_blocks == looked
    assert curve.prompts == 600
    figures = curve.figures(block_size=16)
    assert [row["hit_tokens"] for row in figures["sizes"]] == [16 * cache.hits for cache in caches]
    assert [row["blocks"] for row in figures["sizes"]] == [1, 2, 5, 13, 40, 200, None]
    assert figures["looked_tokens"] == 16 * looked
    # the curve rises with the size, and an unbounded cache misses only blocks never seen before
    hits = [cache.hits for cache in caches]
    assert hits == sorted(hits) and hits[0] < hits[-1]


def test_a_chain_is_served_up_to_its_first_block_the_cache_has_let_go():
    a1, a2, b1, c1 = key("a1"), key("a2"), key("b1"), key("c1")
    curve = HitCurve([("2", 2), ("3", 3), ("inf", None)])
    curve.look([a1, a2], 40)  # first use: nothing is served
    curve.look([b1], 20)
    curve.look([a1, a2], 40)  # a1 was last used 2 blocks ago (a2, b1), a2 2 ago (b1, a1)
    assert curve.hit_blocks == [0, 2, 2]
    curve.look([c1, a1], 40)  # c1 was never seen: a1 behind it is not served, though held at 3
    assert curve.hit_blocks == [0, 2, 2]
    curve.touch([b1])  # a reply's block is used, not counted
    curve.look([b1], 20)  # used 0 blocks ago
    assert curve.hit_blocks == [1, 3, 3]
    assert curve.prompt_tokens == 160 and curve.looked_blocks == 8


def test_times_are_renumbered_without_changing_a_distance():
    rng = random.Random(3)
    names = [key(i) for i in range(15)]
    curve, cache = HitCurve([("4", 4), ("9", 9)], exact_keys=16, sampled_keys=1), [LruPrefixCache(4), LruPrefixCache(9)]
    for _ in range(1_000):  # times run out every 68 uses: renumbered about 40 times
        prompt = rng.sample(names, rng.randint(1, 3))
        curve.look(prompt, 48)
        for c in cache:
            c.look(prompt)
    assert curve.rate == 1.0 and curve.tracked == 15
    assert curve.hit_blocks == [float(cache[0].hits), float(cache[1].hits)]


def test_older_keys_are_kept_only_under_the_threshold_which_falls_as_they_fill():
    curve = HitCurve([("10", 10), ("inf", None)], exact_keys=10, sampled_keys=50)
    keys = [key(("k", i)) for i in range(400)]
    curve.look(keys, 400 * 16)
    assert list(curve._recent) == keys[-10:]  # the 10 most recent, all kept
    hashes = sorted(int.from_bytes(k[:8], "big") for k in keys[:-10])
    assert curve.threshold in hashes  # the highest older key let go last
    assert curve.rate == curve.threshold / SPACE < 0.5
    assert set(curve._sampled) == {k for k in keys[:-10] if int.from_bytes(k[:8], "big") < curve.threshold}
    assert len(curve._sampled) == 50 and curve.tracked == 60
    before = curve.looked_blocks
    curve.look(keys[:5], 80)  # older keys: the sampled count for 1/rate uses each, the others not at all
    sampled = sum(k in curve._recent and int.from_bytes(k[:8], "big") < curve.threshold for k in keys[:5])
    assert curve.looked_blocks - before == pytest.approx(sampled / curve.rate)
    fresh = (key(("new", i)) for i in range(1_000))
    under = next(k for k in fresh if int.from_bytes(k[:8], "big") < curve.threshold)
    over = next(k for k in fresh if int.from_bytes(k[:8], "big") >= curve.threshold)
    before, rate, hits = curve.looked_blocks, curve.rate, list(curve.hit_blocks)
    curve.look([under], 16)  # a first use sampled: counted for 1/rate (the rate it was used at), a miss
    assert curve.looked_blocks == pytest.approx(before + 1 / rate)
    assert curve.hit_blocks == hits
    before = curve.looked_blocks
    curve.look([over], 16)  # a first use not sampled: not counted
    assert curve.looked_blocks == before and curve.hit_blocks == hits


def test_a_sampled_curve_is_exact_up_to_its_recent_keys_and_near_beyond():
    """200 recent keys and 500 older ones (a 5% sample of 13,000) against every key kept:
    the same hit blocks at sizes up to 200, and each larger size's hit ratio within 0.04 of the
    exact one (SHARDS reports mean absolute errors under 0.01 at a 1% sample of real traces;
    here a chain's sampled maximum stands for the chain's, and seeds 11-13 err 0.025 at most)."""
    sizes = [(str(b), b) for b in (50, 200, 800, 3_200)] + [("inf", None)]
    exact, sampled = HitCurve(sizes, exact_keys=100_000), HitCurve(sizes, exact_keys=200, sampled_keys=500)
    for prompt, reply in chains(random.Random(11), 6_000, prefixes=400, tails=2_000):
        for curve in (exact, sampled):
            curve.look(prompt, 16 * len(prompt))
            curve.touch(reply)
    assert exact.rate == 1.0 and 0.03 < sampled.rate < 0.07
    assert sampled.hit_blocks[:2] == exact.hit_blocks[:2]
    assert sampled.looked_blocks == pytest.approx(exact.looked_blocks, rel=0.03)
    for hit_exact, hit_sampled in zip(exact.hit_blocks[2:], sampled.hit_blocks[2:]):
        assert hit_sampled / exact.looked_blocks == pytest.approx(hit_exact / exact.looked_blocks, abs=0.04)


def test_sizes_are_multiples_of_the_device_blocks_then_unbounded():
    assert sizes_for(1_000) == [("0.125", 125), ("0.25", 250), ("0.5", 500), ("1", 1_000), ("2", 2_000),
                                ("4", 4_000), ("8", 8_000), ("16", 16_000), ("32", 32_000), ("64", 64_000),
                                ("inf", None)]
    assert sizes_for(4, times=(0.125, 1))[0] == ("0.125", 1)  # at least a block
    # block counts of other cache formats: their own sizes where no multiple is, ascending
    assert sizes_for(1_000, times=(0.5, 1, 2), extra=[1_940, 2_000, 333]) == [
        ("0.333", 333), ("0.5", 500), ("1", 1_000), ("1.94", 1_940), ("2", 2_000), ("inf", None)]


def test_bad_sizes_and_sample_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"sizes: must ascend, got \[4, 2\]"):
        HitCurve([("a", 4), ("b", 2)])
    with pytest.raises(ValueError, match="exact_keys: must be a whole number of at least 1, got 0"):
        HitCurve([("a", 4)], exact_keys=0)
    with pytest.raises(ValueError, match="sampled_keys: must be a whole number of at least 1, got 2.5"):
        HitCurve([("a", 4)], sampled_keys=2.5)


def test_each_tenant_s_part_of_the_curve_adds_up_to_the_whole():
    """Each block counts for the tenant whose prompt looked it up, at the size the shared LRU
    cache would have held it: the tenants' figures sum to the curve's at every size."""
    sizes = [("1", 1), ("2", 2), ("5", 5), ("13", 13), ("inf", None)]
    curve = HitCurve(sizes, exact_keys=10_000, tenants=10)
    caches = {tenant: [LruPrefixCache(blocks) for _, blocks in sizes] for tenant in ("acme", "globex")}
    shared = [LruPrefixCache(blocks) for _, blocks in sizes]
    rng = random.Random(5)
    tokens = {"acme": 0, "globex": 0}
    for prompt, reply in chains(rng, 300):
        tenant = rng.choice(("acme", "globex"))
        curve.look(prompt, 16 * len(prompt) + 3, tenant)
        curve.touch(reply)
        tokens[tenant] += 16 * len(prompt) + 3
        for own, cache in zip(caches[tenant], shared):  # the shared cache's hits for this tenant's prompt
            before = cache.hits
            cache.look(prompt)
            cache.touch(reply)
            own.hits += cache.hits - before
    figures = curve.tenant_figures(block_size=16)
    for tenant in ("acme", "globex"):
        mine = figures["tenants"][tenant]
        assert mine["hit_tokens"] == {label: 16 * cache.hits for (label, _), cache in zip(sizes, caches[tenant])}
        assert mine["prompt_tokens"] == tokens[tenant]
    whole = curve.figures(block_size=16)
    assert [sum(figures["tenants"][t]["hit_tokens"][row["times"]] for t in tokens) for row in whole["sizes"]] \
        == [row["hit_tokens"] for row in whole["sizes"]]
    assert sum(figures["tenants"][t]["prompts"] for t in tokens) == 300
    assert sum(figures["tenants"][t]["looked_tokens"] for t in tokens) == whole["looked_tokens"]
    assert figures["retired"]["prompts"] == 0 and figures["retired"]["tenants"] == 0


def test_the_least_recently_active_tenant_is_retired_into_one_sum_and_none_is_followed_without_a_book():
    a, b = key("a"), key("b")
    curve = HitCurve([("4", 4), ("inf", None)], tenants=1)
    curve.look([a], 20, "acme")
    curve.look([a], 20, "acme", served_tokens=16)  # a hit at every size, and kvd served it
    curve.look([b], 16, "globex")  # acme is retired
    figures = curve.tenant_figures(block_size=16)
    assert figures["tenants"] == {"globex": {"prompts": 1, "prompt_tokens": 16, "served_tokens": 0,
                                             "looked_tokens": 16, "hit_tokens": {"4": 0, "inf": 0}}}
    assert figures["retired"] == {"tenants": 1, "prompts": 2, "prompt_tokens": 40, "served_tokens": 16,
                                  "looked_tokens": 32, "hit_tokens": {"4": 16, "inf": 16}}
    curve.look([a], 20)  # a prompt without a tenant counts in the whole only
    assert curve.tenant_figures(16)["tenants"]["globex"]["prompts"] == 1 and curve.prompts == 4
    plain = HitCurve([("4", 4), ("inf", None)])
    plain.look([a], 20, "acme")
    assert plain.tenant_figures(16) is None and plain.hit_blocks == [0, 0]


def test_recent_windows_are_the_counts_since_the_mark_a_window_old_or_since_the_start():
    """The counts are marked at the first prompt a minute or more after the last mark; a window
    is the counts now less those of the latest mark at least that old (the first mark, at the
    start, while the curve is younger)."""
    now = [1_000.0]
    a, b = key("a"), key("b")
    curve = HitCurve([("4", 4), ("inf", None)], clock=lambda: now[0])
    curve.look([a, b], 40, served_tokens=0)
    now[0] += 200
    curve.look([a, b], 40, served_tokens=32)  # marked first (at 1,200: one prompt so far)
    five, hour = curve.figures(block_size=16)["recent"]
    assert (five["window"], five["seconds"], hour["window"], hour["seconds"]) == (300, 200.0, 3600, 200.0)
    assert five["prompts"] == hour["prompts"] == 2  # younger than either window: since the start
    now[0] += 150  # 350 s in: the five minutes go back to the mark at 1,000 still
    assert curve.figures(16)["recent"][0]["seconds"] == 350.0
    now[0] += 200  # 550 s in: the mark at 1,200 is the latest at least 300 s old
    curve.look([a], 20, served_tokens=16)  # marked at 1,550 first
    five, hour = curve.figures(16)["recent"]
    assert (five["seconds"], five["prompts"], five["prompt_tokens"], five["served_tokens"]) == (350.0, 2, 60, 48)
    assert five["sizes"] == [{"times": "4", "blocks": 4, "hit_tokens": 48}, {"times": "inf", "blocks": None,
                                                                             "hit_tokens": 48}]
    assert (hour["seconds"], hour["prompts"], hour["served_tokens"]) == (550.0, 3, 48)
    whole = curve.figures(16)
    assert (whole["prompts"], whole["served_tokens"], whole["sizes"][0]["hit_tokens"]) == (3, 48, 48)
    for _ in range(100):  # two hours of a prompt a minute: 61 marks kept, the hour's from an hour ago
        now[0] += 72
        curve.look([b], 20)
    five, hour = curve.figures(16)["recent"]
    assert (five["seconds"], five["prompts"]) == (360.0, 6)  # a mark is made before its prompt counts
    assert (hour["seconds"], hour["prompts"]) == (3600.0, 51)
    assert len(curve._marks) == 61


def test_whole_hit_tokens_round_down_so_that_a_retired_sum_never_counts_fewer_than_its_parts():
    curve = HitCurve([("1", 4), ("2", 8), ("inf", None)], tenants=2)
    a, b = [0.6, 0.3, 0.0] + [0.0] * 5, [0.7, 0.2, 0.5] + [0.0] * 5
    assert (curve.whole_hit_tokens(a, "1", 16), curve.whole_hit_tokens(a, "2", 16)) == (0, 0)
    assert (curve.whole_hit_tokens(b, "2", 16), curve.whole_hit_tokens(b, "inf", 16)) == (0, 16)
    both = [x + y for x, y in zip(a, b)]  # a tenant's row added to the retired sum
    for label in ("1", "2", "inf"):
        assert curve.whole_hit_tokens(both, label, 16) >= curve.whole_hit_tokens(a, label, 16) \
            + curve.whole_hit_tokens(b, label, 16)
    assert curve.whole_hit_tokens(both, "2", 16) == 16


def test_a_tenant_followed_alone_gets_the_curve_of_a_cache_of_its_own():
    """Its own prompts and replies in an LRU cache of its own at shares of the device's blocks,
    against one simulated block by block; the other tenants' blocks do not push its own out."""
    curve = HitCurve(sizes_for(40), tenants=10)
    curve.follow_alone(["acme"], device_blocks=40)
    alone = curve.alone["acme"]
    assert [(label, blocks) for label, blocks in zip(alone.labels, alone.sizes)] == [
        ("0.0625", 2), ("0.125", 5), ("0.25", 10), ("0.5", 20), ("0.75", 30), ("1", 40), ("inf", float("inf"))]
    caches = [LruPrefixCache(blocks) for blocks in (2, 5, 10, 20, 30, 40, None)]
    rng = random.Random(11)
    for prompt, reply in chains(rng, 400):
        tenant = rng.choice(("acme", "globex"))
        curve.look(prompt, 16 * len(prompt), tenant, served_tokens=16)
        curve.touch(reply, tenant)
        if tenant == "acme":
            for cache in caches:
                cache.look(prompt)
                cache.touch(reply)
    figures = curve.tenant_figures(16)
    assert figures["alone"]["acme"]["hit_tokens"] == {
        label: 16 * cache.hits for label, cache in zip(alone.labels, caches)}
    assert figures["alone"]["acme"]["prompts"] == figures["tenants"]["acme"]["prompts"]
    assert figures["alone"]["acme"]["served_tokens"] == figures["tenants"]["acme"]["served_tokens"]
    assert figures["alone_sizes"][0] == {"times": "0.0625", "blocks": 2}
    # alone, acme keeps more than in the cache it shares with globex at the same size
    shared = figures["tenants"]["acme"]["hit_tokens"]
    assert figures["alone"]["acme"]["hit_tokens"]["1"] >= shared["1"]
    curve.follow_alone(["acme", "globex"], device_blocks=40)  # acme keeps its curve; globex starts one
    assert curve.alone["acme"] is alone and curve.alone["globex"].prompts == 0
    curve.follow_alone([], device_blocks=40)
    assert curve.alone == {} and curve.tenant_figures(16)["alone_sizes"] == []
    with pytest.raises(ValueError, match=f"hit_curve_tenants: at most {MAX_ALONE} tenants, got 9"):
        curve.follow_alone([f"t{i}" for i in range(9)], device_blocks=40)


def test_the_tenants_followed_alone_are_those_named_or_else_those_with_shares():
    assert alone_tenants(("docs",), (("acme", 0.5), ("*", 0.5))) == ["docs"]
    assert alone_tenants((), (("globex", 0.25), ("acme", 0.5), ("*", 0.25))) == ["acme", "globex"]
    many = tuple((f"t{i:02d}", 0.01) for i in range(12))
    assert alone_tenants((), many) == [f"t{i:02d}" for i in range(MAX_ALONE)]


def test_a_tenant_followed_alone_has_recent_windows_of_its_own_curve():
    """Its curve alone is marked a minute apart as the whole curve is: `--tenant T --last 5m` sizes
    its share by what its traffic needs now. A snapshot of one tenant copies that tenant's alone."""
    now = [1_000.0]
    curve = HitCurve(sizes_for(40), tenants=10, clock=lambda: now[0])
    curve.follow_alone(["acme"], device_blocks=40)
    a, b, c, d = key("a"), key("b"), key("c"), key("d")
    curve.look([a, b], 40, "acme", served_tokens=0)
    curve.look([c], 20, "globex")
    now[0] += 400
    curve.look([a, b], 40, "acme", served_tokens=32)  # its curve marked first (one prompt so far)
    now[0] += 400
    curve.look([d], 20, "acme")  # marked at 1,800 first: the five minutes go back to the mark at 1,400
    alone = curve.figures_of(curve.tenant_snapshot(), 16)["alone"]["acme"]
    five, hour = alone["recent"]
    assert (five["window"], five["seconds"], five["prompts"], five["prompt_tokens"], five["served_tokens"]) \
        == (300, 400.0, 2, 60, 32)
    assert set(five["hit_tokens"].values()) == {32}  # a's and b's blocks, held at every share
    assert (hour["window"], hour["seconds"], hour["prompts"], hour["prompt_tokens"]) == (3600, 800.0, 3, 100)
    assert hour["hit_tokens"] == alone["hit_tokens"]
    assert curve.figures_of(curve.tenant_snapshot("globex"), 16)["alone"] == {}
    assert list(curve.figures_of(curve.tenant_snapshot("acme"), 16)["alone"]) == ["acme"]

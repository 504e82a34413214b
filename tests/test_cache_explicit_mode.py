"""OpenAI's `prompt_cache_options.mode: "explicit"`: a request's prompt is cached only up to its
longest marked prefix, none of it where it marks none. The blocks past that point are hashed as
the request's own (PrefixHasher's `private`): nothing there is read from the cache or left there
for another request, while its own samples still share them."""

from __future__ import annotations

import contextlib
import time

import pytest

from kvctl.daemon.cache import Namespace, PrefixHasher, chain_keys

PROMPT = list(range(100, 140))  # ten blocks of 4
ACME = Namespace(block_size=4, tenant="acme")


def test_keys_past_the_private_point_are_the_request_s_own_and_those_before_are_everyone_s():
    plain = chain_keys(ACME, PROMPT)
    mine = PrefixHasher(ACME, private=(3, b"nonce-a")).feed(PROMPT)
    assert mine[:3] == plain[:3] and all(a != b for a, b in zip(mine[3:], plain[3:]))
    theirs = PrefixHasher(ACME, private=(3, b"nonce-b")).feed(PROMPT)
    assert theirs[:3] == plain[:3] and not set(theirs[3:]) & set(mine[3:])
    assert PrefixHasher(ACME, private=(3, b"nonce-a")).feed(PROMPT) == mine  # its own recompute finds them
    none_shared = PrefixHasher(ACME, private=(0, b"nonce-a")).feed(PROMPT)
    assert not set(none_shared) & set(plain)
    fed = PrefixHasher(ACME, private=(3, b"nonce-a"))
    pieces = fed.feed(PROMPT[:10])
    twin = fed.copy()  # (a forked sample continues as its parent would)
    assert pieces + fed.feed(PROMPT[10:]) == mine and twin.feed(PROMPT[10:]) == mine[2:]
    assert (twin.private, PrefixHasher(ACME).private) == ((3, b"nonce-a"), None)


QUESTION = "Which replica holds the most pinned blocks, and why does it matter for the fleet? " * 3


def ask(system: str, mode: str | None, marked: bool = True, **extra) -> dict:
    system_part = {"type": "text", "text": system}
    if marked:
        system_part["prompt_cache_breakpoint"] = {"mode": "explicit"}
    body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "system", "content": [system_part]}, {"role": "user", "content": QUESTION}], **extra}
    if mode is not None:
        body["prompt_cache_options"] = {"mode": mode}
    return body


def cached(unix, body) -> int:
    from .daemon_fixtures import call

    answer = call(unix, "POST", "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def kvd(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, start_service, token_table

    service = start_service(tmp_path, num_blocks=256)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


def test_explicit_mode_with_no_mark_reads_nothing_from_the_cache_and_leaves_nothing_there(kvd):
    from .daemon_fixtures import blocks_all_back
    from .test_cache_breakpoints import SYSTEM

    service, unix = kvd
    unmarked = ask(SYSTEM, "explicit", marked=False)
    assert [cached(unix, unmarked), cached(unix, unmarked)] == [0, 0]
    assert cached(unix, ask(SYSTEM, None, marked=False)) == 0  # what it computed is no one else's either
    assert cached(unix, ask(SYSTEM, None, marked=False)) > 0  # (as kvd caches any other request's)
    assert service.engine.stats.breakpoints == {}  # nothing marked, nothing held
    assert blocks_all_back(service)
    from .daemon_fixtures import call

    from .test_sleep import kvctl_on

    evicted = service.status()["evictions"]["private"]  # its blocks went as each of the two ended
    scraped = call(unix, "GET", "/metrics").text.splitlines()
    assert evicted > 0 and f'kvd_evicted_blocks_total{{reason="private"}} {evicted}.0' in scraped
    assert {'kvd_prompt_cache_explicit_requests_total{why="asked"} 2.0',
            'kvd_prompt_cache_explicit_requests_total{why="tenant"} 0.0'} <= set(scraped)
    code, out = kvctl_on(unix, ["status"])
    assert code == 0 and (f", {evicted:,} requests' own as they ended (explicit prompt cache mode) "
                          in " ".join(out.split()) + " ")


def demo_engine(tmp_path):
    """The demo checkpoint's engine (64 blocks of 16), a prompt of five blocks or more, and greedy
    sampling of 8 tokens."""
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    demo = load_model(ensure_demo_checkpoint(tmp_path))
    ids = demo.tokenizer.encode("Operators pin hot prefixes such as system prompts, and evict the rest. " * 6)
    return Engine(demo, EngineSettings(num_blocks=64, block_size=16)), ids, SamplingParams(max_tokens=8,
                                                                                            ignore_eos=True)


def test_the_engine_indexes_a_private_tail_under_the_request_s_own_keys_shares_it_and_drops_it_at_the_end(
        tmp_path):
    pytest.importorskip("torch")
    import dataclasses

    engine, ids, greedy = demo_engine(tmp_path)
    assert len(ids) >= 5 * 16
    private = (2, b"request-own-nonce")
    namespace = engine.namespace("default")
    own = PrefixHasher(namespace, private=private).feed(ids)
    plain = chain_keys(namespace, ids)
    usable = engine.cache.cacheable_blocks(len(ids))
    request = engine.add_request(ids, dataclasses.replace(greedy, n=2, extra={"cache_private": private}))
    shared, found = 0, []
    for _ in range(1_000):
        if not engine.has_work():
            break
        engine.step()
        if len(request.sequences) == 2 and engine.cache.num_sequences == 2:  # both samples hold the prompt
            shared = max(shared, engine.cache.state_counts()["shared"])
            found.append((engine.cache.lookup(own, len(ids)), engine.cache.lookup(plain, len(ids))))
    engine.cache.audit()
    # while it ran: its recompute would have found all of it; another request, the two blocks before
    assert found and set(found) == {(usable, 2)}
    assert shared >= usable  # its two samples shared the prompt's blocks, the private ones too
    assert [len(s.output_ids) for s in request.sequences] == [8, 8]
    # as it ended, its own blocks went (the reason says why); the two before stay cached for everyone
    assert engine.cache.lookup(own, len(ids)) == engine.cache.lookup(plain, len(ids)) == 2
    assert engine.cache.state_counts()["cached"] == 2
    assert engine.cache.pool.private_evictions >= usable - 2  # (the prompt's own, and any full block of a reply)
    dropped = engine.cache.pool.private_evictions
    alone = engine.add_request(ids, greedy)  # (the same output as a request hashed as everyone's)
    while engine.has_work():
        engine.step()
    assert request.sequences[0].output_ids == alone.sequences[0].output_ids
    before = engine.cache.state_counts()
    waiting = engine.add_request(ids, dataclasses.replace(greedy, extra={"cache_private": private}))
    assert [(e.finish_reason, e.token_id) for e in engine.cancel(waiting.request_id)] == [("cancelled", None)]
    engine.cache.audit()  # cancelled before it held a block: nothing of its own to drop, nothing else touched
    assert engine.cache.state_counts() == before and engine.cache.pool.private_evictions == dropped


def test_explicit_mode_caches_the_prompt_up_to_its_longest_mark_and_no_further(kvd):
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service, unix = kvd
    marked = held_tokens(service, SYSTEM)
    explicit = ask(SYSTEM, "explicit")
    assert cached(unix, explicit) == 0
    assert cached(unix, explicit) == marked  # the marked prefix, held; not the question after it
    assert service.engine.stats.breakpoints == {"held": 1, "extended": 1}
    other = "You are the careful assistant of the platform team; answer in a sentence. " * 4
    implicit = ask(other, "implicit")
    cached(unix, implicit)
    again = cached(unix, implicit)
    assert again > held_tokens(service, other) + 2 * service.config.block_size  # the question too


def test_ignore_serves_explicit_mode_as_kvd_caches_any_request(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, start_service, token_table
    from .test_cache_breakpoints import SYSTEM

    service = start_service(tmp_path, num_blocks=256, prompt_cache_breakpoints="ignore")
    try:
        unix = apps(service, token_table(tmp_path))[0]
        unmarked = ask(SYSTEM, "explicit", marked=False)
        assert cached(unix, unmarked) == 0 and cached(unix, unmarked) > 0
    finally:
        service.shutdown(1)



def test_a_preempted_sample_finds_the_request_s_own_blocks_again_and_they_go_as_its_last_sample_ends(tmp_path):
    pytest.importorskip("torch")
    import dataclasses

    from kvctl.daemon.engine.requests import SeqStatus

    engine, ids, greedy = demo_engine(tmp_path)
    namespace = engine.namespace("default")
    usable = engine.cache.cacheable_blocks(len(ids))

    def own_hits(private) -> int:
        return engine.cache.lookup(PrefixHasher(namespace, private=private).feed(ids), len(ids))

    private = (2, b"request-own-nonce")
    request = engine.add_request(ids, dataclasses.replace(greedy, n=2, extra={"cache_private": private}))
    while engine.cache.num_sequences < 2 or any(len(s.output_ids) < 2 for s in request.sequences):
        engine.step()
    first, second = request.sequences
    settings = engine.settings
    engine.settings = dataclasses.replace(settings, max_running=1)  # (no room to come back while its sibling runs)
    engine._preempt(second)  # as a full cache would
    while first.status is not SeqStatus.FINISHED:
        engine.step()
    assert second.status is SeqStatus.WAITING and engine.cache.pool.private_evictions == 0
    assert own_hits(private) == usable  # its sibling ended; what is its request's own stays for it
    engine.settings = settings
    while engine.has_work():
        engine.step()
    engine.cache.audit()
    assert request.metrics.preemptions == 1 and second.output_ids == first.output_ids
    assert request.metrics.recomputed_tokens < 16  # its prompt found again, its own blocks too
    assert own_hits(private) == 2 and engine.cache.state_counts()["cached"] == 2  # the last gone, the rest too
    assert engine.cache.pool.private_evictions >= usable - 2
    dropped = engine.cache.pool.private_evictions

    # preempted, and cancelled while it waits for its turn again: what it wrote goes all the same
    alone = (2, b"another-nonce")
    waiting = engine.add_request(ids, dataclasses.replace(greedy, extra={"cache_private": alone}))
    while len(waiting.sequences[0].output_ids) < 2:
        engine.step()
    engine._preempt(waiting.sequences[0])
    assert own_hits(alone) == usable
    engine.cancel(waiting.request_id)
    engine.cache.audit()
    assert own_hits(alone) == 2 and engine.cache.state_counts()["cached"] == 2
    assert engine.cache.pool.private_evictions >= dropped + usable - 2


# ---- the operator's: a tenant served in explicit mode whatever it asks ---------------------------
def test_prompt_cache_explicit_tenants_is_checked_where_it_is_given():
    from kvctl.daemon.config import ConfigError, resolve

    assert resolve({"prompt_cache_explicit_tenants": "acme, globex"}, env={}).prompt_cache_explicit_tenants == (
        "acme", "globex")
    assert resolve({}, env={"KVD_PROMPT_CACHE_EXPLICIT_TENANTS": "*"}).prompt_cache_explicit_tenants == ("*",)
    with pytest.raises(ConfigError, match=r"prompt_cache_explicit_tenants: invalid value .*tenant 'a b' is not a "
                                          r"tenant name \(letters, digits, \. _ -\) or \*"):
        resolve({"prompt_cache_explicit_tenants": "acme,a b"}, env={})


def test_a_tenant_the_operator_serves_in_explicit_mode_leaves_nothing_cached_and_others_are_served_as_always(
        tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.config import resolve

    from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, apps, call, start_service, token_table
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service = start_service(tmp_path, num_blocks=256, prompt_cache_explicit_tenants="acme")
    try:
        _, tcp = apps(service, token_table(tmp_path))

        def cached_for(token: str, body: dict, path: str = "/v1/chat/completions") -> int:
            answer = call(tcp, "POST", path, json=body, headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        unmarked = ask(SYSTEM, None, marked=False)
        assert [cached_for(USER_TOKEN, unmarked), cached_for(USER_TOKEN, unmarked)] == [0, 0]  # acme: as it asked none
        prompt = {"prompt": SYSTEM + QUESTION, "max_tokens": 2, "ignore_eos": True}
        assert [cached_for(USER_TOKEN, prompt, "/v1/completions"),
                cached_for(USER_TOKEN, prompt, "/v1/completions")] == [0, 0]  # a completion too
        marked = ask(SYSTEM, "implicit")  # what acme marks is cached, whatever mode it names
        assert [cached_for(USER_TOKEN, marked), cached_for(USER_TOKEN, marked)] == [0, held_tokens(service, SYSTEM)]
        assert cached_for(ADMIN_TOKEN, unmarked) == 0 and cached_for(ADMIN_TOKEN, unmarked) > held_tokens(
            service, SYSTEM)  # tenant ops: as always
        service.config_source = lambda: resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"),
                                                 "num_blocks": 256}, env={})
        changed = service.reload_from_source("test")  # live: acme is served as it asks from now on
        assert "prompt_cache_explicit_tenants" in str(changed)
        assert service.explicit_requests == {"asked": 0, "tenant": 6}  # acme's six: its tenant's, whatever it asked
        rows = {row["tenant"]: row for row in call(tcp, "GET", "/admin/tenants", headers={
            "Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["tenants"]}
        assert {tenant: row["explicit_requests"] for tenant, row in rows.items()} == {"acme": 6, "ops": 0}
        assert 'kvd_tenant_explicit_requests_total{tenant="acme"} 6.0' in call(
            tcp, "GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text.splitlines()
        from rich.console import Console

        from kvctl.requests_cmd import render_tenants

        shown = Console(width=200, record=True)
        shown.print(render_tenants({"tenants": list(rows.values()), "blocks": 256}))
        assert ("served in explicit prompt cache mode (their hits stop at their marked breakpoints): acme 6 requests"
                in shown.export_text().splitlines())
        held = held_tokens(service, SYSTEM)  # (acme's marked prefix, held from before)
        assert cached_for(USER_TOKEN, unmarked) == held and cached_for(USER_TOKEN, unmarked) > held
    finally:
        service.shutdown(1)


def test_no_lower_tier_gets_a_request_s_own_blocks(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service = start_service(tmp_path, num_blocks=256, disk_cache_bytes="16MiB", tiering="always",
                            write_policy="write_through")
    try:
        unix = apps(service, token_table(tmp_path))[0]

        def on_disk() -> int:
            assert service.tiers.flush(timeout=10)
            return call(unix, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"]

        cached(unix, ask(SYSTEM, "explicit", marked=False))
        assert on_disk() == 0  # written through as it ran: none of it, its own
        cached(unix, ask(SYSTEM, "explicit", prompt_cache_retention="24h"))  # (retention keeps no own block either)
        assert on_disk() == held_tokens(service, SYSTEM) // service.config.block_size  # the marked prefix alone
        other = "You are the careful assistant of the platform team; answer in a sentence. " * 4
        before = on_disk()
        cached(unix, ask(other, None, marked=False))
        assert on_disk() - before > held_tokens(service, other) // service.config.block_size + 2  # all of it
    finally:
        service.shutdown(1)


# ---- the "why did this miss?" explainer, for a request in explicit mode -----------------------------
def explained(unix, **body) -> dict:
    from .daemon_fixtures import call

    answer = call(unix, "POST", "/admin/explain", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_explain_caps_the_hits_of_a_request_in_explicit_mode_at_its_marked_prefix_and_says_why(kvd):
    from .daemon_fixtures import call
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service, unix = kvd
    size = service.config.block_size
    cached(unix, ask(SYSTEM, None, marked=False))  # an ordinary request: the whole prompt cached
    whole = explained(unix, messages=ask(SYSTEM, None)["messages"])
    assert whole["prompt_cache"] == {"mode": "implicit"}
    assert whole["hit_blocks"] == whole["full_blocks"] - (whole["prompt_tokens"] % size == 0)
    assert whole["first_miss"]["reason"] in ("partial_block", "last_token_computed")

    held = held_tokens(service, SYSTEM) // size
    marked = explained(unix, **{key: value for key, value in ask(SYSTEM, "explicit").items()
                                if key in ("messages", "prompt_cache_options")})
    assert (marked["hit_blocks"], marked["hit_tokens"]) == (held, held * size)
    assert marked["prompt_cache"] == {"mode": "explicit", "why": "asked", "shared_blocks": held}
    assert marked["first_miss"] == {
        "block": held, "reason": "explicit_mode",
        "detail": "the request asks for explicit prompt cache mode (prompt_cache_options.mode): only its longest "
                  f"marked prefix's {held} full blocks ({held * size} tokens) are read from the cache; what follows "
                  "is its own, and leaves the cache as it ends"}
    unmarked = explained(unix, messages=ask(SYSTEM, None, marked=False)["messages"],
                         prompt_cache_options={"mode": "explicit"})
    assert (unmarked["hit_blocks"], unmarked["prompt_cache"]["shared_blocks"]) == (0, 0)
    assert unmarked["first_miss"] == {
        "block": 0, "reason": "explicit_mode",
        "detail": "the request asks for explicit prompt cache mode (prompt_cache_options.mode), and it marks no "
                  "prompt cache breakpoint: none of its prompt is read from the cache, or left there for another "
                  "request"}
    text = explained(unix, text=SYSTEM + QUESTION, prompt_cache_options={"mode": "explicit"})  # a completion's
    assert (text["hit_blocks"], text["first_miss"]["reason"]) == (0, "explicit_mode")
    refused = call(unix, "POST", "/admin/explain", json={"text": SYSTEM, "prompt_cache_options": {"mode": "private"}})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == ("prompt_cache_options.mode: must be implicit or explicit, got "
                                                  "'private'")
    assert refused.json()["error"]["param"] == "prompt_cache_options.mode"


def test_explain_says_a_tenant_is_served_in_explicit_mode_and_a_miss_before_the_mark_is_an_ordinary_one(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service = start_service(tmp_path, num_blocks=256, prompt_cache_explicit_tenants="acme")
    try:
        unix = apps(service, token_table(tmp_path))[0]
        prompt = SYSTEM + QUESTION
        for tenant in ("acme", "globex"):  # an operator's pin holds the prompt's blocks for each
            assert call(unix, "POST", "/admin/pins", json={"text": prompt, "tenant": tenant}).status_code == 200
        acme, globex = (explained(unix, text=prompt, tenant=tenant) for tenant in ("acme", "globex"))
        assert globex["prompt_cache"] == {"mode": "implicit"} and globex["hit_blocks"] > 0
        assert (acme["hit_blocks"], acme["prompt_cache"]) == (0, {"mode": "explicit", "why": "tenant",
                                                                  "shared_blocks": 0})
        assert acme["first_miss"]["detail"] == (
            "tenant 'acme' is served in explicit prompt cache mode (prompt_cache_explicit_tenants), and it marks no "
            "prompt cache breakpoint: none of its prompt is read from the cache, or left there for another request")
        # marked, but its marked prefix is not cached for this tenant: the miss is an ordinary one
        other = "You are the careful assistant of the platform team; answer in a sentence. " * 4
        marked = explained(unix, messages=ask(other, None)["messages"], tenant="acme")
        held = held_tokens(service, other) // service.config.block_size
        assert marked["prompt_cache"] == {"mode": "explicit", "why": "tenant", "shared_blocks": held}
        assert (marked["hit_blocks"], marked["first_miss"]["block"], marked["first_miss"]["reason"]) == (
            0, 0, "never_cached")
    finally:
        service.shutdown(1)


def test_kvctl_explain_sends_a_request_s_cache_options_and_says_it_is_in_explicit_mode(kvd, tmp_path):
    import json

    from .test_cache_breakpoints import SYSTEM, held_tokens
    from .test_sleep import kvctl_on

    service, unix = kvd
    cached(unix, ask(SYSTEM, None, marked=False))
    held = held_tokens(service, SYSTEM) // service.config.block_size
    request = tmp_path / "request.json"
    request.write_text(json.dumps(ask(SYSTEM, "explicit")))
    code, out = kvctl_on(unix, ["explain", "--messages", str(request)])
    lines = out.splitlines()
    assert code == 0 and lines[1] == f"explicit prompt cache mode (asked): only its first {held} full blocks can hit"
    assert lines[0].startswith(f"{held * service.config.block_size} of ")
    assert lines[2].startswith(f"first miss at block {held}: explicit_mode — the request asks for explicit prompt")
    code, out = kvctl_on(unix, ["explain", "--messages", str(request), "--prompt-cache-mode", "implicit"])
    assert code == 0 and "explicit" not in out.splitlines()[1]  # the file's mode, overridden
    code, out = kvctl_on(unix, ["explain", SYSTEM, "--prompt-cache-mode", "explicit", "--json"])
    assert code == 0 and json.loads(out)["prompt_cache"] == {"mode": "explicit", "why": "asked", "shared_blocks": 0}
    from kvctl.errors import UserError

    with pytest.raises(UserError, match=r"^prompt-cache-mode: must be implicit or explicit, got 'own'$"):
        kvctl_on(unix, ["explain", SYSTEM, "--prompt-cache-mode", "own"])


def test_no_tier_takes_a_request_s_own_block_evicted_while_it_waits_nor_one_written_through(tmp_path):
    """A request's own blocks are idle and cached while it waits after a preemption, or while its
    last sample runs: evicted for room then, they go nowhere (the others are kept as always), and
    a write-through skips them too."""
    torch = pytest.importorskip("torch")
    from kvctl.daemon.cache import KVCacheManager
    from kvctl.daemon.cache.tiers import BlockLayout, DiskTier, HostTier, TieredCache
    from kvctl.daemon.model.llama import LayerCache
    from kvctl.policies.tiering import TieringPolicy

    size, layout, space = 4, BlockLayout((torch.float16,), 4, 1, 4, ""), b"s" * 32
    namespace = Namespace(block_size=size)
    manager = KVCacheManager(6, size)
    caches = [LayerCache(torch.zeros(6, size, 1, 4, dtype=torch.float16),
                         torch.zeros(6, size, 1, 4, dtype=torch.float16))]
    tiers = TieredCache(caches, layout, space, host=HostTier(8 * layout.block_bytes, layout),
                        policy=TieringPolicy(mode="always"))
    manager.pool.on_evict = lambda victims: tiers.on_device_evict(victims, lambda root: 0)
    prompt = list(range(200, 212))  # three blocks: the first everyone's, the two after the request's own
    hasher = PrefixHasher(namespace, private=(1, b"request-own-nonce"))
    keys = hasher.feed(prompt)
    manager.admit("explicit", keys, len(prompt), 0, hasher=hasher)
    manager.append("explicit", len(prompt))
    assert [manager.pool.blocks[b].own for b in manager.block_table("explicit")] == [False, True, True]
    manager.release("explicit")  # (preempted: idle, still cached, for its own recompute)
    other = list(range(300, 324))  # six blocks: every cached one is evicted for it
    manager.admit("other", chain_keys(namespace, other), len(other), 0)
    assert set(tiers.host.index) == {keys[0]}  # the everyone's block kept below; the request's own, nowhere
    manager.append("other", len(other))
    manager.release("other")
    assert not any(block.own for block in manager.pool.blocks)  # (a block indexed again is no one's own)
    manager.audit()

    disk_tiers = TieredCache(caches, layout, space, disk=DiskTier(tmp_path, 64 * layout.payload_bytes, layout, space),
                             write_policy="write_through", policy=TieringPolicy(mode="always"))
    manager.admit("again", keys, len(prompt), 0, hasher=hasher)
    manager.append("again", len(prompt))
    disk_tiers.write_through([manager.pool.blocks[b] for b in manager.block_table("again")])
    assert disk_tiers.flush(10) and set(disk_tiers.disk.index) == {keys[0]}
    disk_tiers.close()


def test_the_hit_curve_counts_no_block_of_a_request_s_own_as_one_a_cache_could_serve(kvd):
    from .test_cache_breakpoints import SYSTEM, held_tokens

    service, unix = kvd
    curve = service.engine.cache.hit_curve
    unmarked = ask(SYSTEM, "explicit", marked=False)
    cached(unix, unmarked)
    cached(unix, unmarked)
    assert curve.prompts == 2 and curve.prompt_tokens > 0 and curve.looked_blocks == 0  # none of it any cache's
    cached(unix, ask(SYSTEM, "explicit"))  # marked: its marked prefix is, as it is kvd's
    assert curve.looked_blocks == held_tokens(service, SYSTEM) // service.config.block_size


def test_a_request_in_flight_says_how_much_of_its_prompt_the_cache_may_serve_it(tmp_path):
    pytest.importorskip("torch")
    import dataclasses
    from types import SimpleNamespace

    from kvctl.daemon.server.inflight import request_row

    engine, ids, greedy = demo_engine(tmp_path)
    marked = engine.add_request(ids, dataclasses.replace(greedy, extra={"cache_private": (2, b"nonce")}))
    plain = engine.add_request(ids, greedy)
    service = SimpleNamespace(engine=engine)
    assert [request_row(service, r, engine.clock())["explicit_cache_tokens"] for r in (marked, plain)] == [32, None]


@contextlib.contextmanager
def running_in_explicit_mode(service, ids: list[int], shared_blocks: int = 2):
    """A request in explicit mode (its own from block `shared_blocks` on), its prompt computed and
    indexed, kept running while the block runs: kvd's engine loop takes no step meanwhile."""
    from kvctl.daemon.engine.sampling import SamplingParams

    engine = service.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True,
                            extra={"cache_private": (shared_blocks, b"request-own-nonce")})
    with service.lock:
        held = engine.add_request(ids, params, request_id="own")
        while not held.sequences[0].output_ids:
            engine.step()
        stepping, engine.step = engine.step, lambda: time.sleep(0.005) or []
    try:
        yield held
    finally:
        with service.lock:
            engine.step = stepping
            engine.cancel("own")
            del engine.requests["own"]


def a_prompt_of_blocks(service) -> tuple[list[int], int]:
    """A prompt of the demo tokenizer's, and how many of its blocks the cache indexes (five or more)."""
    ids = service.loaded.tokenizer.encode("Operators pin hot prefixes such as system prompts, and evict the rest. " * 6)
    usable = service.engine.cache.cacheable_blocks(len(ids))
    assert usable >= 5
    return ids, usable


def test_kvctl_prefixes_counts_a_running_request_s_own_blocks_and_kvctl_pin_prefix_pins_none_of_them(kvd):
    from kvctl.daemon.engine.sampling import SamplingParams

    from .daemon_fixtures import call
    from .test_sleep import kvctl_on

    service, unix = kvd
    engine = service.engine
    ids, usable = a_prompt_of_blocks(service)
    size = engine.cache.block_size

    def rows() -> list[dict]:
        return call(unix, "GET", "/admin/prefixes").json()["prefixes"]

    def pin(prefix_id: str):
        return call(unix, "POST", "/admin/pins", json={"prefix": prefix_id})

    with running_in_explicit_mode(service, ids):
        [row] = rows()  # nothing else cached: its shared blocks and its own are one run
        assert (row["blocks"], row["private_blocks"], row["in_use_blocks"]) == (usable, usable - 2, usable)
        code, out = kvctl_on(unix, ["prefixes"])
        header, line = [x.split() for x in out.splitlines()[:2]]
        assert code == 0 and (header[-3:], line[-2:]) == (["in", "use", "private"], [str(usable), str(usable - 2)])
        assert "private: blocks a running request hashed as its own (explicit prompt cache mode)" in out
        code, out = kvctl_on(unix, ["pin", "--prefix", row["prefix_id"]])
        assert code == 0 and "pinned " in out and ": 2 blocks for tenant default (2 cached)" in out
        assert (f"{usable - 2} blocks at the row's end left unpinned: a running request's own (explicit prompt "
                "cache mode), which go as it ends") in " ".join(out.split())
        pinned = call(unix, "GET", "/admin/pins").json()["pins"]
        assert [(p["blocks"], p["cached_blocks"]) for p in pinned] == [(2, 2)]
    assert engine.cache.pool.private_evictions == usable - 2  # its own went as it ended: the pin kept none

    with service.lock:  # another prompt goes on from the same two blocks: the request's own run is a row
        other = engine.add_request(ids[:2 * size] + ids[:3 * size], SamplingParams(max_tokens=2, temperature=0.0))
        while not other.finished:
            engine.step()
        del engine.requests[other.request_id]
    with running_in_explicit_mode(service, ids):
        own_row = next(r for r in rows() if r["private_blocks"])
        root = next(r for r in rows() if r["start_token"] == 0)
        assert (own_row["start_token"], own_row["blocks"], own_row["private_blocks"]) == (2 * size, usable - 2,
                                                                                         usable - 2)
        assert own_row["parent_id"] == root["prefix_id"] and root["private_blocks"] == 0
        refused = pin(own_row["prefix_id"])
        error = refused.json()["error"]
        assert (refused.status_code, error["param"]) == (409, "prefix")
        assert error["message"] == (f"prefix: {own_row['prefix_id']!r} is a running request's own (explicit prompt "
                                    "cache mode: no other request reads it, and it goes as that request ends); pin "
                                    f"the prefix it extends, {root['prefix_id']}")
        assert [p["blocks"] for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [2]  # nothing changed
        [audited] = call(unix, "GET", "/admin/audit", params={"action": "pin", "result": "refused"}).json()["entries"]
        assert (audited["result"], audited["target"], audited["detail"]["reason"]) == (
            "refused", f"prefix={own_row['prefix_id']}", error["message"])  # refused, and audited so
    assert engine.cache.pool.private_evictions == 2 * (usable - 2)
    assert all(not r["private_blocks"] for r in rows())


def test_kvd_router_sums_the_own_blocks_each_replica_left_out_of_a_pin_by_prefix_id():
    from kvctl.daemon.server.fleet_admin import merge_pins

    pinned = {"pin_id": "p1", "blocks": 2, "cached_blocks": 2, "warmed": False}
    merged = merge_pins([{**pinned, "private_blocks_left_out": 3}, pinned, {**pinned, "private_blocks_left_out": 4}])
    assert (merged["cached_blocks"], merged["private_blocks_left_out"]) == (6, 7)
    assert "private_blocks_left_out" not in merge_pins([pinned, pinned])


def test_kvd_router_says_what_a_pin_was_where_any_replica_had_it_before():
    from kvctl.daemon.server.fleet_admin import merge_pins

    fresh = {"pin_id": "p1", "blocks": 2, "cached_blocks": 2, "warmed": False, "refreshed": False}
    was = {"owner": "cron", "note": "support", "expires_in_seconds": 60.0}
    merged = merge_pins([fresh, {**fresh, "refreshed": True, "was": was}])  # (replica 0 joined since)
    assert (merged["refreshed"], merged["was"]) == (True, was)
    assert "was" not in merge_pins([fresh, fresh]) and merge_pins([fresh, fresh])["refreshed"] is False


def test_kvctl_swap_moves_the_shared_part_of_a_prefix_and_leaves_a_running_request_s_own_on_the_device(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table

    service = start_service(tmp_path, num_blocks=256, host_cache_bytes="16MiB")
    try:
        unix = apps(service, token_table(tmp_path))[0]
        ids, usable = a_prompt_of_blocks(service)
        with running_in_explicit_mode(service, ids):
            [row] = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
            moved = call(unix, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "host"}).json()
            assert {k: moved[k] for k in ("blocks", "moved_blocks", "verified_blocks", "kept_on_device")} == {
                "blocks": 2, "moved_blocks": 2, "verified_blocks": 2,
                "kept_on_device": {"in_use": 2, "private": usable - 2}}
            assert service.tiers.flush(timeout=10) and len(service.tiers.host.index) == 2
        assert service.engine.cache.pool.private_evictions == usable - 2
        assert len(service.tiers.host.index) == 2  # no tier got any of its own
    finally:
        service.shutdown(1)

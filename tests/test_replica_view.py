"""A router's view of one replica, fed by hand: the snapshot and device events give exactly its
keys, a restart or a gap asks for a new snapshot, a prompt counts its leading held blocks as
route-facts does, sends count as held until confirmed or expired, and the polled wait grows by
the work sent after the poll was asked."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from kvctl.daemon.cache.keys import Namespace, chain_keys
from kvctl.daemon.server.replica_view import ReplicaView
from kvctl.policies.routing import ReplicaFacts

BLOCK = 4
NAMESPACE = {k: v for k, v in asdict(Namespace(block_size=BLOCK)).items() if k != "tenant"}
PROMPT = list(range(1, 18))  # 17 tokens: 4 full blocks, all 4 cacheable
KEYS = chain_keys(Namespace(**NAMESPACE, tenant="default"), PROMPT)


def snapshot(device_keys, seq=10, stream="s1"):
    return {"stream_id": stream, "seq": seq, "block_size": BLOCK, "namespace": dict(NAMESPACE),
            "tiers": {"device": [k.hex() for k in device_keys], "host": [KEYS[3].hex()]}}


def page(events, next_seq, stream="s1", gap=False):
    return {"stream_id": stream, "events": events, "next": next_seq, "oldest": 1, "latest": next_seq, "gap": gap}


def event(kind, keys, seq, tier="device"):
    return {"seq": seq, "at": 0.0, "kind": kind, "tier": tier, "keys": [k.hex() for k in keys]}


LOAD = {"prompt_tokens": 0, "cached_tokens": 0, "lower_tier": None, "waiting": 1, "running": 2,
        "oldest_age_seconds": 0.5, "tokens_ahead": 1000, "prefill_tokens_per_second": 2000.0,
        "predicted_wait_seconds": 0.5}


def test_a_snapshot_then_device_events_give_exactly_the_replicas_keys():
    view = ReplicaView()
    assert not view.synced
    view.reset(snapshot(KEYS[:2]))
    assert view.synced and view.seq == 10 and view.keys == set(KEYS[:2])  # the host's key is not the device's
    assert view.apply(page([event("stored", KEYS[2:4], 11), event("removed", [KEYS[0]], 12),
                            event("stored", [KEYS[0]], 13, tier="host")], 14))
    assert view.keys == {KEYS[1], KEYS[2], KEYS[3]} and view.seq == 14


def test_a_restarted_replica_or_a_gap_asks_for_a_new_snapshot_and_applies_nothing():
    view = ReplicaView()
    view.reset(snapshot(KEYS[:1]))
    assert not view.apply(page([event("stored", KEYS[1:2], 11)], 12, stream="s2"))
    assert not view.apply(page([event("stored", KEYS[1:2], 11)], 12, gap=True))
    assert view.keys == {KEYS[0]} and view.seq == 10
    view.lose()
    assert not view.synced and view.keys == set()


def test_a_snapshot_with_other_namespace_fields_is_refused_by_name():
    bad = snapshot(KEYS[:1])
    del bad["namespace"]["scale_version"]
    with pytest.raises(ValueError, match=r"snapshot.namespace: expected the fields \[.*'scale_version'"):
        ReplicaView().reset(bad)


def test_cached_tokens_are_the_leading_held_blocks_and_the_last_token_is_always_computed():
    view = ReplicaView()
    view.reset(snapshot([KEYS[0], KEYS[1], KEYS[3]]))
    assert view.cached_tokens(KEYS, len(PROMPT), now=0.0) == 2 * BLOCK  # block 2 missing: 3 is not reached
    view.apply(page([event("stored", [KEYS[2]], 11)], 12))
    assert view.cached_tokens(KEYS, len(PROMPT), now=0.0) == 4 * BLOCK
    assert view.cached_tokens(KEYS, 16, now=0.0) == 3 * BLOCK  # exactly 4 blocks: the 4th is recomputed
    assert view.cached_tokens(KEYS[:1], 3, now=0.0) == 0


def test_a_sent_prompt_counts_as_held_until_its_feed_confirms_or_removes_it_or_it_expires():
    view = ReplicaView(pending_seconds=30.0)
    view.reset(snapshot([KEYS[0]]))
    view.note_sent(KEYS, missing_tokens=13, now=100.0)
    assert set(view.pending) == set(KEYS[1:])  # the held one is not pending
    assert view.cached_tokens(KEYS, len(PROMPT), now=129.9) == 16
    assert view.cached_tokens(KEYS, len(PROMPT), now=130.0) == 4  # expired: only what the feed said
    view.apply(page([event("stored", KEYS[1:3], 11), event("removed", [KEYS[3]], 12)], 13))
    assert view.pending == {} and view.keys == set(KEYS[:3])
    assert view.cached_tokens(KEYS, len(PROMPT), now=200.0) == 12


def test_the_polled_wait_grows_by_the_work_sent_after_the_poll_was_asked():
    view = ReplicaView()
    view.reset(snapshot([]))
    view.note_load(LOAD, asked_at=10.0)
    assert view.facts(8, in_flight=1) == ReplicaFacts(8, 0.5, 3, 2000.0)
    view.note_sent(KEYS, missing_tokens=1000, now=10.5)
    view.note_sent(KEYS, missing_tokens=3000, now=11.5)
    assert view.facts(0, in_flight=5) == ReplicaFacts(0, 0.5 + 4000 / 2000.0, 5, 2000.0)
    view.note_load(LOAD, asked_at=11.0)  # the first send is in this answer, the second is not
    assert view.facts(0, in_flight=0).wait_seconds == 0.5 + 3000 / 2000.0
    assert view.load_age(12.0) == 1.0


def test_the_replicas_queue_limit_is_set_against_the_wait_grown_by_what_was_sent_since():
    """Its max_queue_wait, from the load answer, is in the facts; a wait polled within it that the
    prompts sent since carry past it makes the replica one a router passes over."""
    view = ReplicaView()
    view.note_load({**LOAD, "max_queue_wait_seconds": 2.0}, asked_at=10.0)
    assert view.facts(0, in_flight=0) == ReplicaFacts(0, 0.5, 3, 2000.0, max_wait_seconds=2.0)
    assert not view.facts(0, in_flight=0).past_limit
    view.note_sent(KEYS, missing_tokens=3000, now=10.5)  # 1.5 s more at 2,000 tokens/s: 2.0 s
    assert view.facts(0, in_flight=0).past_limit
    view.note_load({**LOAD, "max_queue_wait_seconds": None}, asked_at=11.0)  # the limit lifted on a reload
    assert view.facts(0, in_flight=0).max_wait_seconds is None


def test_a_tenant_s_own_queue_wait_limit_is_the_one_weighed_for_its_requests():
    """max_queue_wait 2 s; the load answer says batch may wait 60 s and chat without end (0): a
    request of batch's is weighed against 60 s, chat's against none, any other tenant's 2 s."""
    view = ReplicaView()
    view.note_load({**LOAD, "predicted_wait_seconds": 5.0, "max_queue_wait_seconds": 2.0,
                    "tenant_queue_waits": {"batch": 60.0, "chat": 0.0}}, asked_at=10.0)
    facts = {tenant: view.facts(0, in_flight=0, tenant=tenant) for tenant in ("batch", "chat", "acme", None)}
    assert {tenant: f.max_wait_seconds for tenant, f in facts.items()} == {
        "batch": 60.0, "chat": None, "acme": 2.0, None: 2.0}
    assert {tenant: f.past_limit for tenant, f in facts.items()} == {
        "batch": False, "chat": False, "acme": True, None: True}


def test_a_replica_that_goes_by_the_longest_cached_prefix_first_is_waited_for_less_by_a_prompt_it_holds():
    """Its load answer (for a prompt holding nothing: 1,000 tokens ahead, 0.5 s) says what waits by
    the blocks each holds: 200 tokens of requests holding 2 blocks, 600 of ones holding none. A
    prompt holding 2 blocks (8 tokens) would start before the 600; one holding 3, before all 800;
    what was sent since is waited for, as before."""
    view = ReplicaView()
    view.reset(snapshot([]))
    view.note_load({**LOAD, "lpm_waiting": [[2, 200], [0, 600]]}, asked_at=10.0)
    assert [view.facts(cached, in_flight=0).wait_seconds for cached in (0, 4, 8, 12)] == [
        0.5, pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.1)]
    view.note_sent(KEYS, missing_tokens=1000, now=10.5)
    assert view.facts(8, in_flight=0).wait_seconds == pytest.approx(0.2 + 0.5)


def test_a_replica_with_a_priority_queue_is_waited_for_less_by_a_request_of_a_better_place():
    """Its load answer (for the last place: 1,000 tokens ahead, 0.5 s) says what waits by place:
    200 tokens at -10, 300 at 0, 500 at 5; and the tenants' places: acme -10, batch 5 (others 0).
    An acme request waits for the 200; one of another tenant for 500; batch's for all; a
    request whose tenant is not said, for all."""
    view = ReplicaView()
    view.reset(snapshot([]))
    view.note_load({**LOAD, "priority_waiting": [[-10, 200], [0, 300], [5, 500]],
                    "tenant_places": {"acme": -10, "batch": 5}}, asked_at=10.0)
    waits = {tenant: view.facts(0, in_flight=0, tenant=tenant).wait_seconds
             for tenant in ("acme", "globex", "batch", None)}
    assert waits == {"acme": pytest.approx(0.1), "globex": pytest.approx(0.25), "batch": 0.5, None: 0.5}
    view.note_sent(KEYS, missing_tokens=1000, now=10.5)  # what was sent since is waited for, as before
    assert view.facts(0, in_flight=0, tenant="acme").wait_seconds == pytest.approx(0.1 + 0.5)


def test_under_priority_lpm_a_request_waits_for_better_places_and_its_own_place_s_longer_prefixes():
    """Its load answer (1,000 tokens ahead, 0.5 s) says what waits by place and blocks held: at -10,
    100 tokens that go first whatever a newcomer holds (past lpm's patience) and 100 holding 1 block;
    at 0, 200 holding 2 and 300 holding none; at 5, 300. What waits at a worse place, or at its own
    holding fewer blocks than the prompt, starts after it."""
    view = ReplicaView()
    view.reset(snapshot([]))
    view.note_load({**LOAD, "priority_lpm_waiting": [[-10, None, 100], [-10, 1, 100], [0, 2, 200], [0, 0, 300],
                                                     [5, None, 300]],
                    "tenant_places": {"acme": -10, "batch": 5}}, asked_at=10.0)
    waits = {(tenant, cached): view.facts(cached, in_flight=0, tenant=tenant).wait_seconds
             for tenant, cached in (("acme", 0), ("acme", 8), ("globex", 0), ("globex", 12), ("batch", 12),
                                    (None, 12))}
    assert waits == {("acme", 0): pytest.approx(0.1), ("acme", 8): pytest.approx(0.05),
                     ("globex", 0): pytest.approx(0.35), ("globex", 12): pytest.approx(0.1), ("batch", 12): 0.5,
                     (None, 12): 0.5}


def test_a_request_that_defers_itself_waits_for_the_work_up_to_its_own_place():
    """The same load: an acme request (at -10) deferring itself by 5 waits at -5, still for the 200
    alone; by 10, at 0, for the 300 too (it arrived later); by 20, at 10, for all. Another tenant's
    by 3, at 3: for the 200 and the 300, not the 500."""
    view = ReplicaView()
    view.reset(snapshot([]))
    view.note_load({**LOAD, "priority_waiting": [[-10, 200], [0, 300], [5, 500]],
                    "tenant_places": {"acme": -10, "batch": 5}}, asked_at=10.0)
    waits = [view.facts(0, in_flight=0, tenant=tenant, priority=priority).wait_seconds
             for tenant, priority in (("acme", 0), ("acme", 5), ("acme", 10), ("acme", 20), ("globex", 3))]
    assert waits == [pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.25), 0.5, pytest.approx(0.25)]


def test_before_a_prefill_is_measured_the_wait_is_the_oldest_waiting_requests_age():
    view = ReplicaView()
    view.note_load({**LOAD, "prefill_tokens_per_second": None, "predicted_wait_seconds": None}, asked_at=0.0)
    view.note_sent(KEYS, missing_tokens=500, now=1.0)
    assert view.facts(0, in_flight=0) == ReplicaFacts(0, 0.5, 3, None)


def test_a_load_answer_under_a_new_namespace_moves_the_view_to_it_and_names_the_default_tenant():
    view = ReplicaView()
    view.note_load({**LOAD, "tenant": "acme", "namespace": dict(NAMESPACE)}, asked_at=0.0)
    assert view.default_tenant == "acme" and not view.synced  # a load answer alone does not sync a view
    view.reset(snapshot([KEYS[0]]))
    view.note_sent(KEYS, missing_tokens=12, now=1.0)
    rescaled = {**NAMESPACE, "scale_version": "cal-7"}
    view.note_load({**LOAD, "tenant": "default", "namespace": rescaled}, asked_at=2.0)
    assert view.namespace == rescaled and view.pending == {} and view.default_tenant == "default"
    assert view.keys == {KEYS[0]}  # unreachable under the new namespace; its feed removes it in time
    new_keys = chain_keys(Namespace(**rescaled, tenant="default"), PROMPT)
    assert view.cached_tokens(new_keys, len(PROMPT), now=3.0) == 0


def test_lower_tiers_follow_the_feed_and_a_run_counts_each_block_in_the_fastest_tier_holding_it():
    view = ReplicaView()
    view.reset({**snapshot([KEYS[0]]), "tiers": {"device": [KEYS[0].hex()], "host": [KEYS[1].hex()],
                                                 "disk": [KEYS[1].hex(), KEYS[2].hex()]}})
    assert view.lower_run(KEYS[1:]) == {"host": 1, "disk": 1}  # KEYS[3] is nowhere: the run ends there
    # the device's blocks 0 goes down to the host; the disk drops block 2
    view.apply(page([event("removed", [KEYS[0]], 11), event("stored", [KEYS[0]], 12, tier="host"),
                     event("removed", [KEYS[2]], 13, tier="disk")], 14))
    assert view.keys == set() and view.lower_run(KEYS) == {"host": 2}
    rates = {"host": {"bytes_per_second": 1e9, "latency_seconds": 0.001}}
    view.note_load({**LOAD, "block_bytes": 4096, "restore_rates": rates}, asked_at=0.0)
    assert view.restore_seconds({"host": 2}) == pytest.approx(0.001 + 2 * 4096 / 1e9)
    assert view.facts(0, 0, 8, 0.002) == ReplicaFacts(0, 0.5, 3, 2000.0, 8, 0.002)


def test_a_request_is_hashed_under_the_tenant_the_replica_will_serve_it_under():
    view = ReplicaView()
    assert view.tenant_for("acme") == "acme" and view.tenant_for(None) == "default"  # before any answer
    # a TCP front that is no trusted proxy: every request is its token's tenant's
    view.note_load({**LOAD, "tenant": "router-token-tenant", "tenant_header": False}, asked_at=0.0)
    assert view.tenant_for("acme") == "router-token-tenant" and view.tenant_for(None) == "router-token-tenant"
    view.note_load({**LOAD, "tenant": "default", "tenant_header": True}, asked_at=1.0)
    assert view.tenant_for("acme") == "acme" and view.tenant_for(None) == "default"

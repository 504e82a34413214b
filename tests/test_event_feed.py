"""The cache's event feed through the daemon: a snapshot plus the events after it equals the
next snapshot, tier by tier, through demotions, restores, operator evictions and swaps; a
waiting read answers when a request stores blocks; keys a router computes from the snapshot's
namespace are the keys the events name; bad parameters are refused by name."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.cache.keys import Namespace, chain_keys  # noqa: E402
from kvctl.daemon.server.app import create_app  # noqa: E402

from .daemon_fixtures import call, start_service  # noqa: E402

PROMPTS = [f"Prompt number {i} talks about paged caches, eviction order and memory tiers at length, "
           f"long enough to fill a few blocks of sixteen tokens: variant {i}." for i in range(5)]


def complete(app, text, max_tokens=4):
    response = call(app, "POST", "/v1/completions", json={"prompt": text, "max_tokens": max_tokens,
                                                           "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def apply(state: dict[str, set], events: list[dict]) -> dict[str, set]:
    """What a router does with the feed: a set of keys per tier."""
    for event in events:
        held = state.setdefault(event["tier"], set())
        (held.update if event["kind"] == "stored" else held.difference_update)(event["keys"])
    return state


def as_sets(snapshot: dict) -> dict[str, set]:
    return {tier: set(keys) for tier, keys in snapshot["tiers"].items()}


def all_events(app, since: int, **params) -> dict:
    body = call(app, "GET", "/admin/events", params={"since": since, "limit": 10_000, **params}).json()
    assert not body["gap"]
    return body


@pytest.fixture()
def daemon(tmp_path):
    service = start_service(tmp_path, num_blocks=24, host_cache_bytes="200KiB", disk_cache_bytes="16MiB",
                            tiering="always")
    try:
        yield service, create_app(service, service.metrics, front="unix")
    finally:
        service.shutdown(deadline=5)


def test_a_snapshot_plus_the_events_after_it_is_the_next_snapshot_in_every_tier(daemon):
    service, app = daemon
    first = call(app, "GET", "/admin/events/snapshot").json()
    assert set(first["tiers"]) == {"device", "host", "disk"}
    for text in PROMPTS:  # 24 device blocks: the later prompts push the earlier ones down
        complete(app, text)
    rows = call(app, "GET", "/admin/prefixes").json()["prefixes"]
    on_device = next(r for r in rows if "device" in r["tiers"])
    evicted = call(app, "POST", "/admin/evict", json={"prefix": on_device["prefix_id"]}).json()
    assert evicted["evicted_blocks"] > 0
    lower = next(r for r in call(app, "GET", "/admin/prefixes").json()["prefixes"] if "device" not in r["tiers"])
    moved = call(app, "POST", "/admin/swap", json={"prefix": lower["prefix_id"], "to": "device"}).json()
    assert moved["verified_blocks"] == moved["blocks"] > 0
    service.tiers.flush()
    second = call(app, "GET", "/admin/events/snapshot").json()
    assert second["stream_id"] == first["stream_id"] and second["seq"] > first["seq"]
    body = all_events(app, first["seq"])
    assert body["next"] == body["latest"] == second["seq"]
    assert apply(as_sets(first), body["events"]) == as_sets(second)
    reasons = {(e["tier"], e["reason"]) for e in body["events"] if e["kind"] == "removed"}
    assert ("device", "capacity") in reasons and ("device", "operator") in reasons
    assert {e["tier"] for e in body["events"] if e["kind"] == "stored"} == {"device", "host", "disk"}
    # /metrics counts the same blocks, per tier and reason
    counted: dict[tuple, float] = {}
    for event in all_events(app, 0)["events"]:
        label = (event["tier"],) if event["kind"] == "stored" else (event["tier"], event["reason"])
        counted[(event["kind"], *label)] = counted.get((event["kind"], *label), 0) + len(event["keys"])
    scraped = {}
    for family in text_string_to_metric_families(call(app, "GET", "/metrics").text):
        for sample in family.samples:
            if sample.name == "kvd_cache_stored_blocks_total":
                scraped[("stored", sample.labels["tier"])] = sample.value
            elif sample.name == "kvd_cache_removed_blocks_total":
                scraped[("removed", sample.labels["tier"], sample.labels["reason"])] = sample.value
            elif sample.name == "kvd_cache_events_dropped_total":
                assert sample.value == 0
    assert scraped == counted


def test_stored_events_name_the_keys_a_router_computes_from_the_snapshot_namespace(daemon):
    service, app = daemon
    snapshot = call(app, "GET", "/admin/events/snapshot").json()
    complete(app, PROMPTS[0])
    stored = [e for e in all_events(app, snapshot["seq"], tier="device", kind="stored")["events"]]
    ids = service.engine.tokenizer.encode(PROMPTS[0])
    keys = chain_keys(Namespace(**snapshot["namespace"], tenant="default"), ids)
    prompt_blocks = (len(ids) - 1) // snapshot["block_size"]  # the last prompt token is computed, not cached
    assert stored[0]["parent"] is None and stored[0]["depth"] == 0 and stored[0]["tenant"] == "default"
    assert stored[0]["keys"][:prompt_blocks] == [k.hex() for k in keys[:prompt_blocks]]
    # each later stored event of the request extends the chain where the one before it ended
    chain = [k for e in stored for k in e["keys"]]
    for event in stored[1:]:
        assert event["parent"] == chain[chain.index(event["keys"][0]) - 1]


def test_a_waiting_read_answers_with_the_blocks_a_request_stores(daemon):
    service, app = daemon
    latest = call(app, "GET", "/admin/events", params={"since": 0}).json()["latest"]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            waiting = asyncio.create_task(client.get("/admin/events", params={
                "since": latest, "wait": 20, "tier": "device", "kind": "stored"}))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0})
            return (await waiting).json()

    body = asyncio.run(go())
    assert body["events"] and all(e["tier"] == "device" and e["kind"] == "stored" for e in body["events"])
    assert body["events"][0]["seq"] > latest
    quiet = call(app, "GET", "/admin/events", params={"since": body["latest"], "wait": 0.2}).json()
    assert quiet["events"] == [] and quiet["next"] == body["latest"] and not quiet["gap"]


def test_a_stopping_kvd_answers_a_waiting_read_at_once_and_refuses_new_ones(tmp_path):
    """A follower's held-open read (a router's, `kvctl events --follow`) must not hold kvd's
    stop for the rest of its wait: it is answered when the shutdown begins."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path)
    app = create_app(service, service.metrics, front="unix")
    latest = call(app, "GET", "/admin/events", params={"since": 0}).json()["latest"]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            waiting = asyncio.create_task(client.get("/admin/events", params={"since": latest, "wait": 25}))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await asyncio.get_running_loop().run_in_executor(None, service.shutdown, 5)
            answered = await asyncio.wait_for(waiting, 10)  # not the 25 s it asked to wait
            again = await client.get("/admin/events", params={"since": latest, "wait": 25})
            return answered, again

    answered, again = asyncio.run(go())
    assert answered.status_code == 200 and answered.json()["events"] == [] and not answered.json()["gap"]
    assert again.status_code == 503 and again.json()["error"]["message"] == "kvd is shutting down"


def test_a_waiting_read_cancelled_as_an_event_arrives_ends_cancelled():
    """A held-open read whose task is cancelled (kvd stopping, the caller gone) in the same turn as
    the event it waits for arrives must end cancelled: CPython 3.11's asyncio.wait_for, which
    the read waited with, swallows such a cancellation (gh-86296), and the read went on."""
    from kvctl.daemon.cache.events import EventLog
    from kvctl.daemon.server.event_feed import wait_for_events

    log = EventLog()

    async def scenario():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(wait_for_events(log, 0, 100, None, None, wait=30))
        while not log._waiters:  # the read waits for an event
            await asyncio.sleep(0.01)
        log.removed("device", [bytes(16)], "capacity")  # wakes it (a callback on the loop)...
        loop.call_soon_threadsafe(task.cancel)  # ...and cancels it in the same turn
        await asyncio.wait([task], timeout=5)
        return task

    task = asyncio.run(scenario())
    assert task.done() and task.cancelled()


def test_the_key_filter_shows_one_prefix_going_from_tier_to_tier(daemon):
    service, app = daemon
    for text in PROMPTS:
        complete(app, text)
    service.tiers.flush()
    row = next(r for r in call(app, "GET", "/admin/prefixes").json()["prefixes"] if "device" not in r["tiers"])
    life = call(app, "GET", "/admin/events", params={"key": row["prefix_id"]}).json()["events"]
    steps = [(e["kind"], e["tier"], e.get("reason")) for e in life]
    assert steps[0] == ("stored", "device", None) and ("removed", "device", "capacity") in steps
    assert all(any(k.startswith(row["prefix_id"]) for k in e["keys"]) for e in life)
    # replaying its events puts the block where the daemon holds it now
    held = {tier for tier, keys in apply({}, life).items() for k in keys if k.startswith(row["prefix_id"])}
    snapshot = call(app, "GET", "/admin/events/snapshot").json()["tiers"]
    assert held == {tier for tier, keys in snapshot.items() for k in keys if k.startswith(row["prefix_id"])}
    assert held and "device" not in held
    bad = call(app, "GET", "/admin/events", params={"key": "zz12"})
    assert bad.status_code == 400 and bad.json()["error"] == {
        "message": "key: expected 4 to 64 hex digits of a block key, got 'zz12'", "type": "invalid_request_error",
        "param": "key", "code": None}


@pytest.mark.parametrize("params, param, message", [
    ({"kind": "stored,evicted"}, "kind", "kind: unknown value 'evicted'; use stored, removed"),
    ({"tier": "gpu"}, "tier", "tier: unknown value 'gpu'; use device, host, disk, remote"),
    ({"since": -1}, "since", "since: must be >= 0, got -1"),
    ({"limit": 0}, "limit", "limit: must be between 1 and 10000, got 0"),
    ({"wait": 31}, "wait", "wait: must be between 0 and 30 seconds, got 31"),
])
def test_bad_feed_parameters_are_refused_by_name(daemon, params, param, message):
    _, app = daemon
    response = call(app, "GET", "/admin/events", params=params)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message and response.json()["error"]["param"] == param


def test_a_restart_is_a_new_stream_whose_first_events_are_the_disk_blocks_it_found(tmp_path):
    settings = dict(num_blocks=24, disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    app = create_app(service, service.metrics, front="unix")
    complete(app, PROMPTS[0])
    old = call(app, "GET", "/admin/events/snapshot").json()
    service.shutdown(deadline=5)  # saves the device's blocks to disk
    again = start_service(tmp_path, **settings)
    try:
        app = create_app(again, again.metrics, front="unix")
        snapshot = call(app, "GET", "/admin/events/snapshot").json()
        assert snapshot["stream_id"] != old["stream_id"] and snapshot["tiers"]["device"] == []
        assert set(snapshot["tiers"]["disk"]) == set(old["tiers"]["device"])
        stale = call(app, "GET", "/admin/events", params={"since": old["seq"] + 100}).json()
        assert stale["gap"]  # a seq of the old stream: start over from a snapshot
        assert apply({}, all_events(app, 0)["events"]) == {"disk": set(snapshot["tiers"]["disk"])}
    finally:
        again.shutdown(deadline=5)


def test_explain_says_which_tier_a_block_last_left_and_why(daemon):
    """A block dropped from a lower tier was 'never cached' to explain, which knew only the
    device's evictions; the event log knows every tier's."""
    service, app = daemon
    ids = service.engine.tokenizer.encode(PROMPTS[0])
    why = call(app, "POST", "/admin/explain", json={"tokens": ids}).json()["first_miss"]
    assert why["reason"] == "never_cached" and why["detail"].startswith(
        "no request has filled this block under this namespace since kvd started (")  # no record from before it
    complete(app, PROMPTS[0])
    row = call(app, "GET", "/admin/prefixes").json()["prefixes"][0]
    moved = call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "disk"}).json()
    assert moved["verified_blocks"] == moved["blocks"] == row["blocks"]
    why = call(app, "POST", "/admin/explain", json={"tokens": ids}).json()["first_miss"]
    assert (why["reason"], why["tier"], why["key"]) == ("in_lower_tier", "disk", row["prefix_id"])
    # what the next request does with it: restore (tiering: always) and wait up to the prefetch timeout
    blocks = row["blocks"]
    assert (why["lower_tier_blocks"], why["restores"], why["prefetch_wait_seconds"]) == ({"disk": blocks}, True,
                                                                                       2.0 + 0.0)
    assert why["restore_seconds"] > 0 and why["recompute_seconds"] == pytest.approx(
        blocks * 16 / service.engine.prefill_rate.rate)
    assert why["detail"].startswith(f"{blocks} blocks from here are in lower tiers ({blocks} on disk): restoring "
                                    "them takes about ")
    assert why["detail"].endswith("so the next request restores them; it waits up to 2.00 s for the disk part to "
                                  "come up (prefetch_policy timeout)")
    call(app, "POST", "/admin/evict", json={"prefix": row["prefix_id"]})
    why = call(app, "POST", "/admin/explain", json={"tokens": ids}).json()["first_miss"]
    assert (why["reason"], why["tier"], why["evicted_by"], why["key"]) == ("evicted", "disk", "operator",
                                                                           row["prefix_id"])
    assert why["detail"].startswith("evicted from the disk tier ") and why["detail"].endswith(" ago by an operator")


def test_route_facts_say_what_the_device_holds_of_a_prompt_where_the_rest_is_and_how_busy_it_is(daemon):
    service, app = daemon
    ids = service.engine.tokenizer.encode(PROMPTS[1])
    facts = call(app, "POST", "/admin/route-facts", json={"tokens": ids}).json()
    assert (facts["prompt_tokens"], facts["cached_tokens"], facts["lower_tier"]) == (len(ids), 0, None)
    complete(app, PROMPTS[1])
    blocks = (len(ids) - 1) // 16  # the last token is always computed
    facts = call(app, "POST", "/admin/route-facts", json={"text": PROMPTS[1]}).json()
    assert facts == {"prompt_tokens": len(ids), "cached_tokens": blocks * 16, "lower_tier": None, "running": 0,
                     "waiting": 0, "oldest_age_seconds": 0.0, "tokens_ahead": 0, "predicted_wait_seconds": 0.0,
                     "max_queue_wait_seconds": None,  # no limit: a router may count on it waiting
                     "prefill_tokens_per_second": facts["prefill_tokens_per_second"], "tenant": "default",
                     "namespace": call(app, "GET", "/admin/events/snapshot").json()["namespace"],
                     "model": service.model_name, "lower_tier_tokens": {}, "restore_seconds": 0.0,
                     "adapters": {},  # its LoRA adapters: name -> id in the namespace (a router hashes their prompts)
                     "restore_rates": service.tiers.read_rates(), "block_bytes": service.tiers.layout.block_bytes,
                     "draining": False,  # kvctl drain: every router leaves it out
                     "asleep": False,  # kvctl sleep: said as draining too
                     "chat_template": service.chat_template.digest,  # a router renders chats with it
                     "tenant_header": True,  # the Unix front serves a request under the tenant it names
                     "report_cached_tokens": "all"}  # who may see what it caches (a router's X-KVD-Route keeps to it)
    assert facts["prefill_tokens_per_second"] > 0 and facts["namespace"]["tokenizer_digest"] == service.engine.tokenizer.digest
    assert set(facts["restore_rates"]) == {"host", "disk"}
    row = call(app, "GET", "/admin/prefixes").json()["prefixes"][0]
    call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "disk"})
    facts = call(app, "POST", "/admin/route-facts", json={"tokens": ids}).json()
    assert (facts["cached_tokens"], facts["lower_tier"]) == (0, "disk")  # a restore away, not a recompute
    # the whole run is on disk: restoring it costs the disk's latency and its bytes at the disk's
    # rate, a block being a payload as the disk stores it (header and checksum too)
    disk = facts["restore_rates"]["disk"]
    assert facts["lower_tier_tokens"] == {"disk": blocks * 16}
    assert disk["block_bytes"] == service.tiers.layout.payload_bytes > facts["block_bytes"]
    assert facts["restore_seconds"] == pytest.approx(
        disk["latency_seconds"] + blocks * disk["block_bytes"] / disk["bytes_per_second"])
    bad = call(app, "POST", "/admin/route-facts", json={"tokens": ids, "text": "both"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "give exactly one of text, tokens and messages"


def release(service, held) -> None:
    """Cancel the requests held waiting and let admission run again."""
    with service.lock:
        for request in held:
            service.engine.cancel(request.request_id)
        service.engine.admission_paused = False


def test_under_lpm_route_facts_count_only_the_work_lpm_would_start_before_the_prompt(tmp_path):
    """kvd with queue_order lpm, admission held: one request opening with PROMPTS[1] (cached) and
    one sharing nothing wait. Ahead of PROMPTS[1], route-facts count only the first's uncached
    tokens (lpm starts the other after it); ahead of a prompt holding nothing, both. The answer
    also says what waits by the blocks each holds (`lpm_waiting`), for a router's view."""
    from kvctl.daemon.engine.sampling import SamplingParams

    service = start_service(tmp_path, queue_order="lpm")
    try:
        app = create_app(service, service.metrics, front="unix")
        engine = service.engine
        cached, fresh = (engine.tokenizer.encode(text) for text in (PROMPTS[1], PROMPTS[3]))
        complete(app, PROMPTS[1])
        sharing = cached + fresh[:20]
        with service.lock:
            engine.admission_paused = True
            held = [engine.add_request(prompt, SamplingParams(max_tokens=1)) for prompt in (sharing, fresh)]
            hits = engine.cache.lookup(engine.prefix_keys("default", sharing)[2], len(sharing))
        assert hits == len(cached) // 16 > 0
        facts = call(app, "POST", "/admin/route-facts", json={"tokens": cached}).json()
        assert (facts["cached_tokens"], facts["waiting"]) == ((len(cached) - 1) // 16 * 16, 2)
        assert facts["tokens_ahead"] == len(sharing) - hits * 16
        assert facts["lpm_waiting"] == [[hits, len(sharing) - hits * 16], [0, len(fresh)]]
        other = call(app, "POST", "/admin/route-facts", json={"text": PROMPTS[4]}).json()
        assert (other["cached_tokens"], other["tokens_ahead"]) == (0, len(sharing) - hits * 16 + len(fresh))
        release(service, held)
    finally:
        service.shutdown(deadline=2)


def test_under_a_priority_queue_route_facts_count_only_the_work_at_the_tenant_s_place_or_better(tmp_path):
    """kvd with queue_order priority (acme at -10), admission held: a request of acme's and one of
    globex's (at 0) wait. Ahead of an acme prompt, route-facts count only acme's; ahead of a
    globex prompt, both; a load poll (no prompt), both. The answer says what waits by place and
    the tenants' places, for a router's view."""
    from kvctl.daemon.engine.sampling import SamplingParams

    service = start_service(tmp_path, queue_order="priority", tenant_priorities="acme=-10")
    try:
        app = create_app(service, service.metrics, front="unix")
        engine = service.engine
        first, second, probe = (engine.tokenizer.encode(text) for text in (PROMPTS[1], PROMPTS[3], PROMPTS[4]))
        with service.lock:
            engine.admission_paused = True
            held = [engine.add_request(prompt, SamplingParams(max_tokens=1), tenant=tenant,
                                       priority=service.queue_priority(tenant, None))
                    for prompt, tenant in ((first, "globex"), (second, "acme"))]
        ahead = {tenant: call(app, "POST", "/admin/route-facts", json={"tokens": probe, "tenant": tenant}).json()
                 for tenant in ("acme", "globex")}
        assert ahead["acme"]["tokens_ahead"] == len(second)  # globex's arrived first, and goes after
        assert ahead["globex"]["tokens_ahead"] == len(first) + len(second)
        poll = call(app, "POST", "/admin/route-facts", json={"tokens": []}).json()
        assert poll["tokens_ahead"] == len(first) + len(second)
        assert poll["priority_waiting"] == [[-10, len(second)], [0, len(first)]]
        assert poll["tenant_places"] == {"acme": -10}
        # an acme request deferring itself (vLLM's priority) by 10 waits at 0: behind globex's too
        deferred = call(app, "POST", "/admin/route-facts", json={"tokens": probe, "tenant": "acme", "priority": 10})
        assert deferred.json()["tokens_ahead"] == len(first) + len(second)
        assert call(app, "POST", "/admin/route-facts", json={"tokens": probe, "tenant": "acme", "priority": 9}
                    ).json()["tokens_ahead"] == len(second)
        refused = call(app, "POST", "/admin/route-facts", json={"tokens": probe, "tenant": "acme", "priority": -1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert refused.json()["error"]["message"].startswith("priority: -1 would jump ahead of its tenant's place")
        release(service, held)
    finally:
        service.shutdown(deadline=2)


def test_route_facts_refuse_a_request_s_own_priority_where_the_queue_is_first_come_first_served(tmp_path):
    """As kvd refuses such a request itself: a router asking for it learns it (a 400 it passes over)."""
    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        answer = call(app, "POST", "/admin/route-facts", json={"text": PROMPTS[1], "priority": 3})
        assert answer.status_code == 400 and answer.json()["error"]["message"] == (
            "priority: 3 asks for a place in the queue, but kvd serves its queue first come, first served "
            "(queue_order: fifo; queue_order: priority or priority+lpm orders it)")
        assert call(app, "POST", "/admin/route-facts", json={"text": PROMPTS[1], "priority": 0}).status_code == 200
    finally:
        service.shutdown(deadline=2)


def test_route_facts_give_the_queue_wait_limit_of_the_prompt_s_tenant(tmp_path):
    """max_queue_wait 10 s, batch's own 600 s: a batch prompt's route-facts say 600 s, another
    tenant's 10 s; a load poll (no prompt) says 10 s and each tenant's own, for a router's view."""
    service = start_service(tmp_path, max_queue_wait=10, tenant_queue_waits="batch=600,chat=0")
    try:
        app = create_app(service, service.metrics, front="unix")
        limits = {tenant: call(app, "POST", "/admin/route-facts", json={"text": PROMPTS[1], "tenant": tenant}).json()[
            "max_queue_wait_seconds"] for tenant in ("batch", "chat", "acme")}
        assert limits == {"batch": 600.0, "chat": None, "acme": 10.0}
        poll = call(app, "POST", "/admin/route-facts", json={"tokens": []}).json()
        assert poll["max_queue_wait_seconds"] == 10.0
        assert poll["tenant_queue_waits"] == {"batch": 600.0, "chat": 0.0}
    finally:
        service.shutdown(deadline=2)

"""`kvctl fleet sync-pins` at kvd router: a pin one replica has is copied by its keys to the
replicas of its block space that lack it; it then holds the prefix there as it does where it was
made, from a shared Redis at once or as the prefix is computed."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from .daemon_fixtures import call, holds_engine_lock, start_service  # noqa: E402
from .tier_fixtures import redis_server  # noqa: E402,F401

SYSTEM = ("You are the support desk of a fleet of KV caches; answer in one line and name the setting. " * 3)


def unix_app(service):
    from kvctl.daemon.server.app import create_app

    return create_app(service, service.metrics, front="unix")


def router_over(services):
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    replicas = [Replica(f"replica-{i}", replica_client(f"/run/r{i}.sock",
                                                       transport=httpx.ASGITransport(app=unix_app(s))))
                for i, s in enumerate(services)]
    return create_router_app(RouterService(replicas, make_router("prefix"), view="ask"))


def sync(router):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
            return await client.post("/router/sync-pins")
    return asyncio.run(go())


def pins_of(service):
    return call(unix_app(service), "GET", "/admin/pins").json()["pins"]


def test_a_pin_is_copied_to_the_replicas_that_lack_it_and_holds_the_prefix_there(tmp_path):
    services = [start_service(tmp_path / "a", num_blocks=128), start_service(tmp_path / "b", num_blocks=128),
                start_service(tmp_path / "c", num_blocks=128, block_size=32)]  # c: another block space
    try:
        made = call(unix_app(services[0]), "POST", "/admin/pins", headers={"X-KVD-Tenant": "acme"},
                    json={"text": SYSTEM, "ttl": "1h", "note": "support desk"}).json()
        router = router_over(services)
        first = sync(router)
        body = first.json()
        assert first.status_code == 200 and body["result"] == "ok" and body["copied"] == 1
        [row] = body["pins"]
        assert (row["pin_id"], row["tenant"], row["blocks"], row["already_on"]) == (
            made["pin_id"], "acme", made["blocks"], ["replica-0"])
        assert row["copied_to"] == {"replica-1": {"cached_blocks": 0}}  # nothing of it cached there yet
        assert row["left_out"] == {"replica-2": "serves another block space"}
        [copy] = pins_of(services[1])
        assert {k: copy[k] for k in ("pin_id", "tenant", "blocks", "owner", "note", "adapter_id", "space")} == {
            k: made[k] for k in ("pin_id", "tenant", "blocks", "owner", "note", "adapter_id", "space")}
        assert (made["adapter_id"], made["space"]) == ("", services[1].block_space())  # the base model's
        assert 3590 < copy["expires_in_seconds"] <= 3600  # the time it had left where it was made
        assert pins_of(services[2]) == []

        # computed on replica-1, the prefix is pinned there: an eviction of everything unpinned leaves it
        done = call(unix_app(services[1]), "POST", "/v1/completions", headers={"X-KVD-Tenant": "acme"},
                    json={"prompt": SYSTEM + "Q?", "max_tokens": 1, "temperature": 0}).json()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        [copy] = pins_of(services[1])
        assert copy["cached_blocks"] == made["blocks"]
        call(unix_app(services[1]), "POST", "/admin/evict", json={"all_unpinned": True})
        again = call(unix_app(services[1]), "POST", "/v1/completions", headers={"X-KVD-Tenant": "acme"},
                     json={"prompt": SYSTEM + "Q2?", "max_tokens": 1, "temperature": 0}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == made["blocks"] * 16

        second = sync(router).json()  # nothing left to copy
        assert second["copied"] == 0 and second["pins"][0]["already_on"] == ["replica-0", "replica-1"]
        audit = services[1].store.audit_since(action="pin")
        assert [(a["tenant"], a["target"]) for a in audit] == [("acme", made["pin_id"])]
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_a_copy_comes_up_from_a_shared_redis_at_once(tmp_path, redis_server):
    settings = {"num_blocks": 128, "remote_url": redis_server.url, "write_policy": "write_through",
                "tiering": "always"}
    services = [start_service(tmp_path / name, **settings) for name in "ab"]
    try:
        made = call(unix_app(services[0]), "POST", "/admin/pins", json={"text": SYSTEM}).json()
        services[0].tiers.flush()
        body = sync(router_over(services)).json()
        assert body["pins"][0]["copied_to"] == {"replica-1": {"cached_blocks": made["blocks"]}}
        [copy] = pins_of(services[1])
        assert copy["cached_blocks"] == made["blocks"] and copy["expires_in_seconds"] is None
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_a_request_s_prompt_cache_breakpoint_hold_stays_where_the_request_ran(tmp_path):
    from .test_cache_breakpoints import chat_body

    services = [start_service(tmp_path / "a", num_blocks=128), start_service(tmp_path / "b", num_blocks=128)]
    try:
        answer = call(unix_app(services[0]), "POST", "/v1/chat/completions", json=chat_body(SYSTEM)).json()
        assert answer["usage"]["prompt_tokens_details"]["cache_write_tokens"] > 0
        body = sync(router_over(services)).json()
        assert (body["result"], body["copied"], body["pins"]) == ("ok", 0, [])
        assert [p["owner"] for p in pins_of(services[0])] == ["prompt_cache_breakpoint"] and pins_of(services[1]) == []
    finally:
        for service in services:
            service.shutdown(1)


def test_a_stranded_pin_is_copied_nowhere_and_a_copy_keeps_the_adapter_its_keys_were_made_under(tmp_path):
    """A pin whose keys were made in a block space its replica no longer serves (scales since
    recalibrated, say) reaches nothing on any replica of the fleet's space: sync-pins leaves it
    where it is. A copy records the LoRA adapter the keys were made under, as its source says."""
    services = [start_service(tmp_path / name, num_blocks=128) for name in "ab"]
    try:
        app = unix_app(services[0])
        made = [call(app, "POST", "/admin/pins", json={"text": SYSTEM + tail}).json() for tail in ("A", "B" * 40)]
        with services[0].lock:  # as restored from a store written under other scales
            services[0].engine.cache.pins.get(made[0]["pin_id"]).space = "ab" * 32
            services[0].engine.cache.pins.get(made[1]["pin_id"]).adapter_id = "cd" * 32
        body = sync(router_over(services)).json()
        assert [(row["pin_id"], row["copied_to"], row["left_out"]) for row in body["pins"]] == [
            (made[0]["pin_id"], {}, {"replica-1": "the pin is stranded: its keys were made in a block space no "
                                                  "longer served"}),
            (made[1]["pin_id"], {"replica-1": {"cached_blocks": 0}}, {})]
        [copy] = pins_of(services[1])
        assert (copy["pin_id"], copy["adapter_id"], copy["model"], copy["stranded"]) == (
            made[1]["pin_id"], "cd" * 32, None, "adapter")  # no adapter of that digest is served there either
        wrong = call(app, "POST", "/admin/pins", json={"text": SYSTEM, "adapter_id": "cd" * 32})
        assert wrong.status_code == 400 and wrong.json()["error"]["message"] == (
            "adapter_id: names the LoRA adapter that keys were made under; give it with keys")
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_kvd_router_lists_stranded_pins_and_unpins_them_on_every_replica(tmp_path):
    from .test_router import _kvctl_prints

    services = [start_service(tmp_path / name, num_blocks=128) for name in "ab"]
    try:
        router = router_over(services)

        async def ask(*calls):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
                return [await client.request(method, path, **kw) for method, path, kw in calls]

        [made] = asyncio.run(ask(("POST", "/admin/pins", {"json": {"text": SYSTEM, "tenant": "acme"}})))
        pin_id, blocks = made.json()["pin_id"], made.json()["blocks"]
        with services[1].lock:  # as restored from a store written under other scales
            services[1].engine.cache.pins.get(pin_id).space = "ab" * 32
        [listed] = asyncio.run(ask(("GET", "/admin/pins", {})))
        with services[0].lock:
            services[0].engine.cache.pins.get(pin_id).space = "ab" * 32
        for service in services:  # its tree too, on both: then its cached blocks go as it is unpinned
            with service.lock:
                cache = service.engine.cache
                cache.roots[cache.pins.get(pin_id).keys[0]].space = bytes.fromhex("ab" * 32)
        refused, swept, after = asyncio.run(ask(("DELETE", "/admin/pins", {}),
            ("DELETE", "/admin/pins", {"params": {"stranded": "true"}}), ("GET", "/admin/pins", {})))
        [row] = listed.json()["pins"]
        assert (row["pin_id"], row["stranded"], row["replicas"]) == (pin_id, "space", ["replica-0", "replica-1"])
        assert row["stranded_on"] == ["replica-1"]  # on replica-1 alone so far
        [line] = [line for line in _kvctl_prints(["pins"], listed.json()).splitlines() if pin_id in line]
        assert "stranded on 1/2" in line
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stranded"
        body = swept.json()
        assert swept.status_code == 200 and body["result"] == "ok"
        assert body["unpinned"] == [{"pin_id": pin_id, "tenant": "acme", "blocks": blocks, "adapter_id": "",
                                     "stranded": "space", "unpinned_blocks": blocks}]
        assert body["unpinned_blocks"] == 2 * blocks and [r["status"] for r in body["replicas"]] == [200, 200]
        assert body["dropped_stale_blocks"] == 2 * blocks
        assert [service.engine.cache.pool.space_evictions for service in services] == [blocks, blocks]
        assert after.json()["pins"] == []
        assert _kvctl_prints(["unpin", "--stranded"], body).splitlines() == [
            f"unpinned {pin_id} (tenant acme, {blocks} blocks): made under a model revision, tokenizer, cache format, "
            "scales or block size kvd no longer serves",
            f"1 stranded pin unpinned, {2 * blocks} blocks over 2 replicas; {2 * blocks} cached blocks dropped "
            "with them",
            f"  replica-0: {blocks} blocks", f"  replica-1: {blocks} blocks"]
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_a_pin_by_keys_names_its_tenant_and_well_formed_keys(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = unix_app(service)
        no_tenant = call(app, "POST", "/admin/pins", json={"keys": ["ab" * 32]})
        assert no_tenant.status_code == 400 and no_tenant.json()["error"]["message"] == (
            "tenant: a pin by keys names its tenant (the keys were made under it)")
        bad = call(app, "POST", "/admin/pins", json={"keys": ["xyz"], "tenant": "acme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keys"
        both = call(app, "POST", "/admin/pins", json={"keys": ["ab" * 32], "text": "x", "tenant": "acme"})
        assert both.json()["error"]["message"] == "give exactly one of text, tokens, messages, prefix and keys"
        listed = call(app, "GET", "/admin/pins", params={"keys": "true"}).json()
        assert listed == {"pins": [], "space": service.block_space()} and len(listed["space"]) == 64
    finally:
        service.shutdown(deadline=2)


def test_the_pin_list_with_keys_is_made_after_the_engines_lock(tmp_path, monkeypatch):
    """Under the lock kvd reads each pin and how much of it is cached; the rows, and the hex of
    every pinned key (up to the cache's size: 10 ms for 100,000 keys), come after it."""
    from kvctl.daemon.server import pin_ops

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = unix_app(service)
        keys = {"acme": ["ab" * 32, "cd" * 32], "globex": ["ef" * 32]}
        for tenant, chain in keys.items():
            assert call(app, "POST", "/admin/pins", json={"keys": chain, "tenant": tenant}).status_code == 200
        held, pin_times = [], pin_ops._pin_times

        def watched(described, now, wall=None):
            held.append((described["tenant"], holds_engine_lock(service)))
            return pin_times(described, now, wall)

        monkeypatch.setattr(pin_ops, "_pin_times", watched)
        listed = call(app, "GET", "/admin/pins", params={"keys": "true"}).json()["pins"]
        assert sorted((p["tenant"], p["keys"], p["cached_blocks"]) for p in listed) == [
            ("acme", keys["acme"], 0), ("globex", keys["globex"], 0)]
        assert sorted(held) == [("acme", False), ("globex", False)]
    finally:
        service.shutdown(deadline=2)


def test_kvctl_fleet_sync_pins_prints_what_went_where():
    from .test_router import _kvctl_prints

    body = {"pins": [{"pin_id": "pin-0123456789abcdef", "tenant": "acme", "blocks": 12,
                      "already_on": ["/run/a.sock"], "copied_to": {"/run/b.sock": {"cached_blocks": 12}},
                      "left_out": {"/run/c.sock": "serves another block space"}}],
            "copied": 1, "replicas": [], "result": "ok"}
    assert _kvctl_prints(["fleet", "sync-pins"], body).splitlines() == [
        "pin-0123456789abcdef (tenant acme, 12 blocks): copied to /run/b.sock (12 cached)",
        "  /run/c.sock: serves another block space",
        "1 copies made, 1 pins in the fleet"]


def test_a_replica_that_joins_gets_the_fleet_s_pins_once_it_answers_ready(tmp_path):
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    services = [start_service(tmp_path / name, num_blocks=128) for name in "ab"]
    try:
        made = call(unix_app(services[0]), "POST", "/admin/pins", json={"text": SYSTEM, "note": "desk"}).json()
        router = RouterService([Replica("replica-0", replica_client("/run/r0.sock",
                                                                    transport=httpx.ASGITransport(app=unix_app(
                                                                        services[0]))))],
                               make_router("prefix"), view="ask")

        async def join():
            router.add(Replica("replica-1", replica_client("/run/r1.sock",
                                                           transport=httpx.ASGITransport(app=unix_app(services[1])))))
            await asyncio.gather(*router._welcoming)
            return router.status()["replicas"]

        rows = asyncio.run(join())
        assert rows[1]["replica"] == "replica-1" and rows[1]["welcomed"] == {"pins_copied": 1}
        assert "welcomed" not in rows[0]  # it was there from the start
        [copy] = pins_of(services[1])
        assert (copy["pin_id"], copy["note"], copy["blocks"]) == (made["pin_id"], "desk", made["blocks"])
    finally:
        for service in services:
            service.shutdown(deadline=2)

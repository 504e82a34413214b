"""A tenant leaving: `kvctl pins --tenant T` lists its pins, `kvctl unpin --tenant T` removes every
one of them (each audited, each off the store), and `kvctl evict --tenant T` then takes the blocks
they kept, which it leaves alone while they stand and says so."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from .daemon_fixtures import call, start_service  # noqa: E402

ACME_A = "You are the acme help desk; answer questions on anvils, rockets and roller skates in one line. "
ACME_B = "You are acme's shipping clerk; say where a parcel is and when it lands, in one short line. "
GLOBEX = "You are the globex concierge; answer questions on the volcano lair and its monorail politely. "


def unix_app(service):
    from kvctl.daemon.server.app import create_app

    return create_app(service, service.metrics, front="unix")


def pinned(app, text, tenant, **extra) -> dict:
    made = call(app, "POST", "/admin/pins", json={"text": text, "tenant": tenant, **extra})
    assert made.status_code == 200, made.text
    return made.json()


def test_a_tenants_pins_are_listed_and_unpinned_together_and_its_blocks_can_then_be_evicted(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = unix_app(service)
        a, b, g = pinned(app, ACME_A, "acme"), pinned(app, ACME_B, "acme", ttl="1h"), pinned(app, GLOBEX, "globex")
        listed = call(app, "GET", "/admin/pins", params={"tenant": "acme"}).json()
        assert [p["pin_id"] for p in listed["pins"]] == [a["pin_id"], b["pin_id"]]
        kept = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (kept["evicted_blocks"], kept["skipped"]) == (0, {"pinned": a["blocks"] + b["blocks"]})

        swept = call(app, "DELETE", "/admin/tenants/acme/pins")
        assert swept.status_code == 200
        assert swept.json() == {"unpinned": [
            {"pin_id": a["pin_id"], "tenant": "acme", "blocks": a["blocks"], "adapter_id": "", "stranded": None,
             "unpinned_blocks": a["blocks"]},
            {"pin_id": b["pin_id"], "tenant": "acme", "blocks": b["blocks"], "adapter_id": "", "stranded": None,
             "unpinned_blocks": b["blocks"]}], "unpinned_blocks": a["blocks"] + b["blocks"], "tenant": "acme"}
        assert [p["pin_id"] for p in call(app, "GET", "/admin/pins").json()["pins"]] == [g["pin_id"]]
        assert [p["pin_id"] for p in service.store.pins()] == [g["pin_id"]]  # off the store: not back at a start
        audited = service.store.audit_since(action="unpin")
        assert [(r["target"], r["tenant"], r["detail"]) for r in audited] == [
            (b["pin_id"], "acme", {"blocks": b["blocks"], "swept_tenant": "acme"}),
            (a["pin_id"], "acme", {"blocks": a["blocks"], "swept_tenant": "acme"})]
        history = call(app, "GET", "/admin/audit", params={"target": a["pin_id"]}).json()["entries"]
        assert [(e["action"], e["result"]) for e in history] == [("unpin", "ok"), ("pin", "ok")]  # newest first

        taken = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (taken["evicted_blocks"], taken["skipped"]) == (a["blocks"] + b["blocks"], {})
        assert service.engine.cache.pins.get(g["pin_id"]).num_blocks == g["blocks"]  # globex's stands

        again = call(app, "DELETE", "/admin/tenants/acme/pins")  # run twice, nothing is left to do
        assert again.status_code == 200 and again.json() == {"unpinned": [], "unpinned_blocks": 0, "tenant": "acme"}
        bad = call(app, "DELETE", "/admin/tenants/a%20b/pins")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tenant" and "'a b'" in (
            bad.json()["error"]["message"])
        assert call(app, "GET", "/admin/pins", params={"tenant": "a b"}).json()["error"]["param"] == "tenant"
        neither = call(app, "DELETE", "/admin/pins")
        assert neither.status_code == 400 and neither.json()["error"]["message"] == (
            "stranded: DELETE /admin/pins unpins the stranded pins only (stranded=true); unpin one pin by its id, "
            "DELETE /admin/pins/{pin_id}, or a tenant's, DELETE /admin/tenants/{tenant}/pins")
    finally:
        service.shutdown(deadline=2)


def test_a_tenants_stranded_pins_alone_are_unpinned_with_stranded(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = unix_app(service)
        a, b, g = pinned(app, ACME_A, "acme"), pinned(app, ACME_B, "acme"), pinned(app, GLOBEX, "globex")
        with service.lock:  # as restored from a store written under other scales
            for pin_id in (b["pin_id"], g["pin_id"]):
                service.engine.cache.pins.get(pin_id).space = "ab" * 32
        swept = call(app, "DELETE", "/admin/tenants/acme/pins", params={"stranded": "true"}).json()
        assert swept["unpinned"] == [{"pin_id": b["pin_id"], "tenant": "acme", "blocks": b["blocks"],
                                      "adapter_id": "", "stranded": "space", "unpinned_blocks": b["blocks"]}]
        [audited] = service.store.audit_since(action="unpin")
        assert audited["detail"] == {"blocks": b["blocks"], "stranded": "space", "swept_tenant": "acme"}
        assert sorted(p["pin_id"] for p in call(app, "GET", "/admin/pins").json()["pins"]) == sorted(
            [a["pin_id"], g["pin_id"]])  # acme's reachable pin and globex's stranded one stand
    finally:
        service.shutdown(deadline=2)


def test_kvctl_unpin_and_pins_by_tenant_and_evicts_hint_at_the_pins_it_left(capsys):
    from kvctl.cli import main

    from .test_router import _kvctl_prints

    def row(pin_id, tenant, stranded=None):
        return {"pin_id": pin_id, "tenant": tenant, "blocks": 4, "adapter_id": "", "stranded": stranded,
                "unpinned_blocks": 4}

    swept = {"unpinned": [row("pin-00000000000000a1", "acme"), row("pin-00000000000000a2", "acme", "space")],
             "unpinned_blocks": 8, "tenant": "acme"}
    assert _kvctl_prints(["unpin", "--tenant", "acme"], swept).splitlines() == [
        "unpinned pin-00000000000000a1 (tenant acme, 4 blocks)",
        "unpinned pin-00000000000000a2 (tenant acme, 4 blocks): made under a model revision, tokenizer, cache "
        "format, scales or block size kvd no longer serves",
        "2 pins of tenant acme unpinned, 8 blocks"]
    none = {"unpinned": [], "unpinned_blocks": 0, "tenant": "acme"}
    assert _kvctl_prints(["unpin", "--tenant", "acme"], none) == "no pins of tenant acme\n"
    assert _kvctl_prints(["unpin", "--tenant", "acme", "--stranded"], none) == "no stranded pins of tenant acme\n"
    for args, said in ((["unpin"], "a pin's id, --stranded or --tenant, not neither"),
                       (["unpin", "pin-00000000000000a1", "--tenant", "acme"],
                        "a pin's id, or --stranded or --tenant, not both")):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"error: pin_id: give {said}\n"

    def pin(pin_id, tenant):
        return {"pin_id": pin_id, "tenant": tenant, "blocks": 4, "cached_blocks": 4, "owner": "ops", "note": "",
                "expires_at": None, "expires_in_seconds": None, "adapter_id": "", "model": "kvd-demo",
                "stranded": None}

    every = {"pins": [pin("pin-00000000000000a1", "acme"), pin("pin-00000000000000b1", "globex")]}
    # a kvd of before the filter lists every tenant's: kvctl keeps the one asked for
    assert [line.split()[:2] for line in _kvctl_prints(["pins", "--tenant", "acme"], every).splitlines()] == [
        ["pin", "tenant"], ["pin-00000000000000a1", "acme"]]
    assert _kvctl_prints(["pins", "--tenant", "initech"], every) == "tenant initech has no pins\n"

    kept = {"evicted_blocks": 3, "skipped": {"pinned": 8}, "result": "ok", "target": "tenant=acme",
            "lower_tier_blocks_dropped": 0}
    assert _kvctl_prints(["evict", "--tenant", "acme"], kept).splitlines() == [
        "evicted tenant=acme: 3 blocks from the device; left alone: 8 pinned",
        "its pins keep 8 blocks: `kvctl unpin --tenant acme`, then evict again, takes them too"]


def test_kvd_router_unpins_a_tenants_pins_on_every_replica_and_names_a_replica_without_the_path(tmp_path):
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .test_router import _kvctl_prints

    services = [start_service(tmp_path / name, num_blocks=64) for name in "ab"]
    try:
        def router(older: bool):
            def older_kvd(request):  # a kvd of before the tenant's path: 404 for a path it does not know
                return httpx.Response(404, json={"detail": "Not Found"})
            transports = [httpx.ASGITransport(app=unix_app(s)) for s in services]
            if older:
                transports[1] = httpx.MockTransport(older_kvd)
            return create_router_app(RouterService(
                [Replica(f"replica-{i}", replica_client(f"/run/r{i}.sock", transport=t))
                 for i, t in enumerate(transports)], make_router("prefix"), view="ask"))

        async def ask(app, *calls):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
                return [await client.request(method, path, **kw) for method, path, kw in calls]

        fleet = router(older=False)
        [made, listed] = asyncio.run(ask(fleet, ("POST", "/admin/pins", {"json": {"text": ACME_A, "tenant": "acme"}}),
                                         ("GET", "/admin/pins", {"params": {"tenant": "globex"}})))
        pin_id, blocks = made.json()["pin_id"], made.json()["blocks"]
        assert listed.json()["pins"] == []
        [swept] = asyncio.run(ask(fleet, ("DELETE", "/admin/tenants/acme/pins", {})))
        body = swept.json()
        assert swept.status_code == 200 and body["result"] == "ok" and body["tenant"] == "acme"
        assert body["unpinned"] == [{"pin_id": pin_id, "tenant": "acme", "blocks": blocks, "adapter_id": "",
                                     "stranded": None, "unpinned_blocks": blocks}]
        assert body["unpinned_blocks"] == 2 * blocks and [r["status"] for r in body["replicas"]] == [200, 200]
        assert [len(s.engine.cache.pins.all()) for s in services] == [0, 0]
        assert _kvctl_prints(["unpin", "--tenant", "acme"], body).splitlines() == [
            f"unpinned {pin_id} (tenant acme, {blocks} blocks)",
            f"1 pin of tenant acme unpinned, {2 * blocks} blocks over 2 replicas",
            f"  replica-0: {blocks} blocks", f"  replica-1: {blocks} blocks"]

        pinned(unix_app(services[0]), ACME_A, "acme")
        [partial] = asyncio.run(ask(router(older=True), ("DELETE", "/admin/tenants/acme/pins", {})))
        body = partial.json()
        assert body["result"] == "partial" and [r["status"] for r in body["replicas"]] == [200, 501]
        assert body["message"] == ("replica-1: refused (501: this kvd has no DELETE /admin/tenants/{tenant}/pins "
                                   "(an older kvd): unpin the tenant's pins there by id)")
        assert body["unpinned_blocks"] == blocks and services[0].engine.cache.pins.all() == []
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_a_tenant_leaving_takes_its_pinned_prefixes_from_every_tier_and_none_come_back_at_a_start(tmp_path):
    """Written through to disk, a pinned prefix's copies there stay with it while it is pinned;
    `unpin --tenant` then `evict --tenant` takes them from the device and the disk, and a restart
    brings back neither the pins nor the prefixes (the other tenant's stay)."""
    settings = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always", write_policy="write_through")
    service = start_service(tmp_path, **settings)
    try:
        app = unix_app(service)
        a, g = pinned(app, ACME_A, "acme"), pinned(app, GLOBEX, "globex")
        keys = list(service.engine.cache.pins.get(a["pin_id"]).keys)
        assert service.tiers.wait_for_writes(keys, 30) == 0 and set(keys) <= set(service.tiers.known_metas())
        kept = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (kept["evicted_blocks"], kept["lower_tier_blocks_dropped"], kept["skipped"]) == (
            0, 0, {"pinned": a["blocks"]})
        assert call(app, "DELETE", "/admin/tenants/acme/pins").json()["unpinned_blocks"] == a["blocks"]
        gone = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (gone["evicted_blocks"], gone["lower_tier_blocks_dropped"], gone["skipped"]) == (
            a["blocks"], a["blocks"], {})
    finally:
        service.shutdown(deadline=5)
    again = start_service(tmp_path, **settings)
    try:
        app = unix_app(again)
        assert [p["pin_id"] for p in call(app, "GET", "/admin/pins").json()["pins"]] == [g["pin_id"]]
        assert {r["tenant"] for r in call(app, "GET", "/admin/prefixes").json()["prefixes"]} == {"globex"}
        explained = call(app, "POST", "/admin/explain", json={"text": ACME_A, "tenant": "acme"}).json()
        assert explained["hit_tokens"] == 0
    finally:
        again.shutdown(deadline=5)

"""Tiers across processes: the real kvd killed with SIGKILL in the middle of disk writes, again
and again, then restarted (nothing torn is served, the audit passes, outputs are unchanged);
and two daemons sharing prefixes through one Redis."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("redis")

from .daemon_fixtures import blocks_all_back, call, start_service  # noqa: E402
from .kvd_process import TIERS, complete, kvctl, launch  # noqa: E402
from .tier_fixtures import redis_server  # noqa: E402,F401

PROMPTS = [f"Request {i}: the operators of the cache want their prefixes kept warm across restarts, "
           f"so block {i} must come back whole or not at all." for i in range(6)]


def test_sigkill_during_disk_writes_then_restart_serves_nothing_torn(tmp_path):
    reference = start_service(tmp_path / "reference", num_blocks=64)
    try:
        expected = {p: complete(lambda *a, **k: call(_app(reference), "POST", *a, **k), p)["choices"][0]["text"]
                    for p in PROMPTS}
    finally:
        reference.shutdown(deadline=2)
    state, sock, log = tmp_path / "state", tmp_path / "kvd.sock", tmp_path / "kvd.log"
    for round_ in range(3):
        proc, client = launch(state, sock, log)
        done = []

        def drive(prompt):
            try:
                complete(client.post, prompt)
                done.append(prompt)
            except (httpx.TransportError, AssertionError):
                pass  # killed under us

        threads = [threading.Thread(target=drive, args=(p,)) for p in PROMPTS[round_:] + PROMPTS[:round_]]
        for t in threads:
            t.start()
        while len(done) < 1 + round_:  # kill at a different point each round, writes in flight
            time.sleep(0.01)
            assert proc.poll() is None, log.read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for t in threads:
            t.join(30)
        client.close()
    service = start_service(state, **{"num_blocks": 24, **TIERS})
    try:
        scan = service.tier_scan
        assert scan.corrupt == 0 and scan.foreign == 0 and scan.blocks > 0
        app = _app(service)
        for prompt in PROMPTS:
            assert complete(lambda *a, **k: call(app, "POST", *a, **k), prompt)["choices"][0]["text"] == expected[prompt]
        assert service.engine.stats.restored_tokens > 0
        assert blocks_all_back(service)  # includes the cache audit
    finally:
        service.shutdown(deadline=2)


def _app(service):
    from kvctl.daemon.server.app import create_app

    return create_app(service, service.metrics, front="unix")


def test_two_daemons_share_a_prefix_through_redis(tmp_path, redis_server):
    settings = {"num_blocks": 64, "remote_url": redis_server.url, "write_policy": "write_through",
                "tiering": "always"}
    first = start_service(tmp_path / "a", **settings)
    second = start_service(tmp_path / "b", **settings)
    try:
        one = complete(lambda *a, **k: call(_app(first), "POST", *a, **k), PROMPTS[0])
        first.tiers.flush()
        two = complete(lambda *a, **k: call(_app(second), "POST", *a, **k), PROMPTS[0])
        assert two["choices"][0]["text"] == one["choices"][0]["text"]
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (two["usage"]["prompt_tokens"] - 1) // 16 * 16
        tiers = call(_app(second), "GET", "/admin/tiers").json()
        assert tiers["tokens"]["restored"] == cached and tiers["tiers"]["remote"]["hit_tokens"] == cached
    finally:
        first.shutdown(deadline=2)
        second.shutdown(deadline=2)


def test_a_fleet_eviction_searches_a_shared_redis_once_and_each_replica_drops_its_own(tmp_path, redis_server,
                                                                                       monkeypatch):
    """Through kvd router, both replicas on one Redis: one of them claims the eviction's token and
    searches the Redis for the tenant's entries (whichever daemon wrote them); the other only
    drops what it wrote itself and says the search was another replica's. Nothing of the tenant is
    left, and the Redis was scanned once."""
    import asyncio

    from kvctl.daemon.cache.tiers.remote import RemoteTier
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    settings = {"num_blocks": 64, "remote_url": redis_server.url, "write_policy": "write_through",
                "tiering": "always"}
    services = [start_service(tmp_path / name, **settings) for name in "abc"]  # c is not behind the router
    searches = []
    search = RemoteTier.purge
    monkeypatch.setattr(RemoteTier, "purge", lambda self, *a, **k: searches.append(self) or search(self, *a, **k))
    try:
        for service, prompt in zip(services, PROMPTS):  # acme's prompts, one on each daemon
            response = call(_app(service), "POST", "/v1/completions", headers={"X-KVD-Tenant": "acme"},
                            json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200
            service.tiers.flush()
        call(_app(services[2]), "POST", "/v1/completions", headers={"X-KVD-Tenant": "globex"},
             json={"prompt": PROMPTS[3], "max_tokens": 1, "temperature": 0})
        services[2].tiers.flush()
        written = [len(s.tiers.remote.index) for s in services]
        outside = written[2] // 2  # c's acme entries; the other half is globex's
        replicas = [Replica(f"replica-{i}", replica_client(f"/run/r{i}.sock",
                                                           transport=httpx.ASGITransport(app=_app(s))))
                    for i, s in enumerate(services[:2])]
        router = create_router_app(RouterService(replicas, make_router("prefix"), view="ask"))

        async def evict():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
                return await client.post("/admin/evict", json={"tenant": "acme"})

        answer = asyncio.run(evict())
        body = answer.json()
        assert answer.status_code == 200 and body["result"] == "ok", body
        purges = [row["remote_purge"] for row in body["replicas"]]
        searcher = next(i for i, p in enumerate(purges) if "seen" in p)
        assert purges[1 - searcher] == {"by_another_replica": True} and len(searches) == 1
        # each replica dropped what it wrote, by name; the search found c's acme entries and left globex's.
        # The two replicas run at once, so the search may meet entries a replica was about to drop by
        # name: whoever deletes an entry counts it, and every acme entry is counted once.
        lower = [row["lower_tier_blocks_dropped"] for row in body["replicas"]]
        found, seen = purges[searcher]["dropped"], purges[searcher]["seen"]
        assert sum(lower) + found == written[0] + written[1] + outside, (lower, purges)
        assert all(0 <= lower[i] <= written[i] for i in (0, 1)) and outside <= found <= seen, (lower, purges)
        assert seen >= written[2] and purges[searcher]["complete"]
        assert body["remote_purge"] == {"dropped": found, "complete": True, "searches": 1}
        import redis

        # what is left: globex's entries, the spaces registry and the claim
        assert redis.Redis.from_url(redis_server.url).dbsize() == written[2] - outside + 2
        from .test_router import _kvctl_prints

        shown = _kvctl_prints(["evict", "--tenant", "acme"], body).splitlines()
        device = [row["evicted_blocks"] for row in body["replicas"]]
        assert shown == ["fleet of 2 replicas:",
                         f"evicted tenant=acme: {sum(device)} blocks from the device, {sum(lower)} from lower "
                         f"tiers, {found} from the shared Redis",
                         *[f"  replica-{i}: {device[i]} from the device, {lower[i]} from lower tiers; "
                           + (f"searched the shared Redis: {found} of {seen} entries"
                              if i == searcher
                              else "the shared Redis searched by another replica") for i in (0, 1)]]
        again = asyncio.run(evict()).json()  # a new call, a new token: searched again, once
        assert len(searches) == 2 and again["remote_purge"]["searches"] == 1
    finally:
        for service in services:
            service.shutdown(deadline=2)


def test_evicting_a_tenant_on_one_daemon_purges_it_from_the_shared_redis(tmp_path, redis_server):
    """Daemon b never saw acme's prompts; its `evict --tenant acme` still removes what daemon a
    wrote of acme to the shared Redis (payloads record their tenant), and nothing of globex."""
    settings = {"num_blocks": 64, "remote_url": redis_server.url, "write_policy": "write_through",
                "tiering": "always"}
    first = start_service(tmp_path / "a", **settings)
    second = start_service(tmp_path / "b", **settings)

    def ask(service, tenant, prompt):
        response = call(_app(service), "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                        json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        ask(first, "acme", PROMPTS[0])
        ask(first, "globex", PROMPTS[1])
        first.tiers.flush()
        written = len(first.tiers.remote.index)
        report = call(_app(second), "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert report["result"] == "ok" and report["lower_tier_blocks_dropped"] == 0  # nothing of its own
        assert report["remote_purge"] == {"dropped": written // 2, "seen": written, "complete": True}
        assert ask(second, "acme", PROMPTS[0]) == 0  # gone for every daemon
        assert ask(second, "globex", PROMPTS[1]) == written // 2 * 16  # restored from Redis
        # a prefix by its id: b restored globex's (and did not write it back), so it knows its
        # keys; a wrote them
        second.tiers.flush()
        assert len(second.tiers.remote.index) == written // 2  # acme's, computed again on b
        [row] = [r for r in call(_app(second), "GET", "/admin/prefixes").json()["prefixes"] if r["tenant"] == "globex"]
        by_id = call(_app(second), "POST", "/admin/evict", json={"prefix": row["prefix_id"]}).json()
        assert (by_id["evicted_blocks"], by_id["lower_tier_blocks_dropped"], by_id["remote_purge"]) == \
            (row["blocks"], 0, {"dropped": row["blocks"], "seen": row["blocks"], "complete": True})
        assert ask(first, "globex", PROMPTS[2]) == 0 and ask(second, "globex", PROMPTS[1]) == 0  # gone for both
        redis_server.stop()  # a purge that cannot run says so and counts as partial (exit 3)
        down = call(_app(second), "POST", "/admin/evict", json={"tenant": "globex"}).json()
        assert down["result"] == "partial" and "error" in down["remote_purge"]
        assert down["message"].startswith("the shared Redis could not be searched: ")
        redis_server.start()
    finally:
        first.shutdown(deadline=2)
        second.shutdown(deadline=2)


def test_kvctl_tiers_and_swap_as_an_operator_drives_them(tmp_path):
    import json

    sock = tmp_path / "kvd.sock"
    proc, client = launch(tmp_path / "state", sock, tmp_path / "kvd.log", "--host-cache-bytes", "4MiB",
                          "--disk-cache-bytes", "32MiB", "--tiering", "always")
    try:
        first = complete(client.post, PROMPTS[0])
        [prefix] = json.loads(kvctl(sock, "prefixes", "--json").stdout)["prefixes"]
        assert prefix["tier"] == "device"
        moved = kvctl(sock, "swap", prefix["prefix_id"], "--to", "disk")
        assert moved.returncode == 0, moved.stderr
        assert (f"moved {prefix['prefix_id']} to disk: {prefix['blocks']} of {prefix['blocks']} "
                "blocks verified in") in moved.stdout
        listed = kvctl(sock, "prefixes").stdout
        assert prefix["prefix_id"] in listed and "disk" in listed
        report = json.loads(kvctl(sock, "tiers", "--json").stdout)
        assert report["tiers"]["disk"]["blocks"] == prefix["blocks"]
        assert report["moved_bytes"]["device->disk"] > 0 and report["tiers"]["disk"]["health"] == "ok"
        status = kvctl(sock, "status").stdout
        assert "restored" in status and "host 0 B of 4.0 MiB" in status and "disk " in status
        table = kvctl(sock, "tiers").stdout
        assert "write policy: write_back" in table and "restored from lower tiers" in " ".join(table.split())
        rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:] if line.strip()}
        assert table.splitlines()[1].split() == ["device", "host", "disk"]  # a column per tier, a row per figure
        assert rows["blocks"][2] == str(prefix["blocks"]) and rows["health"] == ["ok", "ok", "ok"]
        again = complete(client.post, PROMPTS[0])
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix["blocks"] * 16
        wrong = kvctl(sock, "swap", prefix["prefix_id"], "--to", "tape")
        assert wrong.returncode != 0 and "to: invalid value 'tape'" in wrong.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        client.close()

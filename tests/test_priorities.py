"""Queue priorities: each tenant's place (tenant_priorities, set by the operator) and a request's
own `priority`, which may only defer it; lower runs first, as vLLM orders `priority`."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.config import ConfigError, resolve  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.server.calls import Principal  # noqa: E402

from .daemon_fixtures import (USER_TOKEN, apps, blocks_all_back, call, settled, start_service,  # noqa: E402
                              token_table)


def test_tenants_take_their_places_in_the_queue_and_a_request_may_defer_itself(tmp_path):
    service = start_service(tmp_path, num_blocks=64, queue_order="priority", tenant_priorities="acme=-5,batch=3")
    try:
        engine = service.engine
        with service.lock:
            engine.admission_paused = True  # everything waits, so the queue's order shows
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        asked = [("globex", 0), ("batch", 0), ("acme", 0), ("globex", 4), ("acme", 2)]
        futures = []
        for tenant, requested in asked:
            who = Principal(tenant, "user", tenant)
            futures.append(service.submit_nowait([[1, 2, 3]], params, who, lambda event: None,
                                                 service.queue_priority(tenant, requested)))
        requests = [f.result(timeout=30)[0] for f in futures]
        with service.lock:
            order = [requests.index(s.request) for s in engine.waiting()]
        # vLLM's order, lower first: acme -5, acme -5+2, globex 0, batch 3, globex 0+4; ties by arrival
        assert order == [2, 4, 0, 1, 3]
        rows = {r["request_id"]: r["priority"] for r in call(apps(service, token_table(tmp_path))[0], "GET",
                                                               "/admin/requests").json()["requests"]}
        assert [rows[r.request_id] for r in requests] == [0, 3, -5, 4, -3]
        with service.lock:
            engine.admission_paused = False
            service.lock.notify_all()
        for request in requests:
            for _ in range(600):
                if request.finished:
                    break
                time.sleep(0.05)
        assert all(r.finished for r in requests) and blocks_all_back(service)
        # acme's two went in while globex's and batch's earlier ones still waited
        unix = apps(service, token_table(tmp_path))[0]
        assert "kvd_admitted_ahead_total 2.0" in call(unix, "GET", "/metrics").text.splitlines()
        assert call(unix, "GET", "/admin/status").json()["admitted_ahead"] == 2
    finally:
        service.shutdown(1)


def test_under_priority_lpm_the_places_hold_and_each_place_goes_by_its_longest_cached_prefix(tmp_path):
    """acme at -5: its request goes first; then globex's, the one opening with the cached prompt
    first though it came last; `kvctl requests` names the order, and a router is told what waits by
    place and blocks held. The priority eviction policy and tenant_priorities take this order too."""
    service = start_service(tmp_path, num_blocks=64, queue_order="priority+lpm", tenant_priorities="acme=-5",
                            eviction="priority")
    try:
        engine, unix = service.engine, apps(service, token_table(tmp_path))[0]
        shared = list(range(1, 33))  # two blocks, cached for globex
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        def submit(tenant: str, prompt_ids: list[int]):
            who = Principal(tenant, "user", tenant)
            return service.submit_nowait([prompt_ids], params, who, lambda event: None,
                                         service.queue_priority(tenant, 0)).result(timeout=30)[0]

        warm = submit("globex", shared + [40])
        settled(lambda: warm.finished, bool)
        with service.lock:
            engine.admission_paused = True  # everything waits, so the queue's order shows
        asked = [("globex", list(range(100, 140))), ("acme", list(range(150, 190))), ("globex", shared + [41, 42])]
        requests = [submit(tenant, prompt_ids) for tenant, prompt_ids in asked]
        rows = call(unix, "GET", "/admin/requests").json()
        assert rows["queue_order"] == "priority+lpm"
        place = {row["request_id"]: row["queue_position"] for row in rows["requests"]}
        assert [place[r.request_id] for r in requests] == [3, 1, 2]
        facts = call(unix, "POST", "/admin/route-facts", json={"tokens": shared + [43], "tenant": "globex"}).json()
        assert facts["priority_lpm_waiting"] == [[-5, 0, 40], [0, 2, 2], [0, 0, 40]]
        assert facts["tenant_places"] == {"acme": -5} and facts["tokens_ahead"] == 40 + 2
        with service.lock:
            engine.admission_paused = False
            service.lock.notify_all()
        for request in requests:
            settled(lambda: request.finished, bool, timeout=30)
        first, second, third = (requests[i].metrics.admitted for i in (1, 2, 0))  # in the pass's order
        assert first < second < third and blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_request_may_not_jump_its_tenant_s_place_nor_ask_a_fifo_queue_for_one(tmp_path):
    service = start_service(tmp_path, num_blocks=64, queue_order="priority")
    fifo = start_service(tmp_path / "fifo", num_blocks=64)
    try:
        _, tcp = apps(service, token_table(tmp_path))
        auth = {"Authorization": f"Bearer {USER_TOKEN}"}
        jump = call(tcp, "POST", "/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 1, "priority": -1})
        assert jump.status_code == 400 and jump.json()["error"]["param"] == "priority"
        assert jump.json()["error"]["message"].startswith("priority: -1 would jump ahead of its tenant's place")
        assert call(tcp, "POST", "/v1/completions", headers=auth,
                    json={"prompt": "x", "max_tokens": 1, "priority": 7}).status_code == 200
        _, fifo_tcp = apps(fifo, token_table(tmp_path / "fifo"))
        refused = call(fifo_tcp, "POST", "/v1/chat/completions", headers=auth,
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "priority": 2})
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(
            "priority: 2 asks for a place in the queue, but kvd serves its queue first come, first served")
        assert call(fifo_tcp, "POST", "/v1/completions", headers=auth,
                    json={"prompt": "x", "max_tokens": 1, "priority": 0}).status_code == 200
        lpm = start_service(tmp_path / "lpm", num_blocks=64, queue_order="lpm")
        try:
            _, lpm_tcp = apps(lpm, token_table(tmp_path / "lpm"))
            refused = call(lpm_tcp, "POST", "/v1/completions", headers=auth,
                           json={"prompt": "x", "max_tokens": 1, "priority": 2})
            assert refused.status_code == 400 and refused.json()["error"]["message"] == (
                "priority: 2 asks for a place in the queue, but kvd serves its queue the longest cached prefix "
                "first (queue_order: lpm; queue_order: priority or priority+lpm orders it)")
            assert call(lpm_tcp, "POST", "/v1/completions", headers=auth,
                        json={"prompt": "x", "max_tokens": 1}).status_code == 200
        finally:
            lpm.shutdown(1)
    finally:
        service.shutdown(1)
        fifo.shutdown(1)


def test_tenant_priorities_need_a_priority_queue_and_tenant_names():
    with pytest.raises(ConfigError, match=r"tenant_priorities: set \(from --tenant-priorities\) but queue_order is "
                                          r"'fifo'; set queue_order: priority"):
        resolve({"tenant_priorities": "acme=-1"}, {})
    with pytest.raises(ConfigError, match=r"priority of 'acme' must be an integer, got 'high'"):
        resolve({"tenant_priorities": "acme=high", "queue_order": "priority"}, {})
    assert resolve({"tenant_priorities": {"b": 2, "a": -1}, "queue_order": "priority"}, {}).tenant_priorities == \
        (("a", -1), ("b", 2))


def test_the_priority_eviction_policy_keeps_the_first_tenant_s_prefix_through_another_s_burst(tmp_path):
    """eviction: priority keeps the blocks of the requests that run first (acme, at -10) through a
    burst of another tenant's new prompts, which evict each other; under lru the burst takes it.
    Each tenant's evicted blocks say whose blocks made the room."""
    from .daemon_fixtures import GLOBEX_TOKEN
    from .test_tenant_shares import cached_tokens

    quiet = list(range(1, 50))  # three full blocks and one token
    burst = [[200 + i] + list(range(1, 49)) for i in range(8)]  # 8 x 4 blocks through a 24-block cache
    from .test_router import _kvctl_prints

    cached, evicted, said = {}, {}, {}
    for policy in ("priority", "lru"):
        service = start_service(tmp_path / policy, num_blocks=24, queue_order="priority",
                                tenant_priorities="acme=-10", eviction=policy)
        try:
            unix, tcp = apps(service, token_table(tmp_path / policy))
            assert cached_tokens(tcp, USER_TOKEN, quiet) == 0
            for prompt in burst:
                cached_tokens(tcp, GLOBEX_TOKEN, prompt)
            rows = {row["tenant"]: row for row in call(unix, "GET", "/admin/tenants").json()["tenants"]}
            evicted[policy] = (rows["acme"]["evicted_blocks"], rows["globex"]["evicted_blocks"])
            metrics = call(unix, "GET", "/metrics").text
            assert f'kvd_tenant_evicted_blocks_total{{tenant="acme"}} {evicted[policy][0]}.0' in metrics
            said[policy] = [line for line in _kvctl_prints(["tenants"], call(unix, "GET", "/admin/tenants").json())
                            .splitlines() if line.startswith("evicted")]
            cached[policy] = cached_tokens(tcp, USER_TOKEN, quiet)
            status = call(unix, "GET", "/admin/status").json()
            assert status["eviction_policy"] == policy and status["evictions"]["capacity"] > 0
            assert blocks_all_back(service)
        finally:
            service.shutdown(1)
    assert cached == {"priority": 48, "lru": 0}
    # whose blocks made the room (acme's three full blocks under lru), as kvctl tenants counts them
    assert evicted == {"priority": (0, 4), "lru": (3, 1)}
    assert said == {"priority": ["evicted to make room: globex 4 blocks"],
                    "lru": ["evicted to make room: acme 3 blocks, globex 1"]}


def test_a_reload_that_moves_a_tenant_moves_its_cached_blocks_with_it(tmp_path):
    """acme, first in the queue (-10), cached a prompt it keeps reusing; the operator moves it
    last (10) with a reload. Its cached blocks rank at its new place at once (hits would otherwise
    keep the old one for as long as they come), so globex's burst takes them first."""
    from kvctl.daemon.config import resolve as resolve_config

    from .daemon_fixtures import GLOBEX_TOKEN
    from .test_router import _kvctl_prints
    from .test_tenant_shares import cached_tokens

    quiet = list(range(1, 50))  # three full blocks and one token
    burst = [[200 + i] + list(range(1, 49)) for i in range(8)]
    config = tmp_path / "kvd.yaml"
    config.write_text("queue_order: priority\neviction: priority\ntenant_priorities: {acme: 10}\n")
    state = tmp_path / "state"
    service = start_service(state, num_blocks=24, queue_order="priority", tenant_priorities="acme=-10",
                            eviction="priority")
    try:
        unix, tcp = apps(service, token_table(tmp_path))
        assert [cached_tokens(tcp, USER_TOKEN, quiet) for _ in range(3)] == [0, 48, 48]
        cached_tokens(tcp, GLOBEX_TOKEN, [250] + list(range(1, 49)))
        pool = service.engine.cache.pool

        def owners():
            with service.lock:
                return [pool.blocks[b].tenant for b in pool.policy.order()]
        assert owners() == ["globex"] * 3 + ["acme"] * 3  # acme's go last
        service.config_source = lambda: resolve_config({"state_dir": str(state), "socket": str(state / "kvd.sock"),
                                                        "num_blocks": 24}, {}, config)
        result = call(unix, "POST", "/admin/reload", json={}).json()
        assert (result["changed"], result["reranked_blocks"]) == ({"tenant_priorities": [["acme", 10]]}, {"acme": 3})
        assert owners() == ["acme"] * 3 + ["globex"] * 3  # now first
        assert "cached blocks now ranked at their tenant's new priority (eviction: priority): acme 3" in \
            _kvctl_prints(["config", "reload"], result)
        for prompt in burst:
            cached_tokens(tcp, GLOBEX_TOKEN, prompt)
        rows = {row["tenant"]: row for row in call(unix, "GET", "/admin/tenants").json()["tenants"]}
        assert rows["acme"]["evicted_blocks"] == 3
        assert cached_tokens(tcp, USER_TOKEN, quiet) == 0
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_the_priority_eviction_policy_needs_a_priority_queue():
    with pytest.raises(ConfigError) as refused:
        resolve({"eviction": "priority"}, {})
    assert str(refused.value) == (
        "eviction: priority (from --eviction) keeps the prefixes of the requests that run first, but queue_order is "
        "'fifo', where every request is equal (it would be lru); set queue_order: priority, with tenant_priorities")
    assert resolve({"eviction": "priority", "queue_order": "priority"}, {}).eviction == "priority"


def test_a_flex_request_waits_behind_the_others_under_a_priority_queue_and_says_so(tmp_path):
    """OpenAI's service_tier "flex" defers the request (service_tiers.FLEX_DEFERRAL) where the queue
    is ordered by priority; "priority" never jumps ahead (served as "default"); the answer says the
    tier that served it; a tier OpenAI has not named is a 400."""
    import threading

    service = start_service(tmp_path, num_blocks=64, queue_order="priority", tenant_priorities="batch=3")
    unix = apps(service, token_table(tmp_path))[0]
    try:
        engine = service.engine
        with service.lock:
            engine.admission_paused = True  # everything waits, so the queue's order shows
        answers: dict[str, dict] = {}
        asked = [("flex", "acme", "flex"), ("batch", "batch", None), ("premium", "acme", "priority")]

        def send(name, tenant, tier):
            answers[name] = call(unix, "POST", "/v1/chat/completions", headers={"X-KVD-Tenant": tenant}, json={
                "messages": [{"role": "user", "content": name}], "max_tokens": 2,
                **({"service_tier": tier} if tier else {})}).json()

        threads = []
        for name, tenant, tier in asked:  # one at a time, so that they arrive in this order
            threads.append(threading.Thread(target=send, args=(name, tenant, tier)))
            threads[-1].start()
            assert settled(lambda: waiting(service), lambda n: n == len(threads)) == len(threads)
        rows = call(unix, "GET", "/admin/requests").json()["requests"]
        # lower first: premium (acme 0; "priority" asks nothing more), batch 3, flex (acme 0 + 1000)
        assert sorted((r["priority"], r["tenant"]) for r in rows) == [(0, "acme"), (3, "batch"), (1000, "acme")]
        with service.lock:
            order = [s.request.params.extra.get("priority", 0) for s in engine.waiting()]
            engine.admission_paused = False
            service.lock.notify_all()
        assert order == [0, 0, 1000]  # each request's own deferral, as the trace records it
        for thread in threads:
            thread.join(30)
        assert (answers["flex"]["service_tier"], answers["premium"]["service_tier"]) == ("flex", "default")
        assert "service_tier" not in answers["batch"]  # (it named none)
        response = call(unix, "POST", "/v1/responses", json={"input": "x", "max_output_tokens": 2,
                                                             "service_tier": "flex"}).json()
        assert response["service_tier"] == "flex"
        jumping = call(unix, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                   "service_tier": "flex", "priority": -5})
        assert jumping.status_code == 400 and jumping.json()["error"]["param"] == "priority"  # not 995
        refused = call(unix, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                   "service_tier": "economy"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "service_tier"
        assert refused.json()["error"]["message"] == ("service_tier: must be one of auto, default, flex, priority, "
                                                      "scale, got 'economy'")
    finally:
        service.shutdown(1)


def test_route_facts_weigh_a_flex_request_behind_every_place_that_does_not_defer_itself(tmp_path):
    """A router asks route-facts with the request's service_tier: "flex" waits behind the work of
    every place up to 1,000 behind its tenant's, as kvd would queue it; under a FIFO queue it is
    weighed as default, and a tier OpenAI has not named is a 400."""
    service = start_service(tmp_path, num_blocks=64, queue_order="priority", tenant_priorities="batch=3")
    fifo = start_service(tmp_path / "fifo", num_blocks=64)
    try:
        engine, unix = service.engine, apps(service, token_table(tmp_path))[0]
        fifo_unix = apps(fifo, token_table(tmp_path / "fifo"))[0]
        with service.lock:
            engine.admission_paused = True  # batch's request waits
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        waits = service.submit_nowait([list(range(100, 140))], params, Principal("batch", "user", "batch"),
                                      lambda event: None, service.queue_priority("batch", 0)).result(timeout=30)[0]

        def ahead(app=unix, **asked) -> int:
            answer = call(app, "POST", "/admin/route-facts", json={"tokens": list(range(200, 220)), "tenant": "acme",
                                                                   **asked})
            assert answer.status_code == 200, answer.text
            return answer.json()["tokens_ahead"]

        assert ahead() == ahead(service_tier="default") == ahead(service_tier="priority") == 0  # acme's 0 first
        assert ahead(service_tier="flex") == ahead(priority=5) == 40  # behind batch's place, 3
        assert ahead(fifo_unix, service_tier="flex") == ahead(fifo_unix) == 0
        refused = call(unix, "POST", "/admin/route-facts", json={"tokens": [1, 2], "service_tier": "economy"})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "service_tier")
        assert refused.json()["error"]["message"] == ("service_tier: must be one of auto, default, flex, priority, "
                                                      "scale, got 'economy'")
        with service.lock:
            engine.admission_paused = False
            service.lock.notify_all()
        settled(lambda: waits.finished, bool, timeout=30)
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)
        fifo.shutdown(1)


def waiting(service) -> int:
    with service.lock:  # (the engine thread changes the queue under its lock)
        return len(service.engine.waiting())


def test_a_fifo_queue_serves_flex_as_default():
    from kvctl.daemon.server.service_tiers import deferral, served_tier

    assert [served_tier(t, "fifo") for t in ("flex", "priority", "auto")] == ["default"] * 3
    assert [served_tier(t, "lpm") for t in ("flex", "default")] == ["default"] * 2
    assert [served_tier("flex", order) for order in ("priority", "priority+lpm")] == ["flex", "flex"]
    assert (deferral("flex"), deferral("default")) == (1000, 0)

"""vLLM's `POST /reset_prefix_cache` and SGLang's `/flush_cache`, which scripts and benchmark
harnesses (AIPerf's --reset-kv-cache) call between runs: every unpinned block goes, as `kvctl
evict --all-unpinned` takes it, audited; pins stay; blocks in use stay and make it a 409 that
says so (vLLM answers 200 to a reset it did not do); `timeout` waits for requests in flight."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import ADMIN_TOKEN, apps, assert_admin_only, call, token_table  # noqa: E402
from .evict_cases import ASK_A, ASK_B, BLOCK, SYSTEM, ask, serving  # noqa: E402
from .test_router import drive, router_app  # noqa: E402


def cached_and_pinned(unix) -> tuple[int, int]:
    device = call(unix, "GET", "/admin/status").json()["blocks"]["device"]
    return device["cached"], device["pinned"]


def test_a_reset_takes_every_unpinned_block_keeps_the_pins_and_is_audited(tmp_path):
    with serving(tmp_path, disk_cache_bytes="16MiB", tiering="always", write_policy="write_through") as (service,
                                                                                                        unix):
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"})
        assert pinned.status_code == 200, pinned.text
        ask(unix, ASK_A)
        ask(unix, ASK_B)
        assert service.tiers.flush(timeout=10)
        cached, pins = cached_and_pinned(unix)
        assert pins == len(SYSTEM) // BLOCK and cached > 0
        on_disk = call(unix, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"]
        answer = call(unix, "POST", "/reset_prefix_cache")
        assert answer.status_code == 200
        body = answer.json()
        assert (body["result"], body["target"], body["evicted_blocks"]) == ("ok", "all_unpinned", cached)
        assert body["lower_tier_blocks_dropped"] == on_disk - pins  # the pinned prefix's disk copies stay
        assert cached_and_pinned(unix) == (0, pins)
        [row] = call(unix, "GET", "/admin/prefixes").json()["prefixes"]  # the pinned system prompt alone
        assert (row["start_token"], row["tokens"], row["pinned"], row["tiers"]) == (0, len(SYSTEM), True,
                                                                                   {"device": 3, "disk": 3})
        entry = call(unix, "GET", "/admin/audit").json()["entries"][0]
        assert (entry["action"], entry["target"], entry["result"], entry["actor"]) == (
            "evict", "all_unpinned", "ok", "unix-socket")
        assert ask(unix, ASK_A)["usage"]["prompt_tokens_details"]["cached_tokens"] == len(SYSTEM)  # the pin's
        cached = cached_and_pinned(unix)[0]  # ASK_A's own blocks again
        again = call(unix, "GET", "/flush_cache")  # SGLang's name, and its GET
        assert again.status_code == 200 and again.json()["evicted_blocks"] == cached > 0
        assert cached_and_pinned(unix) == (0, pins)


def test_a_reset_needs_the_admin_role_on_tcp_and_refuses_a_bad_timeout(tmp_path):
    with serving(tmp_path) as (service, _):
        _, tcp = apps(service, token_table(tmp_path))
        assert_admin_only(tcp, "POST", "/flush_cache")
        assert_admin_only(tcp, "POST", "/reset_prefix_cache")
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert call(tcp, "POST", "/reset_prefix_cache", headers=admin).status_code == 200
        bad = call(tcp, "POST", "/flush_cache?timeout=-1", headers=admin)
        assert bad.status_code in (400, 422) and "timeout" in bad.text


def running(unix, long_prompt) -> threading.Thread:
    """A long completion on a thread of its own, returned once it runs and holds blocks."""
    thread = threading.Thread(target=ask_long, args=(unix, long_prompt), daemon=True)
    thread.start()
    for _ in range(500):
        rows = call(unix, "GET", "/admin/requests").json()["requests"]
        if rows and rows[0]["state"] != "waiting" and rows[0]["blocks"] > 0:
            return thread
        time.sleep(0.01)
    raise AssertionError("the long request never ran")


def ask_long(unix, prompt) -> None:
    call(unix, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1500, "temperature": 0,
                                                "ignore_eos": True})


def test_blocks_in_use_stay_and_make_it_a_409_unless_the_reset_waits_for_them(tmp_path):
    with serving(tmp_path, num_blocks=256) as (service, unix):
        ask(unix, ASK_B)
        thread = running(unix, ASK_A)
        try:
            busy = call(unix, "POST", "/reset_prefix_cache")
            assert busy.status_code == 409
            body = busy.json()
            held = body["skipped"]["in_use"]
            assert body["result"] == "partial" and held >= len(ASK_A) // BLOCK
            assert body["message"] == f"{held} blocks are in use by running requests and were not evicted"
            assert body["evicted_blocks"] == 3  # ASK_B's own full blocks (its prompt's and answer's); SYSTEM is in use
        finally:
            for row in call(unix, "GET", "/admin/requests").json()["requests"]:
                call(unix, "POST", "/admin/cancel", json={"request_ids": [row["request_id"]]})
            thread.join(30)
        thread = running(unix, ASK_A)
        waited = call(unix, "POST", "/flush_cache?timeout=120")  # until the request is done
        assert waited.status_code == 200 and waited.json()["result"] == "ok"
        assert "in_use" not in waited.json()["skipped"]
        thread.join(30)
        assert not thread.is_alive()
        assert call(unix, "GET", "/admin/requests").json()["requests"] == []
        assert cached_and_pinned(unix) == (0, 0)


def test_a_reset_at_the_router_resets_every_replica(tmp_path):
    from kvctl.daemon.server.app import create_app

    with serving(tmp_path / "a") as (first, unix_a), serving(tmp_path / "b") as (second, unix_b):
        ask(unix_a, ASK_A)
        ask(unix_b, ASK_B)
        ask(unix_b, ASK_A)
        held = [cached_and_pinned(unix)[0] for unix in (unix_a, unix_b)]
        router, app = router_app([create_app(s, s.metrics, front="unix") for s in (first, second)])

        async def reset(client):
            return await client.post("/reset_prefix_cache")
        [answer] = drive(app, [reset])
        assert answer.status_code == 200
        body = answer.json()
        assert (body["result"], body["evicted_blocks"]) == ("ok", sum(held))
        assert [r["evicted_blocks"] for r in body["replicas"]] == held
        assert [cached_and_pinned(unix) for unix in (unix_a, unix_b)] == [(0, 0), (0, 0)]

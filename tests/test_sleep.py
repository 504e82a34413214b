"""kvd asleep (sleep_ops.py): vLLM's POST /sleep, /wake_up and GET /is_sleeping, SGLang's
/release_memory_occupation and /resume_memory_occupation, `kvctl sleep` and `kvctl wake`.

The cache's memory is given back (the K/V storage freed), its cached blocks written to a lower tier
first; at level 2 the weights go too and waking reads the checkpoint again, refusing a changed one.
Asleep, completions get a 503 and the device is empty; awake again, the same prompt gives the same
tokens, its prefix restored from the lower tier, and the pins are warm."""

from __future__ import annotations

import gc
import json
import re
import weakref

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from kvctl.daemon.cache import KVCacheManager  # noqa: E402
from kvctl.daemon.cache.errors import AuditFailure  # noqa: E402
from kvctl.daemon.cache.keys import Namespace  # noqa: E402
from kvctl.errors import UserError  # noqa: E402

from .conftest import run_prompt  # noqa: E402
from .daemon_fixtures import ADMIN_TOKEN, apps, assert_admin_only, call, token_table  # noqa: E402
from .evict_cases import ASK_A, ASK_B, BLOCK, SYSTEM, ask, serving  # noqa: E402
from .lora_cases import write_adapter  # noqa: E402
from .test_cache_reset import running  # noqa: E402
from .test_router import drive, router_app  # noqa: E402

HOST = {"host_cache_bytes": "16MiB", "tiering": "always"}


def device_counts(unix) -> dict:
    return call(unix, "GET", "/admin/status").json()["blocks"]["device"]


def storage_bytes(service) -> list[int]:
    return [t.untyped_storage().nbytes() for c in service.engine.kv_caches for t in (c.k, c.v)]


def completion(unix, tokens):
    return call(unix, "POST", "/v1/completions", json={"prompt": tokens, "max_tokens": 4, "temperature": 0})


def adapter_tokens(unix, model: str) -> list[int]:
    """The greedy tokens LoRA adapter `model` gives for ASK_A."""
    answer = call(unix, "POST", "/v1/completions", json={"model": model, "prompt": ASK_A, "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


# ---- the cache core ---------------------------------------------------------------------------

def test_release_all_drops_every_block_pinned_ones_too_and_keeps_the_pins():
    cache = KVCacheManager(16, 4)
    namespace = Namespace(block_size=4, tenant="acme")
    tokens = list(range(12))
    run_prompt(cache, "s1", tokens, namespace=namespace)
    cache.release("s1")
    result = cache.pin(namespace, tokens[:8], owner="ops")
    assert (cache.state_counts()["cached"], cache.state_counts()["pinned"]) == (1, 2)
    report = cache.release_all()
    assert (report.evicted_blocks, report.skipped) == (3, {})
    counts = cache.state_counts()
    assert (counts["free"], counts["cached"], counts["pinned"]) == (16, 0, 0)
    assert cache.pool.sleep_evictions == 3 and cache.pool.operator_evictions == 0
    assert [p.pin_id for p in cache.pins.all()] == [result.pin.pin_id]  # the pin stays
    cache.audit()
    # the prefix computed again pins as it is filled
    run_prompt(cache, "s2", tokens, namespace=namespace)
    cache.release("s2")
    assert (cache.state_counts()["cached"], cache.state_counts()["pinned"]) == (1, 2)
    cache.audit()


def test_release_all_is_refused_while_a_sequence_holds_blocks_and_drops_nothing():
    cache = KVCacheManager(8, 4)
    run_prompt(cache, "s1", list(range(8)), reserve=4)
    before = cache.state_counts()
    with pytest.raises(AuditFailure, match="release_all: 1 sequences hold blocks; the cache is released only when "
                                           "none does"):
        cache.release_all()
    assert cache.state_counts() == before and cache.pool.sleep_evictions == 0


def test_weights_offloaded_to_host_memory_come_back_and_compute_the_same(tmp_path):
    """The level-1 path of a GPU (a host copy, the originals let go), run on the CPU: the same
    weights and the same tokens after the round trip."""
    with serving(tmp_path) as (service, unix):
        before = ask(unix, ASK_A)["choices"][0]["text"]
        model = service.loaded.model
        held = model.weight_bytes()
        first_layer_qkv = weakref.ref(model.layers[0].qkv)
        embed = model.w["model.embed_tokens.weight"].clone()
        assert model.release_weights(keep_host_copy=True) == held
        assert model.weights_released and model.w == {} and model.lm_head is None
        gc.collect()
        assert first_layer_qkv() is None  # the host copy is a copy: the originals' memory is free
        assert model.release_weights(keep_host_copy=True) == 0  # released already: the copy stays
        assert model.restore_weights() == held and not model.weights_released
        assert torch.equal(model.w["model.embed_tokens.weight"], embed)
        call(unix, "POST", "/reset_prefix_cache")
        assert ask(unix, ASK_A)["choices"][0]["text"] == before


def test_an_adapter_offloaded_to_host_memory_comes_back_and_computes_the_same(tmp_path):
    """The GPU path of a sleeping LoRA adapter (a host copy, the originals let go), run on the CPU:
    the same packed weights and the same tokens after the round trip."""
    folder = write_adapter(tmp_path / "sql", rank=4, alpha=8, seed=1)
    with serving(tmp_path, lora_modules=f"sql={folder}") as (service, unix):
        before = adapter_tokens(unix, "sql")
        adapter = service.adapters()["sql"]
        packed = weakref.ref(adapter.layers[0]["qkv"].a)
        down = adapter.layers[1]["down"].b.clone()
        assert adapter.offload() == adapter.nbytes > 0
        gc.collect()
        assert packed() is None  # the host copy is a copy: the originals' memory is free
        assert adapter.offloaded_from == torch.device("cpu") and adapter.device == torch.device("cpu")
        assert adapter.offload() == 0  # in host memory already: the copy stays
        assert adapter.restore() == adapter.nbytes and adapter.offloaded_from is None
        assert adapter.restore() == 0
        assert torch.equal(adapter.layers[1]["down"].b, down)
        call(unix, "POST", "/reset_prefix_cache")
        assert adapter_tokens(unix, "sql") == before


# ---- level 1 on the CPU, with a host tier --------------------------------------------------------

def test_asleep_the_cache_memory_is_given_back_and_waking_restores_what_was_cached(tmp_path):
    with serving(tmp_path, **HOST) as (service, unix):
        before = ask(unix, ASK_A)
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"})
        assert pinned.status_code == 200, pinned.text
        cached = device_counts(unix)
        assert (cached["cached"], cached["pinned"]) == (3, 3)  # ASK_A's own 3 blocks, and SYSTEM's pinned
        engine = service.engine
        total_bytes = engine.cache.num_blocks * engine.cache.block_bytes
        answer = call(unix, "POST", "/sleep?level=1")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert {k: body[k] for k in ("is_sleeping", "already", "level", "released", "weights", "cache_bytes",
                                     "weight_bytes", "dropped_blocks", "saved_blocks", "held_below",
                                     "discarded_blocks", "saved_to", "by")} == {
            "is_sleeping": True, "already": False, "level": 1, "released": ["kv_cache"], "weights": "kept",
            "cache_bytes": total_bytes, "weight_bytes": 0, "dropped_blocks": 6, "saved_blocks": 6, "held_below": 0,
            "discarded_blocks": 0, "saved_to": "host", "by": "unix-socket"}
        assert storage_bytes(service) == [0] * len(storage_bytes(service))
        assert device_counts(unix) == {"total": 64, "free": 64, "reserved": 0, "active": 0, "shared": 0,
                                       "cached": 0, "pinned": 0}
        # asleep: completions are refused as a router expects, probes and reads answer
        refused = completion(unix, ASK_A)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        error = refused.json()["error"]
        assert error["code"] == "asleep" and error["message"].startswith("kvd is asleep (level 1 since ")
        assert error["message"].endswith(", by unix-socket): its cache's memory is given back; `kvctl wake` (POST "
                                         "/wake_up) takes it again")
        chat = call(unix, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "asleep"
        ready = call(unix, "GET", "/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == error["message"]
        assert call(unix, "GET", "/health").status_code == 200
        assert call(unix, "GET", "/is_sleeping").json()["is_sleeping"] is True
        status = call(unix, "GET", "/admin/status").json()
        assert status["asleep"]["released"] == ["kv_cache"] and status["evictions"]["sleep"] == 6
        metrics = call(unix, "GET", "/metrics").text
        assert "kvd_sleep_level 1.0" in metrics and 'kvd_evicted_blocks_total{reason="sleep"} 6.0' in metrics
        assert 'kvd_requests_refused_total{reason="asleep"} 2.0' in metrics  # the completion and the chat
        removed = call(unix, "GET", "/admin/events?kind=removed&tier=device").json()["events"]
        assert sum(len(e["keys"]) for e in removed if e["reason"] == "sleep") == 6
        # a pin made asleep stands, unwarmed; a swap to the device is refused
        later = call(unix, "POST", "/admin/pins", json={"tokens": ASK_B[:4 * BLOCK], "owner": "ops"})
        assert later.status_code == 200 and later.json()["warmed"] is False
        rows = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
        [prefix] = [r["prefix_id"] for r in rows if (r["tokens"], r["tiers"]) == (96, {"host": 6})]  # ASK_A, whole
        swap = call(unix, "POST", "/admin/swap", json={"prefix": prefix, "to": "device"})
        assert swap.status_code == 503 and swap.json()["error"]["message"] == error["message"]
        by_id = call(unix, "POST", "/admin/pins", json={"prefix": prefix, "owner": "ops"})  # in host memory now
        assert by_id.status_code == 200 and by_id.json()["cached_blocks"] == 0  # stored and audited: it warms later
        assert by_id.json()["pin_id"] in {row["pin_id"] for row in call(unix, "GET", "/admin/pins").json()["pins"]}
        again = call(unix, "POST", "/admin/sleep", json={"level": 1})
        assert again.json()["already"] is True and again.json()["since"] == body["since"]
        # awake: the storage is back, the pinned prefix warms, the same prompt gives the same tokens
        woke = call(unix, "POST", "/wake_up")
        assert woke.status_code == 200, woke.text
        assert {k: woke.json()[k] for k in ("is_sleeping", "woke", "cache_bytes", "pins_warming")} == {
            "is_sleeping": False, "woke": ["kv_cache"], "cache_bytes": total_bytes, "pins_warming": 3}
        assert storage_bytes(service) == [t.numel() * t.element_size() for c in engine.kv_caches for t in (c.k, c.v)]
        service.pin_warmer.join(30)
        # ASK_A's 6 blocks (SYSTEM's among them) back from host memory, pinned; ASK_B's pin was never computed
        assert device_counts(unix)["pinned"] == 6
        after = ask(unix, ASK_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK  # restored, not computed
        assert call(unix, "GET", "/readyz").status_code == 200
        assert "kvd_sleep_level 0.0" in call(unix, "GET", "/metrics").text
        audit = call(unix, "GET", "/admin/audit").json()["entries"]
        assert (audit[0]["action"], audit[0]["target"], audit[0]["result"]) == ("wake", "memory", "ok")
        [slept] = [e for e in audit if e["action"] == "sleep"]  # the second, a no-op, is not an action
        assert (slept["target"], slept["result"], slept["detail"]["saved_blocks"], slept["detail"]["tags"]) == (
            "memory", "ok", 6, ["kv_cache", "weights"])  # as asked: on the CPU the weights stay


def test_without_a_lower_tier_the_cached_blocks_are_dropped_and_computed_again(tmp_path):
    with serving(tmp_path) as (service, unix):
        before = ask(unix, ASK_A)
        body = call(unix, "POST", "/admin/sleep", json={}).json()
        assert (body["dropped_blocks"], body["saved_blocks"], body["discarded_blocks"], body["saved_to"]) == (
            6, 0, 6, None)
        assert call(unix, "POST", "/admin/wake", json={}).json()["pins_warming"] == 0
        after = ask(unix, ASK_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_quantised_cache_sleeps_and_wakes_with_its_scales(tmp_path):
    """An int8 cache: its storage goes and comes back, its per-head scales stay (they are not the
    cache's memory), and the blocks restored from host memory decode to the same tokens."""
    with serving(tmp_path, cache_dtype="int8", allow_uncalibrated=True, **HOST) as (service, unix):
        before = ask(unix, ASK_A)
        scales = service.engine.loaded_scales()
        body = call(unix, "POST", "/admin/sleep", json={}).json()
        assert (body["dropped_blocks"], body["saved_blocks"]) == (6, 6)
        assert {t.dtype for c in service.engine.kv_caches for t in (c.k, c.v)} == {torch.int8}
        assert storage_bytes(service) == [0] * len(storage_bytes(service))
        call(unix, "POST", "/admin/wake", json={})
        assert service.engine.loaded_scales() == scales
        after = ask(unix, ASK_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK


# ---- level 2: the weights go too ------------------------------------------------------------------

def test_level_2_drops_the_weights_and_waking_reads_the_checkpoint_unless_it_changed(tmp_path):
    with serving(tmp_path, **HOST) as (service, unix):
        before = ask(unix, ASK_B)
        model = service.loaded.model
        held = model.weight_bytes()
        qkv = weakref.ref(model.layers[0].qkv)
        body = call(unix, "POST", "/admin/sleep", json={"level": 2}).json()
        assert (body["released"], body["weights"], body["weight_bytes"]) == (["kv_cache", "weights"], "discarded",
                                                                              held)
        gc.collect()
        assert qkv() is None and model.weights_released  # nothing holds them: their memory is free
        config = service.loaded.path / "config.json"
        original = config.read_text()
        config.write_text(original.replace("{", "{\n", 1))  # the same settings, other bytes: another revision
        refused = call(unix, "POST", "/admin/wake", json={})
        assert refused.status_code == 409
        message = refused.json()["error"]["message"]
        assert message.startswith(f"model: the checkpoint at {service.loaded.path} changed while kvd slept (revision "
                                  f"{service.loaded.revision[:12]}, now ")
        assert message.endswith("restart kvd to serve the new ones. kvd stays asleep")
        assert call(unix, "GET", "/is_sleeping").json()["is_sleeping"] is True
        assert completion(unix, ASK_B).status_code == 503 and model.weights_released
        assert storage_bytes(service)[0] == 0  # nothing was taken back: the weights come first
        config.write_text(original)
        woke = call(unix, "POST", "/admin/wake", json={}).json()
        assert (woke["woke"], woke["weights"], woke["weight_bytes"]) == (["kv_cache", "weights"],
                                                                         "read again from the checkpoint", held)
        after = ask(unix, ASK_B)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
        refusal = next(e for e in call(unix, "GET", "/admin/audit").json()["entries"] if e["result"] == "refused")
        assert (refusal["action"], refusal["detail"]["error"]) == ("wake", message)


def test_the_weights_wake_first_then_the_cache_as_vllm_and_sglang_tags_ask(tmp_path):
    with serving(tmp_path) as (service, unix):
        call(unix, "POST", "/sleep?level=2")
        weights = call(unix, "POST", "/wake_up?tags=weights").json()
        assert (weights["is_sleeping"], weights["woke"], weights["still_released"]) == (True, ["weights"],
                                                                                          ["kv_cache"])
        assert not service.loaded.model.weights_released and completion(unix, ASK_A).status_code == 503
        assert call(unix, "POST", "/wake_up?tags=kv_cache").json()["is_sleeping"] is False
        assert completion(unix, ASK_A).status_code == 200
        # SGLang's: release the cache alone, then resume
        released = call(unix, "POST", "/release_memory_occupation", json={"tags": ["kv_cache"]}).json()
        assert (released["released"], released["weights"]) == (["kv_cache"], None)
        assert call(unix, "POST", "/resume_memory_occupation", json={}).json()["woke"] == ["kv_cache"]
        bad = call(unix, "POST", "/admin/sleep", json={"tags": ["activations"]})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == (
            "tags: unknown tag 'activations'; use kv_cache or weights")
        level = call(unix, "POST", "/sleep?level=3")
        assert level.status_code == 400 and level.json()["error"]["param"] == "level"
        assert call(unix, "POST", "/wake_up").json() == {"is_sleeping": False, "woke": [], "already": True}


# ---- requests in flight, roles --------------------------------------------------------------------

def test_requests_in_flight_keep_kvd_awake_unless_the_sleep_waits_for_them(tmp_path):
    with serving(tmp_path, num_blocks=256) as (service, unix):
        thread = running(unix, ASK_A)
        busy = call(unix, "POST", "/admin/sleep", json={"level": 1})
        assert busy.status_code == 409
        assert busy.json()["error"]["message"] == (
            "requests in flight: 1 running, 0 waiting; kvd stays awake (timeout=S waits up to S seconds for them; "
            "`kvctl cancel` or `kvctl drain` first)")
        assert service.asleep is None and completion(unix, ASK_B).status_code == 200  # still serving
        refused = call(unix, "GET", "/admin/audit").json()["entries"][0]
        assert (refused["action"], refused["result"]) == ("sleep", "refused")
        waited = call(unix, "POST", "/sleep?level=1&timeout=120")  # until the long request is done
        assert waited.status_code == 200 and waited.json()["is_sleeping"] is True
        thread.join(30)
        assert not thread.is_alive() and call(unix, "GET", "/admin/requests").json()["requests"] == []


def test_a_submission_handed_in_as_kvd_falls_asleep_is_refused_by_the_engine_thread(tmp_path):
    """A completion that passed the gate just before the sleep began reaches the engine thread after
    it: the engine thread refuses it, so no step runs on a cache whose memory is going."""
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal, ServiceError
    from kvctl.daemon.server.sleep_ops import Sleep

    with serving(tmp_path) as (service, _):
        engine = service.engine
        with service.lock:  # the engine thread waits here, so the submission is queued after the flag
            service.asleep = Sleep(1, 0.0, "ops")
            service.require_awake = lambda: engine  # the gate as it stood before the sleep
            future = service.submit_nowait([ASK_A], SamplingParams(max_tokens=2), Principal("default", "admin", "ops"),
                                           lambda event: None)
        with pytest.raises(ServiceError, match=r"^kvd is asleep \(level 1 since 1970-01-01 00:00:00 UTC, by ops\)"):
            future.result(timeout=10)
        assert not engine.has_work() and not engine.requests
        service.asleep = None
        del service.require_awake


def test_sleep_and_wake_need_the_admin_role_on_tcp(tmp_path):
    with serving(tmp_path) as (service, _):
        _, tcp = apps(service, token_table(tmp_path))
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation")):
            assert_admin_only(tcp, method, path)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        slept = call(tcp, "POST", "/sleep", headers=admin)
        assert slept.status_code == 200 and slept.json()["by"] == "token:2"  # the token file's line, as audited
        assert call(tcp, "POST", "/wake_up", headers=admin).json()["is_sleeping"] is False


# ---- kvd router -----------------------------------------------------------------------------------

def test_sleep_at_the_router_puts_every_replica_to_sleep_and_it_routes_nowhere_until_they_wake(tmp_path):
    from kvctl.daemon.server.app import create_app

    with serving(tmp_path / "a") as (first, unix_a), serving(tmp_path / "b") as (second, unix_b):
        ask(unix_a, ASK_A)
        ask(unix_b, ASK_B)
        router, app = router_app([create_app(s, s.metrics, front="unix") for s in (first, second)])

        async def go_to_sleep(client):
            return await client.post("/admin/sleep", json={"level": 1})

        async def asked(client):
            return await client.get("/is_sleeping")

        async def complete(client):
            return await client.post("/v1/completions", json={"prompt": ASK_A, "max_tokens": 2})

        async def wake(client):
            return await client.post("/wake_up")

        async def fleet(client):
            return await client.get("/router/status")

        [slept, state, refused, seen] = drive(app, [go_to_sleep, asked, complete, fleet])
        body = slept.json()
        assert slept.status_code == 200 and body["result"] == "ok"
        assert (body["is_sleeping"], body["dropped_blocks"], body["discarded_blocks"]) == (True, 12, 12)
        assert [(r["replica"], r["dropped_blocks"]) for r in body["replicas"]] == [("replica-0", 6), ("replica-1", 6)]
        assert state.json()["is_sleeping"] is True and first.asleep is not None and second.asleep is not None
        assert refused.status_code == 503
        # the route facts of the request it could not place said so: each replica shows as asleep
        assert [(r["replica"], r.get("draining")) for r in seen.json()["replicas"]] == [
            ("replica-0", "asleep"), ("replica-1", "asleep")]
        [woke, served] = drive(app, [wake, complete])
        assert woke.json()["is_sleeping"] is False and [r["woke"] for r in woke.json()["replicas"]] == [
            ["kv_cache"], ["kv_cache"]]
        assert served.status_code == 200


# ---- kvctl ----------------------------------------------------------------------------------------

def kvctl_on(unix, args: list[str]) -> tuple[int, str]:
    """kvctl run against the in-process kvd `unix` (its exit status and what it printed)."""
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app

    class Through:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def post(self, path, body):
            answer = call(unix, "POST", path, json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

        def get(self, path, **params):  # (as kvctl's client: a parameter not given is not sent)
            return call(unix, "GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.command_kit.Client", Through)
        result = CliRunner().invoke(kvctl_app, args, env={"COLUMNS": "120"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # (kvctl's main prints a UserError and exits 2)
    return result.exit_code, result.output


def test_kvctl_sleep_and_wake_say_what_went_and_what_came_back(tmp_path):
    with serving(tmp_path, **HOST) as (service, unix):
        ask(unix, ASK_A)
        call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"})
        total = service.engine.cache.num_blocks * service.engine.cache.block_bytes
        code, out = kvctl_on(unix, ["sleep", "--level", "2"])
        weights = service.loaded.model
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0] == "asleep at level 2: completions get 503 until `kvctl wake`"
        assert lines[1] == (f"  cache    {total / 2**20:.1f} MiB given back; of 6 cached blocks: 6 written to the host "
                            "tier, 0 there already, 0 dropped")
        assert lines[2].startswith("  weights  ") and lines[2].endswith(" MiB dropped; waking reads the checkpoint "
                                                                         "again")
        assert weights.weights_released
        code, out = kvctl_on(unix, ["status"])
        words = " ".join(out.split())  # the table wraps the row
        assert re.search(r"asleep level 2 since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, by unix-socket: the cache's memory "
                         r"and the weights given back; completions get 503 until `kvctl wake` ", words)
        assert "evictions 0 by lru, 0 by operators, 6 as kvd went to sleep " in words
        code, out = kvctl_on(unix, ["sleep"])
        assert code == 0 and out.startswith("asleep already: level 2 since ") and out.rstrip().endswith(
            "by unix-socket (kv_cache, weights given back)")
        code, out = kvctl_on(unix, ["wake", "--only", "weights"])
        assert out.splitlines()[0] == "still asleep: kv_cache given back (`kvctl wake` takes the rest)"
        assert out.splitlines()[1].startswith("  weights  ") and "read again from the checkpoint in " in out
        code, out = kvctl_on(unix, ["wake"])
        lines = out.splitlines()
        assert code == 0 and lines[0].startswith("awake after ") and lines[0].endswith(
            " asleep: completions are taken again")
        assert lines[1] == (f"  cache    {total / 2**20:.1f} MiB taken again, empty: 1 pinned prefix warming from the "
                            "lower tiers, the rest as requests ask")
        code, out = kvctl_on(unix, ["wake"])
        assert out.strip() == "awake already: completions are taken"
        with pytest.raises(UserError, match="^only: unknown value 'gpu'; use kv-cache or weights$"):
            kvctl_on(unix, ["sleep", "--only", "gpu"])


def test_kvctl_sleep_and_wake_say_where_the_lora_adapters_went():
    """What kvctl prints of the adapters: moved to host memory on a GPU (kvd's answer as it gives
    it there), left in host memory on the CPU, and nothing of them from a kvd serving none."""
    from kvctl.sleep_cmd import asleep_text, awake_text

    asleep = {"level": 2, "released": ["weights"], "weights": "discarded", "weight_bytes": 3 * 2**30,
              "adapters": "offloaded", "adapter_bytes": 40 * 2**20}
    assert asleep_text(asleep).splitlines()[1:] == [
        "  weights  3.0 GiB dropped; waking reads the checkpoint again",
        "  adapters 40.0 MiB moved to host memory; waking copies them back"]
    assert asleep_text({**asleep, "adapters": "kept", "adapter_bytes": 0}).splitlines()[2] == (
        "  adapters stay in host memory (kvd runs on the CPU)")
    assert len(asleep_text({**asleep, "adapters": None}).splitlines()) == 2
    woke = {"is_sleeping": True, "still_released": ["kv_cache"], "woke": ["weights"], "weight_bytes": 3 * 2**30,
            "weights": "read again from the checkpoint", "weights_seconds": 2.5, "adapter_bytes": 40 * 2**20,
            "adapters": "copied back from host memory"}
    assert awake_text(woke).splitlines()[1:] == ["  weights  3.0 GiB read again from the checkpoint in 2.50 s",
                                                 "  adapters 40.0 MiB copied back from host memory"]


def test_kvctl_sleep_json_is_kvds_answer(tmp_path):
    with serving(tmp_path) as (_, unix):
        code, out = kvctl_on(unix, ["sleep", "--json"])
        body = json.loads(out)
        assert code == 0 and body["is_sleeping"] is True and body["released"] == ["kv_cache"]
        code, out = kvctl_on(unix, ["wake", "--json"])
        assert json.loads(out)["woke"] == ["kv_cache"]


def test_pins_do_not_warm_while_asleep(tmp_path):
    """Warming pins (as kvd starts or wakes) stops while kvd is asleep: nothing is copied to a device
    cache whose memory is given back, and the books stay whole."""
    from kvctl.daemon.server import tier_ops

    with serving(tmp_path, **HOST) as (service, unix):
        call(unix, "POST", "/admin/pins", json={"tokens": SYSTEM, "owner": "ops"})
        call(unix, "POST", "/admin/sleep", json={})
        assert tier_ops.warm_pins(service) == 0
        with service.lock:
            service.engine.cache.audit()
        assert device_counts(unix)["free"] == 64
        call(unix, "POST", "/admin/wake", json={})
        service.pin_warmer.join(30)
        assert device_counts(unix)["pinned"] == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_level_1_gives_the_gpu_memory_back_and_waking_serves_the_same_tokens(tmp_path):
    """Level 1 on a GPU: the cache's memory and the weights leave the device (the weights to host
    memory), torch's allocator gives it back to the driver, and waking copies the weights back."""
    with serving(tmp_path, device="cuda", dtype="bfloat16", **HOST) as (service, unix):
        ask(unix, ASK_A)
        before = ask(unix, ASK_A)  # from the cache, as after waking: bf16 sums alike, the same tokens
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        body = call(unix, "POST", "/admin/sleep", json={"level": 1}).json()
        assert (body["released"], body["weights"]) == (["kv_cache", "weights"], "offloaded")
        torch.cuda.synchronize()
        assert held - torch.cuda.memory_allocated() >= body["cache_bytes"] + body["weight_bytes"]
        assert torch.cuda.memory_reserved() <= torch.cuda.memory_allocated() + 64 * 2**20  # back to the driver
        woke = call(unix, "POST", "/admin/wake", json={}).json()
        assert woke["woke"] == ["kv_cache", "weights"] and woke["weights"] == "copied back from host memory"
        after = ask(unix, ASK_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_lora_adapters_go_to_host_memory_with_the_weights_and_come_back(tmp_path):
    """On a GPU a LoRA adapter's weights leave the device with the model's, at level 2 too (a
    host copy, not its folder read again), and waking copies them back: the same tokens."""
    folder = write_adapter(tmp_path / "sql", rank=4, alpha=8, seed=1)
    with serving(tmp_path, device="cuda", dtype="bfloat16", lora_modules=f"sql={folder}", **HOST) as (service, unix):
        adapter_tokens(unix, "sql")
        before = adapter_tokens(unix, "sql")  # from the cache, as after waking
        adapter = service.adapters()["sql"]
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        body = call(unix, "POST", "/admin/sleep", json={"level": 2}).json()
        assert (body["weights"], body["adapters"], body["adapter_bytes"]) == ("discarded", "offloaded",
                                                                              adapter.nbytes)
        assert adapter.device.type == "cpu"
        torch.cuda.synchronize()
        assert held - torch.cuda.memory_allocated() >= body["cache_bytes"] + body["weight_bytes"] + adapter.nbytes
        woke = call(unix, "POST", "/admin/wake", json={}).json()
        assert (woke["adapters"], woke["adapter_bytes"]) == ("copied back from host memory", adapter.nbytes)
        assert adapter.device.type == "cuda"
        assert adapter_tokens(unix, "sql") == before

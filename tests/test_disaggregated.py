"""Disaggregated prefill and decode: a prefill kvd computes a prompt and writes its blocks to the
shared Redis (vLLM's kv_transfer_params, do_remote_decode), a decode kvd takes them from there
(do_remote_prefill) and computes only its prompt's tail; kvd router --prefill/--decode does both
hops for each completion (daemon/server/kv_transfer.py, router.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from .daemon_fixtures import USER_TOKEN, apps, call, sse_events, start_service, token_table  # noqa: E402
from .tier_fixtures import redis_server  # noqa: E402,F401

BLOCK = 16
PROMPT = ("You are the support desk of a fleet of KV caches; answer in one line and name the setting. " * 4)
GREEDY = {"max_tokens": 8, "temperature": 0}
PREFILL = {"kv_transfer_params": {"do_remote_decode": True}}


def unix_app(service):
    from kvctl.daemon.server.app import create_app

    return create_app(service, service.metrics, front="unix")


@pytest.fixture
def pair(tmp_path, redis_server):
    """A prefill kvd and a decode kvd sharing one Redis (write_back: nothing goes there unasked)."""
    settings = {"num_blocks": 128, "remote_url": redis_server.url}
    services = [start_service(tmp_path / name, **settings) for name in ("prefill", "decode")]
    try:
        yield services
    finally:
        for service in services:
            service.shutdown(deadline=2)


def prompt_blocks(service, text: str) -> int:
    """Full blocks of the prompt a request may take from a cache (all but the last token's)."""
    ids = service.tokenize(text)
    return (len(ids) - 1) // BLOCK


def metric(text: str, line_start: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_a_decode_kvd_takes_the_prompt_a_prefill_kvd_computed_through_redis_and_answers_the_same(pair):
    prefill, decode = pair
    blocks = prompt_blocks(prefill, PROMPT)
    first = call(unix_app(prefill), "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **PREFILL})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params.pop("publish_seconds") > 0
    assert params == {"do_remote_decode": False, "do_remote_prefill": True, "remote_tier": "redis",
                      "remote_blocks": blocks, "remote_tokens": blocks * BLOCK, "published_blocks": blocks,
                      "prompt_blocks": blocks, "block_size": BLOCK}
    assert decode.engine.cache.pool.match(prefill.engine.prefix_keys("default", prefill.tokenize(PROMPT))[2]) == []
    answer = call(unix_app(decode), "POST", "/v1/completions", json={"prompt": PROMPT, **GREEDY,
                                                                     "kv_transfer_params": params})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    fetch_seconds = body["kv_transfer_params"].pop("fetch_seconds")
    assert body["kv_transfer_params"] == {"do_remote_prefill": True, "fetched_blocks": blocks,
                                          "fetched_tokens": blocks * BLOCK, "cached_blocks": blocks,
                                          "prompt_blocks": blocks, "block_size": BLOCK}
    # the tokens of a kvd that computed the whole prompt itself
    whole = call(unix_app(prefill), "POST", "/v1/completions", json={"prompt": PROMPT, **GREEDY}).json()
    assert body["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    # the decode computed the prompt's tail only: its hit tokens are the transferred blocks
    assert decode.engine.stats.hit_tokens == blocks * BLOCK
    assert decode.engine.stats.prompt_tokens == len(decode.tokenize(PROMPT))
    # a second prefill of the same prompt writes nothing again
    again = call(unix_app(prefill), "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **PREFILL})
    assert again.json()["kv_transfer_params"]["published_blocks"] == 0
    assert again.json()["kv_transfer_params"]["remote_blocks"] == blocks
    metrics_p, metrics_d = (call(unix_app(s), "GET", "/metrics").text for s in pair)
    assert metric(metrics_p, 'kvd_kv_transfer_requests_total{side="prefill"}') == 2
    assert metric(metrics_p, 'kvd_kv_transfer_blocks_total{direction="published"}') == blocks
    assert metric(metrics_d, 'kvd_kv_transfer_requests_total{side="decode"}') == 1
    assert metric(metrics_d, 'kvd_kv_transfer_blocks_total{direction="fetched"}') == blocks
    assert metric(metrics_d, 'kvd_kv_transfer_seconds_total{side="decode"}') == pytest.approx(fetch_seconds)
    status = call(unix_app(decode), "GET", "/admin/status").json()
    assert status["kv_transfers"] == {"decodes": 1, "fetched_blocks": blocks, "fetch_seconds": fetch_seconds}


def test_a_transfer_stays_within_its_tenant(pair):
    """The tenant is in every block key: another tenant's decode finds none of the blocks."""
    prefill, decode = pair
    acme = {"X-KVD-Tenant": "acme"}
    params = call(unix_app(prefill), "POST", "/v1/completions", headers=acme,
                  json={"prompt": PROMPT, "max_tokens": 1, **PREFILL}).json()["kv_transfer_params"]
    other = call(unix_app(decode), "POST", "/v1/completions", headers={"X-KVD-Tenant": "globex"},
                 json={"prompt": PROMPT, **GREEDY, "kv_transfer_params": params}).json()
    assert other["kv_transfer_params"]["fetched_blocks"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same = call(unix_app(decode), "POST", "/v1/completions", headers=acme,
                json={"prompt": PROMPT, **GREEDY, "kv_transfer_params": params}).json()
    assert same["kv_transfer_params"]["fetched_blocks"] == params["remote_blocks"] > 0


def test_a_chat_is_decoded_streamed_after_its_prefill(pair):
    prefill, decode = pair
    chat = {"messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Which setting?"}]}
    params = call(unix_app(prefill), "POST", "/v1/chat/completions",
                  json={**chat, "max_tokens": 1, **PREFILL}).json()["kv_transfer_params"]
    assert params["remote_blocks"] == params["prompt_blocks"] > 0
    streamed = call(unix_app(decode), "POST", "/v1/chat/completions",
                    json={**chat, **GREEDY, "stream": True, "stream_options": {"include_usage": True},
                          "kv_transfer_params": params})
    events = sse_events(streamed)
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == params["remote_tokens"]


def test_a_chat_s_next_turn_across_a_transfer_is_the_same_prompt_on_both_sides(pair):
    """The decode kvd made the reply and keeps its ids (reply_ids.py); the prefill kvd never saw it.
    Across a transfer both tokenize the reply's text, so the decode finds every block the prefill
    computed."""
    prefill, decode = pair
    turn = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Which setting?"}]
    params = call(unix_app(prefill), "POST", "/v1/chat/completions",
                  json={"messages": turn, "max_tokens": 1, **PREFILL}).json()["kv_transfer_params"]
    reply = call(unix_app(decode), "POST", "/v1/chat/completions",
                 json={"messages": turn, "max_tokens": 40, "temperature": 1.0, "seed": 3,
                       "kv_transfer_params": params}).json()["choices"][0]["message"]["content"]
    assert decode.reply_ids.figures()["replies"] == 1  # kept: a chat to the decode kvd alone would splice it
    turn_two = turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    computed = call(unix_app(prefill), "POST", "/v1/chat/completions",
                    json={"messages": turn_two, "max_tokens": 1, **PREFILL}).json()
    params = computed["kv_transfer_params"]
    answer = call(unix_app(decode), "POST", "/v1/chat/completions",
                  json={"messages": turn_two, **GREEDY, "kv_transfer_params": params}).json()
    assert answer["usage"]["prompt_tokens"] == computed["usage"]["prompt_tokens"]
    assert answer["kv_transfer_params"]["cached_blocks"] == params["prompt_blocks"]
    assert decode.reply_ids.figures()["spliced"] == 0


@pytest.mark.parametrize("params, status, message", [
    ({"do_remote_decode": "yes"}, 400, "kv_transfer_params.do_remote_decode: expected true or false, got 'yes'"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, 400,
     "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true (one kvd computes the prompt, "
     "another decodes from it)"),
    ([True], 400, "kv_transfer_params: expected an object, got list"),
])
def test_a_malformed_transfer_is_refused_by_name_before_anything_runs(pair, params, status, message):
    prefill, _ = pair
    answer = call(unix_app(prefill), "POST", "/v1/completions",
                  json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params})
    assert answer.status_code == status and answer.json()["error"]["message"] == message
    assert prefill.engine.stats.prompt_tokens == 0 and prefill.kv_transfers.snapshot() == {}


def test_a_streamed_prefill_a_user_caller_and_a_kvd_without_redis_are_refused(pair, tmp_path):
    prefill, _ = pair
    streamed = call(unix_app(prefill), "POST", "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 1, "stream": True, **PREFILL})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["message"] == ("kv_transfer_params.do_remote_decode: ask without stream: the "
                                                   "answer carries the transfer for the decode")
    _, tcp = apps(prefill, token_table(tmp_path))
    user = call(tcp, "POST", "/v1/completions", headers={"Authorization": f"Bearer {USER_TOKEN}"},
                json={"prompt": PROMPT, "max_tokens": 1, **PREFILL})
    assert user.status_code == 403
    assert user.json()["error"]["message"] == "kv_transfer_params: only an admin caller (kvd router) asks for a KV " \
                                              "transfer"
    alone = start_service(tmp_path / "alone")
    try:
        refused = call(unix_app(alone), "POST", "/v1/completions",
                       json={"prompt": PROMPT, **GREEDY, "kv_transfer_params": {"do_remote_prefill": True}})
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == (
            "kv_transfer_params.do_remote_prefill: kvd has no Redis tier to pass the prompt's blocks through (set "
            "remote_url, the same one at the prefill and the decode kvds)")
        assert alone.engine.stats.prompt_tokens == 0
        # without either flag the field asks for nothing: vLLM's clients may send it empty
        plain = call(unix_app(alone), "POST", "/v1/completions",
                     json={"prompt": PROMPT, **GREEDY, "kv_transfer_params": {}})
        assert plain.status_code == 200 and "kv_transfer_params" not in plain.json()
    finally:
        alone.shutdown(deadline=2)
    assert prefill.engine.stats.prompt_tokens == 0


# ---- kvd router --prefill --decode -----------------------------------------------------------------------------

def router_of(roles: list[tuple[str, object]], view: str = "ask", **settings):
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    replicas = [Replica(f"replica-{role}", replica_client(f"/run/{role}.sock",
                                                         transport=httpx.ASGITransport(app=unix_app(s))), role=role)
                for role, s in roles]
    service = RouterService(replicas, make_router("prefix"), view=view, **settings)
    return service, create_router_app(service)


def through(app, *calls):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return [await step(client) for step in calls]
    return asyncio.run(go())


def test_kvd_router_prefills_at_the_prefill_replica_and_decodes_at_the_decode_replica(pair):
    prefill, decode = pair
    service, app = router_of([("prefill", prefill), ("decode", decode)], local_prefill_tokens=0)
    blocks = prompt_blocks(prefill, PROMPT)
    [answer, status, metrics] = through(app, lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}),
                                        lambda c: c.get("/router/status"), lambda c: c.get("/metrics"))
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvd-prefill"] == "replica-prefill"
    [ready] = through(app, lambda c: c.get("/readyz"))
    assert ready.json() == {"ready": True, "replicas": ["replica-decode"]}  # the prefill replica answers no caller
    assert answer.headers["x-kvd-replica"] == "replica-decode"
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    # the prefill replica made one token, for no one; the decode replica the eight asked for
    generated = [metric(call(unix_app(s), "GET", "/metrics").text, "kvd_generation_tokens_total") for s in pair]
    assert generated == [1, 8]
    assert {k: v for k, v in prefill.kv_transfers.snapshot().items() if k != "publish_seconds"} == {
        "prefills": 1, "published_blocks": blocks}
    assert {k: v for k, v in decode.kv_transfers.snapshot().items() if k != "fetch_seconds"} == {
        "decodes": 1, "fetched_blocks": blocks}
    body = status.json()
    assert body["disaggregated"] == {"transferred": 1}
    assert [(r["replica"], r.get("role"), r["sent"]) for r in body["replicas"]] == [
        ("replica-prefill", "prefill", 1), ("replica-decode", "decode", 1)]
    assert 'kvd_router_disaggregated_total{outcome="transferred"} 1.0' in metrics.text
    # both hops are tries of one request: the fleet's trace keeps the last, the decode (fleet_trace.py)
    traced = [call(unix_app(s), "GET", "/admin/trace?ids=keyed").json()["requests"] for s in pair]
    assert [[(line["router"]["try"], line["output_length"]) for line in lines] for lines in traced] == [[(1, 1)],
                                                                                                      [(2, 8)]]
    assert traced[0][0]["router"]["request"] == traced[1][0]["router"]["request"]
    # a caller's own kv_transfer_params is not passed on: the router decides transfers
    [mine] = through(app, lambda c: c.post("/v1/completions", json={
        "prompt": PROMPT, **GREEDY, "kv_transfer_params": {"do_remote_decode": True}}))
    assert mine.status_code == 200 and mine.headers["x-kvd-replica"] == "replica-decode"


def test_a_prompt_the_decode_replica_holds_nearly_whole_is_computed_there(pair):
    """Dynamo's conditional disaggregation: all but local_prefill_tokens held where it decodes."""
    prefill, decode = pair
    service, app = router_of([("prefill", prefill), ("decode", decode)], local_prefill_tokens=64)
    short = "Which setting?"
    [first, second, third] = through(
        app, lambda c: c.post("/v1/completions", json={"prompt": short, **GREEDY}),
        lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}),
        lambda c: c.post("/v1/completions", json={"prompt": PROMPT + " And the block size?", **GREEDY}))
    assert first.headers["x-kvd-prefill"].startswith("local: ")  # a few tokens: no hop
    assert second.headers["x-kvd-prefill"] == "replica-prefill"
    held = prompt_blocks(prefill, PROMPT) * BLOCK  # the decode replica holds the prompt now
    extra = len(decode.tokenize(PROMPT + " And the block size?")) - held
    assert third.headers["x-kvd-prefill"] == f"local: {extra} prompt tokens to compute at the decode replica"
    assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert service.pd_outcomes == {"local": 2, "transferred": 1}
    # a replica that decodes is asked once for a request it computes whole (the weighing that judged
    # it local chooses it too), twice for one prefilled elsewhere (once more when it holds the prompt)
    assert [(r.name, r.questions) for r in service.replicas] == [("replica-prefill", 1), ("replica-decode", 4)]
    assert prefill.kv_transfers.snapshot()["published_blocks"] == held // BLOCK
    # a request that scores its prompt is computed whole where it decodes, whatever it holds
    [scored] = through(app, lambda c: c.post("/v1/completions", json={"prompt": PROMPT + " New?", "max_tokens": 1,
                                                                        "prompt_logprobs": 0}))
    assert scored.headers["x-kvd-prefill"] == "local: the request scores its whole prompt"


def test_a_prefill_replica_that_cannot_transfer_leaves_the_whole_prompt_to_the_decode_replica(tmp_path, redis_server):
    """No Redis at the prefill replica: its 409 is in X-KVD-Prefill, and the caller is answered."""
    prefill = start_service(tmp_path / "prefill", num_blocks=128)
    decode = start_service(tmp_path / "decode", num_blocks=128, remote_url=redis_server.url)
    try:
        service, app = router_of([("prefill", prefill), ("decode", decode)], local_prefill_tokens=0)
        [answer] = through(app, lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}))
        assert answer.status_code == 200
        assert answer.headers["x-kvd-prefill"] == (
            "none: replica-prefill (409: kv_transfer_params.do_remote_decode: kvd has no Redis tier to pass the "
            "prompt's blocks through (set remote_url, the same one at the prefill and the decode kvds))")
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert service.pd_outcomes == {"prefill_failed": 1}
        assert prefill.engine.stats.prompt_tokens == 0
    finally:
        prefill.shutdown(deadline=2)
        decode.shutdown(deadline=2)


def behind_a_prefill_replica_down(*others: tuple[str, object, str]):
    """A router (ask view, round robin, every prompt worth a prefill) over a prefill replica named
    "down" that cannot be reached, then `others`: (name, kvd service, role)."""
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .test_router import Down

    replicas = [Replica("down", replica_client("/run/down.sock", transport=Down()), role="prefill")] + [
        Replica(name, replica_client(f"/run/{name}.sock", transport=httpx.ASGITransport(app=unix_app(kvd))), role=role)
        for name, kvd, role in others]
    service = RouterService(replicas, make_router("round_robin"), view="ask", local_prefill_tokens=0)
    return service, create_router_app(service)


def test_a_prefill_replica_that_is_down_is_passed_over(pair):
    prefill, decode = pair
    service, app = behind_a_prefill_replica_down(("up", prefill, "prefill"), ("decode", decode, "decode"))
    answers = through(app, *[lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})] * 2)
    assert [a.headers["x-kvd-prefill"] for a in answers] == ["up", "up"]
    assert all(a.headers["x-kvd-replica"] == "decode" for a in answers)
    assert service.pd_outcomes == {"transferred": 2}


def test_a_prefill_replica_that_does_not_answer_rests_and_its_warning_is_not_one_a_request(pair, caplog):
    """With every prefill replica down, each request is decoded whole where it goes: the router
    asks the prefill replica once, then passes it over unasked while it rests (no request needs
    one), and logs the outcome once for all of them, not once each."""
    _, decode = pair
    service, app = behind_a_prefill_replica_down(("decode", decode, "decode"))
    replicas = service.replicas
    with caplog.at_level("WARNING", logger="kvd.router"):
        answers = through(app, *[lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})] * 3)
    assert [a.status_code for a in answers] == [200] * 3
    assert {a.headers["x-kvd-prefill"] for a in answers} == {
        "none: no replica answered: down (ConnectError: connection refused)"}
    assert (replicas[0].questions, replicas[0].skipped_questions) == (1, 2)  # asked by the first request alone
    assert service.pd_outcomes == {"no_prefill_replica": 3}
    assert [r.getMessage() for r in caplog.records if "prefill not done" in r.getMessage()] == [
        "disaggregated prefill not done (no replica answered: down (ConnectError: connection refused)): the "
        "decode replica computes the whole prompt"]


def test_a_recurring_warning_is_logged_once_every_few_seconds_with_how_many_it_held_back(caplog):
    import logging

    from kvctl.daemon.server.log_throttle import EveryFewSeconds

    now = [0.0]
    warnings = EveryFewSeconds(logging.getLogger("kvd.test"), seconds=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="kvd.test"):
        for at in (0.0, 1.0, 9.9, 10.0, 12.0, 30.0):
            now[0] = at
            warnings.warning("prefill not done (%s)", f"at {at}")
    assert [r.getMessage() for r in caplog.records] == [
        "prefill not done (at 0.0)", "prefill not done (at 10.0) (and 2 more like it in the last 10 s)",
        "prefill not done (at 30.0) (and 1 more like it in the last 20 s)"]


def test_prefill_roles_are_checked_where_the_router_is_set_up():
    from kvctl.daemon.config import ConfigError
    from kvctl.daemon.router_config import resolve_router
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    config = resolve_router({"socket": "/run/r.sock", "prefill_replicas": ["/run/p.sock"],
                             "decode_replicas": "/run/d1.sock,/run/d2.sock", "local_prefill_tokens": 512}, env={})
    assert config.prefill_replicas == ("/run/p.sock",) and config.decode_replicas == ("/run/d1.sock", "/run/d2.sock")
    assert config.local_prefill_tokens == 512
    with pytest.raises(ConfigError, match="decode_replicas: prefill replicas need a replica that decodes"):
        resolve_router({"socket": "/run/r.sock", "prefill_replicas": ["/run/p1.sock", "/run/p2.sock"]}, env={})
    with pytest.raises(ConfigError, match=r"replicas: '/run/a.sock' is named in two roles \(replicas, "
                                          r"prefill_replicas, decode_replicas\); each replica in one"):
        resolve_router({"socket": "/run/r.sock", "replicas": ["/run/a.sock", "/run/b.sock"],
                        "prefill_replicas": ["/run/a.sock"]}, env={})
    with pytest.raises(ConfigError, match="local_prefill_tokens"):
        resolve_router({"socket": "/run/r.sock", "replicas": ["/run/a.sock", "/run/b.sock"],
                        "local_prefill_tokens": -1}, env={})
    with pytest.raises(ValueError, match="role: unknown value 'prefil' for /run/a.sock; use both, prefill, decode"):
        RouterService([Replica("/run/a.sock", replica_client("/run/a.sock"), role="prefil")], make_router("prefix"))
    with pytest.raises(ValueError, match="decode: prefill replicas need a replica that decodes"):
        RouterService([Replica("/run/a.sock", replica_client("/run/a.sock"), role="prefill")], make_router("prefix"))


def test_kvctl_status_says_what_each_side_passed_through_redis():
    from rich.console import Console

    from kvctl.fleet_status import disaggregated_line
    from kvctl.status_view import transfer_line

    assert transfer_line({"prefills": 3, "published_blocks": 66, "publish_seconds": 0.036}) == \
        "computed 3 prompts for decode replicas (66 blocks written to Redis, 12.0 ms a prompt)"
    assert transfer_line({"decodes": 2, "fetched_blocks": 44, "fetch_seconds": 0.05}) == \
        "decoded 2 prompts after a prefill replica (44 blocks read from Redis, 25.0 ms a prompt)"
    books = [{"replica": "/run/p.sock", "role": "prefill"}, {"replica": "/run/d.sock", "role": "decode"},
             {"replica": "/run/b.sock"}]
    console = Console(record=True, width=400)
    console.print(disaggregated_line(books, {"transferred": 12, "local": 3, "prefill_failed": 1}))
    assert console.export_text().strip() == (
        "disaggregated prefill and decode: prefill at /run/p.sock; decode at /run/d.sock; decode and whole requests "
        "at /run/b.sock; 12 prompts passed through Redis, 3 computed where they decoded (little to compute there), "
        "1 computed whole where they decoded: no prefill replica did them (kvd router's log says why)")


def test_the_kvd_router_command_takes_prefill_and_decode_replicas(monkeypatch, tmp_path):
    """`kvd router --prefill P --decode D` builds the replicas in their roles."""
    from typer.testing import CliRunner

    from kvctl.daemon import cli as daemon_cli

    seen = {}

    async def fake_route(service, *args, **kwargs):
        seen["roles"] = [(r.name, r.role) for r in service.replicas]
        seen["local"] = service.local_prefill_tokens

    monkeypatch.setattr(daemon_cli, "_route", fake_route)
    result = CliRunner().invoke(daemon_cli.app, ["router", "--prefill", "/run/p.sock", "--decode", "/run/d.sock",
                                                 "--replica", "/run/b.sock", "--local-prefill-tokens", "128",
                                                 "--socket", str(tmp_path / "r.sock"), "--no-gc-freeze"], env={})
    assert result.exit_code == 0, result.output
    assert seen == {"roles": [("/run/b.sock", "both"), ("/run/p.sock", "prefill"), ("/run/d.sock", "decode")],
                    "local": 128}


def test_the_decode_answer_keeps_what_it_cached_from_a_user_who_may_not_see_it(pair, tmp_path):
    """report_cached_tokens admin: a user's answer names no transferred blocks either."""
    prefill, decode = pair
    params = call(unix_app(prefill), "POST", "/v1/completions", headers={"X-KVD-Tenant": "acme"},
                  json={"prompt": PROMPT, "max_tokens": 1, **PREFILL}).json()["kv_transfer_params"]
    from kvctl.daemon.server.usage_report import CALLER_ROLE_HEADER

    decode.config = dataclasses.replace(decode.config, report_cached_tokens="admin")
    answer = call(unix_app(decode), "POST", "/v1/completions",
                  headers={"X-KVD-Tenant": "acme", CALLER_ROLE_HEADER: "user"},
                  json={"prompt": PROMPT, **GREEDY, "kv_transfer_params": params})
    assert answer.status_code == 200, answer.text
    assert "kv_transfer_params" not in answer.json()
    assert json.dumps(answer.json()["usage"]).count("cached_tokens") == 0


def test_the_replicas_file_gives_roles_and_a_reload_changes_them(tmp_path):
    """`prefill SPEC` / `decode SPEC` lines; a changed role takes effect on the reload; a file
    that would leave prefill replicas with no replica that decodes changes nothing."""
    from kvctl.daemon.server.fleet_file import FleetFile, replica_lines
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    listing = tmp_path / "replicas"
    listing.write_text("prefill /run/p.sock  # the big-batch box\ndecode /run/d.sock\n/run/b.sock\n")
    lines = replica_lines(str(listing))
    assert lines == [("/run/p.sock", "prefill"), ("/run/d.sock", "decode"), ("/run/b.sock", "both")]
    service = RouterService([Replica(spec, replica_client(spec), role=role) for spec, role in lines],
                            make_router("prefix"), view="ask")
    fleet = FleetFile(str(listing), fixed=set(), client=replica_client)

    async def go():
        listing.write_text("prefill /run/p.sock\nprefill /run/d.sock\n/run/b.sock\nprefill /run/p2.sock\n")
        changed = fleet.apply(service)
        roles = {r.name: r.role for r in service.replicas}
        listing.write_text("prefill /run/p.sock\nprefill /run/d.sock\nprefill /run/b.sock\n")
        with pytest.raises(ValueError) as refused:
            fleet.apply(service)
        listing.write_text("stage /run/p.sock\n")
        with pytest.raises(ValueError) as bad:
            fleet.apply(service)
        return changed, roles, str(refused.value), str(bad.value), {r.name: r.role for r in service.replicas}

    changed, roles, refused, bad, after = asyncio.run(go())
    assert changed == {"added": ["/run/p2.sock"], "leaving": [], "roles": {"/run/d.sock": "prefill"}}
    assert roles == {"/run/p.sock": "prefill", "/run/d.sock": "prefill", "/run/b.sock": "both",
                     "/run/p2.sock": "prefill"}
    assert refused == (f"replicas_file: {str(listing)!r} leaves prefill replicas with no replica that decodes (a "
                       "decode or both line): the fleet is left as it is")
    assert bad == (f"replicas_file: {listing}:1: expected a socket path or an http(s) URL, a role (both, prefill, "
                   "decode) before it where given, got 'stage /run/p.sock'")
    assert after == roles  # neither changed anything


def test_the_router_s_what_if_says_where_the_prompt_would_be_computed(pair, capsys, monkeypatch):
    """POST /router/route (kvctl route at the router): the decode's routes as before, each prefill
    replica's facts, and the prefill plan: a replica and why, or why the decode replica computes it."""
    prefill, decode = pair
    service, app = router_of([("prefill", prefill), ("decode", decode)], local_prefill_tokens=64)
    [long_, short] = through(app, lambda c: c.post("/router/route", json={"prompt": PROMPT}),
                             lambda c: c.post("/router/route", json={"prompt": "Which setting?"}))
    body = long_.json()
    assert body["prefill"]["replica"] == "replica-prefill"
    assert [(r["replica"], r.get("role"), r["cached_tokens"]) for r in body["replicas"]] == [
        ("replica-prefill", "prefill", 0), ("replica-decode", "decode", 0)]
    assert body["routes"]["prefix"]["replica"] == "replica-decode"
    prompt_tokens = len(decode.tokenize("Which setting?"))
    assert short.json()["prefill"] == {"replica": None,
                                       "reason": f"local: {prompt_tokens} prompt tokens to compute at the decode "
                                                 "replica"}
    assert service.pd_outcomes == {} and prefill.engine.stats.prompt_tokens == 0  # nothing was sent

    from kvctl.route_cmd import show_router_route

    class Answering:
        def post(self, path, asked):
            assert path == "/router/route" and asked == {"prompt": PROMPT, "routing": ["prefix"]}
            return body

    monkeypatch.setenv("COLUMNS", "200")
    show_router_route(Answering(), {"text": PROMPT}, ["prefix"], as_json=False)
    printed = capsys.readouterr().out
    assert f"prefill: at replica-prefill ({body['prefill']['reason']}), its blocks through Redis to the replica " \
           "that decodes" in printed
    assert [line.split()[:3] for line in printed.splitlines() if line.startswith("replica-")][:2] == [
        ["replica-prefill", "(prefill)", "asked"], ["replica-decode", "(decode)", "asked"]]


def test_kvd_router_prefill_and_decode_processes_end_to_end(tmp_path, redis_server):
    """The real processes: two `kvd serve` on one Redis behind `kvd router --prefill --decode`;
    the answer's tokens are those of the decode kvd computing the prompt itself, and `kvctl
    status` at the router and at each kvd says what passed through Redis."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from .kvd_process import running_kvd

    bin_ = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")} | {"COLUMNS": "200"}
    redis = ["--remote-url", redis_server.url, "--num-blocks", "128"]
    for name in ("p", "d"):
        (tmp_path / name).mkdir()
    with running_kvd(tmp_path / "p", *redis) as (_, client_p, sock_p), \
            running_kvd(tmp_path / "d", *redis) as (_, client_d, sock_d):
        front = tmp_path / "router.sock"
        router = subprocess.Popen([str(bin_ / "kvd"), "router", "--prefill", str(sock_p), "--decode", str(sock_d),
                                   "--local-prefill-tokens", "32", "--socket", str(front), "--log-level", "warning"],
                                  env=env, stdout=open(tmp_path / "router.log", "ab"), stderr=subprocess.STDOUT)
        client = httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(uds=str(front)), timeout=60)
        try:
            deadline = time.monotonic() + 30
            while True:
                assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            answer = client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
            assert answer.status_code == 200, answer.text
            assert (answer.headers["x-kvd-prefill"], answer.headers["x-kvd-replica"]) == (str(sock_p), str(sock_d))
            ids = client_d.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
            blocks = (len(ids) - 1) // BLOCK
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
            # the decode kvd computing the prompt itself (another tenant: nothing of it cached) answers the same
            alone = client_d.post("/v1/completions", headers={"X-KVD-Tenant": "solo"},
                                  json={"prompt": PROMPT, **GREEDY}).json()
            assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert answer.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]

            def kvctl(sock):
                shown = subprocess.run([str(bin_ / "kvctl"), "--socket", str(sock), "status"], env=env,
                                       capture_output=True, text=True, timeout=60)
                assert shown.returncode == 0, shown.stderr
                return " ".join(shown.stdout.split())

            assert (f"disaggregated prefill and decode: prefill at {sock_p}; decode at {sock_d}; 1 prompt passed "
                    "through Redis") in kvctl(front)
            assert f"kv transfer computed 1 prompt for decode replicas ({blocks} blocks written to Redis, " in \
                kvctl(sock_p)
            assert f"kv transfer decoded 1 prompt after a prefill replica ({blocks} blocks read from Redis, " in \
                kvctl(sock_d)
        finally:
            client.close()
            router.send_signal(signal.SIGTERM)
            assert router.wait(30) == 0


def test_a_user_who_may_not_see_cached_tokens_is_not_told_why_the_prompt_was_computed_where(pair, tmp_path):
    """report_cached_tokens admin: X-KVD-Prefill ("local: N prompt tokens ...") says how much the
    replica holds, as X-KVD-Route does; a user's answer carries neither, an admin's both."""
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .daemon_fixtures import ADMIN_TOKEN

    for service in pair:
        service.config = dataclasses.replace(service.config, report_cached_tokens="admin")
    replicas = [Replica(f"replica-{role}", replica_client(f"/run/{role}.sock", transport=httpx.ASGITransport(
        app=unix_app(s))), role=role) for role, s in zip(("prefill", "decode"), pair)]
    app = create_router_app(RouterService(replicas, make_router("prefix"), view="ask"), front="tcp",
                            tokens=token_table(tmp_path))

    def ask(token):
        return through(app, lambda c: c.post("/v1/completions", headers={"Authorization": f"Bearer {token}"},
                                             json={"prompt": "Which setting?", **GREEDY}))[0]

    user, admin = ask(USER_TOKEN), ask(ADMIN_TOKEN)
    assert user.status_code == admin.status_code == 200
    assert "x-kvd-prefill" not in user.headers and "x-kvd-route" not in user.headers
    assert admin.headers["x-kvd-prefill"].startswith("local: ") and "x-kvd-route" in admin.headers


def _counting_prompt_hashes(monkeypatch, length: int) -> list:
    """Every hashing of a whole prompt of `length` tokens from now on."""
    from kvctl.daemon.cache import keys

    seen, real = [], keys.PrefixHasher.feed

    def feed(self, token_ids):
        if len(token_ids) == length:
            seen.append(length)
        return real(self, token_ids)

    monkeypatch.setattr(keys.PrefixHasher, "feed", feed)
    return seen


def test_each_side_of_a_transfer_hashes_its_prompt_once_and_a_decode_checks_it_before_it_fetches(pair, monkeypatch):
    """The prefill's publish takes the keys its submission hashed, and so does the decode's fetch:
    one hashing of the prompt per side (a 32k-token prompt's SHA-256 chain is milliseconds, on
    the path to its first token). A decode's prompt over the context is refused before it is
    hashed or anything comes from Redis."""
    prefill, decode = pair
    length = len(prefill.tokenize(PROMPT))
    hashes = _counting_prompt_hashes(monkeypatch, length)
    first = call(unix_app(prefill), "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **PREFILL})
    assert first.status_code == 200 and first.json()["kv_transfer_params"]["published_blocks"] > 0
    assert hashes == [length]
    params = first.json()["kv_transfer_params"]
    answer = call(unix_app(decode), "POST", "/v1/completions", json={"prompt": PROMPT, **GREEDY,
                                                                     "kv_transfer_params": params})
    assert answer.status_code == 200 and answer.json()["kv_transfer_params"]["fetched_blocks"] > 0
    assert hashes == [length, length]
    too_long = call(unix_app(decode), "POST", "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 100_000, "kv_transfer_params": params})
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert hashes == [length, length]
    assert call(unix_app(decode), "GET", "/admin/status").json()["kv_transfers"]["decodes"] == 1


def test_a_traced_router_shows_the_prefill_and_the_decode_as_two_tries_of_one_route(pair):
    """kvd router's spans (route_spans.py): the prefill replica's try and the decode replica's, in
    that order, under the one route span that says where the prompt was computed."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvctl.daemon.server.route_spans import RouteSpans

    prefill, decode = pair
    service, app = router_of([("prefill", prefill), ("decode", decode)], local_prefill_tokens=0)
    exporter = InMemorySpanExporter()
    service.route_spans = RouteSpans(SimpleSpanProcessor(exporter))
    [answer] = through(app, lambda c: c.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}))
    assert answer.status_code == 200 and answer.headers["x-kvd-prefill"] == "replica-prefill"
    spans = exporter.get_finished_spans()
    [route] = [span for span in spans if span.name == "kvd.router.route"]
    tries = [span for span in spans if span.name == "kvd.router.forward"]
    assert [(t.attributes["kvd.replica"], t.attributes["kvd.phase"], t.attributes["http.response.status_code"])
            for t in tries] == [("replica-prefill", "prefill", 200), ("replica-decode", "decode", 200)]
    assert all(t.parent.span_id == route.context.span_id for t in tries)
    assert tries[0].end_time <= tries[1].start_time
    assert (route.attributes["kvd.replica"], route.attributes["kvd.prefill"]) == ("replica-decode", "replica-prefill")


def test_a_prefill_replica_that_goes_silent_is_given_up_and_the_decode_replica_computes_the_prompt(pair, monkeypatch):
    """The prefill replica takes the prefill and goes silent: once it has answered nothing for 30 s
    the router gives it up (where it waited 600 s) and the decode replica computes the whole prompt."""
    import kvctl.daemon.server.router as router_module
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .test_router_silent import GoesSilent, while_the_clock_runs

    prefill, decode = pair
    monkeypatch.setattr(router_module, "DISCONNECT_CHECK_S", 0.005)
    now = [1000.0]
    quiet = GoesSilent(unix_app(prefill), now)
    replicas = [Replica("quiet", replica_client("/run/quiet.sock", transport=quiet), role="prefill"),
                Replica("decode", replica_client("/run/decode.sock", transport=httpx.ASGITransport(
                    app=unix_app(decode))), role="decode")]
    service = RouterService(replicas, make_router("round_robin"), view="ask", local_prefill_tokens=0,
                            clock=lambda: now[0])
    answer = while_the_clock_runs(create_router_app(service), now, lambda c: c.post(
        "/v1/completions", json={"prompt": PROMPT, **GREEDY}))
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "decode"
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed whole there
    said = answer.headers["x-kvd-prefill"]
    assert said.startswith("none: quiet (given up: answered nothing for ") and said.endswith(
        " s (ReadTimeout: timed out))")
    assert service.pd_outcomes == {"no_prefill_replica": 1}
    assert (replicas[0].given_up, replicas[0].failed_forwards, replicas[0].open) == (1, 1, 0)
    assert quiet.asked.count("/v1/completions") == 1

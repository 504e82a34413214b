"""kvd's HTTP APIs in-process: OpenAI completions, errors, auth and tenants, admin, metrics."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import (ADMIN_TOKEN, GLOBEX_TOKEN, USER_TOKEN, apps, blocks_all_back, call,  # noqa: E402
                              holds_engine_lock, sse_events, start_service, token_table)

SYSTEM = "System: you answer questions about paged KV caches, briefly and exactly. "


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    state = tmp_path_factory.mktemp("kvd")
    service = start_service(state)
    unix, tcp = apps(service, token_table(state))
    yield service, unix, tcp
    service.shutdown(1)


def complete(app, **body):
    return call(app, "POST", "/v1/completions", json={"max_tokens": 6, "seed": 1, **body})


def test_health_readiness_and_openapi(daemon):
    _, unix, tcp = daemon
    assert call(unix, "GET", "/healthz").json() == {"status": "ok"}
    assert call(tcp, "GET", "/readyz").json() == {"ready": True}
    paths = call(unix, "GET", "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/models", "/admin/status", "/admin/pins", "/metrics"} <= set(paths)


def test_models_and_a_text_completion(daemon):
    service, unix, _ = daemon
    models = call(unix, "GET", "/v1/models").json()
    assert models["data"][0]["id"] == service.model_name == "kvd-demo-llama-v1"
    assert call(unix, "GET", f"/v1/models/{service.model_name}").json() == models["data"][0]
    nope = call(unix, "GET", "/v1/models/acme/nope")
    assert nope.status_code == 404 and nope.json()["error"]["message"] == (
        "model: 'acme/nope' is not served here; GET /v1/models lists 'kvd-demo-llama-v1'")
    assert nope.json()["error"]["code"] == "model_not_found"
    body = complete(unix, prompt=SYSTEM + "Q1", model=service.model_name).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and len(choice["token_ids"]) == 6
    assert choice["text"] == service.loaded.tokenizer.decode(choice["token_ids"])
    assert body["usage"]["prompt_tokens"] == len(service.tokenize(SYSTEM + "Q1"))
    assert body["usage"]["completion_tokens"] == 6


def test_prompt_shapes_and_choice_order(daemon):
    service, unix, _ = daemon
    ids = service.tokenize("token ids prompt")
    single = complete(unix, prompt=ids).json()
    assert single["usage"]["prompt_tokens"] == len(ids)
    many = complete(unix, prompt=[ids, ids[:5]], n=2, temperature=0.8).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    texts = complete(unix, prompt=["one", "two"]).json()
    assert len(texts["choices"]) == 2


def test_repeat_prompt_reports_cached_tokens_and_same_tokens(daemon):
    _, unix, _ = daemon
    first = complete(unix, prompt=SYSTEM + "Q2", temperature=0.7).json()
    second = complete(unix, prompt=SYSTEM + "Q2", temperature=0.7).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_streaming_matches_the_plain_response(daemon):
    _, unix, _ = daemon
    plain = complete(unix, prompt=SYSTEM + "Q3", temperature=0.9, seed=9).json()
    streamed = sse_events(complete(unix, prompt=SYSTEM + "Q3", temperature=0.9, seed=9, stream=True,
                                   stream_options={"include_usage": True}))
    assert streamed[-1] == "[DONE]"
    chunks = [e for e in streamed[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == plain["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert streamed[-2]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in chunks)  # the usage chunk alone says it


def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(daemon):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk says its prompt's
    tokens and its choice's output tokens so far."""
    service, unix, _ = daemon
    prompt = len(service.tokenize(SYSTEM + "Q4"))
    streamed = sse_events(complete(unix, prompt=SYSTEM + "Q4", temperature=0.9, seed=4, n=2, stream=True,
                                   stream_options={"include_usage": True, "continuous_usage_stats": True}))[:-1]
    chunks, so_far = [e for e in streamed if e["choices"]], {0: 0, 1: 0}
    for chunk in chunks:
        so_far[chunk["choices"][0]["index"]] += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": so_far[chunk["choices"][0]["index"]],
                                  "total_tokens": prompt + so_far[chunk["choices"][0]["index"]]}
    assert so_far == {0: 6, 1: 6} and streamed[-1]["usage"]["completion_tokens"] == 12  # the whole, as before
    alone = sse_events(complete(unix, prompt="x", stream=True, stream_options={"continuous_usage_stats": True}))
    assert all("usage" not in e for e in alone[:-1])  # without include_usage, as vLLM


@pytest.mark.parametrize("body, status, param, fragment", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens: must be an integer >= 1, got 0"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p", "top_p: must be in (0, 1], got 2.0"),
    ({"prompt": {"a": 1}}, 400, "prompt", "prompt: must be a string, a list of strings, a list of token ids "
                                          "(integers) or a list of lists of token ids (got {'a': 1})"),
    ({"prompt": [1.5] * 100_000}, 400, "prompt", "(got [1.5, 1.5, 1.5"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": []}, 400, "prompt", "prompt: must not be empty"),
    ({"prompt": [1, 999]}, 400, "prompt", "prompt: token ids must lie in [0, 258), found 999"),
    # echo decodes the ids it gives back: they are checked before (a negative or huge id crashed the decoder)
    ({"prompt": [[1, 2], [3, -1]], "echo": True}, 400, "prompt[1]", "prompt[1]: token ids must lie in [0, 258), found -1"),
    ({"prompt": [2**40], "echo": True, "max_tokens": 0, "logprobs": 1}, 400, "prompt",
     "prompt: token ids must lie in [0, 258), found 1099511627776"),
    ({"prompt": "x", "max_tokens": 9000}, 413, "max_tokens", "exceeds the model's 8192 positions"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' is not served here"),
    ({"prompt": list(range(200)) * 6}, 400, None, "it can never fit"),
    ({"prompt": [[1, 2]] * 257, "max_tokens": 1}, 400, "prompt",
     "prompt: 257 prompts in one request can never be queued at once (max_queue 256)"),
    ({"prompt": [5] * 1_000_000}, 413, "max_tokens", "prompt (1000000) + max_tokens (16) exceeds"),
])
def test_errors_use_openai_shape_and_status(daemon, body, status, param, fragment):
    _, unix, _ = daemon
    response = call(unix, "POST", "/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert len(error["message"]) < 400  # a huge bad input is not echoed back whole
    if param:
        assert error["param"] == param


@pytest.mark.parametrize("method, path, body, message", [
    ("POST", "/admin/pins", {"text": "x", "ttl": [1]}, "ttl: must be a string or a number (got [1])"),
    ("POST", "/admin/pins", {"text": "x", "ttl": True}, "ttl: must be a string or a number (got True)"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [1]}, "stop: must be a string or a list of strings (got [1])"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}},
     "stop: must be a string or a list of strings (got {'a': 1})"),
    ("POST", "/admin/rollouts", {"policy": {}, "cohort": []}, "cohort: must be a string or a number (got [])"),
])
def test_a_field_of_several_kinds_names_them_all_not_its_first(daemon, method, path, body, message):
    """pydantic reports such a value once per kind; the first alone ("Input should be a valid
    string") told a client sending a number of the wrong sort that the field takes strings."""
    _, unix, _ = daemon
    response = call(unix, method, path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message
    assert response.json()["error"]["param"] == message.split(":")[0]


@pytest.mark.parametrize("path, params, param, message", [
    ("/admin/prefixes", {"limit": "abc"}, "limit",
     "limit: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
    ("/admin/prefixes", {"pinned": "maybe"}, "pinned",
     "pinned: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
    ("/admin/audit", {"since": "yesterday"}, "since",
     "since: Input should be a valid number, unable to parse string as a number (got 'yesterday')"),
])
def test_a_bad_query_parameter_is_named_not_called_query(daemon, path, params, param, message):
    _, unix, _ = daemon
    response = call(unix, "GET", path, params=params)
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (param, message)


def test_an_oversized_prompt_is_refused_before_it_is_hashed_or_reaches_the_engine(daemon, monkeypatch):
    service, unix, _ = daemon
    hashed = []
    monkeypatch.setattr(service, "hash_prompts", lambda *args: hashed.append(args) or None)
    before = dict(service.engine.stats.rejections)
    for body, status in (({"prompt": [5] * 1_000_000}, 413), ({"prompt": [[1, 2]] * 300, "max_tokens": 1}, 400),
                         ({"prompt": [3, 99999] * 10}, 400)):
        assert call(unix, "POST", "/v1/completions", json=body).status_code == status
    assert hashed == [] and service.engine.stats.rejections == before and not service._inbox


@pytest.mark.parametrize("field, value", [("best_of", 3), ("suffix", " end"), ("use_beam_search", True)])
def test_parameters_kvd_does_not_implement_are_refused_not_ignored(daemon, field, value):
    _, unix, _ = daemon
    response = call(unix, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": f"{field}: not supported by kvd, got {value!r}; leave it out",
                                        "type": "invalid_request_error", "param": field,
                                        "code": "unsupported_parameter"}


def test_a_client_chosen_cache_salt_is_refused_with_the_way_to_isolate(daemon):
    """vLLM's cache_salt: ignoring it would let a client believe its prompts are kept apart."""
    _, unix, _ = daemon
    response = call(unix, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "cache_salt": "s3cret"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("cache_salt", "unsupported_parameter")
    assert error["message"] == ("cache_salt: not supported by kvd, got a salt; kvd keeps prefixes apart by "
                                "tenant (the caller's token, or the tenant header behind a trusted proxy), never by "
                                "a salt the client picks; send requests that must not share as another tenant")
    assert complete(unix, prompt="x", max_tokens=2, cache_salt="").status_code == 200  # empty: no salt asked


def test_inert_values_of_unimplemented_parameters_and_unknown_fields_are_accepted(daemon):
    """What OpenAI's clients send by default (and fields nobody defined) changes nothing."""
    _, unix, _ = daemon
    plain = complete(unix, prompt="x", max_tokens=3, temperature=0.0).json()
    inert = complete(unix, prompt="x", max_tokens=3, temperature=0.0, logprobs=None, echo=False, best_of=1,
                     presence_penalty=0, frequency_penalty=0.0, logit_bias={}, suffix=None,
                     vendor_extension="anything").json()
    assert inert["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert complete(unix, prompt="x", max_tokens=3, n=2, best_of=2).status_code == 200


@pytest.mark.parametrize("text, mode, message", [
    ("tok-admin-0123456789 ops admin\n", 0o644, "is open to every user on the machine (mode 0644); restrict it, "
                                                "e.g. chmod 600"),
    ("tok-admin-0123456789 ops admin\n", 0o602, "(mode 0602)"),
    ("short ops admin\n", 0o600, "token_file line 1: token shorter than 16 characters"),
    ("# only a comment\n", 0o600, "holds no token"),
    ("tok-admin-0123456789 ops root\n", 0o640, "token_file line 1: role 'root' is not user, proxy or admin"),
])
def test_a_token_file_others_may_read_or_a_bad_line_is_refused(tmp_path, text, mode, message):
    from kvctl.daemon.server.auth import TokenFileError, TokenTable

    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(TokenFileError) as refused:
        TokenTable.load(path)
    assert message in str(refused.value)
    path.write_text("tok-admin-0123456789 ops admin\n")
    path.chmod(0o640)  # the service's group may read it
    assert [e.role for e in TokenTable.load(path).entries] == ["admin"]


def test_tcp_needs_a_token_and_the_admin_role(daemon):
    _, _, tcp = daemon
    assert call(tcp, "GET", "/v1/models").status_code == 401
    bad = call(tcp, "GET", "/v1/models", headers={"Authorization": "Bearer wrong-token-000000"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    user = {"Authorization": f"Bearer {USER_TOKEN}"}
    assert call(tcp, "GET", "/v1/models", headers=user).status_code == 200
    forbidden = call(tcp, "GET", "/admin/status", headers=user)
    assert forbidden.status_code == 403 and "admin role" in forbidden.json()["error"]["message"]
    assert call(tcp, "GET", "/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200


def test_tenants_never_share_blocks(daemon):
    _, unix, tcp = daemon
    prompt = "Tenant isolation check. " + SYSTEM
    acme = {"Authorization": f"Bearer {USER_TOKEN}", "X-KVD-Tenant": "globex"}  # header ignored on TCP
    globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
    first = call(tcp, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=acme)
    again = call(tcp, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=acme)
    other = call(tcp, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=globex)
    cached = lambda r: r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert (cached(first), cached(other)) == (0, 0) and cached(again) > 0
    on_socket = complete(unix, prompt=prompt, max_tokens=2)  # tenant "default"
    assert cached(on_socket) == 0
    header = call(unix, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                  headers={"X-KVD-Tenant": "bad tenant!"})
    assert header.status_code == 400 and header.json()["error"]["param"] == "X-KVD-Tenant"


def test_a_pin_whose_warm_was_cancelled_or_is_still_running_says_it_was_not_warmed_and_stands(tmp_path,
                                                                                               monkeypatch):
    """A pin by text computes its prefix (one token of output). When that request ends cancelled
    (an operator's `kvctl cancel`, kvd stopping) or has not ended within the wait, the answer says
    "warmed": false (it said true), the pin stands, and its blocks pin as a later request fills them."""
    from kvctl.daemon.engine.engine import TokenEvent
    from kvctl.daemon.server import pin_ops

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        submitted = []

        def cancelled_at_once(prompts, params, principal, sink, adapter):
            submitted.append((len(prompts), params.max_tokens, adapter))
            sink(TokenEvent("req-warm", 0, None, "cancelled"))
            return []

        monkeypatch.setattr(service, "submit", cancelled_at_once)
        prompt = SYSTEM + "A pinned prompt whose warm an operator cancelled."
        blocks = len(service.tokenize(prompt)) // 16
        pinned = call(unix, "POST", "/admin/pins", json={"text": prompt}).json()
        assert submitted == [(1, 1, "")]  # warmed by the model (no LoRA adapter named)
        assert (pinned["warmed"], pinned["blocks"], pinned["cached_blocks"]) == (False, blocks, 0)
        monkeypatch.setattr(service, "submit", lambda *args: submitted.append("never ends") or [])
        monkeypatch.setattr(pin_ops, "WARM_WAIT_S", 0.05)
        other = call(unix, "POST", "/admin/pins", json={"text": SYSTEM + "Another, still warming."}).json()
        assert submitted[-1] == "never ends" and (other["warmed"], other["cached_blocks"]) == (False, 0)
        monkeypatch.undo()
        assert complete(unix, prompt=prompt).status_code == 200  # a request fills the prefix: it pins
        listed = {p["pin_id"]: p for p in call(unix, "GET", "/admin/pins").json()["pins"]}
        assert listed[pinned["pin_id"]]["cached_blocks"] == blocks
        evicted = call(unix, "POST", "/admin/evict", json={"all_unpinned": True}).json()
        assert evicted["skipped"]["pinned"] == blocks
        audit = [(r["action"], r["result"]) for r in call(unix, "GET", "/admin/audit").json()["entries"]
                 if r["action"] == "pin"]
        assert audit == [("pin", "ok"), ("pin", "ok")]
    finally:
        service.shutdown(1)


def test_explain_names_the_tenant_that_holds_a_prompt_and_hashes_it_outside_the_engines_lock(tmp_path,
                                                                                              monkeypatch):
    """"Why did this miss?" for a prompt another tenant has cached: the answer names that tenant.
    The prompt's keys, and each other tenant's, are hashed outside the engine's lock (a long prompt
    times many tenants held up every running request while it hashed), and a tenant's chain past
    its first block only where that block begins one of its cached trees."""
    from kvctl.daemon.server import cache_questions

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        prompt = SYSTEM + "Which tenant holds this one?"
        for tenant, text in (("acme", prompt), ("initech", "Something else entirely, long enough for a block.")):
            answer = call(unix, "POST", "/v1/completions", json={"prompt": text, "max_tokens": 1},
                          headers={"X-KVD-Tenant": tenant})
            assert answer.status_code == 200
        hashed, chain_keys, hasher = [], cache_questions.chain_keys, cache_questions.PrefixHasher

        def watched(namespace, token_ids):
            hashed.append((namespace.tenant, len(token_ids), holds_engine_lock(service)))
            return chain_keys(namespace, token_ids)

        class Watched(hasher):
            __slots__ = ("tenant",)

            def __init__(self, namespace):
                super().__init__(namespace)
                self.tenant = namespace.tenant

            def feed(self, token_ids):
                hashed.append((self.tenant, len(token_ids), holds_engine_lock(service)))
                return super().feed(token_ids)

        monkeypatch.setattr(cache_questions, "chain_keys", watched)
        monkeypatch.setattr(cache_questions, "PrefixHasher", Watched)
        prompt_tokens = len(service.tokenize(prompt))
        why = call(unix, "POST", "/admin/explain", json={"text": prompt, "tenant": "globex"}).json()
        assert (why["hit_blocks"], why["first_miss"]["reason"]) == (0, "other_namespace")
        assert why["first_miss"]["detail"] == "cached for tenant 'acme'; tenants never share blocks"
        assert hashed == [("globex", prompt_tokens, False),  # the prompt, as globex's
                          ("acme", 16, False),  # acme's tree begins with its block 0, the miss: no more
                          ("initech", 16, False)]  # initech's does not: no further
        # globex caches the first two blocks itself: the miss is block 2, which acme's chain reaches
        # from its first block on, each block hashed once
        assert call(unix, "POST", "/v1/completions", json={"prompt": service.tokenize(prompt)[:40], "max_tokens": 1},
                    headers={"X-KVD-Tenant": "globex"}).status_code == 200
        hashed.clear()
        why = call(unix, "POST", "/admin/explain", json={"text": prompt, "tenant": "globex"}).json()
        assert (why["hit_blocks"], why["first_miss"]["block"], why["first_miss"]["reason"]) == (2, 2, "other_namespace")
        assert why["first_miss"]["detail"] == "cached for tenant 'acme'; tenants never share blocks"
        assert hashed == [("globex", prompt_tokens, False), ("acme", 16, False), ("acme", 32, False),
                          ("initech", 16, False)]
    finally:
        service.shutdown(1)


def test_a_pin_by_text_hashes_its_prefix_outside_the_engines_lock(tmp_path, monkeypatch):
    """The prefix's keys are computed before the engine's lock is taken (an 8k-token system prompt
    hashes for a millisecond or two, which held up every running request); the pin is the same."""
    import threading

    from kvctl.daemon.cache import manager

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        hashed, chain_keys = [], manager.chain_keys

        def watched(namespace, token_ids):
            if threading.current_thread() is not service._thread:  # the engine's own steps aside
                hashed.append((len(token_ids), holds_engine_lock(service)))
            return chain_keys(namespace, token_ids)

        monkeypatch.setattr(manager, "chain_keys", watched)
        prompt = SYSTEM + "A pinned prompt, hashed before the lock."
        pinned = call(unix, "POST", "/admin/pins", json={"text": prompt}).json()
        assert hashed == [(len(service.tokenize(prompt)), False)]
        assert pinned["blocks"] == pinned["cached_blocks"] == len(service.tokenize(prompt)) // 16 and pinned["warmed"]
        short = call(unix, "POST", "/admin/pins", json={"text": "Hi."})
        assert (short.status_code, short.json()["error"]["param"]) == (400, "tokens")
        assert short.json()["error"]["message"].endswith("tokens is less than one block (16 tokens); nothing to pin")
    finally:
        service.shutdown(1)


def test_listing_prefixes_reads_the_device_under_the_engines_lock_and_groups_it_after(tmp_path, monkeypatch):
    """`kvctl prefixes` (and a pin, eviction or swap by prefix id) reads the device's cached blocks
    as plain rows under the engine's lock and makes the tree's blocks after it: on a GPU's 100,000
    blocks that hold went from about 120 ms to about 20 ms (scripts/prefix-tree-time --pool-blocks)."""
    from kvctl.daemon.server import prefix_ops

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        assert complete(unix, prompt=SYSTEM + "Q1").status_code == 200
        made, cached_block = [], prefix_ops.CachedBlock

        def watched(*row):
            made.append(holds_engine_lock(service))
            return cached_block(*row)

        monkeypatch.setattr(prefix_ops, "CachedBlock", watched)
        rows = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
        cached = service.status()["blocks"]["device"]["cached"]
        assert made == [False] * cached and cached >= len(service.tokenize(SYSTEM + "Q1")) // 16  # and the answer's
        assert [(r["tokens"], r["blocks"], r["tier"]) for r in rows] == [(cached * 16, cached, "device")]
    finally:
        service.shutdown(1)


def test_the_tenants_rows_are_made_after_the_engines_lock(tmp_path, monkeypatch):
    """`kvctl tenants` reads kvd's books under the engine's lock and makes a row per tenant after
    it: at the default max_tracked_tenants (10,000) the rows held the lock about 17 ms, 2.4 now."""
    from kvctl.daemon.server import tenants

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        with service.lock:
            for name in ("acme", "globex", "initech"):
                service.engine.stats.tenants.row(name)[0] += 16
        held, lower_use = [], tenants._lower_use

        def watched(tiers, lower, tenant):
            held.append((tenant, holds_engine_lock(service)))
            return lower_use(tiers, lower, tenant)

        monkeypatch.setattr(tenants, "_lower_use", watched)
        rows = call(unix, "GET", "/admin/tenants").json()["tenants"]
        assert [(r["tenant"], r["prompt_tokens"]) for r in rows] == [("acme", 16), ("globex", 16), ("initech", 16)]
        assert held == [("acme", False), ("globex", False), ("initech", False)]
    finally:
        service.shutdown(1)


def test_trusted_front_end_may_name_the_tenant(tmp_path, daemon):
    service, _, _ = daemon
    _, trusted = apps(service, token_table(tmp_path), trusted_proxy=True)
    prompt = SYSTEM + "proxy"
    headers = {"Authorization": f"Bearer {USER_TOKEN}", "X-KVD-Tenant": "globex"}
    call(trusted, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers)
    other = call(trusted, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                 headers={"Authorization": f"Bearer {GLOBEX_TOKEN}"})
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_proxy_token_names_the_tenant_without_trusted_proxy_where_a_user_token_cannot(tmp_path, daemon):
    """A gateway's token (role proxy): its requests are served as the X-KVD-Tenant it names, its own
    tenant where it names none, and it has a user's rights; a user token's header still counts for
    nothing (no trusted_proxy), so a leaked one cannot pass as another tenant."""
    from kvctl.daemon.server.auth import TokenTable

    service, _, _ = daemon
    path = tmp_path / "tokens"
    path.write_text(f"{USER_TOKEN} acme user\n{GLOBEX_TOKEN} globex user\ngateway-token-0123456789 gateway proxy\n")
    path.chmod(0o600)
    _, tcp = apps(service, TokenTable.load(path))
    proxy = {"Authorization": "Bearer gateway-token-0123456789"}

    def cached(prompt: str, headers: dict) -> int:
        answer = call(tcp, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    named = "Named by the gateway. " + SYSTEM * 2
    assert cached(named, {**proxy, "X-KVD-Tenant": "globex"}) == 0
    assert cached(named, {"Authorization": f"Bearer {GLOBEX_TOKEN}"}) > 0  # it was globex's
    passed = "A user naming another tenant. " + SYSTEM * 2
    assert cached(passed, {"Authorization": f"Bearer {USER_TOKEN}", "X-KVD-Tenant": "globex"}) == 0
    assert cached(passed, {"Authorization": f"Bearer {GLOBEX_TOKEN}"}) == 0  # served as acme, not globex
    assert cached(passed, {"Authorization": f"Bearer {USER_TOKEN}"}) > 0
    unnamed = "The gateway's own. " + SYSTEM * 2
    assert cached(unnamed, proxy) == 0 and cached(unnamed, {**proxy, "X-KVD-Tenant": "gateway"}) > 0
    refused = call(tcp, "GET", "/admin/status", headers=proxy)
    assert refused.status_code == 403 and refused.json()["error"]["message"] == "this endpoint needs the admin role"


def test_admin_status_shows_the_gpu_kvd_runs_on_as_nvml_numbers_it(daemon, monkeypatch):
    """kvd on cuda:1 under CUDA_VISIBLE_DEVICES=2,3 runs on NVML's GPU 3: only that one is shown."""
    from kvctl.daemon import gpu_nvml

    from .test_gpu_nvml import FakeNvml

    service, unix, _ = daemon
    fake = FakeNvml()
    monkeypatch.setattr(gpu_nvml, "NVML", gpu_nvml.Nvml(fake))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert call(unix, "GET", "/admin/status").json()["gpu"] is None  # on the CPU: no GPU of its own
    monkeypatch.setattr(service.engine.model, "device", torch.device("cuda", 1))  # read by the status only
    gpus = call(unix, "GET", "/admin/status").json()["gpu"]
    assert [(g["index"], g["uuid"], g["utilization"]) for g in gpus] == [(3, "GPU-2c34dddd-0000", 60)]
    call(unix, "GET", "/admin/status")
    assert fake.inits == 1


def test_admin_status_prefixes_pin_evict_explain_and_audit(daemon):
    service, unix, _ = daemon
    status = call(unix, "GET", "/admin/status", params={"blocks": True}).json()
    device = status["blocks"]["device"]
    assert set(device) == {"total", "free", "reserved", "active", "shared", "cached", "pinned"}
    assert sum(v for k, v in device.items() if k != "total") == device["total"] == 64
    assert len(status["block_map"]) == 64 and status["block_map_per_cell"] == 1
    prompt = "Pinned system prompt for the support bot, long enough for three blocks of tokens."
    pinned = call(unix, "POST", "/admin/pins", json={"text": prompt, "tenant": "acme", "ttl": "1h",
                                                     "note": "support"}).json()
    every = call(unix, "GET", "/admin/status", params={"blocks": True}).json()["block_map"]
    assert every.count("p") == pinned["blocks"] and len(every) == 64
    folded = call(unix, "GET", "/admin/status", params={"blocks": True, "cells": 8}).json()
    # eight cells of eight blocks, each in its cell's most common state, folded by kvd
    assert folded["block_map_per_cell"] == 8 and folded["block_map"] == "".join(
        max(dict.fromkeys(run), key=run.count) for run in (every[i:i + 8] for i in range(0, 64, 8)))
    assert call(unix, "GET", "/admin/status", params={"blocks": True, "cells": 64}).json()["block_map"] == every
    refused = call(unix, "GET", "/admin/status", params={"blocks": True, "cells": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cells", refused.text
    assert pinned["blocks"] == pinned["cached_blocks"] == len(service.tokenize(prompt)) // 16
    assert pinned["warmed"] is True and pinned["tenant"] == "acme"
    queue = call(unix, "GET", "/admin/status").json()["queue"]  # warming it measured a prefill step
    assert queue["prefill_tokens_per_second"] > 0 and (queue["tokens_ahead"], queue["predicted_wait_seconds"]) == (0, 0.0)
    listing = call(unix, "GET", "/admin/prefixes", params={"pinned": True}).json()["prefixes"]
    assert [p["tenant"] for p in listing] == ["acme"] and "text" not in listing[0]
    # times are Unix times (not the daemon's monotonic clock), with the spans ready to read
    now = time.time()
    assert now - 60 < listing[0]["last_use"] <= now and 0 <= listing[0]["idle_seconds"] < 60
    [listed_pin] = call(unix, "GET", "/admin/pins").json()["pins"]
    assert now - 60 < listed_pin["created_at"] <= now
    assert listed_pin["expires_at"] == pytest.approx(listed_pin["created_at"] + 3600, abs=5)
    assert 3540 < listed_pin["expires_in_seconds"] <= 3600 and 3540 < pinned["expires_in_seconds"] <= 3600
    assert pinned["expires_at"] == pytest.approx(listed_pin["expires_at"], abs=1)
    evicted = call(unix, "POST", "/admin/evict", json={"all_unpinned": True}).json()
    assert evicted["skipped"].get("pinned", 0) >= pinned["blocks"] and evicted["result"] == "ok"
    explain = call(unix, "POST", "/admin/explain", json={"text": prompt, "tenant": "acme"}).json()
    assert explain["hit_blocks"] == pinned["blocks"] - (1 if len(service.tokenize(prompt)) % 16 == 0 else 0)
    assert call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}").json()["unpinned_blocks"] == pinned["blocks"]
    missing = call(unix, "DELETE", "/admin/pins/pin-0000000000000000")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "unknown pin 'pin-0000000000000000'"
    a_prefix_id = call(unix, "DELETE", "/admin/pins/dd7b0a02869132bd").json()["error"]["message"]
    assert a_prefix_id == "unknown pin 'dd7b0a02869132bd'; pin ids start with pin- (kvctl pins lists them)"
    call(unix, "POST", "/admin/evict", json={"tenant": "acme"})
    why = call(unix, "POST", "/admin/explain", json={"text": prompt, "tenant": "acme"}).json()
    assert why["hit_blocks"] == 0 and why["first_miss"]["reason"] == "evicted"
    assert why["first_miss"]["evicted_by"] == "operator"
    life = call(unix, "GET", "/admin/events", params={"key": why["first_miss"]["key"]}).json()["events"]
    assert [(e["kind"], e["tier"], e.get("reason")) for e in life][-1] == ("removed", "device", "operator")
    complete(unix, prompt=SYSTEM + "Q9")  # cached for tenant "default" only
    elsewhere = call(unix, "POST", "/admin/explain", json={"text": SYSTEM + "Q9", "tenant": "nobody"}).json()
    assert elsewhere["first_miss"]["reason"] == "other_namespace"
    short = call(unix, "POST", "/admin/explain", json={"tokens": [1, 2, 3]}).json()
    assert short["first_miss"]["reason"] == "shorter_than_a_block"
    whole = [4] * 32 + [5] * 10  # two full blocks and 10 tokens of a third
    assert complete(unix, prompt=whole, max_tokens=1).status_code == 200
    rest = call(unix, "POST", "/admin/explain", json={"tokens": whole}).json()
    assert (rest["hit_blocks"], rest["first_miss"]) == (2, {
        "block": 2, "reason": "partial_block",
        "detail": "every full block hit; the last 10 tokens fill only part of a block of 16, and only full "
                  "blocks are cached"})
    exact = call(unix, "POST", "/admin/explain", json={"tokens": whole[:32]}).json()
    assert (exact["hit_blocks"], exact["first_miss"]) == (1, {
        "block": 1, "reason": "last_token_computed",
        "detail": "every block but the last hit; the last token is always computed, so its block of 16 is "
                  "computed again"})
    actions = [(e["action"], e["result"]) for e in call(unix, "GET", "/admin/audit").json()["entries"]]
    assert ("pin", "ok") in actions and ("unpin", "ok") in actions and ("evict", "ok") in actions
    bad = call(unix, "POST", "/admin/evict", json={"tenant": "a", "all_unpinned": True})
    assert bad.status_code == 400


def test_metrics_expose_the_documented_families(daemon):
    _, unix, _ = daemon
    complete(unix, prompt=SYSTEM + "metrics")
    text = call(unix, "GET", "/metrics").text
    for name in ('kvd_blocks{state="free",tier="device"}', "kvd_prefix_hit_tokens_total",
                 "kvd_prompt_tokens_total", "kvd_recomputed_tokens_total",
                 'kvd_evicted_blocks_total{reason="capacity"}', "kvd_allocation_seconds_bucket",
                 'kvd_admission_rejections_total{reason="queue_full"}', "kvd_preemptions_total",
                 "kvd_queue_age_seconds", "kvd_ttft_seconds_bucket", "kvd_inter_token_seconds_bucket",
                 'kvd_engine_steps_total{kind="prefill"}', 'kvd_engine_steps_total{kind="decode"}',
                 'kvd_engine_step_seconds_total{kind="decode"}'):
        assert name in text, name


def test_queue_full_is_429_with_retry_after(tmp_path):
    service = start_service(tmp_path, max_running=1, max_queue=1)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        from kvctl.daemon.engine.sampling import SamplingParams
        from kvctl.daemon.server.calls import Principal

        who = Principal("default", "admin", "test")
        busy = service.submit([[1] * 20], SamplingParams(max_tokens=500, ignore_eos=True), who, lambda e: None)
        while busy[0].sequences[0].status.value == "waiting":  # the engine thread admits it
            time.sleep(0.01)
        queued = service.submit([[2] * 20], SamplingParams(max_tokens=5), who, lambda e: None)
        response = complete(unix, prompt="late")
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "admission queue full" in response.json()["error"]["message"]
        for request in busy + queued:
            service.cancel(request.request_id)
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_tenant_over_its_share_of_requests_in_flight_gets_a_429_and_others_do_not(tmp_path):
    service = start_service(tmp_path, num_blocks=128, max_running=1, max_tenant_requests=1)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        from kvctl.daemon.engine.sampling import SamplingParams
        from kvctl.daemon.server.calls import Principal

        busy = service.submit([[1] * 20], SamplingParams(max_tokens=400, ignore_eos=True),
                              Principal("acme", "admin", "test"), lambda e: None)
        def ask(tenant, prompt):
            return call(unix, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                        json={"prompt": prompt, "max_tokens": 1})

        refused = ask("acme", "acme again")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "tenant_limit" and error["message"].endswith(
            "tenant 'acme' has 1 requests in flight (max_tenant_requests 1)")
        # globex's request is queued behind acme's (one runs at a time), not refused
        others = ask("globex", "globex waits its turn")
        assert others.status_code == 200 and busy[0].finished
        text = call(unix, "GET", "/metrics").text
        assert 'kvd_admission_rejections_total{reason="tenant_limit"} 1.0' in text.splitlines()
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_dozens_of_clients_with_cancellations_end_with_every_block_free(tmp_path):
    service = start_service(tmp_path, max_running=8, max_queue=64, max_batch_tokens=64)
    unix, _ = apps(service, token_table(tmp_path))
    rng = random.Random(3)

    async def one(client, i):
        body = {"prompt": SYSTEM[: rng.randint(10, len(SYSTEM))] + str(i), "max_tokens": rng.randint(1, 30),
                "temperature": 0.5, "seed": i, "stream": i % 2 == 0}
        try:
            return await asyncio.wait_for(client.post("/v1/completions", json=body),
                                          timeout=rng.choice([0.05, 30, 30]))
        except asyncio.TimeoutError:
            return None  # the client went away: its request is cancelled

    async def main():
        transport = httpx.ASGITransport(app=unix)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    try:
        results = asyncio.run(main())
        done = [r for r in results if r is not None]
        assert done and all(r.status_code in (200, 429) for r in done)
        for _ in range(200):
            if blocks_all_back(service):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_whole_answer_cancelled_as_its_first_token_arrives_is_cancelled_in_the_engine(daemon, monkeypatch):
    """A completion answered whole, whose handler is cancelled (the client gone, kvd stopping) in
    the same turn as its first token arrives, must cancel its request in the engine. CPython
    3.11's asyncio.wait_for, which the handler waited for tokens with, swallows such a
    cancellation (gh-86296): the request ran to its last token for no one."""
    import kvctl.daemon.server.app as app_module
    from kvctl.daemon.server.service import LoopSink

    service, unix, _ = daemon
    seen, handler = [], {}

    class CancelsOnFirstToken:
        """The handler's queue, but the first token put in it also cancels the handler's task."""

        def __init__(self, queue) -> None:
            self.queue = queue

        def put_nowait(self, event) -> None:
            self.queue.put_nowait(event)
            seen.append((event.token_id is not None, event.finish_reason))
            if len(seen) == 1:
                handler["task"].cancel()

    monkeypatch.setattr(app_module, "LoopSink", lambda loop, queue: LoopSink(loop, CancelsOnFirstToken(queue)))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=unix), base_url="http://kvd") as client:
            handler["task"] = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": SYSTEM + " cancelled early", "max_tokens": 100, "ignore_eos": True, "temperature": 0}))
            await asyncio.wait([handler["task"]], timeout=30)
            for _ in range(200):  # the engine's answer to the cancel comes through the same sink
                if seen[-1][1] is not None:
                    break
                await asyncio.sleep(0.01)
        return handler["task"]

    task = asyncio.run(scenario())
    assert task.cancelled()
    assert seen[-1] == (False, "cancelled") and sum(token for token, _ in seen) < 100


def test_a_pin_that_cannot_be_made_leaves_nothing_behind(tmp_path):
    service = start_service(tmp_path, num_blocks=16, pin_budget_blocks=64)
    unix, _ = apps(service, token_table(tmp_path))
    for path, body in (("/admin/pins", {"tokens": list(range(20)) + [99999]}), ("/admin/explain", {"tokens": [-1] * 20})):
        response = call(unix, "POST", path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "tokens"
        assert response.json()["error"]["message"] == f"tokens: token ids must lie in [0, 258), found {body['tokens'][-1]}"
    # 272 tokens fill 17 blocks: the 16-block cache can never hold the prefix, so it is not warmed
    too_long = call(unix, "POST", "/admin/pins", json={"tokens": [7] * 272})
    assert too_long.status_code == 409, too_long.text
    assert too_long.json()["error"]["message"].startswith("tokens: the prefix cannot be warmed: ")
    assert call(unix, "GET", "/admin/pins").json()["pins"] == []
    assert call(unix, "GET", "/admin/status").json()["pins"] == 0
    [refused] = [e for e in call(unix, "GET", "/admin/audit").json()["entries"] if e["action"] == "pin"]
    assert refused["result"] == "refused" and "never" in refused["detail"]["reason"]
    service.shutdown(1)


def test_pins_survive_a_restart(tmp_path):
    first = start_service(tmp_path)
    unix, _ = apps(first, token_table(tmp_path))
    prompt = "A prefix pinned before a restart, long enough for two blocks."
    pin = call(unix, "POST", "/admin/pins", json={"text": prompt}).json()
    first.shutdown(1)
    second = start_service(tmp_path)
    try:
        unix, _ = apps(second, token_table(tmp_path))
        pins = call(unix, "GET", "/admin/pins").json()["pins"]
        assert [p["pin_id"] for p in pins] == [pin["pin_id"]] and pins[0]["cached_blocks"] == 0
        complete(unix, prompt=prompt, max_tokens=1)  # refills the prefix: its blocks pin at once
        status = call(unix, "GET", "/admin/status").json()
        assert status["blocks"]["device"]["pinned"] == pin["blocks"]
    finally:
        second.shutdown(1)


def test_a_pin_s_times_are_read_with_the_engine_s_clock_so_a_slow_store_write_does_not_shift_them(tmp_path,
                                                                                                   monkeypatch):
    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        prompt = "A prefix pinned twice while the store writes slowly, long enough for two blocks."
        made = call(unix, "POST", "/admin/pins", json={"text": prompt, "ttl": "1h"}).json()
        save = service.store.save_pin
        monkeypatch.setattr(service.store, "save_pin", lambda row: time.sleep(0.3) or save(row))
        again = call(unix, "POST", "/admin/pins", json={"text": prompt, "ttl": "1h"}).json()
        assert abs(again["created_at"] - made["created_at"]) < 0.05  # (0.3 s off when read after the write)
        [listed] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert abs(listed["created_at"] - made["created_at"]) < 0.05
    finally:
        service.shutdown(1)


def test_a_pin_made_again_says_what_it_was_and_keeps_when_it_was_first_made(tmp_path):
    """Pinning a pinned prefix again sets its owner, note and expiry to this call's (none: it no
    longer expires): the answer and the audit say what they were; the store keeps its first
    making, so a restart shows the same `created_at`."""
    first = start_service(tmp_path)
    unix, tcp = apps(first, token_table(tmp_path))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    prompt = "A prefix pinned twice, long enough for two blocks of sixteen tokens."
    made = call(unix, "POST", "/admin/pins", json={"text": prompt, "ttl": "1h", "note": "support"}).json()
    assert made["refreshed"] is False and "was" not in made
    again = call(tcp, "POST", "/admin/pins", headers=admin, json={"text": prompt, "tenant": "default"}).json()
    assert (again["pin_id"], again["refreshed"], again["note"], again["expires_at"]) == (made["pin_id"], True, "",
                                                                                          None)
    assert again["was"]["owner"] == made["owner"] and again["was"]["note"] == "support"
    assert 3590 < again["was"]["expires_in_seconds"] <= 3600 and again["owner"] != made["owner"]
    assert abs(again["created_at"] - made["created_at"]) < 0.05
    audit = call(unix, "GET", "/admin/audit", params={"action": "pin"}).json()["entries"]
    assert [e["detail"].get("was", {}).get("note") for e in audit] == ["support", None]  # newest first
    first.shutdown(1)
    second = start_service(tmp_path)
    try:
        unix, _ = apps(second, token_table(tmp_path))
        [pin] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert abs(pin["created_at"] - made["created_at"]) < 0.05 and pin["expires_at"] is None
    finally:
        second.shutdown(1)


def test_a_ttl_of_no_finite_span_is_refused_and_one_stored_before_is_kept_until_unpinned(tmp_path):
    """`--ttl inf` (or 1e308d) pinned a prefix whose expiry could not be rendered: /admin/pins
    answered 500 from then on, across restarts, so the pin could not even be listed to remove it."""
    first = start_service(tmp_path)
    unix, _ = apps(first, token_table(tmp_path))
    prompt = "A prefix pinned before a restart, long enough for two blocks."
    for ttl in ("inf", "1e999s", "1e308d", "0"):
        refused = call(unix, "POST", "/admin/pins", json={"text": prompt, "ttl": ttl})
        assert (refused.status_code, refused.json()["error"]["message"]) == \
            (400, f"ttl: must be a finite number of seconds > 0 (or 30m, 1h, 2d), got {ttl!r}")
    assert call(unix, "GET", "/admin/pins").json()["pins"] == []
    pin = call(unix, "POST", "/admin/pins", json={"text": prompt, "ttl": "1h"}).json()
    first.shutdown(1)
    from kvctl.daemon.store import Store

    store = Store(tmp_path / "kvd.sqlite3")  # as an earlier kvd stored `--ttl inf`
    [row] = store.pins()
    store.save_pin({**row, "expires_at": float("inf")})
    second = start_service(tmp_path)
    try:
        unix, _ = apps(second, token_table(tmp_path))
        listed = call(unix, "GET", "/admin/pins")
        assert listed.status_code == 200
        [kept] = listed.json()["pins"]
        assert (kept["pin_id"], kept["expires_at"], kept["expires_in_seconds"]) == (pin["pin_id"], None, None)
    finally:
        second.shutdown(1)


def test_a_reload_follows_where_each_live_setting_now_comes_from(tmp_path):
    """A setting whose value stays but whose source changes (the file stops naming the default)
    is shown from its new source; settings that need a restart keep the source they run with."""
    from kvctl.daemon.config import resolve

    config = tmp_path / "kvd.yaml"
    config.write_text("max_queue: 256\nblock_size: 16\n")
    service = start_service(tmp_path / "state")
    try:
        service.config_source = lambda: resolve({}, {}, config)
        started_with = dict(service.config.sources)  # what the test harness passed as flags
        assert "max_queue" not in started_with and "block_size" not in started_with
        service.reload_from_source("ops")
        assert service.config.sources == {**started_with, "max_queue": str(config)}  # block_size waits for a restart
        config.write_text("block_size: 16\n")
        result = service.reload_from_source("ops")
        assert result["changed"] == {} and service.config.sources == started_with  # 256 is the default's now
    finally:
        service.shutdown(1)


def test_a_reload_refuses_a_config_file_found_empty_and_changes_nothing(tmp_path):
    """A tool that truncates the file before it writes it leaves it empty for a moment; a
    reload (a SIGHUP from a path watcher) then read no settings and put every live one from the
    file back to its default. A file with nothing in it is refused when settings came from it;
    `{}` says "no settings" on purpose."""
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.calls import ServiceError

    config = tmp_path / "kvd.yaml"
    config.write_text("max_queue: 100\nmax_running: 3\n")
    service = start_service(tmp_path / "state")
    try:
        service.config_source = lambda: resolve({}, {}, config)
        service.reload_from_source("ops")
        assert (service.config.max_queue, service.config.max_running) == (100, 3)
        for emptied in ("", "\n  \n"):
            config.write_text(emptied)
            with pytest.raises(ServiceError) as refused:
                service.reload_from_source("ops")
            assert refused.value.status == 400
            assert str(refused.value) == (
                f"reload refused, nothing changed: config: {str(config)!r} is empty, and max_queue, max_running "
                "came from it: a reload would put them back to their defaults (a file caught mid-write?); "
                "write {} there to mean no settings")
            assert (service.config.max_queue, service.config.max_running) == (100, 3)
        assert service.reloads["refused"] == 2 and service.last_reload["result"] == "refused"
        # a setting a reload cannot take live is a refused reload as well: counted, audited
        config.write_text("max_queue: 100\nmax_running: 3\npin_room_tokens: 100000\n")  # more than the cache
        with pytest.raises(ServiceError) as refused:
            service.reload_from_source("ops")
        assert (refused.value.status, refused.value.param) == (400, "pin_room_tokens")
        why = "pin_room_tokens: 100000 is more than the cache holds (64 blocks of 16 tokens: 1024)"
        assert str(refused.value) == "reload refused, nothing changed: " + why
        assert service.reloads["refused"] == 3 and service.last_reload["error"] == why
        newest = service.store.audit_since(0, action="reload")[0]
        assert (newest["result"], newest["detail"]) == ("refused", {"error": why})
        config.write_text("{}\n")
        result = service.reload_from_source("ops")
        assert result["changed"] == {"max_queue": 256, "max_running": 32}  # the defaults, asked for
        config.write_text("")  # nothing came from it now: empty is no news
        assert service.reload_from_source("ops")["changed"] == {}
    finally:
        service.shutdown(1)


def test_reload_applies_live_settings_and_names_the_rest(daemon):
    service, unix, _ = daemon
    from dataclasses import replace

    assert service.engine.settings.quick_prefill_tokens == (0 if service.engine.model.device.type == "cuda" else 64)
    new = replace(service.config, max_queue=99, reservation="p95", block_size=32, quick_prefill_tokens=8,
                  max_tenant_requests=12)
    result = service.reload(new)
    assert result == {"changed": {"max_queue": 99, "max_tenant_requests": 12, "reservation": "p95",
                                  "quick_prefill_tokens": 8},
                      "previous": {"max_queue": 256, "max_tenant_requests": None, "reservation": "fraction:1.0",
                                   "quick_prefill_tokens": None},
                      "needs_restart": ["block_size"]}
    assert service.engine.settings.max_queue == 99 and service.engine.reservation.spec == "p95"
    assert service.engine.settings.max_tenant_requests == 12
    assert service.engine.settings.quick_prefill_tokens == 8
    assert call(unix, "GET", "/admin/config").json()["config"]["max_queue"] == 99
    assert call(unix, "GET", "/admin/config").json()["config"]["block_size"] == 16
    shown = call(unix, "GET", "/admin/config").json()  # which settings a reload changes: those it just changed
    assert {"max_queue", "max_tenant_requests", "reservation", "quick_prefill_tokens"} <= set(shown["live"])
    assert "block_size" not in shown["live"] and set(shown["live"]) <= set(shown["config"])
    entries = call(unix, "GET", "/admin/audit").json()["entries"]
    assert entries[0]["action"] == "reload" and entries[0]["detail"]["needs_restart"] == ["block_size"]


def test_a_body_over_max_request_bytes_is_refused_before_it_is_read(daemon):
    """By its Content-Length, or by its chunks when it declares none; the limit reloads live."""
    from dataclasses import replace

    service, unix, _ = daemon
    service.reload(replace(service.config, max_request_bytes=4096))
    try:
        big = {"prompt": "small", "max_tokens": 1, "user": "u" * 5000}  # a valid 5 kB body
        response = call(unix, "POST", "/v1/completions", json=big)
        assert response.status_code == 413
        assert response.json()["error"] == {
            "message": f"body: {len(response.request.content):,} bytes is over max_request_bytes (4,096); "
                       "send less per request", "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}

        async def chunks():  # no Content-Length: the limit trips while the body arrives
            for _ in range(20):
                yield b" " * 1024

        streamed = call(unix, "POST", "/v1/completions", content=chunks(),
                        headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert streamed.json()["error"]["message"].startswith("body: 5,120 bytes so far is over max_request_bytes")
        assert call(unix, "POST", "/v1/completions", json={"prompt": "small", "max_tokens": 1}).status_code == 200
    finally:
        service.reload(replace(service.config, max_request_bytes=32 * 2**20))
    assert call(unix, "POST", "/v1/completions", json=big).status_code == 200


def test_a_short_prefix_id_that_matches_several_prefixes_evicts_nothing(daemon):
    """As git does with a short hash: at least 4 hex digits, and one prefix or none."""
    service, unix, _ = daemon
    by_head: dict[str, list[int]] = {}
    for n in range(5000):  # two one-block prompts whose ids share their first 4 hex digits
        tokens = [n % 200, n // 200] + [7] * 15
        head = service.engine.prefix_keys("default", tokens)[2][0].hex()[:4]
        by_head.setdefault(head, []).append(n)
        if len(by_head[head]) == 2:
            break
    pair = [[n % 200, n // 200] + [7] * 15 for n in by_head[head]]
    for tokens in pair:
        assert complete(unix, prompt=tokens, max_tokens=1).status_code == 200
    ids = sorted(service.engine.prefix_keys("default", t)[2][0].hex()[:16] for t in pair)
    ambiguous = call(unix, "POST", "/admin/evict", json={"prefix": head})
    assert ambiguous.status_code == 409
    assert ambiguous.json()["error"]["message"] == (f"prefix: {head!r} matches 2 prefixes ({ids[0]}, {ids[1]}); "
                                                    "give more digits")
    for bad in ("ab", "zzzz"):
        refused = call(unix, "POST", "/admin/evict", json={"prefix": bad})
        assert refused.status_code == 400 and "give at least 4 hex digits" in refused.json()["error"]["message"]
    listed = {p["prefix_id"] for p in call(unix, "GET", "/admin/prefixes").json()["prefixes"]}
    assert set(ids) <= listed  # nothing went
    one = call(unix, "POST", "/admin/evict", json={"prefix": ids[0]}).json()
    assert (one["target"], one["evicted_blocks"]) == (f"prefix={ids[0]}", 1)
    listed = {p["prefix_id"] for p in call(unix, "GET", "/admin/prefixes").json()["prefixes"]}
    assert ids[0] not in listed and ids[1] in listed


def test_evict_by_model_revision_takes_the_served_model_s_blocks_and_refuses_an_unknown_one(daemon):
    service, unix, _ = daemon
    complete(unix, prompt="Blocks of the model being served, long enough for two blocks of tokens.", max_tokens=1)
    cached = call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"]
    assert cached > 0
    other = call(unix, "POST", "/admin/evict", json={"model_revision": "0123456789ab"})  # no tier knows it
    assert other.status_code == 404 and other.json()["error"]["message"] == (
        f"model_revision: no tier here holds blocks of '0123456789ab' (this daemon serves {service.loaded.revision[:16]})")
    for bad in ("7", "ABCDEF", "0123-x"):
        short = call(unix, "POST", "/admin/evict", json={"model_revision": bad})
        assert short.status_code == 400 and short.json()["error"]["param"] == "model_revision"
    assert call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"] == cached  # nothing went
    served = call(unix, "POST", "/admin/evict", json={"model_revision": service.loaded.revision[:12]}).json()
    assert (served["evicted_blocks"], served["target"]) == (cached, "model_revision=current")
    assert call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"] == 0


def test_evict_one_prefix_by_id(daemon):
    _, unix, _ = daemon
    complete(unix, prompt="A prefix to evict by its id: " + SYSTEM, max_tokens=1, seed=1)
    listing = call(unix, "GET", "/admin/prefixes", params={"tenant": "default"}).json()["prefixes"]
    target = next(p for p in listing if p["in_use_blocks"] == 0 and not p["pinned"])
    report = call(unix, "POST", "/admin/evict", json={"prefix": target["prefix_id"]}).json()
    assert report == {"evicted_blocks": target["blocks"], "skipped": {}, "result": "ok",
                      "target": f"prefix={target['prefix_id']}", "lower_tier_blocks_dropped": 0}
    after = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
    assert target["prefix_id"] not in [p["prefix_id"] for p in after]
    missing = call(unix, "POST", "/admin/evict", json={"prefix": "ffffffffffffffff"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "prefix"


def test_incremental_text_equals_the_full_decode_and_never_splits_a_character(tmp_path):
    """Streamed deltas decode a short window per token; joined, they equal decoding the whole
    output, and a character split across byte tokens is held back until it is complete."""
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer
    from kvctl.daemon.server.incremental_text import IncrementalText

    tokenizer = Tokenizer(ensure_demo_checkpoint(tmp_path))
    text = "Blocks – 16 tokens each; caché ↦ 日本語 and emoji 🙂 end."
    ids = tokenizer.encode(text)
    stream = IncrementalText(tokenizer.decode)
    deltas = [stream.add(token) for token in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    specials = len(ids) - len(text.encode())  # byte-level: one token per byte, plus BOS
    assert specials == 1 and deltas[0] == ""
    assert deltas.count("") == specials + sum(len(c.encode()) - 1 for c in text)  # a wait per continuation byte


def test_a_stream_that_fell_behind_sends_the_waiting_tokens_in_one_chunk(tmp_path):
    """Events already queued when the stream wakes go out as one chunk per choice, in order,
    with their text joined; a stream that keeps up sends one token per chunk."""
    import json
    from types import SimpleNamespace

    from kvctl.daemon.engine.engine import TokenEvent
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer
    from kvctl.daemon.server.app import _stream
    from kvctl.daemon.server.chat import CompletionShape
    from kvctl.daemon.server.logprobs import PromptParts, TokenNames

    tokenizer = Tokenizer(ensure_demo_checkpoint(tmp_path))
    ids = tokenizer.encode("kv")[1:] + tokenizer.encode("cache")[1:]  # without BOS
    seq = SimpleNamespace(index=0, output_ids=list(ids))
    request = SimpleNamespace(request_id="r", sequences=[seq], rejected=None)
    engine = SimpleNamespace(tokenizer=tokenizer, text_of=lambda s: tokenizer.decode(s.output_ids))

    async def collect(batches):
        queue: asyncio.Queue = asyncio.Queue()
        chunks = []
        stream = _stream(engine, queue, [request], {"r": request}, {("r", 0): 0},
                         {"id": "cmpl-x", "created": 0, "model": "demo"}, CompletionShape(), False, lambda: None,
                         False, PromptParts(TokenNames(tokenizer.token_text), None, None, None, "choice"))
        for batch in batches:
            for event in batch:
                queue.put_nowait(event)
            chunks.append(json.loads((await stream.__anext__())[6:]))
        assert await stream.__anext__() == "data: [DONE]\n\n"
        return [c["choices"][0] for c in chunks]

    events = [TokenEvent("r", 0, t, None) for t in ids[:-1]] + [TokenEvent("r", 0, ids[-1], "length")]
    behind = asyncio.run(collect([events[:5], events[5:]]))
    assert [(c["token_ids"], c["text"], c["finish_reason"]) for c in behind] == [
        (ids[:5], "kvcac", None), (ids[5:], "he", "length")]
    kept_up = asyncio.run(collect([[e] for e in events]))
    assert [c["token_ids"] for c in kept_up] == [[t] for t in ids]
    assert "".join(c["text"] for c in kept_up) == "kvcache"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_only_the_engine_thread_runs_torch_ops_on_several_threads(tmp_path):
    """kvd confines torch's intra-op threads to the engine thread: a thread started later (a
    request or tier worker) runs a large tensor op on itself, leaving no OpenMP team behind,
    while the engine keeps its own count and still serves."""
    import threading

    import torch

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread: nothing to confine")
    service = start_service(tmp_path, confine_threads=True)
    try:
        assert service.engine_threads == threads
        seen, ran, release = {}, threading.Event(), threading.Event()

        def worker():  # lives on after its op, as request and tier workers do
            seen["threads"] = torch.get_num_threads()
            torch.randn(4_000_000).exp_().sum()  # far above torch's grain size: parallel if it could be
            seen["tid"] = str(threading.get_native_id())
            ran.set()
            release.wait(30)

        before = set(os.listdir("/proc/self/task"))
        thread = threading.Thread(target=worker)
        thread.start()
        try:
            assert ran.wait(30)
            assert seen["threads"] == 1
            # only the worker itself is new: it started no OpenMP team of its own
            assert set(os.listdir("/proc/self/task")) - before == {seen["tid"]}
        finally:
            release.set()
            thread.join()
        from kvctl.daemon.engine.sampling import SamplingParams
        from kvctl.daemon.server.calls import Principal

        done = threading.Event()
        [request] = service.submit([[5] * 40], SamplingParams(max_tokens=3, ignore_eos=True),
                                   Principal("default", "admin", "test"),
                                   lambda event: done.set() if event.finish_reason else None)
        assert done.wait(60) and len(request.sequences[0].output_ids) == 3
    finally:
        service.shutdown(1)
        torch.set_num_threads(threads)  # the test process's own default again


def test_status_latency_percentiles_cover_the_latest_2000_ttfts_and_20000_gaps(tmp_path):
    from types import SimpleNamespace

    from kvctl.daemon.engine.requests import RequestMetrics
    from kvctl.daemon.engine.sampling import SamplingParams

    service = start_service(tmp_path)
    try:
        for i in range(2100):  # TTFT i ms; ten gaps of (i % 7 + 1) ms each
            times = [i / 1000 + k * (i % 7 + 1) / 1000 for k in range(11)]
            metrics = RequestMetrics(arrival=0.0, first_token=times[0], token_times=times)
            service.metrics.observe_request(SimpleNamespace(metrics=metrics, params=SamplingParams(), sequences=[]))
        summary = service.metrics.summary()
        ttft, gaps = summary["ttft_seconds"], summary["inter_token_seconds"]
        assert ttft["count"] == 2000 and gaps["count"] == 20000
        assert ttft["p50"] == pytest.approx(1.099)  # of 0.100 .. 2.099 s: the oldest 100 have gone
        assert gaps["p50"] == pytest.approx(0.004)  # requests 100 .. 2099: gaps of 1..7 ms, evenly
    finally:
        service.shutdown(1)


def test_a_submission_does_not_wait_for_the_step_in_progress(tmp_path):
    """Prompts handed in during a step are queued by the engine thread right after it: the
    submitter gets a future at once instead of waiting for the engine's lock. The requests it
    gives run to the end; a future cancelled before they were queued cancels them."""
    import threading

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal

    service = start_service(tmp_path)
    try:
        engine, who = service.engine, Principal("default", "admin", "test")
        real_step, in_step, release = engine.step, threading.Event(), threading.Event()

        def held_step():
            in_step.set()
            assert release.wait(30)
            return real_step()

        engine.step = held_step
        done = threading.Event()
        service.submit([[3] * 20], SamplingParams(max_tokens=2, ignore_eos=True), who,
                       lambda e: done.set() if e.finish_reason else None)  # starts a step, which holds
        assert in_step.wait(30)
        handed = service.submit_nowait([[4] * 30, [5] * 30], SamplingParams(max_tokens=3, ignore_eos=True),
                                       who, lambda e: None)
        left = service.submit_nowait([[6] * 30], SamplingParams(max_tokens=3, ignore_eos=True), who,
                                     lambda e: None)
        assert not handed.done() and not left.done()  # the step still runs: nothing waited for it
        assert left.cancel()  # its client went away before the engine thread looked
        engine.step = real_step
        release.set()
        requests = handed.result(timeout=30)
        assert [r.prompt_ids for r in requests] == [[4] * 30, [5] * 30]
        assert done.wait(30)
        deadline = time.monotonic() + 30
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [len(r.sequences[0].output_ids) for r in requests] == [3, 3]
        cancelled = [r for r in engine.requests.values() if r.prompt_ids == [6] * 30]
        assert all(r.cancelled for r in cancelled)
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_many_threads_submitting_at_once_each_get_their_own_requests_run_to_the_end(tmp_path):
    """Eight threads hand in five prompts each, as fast as they can, while the engine steps:
    every submission is answered with its own requests, every request ends with its three
    tokens, and every block comes back."""
    import threading

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal

    service = start_service(tmp_path, num_blocks=256, max_queue=64)
    try:
        finished: dict[str, int] = {}
        lock = threading.Lock()
        answers: dict[int, list] = {}

        def sink(event):
            if event.finish_reason is not None:
                with lock:
                    finished[event.request_id] = event.index

        def submitter(worker):
            prompts = [[worker + 1] * (10 + i) for i in range(5)]
            answers[worker] = [service.submit([p], SamplingParams(max_tokens=3, ignore_eos=True),
                                              Principal(f"t{worker}", "admin", "test"), sink)[0] for p in prompts]

        threads = [threading.Thread(target=submitter, args=(w,)) for w in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        deadline = time.monotonic() + 60
        while len(finished) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(answers) == list(range(8))
        for worker, requests in answers.items():
            assert [r.prompt_ids for r in requests] == [[worker + 1] * (10 + i) for i in range(5)]
            assert all(r.tenant == f"t{worker}" for r in requests)
        requests = [r for rs in answers.values() for r in rs]
        assert len({r.request_id for r in requests}) == 40 and set(finished) == {r.request_id for r in requests}
        assert all(len(r.sequences[0].output_ids) == 3 for r in requests)
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_a_sleeping_engine_wakes_for_a_submission_and_a_stopped_one_refuses_it(tmp_path):
    """The idle engine thread sleeps (here up to a minute between watchdog pings) and a
    submission wakes it; a blocking submit on the engine thread itself is refused (it would
    wait for ever); once the engine thread has stopped, a submission fails with 503."""
    import threading

    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal, ServiceError

    service = start_service(tmp_path)
    try:
        service.idle_wait = 60.0
        with service.lock:
            service.lock.notify_all()  # let it go back to sleep with the long wait
        time.sleep(0.2)
        done = threading.Event()
        handed = service.submit_nowait([[8] * 20], SamplingParams(max_tokens=2, ignore_eos=True),
                                       Principal("default", "admin", "t"),
                                       lambda e: done.set() if e.finish_reason else None)
        refused_on_engine: list[str] = []

        def submit_from_the_engine_thread(request):
            try:
                service.submit([[7] * 20], SamplingParams(max_tokens=1), Principal("default", "admin", "t"),
                               lambda e: None)
            except RuntimeError as exc:
                refused_on_engine.append(str(exc))

        service.on_finished(submit_from_the_engine_thread)  # observers run on the engine thread
        handed.result(timeout=30)  # woken, not after 60 s
        assert done.wait(30)
        deadline = time.monotonic() + 30
        while not refused_on_engine and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused_on_engine == ["submit() on the engine thread would wait for itself; use submit_nowait()"]
        service._stop.set()
        with service.lock:
            service.lock.notify_all()
        service._thread.join(30)
        future = service.submit_nowait([[9] * 20], SamplingParams(max_tokens=2), Principal("default", "admin", "t"),
                                       lambda e: None)
        with pytest.raises(ServiceError, match="shutting down") as refused:
            future.result(timeout=5)
        assert refused.value.status == 503
    finally:
        service.shutdown(1)


def test_a_submitted_prompt_is_hashed_in_the_submitting_thread_not_in_a_step(tmp_path, monkeypatch):
    """Block keys of a prompt are computed before the engine's lock is taken, so a long prompt
    never holds up the decodes of a step while it is hashed."""
    import threading

    from kvctl.daemon.engine.engine import Engine
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal

    hashing_threads: list[str] = []
    original = Engine.prefix_keys

    def spy(self, tenant, token_ids, adapter="", params=None):
        hashing_threads.append(threading.current_thread().name)
        return original(self, tenant, token_ids, adapter, params)

    monkeypatch.setattr(Engine, "prefix_keys", spy)
    service = start_service(tmp_path)
    try:
        done = threading.Event()
        [request] = service.submit([[7] * 300], SamplingParams(max_tokens=2, ignore_eos=True),
                                   Principal("default", "admin", "test"),
                                   lambda event: done.set() if event.finish_reason else None)
        assert done.wait(60) and len(request.sequences[0].output_ids) == 2
        assert hashing_threads == [threading.current_thread().name]  # once, here; never on kvd-engine
    finally:
        service.shutdown(1)


@pytest.mark.parametrize("front", ["unix", "tcp"])
def test_a_completion_reaches_the_engine_without_a_worker_thread_hop(daemon, monkeypatch, front):
    """Authentication, tenant and body checks of a completion run on the event loop: a worker
    thread (FastAPI's home for plain functions) would first have to win the GIL from the engine
    thread, which held a completion back 5-7 ms on a busy host."""
    import anyio.to_thread

    _, unix, tcp = daemon
    hops: list[str] = []
    original = anyio.to_thread.run_sync

    async def spy(func, *args, **kwargs):
        hops.append(getattr(func, "__name__", repr(func)))
        return await original(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)
    app, headers = (unix, {}) if front == "unix" else (tcp, {"Authorization": f"Bearer {USER_TOKEN}"})
    response = call(app, "POST", "/v1/completions", headers=headers,
                    json={"prompt": SYSTEM + "hop", "max_tokens": 3, "seed": 1, "stream": True})
    assert response.status_code == 200 and sse_events(response)[-1] == "[DONE]"
    assert hops == []
    refused = call(tcp, "GET", "/admin/config", headers={"Authorization": f"Bearer {USER_TOKEN}"})
    assert refused.status_code == 403 and hops == []  # refused before the endpoint's own thread


def test_a_drained_kvd_takes_no_new_completion_says_so_everywhere_and_resumes(daemon):
    """kvctl drain: a completion is refused before it starts (503, `draining`, Retry-After: a
    router passes it on), /readyz is 503 with why, route-facts and status say so (every router in
    front of it leaves it out), the drain and the resume are audited; resumed, it serves again."""
    from rich.console import Console

    from kvctl.status_view import render_status

    from .promql_eval import samples

    service, unix, tcp = daemon

    def refused_for_draining() -> float:  # kvd_requests_refused_total{reason="draining"}
        return samples(call(unix, "GET", "/metrics").text)["kvd_requests_refused_total"][frozenset({
            ("reason", "draining")})]

    counted = refused_for_draining()
    drained = call(unix, "POST", "/admin/drain", json={})
    assert drained.status_code == 200 and drained.json() == {"draining": True, "running": 0, "waiting": 0}
    try:
        refused = complete(unix, prompt="Are you taking requests?")
        assert refused_for_draining() == counted + 1
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"] == {"message": "kvd is draining: it takes no new completion until `kvctl "
                                                      "resume`", "type": "service_unavailable", "param": None,
                                           "code": "draining"}
        ready = call(unix, "GET", "/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == "draining (kvctl resume takes completions again)"
        assert call(unix, "POST", "/admin/route-facts", json={"tokens": []}).json()["draining"] is True
        status = call(unix, "GET", "/admin/status").json()
        console = Console(record=True, width=100)
        render_status(status, console)
        [row] = [line.split(None, 1) for line in console.export_text().splitlines() if line.startswith("draining")]
        assert row[1].strip() == "no new completion is taken (kvctl resume takes them again)"
        bad = call(unix, "POST", "/admin/drain", json={"drain": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "drain"
        user = call(tcp, "POST", "/admin/drain", json={"drain": False}, headers={"Authorization": f"Bearer {USER_TOKEN}"})
        assert user.status_code == 403 and service.draining
    finally:
        resumed = call(unix, "POST", "/admin/drain", json={"drain": False})
    assert resumed.json() == {"draining": False, "running": 0, "waiting": 0}
    assert complete(unix, prompt="Are you taking requests?").status_code == 200
    assert call(unix, "GET", "/readyz").json() == {"ready": True}
    actions = [(a["action"], a["target"]) for a in service.store.audit_since(action="drain")
               + service.store.audit_since(action="resume")]
    assert actions[-2:] == [("drain", "completions"), ("resume", "completions")]


def test_logprobs_come_in_openai_s_completion_shape_streamed_or_whole(daemon):
    service, unix, _ = daemon
    text_of = service.loaded.tokenizer.token_text
    whole = complete(unix, prompt=SYSTEM + "logprobs?", temperature=0.0, logprobs=2).json()["choices"][0]
    ids, logprobs = whole["token_ids"], whole["logprobs"]
    assert logprobs["tokens"] == [text_of(t) for t in ids]
    assert logprobs["text_offset"] == [sum(len(text_of(t)) for t in ids[:i]) for i in range(len(ids))]
    for token, chosen, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert chosen <= 0 and top[token] == chosen and len(top) <= 3
        assert chosen == max(top.values())  # greedy drew the most likely token
    streamed = sse_events(complete(unix, prompt=SYSTEM + "logprobs?", temperature=0.0, logprobs=2, stream=True))
    parts = [e["choices"][0]["logprobs"] for e in streamed[:-1]]
    assert sum((p["tokens"] for p in parts), []) == logprobs["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == logprobs["text_offset"]  # offsets go on across chunks
    assert sum((p["token_logprobs"] for p in parts), []) == pytest.approx(logprobs["token_logprobs"], abs=1e-5)
    plain = complete(unix, prompt=SYSTEM + "logprobs?", temperature=0.0).json()["choices"][0]
    assert plain["logprobs"] is None and plain["token_ids"] == ids


def test_return_tokens_as_token_ids_keeps_apart_tokens_that_decode_alike(daemon):
    """vLLM's `return_tokens_as_token_ids`: the demo's bytes above 127 all decode to U+FFFD, so as
    text the 20 most likely tokens shared keys and lost their logprobs."""
    service, unix, _ = daemon
    text_of = service.loaded.tokenizer.token_text
    asked = dict(prompt=SYSTEM + "which bytes?", max_tokens=6, temperature=1.0, seed=11, logprobs=20)
    as_text = complete(unix, **asked).json()["choices"][0]
    as_ids = complete(unix, **asked, return_tokens_as_token_ids=True).json()["choices"][0]
    ids = as_ids["token_ids"]
    assert ids == as_text["token_ids"] and as_text["logprobs"]["tokens"] == [text_of(t) for t in ids]
    assert any(len(top) < 20 for top in as_text["logprobs"]["top_logprobs"])  # keys that collided
    logprobs = as_ids["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert logprobs["text_offset"] == as_text["logprobs"]["text_offset"]  # offsets in the text, as before
    for token, chosen, top in zip(ids, logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) in (20, 21) and all(key.startswith("token_id:") for key in top)
        assert top[f"token_id:{token}"] == chosen and max(top.values()) >= chosen
    streamed = sse_events(complete(unix, **asked, return_tokens_as_token_ids=True, stream=True))
    assert sum((e["choices"][0]["logprobs"]["tokens"] for e in streamed[:-1]), []) == logprobs["tokens"]
    echoed = complete(unix, prompt="ab", max_tokens=1, temperature=0.0, echo=True, logprobs=1,
                      return_tokens_as_token_ids=True).json()["choices"][0]["logprobs"]
    assert echoed["tokens"][:3] == [f"token_id:{t}" for t in service.tokenize("ab")]
    assert echoed["text_offset"][:3] == [0, len(text_of(service.tokenize("ab")[0])),
                                          len(text_of(service.tokenize("ab")[0])) + 1]


def test_return_token_ids_names_each_prompt_s_ids_on_its_choices(daemon):
    """vLLM's `return_token_ids` on completions: each choice names its prompt's ids (streamed, in
    its first chunk alone); n samples of one prompt name the same ids, two prompts their own."""
    service, unix, _ = daemon
    first, second = service.tokenize(SYSTEM + "ids?"), [5, 6, 7]
    answer = complete(unix, prompt=[first, second], n=2, temperature=1.0, return_token_ids=True).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in answer["choices"]] == [first, first, second, second]
    assert "prompt_token_ids" not in answer
    echoed = complete(unix, prompt="ab", max_tokens=0, echo=True, logprobs=0, return_token_ids=True).json()
    [scored] = echoed["choices"]
    assert scored["prompt_token_ids"] == service.tokenize("ab") and scored["token_ids"] == []
    chunks = sse_events(complete(unix, prompt=SYSTEM + "ids?", stream=True, return_token_ids=True))[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == first
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    plain = complete(unix, prompt=SYSTEM + "ids?").json()["choices"][0]
    assert "prompt_token_ids" not in plain and plain["token_ids"] == sum((c["choices"][0]["token_ids"] for c in chunks),
                                                                         [])


def test_allowed_token_ids_keep_the_draw_to_them(daemon):
    """vLLM's `allowed_token_ids`: no other token is drawn, EOS included, whatever the sampling."""
    service, unix, _ = daemon
    for body in ({"temperature": 1.0, "seed": 5}, {"temperature": 0.0}, {"temperature": 1.0, "logit_bias": {"66": 50}}):
        [choice] = complete(unix, prompt=SYSTEM + "letters?", max_tokens=12, allowed_token_ids=[65, 66, 67],
                            **body).json()["choices"]
        assert set(choice["token_ids"]) <= {65, 66, 67} and len(choice["token_ids"]) == 12
        assert choice["finish_reason"] == "length"  # EOS is not among them
    assert choice["token_ids"] == [66] * 12  # the bias counts among the allowed
    [chat] = call(unix, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ABC?"}], "max_tokens": 5, "temperature": 1.0, "seed": 2,
        "allowed_token_ids": [65, 66, 67]}).json()["choices"]
    assert set(chat["token_ids"]) <= {65, 66, 67}
    assert chat["message"]["content"] == service.loaded.tokenizer.decode(chat["token_ids"])
    refused = complete(unix, prompt="x", allowed_token_ids=[])
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "allowed_token_ids: must name one token or more, got []")


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(daemon):
    _, unix, _ = daemon
    plain = complete(unix, prompt=SYSTEM + "stop here?", max_tokens=30, temperature=0.0).json()["choices"][0]["text"]
    stop = plain[6:9]
    cut = complete(unix, prompt=SYSTEM + "stop here?", max_tokens=30, temperature=0.0, stop=[stop, "\uffff"]).json()
    kept = complete(unix, prompt=SYSTEM + "stop here?", max_tokens=30, temperature=0.0, stop=[stop, "\uffff"],
                    include_stop_str_in_output=True).json()
    assert cut["choices"][0]["text"] == plain[:plain.index(stop)]
    assert kept["choices"][0]["text"] == plain[:plain.index(stop)] + stop
    assert kept["choices"][0]["finish_reason"] == "stop"
    streamed = sse_events(complete(unix, prompt=SYSTEM + "stop here?", max_tokens=30, temperature=0.0, stop=[stop],
                                   include_stop_str_in_output=True, stream=True))[:-1]
    assert "".join(e["choices"][0]["text"] for e in streamed) == kept["choices"][0]["text"]


@pytest.mark.parametrize("field, value, hint", [
    ("skip_special_tokens", False, "kvd's replies leave special tokens out of their text; each choice's token_ids "
                                   "has them"),
    ("truncate_prompt_tokens", 100, "kvd never cuts a prompt short on its own (a cached prefix would be lost to the "
                                    "cut); send it shorter, or send a conversation to /v1/responses with truncation "
                                    "auto"),
    ("bad_words", ["cache"], "for words of one token each, logit_bias -100 bans them; allowed_token_ids keeps to a "
                             "set"),
    ("add_special_tokens", False, "a completion's prompt is tokenized with the tokenizer's special tokens (BOS), a "
                                  "chat's as its template writes them; send token ids for any other"),
])
def test_vllm_fields_kvd_does_not_do_are_refused_with_what_to_do_instead(daemon, field, value, hint):
    _, unix, _ = daemon
    refused = complete(unix, prompt="x", **{field: value})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        f"{field}: not supported by kvd, got {value!r}; {hint}")
    inert = {"skip_special_tokens": True, "truncate_prompt_tokens": None, "bad_words": [], "add_special_tokens": True}
    assert complete(unix, prompt="x", **{field: inert[field]}).status_code == 200


def test_penalties_bias_and_min_tokens_reach_the_sampler(daemon):
    service, unix, _ = daemon
    eos = service.loaded.tokenizer.eos_token_id
    forced = complete(unix, prompt="x", max_tokens=8, temperature=0.0, min_tokens=3,
                      logit_bias={str(eos): 100}).json()["choices"][0]
    assert len(forced["token_ids"]) == 4 and forced["token_ids"][-1] == eos and forced["finish_reason"] == "stop"
    plain = complete(unix, prompt="the cache the cache", max_tokens=30, temperature=0.0).json()["choices"][0]
    penalised = complete(unix, prompt="the cache the cache", max_tokens=30, temperature=0.0, frequency_penalty=2,
                         presence_penalty=2, repetition_penalty=1.5, min_p=0.1).json()["choices"][0]
    assert penalised["token_ids"] != plain["token_ids"]


@pytest.mark.parametrize("body, param, message", [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias: keys must be token ids, got 'abc'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5]: must be a number from -100 to 100, got 101.0"),
    ({"logit_bias": {"900": 1}}, "logit_bias", r"logit_bias: keys must be token ids in [0, 258), got 900"),
    ({"logprobs": 21}, "logprobs", "logprobs: must be an integer from 0 to 20, got 21"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens", "min_tokens: must be an integer from 0 to max_tokens (2), got 3"),
    ({"repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty: must be a number in (0, 10]; 1 changes nothing, got 0.0"),
    # JSON's true is not a number (pydantic's lax mode read it as 1, so logprobs: true meant 1 alternative)
    ({"top_k": -5}, "top_k", "top_k: must be -1 or 0 (no cut) or a whole number >= 1, got -5"),
    ({"logprobs": True}, "logprobs", "logprobs: expected a number, not a boolean (got True)"),
    ({"max_tokens": True}, "max_tokens", "max_tokens: expected a number, not a boolean (got True)"),
    ({"temperature": False}, "temperature", "temperature: expected a number, not a boolean (got False)"),
    ({"logit_bias": {"5": True}}, "logit_bias", "logit_bias: expected a number, not a boolean (got True)"),
    ({"stop_token_ids": [3, True]}, "stop_token_ids", "stop_token_ids: expected a number, not a boolean (got True)"),
])
def test_a_bad_sampling_control_is_a_400_naming_it(daemon, body, param, message):
    _, unix, _ = daemon
    response = complete(unix, prompt="x", **body)
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (param, message)


def test_top_k_minus_one_is_vllm_s_no_cut_as_zero_is(daemon):
    _, unix, _ = daemon
    drawn = [complete(unix, prompt="the cache", max_tokens=8, temperature=1.0, seed=7, top_k=k).json()
             for k in (-1, 0)]
    assert drawn[0]["choices"][0]["token_ids"] == drawn[1]["choices"][0]["token_ids"]


@pytest.mark.parametrize("path, body, message", [
    ("/admin/pins", {"tokens": [1, 2, True]}, "tokens: expected a number, not a boolean (got True)"),
    ("/admin/explain", {"tokens": [False, 2]}, "tokens: expected a number, not a boolean (got False)"),
])
def test_an_admin_call_with_a_boolean_for_a_token_id_is_a_400_naming_it(daemon, path, body, message):
    _, unix, _ = daemon
    response = call(unix, "POST", path, json=body)
    assert response.status_code == 400 and response.json()["error"]["message"] == message


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(daemon):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, one output token."""
    service, unix, _ = daemon
    text_of = service.loaded.tokenizer.token_text
    prompt = SYSTEM + "Q: is the prompt scored?"
    ids = service.tokenize(prompt)
    assert complete(unix, prompt=prompt, max_tokens=1).status_code == 200  # now its prefix is cached
    body = complete(unix, prompt=prompt, max_tokens=1, temperature=0.0, echo=True, logprobs=1,
                    prompt_logprobs=1).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # every position computed
    choice = body["choices"][0]
    out = choice["token_ids"]
    assert len(out) == 1 and choice["text"] == prompt + service.loaded.tokenizer.decode(out)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [text_of(t) for t in ids + out]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [sum(len(text_of(t)) for t in (ids + out)[:i]) for i in range(len(ids) + 1)]
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for token, lp, top, ranked in zip(ids[1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], vllm[1:]):
        assert ranked[str(token)]["logprob"] == lp and top[text_of(token)] == lp
        assert ranked[str(token)]["rank"] >= 1 and ranked[str(token)]["decoded_token"] == text_of(token)
        assert [r["rank"] for t, r in ranked.items() if t != str(token)] in ([], [1])
    cold = complete(unix, prompt=prompt + " ", max_tokens=1, temperature=0.0, echo=True, logprobs=1).json()
    assert cold["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] == \
        pytest.approx(logprobs["token_logprobs"][1:len(ids)], abs=1e-4)  # as on a prompt never seen


def test_echo_streams_the_prompt_in_each_choice_s_first_chunk(daemon):
    service, unix, _ = daemon
    whole = complete(unix, prompt=["first prompt", "second"], temperature=0.0, echo=True, logprobs=0).json()
    streamed = sse_events(complete(unix, prompt=["first prompt", "second"], temperature=0.0, echo=True, logprobs=0,
                                   stream=True))
    for choice in whole["choices"]:
        chunks = [e["choices"][0] for e in streamed[:-1] if e["choices"][0]["index"] == choice["index"]]
        assert chunks[0]["text"].startswith(["first prompt", "second"][choice["index"]])
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert sum((c["logprobs"]["tokens"] for c in chunks), []) == choice["logprobs"]["tokens"]
        assert sum((c["logprobs"]["text_offset"] for c in chunks), []) == choice["logprobs"]["text_offset"]
    echoed = complete(unix, prompt=service.tokenize("ids echo back as text"), echo=True).json()["choices"][0]
    assert echoed["text"].startswith("ids echo back as text") and echoed["logprobs"] is None


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(daemon):
    """lm-evaluation-harness's loglikelihood request as it sends it (echo, max_tokens 0, logprobs):
    the answer is the prompt, its logprobs and nothing after, as the same request with one output
    token answers them; streamed too. Without echo, max_tokens 0 is still refused, saying when it is
    allowed."""
    service, unix, _ = daemon
    text_of = service.loaded.tokenizer.token_text
    prompt = SYSTEM + "Q: which answer is likelier?"
    ids = service.tokenize(prompt)
    one = complete(unix, prompt=prompt, max_tokens=1, temperature=0.0, echo=True, logprobs=2).json()["choices"][0]
    answer = complete(unix, prompt=prompt, max_tokens=0, temperature=0.0, echo=True, logprobs=2)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    [choice] = body["choices"]
    assert choice["text"] == prompt and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [text_of(t) for t in ids]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"][:len(ids)],
                                                                 abs=1e-4, nan_ok=True)
    assert choice["logprobs"]["top_logprobs"][1:] == [
        pytest.approx(top, abs=1e-4) for top in one["logprobs"]["top_logprobs"][1:len(ids)]]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    streamed = sse_events(complete(unix, prompt=prompt, max_tokens=0, temperature=0.0, echo=True, logprobs=2,
                                   stream=True, stream_options={"include_usage": True}))
    chunks = [e["choices"][0] for e in streamed[:-1] if e["choices"]]
    assert "".join(c["text"] for c in chunks) == prompt and all(c["token_ids"] == [] for c in chunks)
    assert sum((c["logprobs"]["tokens"] for c in chunks), []) == choice["logprobs"]["tokens"]
    assert chunks[-1]["finish_reason"] == "length" and streamed[-2]["usage"]["completion_tokens"] == 0
    refused = complete(unix, prompt=prompt, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "max_tokens: must be an integer >= 1, got 0 (0 only with echo: the prompt is scored and nothing generated)")


def test_a_kvd_that_could_not_load_loads_again_on_a_reload(tmp_path):
    """A quantised cache with no calibration: kvd stays up, unready, and says why. Fixing the config
    and reloading loads again, without a restart; a setting the process is bound to (its socket)
    waits for a restart. A reload whose config still fails names the error again."""
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.metrics import Metrics
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    state = tmp_path / "state"
    config = tmp_path / "kvd.yaml"
    config.write_text("cache_dtype: fp8_e4m3\nnum_blocks: 64\n")
    flags = {"state_dir": str(state), "socket": str(tmp_path / "kvd.sock")}
    service = EngineService(resolve(flags, {}, config), Store(tmp_path / "kvd.sqlite3"))
    service.metrics = Metrics(service)
    service.config_source = lambda: resolve(flags, {}, config)
    from kvctl.daemon.server.app import create_app

    unix = create_app(service, service.metrics, front="unix")
    service.start()
    try:
        deadline = time.monotonic() + 60
        while service.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        unready = call(unix, "GET", "/readyz")
        assert unready.status_code == 503 and "fp8_e4m3 has no applied calibration" in unready.json()["reason"]
        config.write_text("cache_dtype: fp8_e4m3\nnum_blocks: 64\nremote_url: redis://ops:hunter2@127.0.0.1:1/0\n")
        result = service.reload_from_source("ops")  # nothing fixed yet: it tries and fails again
        assert "no applied calibration" in result["loading_again"]
        assert result["changed"] == {"remote_url": "redis://ops:***@127.0.0.1:1/0"}  # never the password
        assert "hunter2" not in str(service.store.audit_since(0, action="reload"))
        while service.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "fp8_e4m3 has no applied calibration" in service.load_error
        config.write_text("cache_dtype: auto\nnum_blocks: 64\nmax_queue: 9\nresponses_store_bytes: 1KiB\n")
        flags["socket"] = str(tmp_path / "elsewhere.sock")
        result = service.reload_from_source("ops")
        assert result["changed"] == {"cache_dtype": "auto", "max_queue": 9, "remote_url": None,
                                     "responses_store_bytes": 1024}
        assert result["previous"] == {"cache_dtype": "fp8_e4m3", "max_queue": 256,
                                      "remote_url": "redis://ops:***@127.0.0.1:1/0", "responses_store_bytes": 2**26}
        assert service.responses.budget == 1024  # (the store's own budget, not the config's alone)
        assert result["needs_restart"] == ["socket"] and "no applied calibration" in result["loading_again"]
        assert service.ready.wait(60), service.load_error
        assert call(unix, "GET", "/readyz").json() == {"ready": True}
        assert service.config.socket == str(tmp_path / "kvd.sock") and service.engine.settings.max_queue == 9
        assert complete(unix, prompt="loaded at last", max_tokens=2).status_code == 200
        audit = service.store.audit_since(0, action="reload")
        assert [a["detail"]["changed"] for a in audit][:2] == [
            {"cache_dtype": "auto", "max_queue": 9, "remote_url": None, "responses_store_bytes": 1024},
            {"remote_url": "redis://ops:***@127.0.0.1:1/0"}]
    finally:
        service.shutdown(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_device_cuda_without_cuda_says_so_naming_the_setting(tmp_path):
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    service = EngineService(resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "s"), "device": "cuda",
                                     "num_blocks": 16}, {}), Store(tmp_path / "kvd.sqlite3"))
    with pytest.raises(ValueError) as refused:
        service.load()
    assert str(refused.value).startswith(f"device: cuda, but torch {torch.__version__} finds no CUDA device (")
    assert str(refused.value).endswith("); use device auto or cpu")


def test_status_and_metrics_say_what_the_output_reservation_left_unwritten(tmp_path):
    """A 32-token prompt asking 40 tokens reserves 5 blocks (fraction:1); stopped at its first token
    it wrote its prompt alone, 2 blocks: 3 were reserved and never written."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path)
    try:
        app = create_app(service, service.metrics, front="unix")
        vocab = service.engine.model.config.vocab_size
        answer = call(app, "POST", "/v1/completions", json={
            "prompt": list(range(40, 72)), "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": list(range(vocab))})
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "stop"
        assert call(app, "GET", "/admin/status").json()["reservation"] == {
            "policy": "fraction:1", "finished_blocks": 5, "unused_blocks": 3}
        scraped = call(app, "GET", "/metrics").text.splitlines()
        assert "kvd_finished_blocks_total 5.0" in scraped and "kvd_reserved_unused_blocks_total 3.0" in scraped
    finally:
        service.shutdown(deadline=2)

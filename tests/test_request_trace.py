"""kvd's trace of the requests it served (`GET /admin/trace`, `kvctl trace save`): the operator's
own traffic in the Mooncake format, for `kvctl bench replay`; never tokens or text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvctl.daemon.replay.trace import read_trace
from kvctl.daemon.server.request_trace import RequestTrace, chained_block_ids
from kvctl.tables import seconds

from .test_cli import cli

KEY = b"k" * 32


def finished(arrival: float, prompt: list[int], outputs=(4,), tenant: str = "default", times=None, cached=0,
             routed=None, adapter="", max_tokens=None):
    """What EngineService.on_finished hands its observers, as far as the trace reads it. `times`:
    (admitted, token times) on the engine's clock; None: turned away before its first token.
    `routed`: kvd router's (id, try) of the request; `max_tokens`: what it asked (None: as though unsaid)."""
    admitted, tokens = times if times is not None else (None, [])
    metrics = SimpleNamespace(arrival=arrival, admitted=admitted, first_token=tokens[0] if tokens else None,
                              token_times=list(tokens), cached_tokens=cached)
    extra = {} if routed is None else {"router_attempt": routed}
    return SimpleNamespace(metrics=metrics, prompt_ids=prompt, tenant=tenant,
                           params=SimpleNamespace(extra=extra, max_tokens=max_tokens),
                           adapter=adapter,
                           sequences=[SimpleNamespace(output_ids=[7] * n) for n in outputs])


def test_block_ids_are_chained_over_512_token_blocks_and_keyed_by_tenant_and_secret():
    system, other = list(range(512)), list(range(1, 513))
    a = chained_block_ids(KEY, "default", system + [5] * 100)
    b = chained_block_ids(KEY, "default", system + [6] * 100)
    assert len(a) == 2 and len(chained_block_ids(KEY, "default", system)) == 1  # the last id covers the rest
    assert a[0] == b[0] and a[1] != b[1]  # one system prompt, two questions
    assert chained_block_ids(KEY, "default", other + [5] * 100)[1] != a[1]  # the same tail after another context
    assert not set(chained_block_ids(KEY, "acme", system + [5] * 100)) & set(a)  # tenants never share
    assert not set(chained_block_ids(b"x" * 32, "default", system + [5] * 100)) & set(a)  # another kvd's key


def test_a_saved_trace_is_in_arrival_order_with_ids_numbered_as_they_first_appear():
    trace = RequestTrace(capacity=3, key=KEY)
    system = list(range(600))
    for arrival, prompt, outputs, tenant in [(10.0, system + [1], (3,), "default"),
                                             (10.5, [9] * 20, (0,), "default"),  # turned away: no output
                                             (10.25, system + [2], (5, 8), "acme"),  # n=2: the longer one
                                             (11.0, system + [1], (2,), "default")]:
        trace.observe(finished(arrival, prompt, outputs, tenant))
    assert trace.observed == 4
    lines = [r.to_object() for r in trace.requests(default_tenant="default")]
    assert lines == [  # the first request fell out of the three kept; finished out of order, sorted
        {"timestamp": 0.0, "input_length": 601, "output_length": 8, "hash_ids": [0, 1], "tenant": "acme"},
        {"timestamp": 250.0, "input_length": 20, "output_length": 0, "hash_ids": [2]},
        {"timestamp": 750.0, "input_length": 601, "output_length": 2, "hash_ids": [3, 4]}]
    assert [r.to_object()["hash_ids"] for r in trace.requests(last=1)] == [[0, 1]]  # numbered within the save
    assert trace.report(last=2)["requests"][0]["tenant"] == "default"  # no default named: every tenant shown


def test_a_smaller_trace_keeps_the_newest_and_none_hashes_nothing():
    trace = RequestTrace(capacity=3, key=KEY)
    for arrival in (1.0, 2.0, 3.0):
        trace.observe(finished(arrival, [int(arrival)] * 10))
    trace.resize(2)
    assert [r.input_length for r in trace.requests()] == [10, 10] and trace.requests()[0].timestamp_ms == 0
    assert trace.requests()[1].timestamp_ms == 1000.0  # arrivals 2.0 and 3.0 kept
    trace.resize(0)
    trace.observe(finished(4.0, [1] * 10))
    assert trace.requests() == [] and trace.observed == 3


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, start_service, token_table

    state = tmp_path_factory.mktemp("kvd")
    service = start_service(state)
    unix, _ = apps(service, token_table(state))
    yield service, unix
    service.shutdown(1)


def test_kvd_traces_what_it_served_without_a_token_and_kvctl_saves_it_for_replay(daemon, capsys, tmp_path,
                                                                                 monkeypatch):
    from kvctl import client

    from .daemon_fixtures import call

    service, unix = daemon
    system = [(i * 7) % 250 for i in range(700)]
    bodies = [{"prompt": system + [1, 2, 3], "max_tokens": 3}, {"prompt": system + [4, 5], "max_tokens": 2},
              {"prompt": [3] * 40, "max_tokens": 1}]
    for body in bodies:
        assert call(unix, "POST", "/v1/completions", json={**body, "temperature": 0.0}).status_code == 200
    assert call(unix, "GET", "/admin/trace", params={"last": 0}).status_code == 400
    never_fits = call(unix, "POST", "/v1/completions", json={"prompt": [3] * 900, "max_tokens": 300})
    assert never_fits.status_code != 200  # turned away at admission: demand all the same
    answer = call(unix, "GET", "/admin/trace", params={"last": 4}).json()
    assert answer["requests"][-1] == {"timestamp": answer["requests"][-1]["timestamp"], "input_length": 900,
                                      "output_length": 0, "hash_ids": [4, 5], "max_tokens": 300}
    answer = call(unix, "GET", "/admin/trace", params={"last": 4}).json()
    answer["requests"] = answer["requests"][:3]
    assert (answer["capacity"], answer["block_tokens"]) == (10_000, 512) and answer["observed"] >= 3
    assert [(r["input_length"], r["output_length"]) for r in answer["requests"]] == [(703, 3), (702, 2), (40, 1)]
    assert [r["hash_ids"] for r in answer["requests"]] == [[0, 1], [0, 2], [3]]
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids", "served", "max_tokens"}
               for r in answer["requests"])
    assert [r["max_tokens"] for r in answer["requests"]] == [3, 2, 1]  # what each asked: kvd reserved for it
    served = [r["served"] for r in answer["requests"]]  # how kvd served each: the cache gave the second 688
    assert [s["cached_tokens"] for s in served] == [0, 688, 0]
    assert all(s[k] >= 0 for s in served for k in ("queued_ms", "prefill_ms", "decode_ms"))
    assert served[0]["decode_ms"] > 0 and served[2]["decode_ms"] == 0  # three tokens; one

    monkeypatch.setattr(client.Client, "get",
                        lambda self, path, **params: call(unix, "GET", path, params={k: v for k, v in params.items()
                                                                                   if v is not None}).json())
    out = tmp_path / "today.jsonl"
    status, printed, _ = cli(capsys, "trace", "save", str(out), "--last", "4")
    span = seconds(read_trace(out)[-1].timestamp_ms / 1000)  # "12.3 ms", "1.50 s": where it took seconds
    assert status == 0 and printed.startswith(f"wrote 4 requests over {span} to ") and "1 tenant)" in printed
    saved = read_trace(out)
    assert [(r.input_length, r.output_length, r.hash_ids, r.tenant, r.max_tokens) for r in saved] == [
        (703, 3, (0, 1), None, 3), (702, 2, (0, 2), None, 2), (40, 1, (3,), None, 1), (900, 0, (4, 5), None, 300)]
    assert saved[0].timestamp_ms == 0 and saved[0].timestamp_ms <= saved[1].timestamp_ms <= saved[2].timestamp_ms
    status, printed, _ = cli(capsys, "trace", "save", str(out), "--last", "2", "--json")
    figures = json.loads(printed)
    assert status == 0 and figures["requests"] == 2 and figures["capacity"] == 10_000
    assert figures["observed"] >= 4 and (figures["input_tokens"], figures["output_tokens"]) == (940, 1)
    assert figures["tenants"] == ["default"] and len(read_trace(out)) == 2
    assert cli(capsys, "trace", "save", str(out), "--last", "4")[0] == 0  # the four again, for the replay
    status, printed, _ = cli(capsys, "bench", "replay", str(out), "--block-sizes", "16", "--json")
    assert status == 0 and json.loads(printed)  # the saved file is a trace the replay reads

    (tmp_path / "notes.txt").write_text("not a trace\n")
    status, _, err = cli(capsys, "trace", "save", str(tmp_path / "notes.txt"))
    assert status == 2 and "out: " in err and "is not a trace" in err
    assert (tmp_path / "notes.txt").read_text() == "not a trace\n"
    status, _, err = cli(capsys, "trace", "save", str(out), "--last", "0")
    assert status == 2 and err.strip() == "error: last: must be >= 1, got 0"


def test_kvctl_trace_save_says_when_kvd_has_nothing_to_save(capsys, tmp_path, monkeypatch):
    from kvctl import client

    monkeypatch.setattr(client.Client, "get", lambda self, path, **params: {
        "capacity": 10_000, "observed": 0, "block_tokens": 512, "requests": []})
    status, _, err = cli(capsys, "trace", "save", str(tmp_path / "t.jsonl"))
    assert status == 2 and "kvd has finished no request since it started" in err
    assert not (tmp_path / "t.jsonl").exists()


def test_trace_requests_is_a_setting_a_reload_changes_live(daemon):
    from dataclasses import replace

    service, unix = daemon
    assert service.trace.capacity == 10_000 == service.config.trace_requests
    before = service.config
    try:
        answer = service.reload(replace(service.config, trace_requests=1), actor="test")
        assert answer["changed"] == {"trace_requests": 1} and service.trace.capacity == 1
        assert len(service.trace.requests()) == 1
    finally:
        service.reload(before, actor="test")
    assert service.trace.capacity == 10_000


@pytest.mark.parametrize("value, message", [("-1", "must be >= 0"), ("lots", "lots")])
def test_kvd_refuses_a_bad_trace_requests_by_name(value, message):
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as refused:
        resolve({"trace_requests": value}, env={})
    assert "trace_requests" in str(refused.value) and message in str(refused.value)


def test_a_trace_key_file_is_read_as_the_token_file_is_and_refused_by_name(tmp_path):
    from kvctl.daemon.server.request_trace import key_id, load_trace_key

    path = tmp_path / "trace.key"
    with pytest.raises(ValueError) as refused:
        load_trace_key(path)
    assert str(refused.value) == f"trace_key_file: cannot read {str(path)!r} (No such file or directory)"
    path.write_bytes(b"s" * 31)
    path.chmod(0o640)  # the service's group may read it
    with pytest.raises(ValueError) as refused:
        load_trace_key(path)
    assert str(refused.value) == (f"trace_key_file: {str(path)!r} holds 31 bytes; a key needs at least 32 "
                                  f"(e.g. head -c 32 /dev/urandom > {path})")
    path.write_bytes(b"s" * 32)
    path.chmod(0o644)
    with pytest.raises(ValueError) as refused:
        load_trace_key(path)
    assert str(refused.value) == (f"trace_key_file: {str(path)!r} is open to every user on the machine "
                                  f"(mode 0644); restrict it, e.g. chmod 600 {path}")
    path.chmod(0o600)
    assert load_trace_key(path) == b"s" * 32
    assert key_id(b"s" * 32) == key_id(b"s" * 32) != key_id(b"t" * 32) and len(key_id(KEY)) == 16


def test_replicas_given_one_key_trace_one_prompt_alike_and_say_so():
    system = list(range(600))
    shared = [RequestTrace(capacity=4, key=KEY, shared=True) for _ in range(2)]
    own = [RequestTrace(capacity=4), RequestTrace(capacity=4)]
    for trace in shared + own:
        trace.observe(finished(5.0, system + [1], (3,), times=(5.25, [5.5, 5.625, 5.75]), cached=32))
        trace.observe(finished(5.5, [2] * 10, (1,), tenant="acme"))  # turned away
    reports = [t.report(keyed=True, unix_time=lambda reading: 1_700_000_000.0 + reading) for t in shared + own]
    assert [(r["key"], r["key_id"]) for r in reports[:2]] == [("shared", shared[0].key_id)] * 2
    assert [r["key"] for r in reports[2:]] == ["own", "own"] and reports[2]["key_id"] != reports[3]["key_id"]
    ids = [f"{i:016x}" for i in chained_block_ids(KEY, "default", system + [1])]
    assert reports[0]["requests"] == reports[1]["requests"] == [
        {"arrival": 1_700_000_005.0, "input_length": 601, "output_length": 3, "keyed_ids": ids, "tenant": "default",
         "served": {"queued_ms": 250.0, "prefill_ms": 250.0, "decode_ms": 250.0, "cached_tokens": 32}},
        {"arrival": 1_700_000_005.5, "input_length": 10, "output_length": 1,
         "keyed_ids": [f"{chained_block_ids(KEY, 'acme', [2] * 10)[0]:016x}"], "tenant": "acme", "served": None}]
    assert reports[2]["requests"][0]["keyed_ids"] != ids  # a key drawn at start: ids of its own
    assert reports[0]["started_at"] == 1_700_000_005.0
    plain = shared[0].report(default_tenant="default")  # what `kvctl trace save` at a replica reads
    assert plain["started_at"] is None and plain["key"] == "shared" and plain["requests"][0]["hash_ids"] == [0, 1]
    assert RequestTrace(capacity=4, shared=True).report()["key"] == "own"  # no key given: none shared


def test_a_lora_adapters_prompt_chains_apart_from_the_models_as_its_blocks_do():
    """An adapter's K/V are not the model's (its blocks are its own), so a replay must not count
    its prompt as a hit on the model's: the trace seeds its chain with the adapter."""
    trace = RequestTrace(capacity=4, key=KEY, shared=True)
    system = list(range(600))
    for adapter in ("", "sql", "sql", "support"):
        trace.observe(finished(5.0, system, (1,), adapter=adapter))
    ids = [line["keyed_ids"] for line in trace.report(keyed=True, unix_time=float)["requests"]]
    assert ids[0] == [f"{i:016x}" for i in chained_block_ids(KEY, "default", system)]  # the model's: as before
    assert ids[1] == ids[2] == [f"{i:016x}" for i in chained_block_ids(KEY, "default", system, adapter="sql")]
    assert len({ids[0][0], ids[1][0], ids[3][0]}) == 3 and len({ids[0][1], ids[1][1], ids[3][1]}) == 3


def test_kvd_refuses_to_start_on_a_bad_trace_key_file_and_a_reload_leaves_it_for_a_restart(daemon, tmp_path):
    from dataclasses import replace

    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.service import EngineService

    path = tmp_path / "trace.key"
    path.write_bytes(b"k" * 8)
    path.chmod(0o600)
    config = resolve({"state_dir": str(tmp_path), "trace_key_file": str(path)}, env={})
    assert config.sources["trace_key_file"] == "--trace-key-file"
    with pytest.raises(ValueError, match=r"^trace_key_file: .* holds 8 bytes; a key needs at least 32"):
        EngineService(config, store=None)
    path.write_bytes(b"k" * 32)
    from kvctl.daemon.store import Store

    store = Store(tmp_path / "kvd.sqlite3")
    keyed = EngineService(replace(config, trace_block_tokens=64), store)  # not started: no model loaded
    assert (keyed.trace.shared, keyed.trace.block_tokens) == (True, 64)
    store.close()
    service, _ = daemon
    before = service.config
    try:
        answer = service.reload(replace(service.config, trace_key_file=str(path)), actor="test")
        assert answer["changed"] == {} and answer["needs_restart"] == ["trace_key_file"]
        assert service.trace.shared is False and service.config.trace_key_file is None
    finally:
        service.reload(before, actor="test")


def test_finer_trace_blocks_give_an_id_per_that_many_tokens_and_mark_each_line():
    system = list(range(600))
    trace = RequestTrace(capacity=4, key=KEY, block_tokens=64)
    trace.observe(finished(1.0, system + [1] * 100))
    trace.observe(finished(2.0, system + [2] * 100))
    assert chained_block_ids(KEY, "default", system, 64)[:9] == chained_block_ids(KEY, "default", system + [1], 64)[:9]
    report = trace.report(default_tenant="default")
    assert report["block_tokens"] == 64
    first, second = report["requests"]
    assert first["block_tokens"] == second["block_tokens"] == 64
    # each line's output, 4 tokens after a 700-token prompt, makes one whole block of 64 from the prompt's tail
    assert first["hash_ids"] == list(range(11)) and first["output_hash_ids"] == [11]
    assert second["hash_ids"] == list(range(9)) + [12, 13] and second["output_hash_ids"] == [14]
    assert len(trace.report(keyed=True, unix_time=float)["requests"][0]["keyed_ids"]) == 11


@pytest.mark.parametrize("value, message", [("100", "must be one of 16, 32, 64, 128, 256, 512"),
                                            ("8", "must be one of 16, 32, 64, 128, 256, 512")])
def test_kvd_refuses_a_trace_block_size_the_trace_format_cannot_say(value, message):
    from kvctl.daemon.config import ConfigError, resolve

    assert resolve({"trace_block_tokens": "64"}, env={}).trace_block_tokens == 64
    assert resolve({}, env={"KVD_TRACE_BLOCK_TOKENS": "16"}).trace_block_tokens == 16
    with pytest.raises(ConfigError) as refused:
        resolve({"trace_block_tokens": value}, env={})
    assert str(refused.value) == f"trace_block_tokens: invalid value {value!r} from --trace-block-tokens: {message}"


def test_a_routed_request_s_line_carries_the_router_s_name_for_it_and_a_bad_name_is_refused(daemon):
    """kvd router names each request, each try at it and its own arrival (X-KVD-Router-Attempt):
    the keyed line kvd gives the router carries it, so the fleet's trace can keep a retried
    request's last try alone, in the router's order; the saved (numbered) trace does not. A value
    kvd router would not send is a 400 naming the header, and nothing is run."""
    from .daemon_fixtures import call, settled

    service, unix = daemon

    def answered_and_traced(prompt, headers=None):  # the request's keyed line, once the trace has taken it
        before = service.trace.observed
        assert call(unix, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                    headers=headers or {}).status_code == 200
        return settled(lambda: call(unix, "GET", "/admin/trace", params={"last": 1, "ids": "keyed"}).json(),
                       lambda body: body["observed"] == before + 1)["requests"][0]

    line = answered_and_traced([5] * 37, {"X-KVD-Router-Attempt": "0123456789abcdef/2/1764561600.25"})
    assert (line["input_length"], line["router"]) == (37, {"request": "0123456789abcdef", "try": 2,
                                                           "arrival": 1764561600.25})
    assert set(call(unix, "GET", "/admin/trace", params={"last": 1}).json()["requests"][0]) == {
        "timestamp", "input_length", "output_length", "hash_ids", "served", "max_tokens"}
    observed = service.trace.observed
    for bad in ("0123456789ABCDEF/2/1.5", "0123456789abcdef/0/1.5", "0123456789abcdef/2", "x/1/1.5",
                "0123456789abcdef/10000/1.5", "0123456789abcdef/2/-1.5", "0123456789abcdef/2/inf"):
        refused = call(unix, "POST", "/v1/completions", json={"prompt": [5] * 37, "max_tokens": 1},
                       headers={"X-KVD-Router-Attempt": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-KVD-Router-Attempt"
        assert refused.json()["error"]["message"] == (
            f"X-KVD-Router-Attempt: invalid value {bad!r}; kvd router sends its id of the request (16 lowercase "
            f"hex digits), the try (1 to 9999) and when it routed the request (Unix seconds), '/' between, "
            f"e.g. 9f86d081884c7d65/2/1764561600.123456")
    assert service.trace.observed == observed
    line = answered_and_traced([6] * 37)
    assert line["input_length"] == 37 and "router" not in line


def test_a_request_s_own_priority_is_traced_for_a_replay_of_its_queue(tmp_path):
    """Under queue_order priority a request may defer itself (vLLM's priority): its line says by how
    much, numbered and keyed (kvd router merges those for a fleet's trace); one at its tenant's
    place says nothing."""
    pytest.importorskip("torch")
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.fleet_trace import _held

    from .daemon_fixtures import call, settled, start_service

    service = start_service(tmp_path, queue_order="priority")
    try:
        app = create_app(service, service.metrics, front="unix")
        for priority in (3, 0):
            assert call(app, "POST", "/v1/completions", json={"prompt": [5] * 37, "max_tokens": 1,
                                                              "priority": priority}).status_code == 200
        lines = settled(lambda: call(app, "GET", "/admin/trace").json()["requests"], lambda got: len(got) == 2)
        assert [line.get("priority") for line in lines] == [3, None]
        keyed = call(app, "GET", "/admin/trace", params={"ids": "keyed"}).json()["requests"]
        assert [line.get("priority") for line in keyed] == [3, None]
        assert [_held(line, "replica-0").priority for line in keyed] == [3, 0]
        assert [line["max_tokens"] for line in keyed] == [1, 1]  # and what each asked, merged too
        assert [_held(line, "replica-0").max_tokens for line in keyed] == [1, 1]
    finally:
        service.shutdown(deadline=2)


def test_a_request_in_explicit_prompt_cache_mode_chains_its_own_ids_past_its_marked_prefix():
    """As its cache blocks past the marked prefix were its own (PrefixHasher's `private`), so are its
    trace ids from the first trace block that reaches past it: a replay shares no more than kvd did."""
    from kvctl.daemon.server.request_trace import sequence_block_ids

    prompt, reply = list(range(1_100)), [7] * 600
    plain = sequence_block_ids(KEY, "default", prompt, reply)
    mine = sequence_block_ids(KEY, "default", prompt, reply, own=(512, b"nonce-a"))
    theirs = sequence_block_ids(KEY, "default", prompt, reply, own=(512, b"nonce-b"))
    assert [len(ids) for ids in plain] == [len(ids) for ids in mine] == [3, 1]
    assert mine[0][0] == plain[0][0]  # the first 512 tokens end where the marked prefix does: everyone's
    own = mine[0][1:] + mine[1]
    assert not set(own) & set(plain[0] + plain[1]) and not set(own) & set(theirs[0][1:] + theirs[1])
    assert sequence_block_ids(KEY, "default", prompt, reply, own=(512, b"nonce-a")) == mine  # (its own, again)
    inside = sequence_block_ids(KEY, "default", prompt, reply, own=(100, b"nonce-a"))  # a mark inside a block:
    assert not set(inside[0] + inside[1]) & set(plain[0] + plain[1])  # that block is its own already

    trace = RequestTrace(capacity=4, key=KEY)
    explicit = finished(1.0, prompt, (3,))
    explicit.params.extra["cache_private"] = (32, b"nonce-a")  # 32 blocks of 16: 512 tokens
    trace.observe(explicit, cache_block_size=16)
    trace.observe(finished(2.0, prompt, (3,)), cache_block_size=16)
    lines = [r.to_object()["hash_ids"] for r in trace.requests()]
    assert lines == [[0, 1, 2], [0, 3, 4]]  # the marked prefix shared, nothing after it

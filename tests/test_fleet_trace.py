"""The fleet's trace at kvd router (`kvctl trace save` there): the replicas' traces merged in
arrival order, one prompt one id on every replica given one trace_key_file; refused, with the
way out, where replicas key their ids apart; a replica left out is named."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvctl.daemon.replay.trace import read_trace
from kvctl.daemon.server.fleet_trace import merge_traces, trace_query

from .test_cli import cli

SYSTEM = ["00000000000000aa", "00000000000000bb"]  # a 1,024-token system prompt's keyed ids


def keyed(arrival, ids, output=2, tenant="default", prompt=None, served=None):
    return {"arrival": arrival, "input_length": prompt or 512 * len(ids), "output_length": output,
            "keyed_ids": ids, "tenant": tenant, "served": served}


HOW = {"queued_ms": 1.5, "prefill_ms": 40.0, "decode_ms": 120.25, "cached_tokens": 1024}


def replica(*lines, key="shared", key_id="feedfacefeedface", capacity=100, observed=None):
    return 200, {"capacity": capacity, "observed": len(lines) if observed is None else observed, "block_tokens": 512,
                 "key": key, "key_id": key_id, "started_at": lines[0]["arrival"] if lines else None,
                 "requests": list(lines)}


def test_the_router_asks_each_replica_for_keyed_ids():
    assert trace_query(None) == "/admin/trace?ids=keyed"
    assert trace_query(40) == "/admin/trace?ids=keyed&last=40"


def test_replicas_traces_merge_in_arrival_order_one_prompt_one_id_on_every_replica():
    a = replica(keyed(100.0, SYSTEM + ["0000000000000001"]), keyed(100.9, ["00000000000000cc"], tenant="acme"))
    b = replica(keyed(100.4, SYSTEM + ["0000000000000002"], output=7, served=HOW), keyed(101.5, SYSTEM), observed=9)
    status, body = merge_traces(["r0", "r1"], [a, b], last=None)
    assert status == 200 and body["result"] == "ok" and "message" not in body
    assert body["requests"] == [
        {"timestamp": 0.0, "input_length": 1536, "output_length": 2, "hash_ids": [0, 1, 2], "replica": "r0"},
        {"timestamp": 400.0, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 3], "served": HOW,
         "replica": "r1"},
        {"timestamp": 900.0, "input_length": 512, "output_length": 2, "hash_ids": [4], "tenant": "acme",
         "replica": "r0"},
        {"timestamp": 1500.0, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1], "replica": "r1"}]
    assert (body["capacity"], body["observed"], body["started_at"]) == (200, 11, 100.0)
    assert (body["key"], body["key_id"], body["block_tokens"]) == ("shared", "feedfacefeedface", 512)
    assert body["replicas"] == [{"replica": "r0", "status": 200, "requests": 2, "key": "shared"},
                                {"replica": "r1", "status": 200, "requests": 2, "key": "shared"}]
    status, body = merge_traces(["r0", "r1"], [a, b], last=2)  # the fleet's last two, numbered again
    assert [(r["timestamp"], r["hash_ids"], r["replica"]) for r in body["requests"]] == [
        (0.0, [0], "r0"), (600.0, [1, 2], "r1")]


def test_a_replica_left_out_is_named_and_the_trace_is_partial():
    a = replica(keyed(10.0, SYSTEM))
    down = (None, {"error": "ConnectError: connection refused"})
    status, body = merge_traces(["r0", "r1", "r2"], [a, down, (503, {"error": {"message": "loading the model"}})],
                                last=None)
    assert status == 200 and body["result"] == "partial" and len(body["requests"]) == 1
    assert body["message"] == ("not in the trace: r1 (not reached: ConnectError: connection refused); "
                               "r2 (503: loading the model)")
    assert [row["status"] for row in body["replicas"]] == [200, None, 503]
    lone = replica(keyed(10.0, SYSTEM), key="own", key_id="0123456789abcdef")  # the only one: nothing to meet
    assert merge_traces(["r0", "r1"], [lone, down], last=None)[0] == 200
    status, body = merge_traces(["r0", "r1"], [down, down], last=None)
    assert status == 503 and body["error"]["code"] == "no_replica"


def test_replicas_that_key_their_ids_apart_are_not_merged_and_the_operator_is_told_how():
    own = [replica(keyed(1.0, SYSTEM), key="own", key_id=k) for k in ("0123456789abcdef", "fedcba9876543210")]
    status, body = merge_traces(["r0", "r1"], own, last=None)
    assert status == 409 and body["error"]["code"] == "trace_keys_differ"
    assert body["error"]["message"] == (
        "trace: the replicas key their block ids apart (r0: its own key, drawn at start; r1: its own key, drawn "
        "at start), so one prompt on two of them would look like two; give every replica the same trace_key_file "
        "(e.g. head -c 32 /dev/urandom > /etc/kvd/trace.key; chmod 600; restart them) to save the fleet's trace, "
        "or save each replica's (kvctl --socket REPLICA trace save FILE)")
    two_files = [replica(keyed(1.0, SYSTEM), key_id="00000000000000a1"), replica(key_id="00000000000000b2")]
    status, body = merge_traces(["r0", "r1"], two_files, last=None)
    assert status == 409 and "(r0: key 00000000000000a1; r1: key 00000000000000b2)" in body["error"]["message"]
    fine = replica(keyed(1.0, SYSTEM))
    fine[1]["block_tokens"] = 64
    status, body = merge_traces(["r0", "r1"], [replica(keyed(1.0, SYSTEM)), fine], last=None)
    assert status == 409 and body["error"]["message"] == (
        "trace: the replicas cut prompts into blocks of different sizes for their ids (r0: 512; r1: 64 tokens); "
        "give every replica one trace_block_tokens to save the fleet's trace")
    older = (200, {"capacity": 5, "observed": 1, "block_tokens": 512,
                   "requests": [{"timestamp": 0.0, "input_length": 1, "output_length": 1, "hash_ids": [0]}]})
    status, body = merge_traces(["r0", "r1"], [replica(keyed(1.0, SYSTEM)), older], last=None)
    assert status == 409 and body["error"]["message"].startswith(
        "trace: r1 gave no keyed block ids (a kvd older than this router?)")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two real replicas given one trace_key_file, and two more that draw their own keys."""
    pytest.importorskip("torch")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service

    key = tmp_path_factory.mktemp("keys") / "trace.key"
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    shared = [start_service(tmp_path_factory.mktemp(f"keyed{i}"), trace_key_file=str(key)) for i in range(2)]
    own = [start_service(tmp_path_factory.mktemp(f"own{i}")) for i in range(2)]
    try:
        yield [create_app(s, s.metrics, front="unix") for s in shared], [create_app(s, s.metrics, front="unix")
                                                                          for s in own]
    finally:
        for service in shared + own:
            service.shutdown(deadline=5)


def test_kvctl_trace_save_at_kvd_router_writes_the_fleet_s_traffic_for_a_routing_replay(fleet, capsys, tmp_path,
                                                                                       monkeypatch):
    from kvctl import client

    from .daemon_fixtures import call
    from .test_router import drive, post, router_app

    shared, own = fleet
    _, app = router_app(shared, "round_robin")
    system = [(i * 7) % 250 for i in range(600)]
    prompts = [system + [1, 2], system + [3], [9] * 30, system + [1, 2]]  # alternating replicas
    answers = drive(app, [lambda c, p=p: post(c, p) for p in prompts])
    assert [a.status_code for a in answers] == [200] * 4
    body = call(app, "GET", "/admin/trace").json()
    assert body["result"] == "ok" and [row["requests"] for row in body["replicas"]] == [2, 2]
    assert [(r["input_length"], r["hash_ids"]) for r in body["requests"]] == [
        (602, [0, 1]), (601, [0, 2]), (30, [3]), (602, [0, 1])]  # the system prompt's id on both replicas
    assert call(app, "GET", "/admin/trace", params={"last": 1}).json()["requests"][0]["hash_ids"] == [0, 1]
    refused = call(app, "GET", "/admin/trace", params={"last": "0"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "last: must be a whole number >= 1, got '0'"
    odd = [call(app, "GET", "/admin/trace", params={"last": last}) for last in ("\u00b2", "9" * 5000)]
    assert [(a.status_code, a.json()["error"]["message"][:43]) for a in odd] == [
        (400, "last: must be a whole number >= 1, got '\u00b2'"), (400, "last: must be a whole number >= 1, got '999")]

    monkeypatch.setattr(client.Client, "get",
                        lambda self, path, **params: call(app, "GET", path, params={k: v for k, v in params.items()
                                                                                  if v is not None}).json())
    out = tmp_path / "fleet.jsonl"
    status, printed, _ = cli(capsys, "trace", "save", str(out))
    assert status == 0 and printed.startswith("wrote 4 requests over ") and printed.rstrip().endswith(
        f"to {out} (1,835 prompt tokens, 1 tenant, 2 replicas)")
    assert [r.hash_ids for r in read_trace(out)] == [(0, 1), (0, 2), (3,), (0, 1)]
    assert [r.replica for r in read_trace(out)] == ["replica-0", "replica-1"] * 2  # where round robin sent each
    status, printed, _ = cli(capsys, "bench", "replay", str(out), "--block-sizes", "16", "--replicas", "2",
                             "--routing", "round_robin,prefix", "--json")
    assert status == 0 and json.loads(printed)  # the fleet's trace replays behind the routing policies

    _, apart = router_app(own, "round_robin")
    monkeypatch.setattr(client.Client, "get",
                        lambda self, path, **params: self.answered(call(apart, "GET", path)))
    status, _, err = cli(capsys, "trace", "save", str(tmp_path / "apart.jsonl"))
    assert status != 0 and "the replicas key their block ids apart" in " ".join(err.split())
    assert not (tmp_path / "apart.jsonl").exists()


def test_kvctl_trace_save_writes_what_the_fleet_gave_and_exits_3_naming_the_replica_left_out(
        capsys, tmp_path, monkeypatch):
    from kvctl import client

    a = replica(keyed(10.0, SYSTEM), keyed(10.5, SYSTEM + ["0000000000000003"]))
    down = (None, {"error": "ConnectError: connection refused"})
    _, body = merge_traces(["r0", "r1"], [a, down], last=None)
    monkeypatch.setattr(client.Client, "get", lambda self, path, **params: body)
    out = tmp_path / "fleet.jsonl"
    status, printed, err = cli(capsys, "trace", "save", str(out))
    assert status == 3 and printed.strip() == (f"wrote 2 requests over 500.0 ms to {out} (2,560 prompt tokens, "
                                               f"1 tenant, 1 replica)")
    assert " ".join(err.split()) == "not in the trace: r1 (not reached: ConnectError: connection refused)"
    assert [r.hash_ids for r in read_trace(out)] == [(0, 1), (0, 1, 2)]
    status, printed, _ = cli(capsys, "trace", "save", str(out), "--json")
    figures = json.loads(printed)
    assert status == 3 and (figures["replicas"], figures["result"]) == (["r0"], "partial")
    assert figures["message"] == "not in the trace: r1 (not reached: ConnectError: connection refused)"


def routed(line, request, attempt, arrival):
    """`line` as kvd keeps it for a request kvd router sent: the router's id, try and arrival."""
    return dict(line, router={"request": request, "try": attempt, "arrival": arrival})


def test_the_fleet_s_trace_is_in_the_router_s_order_and_a_retried_request_is_one_line(capsys, tmp_path,
                                                                                      monkeypatch):
    """Lines the router sent carry its arrival: the fleet's trace is in the order the router
    received the requests, on its clock (E reached r0 before D reached r1, but the router had D
    first). A request r0 turned away (429) and the router sent on to r1 is in both replicas'
    traces; the fleet's trace keeps its last try alone and says how many lines it left out. A
    request every replica turned away is kept once, as the last one turned it away. A line of a
    request sent to a replica directly keeps the replica's arrival."""
    a_id, b_id, d_id, e_id = "00000000000000a1", "00000000000000b2", "00000000000000d4", "00000000000000e5"
    r0 = replica(routed(keyed(10.0, SYSTEM, output=0), a_id, 1, 9.99),
                 routed(keyed(11.0, ["00000000000000dd"], output=0), b_id, 1, 10.98),
                 keyed(12.0, ["00000000000000ee"]),  # C, sent to r0 directly
                 routed(keyed(12.46, ["00000000000000ff"]), e_id, 1, 12.45))
    r1 = replica(routed(keyed(10.01, SYSTEM, output=5, served=HOW), a_id, 2, 9.99),
                 routed(keyed(11.02, ["00000000000000dd"], output=0), b_id, 2, 10.98),
                 routed(keyed(12.5, ["00000000000000ee"], output=3), d_id, 1, 12.4))
    status, body = merge_traces(["r0", "r1"], [r0, r1], last=None)
    assert status == 200 and body["retries_merged"] == 2 and body["started_at"] == 9.99
    assert [(r["timestamp"], r["output_length"], r["replica"]) for r in body["requests"]] == [
        (0.0, 5, "r1"), (990.0, 0, "r1"), (2010.0, 2, "r0"), (2410.0, 3, "r1"), (2460.0, 2, "r0")]
    assert [r["hash_ids"] for r in body["requests"]] == [[0, 1], [2], [3], [3], [4]]
    status, body = merge_traces(["r0", "r1"], [r0, r1], last=2)  # `last` counts the fleet's requests
    assert [r["replica"] for r in body["requests"]] == ["r1", "r0"] and body["retries_merged"] == 2
    _, body = merge_traces(["r0", "r1"], [replica(keyed(1.0, SYSTEM)), replica(keyed(1.5, SYSTEM))], last=None)
    assert body["retries_merged"] == 0 and len(body["requests"]) == 2

    from kvctl import client

    _, body = merge_traces(["r0", "r1"], [r0, r1], last=None)
    monkeypatch.setattr(client.Client, "get", lambda self, path, **params: body)
    out = tmp_path / "fleet.jsonl"
    status, printed, _ = cli(capsys, "trace", "save", str(out))
    assert status == 0 and printed.strip() == (  # seven lines the replicas observed, five requests: none earlier
        f"wrote 5 requests over 2.46 s to {out} (3,072 prompt tokens, 1 tenant, 2 replicas); 2 earlier tries of "
        f"requests the router sent on to another replica left out")
    assert [r.replica for r in read_trace(out)] == ["r1", "r1", "r0", "r1", "r0"]
    status, printed, _ = cli(capsys, "trace", "save", str(out), "--json")
    assert json.loads(printed)["retries_merged"] == 2


class RunsThenRefuses(httpx.AsyncBaseTransport):
    """A replica that runs each completion it is sent and then answers 429, as if its queue had
    been full (so it has a trace line for a request the router then sends elsewhere); it notes
    the router's name for each try."""

    def __init__(self, app) -> None:
        self.inner, self.tries = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request):
        answer = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/completions":
            return answer
        await answer.aread()
        self.tries.append(request.headers.get("x-kvd-router-attempt"))
        return httpx.Response(429, json={"error": {"message": "queue full", "type": "x", "param": None,
                                                   "code": "queue_full"}}, headers={"Retry-After": "1"})


def test_the_router_names_each_try_and_its_trace_counts_a_retried_request_once(fleet):
    from kvctl.daemon.server.router_service import replica_client

    from .daemon_fixtures import call, settled
    from .test_router import drive, router_app

    shared, _ = fleet
    service, app = router_app(shared, "round_robin")
    refusing = RunsThenRefuses(shared[0])
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=refusing)
    sent = time.time()
    [answer] = drive(app, [lambda c: c.post("/v1/completions", json={"prompt": [4] * 37, "max_tokens": 3},
                                            headers={"X-KVD-Router-Attempt": "not the router's"})])
    answered = time.time()
    # the caller's own X-KVD-Router-Attempt never reaches a replica: the router's replaces it
    assert answer.status_code == 200 and answer.headers["x-kvd-tried"] == "replica-0 (429)"
    [name] = refusing.tries
    request, attempt, arrival = name.split("/")
    assert len(request) == 16 and attempt == "1" and sent <= float(arrival) <= answered  # the router's clock
    second = settled(lambda: call(shared[1], "GET", "/admin/trace", params={"last": 1, "ids": "keyed"}).json(),
                     lambda body: body["requests"] and body["requests"][-1]["input_length"] == 37)
    line = second["requests"][-1]  # one name, the second try, the router's arrival
    assert line["router"] == {"request": request, "try": 2, "arrival": float(arrival)}
    first = call(shared[0], "GET", "/admin/trace", params={"last": 1, "ids": "keyed"}).json()["requests"][-1]
    assert first["router"] == {"request": request, "try": 1, "arrival": float(arrival)}  # replica-0 ran it too
    body = call(app, "GET", "/admin/trace", params={"last": 3}).json()
    assert body["retries_merged"] >= 1
    assert [r["replica"] for r in body["requests"] if r["input_length"] == 37] == ["replica-1"]


def test_the_fleet_s_trace_counts_the_requests_no_replica_took_in_within_its_span(capsys, tmp_path, monkeypatch):
    """The router notes when it gave up on a request no replica took in; the fleet's trace counts
    those from its first line on (with `last`, from the first line kept), and every one where it
    holds no line. `trace save` says how many are not in the file."""
    r0 = replica(keyed(10.0, SYSTEM), keyed(12.0, ["00000000000000cc"]))
    r1 = replica(keyed(11.0, SYSTEM))
    untraced = [5.0, 10.5, 13.0]  # one before the first line, one between, one after the last
    assert merge_traces(["r0", "r1"], [r0, r1], last=None, untraced=untraced)[1]["router_untraced"] == 2
    assert merge_traces(["r0", "r1"], [r0, r1], last=1, untraced=untraced)[1]["router_untraced"] == 1
    assert merge_traces(["r0", "r1"], [r0, r1], last=None)[1]["router_untraced"] == 0
    empty = merge_traces(["r0", "r1"], [replica(), replica()], last=None, untraced=untraced)[1]
    assert (empty["requests"], empty["router_untraced"]) == ([], 3)

    from kvctl import client

    _, body = merge_traces(["r0", "r1"], [r0, r1], last=None, untraced=untraced)
    monkeypatch.setattr(client.Client, "get", lambda self, path, **params: body)
    out = tmp_path / "fleet.jsonl"
    status, printed, _ = cli(capsys, "trace", "save", str(out))
    assert status == 0 and printed.strip() == (
        f"wrote 3 requests over 2.00 s to {out} (2,560 prompt tokens, 1 tenant, 2 replicas); 2 requests no "
        f"replica took in (none reachable or taking requests) are not in it")
    status, printed, _ = cli(capsys, "trace", "save", str(out), "--json")
    assert json.loads(printed)["router_untraced"] == 2
    monkeypatch.setattr(client.Client, "get", lambda self, path, **params: empty)
    status, _, err = cli(capsys, "trace", "save", str(tmp_path / "none.jsonl"))
    assert status != 0 and " ".join(err.split()) == (
        "error: trace: kvd has finished no request since it started; nothing to save (3 requests no replica "
        "took in, none reachable or taking requests)")


def test_the_router_notes_each_request_no_replica_took_in_and_no_other(fleet):
    """Given up on with every replica stopping (503) or unreachable, none answering the route
    question, or each closing the connection before answering: noted, once each, and counted in
    kvd_router_unrouted_total. Turned away by a replica (429, which keeps a trace line there) and
    then unreachable elsewhere, or served: not noted."""
    from kvctl.daemon.server.router_service import replica_client

    from .test_router import Down, Failing, Refusing, drive, post, router_app

    shared, _ = fleet

    def routed_over(*transports):
        service, app = router_app(shared, "round_robin")
        for i, transport in enumerate(transports):
            if transport is not None:
                service.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=transport)
        return service, app

    service, app = routed_over(Refusing(shared[0], 503), Refusing(shared[1], "unreachable"))
    before = time.time()
    [answer] = drive(app, [lambda c: post(c, [5] * 20)])
    after = time.time()
    assert answer.status_code == 502 and answer.json()["error"]["message"] == (
        "replica replica-1 failed: ConnectError: connection refused")
    assert [r.client._transport.completions for r in service.replicas] == [1, 1]  # each asked once
    [when] = service.untraced
    assert before <= when <= after  # when the router first chose a replica for it
    assert service.unrouted == 1  # and kvd_router_unrouted_total counts it (it counted only no replica live)

    service, app = routed_over(Refusing(shared[0], 429), Refusing(shared[1], "unreachable"))
    [answer] = drive(app, [lambda c: post(c, [5] * 20)])
    assert answer.status_code == 502 and list(service.untraced) == []  # replica-0 keeps a line of it
    assert service.unrouted == 0

    service, app = routed_over(Down(), Down())
    answers = drive(app, [lambda c: post(c, [5] * 20), lambda c: post(c, [6] * 20)])
    assert [a.status_code for a in answers] == [503, 503] and len(service.untraced) == service.unrouted == 2

    service, app = routed_over(*(Failing(app, httpx.RemoteProtocolError) for app in shared))  # both closed
    [answer] = drive(app, [lambda c: post(c, [5] * 20)])
    assert answer.status_code == 502 and len(service.untraced) == service.unrouted == 1

    service, app = routed_over(None, None)
    [answer] = drive(app, [lambda c: post(c, [5] * 20)])
    assert answer.status_code == 200 and list(service.untraced) == []

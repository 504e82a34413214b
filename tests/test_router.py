"""kvd router in front of two real replicas (in-process services): it sends a prompt where its
prefix is cached, spreads new prefixes, streams answers through unchanged, leaves out a replica
that does not answer, and says 503 when none does."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.server.router import Replica, RouterService, create_router_app, replica_client  # noqa: E402
from kvctl.policies.routing import make_router  # noqa: E402

from .daemon_fixtures import start_service  # noqa: E402

SYSTEM_A = "You answer questions about paged KV caches, eviction order and memory tiers, briefly. " * 2
SYSTEM_B = "You are a terse assistant for operators of serving fleets; cite block ids when you can. " * 2


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    services = [start_service(tmp_path_factory.mktemp(f"replica{i}"), num_blocks=64) for i in range(2)]
    try:
        yield [create_app(s, s.metrics, front="unix") for s in services]
    finally:
        for service in services:
            service.shutdown(deadline=5)


class Down(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request):
        raise httpx.ConnectError("connection refused", request=request)


def router_app(apps, routing="prefix", down=()):
    replicas = [Replica(f"replica-{i}", replica_client(f"/run/replica-{i}.sock",
                                                       transport=Down() if i in down else httpx.ASGITransport(app=a)))
                for i, a in enumerate(apps)]
    service = RouterService(replicas, make_router(routing))
    return service, create_router_app(service)


async def post(client, prompt, **extra):
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                      "ignore_eos": True, **extra})


def drive(app, steps):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as client:
            return [await step(client) for step in steps]
    return asyncio.run(go())


def test_prefix_routing_sends_a_prompt_where_its_prefix_is_cached_and_spreads_new_ones(replicas):
    service, app = router_app(replicas, "prefix")
    answers = drive(app, [lambda c: post(c, SYSTEM_A + "Q1?"), lambda c: post(c, SYSTEM_A + "Q2?"),
                          lambda c: post(c, SYSTEM_B + "Q1?"), lambda c: post(c, SYSTEM_B + "Q2?"),
                          lambda c: post(c, SYSTEM_A + "Q3?")])
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.headers["x-kvd-replica"] for a in answers] == [
        "replica-0", "replica-0", "replica-1", "replica-1", "replica-0"]
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == cached[2] == 0 and all(c > 0 for c in (cached[1], cached[3], cached[4]))
    assert answers[0].headers["x-kvd-route"] == "no replica caches its prefix: the least loaded"
    assert answers[1].headers["x-kvd-route"].startswith("caches ")
    assert service.status()["replicas"] == [
        {"replica": "replica-0", "sent": 3, "open": 0, "last_error": None},
        {"replica": "replica-1", "sent": 2, "open": 0, "last_error": None}]


def test_a_streamed_answer_comes_through_unchanged(replicas):
    _, app = router_app(replicas, "round_robin")
    [routed] = drive(app, [lambda c: post(c, SYSTEM_A + "stream me", stream=True)])
    assert routed.status_code == 200 and routed.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in routed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
    [plain] = drive(replicas[0], [lambda c: post(c, SYSTEM_A + "stream me")])
    assert tokens == plain.json()["choices"][0]["token_ids"] and len(tokens) == 3


def test_a_replica_that_does_not_answer_is_left_out_and_none_answering_is_a_503(replicas):
    service, app = router_app(replicas, "least_loaded", down=(0,))
    [answer] = drive(app, [lambda c: post(c, SYSTEM_B + "Q9?")])
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-1"
    assert service.replicas[0].last_error.startswith("ConnectError: connection refused")
    service, app = router_app(replicas, "least_loaded", down=(0, 1))
    [answer] = drive(app, [lambda c: post(c, "anything")])
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == (
        "no replica answered: replica-0 (ConnectError: connection refused); "
        "replica-1 (ConnectError: connection refused)")


def test_a_replicas_own_refusal_reaches_the_caller_and_bad_json_is_refused_here(replicas):
    _, app = router_app(replicas, "round_robin")
    answers = drive(app, [lambda c: post(c, "hello", max_tokens=0), lambda c: post(c, [1, 2, 999_999]),
                          lambda c: c.post("/v1/completions", content=b"{not json",
                                           headers={"content-type": "application/json"})])
    assert answers[0].status_code == 400 and answers[0].json()["error"]["param"] == "max_tokens"
    # a prompt the replicas refuse to even look at is forwarded, and the replica's refusal comes back
    assert answers[1].status_code == 400 and answers[1].json()["error"]["param"] == "prompt"
    assert answers[2].status_code == 400 and answers[2].json()["error"]["message"] == "body: expected a JSON object"


def test_a_tcp_replica_needs_a_token():
    with pytest.raises(ValueError, match="replica: 'http://10.0.0.2:8000' is reached over TCP and needs "
                                         "--token-file"):
        replica_client("http://10.0.0.2:8000")


def test_the_routers_status_sums_the_fleets_steps_and_queues(replicas):
    service, app = router_app(replicas, "round_robin")
    [before] = drive(app, [lambda c: c.get("/admin/status")])
    drive(app, [lambda c: post(c, SYSTEM_A + "Q7?"), lambda c: post(c, SYSTEM_B + "Q7?")])
    [after] = drive(app, [lambda c: c.get("/admin/status")])
    body = after.json()
    each = [r["steps"] for r in body["replica_status"]]
    assert body["steps"] == {kind: {"count": sum(s.get(kind, {}).get("count", 0) for s in each),
                                    "seconds": pytest.approx(sum(s.get(kind, {}).get("seconds", 0.0) for s in each))}
                             for kind in body["steps"]}
    assert sum(s["count"] for s in body["steps"].values()) > sum(s["count"] for s in before.json()["steps"].values())
    assert body["routing"] == "round_robin" and body["model"]["name"] == body["replica_status"][0]["model"]["name"]
    assert body["queue"] == {"waiting": 0, "running": 0}


def test_kvd_router_as_an_operator_runs_it_over_two_kvd_processes(tmp_path):
    """Real processes: two kvd, then `kvd router` in front of them; prompts sharing a system
    prompt land together, the router stops cleanly on SIGTERM and removes its socket."""
    import os
    import signal
    import subprocess
    import time

    from .kvd_process import BIN, running_kvd

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_kvd(tmp_path / "a", "--eviction", "lru") as (_, _, sock_a), \
            running_kvd(tmp_path / "b", "--eviction", "lru") as (_, _, sock_b):
        front = tmp_path / "router.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        router = subprocess.Popen([str(BIN / "kvd"), "router", "--replica", str(sock_a), "--replica", str(sock_b),
                                   "--socket", str(front), "--log-level", "warning"], env=env,
                                  stdout=open(tmp_path / "router.log", "ab"), stderr=subprocess.STDOUT)
        client = httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(uds=str(front)), timeout=60)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                assert router.poll() is None, (tmp_path / "router.log").read_text()
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert oct(front.stat().st_mode & 0o777) == "0o660"
            answers = [client.post("/v1/completions", json={"prompt": SYSTEM_A + q, "max_tokens": 2,
                                                            "temperature": 0}) for q in ("Q1?", "Q2?")]
            assert [a.status_code for a in answers] == [200, 200]
            assert answers[0].headers["x-kvd-replica"] == answers[1].headers["x-kvd-replica"] == str(sock_a)
            assert answers[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert client.get("/v1/models").json()["data"][0]["owned_by"] == "kvd"
        finally:
            client.close()
            router.send_signal(signal.SIGTERM)
            assert router.wait(30) == 0
        assert not front.exists()


def test_kvd_router_refuses_bad_settings_by_name(tmp_path):
    from typer.testing import CliRunner

    from kvctl.daemon.cli import app

    runner = CliRunner()
    cases = [(["--replica", "/a.sock"], "kvd: error: replica: give two or more (--replica, repeated), got 1"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--routing", "random"],
              "kvd: error: routing: unknown value 'random'"),
             (["--replica", "/a.sock", "--replica", "http://10.0.0.2:8000"],
              "kvd: error: replica: 'http://10.0.0.2:8000' is reached over TCP and needs --token-file"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--token-file", str(tmp_path / "none")],
              f"kvd: error: token_file: cannot read a token from {str(tmp_path / 'none')!r}")]
    for args, message in cases:
        result = runner.invoke(app, ["router", *args, "--socket", str(tmp_path / "r.sock")])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not (tmp_path / "r.sock").exists()


def test_a_body_over_the_limit_is_refused_before_the_router_reads_it(replicas):
    service, _ = router_app(replicas, "round_robin")
    app = create_router_app(service, max_request_bytes=1024)
    [answer] = drive(app, [lambda c: post(c, "x" * 2000)])
    assert answer.status_code == 413 and service.status()["replicas"][0]["sent"] == 0

"""kvd router in front of two real replicas (in-process services): it sends a prompt where its
prefix is cached, spreads new prefixes, streams answers through unchanged, leaves out a replica
that does not answer, and says 503 when none does."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.server.router import create_router_app  # noqa: E402
from kvctl.daemon.server.router_service import Replica, RouterService, replica_client  # noqa: E402
from kvctl.policies.routing import make_router  # noqa: E402

from .daemon_fixtures import sse_events, start_service  # noqa: E402



def home_of(prompt: str, names=("replica-0", "replica-1")) -> str:
    """The replica a new prefix goes to (policies/routing.py: its rendezvous order's first)."""
    from kvctl.policies.routing import home_order, prompt_affinity

    return names[home_order(prompt_affinity(prompt), list(names))[0]]


def homed(text: str, name: str) -> str:
    """`text` (longer than a prompt's affinity opening), marked where need be so that, as a new
    prefix, it goes home to `name` of replica-0 and replica-1: tests place prefixes on purpose."""
    assert len(text) >= 256
    return next(t for t in (text if k == 0 else f"[{k}] {text}" for k in range(64)) if home_of(t) == name)


SYSTEM_A = homed("You answer questions about paged KV caches, eviction order and memory tiers, briefly. " * 3,
                 "replica-0")
SYSTEM_B = homed("You are a terse assistant for operators of serving fleets; cite block ids when you can. " * 3,
                 "replica-1")


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


class Counting(httpx.AsyncBaseTransport):
    """Passes requests to an app, counting the route-facts questions that carry a prompt. With
    `hold_until`, completions wait until that many questions were asked here: requests sent at
    once are then all routed before any of them is served (and caches its prefix)."""

    def __init__(self, app, hold_until: int | None = None) -> None:
        self.inner, self.prompt_questions, self.answered = httpx.ASGITransport(app=app), 0, 0
        self.hold_until, self.asked = hold_until, asyncio.Event()

    async def handle_async_request(self, request):
        if request.url.path == "/admin/route-facts" and json.loads(request.content).get("tokens") != []:
            self.prompt_questions += 1
            answer = await self.inner.handle_async_request(request)  # the facts, made before any completion
            self.answered += 1
            # once every one was answered: counted on arrival, a completion could cache before the last
            # was answered (a question answered early saw the count of those still being answered)
            if self.hold_until is not None and self.answered >= self.hold_until:
                self.asked.set()
            return answer
        if request.url.path == "/v1/completions" and self.hold_until is not None:
            async with asyncio.timeout(30):
                await self.asked.wait()
        return await self.inner.handle_async_request(request)


def router_app(apps, routing="prefix", down=(), view="ask", pending_seconds=30.0, hold_until=None):
    replicas = [Replica(f"replica-{i}", replica_client(f"/run/replica-{i}.sock",
                                                       transport=Down() if i in down else Counting(a, hold_until)))
                for i, a in enumerate(apps)]
    service = RouterService(replicas, make_router(routing), view=view, load_interval=0.05,
                            pending_seconds=pending_seconds)
    return service, create_router_app(service)


async def post(client, prompt, **extra):
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                      "ignore_eos": True, **extra})


DRIVE_TIMEOUT_S = 120.0  # httpx's timeouts do not apply through ASGITransport: a step that never answers fails here


def drive(app, steps, service=None, synced=None):
    """Run `steps` against the router's app in one event loop; with `service`, its followers run
    meanwhile, and the steps start once the replicas named by `synced` (default: all) are followed.
    All of it within DRIVE_TIMEOUT_S: a step that never answers fails naming it. (The teardown hung
    the whole suite twice: a follower whose cancellation asyncio.wait_for swallowed went on following;
    see test_a_follower_cancelled_as_its_replica_answers_again_stops.)"""
    done = []

    async def go():
        followers = service.follow() if service is not None else []
        try:
            if service is not None:
                await until_followed(service, range(len(service.replicas)) if synced is None else synced)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as client:
                for step in steps:
                    done.append(await step(client))
                return done
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)

    async def bounded():
        try:
            return await asyncio.wait_for(go(), DRIVE_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"step {len(done) + 1} of {len(steps)} did not answer in {DRIVE_TIMEOUT_S:.0f} s"
                                 + ("" if service is None else f"; the router: {service.status()}")) from None
    return asyncio.run(bounded())


async def until_followed(service, indexes, settled=False, timeout=20.0):
    """Wait until each named replica's view is synced with a load answer (and, with `settled`,
    its feed has confirmed or dropped everything the router sent there, and the view has read
    every event the replica logged so far: a reply's last blocks are logged as it is made, after
    its prompt's were confirmed, and the follower may not have read them yet; and the router has
    its answers to the questions for the ids of the Responses replies it relayed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def caught_up(replica) -> bool:
        answer = await replica.client.get("/admin/events", params={"since": replica.view.seq, "limit": 1})
        return answer.status_code == 200 and not answer.json()["events"]

    while True:
        views = [service.replicas[i].view for i in indexes]
        if all(v.synced and v.load is not None and not (settled and v.pending) for v in views) and not (
                settled and service.reply_ids_asked):
            if not settled or all([await caught_up(service.replicas[i]) for i in indexes]):
                return
        assert loop.time() < deadline, service.status()
        await asyncio.sleep(0.02)


def test_prefix_routing_sends_a_prompt_where_its_prefix_is_cached_and_a_new_one_home(replicas):
    """A new prefix goes to its home (the same replica from any router: a hash of the prompt's
    opening and the replicas' names), its next questions where it is cached."""
    service, app = router_app(replicas, "prefix")
    answers = drive(app, [lambda c: post(c, SYSTEM_A + "Q1?"), lambda c: post(c, SYSTEM_A + "Q2?"),
                          lambda c: post(c, SYSTEM_B + "Q1?"), lambda c: post(c, SYSTEM_B + "Q2?"),
                          lambda c: post(c, SYSTEM_A + "Q3?")])
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.headers["x-kvd-replica"] for a in answers] == [
        "replica-0", "replica-0", "replica-1", "replica-1", "replica-0"]
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == cached[2] == 0 and all(c > 0 for c in (cached[1], cached[3], cached[4]))
    assert answers[0].headers["x-kvd-route"] == ("no replica caches its prefix: its home (the first by its hash "
                                                 "within the load bound)")
    assert answers[1].headers["x-kvd-route"].startswith("caches ")
    assert service.status()["replicas"] == [
        {"replica": "replica-0", "sent": 3, "open": 0, "last_error": None},
        {"replica": "replica-1", "sent": 2, "open": 0, "last_error": None}]


def test_prompts_under_one_prompt_cache_key_go_home_together(replicas):
    """OpenAI's `prompt_cache_key`: a client's key names the home of its new prefixes in place of
    their openings, so a prompt whose own home is replica-0 goes to the key's, replica-1; what a
    replica caches still draws a prompt there."""
    from kvctl.policies.routing import home_order, key_affinity

    names = ["replica-0", "replica-1"]
    key = next(f"team-{k}" for k in range(64) if names[home_order(key_affinity(f"team-{k}"), names)[0]] == "replica-1")
    own = homed("A prompt grouped under a client's cache key, whose own opening goes elsewhere. " * 4, "replica-0")
    other = homed("Another prompt of the same client, under its key too, with an opening of its own. " * 4,
                  "replica-0")
    _, app = router_app(replicas, "prefix")
    answers = drive(app, [lambda c: post(c, own + "Q1?", prompt_cache_key=key),
                          lambda c: post(c, other + "Q1?", prompt_cache_key=key),
                          lambda c: post(c, own + "Q2?"),
                          lambda c: post(c, other[::-1] + "Q1?", prompt_cache_key="")])
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.headers["x-kvd-replica"] for a in answers[:3]] == ["replica-1"] * 3  # the third: cached there
    assert answers[2].headers["x-kvd-route"].startswith("caches ")
    assert answers[3].headers["x-kvd-replica"] == home_of(other[::-1] + "Q1?")  # an empty key: none


def test_a_request_that_scores_its_prompt_is_routed_as_though_nothing_were_cached(replicas):
    """prompt_logprobs (or echo with logprobs) computes every prompt position on the replica, so
    the replica caching its prefix is no reason to send it there."""
    _, app = router_app(replicas, "prefix")
    answers = drive(app, [lambda c: post(c, SYSTEM_A + "warm"), lambda c: post(c, SYSTEM_A + "Q?"),
                          lambda c: post(c, SYSTEM_A + "Q?", echo=True, logprobs=1, max_tokens=1),
                          lambda c: post(c, SYSTEM_A + "Q?", prompt_logprobs=0, max_tokens=1)])
    assert [a.status_code for a in answers] == [200] * 4
    assert answers[1].headers["x-kvd-route"].startswith("caches ")
    for scored in answers[2:]:
        assert scored.headers["x-kvd-route"].startswith("no replica caches its prefix")
        assert scored.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


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
    [answer, scraped] = drive(app, [lambda c: post(c, "anything"), lambda c: c.get("/metrics")])
    assert answer.status_code == 503
    assert "kvd_router_unrouted_total 1.0" in scraped.text.splitlines()
    assert 'kvd_router_questions_total{replica="replica-1",result="failed"} 1.0' in scraped.text.splitlines()
    assert "kvd_router_view_synced" not in scraped.text  # the ask view has none
    from kvctl.daemon.server.cut_connections import cut
    assert f'kvd_router_http_cut_connections_total{{reason="stalled"}} {float(cut["stalled"])}' in scraped.text
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


def test_kvctl_status_at_the_router_shows_a_row_per_replica_and_the_fleets_hits(replicas):
    from rich.console import Console

    from kvctl.status_view import render_status

    service, app = router_app(replicas, "round_robin", down=(1,))
    drive(app, [lambda c: post(c, SYSTEM_A + "Q11?")])
    [answer] = drive(app, [lambda c: c.get("/admin/status")])
    body = answer.json()
    console = Console(record=True, width=80)
    render_status(body, console)
    lines = console.export_text().splitlines()
    assert lines[0].strip() == "fleet behind kvd router: round_robin routing, ask view, 2 replicas"
    assert lines[1].split() == ["replica", "sent", "open", "view", "blocks", "hits", "waiting", "running", "wait",
                                "TTFT", "p50"]
    live = body["replica_status"][0]
    blocks = live["blocks"]["device"]
    assert lines[2].split()[:6] == ["replica-0", "1", "0", "asks", f"{blocks['total'] - blocks['free']}/{blocks['total']}",
                                    f"{live['tokens']['hit_ratio']:.1%}"]
    assert lines[3].split() == ["replica-1", "0", "0", "not", "asked", "down"]  # (it rests: test_router_unanswered.py)
    assert "replica-1 down:" not in console.export_text()  # (the line below says why, once)
    assert " ".join(" ".join(lines[4:6]).split()).startswith(
        "replica-1 not asked: 1 question in a row unanswered (last error: ConnectError: connection refused); "
        "requests ask it again once in ")
    assert lines[-1] == (f"fleet prefix hits: {live['tokens']['hit']:,} of {live['tokens']['prompt']:,} prompt tokens "
                         f"({live['tokens']['hit']/ live['tokens']['prompt']:.1%})")
    reserved = live["reservation"]  # the live replica's, summed: the fleet's preemptions and unwritten reservations
    assert reserved["finished_blocks"] > 0 and " ".join(lines[-3:-1]) .split() == (
        f"fleet preemptions: 0 (0 tokens computed again); reservation fraction:1: "
        f"{reserved['unused_blocks'] / reserved['finished_blocks']:.1%} of the blocks finished requests held were "
        f"reserved and never written ({reserved['unused_blocks']:,} of {reserved['finished_blocks']:,})").split()


def test_the_router_answers_vllm_s_probe_and_tokenizes_at_a_replica_that_is_up(replicas):
    service, app = router_app(replicas, "round_robin", down=(0,))
    health, version, counted, refused = drive(app, [
        lambda c: c.get("/health"), lambda c: c.get("/version"),
        lambda c: c.post("/tokenize", json={"prompt": "count me"}),  # replica-0 is down: replica-1 answers
        lambda c: c.post("/detokenize", json={"tokens": [999]})])
    assert (health.status_code, health.json()) == (200, {}) and version.json()["version"]
    assert counted.status_code == 200 and counted.json()["count"] == len(counted.json()["tokens"]) == 9
    [back] = drive(app, [lambda c: c.post("/detokenize", json={"tokens": counted.json()["tokens"]})])
    assert back.json() == {"prompt": "count me"}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens[0]"
    _, all_down = router_app(replicas, "round_robin", down=(0, 1))
    [none] = drive(all_down, [lambda c: c.post("/tokenize", json={"prompt": "x"})])
    assert none.status_code == 503 and none.json()["error"]["message"].startswith(
        "no replica answered: replica-1: ConnectError")


def test_tokenize_at_the_router_passes_over_a_replica_that_cannot_serve(replicas):
    unloaded = Replica("replica-0", replica_client("/run/replica-0.sock", transport=CannotServe()))
    live = Replica("replica-1", replica_client("/run/replica-1.sock", transport=Counting(replicas[1])))
    app = create_router_app(RouterService([unloaded, live], make_router("round_robin"), view="ask"))
    [counted] = drive(app, [lambda c: c.post("/tokenize", json={"prompt": "count me"})])
    assert counted.status_code == 200 and counted.json()["count"] == 9
    alone = create_router_app(RouterService([Replica("replica-0", replica_client(
        "/run/replica-0.sock", transport=CannotServe()))], make_router("round_robin"), view="ask"))
    [none] = drive(alone, [lambda c: c.post("/tokenize", json={"prompt": "count me"})])
    assert none.status_code == 503 and none.json()["error"]["message"] == f"no replica answered: replica-0: 503: {UNLOADED}"


def test_the_router_merges_no_trace_of_replicas_that_draw_their_own_keys(replicas):
    """Replicas with no trace_key_file (tests/test_fleet_trace.py: with one)."""
    service, app = router_app(replicas, "round_robin")
    [answer] = drive(app, [lambda c: c.get("/admin/trace")])
    assert answer.status_code == 409 and answer.json()["error"]["message"].startswith(
        "trace: the replicas key their block ids apart (replica-0: its own key, drawn at start; replica-1: its own "
        "key, drawn at start)")


def test_a_follower_cancelled_as_its_replica_answers_again_stops(monkeypatch):
    """The router's stop cancels its followers. One pausing after a feed error, cancelled in the
    same turn as the load poll says the replica is back, went on following: CPython 3.11's
    asyncio.wait_for returns what it waited for and swallows a cancellation that lands as it
    finishes (gh-86296), and the router's stop (and these tests' teardown) waited for it forever."""
    import kvctl.daemon.server.replica_feed as feed
    from kvctl.daemon.server.replica_view import ReplicaView

    monkeypatch.setattr(feed, "RETRY_MIN_S", 60.0)  # the pause lasts until `back`

    async def scenario():
        errors = []
        back = asyncio.Event()
        async with httpx.AsyncClient(transport=Down(), base_url="http://replica") as client:
            task = asyncio.create_task(feed.follow_events(client, ReplicaView(), feed.Tokenizers(), errors.append, back))
            while not errors:
                await asyncio.sleep(0.01)
            back.set()
            task.cancel()
            await asyncio.wait([task], timeout=2)
            still_following = not task.done()
            if still_following:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            return task, errors, still_following

    task, errors, still_following = asyncio.run(scenario())
    assert not still_following and task.cancelled()
    assert errors == ["feed: ConnectError: connection refused"]


def test_a_narrow_terminal_wraps_the_fleet_s_views_and_headers_but_cuts_no_figure_or_name():
    """At 80 columns the table cut "1,436/1,536" to "1,436…" and "follows" to "follo…"."""
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    names = ["/run/kvd-0/kvd.sock", "/run/kvd-1/kvd.sock", "/run/kvd-2/kvd.sock"]
    live = {"blocks": {"device": {"total": 1536, "free": 100}},
            "tokens": {"prompt": 100000, "hit": 90000, "hit_ratio": 0.9},
            "queue": {"waiting": 12, "running": 8, "predicted_wait_seconds": 0.0123},
            "latency": {"ttft_seconds": {"p50": 0.0456}}}
    data = {"routing": "prefix", "view": "events",
            "replica_status": [{"replica": names[0], **live}, {"replica": names[1], **live},
                               {"replica": names[2], "error": "503: cannot serve"}],
            "replicas": [{"replica": names[0], "sent": 12345, "open": 8, "view": {"synced": False, "feed_error": "x"}},
                         {"replica": names[1], "sent": 12345, "open": 8, "view": {"synced": True}},
                         {"replica": names[2], "sent": 3, "open": 0, "draining": "at the replica"}]}
    console = Console(record=True, width=80)
    render_fleet_status(data, console)
    lines = console.export_text().splitlines()
    assert "…" not in "".join(lines)
    rows = [line.split() for line in lines if line.startswith("/run/")]
    assert rows[:2] == [[names[0], "12,345", "8", "asks", "1,436/1,536", "90.0%", "12", "8", "12.3", "ms", "45.6", "ms"],
                        [names[1], "12,345", "8", "follows", "1,436/1,536", "90.0%", "12", "8", "12.3", "ms", "45.6",
                         "ms"]]
    assert rows[2] == [names[2], "3", "0", "at", "the", "down"]  # the view wraps at its spaces
    assert rows[3] == [names[2], "down:", "503:", "cannot", "serve"]
    assert "(feed" in lines[lines.index(next(x for x in lines if x.startswith(names[0]))) + 1]
    wide = Console(record=True, width=120)
    render_fleet_status(data, wide)
    text = wide.export_text()
    assert text.splitlines()[2].split()[:4] == [names[0], "12,345", "8", "asks"] and "asks (feed down)" in text


def test_the_fleet_status_says_what_the_replicas_queue_limits_changed_at_the_router():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    data = {"routing": "ttft", "view": "events", "replica_status": [{"replica": "a", **live}, {"replica": "b", **live}],
            "replicas": [{"replica": "a", "sent": 9, "open": 0},
                         {"replica": "b", "sent": 1, "open": 0, "passed_over": 1200}],
            "timeouts_not_rerouted": 3}
    console = Console(record=True, width=120)
    render_fleet_status(data, console)
    assert ("queue limits: passed over b 1,200x (a predicted wait past its max_queue_wait); 3 queue timeouts with "
            "no other replica in time (the caller got the 503)") in " ".join(console.export_text().split())
    quiet = Console(record=True, width=120)
    render_fleet_status({**data, "replicas": data["replicas"][:1], "timeouts_not_rerouted": 0}, quiet)
    assert "queue limits" not in quiet.export_text()


def test_the_fleet_status_says_which_gpu_each_replica_runs_on():
    """kvd@0 and kvd@1 on one host: a line each under the table, as nvidia-smi numbers the GPUs."""
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}

    def gpu(index, used, busy):
        return [{"index": index, "name": "NVIDIA H200", "uuid": f"GPU-{index}", "memory_used": used * 2**30,
                 "memory_total": 141 * 2**30, "utilization": busy}]

    data = {"routing": "prefix", "replicas": [],
            "replica_status": [{"replica": "/run/kvd-0/kvd.sock", **live, "gpu": gpu(0, 120, 87)},
                               {"replica": "/run/kvd-1/kvd.sock", **live, "gpu": gpu(1, 118.5, 91)},
                               {"replica": "/run/kvd-2/kvd.sock", **live, "gpu": None}]}  # on a CPU
    console = Console(record=True, width=120)
    render_fleet_status(data, console)
    assert [line.strip() for line in console.export_text().splitlines() if " on GPU" in line] == [
        "/run/kvd-0/kvd.sock on GPU 0, NVIDIA H200: 120.0 of 141.0 GiB, 87% busy",
        "/run/kvd-1/kvd.sock on GPU 1, NVIDIA H200: 118.5 of 141.0 GiB, 91% busy"]


def test_the_fleet_status_names_each_replica_started_within_the_hour_and_what_its_start_took():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    start = {"ready_after_seconds": 6.0, "load_seconds": 4.6, "pins_warmed_seconds": None,
             "phases": {"model": 0.03, "cache": 0.001, "tiers": 4.51, "pins": 0.0}}
    data = {"routing": "prefix", "replicas": [],
            "replica_status": [{"replica": "/run/kvd-0/kvd.sock", **live, "start": start, "uptime_seconds": 125.0},
                               {"replica": "/run/kvd-1/kvd.sock", **live, "start": start, "uptime_seconds": 7200.0},
                               {"replica": "/run/kvd-2/kvd.sock", **live}]}  # an older kvd: says neither
    console = Console(record=True, width=200)
    render_fleet_status(data, console)
    text = console.export_text()
    assert ("/run/kvd-0/kvd.sock started 2m ago, ready 6.00 s after its process began (tiers (disk scan) 4.51 s of "
            "it)") in text
    assert "kvd-1/kvd.sock started" not in text and "kvd-2/kvd.sock started" not in text
    data["replica_status"][0]["start"] = {**start, "ready_after_seconds": 10.0}  # most of it before the load
    render_fleet_status(data, console := Console(record=True, width=200))
    assert ("/run/kvd-0/kvd.sock started 2m ago, ready 10.00 s after its process began (before the load 5.40 s of "
            "it)") in console.export_text()


def test_the_fleet_status_names_a_replica_whose_store_is_in_trouble():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    data = {"routing": "prefix", "replicas": [],
            "replica_status": [{"replica": "/run/kvd-0/kvd.sock", **live,
                                "store": {"file_ok": False, "written_back": 0, "audit_write_failures": 3}},
                               {"replica": "/run/kvd-1/kvd.sock", **live,
                                "store": {"file_ok": True, "written_back": 2, "audit_write_failures": 0,
                                          "unstored_rollback": 4, "failing_jobs": ["rollout stop conditions"]}}]}
    console = Console(record=True, width=200)
    render_fleet_status(data, console)
    text = console.export_text()
    assert ("/run/kvd-0/kvd.sock store: its file was replaced under kvd: pins, rollouts and records are refused "
            "until kvd restarts and opens the one there") in text
    assert "/run/kvd-0/kvd.sock audit: 3 records the store could not take are only in kvd's log" in text
    assert "kvd-1/kvd.sock store" not in text and "kvd-1/kvd.sock audit" not in text
    assert ("/run/kvd-1/kvd.sock rollout: kvd rolled rollout 4 back on a stop condition and the store has not taken "
            "that yet: a restart before it does resumes the rollout") in text
    assert ("/run/kvd-1/kvd.sock jobs: failing now: rollout stop conditions (kvd's log says why; each is tried "
            "again)") in text
    assert "kvd-0/kvd.sock rollout" not in text and "kvd-0/kvd.sock jobs" not in text  # an older kvd says nothing


class CannotServe(httpx.AsyncBaseTransport):
    """A kvd that is up but whose model did not load: every call but /healthz gets its 503."""

    async def handle_async_request(self, request):
        return httpx.Response(503, json={"error": {"message": UNLOADED, "type": "service_unavailable"}})


UNLOADED = "ValueError: cache_dtype: fp8_e4m3 has no applied calibration for model revision 773fc439a2da"


def test_a_replica_that_cannot_serve_is_shown_with_its_own_reason_not_httpx_s(replicas):
    """The router reports what the replica said (503 and its message), in its status, its event
    feed's error and its route questions, where it showed httpx's sentence with the URL and a link."""
    from rich.console import Console

    from kvctl.status_view import render_status

    unloaded = Replica("replica-1", replica_client("/run/replica-1.sock", transport=CannotServe()))
    service = RouterService([Replica("replica-0", replica_client("/run/replica-0.sock",
                                                                 transport=Counting(replicas[0]))), unloaded],
                            make_router("round_robin"), view="events", load_interval=0.05)
    app = create_router_app(service)
    status, route = drive(app, [lambda c: c.get("/admin/status"),
                                lambda c: c.post("/router/route", json={"prompt": SYSTEM_A + "Q?"})],
                          service=service, synced=[0])
    assert status.json()["replica_status"][1]["error"] == f"503: {UNLOADED}"
    assert unloaded.feed_error == f"feed: 503: {UNLOADED}"
    assert [row.get("error") for row in route.json()["replicas"]] == [None, f"503: {UNLOADED}"]
    console = Console(record=True, width=200)
    render_status(status.json(), console)
    assert f"replica-1 down: 503: {UNLOADED}" in console.export_text().splitlines()


def test_described_names_an_error_answer_by_its_status_and_the_replica_s_message():
    from kvctl.daemon.server.replica_errors import described

    request = httpx.Request("GET", "http://kvd/admin/status")

    def failed(response):
        try:
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            return described(exc)

    assert failed(httpx.Response(503, json={"error": {"message": "the model is still loading"}},
                                 request=request)) == "503: the model is still loading"
    assert failed(httpx.Response(502, text="Bad gateway\n", request=request)) == "502: Bad gateway"
    assert failed(httpx.Response(500, text="", request=request)) == "500: Internal Server Error"
    assert described(httpx.ConnectError("connection refused")) == "ConnectError: connection refused"
    assert len(failed(httpx.Response(503, text="x" * 900, request=request))) == 300
    # another server at a replica's address: its page's first line, not the whole page
    page = httpx.Response(404, text="<!DOCTYPE HTML>\n<html>\n<p>Error code: 404</p>\n</html>\n",
                          headers={"content-type": "text/html; charset=utf-8"}, request=request)
    assert failed(page) == "404: <!DOCTYPE HTML> (text/html, not kvd's JSON)"
    from kvctl.daemon.server.replica_errors import NotKvd, kvd_json

    with pytest.raises(NotKvd) as plain:  # a 200 that is not JSON: was "JSONDecodeError: Expecting value: ..."
        kvd_json(httpx.Response(200, text="hello\n", headers={"content-type": "text/plain"}, request=request))
    assert described(plain.value) == "200: 'hello' (text/plain), not kvd's JSON: is kvd what listens there?"
    assert kvd_json(httpx.Response(200, json={"a": 1}, request=request)) == {"a": 1}


def test_a_path_the_router_does_not_serve_gets_a_404_that_says_where_to_ask(replicas):
    _, app = router_app(replicas, "round_robin")
    [answer] = drive(app, [lambda c: c.get("/admin/config")])
    message = answer.json()["error"]["message"]
    assert answer.status_code == 404 and message.startswith("kvd router does not serve /admin/config: it serves ")
    assert message.endswith("; ask a replica for the rest (kvctl --socket REPLICA_SOCKET ...)")
    listed = message.split(": it serves ")[1].split(";")[0].replace(" and ", ", ").split(", ")
    # every path it serves (a hand-kept list lacked the newer ones), once each, and only those
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
            "/version", "/admin/trace", "/admin/pins/{pin_id}", "/router/drain", "/metrics", "/healthz",
            "/readyz"} <= set(listed)
    assert len(listed) == len(set(listed)) and "/admin/config" not in listed and "/openapi.json" not in listed
    [drain] = drive(app, [lambda c: c.post("/admin/drain", json={"drain": True})])  # `kvctl drain` at the router
    assert drain.status_code == 404 and drain.json()["error"]["message"].startswith(
        "kvd router does not serve /admin/drain: drain or resume one replica through it with kvctl fleet drain "
        "(or resume) REPLICA (POST /router/drain); it serves ")


@pytest.mark.parametrize("view", ["ask", "events"])
def test_kvd_router_as_an_operator_runs_it_over_two_kvd_processes(tmp_path, view):
    """Real processes: two kvd, then `kvd router` in front of them; prompts sharing a system
    prompt land together, the router stops cleanly on SIGTERM and removes its socket. Its start's
    heap is frozen out of the garbage collector's walks, as kvd's is (not with --no-gc-freeze),
    and its collections are timed."""
    import os
    import signal
    import socket
    import subprocess
    import time

    from .kvd_process import BIN, running_kvd

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_kvd(tmp_path / "a", "--eviction", "lru", "--num-blocks", "512") as (_, client_a, sock_a), \
            running_kvd(tmp_path / "b", "--eviction", "lru", "--num-blocks", "512") as (_, client_b, sock_b):
        front = tmp_path / "router.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        tcp = []
        if view == "events":  # and a TCP front, for callers with a token
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            (tmp_path / "clients").write_text("client-token-0123456789 acme user\n")
            (tmp_path / "clients").chmod(0o600)
            tcp = ["--listen", f"127.0.0.1:{port}", "--clients-file", str(tmp_path / "clients")]
        fleet = ["--replica", str(sock_b)]
        if view == "ask":  # the second replica from a replicas file, which SIGHUP applies again
            (tmp_path / "replicas").write_text(f"# behind this router\n{sock_b}\n")
            fleet = ["--replicas-file", str(tmp_path / "replicas")]
        freeze = ["--no-gc-freeze"] if view == "ask" else []
        patience = ["--silent-give-up-seconds", "45"] if view == "ask" else []
        router = subprocess.Popen([str(BIN / "kvd"), "router", "--replica", str(sock_a), *fleet,
                                   "--socket", str(front), "--view", view, *tcp, *freeze, *patience,
                                   "--log-level", "warning"],
                                  env=env,
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
            names = (str(sock_a), str(sock_b))
            home = home_of(SYSTEM_A + "Q1?", names)  # the prefix's home among these names
            other = names[1 - names.index(home)]
            assert answers[0].headers["x-kvd-replica"] == answers[1].headers["x-kvd-replica"] == home
            assert answers[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert client.get("/v1/models").json()["data"][0]["owned_by"] == "kvd"
            routed = client.get("/router/status").json()
            gc_report = routed["gc"]
            assert routed["silent_give_up_seconds"] == (45.0 if patience else 30.0)
            assert gc_report["watching"] is True and gc_report["slow"] == 0
            metrics = client.get("/metrics").text
            frozen = [float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("kvd_gc_frozen_objects ")]
            status = subprocess.run([str(BIN / "kvctl"), "--socket", str(front), "status"], env=env,
                                    capture_output=True, text=True, timeout=60)
            shown = " ".join(status.stdout.split())  # rich wraps the line at the terminal's width
            if freeze:
                assert gc_report["frozen_objects"] == 0 and gc_report["frozen_at_ready"] is None
                assert frozen == [0.0]
                assert "kvd router's garbage collector: heap not frozen (gc_freeze off);" in shown
            else:  # its imports (fastapi, pydantic, httpx, uvicorn): no torch
                assert 30_000 < gc_report["frozen_objects"] <= gc_report["frozen_at_ready"] < 200_000
                assert 30_000 < frozen[0] <= gc_report["frozen_at_ready"]
                assert "kvd router's garbage collector: start's heap frozen (" in shown, status.stdout
            assert 'kvd_gc_pause_seconds_count{generation="0"}' in metrics
            os.unlink(front)  # removed under the router: it binds the socket again
            while not front.exists():
                assert time.monotonic() < deadline + 20 and router.poll() is None
                time.sleep(0.05)
            with httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(uds=str(front)),
                              timeout=60) as fresh:
                assert fresh.get("/healthz").status_code == 200
            # a caller that leaves a non-streamed request: the router closes it, and the replica stops
            with httpx.Client(base_url="http://router", transport=httpx.HTTPTransport(uds=str(front)),
                              timeout=1.0) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    impatient.post("/v1/completions", json={"prompt": "a long story, please", "max_tokens": 6000,
                                                            "ignore_eos": True})
            for _ in range(30):  # 6,000 tokens take this VM 9 s or more
                busy = [c.get("/admin/status").json()["queue"]["running"] for c in (client_a, client_b)]
                if busy == [0, 0]:
                    break
                time.sleep(0.1)
            assert busy == [0, 0]
            if view == "ask":  # kvctl fleet drain: the prompt's next question goes to the other replica
                kvctl = [str(BIN / "kvctl"), "--socket", str(front), "fleet"]
                drained = subprocess.run([*kvctl, "drain", home, "--wait", "10"], env=env, capture_output=True,
                                         text=True, timeout=60)
                assert drained.returncode == 0, drained.stderr
                assert drained.stdout.strip() == f"drained {home}: no new request goes there; none open: it can be stopped"
                moved = client.post("/v1/completions", json={"prompt": SYSTEM_A + "Q5?", "max_tokens": 2})
                assert moved.status_code == 200 and moved.headers["x-kvd-replica"] == other
                resumed = subprocess.run([*kvctl, "resume", home], env=env, capture_output=True, text=True,
                                         timeout=60)
                assert resumed.stdout.strip() == f"resumed {home}: it takes new requests again"
                unknown = subprocess.run([*kvctl, "drain", "/run/nowhere.sock"], env=env, capture_output=True,
                                         text=True, timeout=60)
                assert unknown.returncode == 2 and "replica: no replica '/run/nowhere.sock'" in unknown.stderr
                # the replicas file loses its line: on SIGHUP the replica leaves the fleet
                (tmp_path / "replicas").write_text("# none for now\n")
                router.send_signal(signal.SIGHUP)
                while len(client.get("/router/status").json()["replicas"]) != 1:
                    assert time.monotonic() < deadline + 60
                    time.sleep(0.05)
                assert [r["replica"] for r in client.get("/router/status").json()["replicas"]] == [str(sock_a)]
            if view == "events":  # it follows both feeds; the replica that served holds the prompt's blocks
                while not all(r["view"]["synced"] for r in client.get("/router/status").json()["replicas"]):
                    assert time.monotonic() < deadline + 30
                    time.sleep(0.05)
                rows = {r["replica"]: r for r in client.get("/router/status").json()["replicas"]}
                assert rows[home]["view"]["device_keys"] > 0 and rows[home]["view"]["feed_error"] is None
                # kvctl route --router: the router's own view, and where it would send the next question
                shown = subprocess.run([str(BIN / "kvctl"), "route", "--router", str(front), "--routing", "ttft",
                                        "--json", SYSTEM_A + "Q4?"], env=env, capture_output=True, text=True,
                                       timeout=60)
                assert shown.returncode == 0, shown.stderr
                what_if = json.loads(shown.stdout)
                assert list(what_if["routes"]) == ["prefix", "ttft"]
                assert what_if["routes"]["prefix"]["replica"] == home
                assert [r["source"] for r in what_if["replicas"]] == ["view", "view"]
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as remote:
                    assert remote.get("/v1/models").status_code == 401
                    answer = remote.post("/v1/completions", json={"prompt": SYSTEM_A + "Q3?", "max_tokens": 2},
                                         headers={"Authorization": "Bearer client-token-0123456789"})
                    # served, under acme: none of the default tenant's blocks are acme's
                    assert answer.status_code == 200
                    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                    # token rotation: SIGHUP reloads the clients file, the old token stops working
                    (tmp_path / "clients").write_text("rotated-token-0123456789 acme user\n")
                    router.send_signal(signal.SIGHUP)
                    rotated = {"Authorization": "Bearer rotated-token-0123456789"}
                    while remote.get("/v1/models", headers=rotated).status_code != 200:
                        assert time.monotonic() < deadline + 60
                        time.sleep(0.05)
                    old = {"Authorization": "Bearer client-token-0123456789"}
                    assert remote.get("/v1/models", headers=old).status_code == 401
        finally:
            client.close()
            router.send_signal(signal.SIGTERM)
            assert router.wait(30) == 0
        assert not front.exists()
        log = (tmp_path / "router.log").read_text()
        assert "Traceback" not in log and "leaked" not in log


def test_kvd_router_refuses_bad_settings_by_name(tmp_path):
    from typer.testing import CliRunner

    from kvctl.daemon.cli import app

    runner = CliRunner()
    cases = [(["--replica", "/a.sock"], "kvd: error: replicas: give two or more (--replica, repeated; replicas: in "
                                        "the file), or a replicas_file, got 1"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--routing", "random"],
              "kvd: error: routing: invalid value 'random' from --routing: must be one of round_robin, "
              "least_loaded, prefix, ttft"),
             (["--replica", "/a.sock", "--replica", "http://10.0.0.2:8000"],
              "kvd: error: replica: 'http://10.0.0.2:8000' is reached over TCP and needs --token-file"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--listen", "127.0.0.1:8090"],
              "kvd: error: clients_file: --listen needs the TCP callers' tokens (--clients-file)"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--listen", "8090", "--clients-file", "/x"],
              "kvd: error: listen: invalid value '8090' from --listen: must be HOST:PORT"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--replica", "/a.sock"],
              "kvd: error: replica: '/a.sock' is given twice; each replica once"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--new-prefix-slack", "-1"],
              "kvd: error: new_prefix_slack: invalid value -1 from --new-prefix-slack: must be >= 0"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--queue-limits", "obey"],
              "kvd: error: queue_limits: invalid value 'obey' from --queue-limits: must be one of heed, ignore"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--view", "gossip"],
              "kvd: error: view: invalid value 'gossip' from --view: must be events or ask"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--view", "events", "--load-interval", "0"],
              "kvd: error: load_interval: invalid value 0.0 from --load-interval: must be > 0"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--silent-give-up-seconds", "-5"],
              "kvd: error: silent_give_up_seconds: invalid value -5.0 from --silent-give-up-seconds: must be >= 0 "
              "(0: never give a request up)"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--silent-probe-seconds", "0"],
              "kvd: error: silent_probe_seconds: invalid value 0.0 from --silent-probe-seconds: must be > 0"),
             (["--replica", "/a.sock", "--replica", "/b.sock", "--gc-warn-seconds", "-1"],
              "kvd: error: gc_warn_seconds: invalid value -1.0 from --gc-warn-seconds: must be >= 0 (0: no warning)"),
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


SYSTEM_C = homed("You route requests across replicas by what each one caches; answer with one replica name. " * 3,
                 "replica-0")
SYSTEM_D = homed("You summarise eviction logs for on-call operators in two sentences, never more than that. " * 3,
                 "replica-1")
SYSTEM_E = homed("You explain the cost of recomputing a prompt prefix against restoring it from a lower tier. " * 3,
                 "replica-0")
SYSTEM_F = homed("Keep answers to one line; name the tier a block lives in and why it moved there last. " * 3,
                 "replica-1")


def routed_cached(answer) -> int:
    """The cached tokens the router counted for the replica it chose (its X-KVD-Route reason)."""
    reason = answer.headers["x-kvd-route"]
    assert reason.startswith("caches "), reason
    return int(reason.split()[1])


def test_the_events_view_routes_with_no_question_on_the_requests_path_and_counts_as_kvd_does(replicas):
    service, app = router_app(replicas, "prefix", view="events")

    async def settled(client):
        await until_followed(service, (0, 1), settled=True)

    answers = drive(app, [lambda c: post(c, SYSTEM_C + "Q1?"), settled, lambda c: post(c, SYSTEM_C + "Q2?"),
                          lambda c: post(c, SYSTEM_D + "Q1?"), settled, lambda c: post(c, SYSTEM_D + "Q2?"),
                          lambda c: post(c, SYSTEM_C + "Q3?"), lambda c: c.get("/metrics")], service=service)
    scraped = answers.pop()
    answers = [a for a in answers if a is not None]
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.headers["x-kvd-replica"] for a in answers] == [
        "replica-0", "replica-0", "replica-1", "replica-1", "replica-0"]
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == cached[2] == 0
    # the router hashed the prompts itself, from the replicas' tokenizer and namespace and their
    # feeds: what it counted is what the replica then found
    assert [routed_cached(answers[i]) for i in (1, 3, 4)] == [cached[1], cached[3], cached[4]]
    assert all(c > 0 for c in (cached[1], cached[3], cached[4]))
    assert [r.client._transport.prompt_questions for r in service.replicas] == [0, 0]
    status = service.status()
    assert status["view"] == "events"
    assert [(r["sent"], r["view"]["synced"], r["view"]["feed_error"]) for r in status["replicas"]] == [
        (3, True, None), (2, True, None)]
    assert all(r["view"]["device_keys"] > 0 for r in status["replicas"])

    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped.text) for s in family.samples}

    def per_replica(name, values):
        return [samples[name, (("replica", f"replica-{i}"),)] for i in range(len(values))] == values

    usage = [a.json()["usage"] for a in answers]
    assert per_replica("kvd_router_requests_total", [3, 2])
    assert per_replica("kvd_router_prompt_tokens_total", [sum(usage[i]["prompt_tokens"] for i in (0, 1, 4)),
                                                          sum(usage[i]["prompt_tokens"] for i in (2, 3))])
    assert per_replica("kvd_router_cached_tokens_total", [cached[1] + cached[4], cached[3]])
    assert samples["kvd_router_questions_total", (("replica", "replica-0"), ("result", "ok"))] == 0
    assert per_replica("kvd_router_view_synced", [1, 1]) and per_replica("kvd_router_view_snapshots_total", [1, 1])
    assert samples["kvd_router_decision_seconds_count", ()] == 5 and samples["kvd_router_unrouted_total", ()] == 0


def test_a_burst_sharing_a_new_prefix_goes_to_one_replica_by_its_home_or_what_the_view_counts(replicas):
    def burst(system):
        return lambda client: asyncio.gather(*(post(client, system + q) for q in ("Q1?", "Q2?", "Q3?")))

    service, app = router_app(replicas, "prefix", view="ask", hold_until=3)
    [asked] = drive(app, [burst(SYSTEM_E)])
    # asked at once (each replica answers all three questions before serving any), no replica
    # holds the prefix yet: each goes to the prefix's home
    assert {a.headers["x-kvd-replica"] for a in asked} == {"replica-0"}
    assert {a.headers["x-kvd-route"].split(":")[0] for a in asked} == {"no replica caches its prefix"}

    service, app = router_app(replicas, "prefix", view="events")
    [followed] = drive(app, [burst(SYSTEM_F)], service=service)
    # the first one sent counts as cached where it went, until that replica's feed says
    assert len({a.headers["x-kvd-replica"] for a in followed}) == 1
    assert [a.headers["x-kvd-route"].split()[0] for a in followed] == ["no", "caches", "caches"]


def test_the_events_view_asks_a_replica_it_cannot_follow_and_leaves_out_one_that_is_down(replicas):
    service, app = router_app(replicas, "least_loaded", down=(0,), view="events")
    [answer] = drive(app, [lambda c: post(c, SYSTEM_D + "Q8?")], service=service, synced=(1,))
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-1"
    row = service.status()["replicas"][0]
    assert row["view"]["synced"] is False and row["view"]["feed_error"].startswith("feed: ConnectError")
    assert row["last_error"].startswith("ConnectError: connection refused")  # asked, as the view could not say
    assert service.replicas[1].client._transport.prompt_questions == 0

    service, app = router_app(replicas, "least_loaded", down=(0, 1), view="events")
    [answer] = drive(app, [lambda c: post(c, "anything")], service=service, synced=())
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == (
        "no replica answered: replica-0 (ConnectError: connection refused); "
        "replica-1 (ConnectError: connection refused)")


def test_the_events_view_forwards_a_prompt_it_cannot_hash_and_the_replica_refuses_it(replicas):
    service, app = router_app(replicas, "prefix", view="events")
    answers = drive(app, [lambda c: post(c, [1, 2, -5]), lambda c: post(c, {"not": "a prompt"})], service=service)
    assert [a.status_code for a in answers] == [400, 400]
    assert [a.json()["error"]["param"] for a in answers] == ["prompt", "prompt"]
    assert [r.client._transport.prompt_questions for r in service.replicas] == [0, 0]


def test_a_replica_serves_its_tokenizer_with_the_digest_its_keys_are_made_under(replicas):
    from kvctl.daemon.model.tokenizer import Tokenizer

    [served, snapshot] = drive(replicas[0], [lambda c: c.get("/admin/tokenizer"),
                                             lambda c: c.get("/admin/events/snapshot")])
    body = served.json()
    tokenizer = Tokenizer.from_texts(body["tokenizer_json"], body["tokenizer_config_json"])
    assert tokenizer.digest == body["digest"] == snapshot.json()["namespace"]["tokenizer_digest"]
    [facts] = drive(replicas[0], [lambda c: c.post("/admin/route-facts", json={"text": SYSTEM_A})])
    assert len(tokenizer.encode(SYSTEM_A)) == facts.json()["prompt_tokens"]



def test_the_events_view_weighs_a_long_prompt_in_a_worker_thread_as_it_weighs_a_short_one(replicas, monkeypatch):
    import threading

    from kvctl.daemon.server import router_service

    monkeypatch.setattr(router_service, "LARGE_PROMPT", 8)
    service, app = router_app(replicas, "prefix", view="events")
    threads = []
    weigh = service.weigh_locally
    monkeypatch.setattr(service, "weigh_locally", lambda *a: threads.append(threading.current_thread()) or weigh(*a))
    system = "Long prompts are hashed in a worker thread so the loop keeps streaming answers meanwhile. " * 2
    answers = drive(app, [lambda c: post(c, system + "Q1?"), lambda c: until_followed(service, (0, 1), settled=True),
                          lambda c: post(c, system + "Q2?"), lambda c: post(c, "hi")], service=service)
    assert [answers[i].status_code for i in (0, 2, 3)] == [200, 200, 200]
    assert routed_cached(answers[2]) == answers[2].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    main = threading.main_thread()
    assert [t is main for t in threads] == [False] * 4 + [True] * 2  # two replicas each; "hi" is short
    assert [r.client._transport.prompt_questions for r in service.replicas] == [0, 0]


def test_the_tcp_front_needs_a_token_and_routes_each_caller_under_its_tokens_tenant(replicas):
    from kvctl.daemon.server.auth import TokenEntry, TokenTable

    tokens = TokenTable([TokenEntry(b"u" * 24, "acme", "user", "token:1"),
                         TokenEntry(b"a" * 24, "ops", "admin", "token:2")])
    service, _ = router_app(replicas, "prefix", view="events")
    app = create_router_app(service, front="tcp", tokens=tokens)
    user, admin = {"Authorization": "Bearer " + "u" * 24}, {"Authorization": "Bearer " + "a" * 24}
    system = "Tenants never share cached blocks unless told to; the router keeps to that as kvd does. " * 2

    answers = drive(app, [
        lambda c: c.post("/v1/completions", json={"prompt": system, "max_tokens": 1}),
        lambda c: c.post("/v1/completions", json={"prompt": system, "max_tokens": 1},
                         headers={"Authorization": "Bearer nope-nope-nope-nope"}),
        lambda c: c.get("/router/status", headers=user),
        lambda c: c.get("/metrics", headers=admin),
        lambda c: c.get("/healthz"),
        # a caller naming another tenant is still served as its token's
        lambda c: c.post("/v1/completions", json={"prompt": system + "Q1?", "max_tokens": 1},
                         headers={**user, "X-KVD-Tenant": "globex"}),
        lambda c: until_followed(service, (0, 1), settled=True),
        lambda c: c.post("/v1/completions", json={"prompt": system + "Q2?", "max_tokens": 1}, headers=user),
    ], service=service)
    assert [answers[i].status_code for i in range(5)] == [401, 401, 403, 200, 200]
    assert answers[0].json()["error"]["message"] == "missing bearer token"
    assert answers[1].json()["error"]["message"] == "invalid bearer token"
    assert answers[2].json()["error"]["message"] == "this endpoint needs the admin role"
    served, again = answers[5], answers[7]
    assert served.status_code == again.status_code == 200
    replica = int(served.headers["x-kvd-replica"][-1])
    assert again.headers["x-kvd-replica"] == served.headers["x-kvd-replica"]
    assert routed_cached(again) == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    facts = drive(replicas[replica], [lambda c, t=t: c.post("/admin/route-facts", json={"text": system + "Q3?",
                                                                                       "tenant": t})
                                      for t in ("acme", "globex", "default")])
    assert [f.json()["cached_tokens"] > 0 for f in facts] == [True, False, False]
    # what changes the fleet or every replica's cache needs the admin role: a user's token is refused
    refused = drive(app, [lambda c: c.post("/router/drain", json={"replica": "replica-0"}, headers=user),
                          lambda c: c.post("/admin/evict", json={"tenant": "acme"}, headers=user),
                          lambda c: c.post("/admin/pins", json={"text": system, "tenant": "acme"}, headers=user),
                          lambda c: c.delete("/admin/pins/pin-0000000000000000", headers=user),
                          lambda c: c.get("/admin/pins", headers=user),
                          lambda c: c.get("/admin/prefixes", headers=user)])
    assert [r.status_code for r in refused] == [403] * 6 and not service.replicas[0].draining


def test_the_events_view_takes_up_a_replica_again_when_it_comes_back(replicas, monkeypatch):
    """A replica down at the start is asked per request (and left out); once it answers, the
    router's follower takes a snapshot and routes to it from its feed again, at once: the load
    poll answering again ends the follower's pause (here a minute, longer than the test waits)."""
    import kvctl.daemon.server.replica_feed as feed

    monkeypatch.setattr(feed, "RETRY_MIN_S", 60.0)
    monkeypatch.setattr(feed, "RETRY_MAX_S", 60.0)

    class Switch(httpx.AsyncBaseTransport):
        def __init__(self, app) -> None:
            self.up, self.inner = False, Counting(app)

        async def handle_async_request(self, request):
            if not self.up:
                raise httpx.ConnectError("connection refused", request=request)
            return await self.inner.handle_async_request(request)

    service, app = router_app(replicas, "least_loaded", view="events")
    switch = Switch(replicas[0])
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=switch)

    async def back(client):
        assert service.replicas[0].feed_error.startswith("feed: ConnectError")
        switch.up = True
        await until_followed(service, (0,))

    answers = drive(app, [lambda c: post(c, SYSTEM_B + "Q20?"), back, lambda c: c.get("/router/status")],
                    service=service, synced=(1,))
    assert answers[0].headers["x-kvd-replica"] == "replica-1"  # the only one answering
    row = answers[2].json()["replicas"][0]
    assert row["view"]["synced"] and row["view"]["feed_error"] is None
    assert service.replicas[0].snapshots == 1


@pytest.mark.parametrize("view", ["ask", "events"])
def test_a_request_naming_a_model_goes_only_where_that_model_is_served(replicas, tmp_path, view):
    other = start_service(tmp_path, num_blocks=64, model_name="kvd-other")
    try:
        apps = [replicas[0], create_app(other, other.metrics, front="unix")]
        service, app = router_app(apps, "round_robin", view=view)
        [listed] = drive(replicas[0], [lambda c: c.get("/v1/models")])
        demo = listed.json()["data"][0]["id"]
        answers = drive(app, [lambda c: c.get("/v1/models")] + [
            lambda c, m=m: post(c, SYSTEM_A + "Q30?", model=m) for m in ("kvd-other", "kvd-other", demo, demo, "nope")],
            service=service if view == "events" else None)
        assert sorted(m["id"] for m in answers[0].json()["data"]) == sorted([demo, "kvd-other"])
        assert [a.status_code for a in answers[1:]] == [200, 200, 200, 200, 404]
        # round robin would alternate: the model decides instead
        assert [a.headers["x-kvd-replica"] for a in answers[1:5]] == ["replica-1", "replica-1", "replica-0", "replica-0"]
        assert [a.json()["model"] for a in answers[1:5]] == ["kvd-other", "kvd-other", demo, demo]
        assert answers[5].json()["error"] == {
            "message": f"model: 'nope' is not served by any replica; GET /v1/models lists {', '.join(repr(m) for m in sorted([demo, 'kvd-other']))}",
            "type": "router_error", "param": None, "code": "model_not_found"}
    finally:
        other.shutdown(deadline=2)


def test_the_router_lists_a_model_with_the_least_max_model_len_of_its_replicas(replicas, tmp_path):
    """A client sizes its request to max_model_len: at the router, it must fit every replica; its
    status names the difference (fleet_differences.py), among the replicas that answer."""
    from rich.console import Console

    from kvctl.status_view import render_status

    capped = start_service(tmp_path, num_blocks=64, max_model_len=512)
    try:
        service, app = router_app([replicas[0], create_app(capped, capped.metrics, front="unix")], "round_robin")
        [alone] = drive(replicas[0], [lambda c: c.get("/v1/models")])
        assert alone.json()["data"][0]["max_model_len"] == 8192
        [listed] = drive(app, [lambda c: c.get("/v1/models")])
        model = alone.json()["data"][0]["id"]
        assert [(m["id"], m["max_model_len"]) for m in listed.json()["data"]] == [(model, 512)]
        one, none = drive(app, [lambda c: c.get(f"/v1/models/{model}"), lambda c: c.get("/v1/models/nope")])
        assert one.json() == listed.json()["data"][0]
        assert none.status_code == 404 and none.json()["error"]["message"] == (
            f"model: 'nope' is not served by any replica; GET /v1/models lists {model!r}")
        [status] = drive(app, [lambda c: c.get("/admin/status")])
        assert status.json()["differences"] == [
            {"field": "model.max_model_len", "label": "context limit", "why": "a long request fits some of them only",
             "model": model, "values": [{"value": "512 tokens", "replicas": ["replica-1"]},
                                        {"value": "8,192 tokens", "replicas": ["replica-0"]}],
             "held": "512 tokens on replica-1; 8,192 tokens on replica-0"}]
        console = Console(record=True, width=200)
        render_status(status.json(), console)
        assert ("replicas differ in context limit (a long request fits some of them only): 512 tokens on replica-1; "
                "8,192 tokens on replica-0") in console.export_text()
        # the same software everywhere (one process), and the capped replica down: no difference among the rest
        _, same = router_app([*replicas, create_app(capped, capped.metrics, front="unix")], "round_robin", down=(2,))
        [status] = drive(same, [lambda c: c.get("/admin/status")])
        assert status.json()["differences"] == [] and "error" in status.json()["replica_status"][2]
    finally:
        capped.shutdown(deadline=2)


def test_a_request_the_only_replica_of_its_model_refuses_gets_that_refusal_not_a_model_not_found(replicas, tmp_path):
    """Replicas of two models; the one serving the requested model turns it away (429, its queue
    full). No other replica serves that model, so the retry found none: the router answered 404
    "not served by any replica" for a model GET /v1/models lists. The caller gets the replica's
    429 as it came, with its Retry-After, to try again."""
    other = start_service(tmp_path, num_blocks=64, model_name="kvd-other")
    try:
        service, app = router_app([replicas[0], create_app(other, other.metrics, front="unix")], "round_robin")
        service.replicas[1].client = replica_client("/run/replica-1.sock", transport=Refusing(
            create_app(other, other.metrics, front="unix"), 429))
        [answer] = drive(app, [lambda c: post(c, SYSTEM_A + "Q31?", model="kvd-other")])
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["message"] == "queue full"
        assert answer.headers["x-kvd-tried"] == "replica-1 (429)"
        assert list(service.untraced) == []  # replica-1 keeps a line of it, as turned away
    finally:
        other.shutdown(deadline=2)


@pytest.mark.parametrize("view", ["ask", "events"])
def test_a_prefix_moved_to_a_replicas_host_tier_still_draws_its_requests_there(tmp_path, view):
    """Replica 0 computed a prompt, then an operator moved the prefix to its host tier: the
    router (asking, or following both feeds) still sends the next question there, counts the
    tokens the host tier holds as the replica does, and the replica restores them."""
    services = [start_service(tmp_path / f"r{i}", num_blocks=64, host_cache_bytes="4MiB", tiering="always")
                for i in range(2)]
    try:
        apps = [create_app(s, s.metrics, front="unix") for s in services]
        service, app = router_app(apps, "prefix", view=view)
        system = homed("Blocks moved to the host tier are restored, not recomputed; route to where they are!! " * 3,
                       "replica-0")

        async def swap_down(client):
            if view == "events":
                await until_followed(service, (0, 1), settled=True)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[0]), base_url="http://kvd") as kvd:
                [row] = [r for r in (await kvd.get("/admin/prefixes")).json()["prefixes"]]
                moved = await kvd.post("/admin/swap", json={"prefix": row["prefix_id"], "to": "host"})
                assert moved.status_code == 200, moved.text
                facts = (await kvd.post("/admin/route-facts", json={"text": system + "Q2?"})).json()
            followed = service.replicas[0].view
            deadline = time.monotonic() + 20
            while view == "events" and (followed.keys or not followed.lower.get("host")):  # its feed tells the router
                assert time.monotonic() < deadline, (f"the router's view of replica 0 after the swap: {len(followed.keys)} "
                                                     f"device keys, {followed.lower}; "
                                                     f"{service.status()['replicas'][0]['view']}")
                await asyncio.sleep(0.02)
            if view == "events":
                shown = service.status()["replicas"][0]["view"]
                assert shown["device_keys"] == 0 and shown["lower_tier_keys"]["host"] == len(followed.lower["host"])
            return facts

        first, facts, second = drive(app, [lambda c: post(c, system + "Q1?"), swap_down,
                                           lambda c: post(c, system + "Q2?")],
                                     service=service if view == "events" else None)
        assert first.headers["x-kvd-replica"] == "replica-0"
        assert facts["cached_tokens"] == 0 and facts["lower_tier_tokens"]["host"] > 0
        held = facts["lower_tier_tokens"]["host"]
        assert second.headers["x-kvd-replica"] == "replica-0"
        assert second.headers["x-kvd-route"] == f"caches 0 of its {facts['prompt_tokens']} tokens and {held} more " \
                                                "in a lower tier"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held  # restored, not recomputed
    finally:
        for s in services:
            s.shutdown(deadline=2)


def test_every_metric_the_router_dashboard_charts_is_exported(replicas):
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parent.parent / "examples" / "grafana" / "kvd-router.json").read_text())
    wanted = {name for panel in dashboard["panels"] for target in panel["targets"]
              for name in re.findall(r"kvd_(?:router|gc)_[a-z_]+", target["expr"])}
    assert {"kvd_router_cached_tokens_total", "kvd_router_view_synced", "kvd_router_decision_seconds_bucket",
            "kvd_gc_pause_seconds_bucket"} <= wanted
    service, app = router_app(replicas, "prefix", view="events")
    service.gc_pauses.install()  # as kvd router does
    try:
        [_, scraped] = drive(app, [lambda c: post(c, SYSTEM_B + "Q40?"), lambda c: c.get("/metrics")],
                             service=service)
    finally:
        service.gc_pauses.uninstall()
    text = scraped.text
    exported = set(re.findall(r"^(kvd_(?:router|gc)_[a-z_]+)", text, re.MULTILINE))
    assert sorted(wanted - exported) == []


class Refusing(httpx.AsyncBaseTransport):
    """A replica that answers its questions but refuses completions, as a stopping kvd (503) or
    one whose queue is full (429) does, or cannot be connected to for them ("unreachable")."""

    def __init__(self, app, answer) -> None:
        self.inner, self.answer, self.completions = httpx.ASGITransport(app=app), answer, 0

    async def handle_async_request(self, request):
        if request.url.path != "/v1/completions" or self.answer is None:
            return await self.inner.handle_async_request(request)
        self.completions += 1
        if self.answer == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        body = {"error": {"message": "kvd is shutting down" if self.answer == 503 else "queue full",
                          "type": "x", "param": None, "code": None}}
        return httpx.Response(self.answer, json=body, headers={"Retry-After": "1"} if self.answer == 429 else {})


@pytest.mark.parametrize("refusal", [503, 429, "unreachable"])
def test_a_request_a_replica_refuses_before_starting_it_goes_to_the_next_best(replicas, refusal):
    service, app = router_app(replicas, "round_robin")
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=Refusing(replicas[0], refusal))
    [answer, scraped] = drive(app, [lambda c: post(c, SYSTEM_B + "Q50?"), lambda c: c.get("/metrics")])
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-1"
    assert answer.headers["x-kvd-tried"] == f"replica-0 ({refusal})"
    assert len(answer.json()["choices"][0]["token_ids"]) == 3
    assert 'kvd_router_rerouted_total{replica="replica-0"} 1.0' in scraped.text.splitlines()


class Failing(httpx.AsyncBaseTransport):
    """A replica whose completions fail with `error` (an httpx exception class) the first `times`."""

    def __init__(self, app, error, times=1) -> None:
        self.inner, self.error, self.times, self.completions = httpx.ASGITransport(app=app), error, times, 0

    async def handle_async_request(self, request):
        if request.url.path == "/v1/completions":
            self.completions += 1
            if self.completions <= self.times:
                raise self.error("Server disconnected without sending a response.", request=request)
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize("error", [httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError])
def test_a_connection_closed_before_any_answer_goes_to_another_replica_once(replicas, error):
    """A pooled connection the replica closed as the request went out (a restart without a drain)
    or a replica that went down: the caller has nothing yet, so the request goes elsewhere, once."""
    service, app = router_app(replicas, "round_robin")
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=Failing(replicas[0], error))
    [answer, scraped] = drive(app, [lambda c: post(c, SYSTEM_B + "Q52?", stream=True), lambda c: c.get("/metrics")])
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-1"
    assert answer.headers["x-kvd-tried"] == "replica-0 (closed before answering)"
    assert sse_events(answer)[-1] == "[DONE]"
    lines = scraped.text.splitlines()
    assert 'kvd_router_rerouted_total{replica="replica-0"} 1.0' in lines
    assert 'kvd_router_forward_failures_total{replica="replica-0"} 0.0' in lines


def test_a_second_closed_connection_or_a_timeout_is_a_502_and_never_another_run(replicas):
    service, app = router_app(replicas, "round_robin")
    for i in (0, 1):
        service.replicas[i].client = replica_client(f"/run/replica-{i}.sock",
                                                    transport=Failing(replicas[i], httpx.RemoteProtocolError))
    [answer] = drive(app, [lambda c: post(c, SYSTEM_B + "Q53?")])
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "replica_failed"
    assert answer.json()["error"]["message"] == ("replica replica-1 failed: RemoteProtocolError: Server "
                                                 "disconnected without sending a response.")
    assert [r.client._transport.completions for r in service.replicas] == [1, 1]
    assert [r.failed_forwards for r in service.replicas] == [0, 1]
    # a timeout: it may be running the request (a long queue): not sent again
    service, app = router_app(replicas, "round_robin")
    service.replicas[0].client = replica_client("/run/replica-0.sock",
                                                transport=Failing(replicas[0], httpx.ReadTimeout))
    [answer] = drive(app, [lambda c: post(c, SYSTEM_B + "Q54?")])
    assert answer.status_code == 502 and "ReadTimeout" in answer.json()["error"]["message"]
    assert [r.client._transport.completions if isinstance(r.client._transport, Failing) else None
            for r in service.replicas] == [1, None] and service.replicas[1].sent == 0


def refused_lines(caplog) -> list[dict]:
    """kvd router's log lines for requests no replica took (log_requests), their fields."""
    return [r.fields for r in caplog.records if (getattr(r, "fields", None) or {}).get("event") == "route_refused"]


def test_when_every_replica_refuses_the_caller_gets_the_last_refusal_as_it_came(replicas, caplog):
    service, app = router_app(replicas, "round_robin")
    service.log_requests = True
    for i in (0, 1):
        service.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=Refusing(replicas[i], 429))
    with caplog.at_level("INFO", logger="kvd.router"):
        [answer] = drive(app, [lambda c: post(c, SYSTEM_B + "Q51?", user="quarterly")])
    assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["message"] == "queue full"
    assert answer.headers["x-kvd-tried"] == "replica-0 (429); replica-1 (429)"
    assert "x-kvd-not-rerouted" not in answer.headers  # it went as far as it could
    assert [r.client._transport.completions for r in service.replicas] == [1, 1]  # each asked once
    [line] = refused_lines(caplog)
    assert {k: v for k, v in line.items() if k != "route_id"} == {
        "event": "route_refused", "tenant": "default", "path": "/v1/completions", "status": 429,
        "tried": "replica-0 (429); replica-1 (429)", "why": "no replica left to try"}
    assert not any("Q51" in r.getMessage() or "quarterly" in r.getMessage() for r in caplog.records)


class Behind(httpx.AsyncBaseTransport):
    """A replica whose route-facts say it is `wait` seconds behind, with a max_queue_wait of `limit`;
    with `times_out`, it turns every completion away as kvd does one that waited past its limit."""

    def __init__(self, app, wait: float, limit: float | None, times_out: bool = False) -> None:
        self.inner, self.wait, self.limit = httpx.ASGITransport(app=app), wait, limit
        self.times_out, self.completions = times_out, 0

    async def handle_async_request(self, request):
        if request.url.path == "/v1/completions":
            self.completions += 1
            if self.times_out:
                body = {"error": {"message": f"request waited {self.limit:g} s without being admitted",
                                  "type": "server_error", "param": None, "code": "queue_timeout"}}
                return httpx.Response(503, json=body, headers={"Retry-After": "1"})
        answer = await self.inner.handle_async_request(request)
        if request.url.path != "/admin/route-facts":
            return answer
        facts = json.loads(await answer.aread())
        facts.update(predicted_wait_seconds=self.wait, max_queue_wait_seconds=self.limit)
        return httpx.Response(200, json=facts)


@pytest.mark.parametrize("view", ["ask", "events"])
def test_the_router_passes_over_a_replica_predicted_past_its_max_queue_wait(replicas, view):
    """A new prompt's home is replica-0; both replicas say they are 30 s behind, replica-0 with a
    10 s limit: the prompt goes to replica-1 (no limit), the reason naming what was passed over.
    With queue_limits ignore, or within the limit, it goes home as before."""
    def routed(limit, queue_limits="heed"):
        # a prompt neither replica holds, whose home is replica-0
        fresh = homed(f"{view} {queue_limits} {limit}: a queue-limit question never asked before here. " * 5,
                      "replica-0")
        service, app = router_app(replicas, "prefix", view=view)
        service.router = make_router("prefix", queue_limits=queue_limits)
        for i, wait in ((0, 30.0), (1, 30.0)):
            service.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=Behind(
                replicas[i], wait, limit if i == 0 else None))
        [answer, scraped] = drive(app, [lambda c: post(c, fresh), lambda c: c.get("/metrics")],
                                  service=service if view == "events" else None)
        assert answer.status_code == 200
        lines = scraped.text.splitlines()
        passed = [line for line in lines if line.startswith("kvd_router_passed_over_total{")]
        assert passed == [f'kvd_router_passed_over_total{{replica="replica-{i}"}} {float(n)}' for i, n in (
            (0, [r.passed_over for r in service.replicas][0]), (1, 0))]
        return answer.headers["x-kvd-replica"], answer.headers["x-kvd-route"], service.replicas[0].passed_over

    assert routed(10.0) == ("replica-1", "no replica caches its prefix: its home (the first by its hash within the "
                                         "load bound); passed over replica-0 (predicted wait 30.00 s, past its "
                                         "max_queue_wait 10 s)", 1)
    assert routed(10.0, "ignore")[::2] == routed(60.0)[::2] == ("replica-0", 0)


class BehindWithOwnLimits(Behind):
    """Behind, where tenants have queue wait limits of their own (kvd's tenant_queue_waits): a
    prompt's route-facts give its tenant's limit, and a load poll every tenant's."""

    def __init__(self, app, wait: float, limit: float | None, own: dict[str, float]) -> None:
        super().__init__(app, wait, limit)
        self.own = own

    async def handle_async_request(self, request):
        answer = await super().handle_async_request(request)
        if request.url.path != "/admin/route-facts":
            return answer
        facts, asked = json.loads(await answer.aread()), json.loads(request.content)
        if asked.get("tokens") != [] and asked.get("tenant") in self.own:
            facts["max_queue_wait_seconds"] = self.own[asked["tenant"]] or None
        facts["tenant_queue_waits"] = self.own
        return httpx.Response(200, json=facts)


@pytest.mark.parametrize("view", ["ask", "events"])
def test_the_router_weighs_a_request_against_its_tenant_s_own_queue_wait_limit(replicas, view):
    """replica-0, a new prompt's home, is 30 s behind with a 10 s limit, but batch may wait there
    without end (its own limit, 0): a request of batch's goes home; one of another tenant is sent
    on to replica-1, as past replica-0's limit."""
    def routed(tenant):
        fresh = homed(f"{view} {tenant}: a tenant's own queue limit, asked once here. " * 6, "replica-0")
        service, app = router_app(replicas, "prefix", view=view)
        service.router = make_router("prefix", queue_limits="heed")
        for i in range(2):
            service.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=BehindWithOwnLimits(
                replicas[i], 30.0, 10.0 if i == 0 else None, {"batch": 0.0} if i == 0 else {}))
        [answer] = drive(app, [lambda c: c.post("/v1/completions", headers={"X-KVD-Tenant": tenant}, json={
            "prompt": fresh, "max_tokens": 3, "temperature": 0, "ignore_eos": True})],
            service=service if view == "events" else None)
        assert answer.status_code == 200
        return answer.headers["x-kvd-replica"], service.replicas[0].passed_over

    assert routed("batch") == ("replica-0", 0)
    assert routed("acme") == ("replica-1", 1)


@pytest.mark.parametrize("queue_limits, other_wait", [("heed", 30.0), ("heed", 3.0), ("ignore", 30.0)])
def test_a_queue_timeout_goes_on_only_to_a_replica_predicted_to_start_it_in_time(replicas, queue_limits, other_wait,
                                                                                 caplog):
    """replica-0 (in time by its facts) turns the request away after its wait (503 queue_timeout).
    Heeding limits, the router sends it on only if replica-1's predicted wait is within its 10 s
    limit; else the caller gets the 503 at once, rather than after another wait there for the same
    answer, and X-KVD-Not-Rerouted (and the log line) says why. Ignoring limits, it goes on as any
    503 does."""
    service, app = router_app(replicas, "prefix")
    service.log_requests = True
    service.router = make_router("prefix", queue_limits=queue_limits, balance_seconds=100.0)
    fronts = [Behind(replicas[0], 1.0, 10.0, times_out=True), Behind(replicas[1], other_wait, 10.0)]
    for i, front in enumerate(fronts):
        service.replicas[i].client = replica_client(f"/run/replica-{i}.sock", transport=front)
    fresh = homed(f"{queue_limits} {other_wait}: a request the first replica times out, asked once. " * 5,
                  "replica-0")
    with caplog.at_level("INFO", logger="kvd.router"):
        [answer, scraped] = drive(app, [lambda c: post(c, fresh), lambda c: c.get("/metrics")])
    assert fronts[0].completions == 1
    not_rerouted = 1 if (queue_limits, other_wait) == ("heed", 30.0) else 0
    assert f"kvd_router_timeouts_not_rerouted_total {float(not_rerouted)}" in scraped.text.splitlines()
    assert service.status().get("timeouts_not_rerouted", 0) == not_rerouted
    if not_rerouted:
        assert answer.status_code == 503 and fronts[1].completions == 0
        assert answer.json()["error"]["code"] == "queue_timeout" and answer.headers["retry-after"] == "1"
        assert answer.headers["x-kvd-tried"] == "replica-0 (503)"
        why = "every other replica's predicted wait is past its max_queue_wait: replica-1 (30.00 s, limit 10 s)"
        assert answer.headers["x-kvd-not-rerouted"] == why
        [line] = refused_lines(caplog)
        assert (line["status"], line["tried"], line["why"]) == (503, "replica-0 (503)", why)
    else:
        assert answer.status_code == 200 and fronts[1].completions == 1
        assert (answer.headers["x-kvd-replica"], answer.headers["x-kvd-tried"]) == ("replica-1", "replica-0 (503)")
        assert "x-kvd-not-rerouted" not in answer.headers and refused_lines(caplog) == []


def test_the_router_says_where_it_would_send_a_prompt_without_sending_it(replicas):
    service, app = router_app(replicas, "prefix", view="events")
    system = "What-if questions about routing never move a request nor the router's books. " * 2

    async def what_if(client):
        await until_followed(service, (0, 1), settled=True)
        before = ([r.sent for r in service.replicas], [dict(r.view.pending) for r in service.replicas])
        answer = await client.post("/router/route", json={"prompt": system + "Q2?", "routing": ["ttft", "prefix"]})
        assert ([r.sent for r in service.replicas], [dict(r.view.pending) for r in service.replicas]) == before
        return answer

    first, _, answer, bad = drive(app, [lambda c: post(c, system + "Q1?"), lambda c: until_followed(service, (0, 1)),
                                        what_if, lambda c: c.post("/router/route", json={"prompt": "x",
                                                                                          "routing": ["coin"]})],
                                  service=service)
    body = answer.json()
    where = first.headers["x-kvd-replica"]
    assert body["routing"] == "prefix" and list(body["routes"]) == ["prefix", "ttft"]  # the live policy first
    assert body["routes"]["prefix"]["replica"] == where
    assert body["routes"]["prefix"]["reason"].startswith("caches ")
    rows = {r["replica"]: r for r in body["replicas"]}
    assert [rows[f"replica-{i}"]["source"] for i in (0, 1)] == ["view", "view"]
    assert rows[where]["cached_tokens"] > 0 and rows[where]["cached_tokens"] % 16 == 0
    assert [r.client._transport.prompt_questions for r in service.replicas] == [0, 0]
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("routing: expected a list of ")



def test_kvctl_route_pointed_at_the_router_asks_it_and_at_a_replica_says_what_to_give(replicas, capsys, monkeypatch):
    """`KVD_SOCKET=router kvctl route PROMPT`: with no --replica and no --router, kvctl asks the kvd
    it points at, which is the router: its own view and choice. Pointed at a replica, or at nothing,
    it says to give replicas or a router (it said only to give two or more replicas)."""
    from kvctl import client

    from .daemon_fixtures import call
    from .test_cli import cli

    _, app = router_app(replicas, "prefix")
    for target, said in ((app, None),
                         (replicas[0], "the kvd kvctl points at is a replica, not kvd router"),
                         (None, "no kvd answers where kvctl points")):
        def post(self, path, body, target=target):
            if target is None:
                raise client.KvdUnavailable("kvd is not reachable at /run/none.sock (is it running? `kvd serve`)")
            return self.answered(call(target, "POST", path, json=body))

        monkeypatch.setattr(client.Client, "post", post)
        status, out, err = cli(capsys, "route", "--json", SYSTEM_A + "Q60?")
        if said is None:
            answer = json.loads(out)
            assert status == 0 and list(answer["routes"]) == ["prefix", "least_loaded", "ttft"]
            assert [r["replica"] for r in answer["replicas"]] == ["replica-0", "replica-1"]
        else:
            assert status == 2 and " ".join(err.split()) == (
                f"error: replica: give two or more (--replica SOCKET_OR_URL, repeated), or --router; {said}")


@pytest.mark.parametrize("view", ["ask", "events"])
def test_the_router_is_ready_while_some_replica_can_take_a_request(replicas, view):
    service, app = router_app(replicas, "round_robin", down=(0,), view=view)
    [ready] = drive(app, [lambda c: c.get("/readyz")], service=service if view == "events" else None,
                    synced=(1,))
    assert ready.status_code == 200 and ready.json() == {"ready": True, "replicas": ["replica-1"]}
    service, app = router_app(replicas, "round_robin", down=(0, 1), view=view)
    [ready] = drive(app, [lambda c: c.get("/readyz")], service=service if view == "events" else None, synced=())
    assert ready.status_code == 503 and ready.json() == {"ready": False, "reason": "no replica can take a request"}


def test_behind_tcp_replicas_that_are_no_trusted_proxy_a_prompt_is_hashed_under_the_routers_tenant(tmp_path):
    """Such a replica serves every request under the router's token's tenant, whatever
    X-KVD-Tenant names: the events view hashes the prompt under that tenant too, so it counts
    what the replica will find."""
    from .daemon_fixtures import ADMIN_TOKEN, apps, token_table

    services = [start_service(tmp_path / f"r{i}", num_blocks=64) for i in range(2)]
    try:
        tokens = token_table(tmp_path)
        tcp = [apps(s, tokens, trusted_proxy=False)[1] for s in services]
        replicas = [Replica(f"replica-{i}", replica_client(f"http://replica-{i}:8000", ADMIN_TOKEN,
                                                           transport=httpx.ASGITransport(app=a)))
                    for i, a in enumerate(tcp)]
        service = RouterService(replicas, make_router("prefix"), view="events", load_interval=0.05)
        app = create_router_app(service)
        system = "Behind a proxy that is not trusted, every request is the proxy's tenant's. " * 2
        answers = drive(app, [lambda c: post(c, system + "Q1?"), lambda c: until_followed(service, (0, 1), settled=True),
                              lambda c: c.post("/v1/completions", headers={"X-KVD-Tenant": "acme"}, json={
                                  "prompt": system + "Q2?", "max_tokens": 3, "temperature": 0, "ignore_eos": True})],
                        service=service)
        first, second = answers[0], answers[2]
        assert service.replicas[0].view.default_tenant == "ops" and not service.replicas[0].view.tenant_header
        assert second.headers["x-kvd-replica"] == first.headers["x-kvd-replica"]
        assert routed_cached(second) == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for s in services:
            s.shutdown(deadline=2)


@pytest.mark.parametrize("view", ["ask", "events"])
def test_a_drained_replica_gets_no_new_request_until_it_is_resumed(replicas, view):
    """An operator drains the replica holding a prefix before restarting it: the prefix's next
    requests go elsewhere, the router is ready on the other one only, and draining every replica
    is a 503 that says so; resumed, the replica takes requests again. The replica is told too, so
    a second router in front of it leaves it out as well."""
    service, app = router_app(replicas, "prefix", view=view)
    events = service if view == "events" else None
    try:
        _drain_and_resume(service, app, events, replicas, view)
    finally:  # the replicas serve the other tests
        drive(app, [lambda c: c.post("/router/drain", json={"replica": f"replica-{i}", "drain": False})
                    for i in (0, 1)])


def _drain_and_resume(service, app, events, replicas, view):

    async def settled(client):
        if events is not None:
            await until_followed(service, (0, 1), settled=True)

    first = drive(app, [lambda c: post(c, SYSTEM_A + "Q30?"), settled,
                        lambda c: c.post("/router/drain", json={"replica": "replica-0"}),
                        lambda c: post(c, SYSTEM_A + "Q31?"), lambda c: c.get("/readyz"),
                        lambda c: c.get("/router/status")], service=events)
    assert first[0].headers["x-kvd-replica"] == "replica-0"
    assert first[2].json() == {"replica": "replica-0", "draining": True, "open": 0,
                               "at_replica": {"draining": True, "running": 0, "waiting": 0}}
    assert first[3].status_code == 200 and first[3].headers["x-kvd-replica"] == "replica-1"
    assert first[4].json() == {"ready": True, "replicas": ["replica-1"]}
    assert first[5].json()["replicas"][0]["draining"] == "drained" and "draining" not in first[5].json()["replicas"][1]
    other, other_app = router_app(replicas, "prefix", view=view)  # a second router: told by the replica
    [elsewhere, other_status] = drive(other_app, [lambda c: post(c, SYSTEM_A + "Q31b?"),
                                                  lambda c: c.get("/router/status")],
                                      service=other if view == "events" else None)
    assert elsewhere.headers["x-kvd-replica"] == "replica-1"
    assert other_status.json()["replicas"][0]["draining"] == "at the replica"
    [scraped] = drive(app, [lambda c: c.get("/metrics")])
    assert 'kvd_router_replica_draining{replica="replica-0"} 1.0' in scraped.text.splitlines()
    assert 'kvd_router_replica_draining{replica="replica-1"} 0.0' in scraped.text.splitlines()

    refused = drive(app, [lambda c: c.post("/router/drain", json={"replica": "replica-1"}),
                          lambda c: post(c, SYSTEM_A + "Q32?"), lambda c: c.get("/readyz"),
                          lambda c: c.post("/router/drain", json={"replica": "replica-9"}),
                          lambda c: c.post("/router/drain", json={"replica": "replica-1", "drain": "no"})],
                    service=events)
    assert refused[1].status_code == 503 and refused[1].json()["error"]["message"] == (
        "every replica is draining: replica-0, replica-1")
    assert refused[2].status_code == 503
    assert refused[3].status_code == 404 and refused[3].json()["error"]["message"] == (
        "replica: no replica 'replica-9'; the router has 'replica-0', 'replica-1'")
    assert refused[4].status_code == 400 and refused[4].json()["error"]["message"] == (
        "drain: expected true or false, got 'no'")
    assert service.unrouted == 1  # a request no replica could take, in kvd_router_unrouted_total

    back = drive(app, [lambda c: c.post("/router/drain", json={"replica": "replica-0", "drain": False}),
                       lambda c: post(c, SYSTEM_A + "Q33?"), lambda c: c.get("/router/status")], service=events)
    assert back[0].json() == {"replica": "replica-0", "draining": False, "open": 0,
                              "at_replica": {"draining": False, "running": 0, "waiting": 0}}
    assert back[1].headers["x-kvd-replica"] == "replica-0"  # replica-1 is drained still
    assert back[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "draining" not in back[2].json()["replicas"][0] and back[2].json()["replicas"][1]["draining"] == "drained"


def test_a_replica_taken_out_leaves_once_its_open_requests_answer_and_one_added_is_followed(replicas):
    """Membership changes while the router serves: a replica taken out of the fleet takes no new
    request and stays (followed, in the status) while a request of its is open; then it is gone.
    A replica added is followed at once and takes requests."""
    service, app = router_app(replicas[:1], "least_loaded", view="events")

    async def change(client):
        service.add(Replica("replica-1", replica_client("/run/replica-1.sock", transport=Counting(replicas[1]))))
        await until_followed(service, (0, 1))
        leaving_one = service.replicas[0]
        leaving_one.open = 1  # a stream of its still answering (in-process transports answer whole)
        leaving = service.remove("replica-0")
        during = await post(client, SYSTEM_B + "while it leaves")
        await asyncio.sleep(0.2)
        still = (service.status()["replicas"][0], [t.done() for t in leaving_one.tasks])
        leaving_one.open = 0
        await asyncio.wait_for(leaving, 5)
        return during, still, [t.cancelled() for t in leaving_one.tasks], service.status()

    [(during, still, cancelled, status)] = drive(app, [change], service=service)
    assert during.status_code == 200 and during.headers["x-kvd-replica"] == "replica-1"
    assert still == ({"replica": "replica-0", "sent": 0, "open": 1, "last_error": None, "draining": "leaving",
                      "view": still[0]["view"]}, [False, False])
    assert cancelled == [True, True] and [r["replica"] for r in status["replicas"]] == ["replica-1"]
    with pytest.raises(ValueError, match="replica: 'replica-1' is in the fleet already"):
        service.add(Replica("replica-1", replica_client("/run/replica-1.sock")))


def test_the_replicas_file_adds_and_takes_out_replicas_and_a_bad_one_changes_nothing(tmp_path):
    from kvctl.daemon.server.fleet_file import FleetFile, read_replicas_file

    listing = tmp_path / "replicas"
    listing.write_text("# the fleet\n/run/kvd-0/kvd.sock\n/run/kvd-1/kvd.sock  # rack 2\n\n")
    assert read_replicas_file(str(listing)) == ["/run/kvd-0/kvd.sock", "/run/kvd-1/kvd.sock"]
    replicas = [Replica(spec, replica_client(spec, transport=Down())) for spec in
                ["/run/kvd-fixed/kvd.sock", *read_replicas_file(str(listing))]]
    service = RouterService(replicas, make_router("least_loaded"), view="ask")
    fleet = FleetFile(str(listing), fixed={"/run/kvd-fixed/kvd.sock"},
                      client=lambda spec: replica_client(spec, transport=Down()))

    async def go():
        listing.write_text("/run/kvd-1/kvd.sock\n/run/kvd-2/kvd.sock\n")
        changed = fleet.apply(service)
        names = {r.name: r.leaving for r in service.replicas}
        listing.write_text("/run/kvd-0/kvd.sock\n/run/kvd-1/kvd.sock\n/run/kvd-2/kvd.sock\n")
        back = fleet.apply(service)  # kvd-0 had not gone yet: it stays
        listing.write_text("/run/kvd-1/kvd.sock\nkvd-3.sock\n")
        with pytest.raises(ValueError) as bad:
            fleet.apply(service)
        listing.write_text("")
        fleet.apply(service)  # only the fixed replica is left
        await asyncio.sleep(0.2)
        return changed, names, back, str(bad.value), [r.name for r in service.replicas]

    changed, names, back, bad, left = asyncio.run(go())
    assert changed == {"added": ["/run/kvd-2/kvd.sock"], "leaving": ["/run/kvd-0/kvd.sock"], "roles": {}}
    assert names == {"/run/kvd-fixed/kvd.sock": False, "/run/kvd-0/kvd.sock": True, "/run/kvd-1/kvd.sock": False,
                     "/run/kvd-2/kvd.sock": False}
    assert back == {"added": ["/run/kvd-0/kvd.sock"], "leaving": [], "roles": {}}
    assert bad == (f"replicas_file: {listing}:2: expected a socket path or an http(s) URL, a role (both, prefill, "
                   "decode) before it where given, got 'kvd-3.sock'")
    assert left == ["/run/kvd-fixed/kvd.sock"]
    with pytest.raises(ValueError, match="replica: '/run/kvd-fixed/kvd.sock' is given twice; each replica once"):
        RouterService([Replica(r.name, r.client) for r in replicas[:1]] * 2, make_router("prefix"))


def test_an_eviction_at_the_router_takes_the_blocks_of_every_replica_and_adds_up(replicas):
    """`kvctl evict --tenant` (or a prefix id) at the router: every replica evicts its own blocks of
    it, and the answer sums them beside each replica's; a replica without the prefix has nothing
    to evict; one that cannot be reached makes the answer partial (kvctl exits 3)."""
    tenant = {"X-KVD-Tenant": "evictee"}
    service, app = router_app(replicas, "prefix")

    async def on_both(client):  # the tenant's prompt on each replica: drain one, then the other
        out = []
        for name in ("replica-1", "replica-0"):
            await client.post("/router/drain", json={"replica": name})
            out.append(await client.post("/v1/completions", headers=tenant, json={
                "prompt": SYSTEM_B + "Q40?", "max_tokens": 1, "temperature": 0}))
            await client.post("/router/drain", json={"replica": name, "drain": False})
        return out

    async def prefix_ids(client):
        return [(await c.get("/admin/prefixes", params={"tenant": "evictee"})).json()["prefixes"]
                for c in [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://kvd")
                          for a in replicas]]

    [placed, held] = drive(app, [on_both, prefix_ids])
    assert [a.headers["x-kvd-replica"] for a in placed] == ["replica-0", "replica-1"]
    mine = [[p for p in rows if p["tenant"] == "evictee"] for rows in held]
    blocks = [sum(p["blocks"] for p in rows) for rows in mine]
    assert all(b > 0 for b in blocks), (held, [a.json()["usage"] for a in placed])

    [gone, again, bad] = drive(app, [lambda c: c.post("/admin/evict", json={"tenant": "evictee"}),
                                     lambda c: c.post("/admin/evict", json={"prefix": mine[0][0]["prefix_id"]}),
                                     lambda c: c.post("/admin/evict", json={"tenant": "evictee", "prefix": "ab12"})])
    body = gone.json()
    assert gone.status_code == 200 and body["result"] == "ok" and body["target"] == "tenant=evictee"
    assert body["evicted_blocks"] == sum(blocks)
    assert [(r["replica"], r["status"], r["evicted_blocks"]) for r in body["replicas"]] == [
        ("replica-0", 200, blocks[0]), ("replica-1", 200, blocks[1])]
    assert again.status_code == 404  # no replica holds it any more: the replicas' own 404
    assert again.json()["error"]["message"].startswith("prefix: no cached prefix")
    assert bad.status_code == 400 and bad.json()["error"]["message"] == (
        "evict: give exactly one of prefix, a prompt (text, tokens or messages), tenant, model_revision, all_unpinned")

    service, app = router_app(replicas, "prefix", down=(1,))
    [one_down] = drive(app, [lambda c: c.post("/admin/evict", json={"tenant": "evictee"})])
    body = one_down.json()
    assert one_down.status_code == 200 and body["result"] == "partial" and body["evicted_blocks"] == 0
    assert body["message"] == "replica-1: not reached (ConnectError: connection refused)"
    text = _render_evict(body)
    assert text.splitlines() == ["fleet of 2 replicas:",
                                 "evicted tenant=evictee: 0 blocks from the device",
                                 "  replica-0: 0 from the device, 0 from lower tiers",
                                 "  replica-1: not done: ConnectError: connection refused",
                                 "replica-1: not reached (ConnectError: connection refused)"]


def test_a_conversation_evicted_at_the_router_goes_from_every_replica_that_served_it(replicas):
    """`kvctl evict --messages chat.json` at the router: each replica hashes the prompt in its own
    namespace and takes its own blocks of it; the answer sums them and the blocks kept as shared."""
    forgetter = {"X-KVD-Tenant": "forgetter"}
    service, app = router_app(replicas, "prefix")
    prompt = SYSTEM_B + "Q41, a conversation to forget?"

    async def on_both(client):
        out = []
        for name in ("replica-1", "replica-0"):
            await client.post("/router/drain", json={"replica": name})
            out.append(await client.post("/v1/completions", headers=forgetter, json={
                "prompt": prompt, "max_tokens": 1, "temperature": 0}))
            await client.post("/router/drain", json={"replica": name, "drain": False})
        return out

    async def held(client):
        return [sum(r["blocks"] for r in (await c.get("/admin/prefixes", params={"tenant": "forgetter"})).json()[
            "prefixes"]) for c in [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://kvd")
                                   for a in replicas]]

    [placed, blocks] = drive(app, [on_both, held])
    assert [a.headers["x-kvd-replica"] for a in placed] == ["replica-0", "replica-1"] and min(blocks) > 0
    [preview, still] = drive(app, [lambda c: c.post("/admin/evict/preview", json={"text": prompt,
                                                                                  "tenant": "forgetter"}), held])
    assert preview.status_code == 200 and still == blocks  # nothing went
    assert (preview.json()["dry_run"], preview.json()["evicted_blocks"]) == (True, sum(blocks))
    [gone, left] = drive(app, [lambda c: c.post("/admin/evict", json={"text": prompt, "tenant": "forgetter"}), held])
    body = gone.json()
    assert gone.status_code == 200 and body["result"] == "ok"
    assert (body["target"], body["evicted_blocks"], body["shared_blocks_kept"]) == (
        f"prompt of {placed[0].json()['usage']['prompt_tokens']} tokens (tenant forgetter)", sum(blocks), 0)
    assert [(r["replica"], r["evicted_blocks"]) for r in body["replicas"]] == [
        ("replica-0", blocks[0]), ("replica-1", blocks[1])]
    assert left == [0, 0]


def test_a_fleet_eviction_sums_the_blocks_replicas_were_still_writing_down_and_is_partial():
    from kvctl.daemon.server.fleet_admin import combine, merge_evictions

    done = {"target": "tenant=acme", "skipped": {}, "evicted_blocks": 4, "lower_tier_blocks_dropped": 6,
            "result": "ok"}
    moving = {**done, "lower_tier_blocks_dropped": 2, "lower_tier_blocks_still_moving": 3, "result": "partial",
              "message": "3 blocks were still being written to disk or Redis after 30 s and were not dropped; "
                         "run the eviction again"}
    status, body = combine(["r0", "r1"], [(200, done), (200, moving)], merge_evictions)
    assert status == 200 and body["result"] == "partial"
    assert (body["evicted_blocks"], body["lower_tier_blocks_dropped"], body["lower_tier_blocks_still_moving"]) == (
        8, 8, 3)
    assert body["message"] == "r1: " + moving["message"]
    _, body = combine(["r0", "r1"], [(200, done), (200, done)], merge_evictions)
    assert "lower_tier_blocks_still_moving" not in body and body["result"] == "ok"
    # previews: what each would evict, and what none of them counted, said once
    note = "other daemons' entries on the shared Redis (searched for by the eviction itself)"
    preview = {**done, "dry_run": True, "not_counted": [note]}
    _, body = combine(["r0", "r1"], [(200, preview), (200, {**preview, "evicted_blocks": 1})], merge_evictions)
    assert (body["dry_run"], body["evicted_blocks"], body["not_counted"], body["result"]) == (True, 5, [note], "ok")


def test_kvctl_tiers_at_the_router_shows_each_replica_s_tiers_and_which_did_not_answer(replicas):
    _, app = router_app(replicas, down=(1,))
    [answer] = drive(app, [lambda c: c.get("/admin/tiers")])
    assert answer.status_code == 200
    rows = answer.json()["replicas"]
    assert [(r["replica"], r["status"]) for r in rows] == [("replica-0", 200), ("replica-1", None)]
    assert rows[0]["report"]["configured"] is False and rows[0]["report"]["device"]["blocks"] >= 0
    assert rows[1]["error"].startswith("ConnectError: connection refused")
    shown = _kvctl_prints(["tiers"], answer.json()).splitlines()
    assert shown[0] == "replica replica-0" and shown[1].startswith("no lower tier configured")
    assert "replica replica-1: no answer (ConnectError: connection refused)" in shown
    _, app = router_app(replicas, down=(0, 1))
    [answer] = drive(app, [lambda c: c.get("/admin/tiers")])
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"


def _render_evict(body: dict) -> str:
    """What `kvctl evict` prints for an answer (and its exit status 3 for a partial one)."""
    return _kvctl_prints(["evict", "--tenant", "evictee"], body)


def _kvctl_prints(args: list[str], body: dict) -> str:
    """What kvctl prints for the router's answer `body` (exit status 3 for a partial one)."""
    from .kvctl_fakes import kvctl_answered

    result = kvctl_answered(args, body, columns=100)
    assert result.exit_code == (3 if body.get("result") == "partial" else 0), result.output
    return result.output


def test_a_pin_at_the_router_is_made_listed_and_removed_on_every_replica(replicas):
    """`kvctl pin` at the router pins (and warms) the prefix on every replica under one id;
    `kvctl pins` lists it once, held by both, its cached blocks summed; `kvctl unpin` removes it
    everywhere, and an unknown id is the replicas' own 404."""
    _, app = router_app(replicas, "round_robin")
    text = SYSTEM_A + "Pinned across the fleet."
    [pinned, listed] = drive(app, [
        lambda c: c.post("/admin/pins", json={"text": text, "tenant": "pinner", "note": "fleet"}),
        lambda c: c.get("/admin/pins")])
    body = pinned.json()
    assert pinned.status_code == 200 and body["result"] == "ok" and body["tenant"] == "pinner"
    rows = body["replicas"]
    assert [(r["replica"], r["status"], r["pin_id"]) for r in rows] == [
        ("replica-0", 200, body["pin_id"]), ("replica-1", 200, body["pin_id"])]
    assert body["cached_blocks"] == 2 * body["blocks"] and all(r["cached_blocks"] == body["blocks"] for r in rows)
    [mine] = [p for p in listed.json()["pins"] if p["pin_id"] == body["pin_id"]]
    assert mine["replicas"] == ["replica-0", "replica-1"] and mine["cached_blocks"] == 2 * body["blocks"]
    assert listed.json()["replica_count"] == 2
    assert mine["cached_by_replica"] == {"replica-0": body["blocks"], "replica-1": body["blocks"]}
    shown = _kvctl_prints(["pin", text], body).splitlines()
    assert shown == [f"pinned {body['pin_id']} on 2 replicas: {body['blocks']} blocks for tenant pinner",
                     f"  replica-0: {body['blocks']} cached, warmed", f"  replica-1: {body['blocks']} cached, warmed"]
    [row] = [line for line in _kvctl_prints(["pins"], listed.json()).splitlines() if body["pin_id"] in line]
    assert row.split()[:5] == [body["pin_id"], "pinner", str(body["blocks"]), str(body["blocks"]), "2/2"]
    [gone, unknown, after] = drive(app, [lambda c: c.delete(f"/admin/pins/{body['pin_id']}"),
                                         lambda c: c.delete("/admin/pins/pin-0000000000000000"),
                                         lambda c: c.get("/admin/pins")])
    assert gone.status_code == 200 and gone.json()["unpinned_blocks"] == 2 * body["blocks"]
    assert [r["status"] for r in gone.json()["replicas"]] == [200, 200]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "pin_id"
    [odd] = drive(app, [lambda c: c.delete("/admin/pins/pin-x%3Fall%3D1")])  # passed on as one name, not a query
    assert odd.status_code == 404 and "'pin-x?all=1'" in odd.json()["error"]["message"]
    assert body["pin_id"] not in {p["pin_id"] for p in after.json()["pins"]}


def test_kvctl_prefixes_at_the_router_lists_every_replicas_rows_and_their_ids_work_there(replicas):
    """`kvctl prefixes` at the router: each replica's rows, naming it; `--under` an id that one
    replica holds lists that replica's rows (the other has none); the same id evicts there through
    the router; bad input is the replicas' own 400."""
    tenant = {"X-KVD-Tenant": "lister"}
    _, app = router_app(replicas, "prefix")

    async def place(client):  # SYSTEM_A's home is replica-0, SYSTEM_B's replica-1
        for system in (SYSTEM_A, SYSTEM_B):
            answer = await client.post("/v1/completions", headers=tenant,
                                       json={"prompt": system + "Listed?", "max_tokens": 1, "temperature": 0})
            assert answer.status_code == 200
        return answer

    [_, listed, bad] = drive(app, [place, lambda c: c.get("/admin/prefixes", params={"tenant": "lister"}),
                                   lambda c: c.get("/admin/prefixes", params={"sort": "oldest"})])
    body = listed.json()
    assert [(r["replica"], r["status"]) for r in body["replicas"]] == [("replica-0", 200), ("replica-1", 200)]
    by_replica = {name: [r["prefix_id"] for r in body["prefixes"] if r["replica"] == name]
                  for name in ("replica-0", "replica-1")}
    assert all(by_replica.values()) and not set(by_replica["replica-0"]) & set(by_replica["replica-1"])
    assert body["total"] == len(body["prefixes"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sort"
    shown = _kvctl_prints(["prefixes", "--tenant", "lister"], body).splitlines()
    assert shown[0].split()[:2] == ["replica", "prefix"] and shown[-2:] == ["#0 replica-0", "#1 replica-1"]
    assert any(line.split()[:2] == ["#1", by_replica["replica-1"][0]] for line in shown)

    one = by_replica["replica-1"][0]
    [under, gone] = drive(app, [lambda c: c.get("/admin/prefixes", params={"under": one}),
                                lambda c: c.post("/admin/evict", json={"prefix": one})])
    assert {r["replica"] for r in under.json()["prefixes"]} == {"replica-1"}
    assert [r["status"] for r in under.json()["replicas"]] == [404, 200]
    assert gone.json()["result"] == "ok" and [r["status"] for r in gone.json()["replicas"]] == [404, 200]


class BreaksMidAnswer(httpx.AsyncBaseTransport):
    """A replica that dies during its answer: the completion's body stops `after` bytes in (inside
    an event) with the error httpx raises for a connection closed mid-body. `after` may be a
    function of the whole body: events' lengths differ from one answer to the next."""

    def __init__(self, app, after) -> None:
        self.inner, self.after = httpx.ASGITransport(app=app), after
        self.whole = b""  # the replica's whole answer, before the cut

    async def handle_async_request(self, request):
        answer = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/completions":
            return answer
        body = self.whole = await answer.aread()
        after = self.after(body) if callable(self.after) else self.after
        assert len(body) > after

        class Cut(httpx.AsyncByteStream):
            async def __aiter__(self):
                yield body[:after]
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body "
                                                "(incomplete chunked read)")
        return httpx.Response(answer.status_code, headers=answer.headers, stream=Cut())


def test_a_replica_that_breaks_off_a_streamed_answer_leaves_whole_events_an_error_event_and_done(replicas, caplog):
    service, app = router_app(replicas, "round_robin")

    def inside_the_third_event(body: bytes) -> int:  # the first two go out whole, the third not at all
        return [i for i in range(len(body)) if body.startswith(b"data: ", i)][2] + 10

    breaks = BreaksMidAnswer(replicas[0], inside_the_third_event)
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=breaks)
    with caplog.at_level("WARNING", logger="kvd.router"):
        # (twelve tokens: a reader that fell behind sends the waiting ones in one chunk, and three leave fewer
        # than three events where it falls behind once)
        [answer, scraped] = drive(app, [lambda c: post(c, SYSTEM_B + "Q56?", stream=True, max_tokens=12),
                                        lambda c: c.get("/metrics")])
    assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-0"
    events = sse_events(answer)
    # the two events before the cut, as the replica wrote them (how many tokens each carries depends on
    # how far its reader fell behind: a chunk carries every token that waited)
    replica_events = [json.loads(line[len("data: "):]) for line in breaks.whole.decode().splitlines()
                      if line.startswith("data: {")]
    assert events[:2] == replica_events[:2] and all(e["choices"][0]["token_ids"] for e in events[:2])
    message = ("replica replica-0 failed during the answer: RemoteProtocolError: peer closed connection without "
               "sending complete message body (incomplete chunked read)")
    assert events[2:] == [{"error": {"message": message, "type": "router_error", "param": None,
                                     "code": "replica_failed"}}, "[DONE]"]
    assert answer.text.endswith("data: [DONE]\n\n")
    replica = service.replicas[0]
    assert (replica.failed_forwards, replica.open, replica.rerouted) == (1, 0, 0)
    assert replica.last_error.startswith("RemoteProtocolError: peer closed")
    assert 'kvd_router_forward_failures_total{replica="replica-0"} 1.0' in scraped.text.splitlines()
    assert [r.getMessage() for r in caplog.records if r.name == "kvd.router"] == [
        "replica replica-0 failed after 2 events of a streamed answer: RemoteProtocolError: peer closed "
        "connection without sending complete message body (incomplete chunked read)"]


def test_a_replica_that_breaks_off_a_whole_answer_is_a_502_and_not_run_again(replicas):
    service, app = router_app(replicas, "round_robin")
    service.replicas[0].client = replica_client("/run/replica-0.sock", transport=BreaksMidAnswer(replicas[0], 20))
    [answer] = drive(app, [lambda c: post(c, SYSTEM_B + "Q57?")])
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "replica_failed"
    assert answer.json()["error"]["message"].startswith(
        "replica replica-0 failed during the answer: RemoteProtocolError: peer closed connection")
    assert [r.failed_forwards for r in service.replicas] == [1, 0] and service.replicas[1].sent == 0
    assert service.replicas[0].open == 0


def test_the_router_s_log_leaves_out_a_line_per_request_to_a_replica_unless_at_debug():
    """Its feeds poll each replica many times a second: at info, httpx's line per request was
    nearly all of the router's log (9,775 of 9,801 lines in a soak)."""
    import logging

    from kvctl.daemon.cli import configure_logging

    try:
        configure_logging("info")
        assert [logging.getLogger(n).level for n in ("httpx", "httpcore")] == [logging.WARNING] * 2
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        configure_logging("debug")
        assert [logging.getLogger(n).level for n in ("httpx", "httpcore")] == [logging.NOTSET] * 2
    finally:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_anyio_s_cancelled_read_race_is_logged_at_debug_and_every_other_loop_error_as_before(caplog):
    """A caller that leaves cancels the router's read from its replica; anyio's reader callback can
    then set the result of that cancelled future: an ERROR with a traceback for nothing lost."""
    import logging

    from kvctl.daemon.server.loop_errors import exception_handler

    class Loop:
        def __init__(self):
            self.defaulted = []

        def default_exception_handler(self, context):
            self.defaulted.append(context)

    loop = Loop()
    race = {"message": "Exception in callback <built-in method set_result of _asyncio.Future object at 0x7f>",
            "exception": asyncio.InvalidStateError("invalid state")}
    other_state = {"message": "Exception in callback Task.__step()", "exception": asyncio.InvalidStateError("x")}
    other = {"message": "Exception in callback <built-in method set_result of _asyncio.Future object at 0x7f>",
             "exception": ValueError("a bug")}
    with caplog.at_level(logging.DEBUG, logger="kvd.router"):
        for context in (race, other_state, other):
            exception_handler(loop, context)
    assert loop.defaulted == [other_state, other]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kvd.router"] == [
        ("DEBUG", "a socket read given up on (its caller left) became ready after it was cancelled: Exception in "
                  "callback <built-in method set_result of _asyncio.Future object at 0x7f>")]


class BehindByPlace(Behind):
    """Behind (30 s for the last place), under a priority queue: 3 s of work waits at place 0 and 27 s
    more at place 5. A prompt's route-facts give the wait at its place (a request deferring itself
    by 5, or asking service_tier flex, waits for all of it); a load poll, the last place's and the
    work by place, for the view.
    Requests go on without their priority (the kvd behind serves first come, first served)."""
    RATE = 1000.0

    def __init__(self, app, limit: float | None) -> None:
        super().__init__(app, 30.0, limit)

    async def handle_async_request(self, request):
        asked = json.loads(request.content) if request.method == "POST" else {}
        if "priority" in asked:  # (the kvd behind would refuse it)
            headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
            request = httpx.Request(request.method, request.url, headers=headers,
                                    json={k: v for k, v in asked.items() if k != "priority"})
        answer = await super().handle_async_request(request)
        if request.url.path != "/admin/route-facts":
            return answer
        facts = json.loads(await answer.aread())
        if asked.get("tokens") != []:
            deferred = asked.get("priority", 0) + (1000 if asked.get("service_tier") == "flex" else 0)
            facts["predicted_wait_seconds"] = 30.0 if deferred >= 5 else 3.0
        facts.update(prefill_tokens_per_second=self.RATE, priority_waiting=[[0, 3000], [5, 27000]], tenant_places={})
        return httpx.Response(200, json=facts)


@pytest.mark.parametrize("view", ["ask", "events"])
def test_the_router_weighs_a_request_that_defers_itself_at_its_own_place(replicas, view):
    """Both replicas queue as BehindByPlace; replica-0, a new prompt's home, has a 10 s limit, replica-1
    none. A request at its tenant's place waits 3 s there and goes home; one that defers itself
    (vLLM's priority 5), or asks service_tier flex, would wait behind all 30 s of work, past the limit,
    and is sent on to replica-1. The router asks route-facts with the request's priority and tier, or
    weighs them in its view against the work by place."""
    def routed(priority, tier=None):
        fresh = homed(f"{view} {priority} {tier}: a request deferring itself, asked once here. " * 6, "replica-0")
        service, app = router_app(replicas, "prefix", view=view)
        service.router = make_router("prefix", queue_limits="heed")
        service.replicas[0].client = replica_client("/run/replica-0.sock", transport=BehindByPlace(replicas[0], 10.0))
        service.replicas[1].client = replica_client("/run/replica-1.sock", transport=BehindByPlace(replicas[1], None))
        body = {"prompt": fresh, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        [answer] = drive(app, [lambda c: c.post("/v1/completions", json={
            **body, **({"priority": priority} if priority is not None else {}),
            **({"service_tier": tier} if tier is not None else {})})],
            service=service if view == "events" else None)
        assert answer.status_code == 200
        return answer.headers["x-kvd-replica"], service.replicas[0].passed_over

    assert routed(None) == routed(0) == routed(None, "priority") == ("replica-0", 0)
    assert routed(5) == routed(None, "flex") == ("replica-1", 1)


def test_a_request_s_question_carries_the_priority_it_defers_itself_by():
    from kvctl.daemon.server.route_question import question_of

    assert question_of({"prompt": "hi", "model": "m", "priority": 5}) == {"text": "hi", "model": "m", "priority": 5}
    for priority in (0, -2, True, 1.5, "3", None):  # none to weigh (a bad one: the replica says what is wrong)
        assert question_of({"prompt": "hi", "priority": priority}) == {"text": "hi"}
    assert question_of({"priority": 5}) is None
    assert question_of({"prompt": "hi", "service_tier": "flex"}) == {"text": "hi", "service_tier": "flex"}
    for tier in ("default", "priority", "auto", "economy", None):  # served as default (a bad one: the replica says)
        assert question_of({"prompt": "hi", "service_tier": tier}) == {"text": "hi"}


def test_kvctl_status_at_the_router_sums_the_replicas_preemptions_and_what_their_reservations_leave_unwritten():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    def live(policy, preemptions, recomputed, finished, unused):
        return {"blocks": {"device": {"total": 64, "free": 60}},
                "tokens": {"prompt": 100, "hit": 0, "hit_ratio": 0.0, "recomputed": recomputed},
                "queue": {"waiting": 0, "running": 0}, "preemptions": preemptions,
                "reservation": {"policy": policy, "finished_blocks": finished, "unused_blocks": unused}}

    def shown(*statuses):
        data = {"routing": "prefix", "view": "events", "replicas": [],
                "replica_status": [{"replica": f"r{i}", **status} for i, status in enumerate(statuses)]}
        console = Console(record=True, width=300)
        render_fleet_status(data, console)
        return console.export_text().splitlines()

    lines = shown(live("p95", 2, 300, 400, 30), live("fraction:1", 1, 100, 100, 70))
    assert ("fleet preemptions: 3 (400 tokens computed again); reservation fraction:1 and p95: 20.0% of the blocks "
            "finished requests held were reserved and never written (100 of 500)") in lines
    older = {k: v for k, v in live("p95", 0, 0, 0, 0).items() if k != "reservation"}  # an older kvd says nothing
    assert not any(line.startswith("fleet preemptions") for line in shown(older))


def test_kvctl_events_at_the_router_lists_every_replica_s_newest_merged_by_time(replicas, capsys, monkeypatch):
    """`kvctl events` pointed at kvd router: each replica's newest events (its tail, filters
    passed on), merged by time, each naming its replica; following or paging by seq is one
    replica's to do, and the router and kvctl say so."""
    from kvctl import client

    from .daemon_fixtures import call
    from .test_cli import cli

    _, app = router_app(replicas, "round_robin")
    drive(app, [lambda c: post(c, SYSTEM_A + "Q70?"), lambda c: post(c, SYSTEM_B + "Q71?")])  # one at each
    [merged, refused] = drive(app, [lambda c: c.get("/admin/events", params={"tail": 3, "kind": "stored"}),
                                    lambda c: c.get("/admin/events", params={"since": 4})])
    body = merged.json()
    own = [call(r, "GET", "/admin/events", params={"tail": 3, "kind": "stored"}).json() for r in replicas]
    fleet = sorted(((e["at"], i, e["seq"]), {**e, "replica": f"replica-{i}"}) for i, b in enumerate(own)
                   for e in b["events"])
    assert merged.status_code == 200 and body["events"] == [e for _, e in fleet][-3:]
    assert {e["kind"] for e in body["events"]} == {"stored"}
    assert [(b["replica"], b["latest"]) for b in body["replicas"]] == [
        ("replica-0", own[0]["latest"]), ("replica-1", own[1]["latest"])]
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(
        "since: kvd router has no sequence of events of its own (each replica numbers its own)")

    def get(self, path, **params):
        return self.answered(call(app, "GET", path, params={k: v for k, v in params.items() if v is not None}))

    monkeypatch.setattr(client.Client, "get", get)
    monkeypatch.setenv("COLUMNS", "200")
    status, out, _ = cli(capsys, "events", "--tail", "2", "--kind", "stored")
    lines = out.splitlines()
    assert status == 0 and lines[:2] == [
        f"replica 1: replica-0, seq {own[0]['oldest']}-{own[0]['latest']}",
        f"replica 2: replica-1, seq {own[1]['oldest']}-{own[1]['latest']}"]
    assert lines[2].split()[:3] == ["r", "seq", "time"]
    last_two = [e for _, e in fleet][-2:]
    assert [(line.split()[0], int(line.split()[1])) for line in lines[3:5]] == [
        (str(int(e["replica"][-1]) + 1), e["seq"]) for e in last_two]
    assert lines[5].startswith("2 events of the fleet's newest, oldest first")
    status, out, _ = cli(capsys, "events", "--json", "--tail", "1")
    assert [json.loads(line)["replica"] for line in out.splitlines()] in (["replica-0"], ["replica-1"])
    status, _, err = cli(capsys, "events", "--follow")
    assert status == 2 and " ".join(err.split()) == (
        "error: follow: kvd router has no sequence of events of its own (each replica numbers its own): follow one "
        "replica (kvctl --socket REPLICA events --follow)")


def test_kvctl_audit_at_the_router_lists_every_replica_s_records_newest_first(replicas):
    """After a fleet incident the question is what operators did, and had refused, everywhere:
    `kvctl audit` at kvd router (a 404 before) gives every replica's records, its filters passed
    on, newest first across the fleet, each naming its replica; one that does not answer is named."""
    from .daemon_fixtures import call

    _, app = router_app(replicas, "round_robin")
    text = SYSTEM_B + "Audited across the fleet."
    [pinned] = drive(app, [lambda c: c.post("/admin/pins", json={"text": text, "tenant": "auditor"})])
    pin_id = pinned.json()["pin_id"]
    assert call(replicas[1], "DELETE", f"/admin/pins/{pin_id}").status_code == 200  # (one replica's own)
    [listed, refused] = drive(app, [lambda c: c.get("/admin/audit", params={"tenant": "auditor"}),
                                    lambda c: c.get("/admin/audit", params={"tenant": "auditor", "result": "refused"})])
    entries = listed.json()["entries"]
    assert listed.status_code == 200 and [e["at"] for e in entries] == sorted((e["at"] for e in entries), reverse=True)
    assert (entries[0]["replica"], entries[0]["action"], entries[0]["target"]) == ("replica-1", "unpin", pin_id)
    assert sorted((e["replica"], e["action"], e["target"], e["result"]) for e in entries[1:]) == [
        ("replica-0", "pin", pin_id, "ok"), ("replica-1", "pin", pin_id, "ok")]
    assert [(r["replica"], r["status"]) for r in listed.json()["replicas"]] == [("replica-0", 200), ("replica-1", 200)]
    assert refused.json()["entries"] == [] and "message" not in refused.json()
    shown = _kvctl_prints(["audit"], listed.json()).splitlines()
    assert shown[0].split() == ["when", "replica", "actor", "tenant", "action", "target", "result"]
    assert [line.split()[2:] for line in shown[1:]] == [
        [e["replica"], e["actor"], "auditor", e["action"], pin_id, "ok"] for e in entries]
    _, app = router_app(replicas, "round_robin", down=(1,))
    [half] = drive(app, [lambda c: c.get("/admin/audit", params={"tenant": "auditor"})])
    assert [(e["replica"], e["action"]) for e in half.json()["entries"]] == [("replica-0", "pin")]
    assert half.json()["message"] == "not listed: replica-1 (ConnectError: connection refused)"
    assert _kvctl_prints(["audit"], half.json()).splitlines()[-1] == half.json()["message"]


def held_for(replicas, served, tenants) -> list[list[bool]]:
    """For each (replica index, prompt) of `served`, whether that replica caches some of the prompt
    for each of `tenants` (its route facts): who a request was served as."""
    return [[facts.json()["cached_tokens"] > 0 for facts in drive(replicas[replica], [
        lambda c, t=t: c.post("/admin/route-facts", json={"text": text, "tenant": t}) for t in tenants])]
        for replica, text in served]


def test_a_tcp_front_with_trusted_proxy_serves_the_tenant_a_caller_names_and_says_so(replicas):
    """kvd router --trusted-proxy: its TCP callers are trusted front ends (or kvds sending their
    batches' requests through it), so a request is served as the X-KVD-Tenant it names, and one
    naming none as its token's; /router/status says which rule the TCP front keeps."""
    from kvctl.daemon.server.auth import TokenEntry, TokenTable

    tokens = TokenTable([TokenEntry(b"a" * 24, "ops", "admin", "token:1")])
    service, _ = router_app(replicas, "round_robin")
    app = create_router_app(service, front="tcp", tokens=tokens)
    admin = {"Authorization": "Bearer " + "a" * 24}
    system = "A trusted front end names the tenant of each request it passes on to the router. " * 2
    before = drive(app, [lambda c: c.get("/router/status", headers=admin)])[0].json()
    service.trusted_proxy = True
    answers = drive(app, [
        lambda c: c.get("/router/status", headers=admin),
        lambda c: c.post("/v1/completions", json={"prompt": system, "max_tokens": 1},
                         headers={**admin, "X-KVD-Tenant": "globex"}),
        lambda c: c.post("/v1/completions", json={"prompt": system + "Q?", "max_tokens": 1}, headers=admin),
    ])
    assert before["trusted_proxy"] is False and answers[0].json()["trusted_proxy"] is True
    named, unnamed = (int(a.headers["x-kvd-replica"][-1]) for a in answers[1:])
    assert named != unnamed  # (round robin)
    assert held_for(replicas, ((named, system), (unnamed, system + "Q?")), ("globex", "ops", "default")) == [
        [True, False, False], [False, True, False]]


def test_a_proxy_token_at_the_router_s_tcp_front_names_the_tenant_without_trusted_proxy(replicas):
    """A gateway's token (role proxy) at kvd router's TCP front: the request is served as the
    X-KVD-Tenant it names, though the router runs without --trusted-proxy; a user token naming one
    is served as its own tenant still, and a proxy token has no admin role."""
    from kvctl.daemon.server.auth import TokenEntry, TokenTable

    tokens = TokenTable([TokenEntry(b"p" * 24, "gateway", "proxy", "token:1"),
                         TokenEntry(b"u" * 24, "acme", "user", "token:2")])
    service, _ = router_app(replicas, "round_robin")
    app = create_router_app(service, front="tcp", tokens=tokens)
    proxy, user = {"Authorization": "Bearer " + "p" * 24}, {"Authorization": "Bearer " + "u" * 24}
    system = "A gateway names the tenant of each request it passes on, with a token of its own. " * 2
    answers = drive(app, [
        lambda c: c.post("/v1/completions", json={"prompt": system, "max_tokens": 1},
                         headers={**proxy, "X-KVD-Tenant": "initech"}),
        lambda c: c.post("/v1/completions", json={"prompt": system + "Q?", "max_tokens": 1},
                         headers={**user, "X-KVD-Tenant": "initech"}),
        lambda c: c.get("/router/status", headers=proxy),
    ])
    assert [a.status_code for a in answers] == [200, 200, 403]
    assert service.trusted_proxy is False
    named, passed = (int(a.headers["x-kvd-replica"][-1]) for a in answers[:2])
    assert held_for(replicas, ((named, system), (passed, system + "Q?")), ("initech", "acme", "gateway")) == [
        [True, False, False], [False, True, False]]


def test_at_the_router_kvctl_rollout_status_and_list_show_each_replica_s_rollouts(replicas):
    """A rollout is a replica's own (each runs, stops and numbers its own): at kvd router, `kvctl
    rollout status` and `list` show each replica's under its name, and one without says so (a
    fleet rollout, one at every replica, is test_fleet_rollouts.py's)."""
    from .daemon_fixtures import call
    from .test_sleep import kvctl_on

    _, app = router_app(replicas, "round_robin")
    body = {"policy": {"name": "p95", "settings": {"reservation": "p95"}}, "cohort": "10%",
            "stops": ["ttft_p95_seconds > 3 * baseline"]}
    started = call(replicas[0], "POST", "/admin/rollouts", json=body).json()
    try:
        code, shown = kvctl_on(app, ["rollout", "status"])
        assert code == 0
        lines = shown.splitlines()
        assert lines[0] == "replica replica-0"
        assert lines[1].startswith(f"rollout {started['id']}: running, cohort 10%, policy p95 (version ")
        assert lines[-2:] == ["replica replica-1", "  rollout: none has been started"]
        code, listed = kvctl_on(app, ["rollout", "list"])
        assert code == 0 and listed.splitlines()[0] == "replica replica-0"
        assert "replica replica-1" in listed and "no rollout has been started" in listed.split("replica replica-1")[1]
        assert "p95" in listed.split("replica replica-1")[0]
    finally:
        call(replicas[0], "POST", f"/admin/rollouts/{started['id']}/rollback", json={"reason": "test over"})

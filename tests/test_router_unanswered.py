"""A replica that leaves its questions unanswered (hung, its host gone) is passed over unasked for
a backoff, so that it does not cost every request of the fleet the question's timeout
(policies/unanswered.py, RouterService.resting)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvctl.policies.unanswered import Unanswered


def test_the_rest_doubles_with_each_unanswered_question_in_a_row_up_to_its_cap():
    book = Unanswered(first_seconds=1.0, max_seconds=15.0)
    assert not book.resting(0.0) and book.seconds_left(0.0) == 0.0
    rests = []
    for asked in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):
        book.failed(asked, asked + 2.0)  # known after a 2-second timeout: the rest counts from then
        rests.append(book.seconds_left(asked + 2.0))
    assert rests == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0] and book.in_a_row == 6
    assert book.resting(76.9) and not book.resting(77.0)
    assert not book.resting(70.0, heard_at=60.0)  # it answered something asked after the question
    assert book.resting(70.0, heard_at=59.9)  # asked before: says nothing of now
    book.answered()
    assert (book.in_a_row, book.since, book.resting(62.5), book.backoff_seconds) == (0, None, False, 0.0)
    book.failed(100.0, 100.5)
    assert book.seconds_left(100.5) == 1.0  # a fresh run starts from the first rest


pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .test_router import Counting, drive, post, replicas  # noqa: E402,F401
from .test_router_chat import SYSTEM_1  # noqa: E402


class Hung(Counting):
    """Passes requests to an app, unless `hung`: then every one times out at once, as a replica
    that stopped answering does after ASK_TIMEOUT_S."""

    hung = True

    def __init__(self, app, hold_until=None) -> None:
        super().__init__(app, hold_until)
        self.asked = []  # the paths of what the router asked it (answered or not)

    async def handle_async_request(self, request):
        self.asked.append(request.url.path)
        if self.hung:
            raise httpx.ReadTimeout("timed out", request=request)
        return await super().handle_async_request(request)


def hung_fleet(apps, hung=(0,)):
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    now = [1000.0]
    transports = [Hung(a) if i in hung else Counting(a) for i, a in enumerate(apps)]
    fleet = [Replica(f"replica-{i}", replica_client(f"/run/replica-{i}.sock", transport=t))
             for i, t in enumerate(transports)]
    service = RouterService(fleet, make_router("least_loaded"), view="ask", clock=lambda: now[0])
    return service, create_router_app(service), transports, now


def test_a_replica_that_does_not_answer_is_passed_over_unasked_until_its_rest_is_over(replicas):
    service, app, transports, now = hung_fleet(replicas)
    hung = service.replicas[0]

    def ask(step_now=None):
        async def go(client):
            if step_now is not None:
                now[0] = step_now
            return await post(client, SYSTEM_1 + "Q?")
        return go

    def questions():
        return hung.questions, hung.failed_questions, hung.skipped_questions

    first, second = drive(app, [ask(), ask()])
    assert [a.headers["x-kvd-replica"] for a in (first, second)] == ["replica-1", "replica-1"]
    assert questions() == (1, 1, 1)  # asked once; the second request did not wait on it
    [status, metrics] = drive(app, [lambda c: c.get("/router/status"), lambda c: c.get("/metrics")])
    row = status.json()["replicas"][0]
    assert row["resting"] == {"unanswered_in_a_row": 1, "seconds_left": 1.0}
    assert row["last_error"] == "ReadTimeout: timed out"
    lines = metrics.text.splitlines()
    assert 'kvd_router_replica_resting{replica="replica-0"} 1.0' in lines
    assert 'kvd_router_replica_resting{replica="replica-1"} 0.0' in lines
    assert 'kvd_router_questions_total{replica="replica-0",result="skipped"} 1.0' in lines
    drive(app, [ask(1001.0)])  # its rest over: asked again, unanswered again, and a longer rest
    assert questions() == (2, 2, 1) and service.status()["replicas"][0]["resting"]["seconds_left"] == 2.0
    drive(app, [ask(1002.9)])
    assert questions() == (2, 2, 2)
    transports[0].hung = False
    back, after = drive(app, [ask(1003.0), ask()])
    assert questions() == (4, 2, 2)  # asked, answered: asked by every request again
    assert hung.unanswered.in_a_row == 0 and "resting" not in service.status()["replicas"][0]
    assert back.status_code == after.status_code == 200


def test_where_every_replica_rests_each_is_asked_all_the_same(replicas):
    service, app, transports, now = hung_fleet(replicas, hung=(0, 1))
    first, second = drive(app, [lambda c: post(c, "Q1?"), lambda c: post(c, "Q2?")])
    assert [r.failed_questions for r in service.replicas] == [2, 2]  # the second request asked both again
    assert [r.skipped_questions for r in service.replicas] == [0, 0]
    assert second.status_code == 503 and second.json()["error"]["message"] == (
        "no replica answered: replica-0 (ReadTimeout: timed out); replica-1 (ReadTimeout: timed out)")
    transports[1].hung = False
    [served] = drive(app, [lambda c: post(c, "Q3?")])  # replica-1 is back: the next request finds it
    assert served.status_code == 200 and served.headers["x-kvd-replica"] == "replica-1"
    assert [r.skipped_questions for r in service.replicas] == [0, 0]


def test_with_the_events_view_a_load_poll_answered_ends_the_rest():
    from kvctl.daemon.server.router_service import EVENTS_VIEW_MAX_REST_S, Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    now = [50.0]
    replica = Replica("r", replica_client("/run/r.sock", transport=httpx.MockTransport(
        lambda request: httpx.Response(503))))
    service = RouterService([replica], make_router("round_robin"), clock=lambda: now[0])
    assert replica.unanswered.max_seconds == EVENTS_VIEW_MAX_REST_S == 60.0
    replica.view.note_load({}, 40.0)
    for _ in range(8):
        replica.unanswered.failed(now[0], now[0])
    assert replica.unanswered.backoff_seconds == 60.0  # (15 s with the ask view)
    assert service.resting(replica, 100.0) and not service.answering(replica)
    replica.view.note_load({}, 49.9)  # a poll asked before the latest question: it says nothing of now
    assert service.resting(replica, 100.0)
    replica.view.note_load({}, 50.0)  # asked as the question was, and answered
    assert not service.resting(replica, 51.0) and replica.unanswered.in_a_row == 0


def test_the_fleet_status_says_which_replica_is_not_asked_and_until_when():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    data = {"routing": "prefix", "view": "events",
            "replica_status": [{"replica": "a", **live}, {"replica": "b", "error": "ReadTimeout: timed out"}],
            "replicas": [{"replica": "a", "sent": 9, "open": 0, "view": {"synced": True}},
                         {"replica": "b", "sent": 1, "open": 0, "last_error": "ReadTimeout: timed out",
                          "view": {"synced": True}, "resting": {"unanswered_in_a_row": 3, "seconds_left": 3.5}}]}
    console = Console(record=True, width=200)
    render_fleet_status(data, console)
    text = console.export_text()
    assert text.splitlines()[3].split()[:5] == ["b", "1", "0", "not", "asked"]
    assert ("b not asked: 3 questions in a row unanswered (last error: ReadTimeout: timed out); requests ask it "
            "again once its load poll answers, or in 3.50 s") in " ".join(text.split())
    assert "b down" not in text  # (the line above says why, once)


def test_while_a_probe_is_out_to_a_replica_that_did_not_answer_the_others_do_not_ask_it():
    book = Unanswered()
    book.asking()  # the first question: nothing known yet, so nothing rests
    assert not book.probing and not book.resting(0.0)
    book.failed(0.0, 2.0)
    assert book.resting(2.5) and not book.resting(3.0)
    book.asking()  # its rest over: this question is the probe
    assert book.resting(3.1) and book.resting(99.0)  # whatever the clock, until it is answered or not
    book.failed(3.0, 5.0)
    assert not book.probing and book.seconds_left(5.0) == 2.0
    book.asking()
    book.answered()
    assert not book.resting(7.5)


def test_a_probe_whose_request_is_given_up_leaves_no_rest_behind():
    """The caller leaves while the probe is out: the question is cancelled, and the replica is not
    left resting for good (with the ask view, no load poll would end it)."""
    import asyncio

    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    class Never(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            await asyncio.sleep(3600)

    replica = Replica("r", replica_client("/run/r.sock", transport=Never()))
    service = RouterService([replica], make_router("round_robin"), view="ask", clock=lambda: 10.0)
    replica.unanswered.failed(0.0, 1.0)  # one unanswered before: the next question is a probe

    async def go():
        task = asyncio.ensure_future(service.ask(replica, {"tokens": [1, 2]}, None))
        await asyncio.sleep(0.05)
        assert replica.unanswered.probing and service.resting(replica, 10.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert not replica.unanswered.probing and not service.resting(replica, 10.0)


def test_the_fleet_s_own_questions_pass_a_resting_replica_over_and_an_answer_ends_its_rest(replicas):
    """What the router asks every replica (its status, the models, a listing, /readyz, a tokenize,
    an operator's eviction) notes what came of it as a route question does, and passes a replica
    resting unanswering over (its row says so) rather than waiting out its timeout each time."""
    service, app, transports, now = hung_fleet(replicas, hung=(0,))
    hung = service.replicas[0]
    asked = transports[0].asked
    status, models, pins, ready, tokens = drive(app, [
        lambda c: c.get("/admin/status"), lambda c: c.get("/v1/models"), lambda c: c.get("/admin/pins"),
        lambda c: c.get("/readyz"), lambda c: c.post("/tokenize", json={"prompt": "Hi"})])
    assert asked == ["/admin/status"]  # unanswered: it rests, and the rest pass it over
    assert status.json()["replica_status"][0] == {"replica": "replica-0", "error": "ReadTimeout: timed out"}
    assert status.json()["replicas"][0]["resting"] == {"unanswered_in_a_row": 1, "seconds_left": 1.0}
    assert [m["id"] for m in models.json()["data"]] == ["kvd-demo-llama-v1"]
    assert pins.json()["message"] == ("not listed: replica-0 (not asked: it has answered nothing lately "
                                      "(ReadTimeout: timed out); asked again in 1 s)")
    assert ready.json() == {"ready": True, "replicas": ["replica-1"]}
    assert tokens.status_code == 200 and tokens.json()["count"] == len(tokens.json()["tokens"]) == 3
    [evicted] = drive(app, [lambda c: c.post("/admin/evict", json={"tenant": "acme"})])  # an operator's action too
    assert asked == ["/admin/status"] and evicted.json()["result"] == "partial"
    assert evicted.json()["message"] == ("replica-0: not reached (not asked: it has answered nothing lately "
                                         "(ReadTimeout: timed out); asked again in 1 s)")
    transports[0].hung = False
    now[0] += 1.0  # its rest over: the next question is asked, answered, and the rest is over
    [again, ready] = drive(app, [lambda c: c.get("/admin/status"), lambda c: c.get("/readyz")])
    assert asked == ["/admin/status", "/admin/status", "/readyz"] and hung.unanswered.in_a_row == 0
    assert "error" not in again.json()["replica_status"][0] and "resting" not in again.json()["replicas"][0]
    assert ready.json() == {"ready": True, "replicas": ["replica-0", "replica-1"]}


def test_with_the_events_view_a_load_poll_left_unanswered_rests_the_replica_before_any_request_asks():
    """The events view polls each replica's load: a poll that times out rests the replica as a
    question would (no request need wait out a question first), and the next poll answered ends
    the rest."""
    import asyncio

    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    hung = [True]

    def answer(request):
        if request.url.path == "/admin/route-facts":
            if hung[0]:
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(200, json={"prompt_tokens": 0, "cached_tokens": 0, "waiting": 0, "running": 0})
        return httpx.Response(503)  # (its event feed: not followed here)

    replica = Replica("r", replica_client("/run/r.sock", transport=httpx.MockTransport(answer)))
    service = RouterService([replica], make_router("round_robin"), load_interval=0.01)

    async def go():
        tasks = service.follow()
        try:
            async with asyncio.timeout(30):
                while not replica.unanswered.in_a_row:
                    await asyncio.sleep(0.005)
                assert service.resting(replica, service.clock()) and replica.last_error == "ReadTimeout: timed out"
                assert replica.questions == 0  # no request asked it: the poll did
                hung[0] = False
                while replica.view.load is None:  # (the first poll answered)
                    await asyncio.sleep(0.005)
                assert not service.resting(replica, service.clock()) and replica.unanswered.in_a_row == 0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(go())


class FailsRequests(Counting):
    """Passes requests to an app, but while `failing` answers each completion as a kvd whose engine
    fails every step does: at once, a 500 engine_error (streamed: an error event)."""

    failing = True

    async def handle_async_request(self, request):
        if self.failing and request.url.path == "/v1/completions":
            error = {"error": {"message": "kvd failed while computing this request", "type": "server_error",
                               "param": None, "code": "engine_error"}}
            if json.loads(request.content).get("stream"):
                events = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                return httpx.Response(200, stream=httpx.ByteStream(events),
                                      headers={"content-type": "text/event-stream"})
            return httpx.Response(500, json=error)
        return await super().handle_async_request(request)


def test_a_replica_whose_answers_fail_is_passed_over_and_taken_back_once_it_answers(replicas):
    """A replica whose engine fails every step answers at once, so it would draw the most requests;
    after three failures of its own in a row requests pass it over (1 s, doubling), then go there
    again; an answer that is not a failure ends it."""
    from rich.console import Console

    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.fleet_status import failing_line, render_fleet_status
    from kvctl.policies.routing import make_router

    now = [1000.0]
    failing = FailsRequests(replicas[0])
    fleet = [Replica("replica-0", replica_client("/run/replica-0.sock", transport=failing)),
             Replica("replica-1", replica_client("/run/replica-1.sock", transport=Counting(replicas[1])))]
    service = RouterService(fleet, make_router("round_robin"), view="ask", clock=lambda: now[0])
    app = create_router_app(service)
    bad = fleet[0]

    def send(count, **extra):
        answers = drive(app, [lambda c: post(c, SYSTEM_1 + "Q?", **extra) for _ in range(count)])
        return [(a.headers["x-kvd-replica"], a.status_code) for a in answers]

    assert send(4) == [("replica-0", 500), ("replica-1", 200)] * 2
    assert send(2, stream=True) == [("replica-0", 200), ("replica-1", 200)]  # the third: an engine_error event
    assert bad.failing.in_a_row == 3 and service.failing(bad, now[0])
    assert send(3) == [("replica-1", 200)] * 3  # passed over
    row = service.status()["replicas"][0]
    assert row["failing"] == {"failed_in_a_row": 3, "seconds_left": 1.0}
    assert row["last_error"] == "a stream ended in engine_error"
    [metrics] = drive(app, [lambda c: c.get("/metrics")])
    assert 'kvd_router_replica_failing{replica="replica-0"} 1.0' in metrics.text.splitlines()
    assert failing_line(row).plain == ("replica-0 passed over: its last 3 answers were failures of its own (last "
                                       "error: a stream ended in engine_error); requests go there again in 1.00 s")
    [status] = drive(app, [lambda c: c.get("/admin/status")])
    console = Console(record=True, width=200)
    render_fleet_status(status.json(), console)
    lines = console.export_text().splitlines()
    assert lines[2].split()[:4] == ["replica-0", "3", "0", "failing"] and failing_line(row).plain in lines

    now[0] += 1.0  # its rest over: requests go there again; failing still, it rests twice as long
    assert sorted(send(2)) == [("replica-0", 500), ("replica-1", 200)]
    assert bad.failing.in_a_row == 4 and service.status()["replicas"][0]["failing"]["seconds_left"] == 2.0
    assert bad.last_error == "500: kvd failed while computing this request"
    failing.failing = False
    now[0] += 2.0
    assert sorted(send(2)) == [("replica-0", 200), ("replica-1", 200)]  # answered: the run is over
    assert bad.failing.in_a_row == 0 and "failing" not in service.status()["replicas"][0]


def test_sync_pins_passes_a_resting_replica_over_and_copies_to_it_once_it_answers(replicas):
    """`kvctl fleet sync-pins` lists and copies as the fleet's other questions do: a replica resting
    unanswering is not asked (its row says not listed, and why), and an answer ends its rest."""
    from .daemon_fixtures import call

    service, app, transports, now = hung_fleet(replicas, hung=(0,))
    made = call(replicas[1], "POST", "/admin/pins", headers={"X-KVD-Tenant": "acme"},
                json={"text": SYSTEM_1, "ttl": "1h"}).json()
    asked = transports[0].asked
    first, second = drive(app, [lambda c: c.post("/router/sync-pins"), lambda c: c.post("/router/sync-pins")])
    assert asked == ["/admin/pins"]  # the first listing timed out: the second did not ask it
    assert first.json()["message"] == "not listed: replica-0 (ReadTimeout: timed out)"
    assert second.json()["message"] == ("not listed: replica-0 (not asked: it has answered nothing lately "
                                        "(ReadTimeout: timed out); asked again in 1 s)")
    assert (second.json()["result"], second.json()["copied"]) == ("partial", 0)
    transports[0].hung = False
    now[0] += 1.0
    [third] = drive(app, [lambda c: c.post("/router/sync-pins")])
    assert asked == ["/admin/pins", "/admin/pins", "/admin/pins"]  # listed, then the pin copied to it
    assert (third.json()["result"], third.json()["copied"]) == ("ok", 1)
    assert third.json()["pins"][0]["copied_to"] == {"replica-0": {"cached_blocks": 0}}
    assert [p["pin_id"] for p in call(replicas[0], "GET", "/admin/pins").json()["pins"]] == [made["pin_id"]]
    assert service.replicas[0].unanswered.in_a_row == 0

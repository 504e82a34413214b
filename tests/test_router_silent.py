"""A request forwarded to a replica that then goes silent (its process stopped, its host gone
without a reset) is given up once the replica's questions have gone unanswered for 30 s, where its
caller waited out the 600 s forward timeout (silent_replicas.py)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from kvctl.policies.unanswered import Unanswered


def test_the_book_says_over_how_long_questions_went_unanswered():
    book = Unanswered()
    assert book.silent_seconds() == 0.0
    book.failed(100.0, 102.0)
    assert (book.run_began, book.silent_seconds()) == (100.0, 0.0)
    book.failed(130.5, 132.5)
    assert (book.run_began, book.since, book.silent_seconds()) == (100.0, 130.5, 30.5)
    book.answered()
    assert (book.run_began, book.silent_seconds()) == (None, 0.0)


def test_watched_chunks_pass_as_they_come_and_stop_once_the_replica_is_silent():
    from kvctl.daemon.server.silent_replicas import ReplicaSilent, watched

    async def then_nothing():
        yield b"a"
        yield b"b"
        await asyncio.Event().wait()

    async def ending():
        yield b"x"

    async def breaking():
        yield b"y"
        raise httpx.ReadError("connection reset")

    async def go():
        asked, got = [], []
        answers = iter([None, None, "answered nothing for 31 s (ReadTimeout: timed out)"])

        def silent():
            asked.append(1)
            return next(answers)

        with pytest.raises(ReplicaSilent, match=r"^answered nothing for 31 s \(ReadTimeout: timed out\)$"):
            async for chunk in watched(then_nothing(), silent, every=0.01):
                got.append(chunk)
        assert (got, len(asked)) == ([b"a", b"b"], 3)
        assert [c async for c in watched(ending(), lambda: None, every=0.01)] == [b"x"]
        got = []
        with pytest.raises(httpx.ReadError, match="connection reset"):
            async for chunk in watched(breaking(), lambda: None, every=0.01):
                got.append(chunk)
        assert got == [b"y"]

        got = []  # a caller busy with a chunk it has is never cancelled: only its wait for the next
        with pytest.raises(ReplicaSilent, match="^silent$"):
            async for chunk in watched(then_nothing(), lambda: "silent", every=0.01):
                got.append(chunk)
                await asyncio.sleep(0.05)  # (five of the watcher's turns)
        assert got == [b"a", b"b"]

        async def read_all(stream):
            return [chunk async for chunk in stream]

        reading = asyncio.ensure_future(read_all(watched(then_nothing(), lambda: None, every=0.01)))
        await asyncio.sleep(0.05)
        reading.cancel()  # the caller left: that is a cancellation still, not a silent replica
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(go())


pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .test_router import Counting, drive, replicas  # noqa: E402,F401


class GoesSilent(Counting):
    """Passes requests to a kvd app until a completion comes: that one waits for ever (streamed:
    after its first event), and every later request times out at once, as with a replica whose
    process stopped once it had the request. `answers`: it answers on, the completion held until
    the clock passes `until` (`mute_once_sent`: its questions unanswered meanwhile)."""

    def __init__(self, app, now, stream=False, answers=False, until=0.0, front_answers=False, mute_once_sent=False):
        super().__init__(app)
        self.now, self.stream, self.answers, self.until = now, stream, answers, until
        self.front_answers = front_answers  # its /healthz answers on: the process is up, its engine stuck
        self.silent, self.asked = False, []
        # with `answers`: its questions go unanswered once it has the completion (which it answers in time)
        self.mute_once_sent, self.mute = mute_once_sent, False

    async def handle_async_request(self, request):
        self.asked.append(request.url.path)
        if self.silent and not (self.front_answers and request.url.path == "/healthz"):
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/admin/route-facts" and self.mute:
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/v1/completions" and self.answers:
            self.mute = self.mute_once_sent
            while self.now[0] < self.until:
                await asyncio.sleep(0.005)
        elif request.url.path == "/v1/completions":
            self.silent = True
            if self.stream:
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=FirstEventOnly())
            await asyncio.Event().wait()
        return await super().handle_async_request(request)


class FirstEventOnly(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices": [{"index": 0, "text": " Once"}]}\n\n'
        await asyncio.Event().wait()


def fleet_of_one(app, monkeypatch, settings=None, **silence):
    import kvctl.daemon.server.router as router_module
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    monkeypatch.setattr(router_module, "DISCONNECT_CHECK_S", 0.005)  # (looked at on the router's clock below)
    now = [1000.0]
    transport = GoesSilent(app, now, **silence)
    replica = Replica("replica-0", replica_client("/run/replica-0.sock", transport=transport))
    service = RouterService([replica], make_router("least_loaded"), view="ask", clock=lambda: now[0],
                            **(settings or {}))
    return service, create_router_app(service), transport, now


def while_the_clock_runs(app, now, request):
    """`request(client)` against the router while its clock runs a second every 5 ms."""
    async def go():
        async def tick():
            while True:
                await asyncio.sleep(0.005)
                now[0] += 1.0

        ticking = asyncio.ensure_future(tick())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=60) as client:
                return await request(client)
        finally:
            ticking.cancel()
    return asyncio.run(go())


def silent_seconds(message: str) -> int:
    return int(re.search(r"answered nothing for (\d+) s \(ReadTimeout: timed out\)", message).group(1))


def test_a_request_whose_replica_goes_silent_is_answered_504_once_it_has_answered_nothing_for_30_s(
        replicas, monkeypatch):
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch)
    body = {"prompt": "Tell me a story.", "max_tokens": 4}
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json=body))
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "replica_timeout"
    message = answer.json()["error"]["message"]
    assert message.startswith("replica replica-0 answered nothing for ") and message.endswith(
        "(ReadTimeout: timed out): the router stopped waiting for this answer (it may have run there, so it was "
        "not sent elsewhere)")
    assert 30 <= silent_seconds(message) < 40
    probes = transport.asked[transport.asked.index("/v1/completions") + 1:]
    assert set(probes) == {"/admin/route-facts"} and 7 <= len(probes) <= 9  # one each 5 s, from 5 s after it was sent
    assert transport.asked.count("/v1/completions") == 1  # not sent again, anywhere
    replica = service.replicas[0]
    assert (replica.given_up, replica.failed_forwards, replica.open) == (1, 1, 0)
    [metrics, status] = drive(app, [lambda c: c.get("/metrics"), lambda c: c.get("/router/status")])
    lines = metrics.text.splitlines()
    assert 'kvd_router_given_up_total{replica="replica-0"} 1.0' in lines
    assert status.json()["replicas"][0]["given_up"] == 1
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    console = Console(record=True, width=300)
    render_fleet_status({**status.json(), "replica_status": [{"replica": "replica-0", "error": "ReadTimeout"}]},
                        console)  # (as kvctl status at the router shows it: its status unanswered too)
    assert ("replica-0 given up: 1 request it had, as it answered nothing for 30 s (last error: ReadTimeout: "
            "timed out); each a 504, or a stream's error event") in console.export_text().splitlines()


def test_a_stream_whose_replica_goes_silent_ends_with_an_error_event(replicas, monkeypatch):
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch, stream=True)
    body = {"prompt": "Tell me a story.", "max_tokens": 4, "stream": True}
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json=body))
    assert answer.status_code == 200  # (the stream had begun)
    events = [line[len("data: "):] for line in answer.text.split("\n\n") if line]
    assert json.loads(events[0])["choices"][0]["text"] == " Once" and events[-1] == "[DONE]"
    error = json.loads(events[1])["error"]
    assert error["code"] == "replica_failed" and error["message"].endswith(
        "(ReadTimeout: timed out): the router stopped waiting for the rest of this answer")
    assert 30 <= silent_seconds(error["message"]) < 40 and len(events) == 3
    assert (service.replicas[0].given_up, service.replicas[0].open) == (1, 0)


def test_a_long_answer_from_a_replica_that_answers_its_questions_is_waited_for(replicas, monkeypatch):
    """The replica takes 100 s (of the router's clock) to answer, and answers the router's load
    question each 5 s meanwhile: the request is waited for, and answered."""
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch, answers=True, until=1100.0)
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json={
        "prompt": "Tell me a story.", "max_tokens": 4, "ignore_eos": True}))  # (all 4, not an end sampled early)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    probes = transport.asked[transport.asked.index("/v1/completions") + 1:]
    assert set(probes) == {"/admin/route-facts"} and len(probes) >= 15
    assert service.replicas[0].given_up == 0 and service.replicas[0].unanswered.in_a_row == 0


def test_a_replica_whose_process_answers_but_whose_engine_is_stuck_is_silent_too(replicas, monkeypatch):
    """Its /healthz answers at once (the event loop is well), but the question the router probes
    with waits for the engine's lock, held by a step that does not end: given up all the same."""
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch, front_answers=True)
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json={
        "prompt": "Tell me a story.", "max_tokens": 4}))
    assert answer.status_code == 504 and 30 <= silent_seconds(answer.json()["error"]["message"]) < 40
    assert "/healthz" not in transport.asked and service.replicas[0].given_up == 1


def test_the_give_up_time_and_the_probes_are_the_routers_settings(replicas, monkeypatch):
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch, settings={
        "silent_give_up_seconds": 10.0, "silent_probe_seconds": 2.0})
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json={
        "prompt": "Tell me a story.", "max_tokens": 4}))
    assert answer.status_code == 504 and 10 <= silent_seconds(answer.json()["error"]["message"]) < 14
    probes = transport.asked[transport.asked.index("/v1/completions") + 1:]
    assert set(probes) == {"/admin/route-facts"} and 6 <= len(probes) <= 8  # one each 2 s, from 2 s after it was sent
    [metrics, status] = drive(app, [lambda c: c.get("/metrics"), lambda c: c.get("/router/status")])
    assert ("# HELP kvd_router_given_up_total Requests the router stopped waiting for as the replica had answered "
            "nothing for 10 s") in metrics.text
    assert status.json()["silent_give_up_seconds"] == 10.0
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    console = Console(record=True, width=300)
    render_fleet_status({**status.json(), "replica_status": [{"replica": "replica-0", "error": "ReadTimeout"}]},
                        console)
    assert ("replica-0 given up: 1 request it had, as it answered nothing for 10 s (last error: ReadTimeout: "
            "timed out); each a 504, or a stream's error event") in console.export_text().splitlines()


@pytest.mark.parametrize("give_up, answered", [(30.0, 504), (0.0, 200)])
def test_with_no_give_up_time_a_request_waits_on_a_replica_whose_questions_go_unanswered(replicas, monkeypatch,
                                                                                          give_up, answered):
    """The replica answers the completion after 100 s of the router's clock, its questions
    unanswered meanwhile: given up after 30 s by default; with silent_give_up_seconds 0, waited
    for (and not asked anything meanwhile)."""
    service, app, transport, now = fleet_of_one(replicas[0], monkeypatch, {"silent_give_up_seconds": give_up},
                                                answers=True, until=1100.0, mute_once_sent=True)
    answer = while_the_clock_runs(app, now, lambda c: c.post("/v1/completions", json={
        "prompt": "Tell me a story.", "max_tokens": 4}))
    assert answer.status_code == answered and service.replicas[0].given_up == (answered == 504)
    probes = transport.asked[transport.asked.index("/v1/completions") + 1:]
    if give_up:
        assert set(probes) == {"/admin/route-facts"} and 30 <= silent_seconds(answer.json()["error"]["message"]) < 40
    else:
        assert probes == [] and answer.json()["usage"]["completion_tokens"] == 4

"""kvd router and `/v1/responses`: a new response is routed by its conversation's prefix, as a
chat; one that continues another (`previous_response_id`) goes to the replica that answered it,
which alone keeps that conversation, and so do GET and DELETE of a kept response and the listing
of its input items."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server.response_homes import ResponseHomes  # noqa: E402

from .daemon_fixtures import sse_events  # noqa: E402
from .test_router import drive, replicas, router_app  # noqa: E402,F401
from .test_response_background import gated  # noqa: E402,F401
from .test_router_chat import SYSTEM_0, SYSTEM_1, system_homed  # noqa: E402

STICKY = "it keeps the response this one continues (previous_response_id)"


async def respond(client, **body):
    return await client.post("/v1/responses", json={"max_output_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                    **body})


def test_a_response_goes_home_by_its_prefix_and_its_next_turns_follow_it(replicas):
    service, app = router_app(replicas, "round_robin")  # (alone, it would send each turn elsewhere)
    answers = {}

    def step(name, **body):
        async def go(client):
            previous = answers[body.pop("after")].json()["id"] if "after" in body else None
            answers[name] = await respond(client, **body, **({"previous_response_id": previous} if previous else {}))
            return answers[name]
        return go

    steps = [step("a1", instructions=SYSTEM_0, input="Q1?"), step("b1", instructions=SYSTEM_1, input="Q1?"),
             step("a2", instructions=SYSTEM_0, input="Q2?", after="a1"),
             step("a3", instructions=SYSTEM_0, input="Q3?", after="a2", stream=True),
             step("b2", instructions=SYSTEM_1, input="Q2?", after="b1")]
    drive(app, steps)
    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(answers, 200)
    where = {name: a.headers["x-kvd-replica"] for name, a in answers.items()}
    assert where["a2"] == where["a3"] == where["a1"] != where["b1"] == where["b2"]
    assert [answers[n].headers["x-kvd-route"] for n in ("a2", "a3", "b2")] == [STICKY] * 3
    assert answers["a1"].headers["x-kvd-response-id"] == answers["a1"].json()["id"]
    streamed = sse_events(answers["a3"])
    assert answers["a3"].headers["x-kvd-response-id"] == streamed[-1]["response"]["id"]
    # the turn after came from the cache where the first was answered: its whole opening at least
    usage = answers["a2"].json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 256


def test_an_input_token_count_is_made_where_the_response_it_continues_is_kept(replicas):
    _, app = router_app(replicas, "round_robin")  # (alone, it would send the count elsewhere)
    seen = {}

    async def first(client):
        seen["first"] = await respond(client, instructions=SYSTEM_0, input="Q1?")
        return seen["first"]

    async def counted(client):
        return await client.post("/v1/responses/input_tokens", json={
            "instructions": SYSTEM_0, "input": "Q2?", "previous_response_id": seen["first"].json()["id"]})

    async def next_turn(client):
        return await respond(client, instructions=SYSTEM_0, input="Q2?",
                             previous_response_id=seen["first"].json()["id"])

    made, count, turned = drive(app, [first, counted, next_turn])
    assert count.status_code == 200 and count.headers["x-kvd-route"] == STICKY
    assert count.headers["x-kvd-replica"] == turned.headers["x-kvd-replica"] == made.headers["x-kvd-replica"]
    assert count.json() == {"object": "response.input_tokens", "input_tokens": turned.json()["usage"]["input_tokens"]}


def test_a_kept_response_is_read_and_deleted_where_it_was_answered(replicas):
    service, app = router_app(replicas, "round_robin")
    seen = {}

    async def make(client):
        seen["made"] = await respond(client, instructions=SYSTEM_1, input="Keep it.")
        return seen["made"]

    async def read(client):
        return await client.get(f"/v1/responses/{seen['made'].json()['id']}")

    async def delete(client):
        return await client.delete(f"/v1/responses/{seen['made'].json()['id']}")

    def items(**query):  # (the caller's query goes with it)
        async def go(client):
            return await client.get(f"/v1/responses/{seen['made'].json()['id']}/input_items", params=query)
        return go

    made, first_read, second_read, listed, limited, deleted, gone = drive(
        app, [make, read, read, items(order="asc"), items(limit="0"), delete, read])
    response_id = made.json()["id"]
    assert first_read.json() == second_read.json() == made.json()
    assert first_read.headers["x-kvd-replica"] == second_read.headers["x-kvd-replica"] == made.headers["x-kvd-replica"]
    assert listed.headers["x-kvd-replica"] == made.headers["x-kvd-replica"]
    assert [(item["role"], item["content"]) for item in listed.json()["data"]] == [
        ("user", [{"type": "input_text", "text": "Keep it."}])]
    assert (limited.status_code, limited.json()["error"]["param"]) == (400, "limit")
    assert deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    assert gone.status_code == 404 and gone.json()["error"] == {
        "message": f"response_id: no replica keeps response {response_id!r} (for this tenant)",
        "type": "not_found_error", "param": "response_id", "code": "response_not_found"}


def test_a_router_that_never_saw_a_response_answered_finds_its_home_by_asking(replicas):
    """Another router of the fleet (or this one, restarted) learns homes only from the answers it
    forwards: for a turn that continues a response it never saw, it asks the replicas which keeps
    it, and sends the turn, and a GET, there."""
    _, first_router = router_app(replicas, "round_robin")
    other, second_router = router_app(replicas, "round_robin")
    seen = {}

    async def make(client):
        seen["made"] = await respond(client, instructions=SYSTEM_1, input="Remember this.")
        return seen["made"]

    async def continued(client):
        return await respond(client, instructions=SYSTEM_1, input="And now?",
                             previous_response_id=seen["made"].json()["id"])

    async def read(client):
        return await client.get(f"/v1/responses/{seen['made'].json()['id']}")

    [made] = drive(first_router, [make])
    turned, kept = drive(second_router, [continued, read])
    assert turned.status_code == 200 and turned.headers["x-kvd-route"] == STICKY
    assert turned.headers["x-kvd-replica"] == kept.headers["x-kvd-replica"] == made.headers["x-kvd-replica"]
    assert kept.json() == made.json()
    assert other.response_homes.home(made.json()["id"]) == made.headers["x-kvd-replica"]  # noted once found


def test_the_router_remembers_a_bounded_number_of_homes_least_recently_used_first():
    homes = ResponseHomes(kept=2)
    homes.note("resp_a", "replica-0")
    homes.note("resp_b", "replica-1")
    assert homes.home("resp_a") == "replica-0"  # now the most recently used
    homes.note("resp_c", "replica-0")
    assert [homes.home(r) for r in ("resp_a", "resp_b", "resp_c")] == ["replica-0", None, "replica-0"]
    homes.forget("resp_a")
    assert homes.home("resp_a") is None and homes.home(None) is None and homes.home(["resp_c"]) is None


def test_a_new_response_goes_home_by_its_conversation_as_a_chat_would(replicas):
    first, second = (system_homed(s, name, tag="(responses) ") for s, name in ((SYSTEM_0, "replica-0"),
                                                                               (SYSTEM_1, "replica-1")))
    service, app = router_app(replicas, "prefix", view="ask")
    answers = drive(app, [lambda c: respond(c, instructions=first, input="Where?"),
                          lambda c: respond(c, instructions=second, input=[{"role": "user", "content": "Where?"}]),
                          lambda c: respond(c, input=[{"role": "robot", "content": "x"}])])
    assert [a.status_code for a in answers] == [200, 200, 400]
    assert [a.headers["x-kvd-replica"] for a in answers[:2]] == ["replica-0", "replica-1"]
    routes = [a.headers["x-kvd-route"] for a in answers]
    assert all("its home (the first by its hash within the load bound)" in route for route in routes[:2]), routes
    assert routes[2] == "no replica caches its prefix: the least loaded"
    assert answers[2].json()["error"]["param"] == "input[0].role"  # routed by load; the replica says why


def test_a_background_response_is_polled_and_cancelled_where_it_runs(replicas, gated):
    service, app = router_app(replicas, "round_robin")
    gated["script"][:] = list(range(70, 90))
    seen = {}

    async def start(client):
        seen["made"] = await respond(client, instructions=SYSTEM_0, input="Run it.", background=True,
                                     max_output_tokens=40)
        return seen["made"]

    async def poll(client):
        response_id = seen["made"].json()["id"]
        for _ in range(600):
            answer = await client.get(f"/v1/responses/{response_id}")
            if answer.json()["status"] not in ("queued", "in_progress"):
                return answer
            await asyncio.sleep(0.05)
        raise AssertionError("it never ended")

    async def cancel(client):
        return await client.post(f"/v1/responses/{seen['made'].json()['id']}/cancel")

    async def replay(client):  # (the caller's query goes with it: it has ended, so no stream again)
        return await client.get(f"/v1/responses/{seen['made'].json()['id']}", params={"stream": "true"})

    made, ended, cancelled, replayed = drive(app, [start, poll, cancel, replay])
    assert made.json()["status"] == "queued" and made.headers["x-kvd-response-id"] == made.json()["id"]
    assert ended.json()["status"] == "incomplete" and ended.json()["usage"]["output_tokens"] == 40
    home = made.headers["x-kvd-replica"]
    assert ended.headers["x-kvd-replica"] == cancelled.headers["x-kvd-replica"] == home
    assert cancelled.json() == ended.json()  # it had ended: as it ended
    assert (replayed.status_code, replayed.json()["error"]["param"]) == (400, "stream")


class OpensTheGate(httpx.AsyncBaseTransport):
    """A replica's transport (a Unix socket) that opens `gate` once a GET's answer has begun: the
    replica is then streaming a running response's events, which the gate held back."""

    def __init__(self, path: str, gate) -> None:
        self.inner, self.gate = httpx.AsyncHTTPTransport(uds=path), gate

    async def handle_async_request(self, request):
        answer = await self.inner.handle_async_request(request)
        if request.method == "GET" and request.url.path.startswith("/v1/responses/"):
            self.gate.set()
        return answer

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_background_stream_left_early_streams_again_through_the_router(replicas, gated, tmp_path):
    """Replica and router served on Unix sockets, so that a stream reaches each reader as it is
    written: the client leaves the background stream, and comes back through the router while
    the response runs; the router relays the replica's events as they come."""
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .test_inflight import serving

    gated["script"][:] = list(range(70, 90))
    gated["hold"] = 6
    replica_path, router_path = str(tmp_path / "replica.sock"), str(tmp_path / "router.sock")
    service = RouterService([Replica("replica-0", replica_client(replica_path,
                                                                 transport=OpensTheGate(replica_path, gated["gate"])))],
                            make_router("prefix"), view="ask", load_interval=0.05)

    def events_of(lines: list[str]) -> list[dict]:
        return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]

    async def go():
        replica, replica_task = await serving(replicas[0], replica_path)
        router, router_task = await serving(create_router_app(service), router_path)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=router_path), base_url="http://router",
                                         timeout=60) as client:
                body = {"input": "Keep it running.", "max_output_tokens": 30, "temperature": 0, "background": True,
                        "stream": True}
                lines = []
                async with client.stream("POST", "/v1/responses", json=body) as answer:
                    async for line in answer.aiter_lines():
                        lines.append(line)
                        if len(events_of(lines)) == 5:  # (created, in_progress, the message opened, a delta)
                            break
                first = events_of(lines)
                response_id = first[0]["response"]["id"]
                params = {"stream": "true", "starting_after": str(first[-1]["sequence_number"])}
                async with client.stream("GET", f"/v1/responses/{response_id}", params=params) as again:
                    rest = events_of([line async for line in again.aiter_lines()])
                return first, rest, again.headers["x-kvd-replica"]
        finally:
            for server, task in ((router, router_task), (replica, replica_task)):
                server.should_exit = True
                await task

    first, rest, where = asyncio.run(go())
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 30
    assert where == "replica-0"


def test_a_next_turn_whose_keeper_cannot_take_it_is_refused_there_not_sent_where_it_is_unknown(replicas):
    """The replica that answered a response alone keeps it. Drained, resting unanswered, or
    unreachable, the next turn gets a 503 (or the keeper's own refusal) saying so, with
    X-KVD-Not-Rerouted: sent to another replica it would be refused as unknown (a 404)."""
    from .test_router import Down

    service, app = router_app(replicas, "round_robin")
    [first] = drive(app, [lambda c: respond(c, instructions=SYSTEM_0, input="Q1?")])
    keeper = service.find(first.headers["x-kvd-replica"])
    other = next(r for r in service.replicas if r is not keeper)
    rid = first.json()["id"]

    def next_turn():
        sent = other.sent
        [answer] = drive(app, [lambda c: respond(c, instructions=SYSTEM_0, input="Q2?", previous_response_id=rid)])
        assert other.sent == sent  # never tried where the response is unknown
        return answer

    keeper.draining = True
    drained = next_turn()
    assert drained.status_code == 503 and drained.json()["error"]["code"] == "keeper_unavailable"
    assert drained.json()["error"]["message"] == drained.headers["x-kvd-not-rerouted"] == (
        f"previous_response_id: {rid!r} is kept at {keeper.name} alone, which takes no new request now "
        "(draining); try again once it is resumed")
    keeper.draining = False
    keeper.last_error = "ReadTimeout: timed out"
    keeper.unanswered.failed(service.clock(), service.clock())
    resting = next_turn()
    assert resting.status_code == 503 and resting.json()["error"]["message"] == (
        f"previous_response_id: {rid!r} is kept at {keeper.name} alone, which does not answer now (ReadTimeout: "
        "timed out); try again later")
    keeper.unanswered.answered()
    from kvctl.daemon.server.router_service import replica_client
    keeper.client = replica_client("/run/keeper.sock", transport=Down())
    unreachable = next_turn()
    assert unreachable.status_code == 502  # its own failure, as it came
    assert unreachable.json()["error"]["message"] == f"replica {keeper.name} failed: ConnectError: connection refused"
    assert unreachable.headers["x-kvd-not-rerouted"] == (
        f"previous_response_id: {rid!r} is kept at {keeper.name} alone, which refused the request")


def test_a_home_found_by_asking_does_not_wait_on_a_replica_that_hangs(replicas):
    """The replica that keeps the response says so; another never answers (hung). The router takes
    the first answer that names a keeper and cancels the question still out, where it waited on
    every replica's answer (a hung one's whole timeout: a transport like this one, forever)."""
    import asyncio

    from kvctl.daemon.server.router_service import Replica, replica_client

    _, first_router = router_app(replicas[:1], "round_robin")
    [made] = drive(first_router, [lambda c: respond(c, instructions=SYSTEM_1, input="Remember this.")])
    cancelled = []

    class Hangs(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(request.url.path)
                raise

    service, app = router_app(replicas[:1], "round_robin")
    service.replicas = [Replica("hung", replica_client("/run/hung.sock", transport=Hangs())), *service.replicas]
    [kept] = drive(app, [lambda c: c.get(f"/v1/responses/{made.json()['id']}")])
    assert kept.status_code == 200 and kept.json() == made.json() and kept.headers["x-kvd-replica"] == "replica-0"
    assert cancelled == [f"/v1/responses/{made.json()['id']}"]


def test_a_home_that_cannot_be_found_while_a_replica_does_not_answer_is_a_503_not_a_404(replicas):
    """A router that never saw a response answered asks the fleet which keeps it. Where none that
    answered says so and one could not say (it timed out; then it rests, and is not asked), the
    caller gets a 503 that names it, not a 404 for a response that may exist; a next turn is not
    sent where the response is unknown. Once that replica answers again, it is found there."""
    from .test_router_unanswered import hung_fleet

    _, first_router = router_app(replicas[:1], "round_robin")
    [made] = drive(first_router, [lambda c: respond(c, instructions=SYSTEM_1, input="Remember this.")])
    rid = made.json()["id"]
    service, app, transports, now = hung_fleet(replicas, hung=(0,))  # replica-0 keeps it, and hangs
    hung, other = service.replicas

    [timed_out] = drive(app, [lambda c: c.get(f"/v1/responses/{rid}")])
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "keeper_unavailable"
    assert timed_out.json()["error"]["message"] == (
        f"response_id: response {rid!r} is kept at no replica that answered; replica-0 (ReadTimeout: timed out) "
        "could not say whether it keeps it: try again later")
    assert hung.unanswered.in_a_row == 1 and service.resting(hung, now[0])

    sent = other.sent
    [resting, next_turn] = drive(app, [
        lambda c: c.get(f"/v1/conversations/{rid}"),
        lambda c: respond(c, instructions=SYSTEM_1, input="And then?", previous_response_id=rid)])
    assert hung.unanswered.in_a_row == 1  # not asked while it rests
    assert resting.status_code == 503 and resting.json()["error"]["message"] == (
        f"conversation_id: conversation {rid!r} is kept at no replica that answered; replica-0 (not asked: it has "
        "answered nothing lately (ReadTimeout: timed out); asked again in 1 s) could not say whether it keeps "
        "it: try again later")
    assert next_turn.status_code == 503 and next_turn.json()["error"]["code"] == "keeper_unavailable"
    assert next_turn.headers["x-kvd-not-rerouted"] == next_turn.json()["error"]["message"] == (
        f"previous_response_id: response {rid!r} is kept at no replica that answered; replica-0 (not asked: it "
        "has answered nothing lately (ReadTimeout: timed out); asked again in 1 s) could not say whether it "
        "keeps it: try again later")
    assert other.sent == sent  # never sent where the response is unknown

    transports[0].hung = False
    now[0] += 1.0  # its rest over: asked again, it answers
    [found, gone] = drive(app, [lambda c: c.get(f"/v1/responses/{rid}"),
                                lambda c: c.get("/v1/responses/resp_never_made")])
    assert found.status_code == 200 and found.json() == made.json() and found.headers["x-kvd-replica"] == "replica-0"
    assert hung.unanswered.in_a_row == 0
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"  # every one answered


@pytest.mark.parametrize("view, stream", [("events", False), ("events", True), ("ask", False)])
def test_a_stateless_next_turn_is_counted_with_the_replies_the_replica_keeps_the_ids_of(replicas, view, stream):
    """A client that sends its whole conversation each turn (`store: false`, as agents do) gets its
    replies spliced in as their ids at the replica that answered, as a chat does. A Responses answer
    carries no ids, so in the events view the router asks that replica for those it keeps of the
    replies it relayed (POST /admin/reply-ids, after the answer) and counts the next turn as the
    replica caches it; before, its count stopped at the first reply that tokenizes otherwise."""
    from .daemon_fixtures import call
    from .test_router import routed_cached, until_followed

    system = f"[{view} {stream}] A stateless conversation of the Responses API that goes on. " * 4
    service, app = router_app(replicas, "prefix", view=view)
    opening = [{"role": "system", "content": system}, {"role": "user", "content": "Q1?"}]
    turns = []

    async def first(client):
        turns.append(await client.post("/v1/responses", json={
            "input": opening, "max_output_tokens": 20, "temperature": 1.0, "seed": 0, "store": False,
            "stream": stream}))
        return turns[-1]

    def output_of(answer) -> list[dict]:
        return sse_events(answer)[-1]["response"]["output"] if stream else answer.json()["output"]

    async def settled(client):
        if view == "events":
            await until_followed(service, (0, 1), settled=True)

    async def second(client):
        return await client.post("/v1/responses", json={
            "input": opening + output_of(turns[0]) + [{"role": "user", "content": "And then?"}],
            "max_output_tokens": 2, "store": False})

    one, _, two = drive(app, [first, settled, second], service=service if view == "events" else None)
    assert one.headers["x-kvd-replica"] == two.headers["x-kvd-replica"]  # where the conversation is
    home = replicas[int(one.headers["x-kvd-replica"][-1])]
    [message] = output_of(one)
    text = message["content"][0]["text"]
    kept = call(home, "POST", "/admin/reply-ids", json={"texts": [text]}).json()
    [made] = kept["ids"]  # the replica keeps the reply's ids (less its stop token) ...
    first_prompt = call(home, "POST", "/tokenize", json={"messages": opening}).json()["tokens"]
    again = call(home, "POST", "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert again != made  # ... which its text does not tokenize to
    cached = two.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= (len(first_prompt) + len(made) - 1) // 16 * 16
    assert routed_cached(two) == cached  # the router counted the reply as the replica cached it
    if view == "events":
        assert service.reply_ids.ids_for("default", kept["tokenizer_digest"], text) == made
        assert service.reply_ids_asked == 0


def test_a_relayed_response_s_assistant_texts_are_asked_for_once_it_is_whole():
    """ResponseReplyWatch: the assistant messages' texts (output_text parts joined by newlines, as the
    next turn's input reads them back), once the answer is whole; nothing of one still running, of a
    message with a part that is not text, or of what is not JSON."""
    from kvctl.daemon.server.router_replies import ResponseReplyWatch

    asked = []
    watch = ResponseReplyWatch(asked.append)
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "one"},
                                                                   {"type": "output_text", "text": "two"}]}
    reasoning = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}
    call_item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    refusal = {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    watch.answer(json.dumps({"status": "completed", "output": [reasoning, message, call_item, refusal]}).encode())
    watch.answer(json.dumps({"status": "queued", "output": []}).encode())  # (background: answered later)
    watch.answer(json.dumps({"status": "in_progress", "output": [message]}).encode())
    watch.answer(b"<html>a proxy's page</html>")
    assert asked == [["one\ntwo"]]

    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    asked.clear()
    watch.events(event("response.created", response={"status": "in_progress", "output": []})
                 + event("response.output_text.delta", delta="one") + b"data: {not json\n\n")
    watch.events(event("response.output_item.done", item=message))
    assert asked == []
    watch.events(event("response.incomplete", response={"status": "incomplete", "output": [message]}))
    watch.events(event("response.completed", response={"status": "completed", "output": [reasoning]}))
    assert asked == [["one\ntwo"]]


@pytest.mark.parametrize("answer, kept", [
    ((200, {"tokenizer_digest": "bytes-1", "ids": [list(b"hello"), None]}), {"hello": list(b"hello")}),
    ((404, {"detail": "Not Found"}), {}),  # a kvd from before the route: the replies stay read as text
    ((200, {"tokenizer_digest": "bytes-2", "ids": [list(b"hello"), None]}), {}),  # another tokenizer's ids
    ((200, {"tokenizer_digest": "bytes-1", "ids": [[True, 5], list(b"x")]}), {}),  # not ids; not that text's
    ((500, "nonsense"), {}), (None, {}),  # a failure; no answer at all
])
def test_the_router_keeps_the_ids_a_replica_gives_and_no_other(answer, kept):
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    from .test_router_chat import Bytes

    questions = []

    def handle(request):
        questions.append((request.url.path, json.loads(request.content)))
        if answer is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(answer[0], json=answer[1])

    replica = Replica("r", replica_client("/run/r.sock", transport=httpx.MockTransport(handle)))
    service = RouterService([replica], make_router("prefix"), view="events")
    asyncio.run(service._fetch_reply_ids(replica, "acme", Bytes, ["hello", "there"]))
    assert questions == [("/admin/reply-ids", {"tenant": "acme", "texts": ["hello", "there"]})]
    assert {text: service.reply_ids.ids_for("acme", "bytes-1", text) for text in kept} == kept
    assert service.reply_ids.figures()["replies"] == len(kept)

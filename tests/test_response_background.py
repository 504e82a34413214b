"""`background: true`: a response runs in kvd while its client is away. The client polls it
(`queued`, `in_progress` with the output so far, then the whole response), streams its events
again from where it left (`starting_after`), or cancels it; it ends kept as any response is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

pytest.importorskip("fastapi")

from .test_responses_api import DEMO_EOS, client_for, kvd  # noqa: E402,F401

LONG = 1200  # tokens in a reply long enough to be caught running


@pytest.fixture
def gated(monkeypatch):
    """The model's reply, scripted: `script` token ids, then the EOS. The engine waits at step
    `hold` (default: none) until the test sets `gate`."""
    pytest.importorskip("torch")
    from .scripted_draws import script_draws

    state = {"script": [], "hold": None, "gate": threading.Event()}

    def sample(logits, params, seed, index, step):
        if step == state["hold"]:
            state["gate"].wait(30)
        return state["script"][step] if step < len(state["script"]) else DEMO_EOS

    script_draws(monkeypatch, sample)
    yield state
    state["gate"].set()


async def settle(client, response_id: str):
    """Polls a background response until it has ended."""
    for _ in range(600):
        now = await client.responses.retrieve(response_id)
        if now.status not in ("queued", "in_progress"):
            return now
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} still {now.status}")


def test_a_background_response_is_polled_until_it_ends_and_is_kept(kvd, gated):
    from .daemon_fixtures import blocks_all_back

    service, unix, _ = kvd
    gated["script"][:] = service.loaded.tokenizer.encode("All blocks are back.", add_special_tokens=False)
    gated["hold"] = 3

    async def go():
        client = client_for(unix)
        made = await client.responses.create(input="Hi", max_output_tokens=100, background=True)
        seen = [made.status]
        while seen[-1] != "in_progress":  # the first tokens are out; the fourth waits at the gate
            await asyncio.sleep(0.02)
            running = await client.responses.retrieve(made.id)
            seen.append(running.status)
        figures = service.responses.figures()  # (status() waits for the engine, which waits at the gate)
        gated["gate"].set()
        return made, seen, running, figures, await settle(client, made.id)

    made, seen, running, figures, ended = asyncio.run(go())
    assert (made.status, made.background, made.output, made.usage) == ("queued", True, [], None)
    assert set(seen) <= {"queued", "in_progress"}
    assert running.output[0].type == "message" and running.output[0].status == "in_progress"
    assert running.output_text == "All"[:len(running.output_text)] and running.output_text  # the output so far
    assert figures["running"] == 1
    assert (ended.status, ended.output_text, ended.background) == ("completed", "All blocks are back.", True)
    assert ended.usage.output_tokens == len(gated["script"]) + 1
    assert service.status()["responses"]["running"] == 0 and service.status()["responses"]["responses"] == 1
    assert blocks_all_back(service)


def test_the_background_responses_running_are_a_gauge(kvd):
    from kvctl.daemon.server.response_runs import Run

    from .daemon_fixtures import call

    service, unix, _ = kvd
    service.responses.begin("resp_x", Run("default", "req-x", False, lambda status: {}))
    assert "kvd_responses_running 1.0" in call(unix, "GET", "/metrics").text
    service.responses.ended("resp_x")
    assert "kvd_responses_running 0.0" in call(unix, "GET", "/metrics").text


def test_an_ended_stream_s_events_stay_while_its_response_is_kept_within_a_quarter_of_the_budget():
    from kvctl.daemon.server.response_runs import Run
    from kvctl.daemon.server.response_store import REPLAY_S, ResponseStore

    events = [{"type": "response.output_text.delta", "sequence_number": n, "delta": "x" * 90} for n in range(10)]
    size = sum(len(json.dumps(event)) for event in events)
    store = ResponseStore(8 * size + 400)  # a quarter holds two runs' events
    now = [0.0]
    store.clock = lambda: now[0]

    def ended(response_id: str, tenant: str = "acme", stream: bool = True) -> Run:
        run = Run(tenant, "req-" + response_id, stream, lambda status: {})
        for event in events if stream else ():
            run.publish(event)
        store.put(tenant, {"id": response_id, "created_at": 0}, [])
        store.begin(response_id, run)
        store.ended(response_id, run)
        return run

    first = ended("resp_1")
    assert store.replayable("acme", "resp_1") is first and store.replay_bytes == size
    # counted beside the responses' bytes, for the operator (kvctl responses, kvctl status, the metric)
    assert store.figures()["replay_bytes"] == size and store.figures()["bytes"] == store.used
    assert [(row["tenant"], row["replay_bytes"]) for row in store.tenants()] == [("acme", size)]
    assert store.replayable("globex", "resp_1") is None  # another tenant's: as if it were not there
    ended("resp_2", stream=False)  # (no events kept: made without stream)
    assert list(store.replays) == ["resp_1"]
    ended("resp_3")
    ended("resp_4")  # past a quarter of the budget: the oldest goes
    assert list(store.replays) == ["resp_3", "resp_4"] and store.replay_bytes == 2 * size
    store.delete("acme", "resp_3")
    store.purge("acme", None, dry_run=True)  # (a dry run keeps them)
    assert list(store.replays) == ["resp_4"]
    now[0] = REPLAY_S + 1
    assert store.figures()["replay_bytes"] == 0  # past REPLAY_S: not counted, though not asked for since
    assert store.replayable("acme", "resp_4") is None and store.replay_bytes == 0
    ended("resp_5")
    store.purge("acme", None)  # a purge takes them with their responses
    assert store.replayable("acme", "resp_5") is None and store.replay_bytes == 0


def test_a_cancelled_background_response_stops_its_request_and_keeps_what_it_wrote(kvd, gated):
    from .daemon_fixtures import blocks_all_back, call, settled

    service, unix, _ = kvd
    gated["script"][:] = service.loaded.tokenizer.encode("A", add_special_tokens=False) * LONG
    gated["hold"] = 5
    cancelled: list[str] = []
    cancel = service.cancel
    service.cancel = lambda request_id: (cancelled.append(request_id), cancel(request_id))[1]

    async def go():
        client = client_for(unix)
        made = await client.responses.with_raw_response.create(input="Hi", max_output_tokens=LONG, background=True)
        response = made.parse()
        while (await client.responses.retrieve(response.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        gated["gate"].set()
        first = await client.responses.cancel(response.id)
        again = await client.responses.cancel(response.id)  # it has ended: as it ended
        kept = await client.responses.retrieve(response.id)
        return made.headers["x-kvd-request-id"], first, again, kept

    request_id, first, again, kept = asyncio.run(go())
    assert set(cancelled) == {request_id}  # (the chat's stream, closed after its end, cancels it again: a no-op)
    assert first.status == "cancelled" and first.output[0].status == "incomplete"
    assert 5 <= first.usage.output_tokens < LONG  # it stopped where it was cancelled
    assert first.output_text == "A" * len(first.output_text)
    assert again.model_dump() == first.model_dump() == kept.model_dump()
    assert settled(lambda: blocks_all_back(service), bool)
    plain = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()
    refused = call(unix, "POST", f"/v1/responses/{plain['id']}/cancel")
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        f"response_id: response {plain['id']!r} was not made with background: true; only a background response can "
        "be cancelled")


@contextlib.asynccontextmanager
async def served(app, tmp_path):
    """`app` served by uvicorn on a Unix socket, and OpenAI's client for it: a stream reaches the
    client as it is written (httpx's ASGI transport gives a response only once it is whole)."""
    import httpx
    from openai import AsyncOpenAI

    from .test_inflight import serving

    path = str(tmp_path / "kvd.sock")
    server, task = await serving(app, path)
    http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://kvd", timeout=60)
    try:
        yield AsyncOpenAI(base_url="http://kvd/v1", api_key="unused", max_retries=0, http_client=http), http
    finally:
        await http.aclose()
        server.should_exit = True
        await task


def test_a_background_response_kvd_stops_serving_is_kept_failed(kvd, gated):
    from .daemon_fixtures import blocks_all_back, settled

    service, unix, _ = kvd
    gated["script"][:] = service.loaded.tokenizer.encode("A", add_special_tokens=False) * LONG
    gated["hold"] = 2

    async def go():
        client = client_for(unix)
        made = await client.responses.create(input="Hi", max_output_tokens=LONG, background=True)
        while (await client.responses.retrieve(made.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        run = service.responses.running("default", made.id)
        gated["gate"].set()
        run.task.cancel()  # what kvd's stopping does to it
        await asyncio.wait({run.task})
        return await client.responses.retrieve(made.id)

    kept = asyncio.run(go())
    assert (kept.status, kept.error.code, kept.error.message) == (
        "failed", "server_error", "kvd stopped serving it before it ended")
    assert kept.output[0].status == "incomplete" and kept.output_text.startswith("AA")
    assert settled(lambda: blocks_all_back(service), bool)


async def left_early(client) -> list:
    """Starts a background stream and leaves it after its first five events (created,
    in_progress, the message and its part opened, a delta)."""
    stream = await client.responses.create(input="Hi", max_output_tokens=100, background=True, stream=True)
    first = []
    async for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    await stream.close()
    return first


def test_a_background_stream_left_early_runs_on_to_its_end_and_streams_the_rest_after_it(kvd, gated, tmp_path):
    from kvctl.daemon.server.response_store import REPLAY_S

    from .daemon_fixtures import sse_events

    service, unix, _ = kvd
    text = "Blocks come back from the host tier."
    gated["script"][:] = service.loaded.tokenizer.encode(text, add_special_tokens=False)
    gated["hold"] = 8

    async def go():
        async with served(unix, tmp_path) as (client, http):
            first = await left_early(client)  # (while the run waits at the gate): it runs on
            gated["gate"].set()
            ended = await settle(client, first[0].response.id)
            rest = await http.get(f"/v1/responses/{ended.id}", params={"stream": "true", "starting_after": 4})
            held["bytes"], held["metrics"] = service.responses.replay_bytes, (await http.get("/metrics")).text
            clock = service.responses.clock
            service.responses.clock = lambda: clock() + REPLAY_S + 1  # (its events are let go past REPLAY_S)
            late = await http.get(f"/v1/responses/{ended.id}", params={"stream": "true"})
            return first, ended, rest, late

    held = {}
    first, ended, rest, late = asyncio.run(go())
    assert [e.sequence_number for e in first] == list(range(5))
    assert (ended.status, ended.output_text) == ("completed", text)
    assert ended.usage.output_tokens == len(gated["script"]) + 1
    # it has ended: the rest of its events, from where the client left, to the terminal one
    events = sse_events(rest)
    assert [e["sequence_number"] for e in events] == list(range(5, 5 + len(events)))
    assert events[-1]["type"] == "response.completed"
    assert (events[-1]["response"]["id"], events[-1]["response"]["status"]) == (ended.id, "completed")
    assert first[-1].delta + "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    assert late.status_code == 400 and late.json()["error"]["param"] == "stream"  # then GET it whole
    assert service.responses.replays == {} and service.responses.replay_bytes == 0
    assert held["bytes"] > 0 and f"kvd_responses_replay_bytes {float(held['bytes'])}" in held["metrics"]


def test_a_background_stream_streams_again_while_it_runs_and_refusals_name_the_field(kvd, gated, tmp_path):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, unix, tcp = kvd
    text = "Blocks come back from the host tier."
    gated["script"][:] = service.loaded.tokenizer.encode(text, add_special_tokens=False)
    gated["hold"] = 8

    async def go():
        async with served(unix, tmp_path) as (client, http):
            first = await left_early(client)
            response_id = first[0].response.id
            early = await http.post("/v1/responses", json={"input": "More", "previous_response_id": response_id})
            follow = await client.responses.retrieve(response_id, stream=True,
                                                     starting_after=first[-1].sequence_number)
            gated["gate"].set()
            again = [e async for e in follow]
            later = await client.responses.with_raw_response.create(input="More", previous_response_id=response_id,
                                                                   max_output_tokens=2)
            return first, early, again, later

    first, early, again, later = asyncio.run(go())
    events = first + again
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert early.status_code == 400 and early.json()["error"]["message"] == (
        f"previous_response_id: response {first[0].response.id!r} is still running in the background; continue it "
        "once it has ended")
    assert later.status_code == 200  # it has ended: a next turn continues it

    acme = {"Authorization": f"Bearer {USER_TOKEN}"}
    refused = call(tcp, "POST", "/v1/responses", json={"input": "Hi", "background": True, "store": False},
                   headers=acme)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "background")
    assert refused.json()["error"]["message"] == (
        "background: a background response is kept for its client to fetch, and store is false")
    made = call(tcp, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=acme).json()
    replay = call(tcp, "GET", f"/v1/responses/{made['id']}?stream=true", headers=acme)
    assert replay.status_code == 400 and replay.json()["error"]["message"] == (
        "stream: kvd streams a background response's events again while it runs and for 5m after it ends, and it "
        "is neither running nor ended in the last 5m (or was not made with background and stream); GET it without "
        "stream")
    globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
    for method, path in [("GET", ""), ("POST", "/cancel"), ("GET", "?stream=true")]:
        assert call(tcp, method, f"/v1/responses/{made['id']}{path}", headers=globex).status_code == 404

"""kvd router and `/v1/responses`: a new response is routed by its conversation's prefix, as a
chat; one that continues another (`previous_response_id`) goes to the replica that answered it,
which alone keeps that conversation, and so do GET and DELETE of a kept response and the listing
of its input items."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server.response_homes import ResponseHomes  # noqa: E402

from .daemon_fixtures import sse_events  # noqa: E402
from .test_router import drive, replicas, router_app  # noqa: E402,F401
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
        "message": f"response_id: no replica is known to keep response {response_id!r} (the router learns where each "
                   "response was answered, until it restarts)",
        "type": "not_found_error", "param": "response_id", "code": "response_not_found"}


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

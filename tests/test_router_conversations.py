"""kvd router and `/v1/conversations`: a conversation is made at one replica, which alone keeps
it; its responses, its items, and every request about it go there, and a router that never saw
it made finds it by asking the fleet."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .test_router import drive, replicas, router_app  # noqa: E402,F401
from .test_router_chat import SYSTEM_1  # noqa: E402

STICKY = "it keeps the conversation this one continues (conversation)"


def test_a_conversation_s_turns_and_items_go_where_it_was_made(replicas):
    service, app = router_app(replicas, "round_robin")  # (alone, it would send each turn elsewhere)
    seen = {}

    async def make(client):
        seen["made"] = await client.post("/v1/conversations", json={"metadata": {"k": "v"}, "items": [
            {"role": "user", "content": "Hello."}]})
        return seen["made"]

    def turn(text, **extra):
        async def go(client):
            return await client.post("/v1/responses", json={
                "instructions": SYSTEM_1, "input": text, "conversation": seen["made"].json()["id"],
                "max_output_tokens": 3, "temperature": 0, "ignore_eos": True, **extra})
        return go

    def at(method, below="", **kwargs):
        async def go(client):
            return await client.request(method, f"/v1/conversations/{seen['made'].json()['id']}{below}", **kwargs)
        return go

    made, first, second, listed, added, updated, item, deleted_item, deleted, gone = drive(app, [
        make, turn("Q1?"), turn("Q2?", stream=True), at("GET", "/items", params={"order": "asc"}),
        at("POST", "/items", json={"items": [{"role": "user", "content": "Aside.", "id": "msg_aside"}]}),
        at("POST", json={"metadata": {"k": "w"}}), at("GET", "/items/msg_aside"),
        at("DELETE", "/items/msg_nope"), at("DELETE"), at("GET")])
    home = made.headers["x-kvd-replica"]
    conversation_id = made.json()["id"]
    assert made.status_code == 200 and conversation_id.startswith("conv_")
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert [a.headers["x-kvd-replica"] for a in (first, second, listed, added, updated)] == [home] * 5
    assert first.headers["x-kvd-route"] == second.headers["x-kvd-route"] == STICKY
    assert first.json()["conversation"] == {"id": conversation_id}
    assert [(i["type"], i.get("role")) for i in listed.json()["data"]] == [
        ("message", "user"), ("message", "user"), ("message", "assistant"), ("message", "user"),
        ("message", "assistant")]
    assert listed.json()["data"][3]["content"][0]["text"] == "Q2?"
    assert added.status_code == 200 and updated.json()["metadata"] == {"k": "w"}
    assert item.json()["content"] == [{"type": "input_text", "text": "Aside."}]
    assert deleted_item.status_code == 404 and deleted_item.headers["x-kvd-replica"] == home
    assert deleted.json() == {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
    assert gone.status_code == 404 and gone.json()["error"] == {
        "message": f"conversation_id: no replica keeps conversation {conversation_id!r} (for this tenant)",
        "type": "not_found_error", "param": "conversation_id", "code": "conversation_not_found"}
    assert service.response_homes.home(conversation_id) is None


def test_a_router_that_never_saw_a_conversation_made_finds_its_home_by_asking(replicas):
    _, first_router = router_app(replicas, "round_robin")
    other, second_router = router_app(replicas, "round_robin")
    seen = {}

    async def make(client):
        seen["made"] = await client.post("/v1/conversations", json={})
        return seen["made"]

    async def turn(client):
        return await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                         "conversation": {"id": seen["made"].json()["id"]}})

    [made] = drive(first_router, [make])
    [turned] = drive(second_router, [turn])
    assert turned.status_code == 200 and turned.headers["x-kvd-route"] == STICKY
    assert turned.headers["x-kvd-replica"] == made.headers["x-kvd-replica"]
    assert other.response_homes.home(made.json()["id"]) == made.headers["x-kvd-replica"]  # noted once found


def test_at_the_router_a_purge_removes_the_tenant_s_conversations_on_every_replica(replicas):
    _, app = router_app(replicas, "round_robin")
    drive(app, [lambda c: c.post("/admin/responses/purge", json={"all": True})])  # (what earlier tests left)
    made = drive(app, [lambda c: c.post("/v1/conversations", json={}) for _ in range(2)])
    assert {m.headers["x-kvd-replica"] for m in made} == {"replica-0", "replica-1"}  # one made at each
    listed, done, gone = drive(app, [lambda c: c.get("/admin/responses"),
                                     lambda c: c.post("/admin/responses/purge", json={"tenant": "default"}),
                                     lambda c: c.get(f"/v1/conversations/{made[0].json()['id']}")])
    assert [row["report"]["conversations"]["conversations"] for row in listed.json()["replicas"]] == [1, 1]
    assert done.json()["conversations"] == {"conversations": 2, "bytes": 4, "tenants": {"default": 2}}
    assert gone.status_code == 404


def test_a_new_conversation_goes_to_the_least_busy_replica_and_a_late_joiner_does_not_take_them_all():
    """conversation_home: the fewest of the router's requests open, then the replica that made one
    least recently; what each was sent before does not count, so a replica that joins a busy
    fleet takes its turn, not every new conversation until it has caught up."""
    import httpx

    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    old, joined = (Replica(name, replica_client(f"/run/{name}.sock", transport=httpx.MockTransport(
        lambda request: httpx.Response(503)))) for name in ("old", "joined"))
    old.sent = 10_000  # its traffic before the other replica joined
    service = RouterService([old, joined], make_router("round_robin"))
    assert [service.conversation_home().name for _ in range(4)] == ["old", "joined", "old", "joined"]
    old.open = 2  # busy with this router's requests now: the other one makes the next
    assert [service.conversation_home().name for _ in range(2)] == ["joined", "joined"]
    old.open, joined.draining = 0, True
    assert service.conversation_home().name == "old"
    old.draining = True
    assert service.conversation_home() is None


def test_a_new_conversation_is_made_past_a_replica_that_cannot_be_reached(replicas):
    """A replica that went down has no request open: it must not draw every new conversation.
    One that cannot be reached is passed over for the next, and not tried first again."""
    service, app = router_app(replicas, "round_robin", down=(0,))
    made = drive(app, [lambda c: c.post("/v1/conversations", json={}) for _ in range(3)])
    assert [(m.status_code, m.headers["x-kvd-replica"]) for m in made] == [(200, "replica-1")] * 3
    assert service.replicas[0].rerouted == 1  # tried once; after that, known not to answer: last
    assert service.replicas[0].last_error == "ConnectError: connection refused"
    assert {service.response_homes.home(m.json()["id"]) for m in made} == {"replica-1"}
    _, app = router_app(replicas, "round_robin", down=(0, 1))
    [none] = drive(app, [lambda c: c.post("/v1/conversations", json={})])
    assert none.status_code == 503 and none.json()["error"]["message"] == (
        "no replica answered: replica-0 (ConnectError: connection refused); "
        "replica-1 (ConnectError: connection refused)")


def test_with_the_events_view_a_replica_whose_load_polls_fail_makes_a_new_conversation_last():
    import httpx

    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.policies.routing import make_router

    now = [100.0]
    up, down = (Replica(name, replica_client(f"/run/{name}.sock", transport=httpx.MockTransport(
        lambda request: httpx.Response(503)))) for name in ("up", "down"))
    service = RouterService([down, up], make_router("round_robin"), clock=lambda: now[0])
    up.open = 3  # busier than the one that stopped answering, which has none open
    for replica in (up, down):
        replica.view.note_load({}, 99.0)
    assert [service.answering(r) for r in (down, up)] == [True, True]
    assert service.conversation_home().name == "down"  # both answer: the fewest open
    now[0] = 99.0 + service.load_stale_seconds + 0.1
    up.view.note_load({}, now[0])  # its poll answered; down's did not since
    assert [service.answering(r) for r in (down, up)] == [False, True]
    assert [service.conversation_home().name for _ in range(2)] == ["up", "up"]
    assert service.conversation_home(excluded={id(up)}).name == "down"  # tried, and failed: the other

"""`responses_store_bytes` and `conversations_store_bytes` change live on a reload: a raised
budget keeps everything, a lowered one lets go of what no longer fits (the least recently used
of the tenant holding the most first, from the file too, each one's tenant told why), and a
change that would empty or bypass the file is refused, changing nothing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.conversation_store import ConversationError, ConversationStore  # noqa: E402
from kvctl.daemon.server.response_file import ResponseFile  # noqa: E402
from kvctl.daemon.server.response_store import ResponseStore  # noqa: E402

from .kvctl_fakes import kvctl_answered  # noqa: E402
from .test_conversations import closed, item, stores  # noqa: E402
from .test_responses_api import kvd, scripted  # noqa: E402,F401


def response(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "created_at": 100, "output": []}


def kept(store: ResponseStore, response_id: str, text: str, tenant: str = "acme") -> int:
    """Keeps a response of one message `text`; the bytes it takes."""
    message = {"role": "user", "content": text}
    assert store.put(tenant, response(response_id), [message])
    return len(json.dumps(response(response_id))) + len(json.dumps(message, sort_keys=True))


def test_a_lowered_responses_budget_lets_go_of_the_biggest_tenant_s_least_recently_used_and_says_why():
    store = ResponseStore(2**20)
    sizes = {rid: kept(store, rid, text, tenant) for rid, text, tenant in (
        ("resp_a1", "a" * 300, "acme"), ("resp_a2", "b" * 300, "acme"), ("resp_g1", "g" * 100, "globex"))}
    assert store.get("acme", "resp_a1") is not None  # resp_a2 is now acme's least recently used
    assert store.resize(4 * 2**20) == 0 and len(store.entries) == 3  # raised: nothing goes
    assert store.resize(sizes["resp_a1"] + sizes["resp_g1"]) == 1
    assert list(store.entries) == ["resp_g1", "resp_a1"]  # acme held the most: its least recently used went
    figures = store.figures()
    assert (figures["budget_bytes"], figures["bytes"], figures["dropped"]) == (
        sizes["resp_a1"] + sizes["resp_g1"], sizes["resp_a1"] + sizes["resp_g1"], 1)
    assert store.gone.why("acme", "resp_a2").startswith(
        f"kvd let it go when a reload lowered responses_store_bytes to {figures['budget_bytes']} (its tenant held "
        "the most), ")
    assert store.gone.why("globex", "resp_a2") is None  # only its own tenant is told
    assert store.resize(0) == 2 and store.figures()["bytes"] == 0  # 0 (no file): none is kept from now on
    assert not store.keeps and not store.put("acme", response("resp_new"), [])
    assert store.resize(2**20) == 0 and store.put("acme", response("resp_new"), [])


def test_a_lowered_budget_trims_the_events_kept_for_replay_to_a_quarter_of_it():
    class Run:
        tenant = "acme"
        events = [{"type": "response.output_text.delta", "delta": "x" * 200}]

    store = ResponseStore(2**20)
    kept(store, "resp_1", "hi")
    store.ended("resp_1", Run())
    assert store.replayable("acme", "resp_1") is not None
    events = len(json.dumps(Run.events[0]))
    store.resize(4 * events - 4)  # the response still fits, its events no longer fit in a quarter
    assert store.get("acme", "resp_1") is not None and store.replayable("acme", "resp_1") is None
    assert store.replay_bytes == 0


def test_with_a_file_a_lowered_responses_budget_leaves_the_file_too_and_0_is_refused(tmp_path):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    try:
        first = kept(store, "resp_1", "x" * 200)
        kept(store, "resp_2", "y" * 200)
        store.get("acme", "resp_1")
        with pytest.raises(ValueError) as refused:
            store.resize(0)
        assert str(refused.value) == ("responses_store_bytes: 0 would keep no response and empty "
                                      "responses_store_file; start kvd without the file to keep none")
        assert store.budget == 2**20 and len(store.entries) == 2  # nothing changed
        assert store.resize(first) == 1
        store.file.flush()
        assert [row[0] for row in store.file.db.execute("SELECT id FROM responses")] == ["resp_1"]
    finally:
        store.close()


def test_a_lowered_conversations_budget_lets_go_of_the_least_recently_used_and_0_with_a_file_is_refused(tmp_path):
    store = ConversationStore(2**20)
    first = store.create("acme", [item("a" * 100, "msg_1")], {}, 1)
    second = store.create("acme", [item("b" * 100, "msg_2")], {}, 2)
    store.get("acme", first.id)
    assert store.resize(first.size) == 1 and list(store.entries) == [first.id]
    assert store.gone.why("acme", second.id).startswith(
        f"kvd let it go when a reload lowered conversations_store_bytes to {first.size} (its tenant held the most), ")
    assert store.resize(0) == 1 and not store.keeps
    with pytest.raises(ConversationError) as off:
        store.create("acme", [], {}, 3)
    assert str(off.value) == "items: kvd keeps no conversation (conversations_store_bytes 0)"

    path = tmp_path / "responses.sqlite"
    filed, responses = stores(path)
    try:
        one = filed.create("acme", [item("c" * 100, "msg_3")], {}, 1)
        filed.create("acme", [item("d" * 100, "msg_4")], {}, 2)
        filed.get("acme", one.id)
        with pytest.raises(ValueError) as refused:
            filed.resize(0)
        assert str(refused.value) == (
            f"conversations_store_bytes: from {2**20} to 0 with responses_store_file needs a restart (kvd reads "
            "the file's conversations at start, and leaves them there while it keeps none)")
        assert filed.resize(one.size) == 1
        responses.file.flush()
        assert [row[0] for row in responses.file.db.execute("SELECT id FROM conversations")] == [one.id]
    finally:
        closed(filed, responses)
    off, responses = stores(path, 0)
    try:
        assert off.budget_refusal(2**20) == (
            f"conversations_store_bytes: from 0 to {2**20} with responses_store_file needs a restart (kvd reads "
            "the file's conversations at start, and leaves them there while it keeps none)")
    finally:
        closed(off, responses)


def test_kvd_applies_lowered_store_budgets_on_a_reload_and_a_client_is_told_why_its_response_went(kvd, scripted):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    ids = []
    for n in range(3):
        answer = call(unix, "POST", "/v1/responses", json={"input": f"Hi {n}", "max_output_tokens": 2})
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["id"])
    made = call(unix, "POST", "/v1/conversations", json={"items": [
        {"type": "message", "role": "user", "content": "keep me"}]}).json()
    newest = service.responses.entries[ids[-1]]
    room = newest.size + sum(service.responses.held[id(part)][1] for part in newest.parts())
    result = service.reload(replace(service.config, responses_store_bytes=room, conversations_store_bytes=0))
    assert result["changed"] == {"responses_store_bytes": room, "conversations_store_bytes": 0}
    assert result["needs_restart"] == [] and result["let_go"] == {"responses": 2, "conversations": 1}
    assert list(service.responses.entries) == [ids[-1]]
    gone = call(unix, "GET", f"/v1/responses/{ids[0]}")
    assert gone.status_code == 404
    assert (f"is no longer kept: kvd let it go when a reload lowered responses_store_bytes to {room} (its tenant "
            "held the most)") in gone.json()["error"]["message"]
    refused = call(unix, "POST", "/v1/conversations", json={})
    assert refused.status_code == 400 and "conversations_store_bytes 0" in refused.json()["error"]["message"]
    status = service.status()
    assert status["responses"]["budget_bytes"] == room and status["conversations"]["budget_bytes"] == 0
    assert service.store.audit_since(0, action="reload")[0]["detail"]["let_go"] == {"responses": 2,
                                                                                     "conversations": 1}
    assert call(unix, "GET", f"/v1/conversations/{made['id']}").status_code == 404


def test_a_reload_that_would_empty_the_responses_file_is_refused_changing_nothing(tmp_path):
    from kvctl.daemon.server.calls import ServiceError

    from .daemon_fixtures import kvd_in

    with kvd_in(tmp_path, "kvd", responses_store_file=str(tmp_path / "responses.sqlite")) as (service, _):
        before = service.config
        with pytest.raises(ServiceError) as refused:
            service.reload(replace(before, responses_store_bytes=0, max_queue=7))
        assert (refused.value.status, refused.value.param, str(refused.value)) == (
            400, "responses_store_bytes", "reload refused, nothing changed: responses_store_bytes: 0 would keep no "
                                          "response and empty responses_store_file; start kvd without the file "
                                          "to keep none")
        assert service.config == before and service.engine.settings.max_queue == before.max_queue
        with pytest.raises(ServiceError) as off:
            service.reload(replace(before, conversations_store_bytes=0))
        assert off.value.param == "conversations_store_bytes" and "needs a restart" in str(off.value)
        assert service.responses.budget == service.conversations.budget == 64 * 2**20


def test_kvctl_config_reload_says_what_a_lowered_budget_let_go():
    answer = {"changed": {"responses_store_bytes": 1048576}, "previous": {"responses_store_bytes": 67108864},
              "needs_restart": [], "let_go": {"responses": 1200, "conversations": 0}}
    printed = kvctl_answered(["config", "reload"], answer)
    assert printed.exit_code == 0, printed.output
    assert printed.output.splitlines() == [
        "reloaded: responses_store_bytes 67108864 -> 1048576",
        "let go to fit the lowered budget: 1,200 responses (the least recently used of the tenants holding the most; "
        "a client naming one is told why)"]

"""`/v1/conversations` (OpenAI's Conversations API) and the Responses API's `conversation`: a
conversation's items come first in a response's prompt, its turn's input and output are added to
it as it ends, its next turn comes from the prefix cache; one response at a time writes to it;
each tenant's are its own, within a budget of bytes."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import sqlite3
import threading

import openai
import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.chat_messages import MessagesError, chat_messages  # noqa: E402
from kvctl.daemon.server.conversation_store import ConversationError, ConversationStore  # noqa: E402
from kvctl.daemon.server.responses_input import input_messages  # noqa: E402

from .test_response_background import gated, settle  # noqa: E402,F401
from .test_responses_api import INSTRUCTIONS, WEATHER, client_for, kvd, scripted  # noqa: E402,F401
from .test_tool_calls import CALL_TEXT  # noqa: E402


def item(text: str, item_id: str, role: str = "user") -> dict:
    return {"id": item_id, "type": "message", "role": role, "content": [{"type": "input_text", "text": text}],
            "status": "completed"}


# ---- the store ---------------------------------------------------------------------------------
def test_the_least_recently_used_conversation_goes_first_and_one_too_big_is_refused_whole():
    one = item("x" * 100, "msg_1")
    size = len('{}') + len(json.dumps(one))
    store = ConversationStore(2 * size)
    first = store.create("acme", [one], {}, 1)
    second = store.create("acme", [dict(one)], {}, 2)
    assert store.get("acme", first.id) is first  # first is now the more recently used
    third = store.create("globex", [dict(one)], {}, 3)
    assert (store.get("acme", second.id), store.get("acme", first.id)) == (None, first)
    assert store.get("acme", third.id) is None and store.get("globex", third.id) is third  # its tenant's only
    assert store.figures() == {"conversations": 2, "bytes": 2 * size, "budget_bytes": 2 * size, "dropped": 1,
                               "expired": 0, "turns_lost": 0}
    with pytest.raises(ConversationError) as refused:
        store.add(first, [item("y" * 103, "msg_2")])
    assert (refused.value.status, refused.value.param, str(refused.value)) == (
        413, "items", f"items: the conversation would be {2 * size + 1} bytes, more than kvd keeps for all "
                      f"conversations (conversations_store_bytes {2 * size})")
    assert first.items == [one] and store.figures()["bytes"] == 2 * size  # nothing added
    with pytest.raises(ConversationError) as twice:
        store.add(first, [item("z", "msg_1")])
    assert (twice.value.param, str(twice.value)) == (
        "items[0].id", "items[0].id: the conversation has an item 'msg_1' already")
    assert store.delete_item(first, "msg_1") and first.items == []
    assert store.figures()["bytes"] == size + 2
    assert not store.delete("acme", third.id) and store.delete("globex", third.id)
    assert store.figures()["bytes"] == 2
    with pytest.raises(ConversationError) as none:
        ConversationStore(0).create("acme", [], {}, 1)
    assert str(none.value) == "items: kvd keeps no conversation (conversations_store_bytes 0)"


def test_one_response_at_a_time_writes_to_a_conversation_and_a_dropped_turn_lets_go():
    store = ConversationStore(2**20)
    conversation = store.create("acme", [], {}, 1)
    turn = store.claim(conversation, [item("Hi", "msg_in")])
    with pytest.raises(ConversationError) as locked:
        store.claim(conversation, [])
    assert (locked.value.status, locked.value.code, str(locked.value)) == (
        409, "conversation_locked", f"conversation: another response is running on conversation "
                                    f"{conversation.id!r}; send this one once it has ended")
    turn.end([item("Hello", "msg_out", "assistant")])
    assert [i["id"] for i in conversation.items] == ["msg_in", "msg_out"]
    turn.end([item("again", "msg_again")])  # (once only)
    assert len(conversation.items) == 2
    failed = store.claim(conversation, [item("Hi", "msg_2")])
    failed.end(None)  # a failed or cancelled response adds nothing
    assert len(conversation.items) == 2
    abandoned = store.claim(conversation, [])
    del abandoned  # a stream whose client left before it began: its turn is gone, and so is its hold
    gc.collect()
    store.claim(conversation, []).end(None)


# ---- served ------------------------------------------------------------------------------------
def test_openai_s_client_creates_reads_updates_and_deletes_a_conversation_and_its_items(kvd):
    _, unix, _ = kvd

    async def go():
        client = client_for(unix)
        made = await client.conversations.create(
            metadata={"topic": "tiers"},
            items=[{"type": "message", "role": "user", "content": "Name a tier."},
                   {"type": "message", "role": "assistant", "content": "Host.", "id": "msg_given"}])
        read = await client.conversations.retrieve(made.id)
        listed = [i async for i in client.conversations.items.list(made.id)]
        oldest = await client.conversations.items.list(made.id, order="asc", limit=1)
        added = await client.conversations.items.create(made.id, items=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another?"}]}])
        after = await client.conversations.items.list(made.id, order="asc", after="msg_given")
        one = await client.conversations.items.retrieve("msg_given", conversation_id=made.id)
        updated = await client.conversations.update(made.id, metadata={"topic": "disk"})
        left = await client.conversations.items.delete("msg_given", conversation_id=made.id)
        remaining = [i.id async for i in client.conversations.items.list(made.id, order="asc")]
        deleted = await client.conversations.delete(made.id)
        return made, read, listed, oldest, added, after, one, updated, left, remaining, deleted

    made, read, listed, oldest, added, after, one, updated, left, remaining, deleted = asyncio.run(go())
    assert made.id.startswith("conv_") and made.object == "conversation" and made.metadata == {"topic": "tiers"}
    assert read.model_dump() == made.model_dump()
    assert [(i.role, i.content[0].type, i.content[0].text) for i in listed] == [  # the latest first
        ("assistant", "output_text", "Host."), ("user", "input_text", "Name a tier.")]
    assert listed[0].id == "msg_given" and listed[1].id.startswith("msg_")
    assert [i.id for i in oldest.data] == [listed[1].id] and oldest.has_more
    assert [i.content[0].text for i in added.data] == ["Another?"] and added.first_id == added.last_id
    assert [i.id for i in after.data] == [added.data[0].id] and not after.has_more
    assert one.id == "msg_given" and one.content[0].text == "Host."
    assert updated.metadata == {"topic": "disk"} and left.metadata == {"topic": "disk"}
    assert remaining == [listed[1].id, added.data[0].id]
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)


def test_a_conversation_is_its_tenant_s_and_bad_requests_are_refused_naming_the_field(kvd):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, _, tcp = kvd
    acme = {"Authorization": f"Bearer {USER_TOKEN}"}
    globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
    made = call(tcp, "POST", "/v1/conversations", json={"items": [{"role": "user", "content": "Hi"}]}, headers=acme)
    assert made.status_code == 200, made.text
    conversation_id = made.json()["id"]
    [first] = call(tcp, "GET", f"/v1/conversations/{conversation_id}/items", headers=acme).json()["data"]
    for method, path in [("GET", ""), ("POST", ""), ("DELETE", ""), ("GET", "/items"), ("POST", "/items"),
                         ("GET", f"/items/{first['id']}"), ("DELETE", f"/items/{first['id']}")]:
        body = {"metadata": {}} if path == "" and method == "POST" else {"items": [{"role": "user", "content": "x"}]}
        refused = call(tcp, method, f"/v1/conversations/{conversation_id}{path}", headers=globex,
                       json=body if method == "POST" else None)
        assert refused.status_code == 404, (method, path)
        assert refused.json()["error"] == {
            "message": f"conversation_id: no conversation {conversation_id!r} is kept here (kvd keeps its tenant's "
                       "conversations in memory, within conversations_store_bytes)", "type": "not_found_error",
            "param": "conversation_id", "code": "conversation_not_found"}
    asked = call(tcp, "POST", "/v1/responses", headers=globex, json={"input": "x", "conversation": conversation_id})
    assert (asked.status_code, asked.json()["error"]["param"]) == (404, "conversation")
    for path, body, status, message, param in [
        ("", {"items": [{"role": "user", "content": "x"}] * 21}, 400, "items: at most 20 items at a time, got 21",
         "items"),
        ("", {"items": [{"role": "robot", "content": "x"}]}, 400,
         "items[0].role: must be one of user, system, developer, assistant, got 'robot'", "items[0].role"),
        ("", {"metadata": {"k": 1}}, 400, "metadata.k: must be a string of at most 512 characters, got int",
         "metadata.k"),
        ("", {"metadata": {"k" * 65: "v"}}, 400, "metadata: a key is at most 64 characters, got one of 65",
         "metadata"),
        (f"/{conversation_id}", {}, 400, "metadata: required (the conversation's new metadata)", "metadata"),
        (f"/{conversation_id}/items", {"items": []}, 400, "items: must be a list of items, got an empty list", "items"),
        (f"/{conversation_id}/items", {"items": [{"role": "user", "content": "x", "id": first["id"]}]}, 400,
         f"items[0].id: the conversation has an item {first['id']!r} already", "items[0].id"),
    ]:
        refused = call(tcp, "POST", f"/v1/conversations{path}", json=body, headers=acme)
        assert refused.status_code == status, (path, body, refused.text)
        assert (refused.json()["error"]["message"], refused.json()["error"]["param"]) == (message, param)
    unknown = call(tcp, "GET", f"/v1/conversations/{conversation_id}/items?after=msg_nope", headers=acme)
    assert unknown.json()["error"]["message"] == "after: no item 'msg_nope' in this conversation's list"
    assert call(tcp, "GET", f"/v1/conversations/{conversation_id}/items/msg_nope", headers=acme).json()["error"] == {
        "message": f"item_id: conversation {conversation_id!r} has no item 'msg_nope'", "type": "not_found_error",
        "param": "item_id", "code": "item_not_found"}
    assert [i["id"] for i in call(tcp, "GET", f"/v1/conversations/{conversation_id}/items",
                                  headers=acme).json()["data"]] == [first["id"]]  # nothing refused was added
    assert service.conversations.figures()["conversations"] == 1
    metrics = call(tcp, "GET", "/metrics", headers=acme).text
    assert "kvd_conversations_kept 1.0" in metrics and "kvd_conversations_dropped_total 0.0" in metrics
    assert f"kvd_conversations_kept_bytes {float(service.conversations.figures()['bytes'])}" in metrics


def tools_chat() -> list[dict]:
    return [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]


def test_responses_continue_a_conversation_through_the_prefix_cache_and_add_their_turns(kvd, scripted):
    service, unix, _ = kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("Let me look.\n" + CALL_TEXT, add_special_tokens=False))

    async def go():
        client = client_for(unix)
        made = await client.conversations.create(items=[{"role": "user", "content": "Hello."},
                                                        {"role": "assistant", "content": "Hi."}])
        first = await client.responses.create(instructions=INSTRUCTIONS, input="Weather in Paris?", tools=[WEATHER],
                                              max_output_tokens=200, conversation=made.id)
        call = first.output[-1]
        scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
        events = [event async for event in await client.responses.create(
            instructions=INSTRUCTIONS, conversation={"id": made.id}, tools=[WEATHER], max_output_tokens=200,
            stream=True, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])]
        items = [i async for i in client.conversations.items.list(made.id, order="asc")]
        inputs = [i async for i in client.responses.input_items.list(events[-1].response.id, order="asc")]
        return made, first, events, items, inputs

    made, first, events, items, inputs = asyncio.run(go())
    second = events[-1].response
    assert first.conversation.id == second.conversation.id == made.id
    assert second.output_text == "Sunny in Paris."
    call = first.output[-1]
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
        ("function_call", None), ("function_call_output", None), ("message", "assistant")]
    assert [i.id for i in items[3:5]] == [first.output[0].id, call.id]  # its output items, as the response gave them
    assert items[6].id == second.output[0].id and items[6].content[0].text == "Sunny in Paris."
    assert [i.id for i in inputs] == [i.id for i in items[:6]]  # the conversation's items, then its own input
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello."},
                    {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    first_turn = service.chat_prompt(chat_messages(conversation[:4]), tools=tools_chat())
    assert first.usage.input_tokens == len(first_turn)
    prompt = service.chat_prompt(chat_messages(conversation), tools=tools_chat())
    assert second.usage.input_tokens == len(prompt)  # the turn as a chat client would have sent it all
    block = service.config.block_size
    assert second.usage.input_tokens_details.cached_tokens >= (len(first_turn) // block) * block > 0


def test_a_response_on_a_conversation_is_refused_while_another_writes_to_it_and_a_failure_adds_nothing(kvd, scripted):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    made = call(unix, "POST", "/v1/conversations", json={}).json()
    held = service.conversations.get("default", made["id"])
    turn = service.conversations.claim(held, [])  # (a response running on it)
    busy = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"]})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_locked"
    turn.end(None)
    both = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"],
                                                     "previous_response_id": "resp_1"})
    assert (both.status_code, both.json()["error"]["param"]) == (400, "previous_response_id")
    bad = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": {"name": "x"}})
    assert bad.json()["error"]["message"] == ("conversation: must be a conversation's id or {\"id\": ...}, got "
                                             "{'name': 'x'}")
    too_long = call(unix, "POST", "/v1/responses", json={"input": "x" * 5000, "conversation": made["id"]})
    assert too_long.status_code == 400, too_long.text  # over the context: refused before it ran
    assert too_long.json()["error"]["code"] == "cache_capacity_exceeded"
    scripted.extend([65] * 10)
    cut = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"], "store": False,
                                                    "max_output_tokens": 2})
    assert cut.json()["status"] == "incomplete"  # added as any turn is, though the response itself is not kept
    listed = call(unix, "GET", f"/v1/conversations/{made['id']}/items?order=asc").json()["data"]
    assert [(i["role"], i["status"]) for i in listed] == [("user", "completed"), ("assistant", "incomplete")]
    repeated = [{"role": "user", "content": "Hi", "id": listed[0]["id"]}]
    again = call(unix, "POST", "/v1/responses", json={"input": repeated, "conversation": made["id"]})
    assert again.json()["error"]["message"] == (f"input[0].id: conversation {made['id']!r} has an item "
                                                f"{listed[0]['id']!r} already (or this input has it twice); send this "
                                                "turn's new items only, each with an id of its own")
    twice = [{"role": "user", "content": "a", "id": "msg_twice"}, {"role": "user", "content": "b", "id": "msg_twice"}]
    again = call(unix, "POST", "/v1/responses", json={"input": twice, "conversation": made["id"]})
    assert (again.status_code, again.json()["error"]["param"]) == (400, "input[1].id")


def test_a_background_response_holds_its_conversation_until_it_ends_and_a_cancel_adds_nothing(kvd, gated):
    service, unix, _ = kvd
    gated["script"][:] = service.loaded.tokenizer.encode("Done.", add_special_tokens=False)
    gated["hold"] = 2

    async def go():
        client = client_for(unix)
        made = await client.conversations.create()
        running = await client.responses.create(input="Hi", max_output_tokens=50, background=True,
                                                conversation=made.id)
        while (await client.responses.retrieve(running.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        try:
            await client.responses.create(input="More", conversation=made.id)
            refused = None
        except openai.ConflictError as exc:
            refused = exc
        gated["gate"].set()
        ended = await settle(client, running.id)
        items = [i async for i in client.conversations.items.list(made.id, order="asc")]
        gated["script"][:] = [65] * 2000
        gated["hold"], gated["gate"] = 3, threading.Event()
        second = await client.responses.create(input="Long", max_output_tokens=1500, background=True,
                                               conversation=made.id)
        while (await client.responses.retrieve(second.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        threading.Timer(0.2, gated["gate"].set).start()  # (the cancel waits for the engine, held at the gate)
        cancelled = await client.responses.cancel(second.id)
        after = [i.id async for i in client.conversations.items.list(made.id, order="asc")]
        return refused, ended, items, cancelled, after

    refused, ended, items, cancelled, after = asyncio.run(go())
    assert refused is not None and refused.status_code == 409 and "another response is running" in refused.message
    assert ended.status == "completed" and ended.output_text == "Done."
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Hi"), ("assistant", "Done.")]
    assert cancelled.status == "cancelled" and after == [i.id for i in items]  # the cancelled turn added nothing


def test_a_stream_left_early_adds_nothing_and_lets_go_of_its_conversation(kvd, scripted):
    from starlette.requests import Request

    from kvctl.daemon.server.calls import Principal
    from kvctl.daemon.server.responses_api import ResponsesRequest

    from .daemon_fixtures import call

    service, unix, _ = kvd
    scripted.extend([65] * 2000)
    made = call(unix, "POST", "/v1/conversations", json={}).json()
    [route] = [route for r in unix.routes for route in getattr(getattr(r, "original_router", None), "routes", [r])
               if getattr(route, "path", None) == "/v1/responses" and "POST" in route.methods]
    http = Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": [], "query_string": b""})

    async def go(read: int):
        body = ResponsesRequest.model_validate({"input": "Hi", "max_output_tokens": 2000, "stream": True,
                                                "conversation": made["id"]})
        answer = await route.endpoint(body, http, Principal("default", "admin", "unix-socket"))
        events = answer.body_iterator
        for _ in range(read):
            await anext(events)
        await events.aclose()

    asyncio.run(go(5))  # left after five events
    asyncio.run(go(0))  # left before the first
    scripted[:] = service.loaded.tokenizer.encode("BBB", add_special_tokens=False)
    done = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"],
                                                      "max_output_tokens": 10}).json()
    assert done.get("status") == "completed", done
    listed = call(unix, "GET", f"/v1/conversations/{made['id']}/items?order=asc").json()["data"]
    assert [(i["role"], i["content"][0]["text"]) for i in listed] == [("user", "Hi"), ("assistant", "BBB")]


# ---- on disk -----------------------------------------------------------------------------------
def stores(path, budget: int = 2**20):
    """A conversation store and a response store on the responses file `path`, as kvd makes them."""
    from kvctl.daemon.server.conversation_file import ConversationFile
    from kvctl.daemon.server.response_file import ResponseFile
    from kvctl.daemon.server.response_store import ResponseStore

    file = ResponseFile(path)
    conversations = ConversationStore(budget, ConversationFile(file))
    return conversations, ResponseStore(2**20, file)


def closed(conversations, responses) -> None:
    conversations.close()
    responses.close()


def test_a_restart_reads_back_every_conversation_as_it_was_changed_in_its_order_of_use(tmp_path):
    path = tmp_path / "responses.sqlite"
    conversations, responses = stores(path)
    first = conversations.create("acme", [item("one", "msg_1"), item("two", "msg_2")], {"k": "v"}, 10)
    second = conversations.create("globex", [], {}, 11)
    third = conversations.create("acme", [item("x" * 50, "msg_x")], {}, 12)
    conversations.add(first, [item("three", "msg_3")])
    conversations.set_metadata(first, {"k": "w"})
    assert conversations.delete_item(first, "msg_2")
    conversations.claim(second, [item("hi", "msg_hi")]).end([item("hello", "msg_hello", "assistant")])
    assert conversations.delete("acme", third.id)
    assert conversations.get("acme", first.id) is first  # now the most recently used
    before = conversations.figures()
    closed(conversations, responses)
    assert responses.file.failed == 0

    again, responses = stores(path)
    try:
        assert again.figures() == {**before, "dropped": 0}
        assert list(again.entries) == [second.id, first.id]
        kept = again.get("acme", first.id)
        assert (kept.tenant, kept.created_at, kept.metadata) == ("acme", 10, {"k": "w"})
        assert kept.items == [item("one", "msg_1"), item("three", "msg_3")]
        assert [i["id"] for i in again.get("globex", second.id).items] == ["msg_hi", "msg_hello"]
        assert again.get("acme", third.id) is None
        size = again.entries[second.id].size  # (now the most recently used)
    finally:
        closed(again, responses)
    # room for one: the tenant holding more gives it up (globex, though its conversation was used last), from
    # the file too
    assert size > kept.size
    smaller, responses = stores(path, size)
    try:
        assert list(smaller.entries) == [first.id] and smaller.figures()["dropped"] == 1
    finally:
        closed(smaller, responses)
    with sqlite3.connect(path) as db:
        assert [row[0] for row in db.execute("SELECT id FROM conversations")] == list(smaller.entries)
        assert db.execute("SELECT COUNT(*) FROM conversation_items WHERE conversation = ?",
                          (second.id,)).fetchone() == (0,)


def test_where_truncation_cut_a_conversation_is_read_back_after_a_restart(tmp_path):
    path = tmp_path / "responses.sqlite"
    conversations, responses = stores(path)
    made = conversations.create("acme", [item("one", "msg_1"), item("two", "msg_2"), item("three", "msg_3")], {}, 10)
    conversations.set_start(made, "msg_2")
    assert (made.start(), made.updated_at) == (1, 10)  # kvd's own note: the client changed nothing
    closed(conversations, responses)
    again, responses = stores(path)
    try:
        kept = again.get("acme", made.id)
        assert (kept.prompt_start, kept.start(), kept.updated_at) == ("msg_2", 1, 10)
        again.set_start(kept, None)
    finally:
        closed(again, responses)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT prompt_start FROM conversations").fetchall() == [(None,)]


def test_a_file_an_earlier_kvd_made_gains_the_cut_s_column_and_keeps_its_conversations(tmp_path):
    path = tmp_path / "responses.sqlite"
    with sqlite3.connect(path) as db:  # the tables as kvd made them before it kept where a cut fell
        db.executescript("""
            CREATE TABLE conversations (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
                tenant TEXT NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
                metadata TEXT NOT NULL, rank INTEGER);
            CREATE TABLE conversation_items (conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL,
                body TEXT NOT NULL, PRIMARY KEY (conversation, seq));
            INSERT INTO conversations (id, tenant, created_at, updated_at, metadata) VALUES ('conv_old', 'acme', 5,
                6, '{}');""")
        db.execute("INSERT INTO conversation_items VALUES ('conv_old', 1, 'msg_1', ?)",
                   (json.dumps(item("one", "msg_1")),))
    db.close()
    conversations, responses = stores(path)
    try:
        old = conversations.get("acme", "conv_old")
        assert (old.items, old.start(), old.updated_at) == ([item("one", "msg_1")], 0, 6)
        conversations.set_start(old, "msg_1")
    finally:
        closed(conversations, responses)
    again, responses = stores(path)
    try:
        assert again.get("acme", "conv_old").prompt_start == "msg_1"
    finally:
        closed(again, responses)


def test_a_conversation_continues_after_kvd_restarts(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import call, kvd_in

    path = str(tmp_path / "responses.sqlite")
    with kvd_in(tmp_path, "first", responses_store_file=path) as (_, unix):
        made = call(unix, "POST", "/v1/conversations", json={"metadata": {"who": "ops"}}).json()
        turned = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"],
                                                            "max_output_tokens": 3, "temperature": 0})
        assert turned.status_code == 200, turned.text
        items = call(unix, "GET", f"/v1/conversations/{made['id']}/items").json()
    with kvd_in(tmp_path, "second", responses_store_file=path) as (_, unix):  # (a new kvd on the same file)
        assert call(unix, "GET", f"/v1/conversations/{made['id']}").json() == made
        assert call(unix, "GET", f"/v1/conversations/{made['id']}/items").json() == items
        again = call(unix, "POST", "/v1/responses", json={"input": "More", "conversation": made["id"],
                                                           "max_output_tokens": 3, "temperature": 0})
        assert again.status_code == 200, again.text
        listed = call(unix, "GET", f"/v1/conversations/{made['id']}/items", params={"order": "asc"}).json()["data"]
        assert [(i["role"], i["content"][0]["text"]) for i in listed[:1] + listed[2:3]] == [
            ("user", "Hi"), ("user", "More")]
        assert len(listed) == 4


# ---- the operator's view and purge ---------------------------------------------------------------
def test_the_store_purges_a_tenant_s_conversations_and_those_unchanged_for_a_span():
    now = [1000.0]
    store = ConversationStore(2**20, clock=lambda: now[0])
    old = store.create("acme", [item("a", "msg_a")], {}, 100)
    fresh = store.create("acme", [], {}, 100)
    other = store.create("globex", [item("g", "msg_g")], {}, 100)
    store.add(fresh, [item("b", "msg_b")])  # changed at 1000: no longer idle since 100
    assert (old.updated_at, fresh.updated_at) == (100, 1000)
    assert store.tenants() == {"acme": {"conversations": 2, "conversation_bytes": old.size + fresh.size},
                               "globex": {"conversations": 1, "conversation_bytes": other.size}}
    dry = store.purge(None, 500, dry_run=True)
    assert dry == {"conversations": 2, "bytes": old.size + other.size, "tenants": {"acme": 1, "globex": 1}}
    assert store.get("acme", old.id) is old  # a dry run changes nothing
    assert store.purge("acme", 500) == {"conversations": 1, "bytes": old.size, "tenants": {"acme": 1}}
    assert store.get("acme", old.id) is None and store.get("globex", other.id) is other
    assert store.purge(None, 500, expired=True)["tenants"] == {"globex": 1}
    assert store.figures()["expired"] == 1 and store.used == fresh.size


def test_an_operator_sees_and_purges_a_tenant_s_conversations_with_its_responses(kvd, scripted):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, unix, tcp = kvd
    scripted.extend(service.loaded.tokenizer.encode("Noted.", add_special_tokens=False))
    acme, globex = ({"Authorization": f"Bearer {token}"} for token in (USER_TOKEN, GLOBEX_TOKEN))
    talks = {name: call(tcp, "POST", "/v1/conversations", headers=headers,
                        json={"items": [{"role": "user", "content": f"secret of {name}"}]}).json()["id"]
             for name, headers in (("acme", acme), ("globex", globex))}
    turned = call(tcp, "POST", "/v1/responses", headers=acme, json={"input": "Hi", "conversation": talks["acme"],
                                                                    "max_output_tokens": 8})
    assert turned.status_code == 200
    listed = call(unix, "GET", "/admin/responses").json()
    rows = {row["tenant"]: row for row in listed["tenants"]}
    assert (rows["acme"]["responses"], rows["acme"]["conversations"]) == (1, 1)
    assert (rows["globex"]["responses"], rows["globex"]["conversations"]) == (0, 1)
    assert rows["acme"]["conversation_bytes"] == service.conversations.get("acme", talks["acme"]).size
    assert listed["conversations"]["conversations"] == 2 and "secret of" not in json.dumps(listed)
    done = call(unix, "POST", "/admin/responses/purge", json={"tenant": "acme"}).json()
    assert (done["responses"], done["conversations"]["conversations"], done["conversations"]["tenants"]) == (
        1, 1, {"acme": 1})
    gone = call(tcp, "GET", f"/v1/conversations/{talks['acme']}", headers=acme).json()["error"]
    assert re.fullmatch(f"conversation_id: conversation {talks['acme']!r} is no longer kept: an operator purged it "
                        r"\(kvctl responses purge\), \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", gone["message"]), gone
    # another tenant naming it learns nothing of it
    assert "no longer" not in call(tcp, "GET", f"/v1/conversations/{talks['acme']}", headers=globex).text
    asked = call(tcp, "POST", "/v1/responses", headers=acme, json={"input": "Hi", "conversation": talks["acme"]})
    assert asked.status_code == 404 and "is no longer kept: an operator purged it" in asked.json()["error"]["message"]
    assert call(tcp, "GET", f"/v1/conversations/{talks['globex']}", headers=globex).status_code == 200
    [record] = call(unix, "GET", "/admin/audit?action=responses.purge").json()["entries"]
    assert record["detail"]["conversations"]["conversations"] == 1


def test_conversations_unchanged_past_responses_max_age_are_let_go_by_housekeeping(kvd):
    import time
    from dataclasses import replace

    from kvctl.daemon.server.response_admin import expire

    from .daemon_fixtures import call

    service, unix, _ = kvd
    made = call(unix, "POST", "/v1/conversations", json={}).json()
    idle = service.conversations.get("default", made["id"])
    idle.updated_at = int(time.time()) - 7200  # (last changed two hours ago)
    kept = call(unix, "POST", "/v1/conversations", json={}).json()
    service.reload(replace(service.config, responses_max_age=3600.0))
    assert expire(service) == 1
    assert "is no longer kept: unchanged for longer than responses_max_age" in call(
        unix, "GET", f"/v1/conversations/{made['id']}").json()["error"]["message"]
    assert call(unix, "GET", f"/v1/conversations/{kept['id']}").status_code == 200
    assert service.status()["conversations"]["expired"] == 1
    assert "kvd_conversations_expired_total 1.0" in call(unix, "GET", "/metrics").text


def test_kvctl_responses_shows_each_tenant_s_conversations_and_what_a_purge_removed_of_them():
    from rich.console import Console

    from kvctl.responses_cmd import purge_text, responses_view

    listing = {"tenants": [{"tenant": "acme", "responses": 2, "bytes": 4096, "oldest": 3000.0, "newest": 3500.0,
                            "running": 0, "conversations": 7, "conversation_bytes": 10240}],
               "responses": 2, "bytes": 4096, "budget_bytes": 64 * 2**20, "dropped": 0, "running": 0,
               "conversations": {"conversations": 7, "bytes": 10240, "budget_bytes": 64 * 2**20, "dropped": 2,
                                 "expired": 1, "turns_lost": 0}}
    console = Console(width=120, record=True)
    console.print(responses_view(listing, now=3600.0))
    lines = console.export_text().splitlines()
    assert lines[0].split() == ["tenant", "responses", "bytes", "oldest", "newest", "running", "conversations",
                                "their", "bytes"]
    assert lines[1].split() == ["acme", "2", "4.0", "KiB", "10m", "ago", "1m", "ago", "0", "7", "10.0", "KiB"]
    assert ("conversations: 7 kept in 10.0 KiB of 64.0 MiB; 2 let go for room; 1 idle past responses_max_age"
            in lines)
    assert purge_text({"responses": 1, "bytes": 1024, "tenants": {"acme": 1}, "dry_run": False, "running": 0,
                       "cancelled": 0, "conversations": {"conversations": 3, "bytes": 2048, "tenants": {"acme": 3}}}
                      ) == "removed 1 responses (1.0 KiB): acme 1; and 3 conversations (2.0 KiB): acme 3"


def test_a_turn_cut_off_while_thinking_is_continued_as_previous_response_id_would(kvd, scripted):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    encode = service.loaded.tokenizer.encode
    scripted.extend(encode("<think>Still going", add_special_tokens=False))
    made = call(unix, "POST", "/v1/conversations", json={}).json()
    cut = call(unix, "POST", "/v1/responses", json={"input": "Hi", "conversation": made["id"],
                                                    "max_output_tokens": len(encode("<think>Still",
                                                                                    add_special_tokens=False))})
    assert [item["type"] for item in cut.json()["output"]] == ["reasoning"]  # nothing after its thinking
    scripted[:] = encode("Done.", add_special_tokens=False)
    again = call(unix, "POST", "/v1/responses", json={"input": "Go on.", "conversation": made["id"],
                                                      "max_output_tokens": 10})
    assert again.status_code == 200, again.text
    prompt = service.chat_prompt(chat_messages([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning_content": "Still"},
        {"role": "user", "content": "Go on."}]))
    assert again.json()["usage"]["input_tokens"] == len(prompt)
    with pytest.raises(MessagesError, match="a reasoning item goes before"):  # (a client's own input stays strict)
        input_messages([{"role": "user", "content": "x"},
                        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}]}])


def test_a_turn_s_logprobs_stay_with_its_response_not_in_the_conversation(kvd, scripted):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    scripted.extend(service.loaded.tokenizer.encode("Fine.", add_special_tokens=False))
    made = call(unix, "POST", "/v1/conversations", json={}).json()
    answer = call(unix, "POST", "/v1/responses", json={
        "input": "Hi", "conversation": made["id"], "max_output_tokens": 10, "top_logprobs": 5,
        "include": ["message.output_text.logprobs"]}).json()
    [said] = answer["output"]
    assert len(said["content"][0]["logprobs"]) == len("Fine.") and said["content"][0]["logprobs"][0]["top_logprobs"]
    kept = call(unix, "GET", f"/v1/conversations/{made['id']}/items/{said['id']}").json()
    assert kept == {**said, "content": [{**said["content"][0], "logprobs": []}]}  # the same item, without them
    assert call(unix, "GET", f"/v1/responses/{answer['id']}").json()["output"] == [said]  # (the response keeps them)

"""`GET /v1/responses/{id}/input_items`: the items a kept response was made from (the earlier
turns' inputs and outputs, then its own input), listed and paged as OpenAI's client reads them,
for the response's tenant only."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.chat_messages import MessagesError  # noqa: E402
from kvctl.daemon.server.responses_api import input_items_page  # noqa: E402
from kvctl.daemon.server.responses_input import input_items, input_messages  # noqa: E402

from .test_responses_api import INSTRUCTIONS, WEATHER, client_for, kvd, scripted  # noqa: E402,F401
from .test_tool_calls import CALL_TEXT  # noqa: E402


def test_input_becomes_items_with_ids_and_their_parts():
    given = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "Sunny"}]},
    ]
    input_messages(given)  # (taken first, as the route does)
    items = input_items(given)
    generated = [item.pop("id") for item in items]
    assert generated[1:3] == ["msg_mine", "rs_1"]  # a client's ids are kept
    assert [g[:g.index("_") + 1] for g in generated] == ["msg_", "msg_", "rs_", "msg_", "fc_", "fco_"]
    assert len(set(generated)) == 6
    assert items == [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}],
         "status": "completed"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}], "status": "completed"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "Sunny"}],
         "status": "completed"},
    ]
    [one] = input_items("Hello")
    assert (one["type"], one["role"], one["content"]) == ("message", "user", [{"type": "input_text",
                                                                                "text": "Hello"}])
    with pytest.raises(MessagesError, match=r"^input\[0\]\.id: must be a string, got 7$"):
        input_messages([{"id": 7, "role": "user", "content": "Hi"}])


ITEMS = [{"id": f"i{n}"} for n in range(1, 6)]


def ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_a_page_of_items_is_ordered_limited_and_cursored():
    latest = input_items_page(ITEMS, None, None, None, None)  # the latest first, 20 at most
    assert (ids(latest), latest["first_id"], latest["last_id"], latest["has_more"]) == (
        ["i5", "i4", "i3", "i2", "i1"], "i5", "i1", False)
    first = input_items_page(ITEMS, None, None, "2", "asc")
    assert (ids(first), first["has_more"]) == (["i1", "i2"], True)
    following = input_items_page(ITEMS, first["last_id"], None, "2", "asc")
    assert (ids(following), following["has_more"]) == (["i3", "i4"], True)
    last = input_items_page(ITEMS, following["last_id"], None, "2", "asc")
    assert (ids(last), last["has_more"]) == (["i5"], False)
    assert ids(input_items_page(ITEMS, "i4", None, None, "desc")) == ["i3", "i2", "i1"]
    assert ids(input_items_page(ITEMS, None, "i4", "2", "asc")) == ["i2", "i3"]  # the page just before i4
    assert ids(input_items_page(ITEMS, "i1", "i4", None, "asc")) == ["i2", "i3"]
    empty = input_items_page([], None, None, None, None)
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize("after, before, limit, order, message, param", [
    (None, None, "0", None, "limit: must be a whole number from 1 to 100, got '0'", "limit"),
    (None, None, "101", None, "limit: must be a whole number from 1 to 100, got '101'", "limit"),
    (None, None, "ten", None, "limit: must be a whole number from 1 to 100, got 'ten'", "limit"),
    (None, None, None, "newest", "order: must be asc or desc, got 'newest'", "order"),
    ("i9", None, None, None, "after: no input item 'i9' in this response's list", "after"),
    (None, "i9", None, None, "before: no input item 'i9' in this response's list", "before"),
])
def test_a_bad_page_is_refused_naming_the_parameter(after, before, limit, order, message, param):
    with pytest.raises(MessagesError) as raised:
        input_items_page(ITEMS, after, before, limit, order)
    assert (str(raised.value), raised.value.param) == (message, param)


def test_openai_s_client_lists_the_items_a_continued_response_was_made_from(kvd, scripted):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, unix, tcp = kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("<think>Check.</think>Let me look.\n" + CALL_TEXT, add_special_tokens=False))

    async def go():
        client = client_for(unix)
        first = await client.responses.create(instructions=INSTRUCTIONS, input="Weather in Paris?", tools=[WEATHER],
                                              max_output_tokens=200)
        scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
        events = await client.responses.create(
            instructions=INSTRUCTIONS, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=200,
            stream=True, input=[{"type": "function_call_output", "id": "fco_given", "call_id": first.output[-1].call_id,
                                 "output": "Sunny, 21 C"}])
        second = [event async for event in events][-1].response
        latest = await client.responses.input_items.list(second.id)
        pages = [await client.responses.input_items.list(second.id, order="asc", limit=2)]
        while pages[-1].has_more:
            pages.append(await client.responses.input_items.list(second.id, order="asc", limit=2,
                                                                 after=pages[-1].last_id))
        own = await client.responses.input_items.list(first.id)
        return first, second, latest, pages, own

    first, second, latest, pages, own = asyncio.run(go())
    asked = own.data[0]
    assert (len(own.data), asked.type, asked.role, asked.content[0].text) == (1, "message", "user",
                                                                               "Weather in Paris?")
    # the first turn's input, its output (reasoning, message, call), then the second's input
    context = [asked.id, *[item.id for item in first.output], "fco_given"]
    assert [item.id for item in latest.data] == context[::-1] and latest.has_more is False
    assert [item.type for item in latest.data] == ["function_call_output", "function_call", "message", "reasoning",
                                                   "message"]
    assert latest.data[0].output == "Sunny, 21 C" and latest.data[1].arguments == '{"city": "Paris"}'
    assert [[item.id for item in page.data] for page in pages] == [context[:2], context[2:4], context[4:]]
    assert second.output_text == "Sunny in Paris."

    acme = {"Authorization": f"Bearer {USER_TOKEN}"}
    made = call(tcp, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=acme).json()
    path = f"/v1/responses/{made['id']}/input_items"
    refused = call(tcp, "GET", path, headers={"Authorization": f"Bearer {GLOBEX_TOKEN}"})
    assert (refused.status_code, refused.json()["error"]["param"]) == (404, "response_id")
    assert [item["content"] for item in call(tcp, "GET", path, headers=acme).json()["data"]] == [
        [{"type": "input_text", "text": "Hi"}]]
    bad = call(tcp, "GET", path + "?limit=0", headers=acme)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "limit")
    included = call(tcp, "GET", path + "?include[]=message.input_image.image_url", headers=acme)
    assert included.status_code == 400 and included.json()["error"]["message"] == (
        "include: kvd adds nothing to the items (got ['message.input_image.image_url']); leave it out")

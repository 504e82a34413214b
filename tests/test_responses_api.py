"""`/v1/responses` (OpenAI's Responses API): input items become the chat's messages, the chat's
reply becomes output items (reasoning, message, function calls), whole or streamed alike, as
OpenAI's own client reads them; `previous_response_id` continues a kept conversation through the
prefix cache; kept responses are their tenant's, within a budget of bytes."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.chat_messages import MessagesError, chat_messages  # noqa: E402
from kvctl.daemon.server.response_store import ResponseStore  # noqa: E402
from kvctl.daemon.server.responses_api import OutputItems, ResponsesRequest, chat_body  # noqa: E402
from kvctl.daemon.server.responses_input import input_messages  # noqa: E402

from .test_tool_calls import CALL_TEXT, HERMES  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
INSTRUCTIONS = "You help operators."
DEMO_EOS = 257


# ---- input items as messages -----------------------------------------------------------------
def test_input_items_become_the_messages_a_chat_client_would_send():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    messages = input_messages(items)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Look.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}, "id": "call_1"},
            {"type": "function", "function": {"name": "get_time", "arguments": "{}"}, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    checked = chat_messages(messages)  # the chat's own checks take them as they are
    assert checked[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert checked[2]["reasoning_content"] == checked[2]["thinking"] == "Look."
    assert input_messages("Hello") == [{"role": "user", "content": "Hello"}]


def test_a_call_after_its_reasoning_opens_its_own_assistant_turn():
    messages = input_messages([
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ])
    assert messages[1] == {"role": "assistant", "content": None, "reasoning_content": "Call it.", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}, "id": "c"}]}


@pytest.mark.parametrize("items, message, param", [
    (None, "input: must be a string or a list of items, got nothing", "input"),
    ([], "input: must be a string or a list of items, got an empty list", "input"),
    ([{"role": "robot", "content": "x"}], "input[0].role: must be one of user, system, developer, assistant, got "
     "'robot'", "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0].type: kvd takes text parts only (input_text, output_text), got 'input_image'",
     "input[0].content[0].type"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type: kvd takes message, function_call, "
     "function_call_output and reasoning items, got 'item_reference'", "input[0].type"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}],
     "input[0].arguments: must be a string, got {'a': 1}", "input[0].arguments"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id: must be a string, got None",
     "input[0].call_id"),
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}]}, {"role": "user", "content": "x"}],
     "input[1]: a reasoning item goes before the assistant message or function call it led to, not before a "
     "'user' message", "input[1]"),
    ([{"role": "user", "content": "x"}, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}]}],
     "input[1]: a reasoning item goes before the assistant message or function call it led to", "input[1]"),
])
def test_malformed_input_is_refused_naming_the_item_and_field(items, message, param):
    with pytest.raises(MessagesError) as refused:
        input_messages(items)
    assert (str(refused.value), refused.value.param) == (message, param)


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


@pytest.mark.parametrize("fields, message, param", [
    ({"n": 2}, "n: a response is one reply, got 2; send n to /v1/chat/completions", "n"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type: kvd serves function tools only (no built-in tools), got "
     "'web_search'", "tools[0].type"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice: kvd takes \"none\", \"auto\", "
     "\"required\" or {\"type\": \"function\", \"name\": ...}, got {'type': 'allowed_tools', 'tools': []}",
     "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type: must be text, json_object or json_schema, got 'yaml'",
     "text.format.type"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort: must be one of minimal, low, medium, high, got 'huge'",
     "reasoning.effort"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort: the model's chat template does not read reasoning_effort, "
     "so 'low' would change nothing; leave it out", "reasoning.effort"),
    ({"metadata": {"a": 1}}, "metadata.a: must be a string of at most 512 characters, got int", "metadata.a"),
    ({"metadata": [1]}, "metadata: must be an object of at most 16 string values", "metadata"),
    ({"max_tool_calls": 0}, "max_tool_calls: must be 1 or more, got 0", "max_tool_calls"),
])
def test_what_a_chat_cannot_carry_is_refused_naming_the_field(fields, message, param):
    with pytest.raises(MessagesError) as refused:
        chat_body(request(**fields), [], frozenset())
    assert (str(refused.value), refused.value.param) == (message, param)


def test_the_chat_request_carries_the_fields_in_the_chat_s_names():
    body = request(instructions="Be brief.", max_output_tokens=7, temperature=0.5, seed=3, tools=[WEATHER],
                   tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                   text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
                   reasoning={"effort": "high"}, stream=True)
    chat, conversation = chat_body(body, [{"role": "user", "content": "Earlier"}], frozenset({"reasoning_effort"}))
    assert conversation == [{"role": "user", "content": "Earlier"}, {"role": "user", "content": "Hi"}]
    assert chat == {
        "temperature": 0.5, "seed": 3, "parallel_tool_calls": False, "stream": True, "max_completion_tokens": 7,
        "messages": [{"role": "system", "content": "Be brief."}, *conversation],
        "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        "chat_template_kwargs": {"reasoning_effort": "high"}, "stream_options": {"include_usage": True}}


def test_max_tool_calls_bounds_built_in_tools_which_kvd_has_none_of_so_it_is_echoed():
    from kvctl.daemon.server.responses_api import response_object

    body = request(max_tool_calls=2, tools=[WEATHER])
    chat, _ = chat_body(body, [], frozenset())
    assert "max_tool_calls" not in chat and chat["tools"][0]["function"]["name"] == "get_weather"
    shaped = response_object("resp_1", body, "m", 0, [], "completed", None)
    assert (shaped["max_tool_calls"], shaped["truncation"], shaped["top_logprobs"]) == (2, "disabled", 0)


# ---- output items ------------------------------------------------------------------------------
REPLY = {"role": "assistant", "reasoning_content": "Check the tool.", "content": "Let me look.",
         "tool_calls": [{"id": "call_9", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def shapes(items: list[dict], new: tuple[str, ...] = ("id",)) -> list[dict]:
    """Items without their ids (new for each response; a call's call_id too, new for each reply)."""
    return [{k: v for k, v in item.items() if k not in new} for item in items]


def test_a_whole_reply_and_the_same_reply_streamed_in_pieces_give_the_same_items():
    whole = OutputItems()
    whole.feed(REPLY)
    whole.finish("stop")
    streamed = OutputItems()
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "Check "},
                  {"reasoning_content": "the tool."}, {"content": "Let "}, {"content": "me look."},
                  {"content": "", "tool_calls": [{"index": 0, **REPLY["tool_calls"][0]}]}):
        streamed.feed(delta)
    streamed.finish("tool_calls")
    expected = [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Check the tool."}],
         "status": "completed"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "status": "completed"}]
    assert shapes(whole.items) == shapes(streamed.items) == expected
    events = streamed.take_events()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Let ", "me look."]
    assert streamed.assistant_turn() == {"role": "assistant", "content": "Let me look.",
                                         "reasoning_content": "Check the tool.", "tool_calls": REPLY["tool_calls"]}


def test_an_empty_reply_is_one_empty_message_and_one_cut_off_is_incomplete():
    empty = OutputItems()
    empty.finish("stop")
    assert shapes(empty.items) == [{"type": "message", "role": "assistant", "status": "completed", "content": [
        {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}]
    cut = OutputItems()
    cut.feed({"reasoning_content": "Still thinking"})
    cut.finish("length")
    assert shapes(cut.items) == [{"type": "reasoning", "summary": [], "status": "incomplete",
                                  "content": [{"type": "reasoning_text", "text": "Still thinking"}]}]


def test_the_events_are_those_openai_s_client_reads():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    items = OutputItems()
    items.feed(REPLY)
    items.finish("stop")
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in items.take_events():
        parsed = adapter.validate_python(event)
        assert parsed.type == event["type"] and parsed.sequence_number == event["sequence_number"]


# ---- the store ---------------------------------------------------------------------------------
def kept(store: ResponseStore, tenant: str, response_id: str):
    entry = store.get(tenant, response_id)
    return None if entry is None else entry.response["id"]


def test_kept_responses_are_their_tenant_s_and_the_least_recently_used_go_first():
    def response(n):
        return {"id": f"resp_{n}", "pad": "x" * 80}

    def conversation():  # (each response its own, as separate conversations are)
        return [{"role": "user", "content": "y" * 10}]

    def inputs():
        return [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "y"}]}]

    one = len(json.dumps(response(1))) + len(json.dumps(conversation()[0])) + len(json.dumps(inputs()[0]))
    store = ResponseStore(3 * one)
    for n in (1, 2, 3):
        assert store.put("acme", response(n), conversation(), inputs())
    assert kept(store, "globex", "resp_1") is None  # another tenant's id reads as unknown
    assert not store.delete("globex", "resp_1")
    assert kept(store, "acme", "resp_1") == "resp_1"  # now the most recently used
    store.put("acme", response(4), conversation(), inputs())
    assert [kept(store, "acme", f"resp_{n}") for n in (1, 2, 3, 4)] == ["resp_1", None, "resp_3", "resp_4"]
    assert store.get("acme", "resp_4").inputs == tuple(inputs())
    assert store.figures() == {"responses": 3, "bytes": 3 * one, "budget_bytes": 3 * one, "dropped": 1,
                               "expired": 0, "running": 0, "served_again": 0,
                               "replay_bytes": 0, "file": None}
    assert not store.put("acme", {"id": "resp_big", "pad": "x" * 4 * one}, conversation(), inputs())
    assert kept(store, "acme", "resp_big") is None and store.figures()["responses"] == 3
    assert store.delete("acme", "resp_3") and kept(store, "acme", "resp_3") is None
    assert store.figures()["bytes"] == 2 * one
    none = ResponseStore(0)  # responses_store_bytes 0: keeps none, and lets none go for room
    assert not none.keeps and not none.put("acme", response(1), conversation())
    assert none.figures() == {"responses": 0, "bytes": 0, "budget_bytes": 0, "dropped": 0, "expired": 0,
                              "running": 0, "served_again": 0, "replay_bytes": 0, "file": None}


def test_the_turns_of_a_conversation_count_their_shared_messages_once():
    """Turn N holds the messages of turns 1..N (the same objects): a conversation is counted at
    what its messages take, each let go with the last turn that holds it."""
    def size(part):
        return len(json.dumps(part))

    turns = [{"role": "user", "content": f"question {n} " + "q" * 200} for n in range(6)]
    replies = [{"role": "assistant", "content": f"answer {n} " + "a" * 200} for n in range(6)]
    items = [{"id": f"msg_{n}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
             for n in range(6)]
    store = ResponseStore(2**20)
    conversation: list[dict] = []
    for n in range(6):  # each turn continues the last: its conversation, then its question and reply
        conversation = [*conversation, turns[n], replies[n]]
        assert store.put("acme", {"id": f"resp_{n}"}, conversation, items[:n + 1])
    own = sum(size({"id": f"resp_{n}"}) for n in range(6))
    messages = sum(map(size, turns + replies)) + sum(map(size, items))
    assert store.figures()["bytes"] == own + messages  # each message once, not once per turn that holds it
    assert store.delete("acme", "resp_5")  # its question, reply and item are held by no other turn
    assert store.figures()["bytes"] == own - size({"id": "resp_5"}) + messages - sum(
        map(size, (turns[5], replies[5], items[5])))
    for n in range(5):
        assert store.delete("acme", f"resp_{n}")
    assert store.figures()["bytes"] == 0 and store.held == {}
    # within a small budget: the oldest turns go, and what the newest still holds stays counted
    small = ResponseStore(size({"id": "resp_0"}) * 2 + sum(map(size, turns[:3] + replies[:3] + items[:3])) + 10)
    conversation = []
    for n in range(3):
        conversation = [*conversation, turns[n], replies[n]]
        assert small.put("acme", {"id": f"resp_{n}"}, conversation, items[:n + 1])
    assert [kept(small, "acme", f"resp_{n}") for n in range(3)] == [None, "resp_1", "resp_2"]
    assert small.figures()["bytes"] == size({"id": "resp_1"}) + size({"id": "resp_2"}) + sum(
        map(size, turns[:3] + replies[:3] + items[:3]))
    assert small.figures()["dropped"] == 1


# ---- served ------------------------------------------------------------------------------------
@pytest.fixture
def scripted(monkeypatch):
    """The model's reply, scripted (the demo model's weights are random): the engine draws these
    token ids in turn, then the EOS; everything after the draw runs as served."""
    pytest.importorskip("torch")
    from .scripted_draws import script_draws

    script: list[int] = []
    script_draws(monkeypatch,
                 lambda logits, params, seed, index, step: script[step] if step < len(script) else DEMO_EOS)
    return script


@pytest.fixture
def kvd(tmp_path):
    """A kvd on the demo model with a Hermes-style template, the qwen3 reasoning parser and the hermes
    tool-call parser: (service, unix app, tcp app)."""
    yield from hermes_kvd(tmp_path, HERMES.replace("{{ bos_token }}", "{{ bos_token }}{% if reasoning_effort %}"
                                                   "Effort: {{ reasoning_effort }}\n{% endif %}"))


def hermes_kvd(tmp_path, template: str):
    """A kvd on the demo model with the chat template `template`, the qwen3 reasoning parser and
    the hermes tool-call parser, yielding (service, unix app, tcp app) and shutting it down after."""
    from .daemon_fixtures import apps, start_service, token_table

    path = tmp_path / "template.jinja"
    path.write_text(template, encoding="utf-8")
    service = start_service(tmp_path, chat_template=str(path), tool_call_parser="hermes", reasoning_parser="qwen3",
                            num_blocks=128)
    try:
        yield (service, *apps(service, token_table(tmp_path)))
    finally:
        service.shutdown(1)


def client_for(app, token: str | None = None):
    """OpenAI's own async client, talking to `app` in-process."""
    import httpx
    from openai import AsyncOpenAI

    transport = httpx.ASGITransport(app=app)
    return AsyncOpenAI(base_url="http://kvd/v1", api_key=token or "unused", max_retries=0,
                       http_client=httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60))


def whole_and_streamed(app, ask: dict):
    """The response to `ask` through OpenAI's client, whole, then the events of the same streamed."""
    async def go():
        client = client_for(app)
        whole = await client.responses.create(**ask)
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        return whole, events

    return asyncio.run(go())


def test_openai_s_client_gets_thinking_text_and_a_call_whole_and_streamed_alike(kvd, scripted):
    from .daemon_fixtures import blocks_all_back

    service, unix, _ = kvd
    reply = "<think>Check the tool.</think>Let me look.\n" + CALL_TEXT
    scripted.extend(service.loaded.tokenizer.encode(reply, add_special_tokens=False))
    ask = {"model": service.model_name, "instructions": INSTRUCTIONS, "input": "Weather in Paris?",
           "tools": [WEATHER], "max_output_tokens": 200}
    whole, events = whole_and_streamed(unix, ask)
    assert whole.status == "completed" and whole.object == "response" and whole.instructions == INSTRUCTIONS
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "Check the tool."
    assert whole.output_text == "Let me look."
    call = whole.output[2]
    assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Paris"}', "completed")
    prompt = service.chat_prompt(chat_messages([{"role": "system", "content": INSTRUCTIONS},
                                                {"role": "user", "content": "Weather in Paris?"}]),
                                 tools=[{"type": "function", "function": {k: WEATHER[k] for k in
                                                                          ("name", "description", "parameters")}}])
    assert whole.usage.input_tokens == len(prompt)
    assert whole.usage.output_tokens == len(scripted) + 1  # and the EOS
    assert whole.usage.output_tokens_details.reasoning_tokens == len(
        service.loaded.tokenizer.encode("Check the tool.", add_special_tokens=False))

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    final = events[-1]
    assert final.type == "response.completed"
    assert shapes([i.model_dump() for i in final.response.output], ("id", "call_id")) == \
        shapes([i.model_dump() for i in whole.output], ("id", "call_id"))
    assert final.response.usage.output_tokens_details == whole.usage.output_tokens_details
    assert (final.response.usage.input_tokens, final.response.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == ("Check the tool.", "Let me look.")
    assert blocks_all_back(service)


def test_previous_response_id_continues_the_conversation_through_the_prefix_cache(kvd, scripted):
    service, unix, _ = kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("Let me look.\n" + CALL_TEXT, add_special_tokens=False))

    async def go():
        client = client_for(unix)
        first = await client.responses.create(instructions=INSTRUCTIONS, input="Weather in Paris?", tools=[WEATHER],
                                              max_output_tokens=200)
        call = first.output[-1]
        scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
        second = await client.responses.create(
            instructions=INSTRUCTIONS, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=200,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
        kept = await client.responses.retrieve(second.id)
        return first, second, kept

    first, second, kept = asyncio.run(go())
    assert second.previous_response_id == first.id and second.output_text == "Sunny in Paris."
    call = first.output[-1]
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    prompt = service.chat_prompt(chat_messages(conversation), tools=tools)
    assert second.usage.input_tokens == len(prompt)  # the turn as a chat client would have sent it all
    # the first turn's prompt and reply came back from the cache: every full block of them
    first_turn = service.chat_prompt(chat_messages(conversation[:2]), tools=tools)
    block = service.config.block_size
    assert second.usage.input_tokens_details.cached_tokens >= (len(first_turn) // block) * block > 0
    assert kept.model_dump() == second.model_dump()


def test_input_tokens_counts_what_the_response_would_take_and_refuses_what_it_would(kvd, scripted):
    import openai

    service, unix, _ = kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("Let me look.\n" + CALL_TEXT, add_special_tokens=False))

    async def go():
        client = client_for(unix)
        ask = {"instructions": INSTRUCTIONS, "input": "Weather in Paris?", "tools": [WEATHER]}
        counted = await client.responses.input_tokens.count(**ask)
        first = await client.responses.create(**ask, max_output_tokens=200)
        scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
        follow = {"instructions": INSTRUCTIONS, "previous_response_id": first.id, "tools": [WEATHER], "input": [
            {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "Sunny, 21 C"}]}
        counted_next = await client.responses.input_tokens.count(**follow)
        second = await client.responses.create(**follow, max_output_tokens=200)
        conversation = await client.conversations.create()
        in_conversation = await client.responses.input_tokens.count(conversation=conversation.id, input="Hello?")
        items = await client.conversations.items.list(conversation.id)
        refused = []
        for fields in ({"input": "Hi", "previous_response_id": "resp_nope"}, {"input": "Hi", "model": "gpt-9"},
                       {"input": [{"type": "mystery"}]}):
            try:
                await client.responses.input_tokens.count(**fields)
            except openai.APIStatusError as exc:
                refused.append((exc.status_code, exc.body["param"], exc.body["message"]))
        return counted, first, counted_next, second, in_conversation, items, refused

    counted, first, counted_next, second, in_conversation, items, refused = asyncio.run(go())
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", first.usage.input_tokens)
    assert counted_next.input_tokens == second.usage.input_tokens > first.usage.input_tokens  # (the turn before too)
    hello = service.chat_prompt(chat_messages([{"role": "user", "content": "Hello?"}]))
    assert in_conversation.input_tokens == len(hello) and items.data == []  # counted: not added to it
    assert len(service.responses.entries) == 2  # (first and second: a count keeps nothing)
    assert [(status, param) for status, param, _ in refused] == [
        (404, "previous_response_id"), (404, "model"), (400, "input[0].type")]
    assert refused[0][2].startswith("previous_response_id: no response 'resp_nope' is kept here")


def test_kept_responses_are_read_and_deleted_by_their_tenant_only(kvd, scripted):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call, settled

    service, _, tcp = kvd
    acme = {"Authorization": f"Bearer {USER_TOKEN}"}
    globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
    made = call(tcp, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 3}, headers=acme)
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    assert made.headers["X-KVD-Request-Id"]
    assert call(tcp, "GET", f"/v1/responses/{response_id}", headers=acme).json() == made.json()
    kept = service.status()["responses"]
    assert (kept["responses"], kept["dropped"], kept["budget_bytes"]) == (1, 0, 64 * 2**20) and kept["bytes"] > 0
    finished = 'kvd_finished_total{api="responses",finish_reason="stop"} 1.0'  # counted apart from chats
    metrics = settled(lambda: call(tcp, "GET", "/metrics", headers=acme).text, lambda text: finished in text)
    assert finished in metrics and 'api="chat"' not in metrics
    assert "kvd_responses_kept 1.0" in metrics and f"kvd_responses_kept_bytes {float(kept['bytes'])}" in metrics
    assert "kvd_responses_dropped_total 0.0" in metrics
    for method in ("GET", "DELETE"):
        refused = call(tcp, method, f"/v1/responses/{response_id}", headers=globex)
        assert refused.status_code == 404
        assert refused.json()["error"] == {
            "message": f"response_id: no response {response_id!r} is kept here (kvd keeps its tenant's responses in "
                       "memory, within responses_store_bytes, until it restarts unless responses_store_file keeps "
                       "them; one sent with store: false is not kept)", "type": "not_found_error",
            "param": "response_id", "code": "response_not_found"}
    continued = call(tcp, "POST", "/v1/responses", headers=globex,
                     json={"input": "More", "previous_response_id": response_id})
    assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"
    assert call(tcp, "DELETE", f"/v1/responses/{response_id}", headers=acme).json() == {
        "id": response_id, "object": "response", "deleted": True}
    assert call(tcp, "GET", f"/v1/responses/{response_id}", headers=acme).status_code == 404
    assert service.status()["responses"]["bytes"] == 0
    unkept = call(tcp, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "store": False},
                  headers=acme).json()
    assert unkept["store"] is False
    assert call(tcp, "GET", f"/v1/responses/{unkept['id']}", headers=acme).status_code == 404


def test_a_cut_off_reply_is_incomplete_and_unsupported_fields_are_refused_by_name(kvd, scripted):
    from .daemon_fixtures import call, sse_events

    service, unix, _ = kvd
    encode = service.loaded.tokenizer.encode
    scripted.extend(encode("<think>Still going", add_special_tokens=False))
    limit = len(encode("<think>Still", add_special_tokens=False))
    cut = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": limit}).json()
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [(item["type"], item["status"], item["content"]) for item in cut["output"]] == [
        ("reasoning", "incomplete", [{"type": "reasoning_text", "text": "Still"}])]
    streamed = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": limit, "stream": True})
    events = sse_events(streamed)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert streamed.text.startswith("event: response.created\ndata: ")
    for field, value, hint in [
            ("prompt", {"id": "pmpt_1"}, "kvd keeps no prompt templates; send instructions and input"),
            ]:
        refused = call(unix, "POST", "/v1/responses", json={"input": "Hi", field: value})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == f"{field}: not supported by kvd, got {value!r}; {hint}"
    bad = call(unix, "POST", "/v1/responses", json={"input": [{"role": "robot", "content": "x"}]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "input[0].role")


def test_reasoning_effort_reaches_a_template_that_reads_it(kvd, scripted, monkeypatch):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    answer = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                        "reasoning": {"effort": "low"}}).json()
    prompt = service.chat_prompt(chat_messages([{"role": "user", "content": "Hi"}]),
                                 template_kwargs={"reasoning_effort": "low"})
    plain = service.chat_prompt(chat_messages([{"role": "user", "content": "Hi"}]))
    assert answer["usage"]["input_tokens"] == len(prompt) > len(plain)
    assert answer["reasoning"] == {"effort": "low", "summary": None}
    # the sampling values the reply was drawn with: the request's, else the checkpoint's defaults
    monkeypatch.setattr(type(service), "sampling_defaults", property(lambda self: {"temperature": 0.6}))
    drawn = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "top_p": 0.9}).json()
    assert (drawn["temperature"], drawn["top_p"]) == (0.6, 0.9)


def test_a_chat_s_reasoning_effort_reaches_a_template_that_reads_it_as_a_response_s_does(kvd, scripted, tmp_path):
    """OpenAI's chat field `reasoning_effort` (agent SDKs send it for reasoning models) is given to
    the template as `reasoning_effort`, as a response's `reasoning.effort` is; refused by name where
    it is not an effort, where chat_template_kwargs says another, or (test_chat_api's demo template)
    where the template does not read it. kvd router and kvctl --messages ask about that prompt too."""
    import json

    from kvctl.command_kit import prompt_body
    from kvctl.daemon.server.route_question import question_of

    from .daemon_fixtures import call

    service, unix, _ = kvd
    hi = [{"role": "user", "content": "Hi"}]
    answer = call(unix, "POST", "/v1/chat/completions", json={"messages": hi, "max_tokens": 2,
                                                               "reasoning_effort": "high"})
    assert answer.status_code == 200, answer.text
    prompt = service.chat_prompt(chat_messages(hi), template_kwargs={"reasoning_effort": "high"})
    assert answer.json()["usage"]["prompt_tokens"] == len(prompt) > len(service.chat_prompt(chat_messages(hi)))
    same = call(unix, "POST", "/v1/chat/completions", json={
        "messages": hi, "max_tokens": 2, "reasoning_effort": "high",
        "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert same.json()["usage"]["prompt_tokens"] == len(prompt)
    for extra, message in (
            ({"reasoning_effort": "extreme"}, "reasoning_effort: must be one of minimal, low, medium, high, got "
                                              "'extreme'"),
            ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
             "reasoning_effort: 'low' differs from chat_template_kwargs.reasoning_effort 'high'; give one")):
        refused = call(unix, "POST", "/v1/chat/completions", json={"messages": hi, **extra})
        assert refused.status_code == 400
        assert (refused.json()["error"]["param"], refused.json()["error"]["message"]) == ("reasoning_effort", message)
    # kvd router asks about the prompt the replica renders, for a chat and for a response
    assert question_of({"messages": hi, "reasoning_effort": "high"})["chat_template_kwargs"] == {
        "reasoning_effort": "high"}
    assert question_of({"input": "Hi", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"x": 1}})[
        "chat_template_kwargs"] == {"reasoning_effort": "low", "x": 1}
    assert "chat_template_kwargs" not in question_of({"messages": hi, "reasoning_effort": None})
    # and kvctl --messages sends it as the template reads it
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"messages": hi, "reasoning_effort": "medium"}))
    assert prompt_body(None, None, None, request) == {"messages": hi,
                                                      "chat_template_kwargs": {"reasoning_effort": "medium"}}
    request.write_text(json.dumps({"input": "Hi", "reasoning": {"effort": "minimal"}}))
    assert prompt_body(None, None, None, request)["chat_template_kwargs"] == {"reasoning_effort": "minimal"}


def test_a_stream_left_early_cancels_its_request_in_the_engine(kvd, scripted, monkeypatch):
    """Closing the event stream (what the server does when its client leaves) closes the chat's
    stream under it, which cancels the request: it does not run to its last token for no one."""
    from starlette.requests import Request

    from kvctl.daemon.server.calls import Principal

    from .daemon_fixtures import blocks_all_back, settled

    service, unix, _ = kvd
    scripted.extend([65] * 2000)
    cancelled: list[str] = []
    cancel = service.cancel
    monkeypatch.setattr(service, "cancel", lambda request_id: (cancelled.append(request_id), cancel(request_id))[1])
    # the route's handler (newer FastAPI holds an included router's routes under `original_router`)
    [route] = [route for r in unix.routes for route in getattr(getattr(r, "original_router", None), "routes", [r])
               if getattr(route, "path", None) == "/v1/responses" and "POST" in route.methods]
    body = ResponsesRequest.model_validate({"input": "Hi", "max_output_tokens": 2000, "stream": True})
    http = Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": [], "query_string": b""})

    async def go():
        answer = await route.endpoint(body, http, Principal("default", "admin", "unix-socket"))
        events = answer.body_iterator
        seen = [json.loads((await anext(events)).split("data: ", 1)[1]) for _ in range(5)]
        await events.aclose()  # (then at once: not when the loop's end closes what is left)
        return answer.headers["X-KVD-Request-Id"], seen, list(cancelled)

    request_id, seen, cancelled_at_close = asyncio.run(go())
    assert [e["type"] for e in seen] == ["response.created", "response.in_progress", "response.output_item.added",
                                         "response.content_part.added", "response.output_text.delta"]
    assert cancelled_at_close == [request_id]
    assert settled(lambda: blocks_all_back(service), bool)


def test_a_stream_turned_away_in_the_queue_ends_failed_and_is_not_kept():
    """A chat stream that ends with an error (pins kept the request out while it waited) ends the
    response `failed` with that error, the items begun closed as incomplete; nothing is kept."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from kvctl.daemon.server.calls import Principal
    from kvctl.daemon.server.response_store import ResponseStore
    from kvctl.daemon.server.responses_routes import responses_routes

    from .daemon_fixtures import call, sse_events

    class Served:  # what the routes read of kvd's service
        responses, chat_template, loaded, sampling_defaults, model_name = ResponseStore(2**20), None, None, {}, "m"

        @staticmethod
        def adapter_named(model):
            return ""

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Par"}, "finish_reason": None}]},
              {"error": {"message": "pins leave no room for it", "type": "server_error", "param": None,
                         "code": "pinned_out"}},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}]

    async def chat(body, http, who, api):
        assert (api, body.stream, body.messages) == ("responses", True, [{"role": "user", "content": "Hi"}])

        async def stream():
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"X-KVD-Request-Id": "r1"})

    async def who():
        return Principal("default", "admin", "unix-socket")

    app = FastAPI()
    app.include_router(responses_routes(Served, who, chat, lambda body: None))
    answer = call(app, "POST", "/v1/responses", json={"input": "Hi", "stream": True})
    events = sse_events(answer)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    failed = events[-1]["response"]
    assert (failed["status"], failed["error"]) == ("failed", {"code": "pinned_out",
                                                              "message": "pins leave no room for it"})
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in failed["output"]] == [
        ("message", "incomplete", "Par")]
    assert answer.headers["X-KVD-Request-Id"] == "r1" and Served.responses.figures()["responses"] == 0


def test_with_responses_store_bytes_0_kvd_answers_responses_and_keeps_none(tmp_path, scripted):
    from .daemon_fixtures import apps, call, start_service, token_table

    service = start_service(tmp_path, responses_store_bytes="0")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        made = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        assert made.status_code == 200 and "x-kvd-response-id" not in made.headers  # a router learns no home
        assert call(unix, "GET", f"/v1/responses/{made.json()['id']}").status_code == 404
        continued = call(unix, "POST", "/v1/responses",
                         json={"input": "More", "previous_response_id": made.json()["id"]})
        assert (continued.status_code, continued.json()["error"]["param"]) == (404, "previous_response_id")
        assert service.status()["responses"] == {"responses": 0, "bytes": 0, "budget_bytes": 0, "dropped": 0,
                                                 "expired": 0, "running": 0, "served_again": 0, "replay_bytes": 0,
                                                 "file": None}
        refused = call(unix, "POST", "/v1/responses", json={"input": "Hi", "background": True})
        assert refused.status_code == 400 and refused.json()["error"]["message"] == (
            "background: a background response is kept for its client to fetch, and kvd keeps no response "
            "(responses_store_bytes 0)")
    finally:
        service.shutdown(1)

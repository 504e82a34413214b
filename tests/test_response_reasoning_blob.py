"""`include: ["reasoning.encrypted_content"]`: a client that keeps its own conversation
(`store: false`, as Codex runs) gets each reasoning item's text in a blob, sends the items back
on its next turn, and that turn renders as the conversation did, so it comes from the prefix cache."""

from __future__ import annotations

import asyncio
import base64
import json
import zlib

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server import reasoning_blob  # noqa: E402
from kvctl.daemon.server.chat_messages import MessagesError, chat_messages  # noqa: E402
from kvctl.daemon.server.responses_api import OutputItems, ResponsesRequest, chat_body  # noqa: E402
from kvctl.daemon.server.responses_input import input_items, input_messages  # noqa: E402

from .test_responses_api import INSTRUCTIONS, WEATHER, client_for, hermes_kvd, kvd, scripted  # noqa: E402,F401
from .test_tool_calls import CALL_TEXT, HERMES  # noqa: E402


def test_a_blob_carries_its_text_and_one_altered_is_refused():
    blob = reasoning_blob.encode("Check the tool first. \u00e9")
    assert blob.startswith("kvd-reasoning-v1.") and "Check" not in blob
    assert reasoning_blob.decode(blob) == "Check the tool first. \u00e9"
    assert reasoning_blob.decode("gAAAAABpZtK3mH8x") is None  # another server's: not kvd's to read
    middle = len(blob) // 2 + 9
    altered = blob[:middle] + ("A" if blob[middle] != "A" else "B") + blob[middle + 1:]
    for broken, why in [(blob[:-6], "it is not URL-safe base64"), (blob + "!!", "it is not URL-safe base64"),
                        (blob[:-4], "it is cut short, or inflates past 64 MiB"),
                        (altered, "it is not zlib-compressed, or was altered"),
                        ("kvd-reasoning-v1.", "it is cut short, or inflates past 64 MiB")]:
        with pytest.raises(reasoning_blob.BlobError) as refused:
            reasoning_blob.decode(broken)
        assert str(refused.value) == why
    not_text = reasoning_blob.PREFIX + base64.urlsafe_b64encode(zlib.compress(b'{"text": 7}')).decode()
    with pytest.raises(reasoning_blob.BlobError, match="carries no text"):
        reasoning_blob.decode(not_text)
    bomb = reasoning_blob.PREFIX + base64.urlsafe_b64encode(zlib.compress(b" " * (65 * 2**20))).decode()
    with pytest.raises(reasoning_blob.BlobError, match="inflates past 64 MiB"):
        reasoning_blob.decode(bomb)


def test_a_reasoning_item_s_text_is_its_content_else_its_blob_else_its_summary():
    blob = reasoning_blob.encode("From the blob.")

    def thought(**item):
        messages = input_messages([{"role": "user", "content": "Hi"}, {"type": "reasoning", **item},
                                   {"role": "assistant", "content": "Done."}])
        return messages[1]["reasoning_content"]

    summary = [{"type": "summary_text", "text": "From the summary."}]
    assert thought(content=[{"type": "reasoning_text", "text": "From the content."}], encrypted_content=blob,
                   summary=summary) == "From the content."
    assert thought(content=None, encrypted_content=blob, summary=summary) == "From the blob."
    assert thought(encrypted_content="gAAAAforeign", summary=summary) == "From the summary."
    with pytest.raises(MessagesError) as refused:
        thought(encrypted_content=blob[:-4], summary=summary)
    assert (str(refused.value), refused.value.param) == (
        "input[1].encrypted_content: not a blob kvd gave: it is cut short, or inflates past 64 MiB; send the item "
        "as kvd gave it",
        "input[1].encrypted_content")
    with pytest.raises(MessagesError, match=r"^input\[1\]\.encrypted_content: must be a string, got int$"):
        thought(encrypted_content=5)
    [listed] = input_items([{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": blob}])
    assert listed["content"] == [{"type": "reasoning_text", "text": "From the blob."}]


@pytest.mark.parametrize("include, message, param", [
    (["reasoning.encrypted_content", "code_interpreter_call.outputs"], "include[1]: kvd adds "
     "reasoning.encrypted_content and message.output_text.logprobs to the items, got 'code_interpreter_call.outputs'",
     "include[1]"),
    ("reasoning.encrypted_content", "include: must be a list, got str", "include"),
])
def test_an_include_kvd_does_not_serve_is_refused_naming_it(include, message, param):
    with pytest.raises(MessagesError) as refused:
        chat_body(ResponsesRequest.model_validate({"input": "Hi", "include": include}), [], frozenset())
    assert (str(refused.value), refused.value.param) == (message, param)


def test_a_reasoning_item_carries_its_text_as_it_closes_whole_and_streamed():
    items = OutputItems(carry_reasoning=True)
    items.feed({"reasoning_content": "Think.", "content": "Answer."})
    items.finish("stop")
    reasoning, message = items.items
    assert reasoning_blob.decode(reasoning["encrypted_content"]) == "Think." and "encrypted_content" not in message
    done = [e["item"] for e in items.take_events() if e["type"] == "response.output_item.done"]
    assert done[0]["encrypted_content"] == reasoning["encrypted_content"]
    plain = OutputItems()
    plain.feed({"reasoning_content": "Think."})
    plain.finish("stop")
    assert "encrypted_content" not in plain.items[0]


@pytest.fixture
def thinking_kvd(tmp_path):
    """kvd as `kvd` has it, with a template that renders an assistant turn's thinking before its calls."""
    yield from hermes_kvd(tmp_path, HERMES.replace(
        "<|assistant|>\n{% if message.content %}", "<|assistant|>\n{% if message.reasoning_content %}<think>"
        "{{ message.reasoning_content }}</think>{% endif %}{% if message.content %}", 1))


def test_a_stateless_client_sends_the_items_back_and_its_next_turn_comes_from_the_cache(thinking_kvd, scripted):
    service, unix, _ = thinking_kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("<think>Check the tool.</think>Let me look.\n" + CALL_TEXT,
                                     add_special_tokens=False))
    first_input = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}]
    ask = {"instructions": INSTRUCTIONS, "tools": [WEATHER], "max_output_tokens": 200, "store": False,
           "include": ["reasoning.encrypted_content"]}

    async def go():
        client = client_for(unix)
        first = await client.responses.create(input=first_input, **ask)
        events = [e async for e in await client.responses.create(input=first_input, stream=True, **ask)]
        sent_back = [item.model_dump(exclude_none=True) for item in first.output]
        sent_back[0].pop("content")  # (a client may keep the blob alone)
        call = first.output[-1]
        scripted[:] = tokenizer.encode("Sunny.", add_special_tokens=False)
        second = await client.responses.create(input=[*first_input, *sent_back, {
            "type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}], **ask)
        return first, events, second

    first, events, second = asyncio.run(go())
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning_blob.decode(reasoning.encrypted_content) == "Check the tool."
    streamed = events[-1].response.output[0]
    assert reasoning_blob.decode(streamed.encrypted_content) == "Check the tool."
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert done[0].encrypted_content == streamed.encrypted_content
    call = first.output[-1]
    conversation = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Let me look.", "reasoning_content": "Check the tool.",
                     "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                         "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    prompt = service.chat_prompt(chat_messages(conversation), tools=tools)
    without = service.chat_prompt(chat_messages([{k: v for k, v in m.items() if k != "reasoning_content"}
                                                 for m in conversation]), tools=tools)
    assert second.usage.input_tokens == len(prompt) > len(without)  # the thinking came back from the blob
    first_turn = service.chat_prompt(chat_messages(conversation[:2]), tools=tools)
    block = service.config.block_size
    assert second.usage.input_tokens_details.cached_tokens >= (len(first_turn) // block) * block > 0
    assert service.status()["responses"]["responses"] == 0  # store: false kept none

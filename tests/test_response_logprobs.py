"""`include: ["message.output_text.logprobs"]` with `top_logprobs`: a response's answer text
carries its own tokens' logprobs (not the thinking's, nor a call's markup), the same whole and
streamed, in the chat's shape and with the chat's values; what would give none is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.chat import ChatShape  # noqa: E402
from kvctl.daemon.server.chat_messages import MessagesError  # noqa: E402
from kvctl.daemon.server.response_logprobs import AnswerLogprobs  # noqa: E402
from kvctl.daemon.server.responses_api import ResponsesRequest, chat_body  # noqa: E402

from .test_responses_api import INSTRUCTIONS, WEATHER, kvd, scripted, whole_and_streamed  # noqa: E402,F401
from .test_tool_calls import CALL_TEXT  # noqa: E402

THINKING = "<think>Check.</think>"
ANSWER = "a < b café"  # `<` is held back (it could open <tool_call>); é is two byte tokens
REPLY = THINKING + ANSWER + "\n" + CALL_TEXT


@pytest.fixture
def tokenizer(tmp_path):
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer

    return Tokenizer(ensure_demo_checkpoint(tmp_path))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_the_answer_s_tokens_are_sorted_from_the_thinking_and_the_call_in_chunks_of_any_size(tokenizer, chunk):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert len(ids) == len(REPLY.encode())  # the demo tokenizer: one token per byte
    sorter = AnswerLogprobs(ChatShape("qwen3", "hermes"), tokenizer)
    first = len(THINKING.encode())
    # the answer's bytes, é's two among them; not the \n before the call, nor the call
    assert answer_positions(sorter, ids, chunk) == list(range(first, first + len(ANSWER.encode())))
    assert tokenizer.decode(ids[first:first + len(ANSWER.encode())]) == ANSWER
    assert sorter.take() == []


def answer_positions(sorter: AnswerLogprobs, ids: list[int], chunk: int) -> list[int]:
    """Where the tokens the sorter gives the answer stand in `ids`, fed `chunk` tokens at a time."""
    taken = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        sorter.add(part, [{"at": start + k} for k in range(len(part))], finished=start + chunk >= len(ids))
        taken += sorter.take()
    return [entry["at"] for entry in taken]


def test_tokens_whose_text_never_comes_out_are_dropped(tokenizer):
    """The EOS (no text) and a reply that is thinking only give the answer nothing."""
    sorter = AnswerLogprobs(ChatShape("qwen3", "none"), tokenizer)
    ids = tokenizer.encode("<think>Only this", add_special_tokens=False) + [257]
    sorter.add(ids, [{"at": k} for k in range(len(ids))], finished=True)
    assert sorter.take() == []
    plain = AnswerLogprobs(ChatShape("none", "none"), tokenizer)
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [257]
    plain.add(ids, [{"at": k} for k in range(len(ids))], finished=True)
    assert [entry["at"] for entry in plain.take()] == [0, 1]


@pytest.mark.parametrize("before, answer, after", [
    ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>final<|message|>", "Sunny.",
     "<|return|>"),
    ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary<|message|>", "Checking.",
     '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city":"Oslo"}<|call|>'),
])
def test_under_harmony_the_answer_s_tokens_are_those_of_its_channel(tmp_path, before, answer, after):
    from .test_harmony_calls import harmony_tokenizer

    _, tokenizer = harmony_tokenizer(tmp_path)
    head, body, tail = (tokenizer.encode(text, add_special_tokens=False) for text in (before, answer, after))
    ids = head + body + tail
    assert tokenizer.encode(before + answer + after, add_special_tokens=False) == ids
    for chunk in (1, 4, len(ids)):
        sorter = AnswerLogprobs(ChatShape("openai_gptoss", "openai"), tokenizer)
        assert answer_positions(sorter, ids, chunk) == list(range(len(head), len(head) + len(body)))


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


@pytest.mark.parametrize("fields, message, param", [
    ({"top_logprobs": 3}, 'top_logprobs: 3 gives logprobs only with include: ["message.output_text.logprobs"]; add '
     "it, or leave top_logprobs out", "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include[0]: kvd adds reasoning.encrypted_content and "
     "message.output_text.logprobs to the items, got 'file_search_call.results'", "include[0]"),
])
def test_logprobs_that_would_not_be_given_are_refused_naming_the_field(fields, message, param):
    with pytest.raises(MessagesError) as refused:
        chat_body(request(**fields), [], frozenset())
    assert (str(refused.value), refused.value.param) == (message, param)


def test_the_include_asks_the_chat_for_every_token_s_logprobs():
    chat, _ = chat_body(request(include=["message.output_text.logprobs"], top_logprobs=4), [], frozenset())
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 4)
    chat, _ = chat_body(request(include=["message.output_text.logprobs"]), [], frozenset())
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 0)
    chat, _ = chat_body(request(top_logprobs=0), [], frozenset())
    assert "logprobs" not in chat


def rounded(entries: list[dict]) -> list[tuple]:
    """Entries with their logprobs to 4 places: a prompt computed in another batch (a prefix hit)
    can move the alternatives' last bits."""
    return [(e["token"], e["bytes"], round(e["logprob"], 4), [(t["token"], round(t["logprob"], 4))
                                                              for t in e["top_logprobs"]]) for e in entries]


def test_openai_s_client_gets_the_answer_s_logprobs_whole_and_streamed_with_the_chat_s_values(kvd, scripted):
    from .daemon_fixtures import blocks_all_back, call

    service, unix, _ = kvd
    scripted.extend(service.loaded.tokenizer.encode(REPLY, add_special_tokens=False))
    ask = {"model": service.model_name, "instructions": INSTRUCTIONS, "input": "Weather in Paris?",
           "tools": [WEATHER], "max_output_tokens": 200, "include": ["message.output_text.logprobs"],
           "top_logprobs": 2}
    whole, events = whole_and_streamed(unix, ask)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output_text == ANSWER and whole.top_logprobs == 2
    logprobs = [entry.model_dump() for entry in whole.output[1].content[0].logprobs]
    assert len(logprobs) == len(ANSWER.encode())
    assert "".join(entry["token"] for entry in logprobs) == "a < b caf\ufffd\ufffd"  # é's bytes, each U+FFFD alone
    assert all(len(entry["top_logprobs"]) == 2 for entry in logprobs)

    # the values are the chat's for the same tokens: the reply's, from the answer's first byte on
    chat = call(unix, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        "max_tokens": 200, "logprobs": True, "top_logprobs": 2}).json()
    every = chat["choices"][0]["logprobs"]["content"]
    assert len(every) == len(REPLY.encode()) + 1  # and the EOS
    first = len(THINKING.encode())
    assert rounded(logprobs) == rounded(every[first:first + len(ANSWER.encode())])

    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.model_dump() for e in deltas for entry in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [entry.model_dump() for entry in done.logprobs]
    assert rounded(streamed) == rounded(logprobs)  # (the second request's prompt came from the cache)
    assert [len(e.logprobs) for e in deltas] == [len(e.delta.encode()) for e in deltas]  # each with its own text
    final = events[-1].response.output[1].content[0]
    assert [entry.model_dump() for entry in final.logprobs] == streamed
    assert blocks_all_back(service)


def test_without_the_include_the_answer_carries_none_and_a_kept_turn_s_logprobs_stay_its_own(kvd, scripted):
    from .daemon_fixtures import call

    service, unix, _ = kvd
    scripted.extend(service.loaded.tokenizer.encode("Hello", add_special_tokens=False))
    plain = call(unix, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 20}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 0
    scored = call(unix, "POST", "/v1/responses", json={
        "input": "Hi", "max_output_tokens": 20, "include": ["message.output_text.logprobs"],
        "previous_response_id": plain["id"]}).json()
    assert [entry["token"] for entry in scored["output"][0]["content"][0]["logprobs"]] == list("Hello")
    assert all(entry["top_logprobs"] == [] for entry in scored["output"][0]["content"][0]["logprobs"])
    kept = call(unix, "GET", f"/v1/responses/{scored['id']}").json()
    assert kept["output"] == scored["output"]
    refused = call(unix, "POST", "/v1/responses", json={"input": "Hi", "top_logprobs": 21,
                                                        "include": ["message.output_text.logprobs"]})
    assert refused.status_code == 400
    assert (refused.json()["error"]["message"], refused.json()["error"]["param"]) == (
        "top_logprobs: must be an integer from 0 to 20, got 21", "top_logprobs")

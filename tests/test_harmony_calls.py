"""--tool-call-parser openai (vLLM's name): gpt-oss's calls, harmony messages to a function, become
OpenAI's tool_calls, read with the channels that --reasoning-parser openai_gptoss splits, whole or
streamed alike; a forced call's grammar writes the message gpt-oss writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.daemon.server.chat import ChatShape
from kvctl.daemon.server.reasoning import HARMONY, HarmonySplitter, answer_only
from kvctl.daemon.server.tool_calls import split_harmony, splitter_for

THINK = "<|channel|>analysis<|message|>Need the weather.<|end|>"
# as gpt-oss writes a call: the recipient in the channel's header, the format after <|constrain|>
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
# as its chat template writes one back: the recipient in the role's header, " json" for the format
ROLE_CALL = ' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
OSLO = ("get_weather", '{"city": "Oslo"}')

REPLIES = [  # (reply text, parallel, (reasoning, content, [(name, arguments)]))
    (THINK + CALL + "<|call|>", True, ("Need the weather.", None, [OSLO])),
    (THINK + CALL, True, ("Need the weather.", None, [OSLO])),  # <|call|> stopped it, left out of the text
    (CALL[len("<|start|>assistant"):], True, (None, None, [OSLO])),  # no thinking: the reply opens with the call
    (ROLE_CALL, True, (None, None, [("get_time", "{}")])),  # the recipient in the role's header
    (THINK + "<|start|>assistant" + ROLE_CALL, True, ("Need the weather.", None, [("get_time", "{}")])),
    # a preamble on the commentary channel is content
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL, True,
     ("Need the weather.", "Checking.", [OSLO])),
    (THINK + CALL + "<|call|>" + CALL + "<|call|>", True, ("Need the weather.", None, [OSLO, OSLO])),
    (THINK + CALL + "<|call|>" + CALL + "<|call|>", False, ("Need the weather.", None, [OSLO])),  # the first only
    # cut off by max_tokens, or not JSON: the text is content, so nothing the model wrote is lost
    (THINK + CALL[:-3], True, ("Need the weather.", '{"city":"Osl', [])),
    (CALL.replace('{"city":"Oslo"}', '"Oslo"'), True, (None, '"Oslo"', [])),  # JSON, but no object
    # a built-in tool's message (not a function) goes by its channel, as without the parser
    ('<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis to=browser.search '
     '<|constrain|>json<|message|>{"query":"kv"}<|call|>', True, ('Search.{"query":"kv"}', "", [])),
    ('<|channel|>commentary to=python<|message|>print(1)<|call|>', True, (None, "print(1)", [])),
    (THINK + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>", True,
     ("Need the weather.", "Sunny.", [])),
    ("Plain text, no channel.", True, (None, "Plain text, no channel.", [])),
    ("to be or not", True, (None, "to be or not", [])),  # begins like a recipient, is not one
    (" to=functions.get_time but no marker came", True, (None, " to=functions.get_time but no marker came", [])),
    ("", True, (None, "", [])),
]


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def shown(content: str | None, calls: list) -> str | None:
    """A whole reply's content as its message gives it: null where it is calls and nothing else."""
    return None if calls and not content else content


@pytest.mark.parametrize("text, parallel, expected", REPLIES)
def test_a_whole_harmony_reply_splits_into_thinking_content_and_calls(text, parallel, expected):
    reasoning, content, calls = split_harmony(text, parallel)
    assert (reasoning, content, calls_of(calls)) == expected
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 220), max_size=14))
def test_streamed_in_any_pieces_a_harmony_reply_splits_as_the_whole_one(case, cuts):
    """Deltas cut anywhere, inside a marker or the arguments too, through the chat shape as kvd
    streams them: thinking and content joined and the calls in order are the whole reply's, each
    call one delta, indexed from 0, and no marker nor the start of one is ever given out."""
    text, parallel, (reasoning, content, calls) = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    shape = ChatShape("openai_gptoss", "openai", parallel)
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    chunks = [shape.chunk_choice(0, piece, [], "stop" if i == len(pieces) - 1 else None)
              for i, piece in enumerate(pieces)]
    deltas = [chunk["delta"] for chunk in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == (reasoning or "")
    assert shown("".join(d["content"] for d in deltas), calls) == content
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls_of(streamed) == calls and [c["index"] for c in streamed] == list(range(len(calls)))
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls" if calls else "stop"]
    if calls:  # a reply that is calls gives out no text at all along the way
        for d in deltas[:-1]:
            assert not any(m in d["content"] or d["content"].endswith(m[:3]) for m in HARMONY), d


def test_the_whole_message_has_the_calls_the_thinking_and_the_finish_reason_openai_gives():
    whole = ChatShape("openai_gptoss", "openai").choice(0, THINK + CALL, [1, 2], "stop")
    assert whole["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert (message["content"], message["reasoning"], message["reasoning_content"]) == (
        None, "Need the weather.", "Need the weather.")
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    cut = ChatShape("openai_gptoss", "openai").choice(0, THINK + CALL, [1], "length")
    assert cut["finish_reason"] == "length"  # the model did not end its turn: said so
    answer = ChatShape("openai_gptoss", "openai").choice(
        0, THINK + "<|start|>assistant<|channel|>final<|message|>Sunny.", [1], "stop")
    assert answer["message"] == {"role": "assistant", "content": "Sunny.", "reasoning": "Need the weather.",
                                 "reasoning_content": "Need the weather."} and answer["finish_reason"] == "stop"
    # the reasoning parser alone leaves a call's arguments in content, as before
    alone = ChatShape("openai_gptoss").choice(0, THINK + CALL, [1], "stop")["message"]
    assert alone["content"] == '{"city":"Oslo"}' and "tool_calls" not in alone


def test_without_calls_the_harmony_splitter_is_the_reasoning_parser_s_as_it_was():
    """calls=False: a call's arguments are answer text; its header (in the role's too) is neither."""
    splitter = HarmonySplitter()
    assert splitter.feed(ROLE_CALL) == ("", "{}") and splitter.close() == ("", "") and splitter.take_calls() == []


def test_openai_s_calls_are_read_only_with_the_channels_and_kvd_says_so():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ValueError, match="read with its channels"):
        splitter_for("openai")
    with pytest.raises(ConfigError) as refused:
        resolve({"tool_call_parser": "openai"}, {})
    assert str(refused.value) == (
        "tool_call_parser: openai (from --tool-call-parser) reads calls in harmony's channels, which "
        "reasoning_parser openai_gptoss reads, but reasoning_parser is 'none'; set reasoning_parser: openai_gptoss")
    config = resolve({"tool_call_parser": "openai", "reasoning_parser": "openai_gptoss"}, {})
    assert (config.tool_call_parser, config.reasoning_parser) == ("openai", "openai_gptoss")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def harmony_tokenizer(folder):
    """The demo checkpoint's byte tokenizer with harmony's markers as special tokens, as gpt-oss's."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer

    hf = HFTokenizer.from_str((ensure_demo_checkpoint(folder) / "tokenizer.json").read_text())
    hf.add_special_tokens([AddedToken(marker, special=True) for marker in HARMONY])
    tokenizer = Tokenizer.from_texts(hf.to_str(), None)
    tokenizer.keep_in_text(HARMONY)
    return hf, tokenizer


@pytest.mark.parametrize("only, reply, verdict", [
    # thinks first (free), then the call's message, as gpt-oss writes it
    (None, THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city":"Oslo"}', "whole"),
    (None, '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}', "whole"),  # no thinking
    ("get_weather", THINK + '<|start|>assistant<|channel|>commentary to=functions.get_time', "off at t"),
    (None, THINK + '<|start|>assistant<|channel|>final', "off at f"),  # an answer instead of a call
    (None, '<|channel|>final', "off at f"),
    (None, THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"town":"Oslo"}', "off at t"),  # not what its schema takes
    (None, THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city":"Os', "prefix"),
    (None, THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Oslo"}', "off at  "),  # compact, as gpt-oss writes its arguments
])
def test_a_forced_call_under_harmony_lets_the_model_think_then_holds_it_to_a_call_message(tmp_path, only, reply,
                                                                                          verdict):
    """tool_choice required or named: the reply may open with an analysis message, free until its
    <|end|>; then it is a message to one of the tools (the named one), each marker the special token
    (never the marker spelled out), with arguments its schema accepts. The shape says where it starts,
    so answer_only leaves it as it is."""
    pytest.importorskip("llguidance")
    from kvctl.daemon.engine.structured import GrammarVocabulary
    from kvctl.daemon.server.tool_calls import forced_calls

    hf, tokenizer = harmony_tokenizer(tmp_path)
    constraint = forced_calls([WEATHER, CLOCK], "openai", only, special_tokens=tokenizer.kept_specials)
    assert answer_only(constraint, "openai_gptoss") is constraint
    vocabulary = GrammarVocabulary(hf.to_str(), hf.get_vocab_size(), [257], tokenizer.token_text,
                                   lambda text: tokenizer.encode(text, add_special_tokens=False))
    [state] = vocabulary.prepare(constraint, 1)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert [hf.id_to_token(i) for i in ids].count("<|channel|>") == reply.count("<|channel|>")
    taken = 0
    while taken < len(ids) and bool(state.masked(torch.zeros(hf.get_vocab_size()))[ids[taken]] == 0):
        state.consume(ids[taken])
        taken += 1
    if taken < len(ids):  # the byte tokenizer: a token per character, a special token per marker
        got = f"off at {tokenizer.token_text(ids[taken])}"
    else:
        got = "whole" if state.done else "prefix"
    assert got == verdict


# in the manner of gpt-oss's template: tools in a developer message, a call written back as the model
# writes one (its thinking, from `thinking`, as the analysis message before it), a result as the tool's
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}{% if m.tool_calls %}{% if m.thinking %}<|start|>assistant<|channel|>"
    "analysis<|message|>{{ m.thinking }}<|end|>{% endif %}<|start|>assistant to=functions."
    "{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments"
    " | tojson }}<|call|>{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}<|start|>assistant")


def test_kvd_gives_gpt_oss_s_call_as_tool_calls_whole_streamed_and_forced_and_takes_the_turn_back(tmp_path,
                                                                                                 monkeypatch):
    """kvd serve --reasoning-parser openai_gptoss --tool-call-parser openai on a gpt-oss checkpoint
    whose tokenizer holds harmony's markers as special tokens and stops at <|call|> and <|return|>,
    as gpt-oss's does. Replies are scripted (the tiny model's weights are random); everything after
    the draw runs as served: the stop at <|call|>, the split, the grammar of a forced call."""
    from .scripted_draws import script_draws

    from .daemon_fixtures import apps, call, sse_events, start_service, token_table
    from .model_cases import harmony_checkpoint

    hf = harmony_checkpoint(tmp_path / "model")
    template = tmp_path / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE, encoding="utf-8")
    scripts = {"call": hf.encode(THINK + CALL + "<|call|>", add_special_tokens=False).ids,
               "answer": hf.encode("<|channel|>final<|message|>Sunny in Oslo.<|return|>", add_special_tokens=False).ids}
    script = scripts["call"]
    script_draws(monkeypatch, lambda logits, params, seed, index, step: script[step] if step < len(script) else 2)
    service = start_service(tmp_path / "state", model=str(tmp_path / "model"), chat_template=str(template),
                            reasoning_parser="openai_gptoss", tool_call_parser="openai")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        ask = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, CLOCK],
               "max_tokens": 160}
        whole = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"][0]
        assert whole["token_ids"] == script and whole["finish_reason"] == "tool_calls"  # <|call|> ended it
        message = whole["message"]
        assert (message["content"], message["reasoning"]) == (None, "Need the weather.")
        assert calls_of(message["tool_calls"]) == [OSLO]
        events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**ask, "stream": True}))
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "Need the weather."
        assert "".join(d.get("content") or "" for d in deltas) == ""
        assert [calls_of(d["tool_calls"]) for d in deltas if d.get("tool_calls")] == [[OSLO]]
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "tool_calls"

        # forced: the grammar holds the reply to a call of get_weather, and ends it once the call is whole
        script = hf.encode(THINK + CALL, add_special_tokens=False).ids
        named = {**ask, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        forced = call(unix, "POST", "/v1/chat/completions", json=named).json()["choices"][0]
        assert forced["token_ids"] == script and forced["finish_reason"] == "tool_calls"
        assert calls_of(forced["message"]["tool_calls"]) == [OSLO]

        # the turn goes back with the call, its thinking and its result, and the template writes them as gpt-oss did
        script = scripts["answer"]
        back = {**ask, "messages": [*ask["messages"], {**message, "content": None}, {
            "role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Sunny"}]}
        answer = call(unix, "POST", "/v1/chat/completions", json=back).json()
        assert answer["choices"][0]["message"]["content"] == "Sunny in Oslo."
        assert answer["choices"][0]["finish_reason"] == "stop"
        prompt = call(unix, "POST", "/tokenize", json={"messages": back["messages"], "tools": back["tools"]}).json()
        assert hf.decode(prompt["tokens"], skip_special_tokens=False).endswith(
            "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|><|start|>functions.get_weather '
            "to=assistant<|channel|>commentary<|message|>Sunny<|end|><|start|>assistant")
    finally:
        service.shutdown(1)


def test_gpt_oss_through_the_responses_api_thinks_calls_and_takes_the_result_back(tmp_path, monkeypatch):
    """/v1/responses, the API gpt-oss is published for, on the same served checkpoint: the reply's
    analysis is a reasoning item and its call a function_call item; the next turn, sent as
    previous_response_id and the call's output, is rendered as the chat turn above (the thinking
    back as the analysis message before the call) and comes from the cache up to its new part; so
    does the same turn sent whole by a client that keeps its own conversation, the thinking in the
    reasoning item's encrypted_content."""
    from .scripted_draws import script_draws

    from .daemon_fixtures import apps, call, start_service, token_table
    from .model_cases import harmony_checkpoint

    hf = harmony_checkpoint(tmp_path / "model")
    template = tmp_path / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE, encoding="utf-8")
    script = hf.encode(THINK + CALL + "<|call|>", add_special_tokens=False).ids
    replies = [script, hf.encode("<|channel|>final<|message|>Sunny in Oslo.<|return|>", add_special_tokens=False).ids]
    script_draws(monkeypatch, lambda logits, params, seed, index, step:
                 replies[0][step] if step < len(replies[0]) else 2)
    service = start_service(tmp_path / "state", model=str(tmp_path / "model"), chat_template=str(template),
                            reasoning_parser="openai_gptoss", tool_call_parser="openai")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        tools = [{"type": "function", **WEATHER["function"]}]
        first = call(unix, "POST", "/v1/responses", json={"input": "Weather in Oslo?", "tools": tools,
                                                           "max_output_tokens": 160,
                                                           "include": ["reasoning.encrypted_content"]}).json()
        assert first["status"] == "completed"
        assert [(item["type"], item.get("name"), item.get("arguments")) for item in first["output"]] == [
            ("reasoning", None, None), ("function_call", "get_weather", '{"city": "Oslo"}')]
        assert first["output"][0]["content"] == [{"type": "reasoning_text", "text": "Need the weather."}]
        replies.pop(0)
        call_id = first["output"][1]["call_id"]
        second = call(unix, "POST", "/v1/responses", json={
            "previous_response_id": first["id"], "tools": tools, "max_output_tokens": 160,
            "input": [{"type": "function_call_output", "call_id": call_id, "output": "Sunny"}]}).json()
        assert [(item["type"], item["content"][0]["text"]) for item in second["output"]] == [
            ("message", "Sunny in Oslo.")]
        chat = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "Sunny"}]
        prompt = call(unix, "POST", "/tokenize", json={"messages": chat, "tools": [WEATHER]}).json()["tokens"]
        assert second["usage"]["input_tokens"] == len(prompt)
        assert hf.decode(prompt, skip_special_tokens=False).endswith(
            "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|><|start|>functions.get_weather '
            "to=assistant<|channel|>commentary<|message|>Sunny<|end|><|start|>assistant")
        first_prompt = call(unix, "POST", "/tokenize", json={"messages": chat[:1], "tools": [WEATHER]}).json()
        block = service.config.block_size
        cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= len(first_prompt["tokens"]) // block * block > 0
        # a client that keeps its own conversation (store: false, as Codex runs) sends the items back,
        # the thinking in the reasoning item's blob alone: the same prompt, from the cache
        thought = {key: first["output"][0][key] for key in ("type", "id", "summary", "encrypted_content")}
        third = call(unix, "POST", "/v1/responses", json={
            "store": False, "tools": tools, "max_output_tokens": 160, "include": ["reasoning.encrypted_content"],
            "input": [{"role": "user", "content": "Weather in Oslo?"}, thought, first["output"][1],
                      {"type": "function_call_output", "call_id": call_id, "output": "Sunny"}]}).json()
        assert third["usage"]["input_tokens"] == len(prompt)
        assert third["usage"]["input_tokens_details"]["cached_tokens"] >= (len(prompt) - 1) // block * block
    finally:
        service.shutdown(1)

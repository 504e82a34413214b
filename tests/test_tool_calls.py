"""Tool calls (vLLM's --tool-call-parser hermes, llama3_json, mistral): a chat's tools reach the
template as transformers passes them, a reply's calls come back as OpenAI's tool_calls, whole or streamed alike,
and the conversation sent back with the calls and their results renders, and hits the cache, as the
model wrote it."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("jinja2")

from kvctl.daemon.model.chat_template import ChatTemplate  # noqa: E402
from kvctl.daemon.server.chat import ChatShape  # noqa: E402
from kvctl.daemon.server.chat_messages import (MessagesError, affinity_text, chat_messages,  # noqa: E402
                                               checked_tools)
from kvctl.daemon.server.tool_calls import split_tool_calls, splitter_for, tool_choice_mode  # noqa: E402

# In the style of Qwen2.5's and Qwen3's templates (Hermes' format): the tools' signatures in the system
# turn, an assistant's calls as <tool_call> blocks of JSON, a tool's result as its own turn.
HERMES = """{{ bos_token }}{% if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}For each call, write <tool_call>{"name": ..., "arguments": ...}</tool_call>.{{ eos_token }}
{% elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}{{ eos_token }}
{% endif %}{% for message in messages %}{% if message.role == 'system' %}{% continue %}{% endif %}
{% if message.role == 'assistant' and message.tool_calls %}<|assistant|>
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {% if call.function.arguments is string %}{{ call.function.arguments }}\
{% else %}{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}{{ eos_token }}
{% else %}<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "system", "content": "You help operators."}, {"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MISTRAL_TWO = ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
               '{"name": "get_time", "arguments": {}}]')
FORCED_STATE = __import__("pathlib").Path(__import__("tempfile").mkdtemp(prefix="kvd-forced-"))


def template() -> ChatTemplate:
    return ChatTemplate.compile(HERMES, "hermes.jinja", {"bos_token": "<|begin|>", "eos_token": "<|end|>"})


def names_and_arguments(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# ---- a reply's calls --------------------------------------------------------------------------
REPLIES = [  # (parser, answer text, parallel, (content, [(name, arguments)]))
    ("hermes", CALL_TEXT, True, (None, [("get_weather", '{"city": "Paris"}')])),
    ("hermes", "Let me look.\n\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("get_weather", "get_time").replace(
        '{"city": "Paris"}', "{}") + "\n", True,
     ("Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("hermes", CALL_TEXT + "\n" + CALL_TEXT, False, (None, [("get_weather", '{"city": "Paris"}')])),  # the first only
    ("hermes", '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>', True,
     (None, [("get_weather", '{"city": "Oslo"}')])),  # Llama-style "parameters"
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', True,
     (None, [("get_weather", '{"city": "Oslo"}')])),  # arguments written as JSON text: kept as written
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', True,  # cut off by max_tokens: text
     ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', [])),
    ("hermes", "x <tool_call>not json</tool_call> y", True, ("x <tool_call>not json</tool_call> y", [])),
    ("hermes", "Sunny, 21 °C.\n", True, ("Sunny, 21 °C.\n", [])),  # no call: as written, whitespace and all
    ("hermes", "  \n", True, ("  \n", [])),
    ("hermes", "a <tool_", True, ("a <tool_", [])),  # begins like the tag, never is
    ("hermes", CALL_TEXT + "\nDone.", True, ("Done.", [("get_weather", '{"city": "Paris"}')])),
    ("hermes", "Checking.\n" + CALL_TEXT + "\n\n" + CALL_TEXT + " Done.\n", True,
     ("Checking.\nDone.", [("get_weather", '{"city": "Paris"}')] * 2)),
    # llama3_json: the reply is the calls, or it is text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', True,
     (None, [("get_weather", '{"city": "Paris"}')])),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', True,
     (None, [("get_weather", '{"city": "Paris"}')])),  # the tag, where special tokens are decoded
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
                    '"parameters": {}}\n', True, (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])),
    ("llama3_json", '{"name": "get_weather", "parameters": {}}; {"name": "get_time", "parameters": {}}', False,
     (None, [("get_weather", "{}")])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', True,  # cut off: text
     ('{"name": "get_weather", "parameters": {"city": "Par', [])),
    ("llama3_json", '{"city": "Paris"}', True, ('{"city": "Paris"}', [])),  # JSON, but no call
    ("llama3_json", '{"name": "get_weather", "parameters": {}} and then', True,
     ('{"name": "get_weather", "parameters": {}} and then', [])),
    ("llama3_json", 'The call would be {"name": "get_weather"}.', True,
     ('The call would be {"name": "get_weather"}.', [])),
    ("llama3_json", "\n <|python", True, ("\n <|python", [])),
    ("llama3_json", "", True, ("", [])),
    # mistral: a JSON list after [TOOL_CALLS] (v0.3), or name[ARGS]{...} after each (later tokenizers)
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', True,
     (None, [("get_weather", '{"city": "Paris"}')])),
    ("mistral", MISTRAL_TWO, True, ("Let me look.", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])),
    ("mistral", MISTRAL_TWO, False, ("Let me look.", [("get_weather", '{"city": "Oslo"}')])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}\n', True,
     (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("mistral", '[TOOL_CALLS] {"name": "get_time", "arguments": {}}', True, (None, [("get_time", "{}")])),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', True,  # cut off: text
     ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', [])),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] and more', True,
     ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}] and more', [])),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', True, ('[TOOL_CALLS]get_weather{"city": "Paris"}', [])),
    ("mistral", '[TOOL_CALLS] [{"city": "Paris"}]', True, ('[TOOL_CALLS] [{"city": "Paris"}]', [])),  # no name
    ("mistral", "Sunny. [TOOL_CALLS]", True, ("Sunny. [TOOL_CALLS]", [])),
    ("mistral", "Sunny, 21 °C.\n", True, ("Sunny, 21 °C.\n", [])),
    ("mistral", "a [TOOL_", True, ("a [TOOL_", [])),
    # pythonic: the reply is a Python list of calls, or it is text
    ("pythonic", '[get_weather(city="Paris"), get_time()]', True,
     (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("pythonic", '[get_weather(city="Paris"), get_time()]', False, (None, [("get_weather", '{"city": "Paris"}')])),
    ("pythonic", '<|python_start|>[get_weather(city=\'Oslo\', days=2, at=None)]<|python_end|>', True,
     (None, [("get_weather", '{"city": "Oslo", "days": 2, "at": null}')])),
    ("pythonic", ' [f(a={"b": true, "c": [1, -2.5]}, d=(1, "x"))]\n', True,
     (None, [("f", '{"a": {"b": true, "c": [1, -2.5]}, "d": [1, "x"]}')])),
    ("pythonic", '[get_weather(city="Par', True, ('[get_weather(city="Par', [])),  # cut off: text
    ("pythonic", "[get_weather(city=paris)]", True, ("[get_weather(city=paris)]", [])),  # a name, not a value
    ("pythonic", "[get_weather('Paris')]", True, ("[get_weather('Paris')]", [])),  # by position: no name for it
    ("pythonic", "[os.system(cmd='ls')]", True, ("[os.system(cmd='ls')]", [])),
    ("pythonic", "[f(a=1), 2]", True, ("[f(a=1), 2]", [])),
    ("pythonic", "[1, 2, 3] are the blocks.", True, ("[1, 2, 3] are the blocks.", [])),
    ("pythonic", "Blocks [1, 2].", True, ("Blocks [1, 2].", [])),
    ("pythonic", "[" * 300 + "]" * 300, True, ("[" * 300 + "]" * 300, [])),  # nested past ast's limit: text
]
TAGS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


@pytest.mark.parametrize("parser, text, parallel, expected", REPLIES)
def test_a_whole_reply_s_calls_are_taken_out_and_the_rest_kept(parser, text, parallel, expected):
    content, calls = split_tool_calls(text, parallel, parser)
    assert (content, names_and_arguments(calls)) == expected
    if parser == "mistral":  # Mistral's templates take back ids of 9 letters and digits only
        assert all(c["type"] == "function" and re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls)
    else:
        assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=14))
def test_streamed_in_any_pieces_the_calls_and_content_are_the_whole_reply_s(case, cuts):
    """Deltas cut anywhere, inside a tag or a call's JSON too: the content joined and the calls
    in order are the whole reply's, indexed from 0, and no piece of content holds part of a tag."""
    parser, text, parallel, (content, calls) = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = splitter_for(parser, parallel)
    pieces = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.close()]
    streamed_calls = [call for _, made in pieces for call in made]
    joined = "".join(piece for piece, _ in pieces)
    assert joined == (content or "")
    assert names_and_arguments(streamed_calls) == calls
    assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
    tag = TAGS.get(parser)
    if calls and tag:
        for piece, _ in pieces:
            assert tag not in piece and not piece.endswith(tag[:5])


def test_the_chat_shape_gives_calls_whole_and_as_one_delta_each_with_the_finish_reason_openai_gives():
    whole = ChatShape("none", "hermes").choice(0, "Let me look. " + CALL_TEXT, [1, 2], "stop")
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Let me look."
    assert names_and_arguments(whole["message"]["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]
    cut = ChatShape("none", "hermes").choice(0, CALL_TEXT, [1], "length")
    assert cut["finish_reason"] == "length"  # the model did not end its turn: said so
    plain = ChatShape("none", "hermes").choice(0, "Sunny.", [1], "stop")
    assert plain["message"] == {"role": "assistant", "content": "Sunny."} and plain["finish_reason"] == "stop"
    unparsed = ChatShape("none", "none").choice(0, CALL_TEXT, [1], "stop")  # tool_choice none: text as written
    assert unparsed["message"] == {"role": "assistant", "content": CALL_TEXT} and unparsed["finish_reason"] == "stop"

    shape = ChatShape("qwen3", "hermes")
    pieces = ["<think>Paris", "?</think>\n\nOn it.\n<tool", "_call>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", ""]
    chunks = [shape.chunk_choice(0, piece, [], "stop" if i == len(pieces) - 1 else None)
              for i, piece in enumerate(pieces)]
    deltas = [c["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "", "reasoning": "Paris", "reasoning_content": "Paris"}
    assert deltas[1] == {"content": "\n\nOn it.", "reasoning": "?", "reasoning_content": "?"}
    assert deltas[2] == {"content": ""}
    [call] = deltas[3]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert deltas[4] == {"content": ""} and chunks[4]["finish_reason"] == "tool_calls"
    assert [c["finish_reason"] for c in chunks[:4]] == [None] * 4


def test_under_llama3_json_a_json_reply_is_held_to_its_end_and_text_streams_as_it_comes():
    shape = ChatShape("none", "llama3_json")
    pieces = [' {"name": "get_wea', 'ther", "parameters": {"city": "Paris"}}', ""]
    chunks = [shape.chunk_choice(0, p, [], "stop" if i == 2 else None) for i, p in enumerate(pieces)]
    assert [c["delta"]["content"] for c in chunks] == ["", "", ""]
    assert names_and_arguments(chunks[2]["delta"]["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]
    assert chunks[2]["finish_reason"] == "tool_calls"
    text = ChatShape("none", "llama3_json")
    assert [text.chunk_choice(0, p, [], f)["delta"]["content"] for p, f in (("\nSun", None), ("ny.", "stop"))] == [
        "\nSun", "ny."]


# ---- what a request may ask ----------------------------------------------------------------------
@pytest.mark.parametrize("choice, tools, parser, expected", [
    (None, TOOLS, "hermes", ("auto", None)), (None, None, "none", ("none", None)),
    ("none", TOOLS, "none", ("none", None)), ("auto", TOOLS, "hermes", ("auto", None)),
    ("required", TOOLS, "llama3_json", ("required", None)),
    ({"type": "function", "function": {"name": "get_time"}}, TOOLS, "hermes", ("named", "get_time")),
    ({"type": "function", "function": {"name": "get_date"}}, TOOLS, "hermes",
     "tool_choice.function.name: 'get_date' is not one of the tools (get_weather, get_time)"),
    ({"type": "function", "name": "get_time"}, TOOLS, "hermes",
     "tool_choice: name a function as {\"type\": \"function\", \"function\": {\"name\": ...}}, got "
     "{'type': 'function', 'name': 'get_time'}"),
    ("always", TOOLS, "hermes", "tool_choice: must be \"none\", \"auto\", \"required\" or a function, got 'always'"),
    ("auto", None, "hermes", "tool_choice: \"auto\" needs tools to choose from"),
    ({"type": "function", "function": {"name": "get_time"}}, [], "hermes",
     "tool_choice: {\"function\": {\"name\": 'get_time'}} needs tools to choose from"),
    (None, TOOLS, "none", "tools: kvd parses no tool calls here (start it with --tool-call-parser hermes, "
                          "llama3_json, mistral, pythonic or openai); send tool_choice: \"none\" to show the "
                          "model the tools without calls"),
    ("required", TOOLS, "none", "tools: kvd parses no tool calls here (start it with --tool-call-parser hermes, "
                                "llama3_json, mistral, pythonic or openai); send tool_choice: \"none\" to show "
                                "the model the tools without calls"),
])
def test_tool_choice_is_honoured_and_what_kvd_cannot_honour_is_refused_by_name(choice, tools, parser, expected):
    if isinstance(expected, tuple):
        assert tool_choice_mode(choice, tools, parser) == expected
        return
    with pytest.raises(MessagesError) as refused:
        tool_choice_mode(choice, tools, parser)
    assert str(refused.value) == expected and expected.startswith(refused.value.param + ":")


@pytest.mark.parametrize("parser, only, parallel, text, verdict", [
    ("hermes", None, True, CALL_TEXT, "prefix"),  # another call may follow, or the reply may end
    ("hermes", None, True, CALL_TEXT + "\n" + CALL_TEXT.replace('"get_weather", "arguments": {"city": "Paris"}',
                                                                 '"get_time", "arguments": {}'), "prefix"),
    ("hermes", None, False, CALL_TEXT, "whole"),
    ("hermes", "get_time", True, CALL_TEXT, "off at weather"),  # the named tool only
    ("hermes", None, True, "Sure: " + CALL_TEXT, "off at Sure"),  # calls, nothing else
    ("hermes", None, True, CALL_TEXT.replace('{"city": "Paris"}', '{"town": "Paris"}'), "off at town"),
    ("llama3_json", "get_weather", True, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "whole"),
    ("llama3_json", None, True, '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
     "prefix"),
    # mistral: either form, the model's choice
    ("mistral", None, True, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "whole"),
    ("mistral", None, False, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "whole"),
    ("mistral", None, True, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "prefix"),  # another may follow
    ("mistral", "get_time", True, '[TOOL_CALLS]get_time[ARGS]{}', "whole"),
    ("mistral", "get_time", True, '[TOOL_CALLS]get_weather[ARGS]{}', "off at w"),
    ("mistral", None, True, 'Sure [TOOL_CALLS]', "off at S"),
    ("mistral", None, True, '[TOOL_CALLS]get_weather[ARGS]{"town": "Oslo"}', "off at t"),
    # pythonic: keyword arguments of the schema's properties, in its order, values its schema takes
    ("pythonic", None, True, '[get_weather(city="Oslo")', "prefix"),  # another call may follow
    ("pythonic", None, True, '[get_weather(city="Oslo"), get_time()]', "whole"),
    ("pythonic", None, False, '[get_weather(city="Oslo"), get_time()]', "off at ,"),
    ("pythonic", "get_weather", True, '[get_weather(city="Oslo")]', "whole"),
    ("pythonic", "get_weather", True, '[get_weather()]', "off at )"),  # city is required
    ("pythonic", "get_weather", True, '[get_weather(city=3)]', "off at 3"),
    ("pythonic", "get_weather", True, '[get_weather(town="Oslo")]', "off at t"),
    ("pythonic", None, True, 'Sure: [get_time()]', "off at S"),
])
def test_a_forced_call_s_grammar_takes_calls_of_the_tools_in_the_parser_s_format_only(parser, only, parallel, text,
                                                                                      verdict):
    from kvctl.daemon.engine.structured import GrammarVocabulary
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer
    from kvctl.daemon.server.tool_calls import forced_calls

    pytest.importorskip("llguidance")
    tokenizer = Tokenizer(ensure_demo_checkpoint(FORCED_STATE))
    vocabulary = GrammarVocabulary(tokenizer.texts[0], 258, [257])
    state = vocabulary.follow(forced_calls(TOOLS, parser, only, parallel))
    ids = tokenizer.encode(text, add_special_tokens=False)
    taken = 0
    while taken < len(ids) and state.allowed()[ids[taken]]:
        state.consume(ids[taken])
        taken += 1
    if taken < len(ids):  # the byte tokenizer: a token per character here
        got = f"off at {text[taken:taken + len(verdict) - 7]}"
    else:
        got = "whole" if state.done else "prefix"
    assert got == verdict


def test_where_mistral_s_marker_is_a_special_token_a_forced_call_opens_with_that_token():
    """Mistral's tokenizers hold [TOOL_CALLS] as one special token: the grammar's first token is it,
    not the marker spelled out (which the model never wrote)."""
    pytest.importorskip("llguidance")
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from kvctl.daemon.engine.structured import GrammarVocabulary
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.server.tool_calls import forced_calls

    from kvctl.daemon.model.tokenizer import Tokenizer

    hf = HFTokenizer.from_str((ensure_demo_checkpoint(FORCED_STATE) / "tokenizer.json").read_text())
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    tokenizer = Tokenizer.from_texts(hf.to_str(), None)
    tokenizer.keep_in_text(["[TOOL_CALLS]", "[ARGS]"])
    marker = hf.token_to_id("[TOOL_CALLS]")
    assert tokenizer.kept_specials == {"[TOOL_CALLS]": marker, "[ARGS]": marker + 1}
    vocabulary = GrammarVocabulary(hf.to_str(), hf.get_vocab_size(), [257])
    state = vocabulary.follow(forced_calls(TOOLS, "mistral", special_tokens=tokenizer.kept_specials))
    assert state.allowed().nonzero().flatten().tolist() == [marker]
    state.consume(marker)
    args = hf.token_to_id("[ARGS]")
    assert state.allowed()[args] == False  # noqa: E712 (the name comes first)
    for token in hf.encode("get_time", add_special_tokens=False).ids:
        state.consume(token)
    assert state.allowed().nonzero().flatten().tolist() == [args]
    state.consume(args)
    for token in hf.encode("{}", add_special_tokens=False).ids:
        state.consume(token)
    assert not state.failed and state.allowed()[marker]  # another call may follow


@pytest.mark.parametrize("tools, message", [
    ({"get_weather": {}}, "tools: must be a list of functions, got dict"),
    ([WEATHER, {"type": "retrieval"}], "tools[1].type: must be \"function\", got 'retrieval'"),
    ([{"type": "function", "function": "get_weather"}],
     "tools[0].function: must be an object with name, description and parameters"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name: must be a name of 1 to 64 characters, "
                                                       "got ''"),
    ([WEATHER, WEATHER], "tools[1].function.name: 'get_weather' names two tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[0].function.parameters: must be a JSON Schema object, got str"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "tools[0].function.description: must be a string"),
])
def test_bad_tools_are_named_with_what_was_found(tools, message):
    with pytest.raises(MessagesError) as refused:
        checked_tools(tools)
    assert str(refused.value) == message and message.startswith(refused.value.param + ":")
    assert checked_tools([]) is None and checked_tools(TOOLS) == TOOLS


def test_a_conversation_with_calls_and_results_is_shaped_as_templates_take_it():
    sent = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Paris, so get_weather.",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                                  {"id": "call_2", "type": "function",
                                   "function": {"name": "get_time", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 °C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]}]
    assert chat_messages(sent)[2:] == [
        {"role": "assistant", "content": "", "reasoning_content": "Paris, so get_weather.",
         "thinking": "Paris, so get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "content": "Sunny, 21 °C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2"}]


@pytest.mark.parametrize("message, param, text", [
    ({"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}, "messages[0].tool_calls",
     "messages[0].tool_calls: only an assistant's message calls tools, this is 'user''s"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "1"}}, "messages[0].tool_calls",
     "messages[0].tool_calls: must be a list of calls, got dict"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}, "messages[0].tool_calls[0].type",
     "messages[0].tool_calls[0].type: must be \"function\", got 'code'"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0].function.name",
     "messages[0].tool_calls[0].function.name: must be a function's name, got None"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "messages[0].tool_calls[0].function.arguments", "messages[0].tool_calls[0].function.arguments: must be JSON "
                                                     "text, got int"),
    ({"role": "assistant", "content": None}, "messages[0].content", "messages[0].content: missing"),
    ({"role": "tool", "content": "42", "tool_call_id": 7}, "messages[0].tool_call_id",
     "messages[0].tool_call_id: must be a string, got int"),
    ({"role": "assistant", "content": "a", "function_call": {"name": "f"}}, "messages[0].function_call",
     "messages[0].function_call: OpenAI's older form; send tool_calls"),
])
def test_bad_tool_turns_are_named_with_what_was_found(message, param, text):
    with pytest.raises(MessagesError) as refused:
        chat_messages([message])
    assert (refused.value.param, str(refused.value)) == (param, text)


def test_kvd_renders_tools_and_tool_turns_as_transformers_does(tmp_path):
    """The tools, the assistant's calls (arguments sent as JSON text, as OpenAI sends them; handed to
    the template as objects, as transformers asks) and the results: token for token."""
    pytest.importorskip("tokenizers")
    from kvctl.daemon.model.chat_template import load_chat_template
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer

    from .test_chat_template import hf_tokenizer

    directory = ensure_demo_checkpoint(tmp_path)
    (directory / "chat_template.jinja").write_text(HERMES, encoding="utf-8")
    tokenizer = Tokenizer(directory)
    ours = load_chat_template(directory, tokenizer.config)
    sent = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    as_transformers_takes_it = json.loads(json.dumps(sent))
    as_transformers_takes_it[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    as_transformers_takes_it[2]["content"] = ""
    hf = hf_tokenizer(directory)
    for conversation, theirs in ((ASK, ASK), (sent, as_transformers_takes_it)):
        text = ours.render(chat_messages(conversation), tools=checked_tools(TOOLS))
        assert text == hf.apply_chat_template(theirs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert CALL_TEXT.replace("\n</tool_call>", "") in text or conversation is ASK
    plain = ours.render(chat_messages(ASK))
    assert plain == hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert "Functions you may call" not in plain


def test_a_template_that_does_not_write_tools_refuses_them_rather_than_hide_them():
    from kvctl.daemon.model.chat_template import TemplateKwargsError
    from kvctl.daemon.model.demo import DEMO_CHAT_TEMPLATE

    demo = ChatTemplate.compile(DEMO_CHAT_TEMPLATE, "demo.jinja", {"bos_token": "<|begin|>", "eos_token": "<|end|>"})
    assert not demo.reads_tools and template().reads_tools
    with pytest.raises(TemplateKwargsError) as refused:
        demo.render(chat_messages(ASK), tools=TOOLS)
    assert refused.value.param == "tools" and str(refused.value).startswith(
        "tools: the model's chat template (demo.jinja) does not write tools")
    assert demo.render(chat_messages(ASK), tools=None) == demo.render(chat_messages(ASK))


def test_agents_that_share_tools_share_a_home_and_other_tools_another():
    messages = chat_messages(ASK)
    assert affinity_text(messages, TOOLS) == affinity_text(messages, [dict(WEATHER), CLOCK])
    assert affinity_text(messages, TOOLS) != affinity_text(messages, [WEATHER])
    assert affinity_text(messages, None) == affinity_text(messages) == "<system>You help operators.<user>Weather in Paris?"


# ---- kvd serving tools ---------------------------------------------------------------------------
DEMO_EOS = 257


@pytest.fixture
def scripted(monkeypatch):
    """The model's reply, scripted: the engine draws these token ids in turn, then the EOS, whatever
    its logits say (the demo model's weights are random; everything after the draw runs as served)."""
    pytest.importorskip("torch")
    from .scripted_draws import script_draws

    script: list[int] = []
    script_draws(monkeypatch,
                 lambda logits, params, seed, index, step: script[step] if step < len(script) else DEMO_EOS)
    return script


def kvd_with(tmp_path, template: str, parser: str):
    """A kvd on the demo model with this chat template and tool-call parser: (service, its app)."""
    from .daemon_fixtures import apps, start_service, token_table

    path = tmp_path / f"{parser}.jinja"
    path.write_text(template, encoding="utf-8")
    service = start_service(tmp_path, chat_template=str(path), tool_call_parser=parser)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


@pytest.fixture
def hermes_kvd(tmp_path):
    yield from kvd_with(tmp_path, HERMES, "hermes")


def test_kvd_answers_a_call_whole_and_streamed_and_the_next_turn_hits_the_cache_through_it(hermes_kvd, scripted):
    from .daemon_fixtures import blocks_all_back, call, sse_events

    service, unix = hermes_kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("Let me look.\n" + CALL_TEXT, add_special_tokens=False))
    ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 200}
    answer = call(unix, "POST", "/v1/chat/completions", json=ask).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert names_and_arguments(choice["message"]["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]
    assert answer["usage"]["completion_tokens"] == len(scripted) + 1  # and the EOS

    events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**ask, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    streamed_calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert "".join(chunk["delta"].get("content") or "" for chunk in chunks) == "Let me look."
    assert [c["index"] for c in streamed_calls] == [0]
    assert names_and_arguments(streamed_calls) == [("get_weather", '{"city": "Paris"}')]
    assert chunks[-1]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"

    first_prompt = service.chat_prompt(chat_messages(ASK), tools=TOOLS)
    sent_back = [*ASK, {**choice["message"]}, {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"],
                                               "content": "Sunny, 21 °C"}]
    scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
    second = call(unix, "POST", "/v1/chat/completions",
                  json={"messages": sent_back, "tools": TOOLS, "max_tokens": 50}).json()
    assert second["choices"][0]["message"]["content"] == "Sunny in Paris."
    assert second["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in second["choices"][0]["message"]
    second_prompt = service.chat_prompt(chat_messages(sent_back), tools=TOOLS)
    written = first_prompt + tokenizer.encode("Let me look.\n" + CALL_TEXT, add_special_tokens=False) + [DEMO_EOS]
    assert second_prompt[:len(written)] == written  # the template writes the call back as the model wrote it
    block = service.config.block_size
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(written) // block * block
    assert blocks_all_back(service)


def test_tool_choice_none_shows_the_tools_and_leaves_the_reply_as_written(hermes_kvd, scripted):
    from .daemon_fixtures import call

    service, unix = hermes_kvd
    scripted.extend(service.loaded.tokenizer.encode(CALL_TEXT, add_special_tokens=False))
    answer = call(unix, "POST", "/v1/chat/completions",
                  json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 100})
    [choice] = answer.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": CALL_TEXT} and choice["finish_reason"] == "stop"
    with_tools = call(unix, "POST", "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert answer.json()["usage"]["prompt_tokens"] == with_tools["count"]
    assert with_tools["tokens"] == service.chat_prompt(chat_messages(ASK), tools=TOOLS)
    assert with_tools["count"] > call(unix, "POST", "/tokenize", json={"messages": ASK}).json()["count"]
    refused = call(unix, "POST", "/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "tools: only with messages (a chat's prompt)"
    both = call(unix, "POST", "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                            "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"] == {
        "message": "tool_choice: a forced call and response_format cannot both shape the reply; give one",
        "type": "invalid_request_error", "param": "tool_choice", "code": None}


def test_an_operator_names_an_agent_s_prompt_with_its_tools_to_explain_pin_and_route(hermes_kvd, scripted, tmp_path):
    from kvctl.command_kit import prompt_body
    from kvctl.daemon.model.tokenizer import Tokenizer
    from kvctl.daemon.server.route_question import affinity_of, local_ids, question_of

    from .daemon_fixtures import call

    service, unix = hermes_kvd
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "messages": ASK, "tools": TOOLS}))
    named = prompt_body(None, None, None, request)
    assert named == {"messages": ASK, "tools": TOOLS}
    cold = call(unix, "POST", "/admin/explain", json=named).json()
    assert cold["prompt_tokens"] == len(service.chat_prompt(chat_messages(ASK), tools=TOOLS)) and cold["hit_tokens"] == 0
    pinned = call(unix, "POST", "/admin/pins", json={**named, "ttl": "1h"})
    assert pinned.status_code == 200, pinned.text
    warm = call(unix, "POST", "/admin/explain", json=named).json()
    assert warm["hit_tokens"] == pinned.json()["blocks"] * service.config.block_size > 16
    with_tools, without = (service.chat_prompt(chat_messages(ASK), tools=t) for t in (TOOLS, None))
    common = next(i for i, (a, b) in enumerate(zip(with_tools, without)) if a != b)
    block = service.config.block_size
    # without the tools the prompt parts from the pinned one where the tools begin
    assert call(unix, "POST", "/admin/explain", json={"messages": ASK}).json()["hit_tokens"] == common // block * block

    question = question_of({"messages": ASK, "tools": TOOLS, "max_tokens": 5})
    assert question == {"messages": chat_messages(ASK), "tools": TOOLS}
    texts = service.loaded.tokenizer.texts
    assert local_ids(question, Tokenizer.from_texts(*texts), service.chat_template) == \
        service.chat_prompt(chat_messages(ASK), tools=TOOLS)
    assert affinity_of(question) != affinity_of(question_of({"messages": ASK}))
    assert question_of({"messages": ASK, "tools": "all"}) is None  # the replica names what is wrong


def test_a_tool_call_parser_kvd_does_not_have_is_refused_naming_those_it_has():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as refused:
        resolve({"tool_call_parser": "llama4_json"}, {})
    assert str(refused.value) == ("tool_call_parser: invalid value 'llama4_json' from --tool-call-parser: must be one "
                                  "of none, hermes, llama3_json, mistral, pythonic, openai")


# every argument bounded (CLOCK's open object would let a random model write keys up to max_tokens)
BOUNDED = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {
               "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.mark.parametrize("seed", range(3))
def test_a_required_or_named_call_is_made_whatever_the_weights_and_obeys_the_tool_s_schema(hermes_kvd, seed):
    """The demo model's weights are random: only the grammar makes its reply a call."""
    pytest.importorskip("llguidance")
    from .daemon_fixtures import blocks_all_back, call, sse_events

    service, unix = hermes_kvd
    ask = {"messages": ASK, "tools": BOUNDED, "max_tokens": 120, "temperature": 1.0, "seed": seed}
    required = call(unix, "POST", "/v1/chat/completions",
                    json={**ask, "tool_choice": "required", "parallel_tool_calls": False}).json()["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] is None
    [made] = required["message"]["tool_calls"]
    arguments = json.loads(made["function"]["arguments"])
    assert (made["function"]["name"], arguments) in [("get_time", {}), ("get_weather", {"city": "Paris"}),
                                                     ("get_weather", {"city": "Oslo"})]
    named = {**ask, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = call(unix, "POST", "/v1/chat/completions", json=named).json()["choices"][0]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
    events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**named, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    [streamed] = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert streamed["function"] == whole["message"]["tool_calls"][0]["function"]  # seeded: the same call
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(chunk["delta"].get("content") or "" for chunk in chunks) == ""
    assert blocks_all_back(service)


# In the style of Mistral 7B Instruct v0.3's template: the tools before the last user turn, an
# assistant's calls as a JSON list after [TOOL_CALLS] (ids of 9 letters and digits, or it refuses),
# a tool's result between [TOOL_RESULTS] and [/TOOL_RESULTS].
MISTRAL = """{{ bos_token }}{% for message in messages %}{% if message.role == 'system' %}{% continue %}{% endif %}\
{% if message.role == 'user' %}{% if tools and loop.index0 == 1 %}[AVAILABLE_TOOLS] {{ tools | tojson }}\
[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]\
{% elif message.role == 'assistant' and message.tool_calls %}{% if message.content %}{{ message.content }} {% endif %}\
[TOOL_CALLS] [{% for call in message.tool_calls %}{% if call.id is not defined or call.id | length != 9 %}\
{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}\
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\
{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}\
{% elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]\
{% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}"""
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture
def mistral_kvd(tmp_path):
    yield from kvd_with(tmp_path, MISTRAL, "mistral")


def test_under_mistral_a_call_gets_an_id_its_template_takes_back_and_the_next_turn_hits_the_cache(mistral_kvd,
                                                                                                  scripted):
    from .daemon_fixtures import blocks_all_back, call, sse_events

    service, unix = mistral_kvd
    tokenizer = service.loaded.tokenizer
    scripted.extend(tokenizer.encode("Checking. " + MISTRAL_CALL, add_special_tokens=False))
    ask = {"messages": ASK, "tools": TOOLS, "max_tokens": 200}
    [choice] = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", "Checking.")
    [made] = choice["message"]["tool_calls"]
    assert names_and_arguments([made]) == [("get_weather", '{"city": "Paris"}')]
    assert re.fullmatch("[A-Za-z0-9]{9}", made["id"])
    events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**ask, "stream": True}))
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(chunk["delta"].get("content") or "" for chunk in chunks) == "Checking."
    assert names_and_arguments([c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]) == \
        [("get_weather", '{"city": "Paris"}')]
    assert chunks[-1]["finish_reason"] == "tool_calls"

    first_prompt = service.chat_prompt(chat_messages(ASK), tools=TOOLS)
    sent_back = [*ASK, choice["message"], {"role": "tool", "tool_call_id": made["id"], "content": "Sunny"}]
    scripted[:] = tokenizer.encode("Sunny in Paris.", add_special_tokens=False)
    second = call(unix, "POST", "/v1/chat/completions", json={**ask, "messages": sent_back}).json()
    assert second["choices"][0]["message"]["content"] == "Sunny in Paris."
    written = first_prompt + tokenizer.encode("Checking. " + MISTRAL_CALL, add_special_tokens=False) + [DEMO_EOS]
    assert service.chat_prompt(chat_messages(sent_back), tools=TOOLS)[:len(written)] == written
    block = service.config.block_size
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(written) // block * block
    # an id of OpenAI's form, which this template refuses, is its 400
    other = [*ASK, {**choice["message"], "tool_calls": [{**made, "id": "call_0123456789"}]}, sent_back[-1]]
    refused = call(unix, "POST", "/v1/chat/completions", json={**ask, "messages": other})
    assert refused.status_code == 400
    assert "Tool call IDs should be alphanumeric strings with length 9!" in refused.json()["error"]["message"]
    assert blocks_all_back(service)


@pytest.mark.parametrize("seed", range(3))
def test_under_mistral_a_required_call_is_made_in_one_of_its_forms_whatever_the_weights(mistral_kvd, seed):
    pytest.importorskip("llguidance")
    from .daemon_fixtures import call

    service, unix = mistral_kvd
    # the clock's arguments closed too: an open object lets the random model write keys until max_tokens
    strict = [BOUNDED[0], {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    ask = {"messages": ASK, "tools": strict, "max_tokens": 120, "temperature": 1.0, "seed": seed,
           "tool_choice": "required", "parallel_tool_calls": False}
    [choice] = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [made] = choice["message"]["tool_calls"]
    assert (made["function"]["name"], json.loads(made["function"]["arguments"])) in [
        ("get_time", {}), ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert choice["token_ids"][:len(service.loaded.tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False))] == \
        service.loaded.tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)


@pytest.fixture
def pythonic_kvd(tmp_path):
    yield from kvd_with(tmp_path, HERMES, "pythonic")


def test_under_pythonic_a_reply_s_calls_come_back_with_their_arguments_as_json(pythonic_kvd, scripted):
    from .daemon_fixtures import call

    service, unix = pythonic_kvd
    scripted.extend(service.loaded.tokenizer.encode('[get_weather(city="Paris", days=2)]', add_special_tokens=False))
    [choice] = call(unix, "POST", "/v1/chat/completions",
                    json={"messages": ASK, "tools": TOOLS, "max_tokens": 100}).json()["choices"]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    assert names_and_arguments(choice["message"]["tool_calls"]) == [("get_weather", '{"city": "Paris", "days": 2}')]


def test_under_pythonic_a_required_call_is_made_whatever_the_weights(pythonic_kvd):
    """The demo model's weights are random: only the grammar makes its reply a call."""
    pytest.importorskip("llguidance")
    from .daemon_fixtures import blocks_all_back, call

    service, unix = pythonic_kvd
    strict = [BOUNDED[0], {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    for seed in range(3):
        [choice] = call(unix, "POST", "/v1/chat/completions", json={
            "messages": ASK, "tools": strict, "max_tokens": 60, "temperature": 1.0, "seed": seed,
            "tool_choice": "required", "parallel_tool_calls": False}).json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [made] = choice["message"]["tool_calls"]
        assert (made["function"]["name"], json.loads(made["function"]["arguments"])) in [
            ("get_time", {}), ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"max-items": {"type": "integer"}}}}}]
    refused = call(unix, "POST", "/v1/chat/completions",
                   json={"messages": ASK, "tools": odd, "tool_choice": "required", "max_tokens": 5})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "tools[0].function.parameters.properties: 'max-items' cannot be a keyword argument of a pythonic call")
    assert blocks_all_back(service)


@settings(max_examples=400, deadline=None)
@given(parser=st.sampled_from(["hermes", "llama3_json", "mistral", "pythonic"]),
       text=st.lists(st.sampled_from(list('[](){}"\'=,;:. \\\n0123456789abcfnrtux_-') +
                                     ["[TOOL_CALLS]", "[ARGS]", "<tool_call>", "</tool_call>", "true", "get_time",
                                      "\x00", "<|python_start|>", "\\d", 'f(a="\\d")']), max_size=40).map("".join))
def test_whatever_a_model_writes_is_calls_and_content_or_its_text_as_written(parser, text):
    """No reply makes a parser raise (ast's errors and warnings included); a reply without calls is
    its text exactly."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a parser must not warn on a model's text either (invalid escapes)
        content, calls = split_tool_calls(text, True, parser)
    if not calls:
        assert content == text
    for made in calls:
        assert isinstance(json.loads(made["function"]["arguments"]), dict) and made["function"]["name"]


DEEP = "[" * 100_000 + "]" * 100_000  # nested deeper than Python's parsers recurse


@pytest.mark.parametrize("parser, text", [("hermes", f"<tool_call>{DEEP}</tool_call>"),
                                          ("llama3_json", '{"name": "f", "parameters": ' + DEEP + "}"),
                                          ("mistral", f"[TOOL_CALLS]{DEEP}"), ("mistral", f"[TOOL_CALLS]f[ARGS]{DEEP}"),
                                          ("pythonic", DEEP)],
                         ids=["hermes", "llama3_json", "mistral-list", "mistral-args", "pythonic"])
def test_a_reply_nested_deeper_than_python_recurses_is_its_text_not_a_crash(parser, text):
    assert split_tool_calls(text, True, parser) == (text, [])


def test_a_call_s_arguments_nested_deeper_than_python_recurses_go_to_the_template_as_written():
    [_, sent] = chat_messages([{"role": "user", "content": "a"},
                               {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": DEEP}}]}])
    assert sent["tool_calls"][0]["function"]["arguments"] == DEEP
    from kvctl.daemon.server.router import json_object

    assert json_object(('{"a": ' + DEEP + "}").encode()) is None


ORDERED = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "required": ["a", "c"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}}}}]


@pytest.mark.parametrize("text, verdict", [
    ("[f(a=1, c=3)]", "whole"), ("[f(a=1, b=2, c=3)]", "whole"),
    ("[f(b=2, c=3)]", "off at b"),  # a is required, and first
    ("[f(a=1, b=2)]", "off at )"),  # c is required
    ("[f(c=3, a=1)]", "off at c"),  # the schema's order
    ("[f(a=1, c=3, b=2)]", "off at ,"),
])
def test_a_forced_pythonic_call_writes_required_arguments_always_and_the_rest_in_the_schema_s_order(text, verdict):
    from kvctl.daemon.engine.structured import GrammarVocabulary
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.tokenizer import Tokenizer
    from kvctl.daemon.server.tool_calls import forced_calls

    pytest.importorskip("llguidance")
    tokenizer = Tokenizer(ensure_demo_checkpoint(FORCED_STATE))
    state = GrammarVocabulary(tokenizer.texts[0], 258, [257]).follow(forced_calls(ORDERED, "pythonic", "f"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    taken = 0
    while taken < len(ids) and state.allowed()[ids[taken]]:
        state.consume(ids[taken])
        taken += 1
    got = f"off at {text[taken]}" if taken < len(ids) else "whole" if state.done else "prefix"
    assert got == verdict

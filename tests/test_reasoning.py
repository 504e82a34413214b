"""reasoning_parser (vLLM's --reasoning-parser): a reply's thinking apart from its answer, whole
or streamed, with no half tag ever given out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.daemon.server.chat import ChatShape
from kvctl.daemon.server.reasoning import HARMONY, split_reply, splitter_for

# gpt-oss's harmony replies: thinking on the analysis channel, the answer on the final one
GPT_OSS = ("<|channel|>analysis<|message|>The user asks about blocks. 4 of 16 tokens.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>Four blocks.")
GPT_OSS_TOOL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')

REPLIES = [
    ("<think>\nThe cache holds 4 blocks.\n</think>\n\nFour blocks.", "qwen3",
     ("\nThe cache holds 4 blocks.\n", "\n\nFour blocks.")),
    ("  <think>x < y</think>yes", "qwen3", ("x < y", "yes")),  # leading space; a "<" that is no tag
    ("Four blocks.", "qwen3", (None, "Four blocks.")),  # thinking off: the template closed the block
    ("<thinking is hard", "qwen3", (None, "<thinking is hard")),  # begins like the tag, is not
    ("<think>cut off by max_tokens", "qwen3", ("cut off by max_tokens", "")),
    ("The prompt opened the block.</think>Four.", "deepseek_r1", ("The prompt opened the block.", "Four.")),
    ("still thinking when max_tokens ended", "deepseek_r1", ("still thinking when max_tokens ended", "")),
    ("<think>a</think>b", "none", (None, "<think>a</think>b")),
    ("<", "qwen3", (None, "<")),
    (GPT_OSS, "openai_gptoss", ("The user asks about blocks. 4 of 16 tokens.", "Four blocks.")),
    (GPT_OSS + "<|return|>", "openai_gptoss", ("The user asks about blocks. 4 of 16 tokens.", "Four blocks.")),
    # a call on the commentary channel is answer text (a tool-call parser's to read); its header is neither
    (GPT_OSS_TOOL, "openai_gptoss", ("Need the weather.", '{"city": "Oslo"}')),
    ("<|channel|>analysis<|message|>cut off by max_to", "openai_gptoss", ("cut off by max_to", "")),
    ("<|channel|>final<|message|>a <| b <|chan", "openai_gptoss", (None, "a <| b <|chan")),  # no marker after all
    ("Plain text, no channel.", "openai_gptoss", (None, "Plain text, no channel.")),
    ("<|channel|>analysis<|message|><|end|><|start|>assistant<|message|>Hi", "openai_gptoss", (None, "Hi")),
]


@pytest.mark.parametrize("text, parser, expected", REPLIES)
def test_a_whole_reply_is_split_into_thinking_and_answer(text, parser, expected):
    assert split_reply(text, parser) == expected


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from([r for r in REPLIES if r[1] != "none"]), cuts=st.lists(st.integers(0, 80), max_size=12))
def test_streamed_in_any_pieces_the_split_is_the_whole_reply_s(case, cuts):
    """Deltas cut anywhere, inside a tag too: joined, they are the whole reply's split, and no
    piece given out holds part of a tag."""
    text, parser, (reasoning, answer) = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = splitter_for(parser)
    pieces = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.close()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(a for _, a in pieces) == answer
    for given_out in (r for r, _ in pieces):
        assert "</think" not in given_out and not any(given_out.endswith(t) for t in ("</", "</th", "</think"))
    if parser == "openai_gptoss":  # no marker, nor the start of one, in any piece given out before the end
        for given_out in (part for r, a in pieces[:-1] for part in (r, a)):
            assert not any(m in given_out or given_out.endswith(m[:3]) for m in HARMONY), given_out


def test_the_chat_shape_puts_thinking_under_both_names_and_streams_it_apart():
    whole = ChatShape("qwen3").choice(0, "<think>a</think>b", [1, 2], "stop")["message"]
    assert whole == {"role": "assistant", "content": "b", "reasoning": "a", "reasoning_content": "a"}
    plain = ChatShape("qwen3").choice(0, "b", [1], "stop")["message"]
    assert plain == {"role": "assistant", "content": "b", "reasoning": None, "reasoning_content": None}
    assert ChatShape().choice(0, "<think>a</think>b", [1], "stop")["message"] == {
        "role": "assistant", "content": "<think>a</think>b"}  # none: as written, no new fields
    shape = ChatShape("qwen3")
    deltas = [shape.chunk_choice(0, piece, [], finish)["delta"]
              for piece, finish in (("<thi", None), ("nk>ab</th", None), ("ink>c", None), ("d", "stop"))]
    assert deltas == [{"role": "assistant", "content": ""},
                      {"content": "", "reasoning": "ab", "reasoning_content": "ab"},
                      {"content": "c"}, {"content": "d"}]
    harmony = ChatShape("openai_gptoss")
    assert harmony.choice(0, GPT_OSS, [1], "stop")["message"] == {
        "role": "assistant", "content": "Four blocks.", "reasoning": "The user asks about blocks. 4 of 16 tokens.",
        "reasoning_content": "The user asks about blocks. 4 of 16 tokens."}
    deltas = [harmony.chunk_choice(0, piece, [], finish)["delta"] for piece, finish in (
        ("<|channel|>analysis<|mess", None), ("age|>ab<|end|><|start|>assistant<|channel|>fi", None),
        ("nal<|message|>c<|", None), ("return|>", "stop"))]
    assert deltas == [{"role": "assistant", "content": ""},
                      {"content": "", "reasoning": "ab", "reasoning_content": "ab"},
                      {"content": "c"}, {"content": ""}]


def test_kvd_with_a_reasoning_parser_splits_whole_and_streamed_replies_alike(tmp_path):
    """The demo model writes no tags: under deepseek_r1 (the template opened the block) its whole
    reply, cut off by max_tokens, is thinking, whole and streamed alike; under none it is content."""
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, sse_events, start_service, token_table

    ask = {"messages": [{"role": "user", "content": "How many blocks?"}], "max_tokens": 6, "temperature": 0}
    service = start_service(tmp_path, reasoning_parser="deepseek_r1")
    try:
        unix, _ = apps(service, token_table(tmp_path))
        message = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"][0]["message"]
        events = sse_events(call(unix, "POST", "/v1/chat/completions", json={**ask, "stream": True}))
        streamed = "".join(e["choices"][0]["delta"].get("reasoning") or "" for e in events[:-1] if e["choices"])
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        assert message["content"] == content == "" and message["reasoning"] == message["reasoning_content"]
        assert streamed == message["reasoning"] != ""
    finally:
        service.shutdown(1)
    plain = start_service(tmp_path / "plain")
    try:
        unix, _ = apps(plain, token_table(tmp_path))
        written = call(unix, "POST", "/v1/chat/completions", json=ask).json()["choices"][0]["message"]
        assert written == {"role": "assistant", "content": message["reasoning"]}
    finally:
        plain.shutdown(1)


def test_a_parser_kvd_does_not_have_is_refused_naming_those_it_has():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as refused:
        resolve({"reasoning_parser": "r1"}, {})
    assert str(refused.value) == ("reasoning_parser: invalid value 'r1' from --reasoning-parser: must be one of none, "
                                  "qwen3, deepseek_r1, openai_gptoss")

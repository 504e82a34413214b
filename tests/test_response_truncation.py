"""`truncation: "auto"`: a conversation that outgrows the context drops its earliest turns (cut
only before a user message, the fewest that leave truncation_headroom free), the next turn
starts where it did and comes from the prefix cache, and a last turn that alone does not fit is
refused naming the input."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.chat_messages import MessagesError  # noqa: E402
from kvctl.daemon.server.response_truncation import fitting_cut  # noqa: E402
from kvctl.daemon.server.responses_api import ResponsesRequest, chat_body  # noqa: E402

from .test_responses_api import DEMO_EOS, scripted  # noqa: E402,F401
from .test_tool_calls import HERMES  # noqa: E402

CONTEXT = 384


def test_the_cut_is_the_fewest_turns_that_fit_and_falls_before_a_user_message():
    conversation = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
                    {"role": "user", "content": "c" * 10},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
                    {"role": "tool", "content": "d" * 10}, {"role": "assistant", "content": "e" * 10},
                    {"role": "user", "content": "f" * 10}]
    asked = []

    def length(messages):
        asked.append(len(messages))
        return sum(len(m["content"] or "x") for m in messages)

    assert fitting_cut(conversation, length, 61) == 0  # it fits whole (61 characters)
    assert asked == [7]
    assert fitting_cut(conversation, length, 60) == 2  # from the second user message: 41
    assert fitting_cut(conversation, length, 41) == 2
    assert fitting_cut(conversation, length, 40) == 6  # not at the tool's output: at the last user message
    assert fitting_cut(conversation, length, 10) == 6
    assert fitting_cut(conversation, length, 9) is None


def test_a_truncation_kvd_does_not_know_is_refused_naming_it():
    with pytest.raises(MessagesError) as refused:
        chat_body(ResponsesRequest.model_validate({"input": "Hi", "truncation": "middle"}), [], frozenset())
    assert (str(refused.value), refused.value.param) == ("truncation: must be disabled or auto, got 'middle'",
                                                         "truncation")


@pytest.fixture
def short_kvd(tmp_path):
    """A kvd on the demo model with a Hermes-style template and a context of CONTEXT tokens."""
    from .daemon_fixtures import apps, start_service, token_table

    path = tmp_path / "template.jinja"
    path.write_text(HERMES, encoding="utf-8")
    service = start_service(tmp_path, chat_template=str(path), max_model_len=CONTEXT, num_blocks=128)
    try:
        yield service, apps(service, token_table(tmp_path))[0]
    finally:
        service.shutdown(1)


def test_a_conversation_over_the_context_drops_its_earliest_turns_and_the_next_turn_comes_from_the_cache(
        short_kvd, scripted):
    from kvctl.daemon.server.chat_messages import chat_messages

    from .daemon_fixtures import blocks_all_back, call

    from dataclasses import replace

    service, unix = short_kvd
    service.reload(replace(service.config, truncation_headroom=0.0))  # the fewest turns (headroom: below)
    encode = service.loaded.tokenizer.encode
    scripted.extend(encode("Noted.", add_special_tokens=False))
    question = [f"Question {n}: " + "tell me about blocks " * 5 for n in range(3)]
    ask = {"instructions": "Be brief.", "max_output_tokens": 8}

    def prompt_ids(*messages) -> list[int]:
        return service.chat_prompt(chat_messages([{"role": "system", "content": "Be brief."}, *messages]))

    def prompt(*messages) -> int:
        return len(prompt_ids(*messages))

    turns, previous = [], None
    for n in range(3):
        answer = call(unix, "POST", "/v1/responses", json={**ask, "input": question[n], "truncation": "auto",
                                                           **({"previous_response_id": previous} if previous else {})})
        assert answer.status_code == 200, answer.text
        turns.append(answer.json())
        previous = turns[-1]["id"]
    reply = {"role": "assistant", "content": "Noted."}
    whole = [{"role": "user", "content": question[0]}, reply, {"role": "user", "content": question[1]}, reply,
             {"role": "user", "content": question[2]}]
    assert prompt(*whole[:3]) + 8 <= CONTEXT < prompt(*whole) + 8  # the third turn does not fit whole
    assert [t["usage"]["input_tokens"] for t in turns] == [prompt(*whole[:1]), prompt(*whole[:3]),
                                                          prompt(*whole[2:])]  # the first turn went
    assert [t["truncation"] for t in turns] == ["auto"] * 3
    # the next turn starts where the cut did: its prompt opens with the third's, from the cache
    fourth = call(unix, "POST", "/v1/responses", json={**ask, "input": "And?", "truncation": "auto",
                                                       "previous_response_id": previous}).json()
    assert fourth["usage"]["input_tokens"] == prompt(*whole[2:], reply, {"role": "user", "content": "And?"})
    assert fourth["usage"]["input_tokens"] + 8 <= CONTEXT  # (so it needed no further cut)
    third = prompt_ids(*whole[2:]) + scripted + [DEMO_EOS]  # what the third turn left in the cache
    fourth_ids = prompt_ids(*whole[2:], reply, {"role": "user", "content": "And?"})
    shared = next((i for i, (a, b) in enumerate(zip(third, fourth_ids)) if a != b), min(len(third), len(fourth_ids)))
    block = service.engine.settings.block_size
    assert shared > prompt(*whole[2:])  # the third's prompt and the start of its reply
    assert fourth["usage"]["input_tokens_details"]["cached_tokens"] == shared // block * block
    # every item is still listed, the dropped ones too
    listed = call(unix, "GET", f"/v1/responses/{fourth['id']}/input_items?order=asc&limit=100").json()["data"]
    assert len(listed) == 7 and listed[0]["content"][0]["text"] == question[0]
    # without truncation the same turn is refused as the chat refuses it
    refused = call(unix, "POST", "/v1/responses", json={**ask, "input": question[2], "previous_response_id":
                                                        turns[1]["id"]})
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "context_length_exceeded")
    assert blocks_all_back(service)


def test_a_last_turn_that_alone_does_not_fit_is_refused_naming_the_input(short_kvd, scripted):
    from .daemon_fixtures import call

    service, unix = short_kvd
    scripted.extend([DEMO_EOS])
    long = "blocks " * 200
    refused = call(unix, "POST", "/v1/responses", json={"input": long, "truncation": "auto",
                                                        "max_output_tokens": 8})
    assert refused.status_code == 413
    error = refused.json()["error"]
    latest = len(service.chat_prompt([{"role": "user", "content": long}]))
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert error["message"] == (f"input: truncation auto drops a conversation's earliest turns, but its last turn "
                                f"alone is {latest} tokens, which with 8 for the reply (max_output_tokens) exceeds "
                                f"max_model_len {CONTEXT}")


def test_a_cut_leaves_headroom_so_the_turns_after_it_come_from_the_cache():
    conversation = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
                    {"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "d" * 10},
                    {"role": "user", "content": "e" * 10}, {"role": "assistant", "content": "f" * 10},
                    {"role": "user", "content": "g" * 10}]

    def length(messages):
        return sum(len(m["content"]) for m in messages)

    assert fitting_cut(conversation, length, 60) == 2  # the fewest: 50 of 60
    assert fitting_cut(conversation, length, 60, headroom=0.25) == 4  # 30, within 45: a quarter left free
    assert fitting_cut(conversation, length, 70, headroom=0.5) == 0  # (it fits whole: nothing goes)
    assert fitting_cut(conversation, length, 12, headroom=0.5) == 6  # the headroom cannot be had: the fewest
    assert fitting_cut(conversation, length, 9, headroom=0.5) is None


def test_truncation_headroom_is_a_share_below_one(tmp_path):
    from kvctl.daemon.config import ConfigError, resolve

    assert resolve({"state_dir": str(tmp_path)}, env={}).truncation_headroom == 0.25
    assert resolve({"state_dir": str(tmp_path), "truncation_headroom": "0.5"}, env={}).truncation_headroom == 0.5
    for bad in (1, -0.1, "most"):
        with pytest.raises(ConfigError, match="truncation_headroom"):
            resolve({"state_dir": str(tmp_path), "truncation_headroom": bad}, env={})


def conversation_at_the_edge(service, unix, tag: str, turns: int = 12) -> list[tuple[int, int, int]]:
    """(input tokens, cached tokens, the item its prompt started at) of each turn of a conversation
    (/v1/conversations) with truncation auto, whose turns outgrow the context after the third."""
    from .daemon_fixtures import call

    made = call(unix, "POST", "/v1/conversations", json={}).json()
    rows = []
    for n in range(turns):
        answer = call(unix, "POST", "/v1/responses", json={
            "instructions": f"Be brief {tag}.", "max_output_tokens": 8, "truncation": "auto",
            "conversation": made["id"], "input": f"{tag} question {n}: " + "tell me about blocks " * 3}).json()
        usage = answer["usage"]
        rows.append((usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                     service.conversations.get("default", made["id"]).start()))
    return rows


def test_with_headroom_a_conversation_at_the_context_s_edge_recomputes_less(short_kvd, scripted):
    from dataclasses import replace

    service, unix = short_kvd
    scripted.extend(service.loaded.tokenizer.encode("Noted.", add_special_tokens=False))
    block = service.engine.settings.block_size
    service.reload(replace(service.config, truncation_headroom=0.0))  # (a live setting)
    fewest = conversation_at_the_edge(service, unix, "A")
    service.reload(replace(service.config, truncation_headroom=0.25))
    spaced = conversation_at_the_edge(service, unix, "B")
    # the fewest turns: from the fourth turn on, every turn is cut anew, so its prompt starts somewhere
    # new and only the instructions' blocks come from the cache
    starts = [start for _, _, start in fewest]
    assert starts[:3] == [0, 0, 0] and all(b > a for a, b in zip(starts[3:], starts[4:]))
    assert all(cached < 3 * block for _, cached, _ in fewest[3:])
    # with a quarter of the room left free, a cut is followed by a turn that fits as it is: its prompt
    # starts as the last one's did, and the whole of that comes from the cache
    cuts = [n for n in range(1, 12) if spaced[n][2] != spaced[n - 1][2]]
    assert cuts == [3, 5, 7, 9, 11]
    for n in (4, 6, 8, 10):
        assert spaced[n][2] == spaced[n - 1][2] and spaced[n][1] >= spaced[n - 1][0] // block * block
    recomputed = [sum(prompt - cached for prompt, cached, _ in rows) for rows in (fewest, spaced)]
    assert recomputed[1] < 0.6 * recomputed[0]  # (1,783 tokens against 3,181)
    assert all(prompt + 8 <= CONTEXT for prompt, _, _ in fewest + spaced)
    items = service.conversations.get("default", next(iter(service.conversations.entries))).items
    assert len(items) == 24  # every turn is kept, the cut ones too

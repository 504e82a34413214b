"""`truncation: "auto"`: a conversation that outgrows the context drops its earliest turns (cut
only before a user message, the fewest that fit), the next turn starts where it did and comes
from the prefix cache, and a last turn that alone does not fit is refused naming the input."""

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

    service, unix = short_kvd
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

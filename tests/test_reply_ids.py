"""A chat's next turn is prompted with the ids the model made for its reply, not the reply's
text tokenized again (reply_ids.py, reply_splice.py): the memory of replies, the splice and
its refusals, and a live kvd whose next turn finds the reply's blocks cached."""

from __future__ import annotations

import pytest

from kvctl.daemon.server.reply_ids import ENTRY_BYTES, ReplyIds
from kvctl.daemon.server.reply_splice import reply_ids_of, spliced_prompt

from .test_chat_api import daemon  # noqa: F401 (a kvd on the demo checkpoint, for the live tests below)

BLOCK = 16


# ---- the memory of replies ---------------------------------------------------------------------
def test_a_reply_s_ids_are_its_tenant_s_and_its_tokenizer_s():
    replies = ReplyIds(2**20)
    assert replies.remember("acme", "tok-1", "hello", [104, 101, 108, 108, 111])
    assert replies.ids_for("acme", "tok-1", "hello") == [104, 101, 108, 108, 111]
    assert replies.ids_for("globex", "tok-1", "hello") is None  # another tenant's reply is not read
    assert replies.ids_for("acme", "tok-2", "hello") is None  # nor one made under another tokenizer
    assert replies.ids_for("acme", "tok-1", "hello!") is None
    assert replies.remember("acme", "tok-1", "hello", [7, 8])  # the same text again: the last ids win
    assert replies.ids_for("acme", "tok-1", "hello") == [7, 8]
    figures = replies.figures()
    assert (figures["replies"], figures["bytes"], figures["remembered"]) == (1, ENTRY_BYTES + 8, 2)


def test_for_room_the_least_recently_used_reply_of_the_tenant_holding_the_most_goes():
    one = ENTRY_BYTES + 4 * 10
    replies = ReplyIds(4 * one)
    for tenant, text in (("acme", "a1"), ("acme", "a2"), ("acme", "a3"), ("globex", "g1")):
        assert replies.remember(tenant, "tok", text, list(range(10)))
    assert replies.ids_for("acme", "tok", "a1") is not None  # a turn found it: a2 is acme's oldest now
    assert replies.remember("globex", "tok", "g2", list(range(10)))
    kept = {text for text in ("a1", "a2", "a3") if replies.ids_for("acme", "tok", text) is not None}
    assert kept == {"a1", "a3"}  # acme held the most (3 of 4): its least recently used went, not globex's g1
    assert replies.ids_for("globex", "tok", "g1") is not None
    assert replies.figures()["dropped"] == 1
    assert not replies.remember("acme", "tok", "huge", list(range(4 * 10 + 100)))  # bigger than the budget
    assert replies.resize(one) == 3 and replies.figures()["replies"] == 1  # lowered live, as a reload does
    assert replies.resize(0) == 1 and not replies.keeps
    assert not replies.remember("acme", "tok", "a1", [1]) and replies.figures()["bytes"] == 0


# ---- which ids a reply can be read back as ------------------------------------------------------
def decode(ids):
    return "".join(chr(t) for t in ids if t < 256)


EOS = 257


@pytest.mark.parametrize("ids, text, expected", [
    ([104, 105, EOS], "hi", [104, 105]),  # the stop token: the template writes its own end of the turn
    ([104, 105], "hi", [104, 105]),  # cut at max_tokens
    ([104, EOS, 105, EOS], "hi", None),  # a special token inside would be read where the text has none
    ([104, 105, 33, 33], "hi", None),  # a stop string ("!!") cut the text: no ids say it exactly
    ([EOS], "", None),  # nothing to read back
])
def test_a_reply_is_read_back_as_its_ids_only_where_they_say_its_text_exactly(ids, text, expected):
    assert reply_ids_of(ids, text, decode, frozenset({256, EOS})) == expected


# ---- the splice ----------------------------------------------------------------------------------
def chatml(messages, trim=False):
    turns = "".join(f"<{m['role']}>{m['content'].strip() if trim else m['content']}</>" for m in messages)
    return turns + "<assistant>"


def encode(text):
    """A tokenizer that spells every letter apart, except "ab", one token (256)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("ab", i):
            out.append(256)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


CONVERSATION = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
                {"role": "user", "content": "r"}, {"role": "assistant", "content": " c "},
                {"role": "user", "content": "s"}]
MADE = {"ab": [97, 98], " c ": [32, 99, 32]}  # the model made "a", "b"; the tokenizer reads back "ab"


def test_kept_replies_go_in_as_their_ids_between_the_template_s_text():
    ids, spliced, changed = spliced_prompt(CONVERSATION, chatml, encode, MADE.get)
    text = chatml(CONVERSATION)
    assert encode(text) != ids and decode(ids) == text  # the same text, split as the model split it
    assert ids == (encode("<user>q</><assistant>") + [97, 98] + encode("</><user>r</><assistant>") + [32, 99, 32]
                   + encode("</><user>s</><assistant>"))
    assert (spliced, changed) == (2, False)
    assert spliced_prompt(CONVERSATION, chatml, encode, {}.get) == (encode(text), 0, False)  # none kept


@pytest.mark.parametrize("render", [
    lambda messages: chatml(messages, trim=True),  # writes " c " as "c": the model never made that
    lambda messages: chatml([m for m in messages if m["role"] != "assistant"]),  # drops the replies
    lambda messages: chatml(messages) + messages[1]["content"],  # writes a reply twice
    lambda messages: chatml(messages[::-1]),  # out of order
])
def test_a_template_that_writes_a_kept_reply_otherwise_gets_the_text_tokenized(render):
    assert spliced_prompt(CONVERSATION, render, encode, MADE.get) == (encode(render(CONVERSATION)), 0, True)


def test_a_template_that_refuses_the_marker_gets_the_text_tokenized():
    def picky(messages):
        if any("\ue000" in m["content"] for m in messages):
            raise ValueError("messages: the chat template refused them: odd content")
        return chatml(messages)

    assert spliced_prompt(CONVERSATION, picky, encode, MADE.get) == (encode(chatml(CONVERSATION)), 0, True)


# ---- a live kvd ----------------------------------------------------------------------------------
def chat(app, messages, **body):
    from .daemon_fixtures import call

    answer = call(app, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 40, **body})
    assert answer.status_code == 200, answer.text
    return answer


def streamed(app, messages, **body) -> tuple[str, list[int]]:
    """A streamed chat's whole reply and its ids, put together from its chunks."""
    from .daemon_fixtures import sse_events

    chunks = [c for c in sse_events(chat(app, messages, stream=True, **body)) if c != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]


def rendered(service, messages):
    return service.loaded.tokenizer.encode(service.chat_template.render(messages), add_special_tokens=False)


def first_turn(app, question: str, seed: int, stream: bool = False):
    """(the first turn, its reply's text, the ids the model made): a sampled reply of 40 bytes, which
    the demo's byte-level tokenizer reads back otherwise (a character cut at its end, or bytes that
    are not UTF-8, come back as U+FFFD, three bytes)."""
    turn = [{"role": "user", "content": question}]
    if stream:
        text, ids = streamed(app, turn, temperature=1.0, seed=seed)
    else:
        [choice] = chat(app, turn, temperature=1.0, seed=seed).json()["choices"]
        text, ids = choice["message"]["content"], choice["token_ids"]
    return turn, text, ids


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_turn_is_prompted_with_the_reply_s_own_ids_and_hits_its_blocks(daemon, stream):
    from .daemon_fixtures import call

    service, unix, _ = daemon
    turn, text, made = first_turn(unix, f"Tell me about tier {int(stream)} of the cache, at length.", seed=4,
                                  stream=stream)
    # (a reply kvd keeps: no token its text hides, such as a BOS the random model drew; the EOS ends it)
    assert not set(made[:-1]) & service.loaded.tokenizer.hidden_specials
    first = rendered(service, turn)
    assert rendered(service, turn + [{"role": "assistant", "content": text}])[len(first):] != made  # read otherwise
    before = service.reply_ids.figures()["spliced"]
    second = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    usage = chat(unix, second, max_tokens=2).json()["usage"]
    tail = service.loaded.tokenizer.encode("<|end|>\n<|user|>\nAnd then?<|end|>\n<|assistant|>\n",
                                           add_special_tokens=False)
    prompt = first + made + tail  # the reply as the model made it (its last token the stop token, or cut)
    if made[-1] == service.loaded.tokenizer.eos_token_id:
        prompt = first + made[:-1] + tail
    counted = call(unix, "POST", "/tokenize", json={"messages": second}).json()
    assert counted["tokens"] == prompt and usage["prompt_tokens"] == len(prompt)
    # cached: the first prompt and the reply, less its last token (never computed), in whole blocks
    assert usage["prompt_tokens_details"]["cached_tokens"] == (len(first) + len(made) - 1) // BLOCK * BLOCK
    assert service.reply_ids.figures()["spliced"] == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_names_the_ids_the_model_read_the_kept_reply_s_among_them(daemon, stream):
    """vLLM's `return_token_ids`: a chat's answer names its prompt's ids (streamed, in the first chunk
    alone), which are the template's text tokenized and the kept reply as the model made it."""
    from .daemon_fixtures import call, sse_events

    service, unix, _ = daemon
    turn, text, made = first_turn(unix, f"Which ids went in, take {int(stream)}?", seed=5)
    second = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    prompt = call(unix, "POST", "/tokenize", json={"messages": second}).json()["tokens"]
    reply = made[:-1] if made[-1] == service.loaded.tokenizer.eos_token_id else made
    assert prompt[len(rendered(service, turn)):][:len(reply)] == reply and prompt != rendered(service, second)
    asked = dict(max_tokens=3, temperature=1.0, seed=2, return_token_ids=True)
    if stream:
        chunks = [c for c in sse_events(chat(unix, second, stream=True, **asked)) if c != "[DONE]"]
        assert chunks[0]["prompt_token_ids"] == prompt
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks)  # a chat's is the answer's
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    else:
        answer = chat(unix, second, **asked).json()
        assert answer["prompt_token_ids"] == prompt and answer["usage"]["prompt_tokens"] == len(prompt)
        ids = answer["choices"][0]["token_ids"]
    assert ids == chat(unix, second, max_tokens=3, temperature=1.0, seed=2).json()["choices"][0]["token_ids"]
    plain = chat(unix, second, max_tokens=1, return_token_ids=False).json()
    assert "prompt_token_ids" not in plain and "prompt_token_ids" not in plain["choices"][0]


def test_without_the_memory_the_reply_is_tokenized_again_and_only_the_first_prompt_hits(tmp_path):
    from .daemon_fixtures import call, kvd_in

    with kvd_in(tmp_path, "off", reply_ids_bytes="0") as (service, unix):
        turn, text, made = first_turn(unix, "Tell me about tier 0 of the cache, at length.", seed=3)
        second = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        usage = chat(unix, second, max_tokens=2).json()["usage"]
        plain = rendered(service, second)
        assert call(unix, "POST", "/tokenize", json={"messages": second}).json()["tokens"] == plain
        first = rendered(service, turn)
        same = next(i for i, (a, b) in enumerate(zip(plain, first + made)) if a != b)
        assert usage["prompt_tokens_details"]["cached_tokens"] == same // BLOCK * BLOCK < (len(first) + len(made) - 1
                                                                                          ) // BLOCK * BLOCK
        assert service.reply_ids.figures() == {"budget_bytes": 0, "bytes": 0, "replies": 0, "remembered": 0,
                                               "dropped": 0, "spliced": 0, "template_changed": 0}


def test_another_tenant_sending_the_same_reply_back_gets_it_tokenized(daemon):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, _, tcp = daemon
    acme, globex = ({"Authorization": f"Bearer {token}"} for token in (USER_TOKEN, GLOBEX_TOKEN))
    turn = [{"role": "user", "content": "Which tier holds the most?"}]
    answer = call(tcp, "POST", "/v1/chat/completions", headers=acme,
                  json={"messages": turn, "max_tokens": 40, "temperature": 1.0, "seed": 5}).json()
    second = turn + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Why?"}]
    mine = call(tcp, "POST", "/tokenize", headers=acme, json={"messages": second}).json()["tokens"]
    theirs = call(tcp, "POST", "/tokenize", headers=globex, json={"messages": second}).json()["tokens"]
    assert theirs == rendered(service, second) != mine


def test_a_reply_the_model_ended_with_a_stop_string_is_not_kept(daemon):
    service, unix, _ = daemon
    turn, text, made = first_turn(unix, "Count the tiers.", seed=7)
    stop = text[5:7]
    [choice] = chat(unix, turn, temperature=1.0, seed=7, stop=[stop]).json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text[:text.index(stop)]
    tokenizer = service.loaded.tokenizer
    assert service.reply_ids.ids_for("default", tokenizer.digest, choice["message"]["content"]) is None
    assert service.reply_ids.ids_for("default", tokenizer.digest, text) is not None


def test_status_and_metrics_count_the_replies(daemon):
    from .daemon_fixtures import call

    service, unix, _ = daemon
    before = service.reply_ids.figures()["replies"]
    first_turn(unix, "Count the replies.", seed=11)
    figures = call(unix, "GET", "/admin/status").json()["reply_ids"]
    assert figures == service.reply_ids.figures() and figures["replies"] == before + 1
    scraped = call(unix, "GET", "/metrics").text
    assert f"kvd_reply_ids_kept {float(figures['replies'])}" in scraped
    assert f"kvd_reply_ids_spliced_total {float(figures['spliced'])}" in scraped


def test_a_reload_lowers_the_memory_live_and_kvctl_says_what_went(tmp_path):
    from dataclasses import replace

    from .daemon_fixtures import kvd_in
    from .kvctl_fakes import kvctl_answered

    with kvd_in(tmp_path, "kvd") as (service, unix):
        for seed in (1, 2, 3):
            first_turn(unix, f"Question {seed}?", seed=seed)
        kept = service.reply_ids.figures()["replies"]
        assert kept == 3
        result = service.reload(replace(service.config, reply_ids_bytes=0))
        assert result["changed"] == {"reply_ids_bytes": 0} and result["let_go"] == {"reply_ids": 3}
        turn, text, made = first_turn(unix, "Question 4?", seed=4)
        assert service.reply_ids.figures()["replies"] == 0  # none kept from now on
    printed = kvctl_answered(["config", "reload"], {"changed": {"reply_ids_bytes": 0},
                                                    "previous": {"reply_ids_bytes": 67108864}, "needs_restart": [],
                                                    "let_go": {"reply_ids": 3}})
    assert printed.output.splitlines() == [
        "reloaded: reply_ids_bytes 67108864 -> 0",
        "let go to fit the lowered budget: 3 chat replies' ids (the least recently used of the tenants holding the "
        "most; their next turns are tokenized from their text)"]


def test_a_response_s_next_turn_hits_its_reply(daemon):
    """/v1/responses' previous_response_id: kvd keeps the conversation, the reply as text; its next turn
    is prompted with the reply's ids."""
    from .daemon_fixtures import call

    service, unix, _ = daemon
    first = call(unix, "POST", "/v1/responses", json={"input": "Which tier is the slowest?", "max_output_tokens": 40,
                                                      "temperature": 1.0, "seed": 11}).json()
    turn = [{"role": "user", "content": "Which tier is the slowest?"}]
    prompt = rendered(service, turn)
    assert first["usage"]["input_tokens"] == len(prompt)
    made = first["usage"]["output_tokens"]
    second = call(unix, "POST", "/v1/responses", json={"input": "Why?", "max_output_tokens": 2,
                                                       "previous_response_id": first["id"]}).json()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == (len(prompt) + made - 1) // BLOCK * BLOCK


def test_admin_reply_ids_names_the_ids_kept_of_each_text_for_the_tenant(daemon):
    """`POST /admin/reply-ids` (what kvd router's events view asks of a Responses answer it relays):
    the ids each text is prompted back as, for the tenant that was answered; None for a text kvd keeps
    no reply of (edited, another tenant's)."""
    from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, call

    service, unix, tcp = daemon
    turn, text, made = first_turn(unix, "Which ids does the router ask for?", seed=1)
    reply = made[:-1] if made[-1] == service.loaded.tokenizer.eos_token_id else made
    digest = service.loaded.tokenizer.digest
    answer = call(unix, "POST", "/admin/reply-ids", json={"texts": [text, text + "!", "never said"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"tenant": "default", "tokenizer_digest": digest, "ids": [reply, None, None]}
    assert call(unix, "POST", "/admin/reply-ids", json={"texts": [text], "tenant": "acme"}).json()["ids"] == [None]
    # a tenant's own: a user's token is not an admin's
    admin, user = ({"Authorization": f"Bearer {token}"} for token in (ADMIN_TOKEN, USER_TOKEN))
    assert call(tcp, "POST", "/admin/reply-ids", headers=user, json={"texts": [text]}).status_code == 403
    for body, param, words in (({"texts": []}, "texts", "at least 1"), ({"texts": ["a"] * 65}, "texts", "at most 64"),
                               ({"texts": [text], "tenant": "no tenant"}, "tenant", "pattern"),
                               ({"texts": [5]}, "texts", "valid string (got 5)")):
        refused = call(tcp, "POST", "/admin/reply-ids", headers=admin, json=body)
        assert refused.status_code == 400, body
        assert refused.json()["error"]["param"] == param and words in refused.json()["error"]["message"], refused.text


def test_with_a_disk_tier_the_replies_ids_outlive_a_restart_and_the_next_turn_hits_its_reply(tmp_path):
    """The disk tier keeps the cache's blocks through a restart, and kvd the replies' ids (written as
    it stops, read back as it starts): the next turn after the restart hits the first prompt and the
    reply, restored from disk, as it would have before."""
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service

    settings = dict(num_blocks=256, disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    try:
        turn, text, made = first_turn(create_app(service, service.metrics, front="unix"), "Before the restart?",
                                      seed=3)
        first = rendered(service, turn)
    finally:
        service.shutdown(deadline=5)
    assert (tmp_path / "reply_ids.sqlite3").stat().st_mode & 0o777 == 0o600
    again = start_service(tmp_path, **settings)
    try:
        assert again.reply_ids.figures()["replies"] == 1
        second = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "And after?"}]
        usage = chat(create_app(again, again.metrics, front="unix"), second, max_tokens=2).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (len(first) + len(made) - 1) // BLOCK * BLOCK
        assert again.reply_ids.figures()["spliced"] == 1
    finally:
        again.shutdown(deadline=5)


def test_the_replies_file_keeps_each_tenant_s_order_and_one_unreadable_is_set_aside(tmp_path, caplog):
    from kvctl.daemon.server.reply_ids_file import load_reply_ids, save_reply_ids

    replies = ReplyIds(2**20)
    for tenant, text, ids in (("acme", "a1", [1, 2]), ("globex", "g1", [3]), ("acme", "a2", [2**31 - 1, 0])):
        replies.remember(tenant, "tok", text, ids)
    replies.remember("acme", "old-tok", "a3", [9])  # another tokenizer's: not read back under "tok"
    assert replies.ids_for("acme", "tok", "a1") == [1, 2]  # a1 is now acme's most recently used
    assert save_reply_ids(replies, tmp_path) == 4
    back = ReplyIds(2 * (ENTRY_BYTES + 8) + ENTRY_BYTES + 4)  # room for three
    assert load_reply_ids(back, tmp_path, "tok") == 3
    assert [(tenant, ids.tolist()) for _, tenant, _, ids in back.kept_in_order()] == [
        ("acme", [2**31 - 1, 0]), ("acme", [1, 2]), ("globex", [3])]
    assert back.ids_for("acme", "tok", "a2") == [2**31 - 1, 0] and back.ids_for("acme", "old-tok", "a3") is None
    (tmp_path / "reply_ids.sqlite3").write_bytes(b"not a database")
    assert load_reply_ids(ReplyIds(2**20), tmp_path, "tok") == 0
    assert (tmp_path / "reply_ids.sqlite3.unreadable").is_file() and not (tmp_path / "reply_ids.sqlite3").exists()
    assert "could not be read" in caplog.text


def test_explain_says_how_a_chat_s_replies_go_in_and_counts_the_hit_the_chat_then_gets(daemon):
    """`kvctl explain --messages`: the chat as its tenant's next turn would be prompted, and which of
    its assistant messages go in as the ids the model made; an edited reply is read as text."""
    from .daemon_fixtures import call

    service, unix, _ = daemon
    turn, text, made = first_turn(unix, "What would explain say?", seed=23)
    assert not set(made[:-1]) & service.loaded.tokenizer.hidden_specials  # (one with a special inside is not kept)
    second = turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    explained = call(unix, "POST", "/admin/explain", json={"messages": second}).json()
    assert explained["replies"] == {"assistant_messages": 1, "as_ids": 1, "as_text": 0, "template_changed": False}
    usage = chat(unix, second, max_tokens=2).json()["usage"]
    assert explained["hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert explained["prompt_tokens"] == usage["prompt_tokens"]
    edited = turn + [{"role": "assistant", "content": text + "!"}, {"role": "user", "content": "And then?"}]
    assert call(unix, "POST", "/admin/explain", json={"messages": edited}).json()["replies"] == {
        "assistant_messages": 1, "as_ids": 0, "as_text": 1, "template_changed": False}
    assert "replies" not in call(unix, "POST", "/admin/explain", json={"text": "a prompt of text"}).json()


def test_kvctl_reads_a_responses_request_as_the_chat_kvd_serves_it(daemon, tmp_path):
    """`kvctl explain|pin|evict|route --messages` take a /v1/responses request's body too (a stateless
    agent's turn, as logged): its instructions, input items and tools, read as kvd serves it. Its
    explanation is the turn's own usage; one that continues a kept response is refused."""
    import json

    from kvctl.command_kit import prompt_body
    from kvctl.errors import UserError

    from .daemon_fixtures import call

    service, unix, _ = daemon
    opening = {"instructions": "Answer about tiers.", "input": [{"role": "user", "content": "Which tier is first?"}]}
    first = call(unix, "POST", "/v1/responses", json={**opening, "max_output_tokens": 40, "temperature": 1.0,
                                                      "seed": 1, "store": False}).json()
    [message] = first["output"]
    assert service.reply_ids.ids_for("default", service.loaded.tokenizer.digest,
                                     message["content"][0]["text"]) is not None  # (a reply kvd keeps)
    body = {**opening, "input": opening["input"] + [message, {"role": "user", "content": "And then?"}], "store": False}
    path = tmp_path / "turn.json"
    path.write_text(json.dumps(body))
    asked = prompt_body(None, None, None, path)
    assert asked["messages"][0] == {"role": "system", "content": "Answer about tiers."}
    explained = call(unix, "POST", "/admin/explain", json=asked).json()
    usage = call(unix, "POST", "/v1/responses", json={**body, "max_output_tokens": 1}).json()["usage"]
    assert (explained["prompt_tokens"], explained["hit_tokens"]) == (
        usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"])
    assert explained["replies"]["as_ids"] == 1 and explained["hit_tokens"] > 0
    for continued, field in (({"previous_response_id": first["id"]}, "previous_response_id"),
                             ({"conversation": "conv_1"}, "conversation")):
        path.write_text(json.dumps({**body, **continued}))
        with pytest.raises(UserError) as refused:
            prompt_body(None, None, None, path)
        assert str(refused.value) == (f"messages: {str(path)!r} continues a conversation kvd keeps ({field}); kvctl "
                                      "reads the request's own input only: give the whole conversation in `input`")
    path.write_text(json.dumps({**body, "tools": [{"type": "function", "name": "lookup", "parameters": {}}],
                                "chat_template_kwargs": {"thinking": False}}))  # its tools, as a chat's
    assert prompt_body(None, None, None, path) == {**asked, "chat_template_kwargs": {"thinking": False}, "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {}}}]}
    path.write_text(json.dumps({"input": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(UserError) as refused:
        prompt_body(None, None, None, path)
    assert str(refused.value) == (f"messages: {str(path)!r}: input[0].role: must be one of user, system, developer, "
                                  "assistant, got 'robot'")


def test_kvctl_explain_says_how_a_chat_s_replies_went_in():
    from .kvctl_fakes import kvctl_answered

    answer = {"hit_tokens": 96, "prompt_tokens": 120, "hit_blocks": 6, "full_blocks": 7, "tenant": "acme",
              "replies": {"assistant_messages": 3, "as_ids": 2, "as_text": 1, "template_changed": False}}
    shown = " ".join(kvctl_answered(["explain", "x"], answer).output.split())
    assert ("replies: 2 of 3 assistant messages go in as the ids the model made; 1 read as text: kvd keeps no reply "
            "of that text for this tenant (edited, another tenant's, let go for room, or made before a restart "
            "without a disk tier), and its blocks miss where the text reads back otherwise") in shown
    changed = {**answer, "replies": {"assistant_messages": 1, "as_ids": 0, "as_text": 1, "template_changed": True}}
    assert ("replies: 0 of 1 assistant messages go in as the ids the model made; the chat template writes a kept "
            "reply otherwise (trims it, cuts its reasoning), so the chat is read as text") in \
        " ".join(kvctl_answered(["explain", "x"], changed).output.split())
    assert "replies" not in kvctl_answered(["explain", "x"], {**answer, "replies": None}).output

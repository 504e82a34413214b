"""`POST /v1/chat/completions` in-process on the demo checkpoint: a chat is the completion of its
rendered prompt, prefixes are shared across conversations and turns, streaming, and refusals."""

from __future__ import annotations

import shutil

import pytest

import kvctl

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import apps, blocks_all_back, call, sse_events, start_service, token_table  # noqa: E402

SYSTEM = ("You are the operator's assistant for a fleet of KV caches. Answer in one short sentence, "
          "name the setting to change, and never guess a figure you were not given.")
BLOCK = 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    state = tmp_path_factory.mktemp("kvd")
    service = start_service(state, num_blocks=256)
    unix, tcp = apps(service, token_table(state))
    yield service, unix, tcp
    service.shutdown(1)


def chat(app, messages, **body):
    return call(app, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "seed": 3, **body})


def conversation(question, *turns):
    return [{"role": "system", "content": SYSTEM}, *turns, {"role": "user", "content": question}]


def rendered(service, messages, add_generation_prompt=True):
    text = service.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
    return service.loaded.tokenizer.encode(text, add_special_tokens=False)


def common_blocks(a, b):
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same // BLOCK * BLOCK


def test_a_chat_is_the_completion_of_its_rendered_prompt(daemon):
    service, unix, _ = daemon
    messages = conversation("Which setting bounds the host tier?")
    answer = chat(unix, messages, temperature=0.8, model=service.model_name)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    ids = rendered(service, messages)
    plain = call(unix, "POST", "/v1/completions",
                 json={"prompt": ids, "max_tokens": 6, "seed": 3, "temperature": 0.8}).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == service.model_name
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]
    assert choice["message"] == {"role": "assistant", "content": service.loaded.tokenizer.decode(choice["token_ids"])}
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 6
    assert blocks_all_back(service)


def test_conversations_sharing_a_system_prompt_share_its_blocks(daemon):
    service, unix, _ = daemon
    first = conversation("How do I pin the system prompt?")
    second = conversation("What evicts a pinned prefix?")
    chat(unix, first)
    usage = chat(unix, second).json()["usage"]
    shared = common_blocks(rendered(service, first), rendered(service, second))
    assert shared >= 64  # the system prompt is several blocks
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared


def test_the_next_turn_of_a_conversation_hits_the_turn_before(daemon):
    service, unix, _ = daemon
    turn_one = conversation("Name one tier.")
    reply = chat(unix, turn_one, temperature=0).json()["choices"][0]["message"]["content"]
    turn_two = conversation("And another?", {"role": "user", "content": "Name one tier."},
                            {"role": "assistant", "content": reply})  # system, user, assistant, user
    usage = chat(unix, turn_two, temperature=0).json()["usage"]
    first_prompt = rendered(service, turn_one)
    assert rendered(service, turn_two)[:len(first_prompt)] == first_prompt  # the template extends the turn
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(first_prompt) // BLOCK * BLOCK


def test_streaming_sends_deltas_that_add_up_to_the_whole_answer(daemon):
    service, unix, _ = daemon
    messages = conversation("Stream me an answer.")
    plain = chat(unix, messages, temperature=0.9, n=2).json()
    events = sse_events(chat(unix, messages, temperature=0.9, n=2, stream=True,
                             stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["object"] for c in events[:-1]} == {"chat.completion.chunk"}
    assert len({c["id"] for c in events[:-1]}) == 1 and events[0]["id"].startswith("chatcmpl-")
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"]["content"] for c in mine) == plain["choices"][index]["message"]["content"]
        assert [t for c in mine for t in c["token_ids"]] == plain["choices"][index]["token_ids"]
        assert [c["finish_reason"] for c in mine][-1] == "length" and not any(
            c["finish_reason"] for c in mine[:-1])
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"] | {
        "prompt_tokens_details": events[-2]["usage"]["prompt_tokens_details"]}
    assert blocks_all_back(service)


def test_continue_final_message_goes_on_with_the_assistant_s_words(daemon):
    service, unix, _ = daemon
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one, two,"}]
    body = chat(unix, messages, continue_final_message=True, add_generation_prompt=False, temperature=0).json()
    ids = service.loaded.tokenizer.encode("<|begin|><|user|>\nCount.<|end|>\n<|assistant|>\none, two,", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    plain = call(unix, "POST", "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert body["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    # add_generation_prompt left out: it gives way to continue_final_message
    same = chat(unix, messages, continue_final_message=True, temperature=0).json()
    assert same["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


def test_max_completion_tokens_is_max_tokens(daemon):
    _, unix, _ = daemon
    body = call(unix, "POST", "/v1/chat/completions", json={
        "messages": conversation("Short."), "max_completion_tokens": 3, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"


def test_the_values_of_unsupported_fields_that_ask_for_nothing_are_taken(daemon):
    """What a client sends by default (OpenAI's verbosity medium, no web search, vLLM's special tokens
    skipped) changes nothing."""
    _, unix, _ = daemon
    asked = {"messages": conversation("Inert?"), "max_tokens": 3, "temperature": 0.0}
    plain = call(unix, "POST", "/v1/chat/completions", json=asked).json()
    inert = call(unix, "POST", "/v1/chat/completions", json={
        **asked, "verbosity": "medium", "web_search_options": None, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "bad_words": [],
        "add_special_tokens": False}).json()
    assert inert["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


@pytest.mark.parametrize("body, status, param, message", [
    ({"messages": []}, 400, "messages", "messages: must not be empty"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, 400, "messages[1].role",
     "messages[1].role: must be one of system, user, assistant, tool, got 'bot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type",
     "messages[0].content[0].type: kvd takes text parts only ({\"type\": \"text\", \"text\": ...}), got 'image_url'"),
    ({"messages": "hello"}, 400, "messages", "messages: Input should be a valid list (got 'hello')"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400, "tools[0].function",
     "tools[0].function: must be an object with name, description and parameters"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "tools: kvd parses no tool calls here (start it with --tool-call-parser hermes, llama3_json, mistral, "
     "pythonic or openai); send tool_choice: \"none\" to show the model the tools without calls"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "none"}, 400, "tools",
     "tools: the model's chat template (TEMPLATE) does not write tools, so the model could not see them; describe "
     "them in a message, or start kvd with a --chat-template that renders tools"),
    ({"messages": [{"role": "user", "content": "a"}], "functions": [{"name": "f"}]}, 400, "functions",
     "functions: not supported by kvd, got [{'name': 'f'}]; OpenAI's older form of tools: send tools"),
    ({"messages": [{"role": "user", "content": "a"}], "echo": True}, 400, "echo",
     "echo: not supported by kvd, got True; leave it out"),
    ({"messages": [{"role": "user", "content": "a"}], "skip_special_tokens": False}, 400, "skip_special_tokens",
     "skip_special_tokens: not supported by kvd, got False; kvd's replies leave special tokens out of their text; "
     "each choice's token_ids has them"),
    ({"messages": [{"role": "user", "content": "a"}], "verbosity": "low"}, 400, "verbosity",
     "verbosity: not supported by kvd, got 'low'; kvd's model writes as it writes; say how long a reply should be in "
     "the messages, or cap it with max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "web_search_options": {}}, 400, "web_search_options",
     "web_search_options: not supported by kvd, got {}; kvd searches nothing; put what the model should read in the "
     "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400, "add_special_tokens",
     "add_special_tokens: not supported by kvd, got True; a completion's prompt is tokenized with the tokenizer's "
     "special tokens (BOS), a chat's as its template writes them; send token ids for any other"),
    ({"messages": [{"role": "user", "content": "a"}], "reasoning_effort": "low"}, 400, "reasoning_effort",
     "reasoning_effort: the model's chat template does not read reasoning_effort, so 'low' would change nothing; "
     "leave it out"),
    ({"messages": [{"role": "user", "content": "a"}], "allowed_token_ids": [70, 258]}, 400, "allowed_token_ids",
     "allowed_token_ids: must be token ids in [0, 258), got 258"),
    ({"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "prompt_logprobs: must be an integer from 0 to 20, got 21"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, 400, "top_logprobs",
     "top_logprobs: 3 needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs: must be an integer from 0 to 20, got 21"),
    ({"messages": [{"role": "user", "content": "a"}], "frequency_penalty": 3}, 400, "frequency_penalty",
     "frequency_penalty: must be a number from -2 to 2, got 3.0"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": True}, 400, "top_logprobs",
     "top_logprobs: expected a number, not a boolean (got True)"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"}, 400, "chat_template",
     "chat_template: not supported by kvd, got '{{ 1 }}'; kvd renders every conversation with the model's own "
     "template (kvd serve --chat-template sets it for the daemon)"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "chat_template_kwargs.enable_thinking", "chat_template_kwargs.enable_thinking: the model's chat template does not "
     "read 'enable_thinking'; it reads: none"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "max_completion_tokens": 5}, 400,
     "max_completion_tokens", "max_completion_tokens: 5 differs from max_tokens 4; give one of them"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True,
      "add_generation_prompt": True}, 400, "add_generation_prompt",
     "add_generation_prompt: true contradicts continue_final_message: true (the prompt cannot both end inside the "
     "last message and open a new one)"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 9000}, 413, "max_tokens",
     "max_tokens: prompt (27) + max_tokens (9000) exceeds the model's 8192 positions"),
    ({"messages": [{"role": "user", "content": "x" * 8200}]}, 413, "messages",
     "messages: the conversation is 8226 tokens, which leaves no room for a reply in the model's 8192 positions"),
    ({"messages": [{"role": "user", "content": "a"}], "model": "gpt-4o"}, 404, "model",
     "model: 'gpt-4o' is not served here; GET /v1/models lists 'kvd-demo-llama-v1'"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 0}, 400, "n", "n: must be an integer from 1 to 64, got 0"),
])
def test_bad_chat_requests_are_refused_by_name_and_leave_nothing_behind(daemon, body, status, param, message):
    service, unix, _ = daemon
    answer = call(unix, "POST", "/v1/chat/completions", json=body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert (error["param"], error["message"]) == (param, message.replace("TEMPLATE", service.chat_template.source))
    assert blocks_all_back(service)


def test_a_user_token_may_chat_and_its_tenant_keeps_its_own_blocks(daemon):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN

    _, _, tcp = daemon
    messages = conversation("Tenants?")
    acme = {"Authorization": f"Bearer {USER_TOKEN}"}
    globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
    payload = {"messages": messages, "max_tokens": 2}
    call(tcp, "POST", "/v1/chat/completions", json=payload, headers=acme)
    again = call(tcp, "POST", "/v1/chat/completions", json=payload, headers=acme).json()
    other = call(tcp, "POST", "/v1/chat/completions", json=payload, headers=globex).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert call(tcp, "POST", "/v1/chat/completions", json=payload).status_code == 401


def test_a_model_without_a_chat_template_says_how_to_give_it_one(tmp_path):
    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint(tmp_path / "build")
    model = tmp_path / "no-template"
    shutil.copytree(demo, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    service = start_service(tmp_path / "state", model=str(model))
    try:
        unix, _ = apps(service, token_table(tmp_path))
        answer = chat(unix, [{"role": "user", "content": "hi"}])
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == (
            "messages: model 'no-template' has no chat template (none in its tokenizer_config.json or "
            "chat_template.jinja); start kvd with --chat-template FILE, or send the prompt to /v1/completions")
        assert call(unix, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        service.shutdown(1)


def test_a_template_given_at_start_renders_and_its_refusals_are_400s(tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('this model takes no system prompt') }}{% endif %}"
                        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    service = start_service(tmp_path / "state", chat_template=str(template))
    try:
        unix, _ = apps(service, token_table(tmp_path))
        refused = chat(unix, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
        assert refused.status_code == 400
        assert refused.json()["error"] | {"type": None} == {
            "message": "messages: the chat template refused them: this model takes no system prompt",
            "param": "messages", "code": "chat_template_refused", "type": None}
        answer = chat(unix, [{"role": "user", "content": "hi"}]).json()
        assert answer["usage"]["prompt_tokens"] == len(service.loaded.tokenizer.encode("user: hi\nassistant:",
                                                                                        add_special_tokens=False))
        assert service.status()["model"]["chat_template"] == {"source": str(template),
                                                              "digest": service.chat_template.digest,
                                                              "defaults": {}}
    finally:
        service.shutdown(1)


def test_a_template_that_does_not_parse_stops_the_start_with_its_file_and_line(tmp_path):
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m['content'] }")
    config = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 8,
                      "chat_template": str(template)}, env={})
    service = EngineService(config, Store(tmp_path / "kvd.sqlite3"))
    with pytest.raises(ValueError) as caught:
        service.load()
    assert str(caught.value).startswith(f"chat_template: {template} does not parse: ")
    assert "(line 2)" in str(caught.value)


def test_the_openapi_document_lists_the_chat_endpoint(daemon):
    _, unix, _ = daemon
    document = call(unix, "GET", "/openapi.json").json()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schema = document["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["required"] == ["messages"]
    assert {"max_completion_tokens", "continue_final_message", "stream"} <= set(schema["properties"])


def test_a_system_prompt_pinned_as_messages_is_what_every_chat_starting_with_it_hits(daemon):
    """Pinned as messages, a system prompt is rendered as chats begin (no reply opened); pinned as
    text it would lack the template's tokens and match no chat."""
    service, unix, _ = daemon
    system = [{"role": "system", "content": "Pinned: " + SYSTEM}]
    pinned = call(unix, "POST", "/admin/pins", json={"messages": system, "note": "chat"}).json()
    prefix = rendered(service, system, add_generation_prompt=False)
    assert pinned["blocks"] == len(prefix) // BLOCK and pinned["warmed"]
    conversation = system + [{"role": "user", "content": "Does the pin hold?"}]
    explained = call(unix, "POST", "/admin/explain", json={"messages": conversation}).json()
    usage = chat(unix, conversation).json()["usage"]
    assert explained["prompt_tokens"] == usage["prompt_tokens"] == len(rendered(service, conversation))
    assert explained["hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == pinned["blocks"] * BLOCK
    as_text = call(unix, "POST", "/admin/explain", json={"text": system[0]["content"]}).json()
    assert as_text["hit_tokens"] == 0  # the text alone, without the template's tokens, hits nothing of it
    bad = call(unix, "POST", "/admin/explain", json={"messages": [{"role": "user"}]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "messages[0].content")
    both = call(unix, "POST", "/admin/pins", json={"messages": system, "text": "x"})
    assert both.json()["error"]["message"] == "give exactly one of text, tokens, messages, prefix and keys"
    both = call(unix, "POST", "/admin/explain", json={"messages": system, "text": "x"})
    assert both.json()["error"]["message"] == "give exactly one of text, tokens and messages"
    assert call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}").status_code == 200


def test_finished_samples_are_counted_by_api_and_finish_reason(daemon):
    import time

    from prometheus_client.parser import text_string_to_metric_families

    service, unix, _ = daemon

    def finished() -> dict:
        text = call(unix, "GET", "/metrics").text
        return {(s.labels["api"], s.labels["finish_reason"]): s.value for family in
                text_string_to_metric_families(text) if family.name == "kvd_finished" for s in family.samples
                if s.name == "kvd_finished_total"}

    before = finished()
    chat(unix, conversation("Count them."), n=2, max_tokens=3, ignore_eos=True)
    call(unix, "POST", "/v1/completions", json={"prompt": "count me", "max_tokens": 2, "ignore_eos": True})
    want = {("chat", "length"): 2, ("completions", "length"): 1}
    for _ in range(100):  # counted as the engine thread sees them finish, just after the answer
        after = finished()
        if all(after.get(k, 0) - before.get(k, 0) == v for k, v in want.items()):
            break
        time.sleep(0.01)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in want} == want


def test_chat_logprobs_come_in_openai_s_chat_shape_streamed_or_whole(daemon):
    service, unix, _ = daemon
    messages = conversation("Which tokens were likely?")
    whole = chat(unix, messages, temperature=0.0, logprobs=True, top_logprobs=2).json()["choices"][0]
    content = whole["logprobs"]["content"]
    text_of = service.loaded.tokenizer.token_text
    assert [c["token"] for c in content] == [text_of(t) for t in whole["token_ids"]]
    for item in content:
        assert item["bytes"] == list(item["token"].encode("utf-8")) and item["logprob"] <= 0
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] == item["logprob"]
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    streamed = sse_events(chat(unix, messages, temperature=0.0, logprobs=True, top_logprobs=2, stream=True))
    parts = sum((e["choices"][0]["logprobs"]["content"] for e in streamed[:-1]), [])
    assert [p["token"] for p in parts] == [c["token"] for c in content]
    assert [p["logprob"] for p in parts] == pytest.approx([c["logprob"] for c in content], abs=1e-5)
    alone = chat(unix, messages, temperature=0.0, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in alone] == [[]] * len(alone)  # no alternatives unless asked
    assert chat(unix, messages, temperature=0.0).json()["choices"][0]["logprobs"] is None


def test_vllm_s_tokenize_and_detokenize_count_what_completions_and_chats_send(daemon):
    """Clients written for vLLM's server count tokens with /tokenize before they send."""
    service, unix, _ = daemon
    positions = service.loaded.config.max_position_embeddings
    prompt = SYSTEM + "How many tokens?"
    counted = call(unix, "POST", "/tokenize", json={"prompt": prompt}).json()
    usage = call(unix, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert counted == {"count": usage["prompt_tokens"], "max_model_len": positions,
                       "tokens": service.tokenize(prompt)}
    bare = call(unix, "POST", "/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == counted["tokens"][1:]  # without the BOS token
    messages = conversation("And this chat?")
    chat_usage = chat(unix, messages, max_tokens=1).json()["usage"]
    as_chat = call(unix, "POST", "/tokenize", json={"messages": messages}).json()
    assert as_chat["tokens"] == rendered(service, messages) and as_chat["count"] == chat_usage["prompt_tokens"]
    unopened = call(unix, "POST", "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert unopened["tokens"] == rendered(service, messages, add_generation_prompt=False)
    both = call(unix, "POST", "/tokenize", json={"messages": messages, "add_generation_prompt": True,
                                                 "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
    back = call(unix, "POST", "/detokenize", json={"tokens": counted["tokens"]}).json()
    assert back == {"prompt": prompt}
    assert call(unix, "GET", "/v1/models").json()["data"][0]["max_model_len"] == positions
    assert call(unix, "GET", "/health").status_code == 200
    assert call(unix, "GET", "/version").json() == {"version": kvctl.__version__}


@pytest.mark.parametrize("path, body, param, message", [
    ("/tokenize", {}, "prompt", "prompt: give a prompt (text) or messages (a chat), not both or neither"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt",
     "prompt: give a prompt (text) or messages (a chat), not both or neither"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "model", None),
    ("/detokenize", {"tokens": [5, 258]}, "tokens[1]", "tokens[1]: must be a token id in [0, 258), got 258"),
    ("/detokenize", {"tokens": [5, True]}, "tokens", None),
])
def test_tokenize_and_detokenize_refuse_a_bad_body_by_field(daemon, path, body, param, message):
    _, unix, _ = daemon
    answer = call(unix, "POST", path, json=body)
    error = answer.json()["error"]
    assert answer.status_code == (404 if param == "model" else 400) and error["param"] == param
    assert message is None or error["message"] == message


def test_vllm_s_probe_and_version_need_no_token_but_tokenize_does(daemon):
    _, _, tcp = daemon
    assert call(tcp, "GET", "/health").json() == {} and "version" in call(tcp, "GET", "/version").json()
    assert call(tcp, "POST", "/tokenize", json={"prompt": "x"}).status_code == 401


def test_chat_logprobs_name_tokens_by_id_when_asked_and_keep_their_text_s_bytes(daemon):
    service, unix, _ = daemon
    text_of = service.loaded.tokenizer.token_text
    messages = conversation("Which ids?")
    choice = chat(unix, messages, temperature=0.0, logprobs=True, top_logprobs=3,
                  return_tokens_as_token_ids=True).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for token, item in zip(choice["token_ids"], content):
        assert item["bytes"] == list(text_of(token).encode("utf-8"))
        assert len({t["token"] for t in item["top_logprobs"]}) == 3  # three ids, whatever their text
        assert all(t["token"].startswith("token_id:") for t in item["top_logprobs"])


def test_chat_prompt_logprobs_rank_every_rendered_prompt_token_once_per_answer(daemon):
    service, unix, _ = daemon
    messages = conversation("Rank my prompt's tokens")
    ids = rendered(service, messages)
    body = chat(unix, messages, temperature=0.0, prompt_logprobs=2, n=2).json()
    ranked = body["prompt_logprobs"]
    assert ranked[0] is None and len(ranked) == len(ids)
    for token, entry in zip(ids[1:], ranked[1:]):
        assert entry[str(token)]["decoded_token"] == service.loaded.tokenizer.token_text(token)
        others = sorted(r["rank"] for t, r in entry.items() if t != str(token))
        assert others in ([1, 2], [1], [2]) and entry[str(token)]["rank"] >= 1
        assert (entry[str(token)]["rank"] <= 2) == (len(entry) == 2)  # the token is among the two, or a third
    assert all("prompt_logprobs" not in c for c in body["choices"])
    streamed = sse_events(chat(unix, messages, temperature=0.0, prompt_logprobs=2, stream=True))
    carrying = [e for e in streamed[:-1] if "prompt_logprobs" in e]
    assert len(carrying) == 1
    again = carrying[0]["prompt_logprobs"]
    assert again[0] is None and [{t: r["rank"] for t, r in e.items()} for e in again[1:]] == \
        [{t: r["rank"] for t, r in e.items()} for e in ranked[1:]]
    assert [r["logprob"] for e in again[1:] for r in e.values()] == \
        pytest.approx([r["logprob"] for e in ranked[1:] for r in e.values()], abs=1e-4)


def test_24h_retention_without_a_persistent_tier_is_served_as_any_other(daemon):
    """`prompt_cache_retention: "24h"` where kvd has no disk or Redis tier: kept in memory, as every
    request is (OpenAI's retention is a best effort too); "in-memory", the other spelling, is taken."""
    service, unix, _ = daemon
    assert service.tiers is None
    for retention in ("24h", "in-memory", "in_memory", None):
        answer = chat(unix, conversation(f"Kept how long, {retention}?"), prompt_cache_retention=retention)
        assert answer.status_code == 200, answer.text

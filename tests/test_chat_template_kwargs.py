"""A request's chat_template_kwargs (vLLM's and SGLang's field): Qwen3's `enable_thinking` reaches the
template wherever a chat's prompt is rendered, and nothing else does."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("jinja2")

from kvctl.daemon.model.chat_template import ChatTemplate, TemplateKwargsError  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.server.route_question import local_ids, question_of  # noqa: E402

from .daemon_fixtures import apps, call, failed_start, start_service, token_table  # noqa: E402

# In the style of Qwen3's template: a reply opens with an empty thinking block when the caller turns
# thinking off; tools, when given, are described before the conversation.
THINKING = """{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}
{% endif %}{% for message in messages %}<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

SYSTEM = "You answer questions about KV caches, briefly and exactly, for operators of a fleet. " * 2
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a pin do?"}]


def template() -> ChatTemplate:
    return ChatTemplate.compile(THINKING, "thinking.jinja", {"bos_token": "<s>", "eos_token": "</s>"})


def test_a_template_takes_the_names_it_reads_less_those_kvd_passes_and_refuses():
    assert template().request_kwargs == {"enable_thinking"}
    off = template().render(CHAT, kwargs={"enable_thinking": False})
    assert off.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert template().render(CHAT, kwargs={"enable_thinking": True}) == template().render(CHAT) \
        == off[:-len("<think>\n\n</think>\n\n")]


@pytest.mark.parametrize("kwargs, param, message", [
    ({"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, "chat_template_kwargs.chat_template",
     "chat_template_kwargs.chat_template: a request cannot replace the model's chat template (kvd serve "
     "--chat-template sets it)"),
    ({"tools": [{"type": "function"}]}, "chat_template_kwargs.tools",
     "chat_template_kwargs.tools: kvd sets tools itself (send tools as the request's field)"),
    ({"messages": []}, "chat_template_kwargs.messages",
     "chat_template_kwargs.messages: kvd sets messages itself (send messages as the request's field)"),
    ({"eos_token": ""}, "chat_template_kwargs.eos_token", "chat_template_kwargs.eos_token: kvd sets eos_token itself"),
    ({"enable_thinkng": False}, "chat_template_kwargs.enable_thinkng",
     "chat_template_kwargs.enable_thinkng: the model's chat template does not read 'enable_thinkng' (did you mean "
     "'enable_thinking'?); it reads: enable_thinking"),
    (["enable_thinking"], "chat_template_kwargs",
     "chat_template_kwargs: must be a JSON object of names the chat template reads, got list"),
])
def test_what_a_template_cannot_take_is_refused_by_name(kwargs, param, message):
    with pytest.raises(TemplateKwargsError) as refused:
        template().render(CHAT, kwargs=kwargs)
    assert (refused.value.param, str(refused.value)) == (param, message)


def test_the_kwargs_render_as_transformers_renders_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    demo = ensure_demo_checkpoint(tmp_path / "state")
    hf = transformers.AutoTokenizer.from_pretrained(str(demo))
    ours = ChatTemplate.compile(THINKING, "thinking.jinja", {"bos_token": hf.bos_token, "eos_token": hf.eos_token})
    for thinking in (False, True):
        assert ours.render(CHAT, kwargs={"enable_thinking": thinking}) == hf.apply_chat_template(
            CHAT, chat_template=THINKING, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    state = tmp_path_factory.mktemp("kvd")
    (state / "thinking.jinja").write_text(THINKING)
    service = start_service(state, num_blocks=256, chat_template=str(state / "thinking.jinja"))
    unix, tcp = apps(service, token_table(state))
    yield service, unix, tcp
    service.shutdown(1)


def chat(app, **body):
    return call(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "seed": 3, **body})


def test_a_chat_s_kwargs_reach_its_prompt_and_its_cache(daemon):
    """Thinking off adds the empty block to the prompt the model sees; a second request with the
    same kwargs hits every full block of the first; /tokenize counts the same prompt."""
    service, unix, _ = daemon
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = chat(unix, **off).json()["usage"]
    expected = service.loaded.tokenizer.encode(template_of(service).render(CHAT, kwargs={"enable_thinking": False}),
                                               add_special_tokens=False)
    assert first["prompt_tokens"] == len(expected) == len(service.chat_prompt(CHAT)) + len("<think>\n\n</think>\n\n")
    again = chat(unix, **off).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == len(expected) // 16 * 16
    counted = call(unix, "POST", "/tokenize", json={"messages": CHAT, **off}).json()
    assert counted["tokens"] == expected and counted["count"] == first["prompt_tokens"]
    streamed = call(unix, "POST", "/v1/chat/completions",
                    json={"messages": CHAT, "max_tokens": 2, "stream": True, **off})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text


def template_of(service) -> ChatTemplate:
    return service.chat_template


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/tokenize", {"messages": CHAT}),
    ("/admin/explain", {"messages": CHAT}),
])
def test_kwargs_the_template_cannot_take_are_refused_wherever_a_chat_is_rendered(daemon, path, body):
    service, unix, _ = daemon
    before = service.status()["blocks"]
    answer = call(unix, "POST", path, json={**body, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "chat_template_kwargs.chat_template"
    assert answer.json()["error"]["message"].startswith("chat_template_kwargs.chat_template: a request cannot "
                                                        "replace the model's chat template")
    assert service.status()["blocks"] == before


def test_an_operator_names_a_chat_with_its_kwargs_to_explain_pin_and_evict_it(daemon):
    """`kvctl explain|pin|evict --messages request.json` sends the request's chat_template_kwargs, so
    the prompt they name is the one the chat was served with."""
    service, unix, _ = daemon
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    chat(unix, **off)
    served = len(service.chat_prompt(CHAT, template_kwargs={"enable_thinking": False}))
    named = call(unix, "POST", "/admin/explain", json={"messages": CHAT, **off}).json()
    plain = call(unix, "POST", "/admin/explain", json={"messages": CHAT}).json()
    assert (named["prompt_tokens"], named["hit_tokens"]) == (served, served // 16 * 16)
    assert plain["prompt_tokens"] == served - len("<think>\n\n</think>\n\n")
    for path in ("/admin/explain", "/tokenize"):  # a prompt given as text has no template to pass them to
        text_with_kwargs = call(unix, "POST", path, json={"prompt" if path == "/tokenize" else "text": "hello", **off})
        assert text_with_kwargs.status_code == 400
        assert text_with_kwargs.json()["error"]["message"] == \
            "chat_template_kwargs: only with messages (a chat's prompt)"
        assert text_with_kwargs.json()["error"]["param"] == "chat_template_kwargs"
    evicted = call(unix, "POST", "/admin/evict", json={"messages": CHAT, **off}).json()
    assert evicted["prompt_blocks"] == served // 16
    after = call(unix, "POST", "/admin/explain", json={"messages": CHAT, **off}).json()
    assert after["hit_tokens"] == evicted["shared_blocks_kept"] * 16


def test_the_router_renders_a_chat_with_its_kwargs_as_the_replica_does(daemon):
    service, _, _ = daemon
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    question = question_of(body)
    assert question["chat_template_kwargs"] == {"enable_thinking": False}
    tokenizer = service.loaded.tokenizer
    assert local_ids(question, tokenizer, template_of(service)) == \
        service.chat_prompt(CHAT, template_kwargs={"enable_thinking": False})
    refused = question_of({"messages": CHAT, "chat_template_kwargs": {"tools": []}})
    assert local_ids(refused, tokenizer, template_of(service)) == []  # the replica says why


def test_kvctl_reads_a_chat_request_s_kwargs_from_its_messages_file(tmp_path):
    from kvctl.command_kit import prompt_body

    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}))
    assert prompt_body(None, None, None, request) == {"messages": CHAT,
                                                      "chat_template_kwargs": {"enable_thinking": False}}
    listed = tmp_path / "messages.json"
    listed.write_text(json.dumps(CHAT))
    assert prompt_body(None, None, None, listed) == {"messages": CHAT}



# ---- the operator's defaults: the chat_template_kwargs setting ----------------------------------

OFF = '{"enable_thinking": false}'


@pytest.mark.parametrize("flags, env, yaml_text, expected", [
    ({"chat_template_kwargs": OFF}, {}, None, OFF),
    ({}, {"KVD_CHAT_TEMPLATE_KWARGS": '{"enable_thinking":false}'}, None, OFF),  # canonical JSON
    ({}, {}, "chat_template_kwargs:\n  enable_thinking: false\n", OFF),
    ({"chat_template_kwargs": "{}"}, {}, None, None),
])
def test_the_setting_is_a_json_object_from_a_flag_or_the_environment_and_a_mapping_in_yaml(tmp_path, flags, env,
                                                                                          yaml_text, expected):
    from kvctl.daemon.config import resolve

    path = None
    if yaml_text:
        path = tmp_path / "kvd.yaml"
        path.write_text(yaml_text)
    assert resolve(flags, env, path).chat_template_kwargs == expected


@pytest.mark.parametrize("value", ["enable_thinking=false", "[1]"])
def test_a_setting_that_is_not_a_json_object_is_refused_naming_it(value):
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as refused:
        resolve({"chat_template_kwargs": value}, {})
    assert str(refused.value).startswith(f"chat_template_kwargs: invalid value {value!r} from --chat-template-kwargs: "
                                         "must be ")


def test_defaults_render_unless_a_request_says_otherwise_and_the_digest_names_them():
    from kvctl.daemon.model.config import ModelError

    plain, off = template(), template().with_defaults({"enable_thinking": False})
    assert off.render(CHAT) == plain.render(CHAT, kwargs={"enable_thinking": False})
    assert off.render(CHAT, kwargs={"enable_thinking": True}) == plain.render(CHAT)
    assert off.digest != plain.digest == template().with_defaults({}).digest
    assert off.digest == template().with_defaults({"enable_thinking": False}).digest
    with pytest.raises(ModelError) as refused:
        template().with_defaults({"enable_thinkng": False})
    assert str(refused.value) == ("chat_template_kwargs.enable_thinkng: the model's chat template does not read "
                                  "'enable_thinkng' (did you mean 'enable_thinking'?); it reads: enable_thinking "
                                  "(the setting chat_template_kwargs, for thinking.jinja)")


def test_kvd_with_defaults_serves_them_says_them_and_a_router_renders_with_them(tmp_path):
    from rich.console import Console

    from kvctl.daemon.server.replica_feed import served_template
    from kvctl.status_view import render_status

    (tmp_path / "thinking.jinja").write_text(THINKING)
    service = start_service(tmp_path, num_blocks=256, chat_template=str(tmp_path / "thinking.jinja"),
                            chat_template_kwargs=OFF)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        think_block = len("<think>\n\n</think>\n\n")
        defaulted = chat(unix).json()["usage"]["prompt_tokens"]
        thinking = chat(unix, chat_template_kwargs={"enable_thinking": True}).json()["usage"]["prompt_tokens"]
        assert defaulted == thinking + think_block
        status = call(unix, "GET", "/admin/status").json()
        assert status["model"]["chat_template"]["defaults"] == {"enable_thinking": False}
        console = Console(width=200, record=True)
        render_status(status, console)
        assert re.search(r"chat template +\S+thinking\.jinja \([0-9a-f]{12}\); enable_thinking false unless a "
                         r"request says otherwise", console.export_text())
        served = call(unix, "GET", "/admin/tokenizer").json()
        assert served["chat_template_kwargs"] == {"enable_thinking": False}
        rendered = served_template(served, served["chat_template_digest"], service.loaded.tokenizer)
        assert local_ids(question_of({"messages": CHAT}), service.loaded.tokenizer, rendered) == \
            service.chat_prompt(CHAT)
    finally:
        service.shutdown(1)


def test_a_default_the_template_does_not_read_keeps_kvd_from_serving_and_says_why(tmp_path):
    error = failed_start(tmp_path, chat_template_kwargs=OFF)  # the demo template reads no such name
    assert "chat_template_kwargs.enable_thinking: the model's chat template does not read 'enable_thinking'; " \
           "it reads: none (the setting chat_template_kwargs, for " in error

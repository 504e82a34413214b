"""Chat templates: where they are found, rendering as `transformers` renders them, the sandbox,
and the checks on chat messages."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

from kvctl.daemon.model.chat_template import (ChatTemplateError, load_chat_template,  # noqa: E402
                                              template_from_config)
from kvctl.daemon.model.config import ModelError  # noqa: E402
from kvctl.daemon.model.demo import DEMO_CHAT_TEMPLATE, ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.tokenizer import Tokenizer  # noqa: E402
from kvctl.daemon.server.chat_messages import MessagesError, affinity_text, chat_messages  # noqa: E402

# A template in the style of the Llama 3 family: a system message taken off the front, roles that
# must alternate (raise_exception), whitespace shaped by trim_blocks and lstrip_blocks, tojson with
# non-ASCII text, and loop controls.
LLAMA_STYLE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = 'You are helpful.' %}
    {% set rest = messages %}
{% endif %}
<|start|>system<|sep|>{{ system | trim }}<|eot|>
{% for message in rest %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
<|start|>{{ message['role'] }}<|sep|>{{ message['content'] | trim }}<|eot|>
{% endfor %}
{% if meta is defined %}{{ meta | tojson }}{% endif %}
{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}],
    [{"role": "system", "content": "  Réponds en français.  "}, {"role": "user", "content": "Qu'est-ce ? ✓"},
     {"role": "assistant", "content": "Un cache."}, {"role": "user", "content": "Merci"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "STOP"},
     {"role": "assistant", "content": "never shown"}],
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("state"))


def hf_tokenizer(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def ours(directory, override=None):
    tokenizer = Tokenizer(directory)
    return tokenizer, load_chat_template(directory, tokenizer.config, override)


@pytest.mark.parametrize("conversation", CONVERSATIONS[:3])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_demo_template_renders_and_encodes_as_transformers_does(demo_dir, conversation, add_generation_prompt):
    tokenizer, template = ours(demo_dir)
    hf = hf_tokenizer(demo_dir)
    text = template.render(chat_messages(conversation), add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.encode(text, add_special_tokens=False)[0] == tokenizer.bos_token_id  # the template's one BOS, not two


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_a_llama_style_template_renders_as_transformers_does(demo_dir, tmp_path, conversation):
    template_file = tmp_path / "llama.jinja"
    template_file.write_text(LLAMA_STYLE)
    _, template = ours(demo_dir, template_file)
    hf = hf_tokenizer(demo_dir)
    expected = hf.apply_chat_template(conversation, chat_template=LLAMA_STYLE, tokenize=False,
                                      add_generation_prompt=True)
    assert template.render(chat_messages(conversation)) == expected
    assert template.source == str(template_file)


def test_a_template_that_raises_is_a_refusal_naming_its_reason(demo_dir, tmp_path):
    template_file = tmp_path / "llama.jinja"
    template_file.write_text(LLAMA_STYLE)
    _, template = ours(demo_dir, template_file)
    with pytest.raises(ChatTemplateError) as caught:
        template.render(chat_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert str(caught.value) == ("messages: the chat template refused them: Conversation roles must alternate "
                                 "user/assistant/user/assistant/...")


@pytest.mark.parametrize("body", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
])
def test_the_sandbox_keeps_a_template_from_python_internals_and_from_changing_messages(demo_dir, tmp_path, body):
    template_file = tmp_path / "evil.jinja"
    template_file.write_text(body)
    _, template = ours(demo_dir, template_file)
    messages = chat_messages([{"role": "user", "content": "hello"}])
    with pytest.raises(ChatTemplateError, match=r"^messages: the chat template refused them: "):
        template.render(messages)
    assert messages == [{"role": "user", "content": "hello"}]


def test_continue_final_message_ends_the_prompt_inside_the_last_message(demo_dir):
    _, template = ours(demo_dir)
    conversation = chat_messages([{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}])
    text = template.render(conversation, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|begin|><|user|>\nCount:<|end|>\n<|assistant|>\none, two,"
    hf = hf_tokenizer(demo_dir)
    assert text == hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)


def write_model_dir(source, target, tokenizer_config_extra=None, template_file=False):
    target.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(tokenizer_config_extra or {})
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file:
        (target / "chat_template.jinja").write_text("FROM-FILE{{ messages[0]['content'] }}")
    return target


def test_where_the_template_comes_from(demo_dir, tmp_path):
    plain = write_model_dir(demo_dir, tmp_path / "plain")
    assert ours(plain)[1] is None  # no template anywhere: completions only
    in_config = write_model_dir(demo_dir, tmp_path / "in-config", {"chat_template": "CONFIG{{ eos_token }}"})
    template = ours(in_config)[1]
    assert (template.render([{"role": "user", "content": "x"}]), template.source) == (
        "CONFIG<|end|>", "tokenizer_config.json")
    named = write_model_dir(demo_dir, tmp_path / "named", {"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]})
    assert ours(named)[1].render([{"role": "user", "content": "x"}]) == "DEFAULT"
    both = write_model_dir(demo_dir, tmp_path / "both", {"chat_template": "CONFIG"}, template_file=True)
    assert ours(both)[1].render([{"role": "user", "content": "x"}]) == "FROM-FILEx"  # the file wins
    override = tmp_path / "override.jinja"
    override.write_text("OVERRIDE")
    assert ours(both, override)[1].render([{"role": "user", "content": "x"}]) == "OVERRIDE"  # the flag wins


@pytest.mark.parametrize("config, fragment", [
    ({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]},
     "chat_template: tokenizer_config.json lists templates named 'tool_use', 'rag' but none named 'default'"),
    ({"chat_template": 3}, "chat_template: tokenizer_config.json holds a int, expected a string"),
])
def test_a_template_list_without_default_or_of_another_type_is_refused(config, fragment):
    with pytest.raises(ModelError) as caught:
        template_from_config(config)
    assert str(caught.value).startswith(fragment)


def test_a_template_that_does_not_parse_or_a_missing_file_stops_the_load(demo_dir, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ bos_token }}\n{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ModelError) as caught:
        ours(demo_dir, broken)
    assert str(caught.value).startswith(f"chat_template: {broken} does not parse: ")
    assert "(line 2)" in str(caught.value)
    with pytest.raises(ModelError, match=r"chat_template: '/nowhere/t.jinja' is not a file"):
        ours(demo_dir, "/nowhere/t.jinja")


def test_a_demo_checkpoint_built_before_chat_gets_its_template_without_a_new_tokenizer_digest(tmp_path):
    directory = ensure_demo_checkpoint(tmp_path)
    digest = Tokenizer(directory).digest
    (directory / "chat_template.jinja").unlink()
    assert ensure_demo_checkpoint(tmp_path) == directory
    assert (directory / "chat_template.jinja").read_text() == DEMO_CHAT_TEMPLATE
    assert Tokenizer(directory).digest == digest  # every cached block's key stays valid
    assert not list(directory.glob(".*.tmp"))


@pytest.mark.parametrize("messages, param, message", [
    ([], "messages", "messages: must not be empty"),
    (["hi"], "messages[0]", "messages[0]: must be an object with role and content, got str"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role",
     "messages[1].role: must be one of system, user, assistant, tool, got 'robot'"),
    ([{"role": "function", "content": "42"}], "messages[0].role",
     "messages[0].role: must be one of system, user, assistant, tool, got 'function' (role function is OpenAI's "
     "older form of tool)"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls[0].function",
     "messages[0].tool_calls[0].function: must be an object with name and arguments"),
    ([{"role": "user"}], "messages[0].content", "messages[0].content: missing"),
    ([{"role": "user", "content": 7}], "messages[0].content",
     "messages[0].content: must be a string or a list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
     "messages[0].content[1].type",
     "messages[0].content[1].type: kvd takes text parts only ({\"type\": \"text\", \"text\": ...}), got 'image_url'"),
    ([{"role": "user", "content": "a", "name": 5}], "messages[0].name", "messages[0].name: must be a string, got int"),
])
def test_bad_messages_are_named_with_what_was_found(messages, param, message):
    with pytest.raises(MessagesError) as caught:
        chat_messages(messages)
    assert (caught.value.param, str(caught.value)) == (param, message)


def test_the_developer_role_is_rendered_as_the_system_role_templates_know():
    assert chat_messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_text_parts_are_joined_and_only_role_content_and_name_reach_the_template():
    shaped = chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                             "name": "ann", "refusal": None}])
    assert shaped == [{"role": "user", "content": "a\nb", "name": "ann"}]
    assert affinity_text(shaped) == "<user>a\nb"


def test_the_example_template_renders_as_transformers_does_and_opens_every_chat_alike(demo_dir):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "chat-templates" / "dated-header.jinja"
    tokenizer, template = ours(demo_dir, example)
    hf = hf_tokenizer(demo_dir)
    for conversation in CONVERSATIONS[:3]:
        expected = hf.apply_chat_template(conversation, chat_template=example.read_text(), tokenize=False,
                                          add_generation_prompt=True)
        assert template.render(chat_messages(conversation)) == expected
    one, two = (tokenizer.encode(template.render(chat_messages(c)), add_special_tokens=False) for c in CONVERSATIONS[:2])
    assert one[:48] == two[:48]  # three blocks of 16 before any message's content: the header and the date
    with pytest.raises(ChatTemplateError, match="only the first message may be a system message"):
        template.render(chat_messages([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]))

"""A checkpoint's chat template: the Jinja text that turns chat messages into one prompt.

Where it comes from, first found wins:

1. the file the operator names (`kvd serve --chat-template FILE`, as vLLM's flag);
2. `chat_template.jinja` in the checkpoint directory (what recent `transformers` saves);
3. `tokenizer_config.json`'s `chat_template`: a string, or a list of `{name, template}` of which
   the one named `default` is used.

A checkpoint with none of these serves completions only; `/v1/chat/completions` then says so.

The template is rendered the way `transformers`' `apply_chat_template` renders it, so that a
prompt sent through kvd is the prompt the model was trained on: an immutable sandboxed Jinja
environment (a template cannot reach Python objects' internals or change the messages it is
handed), `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that keeps non-ASCII text as it is, and the globals `raise_exception(message)` and
`strftime_now(format)`. The tokenizer's special tokens (`bos_token`, `eos_token`, ...) are
passed as strings. The text is then encoded without adding a BOS: the template writes its own.

A request's `chat_template_kwargs` (vLLM's and SGLang's field: Qwen3's `enable_thinking`, say) reach
the template only where it reads them: a name the template does not read is refused with the
names it does, and no request can replace the template itself (`chat_template`, which let a caller
run a Jinja loop of its own on vLLM's and SGLang's servers: GHSA-6fvq-23cw-5628), the values kvd
passes (`messages`, `add_generation_prompt`, `tools`, the special tokens), or hand it `documents`,
which kvd does not use. A chat's `tools` are passed as `transformers` passes them (None when there
are none); a template that does not read `tools` cannot show them to the model, so a chat that
brings tools to it is refused rather than served without them. The operator's
`chat_template_kwargs` setting gives every chat defaults (vLLM's --default-chat-template-kwargs),
checked the same way when kvd starts; a request's own win, name by name, and the template's digest
names the defaults too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from .config import ModelError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# what kvd passes a template itself: a request's chat_template_kwargs cannot set these
KVD_PASSES = ("messages", "add_generation_prompt", "tools", "raise_exception", "strftime_now",
              *SPECIAL_TOKEN_FIELDS)
# what a request's chat_template_kwargs may not hand a template even where it reads them, and why
REFUSED_KWARGS = {
    "chat_template": "a request cannot replace the model's chat template (kvd serve --chat-template sets it)",
    "documents": "kvd does not take documents; put them in a message instead",
}


class ChatTemplateError(ValueError):
    """The template refused the messages (its own `raise_exception`, or an error while rendering)."""


class TemplateKwargsError(ValueError):
    """A request's chat_template_kwargs cannot be passed to the template; `param` names the key."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


def compile_template(text: str, source: str):
    """The template compiled in the sandbox; ModelError naming `source` when it does not parse."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelError(f"chat_template: {source} does not parse: {exc.message} (line {exc.lineno})") from None


def variables_read(text: str) -> frozenset[str]:
    """The names a template reads that it does not set itself (`enable_thinking`, `messages`, ...)."""
    import jinja2
    import jinja2.ext
    from jinja2 import meta

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    return frozenset(meta.find_undeclared_variables(env.parse(text)))


@dataclass(frozen=True)
class ChatTemplate:
    """One compiled chat template and where it came from."""

    text: str
    source: str  # the file (or "tokenizer_config.json") it was read from, for status and errors
    special_tokens: dict  # bos_token, eos_token, ... as strings, as the template sees them
    compiled: object = field(compare=False, repr=False)  # the jinja2 Template of `text`
    # the names a request's chat_template_kwargs may set: those the template reads, less KVD_PASSES
    # and REFUSED_KWARGS
    request_kwargs: frozenset[str] = field(default=frozenset(), compare=False)
    # the operator's chat_template_kwargs: what every render gets unless its request says otherwise
    defaults: dict = field(default_factory=dict, compare=False)
    reads_tools: bool = field(default=False, compare=False)  # the template writes a chat's tools

    @classmethod
    def compile(cls, text: str, source: str, special_tokens: dict) -> "ChatTemplate":
        """ModelError naming `source` when `text` does not parse."""
        compiled = compile_template(text, source)
        reads = variables_read(text)
        takes = reads - set(KVD_PASSES) - set(REFUSED_KWARGS)
        return cls(text, source, special_tokens, compiled, frozenset(takes), reads_tools="tools" in reads)

    def with_defaults(self, defaults: dict | None) -> "ChatTemplate":
        """This template with the operator's `chat_template_kwargs`; ModelError naming the one it
        cannot take."""
        if not defaults:
            return self
        try:
            checked = self.checked_kwargs(defaults)
        except TemplateKwargsError as exc:
            raise ModelError(f"{exc} (the setting chat_template_kwargs, for {self.source})") from None
        return replace(self, defaults=checked)

    def checked_kwargs(self, kwargs) -> dict:
        """A request's `chat_template_kwargs` (None: none) as the template will get them;
        TemplateKwargsError naming the key the template cannot take, and why."""
        import difflib

        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict):
            raise TemplateKwargsError(f"chat_template_kwargs: must be a JSON object of names the chat template "
                                      f"reads, got {type(kwargs).__name__}", "chat_template_kwargs")
        for key in kwargs:
            where = f"chat_template_kwargs.{key}"
            if key in REFUSED_KWARGS:
                raise TemplateKwargsError(f"{where}: {REFUSED_KWARGS[key]}", where)
            if key in KVD_PASSES:
                as_field = key in ("messages", "add_generation_prompt", "tools")
                field_hint = f" (send {key} as the request's field)" if as_field else ""
                raise TemplateKwargsError(f"{where}: kvd sets {key} itself{field_hint}", where)
            if key not in self.request_kwargs:
                near = difflib.get_close_matches(key, sorted(self.request_kwargs), n=1)
                takes = ", ".join(sorted(self.request_kwargs)) or "none"
                raise TemplateKwargsError(f"{where}: the model's chat template does not read {key!r}"
                                          + (f" (did you mean {near[0]!r}?)" if near else "")
                                          + f"; it reads: {takes}", where)
        return dict(kwargs)

    @property
    def digest(self) -> str:
        """SHA-256 of the template's text and the operator's defaults: two replicas whose digests
        match render alike."""
        digest = hashlib.sha256(b"kvctl/chat-template/v1\0" + self.text.encode("utf-8"))
        if self.defaults:  # they change what it renders: a router renders with them too
            digest.update(b"\0defaults\0" + json.dumps(self.defaults, sort_keys=True).encode("utf-8"))
        return digest.hexdigest()

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict | None = None,
               tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` (already checked: roles and string contents).

        `continue_final_message`: the prompt ends inside the last message (an assistant reply the
        model is to go on with) instead of after it; the text after that message's content is cut.
        `kwargs`: a request's chat_template_kwargs (TemplateKwargsError unless `checked_kwargs`
        passes them). `tools`: a chat's tools (chat_messages.checked_tools); TemplateKwargsError
        when the template does not read them."""
        import jinja2

        given = {**self.defaults, **self.checked_kwargs(kwargs)}
        if tools and not self.reads_tools:
            raise TemplateKwargsError(f"tools: the model's chat template ({self.source}) does not write tools, so "
                                      "the model could not see them; describe them in a message, or start kvd with "
                                      "a --chat-template that renders tools", "tools")
        try:
            text = self.compiled.render(**given, messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools or None, documents=None, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template refused them: {exc.message or exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            raise ChatTemplateError(f"messages: the chat template failed on them: {type(exc).__name__}: {exc}"
                                    ) from None
        if continue_final_message:
            final = messages[-1]["content"]
            end = text.rfind(final.strip()) if final.strip() else -1
            if end < 0:
                raise ChatTemplateError("continue_final_message: the chat template does not write the last "
                                        "message's content as it is, so the prompt cannot end inside it")
            text = text[:end + len(final.strip())]
        return text


def special_tokens_of(tokenizer_config: dict) -> dict:
    """The special tokens a template may name, as strings (a token given as {"content": ...} too)."""
    tokens = {}
    for name in SPECIAL_TOKEN_FIELDS:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def template_from_config(tokenizer_config: dict) -> str | None:
    """`tokenizer_config.json`'s chat_template: a string, or the `default` of a named list."""
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
        raise ModelError("chat_template: tokenizer_config.json lists templates named "
                         + ", ".join(repr(n) for n in named) + " but none named 'default'; "
                         "name one with --chat-template FILE")
    raise ModelError(f"chat_template: tokenizer_config.json holds a {type(value).__name__}, "
                     "expected a string or a list of {name, template}")


def load_chat_template(model_dir: Path, tokenizer_config: dict, override: str | Path | None = None,
                       defaults: dict | None = None) -> ChatTemplate | None:
    """The checkpoint's chat template (see the module's docstring for the order), compiled once
    here so that a template that does not parse stops kvd at start, not at the first chat; with
    the operator's `defaults` (chat_template_kwargs), checked against it."""
    template = _load_chat_template(model_dir, tokenizer_config, override)
    if template is None and defaults:
        raise ModelError("chat_template_kwargs: set, but the model has no chat template to give them to "
                         "(kvd serve --chat-template FILE gives it one)")
    return None if template is None else template.with_defaults(defaults)


def _load_chat_template(model_dir: Path, tokenizer_config: dict, override: str | Path | None) -> ChatTemplate | None:
    special = special_tokens_of(tokenizer_config)
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ModelError(f"chat_template: {str(path)!r} is not a file")
        text, source = path.read_text(encoding="utf-8"), str(path)
    elif (Path(model_dir) / TEMPLATE_FILE).is_file():
        path = Path(model_dir) / TEMPLATE_FILE
        text, source = path.read_text(encoding="utf-8"), str(path)
    else:
        text, source = template_from_config(tokenizer_config), "tokenizer_config.json"
        if text is None:
            return None
    return ChatTemplate.compile(text, source, special)

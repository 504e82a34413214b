"""Chat messages as `/v1/chat/completions` takes them: checked field by field, contents as text.

Plain Python (no pydantic, no torch): `kvctl route --messages` computes a chat's home with it as
`kvd router` does.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role: checkpoints' templates know `system`, so it is rendered so
ROLE_ALIASES = {"developer": "system"}
TOOL_NAME_MAX = 64  # OpenAI's longest function name


class MessagesError(ValueError):
    """A message is malformed; the text names it (`messages[2].role`) and what was found."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


EFFORTS = ("minimal", "low", "medium", "high")  # OpenAI's reasoning efforts


def with_reasoning_effort(kwargs: Any, effort: Any, reads: frozenset | set, param: str) -> Any:
    """A request's chat_template_kwargs (`kwargs`) with OpenAI's reasoning effort (`effort`, from the
    field `param`: a chat's `reasoning_effort`, a response's `reasoning.effort`) as `reasoning_effort`,
    for a template that reads that name (`reads`: the names it reads); MessagesError names `param`
    where the effort is not one of EFFORTS, the template would not read it, or the kwargs say another."""
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise MessagesError(f"{param}: must be one of {', '.join(EFFORTS)}, got {effort!r}", param)
    if "reasoning_effort" not in reads:
        raise MessagesError(f"{param}: the model's chat template does not read reasoning_effort, so "
                            f"{effort!r} would change nothing; leave it out", param)
    given = dict(kwargs) if isinstance(kwargs, dict) else {}
    if given.get("reasoning_effort", effort) != effort:
        raise MessagesError(f"{param}: {effort!r} differs from chat_template_kwargs.reasoning_effort "
                            f"{given['reasoning_effort']!r}; give one", param)
    return {**given, "reasoning_effort": effort}


def asked_kwargs(body: dict) -> Any:
    """A raw chat or Responses body's chat_template_kwargs with its reasoning effort folded in as
    the template reads it, unchecked (for a question about its prompt: kvd router's routing, kvctl's
    --messages; kvd checks what it renders)."""
    kwargs = body.get("chat_template_kwargs")
    reasoning = body.get("reasoning")
    effort = body.get("reasoning_effort", reasoning.get("effort") if isinstance(reasoning, dict) else None)
    if not isinstance(effort, str) or (kwargs is not None and not isinstance(kwargs, dict)):
        return kwargs
    return {"reasoning_effort": effort, **(kwargs or {})}


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = repr(kind) if kind is not None else f"a {type(part).__name__}"
                raise MessagesError(f"{where}[{j}].type: kvd takes text parts only "
                                    f"({{\"type\": \"text\", \"text\": ...}}), got {shown}", f"{where}[{j}].type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise MessagesError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}", where)


def _string_field(message: dict, key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise MessagesError(f"{where}.{key}: must be a string, got {type(value).__name__}", f"{where}.{key}")
    return value


def chat_messages(raw: list[Any]) -> list[dict]:
    """The messages as the template takes them ({role, content[, name]}, contents as text; an
    assistant's `tool_calls` with their arguments as objects, a tool's `tool_call_id`, an
    assistant's `reasoning_content` and `thinking`), or MessagesError naming the first message and field at fault."""
    if not raw:
        raise MessagesError("messages: must not be empty", "messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise MessagesError(f"{where}: must be an object with role and content, got {type(message).__name__}",
                                where)
        role = ROLE_ALIASES.get(message.get("role"), message.get("role"))
        if role not in ROLES:
            hint = " (role function is OpenAI's older form of tool)" if role == "function" else ""
            raise MessagesError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}{hint}",
                                f"{where}.role")
        if message.get("function_call") is not None:
            raise MessagesError(f"{where}.function_call: OpenAI's older form; send tool_calls",
                                f"{where}.function_call")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise MessagesError(f"{where}.tool_calls: only an assistant's message calls tools, this is {role!r}'s",
                                f"{where}.tool_calls")
        if (message.get("content") is None) and not calls:
            raise MessagesError(f"{where}.content: missing", f"{where}.content")
        content = message.get("content")
        shaped = {"role": role, "content": "" if content is None else message_text(content, f"{where}.content")}
        for key in ("name", "tool_call_id") if role == "tool" else ("name",):
            value = _string_field(message, key, where)
            if value is not None:
                shaped[key] = value
        if calls:
            shaped["tool_calls"] = tool_calls_of(calls, f"{where}.tool_calls")
        if role == "assistant":  # thinking sent back: templates that keep it read reasoning_content (Qwen3,
            # DeepSeek) or thinking (gpt-oss, whose template writes a call's back as its analysis message)
            thought = _string_field(message, "reasoning_content", where)
            thought = thought if thought is not None else _string_field(message, "reasoning", where)
            if thought is not None:
                shaped["reasoning_content"] = shaped["thinking"] = thought
        messages.append(shaped)
    return messages


def tool_calls_of(calls: Any, where: str) -> list[dict]:
    """An assistant's `tool_calls` as templates take them: each {id, type, function: {name,
    arguments}}, the arguments an object where the JSON text holds one (as `transformers` asks of
    templates; text that is not a JSON object stays text)."""
    if not isinstance(calls, list):
        raise MessagesError(f"{where}: must be a list of calls, got {type(calls).__name__}", where)
    shaped = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise MessagesError(f"{at}.function: must be an object with name and arguments", f"{at}.function")
        if call.get("type", "function") != "function":
            raise MessagesError(f"{at}.type: must be \"function\", got {call.get('type')!r}", f"{at}.type")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise MessagesError(f"{at}.function.name: must be a function's name, got {name!r}", f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, dict):
            raise MessagesError(f"{at}.function.arguments: must be JSON text, got {type(arguments).__name__}",
                                f"{at}.function.arguments")
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        call_id = _string_field(call, "id", at)
        if call_id is not None:
            entry["id"] = call_id
        shaped.append(entry)
    return shaped


def checked_tools(tools: Any) -> list[dict] | None:
    """A chat's `tools` as its template gets them (None: none, or an empty list), or
    MessagesError naming the tool and field at fault: each `{"type": "function", "function":
    {"name", "description"?, "parameters"?}}`, names unique."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise MessagesError(f"tools: must be a list of functions, got {type(tools).__name__}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            got = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise MessagesError(f"{where}.type: must be \"function\", got {got!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise MessagesError(f"{where}.function: must be an object with name, description and parameters",
                                f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= TOOL_NAME_MAX:
            raise MessagesError(f"{where}.function.name: must be a name of 1 to {TOOL_NAME_MAX} characters, got "
                                f"{name!r}", f"{where}.function.name")
        if name in seen:
            raise MessagesError(f"{where}.function.name: {name!r} names two tools", f"{where}.function.name")
        seen.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise MessagesError(f"{where}.function.description: must be a string", f"{where}.function.description")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise MessagesError(f"{where}.function.parameters: must be a JSON Schema object, got "
                                f"{type(function['parameters']).__name__}", f"{where}.function.parameters")
    return tools or None


def refuse_chat_fields_without_messages(body: Any) -> None:
    """A prompt given as text or ids has no chat template to hand `chat_template_kwargs` or `tools`
    to: MessagesError naming the field, not the field quietly ignored."""
    for name in ("chat_template_kwargs", "tools"):
        if getattr(body, name, None) is not None:
            raise MessagesError(f"{name}: only with messages (a chat's prompt)", name)


def messages_size(messages: list[dict], tools: list[dict] | None = None) -> int:
    """Characters of content in all: how much rendering and tokenizing there is to do."""
    calls = sum(len(json.dumps(m["tool_calls"])) for m in messages if "tool_calls" in m)
    return sum(len(m["content"]) for m in messages) + calls + (len(json.dumps(tools)) if tools else 0)


def affinity_text(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation's opening as one text, for where a new prefix goes home: every router
    computes it alike from the request alone, whatever template a replica renders with. Tools
    come first: templates write them at the top, and agents that share them share that prefix."""
    opening = f"<tools>{json.dumps(tools, sort_keys=True)}" if tools else ""
    return opening + "".join(f"<{m['role']}>{m['content']}" for m in messages)

"""Chat messages as `/v1/chat/completions` takes them: checked field by field, contents as text.

Plain Python (no pydantic, no torch): `kvctl route --messages` computes a chat's home with it as
`kvd router` does.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")
# OpenAI's newer name for the system role: checkpoints' templates know `system`, so it is rendered so
ROLE_ALIASES = {"developer": "system"}


class MessagesError(ValueError):
    """A message is malformed; the text names it (`messages[2].role`) and what was found."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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


def chat_messages(raw: list[Any]) -> list[dict]:
    """The messages as the template takes them ({role, content[, name]}, contents as text), or
    MessagesError naming the first message and field at fault."""
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
            hint = "; kvd does not call tools" if role in ("tool", "function") else ""
            raise MessagesError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}{hint}",
                                f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise MessagesError(f"{where}.tool_calls: kvd does not call tools", f"{where}.tool_calls")
        if "content" not in message or message["content"] is None:
            raise MessagesError(f"{where}.content: missing", f"{where}.content")
        shaped = {"role": role, "content": message_text(message["content"], f"{where}.content")}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise MessagesError(f"{where}.name: must be a string, got {type(name).__name__}", f"{where}.name")
            shaped["name"] = name
        messages.append(shaped)
    return messages


def refuse_template_kwargs_without_messages(kwargs: Any) -> None:
    """A prompt given as text or ids has no chat template to hand `chat_template_kwargs` to:
    MessagesError naming the field, not kwargs quietly ignored."""
    if kwargs is not None:
        raise MessagesError("chat_template_kwargs: only with messages (a chat's prompt)", "chat_template_kwargs")


def messages_size(messages: list[dict]) -> int:
    """Characters of content in all: how much rendering and tokenizing there is to do."""
    return sum(len(m["content"]) for m in messages)


def affinity_text(messages: list[dict]) -> str:
    """The conversation's opening as one text, for where a new prefix goes home: every router
    computes it alike from the request alone, whatever template a replica renders with."""
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)

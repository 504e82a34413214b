"""`POST /v1/chat/completions`: the request, its messages, and the shape of its answers.

The messages are checked here (roles, text contents) and rendered into one prompt by the
checkpoint's chat template (`kvctl.daemon.model.chat_template`); from there a chat request is a
completion: the same engine, prefix cache, admission and cancellation. Only the answer's shape
differs: `message` / `delta` instead of `text`, and `chat.completion[.chunk]` objects.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

ROLES = ("system", "user", "assistant")
# chat fields of OpenAI's API (and vLLM's) that kvd does not implement, with the values that ask for
# nothing; any other value is refused by name (see app.refuse_unsupported)
UNSUPPORTED_CHAT_FIELDS = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "prompt_logprobs": (None,), "best_of": (None, 1),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "response_format": (None, {"type": "text"}), "cache_salt": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None, []),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "echo": (None, False),
}
CHAT_HINTS = {
    "tools": "kvd does not call tools; describe them in a message instead",
    "chat_template": "kvd renders every conversation with the model's own template (kvd serve --chat-template "
                     "sets it for the daemon)",
}


class MessagesError(ValueError):
    """A message is malformed; the text names it (`messages[2].role`) and what was found."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any]  # checked by chat_messages, which names the message and field at fault
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    ignore_eos: bool = False
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's turn opening
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last (assistant) message

    def generation_prompt(self) -> bool:
        """add_generation_prompt as it applies: off when the prompt is to end inside the last message
        (asking for both is a contradiction, refused by name)."""
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise MessagesError("add_generation_prompt: true contradicts continue_final_message: true (the "
                                    "prompt cannot both end inside the last message and open a new one)",
                                    "add_generation_prompt")
            return False
        return self.add_generation_prompt

    def output_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: what the context has left (as vLLM)."""
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise MessagesError(f"max_completion_tokens: {self.max_completion_tokens} differs from max_tokens "
                                f"{self.max_tokens}; give one of them", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
        role = message.get("role")
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


def messages_size(messages: list[dict]) -> int:
    """Characters of content in all: how much rendering and tokenizing there is to do."""
    return sum(len(m["content"]) for m in messages)


def affinity_text(messages: list[dict]) -> str:
    """The conversation's opening as one text, for where a new prefix goes home: every router
    computes it alike from the request alone, whatever template a replica renders with."""
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


class CompletionShape:
    """The answer's shape for /v1/completions."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "token_ids": token_ids, "logprobs": None,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        return self.choice(index, text, token_ids, finish_reason)


class ChatShape(CompletionShape):
    """The answer's shape for /v1/chat/completions: the first chunk of each choice names the role."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self) -> None:
        self.opened: set[int] = set()

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "token_ids": token_ids,
                "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        if index in self.opened:
            delta = {"content": text}
        else:
            delta = {"role": "assistant", "content": text}
            self.opened.add(index)
        return {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": None,
                "finish_reason": finish_reason}

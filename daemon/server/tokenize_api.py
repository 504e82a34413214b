"""vLLM's `/tokenize` and `/detokenize`, so clients and tools written for vLLM's server count
and decode tokens against kvd unchanged.

    POST /tokenize    {"prompt": TEXT, "add_special_tokens": true}
                      or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                          "chat_template_kwargs": {...}, "tools": [...]}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [ID, ...]} -> {"prompt": TEXT}

A chat is rendered by the model's template exactly as /v1/chat/completions renders it, so
`count` is the prompt that a chat would send. Nothing is queued or cached: the tokenizer only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from kvctl.daemon.model.tokenizer import first_outside_vocab

from .chat import generation_prompt
from .chat_messages import MessagesError, chat_messages, checked_tools, refuse_chat_fields_without_messages


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # what the tokenizer adds to a prompt (a BOS, mostly), as /v1/completions does
    add_generation_prompt: bool = True  # chats: end with the assistant's turn opening
    continue_final_message: bool = False  # chats: end inside the last message
    chat_template_kwargs: Any = None  # chats: names the chat template reads, as /v1/chat/completions takes them
    tools: Any = None  # chats: the tools the template writes, as /v1/chat/completions takes them


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


def tokenize(service, body: TokenizeRequest, tenant: str | None = None) -> dict:
    """The token ids of a prompt or a chat (`tenant`'s replies as their own ids, as its chat would be
    prompted: reply_ids.py); MessagesError naming the field at fault."""
    if (body.prompt is None) == (body.messages is None):
        raise MessagesError("prompt: give a prompt (text) or messages (a chat), not both or neither", "prompt")
    if body.prompt is not None:
        refuse_chat_fields_without_messages(body)
        ids = service.loaded.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = service.chat_prompt(chat_messages(body.messages), generation_prompt(body), body.continue_final_message,
                                  body.chat_template_kwargs, checked_tools(body.tools), tenant)
    return {"count": len(ids), "max_model_len": service.require_ready().context_limit, "tokens": ids}


def detokenize(service, body: DetokenizeRequest) -> dict:
    """The text of token ids (special tokens left out, as a completion's text); MessagesError
    naming the first id outside the vocabulary."""
    vocab = service.loaded.tokenizer.vocab_size
    bad = first_outside_vocab(body.tokens, vocab)
    if bad is not None:
        raise MessagesError(f"tokens[{bad}]: must be a token id in [0, {vocab}), got {body.tokens[bad]}",
                            f"tokens[{bad}]")
    return {"prompt": service.loaded.tokenizer.decode(body.tokens)}

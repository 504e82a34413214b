"""`POST /v1/responses`: OpenAI's Responses API, served as a chat turn.

A Responses request becomes a `/v1/chat/completions` request (`chat_body`): its `input` items
become messages, `instructions` the system message, `tools` and `tool_choice` the chat's forms,
`text.format` the `response_format`, `reasoning.effort` the template's `reasoning_effort`. The
chat's answer, whole or streamed, becomes the response's output items (`OutputItems`): a
`reasoning` item for the thinking the reasoning parser set apart, a `message` for the answer, a
`function_call` for each call the tool-call parser read. So a response is served by the same
engine, prefix cache, parsers and refusals as a chat.

`previous_response_id` continues a stored response's conversation (response_store.py): its
messages, then the new input, rendered by the template as a chat client would send them all, so
the turn's prompt starts with the last one's and its blocks come from the prefix cache.

Plain Python (no torch, no FastAPI): the request's checks and the answer's shapes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import ConfigDict

from . import reasoning_blob
from .chat import Count, GenerationFields
from .chat_messages import MessagesError, with_reasoning_effort
from .list_pages import ITEMS_PAGE, input_items_page  # noqa: F401 (its routes and the conversations' page with it)
from .response_logprobs import OUTPUT_LOGPROBS, AnswerLogprobs
from .response_truncation import TRUNCATIONS
from .responses_input import checked_metadata, chat_tools, input_messages, new_id

# fields of OpenAI's Responses API that kvd does not implement, with the values that ask for nothing;
# any other value is refused by name (api_errors.refuse_unsupported)
UNSUPPORTED_RESPONSE_FIELDS = {
    "prompt": (None,),
    "context_management": (None, []),
}
RESPONSE_HINTS = {
    "prompt": "kvd keeps no prompt templates; send instructions and input",
}
# chat fields a Responses request passes on as they are (the rest are built from its own fields)
PASSED_ON = ("model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "user", "ignore_eos",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
             "priority", "return_tokens_as_token_ids", "kv_transfer_params", "parallel_tool_calls",
             "prompt_cache_retention", "prompt_cache_options", "service_tier")
CARRY_REASONING = "reasoning.encrypted_content"  # reasoning items carry their text (reasoning_blob.py)
INCLUDED = (CARRY_REASONING, OUTPUT_LOGPROBS)  # the `include` values kvd serves


class ResponsesRequest(GenerationFields):
    """A `POST /v1/responses` body. The sampling fields are the chat's (GenerationFields, kvd's
    extensions included); `input` and the tool fields are checked by `chat_body`, which names
    the item and field at fault."""

    model_config = ConfigDict(extra="allow")

    input: Any = None  # a string, or a list of items (messages, function calls and their outputs, reasoning)
    instructions: str | None = None  # the system message, first; not carried to the next turn
    max_output_tokens: Count | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None  # a conversation's id, or {"id": ...}: its items come first, and this turn's go to it
    store: bool = True
    reasoning: Any = None  # {"effort": ...}: the chat template's reasoning_effort (gpt-oss reads it)
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: Any = None
    chat_template_kwargs: Any = None  # vLLM's, as /v1/chat/completions takes them
    prompt_cache_key: str | None = None  # OpenAI's routing hint: kvd's prefix cache needs none (echoed back)
    safety_identifier: str | None = None
    background: bool = False  # run it while the client is away (response_runs.py); kept for it to fetch
    include: Any = None  # INCLUDED: reasoning items carry their text to a next turn; the answer's logprobs
    top_logprobs: Count | None = None  # with include message.output_text.logprobs: alternatives per token
    max_tool_calls: Count | None = None  # OpenAI's bound on built-in tools' calls: kvd serves none, so it holds
    truncation: Any = None  # "auto": the earliest turns of a conversation over the context go (response_truncation.py)

    def carries_reasoning(self) -> bool:
        """Whether its reasoning items are to carry their text (`include`, checked by `chat_body`)."""
        return isinstance(self.include, list) and CARRY_REASONING in self.include

    def conversation_id(self) -> str | None:
        """The id of the conversation it continues (None: none, or `conversation` is malformed)."""
        given = self.conversation.get("id") if isinstance(self.conversation, dict) else self.conversation
        return given if isinstance(given, str) and given else None

    def wants_logprobs(self) -> bool:
        """Whether its answer's text is to carry its tokens' logprobs (`include`)."""
        return isinstance(self.include, list) and OUTPUT_LOGPROBS in self.include


def chat_tool_choice(choice: Any) -> Any:
    """The Responses API's tool_choice in the chat's form ({"type": "function", "name": X} names
    a function there as {"type": "function", "function": {"name": X}})."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise MessagesError(f"tool_choice: kvd takes \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                            f"\"name\": ...}}, got {choice!r}", "tool_choice")
    return choice


def response_format(text: Any) -> Any:
    """`text.format` as the chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise MessagesError(f"text: must be an object with format, got {type(text).__name__}", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise MessagesError(f"text.verbosity: not supported by kvd, got {text['verbosity']!r}; leave it out",
                            "text.verbosity")
    shape = text.get("format")
    if shape is None:
        return None
    kind = shape.get("type") if isinstance(shape, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {key: shape[key] for key in ("name", "schema", "strict",
                                                                                      "description") if key in shape}}
    raise MessagesError(f"text.format.type: must be text, json_object or json_schema, got {kind!r}",
                        "text.format.type")


def template_kwargs(body: ResponsesRequest, reads: frozenset | set) -> dict | None:
    """The template's kwargs: the request's `chat_template_kwargs`, with `reasoning.effort` as
    `reasoning_effort` where the template reads it (`reads`: the names it reads)."""
    reasoning = body.reasoning
    if reasoning is not None and not isinstance(reasoning, dict):
        raise MessagesError(f"reasoning: must be an object with effort, got {type(reasoning).__name__}", "reasoning")
    return with_reasoning_effort(body.chat_template_kwargs, (reasoning or {}).get("effort"), reads,
                                 "reasoning.effort")


def chat_body(body: ResponsesRequest, earlier: list[dict], reads: frozenset | set) -> tuple[dict, list[dict]]:
    """The chat request this response is served as, and the conversation it continues with (the
    earlier messages and this input, without the instructions: a next turn gives its own).
    `earlier`: the previous response's conversation ([] without one); `reads`: the names the
    chat template reads. MessagesError names the field at fault."""
    if body.n != 1:
        raise MessagesError(f"n: a response is one reply, got {body.n}; send n to /v1/chat/completions", "n")
    if body.include is not None:
        if not isinstance(body.include, list):
            raise MessagesError(f"include: must be a list, got {type(body.include).__name__}", "include")
        for i, name in enumerate(body.include):
            if name not in INCLUDED:
                raise MessagesError(f"include[{i}]: kvd adds {' and '.join(INCLUDED)} to the items, got {name!r}",
                                    f"include[{i}]")
    if body.top_logprobs and not body.wants_logprobs():
        raise MessagesError(f"top_logprobs: {body.top_logprobs} gives logprobs only with include: "
                            f"[\"{OUTPUT_LOGPROBS}\"]; add it, or leave top_logprobs out", "top_logprobs")
    if body.truncation is not None and body.truncation not in TRUNCATIONS:
        raise MessagesError(f"truncation: must be {' or '.join(TRUNCATIONS)}, got {body.truncation!r}", "truncation")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise MessagesError(f"max_tool_calls: must be 1 or more, got {body.max_tool_calls}", "max_tool_calls")
    checked_metadata(body.metadata)
    if body.conversation is not None:
        if body.conversation_id() is None:
            raise MessagesError(f"conversation: must be a conversation's id or {{\"id\": ...}}, got "
                                f"{body.conversation!r}", "conversation")
    conversation = [*earlier, *input_messages(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict = {name: getattr(body, name) for name in PASSED_ON if name in body.model_fields_set}
    chat.update(messages=system + conversation, stream=body.stream, max_completion_tokens=body.max_output_tokens,
                tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
                response_format=response_format(body.text), chat_template_kwargs=template_kwargs(body, reads))
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # the last event's response carries the usage
    if body.wants_logprobs():  # every output token's, which OutputItems sorts (response_logprobs.py)
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    return chat, conversation


def usage_of(chat_usage: dict, reasoning_tokens: int) -> dict:
    """The chat's usage in the Responses API's names. `cached_tokens` is 0 where kvd does not
    report them to this caller (report_cached_tokens), as the chat's answer leaves them out."""
    details = chat_usage.get("prompt_tokens_details") or {}
    written = {k: details[k] for k in ("cache_write_tokens", "cache_write_tokens_details") if k in details}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), **written},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


class OutputItems:
    """A response's output items, built from the chat's reply piece by piece (`reasoning`,
    `content`, `call`), and the stream's events as they are (`events`, each with its
    `sequence_number`). A whole reply goes through the same steps as a streamed one, so both
    give the same items.

    `answer_logprobs` (response_logprobs.AnswerLogprobs, where the request asks for logprobs)
    sorts the reply's tokens (`tokens`); the answer's go with the message's text deltas."""

    def __init__(self, carry_reasoning: bool = False, answer_logprobs: AnswerLogprobs | None = None) -> None:
        self.carry_reasoning = carry_reasoning  # a reasoning item gets its encrypted_content as it closes
        self.answer_logprobs = answer_logprobs
        self.response: dict | None = None  # the whole Response object, once the reply has ended (its route sets it)
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.events: list[dict] = []
        self.sequence = 0

    def emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def _start(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=json.loads(json.dumps(item)))
        return item

    def _open_text(self, kind: str) -> dict:
        """The reasoning or message item being written, opened (with its one text part) if it is not."""
        item = self.open
        if item is not None and item["type"] == kind:
            return item
        if kind == "reasoning":
            fresh = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            fresh = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                     "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = self.open = self._start(fresh)
        item["content"].append(part)
        self.emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                  content_index=0, part=dict(part))
        return item

    def _text(self, kind: str, delta: str, delta_event: str) -> None:
        if not delta:
            return
        item = self._open_text(kind)
        part = item["content"][0]
        part["text"] += delta
        extra = {}
        if kind == "message":
            extra["logprobs"] = self._answer_logprobs()
            part["logprobs"] = part["logprobs"] + extra["logprobs"]  # (a new list: events hold the old)
        self.emit(delta_event, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=delta,
                  **extra)

    def _answer_logprobs(self) -> list[dict]:
        return self.answer_logprobs.take() if self.answer_logprobs is not None else []

    def tokens(self, choice: dict, finished: bool) -> None:
        """A chat choice's (or chunk's) tokens with their logprobs (`token_ids`, `logprobs.content`),
        before the text they make is fed (`finished`: the reply has ended). Nothing to do where no
        logprobs were asked for."""
        if self.answer_logprobs is not None:
            self.answer_logprobs.add(choice["token_ids"], choice["logprobs"]["content"], finished)

    def reasoning(self, delta: str) -> None:
        self._text("reasoning", delta, "response.reasoning_text.delta")

    def content(self, delta: str) -> None:
        self._text("message", delta, "response.output_text.delta")

    def call(self, call: dict) -> None:
        """One call the parser read (the chat's {id, function: {name, arguments}}), whole."""
        function = call["function"]
        item = self._start({"id": new_id("fc_"), "type": "function_call", "call_id": call["id"],
                            "name": function["name"], "arguments": "", "status": "in_progress"})
        index = len(self.items) - 1
        item["arguments"] = function["arguments"]
        self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                  delta=function["arguments"])
        self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=function["name"], arguments=function["arguments"])
        item["status"] = "completed"
        self.emit("response.output_item.done", output_index=index, item=dict(item))

    def close(self, status: str = "completed") -> None:
        """Ends the reasoning or message item being written (`status`: "incomplete" for one cut off)."""
        item, self.open = self.open, None
        if item is None:
            return
        index, part = len(self.items) - 1, item["content"][0]
        if item["type"] == "reasoning":
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"])
        else:
            part["logprobs"] = part["logprobs"] + self._answer_logprobs()  # (any the last delta did not carry)
            self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"], logprobs=list(part["logprobs"]))
        self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                  part=dict(part))
        item["status"] = status
        if item["type"] == "reasoning" and self.carry_reasoning:
            item["encrypted_content"] = reasoning_blob.encode(part["text"])
        self.emit("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))

    def finish(self, finish_reason: str | None) -> None:
        """The reply ended: the open item closes (incomplete where the reply was cut off or
        cancelled); a reply with no item at all gets an empty message."""
        if not self.items:
            self._open_text("message")
        self.close("incomplete" if finish_reason in ("length", "cancelled") else "completed")

    def assistant_turn(self) -> dict:
        """The reply as the assistant's message of the conversation a next turn continues."""
        message: dict = {"role": "assistant", "content": "".join(
            item["content"][0]["text"] for item in self.items if item["type"] == "message")}
        thought = self.reasoning_text()
        if thought:
            message["reasoning_content"] = thought
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return message

    def reasoning_text(self) -> str:
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == "reasoning")

    def feed(self, piece: dict) -> None:
        """A whole chat reply's message, or a streamed chunk's delta: its thinking, its answer,
        then its calls."""
        self.reasoning(piece.get("reasoning_content") or "")
        self.content(piece.get("content") or "")
        for call in piece.get("tool_calls") or ():
            self.call(call)


def response_object(response_id: str, body: ResponsesRequest, model: str, created_at: int, items: list[dict],
                    status: str, usage: dict | None, finish_reason: str | None = None,
                    error: dict | None = None, defaults: dict | None = None, tier: str = "auto") -> dict:
    """The Response object, as OpenAI's API and its clients shape it. `defaults`: the sampling
    values a field left out takes (the checkpoint's generation config), so that `temperature`
    and `top_p` say what the reply was drawn with; `tier`: the service tier that serves it
    (service_tiers.py; "auto" where the request named none)."""
    drawn = {name: getattr(body, name) if name in body.model_fields_set or name not in (defaults or {})
             else defaults[name] for name in ("temperature", "top_p")}
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    reasoning = body.reasoning if isinstance(body.reasoning, dict) else {}
    text_format = (body.text or {}).get("format") if isinstance(body.text, dict) else None
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "background": body.background,
            "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": model,
            "output": json.loads(json.dumps(items)),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "conversation": {"id": body.conversation_id()} if body.conversation_id() else None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": None}, "store": body.store,
            "temperature": drawn["temperature"], "text": {"format": text_format or {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0, "top_p": drawn["top_p"],
            "truncation": body.truncation or "disabled", "usage": usage,
            "user": body.user, "metadata": body.metadata or {}, "prompt_cache_key": body.prompt_cache_key,
            "prompt_cache_retention": body.prompt_cache_retention,
            "safety_identifier": body.safety_identifier, "service_tier": tier}


def without_logprobs(items: list[dict]) -> list[dict]:
    """Output items as a conversation keeps them: a message's text parts without their logprobs
    (with top_logprobs, each token's alternatives would make the conversation many times its
    text). Items with none are the same objects."""
    def plain(item: dict) -> dict:
        parts = item.get("content") if item.get("type") == "message" else None
        if not parts or not any(part.get("logprobs") for part in parts):
            return item
        return {**item, "content": [{**part, "logprobs": []} if part.get("logprobs") else part for part in parts]}
    return [plain(item) for item in items]


def status_of(finish_reason: str | None) -> str:
    return {"length": "incomplete", "cancelled": "cancelled"}.get(finish_reason, "completed")


def now() -> int:
    return int(time.time())

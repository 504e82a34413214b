"""`POST /v1/chat/completions`: the request, its messages, and the shape of its answers.

The messages are checked by `chat_messages` (roles, text contents) and rendered into one prompt by the
checkpoint's chat template (`kvctl.daemon.model.chat_template`); from there a chat request is a
completion: the same engine, prefix cache, admission and cancellation. Only the answer's shape
differs: `message` / `delta` instead of `text`, and `chat.completion[.chunk]` objects.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, FiniteFloat
from pydantic_core import PydanticCustomError

from kvctl.daemon.engine.sampling import MAX_LOGPROBS

from .chat_messages import MessagesError, message_text, with_reasoning_effort
from .logprobs import chat_logprobs, completion_logprobs
from .reasoning import ThinkSplitter, reasoning_fields, split_reply, splitter_for
from . import tool_calls

# vLLM's fields of both APIs that kvd does not do, with the values that ask for nothing (app.py's
# UNSUPPORTED_HINTS say what to send instead)
VLLM_NOT_DONE = {
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "bad_words": (None, []),
}
# chat fields of OpenAI's API (and vLLM's) that kvd does not implement, with the values that ask for
# nothing; any other value is refused by name (see api_errors.refuse_unsupported)
UNSUPPORTED_CHAT_FIELDS = {
    "best_of": (None, 1),
    "use_beam_search": (None, False), "cache_salt": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "chat_template": (None,), "documents": (None, []),
    "audio": (None,), "modalities": (None, ["text"]),
    "echo": (None, False), "add_special_tokens": (None, False), **VLLM_NOT_DONE,
    "web_search_options": (None,), "verbosity": (None, "medium"),
}
CHAT_HINTS = {
    "web_search_options": "kvd searches nothing; put what the model should read in the messages",
    "verbosity": "kvd's model writes as it writes; say how long a reply should be in the messages, or cap it with "
                 "max_completion_tokens",
    "functions": "OpenAI's older form of tools: send tools",
    "function_call": "OpenAI's older form of tool_choice: send tool_choice",
    "chat_template": "kvd renders every conversation with the model's own template (kvd serve --chat-template "
                     "sets it for the daemon)",
}


def _not_a_boolean(value: Any) -> Any:
    """JSON's true and false are not numbers (pydantic's lax mode would read them as 1 and 0):
    refused, as OpenAI refuses them."""
    if isinstance(value, bool):
        raise PydanticCustomError("number_not_boolean", "expected a number, not a boolean")
    return value


Count = Annotated[int, BeforeValidator(_not_a_boolean)]  # a whole number in a request (1.0 passes; true does not)
# a number in a request: finite (Python's json reads NaN and Infinity, which no answer could carry back)
Number = Annotated[FiniteFloat, BeforeValidator(_not_a_boolean)]


class GenerationFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: the model, sampling, stops and
    streaming. Unknown fields are kept, to be refused by name when they ask for something."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: Count = 0
    seed: Count | None = None
    n: Count = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    ignore_eos: bool = False
    # applied to the logits before a token is drawn (daemon/engine/logits.py); the defaults change nothing
    # (null, which OpenAI's clients may send, is the default)
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_p: Number | None = None
    min_tokens: Count | None = None
    logit_bias: dict[str, Number] | None = None  # token id (a JSON key, so a string) -> bias
    priority: Count | None = None  # vLLM's: with queue_order priority, lower runs first (EngineService.queue_priority)
    service_tier: Any = None  # OpenAI's: "flex" defers the request under a priority queue (service_tiers.py)
    # OpenAI's: "24h" writes the request's blocks to the persistent tiers as it finishes (Engine._retain);
    # "in_memory" (or "in-memory"), as by default, keeps them as the write policy does
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None  # OpenAI's: its ttl for the breakpoints that name none (cache_breakpoints.py)
    # vLLM's: logprobs name tokens "token_id:N", so tokens of one text (parts of a character) stay apart
    return_tokens_as_token_ids: bool | None = False
    # vLLM's: the answer names the prompt's ids too (`prompt_token_ids`: on each choice of a
    # completion, on a chat's answer; streamed, in the first chunk), the ids the model read: a
    # chat's rendered template, its replies as the ids kvd kept (reply_splice.py)
    return_token_ids: bool | None = False
    # the reply's shape (response_format.py): OpenAI's, and vLLM's guided_* and structured_outputs
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # vLLM's: a KV transfer between a prefill kvd and a decode kvd (kv_transfer.py); checked there
    kv_transfer_params: Any = None
    allowed_token_ids: list[Count] | None = None  # vLLM's: only these tokens may be drawn
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the reply stays in its text

    def sampling_controls(self) -> dict:
        """The fields above as SamplingParams takes them (null: the value that changes nothing)."""
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "min_p": self.min_p or 0.0, "min_tokens": self.min_tokens or 0, "logit_bias": self.logit_bias_pairs(),
                "allowed_token_ids": tuple(self.allowed_token_ids or ()),
                "include_stop_str_in_output": self.include_stop_str_in_output}

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; ValueError naming a key that is not a token id."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
            pairs.append((token, bias))
        return tuple(sorted(pairs))


def generation_prompt(body: BaseModel) -> bool:
    """A chat body's add_generation_prompt as it applies: off when the prompt is to end inside the
    last message (continue_final_message; asking for both is a contradiction, refused by name)."""
    if body.continue_final_message:
        if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
            raise MessagesError("add_generation_prompt: true contradicts continue_final_message: true (the "
                                "prompt cannot both end inside the last message and open a new one)",
                                "add_generation_prompt")
        return False
    return body.add_generation_prompt


class ChatCompletionRequest(GenerationFields):
    messages: list[Any]  # checked by chat_messages, which names the message and field at fault
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False  # each output token's logprob, and top_logprobs alternatives
    top_logprobs: Count | None = None
    prompt_logprobs: Count | None = None  # vLLM's: each prompt token's logprob, rank and alternatives
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's turn opening
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the last (assistant) message
    # vLLM's and SGLang's: names the chat template reads (Qwen3's enable_thinking), checked against it
    # (ChatTemplate.checked_kwargs)
    chat_template_kwargs: Any = None
    tools: Any = None  # checked by chat_messages.checked_tools, which names the tool and field at fault
    tool_choice: Any = None  # "none", "auto", "required" or a named function (tool_calls.tool_choice_mode)
    parallel_tool_calls: bool | None = None  # false: the reply's first call only
    # OpenAI's Predicted Outputs: {"type": "content", "content": TEXT or text parts}, the text the reply
    # is expected to be mostly made of (a file an edit leaves mostly as it was), drafted ahead
    prediction: Any = None
    # OpenAI's: how hard a reasoning model thinks, given to a chat template that reads reasoning_effort
    # (gpt-oss's) as that name (with_reasoning_effort)
    reasoning_effort: Any = None

    def generation_prompt(self) -> bool:
        return generation_prompt(self)

    def template_kwargs(self, reads: frozenset | set) -> dict | None:
        """The chat template's kwargs: chat_template_kwargs, with reasoning_effort where it reads it."""
        return with_reasoning_effort(self.chat_template_kwargs, self.reasoning_effort, reads, "reasoning_effort")

    def prediction_text(self) -> str | None:
        """The prediction's text (its text parts joined as a message's are), None for none;
        MessagesError naming the field at fault."""
        given = self.prediction
        if given is None:
            return None
        if not isinstance(given, dict):
            raise MessagesError(f"prediction: must be an object {{\"type\": \"content\", \"content\": ...}}, "
                                f"got {type(given).__name__}", "prediction")
        unknown = sorted(set(given) - {"type", "content"})
        if unknown:
            raise MessagesError(f"prediction.{unknown[0]}: not a field of a prediction (type, content)",
                                f"prediction.{unknown[0]}")
        if given.get("type") != "content":
            raise MessagesError(f"prediction.type: must be content, got {given.get('type')!r}", "prediction.type")
        return message_text(given.get("content"), "prediction.content")

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token when logprobs are asked for (0: the token's own only), else None."""
        if self.top_logprobs is not None and self.top_logprobs != 0 and not self.logprobs:
            raise MessagesError(f"top_logprobs: {self.top_logprobs} needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise MessagesError(f"top_logprobs: must be an integer from 0 to {MAX_LOGPROBS}, got {self.top_logprobs}",
                                "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: what the context has left (as vLLM)."""
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise MessagesError(f"max_completion_tokens: {self.max_completion_tokens} differs from max_tokens "
                                f"{self.max_tokens}; give one of them", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionShape:
    """The answer's shape for /v1/completions."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_logprobs_on = "choice"  # where vLLM puts prompt_logprobs in this API's answers

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "token_ids": token_ids, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
        return self.choice(index, text, token_ids, finish_reason, logprobs)

    def logprobs(self, names, token_ids: list[int], entries: list, offset: int = 0) -> tuple[dict, int]:
        """These tokens' logprobs in this API's shape (named by `names`, a logprobs.TokenNames), and
        the text offset after them."""
        return completion_logprobs(names, token_ids, entries, offset)


class ChatShape(CompletionShape):
    """The answer's shape for /v1/chat/completions: the first chunk of each choice names the role."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_logprobs_on = "answer"

    def __init__(self, reasoning_parser: str = "none", tool_call_parser: str = "none",
                 parallel_tool_calls: bool = True) -> None:
        self.opened: set[int] = set()
        self.reasoning_parser = reasoning_parser  # reasoning.py: where thinking goes apart from the answer
        self.splitters: dict[int, ThinkSplitter] = {}
        # tool_calls.py: the answer's calls as tool_calls ("none": not parsed, as with tool_choice none)
        self.tool_call_parser = tool_call_parser
        self.parallel_tool_calls = parallel_tool_calls
        self.tool_splitters: dict = {}  # choice index -> its tool_calls.splitter_for

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
        message, calls = {"role": "assistant", "content": text}, []
        if self.tool_call_parser == "openai":  # harmony: calls are read with the channels
            reasoning, message["content"], calls = tool_calls.split_harmony(text, self.parallel_tool_calls)
            message.update(reasoning_fields(reasoning))
        else:
            if self.reasoning_parser != "none":
                reasoning, message["content"] = split_reply(text, self.reasoning_parser)
                message.update(reasoning_fields(reasoning))
            if self.tool_call_parser != "none":
                message["content"], calls = tool_calls.split_tool_calls(message["content"], self.parallel_tool_calls,
                                                                        self.tool_call_parser)
        if calls:
            message["tool_calls"] = calls
            finish_reason = called_finish(finish_reason)
        return {"index": index, "message": message, "token_ids": token_ids, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
        delta = {"content": text} if index in self.opened else {"role": "assistant", "content": text}
        self.opened.add(index)
        if self.reasoning_parser != "none":
            splitter = self.splitters.get(index)
            if splitter is None:
                splitter = self.splitters[index] = splitter_for(self.reasoning_parser,
                                                                calls=self.tool_call_parser == "openai")
            reasoning, delta["content"] = splitter.feed(text)
            if finish_reason is not None:
                more_reasoning, more_answer = splitter.close()
                reasoning, delta["content"] = reasoning + more_reasoning, delta["content"] + more_answer
            if reasoning:
                delta.update(reasoning_fields(reasoning))
        if self.tool_call_parser != "none":
            tools = self.tool_splitters.get(index)
            if tools is None:
                tools = self.tool_splitters[index] = (
                    tool_calls.HarmonyCallSplitter(self.splitters[index], self.parallel_tool_calls)
                    if self.tool_call_parser == "openai"  # the calls the harmony splitter set apart
                    else tool_calls.splitter_for(self.tool_call_parser, self.parallel_tool_calls))
            delta["content"], calls = tools.feed(delta["content"])
            if finish_reason is not None:
                more_content, more_calls = tools.close()
                delta["content"], calls = delta["content"] + more_content, calls + more_calls
                finish_reason = called_finish(finish_reason) if tools.calls else finish_reason
            if calls:
                delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def logprobs(self, names, token_ids: list[int], entries: list, offset: int = 0) -> tuple[dict, int]:
        return chat_logprobs(names, token_ids, entries), offset


def called_finish(finish_reason: str | None) -> str | None:
    """A reply that ended by itself after calling tools finished for "tool_calls" (OpenAI's reason);
    one cut off (length) says so."""
    return "tool_calls" if finish_reason == "stop" else finish_reason

"""What the router reads of a request to weigh it: its prompt as a question for the replicas.

A question is what `/admin/route-facts` takes: `{"text": ...}`, `{"tokens": [...]}`, or, for a
chat, `{"messages": [...]}` (checked, contents as text, with the request's `chat_template_kwargs`
and `tools` where it has them), which a replica renders with its own chat template. The events view renders a
chat itself with the template the replica serves (fetched once, by digest, with its tokenizer) and
hashes the ids, as it does a completion's text.
"""

from __future__ import annotations

from kvctl.daemon.model.chat_template import ChatTemplate, ChatTemplateError, TemplateKwargsError
from kvctl.daemon.model.tokenizer import Tokenizer
from kvctl.policies.routing import key_affinity, prompt_affinity

from .chat_messages import MessagesError, affinity_text, asked_kwargs, chat_messages, checked_tools, messages_size
from .reply_splice import IdsFor, spliced_prompt
from .responses_input import chat_fields


def question_of(body: dict) -> dict | None:
    """The question for the request's (first) prompt, with the model it names (a LoRA adapter's
    blocks are its own), the priority it defers itself by (vLLM's `priority`, above 0) and its
    `service_tier` where it asks "flex" (a replica whose queue goes by priority defers it further:
    service_tiers.py); None when it has none the router can read (the replica then says what is
    wrong with it)."""
    question = prompt_question(body)
    if question is not None and isinstance(body.get("model"), str):
        question["model"] = body["model"]
    priority = body.get("priority")
    if question is not None and isinstance(priority, int) and not isinstance(priority, bool) and priority > 0:
        question["priority"] = priority  # a request that defers itself waits behind more under a priority queue
    if question is not None and body.get("service_tier") == "flex":  # (any other tier is served as default)
        question["service_tier"] = "flex"
    key = body.get("prompt_cache_key")  # OpenAI's: the client's grouping of prompts that share a prefix
    if question is not None and isinstance(key, str) and key:
        question["cache_key"] = key
    return question


def prompt_question(body: dict) -> dict | None:
    """The question for the request's (first) prompt, as `question_of` asks it, less the model.
    A Responses request is asked as the chat it is served as (its own input: a response that
    continues another goes where that one was answered, RouterService.previous_home)."""
    if "input" in body and "messages" not in body and "prompt" not in body:
        try:
            body = chat_fields(body) | {k: body[k] for k in ("chat_template_kwargs", "reasoning") if k in body}
        except MessagesError:
            return None
    if "messages" in body and "prompt" not in body:
        try:
            question = {"messages": chat_messages(body["messages"] if isinstance(body["messages"], list) else [])}
            tools = checked_tools(body.get("tools"))
        except MessagesError:
            return None
        kwargs = asked_kwargs(body)  # (with the request's reasoning effort, as the replica renders it)
        if kwargs is not None:
            question["chat_template_kwargs"] = kwargs
        if tools:
            question["tools"] = tools
        return question
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"tokens": prompt}
    return None


def computes_whole_prompt(body: dict) -> bool:
    """The request scores its prompt (vLLM's `prompt_logprobs`, or `echo` with `logprobs`): the
    replica computes every prompt position whatever it caches, so no cache draws it anywhere."""
    return body.get("prompt_logprobs") is not None or (bool(body.get("echo")) and body.get("logprobs") is not None)


def question_size(question: dict | None) -> int:
    """Characters or token ids to tokenize and hash: a large one is weighed off the event loop."""
    if question is None:
        return 0
    if "messages" in question:
        return messages_size(question["messages"], question.get("tools"))
    return len(question["text"] if "text" in question else question["tokens"])


def affinity_of(question: dict | None) -> bytes | None:
    """The `prompt_affinity` of a request's question (`question_of`): where a new prefix goes
    home. A chat's comes from its messages as they are, so every router agrees whatever template
    a replica renders with. A request that names a `prompt_cache_key` goes home by it instead
    (`key_affinity`)."""
    if question is None:
        return None
    if "cache_key" in question:
        return key_affinity(question["cache_key"])
    if "messages" in question:
        return prompt_affinity(affinity_text(question["messages"], question.get("tools")))
    return prompt_affinity(question["text"] if "text" in question else question["tokens"])


def local_ids(question: dict, tokenizer: Tokenizer, template: ChatTemplate | None,
              reply_ids: IdsFor | None = None) -> list[int]:
    """The question's token ids as the replica will see them ([] for a chat its template refuses,
    or when it has no template: the replica says why when the request reaches it). `reply_ids`:
    the ids of the replies the replica keeps, by their text (router_replies.py), which a chat's
    prompt takes as the replica splices them (reply_splice.py)."""
    if "tokens" in question:
        return question["tokens"]
    if "text" in question:
        return tokenizer.encode(question["text"])
    if template is None:
        return []

    def render(messages: list[dict]) -> str:
        return template.render(messages, kwargs=question.get("chat_template_kwargs"), tools=question.get("tools"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        if reply_ids is None:
            return encode(render(question["messages"]))
        return spliced_prompt(question["messages"], render, encode, reply_ids)[0]
    except (ChatTemplateError, TemplateKwargsError):
        return []

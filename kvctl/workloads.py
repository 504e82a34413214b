"""Benchmark workloads as token-id requests (no tokenizer, no torch), or as chats.

    shared-prefix  G groups; each a system prompt of S tokens and Q questions of U tokens
    multi-turn     C conversations of T turns; each turn's prompt is the previous prompt, a
                   reply and a new user message, sent after the previous turn finishes

As chats (`chat=True`, for /v1/chat/completions), each part is a message of text instead: the
system prompt, the questions and user messages, the replies as the assistant's. A part of N
tokens becomes N characters of lowercase words (`as_text`): N tokens on a byte-level tokenizer
like the demo checkpoint's, fewer on a BPE one. The chat template adds its own tokens.
    trace:FILE     a Mooncake trace: arrivals from timestamps (x time_scale); each hash id's
                   block gets tokens from a generator seeded by the id, so equal ids give
                   equal tokens (block_tokens tokens per 512-token block, to shrink for CPUs)
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    arrival: float | None = None  # seconds after the start; None: as soon as a slot is free
    after: int | None = None  # index of a request that must finish first (a previous turn)
    group: str = ""  # shared-prefix group or conversation, for reports
    messages: list[dict] | None = None  # a chat's messages (then `prompt` is empty: the server renders them)
    said: list[int] | None = None  # a later turn's own new tokens (its user message), after the reply it follows


def as_text(ids: list[int]) -> str:
    """Token ids as as many characters of lowercase words: a space after every sixth letter."""
    return "".join(" " if i % 7 == 6 else chr(97 + t % 26) for i, t in enumerate(ids))


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def shared_prefix(*, groups: int = 4, system_tokens: int = 256, questions: int = 8, question_tokens: int = 32,
                  max_tokens: int = 32, vocab: int = 256, seed: int = 0, chat: bool = False) -> list[BenchRequest]:
    """Question-major order: the first request of each group is cold, the rest reuse its prefix."""
    systems = [_tokens(random.Random(f"{seed}/system/{g}"), system_tokens, vocab) for g in range(groups)]
    out = []
    for q in range(questions):
        for g in range(groups):
            question = _tokens(random.Random(f"{seed}/question/{g}/{q}"), question_tokens, vocab)
            if chat:
                out.append(BenchRequest([], max_tokens, group=f"group-{g}", messages=[
                    {"role": "system", "content": as_text(systems[g])}, {"role": "user", "content": as_text(question)}]))
            else:
                out.append(BenchRequest(systems[g] + question, max_tokens, group=f"group-{g}"))
    return out


def multi_turn(*, conversations: int = 4, turns: int = 4, user_tokens: int = 48, reply_tokens: int = 32,
               max_tokens: int = 32, vocab: int = 256, seed: int = 0, chat: bool = False) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for c in range(conversations):
        rng = random.Random(f"{seed}/conversation/{c}")
        context: list[int] = []
        messages: list[dict] = []
        previous = None
        for t in range(turns):
            if t:
                reply = _tokens(rng, reply_tokens, vocab)  # the assistant's last reply
                context = context + reply
                messages = messages + [{"role": "assistant", "content": as_text(reply)}]
            user = _tokens(rng, user_tokens, vocab)
            context = context + user
            messages = messages + [{"role": "user", "content": as_text(user)}]
            out.append(BenchRequest([] if chat else list(context), max_tokens, after=previous,
                                    group=f"conversation-{c}", messages=list(messages) if chat else None,
                                    said=None if chat or not t else user))
            previous = len(out) - 1
    return out


def hash_block_tokens(hash_id: int, count: int, vocab: int) -> list[int]:
    """Tokens of one trace block: a generator seeded by the hash id (stable across processes)."""
    return _tokens(random.Random(hash_id), count, vocab)


def from_trace(path: str, *, time_scale: float = 1.0, limit: int | None = None, block_tokens: int = 512,
               max_tokens: int | None = None, vocab: int = 256) -> list[BenchRequest]:
    from kvctl.daemon.replay.trace import TRACE_BLOCK_TOKENS, read_trace

    if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
        raise ValueError(f"block_tokens: must be in [1, {TRACE_BLOCK_TOKENS}], got {block_tokens}")
    out = []
    for request in read_trace(path, limit):
        length = -(-request.input_length * block_tokens // TRACE_BLOCK_TOKENS)
        per_id = max(1, request.block_tokens * block_tokens // TRACE_BLOCK_TOKENS)  # a finer trace's ids: fewer
        prompt: list[int] = []
        for hash_id in request.hash_ids:
            prompt += hash_block_tokens(hash_id, per_id, vocab)
        output = max(1, request.output_length if max_tokens is None else min(request.output_length, max_tokens))
        out.append(BenchRequest(prompt[:length], output, arrival=request.timestamp_ms / 1000.0 * time_scale,
                                group="trace"))
    return out

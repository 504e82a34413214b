"""A reasoning model's thinking, apart from its answer: what it writes between `<think>` and
`</think>` goes to the message's `reasoning` (vLLM's field, and `reasoning_content` beside it, the
name DeepSeek gave it and many clients read), the rest to `content`.

`reasoning_parser` (vLLM's `--reasoning-parser` names):
- `qwen3`: thinking is what the reply opens with `<think>` (Qwen3 writes the tag itself; with
  `enable_thinking: false` the template closes an empty block and the reply is all answer);
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply starts inside it
  (DeepSeek-R1 and its distills) and everything before `</think>` is thinking;
- `none`: the reply as written, tags and all, in `content`.

A reply cut off before `</think>` (max_tokens) is all thinking, whole or streamed alike. Streamed,
a tag split across two deltas is held back until it is whole, so no client sees half of one.
"""

from __future__ import annotations

from dataclasses import replace

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkSplitter:
    """One reply's text, fed as it comes, split into (reasoning, answer) pieces."""

    def __init__(self, starts_inside: bool) -> None:
        self.state = "thinking" if starts_inside else "opening"  # opening -> thinking -> answer
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that can be given out now."""
        self.pending += text
        reasoning = answer = ""
        if self.state == "opening":
            start = self.pending.lstrip()
            if start.startswith(OPEN):
                self.pending, self.state = start[len(OPEN):], "thinking"
            elif OPEN.startswith(start):
                return "", ""  # perhaps the tag, not yet whole (or only whitespace so far)
            else:
                self.state = "answer"
        if self.state == "thinking":
            end = self.pending.find(CLOSE)
            if end < 0:
                given = len(self.pending) - held_back(self.pending, CLOSE)
                reasoning, self.pending = self.pending[:given], self.pending[given:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:end], self.pending[end + len(CLOSE):], "answer"
        answer, self.pending = self.pending, ""
        return reasoning, answer

    def close(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        rest, self.pending = self.pending, ""
        if self.state == "opening":  # whitespace, or the opening tag's first characters: an answer
            return "", rest
        return (rest, "") if self.state == "thinking" else ("", rest)


def splitter_for(parser: str) -> ThinkSplitter:
    """A reply's splitter under `parser` (qwen3 or deepseek_r1)."""
    return ThinkSplitter(starts_inside=parser == "deepseek_r1")


def split_reply(text: str, parser: str) -> tuple[str | None, str]:
    """A whole reply as (reasoning or None, answer) under `parser`."""
    if parser == "none":
        return None, text
    splitter = splitter_for(parser)
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.close()
    return (reasoning + more_reasoning) or None, answer + more_answer


def reasoning_fields(reasoning: str | None) -> dict:
    """The message's (or delta's) reasoning under both names clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def answer_only(constraint, parser: str):
    """A reply's shape (structured.Constraint) held to its answer under `parser`: the model thinks
    freely first, as vLLM's reasoning-aware structured outputs let it."""
    if constraint is None or parser == "none":
        return constraint
    return replace(constraint, after=CLOSE, opens=None if parser == "deepseek_r1" else OPEN)

"""A reasoning model's thinking, apart from its answer: what it writes between `<think>` and
`</think>` goes to the message's `reasoning` (vLLM's field, and `reasoning_content` beside it, the
name DeepSeek gave it and many clients read), the rest to `content`.

`reasoning_parser` (vLLM's `--reasoning-parser` names):
- `qwen3`: thinking is what the reply opens with `<think>` (Qwen3 writes the tag itself; with
  `enable_thinking: false` the template closes an empty block and the reply is all answer);
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply starts inside it
  (DeepSeek-R1 and its distills) and everything before `</think>` is thinking;
- `openai_gptoss`: gpt-oss's harmony format, where a reply is messages on channels:
  `<|channel|>analysis<|message|>` thinking `<|end|>`, then `<|start|>assistant<|channel|>final<|message|>`
  the answer. The `analysis` channel's text is thinking; every other message's text (`final`, and
  `commentary`, which this parser does not read as tool calls) is the answer; the markers and
  headers are neither. Decoded text keeps those special tokens for it (`MARKERS`);
- `none`: the reply as written, tags and all, in `content`.

A reply cut off before `</think>` (max_tokens) is all thinking, whole or streamed alike. Streamed,
a tag split across two deltas is held back until it is whole, so no client sees half of one.
"""

from __future__ import annotations

from dataclasses import replace

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1", "openai_gptoss")
OPEN, CLOSE = "<think>", "</think>"
# gpt-oss's harmony format: where a message starts, names its channel, begins its text, and ends
HARMONY = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_ANSWER = "<|channel|>final<|message|>"  # what the answer's text follows
# special tokens a parser reads in the reply's text: kvd's decoded text keeps them (Tokenizer.keep_in_text)
MARKERS = {"openai_gptoss": HARMONY}


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


class HarmonySplitter:
    """One harmony reply's text (gpt-oss), fed as it comes, split into (reasoning, answer) pieces:
    each message's text goes by its channel, `analysis` to reasoning and any other to the answer;
    markers and headers (role, channel, recipient, `<|constrain|>` format) to neither. Text before
    any marker is answer. A marker split across two feeds is held back until it is whole."""

    def __init__(self) -> None:
        self.state = "text"  # text (a message's), header (after <|start|> or <|channel|>), between (after an end)
        self.channel: str | None = None
        self.header = ""
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that can be given out now."""
        self.pending += text
        reasoning, answer = [], []
        while self.pending:
            found = [(at, marker) for marker in HARMONY if (at := self.pending.find(marker)) >= 0]
            if not found:  # give out what cannot begin a marker
                keep = max(held_back(self.pending, marker) for marker in HARMONY)
                self._take(self.pending[:len(self.pending) - keep], reasoning, answer)
                self.pending = self.pending[len(self.pending) - keep:]
                break
            at, marker = min(found)
            self._take(self.pending[:at], reasoning, answer)
            self.pending = self.pending[at + len(marker):]
            self._mark(marker)
        return "".join(reasoning), "".join(answer)

    def close(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        reasoning, answer = [], []
        self._take(self.pending, reasoning, answer)
        self.pending = ""
        return "".join(reasoning), "".join(answer)

    def _take(self, text: str, reasoning: list, answer: list) -> None:
        if self.state == "text":
            (reasoning if self.channel == "analysis" else answer).append(text)
        elif self.state == "header":
            self.header += text

    def _mark(self, marker: str) -> None:
        if marker in ("<|start|>", "<|channel|>"):  # a header follows: the role, or the channel and recipient
            self.state, self.header = "header", ""
            if marker == "<|start|>":
                self.channel = None
            else:
                self.channel = ""  # named by the header's first word, at <|message|>
        elif marker == "<|constrain|>":
            self.header += " "
        elif marker == "<|message|>":
            if self.channel == "":
                self.channel = (self.header.split() or [""])[0]
            self.state = "text"
        else:  # <|end|>, <|return|>, <|call|>: the message is over
            self.state, self.channel = "between", None


def splitter_for(parser: str) -> ThinkSplitter | HarmonySplitter:
    """A reply's splitter under `parser` (qwen3, deepseek_r1 or openai_gptoss)."""
    if parser == "openai_gptoss":
        return HarmonySplitter()
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
    if parser == "openai_gptoss":  # the answer is the final channel's message
        return replace(constraint, after=HARMONY_ANSWER, opens=None)
    return replace(constraint, after=CLOSE, opens=None if parser == "deepseek_r1" else OPEN)

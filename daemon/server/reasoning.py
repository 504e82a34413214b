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
  `commentary`) is the answer; the markers and headers are neither. Decoded text keeps those
  special tokens for it (`MARKERS`). With `--tool-call-parser openai` a message to a function
  (`to=functions.NAME`, in its channel's header or its role's) is a call, not answer text
  (`HarmonySplitter(calls=True)`);
- `none`: the reply as written, tags and all, in `content`.

A reply cut off before `</think>` (max_tokens) is all thinking, whole or streamed alike. Streamed,
a tag split across two deltas is held back until it is whole, so no client sees half of one.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1", "openai_gptoss")
OPEN, CLOSE = "<think>", "</think>"
# gpt-oss's harmony format: where a message starts, names its channel, begins its text, and ends
HARMONY = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_ANSWER = "<|channel|>final<|message|>"  # what the answer's text follows
RECIPIENT = re.compile(r"to=(\S+)")  # a harmony header's recipient: `to=functions.get_weather`
FUNCTIONS = "functions."  # a recipient that is one of the request's tools (others are built-in tools)
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
    markers and headers (role, channel, recipient, `<|constrain|>` format) to neither. The reply
    begins in its role's header (the prompt ends `<|start|>assistant`): text there that names a
    recipient (` to=functions.x`) is header, any other text before a marker is answer. A marker
    split across two feeds is held back until it is whole.

    `calls`: a message to a function (`to=functions.NAME`) is held until it ends (`<|call|>`, any
    end, the next message's marker, or the reply's end) and, where its text is a JSON object, set
    apart as a call {name, arguments (JSON text)}, taken with `take_calls`; text that is no such
    object is answer, so nothing the model wrote is lost."""

    def __init__(self, calls: bool = False) -> None:
        self.reads_calls = calls
        self.state = "opening"  # opening -> text (a message's) | header (after <|start|>, <|channel|>) | call | between
        self.channel: str | None = None
        self.recipient: str | None = None  # the message's, from its role's header or its channel's
        self.header = ""
        self.pending = ""
        self.body = ""  # a call's text, held until its message ends
        self.calls: list[dict] = []  # calls whose messages have ended, not yet taken
        self.first_header = False  # the reply opened in its role's header and no marker has come yet

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that can be given out now."""
        self.pending += text
        reasoning, answer = [], []
        if self.state == "opening":
            start = self.pending.lstrip()
            if len(start) < len("to=") and "to=".startswith(start):
                return "", ""  # whitespace, or what may begin a recipient: held
            self.state = "header" if start.startswith("to=") else "text"
            self.first_header = self.state == "header"
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
            self._mark(marker, answer)
        return "".join(reasoning), "".join(answer)

    def close(self) -> tuple[str, str]:
        """What was held back, once the reply has ended (a call's message ends with it)."""
        reasoning, answer = [], []
        if self.state == "opening" or self.first_header:
            answer.append(self.header + self.pending)  # no marker came: what looked like a header is text
        else:
            self._take(self.pending, reasoning, answer)
            if self.state == "call":
                self._end_call(answer)
        self.pending = self.header = ""
        return "".join(reasoning), "".join(answer)

    def take_calls(self) -> list[dict]:
        """The calls whose messages have ended since the last take."""
        calls, self.calls = self.calls, []
        return calls

    def _take(self, text: str, reasoning: list, answer: list) -> None:
        if self.state == "text":
            (reasoning if self.channel == "analysis" else answer).append(text)
        elif self.state == "header":
            self.header += text
        elif self.state == "call":
            self.body += text

    def _mark(self, marker: str, answer: list) -> None:
        self.first_header = False
        if self.state == "call":  # any marker ends a call's message
            self._end_call(answer)
        if self.state == "header" and marker != "<|start|>":  # the role's header: its recipient, if any
            self._read_recipient()
        if marker in ("<|start|>", "<|channel|>"):  # a header follows: the role, or the channel and recipient
            if marker == "<|start|>" or self.state != "header":
                self.recipient = None  # a new message (after <|channel|>: one with no role header)
            self.state, self.header = "header", ""
            self.channel = None if marker == "<|start|>" else ""  # named by the header's first word, at <|message|>
        elif marker == "<|constrain|>":
            self.header += " "
        elif marker == "<|message|>":
            if self.channel == "":
                self.channel = next((word for word in self.header.split() if not word.startswith("to=")), "")
            self._read_recipient()
            calling = self.reads_calls and (self.recipient or "").startswith(FUNCTIONS)
            self.state, self.body = ("call" if calling else "text"), ""
        else:  # <|end|>, <|return|>, <|call|>: the message is over
            self.state, self.channel, self.recipient = "between", None, None

    def _read_recipient(self) -> None:
        found = RECIPIENT.search(self.header)
        if found:
            self.recipient = found.group(1)

    def _end_call(self, answer: list) -> None:
        """A call's message has ended: its call, or (not a JSON object) its text as answer."""
        try:
            arguments = json.loads(self.body)
        except (ValueError, RecursionError):
            arguments = None
        name = (self.recipient or "")[len(FUNCTIONS):]
        if isinstance(arguments, dict) and name:
            self.calls.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
        else:
            answer.append(self.body)
        self.state, self.body, self.channel, self.recipient = "between", "", None, None


def splitter_for(parser: str, calls: bool = False) -> ThinkSplitter | HarmonySplitter:
    """A reply's splitter under `parser` (qwen3, deepseek_r1 or openai_gptoss; `calls`: harmony's
    calls set apart, for --tool-call-parser openai)."""
    if parser == "openai_gptoss":
        return HarmonySplitter(calls)
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
    if constraint is None or parser == "none" or constraint.after is not None:
        return constraint  # (a shape that says where it starts already: a forced call's under harmony)
    if parser == "openai_gptoss":  # the answer is the final channel's message
        return replace(constraint, after=HARMONY_ANSWER, opens=None)
    return replace(constraint, after=CLOSE, opens=None if parser == "deepseek_r1" else OPEN)

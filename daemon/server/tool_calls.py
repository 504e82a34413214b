"""Tool calls in a chat reply: what the model writes to call a function, as OpenAI's `tool_calls`.

`tool_call_parser` (vLLM's `--tool-call-parser` names):
- `hermes`: a call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>` (the format of Hermes 2 Pro, Qwen2.5 and Qwen3, whose chat templates ask for it);
  several blocks are several calls;
- `none`: kvd parses no calls; a chat may still show the model its tools with `tool_choice: "none"`.

A call's `arguments` are given out as JSON text, as OpenAI gives them. A block that is not such an
object (JSON cut off by max_tokens, say) is no call: it stays in `content`, tags and all, so
nothing the model wrote is lost; so is the text around the calls, less the whitespace that only
separates them from it ("Checking.\n<call>\nDone." is "Checking.\nDone."). A reply with no call is
its content exactly as written.

Streamed, the text before a block goes out as it comes; a block is held until it closes and then
goes out whole, as one `tool_calls` delta (OpenAI's clients join a call's deltas by `index`, and
one delta is a whole call); a tag split across deltas is held back until it is whole. Whole and
streamed replies split alike: a whole reply is one delta.
"""

from __future__ import annotations

import json
import secrets

from .chat_messages import MessagesError

TOOL_CALL_PARSERS = ("none", "hermes")
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def tool_choice_mode(tool_choice, tools: list[dict] | None, parser: str) -> str:
    """`tool_choice` as kvd honours it: "auto" (calls in the reply become `tool_calls`) or "none"
    (the model sees the tools, if any, and its reply is text); MessagesError naming the field for
    what kvd cannot honour."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if forced:
        named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) \
            and isinstance(tool_choice.get("function"), dict) else None
        wanted = f"a call of {named!r}" if isinstance(named, str) else "a call"
        raise MessagesError(f"tool_choice: {tool_choice!r} is not supported: kvd does not constrain decoding, so it "
                            f"cannot force {wanted}; send \"auto\" (the model chooses) or \"none\"", "tool_choice")
    if tool_choice != "auto":
        raise MessagesError(f"tool_choice: must be \"none\" or \"auto\", got {tool_choice!r}", "tool_choice")
    if not tools:
        raise MessagesError("tool_choice: \"auto\" needs tools to choose from", "tool_choice")
    if parser == "none":
        raise MessagesError("tools: kvd parses no tool calls here (start it with --tool-call-parser hermes); send "
                            "tool_choice: \"none\" to show the model the tools without calls", "tools")
    return "auto"


def parse_call(body: str) -> dict | None:
    """One block's call as {name, arguments (JSON text)}, or None when it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        return None
    return {"name": call["name"], "arguments": arguments}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallSplitter:
    """One reply's answer text, fed as it comes, split into content and calls (hermes blocks).

    `parallel`: False keeps only the first call (OpenAI's `parallel_tool_calls: false`)."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.pending = ""  # text not yet given out: a block's body, or what may begin a tag
        self.inside = False
        self.space = ""  # whitespace after the content given out: kept back until text follows it
        self.after_call = False  # whitespace right after a call only separates it from what follows
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content that can be given out now, and the calls whose blocks have closed (each
        {index, id, type, function: {name, arguments}})."""
        self.pending += text
        content, calls = "", []
        while True:
            if not self.inside:
                start = self.pending.find(OPEN)
                if start < 0:
                    given = len(self.pending) - held_back(self.pending, OPEN)
                    content += self._outside(self.pending[:given])
                    self.pending = self.pending[given:]
                    return content, calls
                content += self._outside(self.pending[:start])
                self.pending, self.inside = self.pending[start + len(OPEN):], True
            end = self.pending.find(CLOSE)
            if end < 0:
                return content, calls
            body, self.pending, self.inside = self.pending[:end], self.pending[end + len(CLOSE):], False
            call = parse_call(body)
            if call is None:  # not a call: text, as written
                content += self._outside(OPEN + body + CLOSE)
                continue
            # whitespace after a call only separates it; the whitespace before it separates the text
            # around it, if text follows (else close drops it)
            self.after_call = True
            if self.parallel or self.calls == 0:
                calls.append({"index": self.calls, "id": new_call_id(), "type": "function", "function": call})
                self.calls += 1

    def close(self) -> str:
        """The content held back, once the reply has ended (an unclosed block is text)."""
        rest = (OPEN if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        content = self._outside(rest)
        if not self.calls:  # no call: the reply as written, whitespace and all
            content += self.space
        self.space = ""
        return content

    def _outside(self, text: str) -> str:
        """Text outside blocks as it can be given out: trailing whitespace kept back."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.space + text
        kept = text.rstrip()
        self.space = text[len(kept):]
        return kept


def split_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """A whole reply's answer as (content, or None when there are calls and nothing else, calls
    without their stream `index`)."""
    splitter = ToolCallSplitter(parallel)
    content, calls = splitter.feed(text)
    content += splitter.close()
    return (None if calls and not content else content), [
        {key: value for key, value in call.items() if key != "index"} for call in calls]

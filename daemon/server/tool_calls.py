"""Tool calls in a chat reply: what the model writes to call a function, as OpenAI's `tool_calls`.

`tool_call_parser` (vLLM's `--tool-call-parser` names):
- `hermes`: a call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>` (the format of Hermes 2 Pro, Qwen2.5 and Qwen3, whose chat templates ask for it);
  several blocks are several calls;
- `llama3_json`: a reply that is JSON, `{"name": ..., "parameters": {...}}` (several separated by
  `;`), after Llama 3.1's `<|python_tag|>` where it is decoded, is its calls (the format Llama 3.1,
  3.2 and 3.3's templates ask for); a reply that opens otherwise, or is not such JSON, is text;
- `none`: kvd parses no calls; a chat may still show the model its tools with `tool_choice: "none"`.

`tool_choice` "auto" (the model chooses) and "none" leave the reply to the model; "required" and a
named function (`{"type": "function", "function": {"name": ...}}`) hold it to calls in the
parser's format (`forced_calls`: a grammar of the tools' parameter schemas, followed as structured
outputs are), so the model calls a tool, with arguments its schema accepts.

A call's `arguments` are given out as JSON text, as OpenAI gives them. A block that is not such an
object (JSON cut off by max_tokens, say) is no call: it stays in `content`, tags and all, so
nothing the model wrote is lost; so is the text around the calls, less the whitespace that only
separates them from it ("Checking.\n<call>\nDone." is "Checking.\nDone."). A reply with no call is
its content exactly as written.

Streamed, the text before a block goes out as it comes; a block is held until it closes and then
goes out whole, as one `tool_calls` delta (OpenAI's clients join a call's deltas by `index`, and
one delta is a whole call); a tag split across deltas is held back until it is whole. Under
`llama3_json` a reply that opens with `{` is held to its end (it is a call or it is not). Whole and
streamed replies split alike: a whole reply is one delta.
"""

from __future__ import annotations

import json
import secrets

from .chat_messages import MessagesError
from .reasoning import held_back

TOOL_CALL_PARSERS = ("none", "hermes", "llama3_json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's, before a call; gone where special tokens are not decoded


def tool_choice_mode(tool_choice, tools: list[dict] | None, parser: str) -> tuple[str, str | None]:
    """`tool_choice` as kvd honours it, as (mode, function name): ("auto", None) (calls in the
    reply become `tool_calls`), ("none", None) (the model sees the tools, if any, and its reply is
    text), ("required", None) or ("named", NAME) (the reply is held to calls: `forced_calls`);
    MessagesError naming the field for what kvd cannot honour."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return "none", None
    named = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(named, str):
            raise MessagesError(f"tool_choice: name a function as {{\"type\": \"function\", \"function\": {{\"name\": "
                                f"...}}}}, got {tool_choice!r}", "tool_choice")
    elif tool_choice not in ("auto", "required"):
        raise MessagesError(f"tool_choice: must be \"none\", \"auto\", \"required\" or a function, got "
                            f"{tool_choice!r}", "tool_choice")
    shown = f"{{\"function\": {{\"name\": {named!r}}}}}" if named else f"\"{tool_choice}\""
    if not tools:
        raise MessagesError(f"tool_choice: {shown} needs tools to choose from", "tool_choice")
    if parser == "none":
        raise MessagesError("tools: kvd parses no tool calls here (start it with --tool-call-parser hermes or "
                            "llama3_json); send tool_choice: \"none\" to show the model the tools without calls",
                            "tools")
    if named is not None:
        names = [tool["function"]["name"] for tool in tools]
        if named not in names:
            raise MessagesError(f"tool_choice.function.name: {named!r} is not one of the tools ({', '.join(names)})",
                                "tool_choice.function.name")
        return "named", named
    return tool_choice, None


def forced_calls(tools: list[dict], parser: str, only: str | None = None, parallel: bool = True):
    """The reply as calls in `parser`'s format and nothing else (a structured.Constraint): one call
    of `only` (a named tool_choice), else one or more calls (one without `parallel`) of any of the
    tools, each with the arguments its parameters' schema accepts, laid out as the model's own calls
    are. (Imported here: kvd router reads this module's parser names, and needs no engine.)"""
    from kvctl.daemon.engine.structured import JSON_LAYOUT, Constraint

    key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": tool["function"]["name"]},
                             key: tool["function"].get("parameters") or {"type": "object"}}}
             for tool in tools if only is None or tool["function"]["name"] == only]
    call = json.dumps({"anyOf": calls, "x-guidance": JSON_LAYOUT})
    more = only is None and parallel
    if parser == "llama3_json":
        rules = ['start: call ("; " call)*' if more else "start: call"]
    else:
        rules = ['start: block ("\\n" block)*' if more else "start: block",
                 f'block: "{OPEN}\\n" call "\\n{CLOSE}"']
    lark = "\n".join([*rules, f"call: %json {call}"])
    return Constraint.lark(lark, "tool_choice" if only is None else "tool_choice.function.name")


def parse_call(body: str) -> dict | None:
    """One block's call as {name, arguments (JSON text)}, or None when it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    return call_of(call)


def call_of(call) -> dict | None:
    """A parsed JSON value as a call {name, arguments (JSON text)}, or None when it is not one."""
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
    `feed` and `close` give (content, calls), each call {index, id, type, function: {name,
    arguments}}; a parser of another format is a class with the same two methods.

    `parallel`: False keeps only the first call (OpenAI's `parallel_tool_calls: false`)."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.pending = ""  # text not yet given out: a block's body, or what may begin a tag
        self.inside = False
        self.space = ""  # whitespace after the content given out: kept back until text follows it
        self.after_call = False  # whitespace right after a call only separates it from what follows
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content that can be given out now, and the calls whose blocks have closed."""
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
                calls.append(numbered(call, self.calls))
                self.calls += 1

    def close(self) -> tuple[str, list[dict]]:
        """The content held back, once the reply has ended (an unclosed block is text)."""
        rest = (OPEN if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        content = self._outside(rest)
        if not self.calls:  # no call: the reply as written, whitespace and all
            content += self.space
        self.space = ""
        return content, []

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


def numbered(call: dict, index: int) -> dict:
    """A call as a reply gives it out: its stream index, a new id."""
    return {"index": index, "id": new_call_id(), "type": "function", "function": call}


class JsonReplySplitter:
    """llama3_json: a reply that opens with JSON (or the python tag) is held to its end, then read
    as calls: one object, or several separated by `;`. Any other reply is content as it comes."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.state = "opening"  # opening -> holding (JSON, perhaps calls) | text
        self.pending = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.state == "text":
            return text, []
        self.pending += text
        start = self.pending.lstrip()
        if self.state == "opening":
            if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
                return "", []  # only whitespace so far, or perhaps the tag
            self.state = "holding" if start.startswith(("{", PYTHON_TAG)) else "text"
        if self.state == "text":
            out, self.pending = self.pending, ""
            return out, []
        return "", []

    def close(self) -> tuple[str, list[dict]]:
        text, self.pending = self.pending, ""
        calls = json_calls(text) if self.state == "holding" else None
        if not calls:
            return text, []
        calls = calls if self.parallel else calls[:1]
        self.calls = len(calls)
        return "", [numbered(call, index) for index, call in enumerate(calls)]


def json_calls(text: str) -> list[dict] | None:
    """The calls a llama3_json reply holds, or None when it is not calls alone."""
    text = text.strip()
    text = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_of(value)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest) + 1


def splitter_for(parser: str, parallel: bool = True):
    """A reply's tool-call splitter under `parser` (hermes or llama3_json)."""
    return JsonReplySplitter(parallel) if parser == "llama3_json" else ToolCallSplitter(parallel)


def split_tool_calls(text: str, parallel: bool = True, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """A whole reply's answer as (content, or None when there are calls and nothing else, calls
    without their stream `index`)."""
    splitter = splitter_for(parser, parallel)
    content, calls = splitter.feed(text)
    more_content, more_calls = splitter.close()
    content, calls = content + more_content, calls + more_calls
    return (None if calls and not content else content), [
        {key: value for key, value in call.items() if key != "index"} for call in calls]

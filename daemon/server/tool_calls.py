"""Tool calls in a chat reply: what the model writes to call a function, as OpenAI's `tool_calls`.

`tool_call_parser` (vLLM's `--tool-call-parser` names):
- `hermes`: a call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>` (the format of Hermes 2 Pro, Qwen2.5 and Qwen3, whose chat templates ask for it);
  several blocks are several calls;
- `llama3_json`: a reply that is JSON, `{"name": ..., "parameters": {...}}` (several separated by
  `;`), after Llama 3.1's `<|python_tag|>` where it is decoded, is its calls (the format Llama 3.1,
  3.2 and 3.3's templates ask for); a reply that opens otherwise, or is not such JSON, is text;
- `mistral`: what follows `[TOOL_CALLS]` is calls: a JSON list of `{"name", "arguments"}` objects
  (Mistral 7B Instruct v0.3's template), or `name[ARGS]{...}`, one per `[TOOL_CALLS]` (the form of
  Mistral's later tokenizers); text before it is content. Where the markers are special tokens, kvd
  keeps them in its decoded text (as vLLM decodes a Mistral tool request's special tokens), and a
  call's id is 9 letters and digits, the only ids Mistral's templates take back;
- `pythonic`: a reply that is a Python list of calls, `[get_weather(city="Paris"), get_time()]`,
  after Llama 4's `<|python_start|>` where it is decoded, is its calls (the format of Llama 4 and of
  Llama 3.2's pythonic template); the arguments, Python literals, are given out as JSON;
- `openai`: gpt-oss's harmony format, read with its channels (it needs `--reasoning-parser
  openai_gptoss`): a message to a function, `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}` (or with the recipient in its role's header, `<|start|>assistant
  to=functions.NAME<|channel|>commentary json<|message|>`), is a call, its text the arguments; it ends at
  `<|call|>`, where gpt-oss stops, so a reply holds one (vLLM's `openai` parser reads the same);
  a message to a recipient that is not a function (a built-in tool) goes by its channel, as without it;
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
goes out whole, as one `tool_calls` delta (OpenAI's clients join a call's deltas by `index`, and one
delta is a whole call); a tag split across deltas is held back until it is whole. Under
`llama3_json` a reply that opens with `{` is held to its end (it is a call or it is not), under
`pythonic` one that opens with `[`; under `mistral`, what follows `[TOOL_CALLS]`; under `openai`, a
call's message, which goes out when it ends. Whole and streamed replies split alike: a whole reply
is one delta.
"""

from __future__ import annotations

import ast
import json
import math
import secrets
import string
from dataclasses import replace

from .chat_messages import MessagesError
from .reasoning import HARMONY, HarmonySplitter, held_back

TOOL_CALL_PARSERS = ("none", "hermes", "llama3_json", "mistral", "pythonic", "openai")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's, before a call; gone where special tokens are not decoded
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around pythonic calls; likewise
JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's, which a pythonic call's value may use
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# special tokens a parser reads in the reply's text: kvd's decoded text keeps them (Tokenizer.keep_in_text)
MARKERS = {"mistral": (MISTRAL_CALLS, MISTRAL_ARGS), "openai": HARMONY}
# harmony (openai): a forced call's message, after the analysis message it may open with
HARMONY_THINKING, HARMONY_THOUGHT_END = "<|channel|>analysis<|message|>", "<|end|>"
HARMONY_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


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
        raise MessagesError("tools: kvd parses no tool calls here (start it with --tool-call-parser hermes, "
                            "llama3_json, mistral, pythonic or openai); send tool_choice: \"none\" to show the model "
                            "the tools without calls",
                            "tools")
    if named is not None:
        names = [tool["function"]["name"] for tool in tools]
        if named not in names:
            raise MessagesError(f"tool_choice.function.name: {named!r} is not one of the tools ({', '.join(names)})",
                                "tool_choice.function.name")
        return "named", named
    return tool_choice, None


def forced_calls(tools: list[dict], parser: str, only: str | None = None, parallel: bool = True,
                 special_tokens: dict[str, int] | None = None):
    """The reply as calls in `parser`'s format and nothing else (a structured.Constraint): one call
    of `only` (a named tool_choice), else one or more calls (one without `parallel`) of any of the
    tools, each with the arguments its parameters' schema accepts, laid out as the model's own calls
    are. `special_tokens`: the parser's markers that are special tokens of the model's tokenizer
    (Tokenizer.kept_specials), by id: a grammar's text cannot be one. (Imported here: kvd router
    reads this module's parser names, and needs no engine.)"""
    from kvctl.daemon.engine.structured import JSON_LAYOUT, Constraint

    field = "tool_choice" if only is None else "tool_choice.function.name"
    chosen = [(at, tool["function"]) for at, tool in enumerate(tools)  # (its place in tools, the function)
              if only is None or tool["function"]["name"] == only]
    more = only is None and parallel

    def marker(text: str) -> str:  # a special token by id: a grammar's text cannot be one
        token = (special_tokens or {}).get(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    if parser == "openai":  # one message to a function: gpt-oss stops at its <|call|>
        return harmony_call_constraint(chosen, marker, field)
    if parser == "pythonic":  # keyword arguments, not a JSON object: a grammar of its own
        return Constraint.lark(pythonic_grammar(chosen, more, JSON_LAYOUT), field)
    key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": function["name"]}, key: parameters_of(function)}}
             for _, function in chosen]
    call = json.dumps({"anyOf": calls, "x-guidance": JSON_LAYOUT})
    if parser == "mistral":  # either of the two forms: the model writes the one it was taught
        opening = marker(MISTRAL_CALLS)
        rules = [f"start: {opening} (listed | named" + (f" ({opening} named)*)" if more else ")"),
                 'listed: " "? "[" call (", " call)* "]"' if more else 'listed: " "? "[" call "]"',
                 "named: " + " | ".join(f"named_{i}" for i in range(len(chosen)))]
        rules += [f"named_{i}: {json.dumps(function['name'])} {marker(MISTRAL_ARGS)} "
                  f"%json {json.dumps({**parameters_of(function), 'x-guidance': JSON_LAYOUT})}"
                  for i, (_, function) in enumerate(chosen)]
    elif parser == "llama3_json":
        rules = ['start: call ("; " call)*' if more else "start: call"]
    else:
        rules = ['start: block ("\\n" block)*' if more else "start: block",
                 f'block: "{OPEN}\\n" call "\\n{CLOSE}"']
    return Constraint.lark("\n".join([*rules, f"call: %json {call}"]), field)


def harmony_call_constraint(chosen: list[tuple[int, dict]], marker, field: str):
    """gpt-oss's call of one of the `chosen` tools, as it writes one after thinking:
    `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and
    arguments its parameters' schema accepts, written compact (`{"city":"Oslo"}`), as harmony's
    examples and gpt-oss write them. The reply may first think (an analysis message, which the shape
    leaves free until its `<|end|>`), as harmony's replies do."""
    from kvctl.daemon.engine.structured import Constraint

    rules = [f'start: ({marker("<|start|>")} "assistant")? {marker("<|channel|>")} "commentary to=functions." call',
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, (_, function) in enumerate(chosen):
        arguments = json.dumps({**parameters_of(function), "x-guidance": HARMONY_JSON_LAYOUT})
        rules.append(f'call_{i}: {json.dumps(function["name"] + " ")} {marker("<|constrain|>")} "json" '
                     f'{marker("<|message|>")} %json {arguments}')
    return replace(Constraint.lark("\n".join(rules), field), after=HARMONY_THOUGHT_END, opens=HARMONY_THINKING)


def parameters_of(function: dict) -> dict:
    """A tool function's parameters schema (any object where it gives none)."""
    return function.get("parameters") or {"type": "object"}


def parse_call(body: str) -> dict | None:
    """One block's call as {name, arguments (JSON text)}, or None when it is not one."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses ("[[[[...")
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


MISTRAL_ID_CHARACTERS = string.ascii_letters + string.digits


def new_call_id(parser: str = "hermes") -> str:
    """A call's id: OpenAI's form, or 9 letters and digits under mistral (its templates refuse others)."""
    if parser == "mistral":
        return "".join(secrets.choice(MISTRAL_ID_CHARACTERS) for _ in range(9))
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
        kept, self.space = space_held_back(self.space + text)
        return kept


def space_held_back(text: str) -> tuple[str, str]:
    """(text to give out now, its trailing whitespace): kept back until text follows it, since
    whitespace just before a call only separates it from the text and is dropped with calls."""
    kept = text.rstrip()
    return kept, text[len(kept):]


def numbered(call: dict, index: int, parser: str = "hermes") -> dict:
    """A call as a reply gives it out: its stream index, a new id."""
    return {"index": index, "id": new_call_id(parser), "type": "function", "function": call}


class JsonReplySplitter:
    """llama3_json: a reply that opens with JSON (or the python tag) is held to its end, then read
    as calls: one object, or several separated by `;`. Any other reply is content as it comes.
    (pythonic: the same, for a reply that opens with `[` or Llama 4's python tag.)"""

    def __init__(self, parallel: bool = True, parser: str = "llama3_json") -> None:
        self.parallel = parallel
        self.state = "opening"  # opening -> holding (JSON, perhaps calls) | text
        self.pending = ""
        self.calls = 0
        self.tag, self.opener, self.read = ((PYTHON_START, "[", pythonic_calls) if parser == "pythonic"
                                            else (PYTHON_TAG, "{", json_calls))
        self.parser = parser

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.state == "text":
            return text, []
        self.pending += text
        start = self.pending.lstrip()
        if self.state == "opening":
            if not start or (self.tag.startswith(start) and start != self.tag):
                return "", []  # only whitespace so far, or perhaps the tag
            self.state = "holding" if start.startswith((self.opener, self.tag)) else "text"
        if self.state == "text":
            out, self.pending = self.pending, ""
            return out, []
        return "", []

    def close(self) -> tuple[str, list[dict]]:
        text, self.pending = self.pending, ""
        calls = self.read(text) if self.state == "holding" else None
        if not calls:
            return text, []
        calls = calls if self.parallel else calls[:1]
        self.calls = len(calls)
        return "", [numbered(call, index, self.parser) for index, call in enumerate(calls)]


def json_calls(text: str) -> list[dict] | None:
    """The calls a llama3_json reply holds, or None when it is not calls alone."""
    text = text.strip()
    text = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
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


class MistralSplitter:
    """mistral: text before `[TOOL_CALLS]` is content as it comes (whitespace at its end kept back
    until text follows it, or the reply ends without calls); what follows is held to the reply's end,
    then read as calls. What does not read as calls is content as written, the marker with it."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.pending = ""  # what may begin the marker, or (once it is seen) everything after it
        self.holding = False
        self.space = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        if self.holding:
            return "", []
        start = self.pending.find(MISTRAL_CALLS)
        if start >= 0:
            content, self.pending, self.holding = self.pending[:start], self.pending[start + len(MISTRAL_CALLS):], True
        else:
            given = len(self.pending) - held_back(self.pending, MISTRAL_CALLS)
            content, self.pending = self.pending[:given], self.pending[given:]
        kept, self.space = space_held_back(self.space + content)
        return kept, []

    def close(self) -> tuple[str, list[dict]]:
        held, self.pending = self.pending, ""
        calls = mistral_calls(held) if self.holding else None
        if not calls:
            space, self.space = self.space, ""
            return space + (MISTRAL_CALLS if self.holding else "") + held, []
        self.space = ""
        calls = calls if self.parallel else calls[:1]
        self.calls = len(calls)
        return "", [numbered(call, index, "mistral") for index, call in enumerate(calls)]


def mistral_calls(text: str) -> list[dict] | None:
    """The calls after a reply's first `[TOOL_CALLS]`: a JSON list of calls (or one call), or
    `name[ARGS]{...}` pieces each after its own marker; None when that is not all the text holds."""
    if text.lstrip().startswith(("[", "{")):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        calls = [call_of(item) for item in (value if isinstance(value, list) else [value])]
        return calls if calls and None not in calls else None
    calls = []
    for piece in text.split(MISTRAL_CALLS):
        name, marker, arguments = piece.partition(MISTRAL_ARGS)
        if not marker:
            return None
        try:
            call = call_of({"name": name.strip(), "arguments": json.loads(arguments)})
        except (ValueError, RecursionError):
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


class HarmonyCallSplitter:
    """openai: the calls that the reply's HarmonySplitter (reasoning.py, `calls=True`) set apart as
    their messages ended, numbered; the answer text it gave out is content, as it is."""

    def __init__(self, harmony, parallel: bool = True) -> None:
        self.harmony = harmony
        self.parallel = parallel
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return text, self._numbered()

    def close(self) -> tuple[str, list[dict]]:
        return "", self._numbered()

    def _numbered(self) -> list[dict]:
        calls = []
        for call in self.harmony.take_calls():
            if self.parallel or self.calls == 0:
                calls.append(numbered(call, self.calls))
                self.calls += 1
        return calls


def split_harmony(text: str, parallel: bool = True) -> tuple[str | None, str | None, list[dict]]:
    """A whole harmony reply under `openai` as (reasoning or None, content (None when there are
    calls and nothing else), calls without their stream `index`)."""
    harmony = HarmonySplitter(calls=True)
    calls_of = HarmonyCallSplitter(harmony, parallel)
    reasoning, answer = harmony.feed(text)
    more_reasoning, more_answer = harmony.close()
    content, calls = calls_of.feed(answer + more_answer)
    calls += calls_of.close()[1]
    return (reasoning + more_reasoning) or None, (None if calls and not content else content), [
        {key: value for key, value in call.items() if key != "index"} for call in calls]


def splitter_for(parser: str, parallel: bool = True):
    """A reply's tool-call splitter under `parser` (hermes, llama3_json, mistral or pythonic; openai's
    is a HarmonyCallSplitter over the reply's HarmonySplitter)."""
    if parser == "openai":
        raise ValueError("openai: a harmony reply's calls are read with its channels: HarmonyCallSplitter over "
                         "reasoning.HarmonySplitter(calls=True)")
    if parser == "mistral":
        return MistralSplitter(parallel)
    if parser in ("llama3_json", "pythonic"):
        return JsonReplySplitter(parallel, parser)
    return ToolCallSplitter(parallel)


def pythonic_calls(text: str) -> list[dict] | None:
    """The calls a pythonic reply holds (`[name(key=value, ...), ...]`), or None when it is not
    calls alone. Values are Python literals, or JSON's (true, false, null: an object written as
    JSON); anything else (a name, an expression, *args) makes it text."""
    text = text.strip()
    if text.startswith(PYTHON_START):
        text = text[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, or a name twice
                return None
            try:
                arguments[keyword.arg] = python_value(keyword.value)
            except (ValueError, TypeError, RecursionError, MemoryError):
                return None
        calls.append({"name": node.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return calls


def python_value(node: ast.AST):
    """A call's literal argument as JSON holds it; ValueError for what JSON cannot."""
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [python_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys):
            raise ValueError("a key that is not a string")
        return {key.value: python_value(value) for key, value in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"not a JSON value: {type(value).__name__}")


def pythonic_grammar(chosen: list[tuple[int, dict]], more: bool, layout: dict) -> str:
    """Lark rules for pythonic calls of the `chosen` (place in tools, function) pairs, several where
    `more`: each tool's schema properties as keyword arguments in the order the schema gives them
    (the required ones always, the others where the model writes them), each value JSON its
    property's schema accepts (a Python literal too, but for true, false and null, which
    pythonic_calls reads); a tool whose schema names no properties takes any."""
    rules = ['start: "[" call (", " call)* "]"' if more else 'start: "[" call "]"']
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    for i, (at, function) in enumerate(chosen):
        schema = parameters_of(function)
        properties = list((schema.get("properties") or {}).items())
        required = set(schema.get("required") or [])
        name = json.dumps(function["name"] + "(")
        for prop, _ in properties:
            if not prop.isidentifier():
                where = f"tools[{at}].function.parameters.properties"
                raise MessagesError(f"{where}: {prop!r} cannot be a keyword argument of a pythonic call", where)
        if not properties:
            free = schema.get("additionalProperties", True) is not False
            rules.append(f'call_{i}: {name} (any_{i} (", " any_{i})*)? ")"' if free else f'call_{i}: {name} ")"')
            if free:
                rules.append(f'any_{i}: /[A-Za-z_][A-Za-z0-9_]*/ "=" %json {json.dumps({"x-guidance": layout})}')
            continue
        n = len(properties)
        emptiable = [all(p not in required for p, _ in properties[k:]) for k in range(n + 1)]

        def ref(kind: str, k: int) -> str:
            return "" if k == n else f"{kind}_{i}_{k}" + ("?" if emptiable[k] else "")

        rules.append(f'call_{i}: {name} {ref("first", 0)} ")"')
        for k, (prop, prop_schema) in enumerate(properties):
            value = json.dumps({**prop_schema, "x-guidance": layout}) if isinstance(prop_schema, dict) else "{}"
            rules.append(f"arg_{i}_{k}: {json.dumps(prop + '=')} %json {value}")
            first = [f"arg_{i}_{k} {ref('rest', k + 1)}"] + ([f"first_{i}_{k + 1}"]
                                                            if prop not in required and k + 1 < n else [])
            rest = [f'", " arg_{i}_{k} {ref("rest", k + 1)}'] + ([f"rest_{i}_{k + 1}"]
                                                                 if prop not in required and k + 1 < n else [])
            # first_k (nothing written yet) is reached while every property before k is left out; rest_k, past k-1
            if all(p not in required for p, _ in properties[:k]):
                rules.append(f"first_{i}_{k}: " + " | ".join(first))
            if k > 0:
                rules.append(f"rest_{i}_{k}: " + " | ".join(rest))
    return "\n".join(rules)


def split_tool_calls(text: str, parallel: bool = True, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """A whole reply's answer as (content, or None when there are calls and nothing else, calls
    without their stream `index`)."""
    splitter = splitter_for(parser, parallel)
    content, calls = splitter.feed(text)
    more_content, more_calls = splitter.close()
    content, calls = content + more_content, calls + more_calls
    return (None if calls and not content else content), [
        {key: value for key, value in call.items() if key != "index"} for call in calls]

"""A Responses API request's input as chat messages, and its function tools as the chat's.

Plain Python (no pydantic, no torch): kvd serves `/v1/responses` with it (responses_api.py), and
`kvd router` reads a new response's conversation with it, to route it by its prefix as a chat.
"""

from __future__ import annotations

import uuid
from typing import Any

from . import reasoning_blob
from .chat_messages import MessagesError

METADATA_KEYS = 16  # OpenAI's most metadata pairs
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content: Any, where: str) -> str:
    """An item's content as text: a string, or text parts (input_text, output_text) joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessagesError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}",
                            where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = repr(kind) if kind is not None else f"a {type(part).__name__}"
            raise MessagesError(f"{where}[{j}].type: kvd takes text parts only (input_text, output_text), got "
                                f"{shown}", f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def _content_of(content: Any, where: str) -> Any:
    """An item's content as a chat message's: its text (_text_of), or where a part marks a prompt
    cache breakpoint, its parts as the chat's text parts, each mark kept (cache_breakpoints.py)."""
    text = _text_of(content, where)
    if isinstance(content, list) and any("prompt_cache_breakpoint" in part for part in content):
        return [{"type": "text", "text": part["text"], **({"prompt_cache_breakpoint": part["prompt_cache_breakpoint"]}
                                                         if "prompt_cache_breakpoint" in part else {})}
                for part in content]
    return text


def _blob_text(item: dict, where: str) -> str | None:
    """The text a reasoning item's `encrypted_content` carries (reasoning_blob.py); None where it
    has none, or one kvd cannot read (another server's)."""
    blob = item.get("encrypted_content")
    if blob is None:
        return None
    if not isinstance(blob, str):
        raise MessagesError(f"{where}.encrypted_content: must be a string, got {type(blob).__name__}",
                            f"{where}.encrypted_content")
    try:
        return reasoning_blob.decode(blob)
    except reasoning_blob.BlobError as exc:
        raise MessagesError(f"{where}.encrypted_content: not a blob kvd gave: {exc}; send the item as kvd gave it",
                            f"{where}.encrypted_content") from None


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else the text its
    encrypted_content carries, else its summary's summary_text."""
    field = "content" if item.get("content") else "summary"
    if field == "summary" and (carried := _blob_text(item, where)) is not None:
        return carried
    parts = item.get(field) or []
    if not isinstance(parts, list):
        raise MessagesError(f"{where}.{field}: must be a list of text parts", f"{where}.{field}")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise MessagesError(f"{where}.{field}[{j}]: must be {{\"type\": \"reasoning_text\", \"text\": ...}}",
                                f"{where}.{field}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(raw: Any, field: str = "input", kept: bool = False) -> list[dict]:
    """The request's `input` as chat messages (as chat_messages.chat_messages takes them), or
    MessagesError naming the item and field at fault (`field`: what the request calls the list,
    a conversation's `items`). A function call joins the assistant message before it (one turn:
    its text, then its calls, as a chat client sends it back); a reasoning item goes with the
    assistant message or call after it. `kept`: a kept conversation's items, where a reply cut
    off while it was thinking left a reasoning item with nothing after it: that stands as an
    assistant turn of its own, with no text (as `previous_response_id` continues it)."""
    if isinstance(raw, str) and field == "input":
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        got = "an empty list" if raw == [] else "nothing" if raw is None else type(raw).__name__
        kinds = "a string or a list of items" if field == "input" else "a list of items"
        raise MessagesError(f"{field}: must be {kinds}, got {got}", field)
    messages: list[dict] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise MessagesError(f"{where}: must be an object (a message or an item), got {type(item).__name__}", where)
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise MessagesError(f"{where}.id: must be a string, got {item['id']!r}", f"{where}.id")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise MessagesError(f"{where}.role: must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                                    f"{where}.role")
            message = {"role": role, "content": _content_of(item.get("content"), f"{where}.content")}
        elif kind == "function_call":
            call = {"type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise MessagesError(f"{where}.{key}: must be a string, got {item.get(key)!r}", f"{where}.{key}")
            call["id"] = item["call_id"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise MessagesError(f"{where}.call_id: must be a string, got {item.get('call_id')!r}",
                                    f"{where}.call_id")
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": _content_of(item.get("output"), f"{where}.output")}
        elif kind == "reasoning":
            if thought is not None:
                raise MessagesError(f"{where}: two reasoning items in a row; send one per assistant turn", where)
            thought = _reasoning_text(item, where)
            continue
        else:
            raise MessagesError(f"{where}.type: kvd takes message, function_call, function_call_output and reasoning "
                                f"items, got {kind!r}", f"{where}.type")
        if thought is not None and kept and message["role"] != "assistant":
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
            thought = None
        if thought is not None:
            if message["role"] != "assistant":
                raise MessagesError(f"{where}: a reasoning item goes before the assistant message or function call "
                                    f"it led to, not before a {message['role']!r} message", where)
            message["reasoning_content"], thought = thought, None
        messages.append(message)
    if thought is not None and kept:
        messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
    elif thought is not None:
        raise MessagesError(f"{field}[{len(raw) - 1}]: a reasoning item goes before the assistant message or "
                            "function call it led to", f"{field}[{len(raw) - 1}]")
    return messages


def checked_metadata(metadata: Any, param: str = "metadata") -> dict:
    """`metadata` as OpenAI's API takes it (None: {}): at most METADATA_KEYS pairs, keys of at
    most 64 characters, string values of at most 512; MessagesError naming `param` otherwise."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS:
        raise MessagesError(f"{param}: must be an object of at most {METADATA_KEYS} string values", param)
    for key, value in metadata.items():
        if len(key) > 64:
            raise MessagesError(f"{param}: a key is at most 64 characters, got one of {len(key)}", param)
        if not isinstance(value, str) or len(value) > 512:
            raise MessagesError(f"{param}.{key}: must be a string of at most 512 characters, got "
                                + (f"one of {len(value)}" if isinstance(value, str) else type(value).__name__),
                                f"{param}.{key}")
    return metadata


def new_id(prefix: str) -> str:
    """A new id for a response or an item: `prefix` ("resp_", "msg_", ...) and 32 hex digits."""
    return prefix + uuid.uuid4().hex


def _parts(content: Any, kind: str) -> list[dict]:
    """A message's content as text parts of `kind` (a string becomes one part)."""
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    return [{"type": kind, "text": part["text"], **({"annotations": []} if kind == "output_text" else {})}
            for part in content]


def input_items(raw: Any) -> list[dict]:
    """The request's `input` (already taken by `input_messages`) as the items
    `GET /v1/responses/{id}/input_items` lists: each with its `id` (the one the client gave, else
    a new one) and its `status`, a string input as one user message, a message's text as parts,
    an assistant's message as an output message (output_text parts)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    items = []
    for item in raw:
        kind = item.get("type", "message")
        if kind == "message":
            assistant = item["role"] == "assistant"
            shaped = {"id": item.get("id") or new_id("msg_"), "type": "message", "role": item["role"],
                      "content": _parts(item["content"], "output_text" if assistant else "input_text"),
                      "status": "completed"}
        elif kind == "function_call":
            shaped = {"id": item.get("id") or new_id("fc_"), "type": "function_call", "call_id": item["call_id"],
                      "name": item["name"], "arguments": item["arguments"], "status": "completed"}
        elif kind == "function_call_output":
            output = item["output"]
            shaped = {"id": item.get("id") or new_id("fco_"), "type": "function_call_output",
                      "call_id": item["call_id"],
                      "output": output if isinstance(output, str) else _parts(output, "input_text"),
                      "status": "completed"}
        else:  # reasoning (its content: as given, else the text its encrypted_content carries)
            carried = None if item.get("content") else _blob_text(item, "input")
            shaped = {"id": item.get("id") or new_id("rs_"), "type": "reasoning",
                      "summary": list(item.get("summary") or []),
                      "content": list(item.get("content") or [])
                      or ([{"type": "reasoning_text", "text": carried}] if carried else [])}
        items.append(shaped)
    return items


def chat_tools(tools: Any) -> list[dict] | None:
    """The Responses API's function tools ({"type": "function", "name", "description",
    "parameters", "strict"}) in the chat's form, checked there; MessagesError for another kind."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise MessagesError(f"tools: must be a list of functions, got {type(tools).__name__}", "tools")
    shaped = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise MessagesError(f"tools[{i}].type: kvd serves function tools only (no built-in tools), got {kind!r}",
                                f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        shaped.append({"type": "function", "function": function})
    return shaped


def chat_fields(body: dict) -> dict:
    """A Responses request's own conversation as a chat request's fields (`messages`, with the
    instructions first, and `tools`); MessagesError naming the field at fault."""
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    fields = {"messages": system + input_messages(body.get("input"))}
    tools = chat_tools(body.get("tools"))
    if tools:
        fields["tools"] = tools
    return fields

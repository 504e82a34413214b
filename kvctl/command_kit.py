"""What kvctl's commands share: the client for the daemon the root options name, printing an
answer (as JSON or drawn), redrawing it (`--watch`), and a prompt given as text, token ids, a
file or chat messages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import typer
from rich.console import Console, Group
from rich.text import Text

from .client import Client
from .errors import KvdUnavailable, UserError
from .outputs import read_text


def client_for(ctx: typer.Context, tenant: str | None = None) -> Client:
    options = ctx.find_root().obj or {}
    return Client(options.get("socket"), options.get("url"), options.get("token_file"), tenant=tenant,
                  ca_file=options.get("ca_file"), client_cert=options.get("client_cert"))


def emit(data, as_json: bool, render) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        render(data)


def show_or_watch(fetch: Callable[[], dict], view, watch: bool, as_json: bool,
                  for_json: Callable[[dict], dict] = lambda d: d) -> None:
    """Print what `fetch()` answers: as `view` draws it, as JSON (`for_json` makes it JSON-safe),
    or redrawn every second until Ctrl-C (`--watch`)."""
    if watch and not as_json:
        redraw(fetch, view)
        return
    data = fetch()
    emit(for_json(data) if as_json else data, as_json, lambda d: Console().print(view(d)))


def prompt_body(text: str | None, tokens: str | None, file: Path | None, messages: Path | None = None,
                cache_options: bool = False) -> dict:
    """The prompt an admin request names, from kvctl's arguments (one of them). `cache_options`: with
    a request's body in `messages`, its `prompt_cache_options` come too (kvctl explain)."""
    given = [x for x in (text, tokens, file, messages) if x is not None]
    if len(given) != 1:
        raise UserError("give exactly one of TEXT, --tokens, --file or --messages")
    if messages is not None:
        return chat_messages_file(messages, cache_options)
    if tokens is not None:
        try:
            return {"tokens": [int(t) for t in tokens.split(",") if t.strip()]}
        except ValueError:
            raise UserError(f"tokens: expected comma-separated integers, got {tokens!r}") from None
    if file is not None:
        return {"text": read_text(file, "file", "give the prompt's text, or its token ids with --tokens")}
    return {"text": text}


def chat_messages_file(path: Path, cache_options: bool = False) -> dict:
    """`{"messages": [...]}` from a JSON file: a list of {role, content}, a chat request's body (an
    object with `messages`, whose `chat_template_kwargs` and `tools` come too, and with
    `cache_options` its `prompt_cache_options`), or a Responses request's body (`input`, with its
    `instructions` and `tools`: the chat kvd serves it as). kvd checks them and renders them with
    the model's chat template."""
    from kvctl.daemon.server.chat_messages import asked_kwargs

    raw = read_text(path, "messages", "give a JSON list of {\"role\", \"content\"} messages")
    try:
        loaded = json.loads(raw)
    except ValueError as exc:
        raise UserError(f"messages: {str(path)!r} is not JSON ({exc})") from None
    options = loaded.get("prompt_cache_options") if cache_options and isinstance(loaded, dict) else None
    extra = {} if options is None else {"prompt_cache_options": options}  # (the request's own prompt cache mode)
    if isinstance(loaded, dict) and "input" in loaded and "messages" not in loaded:
        return {**responses_chat(loaded, path), **extra}
    if isinstance(loaded, dict) and "messages" in loaded:
        extra.update({key: loaded[key] for key in ("tools",) if loaded.get(key) is not None})
        kwargs = asked_kwargs(loaded)  # (with the request's reasoning_effort, as kvd renders it)
        if kwargs is not None:
            extra["chat_template_kwargs"] = kwargs
        loaded = loaded["messages"]
    if not isinstance(loaded, list):
        raise UserError(f"messages: {str(path)!r} holds a {type(loaded).__name__}; give a list of "
                        "{\"role\", \"content\"} messages, or a chat request with \"messages\"")
    return {"messages": loaded, **extra}


def responses_chat(body: dict, path: Path) -> dict:
    """A Responses request's body (its own `input`) as the chat kvd serves it as: its instructions
    first, its items as messages, its tools (responses_input.chat_fields, kvd's own reading)."""
    from kvctl.daemon.server.chat_messages import MessagesError, asked_kwargs
    from kvctl.daemon.server.responses_input import chat_fields

    for field in ("previous_response_id", "conversation"):
        if body.get(field) is not None:
            raise UserError(f"messages: {str(path)!r} continues a conversation kvd keeps ({field}); kvctl reads "
                            "the request's own input only: give the whole conversation in `input`")
    try:
        fields = chat_fields(body)
    except MessagesError as exc:
        raise UserError(f"messages: {str(path)!r}: {exc}") from None
    kwargs = asked_kwargs(body)  # (with the request's reasoning.effort, as kvd renders it)
    if kwargs is not None:
        fields["chat_template_kwargs"] = kwargs
    return fields


def redraw(fetch, render, console: Console | None = None, interval: float = 1.0, sleep=time.sleep) -> None:
    """Redraw what `render` makes of `fetch()` every `interval` until Ctrl-C (`--watch`).
    While kvd cannot answer (a restart, a reload of the model) the last picture stays up under a
    line that says since when, and the watch carries on once kvd is back; any other error ends it."""
    from rich.live import Live

    frame = render(fetch())
    lost_since = None
    with Live(frame, console=console, refresh_per_second=2) as live:
        try:
            while True:
                sleep(interval)
                try:
                    frame, lost_since = render(fetch()), None
                    live.update(frame)
                except KvdUnavailable as exc:
                    lost_since = lost_since or time.strftime("%H:%M:%S")
                    live.update(Group(frame, Text(f"{exc} — since {lost_since}; still watching (Ctrl-C stops)",
                                                  style="yellow")))
        except KeyboardInterrupt:
            pass

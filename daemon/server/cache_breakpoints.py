"""OpenAI's prompt cache breakpoints: a request marks where reusable prefixes of its prompt end
(`prompt_cache_breakpoint: {"mode": "explicit", "ttl": "30m" | "12h"}` on a text part of a
message's content; the latest MOST_BREAKPOINTS kept, one fewer where `prompt_cache_options.mode`
is implicit, as OpenAI writes them), each with a minimum lifetime (its own `ttl`, else the
request's `prompt_cache_options.ttl`, else 30m).

`prompt_cache_options.mode`: "implicit" (the default) is kvd's prefix cache as always, which
caches every prompt's full blocks; "explicit" caches the prompt only up to its longest marked
prefix, none of it where it marks none (OpenAI: such a request does not use prompt caching):
`private_from` is where the request's own hashing starts (PrefixHasher's `private`), so nothing
past it is read from the cache or left there for another request.

kvd keeps each marked prefix's full blocks for that long after the request that marks it ends:
a pin of the request's tenant, marked as a breakpoint's (daemon/cache/manager.py `hold`), paid
from the tenant's pin budget and refused (the request served all the same) where that budget or
pin_room_tokens has no room. A request that marks the same prefix again extends it. An
operator's setting `prompt_cache_breakpoints: ignore` serves requests as if they marked none.

A breakpoint's prefix is found by rendering the messages up to the end of the marked part (the
last of them continued, not closed) and taking as much of it as the whole prompt starts with:
whatever the chat template writes around a message, the prefix held is one the prompt has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvctl.daemon.model.chat_template import ChatTemplateError

from .chat_messages import MessagesError, chat_messages

TTLS = {"30m": 1800.0, "12h": 43200.0}  # OpenAI's lifetimes, in seconds
DEFAULT_TTL = "30m"
MOST_BREAKPOINTS = 4  # per request in explicit mode: the latest are kept (implicit: one fewer, as OpenAI)
MODES = ("implicit", "explicit")  # prompt_cache_options.mode


@dataclass(frozen=True)
class Mark:
    """A breakpoint: the end of part `part` of message `message`'s content, held for `ttl` (a TTLS key)."""

    message: int
    part: int
    ttl: str


def request_ttl(options: Any) -> str:
    """The lifetime `prompt_cache_options` gives breakpoints that name none; MessagesError naming
    the field at fault."""
    if options is None:
        return DEFAULT_TTL
    if not isinstance(options, dict):
        raise MessagesError(f"prompt_cache_options: must be an object, got {type(options).__name__}",
                            "prompt_cache_options")
    unknown = sorted(set(options) - {"mode", "ttl"})
    if unknown:
        raise MessagesError(f"prompt_cache_options.{unknown[0]}: kvd knows mode and ttl only",
                            f"prompt_cache_options.{unknown[0]}")
    if options.get("mode", "implicit") not in MODES:
        raise MessagesError(f"prompt_cache_options.mode: must be implicit or explicit, got {options['mode']!r}",
                            "prompt_cache_options.mode")
    return _ttl(options.get("ttl", DEFAULT_TTL), "prompt_cache_options.ttl")


def _ttl(value: Any, where: str) -> str:
    if value not in TTLS:
        raise MessagesError(f"{where}: must be {' or '.join(TTLS)}, got {value!r}", where)
    return value


def explicit(options: Any) -> bool:
    """Whether `prompt_cache_options` (checked by `request_ttl`) asks for explicit mode."""
    return isinstance(options, dict) and options.get("mode") == "explicit"


EXPLICIT_BECAUSE = ("asked", "tenant")  # why a request is served in explicit mode (kvd_prompt_cache_explicit_requests)


def explicit_because(options: Any, tenant: str, honoured: bool, tenants: tuple[str, ...]) -> str | None:
    """Why a request of `tenant` is served in explicit mode: "tenant", the operator serves its tenant
    so whatever it asks (`tenants`, prompt_cache_explicit_tenants; "*": every tenant); "asked", it
    asks for it (where the operator honours breakpoints: `honoured`); None: it is not."""
    if tenant in tenants or "*" in tenants:
        return "tenant"
    return "asked" if honoured and explicit(options) else None


def private_from(lengths: list[tuple[int, float, str]], block_size: int) -> int:
    """In explicit mode, the first block of the prompt hashed as the request's own: the one after
    the longest marked prefix's full blocks (`prefix_lengths`), 0 where none is placed."""
    return max((tokens for tokens, _, _ in lengths), default=0) // block_size


def marks(messages: Any, options: Any) -> list[Mark]:
    """The breakpoints `messages` (a chat request's, as sent) mark, in prompt order, the latest
    MOST_BREAKPOINTS (implicit mode: one fewer); MessagesError naming a malformed one."""
    default = request_ttl(options)
    found = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            mark = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
            if mark is None:
                continue
            where = f"messages[{i}].content[{j}].prompt_cache_breakpoint"
            if not isinstance(mark, dict) or mark.get("mode") != "explicit":
                raise MessagesError(f'{where}: must be {{"mode": "explicit"[, "ttl": "30m" or "12h"]}}, got '
                                    f"{mark!r}"[:300], where)
            unknown = sorted(set(mark) - {"mode", "ttl"})
            if unknown:
                raise MessagesError(f"{where}.{unknown[0]}: kvd knows mode and ttl only", f"{where}.{unknown[0]}")
            found.append(Mark(i, j, _ttl(mark.get("ttl", default), f"{where}.ttl")))
    return found[-(MOST_BREAKPOINTS if explicit(options) else MOST_BREAKPOINTS - 1):]


def prefix_lengths(messages: list[dict], found: list[Mark], render: Callable[[list[dict]], list[int]],
                   prompt_ids: list[int]) -> list[tuple[int, float, str]]:
    """(tokens, seconds, ttl) of each breakpoint's prefix of `prompt_ids`: `render(messages)` gives
    the ids of messages (as sent) ending inside the last one, as the request's prompt renders
    them. Breakpoints whose prefixes are alike are one, with the longest lifetime."""
    held: dict[int, str] = {}
    for mark in found:
        message = messages[mark.message]
        upto = [*messages[:mark.message], {**message, "content": message["content"][:mark.part + 1]}]
        ids = render(upto)
        tokens = _common(ids, prompt_ids)
        if tokens and TTLS[mark.ttl] >= TTLS[held.get(tokens, mark.ttl)]:
            held[tokens] = mark.ttl
    return [(tokens, TTLS[ttl], ttl) for tokens, ttl in sorted(held.items())]


def rendered_lengths(service, messages: list[dict], found: list[Mark], prompt_ids: list[int],
                     template_kwargs: dict | None, tools: list[dict] | None, tenant: str | None):
    """`prefix_lengths`, each mark's messages rendered by `service`'s chat template as the request's
    prompt was (its kwargs and tools; with `tenant`, its replies as their own ids). A template that
    cannot end inside a message places no mark there."""
    def ending_inside(upto: list[dict]) -> list[int]:
        try:
            return service.chat_prompt(chat_messages(upto), False, True, template_kwargs, tools, tenant=tenant)
        except (MessagesError, ChatTemplateError):
            return []

    return prefix_lengths(messages, found, ending_inside, prompt_ids)


def private_start(options: Any, tenant: str, config, lengths: list[tuple[int, float, str]],
                  block_size: int) -> tuple[str, int] | None:
    """(why, first block hashed as the request's own) where a request of `tenant` asking `options`
    under kvd's `config` is served in explicit mode (`explicit_because`, `private_from`), else None.
    `lengths`: its placed marks' (`prefix_lengths`; none where the operator ignores them)."""
    because = explicit_because(options, tenant, config.prompt_cache_breakpoints == "honour",
                               config.prompt_cache_explicit_tenants)
    return None if because is None else (because, private_from(lengths, block_size))


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def written(held: list[tuple[int, str]]) -> dict:
    """OpenAI's cache_write_tokens of the prefixes a request's breakpoints newly held ((tokens,
    ttl) each): the tokens of the longest, and of those the ones held 12h (a shorter prefix's
    tokens lie inside a longer one's)."""
    total = max((tokens for tokens, _ in held), default=0)
    long = max((tokens for tokens, ttl in held if ttl == "12h"), default=0)
    return {"cache_write_tokens": total,
            "cache_write_tokens_details": {"ttl_30m_tokens": total - long, "ttl_12h_tokens": long}}

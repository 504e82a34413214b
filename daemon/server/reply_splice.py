"""A chat's prompt with kvd's own replies as the ids the model made (reply_ids.py says why).

`reply_ids_of` names the ids a finished reply can be read back as: its output less a last
special token (the stop token, which the chat template writes after the reply itself), and
only where those ids decode to exactly the reply's text with no special token hidden in them.

`spliced_prompt` renders the conversation twice: as it is, and with each assistant message
whose ids are kept replaced by a marker no client can send. Only where the second rendering,
with each marker put back as its text, is the first one letter for letter (the template wrote
each reply as it is: it did not trim it, cut its reasoning or escape it) is the prompt spliced:
the template's text between the replies tokenized as always, each reply as its ids. So a
spliced prompt is the same text as the plain one, split as the model split its replies; a turn
after it finds the earlier turn's prompt and reply in the cache, token for token.
"""

from __future__ import annotations

import secrets
from typing import Callable

Render = Callable[[list[dict]], str]
Encode = Callable[[str], list[int]]
IdsFor = Callable[[str], "list[int] | None"]


def reply_ids_of(output_ids, text: str, decode: Callable[[list[int]], str], hidden: frozenset[int]) -> list[int] | None:
    """The ids `text` (a finished reply, as answered) can be prompted back as, or None where none
    can say it exactly: a stop string cut it, or a special token stands inside it."""
    ids = list(output_ids)
    if ids and ids[-1] in hidden:
        ids.pop()  # the stop token: the template writes its own end of the turn
    if not ids or not text or any(token in hidden for token in ids):
        return None
    return ids if decode(ids) == text else None


def spliced_prompt(messages: list[dict], render: Render, encode: Encode,
                   ids_for: IdsFor) -> tuple[list[int], int, bool]:
    """(the prompt, how many replies went in as their ids, whether the template wrote a kept reply
    otherwise and the whole prompt was tokenized from its text)."""
    found = {i: ids for i, message in enumerate(messages)
             if message.get("role") == "assistant" and isinstance(message.get("content"), str)
             and (ids := ids_for(message["content"])) is not None}
    text = render(messages)
    if not found:
        return encode(text), 0, False
    nonce = secrets.token_hex(8)
    markers = {i: f"\ue000kvd-reply-{nonce}-{i}\ue001" for i in found}
    try:
        marked = render([{**message, "content": markers[i]} if i in markers else message
                         for i, message in enumerate(messages)])
    except ValueError:  # (ChatTemplateError) the template takes the replies, not a marker: it reads them
        return encode(text), 0, True
    pieces, rest = [], marked
    for i in found:
        before, mark, rest = rest.partition(markers[i])
        if not mark or markers[i] in rest:
            return encode(text), 0, True
        pieces.append(before)
    if "".join(piece + messages[i]["content"] for piece, i in zip(pieces, found)) + rest != text:
        return encode(text), 0, True
    ids: list[int] = []
    for piece, i in zip(pieces, found):
        ids += encode(piece) + found[i]
    return ids + encode(rest), len(found), False

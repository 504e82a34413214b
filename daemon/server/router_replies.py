"""kvd router's memory of chat replies, so that its events view counts a conversation's next turn
as the replica that answered it will cache it.

A replica prompts a chat's next turn with its earlier replies as the ids the model made
(reply_ids.py, reply_splice.py), not their text tokenized again. The events view renders a chat
itself to find what each replica caches of it (route_question.local_ids); reading the replies as
text, its count stopped at the first reply that tokenizes otherwise, and it told a conversation's
home that it held less than it did.

So the router reads each chat answer it relays (`/v1/chat/completions`, whole or streamed): every
choice that ended by itself or at its length, with its text and `token_ids` (which a replica's
chat answers always carry), is kept by the same test the replica keeps it by (`reply_ids_of`: the
ids say the text exactly), in a `ReplyIds` of the router's own (`reply_ids_bytes`), by the tenant
the replica served it under and its tokenizer. The chat's next turn is then rendered with those
replies spliced in, as the replica renders it.

Not where prompts cross a KV transfer (disaggregated: both sides tokenize the text, as the replica
does), nor in the ask view (each replica renders the chat itself). A reply the replica let go of
for room and the router kept still counts: the router then says the home holds more than it does,
and the replica computes the rest, as for any estimate of the events view.
"""

from __future__ import annotations

import json
from typing import Callable

from .reply_ids import KEPT_ENDINGS

Keep = Callable[[list[int], str], None]  # (the choice's token_ids, its text)


def keeper(memory, tokenizer, tenant: str) -> Keep:
    """Keeps a relayed reply in `memory` (a ReplyIds) under `tenant` and `tokenizer`'s digest, where
    its ids say its text exactly."""
    def keep(output_ids: list[int], text: str) -> None:
        memory.remember_reply(tenant, tokenizer, output_ids, text)
    return keep


class ReplyWatch:
    """Reads one relayed chat answer and hands each finished choice's ids and text to `keep`.
    It never stands in the answer's way: what it cannot read it passes over."""

    def __init__(self, keep: Keep) -> None:
        self.keep = keep
        self.texts: dict[int, list[str]] = {}  # a streamed choice's text so far, by its index
        self.ids: dict[int, list[int]] = {}

    def answer(self, content: bytes) -> None:
        """A whole answer (not streamed)."""
        try:
            choices = json.loads(content).get("choices") or []
            for choice in choices:
                message = choice.get("message") or {}
                if choice.get("finish_reason") in KEPT_ENDINGS and isinstance(message.get("content"), str):
                    self._kept(list(choice.get("token_ids") or []), message["content"])
        except (ValueError, TypeError, AttributeError):
            return

    def events(self, raw: bytes) -> None:
        """Whole server-sent events of a streamed answer, as relayed."""
        for line in raw.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            try:
                for choice in json.loads(line[6:]).get("choices") or []:
                    self._chunk(choice)
            except (ValueError, TypeError, AttributeError):
                continue

    def _chunk(self, choice: dict) -> None:
        index = choice["index"]
        text = (choice.get("delta") or {}).get("content")
        if isinstance(text, str):
            self.texts.setdefault(index, []).append(text)
        self.ids.setdefault(index, []).extend(choice.get("token_ids") or [])
        if choice.get("finish_reason") is not None:
            text, ids = "".join(self.texts.pop(index, [])), self.ids.pop(index, [])
            if choice["finish_reason"] in KEPT_ENDINGS:
                self._kept(ids, text)

    def _kept(self, ids: list, text: str) -> None:
        if all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
            self.keep(ids, text)

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

A Responses answer (`/v1/responses`, a chat turn at the replica: a client that sends its whole
conversation each time, `store: false`, continues by these replies too) carries no token ids. So
`ResponseReplyWatch` reads its assistant messages' texts, as the next turn's input gives them back
(output_text parts joined by newlines), and once it is whole the router asks the replica that
answered for the ids it keeps of them (`POST /admin/reply-ids`), after the answer, off its path:
what the replica keeps, the router keeps. A replica that does not know the route (404) or does not
answer leaves the router counting those replies as text, as before.

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
        if token_ids(ids):
            self.keep(ids, text)


def token_ids(ids: list) -> bool:
    """Whether a list read from a replica's JSON is token ids (whole numbers, not booleans)."""
    return all(isinstance(token, int) and not isinstance(token, bool) for token in ids)


Ask = Callable[[list[str]], None]  # (the answer's assistant texts): ask the replica for their ids


def assistant_texts(response: dict) -> list[str]:
    """A Responses answer's assistant messages, each as its text parts joined by newlines (as the
    next turn's input reads them back: responses_input.py); none where a part is not text."""
    texts = []
    for item in response.get("output") or []:
        if not isinstance(item, dict) or item.get("type") != "message" or item.get("role") != "assistant":
            continue
        parts = item.get("content")
        if not isinstance(parts, list) or not parts or not all(
                isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str)
                for part in parts):
            continue
        text = "\n".join(part["text"] for part in parts)
        if text:
            texts.append(text)
    return texts


class ResponseReplyWatch:
    """Reads one relayed Responses answer and hands its assistant texts to `ask` once it is whole
    (the answer itself, or a stream's `response.completed` or `response.incomplete`). Like
    ReplyWatch, it never stands in the answer's way."""

    ENDS = ("response.completed", "response.incomplete")

    def __init__(self, ask: Ask) -> None:
        self.ask = ask

    def answer(self, content: bytes) -> None:
        """A whole answer (not streamed)."""
        try:
            response = json.loads(content)
        except ValueError:
            return
        if isinstance(response, dict) and response.get("status") in ("completed", "incomplete"):
            self._asked(response)

    def events(self, raw: bytes) -> None:
        """Whole server-sent events of a streamed answer, as relayed."""
        if b"response.completed" not in raw and b"response.incomplete" not in raw:
            return  # (a delta: read no further)
        for line in raw.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") in self.ENDS and isinstance(event.get("response"), dict):
                self._asked(event["response"])

    def _asked(self, response: dict) -> None:
        texts = assistant_texts(response)
        if texts:
            self.ask(texts)

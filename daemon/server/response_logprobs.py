"""The answer's own tokens' logprobs, for a response's `output_text` (the Responses API's
`include: ["message.output_text.logprobs"]`).

The chat gives logprobs for every output token: the thinking, the answer and the tool calls'
markup alike. A response's message gives those of its answer only, as OpenAI's does. Each token
goes where its text goes: its piece of the decoded text (decoded as the chat's stream decodes
it) is fed, one token at a time, through a chat shape of its own with the chat's parsers
(`ChatShape`: the reasoning and tool-call splitters), and a token whose text comes out as
answer text is the answer's. A splitter holds back text that could start a marker (`<` before
`<tool_call>`, the space before it) and lets it out with a later token; the answer then takes
the held tokens whose text holds what came out (found in their joined text, from the end), the
tokens before them went to a marker, and those after them stay held. A token that holds part of
a character (its piece is empty; it decodes alone to U+FFFD) goes with the one that completes
it. Tokens that went to the thinking or to a call are dropped, as are those whose text never
came out (the EOS).

Token by token and not chunk by chunk, so a whole reply and the same reply streamed in chunks
of any size give the same tokens.
"""

from __future__ import annotations

from typing import Sequence

from .incremental_text import IncrementalText

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them


class AnswerLogprobs:
    """Sorts a reply's tokens (with their chat logprobs entries) into the answer's and the rest,
    as they come (`add`); `take` gives the answer's that came since it was last called."""

    def __init__(self, shape, tokenizer) -> None:
        self.shape = shape  # a fresh chat.ChatShape with the chat's parsers: its splitters are this one's own
        self.text = IncrementalText(tokenizer.decode)
        self.token_text = tokenizer.token_text
        self.held: list[tuple[str, int, dict]] = []  # (piece, token, entry): tokens whose text has not come out
        self.ready: list[dict] = []  # the answer's entries, in order, not yet taken

    def add(self, token_ids: Sequence[int], entries: Sequence[dict], finished: bool = False) -> None:
        """The reply's next tokens and their entries (the chat's `logprobs.content`, one per token);
        `finished`: the reply has ended, so the splitters let out what they held."""
        for token, entry in zip(token_ids, entries, strict=True):
            piece = self.text.add(token)
            self.held.append((piece, token, entry))
            self._came_out(self.shape.chunk_choice(0, piece, [], None)["delta"])
        if finished:
            self._came_out(self.shape.chunk_choice(0, "", [], "stop")["delta"])
            self.held = []

    def take(self) -> list[dict]:
        ready, self.ready = self.ready, []
        return ready

    def _came_out(self, delta: dict) -> None:
        answer = delta.get("content") or ""
        if answer:
            self.ready += self._covering(answer)
        elif delta.get("reasoning_content") or delta.get("tool_calls"):
            self.held = []  # the thinking's, or a call's

    def _covering(self, answer: str) -> list[dict]:
        """The entries of the held tokens whose text came out as `answer`: where it stands in
        their text (the last place; the end, where a splitter changed it), with the parts of a
        character just before it. Those before it went to a marker; those after it stay held."""
        pieces = [piece for piece, _, _ in self.held]
        text = "".join(pieces)
        at = text.rfind(answer)
        if at < 0:
            at = max(0, len(text) - len(answer))
        end, offset, first, last = at + len(answer), 0, None, len(pieces) - 1
        for index, piece in enumerate(pieces):
            if first is None and offset + len(piece) > at:
                first = index
            if offset >= end:
                last = index - 1
                break
            offset += len(piece)
        first = len(pieces) if first is None else first
        while first > 0 and not pieces[first - 1] and self.token_text(self.held[first - 1][1]).endswith("\ufffd"):
            first -= 1
        taken, self.held = self.held[first:last + 1], self.held[last + 1:]
        return [entry for _, _, entry in taken]

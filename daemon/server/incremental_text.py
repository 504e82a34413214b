"""A growing token sequence's text, one token at a time (a stream's deltas)."""

from __future__ import annotations


class IncrementalText:
    """Text of a growing token sequence, decoding only a short window per token (not the whole
    output each time): the tokens since the last emitted text, with the ones before them as
    context, so tokenizers that space words by their neighbours decode as they would in full."""

    __slots__ = ("decode", "ids", "prefix", "read")

    def __init__(self, decode) -> None:
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

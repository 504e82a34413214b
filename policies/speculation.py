"""Speculative decoding by prompt lookup (vLLM's `ngram` method): plain data in, a draft out.

A sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked
up among its earlier tokens, prompt and output alike; the tokens that followed their latest
earlier occurrence are the draft. The engine computes the draft's rows beside the sequence's
next token in one step and keeps the longest run the model agrees with, plus the model's own
next token: a reply is the one it would have been without speculation, in fewer steps
when the text repeats itself (code edits, quoted documents, JSON keys, a looping small model).

`NgramIndex` keeps, per n-gram, where its latest occurrence's follower is, fed token by token,
so a proposal is a few dict lookups however long the context is.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

METHODS = ("ngram",)  # what kvd serves: a draft model or an EAGLE head needs weights of its own
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class NgramSpeculation:
    """`speculative_config` as kvd serves it (vLLM's keys)."""

    num_speculative_tokens: int  # draft tokens per step at most (k)
    prompt_lookup_max: int = 4  # the longest suffix looked up
    prompt_lookup_min: int = 2  # the shortest; a match of fewer tokens proposes nothing
    # no drafts while more than this many sequences run (vLLM's disable_by_batch_size): a full batch
    # is compute-bound, where verifying guesses costs more than it saves; None: always
    disable_by_batch_size: int | None = None
    method: str = "ngram"

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min,
                "disable_by_batch_size": self.disable_by_batch_size}


SPECULATION_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size")


def parse_speculation(value: Mapping[str, Any] | None) -> NgramSpeculation | None:
    """`speculative_config` (a mapping, from YAML or JSON) checked field by field; None or {}: off.
    Raises ValueError naming the field and the value."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a mapping such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                         f"got {value!r}")
    unknown = sorted(set(value) - set(SPECULATION_KEYS))
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), SPECULATION_KEYS, n=1)
        raise ValueError(f"{unknown[0]}: not a key kvd knows" + (f" (did you mean {near[0]}?)" if near else "")
                         + f"; it knows {', '.join(SPECULATION_KEYS)}")
    method = value.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"method: kvd serves ngram (prompt lookup) only, got {method!r}; a draft model, "
                         "EAGLE or MTP head needs weights kvd does not load")

    def count(name: str, low: int, high: int, default: int | None) -> int | None:
        got = value.get(name, default)
        if got is None:
            return None
        if not isinstance(got, int) or isinstance(got, bool) or not low <= got <= high:
            raise ValueError(f"{name}: must be an integer from {low} to {high}, got {got!r}")
        return got

    k = count("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, None)
    if k is None:
        raise ValueError("num_speculative_tokens: required (draft tokens per step, 1 to "
                         f"{MAX_SPECULATIVE_TOKENS})")
    high = count("prompt_lookup_max", 1, 64, 4)
    low = count("prompt_lookup_min", 1, 64, min(2, high))
    if low > high:
        raise ValueError(f"prompt_lookup_min: must be at most prompt_lookup_max ({high}), got {low}")
    return NgramSpeculation(k, high, low, count("disable_by_batch_size", 1, 1_000_000, None))


class NgramIndex:
    """One sequence's n-grams (n from `low` to `high`), each mapped to the position of the token
    that followed its latest occurrence. Fed the sequence's tokens in order (`extend`)."""

    __slots__ = ("low", "high", "tokens", "_next")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens, follows, low, high = self.tokens, self._next, self.low, self.high
        for token in token_ids:
            end = len(tokens)  # the n-grams that end just before this token are followed by it
            for n in range(low, min(high, end) + 1):
                follows[tuple(tokens[end - n:end])] = end
            tokens.append(token)

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix seen before; [] when none was."""
        tokens = self.tokens
        if limit < 1:
            return []
        for n in range(min(self.high, len(tokens)), self.low - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []

"""Speculative decoding by prompt lookup (vLLM's `ngram` method): plain data in, a draft out.

A sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked
up among its earlier tokens, prompt and output alike; the tokens that followed their latest
earlier occurrence are the draft. The engine computes the draft's rows beside the sequence's
next token in one step and keeps the longest run the model agrees with, plus the model's own
next token: a reply is the one it would have been without speculation, in fewer steps
when the text repeats itself (code edits, quoted documents, JSON keys, a looping small model).

`NgramIndex` holds a sequence's tokens as one int32 array, fed token by token; a proposal is a
vectorised search of it.
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
    """One sequence's tokens, searched for the latest earlier occurrence of their last n (n from
    `low` to `high`). Fed the sequence's tokens in order (`extend`).

    Held as one int32 array (4 bytes a token: a map of every n-gram took ~500 bytes a token, some
    16 MB for a 32k-token context, per sequence); a proposal compares the array with the last
    token once and then only the candidates it found, in C: about 70 µs at 32k tokens on a 2-core
    VM, 130 µs where the last token recurs every 50 tokens or so."""

    __slots__ = ("low", "high", "_tokens", "_size")

    def __init__(self, low: int, high: int) -> None:
        import numpy  # here, not at import: kvd router reads this module's config parser and needs none

        self.low, self.high = low, high
        self._tokens = numpy.empty(64, dtype=numpy.int32)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def tokens(self) -> list[int]:
        return self._tokens[:self._size].tolist()

    def extend(self, token_ids: Sequence[int]) -> None:
        size = self._size + len(token_ids)
        if size > len(self._tokens):  # doubling: amortised O(1) a token
            grown = self._tokens.copy()
            grown.resize(max(size, 2 * len(self._tokens)), refcheck=False)  # its tokens kept, zeros after
            self._tokens = grown
        self._tokens[self._size:size] = token_ids
        self._size = size

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix (at most `high`, at least `low`
        tokens) seen before, at its latest occurrence; [] when none was."""
        size, tokens = self._size, self._tokens
        if limit < 1 or size < 2:
            return []
        followers, matched = suffix_matches(tokens[:size - 1], tokens[:size], self.high)
        if not len(followers) or matched.max() < self.low:
            return []
        best = followers[matched == matched.max()][-1]  # the longest match, its latest occurrence
        return tokens[best:min(best + limit, size)].tolist()


def suffix_matches(corpus, tokens, high: int):
    """Where the last tokens of `tokens` (an int32 array) occur in `corpus`: `followers`, each j such
    that corpus[j - 1] is the last token, and `matched`, how many of the last tokens (up to `high`)
    end at corpus[j - 1], vectorised (NumPy arrays both)."""
    import numpy  # here, not at import: kvd router reads this module's config parser and needs none

    last = len(tokens) - 1
    followers = numpy.flatnonzero(corpus == tokens[last]) + 1
    matched = numpy.ones(len(followers), dtype=numpy.int64)
    for back in range(1, min(high, len(tokens))):
        at = followers - 1 - back
        still = (matched == back) & (at >= 0)
        still[still] = corpus[at[still]] == tokens[last - back]
        matched += still
    return followers, matched


class PredictionLookup:
    """A request's predicted reply (OpenAI's Predicted Outputs, `prediction`) as drafts for one of
    its samples. While the reply follows the prediction token for token, the draft is the
    prediction's next tokens. Where the reply leaves it (the part of a file an edit changes), the
    reply's last n tokens (n from `high` down to `low`) are looked up in the prediction, and the
    draft goes on from the longest match, its first occurrence after where the reply last followed
    the prediction (else its first anywhere): the reply has come back to the unchanged part."""

    __slots__ = ("low", "high", "_tokens", "_at", "_last", "_fed")

    def __init__(self, prediction: Sequence[int], low: int = 2, high: int = 4) -> None:
        import numpy

        self.low, self.high = low, high
        self._tokens = numpy.asarray(prediction, dtype=numpy.int32)
        self._at: int | None = 0  # the prediction's token the reply's next one would match; None: lost
        self._last = 0  # where the reply last followed the prediction
        self._fed = 0  # reply tokens read

    def propose(self, reply: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens of the prediction after `reply` (the sample's output so far; each call
        reads the tokens added since the last); [] where the reply is not found in it."""
        tokens = self._tokens
        for token in reply[self._fed:]:
            if self._at is not None and self._at < len(tokens) and tokens[self._at] == token:
                self._at += 1
                self._last = self._at
            else:
                self._at = None
        self._fed = len(reply)
        if self._at is None and len(reply) >= self.low:
            self._at = self._find(reply)
        if self._at is None or limit < 1:
            return []
        return tokens[self._at:self._at + limit].tolist()

    def _find(self, reply: Sequence[int]) -> int | None:
        import numpy

        tail = numpy.asarray(reply[-self.high:], dtype=numpy.int32)
        followers, matched = suffix_matches(self._tokens, tail, self.high)
        if not len(followers) or matched.max() < self.low:
            return None
        longest = followers[matched == matched.max()]
        ahead = longest[longest >= self._last]
        return int(ahead[0] if len(ahead) else longest[0])

"""Sampling parameters and a deterministic sampler.

Randomness for token t of sample i of a request is one number u in [0, 1) made from
SHA-256(seed, i, t) (`step_uniform`), so a sequence that is preempted and recomputed draws
exactly the tokens it would have drawn without the interruption, and `n > 1` samples differ.

The step's sampled rows are drawn together (`draw_tokens`): their scores as one [rows, vocab]
tensor on the logits' device, the temperature, min_p, top_k and top_p of each row as columns of
one small tensor, and the token taken where u falls in the row's cumulative probabilities (the
kept tokens in descending order where top_k or top_p cuts the row, else in vocabulary order). A
fixed number of tensor ops whatever the rows, and one copy of their token ids to the host. A cut
row's kept tokens are looked for among its 1,024 highest scores (`torch.topk`) before its whole
vocabulary is sorted, which only a row whose kept tokens may lie past them needs. Each
row drew alone before, on the host: its logits copied there first (a device sync each), then
half a dozen ops of its own, so a GPU batch of 256 sampled rows cost 256 copies of a vocabulary
of floats and some 1,500 small ops on the CPU every step (`kvctl bench sampler` compares the two).
What a row computes does not depend on the rows beside it, so a token drawn in a batch is the
token the same draw takes alone (a speculative draft's verdict draws its rows one at a time).
`sampling_scores` is the reference of which tokens a row keeps and with what weight.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Sequence

import torch


class RequestError(ValueError):
    """A request field is invalid; the message names the field and the value."""


class ContextLengthExceeded(RequestError):
    """The prompt plus max_tokens does not fit the model's positions."""


MAX_LOGPROBS = 20  # alternatives a request may ask for per token (vLLM's default limit)
# extra: (blocks, nonce) where a request hashes its prompt as its own from block `blocks` on (OpenAI's
# explicit prompt cache mode; PrefixHasher's `private`)
CACHE_PRIVATE = "cache_private"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: the engine draws one, so recomputation still matches
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # what daemon/engine/logits.py applies before a token is drawn (the defaults change nothing)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be drawn; () for any
    include_stop_str_in_output: bool = False  # vLLM's: a stop string that ended the text stays in it
    logprobs: int | None = None  # report each output token's logprob and this many alternatives
    # report each prompt token's logprob (after the first) and this many alternatives: every prompt
    # position is computed, none taken from the cache (Request.prompt_logprobs)
    prompt_logprobs: int | None = None
    # structured.Constraint: the shape the reply is held to (a JSON Schema, a regex, choices), or None
    constraint: object | None = None
    # OpenAI's Predicted Outputs: the tokens the reply is expected to be mostly made of (a file before
    # an edit), drafted ahead of each sample and kept where the model agrees (engine/speculative.py)
    prediction: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def cache_private(self) -> tuple[int, bytes] | None:
        """Where and how the request hashes its blocks as its own (extra[CACHE_PRIVATE]), or None."""
        return self.extra.get(CACHE_PRIVATE)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias or a minimum length applies (logits.adjust_logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.allowed_token_ids)

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, value, rule: str):
            raise RequestError(f"{name}: {rule}, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", self.temperature, "must be between 0 and 100")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            bad("n", self.n, "must be an integer from 1 to 64")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "must be an integer in [0, 2**63)")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                bad("stop_token_ids", token, f"must be token ids in [0, {vocab_size})")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                bad("stop", text, "must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                bad(name, value, "must be a number from -2 to 2")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", self.repetition_penalty, "must be a number in (0, 10]; 1 changes nothing")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "must be a number from 0 to 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be an integer from 0 to max_tokens ({self.max_tokens})")
        for token in self.allowed_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                bad("allowed_token_ids", token, f"must be token ids in [0, {vocab_size})")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                bad("logit_bias", token, f"keys must be token ids in [0, {vocab_size})")
            if not _number(bias) or not -100 <= bias <= 100:
                bad(f"logit_bias[{token}]", bias, "must be a number from -100 to 100")
        for token in self.prediction:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                bad("prediction", token, f"must be token ids in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                bad(name, value, f"must be an integer from 0 to {MAX_LOGPROBS}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf")


def step_uniform(seed: int, sample_index: int, step: int) -> float:
    """The number in [0, 1) that draws token `step` of sample `sample_index` of a request seeded
    `seed`: 53 bits of SHA-256 over the three (the same on every host and device)."""
    digest = hashlib.sha256(b"kvctl/sample/v2" + struct.pack("<QQQ", seed, sample_index, step)).digest()
    return (int.from_bytes(digest[:8], "little") >> 11) * 2.0 ** -53


@dataclass(frozen=True, slots=True)
class Draw:
    """One token to draw: under `params`, as token `step` of sample `sample_index` of a request
    seeded `seed` (step_uniform)."""

    params: SamplingParams
    seed: int
    sample_index: int
    step: int


def draw_tokens(scores: torch.Tensor, draws: Sequence[Draw], window: int | None = None) -> list[int]:
    """The token of each draw, from the same row of `scores` [rows, vocab] (logits, adjusted where
    a penalty or a grammar applies), in one batch of tensor ops on their device (module docstring):
    the argmax where the temperature is 0; else the token at the draw's step_uniform in the row's
    probabilities after its temperature, min_p, top_k and top_p (sampling_scores' kept tokens).
    `window`: how many of a cut row's highest scores are looked in first (WINDOW unless given; the
    vocabulary's size or more sorts every cut row whole, as `kvctl bench sampler`'s baseline)."""
    if len(draws) != scores.shape[0]:
        raise ValueError(f"draws: {len(draws)} for {scores.shape[0]} rows of scores")
    vocab = scores.shape[-1]
    tokens = [0] * len(draws)
    kinds = ["greedy" if d.params.temperature == 0 else
             "cut" if d.params.top_p < 1.0 or 0 < d.params.top_k < vocab else "whole" for d in draws]
    for kind in dict.fromkeys(kinds):  # greedy rows, rows top_k or top_p cut, the others: each in one go
        rows = [i for i, k in enumerate(kinds) if k == kind]
        part = scores if len(rows) == len(draws) else scores[torch.tensor(rows, device=scores.device)]
        if kind == "greedy":
            drawn = part.argmax(-1)
        else:
            table = torch.tensor([[d.params.temperature, d.params.min_p, d.params.top_k if 0 < d.params.top_k < vocab
                                   else vocab, d.params.top_p, step_uniform(d.seed, d.sample_index, d.step)]
                                  for d in (draws[i] for i in rows)], dtype=torch.float64)
            group = [draws[i].params for i in rows]  # (a filter no row of the group sets costs no pass)
            drawn = _drawn(part, table.to(scores.device, torch.float32), kind == "cut",
                           WINDOW if window is None else window, min_p=any(p.min_p > 0 for p in group),
                           top_k=any(0 < p.top_k < vocab for p in group))
        for i, token in zip(rows, drawn.tolist()):
            tokens[i] = token
    return tokens


WINDOW = 1024  # a cut row's kept tokens are looked for among its WINDOW highest first (_window_weights)


def _drawn(scores: torch.Tensor, table: torch.Tensor, cut: bool, window: int, *, min_p: bool = True,
           top_k: bool = True) -> torch.Tensor:
    """The token of each row of `scores` [rows, vocab] under its row of `table` (temperature,
    min_p, top_k, top_p, u): the first token whose cumulative weight passes u times the row's kept
    total. A row that top_k or top_p cuts is looked at in its `window` highest scores first
    (_window_weights); only a row whose kept tokens may lie past them is sorted whole (_weights).
    `min_p`, `top_k`: whether some row sets that filter (where none does, its passes are skipped)."""
    u = table[:, 4]
    if cut and window < scores.shape[-1]:
        probs, order, whole = _window_weights(scores, table, window, min_p=min_p, top_k=top_k)
        tokens = _picked(probs, order, u)
        if bool(whole.all()):  # (one sync: the ids come to the host next anyway)
            return tokens
        spilled = (~whole).nonzero()[:, 0]
        probs, order = _weights(scores[spilled], table[spilled], cut, min_p=min_p, top_k=top_k)
        return tokens.index_copy(0, spilled, _picked(probs, order, u[spilled]))
    probs, order = _weights(scores, table, cut, min_p=min_p, top_k=top_k)
    return _picked(probs, order, u)


def _picked(probs: torch.Tensor, order: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of weights `probs` (in `order`'s order of token ids, or the
    vocabulary's where None) at the fraction u of its total."""
    cumulative = torch.cumsum(probs, dim=-1)
    position = torch.searchsorted(cumulative, u[:, None] * cumulative[:, -1:], right=True)
    # (u x total may round up to the total: the last token that may be drawn, never one left out)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    position = torch.minimum(position, last)
    return (position if order is None else order.gather(-1, position))[:, 0]


def _window_weights(scores: torch.Tensor, table: torch.Tensor, window: int, *, min_p: bool = True,
                    top_k: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_weights for rows that top_k or top_p cut, found among each row's `window` highest scores
    (torch.topk) rather than by sorting the whole vocabulary: the weights [rows, window] and their
    token ids in the order the whole sort gives (descending, ties by id), and for each row whether
    they are the whole answer. The top_p mass is a fraction of the whole row's (its logsumexp), so
    a row's kept tokens and weights are those of the whole sort; a row is not whole where its kept
    tokens reach the window's end or its lowest score (a tie there may go on past the window), or
    its top_k is wider than the window. A model's next-token distribution keeps a few dozen to a
    few hundred tokens at a top_p of 0.9-0.95; a flat one spills and is sorted whole."""
    k, top_p, vocab = table[:, 2], table[:, 3], scores.shape[-1]
    scores = _tempered(scores, table, min_p)
    values, ids = torch.topk(scores, window, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # topk leaves ties in no set order: the whole sort's is by id
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_value)
    uncut = k >= vocab  # (k is the vocabulary's size where the row has no top_k)
    if top_k:
        kth = torch.where(uncut[:, None], float("-inf"), values.gather(-1, k.long().clamp(1, window)[:, None] - 1))
        in_k = values >= kth
        total = torch.logsumexp(scores.masked_fill(scores < kth, float("-inf")), dim=-1, keepdim=True)
    else:
        in_k = torch.ones_like(values, dtype=torch.bool)
        total = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(values - total).masked_fill(~in_k, 0.0)
    before = torch.cumsum(probs, dim=-1) - probs
    dropped = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    kept = (in_k & ~dropped & (values > float("-inf"))).sum(-1)  # the kept tokens are the first `kept`
    lowest_kept = values.gather(-1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    whole = (kept < window) & (lowest_kept > values[:, -1]) & (uncut | (k <= window))
    return probs.masked_fill(dropped, 0.0), ids, whole


def _weights(scores: torch.Tensor, table: torch.Tensor, cut: bool, *, min_p: bool = True,
             top_k: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's weights (unnormalised probabilities; 0 for a token left out) after sampling_scores'
    filters, in its order, on every row at once; with `cut` (some top_k or top_p), in descending
    order of score, with that order (token ids), else in vocabulary order and None."""
    k, top_p = table[:, 2], table[:, 3]
    scores = _tempered(scores, table, min_p)
    if not cut:
        return torch.softmax(scores, dim=-1), None
    # top_k, then top_p, on the sorted row (sampling_scores' steps); drawn in that order
    scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    if top_k:
        scores = scores.masked_fill(scores < scores.gather(-1, k.long()[:, None] - 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1.0), 0.0), order


def _tempered(scores: torch.Tensor, table: torch.Tensor, min_p: bool = True) -> torch.Tensor:
    """Each row's scores over its temperature, with the tokens its min_p leaves out (the first of
    sampling_scores' filters) at -inf; `min_p`: whether some row sets one (else no pass is made)."""
    scores = scores.float() / table[:, 0:1]
    if not min_p:
        return scores
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < table[:, 1:2] * probs.amax(-1, keepdim=True), float("-inf"))


def sampling_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores a token is drawn from: logits [vocab] over the temperature (> 0), with the
    tokens `min_p`, `top_k` and `top_p` leave out at -inf (vLLM's order). The reference, row by
    row, of what draw_tokens keeps (its tests hold it to this), and the baseline of `kvctl bench
    sampler`."""
    scores = logits.float().cpu() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < scores.shape[0]:
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, stable=True)  # (equal scores: by id)
        probs = torch.softmax(sorted_scores, dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        drop = cumulative - probs >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores

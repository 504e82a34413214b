"""Sampling parameters and a deterministic sampler.

Randomness for token t of sample i of a request comes from a generator seeded with
SHA-256(seed, i, t), so a sequence that is preempted and recomputed draws exactly the
tokens it would have drawn without the interruption, and `n > 1` samples differ.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import torch


class RequestError(ValueError):
    """A request field is invalid; the message names the field and the value."""


class ContextLengthExceeded(RequestError):
    """The prompt plus max_tokens does not fit the model's positions."""


MAX_LOGPROBS = 20  # alternatives a request may ask for per token (vLLM's default limit)


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
    extra: dict = field(default_factory=dict, compare=False)

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                bad(name, value, f"must be an integer from 0 to {MAX_LOGPROBS}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf")


def step_generator(seed: int, sample_index: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(b"kvctl/sample/v1" + struct.pack("<QQQ", seed, sample_index, step)).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, sample_index: int,
                 step: int) -> int:
    """One token from float32 logits [vocab] under `params`."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(sampling_scores(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=step_generator(seed, sample_index, step)))


def sampling_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores a token is drawn from: logits [vocab] over the temperature (> 0), with the
    tokens `min_p`, `top_k` and `top_p` leave out at -inf (vLLM's order)."""
    scores = logits.float().cpu() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < scores.shape[0]:
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        drop = cumulative - probs >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores

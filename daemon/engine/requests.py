"""Requests and their sequences as the engine tracks them, with per-request accounting."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .sampling import SamplingParams


class SeqStatus(str, Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and to be recomputed)
    PREFILL = "prefill"  # admitted; prompt (plus any earlier output) being written in chunks
    DECODE = "decode"  # generating one token per step
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival: float  # clock value when the request arrived
    admitted: float | None = None  # first admission of its first sequence
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # clock value of every output token
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    restored_tokens: int = 0  # prompt tokens brought back from a lower tier (part of cached_tokens)
    # put back on the device for its next admission and not yet counted: blocks installed while it
    # waited can be evicted again before it is admitted, so only what that admission hits counts
    installed_tokens: int = 0
    preemptions: int = 0
    # blocks its samples held at their finish (not cancelled), and of those reserved for output never written
    finished_blocks: int = 0
    reserved_unused_blocks: int = 0
    # (tokens, ttl) of each prefix its prompt cache breakpoints newly held as it finished (None: not yet)
    cache_written: list | None = None
    passed_over: int = 0  # requests that arrived after it and were admitted while it waited
    drafted_tokens: int = 0  # speculative draft tokens its samples' steps carried (engine/speculative.py)
    kept_draft_tokens: int = 0  # of those, the ones its samples took
    # of those, drafted from its prediction (params.prediction), and of them the ones kept: its usage's
    # accepted_prediction_tokens, and rejected_prediction_tokens the difference
    predicted_tokens: int = 0
    kept_predicted_tokens: int = 0
    # its prefix's fetch from disk or Redis while it waited (engine clock), if there was one
    prefetch_started: float | None = None
    prefetch_tokens: int = 0  # tokens that fetch set out to bring up
    prefetch_outcome: str | None = None  # how the wait ended (policies.tiering.PREFETCH_OUTCOMES)

    @property
    def time_queued(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class Sequence:
    seq_id: str  # "<request id>/<sample index>"
    request: "Request"
    index: int  # sample index within the request (0 .. n-1)
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    prefill_target: int = 0  # tokens to have in the cache before decoding (prompt + earlier output)
    finish_reason: str | None = None
    text_end: int | None = None  # output text is cut here when a stop string matched
    ever_computed: int = 0  # most tokens this sequence ever had in the cache (for recompute counts)
    prefix_keys: tuple | None = None  # (namespace, tokens hashed, block keys, hasher, ids): hashed once
    # per output token when the request asks for logprobs: (its logprob, ((id, logprob), ...) of the
    # most likely alternatives, best first)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    grammar: object | None = None  # structured.GrammarState: where the reply is in its shape, if it has one
    draft: list[int] = field(default_factory=list)  # this step's speculative tokens after its next one
    ngrams: object | None = None  # speculation's NgramIndex of its tokens, built at its first draft
    prediction: object | None = None  # its request's prediction as a PredictionLookup, built at its first draft
    drafted_from_prediction: bool = False  # whether this step's draft came from it

    @property
    def all_tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def tokens_between(self, begin: int, end: int) -> list[int]:
        """all_tokens[begin:end] without building all_tokens (a decode step needs one token)."""
        prompt = self.request.prompt_ids
        if end <= len(prompt):
            return prompt[begin:end]
        if begin >= len(prompt):
            return self.output_ids[begin - len(prompt):end - len(prompt)]
        return prompt[begin:] + self.output_ids[:end - len(prompt)]


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed (drawn when the client gave none)
    tenant: str
    priority: int
    order: int  # arrival order; with priority, the queue key
    metrics: RequestMetrics
    sequences: list[Sequence] = field(default_factory=list)
    rejected: str | None = None  # why the request was turned away, if it was
    # the limit that turned it away: never_fits, pinned_out, queue_full, tenant_limit or queue_timeout;
    # or engine_error: an engine step failed while it was in flight (Engine.fail)
    rejected_kind: str | None = None
    cancelled: bool = False
    reservation: object | None = None  # a rollout cohort's reservation policy; None: the engine's
    # with params.prompt_logprobs: for prompt tokens 1, 2, ... (the first has none) their logprob, their
    # rank in the model's distribution (1: the most likely) and the most likely alternatives
    prompt_logprobs: list[tuple[float, int, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    cohort: str | None = None  # "candidate" or "baseline" while a rollout runs
    # a speculative.SpeculationOverride: its rollout cohort's own speculative_config; None: the engine's
    speculation: object | None = None
    # the first block of the prefix found lost from the device at its turn, once a fetch of it was
    # judged (engine._fetch_what_was_lost): judged once, not again at every pass while it waits
    lost_judged: bytes | None = None
    # with params.constraint: each sample's start in its grammar, compiled when the request was
    # checked (Engine.prepare_grammars), taken by the sample at its first draw
    grammars: list | None = None
    adapter: str = ""  # the LoRA adapter that computes it (daemon/model/lora.py); "": the base model
    # that adapter as it was served when the request came (a LoraAdapter; None: the base model): a
    # reload that gives the name other weights, or takes it away, leaves the request on these
    lora: object | None = None
    # explicit prompt cache mode (params.cache_private): the keys of the blocks its finished samples
    # wrote as its own, dropped from the cache as its last sample finishes (Engine._finish)
    own_keys: list = field(default_factory=list, repr=False)
    # the prompt's token ids, each once, as a tensor on the device of the logits that read them (the
    # repetition penalty's, logits.adjust_logits): made at the first draw, not at every step
    prompt_vocab: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def prompt_tokens_on(self, device) -> torch.Tensor:
        """The prompt's token ids, each once, as an int64 tensor on `device` (made once)."""
        if self.prompt_vocab is None or self.prompt_vocab.device != torch.device(device):
            self.prompt_vocab = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.int64, device=device)
        return self.prompt_vocab

    def take_grammar(self, index: int):
        """Sample `index`'s start in its grammar, once (None: none was compiled for it)."""
        if self.grammars is None or index >= len(self.grammars):
            return None
        grammar, self.grammars[index] = self.grammars[index], None
        return grammar

    @property
    def scoring(self) -> bool:
        """Its prompt's logprobs are asked for and not all known: every prompt position is computed."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def finished(self) -> bool:
        return self.rejected is not None or self.cancelled or (
            bool(self.sequences) and all(s.status is SeqStatus.FINISHED for s in self.sequences)
            and len(self.sequences) == self.params.n)

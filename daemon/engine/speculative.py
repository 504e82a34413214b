"""Speculative decoding for the engine: who gets a draft, and what the model made of it.

With `speculative_config` set, a decoding sequence gets up to k draft tokens a step from
prompt lookup (policies/speculation.py); a request that gives a prediction of its reply
(OpenAI's Predicted Outputs) gets them from the prediction, with or without it. The engine
writes their slots at the sequence's tail (`KVCacheManager.append_draft`), computes them in the
same step as the sequence's next token,
and keeps the longest run of draft tokens equal to the model's own choice at each position,
plus the model's token after that run. The rejected tail's slots go back (`drop_draft`); the
accepted tokens are appended by id into the same slots, so their blocks are indexed only once
they hold what the model chose.

A reply is the one the model would have given without speculation: each kept token is the one
the sequence takes at its position without a draft (the argmax, or the seeded draw from its
adjusted and grammar-masked logits; Engine._verify), so greedy and sampled requests alike keep
their replies, and a sampled draft token is kept with the model's probability of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvctl.policies.speculation import NgramIndex, NgramSpeculation, PredictionLookup

from .requests import Sequence

# draft tokens a step drafts from a request's prediction at most, where no speculative_config sets k:
# a prediction is mostly right (the file an edit leaves mostly as it was), so its drafts run long
PREDICTION_TOKENS = 8


@dataclass(frozen=True)
class SpeculationOverride:
    """A request's own speculation in place of the engine's: a rollout cohort's `speculative_config`
    (daemon/server/rollouts.py); `config` None: no prompt-lookup drafts for it (a request's own
    prediction is drafted still)."""

    config: NgramSpeculation | None


@dataclass
class SpeculationStats:
    """Running totals for metrics and status (vLLM's spec_decode families count the same)."""

    drafts: int = 0  # sequences' steps that carried a draft
    draft_tokens: int = 0  # tokens proposed in them
    accepted_tokens: int = 0  # of those, the tokens the model agreed with
    emitted_tokens: int = 0  # tokens those steps gave (accepted plus the model's own next one)
    # accepted_per_position[i]: drafts whose token i was accepted
    accepted_per_position: list[int] = field(default_factory=list)

    def describe(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "emitted_tokens": self.emitted_tokens, "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None,
                "mean_accepted_length": round(self.emitted_tokens / self.drafts, 3) if self.drafts else None}


class Speculator:
    """Drafts for the engine's decoding sequences and the verdict on them."""

    def __init__(self, config: NgramSpeculation | None, prediction_max_batch: int | None = None) -> None:
        self.stats = SpeculationStats()  # prompt lookup's drafts (speculative_config)
        self.predicted = SpeculationStats()  # requests' predictions' drafts, apart: the callers chose them
        self.config: NgramSpeculation | None = None
        self.prediction_max_batch: int | None = None
        self.configure(config, prediction_max_batch)

    def configure(self, config: NgramSpeculation | None, prediction_max_batch: int | None = None) -> None:
        """Serve `config` from the next step on (None: no drafts), and draft requests' predictions
        only while at most `prediction_max_batch` sequences run (None: at any batch size); the
        totals carry on."""
        self.config = config
        self.prediction_max_batch = prediction_max_batch
        if config is not None:
            self._count_positions(self.stats, config.num_speculative_tokens)

    @staticmethod
    def _count_positions(stats: SpeculationStats, k: int) -> None:
        """Per-position totals for drafts of up to k tokens (zeros until one is kept there)."""
        per_position = stats.accepted_per_position
        per_position += [0] * (k - len(per_position))

    def draft(self, seq: Sequence, running: int, budget: int) -> list[int]:
        """Up to k draft tokens for `seq` (which decodes this step), within `budget` rows and its
        own max_tokens (the step gives at most one token more than the draft); [] for none. A
        request with a prediction drafts from it first (PREDICTION_TOKENS at most, or the
        speculation's k; none while more than `prediction_max_batch` sequences run), by prompt
        lookup where the reply is not found in it."""
        override = seq.request.speculation
        config = self.config if override is None else override.config
        seq.drafted_from_prediction = False
        if budget < 1 or (config is not None and config.disable_by_batch_size is not None
                          and running > config.disable_by_batch_size):
            return []
        left = seq.request.params.max_tokens - len(seq.output_ids) - 1
        prediction = seq.request.params.prediction
        if prediction and (self.prediction_max_batch is None or running <= self.prediction_max_batch):
            k = PREDICTION_TOKENS if config is None else config.num_speculative_tokens
            if seq.prediction is None:
                seq.prediction = PredictionLookup(prediction)
            draft = seq.prediction.propose(seq.output_ids, min(k, budget, left))
            if draft:
                seq.drafted_from_prediction = True
                return draft
        if config is None:
            return []
        limit = min(config.num_speculative_tokens, budget, left)
        if limit < 1:
            return []
        index = seq.ngrams
        if index is None or (index.low, index.high) != (config.prompt_lookup_min, config.prompt_lookup_max):
            index = seq.ngrams = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        total = len(seq.request.prompt_ids) + len(seq.output_ids)
        if len(index) < total:
            index.extend(seq.tokens_between(len(index), total))
        return index.propose(limit)

    def judge(self, draft: list[int], tokens: list[int], predicted: bool = False) -> int:
        """Count a drafted step: `tokens`, the ones it gave (its draft's leading run the sequence
        took, then the token after that run, if the sequence did not end on the run); returns the
        draft tokens kept. `predicted`: the draft came from the request's prediction, counted in
        `self.predicted`, not in prompt lookup's `self.stats`."""
        accepted = 0
        while accepted < min(len(draft), len(tokens)) and draft[accepted] == tokens[accepted]:
            accepted += 1
        stats = self.predicted if predicted else self.stats
        stats.drafts += 1
        stats.draft_tokens += len(draft)
        stats.accepted_tokens += accepted
        stats.emitted_tokens += len(tokens)
        self._count_positions(stats, accepted)  # a rollout cohort's k, or a prediction's, may be above the engine's
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
        return accepted

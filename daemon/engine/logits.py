"""What a request's sampling fields do to its next-token logits before a token is drawn.

OpenAI's and vLLM's fields, in vLLM's order:

0. `allowed_token_ids` (vLLM's): no other token can be drawn;
1. `min_tokens`: until the output has that many tokens, EOS (unless `ignore_eos`) and
   `stop_token_ids` cannot be drawn;
2. `logit_bias`: a fixed number added to named tokens' logits (100 all but forces a token,
   -100 all but bans it);
3. `repetition_penalty` (vLLM's and transformers'): every token seen in the prompt or the output
   has a positive logit divided by it, a negative one multiplied by it;
4. `frequency_penalty` and `presence_penalty` (OpenAI's): subtracted per occurrence in the output,
   and once for any occurrence.

`adjust_rows` applies them to the step's rows together, a fixed number of tensor ops whatever the
rows (the ids each row names copied to the logits' device at once); `adjust_logits` is its row-by-row
reference, which the tests hold it to, value for value.

Then the draw (sampling.draw_tokens, with the step's other rows) applies temperature, `min_p`,
`top_k` and `top_p` (`sampling_scores` is their row-by-row reference) and takes a token (or the
highest, when greedy). Each step depends only on the tokens so far, so a preempted and
recomputed sequence draws what it would have drawn. `logprobs` report the model's own distribution,
before any of this, as vLLM reports it by default.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy
import torch

from .sampling import SamplingParams


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int] | torch.Tensor,
                  output_ids: list[int], eos_ids: set[int]) -> torch.Tensor:
    """One sequence's next-token logits [vocab] after its penalties, bias and minimum length
    (float32, a new tensor: the batch's logits are left as they are). `prompt_ids`: the prompt's
    ids, or a tensor of them (each once, on the logits' device: Request.prompt_tokens_on, made once
    for the request, where a long prompt's set of ids made again at every step cost milliseconds)."""
    scores = logits.float().clone()
    device = scores.device  # the logits' (a GPU's, on CUDA): every index made here goes there
    if params.allowed_token_ids:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=device)
        kept = scores[allowed]
        scores.fill_(float("-inf"))
        scores[allowed] = kept
    if len(output_ids) < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if banned:
            scores[sorted(banned)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.int64, device=device)
        scores.index_add_(0, ids, torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32,
                                               device=device))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(scores.shape[0], dtype=torch.bool, device=device)
        seen[prompt_ids if isinstance(prompt_ids, torch.Tensor) else
             torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        if output_ids:
            seen[torch.tensor(output_ids, dtype=torch.int64, device=device)] = True
        penalty = params.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64, device=device), minlength=scores.shape[0])
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores


@dataclass(frozen=True, slots=True)
class RowTokens:
    """What one row's adjustments read: its request's `params`, the ids of its `output` so far, and,
    where a repetition penalty applies, its `prompt`'s ids, each once, on the logits' device
    (Request.prompt_tokens_on)."""

    params: SamplingParams
    output: Sequence[int]
    prompt: torch.Tensor | None = None


def adjust_rows(scores: torch.Tensor, rows: Sequence[RowTokens], eos_ids: set[int]) -> torch.Tensor:
    """`scores` [rows, vocab] (float32, a copy the caller owns: changed in place and returned) after
    each row's penalties, bias and minimum length, as adjust_logits does to one row, in its order.

    Each kind is a few ops for all the rows that ask for it, and touches only the scores of the ids
    they name (gathered, changed, put back): the ids go to the device in one copy per kind (the
    prompts' id tensors are there already), and an output's counts are made on the host, where its
    ids are. Only `allowed_token_ids` writes whole rows (-inf but for the ids it keeps)."""
    if scores.dim() != 2 or len(rows) != scores.shape[0]:
        raise ValueError(f"rows: {len(rows)} for scores of shape {tuple(scores.shape)}")
    device = scores.device
    limited = {i: r.params.allowed_token_ids for i, r in enumerate(rows) if r.params.allowed_token_ids}
    if limited:
        at = _pairs(limited, device)
        kept = scores[at]
        scores.index_fill_(0, torch.tensor(list(limited), device=device), float("-inf"))
        scores[at] = kept
    banned = {i: sorted(set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_ids)))
              for i, r in enumerate(rows) if len(r.output) < r.params.min_tokens}
    banned = {i: ids for i, ids in banned.items() if ids}
    if banned:
        scores[_pairs(banned, device)] = float("-inf")
    biased = {i: r.params.logit_bias for i, r in enumerate(rows) if r.params.logit_bias}
    if biased:
        at = _pairs({i: [token for token, _ in bias] for i, bias in biased.items()}, device)
        added = numpy.fromiter((b for bias in biased.values() for _, b in bias), dtype=numpy.float32)
        scores.index_put_(at, torch.from_numpy(added).to(device), accumulate=True)
    repeating = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if repeating:  # (an id in both the prompt and the output is written twice, the same number each time)
        at = _pairs({i: rows[i].output for i in repeating}, device, {i: rows[i].prompt for i in repeating})
        seen = scores[at]
        penalty = _per_row([r.params.repetition_penalty for r in rows], device)[at[0]]
        scores[at] = torch.where(seen > 0, seen / penalty, seen * penalty)
    counted = {i: r.output for i, r in enumerate(rows)
               if r.output and (r.params.frequency_penalty or r.params.presence_penalty)}
    if counted:
        at, count = _counted(counted, scores.shape[1], device)
        frequency = _per_row([r.params.frequency_penalty for r in rows], device)[at[0]]
        presence = _per_row([r.params.presence_penalty for r in rows], device)[at[0]]
        scores[at] = scores[at] - (frequency * count + presence)
    return scores


def _pairs(ids: dict[int, Sequence[int]], device, tensors: dict[int, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids), int64 on `device`: row i beside each id of ids[i] (all in one copy), then beside
    each id of tensors[i] (already on the device)."""
    lengths = [len(v) for v in ids.values()]
    host = numpy.empty((2, sum(lengths)), dtype=numpy.int64)
    host[0] = numpy.repeat(numpy.fromiter(ids, dtype=numpy.int64, count=len(ids)), lengths)
    host[1] = numpy.fromiter(itertools.chain.from_iterable(ids.values()), dtype=numpy.int64, count=host.shape[1])
    rows, tokens = torch.from_numpy(host).to(device).unbind(0)
    if tensors:
        sizes = [t.numel() for t in tensors.values()]
        rows = torch.cat([rows, torch.repeat_interleave(torch.tensor(list(tensors), device=device),
                                                        torch.tensor(sizes, device=device), output_size=sum(sizes))])
        tokens = torch.cat([tokens, *tensors.values()])
    return rows, tokens


def _counted(ids: dict[int, Sequence[int]], vocab: int, device
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Each (row, id) that row i's ids name, once, and how many times it does (float32), on
    `device`: counted on the host, where the ids are, and copied in one go."""
    lengths = [len(v) for v in ids.values()]
    keys = numpy.repeat(numpy.fromiter(ids, dtype=numpy.int64, count=len(ids)), lengths) * vocab
    keys += numpy.fromiter(itertools.chain.from_iterable(ids.values()), dtype=numpy.int64, count=keys.shape[0])
    keys, counts = numpy.unique(keys, return_counts=True)
    rows, tokens, count = torch.from_numpy(numpy.stack([keys // vocab, keys % vocab, counts])).to(device).unbind(0)
    return (rows, tokens), count.float()


def _per_row(values: list[float], device) -> torch.Tensor:
    """float32 [rows]: one number per row, gathered by the rows of a step's pairs."""
    return torch.tensor(values, dtype=torch.float32, device=device)

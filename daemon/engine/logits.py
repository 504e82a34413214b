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

Then the draw (sampling.draw_tokens, with the step's other rows) applies temperature, `min_p`,
`top_k` and `top_p` (`sampling_scores` is their row-by-row reference) and takes a token (or the
highest, when greedy). Each step depends only on the tokens so far, so a preempted and
recomputed sequence draws what it would have drawn. `logprobs` report the model's own distribution,
before any of this, as vLLM reports it by default.
"""

from __future__ import annotations

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

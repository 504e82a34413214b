"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), in torch.

A router scores every expert for each token; the token goes to its `top_k` experts, each a gated
MLP like a dense layer's, and their outputs are summed weighed by the router's softmax over the
experts chosen (renormalised to sum to 1 where the model says so). Only the experts some token
of the step chose run, each over its tokens only: a decode step of a few sequences runs a few.

Experts' weights are packed per layer as the dense MLP's are: `gate_up` [E, 2·I, hidden]
(gate rows, then up rows) and `down` [E, hidden, I]. The KV cache is untouched by any of
this: a MoE model's blocks are its attention's, as a dense model's are.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `top_k` experts and their weights: ([T, k] in x's dtype, [T, k] int64). The
    softmax runs in float32 over every expert's score; `normalise`: the chosen weights are
    divided by their sum."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def experts_mlp(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Σ over each row's chosen experts of weight · down(act(gate) · up): [T, hidden]. Each expert
    some row chose runs once, over those rows."""
    out = torch.zeros_like(x)
    chosen = experts.flatten()
    order = torch.argsort(chosen, stable=True)  # the (row, slot) pairs grouped by expert
    counts = torch.bincount(chosen, minlength=gate_up.shape[0]).tolist()
    top_k, start, flat_weights = experts.shape[1], 0, weights.flatten()
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // top_k
        gate, up = F.linear(x.index_select(0, rows), gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(activation(gate) * up, down[expert]) * flat_weights[pairs, None]
        out.index_add_(0, rows, y)
    return out


def moe_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            normalise: bool, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts' output for rows `x` [T, hidden] (route, then experts_mlp)."""
    weights, experts = route(x, router, top_k, normalise)
    return experts_mlp(x, weights, experts, gate_up, down, activation)


def moe_mlp_ref(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                normalise: bool, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The reference: every row through every expert, the unchosen weighed 0 (slow, plain)."""
    weights, experts = route(x, router, top_k, normalise)
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
        out += F.linear(activation(gate) * up, down[expert]) * dense[:, expert, None]
    return out

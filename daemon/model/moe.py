"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), in torch.

A router scores every expert for each token; the token goes to its `top_k` experts, each a gated
MLP like a dense layer's, and their outputs are summed weighed by the router's softmax over the
experts chosen (renormalised to sum to 1 where the model says so). Only the experts some token
of the step chose run, each over its tokens only: a decode step of a few sequences runs a few.
gpt-oss adds biases to the router and to each expert's projections, and its experts' activation
is a clamped SwiGLU (`clamped_swiglu`) where the others' is the model's `activation(gate) * up`
(`gated`): both are a `glu(gate, up)`.

On a GPU (`fused`), the experts run as two grouped GEMMs over every chosen expert at once
(kvctl.kernels.moe_experts, Triton): no expert-by-expert loop, and no device sync to learn which
experts were chosen.

gpt-oss's experts may be kept in MXFP4, as its checkpoints publish them (`gate_up_scales` and
`down_scales` given, `gate_up` and `down` their blocks: kvctl.kernels.mxfp4): the grouped GEMMs
decode each tile as they load it; without them each chosen expert is dequantised as it runs.
Either way a step computes with exactly the weights the checkpoint dequantises to.

Experts' weights are packed per layer as the dense MLP's are: `gate_up` [E, 2·I, hidden]
(gate rows, then up rows) and `down` [E, hidden, I]. The KV cache is untouched by any of
this: a MoE model's blocks are its attention's, as a dense model's are.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kvctl.kernels import moe_experts
from kvctl.kernels.mxfp4 import dequantise_mxfp4


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated(activation: Callable[[torch.Tensor], torch.Tensor]) -> Glu:
    """The gated MLP's activation of Llama's family: activation(gate) * up."""
    return lambda gate, up: activation(gate) * up


def clamped_swiglu(limit: float, alpha: float) -> Glu:
    """gpt-oss's experts' activation: the gate clamped to at most `limit`, up to +-`limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    return glu


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalise: bool,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `top_k` experts and their weights: ([T, k] in x's dtype, [T, k] int64). The
    softmax runs in float32 over every expert's score (`bias`: the router's, gpt-oss); `normalise`:
    the chosen weights are divided by their sum, which is the softmax over the top k's scores alone."""
    probs = torch.softmax(F.linear(x, router, bias).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def experts_mlp(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, glu: Glu, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, fused: bool = False,
                gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each row's chosen experts of weight · down(glu(gate, up)): [T, hidden]. Each expert
    some row chose runs once, over those rows; `gate_up_bias` [E, 2·I] and `down_bias` [E, hidden]
    are the experts' biases (gpt-oss), if any; `*_scales`: those weights kept in MXFP4 (see the
    module docstring). `fused`: through the Triton grouped GEMMs."""
    if fused:
        return moe_experts(x, weights, experts, gate_up, down, glu, gate_up_bias, down_bias,
                           gate_up_scales=gate_up_scales, down_scales=down_scales)
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
        gate, up = F.linear(x.index_select(0, rows), expert_weight(gate_up, gate_up_scales, expert, x.dtype),
                            _row(gate_up_bias, expert)).chunk(2, dim=-1)
        y = F.linear(glu(gate, up), expert_weight(down, down_scales, expert, x.dtype),
                     _row(down_bias, expert)) * flat_weights[pairs, None]
        out.index_add_(0, rows, y)
    return out


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def expert_weight(weight: torch.Tensor, scales: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's projection [out, in] in `dtype`: as stored, or dequantised from MXFP4 (`scales`)."""
    return weight[expert] if scales is None else dequantise_mxfp4(weight[expert], scales[expert], dtype)


def moe_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            normalise: bool, glu: Glu, router_bias: torch.Tensor | None = None,
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
            fused: bool = False, gate_up_scales: torch.Tensor | None = None,
            down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output for rows `x` [T, hidden] (route, then experts_mlp)."""
    weights, experts = route(x, router, top_k, normalise, router_bias)
    return experts_mlp(x, weights, experts, gate_up, down, glu, gate_up_bias, down_bias, fused,
                       gate_up_scales, down_scales)


def moe_mlp_ref(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                normalise: bool, glu: Glu, router_bias: torch.Tensor | None = None,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: every row through every expert, the unchosen weighed 0 (slow, plain)."""
    weights, experts = route(x, router, top_k, normalise, router_bias)
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        gate, up = F.linear(x, expert_weight(gate_up, gate_up_scales, expert, x.dtype),
                            _row(gate_up_bias, expert)).chunk(2, dim=-1)
        out += F.linear(glu(gate, up), expert_weight(down, down_scales, expert, x.dtype),
                        _row(down_bias, expert)) * dense[:, expert, None]
    return out

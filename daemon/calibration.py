"""Calibration of quantised KV caches: measure, derive scales, and judge the quality.

1. Run calibration prompts through the model with a float cache and record, per layer and
   per KV head, the absolute maxima of K (after RoPE) and V.
2. scale = absmax x margin / the format's largest value (the margin leaves room for outliers
   the prompts did not show; values beyond it clip).
3. On held-out prompts, bucketed by context length, compare the quantised cache with the
   float one: KL divergence of next-token distributions (mean over positions), top-1
   agreement, greedy match length until the first divergent token, and the change in
   perplexity of the prompt text.
4. Quantise one layer at a time to rank layers by sensitivity, and keep the most sensitive
   ones unquantised until the KL target (`max_kl`) is met.

Everything runs on scratch caches, never on the serving cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field

import torch

from kvctl.kernels import cache_dtype as to_torch_dtype
from kvctl.kernels.formats import QUANT_MAX

from .model.llama import ForwardBatch, LoadedModel

SCRATCH_BLOCK = 16


def builtin_prompts(tokenizer, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration, held-out) prompts: prose, code, repeated structure, mixed lengths."""
    rng = random.Random(seed)
    words = ("cache block token prefix tenant eviction policy latency memory request decode prefill "
             "attention layer scale format budget operator rollout replay").split()
    prose = lambda n: " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."  # noqa: E731
    code = lambda n: "\n".join(f"def f{i}(x):\n    return x * {i} + {rng.randint(0, 99)}" for i in range(n))  # noqa: E731
    table = lambda n: "\n".join(json.dumps({"id": i, "tier": rng.choice(["device", "host", "disk"]),  # noqa: E731
                                            "hits": rng.randint(0, 9)}) for i in range(n))
    texts = [prose(40), code(6), table(8), prose(200), code(30), table(40), prose(600)]
    held = [prose(60), code(10), table(12), prose(300), code(45), table(60), prose(900), code(120)]
    return [tokenizer.encode(t) for t in texts], [tokenizer.encode(t) for t in held]


def _scratch(loaded: LoadedModel, tokens: int, dtype=None, keep=(), scales=None):
    blocks = -(-tokens // SCRATCH_BLOCK) + 1
    return loaded.model.allocate_cache(blocks, SCRATCH_BLOCK, dtype, keep, scales), blocks


def _batch(ids: list[int], start: int, blocks: int, all_rows: bool,
           device: torch.device | str = "cpu") -> ForwardBatch:
    """One prompt (or one decode token) as a batch on the model's `device`."""
    n, end = len(ids), start + len(ids)

    def tensor(values, dtype=torch.int64):
        return torch.as_tensor(values, dtype=dtype, device=device)

    rows = torch.arange(n, device=device) if all_rows else tensor([n - 1])
    return ForwardBatch(input_ids=tensor(ids), positions=torch.arange(start, end, device=device),
                        slot_mapping=torch.arange(start, end, device=device),
                        query_start_loc=tensor([0, n], torch.int32), context_lens=tensor([end], torch.int32),
                        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                        logits_indices=rows, max_new_tokens=n, max_context=end)


def measure_absmax(loaded: LoadedModel, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and KV head: max |K| and max |V| over every token of every prompt. [L, H] each."""
    c = loaded.config
    k_max = torch.zeros(c.num_layers, c.num_kv_heads)
    v_max = torch.zeros(c.num_layers, c.num_kv_heads)

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_max[layer] = torch.maximum(k_max[layer], k.float().abs().amax(dim=(0, 2)).cpu())
        v_max[layer] = torch.maximum(v_max[layer], v.float().abs().amax(dim=(0, 2)).cpu())

    for ids in prompts:
        caches, blocks = _scratch(loaded, len(ids))
        loaded.model.forward(_batch(ids, 0, blocks, False, loaded.model.device), caches, observer=observe)
    return k_max, v_max


def derive_scales(k_max: torch.Tensor, v_max: torch.Tensor, dtype_name: str,
                  margin: float) -> dict[int, tuple[list[float], list[float]]]:
    """scale = absmax x margin / format max (a floor keeps silent heads usable)."""
    limit = QUANT_MAX[to_torch_dtype(dtype_name)]
    out = {}
    for layer in range(k_max.shape[0]):
        k = (k_max[layer].clamp_min(1e-6) * margin / limit).tolist()
        v = (v_max[layer].clamp_min(1e-6) * margin / limit).tolist()
        out[layer] = (k, v)
    return out


def _logits(loaded: LoadedModel, ids: list[int], dtype, keep, scales) -> torch.Tensor:
    caches, blocks = _scratch(loaded, len(ids), dtype, keep, scales)
    return loaded.model.forward(_batch(ids, 0, blocks, True, loaded.model.device), caches)


def _greedy(loaded: LoadedModel, ids: list[int], steps: int, dtype, keep, scales) -> list[int]:
    caches, blocks = _scratch(loaded, len(ids) + steps, dtype, keep, scales)
    logits = loaded.model.forward(_batch(ids, 0, blocks, False, loaded.model.device), caches)
    out = [int(logits[0].argmax())]
    for _ in range(steps - 1):
        logits = loaded.model.forward(_batch([out[-1]], len(ids) + len(out) - 1, blocks, False, loaded.model.device),
                                      caches)
        out.append(int(logits[0].argmax()))
    return out


@dataclass
class SliceMetrics:
    max_context: int
    prompts: int = 0
    kl: float = 0.0  # mean KL(float || quantised) over positions and prompts
    top1_agreement: float = 0.0
    greedy_match_len: float = 0.0  # mean tokens generated identically before the first divergence
    ppl_delta: float = 0.0  # relative change of perplexity on the prompt text
    _sums: dict = field(default_factory=lambda: {"kl": 0.0, "top1": 0.0, "match": 0.0, "ppl": 0.0})

    def as_dict(self) -> dict:
        return {"max_context": self.max_context, "prompts": self.prompts, "kl": self.kl,
                "top1_agreement": self.top1_agreement, "greedy_match_len": self.greedy_match_len,
                "ppl_delta": self.ppl_delta}


def compare(loaded: LoadedModel, ids: list[int], dtype, keep, scales, greedy_tokens: int) -> dict:
    """KL, top-1 agreement, perplexity change and greedy match length for one prompt."""
    ref = _logits(loaded, ids, None, (), None)
    quant = _logits(loaded, ids, dtype, keep, scales)
    p_log, q_log = torch.log_softmax(ref, -1), torch.log_softmax(quant, -1)
    kl = float((p_log.exp() * (p_log - q_log)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == quant.argmax(-1)).float().mean())
    targets = torch.tensor(ids[1:], device=ref.device)
    nll_ref = float(-p_log[:-1].gather(1, targets[:, None]).mean())
    nll_q = float(-q_log[:-1].gather(1, targets[:, None]).mean())
    ppl_delta = math.exp(nll_q) / math.exp(nll_ref) - 1.0 if len(ids) > 1 else 0.0
    match = 0
    if greedy_tokens:
        a = _greedy(loaded, ids, greedy_tokens, None, (), None)
        b = _greedy(loaded, ids, greedy_tokens, dtype, keep, scales)
        while match < len(a) and a[match] == b[match]:
            match += 1
    return {"kl": kl, "top1": top1, "ppl": ppl_delta, "match": match}


def evaluate(loaded: LoadedModel, held_out: list[list[int]], dtype_name: str, scales, keep: tuple[int, ...],
             slices: list[int], greedy_tokens: int) -> list[SliceMetrics]:
    dtype = to_torch_dtype(dtype_name)
    results = [SliceMetrics(s) for s in sorted(slices)]
    for ids in held_out:
        bucket = next((r for r in results if len(ids) <= r.max_context), None)
        if bucket is None or len(ids) < 2:
            continue
        m = compare(loaded, ids, dtype, keep, scales, greedy_tokens)
        bucket.prompts += 1
        for key in ("kl", "top1", "match", "ppl"):
            bucket._sums[key] += m[key]
    for r in results:
        if r.prompts:
            r.kl = r._sums["kl"] / r.prompts
            r.top1_agreement = r._sums["top1"] / r.prompts
            r.greedy_match_len = r._sums["match"] / r.prompts
            r.ppl_delta = r._sums["ppl"] / r.prompts
    return [r for r in results if r.prompts]


def layer_sensitivity(loaded: LoadedModel, prompts: list[list[int]], dtype_name: str, scales) -> list[float]:
    """Mean KL with only layer i quantised, for every layer."""
    dtype = to_torch_dtype(dtype_name)
    layers = loaded.config.num_layers
    out = []
    for layer in range(layers):
        keep = tuple(i for i in range(layers) if i != layer)
        out.append(sum(compare(loaded, ids, dtype, keep, scales, 0)["kl"] for ids in prompts) / len(prompts))
    return out


def recommend_keep(loaded: LoadedModel, prompts: list[list[int]], dtype_name: str, scales,
                   sensitivity: list[float], max_kl: float,
                   max_keep_fraction: float = 0.5) -> tuple[tuple[int, ...], float]:
    """Keep the most sensitive layers unquantised, one at a time, until mean KL <= max_kl.

    NOTE: at most `max_keep_fraction` of the layers stay unquantised; past that the format
    buys too little, and the candidate is reported as missing its target instead."""
    dtype = to_torch_dtype(dtype_name)
    order = sorted(range(len(sensitivity)), key=lambda i: -sensitivity[i])
    keep: tuple[int, ...] = ()
    for count in range(int(len(order) * max_keep_fraction) + 1):
        keep = tuple(sorted(order[:count]))
        kl = sum(compare(loaded, ids, dtype, keep, scales, 0)["kl"] for ids in prompts) / len(prompts)
        if kl <= max_kl:
            return keep, kl
    return keep, kl


def prompts_digest(prompts: list[list[int]]) -> str:
    digest = hashlib.sha256(b"kvctl/calibration-prompts/v1")
    for ids in prompts:
        digest.update(json.dumps(ids).encode())
    return digest.hexdigest()[:16]

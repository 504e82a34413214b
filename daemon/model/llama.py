"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4, Gemma 2 and 3, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss) that reads and writes the paged KV cache.

One forward pass takes a flat batch of new tokens from many sequences (prefill chunks and
decodes mixed), writes their K/V into the cache at `slot_mapping`, and attends through the
block tables: Triton kernels on CUDA, the batched torch path (`paged_attention_torch`,
checked against the references) elsewhere.

    input_ids, positions, slot_mapping   [num_new_tokens]
    query_start_loc                      [num_seqs + 1]  sequence s owns rows qsl[s]:qsl[s+1]
    context_lens                         [num_seqs]      cached prefix + new tokens
    block_tables                         [num_seqs, max_blocks]
    logits_indices                       rows whose next-token logits are wanted
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F

from kvctl.kernels import (is_quantised, paged_attention_torch, paged_decode_attention, paged_prefill_attention,
                           plan_attention, write_kv)
from kvctl.kernels.formats import to_cache

from .config import ModelConfig, ModelError
from .generation_config import GenerationConfig, merged_eos, read_generation_config
from .lora import lora_delta
from .moe import clamped_swiglu, gated, moe_mlp
from .rope import attention_factor, inverse_frequencies
from .tokenizer import Tokenizer
from .weights import expert_names, load_weights, model_revision

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LayerCache:
    """One layer's paged K/V storage, with its per-KV-head scales when quantised."""

    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor  # same shape and dtype as k
    k_scale: torch.Tensor | None = None  # [num_kv_heads] float32, quantised formats only
    v_scale: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    logits_indices: torch.Tensor  # [K] int64
    max_new_tokens: int  # most new tokens of any sequence (1 means a pure decode batch)
    max_context: int  # longest context
    # block id -> what the block holds (its prefix-index key) or None: lets the CPU attention plan
    # keep copies of cached blocks across steps (see kernels.torch_paged.plan_decode)
    block_content: Callable[[int], Hashable | None] | None = None
    # LoRA adapters (daemon/model/lora.py) and the token rows each serves, an int64 tensor or None
    # for every row; None: the base model for every row
    lora: list[tuple[Any, torch.Tensor | None]] | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """RMSNorm in one of the ways transformers computes it (ModelConfig.norm_style): "llama"
    (normalised in float32, cast back, times `weight`), "gemma" (times 1 + `weight`, in float32,
    then cast back) or "float32" (times `weight` in float32, then cast back: gpt-oss)."""
    if style != "llama":
        x32 = x.float()
        scale = 1.0 + weight.float() if style == "gemma" else weight.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rope_table(inv_freq: torch.Tensor, positions: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """cos and sign-folded sin for every position: [positions, 2, D] in `dtype`, times `scale`
    (YaRN's attention factor; 1 otherwise).

    Row p holds cos(p·f) and (-sin, +sin)(p·f) over the two halves, so that rotate-half RoPE
    is x·cos + swap_halves(x)·sin_signed. Precomputed once (as vLLM's cos/sin cache); a step
    gathers its positions' rows."""
    freqs = torch.arange(positions, dtype=torch.int64, device=inv_freq.device)[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = inv_freq.shape[0]
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return torch.stack(((emb.cos() * scale).to(dtype), (signed * scale).to(dtype)), dim=1)


ROPE_ROWS = 4096  # positions the RoPE table covers at first; it grows with the contexts served


class RopeTable:
    """One RoPE (base `theta`, `scaling`: rope.py's llama3, linear or yarn) as a `rope_table`,
    grown (doubling, up to `limit` positions) to cover the contexts served: a 128k-position model
    does not hold a table for contexts it is never asked to serve."""

    def __init__(self, head_dim: int, theta: float, scaling, limit: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        self.scale = attention_factor(scaling)
        self.limit, self.dtype = limit, dtype
        self.table = rope_table(self.inv_freq, min(ROPE_ROWS, limit), dtype, self.scale)

    def rows(self, positions: int) -> torch.Tensor:
        """The table, grown to cover `positions` if it does not."""
        if positions > self.table.shape[0]:
            rows = min(max(positions, 2 * self.table.shape[0]), self.limit)
            self.table = rope_table(self.inv_freq, rows, self.dtype, self.scale)
        return self.table


@dataclass
class LayerWeights:
    """One decoder layer's weights, packed so a step makes one GEMM for Q, K and V and one for
    the gate and up projections."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2·Hkv)·D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    # the dense MLP, or a MoE layer's shared expert (Qwen2-MoE); None in a MoE layer without one
    gate_up: torch.Tensor | None  # [2·intermediate, hidden]
    down: torch.Tensor | None
    qk_norm: torch.Tensor | None = None  # Qwen3: [H + Hkv, D], q_norm's weight on each Q head, k_norm's on each K head
    attn_out_norm: torch.Tensor | None = None  # Gemma: normalises the attention's output before the residual
    mlp_out_norm: torch.Tensor | None = None  # Gemma: normalises the MLP's output before the residual
    # a MoE layer (daemon/model/moe.py): the router [E, hidden], the experts packed as the dense MLP
    # is ([E, 2·I, hidden] and [E, hidden, I]), and the shared expert's gate [1, hidden]
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # the output projection's bias (`attention_bias`)
    sinks: torch.Tensor | None = None  # gpt-oss: [H] float32, each head's sink logit
    # gpt-oss: the router's bias [E] and the experts' biases ([E, 2·I] gate then up, [E, hidden])
    router_bias: torch.Tensor | None = None
    experts_gate_up_bias: torch.Tensor | None = None
    experts_down_bias: torch.Tensor | None = None
    # gpt-oss's experts kept in MXFP4 (kvctl.kernels.mxfp4): experts_gate_up and experts_down are then
    # their blocks ([E, 2·I, hidden/32, 16], [E, hidden, I/32, 16] uint8) and these their scales
    experts_gate_up_scales: torch.Tensor | None = None
    experts_down_scales: torch.Tensor | None = None


def pack_layers(config: ModelConfig, weights: dict[str, torch.Tensor]) -> list[LayerWeights]:
    """Move each layer's checkpoint tensors out of `weights` into packed LayerWeights (the
    originals are dropped, so packing does not double the memory they take)."""
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        take = weights.pop
        bias = None
        if i in config.moe_layers and config.stacked_experts:  # gpt-oss: stacked, gate and up interleaved
            mlp = _pack_stacked_experts(i, take)
        elif i in config.moe_layers:  # router, experts, and a shared expert's gate_up and down (or None)
            mlp = _pack_experts(config, i, take)
        elif config.fused_projections:  # Phi-3 stores them packed as kvd packs them: [q; k; v] and [gate; up]
            mlp = {"gate_up": take(p + "mlp.gate_up_proj.weight"), "down": take(p + "mlp.down_proj.weight")}
        else:
            mlp = {"gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                   "down": take(p + "mlp.down_proj.weight")}
        if config.fused_projections:
            qkv = take(p + "self_attn.qkv_proj.weight")
        else:
            qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if p + "self_attn.q_proj.bias" in weights:
                bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        qk_norm = None
        if config.qk_norm:  # one weight per row of the [T, H + Hkv, D] view that RoPE rotates
            qk_norm = torch.cat([take(p + "self_attn.q_norm.weight").expand(config.num_heads, -1),
                                 take(p + "self_attn.k_norm.weight").expand(config.num_kv_heads, -1)])
        # Gemma's post_attention_layernorm normalises the attention's output; the norm before its
        # MLP is pre_feedforward_layernorm (Llama's post_attention_layernorm is that one)
        sandwich = config.gemma_norms
        attn_out_norm = take(p + "post_attention_layernorm.weight") if sandwich else None
        mlp_norm = take(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"))
        mlp_out_norm = take(p + "post_feedforward_layernorm.weight") if sandwich else None
        o_bias = take(p + "self_attn.o_proj.bias") if config.o_bias else None
        sinks = take(p + "self_attn.sinks").float() if config.attention_sinks else None  # the kernels take float32
        layers.append(LayerWeights(take(p + "input_layernorm.weight"), qkv, bias, take(p + "self_attn.o_proj.weight"),
                                   mlp_norm, qk_norm=qk_norm, attn_out_norm=attn_out_norm, mlp_out_norm=mlp_out_norm,
                                   o_bias=o_bias, sinks=sinks, **mlp))
    return layers


def _pack_stacked_experts(layer: int, take) -> dict[str, torch.Tensor | None]:
    """gpt-oss's MoE layer, packed as kvd packs any: the router and its bias, the experts'
    gate_up [E, 2·I, hidden] (the checkpoint's [E, hidden, 2·I] transposed, its interleaved gate
    and up columns put gate first, then up) and down [E, hidden, I], with their biases alike.
    Experts kept in MXFP4 (`load_weights`) come as blocks and scales whose rows are already the
    output features: their rows are put in the same order, which moves no value of a group."""
    p = f"model.layers.{layer}.mlp."
    gate_up_scales = take(p + "experts.gate_up_proj_scales", None)
    down_scales = take(p + "experts.down_proj_scales", None)
    gate_up = take(p + "experts.gate_up_proj")
    gate_up = gate_up if gate_up_scales is not None else gate_up.transpose(1, 2)  # rows gate 0, up 0, gate 1...
    gate_up_bias = take(p + "experts.gate_up_proj_bias")
    packed = {"router": take(p + "router.weight"), "router_bias": take(p + "router.bias"),
              "experts_gate_up": gate_first(gate_up), "experts_gate_up_bias": gate_first(gate_up_bias),
              "experts_down_bias": take(p + "experts.down_proj_bias"), "gate_up": None, "down": None,
              "shared_gate": None, "experts_down_scales": down_scales,
              "experts_gate_up_scales": None if gate_up_scales is None else gate_first(gate_up_scales)}
    del gate_up, gate_up_bias
    down = take(p + "experts.down_proj")
    packed["experts_down"] = down if down_scales is not None else down.transpose(1, 2).contiguous()
    return packed


def gate_first(interleaved: torch.Tensor) -> torch.Tensor:
    """[E, 2·I, ...] rows gate 0, up 0, gate 1, up 1... as gate 0..I-1, then up 0..I-1."""
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)


def _pack_experts(config: ModelConfig, layer: int, take) -> dict[str, torch.Tensor | None]:
    """A MoE layer's MLP, packed: its router, its experts stacked ([E, 2·I, hidden] gate and up,
    [E, hidden, I] down), and `gate_up`/`down`/`shared_gate` for a shared expert (else None)."""
    p = f"model.layers.{layer}.{config.experts_prefix}"
    gate_up, down = [], []
    for expert in range(config.num_experts):
        gate, up, down_name = expert_names(config, layer, expert)
        gate_up.append(torch.cat([take(gate), take(up)]))
        down.append(take(down_name))
    packed = {"router": take(p + "gate.weight"), "experts_gate_up": torch.stack(gate_up),
              "experts_down": torch.stack(down), "gate_up": None, "down": None, "shared_gate": None}
    del gate_up[:], down[:]  # (each expert's own tensors go as the stacks take their place)
    if config.shared_expert_intermediate_size:
        packed["gate_up"] = torch.cat([take(p + "shared_expert.gate_proj.weight"),
                                       take(p + "shared_expert.up_proj.weight")])
        packed["down"] = take(p + "shared_expert.down_proj.weight")
        packed["shared_gate"] = take(p + "shared_expert_gate.weight")
    return packed


@dataclass
class StagedWeights:
    """Another checkpoint's weights of the served model, packed as the model serves them and held
    in host memory (pinned for a GPU) until `LlamaModel.copy_weights_in` copies them into the
    tensors served: a GPU then never holds two sets of weights (daemon/server/weights_ops.py)."""

    names: dict[str, torch.Tensor]  # the tensors outside the layers (embeddings, final norm, lm_head)
    layers: list[LayerWeights]


def stage_weights(config: ModelConfig, weights: dict[str, torch.Tensor], pin: bool) -> StagedWeights:
    """Pack `weights` (checkpoint names, in host memory; packing takes them out of the dict) for
    `copy_weights_in`; `pin`: in page-locked memory, so that the copy to a GPU runs at the bus's rate."""
    layers = pack_layers(config, weights)
    if pin:  # a tensor at a time, each pageable copy dropped as its pinned one takes its place
        for name in list(weights):
            weights[name] = weights[name].pin_memory()
        for layer in layers:
            for f in fields(layer):
                if (t := getattr(layer, f.name)) is not None:
                    setattr(layer, f.name, t.pin_memory())
    return StagedWeights(weights, layers)


def _layer_tensors(layer: LayerWeights) -> list[torch.Tensor]:
    return [t for t in (getattr(layer, f.name) for f in fields(layer)) if t is not None]


def _layer_to(layer: LayerWeights, device: torch.device, copy: bool = False) -> LayerWeights:
    return LayerWeights(**{f.name: None if (t := getattr(layer, f.name)) is None else t.to(device, copy=copy)
                           for f in fields(layer)})


class LlamaModel:
    """The decoder's forward pass; weights are plain tensors keyed by their checkpoint names."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self._take_weights(weights)
        self._host_weights: tuple[dict, list] | None = None  # the weights' copy in host memory while offloaded
        limit = config.max_position_embeddings
        # one RoPE for every layer; Gemma 3's sliding layers rotate with their own
        self.ropes = [RopeTable(config.head_dim, config.rope_theta, config.rope_scaling, limit, dtype, device)]
        if config.sliding_rope_theta is not None:
            self.ropes.append(RopeTable(config.head_dim, config.sliding_rope_theta, config.sliding_rope_scaling,
                                        limit, dtype, device))
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping  # Gemma 2 caps each attention score
        self.use_triton = device.type == "cuda"
        self.windows = config.layer_windows()  # each layer's span: its sliding window, or None (full attention)
        self.layer_rope = [1 if len(self.ropes) > 1 and window is not None else 0 for window in self.windows]
        # what the dense MLP and a MoE layer's experts compute from their gate and up (daemon/model/moe.py)
        self.glu = gated(ACTIVATIONS[config.activation])
        self.experts_glu = (self.glu if config.swiglu_limit is None
                            else clamped_swiglu(config.swiglu_limit, config.swiglu_alpha))
        # the CPU attention plans of the last forward pass, one per span (full, sliding), reused while they fit
        self._plans: dict[int | None, Any] = {}

    def _take_weights(self, weights: dict[str, torch.Tensor], layers: list[LayerWeights] | None = None) -> None:
        """Serve `weights` (checkpoint names; each layer's are packed out of it unless `layers` are)."""
        self.w = weights
        self.layers = pack_layers(self.config, weights) if layers is None else layers
        self.lm_head = weights["model.embed_tokens.weight"] if self.config.tie_word_embeddings \
            else weights["lm_head.weight"]

    # ---- the weights' memory while kvd sleeps (daemon/server/sleep_ops.py) ------------------------
    @property
    def weights_released(self) -> bool:
        return not self.layers

    def weight_bytes(self) -> int:
        """Bytes the weights take where they serve from (each storage once: tied embeddings share one)."""
        seen: dict[int, int] = {}
        for tensor in [*self.w.values(), *(t for layer in self.layers for t in _layer_tensors(layer))]:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def release_weights(self, keep_host_copy: bool) -> int:
        """Let go of the weights; returns the bytes they took. `keep_host_copy`: copy them to host
        memory first (waking copies them back); else waking reads the checkpoint again. Released
        already: a host copy goes too unless `keep_host_copy` (0 bytes)."""
        if self.weights_released:
            if not keep_host_copy:
                self._host_weights = None
            return 0
        held = self.weight_bytes()
        if keep_host_copy:
            host = torch.device("cpu")  # (a copy even from the CPU: the originals go, as from a GPU)
            self._host_weights = ({name: t.to(host, copy=True) for name, t in self.w.items()},
                                  [_layer_to(layer, host, copy=True) for layer in self.layers])
        self.w, self.layers, self.lm_head, self._plans = {}, [], None, {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return held

    def restore_weights(self) -> int:
        """Serve again from the host copy `release_weights` kept; returns the bytes they take."""
        if self._host_weights is None:
            raise ModelError("weights: released without a host copy; read the checkpoint again to restore them")
        names, layers = self._host_weights
        return self.use_weights({n: t.to(self.device) for n, t in names.items()},
                                [_layer_to(layer, self.device) for layer in layers])

    def copy_weights_in(self, staged: StagedWeights) -> int:
        """Serve `staged` from the next forward pass by copying it into the tensors served now, in
        place (their memory, and so any address taken of it, stays): the device holds one set of
        weights throughout. Every shape is checked before anything is copied (ModelError naming
        the first that differs: nothing changed). Returns the bytes copied."""
        if self.weights_released:
            raise ModelError("weights: released while kvd sleeps; wake them before new weights are copied in")
        if len(staged.layers) != len(self.layers):
            raise ModelError(f"weights: {len(staged.layers)} layers staged, {len(self.layers)} served")
        pairs = [(name, self.w[name], staged.names.get(name)) for name in self.w]
        for i, (old, new) in enumerate(zip(self.layers, staged.layers)):
            pairs += [(f"layer {i} {f.name}", getattr(old, f.name), getattr(new, f.name)) for f in fields(old)]
        for name, served, new in pairs:
            if (served is None) != (new is None) or (served is not None and served.shape != new.shape):
                raise ModelError(f"weights: {name} is {None if new is None else tuple(new.shape)} in the new "
                                 f"weights, {None if served is None else tuple(served.shape)} served")
        copied = 0
        for _, served, new in pairs:
            if served is not None:
                served.copy_(new, non_blocking=True)
                copied += new.nbytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the staged host memory may go once this returns
        self._host_weights, self._plans = None, {}
        return copied

    def use_weights(self, weights: dict[str, torch.Tensor], layers: list[LayerWeights] | None = None) -> int:
        """Serve `weights` from the next forward pass (checkpoint names, on this device in this
        dtype: the checkpoint read again, or another one's), any host copy dropped; returns the
        bytes they take."""
        self._take_weights(weights, layers)
        self._host_weights, self._plans = None, {}
        return self.weight_bytes()

    def allocate_cache(self, num_blocks: int, block_size: int, cache_dtype: torch.dtype | None = None,
                       keep_layers: tuple[int, ...] = (),
                       scales: dict[int, tuple[list[float], list[float]]] | None = None) -> list[LayerCache]:
        """Per-layer caches in `cache_dtype` (default: the model's); layers in `keep_layers` stay in
        the model dtype. Quantised layers get their scales from `scales` (unit scales if absent)."""
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        caches = []
        for layer in range(c.num_layers):
            dtype = self.dtype if cache_dtype is None or layer in keep_layers else cache_dtype
            entry = LayerCache(torch.zeros(shape, dtype=dtype, device=self.device),
                               torch.zeros(shape, dtype=dtype, device=self.device))
            if is_quantised(dtype):
                k_scale, v_scale = (scales or {}).get(layer, ([1.0] * c.num_kv_heads, [1.0] * c.num_kv_heads))
                entry.k_scale = torch.tensor(k_scale, dtype=torch.float32, device=self.device)
                entry.v_scale = torch.tensor(v_scale, dtype=torch.float32, device=self.device)
            caches.append(entry)
        return caches

    def cache_bytes_per_block(self, block_size: int, cache_dtype: torch.dtype | None = None,
                              keep_layers: tuple[int, ...] = ()) -> int:
        c = self.config
        total = 0
        for layer in range(c.num_layers):
            dtype = self.dtype if cache_dtype is None or layer in keep_layers else cache_dtype
            element = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
            total += 2 * block_size * c.num_kv_heads * c.head_dim * element
        return total

    def _write(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
        """Store the step's new K/V: the Triton kernel on CUDA; on the CPU the same rows through
        plain indexing (the engine hands only slots it allocated, so the reference's checks are
        left to `write_kv_ref`)."""
        if self.use_triton:
            write_kv(k, v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale)
            return
        rows = cache.k.shape[0] * cache.k.shape[1]
        cache.k.view(rows, *cache.k.shape[2:])[slots] = to_cache(k, cache.k.dtype, cache.k_scale)
        cache.v.view(rows, *cache.v.shape[2:])[slots] = to_cache(v, cache.v.dtype, cache.v_scale)

    def forget_plans(self) -> None:
        """Drop the CPU attention plans kept from the last step (they hold copies and slices of
        cached blocks): the cache's blocks are about to change under them."""
        self._plans = {}

    def _attention(self, q, cache: LayerCache, batch: ForwardBatch, plan=None, window: int | None = None,
                   sinks: torch.Tensor | None = None):
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, window=window, softcap=self.softcap, sinks=sinks)
        if self.use_triton and batch.max_new_tokens == 1:
            return paged_decode_attention(q, cache.k, cache.v, batch.block_tables, batch.context_lens,
                                          scale=self.scale, max_context=batch.max_context, **scales)
        if self.use_triton:
            return paged_prefill_attention(q, cache.k, cache.v, batch.block_tables, batch.query_start_loc,
                                           batch.context_lens, scale=self.scale,
                                           max_new_tokens=batch.max_new_tokens, **scales)
        return paged_attention_torch(q, cache.k, cache.v, batch.block_tables, batch.query_start_loc,
                                     batch.context_lens, scale=self.scale, max_new_tokens=batch.max_new_tokens,
                                     plan=plan, **scales)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights, i: int, lora) -> torch.Tensor:
        """Layer `i`'s MLP over rows `x`: the dense gated MLP (with its LoRA terms), or a MoE
        layer's routed experts plus any shared expert, gated by a sigmoid (daemon/model/moe.py)."""
        routed = None
        if layer.router is not None:
            c = self.config
            routed = moe_mlp(x, layer.router, layer.experts_gate_up, layer.experts_down, c.experts_per_token,
                             c.norm_topk_prob, self.experts_glu, layer.router_bias, layer.experts_gate_up_bias,
                             layer.experts_down_bias, fused=self.use_triton,
                             gate_up_scales=layer.experts_gate_up_scales, down_scales=layer.experts_down_scales)
            if layer.gate_up is None:
                return routed
        gate_up = F.linear(x, layer.gate_up)
        if lora and routed is None:  # (adapters adapt a dense MLP only: lora.py refuses a MoE layer's)
            lora_delta(gate_up, x, lora, i, "gate_up")
        act = self.glu(*gate_up.chunk(2, dim=-1))
        out = F.linear(act, layer.down)
        if lora and routed is None:
            lora_delta(out, act, lora, i, "down")
        if routed is None:
            return out
        return routed + torch.sigmoid(F.linear(x, layer.shared_gate)) * out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[LayerCache],
                observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Next-token logits (float32) for the rows in `batch.logits_indices`.

        `observer(layer, k, v)` sees each layer's new K (after RoPE) and V before they are
        written (calibration measures them)."""
        c, w = self.config, self.w
        heads, kv_heads, dim, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        style = c.norm_style
        hidden = F.embedding(batch.input_ids, w["model.embed_tokens.weight"])
        if c.embedding_scale is not None:  # Gemma: scaled in the model's dtype, as transformers does
            hidden = hidden * torch.tensor(c.embedding_scale, dtype=hidden.dtype, device=hidden.device)
        rotations = []  # each RoPE's cos and signed sin at the step's positions: [T, 1, D] each
        for rope in self.ropes:
            rows = rope.rows(batch.max_context)[batch.positions]
            rotations.append((rows[:, None, 0], rows[:, None, 1]))
        half = dim // 2
        tokens = hidden.shape[0]
        lora = batch.lora
        plans: dict[int | None, Any] = {}
        if not self.use_triton and kv_caches:  # grouped once per span, used by its layers (and by the next step)
            for window in dict.fromkeys(self.windows):
                plans[window] = plan_attention(batch.block_tables, batch.query_start_loc, batch.context_lens,
                                               kv_caches[0].k.shape[1], batch.max_new_tokens, self._plans.get(window),
                                               batch.block_content, window=window)
            self._plans = plans
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps, style)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            if lora:
                lora_delta(qkv, x, lora, i, "qkv")
            qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            if layer.qk_norm is not None:  # Qwen3, Gemma 3: each head of Q and K normalised before RoPE
                qk = rms_norm(qk, layer.qk_norm, eps, style)
            cos, sin = rotations[self.layer_rope[i]]
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin  # RoPE on Q and K at once
            q, k = qk[:, :heads].contiguous(), qk[:, heads:]
            v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
            cache = kv_caches[i]
            if observer is not None:
                observer(i, k, v)
            self._write(k, v, cache, batch.slot_mapping)
            attn = self._attention(q, cache, batch, plans.get(self.windows[i]), self.windows[i], layer.sinks).reshape(
                tokens, heads * dim)
            out = F.linear(attn, layer.o_proj, layer.o_bias)
            if lora:  # each projection's output gains its adapters' terms on their rows
                lora_delta(out, attn, lora, i, "o")
            if layer.attn_out_norm is not None:
                out = rms_norm(out, layer.attn_out_norm, eps, style)
            hidden = hidden + out
            x = rms_norm(hidden, layer.post_norm, eps, style)
            out = self._mlp(x, layer, i, lora)
            if layer.mlp_out_norm is not None:
                out = rms_norm(out, layer.mlp_out_norm, eps, style)
            hidden = hidden + out
        last = rms_norm(hidden[batch.logits_indices], w["model.norm.weight"], eps, style)
        logits = F.linear(last, self.lm_head).float()
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    revision: str  # digest of config.json and the weight files
    path: Path
    # generation_config.json: its EOS tokens are in config.eos_token_ids already; its sampling
    # defaults are for requests that leave those fields out
    generation: GenerationConfig = GenerationConfig()
    # LoRA adapters served beside the model, by the name a request's `model` gives (daemon/model/lora.py)
    adapters: dict = field(default_factory=dict)


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: str | None = None, generation_config: str = "auto",
               dequantise_experts: bool = False) -> LoadedModel:
    """Load config, weights and tokenizer from a Hugging Face style directory, with the EOS tokens
    and sampling defaults of its generation_config.json (`generation_config`: auto, none or a
    path; daemon/model/generation_config.py). An MXFP4 checkpoint's experts stay in MXFP4 unless
    `dequantise_experts` (ModelConfig.dequantise_experts)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"model: {str(model_dir)!r} is not a directory")
    config = ModelConfig.load(model_dir)
    generation = read_generation_config(model_dir, generation_config)
    config = replace(config, eos_token_ids=merged_eos(config.eos_token_ids, generation),
                     dequantise_experts=dequantise_experts and config.quantisation == "mxfp4")
    _check_sampling_defaults(generation, config.vocab_size)
    dtype_name = dtype or config.dtype
    if dtype_name not in TORCH_DTYPES:
        raise ModelError(f"dtype: {dtype_name!r} unsupported; use one of {', '.join(TORCH_DTYPES)}")
    device = torch.device(device)
    weights = load_weights(model_dir, config, TORCH_DTYPES[dtype_name], device)
    tokenizer = Tokenizer(model_dir)
    model = LlamaModel(config, weights, device, TORCH_DTYPES[dtype_name])
    return LoadedModel(config, model, tokenizer, model_revision(model_dir), model_dir, generation)


def _check_sampling_defaults(generation: GenerationConfig, vocab_size: int) -> None:
    """A default no request could use stops the load, naming the file, not every request."""
    from kvctl.daemon.engine.sampling import RequestError, SamplingParams

    try:
        SamplingParams(max_tokens=1, **generation.sampling).validate(vocab_size)
    except RequestError as exc:
        raise ModelError(f"{generation.source}: {exc}") from None
    for token in generation.eos_token_ids:
        if token >= vocab_size:
            raise ModelError(f"{generation.source}: eos_token_id {token} is outside the vocabulary of {vocab_size}")

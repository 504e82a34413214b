"""paged_decode_attention: one new query token per sequence against its paged K/V.

Algorithm: flash-decoding. The context of each sequence is cut into partitions
of `partition_size` tokens; program (seq, kv_head, split) computes attention of
every query head sharing `kv_head` (GQA) over one partition with an online
softmax and writes an unnormalised partial result with its running max and sum.
A second kernel merges the partials by log-sum-exp. Small batches with long
contexts thus still fill the GPU. When one partition covers every context (the
batch alone fills the GPU), the first kernel writes the output itself: no partial
buffers, no second launch (vLLM's paged attention v1 against v2).

Layouts::

    q             [num_seqs, num_heads, head_dim]
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables  [num_seqs, max_blocks] int32   logical block -> physical block
    context_lens  [num_seqs] int32               tokens to attend (>= 1)
    window        int or None                    a sliding-window layer: the last `window` tokens only
    sinks         [num_heads] float32 or None    attention sinks (gpt-oss): a logit per query head that
                                                 joins each softmax's sum and adds no value
    k/v_scale     [num_kv_heads] float32         quantised caches only
    out           [num_seqs, num_heads, head_dim]

With a window, the partitions cover only the window's tokens, so the tokens before it are never
read and a long context costs what its window costs. A sink joins the first split's softmax as a
key of that score whose value is zero, so the merge needs nothing more. Tokens are read a tile (`DecodeLaunch.tile`)
at a time; a token's address is computed from its own block-table entry, so any block size works
and the tables may be scattered. Offsets are 64-bit.
"""

from dataclasses import dataclass, replace

import torch

from ._triton import interpreting, tl, triton
from .checks import (CheckedOnce, check, check_cache, check_device, check_query, check_scales, check_sinks,
                     check_softcap, check_tensor, check_window, next_power_of_2)
from .formats import from_cache
from .launch import TritonLaunch, check_tile
from .paged_tile import head_scales, load_kv_tile, online_softmax_step

TILE_N = 64  # tokens per inner step (the H200 sweep's choice; docs/results)


@dataclass(frozen=True)
class DecodeLaunch(TritonLaunch):
    """How the decode kernel is launched on a GPU (the CPU interpreter ignores warps and stages).

    tile             tokens read per inner step (a power of two, at least 16)
    num_warps        warps per program
    num_stages       software-pipeline depth of the token loop (None: Triton's default)
    programs_per_sm  programs the context split aims for, per multiprocessor
    fp16_dot         quantised caches: 1 multiplies in float16 (the query converted once, K/V
                     from their format in one step), 0 in the query's dtype, None (default)
                     float16 for fp8_e4m3 only: on the H200 that was 13-17% faster for
                     fp8_e4m3 and 13-15% slower for int8 (docs/results). float16 holds every
                     fp8 and int8 value exactly; a query past its range (65504) would overflow.
    direct_write     1 (default): when one split covers every context, the partial kernel writes
                     the output and the merge launch is skipped; 0 always merges. Not yet timed on
                     a GPU: the direct variant takes 152 registers a thread where the split one
                     takes 115 on sm_90 with Triton 3.9 (128 and 127 with Triton 3.6).

    `scripts/sweep-kernels` times alternatives on a GPU; the defaults are what it chose.
    """

    tile: int = TILE_N
    num_warps: int = 4
    num_stages: int | None = None
    programs_per_sm: int = 2
    fp16_dot: int | None = None
    direct_write: int = 1

    def __post_init__(self) -> None:
        check_tile("tile", self.tile)
        self.check_warps_and_stages()
        check(self.programs_per_sm >= 1, "launch.programs_per_sm",
              f"must be at least 1, got {self.programs_per_sm}")
        check(self.fp16_dot in (None, 0, 1), "launch.fp16_dot", f"must be 0 or 1, got {self.fp16_dot}")
        check(self.direct_write in (0, 1), "launch.direct_write", f"must be 0 or 1, got {self.direct_write}")

    def fitted(self, rows: int, head_dim: int, dot_f32: bool) -> "DecodeLaunch":
        """This launch with the tile halved until one step's tiles fit `STEP_TILE_BYTES`."""
        tile = self.tile
        while tile > 16 and not step_fits(rows, tile, head_dim, dot_f32):
            tile //= 2
        return self if tile == self.tile else replace(self, tile=tile)


DEFAULT_LAUNCH = DecodeLaunch()

STEP_TILE_BYTES = 80 << 10


def step_fits(rows: int, tile: int, head_dim: int, dot_f32: bool) -> bool:
    """Whether a program's query rows and one K and one V tile stay within `STEP_TILE_BYTES`
    (they sit in shared memory for tl.dot). The bound keeps every kernel inside the 99 KiB
    block of sm_86/sm_89: at float32 and head_dim 256, a 64-token decode tile needed 148 KiB
    and 64 prefill rows 136 KiB (`python -m kvctl.kernels.compile_check --arch sm_89`)."""
    element = 4 if dot_f32 else 2
    return (rows + 2 * tile) * next_power_of_2(head_dim) * element <= STEP_TILE_BYTES


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    k_scale_ptr,  # [num_kv_heads] float32 (QUANT only)
    v_scale_ptr,  # [num_kv_heads] float32 (QUANT only)
    sinks_ptr,  # [num_heads] float32 (SINKS only)
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_max_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, head_dim] (DIRECT only)
    sm_scale,
    stride_qs, stride_qh,
    stride_os, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bt,
    partition_size, block_size, head_dim, group_size, num_splits, head_chunks,
    window,  # tokens a sliding-window layer attends to (SLIDING only)
    softcap,  # scores are capped at +-softcap (SOFTCAP only)
    GROUP_P: tl.constexpr,  # query heads per program (of one KV head), padded to >= 16 for tl.dot
    DIM_P: tl.constexpr,  # head_dim padded to a power of two
    TILE: tl.constexpr,  # tokens per step
    QUANT: tl.constexpr,
    FP16_DOT: tl.constexpr,  # multiply in float16 (quantised caches; see DecodeLaunch.fp16_dot)
    DOT_F32: tl.constexpr,  # multiply in float32 (float32 queries, or the CPU interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32, the default otherwise
    DIRECT: tl.constexpr,  # one split: normalise and write `out` here (the part buffers are unused)
    SLIDING: tl.constexpr,  # attend to the last `window` tokens only
    SOFTCAP: tl.constexpr,  # cap each score: softcap * tanh(score / softcap) (Gemma 2)
    SINKS: tl.constexpr,  # each head's sink logit joins the softmax's sum (gpt-oss)
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // head_chunks
    chunk = tl.program_id(1) % head_chunks
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if SLIDING:  # the splits cover the window, from its first token
        start = tl.maximum(context_len - window, 0) + split * partition_size
    else:
        start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    group = chunk * GROUP_P + tl.arange(0, GROUP_P)  # this program's query heads within the group
    dims = tl.arange(0, DIM_P)
    heads = kv_head * group_size + group
    head_mask = group < group_size
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP16_DOT:
        q = q.to(tl.float16)  # quantised K/V then convert to float16 in one step
    elif DOT_F32:
        q = q.to(tl.float32)
    row_max = tl.full([GROUP_P], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    if SINKS:  # the first split starts from the sink: a key of score `sink` and value zero
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0)
        row_max = tl.where(split == 0, sink, row_max)
        row_sum = tl.where(split == 0, row_sum + 1.0, row_sum)
    qk_scale, out_scale = head_scales(sm_scale, kv_head, k_scale_ptr, v_scale_ptr, QUANT)
    for tile_start in range(start, end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        token_mask = tokens < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, tokens,
                            token_mask, kv_head, dims, dim_mask, stride_cb, stride_co, stride_ch,
                            block_size)
        row_max, row_sum, acc = online_softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), token_mask[None, :], qk_scale, row_max, row_sum, acc,
            PRECISION, False, softcap, SOFTCAP)

    if DIRECT:  # what the merge makes of a single split: the output over its own sum
        out = acc * (out_scale / row_sum)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    else:
        part = (seq * (tl.num_programs(1) // head_chunks) * group_size + heads) * num_splits + split
        tl.store(part_max_ptr + part, row_max, mask=head_mask)
        tl.store(part_sum_ptr + part, row_sum, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc * out_scale,
                 mask=head_mask[:, None] & dim_mask[None, :])


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_max_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_os, stride_oh,
    num_heads, num_splits, head_dim,
    SPLITS_P: tl.constexpr,
    DIM_P: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, DIM_P)
    split_mask = splits < num_splits
    base = (seq * num_heads + head) * num_splits
    maxes = tl.load(part_max_ptr + base + splits, mask=split_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=split_mask, other=0.0)
    top = tl.max(maxes, 0)
    weights = tl.where(split_mask & (maxes > float("-inf")), tl.exp(maxes - top), 0.0)
    total = tl.sum(weights * sums, 0)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * head_dim + dims[None, :],
                  mask=split_mask[:, None] & (dims[None, :] < head_dim), other=0.0)
    out = tl.sum(weights[:, None] * acc, 0) / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


def _check(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks=None) -> tuple[int, bool]:
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    group = check_query(q, num_kv_heads, head_dim)
    check_sinks(sinks, q.shape[1], q.device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    if block_tables.shape[0] != q.shape[0]:
        check(False, "block_tables", f"{block_tables.shape[0]} rows for {q.shape[0]} sequences")
    if context_lens.shape[0] != q.shape[0]:
        check(False, "context_lens", f"{context_lens.shape[0]} lengths for {q.shape[0]} sequences")
    return group, check_scales(k_cache, k_scale, v_scale)


QUERY_TILE_BYTES = 16 << 10  # one program's query tile stays within this (it sits in shared memory for tl.dot)


def _heads_per_program(group: int, head_dim: int, dot_f32: bool) -> int:
    """Query heads of one KV head that a program takes together: all of them (padded to the
    16 rows tl.dot needs) unless their tile would pass `QUERY_TILE_BYTES`; then the group is
    split across programs. Grouped-query ratios of 64 with float32 and head_dim 256 asked for
    139 KiB of shared memory as one program and 100.3 KiB as two, past the 99 KiB of an sm_89
    block (`python -m kvctl.kernels.compile_check --arch sm_89`)."""
    padded = max(16, next_power_of_2(group))
    row_bytes = next_power_of_2(head_dim) * (4 if dot_f32 else 2)
    return max(16, min(padded, next_power_of_2(QUERY_TILE_BYTES // row_bytes + 1) // 2))


def choose_partition(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                     launch: DecodeLaunch = DEFAULT_LAUNCH) -> int:
    """Tokens per split: enough programs to fill the device, never below one tile."""
    tile = launch.tile
    if device.type == "cuda":
        target_programs = launch.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target_programs = 8  # the interpreter runs programs one by one: keep splits few
    splits = max(1, min(-(-target_programs // max(num_seqs * num_kv_heads, 1)),
                        -(-max_context // tile), 64))
    per_split = -(-max_context // splits)
    return max(tile, -(-per_split // tile) * tile)


@dataclass(frozen=True)
class _DecodePlan:
    """What a decode call decides from its arguments' shapes, dtypes, strides and devices alone
    (checked once): the same for every layer of a step, so the launcher computes it once."""

    group: int
    quantised: bool
    device: torch.device
    heads_per_program: int
    head_chunks: int
    launch: DecodeLaunch
    partition_size: int
    num_splits: int
    direct: bool
    fp16_dot: bool
    dot_f32: bool


_PLANS = CheckedOnce()


def _plan(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks, max_context: int,
          partition_size: int | None, launch: DecodeLaunch) -> _DecodePlan:
    """The checked arguments' launch plan, made once per distinct metadata (`CheckedOnce`)."""
    return _PLANS.get((q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks),
                      (max_context, partition_size, launch, QUERY_TILE_BYTES, STEP_TILE_BYTES),  # and the budgets
                      lambda: _make_plan(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks,
                                         max_context, partition_size, launch))


def _make_plan(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks, max_context: int,
               partition_size: int | None, launch: DecodeLaunch) -> _DecodePlan:
    """Check every argument (naming a bad one) and plan the launch."""
    group, quantised = _check(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks)
    device = check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                           "context_lens": context_lens, "k_scale": k_scale, "v_scale": v_scale})
    num_seqs, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check(max_context >= 1, "context_lens", "every sequence needs at least one token")
    dot_f32 = q.dtype == torch.float32 or interpreting()
    heads_per_program = _heads_per_program(group, head_dim, dot_f32)
    launch = launch.fitted(heads_per_program, head_dim, dot_f32)
    if partition_size is None:
        partition_size = choose_partition(num_seqs, num_kv_heads, max_context, device, launch)
    if partition_size <= 0 or partition_size % launch.tile:
        check(False, "partition_size", f"must be a positive multiple of {launch.tile}, got {partition_size}")
    num_splits = -(-max_context // partition_size)
    return _DecodePlan(
        group=group, quantised=quantised, device=device, heads_per_program=heads_per_program,
        head_chunks=-(-group // heads_per_program), launch=launch, partition_size=partition_size,
        num_splits=num_splits, direct=num_splits == 1 and launch.direct_write == 1,
        fp16_dot=quantised and q.dtype != torch.float32 and (
            launch.fp16_dot == 1 or (launch.fp16_dot is None and k_cache.dtype == torch.float8_e4m3fn)),
        dot_f32=dot_f32)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_context: int | None = None,
                           partition_size: int | None = None,
                           launch: DecodeLaunch = DEFAULT_LAUNCH, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache (Triton). See the module docstring for layouts.

    `max_context` (the largest context length) saves a device sync when the caller knows it.
    `launch` sets tile, warps, stages and split target (`DecodeLaunch`).
    `window`: a sliding-window layer's span; each sequence attends to its last `window` tokens.
    `softcap`: each score s becomes softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping).
    `sinks`: [num_heads] float32, each head's sink logit s: the softmax's sum gains exp(s) (gpt-oss).
    """
    check_window(window)
    check_softcap(softcap)
    if max_context is None or (isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] == 0):
        _check(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks)  # before reading them
        if q.shape[0] == 0:
            return torch.empty_like(q)
        if max_context is None:
            max_context = int(context_lens.max())
    span = max_context if window is None else min(max_context, window)  # the most tokens any sequence attends to
    plan = _plan(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks, span, partition_size,
                 launch)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    quantised, num_splits = plan.quantised, plan.num_splits
    out = torch.empty_like(q)
    if plan.direct:  # the partial kernel writes `out`; the part pointers are never read
        part_acc = part_max = part_sum = out
    else:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=plan.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=plan.device)
        part_sum = torch.empty_like(part_max)
    placeholder = context_lens
    launch = plan.launch
    _decode_partial_kernel[(num_seqs, num_kv_heads * plan.head_chunks, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        k_scale if quantised else placeholder, v_scale if quantised else placeholder,
        placeholder if sinks is None else sinks, part_acc, part_max, part_sum, out, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        plan.partition_size, block_size, head_dim, plan.group, num_splits, plan.head_chunks, window or 0,
        float(softcap or 1.0), GROUP_P=plan.heads_per_program, DIM_P=next_power_of_2(head_dim),
        TILE=launch.tile, QUANT=quantised,
        FP16_DOT=plan.fp16_dot, DOT_F32=plan.dot_f32, PRECISION="ieee" if plan.dot_f32 else "tf32",
        DIRECT=plan.direct, SLIDING=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        **launch.compile_options(),
    )
    if plan.direct:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
        num_heads, num_splits, head_dim,
        SPLITS_P=max(2, next_power_of_2(num_splits)), DIM_P=next_power_of_2(head_dim),
    )
    return out


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                    scale: torch.Tensor | None) -> torch.Tensor:
    """The first `length` tokens of one sequence as float32 [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    tokens = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]
    return from_cache(tokens, scale)


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal_offset: int | None = None, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention in float32. q [n, H, D]; k, v [t, H_kv, D] -> [n, H, D].

    With `causal_offset` c, query i sits at position c + i and sees keys 0..c+i; with a
    `window` W as well, only the last W of them: keys c+i-W+1..c+i (transformers' sliding window).
    With `softcap` C, each score s becomes C * tanh(s / C) before the mask (Gemma 2).
    With `sinks` [H], head h's softmax runs over its scores and sinks[h], whose share is then
    dropped (gpt-oss): the weights of the keys sum to less than 1.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal_offset is not None:
        positions = causal_offset + torch.arange(q.shape[0], device=q.device)
        keys = torch.arange(k.shape[0], device=q.device)[None, :]
        visible = keys <= positions[:, None]
        if window is not None:
            visible &= keys > positions[:, None] - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v)
    column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnt,thd->nhd", probs, v)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, window: int | None = None,
                               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `paged_decode_attention`: gathers each sequence through its table."""
    check_window(window)
    check_softcap(softcap)
    _check(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, sinks)
    out = torch.empty_like(q)
    for seq in range(q.shape[0]):
        length = int(context_lens[seq])
        check(length >= 1, "context_lens", f"sequence {seq} has length {length}; need >= 1")
        k = gather_sequence(k_cache, block_tables[seq], length, k_scale)
        v = gather_sequence(v_cache, block_tables[seq], length, v_scale)
        out[seq] = attend_ref(q[seq:seq + 1], k, v, scale, causal_offset=length - 1, window=window,
                              softcap=softcap, sinks=sinks)[0].to(q.dtype)
    return out


__all__ = ["DecodeLaunch", "paged_decode_attention", "paged_decode_attention_ref", "attend_ref",
           "gather_sequence", "choose_partition"]

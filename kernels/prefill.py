"""paged_prefill_attention: new tokens of many sequences attend causally to their paged K/V.

Each sequence brings `n` new query tokens (already written to the cache) after a
cached prefix of `context_len - n` tokens: a prefix hit or an earlier chunk of a
long prompt. Only the new rows are computed. Program (seq, row tile, head)
streams key tiles up to the tile's last position with an online softmax. A sliding-window
layer (`window`) sees only the last `window` keys of each row; the key tiles start at the
first row's window, so keys before every row's window are never read. With attention sinks
(`sinks`, gpt-oss), each row's softmax starts from its head's sink: a key of that score whose
value is zero.

Layouts::

    q                [total_new_tokens, num_heads, head_dim]   sequences back to back
    query_start_loc  [num_seqs + 1] int32   sequence s owns rows [qsl[s], qsl[s+1])
    context_lens     [num_seqs] int32       prefix + new tokens of each sequence
    k/v_cache, block_tables, k/v_scale      as for decode
    out              like q
"""

from dataclasses import dataclass, replace

import torch

from ._triton import interpreting, tl, triton
from .checks import (CheckedOnce, check, check_cache, check_device, check_query, check_scales,
                     check_sinks, check_softcap, check_tensor, check_window, next_power_of_2)
from . import decode
from .decode import attend_ref, gather_sequence, step_fits
from .launch import TritonLaunch, check_tile
from .paged_tile import head_scales, load_kv_tile, online_softmax_step

BLOCK_M = 64  # query rows per program (the H200 sweep's choice; docs/results)
TILE_N = 32  # keys per step


@dataclass(frozen=True)
class PrefillLaunch(TritonLaunch):
    """How the prefill kernel is launched on a GPU (the CPU interpreter ignores warps and stages).

    rows        query rows (new tokens of one head) per program, a power of two >= 16
    tile        keys read per inner step, a power of two >= 16
    num_warps   warps per program
    num_stages  software-pipeline depth of the key loop (None: Triton's default)
    """

    rows: int = BLOCK_M
    tile: int = TILE_N
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        check_tile("rows", self.rows)
        check_tile("tile", self.tile)
        self.check_warps_and_stages()

    def fitted(self, head_dim: int, dot_f32: bool) -> "PrefillLaunch":
        """This launch with rows, then the tile, halved until a step fits (`decode.step_fits`)."""
        rows, tile = self.rows, self.tile
        while rows > 16 and not step_fits(rows, tile, head_dim, dot_f32):
            rows //= 2
        while tile > 16 and not step_fits(rows, tile, head_dim, dot_f32):
            tile //= 2
        return self if (rows, tile) == (self.rows, self.tile) else replace(self, rows=rows, tile=tile)


DEFAULT_LAUNCH = PrefillLaunch()


@triton.jit
def _prefill_kernel(
    q_ptr,  # [total_new_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    k_scale_ptr,  # [num_kv_heads] float32 (QUANT only)
    v_scale_ptr,  # [num_kv_heads] float32 (QUANT only)
    sinks_ptr,  # [num_heads] float32 (SINKS only)
    out_ptr,  # [total_new_tokens, num_heads, head_dim]
    sm_scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bt,
    block_size, head_dim, group_size,
    window,  # tokens a sliding-window layer attends to (SLIDING only)
    softcap,  # scores are capped at +-softcap (SOFTCAP only)
    ROWS: tl.constexpr,
    TILE: tl.constexpr,
    DIM_P: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_F32: tl.constexpr,  # multiply in float32 (float32 queries, or the CPU interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32, the default otherwise
    SLIDING: tl.constexpr,  # each row sees its last `window` keys only
    SOFTCAP: tl.constexpr,  # cap each score: softcap * tanh(score / softcap) (Gemma 2)
    SINKS: tl.constexpr,  # the head's sink logit joins each row's softmax sum (gpt-oss)
):
    seq = tl.program_id(0).to(tl.int64)
    row_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group_size
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if row_tile * ROWS >= num_new:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - num_new

    rows = row_tile * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_new
    positions = prefix + rows
    dims = tl.arange(0, DIM_P)
    dim_mask = dims < head_dim
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_P], tl.float32)
    if SINKS:  # every row starts from the sink: a key of score `sink` and value zero
        row_max = tl.zeros([ROWS], tl.float32) + tl.load(sinks_ptr + head)
        row_sum = row_sum + 1.0
    qk_scale, out_scale = head_scales(sm_scale, kv_head, k_scale_ptr, v_scale_ptr, QUANT)
    key_end = tl.minimum(context_len, prefix + (row_tile + 1) * ROWS)
    if SLIDING:  # from the first row's window on
        key_start = tl.maximum(prefix + row_tile * ROWS - window + 1, 0)
    else:
        key_start = 0
    for tile_start in range(key_start, key_end, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_mask = keys < key_end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, keys,
                            key_mask, kv_head, dims, dim_mask, stride_cb, stride_co, stride_ch,
                            block_size)
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
        if SLIDING:
            visible = visible & (keys[None, :] > positions[:, None] - window)
        row_max, row_sum, acc = online_softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), visible, qk_scale, row_max, row_sum, acc, PRECISION,
            SLIDING, softcap, SOFTCAP)

    out = acc * (out_scale / row_sum)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale, sinks=None):
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    group = check_query(q, num_kv_heads, head_dim)
    check_sinks(sinks, q.shape[1], q.device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,))
    check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        check(False, "query_start_loc",
              f"expected {num_seqs + 1} entries (num_seqs + 1), got {query_start_loc.shape[0]}")
    if block_tables.shape[0] != num_seqs:
        check(False, "block_tables", f"{block_tables.shape[0]} rows for {num_seqs} sequences")
    return group, check_scales(k_cache, k_scale, v_scale)


_CHECKED = CheckedOnce()  # once per distinct argument metadata: every layer of a step calls alike


def _check_and_fit(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale, sinks,
                   launch: PrefillLaunch) -> tuple[int, bool, PrefillLaunch, bool]:
    """Every argument checked (a bad one named); the GQA group, whether the cache is quantised,
    the launch fitted to the step budget, and whether the dots run in float32."""
    group, quantised = _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale,
                              sinks)
    check_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                  "query_start_loc": query_start_loc, "context_lens": context_lens,
                  "k_scale": k_scale, "v_scale": v_scale})
    dot_f32 = q.dtype == torch.float32 or interpreting()
    return group, quantised, launch.fitted(k_cache.shape[3], dot_f32), dot_f32


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, *, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            max_new_tokens: int | None = None,
                            launch: PrefillLaunch = DEFAULT_LAUNCH, window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new tokens over prefix + themselves (Triton); see the module docstring.

    `max_new_tokens` (the most new tokens of any sequence) saves a device sync when known.
    `launch` sets rows, tile, warps and stages (`PrefillLaunch`).
    `window`: a sliding-window layer's span; each row attends to its last `window` keys.
    `softcap`: each score s becomes softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping).
    `sinks`: [num_heads] float32, each head's sink logit s: the softmax's sum gains exp(s) (gpt-oss).
    """
    check_window(window)
    check_softcap(softcap)
    group, quantised, launch, dot_f32 = _CHECKED.get(
        (q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale, sinks),
        (launch, decode.STEP_TILE_BYTES),  # the budget the launch is fitted to
        lambda: _check_and_fit(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale,
                               sinks, launch))
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_new_tokens is None:
        max_new_tokens = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    _, block_size, _, head_dim = k_cache.shape
    placeholder = context_lens
    grid = (num_seqs, -(-max_new_tokens // launch.rows), q.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        k_scale if quantised else placeholder, v_scale if quantised else placeholder,
        placeholder if sinks is None else sinks, out,
        float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_size, head_dim, group, window or 0, float(softcap or 1.0),
        ROWS=launch.rows, TILE=launch.tile, DIM_P=next_power_of_2(head_dim), QUANT=quantised,
        DOT_F32=dot_f32, PRECISION="ieee" if dot_f32 else "tf32", SLIDING=window is not None,
        SOFTCAP=softcap is not None, SINKS=sinks is not None,
        **launch.compile_options(),
    )
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, *, scale: float,
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None, window: int | None = None,
                                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `paged_prefill_attention`."""
    check_window(window)
    check_softcap(softcap)
    _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, k_scale, v_scale, sinks)
    out = torch.empty_like(q)
    for seq in range(context_lens.shape[0]):
        start, stop = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        length = int(context_lens[seq])
        check(0 <= stop - start <= length, "context_lens",
              f"sequence {seq} has {stop - start} new tokens but context length {length}")
        if stop == start:
            continue
        k = gather_sequence(k_cache, block_tables[seq], length, k_scale)
        v = gather_sequence(v_cache, block_tables[seq], length, v_scale)
        out[start:stop] = attend_ref(q[start:stop], k, v, scale,
                                     causal_offset=length - (stop - start), window=window,
                                     softcap=softcap, sinks=sinks).to(q.dtype)
    return out

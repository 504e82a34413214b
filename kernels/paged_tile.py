"""Pieces shared by the paged attention kernels (inlined by Triton into each kernel).

`load_kv_tile` gathers TILE tokens of one KV head through a block table, as stored.
A quantised cache's scales are per KV head, constant within a program, so the kernels
never scale a tile: `head_scales` folds the key scale into the score scale and the value
scale into the output. `online_softmax_step` folds one tile into a running (max, sum,
accumulator) triple, flash-attention style; with SOFTCAP it caps each score first, as Gemma 2
does: cap * tanh(score / cap).
"""

from ._triton import tl, triton


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_row_ptr,  # [max_blocks] int32: this sequence's block table
    tokens,  # [TILE] token positions
    token_mask,  # [TILE] positions to read
    kv_head,
    dims,  # [DIM_P]
    dim_mask,  # [DIM_P]
    stride_cb, stride_co, stride_ch,
    block_size,
):
    physical = tl.load(table_row_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
    addr = (physical[:, None] * stride_cb + (tokens % block_size)[:, None] * stride_co
            + kv_head * stride_ch + dims[None, :])
    mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + addr, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + addr, mask=mask, other=0.0)
    return k, v


@triton.jit
def head_scales(sm_scale, kv_head, k_scale_ptr, v_scale_ptr, QUANT: tl.constexpr):
    """(score scale, output scale) of one KV head: softmax scale x key scale, and the value
    scale; (sm_scale, 1) for an unquantised cache."""
    if QUANT:
        return sm_scale * tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    else:
        return sm_scale * 1.0, 1.0


@triton.jit
def online_softmax_step(q, k, v, visible, sm_scale, row_max, row_sum, acc, PRECISION: tl.constexpr,
                        MAY_SEE_NONE: tl.constexpr, softcap, SOFTCAP: tl.constexpr):
    """q [M, D], k/v [TILE, D] in q's dtype, visible [M, TILE]; returns the updated triple.
    MAY_SEE_NONE: a row may have seen no key yet after this tile (a sliding window that starts
    in a later tile); its max stays -inf and it must not turn into NaN. SOFTCAP: scores are
    capped at +-`softcap` (tanh written as 2 sigmoid(2x) - 1, which every Triton backend has)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    if SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(scores * (2.0 / softcap)) - 1.0)
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    if MAY_SEE_NONE:  # exp(-inf - -inf) is NaN: subtract 0 instead, which leaves every term 0
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        shift = new_max
    probs = tl.exp(scores - shift[:, None])
    alpha = tl.exp(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None] + tl.dot(probs.to(q.dtype), v, input_precision=PRECISION)
    return new_max, row_sum, acc

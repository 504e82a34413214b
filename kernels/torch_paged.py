"""paged_attention_torch: batched paged attention in plain torch, for CPUs and small models.

The `*_ref` functions walk one sequence at a time for clarity; this version gathers every
sequence's blocks through its block table in one indexing operation and attends with two
einsums, masking positions past each context and after each query (causal). It serves
decode (one new token per sequence) and prefill (any number) alike. It materialises the
gathered K/V of the batch (never a dequantised copy of the whole cache), so it suits the
small batches and models of CPU serving; CUDA uses the Triton kernels.

    q                [total_new_tokens, num_heads, head_dim]
    query_start_loc  [num_seqs + 1] int32
    context_lens     [num_seqs] int32
    block_tables     [num_seqs, max_blocks] int32
"""

import torch

from .formats import from_cache


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, max_new_tokens: int | None = None) -> torch.Tensor:
    """Decodes (one new token) are attended together; each prefill on its own, so a mixed
    batch never pads every decode row to the longest prompt chunk."""
    starts = query_start_loc.long()
    counts = starts[1:] - starts[:-1]
    if max_new_tokens == 1 or bool((counts <= 1).all()):
        return _attend(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale,
                       v_scale, 1)
    out = torch.empty_like(q)
    decodes = torch.nonzero(counts == 1).flatten()
    if decodes.numel():
        rows = starts[decodes]
        ones = torch.arange(decodes.numel() + 1, device=q.device, dtype=query_start_loc.dtype)
        out[rows] = _attend(q[rows], k_cache, v_cache, block_tables[decodes], ones, context_lens[decodes],
                            scale, k_scale, v_scale, 1)
    for seq in torch.nonzero(counts > 1).flatten().tolist():
        begin, end = int(starts[seq]), int(starts[seq + 1])
        width = end - begin
        used = -(-int(context_lens[seq]) // k_cache.shape[1])
        out[begin:end] = _attend(q[begin:end], k_cache, v_cache, block_tables[seq:seq + 1, :used],
                                 query_start_loc.new_tensor([0, width]), context_lens[seq:seq + 1], scale,
                                 k_scale, v_scale, width)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, width: int) -> torch.Tensor:
    """All sequences padded to `width` query rows (gathered K/V, masked softmax)."""
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.long()
    new_counts = starts[1:] - starts[:-1]
    tables = block_tables.long()
    # [S, T, Hkv, D] with T = max_blocks * block_size
    k = from_cache(k_cache[tables].flatten(1, 2), k_scale)
    v = from_cache(v_cache[tables].flatten(1, 2), v_scale)
    slots = torch.arange(width, device=q.device)
    rows = starts[:-1, None] + slots[None, :]  # [S, N]
    valid_rows = slots[None, :] < new_counts[:, None]
    rows = torch.where(valid_rows, rows, torch.zeros_like(rows))
    queries = q.float()[rows].view(num_seqs, width, num_kv_heads, group, head_dim)
    positions = (context_lens.long() - new_counts)[:, None] + slots[None, :]  # [S, N]
    keys = torch.arange(k.shape[1], device=q.device)
    visible = keys[None, None, :] <= positions[:, :, None]  # [S, N, T]; past-context keys excluded
    scores = torch.einsum("snkgd,stkd->skgnt", queries, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgnt,stkd->snkgd", probs, v).reshape(num_seqs, width, q.shape[1], head_dim)
    return out[valid_rows].to(q.dtype)

"""paged_attention_torch: batched paged attention in plain torch, for CPUs and small models.

The `*_ref` functions walk one sequence at a time for clarity; this version gathers every
sequence's blocks through its block table in one indexing operation and attends with two
einsums, masking positions past each context and after each query (causal). It serves
decode (one new token per sequence) and prefill (any number) alike. It materialises the
gathered K/V of the batch (never a dequantised copy of the whole cache), so it suits the
small batches and models of CPU serving; CUDA uses the Triton kernels.

Decodes that share a cached prefix (the same physical blocks: a system prompt) use cascade
attention: each group's common prefix is attended once for all its queries (a zero-copy
slice of the cache when its blocks are contiguous), each sequence's own suffix batched, and
the two partial results merged by their log-sum-exp. Without sharing, that is one gather of
every sequence's whole context per layer per step.

    q                [total_new_tokens, num_heads, head_dim]
    query_start_loc  [num_seqs + 1] int32
    context_lens     [num_seqs] int32
    block_tables     [num_seqs, max_blocks] int32
"""

from dataclasses import dataclass

import torch

from .formats import from_cache


@dataclass
class DecodePlan:
    """Decode rows of a batch, grouped for cascade attention (built once per step)."""

    num_seqs: int
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (first block, blocks, members, scattered)
    suffix_tables: torch.Tensor  # [S, W] each sequence's blocks after its shared prefix (padded)
    visible: torch.Tensor  # [S, W * block_size] suffix keys before the sequence's context end
    cascade: bool  # False: no sharing, plain batched attention
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    prefix: torch.Tensor | None = None  # [S] blocks each sequence shares with its group


@dataclass
class AttentionPlan:
    """What paged_attention_torch needs besides q and the caches; the same for every layer."""

    decode_rows: torch.Tensor | None  # rows of q that decode; None when every row does
    decode: DecodePlan | None
    prefills: list[tuple[int, int, int, int]]  # (first row, end row, sequence, blocks used)


def plan_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                   block_size: int, max_new_tokens: int | None = None) -> AttentionPlan:
    """Group a batch once per step: decodes (cascaded over shared prefixes) and prefills."""
    starts = query_start_loc.long()
    counts = starts[1:] - starts[:-1]
    if max_new_tokens == 1 or bool((counts <= 1).all()):
        return AttentionPlan(None, plan_decode(block_tables, context_lens, block_size), [])
    decodes = torch.nonzero(counts == 1).flatten()
    decode = None
    if decodes.numel():
        decode = plan_decode(block_tables[decodes], context_lens[decodes], block_size)
    prefills = []
    for seq in torch.nonzero(counts > 1).flatten().tolist():
        used = -(-int(context_lens[seq]) // block_size)
        prefills.append((int(starts[seq]), int(starts[seq + 1]), seq, used))
    return AttentionPlan(starts[decodes] if decodes.numel() else None, decode, prefills)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodePlan:
    """Shared prefixes per group of decodes with the same first block, found with tensor ops
    (no walk over the tables in Python); suffix tables gathered from each sequence's own row."""
    tables, lengths = block_tables.long(), context_lens.long()
    num_seqs, device = tables.shape[0], tables.device
    prefix = torch.zeros(num_seqs, dtype=torch.long, device=device)
    groups = []
    eligible = lengths > block_size
    first = tables[:, 0]
    for block in torch.unique(first[eligible]).tolist():
        index = torch.nonzero((first == block) & eligible).flatten()
        if index.numel() < 2:
            continue
        limit = int(((lengths[index] - 1) // block_size).min())  # whole blocks before every last key
        rows = tables[index, :limit]
        same = (rows == rows[0]).all(0)
        shared = limit if bool(same.all()) else int((~same).int().argmax())
        if shared == 0:
            continue
        prefix[index] = shared
        blocks = rows[0, :shared]
        consecutive = shared == 1 or bool((blocks[1:] - blocks[:-1] == 1).all())
        groups.append((int(blocks[0]), shared, index, None if consecutive else blocks))
    if not groups:
        return DecodePlan(num_seqs, [], block_tables, torch.empty(0), False, block_tables, context_lens, prefix)
    ends = -(-lengths // block_size)  # blocks in use per sequence
    width = int((ends - prefix).max())
    columns = prefix[:, None] + torch.arange(width, device=device)[None, :]
    suffix = tables.gather(1, torch.minimum(columns, (ends - 1)[:, None]))  # padding repeats a used block
    positions = columns * block_size  # first key of each suffix block
    keys = (positions[:, :, None] + torch.arange(block_size, device=device)).flatten(1)
    visible = keys < lengths[:, None]
    return DecodePlan(num_seqs, groups, suffix, visible, True, block_tables, context_lens, prefix)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, max_new_tokens: int | None = None,
                          plan: AttentionPlan | None = None) -> torch.Tensor:
    """Decodes (one new token) are attended together; each prefill on its own, so a mixed
    batch never pads every decode row to the longest prompt chunk. `plan` (from
    `plan_attention`, the same for every layer of a step) saves regrouping per layer."""
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, context_lens, k_cache.shape[1], max_new_tokens)
    if plan.decode_rows is None and not plan.prefills:
        return _attend_decode(q, k_cache, v_cache, plan.decode, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode_rows] = _attend_decode(q[plan.decode_rows], k_cache, v_cache, plan.decode, scale,
                                               k_scale, v_scale)
    for begin, end, seq, used in plan.prefills:
        width = end - begin
        out[begin:end] = _attend(q[begin:end], k_cache, v_cache, block_tables[seq:seq + 1, :used],
                                 query_start_loc.new_tensor([0, width]), context_lens[seq:seq + 1], scale,
                                 k_scale, v_scale, width)
    return out


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                   scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
    """One new token per sequence; cascade over shared prefixes (see the module docstring)."""
    num_seqs = plan.num_seqs
    if not plan.cascade:
        ones = torch.arange(num_seqs + 1, device=q.device, dtype=torch.int32)
        return _attend(q, k_cache, v_cache, plan.block_tables, ones, plan.context_lens, scale, k_scale,
                       v_scale, 1)
    num_kv_heads, head_dim = k_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    queries = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    # Shared prefixes, once per group: running max m, sum l and unnormalised output o.
    m1 = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=q.device)
    l1 = torch.zeros_like(m1)
    o1 = torch.zeros_like(queries)
    for first, count, index, scattered in plan.groups:
        if scattered is None:  # consecutive blocks: a view of the cache, no copy
            k_rows, v_rows = k_cache[first:first + count].flatten(0, 1), v_cache[first:first + count].flatten(0, 1)
        else:
            k_rows, v_rows = k_cache[scattered].flatten(0, 1), v_cache[scattered].flatten(0, 1)
        k, v = from_cache(k_rows, k_scale), from_cache(v_rows, v_scale)  # [T, Hkv, D]
        members = index.numel()
        # one GEMM per KV head for every query of the group: [Hkv, members * G, D] x [Hkv, D, T]
        grouped = queries[index].permute(1, 0, 2, 3).reshape(num_kv_heads, members * group, head_dim)
        scores = torch.matmul(grouped, k.permute(1, 2, 0)) * scale
        m = scores.amax(-1, keepdim=True)
        e = torch.exp(scores - m)
        o = torch.matmul(e, v.permute(1, 0, 2))  # [Hkv, members * G, D]
        unflat = (num_kv_heads, members, group)
        m1[index] = m.view(unflat).permute(1, 0, 2)
        l1[index] = e.sum(-1).view(unflat).permute(1, 0, 2)
        o1[index] = o.view(*unflat, head_dim).permute(1, 0, 2, 3)
    # Each sequence's own suffix, batched and masked.
    k = from_cache(k_cache[plan.suffix_tables].flatten(1, 2), k_scale)  # [S, W * block, Hkv, D]
    v = from_cache(v_cache[plan.suffix_tables].flatten(1, 2), v_scale)
    scores = torch.einsum("skgd,stkd->skgt", queries, k) * scale
    scores = scores.masked_fill(~plan.visible[:, None, None, :], float("-inf"))
    m2 = scores.amax(-1)  # finite: every suffix holds the sequence's last key
    e = torch.exp(scores - m2[..., None])
    l2 = e.sum(-1)
    o2 = torch.einsum("skgt,stkd->skgd", e, v)
    # Merge: weights relative to the larger maximum (exp(-inf) = 0 where there is no prefix).
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * a1[..., None] + o2 * a2[..., None]) / (l1 * a1 + l2 * a2)[..., None]
    return out.reshape(num_seqs, q.shape[1], head_dim).to(q.dtype)


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

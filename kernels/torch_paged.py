"""paged_attention_torch: batched paged attention in plain torch, for CPUs and small models.

The `*_ref` functions walk one sequence at a time for clarity; this path batches a step's
sequences and attends with torch's fused CPU attention (`_attend_lse`, which also returns the
log-sum-exp; a matmul fallback elsewhere). It serves decode (one new token per sequence) and
prefill (any number) alike. It gathers K/V through the block tables (never a dequantised copy
of the whole cache), so it suits the small batches and models of CPU serving; CUDA uses the
Triton kernels.

A decode row is a sequence's next token. A sequence may bring up to `DECODE_MAX_ROWS` new
tokens this way (a short prompt chunk), each attending to the keys up to its own position,
when padding every decode to that many rows costs little (`_decode_rows`).
Decodes that share a cached prefix (the same physical blocks: a system prompt) use cascade
attention: each group's common prefix is attended once for all its queries, every sequence's
own suffix in one batched call, and the two partial results merged by their log-sum-exp.
Prefixes of similar length are attended together in one call over a copy of their rows
(`PrefixStack`, kept while the plan is); otherwise each group gets its own call, reading a
zero-copy slice of the cache when its blocks are contiguous. A decode whose long prefix nobody
else in the batch shares is attended the same way, as a group of one, so that its whole
context does not become the width every sequence's suffix is padded to. The grouping is planned once per
step from the block tables (`plan_attention`), in plain Python over a few hundred integers,
reused by every layer, and kept across steps while the decoding sequences keep their blocks.
A prompt chunk attends to its cached prefix without a mask and to itself with a causal square
(so the masked half is skipped), merged the same way.

A sliding-window layer (`window`, planned apart from the full layers) shares nothing: each
decode reads only the blocks its rows' windows reach, masked below the window, and a prompt
chunk whose window has moved past the first key attends once over the keys its rows can see,
with a band mask.

A `softcap` C (Gemma 2's attn_logit_softcapping) turns each score s into C * tanh(s / C) before
the mask: such a layer attends through the plain matmul path (torch's fused CPU attention has no
cap), planned and merged by log-sum-exp as any other, since the cap acts on each score alone.

Attention sinks (`sinks`, gpt-oss: a logit per query head that joins each softmax's sum and adds
no value) are applied once, to the merged result: with L the log-sum-exp over every key and s
the sink, the output is out * sigmoid(L - s), since exp(L) / (exp(L) + exp(s)) is that.

    q                [total_new_tokens, num_heads, head_dim]
    query_start_loc  [num_seqs + 1] int32
    context_lens     [num_seqs] int32
    block_tables     [num_seqs, max_blocks] int32
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import torch

from .checks import check, check_sinks, check_softcap, check_window
from .formats import from_cache

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class PrefixGroup:
    """Decodes that share their first `blocks` cache blocks; rows start:end of the plan's order.
    A group of one (a "solo") is a decode whose long prefix nobody else in the batch shares:
    attended on its own, in place, so that it does not widen every sequence's suffix."""

    members: list[int]  # sequence indices in the batch
    first_block: int
    blocks: int
    scattered: torch.Tensor | None  # the shared block ids when they are not consecutive
    start: int
    end: int
    splits: int = 1  # the prefix is attended in this many equal parts, merged by log-sum-exp


@dataclass
class PrefixStack:
    """Shared prefixes attended in one call: the groups' prefix rows copied side by side (once
    per plan, per layer), shorter prefixes padded and masked, and each group's queries padded
    to the largest group's count.

    The copy is safe to keep for as long as the plan is reused: a plan is only reused while the
    decoding sequences keep the same blocks, and meanwhile no shared prefix block is written
    (every sequence, decoding or prefilling, writes only after its shared blocks, in blocks it
    holds alone) or given back (its members hold it)."""

    blocks: torch.Tensor  # [G, longest] block ids (a shorter prefix repeats its last block)
    members: int  # query slots per group (the largest group's member count)
    rows: torch.Tensor | None  # [G * members] plan-order sequence of each slot; None: groups are full
    valid: torch.Tensor | None  # real slots among the G * members, in plan order; None: all
    mask: torch.Tensor | None  # [G, 1, 1, keys] -inf past a shorter prefix; None: equal lengths
    copies: dict = field(default_factory=dict)  # cache tensor -> (k rows, v rows) or None when too big
    contents: tuple | None = None  # what each stacked block holds (see `plan_decode`); None: unknown


STACK_MAX_BYTES = 64 << 20  # the stacked K+V copies of all layers stay under this; past it, one call per group


@dataclass
class DecodePlan:
    """Decode rows of a batch, grouped for cascade attention (built once per step).

    Sequences are processed in `order` (group members together, then sequences without a shared
    prefix); `inverse` puts them back. Both are None when the batch is already in that order.
    Every sequence gets `rows` query rows, right-aligned: a sequence with fewer new tokens is
    padded at the front (`row_index` places the real rows; None when nobody is padded)."""

    num_seqs: int
    groups: list[PrefixGroup]
    prefix: list[int]  # blocks each sequence shares with its group (0: none), batch order
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    suffix_tables: torch.Tensor  # [S, W] each row's blocks after its shared prefix (padded), plan order
    suffix_mask: torch.Tensor  # [S, 1, 1, W * block_size] 0 where a suffix key is in context, else -inf
    layout: tuple = ()  # what the grouping was computed from: blocks in use, split settings, counts
    order_list: tuple[int, ...] = ()
    key_positions: torch.Tensor | None = None  # [S, W * block_size] position of each suffix key, plan order
    rows: int = 1  # query rows per sequence (1: plain decode)
    row_index: torch.Tensor | None = None  # padded row of each real row, batch order
    stack: PrefixStack | None = None  # the groups' prefixes in one call, when worth it


@dataclass
class AttentionPlan:
    """What paged_attention_torch needs besides q and the caches; the same for every layer."""

    decode_rows: torch.Tensor | None  # rows of q that decode; None when every row does
    decode: DecodePlan | None
    prefills: list[tuple[int, int, int, int]]  # (first row, end row, sequence, blocks used)
    window: int | None = None  # planned for a sliding-window layer of this span; None: full attention


DECODE_MAX_ROWS = 16  # a sequence with at most this many new tokens is attended as decode rows


BlockContent = Callable[[int], Hashable | None]  # block id -> what it holds (a content key), None: unknown


def plan_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                   block_size: int, max_new_tokens: int | None = None,
                   previous: AttentionPlan | None = None, block_content: BlockContent | None = None,
                   window: int | None = None) -> AttentionPlan:
    """Group a batch once per step: decodes (cascaded over shared prefixes) and prefills.
    `previous` (the last step's plan): its decode grouping is kept when this step's decoding
    sequences are laid out as before, beside prompt chunks or not; its stacked prefix copy is
    kept when the new grouping stacks the same contents (`block_content`, see `plan_decode`).
    `window`: the plan of a sliding-window layer of that span (see `plan_decode`)."""
    splits = torch.get_num_threads()
    if max_new_tokens == 1:
        counts = None
    else:
        starts = query_start_loc.tolist()
        counts = [b - a for a, b in zip(starts, starts[1:])]
    decodes = None if counts is None else _decode_rows(counts)
    if decodes is None or len(decodes) == len(counts):
        reuse = previous.decode if previous is not None else None
        return AttentionPlan(None, plan_decode(block_tables, context_lens, block_size, splits, reuse=reuse,
                                               counts=counts, block_content=block_content, window=window), [],
                             window)
    decode = rows = None
    if decodes:
        index = torch.tensor(decodes, device=block_tables.device)
        decode = plan_decode(block_tables[index], context_lens[index], block_size, splits,
                             reuse=previous.decode if previous is not None else None,
                             counts=[counts[s] for s in decodes], block_content=block_content, window=window)
        rows = torch.tensor([r for s in decodes for r in range(starts[s], starts[s + 1])], device=block_tables.device)
    lengths = context_lens.tolist()
    chosen = set(decodes)
    prefills = [(starts[s], starts[s + 1], s, -(-lengths[s] // block_size))
                for s in range(len(counts)) if s not in chosen]
    return AttentionPlan(rows, decode, prefills, window)


DECODE_MAX_PADDING = 2  # decode rows, padding included, stay within this many times the real ones


def _decode_rows(counts: list[int]) -> list[int]:
    """The sequences attended as decode rows: at most `DECODE_MAX_ROWS` new tokens each, and
    every one is padded to the most among them, so the longest chunks are left to the prefill
    path until the padded rows are at most `DECODE_MAX_PADDING` times the real ones. Eight
    decodes beside a 16-token chunk would otherwise attend 144 rows for 24."""
    chosen = [s for s, n in enumerate(counts) if n <= DECODE_MAX_ROWS]
    while chosen:
        rows = max(counts[s] for s in chosen)
        if len(chosen) * rows <= DECODE_MAX_PADDING * sum(counts[s] for s in chosen):
            break
        chosen = [s for s in chosen if counts[s] < rows]
    return chosen


def _shared_length(rows: list[list[int]], limit: int) -> int:
    """How many leading entries every row has in common, at most `limit`."""
    base = rows[0][:limit]
    shared = limit
    for row in rows[1:]:
        if row[:shared] != base[:shared]:
            shared = next(i for i, (a, b) in enumerate(zip(row, base)) if a != b)
    return shared


SPLIT_MIN_KEYS = 2048  # a shared prefix is split across threads only in parts at least this long
SOLO_MIN_BLOCKS = 4  # a decode sharing nothing gets its own prefix call from this many leading blocks on...
SOLO_MAX = 4  # ...for at most this many decodes of a batch (each is one more call per layer)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, splits: int = 1,
                min_split_keys: int = SPLIT_MIN_KEYS, reuse: DecodePlan | None = None,
                counts: list[int] | None = None, block_content: BlockContent | None = None,
                window: int | None = None) -> DecodePlan:
    """Group decodes by shared leading blocks (those with the same first block share what all of
    them share) and lay out every sequence's remaining blocks as one padded suffix table.

    A group's queries are few (a handful of rows), so one call over its prefix runs on one
    thread; a prefix of at least `splits` × `min_split_keys` keys is attended in `splits` equal
    parts at once (flash-decoding), its length trimmed to a multiple of `splits` blocks (the
    rest joins each member's suffix).

    `counts` (new tokens per sequence, default one each) gives every sequence max(counts) query
    rows; the shared prefix ends before the first of them.

    In a batch with groups, a decode that shares nothing but starts with `SOLO_MIN_BLOCKS` or
    more consecutive blocks becomes a group of one over that run (at most `SOLO_MAX` of them,
    each one more call per layer), attended in place after the stacked groups: otherwise its
    whole context would set the width of every sequence's padded suffix table.

    Between two decode steps usually only the context lengths move: when `reuse` was planned
    from the same blocks in use and counts, its grouping is kept and only the mask is redone.
    Otherwise (a sequence took a new block, joined or left) the grouping is redone, but the
    copy of the stacked prefixes is kept when they hold the same contents as `reuse`'s:
    `block_content(block)` names what a block holds (the prefix index's content key, which
    covers the tokens, the model and the scales), None when nothing vouches for it.

    With a `window` (a sliding-window layer) nothing is grouped: a shared prefix soon falls out of
    every member's window. Each sequence's suffix starts at the block holding the first key its
    earliest row sees, so the blocks before the window are never read, and the mask hides the
    keys below each row's window as well as those after it."""
    tables, lengths = block_tables.tolist(), context_lens.tolist()
    num_seqs, device = len(lengths), block_tables.device
    rows = max(counts) if counts else 1
    ends = [-(-n // block_size) for n in lengths]  # blocks in use per sequence
    used = [row[:end] for row, end in zip(tables, ends)]  # the batch pads tables to its widest
    skipped = None  # with a window: each sequence's blocks before its first real row's window
    if window is not None:
        firsts = [n - (counts[s] if counts else 1) for s, n in enumerate(lengths)]  # its first new token
        skipped = tuple(max(0, first + 1 - window) // block_size for first in firsts)
    layout = (used, block_size, splits, min_split_keys, counts if rows > 1 else None, window, skipped)
    if reuse is not None and reuse.layout == layout:
        return replace(reuse, suffix_mask=_suffix_mask(reuse.key_positions, [lengths[s] for s in reuse.order_list],
                                                       rows, window))
    by_first: dict[int, list[int]] = {}
    for seq, (row, length) in enumerate(zip(tables, lengths)):
        if window is None and length - rows >= block_size:
            by_first.setdefault(row[0], []).append(seq)
    prefix = [0] * num_seqs if skipped is None else list(skipped)  # blocks before each suffix
    groups: list[PrefixGroup] = []
    order: list[int] = []
    for first, members in by_first.items():
        if len(members) < 2:
            continue
        limit = min((lengths[s] - rows) // block_size for s in members)  # whole blocks before every new row
        shared = _shared_length([tables[s] for s in members], limit)
        parts = splits if splits > 1 and shared * block_size >= splits * min_split_keys else 1
        shared -= shared % parts
        if shared == 0:
            continue
        blocks = tables[members[0]][:shared]
        scattered = None if _consecutive(blocks) else torch.tensor(blocks, dtype=torch.long, device=device)
        groups.append(PrefixGroup(members, first, shared, scattered, len(order), len(order) + len(members), parts))
        for seq in members:
            prefix[seq] = shared
        order += members
    stacked_groups = list(groups)
    if groups:  # a long prefix nobody shares would otherwise widen every sequence's suffix
        for solo in _solo_groups(tables, lengths, rows, block_size, splits, min_split_keys, order):
            groups.append(solo)
            prefix[solo.members[0]] = solo.blocks
            order.append(solo.members[0])
    grouped = set(order)
    order += [s for s in range(num_seqs) if s not in grouped]
    width = max(ends[s] - prefix[s] for s in order)
    suffix = []
    for seq in order:
        row = tables[seq][prefix[seq]:ends[seq]]
        suffix.append(row + [row[-1]] * (width - len(row)))  # padding repeats a used (masked) block
    first_key = torch.tensor([prefix[s] * block_size for s in order], device=device)
    positions = first_key[:, None] + torch.arange(width * block_size, device=device)[None, :]
    identity = order == list(range(num_seqs))
    order_t = None if identity else torch.tensor(order, device=device)
    inverse = None if identity else torch.argsort(order_t)
    row_index = None
    if counts and min(counts) < rows:  # right-align each sequence's rows in its `rows` slots
        row_index = torch.tensor([s * rows + r for s, n in enumerate(counts) for r in range(rows - n, rows)],
                                 device=device)
    return DecodePlan(num_seqs, groups, prefix, order_t, inverse,
                      torch.tensor(suffix, dtype=torch.long, device=device),
                      _suffix_mask(positions, [lengths[s] for s in order], rows, window), layout, tuple(order),
                      positions, rows, row_index, _plan_stack(stacked_groups, tables, block_size, device, block_content,
                                                              reuse.stack if reuse is not None else None))


def _solo_groups(tables: list[list[int]], lengths: list[int], rows: int, block_size: int, splits: int,
                 min_split_keys: int, grouped: list[int]) -> list[PrefixGroup]:
    """Groups of one for decodes outside `grouped` (in plan order after it) whose leading run
    of consecutive blocks before their rows is at least `SOLO_MIN_BLOCKS` long; at most
    `SOLO_MAX` of them."""
    solos: list[PrefixGroup] = []
    taken = set(grouped)
    for seq in range(len(lengths)):
        if seq in taken or len(solos) >= SOLO_MAX:
            continue
        limit = (lengths[seq] - rows) // block_size
        run = _leading_run(tables[seq][:limit]) if limit > 0 else 0
        parts = splits if splits > 1 and run * block_size >= splits * min_split_keys else 1
        run -= run % parts
        if run >= SOLO_MIN_BLOCKS:
            start = len(grouped) + len(solos)
            solos.append(PrefixGroup([seq], tables[seq][0], run, None, start, start + 1, parts))
    return solos


def _plan_stack(groups: list[PrefixGroup], tables: list[list[int]], block_size: int, device: torch.device,
                block_content: BlockContent | None = None, previous: PrefixStack | None = None) -> PrefixStack | None:
    """Stack two or more unsplit prefixes whose padding to the longest costs at most half again.
    The copies of `previous` carry over when every stacked block is known to hold what it held."""
    if len(groups) < 2 or any(g.splits > 1 for g in groups):
        return None
    longest = max(g.blocks for g in groups)
    if 2 * sum(longest - g.blocks for g in groups) > sum(g.blocks for g in groups):
        return None
    ids = []
    for g in groups:
        own = tables[g.members[0]][:g.blocks]
        ids.append(own + [own[-1]] * (longest - g.blocks))
    members = max(len(g.members) for g in groups)
    rows = valid = mask = None
    if any(len(g.members) < members for g in groups):
        rows = torch.tensor([g.start + min(i, len(g.members) - 1) for g in groups for i in range(members)],
                            device=device)
        valid = torch.tensor([n * members + i for n, g in enumerate(groups) for i in range(len(g.members))],
                             device=device)
    if any(g.blocks < longest for g in groups):
        keys = torch.arange(longest * block_size, device=device)
        ends = torch.tensor([g.blocks * block_size for g in groups], device=device)
        mask = torch.zeros((len(groups), longest * block_size), dtype=torch.float32, device=device)
        mask = mask.masked_fill_(keys[None, :] >= ends[:, None], float("-inf"))[:, None, None, :]
    contents = None
    if block_content is not None:
        contents = tuple(tuple(map(block_content, row)) for row in ids)
        if any(None in row for row in contents):
            contents = None
    stack = PrefixStack(torch.tensor(ids, dtype=torch.long, device=device), members, rows, valid, mask,
                        contents=contents)
    if contents is not None and previous is not None and previous.contents == contents:
        stack.copies = previous.copies  # the same rows: the copies made for `previous` still hold
    return stack


def _stacked_rows(stack: PrefixStack, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The stacked prefixes' raw cache rows [G, keys, Hkv, D] (copied on first use by a layer),
    or None for a layer whose copy would take the plan's copies past STACK_MAX_BYTES."""
    key = k_cache.data_ptr()
    if key not in stack.copies:
        held = sum(2 * k.numel() * k.element_size() for k, _ in filter(None, stack.copies.values()))
        size = 2 * stack.blocks.numel() * k_cache[0].numel() * k_cache.element_size()
        stack.copies[key] = None if held + size > STACK_MAX_BYTES else (_gather(k_cache, stack.blocks).flatten(1, 2),
                                                                        _gather(v_cache, stack.blocks).flatten(1, 2))
    return stack.copies[key]


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for a tensor of block ids of any shape, copied a whole block at a time
    (index_select over the blocks' rows: 2-5x faster on CPU than advanced indexing, which
    copies element by element)."""
    if not cache.is_contiguous():
        return cache[blocks]
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape, *cache.shape[1:])


def _suffix_mask(positions: torch.Tensor, lengths: list[int], rows: int = 1,
                 window: int | None = None) -> torch.Tensor:
    """[S, 1, rows, T] additive mask: row j of a sequence of context length n sees the suffix
    keys before n - rows + j + 1 (0), not the later ones (-inf), and with a `window` W only the
    last W of those. Every row sees at least one key, so a padding row never turns into NaN."""
    length = torch.tensor(lengths, device=positions.device)
    if rows == 1:
        mask = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
        hidden = positions >= length[:, None]
        if window is not None:
            hidden |= positions < length[:, None] - window
        return mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]
    ends = (length[:, None] - rows + 1 + torch.arange(rows, device=positions.device)[None, :]).clamp_(min=1)
    mask = torch.zeros((len(lengths), rows, positions.shape[1]), dtype=torch.float32, device=positions.device)
    if window is not None:  # a padding row before the suffix's first key sees that key
        ends = torch.maximum(ends, positions[:, :1] + 1)
    hidden = positions[:, None, :] >= ends[:, :, None]
    if window is not None:
        hidden |= positions[:, None, :] < ends[:, :, None] - window
    return mask.masked_fill_(hidden, float("-inf"))[:, None]


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None, causal: bool = False,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp. q [B, H, L, D], k and v [B, H, T, D] (float32,
    any strides with a unit last one: a stride-0 head axis shares K/V across grouped query
    heads), mask additive [B or 1, 1, L or 1, T]; `causal` (square L = T only) lets query i
    see keys 0..i; `softcap` C caps each score at C * tanh(s / C) before the mask. Returns
    out [B, H, L, D] and lse [B, H, L] (a row that sees no key: out 0, lse -inf)."""
    if _FLASH_CPU is not None and q.device.type == "cpu" and softcap is None:
        return _FLASH_CPU(q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(torch.isinf(lse), 0.0, lse)  # exp(-inf - -inf) would be NaN
    return torch.matmul(torch.exp(scores - shift[..., None]), v), lse


def _sunk(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """`out` (over keys whose log-sum-exp is `lse`) with each head's sink in the softmax's sum:
    out * sigmoid(lse - sink). `sinks` is broadcast against lse already; None: out unchanged."""
    return out if sinks is None else out * torch.sigmoid(lse - sinks).unsqueeze(-1)


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets combined from each one's output and log-sum-exp:
    o2 + (o1 - o2) * w with w = exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2), in three ops.
    (The combined log-sum-exp, where a caller needs it, is logaddexp(l1, l2).)"""
    return torch.lerp(o2, o1, torch.sigmoid(l1 - l2).unsqueeze(-1))


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, max_new_tokens: int | None = None,
                          plan: AttentionPlan | None = None, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decodes (one new token) are attended together; each prefill on its own, so a mixed
    batch never pads every decode row to the longest prompt chunk. `plan` (from
    `plan_attention`, the same for every layer of a step) saves regrouping per layer; it must
    have been planned for the same `window` (a sliding-window layer's span, None: full).
    `softcap`: each score s becomes softcap * tanh(s / softcap). `sinks`: [num_heads] float32,
    each head's sink logit s: the softmax's sum gains exp(s) (gpt-oss)."""
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, q.shape[1], q.device)
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, context_lens, k_cache.shape[1], max_new_tokens,
                              window=window)
    elif plan.window != window:
        check(False, "plan", f"was planned for window {plan.window}, not {window}")
    if plan.decode_rows is None and not plan.prefills:
        return _attend_decode(q, k_cache, v_cache, plan.decode, scale, k_scale, v_scale, softcap, sinks)
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode_rows] = _attend_decode(q[plan.decode_rows], k_cache, v_cache, plan.decode, scale,
                                               k_scale, v_scale, softcap, sinks)
    for begin, end, seq, used in plan.prefills:
        out[begin:end] = _attend_prefill(q[begin:end], k_cache, v_cache, block_tables[seq, :used],
                                         int(context_lens[seq]), scale, k_scale, v_scale, window, softcap, sinks)
    return out


def _heads_first(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows [..., T, Hkv, D] as float32 [..., Hkv, T, D] (a view when no conversion is needed)."""
    return from_cache(rows, scale).transpose(-3, -2)


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                   scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A few new tokens per sequence (`plan.rows`, usually one); cascade over shared prefixes
    (see the module docstring). Query rows are laid out [S, Hkv, rows x group, D], token-major."""
    num_seqs, rows = plan.num_seqs, plan.rows
    num_kv_heads, head_dim = k_cache.shape[2:]
    group = q.shape[1] // num_kv_heads
    width = rows * group  # query rows per sequence and KV head
    queries = q.float()
    if plan.row_index is not None:  # pad the sequences with fewer new tokens
        padded = queries.new_zeros((num_seqs * rows, q.shape[1], head_dim))
        padded[plan.row_index] = queries
        queries = padded
    queries = queries.view(num_seqs, rows, num_kv_heads, group, head_dim)
    queries = queries.transpose(1, 2).reshape(num_seqs, num_kv_heads, width, head_dim)
    if plan.order is not None:
        queries = queries[plan.order]
    mask = plan.suffix_mask if rows == 1 or group == 1 else plan.suffix_mask.repeat_interleave(group, dim=2)
    # Every sequence's own blocks (all of them where it shares nothing), batched and masked.
    k = _heads_first(_gather(k_cache, plan.suffix_tables).flatten(1, 2), k_scale)  # [S, Hkv, W * block, D]
    v = _heads_first(_gather(v_cache, plan.suffix_tables).flatten(1, 2), v_scale)
    out, lse = _attend_lse(queries, k, v, scale, mask, softcap=softcap)
    if plan.groups:
        stacked = _stacked_rows(plan.stack, k_cache, v_cache) if plan.stack is not None else None
        count = 0 if stacked is None else len(plan.stack.blocks)  # the stack covers the first groups
        parts = [_attend_stacked(queries, stacked, plan, scale, k_scale, v_scale, softcap)] if count else []
        if count < len(plan.groups):  # the rest (solos, or every group when nothing is stacked) one by one
            parts.append(_attend_each_group(queries, k_cache, v_cache, plan.groups[count:], scale, k_scale, v_scale,
                                            softcap))
        shared_out, shared_lse = parts[0] if len(parts) == 1 else (torch.cat((parts[0][0], parts[1][0])),
                                                                   torch.cat((parts[0][1], parts[1][1])))
        n = plan.groups[-1].end
        merged = _merge(shared_out, shared_lse, out[:n], lse[:n])
        out = merged if n == num_seqs else torch.cat((merged, out[n:]))
        if sinks is not None:
            lse = torch.cat((torch.logaddexp(shared_lse, lse[:n]), lse[n:]))
    if sinks is not None:  # query row r * group + g of KV head h is head h * group + g
        out = _sunk(out, lse, sinks.view(num_kv_heads, 1, group).expand(-1, rows, -1).reshape(num_kv_heads, width))
    if plan.inverse is not None:
        out = out[plan.inverse]
    if rows > 1:
        out = out.view(num_seqs, num_kv_heads, rows, group, head_dim).transpose(1, 2)
    out = out.reshape(num_seqs * rows, q.shape[1], head_dim)
    if plan.row_index is not None:
        out = out[plan.row_index]
    return out.to(q.dtype)


def _attend_stacked(queries: torch.Tensor, stacked: tuple, plan: DecodePlan, scale: float,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, softcap: float | None = None):
    """Every group's queries over its shared prefix in one call, from the stacked copy.
    queries [S, Hkv, W, D] in plan order; returns out [members, Hkv, W, D] and lse [members, Hkv, W]
    for the grouped sequences, in plan order."""
    st = plan.stack
    count = len(st.blocks)  # the first `count` groups of the plan
    _, num_kv_heads, width, head_dim = queries.shape
    k, v = _heads_first(stacked[0], k_scale), _heads_first(stacked[1], v_scale)  # [G, Hkv, keys, D]
    grouped = queries[st.rows] if st.rows is not None else queries[:count * st.members]
    grouped = grouped.view(count, st.members, num_kv_heads, width, head_dim).transpose(1, 2)
    o, l = _attend_lse(grouped.reshape(count, num_kv_heads, st.members * width, head_dim), k, v, scale, st.mask,
                       softcap=softcap)
    o = o.view(count, num_kv_heads, st.members, width, head_dim).transpose(1, 2).flatten(0, 1)
    l = l.view(count, num_kv_heads, st.members, width).transpose(1, 2).flatten(0, 1)
    return (o[st.valid], l[st.valid]) if st.valid is not None else (o, l)


def _attend_each_group(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       groups: list[PrefixGroup], scale: float, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, softcap: float | None = None):
    """Each group's shared prefix once for all its members' queries, one call per group (split
    parts merged); the groups' rows follow each other in plan order. Same results as
    `_attend_stacked` for the groups it stacks."""
    _, num_kv_heads, width, head_dim = queries.shape
    shared_out, shared_lse = [], []
    for g in groups:
        parts = (g.splits, -1, num_kv_heads, head_dim)
        if g.scattered is None:  # a view of the consecutive blocks
            k_rows, v_rows = k_cache[g.first_block:g.first_block + g.blocks], v_cache[g.first_block:g.first_block + g.blocks]
        else:
            k_rows, v_rows = _gather(k_cache, g.scattered), _gather(v_cache, g.scattered)
        k = _heads_first(k_rows.view(parts), k_scale)  # [splits, Hkv, T / splits, D]
        v = _heads_first(v_rows.view(parts), v_scale)
        members = g.end - g.start
        grouped = queries[g.start:g.end].transpose(0, 1).reshape(1, num_kv_heads, members * width, head_dim)
        o, l = _attend_lse(grouped.expand(g.splits, -1, -1, -1), k, v, scale, softcap=softcap)
        if g.splits > 1:  # merge the parts
            whole = torch.logsumexp(l, 0, keepdim=True)
            o, l = (o * torch.exp(l - whole)[..., None]).sum(0, keepdim=True), whole
        shared_out.append(o.reshape(num_kv_heads, members, width, head_dim).transpose(0, 1))
        shared_lse.append(l.reshape(num_kv_heads, members, width).transpose(0, 1))
    return torch.cat(shared_out), torch.cat(shared_lse)


def _consecutive(blocks: list[int]) -> bool:
    """Whether the blocks follow each other in the cache, so a slice reads them in place."""
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def _leading_run(blocks: list[int]) -> int:
    """How many of the first blocks are consecutive in the cache (a shared prompt usually is)."""
    run = 1
    while run < len(blocks) and blocks[run] == blocks[0] + run:
        run += 1
    return run


def _rows(cache: torch.Tensor, blocks: list[int], lo: int, hi: int, block_size: int) -> torch.Tensor:
    """The cache rows of positions lo..hi-1, [hi - lo, Hkv, D]: a view when their blocks are
    consecutive, else a gather of just those blocks."""
    first, last = lo // block_size, (hi - 1) // block_size
    ids = blocks[first:last + 1]
    if _consecutive(ids):
        part = cache[ids[0]:ids[0] + len(ids)]
    else:
        part = _gather(cache, torch.tensor(ids, device=cache.device))
    offset = lo - first * block_size
    return part.flatten(0, 1)[offset:offset + hi - lo]


def _attend_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    context_len: int, scale: float, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's new rows q [N, H, D] over its blocks `table`: the new rows causal among
    themselves (a square: one causal call that skips the masked half), and every cached key
    before them visible without a mask: the leading run of consecutive blocks (usually the
    shared prompt) read in place, the rest gathered. Partial results merge by log-sum-exp.
    With a `window` that hides keys from some row, one call over the keys from the first row's
    window on, with a band mask."""
    width = q.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    blocks = table.tolist()
    queries = q.float().view(width, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, N, D]
    head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)

    def attend(lo: int, hi: int, causal: bool = False, mask: torch.Tensor | None = None):
        # K/V as [Hkv, G, T, D] with a stride-0 G axis: each KV head serves its query heads uncopied
        shape = (num_kv_heads, group, hi - lo, head_dim)
        k = from_cache(_rows(k_cache, blocks, lo, hi, block_size), k_scale).transpose(0, 1).unsqueeze(1)
        v = from_cache(_rows(v_cache, blocks, lo, hi, block_size), v_scale).transpose(0, 1).unsqueeze(1)
        return _attend_lse(queries, k.expand(shape), v.expand(shape), scale, mask=mask, causal=causal,
                           softcap=softcap)

    cached = context_len - width
    if window is not None and context_len > window:  # the last row's window starts past key 0
        lo = max(0, cached - window + 1)
        keys = torch.arange(lo, context_len, device=q.device)[None, :]
        rows = cached + torch.arange(width, device=q.device)[:, None]
        band = torch.zeros((width, context_len - lo), dtype=torch.float32, device=q.device)
        band.masked_fill_((keys > rows) | (keys <= rows - window), float("-inf"))
        out, lse = attend(lo, context_len, mask=band[None, None])
        return _sunk(out, lse, head_sinks).permute(2, 0, 1, 3).reshape(width, q.shape[1], head_dim).to(q.dtype)
    out, lse = attend(cached, context_len, causal=True)
    in_place = min(_leading_run(blocks) * block_size, cached)
    parts = [(lo, hi) for lo, hi in ((0, in_place), (in_place, cached)) if hi > lo]
    for i, (lo, hi) in enumerate(parts):
        part_out, part_lse = attend(lo, hi)
        out = _merge(part_out, part_lse, out, lse)
        if i + 1 < len(parts) or sinks is not None:  # the combined log-sum-exp, for the next part or the sinks
            lse = torch.logaddexp(part_lse, lse)
    return _sunk(out, lse, head_sinks).permute(2, 0, 1, 3).reshape(width, q.shape[1], head_dim).to(q.dtype)

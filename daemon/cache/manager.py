"""The cache manager: sequences, block tables, admission, forks, pins and the audit.

It is torch-free: it decides which physical blocks hold which tokens; the engine
moves the data. A sequence's life::

    can_admit() / admit()   look up the cached prefix, reserve blocks for the rest
                            of the prompt plus the output reservation
    append(n) / append_tokens(ids)
                            fill reserved blocks (then new ones); full blocks are
                            indexed under their chain keys; a shared partial block
                            is copied first and the (src, dst) pair returned
    append_draft(n) / drop_draft()
                            a speculative draft's slots at the tail, never indexed,
                            taken back whole once the model has judged it
    fork()                  share every block with a child (n > 1 sampling, beams)
    slide(computed)         a model whose every layer slides a window: give back the
                            blocks before the window of the next token (they stay
                            cached), and top the reservation up again
    release()               the one release path: tail blocks first, idempotent

Sliding windows (`window=W`): a token at position p attends to p-W+1..p only, so a sequence
needs the blocks of its last W tokens and of the tokens it computes next. Its table keeps one
entry per logical block; those it gave back read `DROPPED`. It reserves at most what its window
and a step's tokens span (`window_blocks`), not its whole prompt and output.

Blocks an operator can see, by state (counted in O(1))::

    free      no content, nobody holds it
    reserved  held by an admitted sequence, not written yet
    active    written, one holder
    shared    written, several holders (ref count > 1)
    cached    idle, indexed, evictable in policy order
    pinned    idle, indexed, kept by a pin
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

from kvctl.policies.admission import (AdmissionDecision, Verdict, blocks_for_tokens, decide, peak_blocks,
                                      sliding_window_blocks)
from kvctl.policies.eviction import EvictionPolicy, make_eviction_policy
from kvctl.policies.tenant_shares import OTHERS, TenantShares, share_blocks

from .errors import (AuditFailure, CacheFull, DuplicateSequence, InvalidRequest, PinLeavesNoRoom, UnknownPin,
                     UnknownSequence)
from .hit_curve import HitCurve
from .keys import BlockKey, Namespace, PrefixHasher, chain_keys, validate_block_size
from .pins import BREAKPOINT_OWNER, Pin, PinRegistry, pin_id_for, pin_origin
from .pool import BlockPool


DROPPED = -1  # a table entry a sliding-window sequence gave back (no block: nothing reads it again)


def block_ids(ids: Iterable[int]) -> array:
    """A block table's entries as C ints (32-bit: block ids and DROPPED)."""
    return array("i", ids)


@dataclass(slots=True)
class SequenceState:
    seq_id: str  # caller's id, unique among live sequences
    tenant: str  # owner of the sequence; pins and isolation follow it
    # physical block of each logical block, covering num_tokens exactly: C ints (`block_table_ids`),
    # so a step copies each sequence's table into its batch's as bytes, not as Python ints
    table: array
    reserve: list[int]  # blocks held for this sequence's future tokens (state: reserved)
    num_tokens: int  # tokens written (cached prefix hits included)
    keys: list[BlockKey]  # chain keys known for its full blocks, root first
    hasher: PrefixHasher | None  # continues the chain for appended tokens; None: keys given by caller
    hit_tokens: int = 0  # prompt tokens served from the cache at admission
    prompt_tokens: int = 0  # prompt length at admission
    priority: int = 0  # the engine's (higher first): the `priority` eviction policy keeps its blocks longer
    draft: int = 0  # tokens at its tail written as a speculative draft (append_draft), not indexed
    draft_borrowed: int = 0  # free blocks the draft took beyond the sequence's reservation
    dropped: int = 0  # leading table entries given back (DROPPED) under a sliding window
    promised: int = 0  # table entries its prompt and output reservation come to (blocks_for_tokens)

    @property
    def held_blocks(self) -> int:
        """Blocks its table holds now (the entries not given back under a sliding window)."""
        return len(self.table) - self.dropped


@dataclass(frozen=True, slots=True)
class Admission:
    seq_id: str
    hit_blocks: int  # cached blocks reused for the prompt's prefix
    hit_tokens: int  # hit_blocks x block size
    reserved_blocks: int  # new blocks reserved for the rest of the prompt and the output


@dataclass(frozen=True, slots=True)
class PinResult:
    pin: Pin
    cached_blocks: int  # blocks of the prefix in the cache now (pinned at once)
    pending_blocks: int  # blocks not cached yet; pinned when a request fills them
    refreshed: bool  # True when an existing pin of the same prefix was updated
    # refreshed: the pin's owner, note and expires_at (the clock's; None: none) before this call set them
    was: dict | None = None
    # the ids of the tenant's breakpoint holds let go to make room for it in the tenant's pin budget
    let_go: tuple[str, ...] = ()


ROOTS_MARGIN = 1024  # roots kept beyond twice the pool's blocks before the forgotten ones go


@dataclass(slots=True)
class RootInfo:
    """What the manager knows of a prefix tree, keyed by its first block's key."""

    tenant: str  # whose namespace the chain was hashed under
    first_seen: float  # clock value of the first admission that reached it
    last_use: float  # clock value of the latest admission that reached it
    hits: int = 0  # admissions that reused at least its first block
    # the LoRA adapter it was hashed under (its digest, Namespace.adapter_id; "": the base model);
    # None where not known (restored from a lower tier before any admission reached it)
    adapter_id: str | None = None
    # the block space it was hashed in (Namespace.space_key): a tree of another space than the
    # served one (older scales, say) is cached but no request reaches it; None where not known
    space: BlockKey | None = None

    def stale(self, served: BlockKey) -> bool:
        """Whether its tree was hashed in another block space than `served` (no request reaches it)."""
        return self.space is not None and self.space != served


@dataclass(frozen=True, slots=True)
class EvictionReport:
    evicted_blocks: int
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> keys left alone


class KVCacheManager:
    """Paged KV cache bookkeeping over one pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, *, policy: str | EvictionPolicy = "lru",
                 block_bytes: int = 1, pin_budget_blocks: int | None = None,
                 pin_budgets: dict[str, int] | None = None,
                 clock: Callable[[], float] | None = None,
                 window: int | None = None, step_tokens: int = 1) -> None:
        """`window`: the model's sliding window where every layer slides one (see the module
        docstring); `step_tokens`: the most tokens one sequence computes in a step (a prompt
        chunk), which a sliding sequence holds blocks for beside its window."""
        self.block_size = validate_block_size(block_size)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise InvalidRequest(f"window: must be a positive number of tokens or None, got {window!r}")
        self.window = window
        self.step_tokens = step_tokens  # (kvd's max_batch_tokens: a reload sets it again)
        self.window_released = 0  # blocks sequences gave back as their window passed them (`slide`)
        if isinstance(policy, str):
            policy = make_eviction_policy(policy, block_tokens=block_size, block_bytes=block_bytes)
        self.pool = BlockPool(num_blocks, policy)
        self.num_blocks = num_blocks
        default_budget = num_blocks // 2 if pin_budget_blocks is None else pin_budget_blocks
        self.pins = PinRegistry(default_budget, pin_budgets)
        # the room, in tokens of one sequence, a new pin must leave beside the pins (set_pin_room)
        self.pin_room_tokens = 0
        self._seqs: dict[str, SequenceState] = {}
        self.num_reserved = 0
        self._clock = clock or _logical_clock()
        self.roots: dict[BlockKey, RootInfo] = {}
        self.block_bytes = block_bytes
        # what an LRU cache of other sizes would have served of the prompts looked up (hit_curve.py), where
        # the owner keeps one (the engine: it feeds each prompt as first admitted; `release`, the written blocks)
        self.hit_curve: HitCurve | None = None

    @property
    def policy_name(self) -> str:
        return self.pool.policy.name

    def set_tenant_shares(self, shares: Sequence[tuple[str, float]]) -> None:
        """Give tenants shares of the pool as (tenant, fraction) pairs, `*` for the others: when
        room is needed, a tenant holding more idle blocks than its share loses its own first
        (policies.tenant_shares). Empty: no shares. Safe while blocks are cached."""
        pool = self.pool
        current = pool.policy
        if isinstance(current, TenantShares):
            if shares:
                current.shares = share_blocks(shares, self.num_blocks)
            else:
                pool.policy = current.inner
            return
        if shares:
            blocks = pool.blocks
            wrapped = TenantShares(current, lambda block_id: blocks[block_id].tenant,
                                   share_blocks(shares, self.num_blocks))
            wrapped.adopt(current.order())
            pool.policy = wrapped

    def tenant_shares(self) -> dict[str, dict] | None:
        """Per tenant with idle blocks or a share: its idle (evictable) blocks and its share in
        blocks (None: no share); None when no shares are set."""
        policy = self.pool.policy
        if not isinstance(policy, TenantShares):
            return None
        idle = policy.idle_blocks()
        named = set(idle) | {t for t in policy.shares if t != OTHERS}
        return {tenant: {"idle_blocks": idle.get(tenant, 0), "share_blocks": policy.share_of(tenant)}
                for tenant in sorted(named)}

    # ---- reading ---------------------------------------------------------------------------
    def state_counts(self) -> dict[str, int]:
        """Blocks by operator-visible state; sums to num_blocks. O(1)."""
        pool = self.pool
        free, cached, pinned = pool.num_free, pool.num_evictable, pool.num_pinned_idle
        reserved, shared = self.num_reserved, pool.num_shared
        active = self.num_blocks - free - cached - pinned - reserved - shared
        return {"free": free, "reserved": reserved, "active": active, "shared": shared,
                "cached": cached, "pinned": pinned}

    def sequence(self, seq_id: str) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def holding(self, seq_id: str) -> tuple[int, int]:
        """The blocks a sequence holds, reserved ones included, and of those the reserved ones it
        has not written yet; (0, 0) when it is gone."""
        seq = self._seqs.get(seq_id)
        return (0, 0) if seq is None else (seq.held_blocks + len(seq.reserve), len(seq.reserve))

    def block_table(self, seq_id: str) -> list[int]:
        """One physical block per logical block; DROPPED where a sliding sequence gave it back."""
        return list(self.sequence(seq_id).table)

    def block_table_ids(self, seq_id: str) -> array:
        """`block_table` as the sequence's own array of C ints, not a copy: for a step to copy into
        its batch's table at once (read it before the cache changes the sequence again)."""
        return self.sequence(seq_id).table

    @property
    def window_blocks(self) -> int | None:
        """The most blocks a sliding sequence holds at once (`sliding_window_blocks`); None without a window."""
        return None if self.window is None else sliding_window_blocks(self.window, self.step_tokens, self.block_size)

    def set_pin_room(self, tokens: int) -> None:
        """Keep room for a sequence of `tokens` tokens (prompt and output) beside the pins: a new
        pin that would leave fewer blocks outside them is refused (PinLeavesNoRoom). 0: none kept.
        Pins that stand already stay; a request they leave too little room is turned away as
        before (pinned_out)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= self.capacity_tokens:
            raise InvalidRequest(f"pin_room_tokens: must be a whole number of tokens from 0 to what the cache "
                                 f"holds ({self.num_blocks} blocks of {self.block_size}: {self.capacity_tokens}), "
                                 f"got {tokens!r}")
        self.pin_room_tokens = tokens

    @property
    def capacity_tokens(self) -> int:
        """The tokens the whole cache holds."""
        return self.num_blocks * self.block_size

    @property
    def pin_room_blocks(self) -> int:
        """The blocks a new pin must leave beside the pins (under a window, those its sequence holds at once)."""
        return self.peak_blocks(self.pin_room_tokens) if self.pin_room_tokens else 0

    def peak_blocks(self, tokens: int) -> int:
        """The most blocks a sequence of `tokens` tokens holds at once (`policies.admission.peak_blocks`)."""
        return peak_blocks(tokens, self.block_size, self.window, self.step_tokens)

    def first_needed(self, computed_tokens: int) -> int:
        """The first logical block the token after `computed_tokens` attends to (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, computed_tokens - self.window + 1) // self.block_size

    def _reservation(self, promised: int, entries: int, held: int) -> int:
        """Blocks to hold in reserve for a sequence whose table has `entries` of its `promised`
        entries, `held` of them held: all it still appends, or under a window what keeps it
        within `window_blocks`."""
        rest = max(promised - entries, 0)
        return rest if self.window_blocks is None else max(0, min(rest, self.window_blocks - held))

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def reserved_block_ids(self) -> set[int]:
        """Blocks held in reservations (state: reserved), for block maps."""
        return {b for seq in self._seqs.values() for b in seq.reserve}

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def cacheable_blocks(self, prompt_tokens: int) -> int:
        """Full blocks a prompt may take from the cache.

        NOTE: the last prompt token is always computed (its logits start decoding),
        so a prompt of exactly k full blocks can reuse at most k - 1 of them.
        """
        return max(prompt_tokens - 1, 0) // self.block_size

    def lookup(self, keys: Sequence[BlockKey], prompt_tokens: int | None = None) -> int:
        """Blocks of the longest prefix of `keys` a prompt takes from the cache (under a window,
        see `_hit`). Reads only."""
        limit = None if prompt_tokens is None else self.cacheable_blocks(prompt_tokens)
        return self._hit(keys, limit)[0]

    def _hit(self, keys: Sequence[BlockKey], limit: int | None) -> tuple[int, int, list[int]]:
        """The prefix hit of `keys` (at most `limit` blocks): its length in blocks, how many of its
        first blocks the next token's window does not reach, and the cached blocks it does reach.

        Without a window every block from the root must be cached. Under one only those the next
        token attends to: a prompt whose first blocks were evicted (a sliding sequence gives them
        back first, so LRU takes them first) still hits the rest, as vLLM's sliding-window
        prefix caching does."""
        if self.window is None:
            hits = self.pool.match(keys, limit)
            return len(hits), 0, hits
        block_of, length, run = self.pool.block_of, 0, 0
        for i, key in enumerate(keys if limit is None else keys[:limit]):
            run = run + 1 if block_of(key) is not None else 0
            if run and run >= i + 1 - self.first_needed((i + 1) * self.block_size):
                length = i + 1  # blocks first_needed..i are all cached
        skipped = self.first_needed(length * self.block_size)
        return length, skipped, [block_of(key) for key in keys[skipped:length]]

    # ---- admission -------------------------------------------------------------------------
    def can_admit(self, keys: Sequence[BlockKey], prompt_tokens: int, reserve_tokens: int, *,
                  request: str = "?", queue_length: int = 0,
                  queue_limit: int | None = None, reuse: bool = True) -> AdmissionDecision:
        """Would `admit` succeed now? Reads only."""
        self._check_counts(request, prompt_tokens, reserve_tokens)
        length, _, held = self._hit(keys, self.cacheable_blocks(prompt_tokens)) if reuse else (0, 0, [])
        needed = self._reservation(blocks_for_tokens(prompt_tokens + reserve_tokens, self.block_size), length,
                                   len(held))
        available = self.pool.available() - self.pool.evictable_in(held)
        return decide(request=request, needed_blocks=needed, available_blocks=available,
                      total_blocks=self.num_blocks, hit_blocks=length,
                      queue_length=queue_length, queue_limit=queue_limit)

    def admit(self, seq_id: str, keys: Sequence[BlockKey], prompt_tokens: int, reserve_tokens: int,
              *, tenant: str = "default", hasher: PrefixHasher | None = None, reuse: bool = True,
              adapter_id: str | None = None, priority: int = 0) -> Admission:
        """Take the cached prefix and reserve blocks for the rest of the prompt and the output.
        Under a sliding window only the hit blocks the next token's window reaches are taken
        (the rest of the hit is counted, and stays cached), and the reservation is capped.

        `keys` are the chain keys of the prompt's full blocks; `adapter_id`, the LoRA adapter of
        their namespace ("": the base model), recorded for their tree; `priority`, the engine's
        (higher first), what the blocks it reuses and writes are worth to the eviction policy. All or nothing:
        CacheFull leaves every block as it was. `reuse=False` takes nothing from the cache (a
        prompt whose every position must be computed); its full blocks are still indexed as they
        fill, where no other block holds their key.
        """
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id)
        self._check_counts(seq_id, prompt_tokens, reserve_tokens)
        if len(keys) > prompt_tokens // self.block_size:
            raise InvalidRequest(f"request {seq_id}: {len(keys)} keys for {prompt_tokens} prompt tokens "
                                 f"at block size {self.block_size}")
        pool, now = self.pool, self._clock()
        length, skipped, held = self._hit(keys, self.cacheable_blocks(prompt_tokens)) if reuse else (0, 0, [])
        promised = blocks_for_tokens(prompt_tokens + reserve_tokens, self.block_size)
        needed = self._reservation(promised, length, len(held))
        available = pool.available() - pool.evictable_in(held)
        if needed > available:
            raise CacheFull(seq_id, needed, available, self.num_blocks)
        pool.acquire(held, now, hit=True, priority=priority)
        touched = [b for b in map(pool.block_of, keys[:skipped]) if b is not None]
        if touched:  # the hit's cached blocks before the window are reused as the engine counts them: touched, not held
            pool.acquire(touched, now, hit=True, priority=priority)
            pool.release(reversed(touched), now)
        reserve = pool.allocate(needed, now, seq_id)
        if keys:
            root = self.roots.get(keys[0])
            if root is None:
                root = self.roots[keys[0]] = RootInfo(tenant, now, now)
            if root.adapter_id is None:
                root.adapter_id = adapter_id
            if root.space is None and hasher is not None:
                root.space = hasher.namespace.space_key()
            root.last_use = now
            root.hits += bool(length)
        reserve.reverse()  # pop() hands them out in allocation order
        self.num_reserved += needed
        self._seqs[seq_id] = SequenceState(
            seq_id=seq_id, tenant=tenant, table=block_ids([DROPPED] * skipped + held), reserve=reserve,
            num_tokens=length * self.block_size, keys=list(keys), hasher=hasher,
            hit_tokens=length * self.block_size, prompt_tokens=prompt_tokens, priority=priority,
            dropped=skipped, promised=promised)
        self._bound_roots()  # after the sequence is registered: its root is kept
        return Admission(seq_id, length, length * self.block_size, needed)

    def admit_tokens(self, seq_id: str, namespace: Namespace, prompt_token_ids: Sequence[int],
                     reserve_tokens: int, priority: int = 0) -> Admission:
        """`admit` for a prompt given as token ids; later `append_tokens` continues the chain."""
        if namespace.block_size != self.block_size:
            raise InvalidRequest(f"namespace.block_size: {namespace.block_size} does not match the "
                                 f"pool's block size {self.block_size}")
        hasher = PrefixHasher(namespace)
        keys = hasher.feed(prompt_token_ids)
        return self.admit(seq_id, keys, len(prompt_token_ids), reserve_tokens,
                          tenant=namespace.tenant, hasher=hasher, adapter_id=namespace.adapter_id, priority=priority)

    def _check_counts(self, request: str, prompt_tokens: int, reserve_tokens: int) -> None:
        if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise InvalidRequest(f"request {request}: prompt_tokens must be >= 1, got {prompt_tokens!r}")
        if not isinstance(reserve_tokens, int) or reserve_tokens < 0:
            raise InvalidRequest(f"request {request}: reserve_tokens must be >= 0, got {reserve_tokens!r}")

    # ---- growth ----------------------------------------------------------------------------
    def append(self, seq_id: str, num_tokens: int, new_keys: Iterable[BlockKey] = ()) -> list[tuple[int, int]]:
        """Write `num_tokens` more tokens; returns (src, dst) block copies the engine must do first.

        Blocks come from the sequence's reservation, then from the pool. Blocks
        that become full are indexed under the sequence's known keys (`new_keys`
        extends them). All or nothing: CacheFull leaves the sequence unchanged.
        """
        seq = self.sequence(seq_id)
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidRequest(f"request {seq_id}: num_tokens must be >= 0, got {num_tokens!r}")
        pool, size = self.pool, self.block_size
        table, reserve = seq.table, seq.reserve
        old_tokens = seq.num_tokens
        new_tokens = old_tokens + num_tokens
        grow, tail_shared, from_pool = self._growth(seq, num_tokens)
        now = self._clock()
        if from_pool > 0:
            available = pool.available()
            if from_pool > available:
                raise CacheFull(seq_id, from_pool, available, self.num_blocks)
            taken = pool.allocate(from_pool, now, seq_id)
            taken.reverse()
            reserve[:0] = taken  # NOTE: taken blocks are used after the reserved ones
            self.num_reserved += from_pool
        copies: list[tuple[int, int]] = []
        if tail_shared:
            src = table[-1]
            dst = reserve.pop()
            table[-1] = dst
            pool.release((src,), now)
            copies.append((src, dst))
            self.num_reserved -= 1
        if grow > 0:
            split = len(reserve) - grow
            table.extend(reversed(reserve[split:]))  # the stack's top is used first
            del reserve[split:]
            self.num_reserved -= grow
        seq.keys.extend(new_keys)
        seq.num_tokens = new_tokens
        keys = seq.keys
        first_full, last_full = old_tokens // size, min(new_tokens // size, len(keys))
        if last_full > first_full:
            private = seq.hasher.private if seq.hasher is not None else None
            pool.insert_many(table, keys, first_full, last_full, now, seq.tenant, seq.priority,
                             own_from=private[0] if private is not None else None)
        return copies

    def _growth(self, seq: SequenceState, num_tokens: int) -> tuple[int, bool, int]:
        """What writing `num_tokens` more takes: blocks the table grows by, whether its shared
        partial tail block must be copied first, and blocks needed beyond the reservation."""
        size = self.block_size
        grow = -(-(seq.num_tokens + num_tokens) // size) - len(seq.table)
        tail_shared = (num_tokens > 0 and seq.num_tokens % size != 0
                       and self.pool.blocks[seq.table[-1]].ref_count > 1)
        return grow, tail_shared, grow + tail_shared - len(seq.reserve)

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """`append` for tokens given by id (decode); their full blocks get chain keys."""
        seq = self.sequence(seq_id)
        if seq.draft:
            raise InvalidRequest(f"request {seq_id}: {seq.draft} draft tokens at its tail; drop_draft() first")
        if seq.hasher is None:
            raise InvalidRequest(f"request {seq_id}: admitted by keys, so append_tokens cannot hash "
                                 "its tokens; use append() with keys")
        if seq.num_tokens < seq.prompt_tokens:
            raise InvalidRequest(f"request {seq_id}: {seq.num_tokens} of {seq.prompt_tokens} prompt "
                                 "tokens written; append the rest of the prompt with append() first")
        hasher = seq.hasher.copy()
        keys = hasher.feed(token_ids)
        copies = self.append(seq_id, len(token_ids), keys)
        seq.hasher = hasher
        return copies

    def append_draft(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Slots for `num_tokens` speculative tokens after the sequence's last: the model writes
        their K/V while it checks them, and `drop_draft` takes them all back before the accepted
        ones are appended again by id (into the same slots, so what the model wrote there stays).

        A draft is a guess: it takes the sequence's reservation and free blocks, never a cached
        block (CacheFull, with nothing changed, where those do not cover it). Its blocks are not
        indexed, so no other request can match a token the model has not accepted."""
        seq = self.sequence(seq_id)
        if seq.draft:
            raise InvalidRequest(f"request {seq_id}: already holds a draft of {seq.draft} tokens")
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidRequest(f"request {seq_id}: draft num_tokens must be >= 1, got {num_tokens!r}")
        borrowed = max(0, self._growth(seq, num_tokens)[2])
        if borrowed > self.pool.num_free:
            raise CacheFull(seq_id, borrowed, self.pool.num_free, self.num_blocks)
        known = len(seq.keys)
        copies = self.append(seq_id, num_tokens)
        assert len(seq.keys) == known  # nothing of a draft is indexed
        seq.draft, seq.draft_borrowed = num_tokens, borrowed
        return copies

    def drop_draft(self, seq_id: str) -> int:
        """Take back the sequence's draft slots (see `append_draft`); returns the tokens dropped.

        Blocks the draft alone filled go back on top of the reservation, in table order, so that
        appending the accepted tokens takes the same blocks again; those it borrowed from the
        free list beyond the reservation go back there."""
        seq = self.sequence(seq_id)
        dropped = seq.draft
        if not dropped:
            return 0
        seq.num_tokens -= dropped
        keep = -(-seq.num_tokens // self.block_size)
        surplus = seq.table[keep:]
        del seq.table[keep:]
        seq.reserve.extend(reversed(surplus))  # the top of the stack is handed out first
        borrowed = min(seq.draft_borrowed, len(seq.reserve))
        if borrowed:
            self.pool.release(seq.reserve[:borrowed], self._clock())
            del seq.reserve[:borrowed]
        self.num_reserved += len(surplus) - borrowed
        seq.draft = seq.draft_borrowed = 0
        return dropped

    def fork(self, parent_id: str, child_id: str, reserve_tokens: int = 0) -> Admission:
        """A child sequence sharing every block of its parent (ref counts +1).

        The child gets its own reservation for `reserve_tokens` more tokens, plus
        one block for the copy-on-write of a shared partial tail block.
        """
        parent = self.sequence(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(child_id)
        if not isinstance(reserve_tokens, int) or reserve_tokens < 0:
            raise InvalidRequest(f"request {child_id}: reserve_tokens must be >= 0, got {reserve_tokens!r}")
        size = self.block_size
        partial_tail = parent.num_tokens % size != 0
        promised = blocks_for_tokens(parent.num_tokens + reserve_tokens, size)
        # the block for the copy of a shared partial tail counts within a window's blocks too
        needed = self._reservation(promised, len(parent.table), parent.held_blocks + partial_tail) + partial_tail
        pool, now = self.pool, self._clock()
        if needed > pool.available():
            raise CacheFull(child_id, needed, pool.available(), self.num_blocks)
        pool.acquire(parent.table[parent.dropped:], now, hit=False)
        reserve = pool.allocate(needed, now, child_id)
        reserve.reverse()
        self.num_reserved += needed
        self._seqs[child_id] = SequenceState(
            seq_id=child_id, tenant=parent.tenant, table=block_ids(parent.table), reserve=reserve,
            num_tokens=parent.num_tokens, keys=list(parent.keys),
            hasher=None if parent.hasher is None else parent.hasher.copy(),
            hit_tokens=parent.hit_tokens, prompt_tokens=parent.prompt_tokens, priority=parent.priority,
            dropped=parent.dropped, promised=promised)
        return Admission(child_id, 0, 0, needed)

    # ---- sliding windows -------------------------------------------------------------------
    def slide(self, seq_id: str, computed_tokens: int) -> int:
        """Under a sliding window, give back the blocks before the window of the token after
        the sequence's first `computed_tokens` (no later token attends to them): they stay
        cached, as a finished sequence's do, and the reservation is topped up again to what
        the sequence still needs within `window_blocks`. The tail block is always kept.
        Returns the blocks given back (0 without a window)."""
        seq = self.sequence(seq_id)
        if self.window is None:
            return 0
        if not isinstance(computed_tokens, int) or not 0 <= computed_tokens <= seq.num_tokens:
            raise InvalidRequest(f"request {seq_id}: computed_tokens must be 0..{seq.num_tokens}, "
                                 f"got {computed_tokens!r}")
        first = min(self.first_needed(computed_tokens), len(seq.table) - 1)
        if first <= seq.dropped:
            return 0
        pool, now = self.pool, self._clock()
        gone = seq.table[seq.dropped:first]
        pool.release(reversed(gone), now)  # the deepest first, as `release` gives a table back
        seq.table[seq.dropped:first] = block_ids([DROPPED]) * len(gone)
        seq.dropped = first
        self.window_released += len(gone)
        # no more than it gave back, nor than the pool has (a block another sequence shares stays held)
        top_up = min(self._reservation(seq.promised, len(seq.table), seq.held_blocks) - len(seq.reserve),
                     len(gone), pool.available())
        if top_up > 0:
            taken = pool.allocate(top_up, now, seq_id)
            taken.reverse()
            seq.reserve[:0] = taken
            self.num_reserved += len(taken)
        return len(gone)

    # ---- the one release path --------------------------------------------------------------
    def release(self, seq_id: str, written_tokens: int | None = None) -> int:
        """Give back every block of a sequence; 0 if it is already gone. Returns blocks released.

        The table goes back tail-first so that under LRU a prefix's deepest block
        is evicted before its root; unused reserved blocks return to the free list.
        `written_tokens`: how many of its tokens the model has actually written (a sequence
        preempted mid-step was appended but never computed); blocks it indexed beyond that
        are dropped from the index instead of being cached with unwritten content.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return 0
        now = self._clock()
        if self.hit_curve is not None:
            written = seq.num_tokens if written_tokens is None else min(written_tokens, seq.num_tokens)
            self.hit_curve.touch(reversed(seq.keys[:written // self.block_size]), seq.tenant)  # (tail first)
        if written_tokens is not None and written_tokens < seq.num_tokens:
            pool = self.pool
            for position in range(max(written_tokens // self.block_size, seq.dropped), len(seq.table)):
                block = pool.blocks[seq.table[position]]
                if (block.key is not None and position < len(seq.keys) and block.key == seq.keys[position]
                        and block.ref_count == 1 and not block.pin_count):
                    pool.unindex(block.block_id)
        self.pool.release(reversed(seq.table[seq.dropped:]), now)
        self.pool.release(seq.reserve, now)
        self.num_reserved -= len(seq.reserve)
        return seq.held_blocks + len(seq.reserve)

    # ---- restores from lower tiers ---------------------------------------------------------
    def install(self, keys: Sequence[BlockKey], start: int, count: int, tenant: str,
                load: Callable[[Sequence[BlockKey], list[int]], None], space: BlockKey | None = None,
                priority: int = 0) -> int:
        """Put blocks start..start+count of a chain back into the cache from a lower tier.

        keys[:start] must be cached now (they are held meanwhile so that making room never
        evicts them); `load(keys, block_ids)` writes the data. The new blocks end up cached
        and idle, ready for the admission that follows. All or nothing if `load` raises.
        Returns blocks installed (fewer than `count` when the cache lacks room). `space`: the
        block space the lower tier holds them in, recorded for their tree; `priority`: the
        engine's, of the request they come back for (what the eviction policy weighs them at).
        """
        pool, now = self.pool, self._clock()
        hits = pool.match(keys[:start])
        if len(hits) != start:
            raise InvalidRequest(f"keys: only {len(hits)} of the first {start} blocks are cached")
        count = min(count, pool.available() - pool.evictable_in(hits), len(keys) - start)
        if count <= 0:
            return 0
        return self._install_at(keys, hits, list(range(start, start + count)), tenant, load, space, priority, now)

    def install_window(self, keys: Sequence[BlockKey], first: int, stop: int, tenant: str,
                       load: Callable[[Sequence[BlockKey], list[int]], None], space: BlockKey | None = None,
                       priority: int = 0) -> int:
        """Under a sliding window: put back from a lower tier the blocks of keys[first:stop] the
        cache lacks, so that a prompt's hit of `stop` blocks finds its window (blocks `first_needed`
        to stop-1) whole; the blocks before `first` are not needed. The ones cached already are
        held meanwhile. `load`, `space` and `priority` as `install` takes them. All or nothing:
        returns the blocks installed, 0 when the cache lacks room for them all."""
        if self.window is None:
            raise InvalidRequest("install_window: the cache has no sliding window; install restores a chain")
        pool, now = self.pool, self._clock()
        block_of = pool.block_of
        held = [b for key in keys[first:stop] if (b := block_of(key)) is not None]
        lacking = [i for i in range(first, stop) if block_of(keys[i]) is None]
        if not lacking or len(lacking) > pool.available() - pool.evictable_in(held):
            return 0
        return self._install_at(keys, held, lacking, tenant, load, space, priority, now)

    def _install_at(self, keys: Sequence[BlockKey], held: list[int], positions: list[int], tenant: str,
                    load: Callable[[Sequence[BlockKey], list[int]], None], space: BlockKey | None,
                    priority: int, now: float) -> int:
        """`install`'s work: hold the cached blocks `held` (making room must not evict them), give
        each of the chain's `positions` (ascending, not cached) a block, `load` them and index them,
        idle. Returns how many: all of them, or 0 when the blocks cannot be had (nothing changed)."""
        pool = self.pool
        pool.acquire(held, now, hit=False)
        try:
            ids = pool.allocate(len(positions), now, "restore")
        except CacheFull:
            pool.release(reversed(held), now)
            return 0
        try:
            load([keys[i] for i in positions], ids)
        except BaseException:
            pool.release(reversed(held + ids), now)
            raise
        table = [DROPPED] * (positions[-1] + 1)  # read only at `positions` (insert_many skips keys cached)
        for position, block_id in zip(positions, ids):
            table[position] = block_id
        pool.insert_many(table, keys, positions[0], positions[-1] + 1, now, tenant, priority)
        pool.release(reversed(held + ids), now)
        if keys[0] not in self.roots:
            self.roots[keys[0]] = RootInfo(tenant, now, now, space=space)
            self._bound_roots()  # the restored blocks are indexed: their root is kept
        return len(positions)

    # ---- pins ------------------------------------------------------------------------------
    def pin(self, namespace: Namespace, token_ids: Sequence[int], *, ttl: float | None = None,
            owner: str = "", note: str = "") -> PinResult:
        """Pin the full blocks of a token prefix under `namespace` (its tenant pays)."""
        return self.pin_keys(namespace.tenant, self.keys_to_pin(namespace, token_ids), ttl=ttl, owner=owner,
                             note=note, **pin_origin(namespace))

    def keys_to_pin(self, namespace: Namespace, token_ids: Sequence[int]) -> list[BlockKey]:
        """The block keys `pin` would pin: hashing only, no state read or changed, so a caller can
        hash outside the lock it holds around `pin_keys`. InvalidRequest for a namespace of another
        block size or a prefix shorter than a block."""
        if namespace.block_size != self.block_size:
            raise InvalidRequest(f"namespace.block_size: {namespace.block_size} does not match the "
                                 f"pool's block size {self.block_size}")
        keys = chain_keys(namespace, token_ids)
        if not keys:
            raise InvalidRequest(f"token_ids: {len(token_ids)} tokens is less than one block "
                                 f"({self.block_size} tokens); nothing to pin")
        return keys

    def pin_keys(self, tenant: str, keys: Sequence[BlockKey], *, ttl: float | None = None,
                 owner: str = "", note: str = "", space: str | None = None,
                 adapter_id: str | None = None, leave_room: bool = True,
                 created_at: float | None = None, holds_give_way: bool = True) -> PinResult:
        """Pin a chain of block keys for `tenant` (its budget pays). `space` and `adapter_id`:
        where the keys were made (Pin), when known; pinning the same keys again refreshes the
        pin's owner, note and TTL, and fills in what it did not know of where they were made.
        `leave_room`: refuse a pin that would leave requests fewer blocks than `pin_room_blocks`
        beside the pins (PinLeavesNoRoom; False: a pin restored as it stood). `created_at`: when
        it was first made, on this clock (a pin restored: before the restart; None: now).
        `holds_give_way`: past the tenant's budget, its requests' breakpoint holds are let go, the
        soonest to lapse first, where that makes room (`let_go`); an operator's pin comes first."""
        if not keys:
            raise InvalidRequest("keys: a pin needs at least one block")
        if ttl is not None and not 0 < ttl < math.inf:
            raise InvalidRequest(f"ttl: must be a finite number of seconds > 0, got {ttl!r}")
        now = self._clock()
        key_tuple = tuple(keys)
        pin_id = pin_id_for(tenant, key_tuple)
        expires = None if ttl is None else now + ttl
        cached = len(self.pool.match(key_tuple))
        if pin_id in self.pins:
            existing = self.pins.get(pin_id)
            was = {"owner": existing.owner, "note": existing.note, "expires_at": existing.expires_at}
            existing.owner, existing.note, existing.expires_at = owner, note, expires
            existing.breakpoint = False  # (a breakpoint's hold pinned by an operator is theirs now)
            existing.space = existing.space if space is None else space
            existing.adapter_id = existing.adapter_id if adapter_id is None else adapter_id
            return PinResult(existing, cached, len(key_tuple) - cached, refreshed=True, was=was)
        let_go = self._holds_in_the_way(tenant, key_tuple) if holds_give_way else []
        if not let_go:
            self.pins.check_budget(tenant, key_tuple)
        # (a prefix longer than the whole cache is the warm's to refuse: it never fits)
        if leave_room and (floor := self.pin_room_blocks) and len(key_tuple) <= self.num_blocks:
            added = self.pool.new_pin_keys(key_tuple)
            pinned_after = self.pool.num_pin_keys + added
            if added and self.num_blocks - pinned_after < floor:
                raise PinLeavesNoRoom(added, pinned_after, self.num_blocks, floor)
        for hold in let_go:
            self.unpin(hold.pin_id)
        pin = Pin(pin_id, tenant, key_tuple, owner, note, now if created_at is None else created_at, expires, space,
                  adapter_id)
        self.pins.add(pin)
        self.pool.add_pin_refs(key_tuple, now)
        return PinResult(pin, cached, len(key_tuple) - cached, refreshed=False,
                         let_go=tuple(hold.pin_id for hold in let_go))

    def _holds_in_the_way(self, tenant: str, keys: tuple[BlockKey, ...]) -> list[Pin]:
        """The fewest of `tenant`'s breakpoint holds, the soonest to lapse first, whose going would
        let `keys` into its pin budget: none where they fit already, or where they would not fit
        even with every hold gone (the budget check then refuses them). Reads only."""
        budget = self.pins.budget(tenant)
        mine = [pin for pin in self.pins.all() if pin.tenant == tenant]
        if len({key for pin in mine for key in pin.keys} | set(keys)) <= budget:
            return []
        holds = sorted((pin for pin in mine if pin.breakpoint),
                       key=lambda pin: (math.inf if pin.expires_at is None else pin.expires_at, pin.pin_id))
        staying = [pin for pin in mine if not pin.breakpoint]
        for n in range(1, len(holds) + 1):
            if len({key for pin in staying + holds[n:] for key in pin.keys} | set(keys)) <= budget:
                return holds[:n]
        return []

    def hold(self, tenant: str, keys: Sequence[BlockKey], ttl: float, *, space: str | None = None,
             adapter_id: str | None = None, created_at: float | None = None) -> str:
        """Keep a request's prompt cache breakpoint (daemon/server/cache_breakpoints.py): the chain
        `keys` pinned for `tenant` for `ttl` seconds from now, as a pin marked `breakpoint`, owned by
        BREAKPOINT_OWNER. "held": a new one; "extended": the tenant's breakpoint pin of these keys
        lives `ttl` from now where that is later than it would; "pinned": an operator's pin holds
        them already (left as it is). PinBudgetExceeded or PinLeavesNoRoom as `pin_keys`.
        `created_at`: when a new one was first made (one held again after a restart), as `pin_keys`."""
        key_tuple = tuple(keys)
        pin_id = pin_id_for(tenant, key_tuple)
        if pin_id in self.pins:
            existing = self.pins.get(pin_id)
            if not existing.breakpoint:
                return "pinned"
            until = self._clock() + ttl
            if existing.expires_at is not None and until > existing.expires_at:
                existing.expires_at = until
            return "extended"
        result = self.pin_keys(tenant, key_tuple, ttl=ttl, owner=BREAKPOINT_OWNER, holds_give_way=False,
                               note="a request's prompt_cache_breakpoint", space=space, adapter_id=adapter_id,
                               created_at=created_at)
        result.pin.breakpoint = True
        return "held"

    def room_beside_pins(self, keys: Sequence[BlockKey], reuse: bool = True) -> tuple[int, int]:
        """(the cached blocks pins hold outside the cached prefix of these block keys, the most
        blocks a sequence whose prompt has them could ever hold: the cache's less those; with
        `reuse` False, every pinned block counts). O(pinned keys): a caller that needs fewer
        blocks than `num_blocks - pool.num_pin_keys` can skip it. Reads only."""
        pinned = self.pool.pinned_blocks()
        if reuse and pinned:
            pinned -= set(self.pool.match(keys, self.num_blocks))
        return len(pinned), self.num_blocks - len(pinned)

    def unpin(self, pin_id: str) -> Pin:
        pin = self.pins.remove(pin_id)
        self.pool.drop_pin_refs(reversed(pin.keys), self._clock())  # deepest first, as on release
        return pin

    def expire_pins(self, now: float | None = None) -> list[Pin]:
        """Drop pins whose TTL has lapsed at `now` (default: the manager's clock)."""
        now = self._clock() if now is None else now
        return [self.unpin(pin_id) for pin_id in self.pins.expired(now)]

    # ---- operator eviction -----------------------------------------------------------------
    def evict_prefix(self, keys: Sequence[BlockKey], dry_run: bool = False,
                     reason: str = "operator") -> EvictionReport:
        """Evict the cached blocks of a prefix, deepest first; in-use and pinned blocks stay.
        `dry_run`: report what would go, and change nothing. `reason`: BlockPool.evict_keys."""
        evicted, skipped = self.pool.evict_keys(reversed(keys), self._clock(), dry_run=dry_run, reason=reason)
        return EvictionReport(len(evicted), {k: v for k, v in skipped.items() if v})

    def evict_where(self, select: Callable[[BlockKey, RootInfo | None, str | None], bool],
                    dry_run: bool = False, reason: str = "operator") -> EvictionReport:
        """Evict every indexed block whose (root key, root info, tenant) `select` accepts, deepest first."""
        chosen = [b for b in self.pool.blocks
                  if b.key is not None and select(b.root, self.roots.get(b.root), b.tenant)]
        chosen.sort(key=lambda b: -b.depth)
        return self.evict_prefix([b.key for b in reversed(chosen)], dry_run=dry_run, reason=reason)

    def release_all(self) -> EvictionReport:
        """Drop every cached block, pinned ones too (kvd going to sleep: the memory they are in is
        given back). Their pins stay: a pinned block pins again as it is filled or restored. Refused
        (AuditFailure) while a sequence holds blocks: nothing is dropped then."""
        if self._seqs:
            raise AuditFailure(f"release_all: {len(self._seqs)} sequences hold blocks; the cache is released "
                               "only when none does")
        chosen = sorted((b for b in self.pool.blocks if b.key is not None), key=lambda b: -b.depth)
        evicted, skipped = self.pool.evict_keys([b.key for b in chosen], self._clock(), reason="sleep",
                                                pinned_too=True)
        return EvictionReport(len(evicted), {k: v for k, v in skipped.items() if v})

    def evict_stale(self, served: BlockKey) -> EvictionReport:
        """Drop the cached blocks of every tree hashed in another block space than `served` (new
        scales made them unreachable; a pin's blocks stay, as its stranded pin says), so that they
        neither wait for the policy (a hot tree's hits keep it under `lfu` or `cost`) nor go down
        to a lower tier when it comes to them."""
        return self.evict_where(lambda root, info, tenant: info is not None and info.stale(served), reason="space")

    def reprioritise_tenants(self, changes: Mapping[str, int]) -> dict[str, int]:
        """Cached blocks of each tenant in `changes` move to its new priority (`eviction: priority`
        ranks them by the engine's priority, which counts the tenant's): {tenant: blocks moved}."""
        return dict(self.pool.reprioritise_tenants(changes))

    def adapter_blocks(self) -> dict[str | None, int]:
        """Indexed blocks of the pool by the LoRA adapter their tree was hashed under (its digest;
        "": the base model; None: not known)."""
        counts: dict[str | None, int] = {}
        roots = self.roots
        for b in self.pool.blocks:
            if b.key is not None:
                info = roots.get(b.root)
                adapter = info.adapter_id if info is not None else None
                counts[adapter] = counts.get(adapter, 0) + 1
        return counts

    def cached_block_rows(self) -> list[tuple]:
        """Every indexed block of the pool (tier "device"), never its tokens, as a plain tuple in
        CachedBlock's field order: `CachedBlock(*row)` makes what `PrefixTree` reads. Tuples, so that
        the caller's lock covers only the read (13-30 ms for 100,000 blocks, where making the
        CachedBlocks there held it for 112-125 ms: scripts/prefix-tree-time --pool-blocks)."""
        return [(b.key, b.parent, b.root, b.depth, "device", b.tenant, b.hits, b.last_use, b.pin_count > 0,
                 b.ref_count > 0, b.own) for b in self.pool.blocks if b.key is not None]

    def _bound_roots(self) -> None:
        """Keep `roots` from growing with every prompt start ever seen (a daemon nobody lists the
        prefixes of would otherwise grow it for its whole life): past twice the pool's blocks plus
        a margin (a root with a block here holds one of them), forget the roots with no block here.
        Amortised O(1) per new root. What a lower tier alone holds loses its hits and last use;
        its blocks keep their tenant."""
        if len(self.roots) > 2 * self.num_blocks + ROOTS_MARGIN:  # keep what running sequences start with
            self.forget_roots(keep={seq.keys[0] for seq in self._seqs.values() if seq.keys})

    def forget_roots(self, keep: Collection[BlockKey] = ()) -> None:
        """Drop what is known of a prefix tree (tenant, hits, last use) once none of its blocks is
        cached here or in `keep` (the roots a lower tier still holds)."""
        cached = {b.root for b in self.pool.blocks if b.key is not None}
        for root in [r for r in self.roots if r not in cached and r not in keep]:
            del self.roots[root]

    # ---- books -----------------------------------------------------------------------------
    def audit(self) -> None:
        """Reconcile every counter against the blocks; raise AuditFailure listing all mismatches."""
        holders: Counter[int] = Counter()
        owners: dict[int, str] = {}
        problems: list[str] = []
        reserved = 0
        size = self.block_size
        for seq in self._seqs.values():
            held = seq.table[seq.dropped:]
            if seq.table[:seq.dropped] != block_ids([DROPPED]) * seq.dropped or DROPPED in held:
                problems.append(f"sequence {seq.seq_id}: entries given back are not its first {seq.dropped}")
            holders.update(held)
            holders.update(seq.reserve)
            reserved += len(seq.reserve)
            if len(seq.table) != -(-seq.num_tokens // size):
                problems.append(f"sequence {seq.seq_id}: {len(seq.table)} blocks for "
                                f"{seq.num_tokens} tokens")
            if len(set(held)) != len(held):
                problems.append(f"sequence {seq.seq_id}: a block appears twice in its table")
            for block_id in seq.reserve:
                if block_id in owners:
                    problems.append(f"block {block_id}: reserved by {seq.seq_id} and {owners[block_id]}")
                owners[block_id] = seq.seq_id
        for block_id, owner in owners.items():
            if holders[block_id] != 1:
                problems.append(f"block {block_id}: reserved by {owner} but has "
                                f"{holders[block_id]} holders")
        if reserved != self.num_reserved:
            problems.append(f"num_reserved is {self.num_reserved}, counted {reserved}")
        if self.pool.pin_refs() != dict(self.pins.key_counts()):
            problems.append("pool pin references differ from the registered pins")
        problems.extend(self.pool.audit(holders))
        if problems:
            raise AuditFailure("cache audit failed:\n  " + "\n  ".join(problems))


def _logical_clock() -> Callable[[], float]:
    """A clock that ticks once per call: deterministic default for tests and replays."""
    ticks = 0.0

    def tick() -> float:
        nonlocal ticks
        ticks += 1.0
        return ticks

    return tick


__all__ = ["DROPPED", "Admission", "EvictionReport", "KVCacheManager", "PinResult", "SequenceState",
           "UnknownPin", "Verdict"]

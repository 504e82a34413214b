"""The block pool: N physical blocks, their reference counts, the prefix index
and the evictable queue.

Where a block can be (exactly one place at a time)::

              allocate()                    release() (ref -> 0)
    free list ----------> held (ref >= 1) -----------------------+
       ^                     |   ^                               |
       |                     |   | acquire() on a hit            v
       |                     |   +--------------------- evictable (policy order)
       |                     |                        or pinned-idle (pin_count > 0)
       +---- evicted --------+-------------------------------------+
         (key dropped from the index when the policy picks it)

A block is *indexed* while `key` is set: it holds the content of a full block
and `index[key]` points back at it. Only the pool mutates reference counts,
keys, pin counts and queue membership; sequences and pins go through it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from kvctl.policies.eviction import EvictionPolicy

from .errors import AuditFailure, CacheFull
from .events import EventLog
from .keys import BlockKey


@dataclass(slots=True)
class Block:
    """Metadata of one physical block (its K/V data lives in the engine's tensors)."""

    block_id: int  # index into the pool's storage; fixed for the pool's life
    ref_count: int = 0  # live holders: block-table entries plus reservations; >= 0
    key: BlockKey | None = None  # content key while indexed; None for free or unindexed blocks
    pin_count: int = 0  # pins covering `key`; > 0 keeps the block out of eviction
    depth: int = 0  # position in its prefix chain while indexed (0 = first block)
    root: BlockKey | None = None  # key of its chain's first block while indexed (names its tree)
    parent: BlockKey | None = None  # key of the block before it in its chain while indexed (None at depth 0)
    tenant: str | None = None  # whose namespace its key was hashed under, while indexed
    hits: int = 0  # prefix hits that reused it since it was indexed
    last_use: float = 0.0  # clock reading of its indexing or latest acquire
    # indexed under a key of one request's own (explicit prompt cache mode: PrefixHasher's `private`):
    # no other request can read it, and no lower tier may hold it (a prompt its client would not leave)
    own: bool = False


class BlockPool:
    """Physical blocks of one tier, with O(1) allocate, hit and release per block.

    The free list holds blocks with no content; the eviction policy holds
    indexed blocks that nobody uses. Allocation takes free blocks first and only
    then evicts, so cached content survives as long as there is room.
    """

    def __init__(self, num_blocks: int, policy: EvictionPolicy) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.policy = policy
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: reversed so that pop() hands out block 0 first; tests read better.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._index: dict[BlockKey, int] = {}
        self._pin_refs: dict[BlockKey, int] = {}
        self.num_shared = 0  # blocks with ref_count > 1
        self.num_pinned_idle = 0  # indexed, pinned, ref_count == 0
        self.evictions = 0  # indexed blocks dropped to make room
        self.share_evictions = 0  # of those, the ones whose tenant held more idle blocks than its share
        self.operator_evictions = 0  # indexed blocks dropped on an operator's request
        self.space_evictions = 0  # dropped as new scales loaded: made under the old ones, no request reaches them
        self.sleep_evictions = 0  # dropped as kvd went to sleep and gave back the cache's memory
        self.private_evictions = 0  # a request's own blocks (explicit prompt cache mode), dropped as it ended
        # key -> (clock value, reason) of recent evictions, oldest first; answers "why did this miss?"
        self.eviction_log: OrderedDict[BlockKey, tuple[float, str]] = OrderedDict()
        self.eviction_log_size = 65536
        # called with the victims of a capacity eviction while their data is still intact
        # (the tiers copy them down); None when there are no lower tiers
        self.on_evict: Callable[[list[Block]], None] | None = None
        # called with the victims of a capacity eviction counted by tenant (None: not known)
        self.on_tenant_evictions: Callable[[Counter[str | None]], None] | None = None
        self.inserted: list[int] | None = None  # when a list, insert_many records indexed ids here
        self.reused: list[int] | None = None  # when a list, acquire records blocks on their first hit here
        self.tenant_blocks: Counter[str | None] = Counter()  # indexed blocks per tenant (in use or idle)
        self.events: EventLog | None = None  # when set, every key indexed or dropped is logged there

    # ---- reading -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    @property
    def num_indexed(self) -> int:
        return len(self._index)

    def available(self) -> int:
        """Blocks an allocation could take now: free plus evictable."""
        return len(self._free) + len(self.policy)

    def match(self, keys: Sequence[BlockKey], limit: int | None = None) -> list[int]:
        """Block ids of the longest indexed prefix of `keys`. Reads only; mutates nothing."""
        get = self._index.get
        hits: list[int] = []
        for key in keys if limit is None else keys[:limit]:
            block_id = get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def block_of(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    @property
    def num_pin_keys(self) -> int:
        """Keys pins hold, cached or not: at least the cached blocks they pin (pinned_blocks)."""
        return len(self._pin_refs)

    def new_pin_keys(self, keys: Iterable[BlockKey]) -> int:
        """How many distinct keys of `keys` no pin holds yet: what pinning them adds to num_pin_keys."""
        refs = self._pin_refs
        return sum(1 for key in set(keys) if key not in refs)

    def pinned_blocks(self) -> set[int]:
        """Ids of the cached blocks pins hold: never evicted while pinned (a pinned key not cached
        holds no block)."""
        index = self._index
        return {index[key] for key in self._pin_refs if key in index}

    def evictable_in(self, block_ids: Iterable[int]) -> int:
        """How many of `block_ids` sit in the evictable queue now."""
        policy = self.policy
        return sum(1 for b in block_ids if b in policy)

    # ---- reference counting ----------------------------------------------------------------
    def allocate(self, count: int, now: float, request: str = "?") -> list[int]:
        """Take `count` blocks (ref count 1 each), evicting cached ones if needed.

        All or nothing: raises CacheFull and changes nothing when fewer are available.
        """
        free = self._free
        if count > len(free) + len(self.policy):
            raise CacheFull(request, count, len(free) + len(self.policy), self.num_blocks)
        blocks = self.blocks
        from_free = min(count, len(free))
        taken = free[len(free) - from_free:]
        taken.reverse()  # the free list is a stack: its top goes first
        del free[len(free) - from_free:]
        if count > from_free:
            index = self._index
            victims = self.policy.pop_many(count - from_free, now)
            reason = self.policy.name
            # victims taken because their tenant held more idle blocks than its share (policies.tenant_shares)
            for_share = getattr(self.policy, "evicted_for_share", None) or {}
            if self.on_evict is not None:
                self.on_evict([blocks[b] for b in victims])
            if self.on_tenant_evictions is not None:
                self.on_tenant_evictions(Counter(blocks[b].tenant for b in victims))
            if self.events is not None:
                if for_share:
                    self.events.removed("device", [blocks[b].key for b in victims if b in for_share], "tenant_share")
                self.events.removed("device", [blocks[b].key for b in victims if b not in for_share], "capacity")
            for block_id in victims:
                block = blocks[block_id]
                self._count_unindexed(block.tenant)
                del index[block.key]
                self._log_eviction(block.key, now, "tenant_share" if block_id in for_share else reason)
                block.key = None
                block.root = None
                block.parent = None
            self.evictions += len(victims)
            self.share_evictions += len(for_share)
            taken.extend(victims)
        for block_id in taken:
            blocks[block_id].ref_count = 1
        return taken

    def _count_unindexed(self, tenant: str | None) -> None:
        """One block fewer indexed for `tenant`; a tenant with none left leaves the books (kvd may
        see tenants without end)."""
        left = self.tenant_blocks[tenant] - 1
        if left:
            self.tenant_blocks[tenant] = left
        else:
            del self.tenant_blocks[tenant]

    def _log_eviction(self, key: BlockKey, now: float, reason: str) -> None:
        log = self.eviction_log
        log[key] = (now, reason)
        if len(log) > self.eviction_log_size:
            log.popitem(last=False)

    def acquire(self, block_ids: Sequence[int], now: float, *, hit: bool, priority: int = 0) -> None:
        """Add one reference to each block (a prefix hit, or a fork sharing a table); `priority`:
        the engine's, of the request a hit is for (the policy may keep its blocks longer)."""
        blocks, policy = self.blocks, self.policy
        for block_id in block_ids:
            block = blocks[block_id]
            ref = block.ref_count
            if ref == 0:
                if block.pin_count:
                    self.num_pinned_idle -= 1
                else:
                    policy.remove(block_id)
            elif ref == 1:
                self.num_shared += 1
            block.ref_count = ref + 1
            block.last_use = now
            block.hits += hit
            if hit and block.hits == 1 and self.reused is not None:
                self.reused.append(block_id)
        if hit:
            policy.record_hits(block_ids, now, priority)

    def release(self, block_ids: Iterable[int], now: float) -> None:
        """Drop one reference from each block, in the order given.

        A block whose count reaches zero becomes evictable if it is indexed (in the
        order given, so callers pass a sequence's blocks tail-first), stays idle if
        pinned, and returns to the free list otherwise.
        """
        blocks, free = self.blocks, self._free
        evictable: list[int] = []
        for block_id in block_ids:
            block = blocks[block_id]
            ref = block.ref_count - 1
            block.ref_count = ref
            if ref == 0:
                if block.key is None:
                    free.append(block_id)
                elif block.pin_count:
                    self.num_pinned_idle += 1
                else:
                    evictable.append(block_id)
            elif ref == 1:
                self.num_shared -= 1
            elif ref < 0:
                block.ref_count = 0
                raise AuditFailure(f"block {block_id}: released more often than acquired")
        if evictable:
            self.policy.push(evictable, now)

    # ---- the prefix index ------------------------------------------------------------------
    def insert_many(self, table: Sequence[int], keys: Sequence[BlockKey], start: int, stop: int,
                    now: float, tenant: str | None = None, priority: int = 0, own_from: int | None = None) -> int:
        """Index `table[i]` under `keys[i]` for start <= i < stop (blocks that just became full),
        written by a request of `priority` (the engine's); those from `own_from` on are keyed as the
        request's own (Block.own).

        A key another block already holds is skipped (that block stays unindexed
        and is freed on release). Returns how many blocks were indexed.
        """
        index, blocks, pin_refs = self._index, self.blocks, self._pin_refs
        inserted: list[int] = []
        depths: list[int] = []
        for position in range(start, stop):
            key = keys[position]
            if key in index:
                continue
            block_id = table[position]
            index[key] = block_id
            block = blocks[block_id]
            block.key = key
            block.depth = position
            block.root = keys[0]
            block.parent = keys[position - 1] if position else None
            block.tenant = tenant
            block.own = own_from is not None and position >= own_from
            self.tenant_blocks[tenant] += 1
            block.hits = 0
            block.last_use = now
            if pin_refs:
                block.pin_count = pin_refs.get(key, 0)
            inserted.append(block_id)
            depths.append(position)
        if inserted:
            self.policy.on_insert(inserted, depths, now, priority)
            if self.inserted is not None:
                self.inserted.extend(inserted)
            if self.events is not None:
                self.events.stored("device", [blocks[b] for b in inserted])
        return len(inserted)

    def unindex(self, block_id: int) -> None:
        """Drop a held, unpinned block's key (its content was never written); it is freed on release."""
        block = self.blocks[block_id]
        if block.key is None or block.ref_count == 0 or block.pin_count:
            raise AuditFailure(f"block {block_id}: unindex needs an indexed, held, unpinned block")
        self.policy.forget(block_id)
        del self._index[block.key]
        self._count_unindexed(block.tenant)
        if self.events is not None:
            self.events.removed("device", (block.key,), "unwritten")
        block.key = None
        block.root = None
        block.parent = None

    def evict_keys(self, keys: Iterable[BlockKey], now: float = 0.0,
                   dry_run: bool = False, reason: str = "operator",
                   pinned_too: bool = False) -> tuple[list[int], dict[str, int]]:
        """Drop the given keys from the cache where they are evictable now.

        Returns the evicted block ids and a count of keys left alone by reason
        (`in_use`, `pinned`, `not_cached`). Blocks in use are never touched, pinned ones only
        with `pinned_too` (kvd going to sleep gives back the memory they are in: their pins stay,
        and a block pins again as it is filled or restored).
        `dry_run`: the same answer, of the blocks that would go, and nothing changes.
        `reason`: "operator" (an operator asked), "space" (kvd dropped what new scales made
        unreachable), "sleep" or "private" (the blocks a request hashed as its own, as it ended), as
        the eviction log, the counters and the event feed say it.
        """
        evicted: list[int] = []
        removed_keys: list[BlockKey] = []
        skipped = {"in_use": 0, "pinned": 0, "not_cached": 0}
        for key in keys:
            block_id = self._index.get(key)
            if block_id is None:
                skipped["not_cached"] += 1
                continue
            block = self.blocks[block_id]
            if block.ref_count:
                skipped["in_use"] += 1
            elif block.pin_count and not pinned_too:
                skipped["pinned"] += 1
            elif dry_run:
                evicted.append(block_id)
            else:
                if block.pin_count:  # idle and pinned: out of the policy's queue already
                    self.num_pinned_idle -= 1
                    block.pin_count = 0
                else:
                    self.policy.remove(block_id)
                self.policy.forget(block_id)
                del self._index[key]
                self._count_unindexed(block.tenant)
                self._log_eviction(key, now, reason)
                removed_keys.append(key)
                block.key = None
                block.root = None
                block.parent = None
                self._free.append(block_id)
                evicted.append(block_id)
        if dry_run:
            return evicted, skipped
        if reason == "space":
            self.space_evictions += len(evicted)
        elif reason == "sleep":
            self.sleep_evictions += len(evicted)
        elif reason == "private":
            self.private_evictions += len(evicted)
        else:
            self.operator_evictions += len(evicted)
        if self.events is not None:
            self.events.removed("device", removed_keys, reason)
        return evicted, skipped

    # ---- pins ------------------------------------------------------------------------------
    def add_pin_refs(self, keys: Iterable[BlockKey], now: float) -> None:
        for key in keys:
            count = self._pin_refs.get(key, 0) + 1
            self._pin_refs[key] = count
            block_id = self._index.get(key)
            if block_id is not None:
                block = self.blocks[block_id]
                if count == 1 and block.ref_count == 0:
                    self.policy.remove(block_id)
                    self.num_pinned_idle += 1
                block.pin_count = count

    def drop_pin_refs(self, keys: Iterable[BlockKey], now: float) -> None:
        """Remove one pin reference per key; idle blocks left unpinned become evictable
        in the order given (callers pass a prefix deepest-first)."""
        freed: list[int] = []
        for key in keys:
            count = self._pin_refs[key] - 1
            if count:
                self._pin_refs[key] = count
            else:
                del self._pin_refs[key]
            block_id = self._index.get(key)
            if block_id is not None:
                block = self.blocks[block_id]
                block.pin_count = count
                if count == 0 and block.ref_count == 0:
                    self.num_pinned_idle -= 1
                    freed.append(block_id)
        if freed:
            self.policy.push(freed, now)

    def pin_refs(self) -> dict[BlockKey, int]:
        return dict(self._pin_refs)

    # ---- priorities ------------------------------------------------------------------------
    def reprioritise_tenants(self, changes: Mapping[str, int]) -> Counter[str]:
        """Move the priority the policy holds for each block of a tenant in `changes` by that
        tenant's change (the engine's priority, higher kept longer; `eviction: priority` alone
        keeps one): the operator changed its `tenant_priorities`. Blocks in use, idle and pinned
        alike. Returns the blocks moved per tenant (none under other policies)."""
        blocks, moved = self.blocks, Counter()

        def change(block_id: int) -> int:
            tenant = blocks[block_id].tenant
            delta = changes.get(tenant, 0) if tenant is not None else 0
            if delta:
                moved[tenant] += 1
            return delta

        self.policy.reprioritise(change)
        return moved

    # ---- books -----------------------------------------------------------------------------
    def audit(self, holders: dict[int, int]) -> list[str]:
        """Every mismatch between the books and the blocks, given the live holder counts."""
        problems: list[str] = []
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            problems.append("free list holds a block twice")
        shared = pinned_idle = evictable = 0
        for block in self.blocks:
            b = block.block_id
            expected = holders.get(b, 0)
            if block.ref_count != expected:
                problems.append(f"block {b}: ref_count {block.ref_count} but {expected} live holders")
            in_free, in_policy = b in free_set, b in self.policy
            if block.ref_count > 1:
                shared += 1
            if block.key is not None:
                if self._index.get(block.key) != b:
                    problems.append(f"block {b}: has a key the index does not map to it")
                want_pins = self._pin_refs.get(block.key, 0)
                if block.pin_count != want_pins:
                    problems.append(f"block {b}: pin_count {block.pin_count} but {want_pins} pins")
                if in_free:
                    problems.append(f"block {b}: indexed but on the free list")
                if block.ref_count == 0:
                    if block.pin_count:
                        pinned_idle += 1
                        if in_policy:
                            problems.append(f"block {b}: pinned but evictable")
                    elif not in_policy:
                        problems.append(f"block {b}: idle and indexed but not evictable (leaked)")
                    else:
                        evictable += 1
                elif in_policy:
                    problems.append(f"block {b}: in use (ref {block.ref_count}) but evictable")
            else:
                if block.pin_count:
                    problems.append(f"block {b}: pin_count {block.pin_count} without a key")
                if in_policy:
                    problems.append(f"block {b}: evictable without a key")
                if block.ref_count == 0 and not in_free:
                    problems.append(f"block {b}: idle, no key, not on the free list (leaked)")
                if block.ref_count and in_free:
                    problems.append(f"block {b}: in use (ref {block.ref_count}) but on the free list")
        for key, b in self._index.items():
            if self.blocks[b].key != key:
                problems.append(f"index maps a key to block {b}, which holds another")
        if evictable != len(self.policy):
            problems.append(f"evictable queue holds {len(self.policy)} blocks, {evictable} qualify")
        counted = Counter(block.tenant for block in self.blocks if block.key is not None)
        if +self.tenant_blocks != counted:
            problems.append(f"indexed blocks per tenant: books say {dict(+self.tenant_blocks)}, blocks {dict(counted)}")
        policy_books = getattr(self.policy, "problems", None)  # a policy with books of its own (tenant shares)
        if policy_books is not None:
            problems += policy_books()
        if shared != self.num_shared:
            problems.append(f"num_shared is {self.num_shared}, counted {shared}")
        if pinned_idle != self.num_pinned_idle:
            problems.append(f"num_pinned_idle is {self.num_pinned_idle}, counted {pinned_idle}")
        in_use = sum(1 for block in self.blocks if block.ref_count)
        total = len(self._free) + len(self.policy) + self.num_pinned_idle + in_use
        if total != self.num_blocks:
            problems.append(f"free {len(self._free)} + evictable {len(self.policy)} + pinned idle "
                            f"{self.num_pinned_idle} + in use {in_use} = {total}, not {self.num_blocks}")
        return problems

"""The host tier: preallocated block slots in CPU memory (pinned when CUDA is present).

Slots mirror the device cache's per-layer layout, so moves are one gather/scatter per layer
and no encoding. Eviction is LRU over idle slots; a slot that a transfer owns (`busy`) is
never evicted or reused. With tenant shares (`tenant_cache_shares`, as on the device), a
tenant holding more slots than its share (counting the blocks it brings) loses its own least
recently used entries first, and a block that would put its tenant over its share pushes out
no other tenant's entry: one tenant's flood of one-off prompts does not empty host memory of
every other tenant's prefixes. Free slots are still lent to anyone.

On CUDA, copies between device blocks and (pinned) slots are asynchronous on the current
stream, so the serving loop never waits for them; each slot remembers an event recorded after
its latest copy, and any CPU-side read or write of the slot waits for that event first.
Device-side users are ordered by the stream itself.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from typing import Sequence

import torch

from kvctl.policies.tenant_shares import share_blocks, share_of

from .payload import BlockLayout, BlockMeta, MetaBook


def pair_runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst first row, src first row, length) of runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for d, s in zip(dst_rows, src_rows):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def copy_layers(dst_layers, dst_rows: Sequence[int], src_layers, src_rows: Sequence[int]) -> None:
    """dst[dst_rows] = src[src_rows] along dim 0 for each (dst, src) tensor pair: any dtype,
    across devices, with slice copies (no intermediate tensor) when the rows come in runs."""
    parts = pair_runs(dst_rows, src_rows)
    if len(parts) <= 8:  # copy_ handles every cache dtype, fp8 included
        targets = [dst[d:d + n] for dst in dst_layers for d, _, n in parts]
        sources = [src[s:s + n] for src in src_layers for _, s, n in parts]
        if dst_layers[0].device == src_layers[0].device and hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(targets, sources)  # one call for every layer's copies
        else:  # across devices: asynchronous per tensor (pinned host memory on CUDA)
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=True)
        return
    dst_index = torch.tensor(list(dst_rows), dtype=torch.int64)
    src_index = torch.tensor(list(src_rows), dtype=torch.int64)
    for dst, src in zip(dst_layers, src_layers):
        copy_rows(dst, dst_index, select_rows(src, src_index))


def select_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0 for any dtype (fp8 has no CPU index kernels: bytes move instead;
    runs of consecutive rows are sliced, which is much faster than an index kernel)."""
    rows = index.tolist()
    parts = pair_runs(range(len(rows)), rows)
    if len(parts) <= 4:
        out = torch.empty((len(rows),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        for start, first, length in parts:
            out[start:start + length].copy_(t[first:first + length])
        return out
    return t.view(torch.uint8).index_select(0, index.to(t.device)).view(t.dtype)


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst[index] = src along dim 0 for any dtype, across devices (slices for runs of rows)."""
    rows = index.tolist()
    parts = pair_runs(rows, range(len(rows)))
    if len(parts) <= 4:
        for first, start, length in parts:
            dst[first:first + length].copy_(src[start:start + length], non_blocking=True)
        return
    dst.view(torch.uint8).index_copy_(0, index.to(dst.device),
                                      src.view(torch.uint8).to(dst.device, non_blocking=True))


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, layout: BlockLayout, pin_memory: bool = False) -> None:
        self.layout = layout
        self.num_slots = capacity_bytes // layout.block_bytes
        if self.num_slots < 1:
            raise ValueError(f"tiers.host.bytes: {capacity_bytes} holds no block of {layout.block_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        shape = (self.num_slots, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.layers = [(torch.empty(shape, dtype=d, pin_memory=pin_memory),
                        torch.empty(shape, dtype=d, pin_memory=pin_memory)) for d in layout.layer_dtypes]
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out low slots first, in runs
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.meta: MetaBook = MetaBook()
        self.busy: dict[bytes, int] = {}  # key -> transfers reading the slot now
        self._copies: dict[int, object] = {}  # slot -> CUDA event of its latest asynchronous copy
        self.events = None  # an EventLog: each key indexed or dropped here is logged there
        self.tenant_blocks: Counter[str] = Counter()  # entries per tenant ("" where not known)
        # each tenant's entries, least recently used first, and every entry's place in the LRU order:
        # a share eviction finds a tenant's oldest entry without a scan
        self._by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        self._stamp: dict[bytes, int] = {}
        self._stamps = itertools.count()
        self.shares: dict[str, int] = {}  # tenant ("*": the others) -> its share in slots; empty: no shares
        self.share_evictions = 0  # entries evicted because their tenant held more than its share

    def set_tenant_shares(self, shares) -> None:
        """(tenant, fraction) pairs as `tenant_cache_shares` gives them; () for none."""
        self.shares = share_blocks(shares, self.num_slots) if shares else {}

    def share_of(self, tenant: str) -> int | None:
        """The tenant's share in slots; None: it has none."""
        return share_of(self.shares, tenant)

    def _tenant(self, key: bytes) -> str:
        meta = self.meta.get(key)
        return (meta.tenant if meta is not None else None) or ""

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.layout.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def touch(self, key: bytes) -> None:
        self.index.move_to_end(key)
        self._by_tenant[self._tenant(key)].move_to_end(key)
        self._stamp[key] = next(self._stamps)

    def take_slots(self, count: int, protect: set[bytes] = frozenset(),
                   tenants: Sequence[str | None] | None = None) -> tuple[list[int], list[bytes], list[int]]:
        """Slots for `count` incoming blocks (of `tenants`, one each, where known): free slots
        first, then idle entries evicted, least recently used first. Returns (slots, evicted keys,
        kept): `kept` are the positions of the incoming blocks that got the slots, in order; the
        evicted entries' slots come last, in the order of their keys, and their data stays
        readable until the slots are written.

        With tenant shares (and `tenants` given), a tenant that holds more than its share, counting
        the block coming in, loses its own least recently used entries first; and a block whose
        tenant would be over its share does not push out another tenant's entry: it gets no slot
        (it goes down a tier, or is dropped)."""
        if self.shares and tenants is not None:
            return self._take_slots_shared(list(tenants), protect)
        slots: list[int] = []
        evicted: list[bytes] = []
        while len(slots) < count and self._free:
            slots.append(self._free.pop())
        while len(slots) < count:  # no copy of the index: a large host tier costs nothing more per call
            key = self._oldest_idle(self.index, protect)
            if key is None:
                break
            slots.append(self._unindex(key))
            evicted.append(key)
        if evicted and self.events is not None:
            self.events.removed("host", evicted, "capacity")
        return slots, evicted, list(range(len(slots)))

    def _take_slots_shared(self, tenants: list[str | None], protect: set[bytes]):
        slots: list[int] = []
        kept: list[int] = []
        victims: list[tuple[bytes, str]] = []  # (key, reason) in eviction order
        coming: Counter[str] = Counter()  # incoming blocks given a slot, per tenant (indexed by the caller)

        def held(tenant: str) -> int:
            return self.tenant_blocks[tenant] + coming[tenant]

        for position, tenant in enumerate(tenants):
            tenant = tenant or ""
            if self._free:
                slots.append(self._free.pop())
                kept.append(position)
                coming[tenant] += 1
                continue
            victim, reason = None, "tenant_share"
            for owner, entries in self._by_tenant.items():  # over its share once this block is in (its own count)
                share = self.share_of(owner)
                if share is not None and held(owner) + (owner == tenant) > share:
                    key = self._oldest_idle(entries, protect)
                    if key is not None and (victim is None or self._stamp[key] < self._stamp[victim]):
                        victim = key
            if victim is None:
                share = self.share_of(tenant)
                if share is not None and held(tenant) + 1 > share:
                    continue  # over its share: it may not push out another tenant's entry
                victim, reason = self._oldest_idle(self.index, protect), "capacity"
                if victim is None:
                    break  # nothing left to evict
            slots.append(self._unindex(victim))
            kept.append(position)
            coming[tenant] += 1
            victims.append((victim, reason))
        for_share = [key for key, reason in victims if reason == "tenant_share"]
        self.share_evictions += len(for_share)
        if self.events is not None:
            if for_share:
                self.events.removed("host", for_share, "tenant_share")
            if len(for_share) < len(victims):
                self.events.removed("host", [key for key, reason in victims if reason == "capacity"], "capacity")
        return slots, [key for key, _ in victims], kept

    def _oldest_idle(self, entries, protect: set[bytes]) -> bytes | None:
        """The least recently used of `entries` (keys in LRU order) that no transfer reads or
        protects: those are few, so this is O(1) but for them."""
        for key in entries:
            if key not in self.busy and key not in protect:
                return key
        return None

    def _unindex(self, key: bytes) -> int:
        """Take `key` out of the index (its meta stays until `forget_meta`); returns its slot."""
        tenant = self._tenant(key)
        self.tenant_blocks[tenant] -= 1
        if not self.tenant_blocks[tenant]:
            del self.tenant_blocks[tenant]
        entries = self._by_tenant[tenant]
        del entries[key]
        if not entries:
            del self._by_tenant[tenant]
        del self._stamp[key]
        return self.index.pop(key)

    def _record(self, slots: Sequence[int], caches) -> None:
        if caches and caches[0].k.is_cuda:
            event = torch.cuda.Event()
            event.record()
            for slot in slots:
                self._copies[slot] = event

    def settle(self, slots: Sequence[int]) -> None:
        """Wait for asynchronous copies into or out of these slots (before touching them on the CPU)."""
        for slot in slots:
            event = self._copies.pop(slot, None)
            if event is not None:
                event.synchronize()

    def read_slots(self, slots: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given slots' K/V, per layer [n, block, heads, dim]."""
        self.settle(slots)
        index = torch.tensor(list(slots), dtype=torch.int64)
        return [(select_rows(k, index), select_rows(v, index)) for k, v in self.layers]

    def fill(self, slots: Sequence[int], metas: Sequence[BlockMeta],
             layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write K/V ([n, ...] per layer, any device) into `slots` and index them."""
        self.settle(slots)
        index = torch.tensor(list(slots), dtype=torch.int64)
        for (hk, hv), (k, v) in zip(self.layers, layers):
            copy_rows(hk, index, k)
            copy_rows(hv, index, v)
        self._index(slots, metas)

    def fill_from(self, slots: Sequence[int], metas: Sequence[BlockMeta], caches, block_ids: Sequence[int]) -> None:
        """Copy device blocks straight into `slots` (no gather) and index them."""
        copy_layers([t for pair in self.layers for t in pair], slots,
                    [t for c in caches for t in (c.k, c.v)], block_ids)
        self._record(slots, caches)
        self._index(slots, metas)

    def _index(self, slots: Sequence[int], metas: Sequence[BlockMeta]) -> None:
        for slot, meta in zip(slots, metas):
            if meta.key in self.index:
                self._free.append(self._unindex(meta.key))  # written again: the old slot is free
            self.index[meta.key] = slot
            self.meta[meta.key] = meta
            tenant = meta.tenant or ""
            self.tenant_blocks[tenant] += 1
            self._by_tenant.setdefault(tenant, OrderedDict())[meta.key] = None
            self._stamp[meta.key] = next(self._stamps)
        if self.events is not None:
            self.events.stored("host", metas)

    def copy_out(self, slots: Sequence[int], caches, block_ids: Sequence[int]) -> None:
        """Copy `slots` straight into device blocks (a restore)."""
        copy_layers([t for c in caches for t in (c.k, c.v)], block_ids,
                    [t for pair in self.layers for t in pair], slots)
        self._record(slots, caches)

    def drop(self, key: bytes, reason: str = "operator") -> bool:
        if key not in self.index:
            self.meta.pop(key, None)
            return False
        self._free.append(self._unindex(key))
        self.meta.pop(key, None)
        if self.events is not None:
            self.events.removed("host", (key,), reason)
        return True

    def forget_meta(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key not in self.index:
                self.meta.pop(key, None)

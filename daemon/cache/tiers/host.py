"""The host tier: preallocated block slots in CPU memory (pinned when CUDA is present).

Slots mirror the device cache's per-layer layout, so moves are one gather/scatter per layer
and no encoding. Eviction is LRU over idle slots; a slot that a transfer owns (`busy`) is
never evicted or reused.

On CUDA, copies between device blocks and (pinned) slots are asynchronous on the current
stream, so the serving loop never waits for them; each slot remembers an event recorded after
its latest copy, and any CPU-side read or write of the slot waits for that event first.
Device-side users are ordered by the stream itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from .payload import BlockLayout, BlockMeta


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
        self.meta: dict[bytes, BlockMeta] = {}
        self.busy: dict[bytes, int] = {}  # key -> transfers reading the slot now
        self._copies: dict[int, object] = {}  # slot -> CUDA event of its latest asynchronous copy
        self.events = None  # an EventLog: each key indexed or dropped here is logged there

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.layout.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def touch(self, key: bytes) -> None:
        self.index.move_to_end(key)

    def take_slots(self, count: int, protect: set[bytes] = frozenset()) -> tuple[list[int], list[bytes]]:
        """Up to `count` slots, evicting least recently used idle entries. Returns (slots, evicted
        keys); the evicted entries' data stays readable until the slots are written."""
        slots: list[int] = []
        evicted: list[bytes] = []
        while len(slots) < count and self._free:
            slots.append(self._free.pop())
        if len(slots) < count:
            for key in list(self.index):
                if len(slots) == count:
                    break
                if key in self.busy or key in protect:
                    continue
                slots.append(self.index.pop(key))
                evicted.append(key)
        if evicted and self.events is not None:
            self.events.removed("host", evicted, "capacity")
        return slots, evicted

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
            self.index[meta.key] = slot
            self.meta[meta.key] = meta
        if self.events is not None:
            self.events.stored("host", metas)

    def copy_out(self, slots: Sequence[int], caches, block_ids: Sequence[int]) -> None:
        """Copy `slots` straight into device blocks (a restore)."""
        copy_layers([t for c in caches for t in (c.k, c.v)], block_ids,
                    [t for pair in self.layers for t in pair], slots)
        self._record(slots, caches)

    def drop(self, key: bytes, reason: str = "operator") -> bool:
        slot = self.index.pop(key, None)
        self.meta.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot)
        if self.events is not None:
            self.events.removed("host", (key,), reason)
        return True

    def forget_meta(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key not in self.index:
                self.meta.pop(key, None)

"""TieredCache: moves blocks between the device cache and the host, disk and remote tiers.

Who owns a block, one state at a time (`location()`):

    device   indexed in the device pool (the pool is the authority)
    moving   a transfer owns it: being written down (its payload is in flight) or restored
    host     in a host slot          disk   in a disk segment          remote  in Redis
    evicted  nowhere

Transitions:

    device --evicted by the pool, worth keeping--> host  (write_back) or the first lower tier
    host   --evicted--> moving --published--> disk (or remote)           disk --evicted--> remote
    disk/remote --prefetch (verified)--> staged --admission--> device     host --admission--> device
    write_through: every newly filled device block is also written to disk and remote.
    write_through_selective (SGLang HiCache's name): a device block is written to disk and remote
    when it is first reused (a prefix hit takes it), not when it is filled: only what proved
    reusable costs a write.

A block in `moving` is never evicted, reused or published twice; a prefetch that finds it
takes its tensors straight from the write in flight. Encoding, disk and remote I/O run on two
background threads (one writes, one prefetches) in whole groups; the serving loop only gathers
and scatters tensors.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from kvctl.daemon.model.memory import caches_released
from kvctl.policies.tiering import WRITE_POLICIES, RateMeter, TieringPolicy, held_run

from .codec import check_codec, unsupported
from .disk import DiskTier, Segment, SegmentShort
from .host import HostTier, copy_rows, select_rows
from .payload import (BlockData, BlockLayout, BlockMeta, PayloadError, decode_block, encode_parts,
                      payload_codec, payload_length, read_header)
from .remote import RemoteTier, RemoteUnavailable
from .spaces import summary

log = logging.getLogger("kvd.tiers")

LOWER = ("host", "disk", "remote")
UNBOUNDED_BYTES = 2**62  # a remote tier given no byte budget; reported as capacity None


@dataclass
class TierStats:
    restored_blocks: int = 0  # blocks that came back to the device from this tier
    hit_tokens: int = 0
    bytes_in: int = 0  # written into this tier
    bytes_out: int = 0  # read out of this tier
    checksum_failures: int = 0  # payloads that failed verification (counted as misses, deleted)
    errors: int = 0  # I/O errors and timeouts
    dropped_blocks: int = 0  # demotions this tier could not take (full of moving blocks, degraded)
    degraded: str | None = None  # why the tier is degraded now, or None
    degraded_until: float = 0.0
    read: RateMeter = field(default_factory=lambda: RateMeter(rate=1e9, latency=1e-4))
    write: RateMeter = field(default_factory=lambda: RateMeter(rate=1e9, latency=1e-4))
    restore_seconds: list[float] = field(default_factory=list)  # drained by the metrics


@dataclass
class Prefetch:
    request_id: str
    keys: list[bytes]
    future: Future | None = None
    staged: list[bytes] = field(default_factory=list)
    cancelled: bool = False
    started: float = 0.0
    ended: float | None = None  # when the fetch stopped (everything staged, a miss, or cancelled)
    tried: set = field(default_factory=set)  # every block this request's fetches set out to bring up

    def seconds(self) -> float | None:
        """How long the fetch ran, once it has stopped."""
        return None if self.ended is None else self.ended - self.started


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)


def _stack_blocks(per_block: list, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-block [(K, V) per layer] -> per layer (K [n, ...], V [n, ...]), any dtype. Blocks of one
    dtype are stacked in a single copy and split into strided per-layer views."""
    stacked = [b.stacked() if isinstance(b, BlockData) else None for b in per_block]
    if all(t is not None for t in stacked):
        dtype = stacked[0].dtype  # stacked as bytes: fp8 has no CPU stack kernel
        whole = torch.stack([t.view(torch.uint8) for t in stacked]).view(dtype)  # [n, layers, 2, block, heads, dim]
        return [(whole[:, layer, 0], whole[:, layer, 1]) for layer in range(num_layers)]
    return [(torch.stack([b[layer][0].view(torch.uint8) for b in per_block]).view(per_block[0][layer][0].dtype),
             torch.stack([b[layer][1].view(torch.uint8) for b in per_block]).view(per_block[0][layer][1].dtype))
            for layer in range(num_layers)]


class SourceGone(LookupError):
    """A block a restore was to copy back is no longer in host memory or staging: an operator's
    eviction (`drop`, which runs outside the engine's lock) took it after the restore was planned."""


class TieredCache:
    def __init__(self, kv_caches, layout: BlockLayout, space: bytes, *, host: HostTier | None = None,
                 disk: DiskTier | None = None, remote: RemoteTier | None = None,
                 write_policy: str = "write_back", policy: TieringPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, compress: str | Mapping[str, str] = "none") -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy: invalid value {write_policy!r}; use {', '.join(WRITE_POLICIES)}")
        self.kv_caches, self.layout, self.space = kv_caches, layout, space
        self.compress = compress  # asked for, per payload tier (tier_compress); `codec(tier)` is what is written
        self.host, self.disk, self.remote = host, disk, remote
        self.write_policy, self.clock = write_policy, clock
        self.policy = policy or TieringPolicy()
        self.lock = threading.RLock()
        self.stats = {name: TierStats() for name in LOWER}
        self.stats["host"].read = RateMeter(rate=5e9, latency=1e-5)
        self.stats["host"].write = RateMeter(rate=5e9, latency=1e-5)
        self.stats["disk"].read = RateMeter(rate=1e9, latency=5e-4)
        self.stats["disk"].write = RateMeter(rate=5e8, latency=2e-3)
        self.stats["remote"].read = RateMeter(rate=5e8, latency=1e-3)
        self.stats["remote"].write = RateMeter(rate=5e8, latency=1e-3)
        self.moved: Counter[tuple[str, str]] = Counter()  # (src, dst) -> bytes
        self.retained_blocks = 0  # written down for requests asking prompt_cache_retention "24h" (`retain`)
        self.inflight: dict[bytes, tuple[BlockMeta, list]] = {}  # moving: (meta, K/V per layer) being written down
        self.staged: dict[bytes, tuple[list, str]] = {}  # verified blocks fetched for waiting requests
        self.prefetches: dict[str, Prefetch] = {}
        self._protected: set[bytes] = set()  # host keys a restore is reading right now
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvd-tier-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvd-tier-read")
        self._pending_writes: list[Future] = []
        self._fetch_ids = itertools.count()
        self.device = kv_caches[0].k.device if kv_caches else torch.device("cpu")

    # ---- views -----------------------------------------------------------------------------
    def tiers(self) -> list:
        return [t for t in (self.host, self.disk, self.remote) if t is not None]

    def location(self, key: bytes, on_device: bool = False) -> str:
        if on_device:
            return "device"
        with self.lock:
            if key in self.inflight:
                return "moving"
            for tier in self.tiers():
                if key in tier.index:
                    return tier.name
        return "evicted"

    def lower_run(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Blocks per tier of the longest run from keys[0] that lower tiers hold (each block
        counted in the fastest tier holding it; one being written down counts as the host's:
        its tensors are in memory): what a request would restore instead of computing."""
        with self.lock:
            return held_run(keys, [("host", self.inflight), *((t.name, t.index) for t in self.tiers())])

    def read_rates(self) -> dict[str, dict[str, float]]:
        """Each tier's read rate, fixed latency and bytes a block as the restore judgement uses them
        (measured, else its prior): what `kvctl.policies.tiering.restore_seconds` takes."""
        with self.lock:
            return {t.name: {"bytes_per_second": self.stats[t.name].read.rate,
                             "latency_seconds": self.stats[t.name].read.latency,
                             "block_bytes": self.block_bytes_in(t.name)} for t in self.tiers()}

    @property
    def compress(self) -> dict[str, str]:
        """The codec asked for each payload tier: {"disk": ..., "remote": ...}."""
        return dict(self._compress)

    @compress.setter
    def compress(self, value: str | Mapping[str, str]) -> None:
        """One codec for disk and Redis, or a mapping of either (the other keeps its own)."""
        given = {"disk": value, "remote": value} if isinstance(value, str) else dict(value)
        unknown = set(given) - {"disk", "remote"}
        if unknown:
            raise ValueError(f"tier_compress: {sorted(unknown)[0]!r} is not a tier that stores payloads; "
                             "use disk or remote")
        current = getattr(self, "_compress", {"disk": "none", "remote": "none"})
        self._compress = {**current, **{tier: check_codec(codec) for tier, codec in given.items()}}

    def codec(self, tier: str) -> str:
        """How blocks are written to that tier (disk or remote) now: what `compress` asks, or none
        where the device cache's format cannot be compressed (codec.py)."""
        return self.layout.codec_for(self._compress[tier])

    def block_bytes_in(self, tier: str) -> int:
        """Bytes one block takes to read from a tier: the device's bytes in the host tier, a
        payload as written now on disk and in Redis."""
        return self.layout.block_bytes if tier == "host" else self.layout.stored_bytes(self.codec(tier))

    def known_metas(self) -> dict[bytes, tuple[BlockMeta, str]]:
        """Every block a lower tier holds, with its fastest tier (for prefix listings)."""
        out: dict[bytes, tuple[BlockMeta, str]] = {}
        with self.lock:
            for key, (meta, _) in self.inflight.items():
                out[key] = (meta, "moving")
            for tier in reversed(self.tiers()):
                index = tier.index
                for key in list(index):
                    meta = tier.meta.get(key)
                    if meta is not None:
                        out[key] = (meta, tier.name)
        return out

    def _usable(self, name: str) -> bool:
        stats = self.stats[name]
        if stats.degraded and self.clock() >= stats.degraded_until:
            stats.degraded = None  # try again; a failure marks it degraded anew
        if name == "remote" and self.remote is not None:
            return self.remote.breaker.allow(self.clock())
        return stats.degraded is None

    def _degrade(self, name: str, reason: str, seconds: float = 30.0) -> None:
        stats = self.stats[name]
        stats.errors += 1
        if stats.degraded is None and name != "remote":  # the remote tier logs its outages itself
            log.warning("tier %s degraded: %s", name, reason)
        stats.degraded, stats.degraded_until = reason, self.clock() + seconds

    # ---- device side (the serving loop calls these, holding the service lock) ---------------
    def _device_present(self) -> None:
        """Refuse a copy to or from the device cache while its memory is given back (kvd asleep)."""
        if caches_released(self.kv_caches):
            raise RuntimeError("the device cache is released (kvd is asleep): no block is copied to or from it")

    def gather(self, block_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._device_present()
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return [(select_rows(c.k, index).cpu(), select_rows(c.v, index).cpu()) for c in self.kv_caches]

    def on_device_evict(self, victims: list, prefix_hits: Callable[[bytes], int]) -> None:
        """The pool is about to reuse these indexed blocks: keep the ones worth keeping (never a
        request's own: Block.own)."""
        size, nbytes = self.layout.block_size, self.layout.block_bytes
        target = self._first_lower()
        victims = [b for b in victims if not b.own]
        if target is None or not victims:
            return
        write = self.stats[target].write
        keep = [b for b in victims if self.policy.worth_keeping(prefix_hits(b.root), size, nbytes, write)]
        if len(keep) < len(victims) and self.policy.mode == "measured" and self.policy.should_probe(write, self.clock()):
            keep = list(victims)  # the write rate is not known well enough, or is old: the group measures it
        if self.write_policy != "write_back" and target != "host":
            keep = [b for b in keep if not self._held_below(b.key)]
        if not keep:
            return
        metas = [BlockMeta.of(b) for b in keep]
        started = time.perf_counter()
        if target == "host":
            self._put_host(metas, src="device", block_ids=[b.block_id for b in keep])
            self.stats["host"].write.observe(nbytes * len(keep), time.perf_counter() - started, at=self.clock())
        else:
            self._write_down(metas, self.gather([b.block_id for b in keep]), src="device", targets=[target])

    def write_through(self, blocks: list) -> None:
        """Newly filled device blocks (write_through), or newly reused ones (write_through_selective),
        after the step that wrote or reused them, go to the persistent tiers."""
        if self.write_policy != "write_back":
            self._persist(blocks)

    def retain(self, blocks: list) -> int:
        """The blocks of a request that asked to be kept long (OpenAI's `prompt_cache_retention: "24h"`),
        as it finishes: they go to the persistent tiers (disk, remote) now, whatever the write policy,
        so that they outlive their eviction from the device. How many went (0 without a persistent
        tier: the request is kept as any other, in memory)."""
        written = self._persist(blocks)
        self.retained_blocks += written
        return written

    def _persist(self, blocks: list) -> int:
        """Write the device blocks the persistent tiers lack to them; how many were written."""
        targets = [t.name for t in (self.disk, self.remote) if t is not None]
        if not targets or not blocks:
            return 0
        blocks = [b for b in blocks if b.key is not None and not b.own and not self._held_below(b.key)]
        if blocks:
            self._write_down([BlockMeta.of(b) for b in blocks],
                             self.gather([b.block_id for b in blocks]), src="device", targets=targets)
        return len(blocks)

    def _first_lower(self) -> str | None:
        for tier in self.tiers():
            if self._usable(tier.name):
                return tier.name
        return None

    def _held_below(self, key: bytes) -> bool:
        return key in self.inflight or (self.disk is not None and key in self.disk.index) or \
            (self.remote is not None and self.remote.holds(key))

    def _put_host(self, metas: list[BlockMeta], src: str, layers=None, block_ids: list[int] | None = None) -> None:
        """Place blocks in host slots, shallowest first (a deep block is useless without its
        ancestors). Host entries evicted to make room, and blocks that find no slot, go down a
        tier (write_back) or are dropped and counted. The data comes from CPU `layers` ([n, ...]
        per layer) or straight from device `block_ids`."""
        host = self.host
        if block_ids is not None:
            self._device_present()

        def pick(positions: list[int]):
            if block_ids is not None:
                return self.gather([block_ids[i] for i in positions])
            index = torch.tensor(positions, dtype=torch.int64)
            return [(select_rows(k, index), select_rows(v, index)) for k, v in layers]

        spill_metas: list[BlockMeta] = []
        spill_layers: list = []
        with self.lock:
            for m in metas:
                if m.key in host.index:
                    host.touch(m.key)
            fresh = sorted((i for i, m in enumerate(metas) if m.key not in host.index), key=lambda i: metas[i].depth)
            if not fresh:
                return
            slots, evicted, kept = host.take_slots(len(fresh), protect=self._protected,
                                                   tenants=[metas[i].tenant for i in fresh])
            if evicted:
                spill_metas += [host.meta[k] for k in evicted]
                spill_layers.append(host.read_slots(slots[len(slots) - len(evicted):]))
                host.forget_meta(evicted)
            placed = [fresh[i] for i in kept]
            overflow = [fresh[i] for i in sorted(set(range(len(fresh))) - set(kept))]
            if placed and block_ids is not None:
                host.fill_from(slots, [metas[i] for i in placed], self.kv_caches, [block_ids[i] for i in placed])
            elif placed:
                host.fill(slots, [metas[i] for i in placed], pick(placed))
            if placed:
                self.stats["host"].bytes_in += len(placed) * self.layout.block_bytes
                self.moved[(src, "host")] += len(placed) * self.layout.block_bytes
            if overflow:
                spill_metas += [metas[i] for i in overflow]
                spill_layers.append(pick(overflow))
        if not spill_metas:
            return
        lower = [t.name for t in (self.disk, self.remote) if t is not None and self._usable(t.name)][:1]
        if self.write_policy == "write_back" and lower:
            joined = [(_cat([part[layer][0] for part in spill_layers]), _cat([part[layer][1] for part in spill_layers]))
                      for layer in range(self.layout.num_layers)]
            self._write_down(spill_metas, joined, src="host", targets=lower)
        elif self.write_policy == "write_back":
            self.stats["host"].dropped_blocks += len(spill_metas)

    def _write_down(self, metas: list[BlockMeta], layers, src: str, targets: list[str]) -> None:
        """Hand CPU copies of the blocks to the writer thread, which encodes and publishes them;
        the blocks are `moving` meanwhile (a prefetch takes their tensors from here)."""
        fresh = []
        with self.lock:
            for i, meta in enumerate(metas):
                if meta.key in self.inflight:
                    continue
                self.inflight[meta.key] = (meta, [(k[i], v[i]) for k, v in layers])
                fresh.append(i)
        if not fresh:
            return
        if len(fresh) < len(metas):
            index = torch.tensor(fresh, dtype=torch.int64)
            metas = [metas[i] for i in fresh]
            layers = [(select_rows(k, index), select_rows(v, index)) for k, v in layers]
        future = self._writer.submit(self._publish, metas, layers, src, targets)
        with self.lock:  # the engine's thread and operator actions both write down: none may drop another's
            self._pending_writes = [f for f in self._pending_writes if not f.done()] + [future]

    def _publish(self, metas: list[BlockMeta], layers, src: str, targets: list[str]) -> None:
        try:
            encoded: dict[str, list] = {}  # each codec once, for every target that writes with it
            for name in targets:
                codec = self.codec(name)
                if codec not in encoded:
                    encoded[codec] = list(zip(metas, encode_parts(self.layout, self.space, metas, layers, codec)))
                for part in self._segments_for(name, encoded[codec]):
                    self._publish_to(name, part, src)
        finally:
            with self.lock:
                for meta in metas:
                    self.inflight.pop(meta.key, None)

    def _segments_for(self, name: str, items: list) -> list[list]:
        """The writes a group makes to a tier: one, or for a disk with tenant shares one segment per
        tenant (so that a tenant's segments can go without another's blocks)."""
        if name != "disk" or not self.disk.shares:
            return [items]
        by_tenant: dict[str, list] = {}
        for item in items:
            by_tenant.setdefault(item[0].tenant or "", []).append(item)
        return list(by_tenant.values())

    def _publish_to(self, name: str, items: list[tuple[BlockMeta, bytes]], src: str) -> None:
        if not self._usable(name):
            self.stats[name].dropped_blocks += len(items)
            return
        nbytes = sum(payload_length(p) for _, p in items)
        started = time.perf_counter()
        try:
            if name == "disk":
                salvaged: list[tuple[BlockMeta, bytes]] = []
                salvage = self._salvager(salvaged) if self.remote is not None and self.write_policy == "write_back" \
                    else None
                tenants = {meta.tenant or "" for meta, _ in items}
                self.disk.make_room(nbytes, protect=lambda k: k in self._protected, salvage=salvage,
                                    tenant=tenants.pop() if len(tenants) == 1 else None)
                written = self.disk.write_group(items)
                if salvaged:
                    self._publish_to("remote", salvaged, "disk")
            else:
                written = self.remote.write_group(items)
        except RemoteUnavailable as exc:
            self._degrade(name, str(exc), seconds=0.0)
            return
        except OSError as exc:
            self._degrade(name, f"{exc.strerror or type(exc).__name__} (errno {exc.errno})")
            return
        stats = self.stats[name]
        fixed = self.disk.last_fsync_seconds if name == "disk" else None
        if written:  # a group the tier held already wrote nothing: no measure of its bandwidth
            stats.write.observe(written, time.perf_counter() - started, fixed=fixed, at=self.clock())
        stats.bytes_in += written
        self.moved[(src, name)] += written

    def _salvager(self, out: list):
        """What write-back saves to Redis of a disk segment about to go: its blocks Redis lacks, as
        Redis stores blocks (re-encoded where the disk stored them otherwise)."""
        def salvage(segment: Segment, data: bytes) -> None:
            offset = 0
            while offset < len(data):
                try:
                    meta, _, total = read_header(data, offset)
                except PayloadError:
                    return
                if meta.key in self.disk.index and meta.key not in self.remote.written:
                    payload = self._as_remote(meta, data[offset:offset + total])
                    if payload is not None:
                        out.append((meta, payload))
                offset += total
        return salvage

    def _as_remote(self, meta: BlockMeta, payload):
        """A disk payload as the remote tier stores blocks: itself when the codecs agree, else
        verified and encoded again (None when it fails verification: not worth saving)."""
        want = self.codec("remote")
        try:
            if payload_codec(payload) == want:
                return payload
            block = decode_block(payload, self.layout, self.space, meta.key).stacked()
        except PayloadError:
            return None
        if block is None:  # per-layer dtypes differ: never compressed, so the codecs agreed
            return payload
        layers = [(block[layer, 0][None], block[layer, 1][None]) for layer in range(self.layout.num_layers)]
        return b"".join(encode_parts(self.layout, self.space, [meta], layers, want)[0])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes; True when all finished within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            pending = list(self._pending_writes)
        for future in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(timeout=left)
            except Exception:  # noqa: BLE001  (a timeout, or an error already counted)
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        if self.disk is not None:
            self.disk.sync_dir()
        return True

    # ---- restore ---------------------------------------------------------------------------
    def available_run(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(blocks, bytes to move) of the longest run from keys[0] that the host tier or the
        staging area holds now (restorable without I/O)."""
        n = 0
        with self.lock:
            for key in keys:
                if self._in_memory(key):
                    n += 1
                else:
                    break
        return n, n * self.layout.block_bytes

    def in_memory(self, keys: Sequence[bytes]) -> set[bytes]:
        """Those of `keys` the host tier or the staging area holds now (restorable without I/O)."""
        with self.lock:
            return {key for key in keys if self._in_memory(key)}

    def _in_memory(self, key: bytes) -> bool:
        return key in self.staged or (self.host is not None and key in self.host.index)

    @contextmanager
    def protecting(self, keys: Sequence[bytes]):
        """Keep these host entries from being evicted (a restore of them is under way: making
        room on the device demotes other blocks into the host tier)."""
        with self.lock:
            added = [k for k in keys if k not in self._protected]
            self._protected.update(added)
        try:
            yield
        finally:
            with self.lock:
                self._protected.difference_update(added)

    def restore_into(self, manager, keys: Sequence[bytes], start: int, count: int, tenant: str,
                     priority: int = 0) -> int:
        """Put blocks start..start+count of a chain (held in host slots or staged) back in the
        device cache of `manager`, for a request of `priority` (the engine's); their host slots are
        protected while making room demotes other blocks. Returns blocks restored: fewer than
        planned, or none, when an operator's eviction took some of them since (the request computes
        the rest; no block is left half-installed)."""
        with self.protecting(keys[start:start + count]):
            count = min(count, self.available_run(keys[start:start + count])[0])  # what is still here
            if count <= 0:
                return 0
            try:
                return manager.install(keys, start, count, tenant, self.load_into, self.space, priority)
            except SourceGone:  # dropped between that look and the copy: install undid its allocation
                return 0

    def restore_window_into(self, manager, keys: Sequence[bytes], first: int, stop: int, tenant: str,
                            priority: int = 0) -> int:
        """Under a sliding window: put the blocks of keys[first:stop] the device lacks (each held
        in a host slot or staged) back in the device cache of `manager`, all or none
        (KVCacheManager.install_window), their host slots protected meanwhile. Returns blocks
        restored: none when one of them left memory since, or the device lacks room for them all."""
        lacking = [key for key in keys[first:stop] if manager.pool.block_of(key) is None]
        with self.protecting(lacking):
            if len(self.in_memory(lacking)) < len(lacking):
                return 0
            try:
                return manager.install_window(keys, first, stop, tenant, self.load_into, self.space, priority)
            except SourceGone:  # dropped between that look and the copy: install_window undid its allocation
                return 0

    def load_into(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Scatter the host/staged data of `keys` into device blocks (engine thread)."""
        started = time.perf_counter()
        self._device_present()
        with self.lock, self.protecting(keys):
            if any(k not in self.staged and (self.host is None or k not in self.host.index) for k in keys):
                raise SourceGone("keys: a block to restore left host memory and staging (evicted meanwhile)")
            host_pos = [i for i, k in enumerate(keys) if k not in self.staged]
            staged_pos = [i for i, k in enumerate(keys) if k in self.staged]
            for positions, source in ((host_pos, "host"), (staged_pos, "staged")):
                if not positions:
                    continue
                if source == "host":
                    slots = [self.host.index[keys[i]] for i in positions]
                    for k in (keys[i] for i in positions):
                        self.host.touch(k)
                    self.host.copy_out(slots, self.kv_caches, [block_ids[i] for i in positions])
                else:
                    ids = torch.tensor([block_ids[i] for i in positions], dtype=torch.int64, device=self.device)
                    layers = _stack_blocks([self.staged[keys[i]][0] for i in positions], self.layout.num_layers)
                    for cache, (k, v) in zip(self.kv_caches, layers):
                        copy_rows(cache.k, ids, k)
                        copy_rows(cache.v, ids, v)
                for i in positions:
                    tier = "host" if source == "host" else self.staged[keys[i]][1]
                    data = None if source == "host" else self.staged[keys[i]][0]
                    # what the tier gave: a payload as stored (compressed or not), or the device's bytes
                    nbytes = self.layout.stored_bytes(data.codec) if isinstance(data, BlockData) \
                        else self.layout.block_bytes
                    stats = self.stats[tier]
                    stats.restored_blocks += 1
                    stats.hit_tokens += self.layout.block_size
                    stats.bytes_out += nbytes
                    self.moved[(tier, "device")] += nbytes
        seconds = time.perf_counter() - started
        self.stats["host"].restore_seconds.append(seconds)
        if keys:
            self.stats["host"].read.observe(len(keys) * self.layout.block_bytes, seconds)

    # ---- prefetch ----------------------------------------------------------------------------
    def start_prefetch(self, request_id: str, keys: Sequence[bytes]) -> bool:
        """Fetch the lower-tier part of a waiting request's prefix into staging, in the background.
        `keys` are the blocks the device lacks, in chain order. False when nothing to fetch, while
        the request's earlier fetch runs, or when an earlier one set out for the same first block
        (it failed there: a block is asked for once a request). What an earlier fetch of the
        request staged stays staged for it."""
        with self.lock:
            earlier = self.prefetches.get(request_id)
            if earlier is not None and earlier.future is not None and not earlier.future.done():
                return False
            start = 0
            for key in keys:
                if self._in_memory(key):
                    start += 1
                else:
                    break
            keys = list(keys[start:])
            if not keys or (self.disk is None and self.remote is None):
                return False
            if self.remote is None and keys[0] not in self.disk.index and keys[0] not in self.inflight:
                return False
            if earlier is not None and keys[0] in earlier.tried:
                return False
            job = Prefetch(request_id, keys, started=self.clock(), tried=set(keys))
            if earlier is not None:
                job.staged, job.tried = list(earlier.staged), job.tried | earlier.tried
            self.prefetches[request_id] = job
        job.future = self._reader.submit(self._fetch_timed, job)
        return True

    def _fetch_timed(self, job: Prefetch) -> int:
        try:
            return self._fetch(job)
        finally:
            job.ended = self.clock()

    def prefetch_pending(self, request_id: str) -> bool:
        job = self.prefetches.get(request_id)
        return job is not None and job.future is not None and not job.future.done()

    def wait_prefetch(self, request_id: str, timeout: float) -> None:
        job = self.prefetches.get(request_id)
        if job is not None and job.future is not None:
            try:
                job.future.result(timeout=timeout)
            except Exception:  # noqa: BLE001
                pass

    FETCH_GROUP = 32  # blocks per disk pread span or Redis round trip

    def _fetch(self, job: Prefetch) -> int:
        """Stage job.keys in chain order, a group at a time, from the fastest tier holding each;
        stop at the first block found nowhere or failing verification (the rest is recomputed)."""
        keys, i = job.keys, 0
        while i < len(keys) and not job.cancelled:
            with self.lock:
                if keys[i] in self.staged:  # another job brought it up: hold it for this one too
                    if job.cancelled:
                        return len(job.staged)
                    job.staged.append(keys[i])
                    i += 1
                    continue
                entry = self.inflight.get(keys[i])
            if entry is not None:  # still being written down: its tensors are right here
                with self.lock:
                    if not job.cancelled:
                        self.staged[keys[i]] = (entry[1], "host")
                        job.staged.append(keys[i])
                i += 1
                continue
            if self.disk is not None and keys[i] in self.disk.index and self._usable("disk"):
                run = []
                for key in keys[i:i + self.FETCH_GROUP]:
                    if key not in self.disk.index:
                        break
                    run.append(key)
                source, started = "disk", time.perf_counter()
                payloads = self.disk.read_many(run)
                # nothing read: a failed read, unless an eviction dropped them all meanwhile (a miss)
                if not payloads and any(key in self.disk.index for key in run):
                    self._degrade("disk", "read failed")
                else:
                    self.stats["disk"].read.observe(sum(len(p) for p in payloads.values()),
                                                    time.perf_counter() - started, at=self.clock())
            elif self.remote is not None and self._usable("remote"):
                run, source, started = keys[i:i + self.FETCH_GROUP], "remote", time.perf_counter()
                try:
                    payloads = self.remote.read_many(run)
                except RemoteUnavailable as exc:
                    self._degrade("remote", str(exc), seconds=0.0)
                    payloads = None
                # A round trip that found nothing measures the latency; one that brought blocks, the
                # bandwidth net of it. Else a first small read, mostly round trip, priced every restore
                # from Redis as slower than recomputing, and nothing was fetched again to learn better.
                meter, seconds = self.stats["remote"].read, time.perf_counter() - started
                if payloads:
                    meter.observe_net_of_latency(sum(len(p) for p in payloads.values()), seconds, at=self.clock())
                elif payloads is not None:
                    meter.observe_latency(seconds)
                payloads = payloads or {}
            else:
                break
            for key in run:
                data = payloads.get(key)
                if data is None:
                    return len(job.staged)
                try:
                    layers = decode_block(data, self.layout, self.space, key)
                except PayloadError as exc:
                    self._bad_payload(source, key, exc)
                    return len(job.staged)
                if not layers.decoded:
                    layers.stacked()  # decompressed here, on the reader thread, not in the serving loop
                with self.lock:
                    if job.cancelled:
                        return len(job.staged)
                    self.staged[key] = (layers, source)
                    job.staged.append(key)
                    if source == "remote":
                        self.remote.note_read(key)
                i += 1
        return len(job.staged)

    def _bad_payload(self, source: str, key: bytes, exc: PayloadError) -> None:
        """A payload that failed verification: counted, logged (no content), deleted; a miss."""
        self.stats[source].checksum_failures += 1
        log.warning("tier %s: dropped a block that failed verification (%s)", source, exc.reason)
        tier = {"disk": self.disk, "remote": self.remote}.get(source)
        if tier is not None:
            tier.drop(key, "corrupt")

    def verify_disk_segment(self, name: str):
        """Read one disk segment whole and verify its blocks (`DiskTier.check_segment`); each that
        fails is dropped as a failed restore's is (counted in checksum failures, logged, a `corrupt`
        removal event). A read error other than a file gone or cut short marks the tier degraded,
        as a failed read does. The SegmentCheck, or None when the segment is gone."""
        check = self.disk.check_segment(name)
        if check is None:
            return None
        for key, exc in check.bad:
            self._bad_payload("disk", key, exc)
        failed = check.unreadable
        if failed is not None and not isinstance(failed, (FileNotFoundError, SegmentShort)):
            with self.lock:
                self._degrade("disk", f"verify read failed: {failed.strerror or failed}")
        return check

    def finish_prefetch(self, request_id: str) -> None:
        """The request was admitted or cancelled: stop its fetch and drop what it staged."""
        with self.lock:
            job = self.prefetches.pop(request_id, None)
            if job is None:
                return
            job.cancelled = True
            for key in job.staged:
                if not any(key in other.staged for other in self.prefetches.values()):
                    self.staged.pop(key, None)

    # ---- operator actions ------------------------------------------------------------------
    def wait_for_writes(self, keys: Iterable[bytes], timeout: float) -> int:
        """Before an eviction drops `keys`: wait up to `timeout` seconds for the writes of those
        still being written down to land, so that `drop` takes them too instead of a write
        publishing them after the eviction said what it removed. Returns how many are still being
        written when it gives up (0: none)."""
        keys = list(keys)
        with self.lock:
            moving = [k for k in keys if k in self.inflight]
        if moving:
            self.flush(timeout)
            with self.lock:
                moving = [k for k in moving if k in self.inflight]
        return len(moving)

    def drop(self, keys: Iterable[bytes]) -> int:
        """Remove blocks from every lower tier (an operator's eviction). Returns blocks dropped: a
        block only in Redis counts if this call deleted it there (another daemon's purge may have
        taken it first, and counts it itself)."""
        dropped = 0
        remote: list[bytes] = []
        only_remote: list[bytes] = []  # counted once the server says it still held them
        for key in keys:
            with self.lock:
                if key in self.inflight:
                    continue  # being written down (wait_for_writes first): the next eviction catches it
                self.staged.pop(key, None)
                hit = self.host is not None and self.host.drop(key)
            if self.disk is not None and key in self.disk.index:
                self.disk.drop(key)
                hit = True
            if self.remote is not None and key in self.remote.written:
                remote.append(key)
                if not hit:
                    only_remote.append(key)
            dropped += bool(hit)
        if remote:
            deleted = self.remote.drop_many(remote)  # one pipelined round trip, not one per block
            dropped += sum(1 for key in only_remote if key in deleted)
        return dropped

    def drop_host(self, key: bytes, reason: str = "operator") -> bool:
        with self.lock:
            return self.host is not None and key not in self._protected and self.host.drop(key, reason)

    def drop_host_trees(self, roots: set[bytes], reason: str = "space") -> int:
        """Drop what host memory holds of the trees with these first blocks (new scales made
        their keys unreachable). Returns blocks dropped."""
        if self.host is None or not roots:
            return 0
        with self.lock:
            meta = self.host.meta
            keys = [key for key in list(self.host.index) if (m := meta.get(key)) is not None and m.root in roots]
        return sum(self.drop_host(key, reason) for key in keys)

    def retarget(self, layout: BlockLayout, space: bytes, record: dict | None = None) -> None:
        """New scales (or format): payloads are now written and checked under this layout and space
        (`record` says what it is, spaces.py). Blocks of the old one become unreachable (their keys
        change too) and age out."""
        with self.lock:
            self.layout, self.space = layout, space
            for tier in (self.disk, self.remote):
                if tier is not None:
                    tier.space = space
            if self.disk is not None:
                self.disk.layout = layout
        if record is not None and self.disk is not None:
            self.disk.spaces.add(space, record)
        if record is not None and self.remote is not None:
            self.remote.record_space(space, record)

    def space_records(self) -> tuple[dict[str, dict], str | None]:
        """Every space the disk folder or the shared Redis has a record of ({digest hex: record}),
        and why the Redis could not be asked (None when it was, or there is none)."""
        records = self.disk.spaces.load() if self.disk is not None else {}
        error = None
        if self.remote is not None:
            try:
                records = {**self.remote.spaces(), **records}
            except RemoteUnavailable as exc:
                error = str(exc)
        return records, error

    def fetch_now(self, keys: Sequence[bytes], timeout: float = 30.0) -> str | None:
        """Stage the run of `keys` from disk or remote and wait (operator swaps, benchmarks).
        Returns the job to hand to `finish_prefetch` once the staged blocks are used, or None
        when there was nothing to fetch."""
        job_id = f"fetch-{next(self._fetch_ids)}"
        if not self.start_prefetch(job_id, keys):
            return None
        self.wait_prefetch(job_id, timeout)
        return job_id

    def copy_to(self, name: str, metas: list[BlockMeta], layers, src: str) -> int:
        """Write blocks into one tier now and wait; returns blocks that tier holds afterwards."""
        if name == "host":
            self._put_host(metas, src=src, layers=layers)
            return sum(1 for m in metas if m.key in self.host.index)
        self._write_down(metas, layers, src=src, targets=[name])
        self.flush()
        tier = self.disk if name == "disk" else self.remote
        return sum(1 for m in metas if m.key in tier.index)

    def read_blocks(self, keys: Sequence[bytes]) -> list | None:
        """Verified (K, V) per layer [n, ...] of blocks from the fastest lower tier, or None."""
        per_block = []
        for key in keys:
            with self.lock:
                if self.host is not None and key in self.host.index:
                    layers = self.host.read_slots([self.host.index[key]])
                    per_block.append([(k[0], v[0]) for k, v in layers])
                    continue
            job = self.fetch_now([key])
            try:
                with self.lock:
                    entry = self.staged.get(key)
                if entry is None:
                    return None
                per_block.append(entry[0])
            finally:
                if job is not None:
                    self.finish_prefetch(job)
        return _stack_blocks(per_block, self.layout.num_layers)

    # ---- reports -----------------------------------------------------------------------------
    def tenant_bytes(self) -> dict[str, dict[str, int]]:
        """Per tier, the bytes each tenant's blocks take there ("" where the tenant is not known):
        in the host tier its slots times a block's bytes; in Redis, what this daemon wrote."""
        out: dict[str, dict[str, int]] = {}
        if self.host is not None:
            with self.lock:
                out["host"] = {t: n * self.layout.block_bytes for t, n in self.host.tenant_blocks.items()}
        for tier in (self.disk, self.remote):
            if tier is not None:
                with tier.lock:
                    out[tier.name] = dict(tier.tenant_bytes)
        return out

    def report(self) -> dict:
        """Per tier: capacity, use, blocks, hit tokens, bytes each way, rates, failures, health."""
        out = {}
        with self.lock:
            for tier in self.tiers():
                stats = self.stats[tier.name]
                blocks = len(tier.index)
                health = "degraded" if stats.degraded else "ok"
                if tier.name == "remote":
                    health = {"ok": health, "down": "down", "probing": "probing"}[tier.health()]
                capacity = None if tier.capacity_bytes >= UNBOUNDED_BYTES else tier.capacity_bytes
                out[tier.name] = {
                    "capacity_bytes": capacity, "used_bytes": tier.used_bytes, "blocks": blocks,
                    "hit_tokens": stats.hit_tokens, "restored_blocks": stats.restored_blocks,
                    "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
                    "read_bytes_per_second": stats.read.rate if stats.read.samples else None,
                    "write_bytes_per_second": stats.write.rate if stats.write.samples else None,
                    "checksum_failures": stats.checksum_failures, "errors": stats.errors,
                    "dropped_blocks": stats.dropped_blocks, "health": health,
                    "block_bytes": self.block_bytes_in(tier.name),  # a block as this tier stores it now
                    "degraded_reason": stats.degraded if tier.name != "remote" else (
                        tier.last_error if health != "ok" else None),
                }
                if tier.shares:  # evicted from tenants over their share
                    out[tier.name]["share_evictions"] = tier.share_evictions
                if tier.name == "disk":  # segments set aside (another model's, or corrupt), within its bytes
                    out[tier.name]["set_aside_bytes"] = tier.quarantine_bytes
                    # where its filesystem holds it below its bytes: the room left there (less the space
                    # kept free) and the most the tier can hold; the blocks evicted because that ran short
                    bound = tier.bounded_by_filesystem()
                    out[tier.name]["filesystem_bound"] = None if bound is None else {
                        "room_bytes": bound[0], "holds_at_most_bytes": bound[1]}
                    out[tier.name]["filesystem_evictions"] = tier.filesystem_evictions
                    out[tier.name]["vanished_segments"] = tier.vanished_segments
            out_moved = {f"{s}->{d}": b for (s, d), b in sorted(self.moved.items())}
        if self.disk is not None and self.disk.quarantine_bytes:  # whose: the folder's book names the spaces
            book = self.disk.spaces.load()
            out["disk"]["set_aside"] = [
                {**(summary(g["space"].hex(), book.get(g["space"].hex())) if g["space"] else {"space": None}),
                 "kind": g["kind"], "segments": g["segments"], "bytes": g["bytes"]}
                for g in self.disk.set_aside()]
        compression = {  # per payload tier: the codec asked for, the one written, a block's bytes both ways
            tier.name: {"setting": self._compress[tier.name], "codec": self.codec(tier.name),
                        "inactive_reason": unsupported(self.layout.layer_dtypes, self._compress[tier.name]),
                        "block_bytes": self.layout.payload_bytes,
                        "stored_block_bytes": self.layout.stored_bytes(self.codec(tier.name))}
            for tier in (self.disk, self.remote) if tier is not None}
        return {"write_policy": self.write_policy, "retained_blocks": self.retained_blocks,
                "tiers": out, "moved_bytes": out_moved,
                "moving_blocks": len(self.inflight), "staged_blocks": len(self.staged), "compress": compression}

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

"""Lower memory tiers for the KV cache: host, disk and remote (Redis), with verified moves.

    payload.py   the on-disk / on-wire block format (header, tensors, XXH3-64; no pickle)
    codec.py     how disk and Redis store a block's K/V: as the device does, or compressed (int8, fp8)
    host.py      pinned (CUDA) or plain CPU slots
    disk.py      durable segment files, re-indexed and verified at start
    remote.py    Redis / Redis Cluster with timeouts and a circuit breaker
    spaces.py    what a space digest stands for (model revision, format, scales), recorded by each tier
    tiered.py    TieredCache: demotion, write-through, prefetch, restore, state per block
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvctl.policies.tiering import TieringPolicy

from .disk import DiskTier, ScanReport
from .host import HostTier
from .payload import BlockData, BlockLayout, BlockMeta, PayloadError, decode_block, encode_blocks, encode_parts
from .remote import RemoteTier, RemoteUnavailable
from .spaces import space_record
from .tiered import LOWER, UNBOUNDED_BYTES, WRITE_POLICIES, TieredCache


def engine_layout(engine) -> BlockLayout:
    """The block layout of an engine's device cache (per-layer dtypes follow keep_layers)."""
    config = engine.loaded.config
    return BlockLayout(tuple(c.k.dtype for c in engine.kv_caches), engine.settings.block_size,
                       config.num_kv_heads, config.head_dim, engine.scale_version)


def space_digest(engine) -> bytes:
    """The engine's block space (its namespace less tenant and adapter): what every payload must match."""
    return engine.namespace("*").space_key()


def engine_space_record(engine) -> dict:
    """What the engine's space is, as the tiers record it (spaces.py)."""
    return space_record(engine.namespace("*").describe(), engine_layout(engine).describe())


def build_tiers(engine, *, host_bytes: int | None = None, disk_bytes: int | None = None,
                disk_path: str | Path | None = None, remote_url: str | None = None,
                remote_bytes: int | None = None, write_policy: str = "write_back",
                remote_timeout: float = 0.5, tiering: str = "measured",
                compress: str | dict[str, str] = "none") -> tuple[TieredCache | None, ScanReport | None]:
    """The configured tiers for `engine`, attached; (None, None) when none is configured.
    The disk tier is scanned (verified and re-indexed) before this returns."""
    if not (host_bytes or disk_bytes or remote_url):
        return None, None
    layout, space, record = engine_layout(engine), space_digest(engine), engine_space_record(engine)
    events = getattr(engine, "events", None)  # each tier logs what it indexes and drops
    host = None
    if host_bytes:
        try:
            host = HostTier(host_bytes, layout, pin_memory=torch.cuda.is_available())
        except (RuntimeError, MemoryError) as exc:  # torch's "DefaultCPUAllocator: can't allocate memory"
            raise ValueError(f"tiers.host.bytes: {host_bytes:,} bytes cannot be allocated on this host "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); give a smaller host tier") from None
    shares = getattr(getattr(engine, "settings", None), "tenant_cache_shares", ())  # as on the device
    if host is not None:
        host.events = events
        host.set_tenant_shares(shares)
    disk, report = None, None
    if disk_bytes:
        if disk_path is None:
            raise ValueError("tiers.disk.path: required with tiers.disk.bytes")
        try:
            disk = DiskTier(disk_path, disk_bytes, layout, space, record=record)
        except OSError as exc:  # a folder that cannot be made or opened: the setting, not a bare errno
            raise ValueError(f"tiers.disk.path: cannot use {str(disk_path)!r} for the disk tier "
                             f"({exc.strerror or type(exc).__name__})") from None
        disk.set_tenant_shares(shares)
        disk.events = events  # before the scan: the blocks it re-indexes are stored events too
        report = disk.scan()
    remote = None
    if remote_url:
        remote = RemoteTier(remote_url, remote_bytes or UNBOUNDED_BYTES, space, timeout=remote_timeout)
        remote.events = events
        remote.set_tenant_shares(shares)
        remote.record_space(space, record)
    tiers = TieredCache(engine.kv_caches, layout, space, host=host, disk=disk, remote=remote,
                        write_policy=write_policy, policy=TieringPolicy(mode=tiering), compress=compress)
    engine.attach_tiers(tiers)
    return tiers, report


__all__ = ["BlockData", "BlockLayout", "encode_parts", "BlockMeta", "DiskTier", "HostTier", "LOWER", "PayloadError", "RemoteTier",
           "RemoteUnavailable", "ScanReport", "TieredCache", "WRITE_POLICIES", "build_tiers",
           "decode_block", "encode_blocks", "engine_layout", "engine_space_record", "space_digest"]

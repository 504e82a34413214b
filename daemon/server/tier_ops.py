"""Operator actions on the lower tiers: report, prefix listing by tier, swap, save on shutdown.

kvctl presents; these functions decide, under the service lock where they touch the device
cache. Disk and Redis I/O happens outside the lock.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from kvctl.daemon.cache.tiers import BlockMeta, build_tiers, decode_block
from kvctl.daemon.stats import percentile
from kvctl.policies.tiering import PREFETCH_OUTCOMES

from .byte_sizes import format_bytes
from .calls import ServiceError
from .engine_liveness import held_for
from .evict_ops import EVICT_WRITE_WAIT_S
from .prefix_ops import prefix_tree, resolve_prefix
from .tier_verify import DEFAULT_RATE, DiskVerification

log = logging.getLogger("kvd")

TARGETS = ("device", "host", "disk", "remote")


def attach(service, engine) -> None:
    """Build the configured tiers for a freshly loaded engine (scans the disk tier)."""
    cfg = service.config
    disk_path = cfg.disk_cache_path or str(Path(cfg.state_dir) / "kvcache")
    tiers, scan = build_tiers(engine, host_bytes=cfg.host_cache_bytes, disk_bytes=cfg.disk_cache_bytes,
                              disk_path=disk_path, remote_url=cfg.remote_url,
                              remote_bytes=cfg.remote_cache_bytes, write_policy=cfg.write_policy,
                              remote_timeout=cfg.remote_timeout, tiering=cfg.tiering, compress=cfg.tier_codecs())
    service.tiers, service.tier_scan = tiers, scan
    if scan is not None:
        log.info("disk tier: %d blocks in %d segments re-indexed in %.2f s from their headers (%d of them set aside "
                 "before, for this model); set aside %d corrupt, %d foreign; removed %d unfinished and %d set aside "
                 "for room", scan.blocks, scan.segments, scan.seconds, scan.readmitted, scan.corrupt, scan.foreign,
                 scan.torn, scan.quarantine_dropped)
        bound = tiers.disk.bounded_by_filesystem()
        if bound is not None:
            log.warning("disk tier: tiers.disk.bytes is %s but its filesystem (%s) has room for %s more, keeping "
                        "some free for other files: the tier holds at most %s",
                        format_bytes(tiers.disk.capacity_bytes), tiers.disk.root, *map(format_bytes, bound))


def report(service) -> dict:
    engine = service.require_ready()
    tiers = service.tiers
    with service.engine_lock():
        counts = engine.cache.state_counts()
        stats = engine.stats
        device = {"capacity_bytes": engine.cache.num_blocks * engine.cache.block_bytes,
                  "used_bytes": (engine.cache.num_blocks - counts["free"]) * engine.cache.block_bytes,
                  "blocks": engine.cache.num_blocks - counts["free"], "health": "ok"}
        tokens = {"prompt": stats.prompt_tokens, "hit": stats.hit_tokens, "restored": stats.restored_tokens,
                  "recomputed": stats.recomputed_tokens}
        prefetch = prefetch_report(engine)
    body = {"configured": tiers is not None, "tokens": tokens, "device": device}
    if tiers is None:
        body.update({"write_policy": None, "tiers": {}, "moved_bytes": {}})
        return body
    body.update(tiers.report())
    body["prefetch"] = prefetch
    scan = service.tier_scan
    if scan is not None:
        body["disk_scan"] = {"blocks": scan.blocks, "segments": scan.segments, "corrupt": scan.corrupt,
                             "foreign": scan.foreign, "torn": scan.torn, "readmitted": scan.readmitted,
                             "set_aside_dropped": scan.quarantine_dropped, "seconds": scan.seconds}
    run = service.disk_verify
    body["verify"] = None if run is None or run.tiers is not tiers else run.report()
    body["break_even_tokens"] = {  # None: restoring from that tier never beats recomputing (JSON has no inf)
        name: finite_or_none(tiers.policy.break_even_tokens(tiers.block_bytes_in(name) / tiers.layout.block_size,
                                                            tiers.stats[name].read))
        for name in body["tiers"]}
    body["break_even_measured"] = {name: tiers.stats[name].read.samples > 0 and tiers.policy.prefill.samples > 0
                                   for name in body["tiers"]}
    return body


def start_verify(service, rate: float | None, principal, unpaced: bool = False) -> dict:
    """Begin reading the disk tier through and verifying every block (tier_verify.py), at `rate`
    bytes a second (DEFAULT_RATE when None), or as fast as the disk and a core allow (`unpaced`);
    refused while one runs, or with no disk tier."""
    service.require_ready()
    tiers = service.tiers
    if tiers is None or tiers.disk is None:
        raise ServiceError(409, "tiers verify: no disk tier is configured (tiers.disk.bytes, --disk-cache-bytes)",
                           "tiers")
    if rate is not None and unpaced:  # (the request's model has checked the rate: finite, > 0)
        raise ServiceError(400, "rate: give a rate or unpaced, not both", "rate")
    rate = None if unpaced else (rate or DEFAULT_RATE)
    with service.verify_lock:
        current = service.disk_verify
        if current is not None and current.running and current.tiers is tiers:
            report = current.report()
            raise ServiceError(409, f"tiers verify: one is running (started by {report['actor']}, "
                                    f"{report['segments_done']:,} of {report['segments_total']:,} segments read); "
                                    "stop it first (kvctl tiers verify --stop)", "tiers")
        run = service.disk_verify = DiskVerification(tiers, principal.actor, rate)
        run.start()
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="tiers.verify", target="disk",
                        result="ok", detail={"rate_bytes_per_second": rate, "segments": run.report()["segments_total"]})
    return {"verify": run.report()}


def stop_verify(service, principal) -> dict:
    """End the running verification after the segment it is reading; its report so far."""
    with service.verify_lock:
        run = service.disk_verify
        if run is None or not run.running:
            raise ServiceError(409, "tiers verify: none is running", "tiers")
        run.stop(principal.actor)
    run.join(timeout=10)
    report = run.report()
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="tiers.verify.stop", target="disk",
                        result="ok", detail={k: report[k] for k in ("segments_done", "segments_total", "bad_blocks")})
    return {"verify": report}


def finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) else value


def prefetch_report(engine) -> dict:
    """How requests waited for their prefixes to come up from disk or Redis: the policy, how each
    wait ended, blocks staged by then, the latest waits' percentiles, requests waiting now (the
    engine's lock held)."""
    policy, stats = engine.prefetch, engine.stats
    waits = list(stats.recent_prefetch_waits)
    return {"policy": policy.policy, "timeout_seconds": policy.timeout,
            "timeout_per_1k_tokens_seconds": policy.per_1k_tokens,
            "outcomes": {outcome: stats.prefetch_outcomes.get(outcome, 0) for outcome in PREFETCH_OUTCOMES},
            "staged_blocks": stats.prefetch_staged_blocks,
            "wait_seconds": {"p50": percentile(waits, 0.5), "p95": percentile(waits, 0.95),
                             "max": max(waits, default=None), "count": len(waits)},
            "fetching_now": sum(1 for r in engine.requests.values() if not r.finished and engine.fetching_prefix(r))}


def swap(service, prefix_id: str, to: str, copy: bool, principal) -> dict:
    """Move (or copy) a prefix to one tier and verify it there: the block `prefix_id` names and every
    block that extends it (its subtree, as `kvctl evict --prefix` takes it). To the device, the
    blocks it extends come up too where they are missing: a prefix is usable only whole."""
    engine = service.require_ready()
    tiers = service.tiers
    if to not in TARGETS:
        raise ServiceError(400, f"to: invalid value {to!r}; use {', '.join(TARGETS)}", "to")
    if tiers is None:
        raise ServiceError(409, "swap: no lower tier is configured (set tiers: in the config, or "
                                "--host-cache-bytes / --disk-cache-bytes / --remote-url)")
    if to != "device" and getattr(tiers, to) is None:
        raise ServiceError(400, f"to: the {to} tier is not configured", "to")
    tree, _ = prefix_tree(service)
    first = resolve_prefix(prefix_id, tree)
    prefix_id = first.hex()[:16]
    keys = tree.subtree_keys(first)
    started = time.perf_counter()
    if to == "device":
        tenant = tree.nodes[tree.node_of[first]].tenant or "default"  # whose blocks they are
        body = _to_device(service, engine, tree.leaf_paths(first), keys, tenant)
    else:
        wanted = set(keys)
        with service.lock:  # the blocks and their contents in one hold: a step may reuse a block after it
            device = sorted((b for b in engine.cache.pool.blocks if b.key in wanted), key=lambda b: b.depth)
            own = sum(b.own for b in device)  # a running request's own blocks (explicit prompt cache mode): no tier's
            device = [b for b in device if not b.own]
            device_metas = [BlockMeta.of(b) for b in device]
            device_layers = tiers.gather([b.block_id for b in device]) if device else None
        lower = {k: m for k, (m, _) in tiers.known_metas().items() if k in wanted}
        body = _to_lower(service, engine, tiers, to, copy, device_metas, device_layers, lower)
        if own:
            body["kept_on_device"]["private"] = own
    body.update({"prefix_id": prefix_id, "to": to, "copy": copy, "seconds": time.perf_counter() - started})
    with service.lock:
        engine.cache.audit()
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="swap", target=f"prefix={prefix_id}",
                        result="ok" if body["verified_blocks"] == body["blocks"] else "partial",
                        detail={k: body[k] for k in ("to", "copy", "blocks", "verified_blocks")})
    return body


def _to_device(service, engine, paths: list[list[bytes]], keys: list[bytes], tenant: str) -> dict:
    """Restore each leaf's chain (root first) that the device lacks; verify the subtree's `keys`."""
    moved = 0
    for path in paths:
        installed, _ = restore_chain(service, path, tenant)
        moved += installed
    own = set(keys)
    before = {k for path in paths for k in path if k not in own}  # the prefix it extends
    with service.lock:
        on_device = sum(1 for k in keys if engine.cache.pool.block_of(k) is not None)
        extended = sum(1 for k in before if engine.cache.pool.block_of(k) is not None)
    return {"blocks": len(keys), "moved_blocks": moved, "verified_blocks": on_device,
            "extended_blocks": len(before), "extended_on_device": extended}


def restore_chain(service, keys: list[bytes], tenant: str, timeout: float = 30.0) -> tuple[int, int]:
    """Bring the part of a chain of block keys that the device lacks back from the lower tiers
    (as far as they hold it unbroken; a fetch from disk or Redis waits up to `timeout` seconds).
    Returns (blocks restored, blocks of the chain on the device)."""
    engine, tiers = service.engine, service.tiers
    with service.lock:
        start = len(engine.cache.pool.match(keys))
    job = tiers.fetch_now(keys[start:], timeout)
    try:
        with service.lock:
            if service.asleep is not None:  # the device cache's memory is given back (sleep_ops.py)
                raise ServiceError(503, service.asleep.refusal())
            start = len(engine.cache.pool.match(keys))
            run, _ = tiers.available_run(keys[start:])
            installed = tiers.restore_into(engine.cache, keys, start, run, tenant)
            return installed, len(engine.cache.pool.match(keys))
    finally:
        if job is not None:
            tiers.finish_prefetch(job)


def warm_pins(service) -> int:
    """Bring every pinned prefix that a lower tier holds back to the device (a restart keeps the
    pins and the disk tier, but the device starts empty): a pinned prefix is hot again without
    waiting for a request to pay for the restore. Its blocks pin as they land. Returns blocks restored."""
    if service.tiers is None:
        return 0
    with service.lock:
        pins = [(pin.pin_id, pin.tenant, list(pin.keys)) for pin in service.engine.cache.pins.all()]
    restored = 0
    for pin_id, tenant, keys in pins:
        if service.asleep is not None:  # asleep again: waking warms them
            break
        try:
            installed, on_device = restore_chain(service, keys, tenant)
        except Exception as exc:  # a tier that fails is reported by its health; the pin stays
            log.warning("pin %s: not restored from the lower tiers: %s", pin_id, exc)
            continue
        restored += installed
        if installed:
            log.info("pin %s: %d of %d blocks restored from the lower tiers", pin_id, on_device, len(keys))
    return restored


def _to_lower(service, engine, tiers, to, copy, device_metas, device_layers, lower) -> dict:
    """Write the prefix's blocks to tier `to`: those on the device from `device_layers` (their
    contents, read when they were listed), the others from the lower tier holding each; verify
    them there and, unless `copy`, take them off the device and the other tiers."""
    target = getattr(tiers, to)
    moved = 0
    if device_metas:
        moved += tiers.copy_to(to, device_metas, device_layers, src="device")
    elsewhere = [m for k, m in sorted(lower.items(), key=lambda kv: kv[1].depth)
                 if k not in target.index and k not in {d.key for d in device_metas}]
    for meta in elsewhere:
        layers = tiers.read_blocks([meta.key])
        if layers is not None:
            moved += tiers.copy_to(to, [meta], layers, src=tiers.location(meta.key))
    all_metas = device_metas + [m for k, m in lower.items() if k not in {d.key for d in device_metas}]
    verified = sum(1 for m in all_metas if _verify(tiers, to, m.key))
    evicted = dropped = 0
    kept: dict[str, int] = {}
    if not copy:
        if device_metas:
            with service.lock:
                report = engine.cache.evict_prefix([m.key for m in device_metas])
            evicted, kept = report.evicted_blocks, {k: v for k, v in report.skipped.items() if v and k != "not_cached"}
        # copies on their way to another tier land first and go too, or the move would leave them there
        tiers.wait_for_writes([m.key for m in all_metas], EVICT_WRITE_WAIT_S)
        for m in all_metas:
            if _verify(tiers, to, m.key):
                for other in ("host", "disk", "remote"):
                    tier = getattr(tiers, other)
                    if other != to and tier is not None and m.key in tier.index:
                        (tier.drop if other != "host" else tiers.drop_host)(m.key)
                        dropped += 1
    return {"blocks": len(all_metas), "moved_blocks": moved, "verified_blocks": verified,
            "kept_on_device": kept,  # blocks a move left on the device too: pinned, or in use by a request
            "evicted_from_device": evicted, "dropped_elsewhere": dropped}


def _verify(tiers, to: str, key: bytes) -> bool:
    """Read the block back from `to` and check it (host: present; disk/remote: full verification)."""
    if to == "host":
        return key in tiers.host.index
    tier = getattr(tiers, to)
    try:
        data = tier.read(key)
    except Exception:  # noqa: BLE001  (remote down: not verified)
        return False
    if data is None:
        return False
    try:
        decode_block(data, tiers.layout, tiers.space, key)
    except ValueError:
        return False
    return True


def save_on_shutdown(service, deadline: float) -> dict:
    """Write what would be lost with the process to disk before the deadline (monotonic): every
    cached device block disk lacks, the most reused prefixes first and each prefix's blocks in
    order (a block is of use only after its ancestors), then the host tier's that disk lacks (most
    recently used first). Nothing is judged against serving here: the process is ending, and what
    is not written is recomputed after the restart. (A write rate measured low once made the
    eviction-time judgement refuse every block: a restart found 0 of 95 cached blocks.)"""
    tiers, engine = service.tiers, service.engine
    if tiers is None or tiers.disk is None or engine is None:
        return {"saved_blocks": 0}
    keep = []
    with _held_until(service, deadline) as had:
        if had:
            hits = {root: info.hits for root, info in engine.cache.roots.items()}
            keep = sorted((b for b in engine.cache.pool.blocks  # (a request's own blocks: no tier's)
                           if b.key is not None and not b.own and b.key not in tiers.disk.index),
                          key=lambda b: (-hits.get(b.root, 0), b.depth))
    if not had:
        log.warning("the device's cached blocks are not saved to disk: the engine held its lock past the stop's "
                    "deadline (%s)", service.engine_loop.stalled() or "a step still running")
    if service.device_lost:  # its blocks cannot be read (device_loss.py): the host tier's still can
        log.warning("the device's %d cached blocks are not saved to disk: the device is lost", len(keep))
        keep = []
    saved = 0
    for start in range(0, len(keep), 64):
        if time.monotonic() >= deadline:
            break
        group = keep[start:start + 64]
        with _held_until(service, deadline) as had:
            layers = tiers.gather([b.block_id for b in group]) if had else None
        if layers is None:  # (the engine stalled, or a step ran past the deadline)
            break
        saved += tiers.copy_to("disk", [BlockMeta.of(b) for b in group], layers, src="device")
    host_saved, host_keep = _save_host(tiers, {b.key for b in keep}, deadline)
    tiers.close(timeout=max(0.0, deadline - time.monotonic()))
    log.info("saved %d of %d cached device blocks and %d of %d host tier blocks to the disk tier",
             saved, len(keep), host_saved, host_keep)
    return {"saved_blocks": saved, "candidates": len(keep), "host_saved_blocks": host_saved,
            "host_candidates": host_keep}


def _held_until(service, deadline: float):
    """The engine's lock for a stop's save, waited for until `deadline` (time.monotonic()) at
    most, and not once the engine is stalled: a stop ends by its deadline (engine_liveness.held_for)."""
    return held_for(service.lock, service.engine_loop, deadline - time.monotonic())


def _save_host(tiers, written: set[bytes], deadline: float) -> tuple[int, int]:
    """Copy the host tier's blocks that disk lacks to disk, most recently used first, while the
    deadline allows. Returns (blocks saved, candidates)."""
    host = tiers.host
    if host is None:
        return 0, 0
    with tiers.lock:
        metas = [host.meta[k] for k in reversed(host.index) if k not in written and k not in tiers.disk.index
                 and k in host.meta]
    saved = 0
    for start in range(0, len(metas), 64):
        if time.monotonic() >= deadline:
            break
        with tiers.lock:  # what is still in host memory (never fetched from elsewhere here)
            group = [m for m in metas[start:start + 64] if m.key in host.index]
        layers = tiers.read_blocks([m.key for m in group]) if group else None
        if layers is not None:
            saved += tiers.copy_to("disk", group, layers, src="host")
    return saved, len(metas)

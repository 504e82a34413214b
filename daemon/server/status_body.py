"""The body of `GET /admin/status` (what `kvctl status` shows): blocks by state, tokens and hits,
evictions, queue, rollout, store, start, GC, latency, the GPU, the tiers and, when asked, the
block map. Counters are copied under the engine's lock; what takes longer (the block map's fold,
latency percentiles, NVML, tier reports) is made after it."""

from __future__ import annotations

import time

from kvctl.daemon import gpu_nvml
from kvctl.daemon.software import software_versions

from . import pin_ops
from .block_map import fold_block_map, read_block_map


def cache_format(engine) -> str:
    """The cache's format as set (fp8_e4m3, int8, ...), or "auto": the model's dtype."""
    return engine.settings.cache_dtype if engine.cache_dtype is not None else "auto"


def cache_status(service) -> dict:
    """Format, scale set and a check that the kernels read the stored scales."""
    engine = service.engine
    body = {"dtype": cache_format(engine),
            "layout": engine.layout(), "scale_version": engine.scale_version or None,
            "uncalibrated": engine.scale_version == "unit", "scale_set": None, "scales_verified": None}
    if service.calibration is not None:
        c = service.calibration
        body["scale_set"] = {"id": c["id"], "calibrated_at": c["created_at"], "applied_at": c["applied_at"],
                             "prompts_digest": c["prompts_digest"], "margin": c["margin"]}
        loaded = engine.loaded_scales()
        body["scales_verified"] = all(
            all(abs(a - b) <= 1e-6 * max(abs(b), 1e-12) for a, b in zip(loaded[layer][i], c["scales"][layer][i]))
            for layer in loaded for i in (0, 1))
    return body


def sliding_window(config, cache) -> dict | None:
    """The model's sliding window as /admin/status gives it, or None when no layer slides one."""
    if config.sliding_window is None:
        return None
    return {"tokens": config.sliding_window, "layers": len(config.sliding_layers), "of": config.num_layers,
            "blocks_per_sequence": cache.window_blocks, "released_blocks": cache.window_released}


def status_body(service, with_blocks: bool = False, cells: int | None = None) -> dict:
    """`GET /admin/status`: with `with_blocks`, the block map too, in at most `cells` cells
    (block_map.fold_block_map; None: a character per block)."""
    engine = service.require_ready()
    waiting_writes, longest_write_wait = service.store.waiting_writes()
    with service.engine_lock():  # (503 once the engine is stalled)
        cache = engine.cache
        counts = cache.state_counts()
        in_flight, retiring = engine.adapter_requests(), engine.retiring_adapters()
        cached = cache.adapter_blocks() if service.adapters() or retiring else {}
        on_old: dict[str, int] = {}  # a replaced adapter's requests on its earlier weights, not the served ones
        for row in retiring:
            row["cached_blocks"] = cached.get(row["digest"], 0)
            on_old[row["name"]] = on_old.get(row["name"], 0) + row["requests"]
        stats = engine.stats
        queue = engine.queue_figures()
        block_map = read_block_map(cache) if with_blocks else None
        body = {
            "model": {"name": service.model_name, "architecture": service.loaded.config.architecture,
                      "path": str(service.loaded.path),
                      "revision": service.loaded.revision, "dtype": str(engine.model.dtype),
                      "device": str(engine.model.device),
                      "max_model_len": engine.context_limit,
                      # layers that slide a window, and what a sequence holds under it (None: every layer attends
                      # in full; blocks_per_sequence None: a full-attention layer keeps every block)
                      "sliding_window": sliding_window(service.loaded.config, cache),
                      "experts": experts(service.loaded.config),  # None: a dense model
                      "chat_template": None if service.chat_template is None else {
                          "source": service.chat_template.source, "digest": service.chat_template.digest,
                          "defaults": service.chat_template.defaults},
                      # what a request that leaves a sampling field out gets (generation_config.json)
                      "sampling_defaults": {"source": service.loaded.generation.source,
                                            "values": service.sampling_defaults},
                      # LoRA adapters served beside it (lora_modules), each with its requests in flight
                      "adapters": [{**adapter.describe(),
                                    "requests": sum(in_flight[name].values()) - on_old.get(name, 0),
                                    "cached_blocks": cached.get(adapter.digest, 0),  # device blocks hashed under it
                                    # lora_modules, or an admin caller at runtime (lora_ops: until a restart)
                                    "source": "runtime" if service.runtime_lora.get(name) else "lora_modules"}
                                   for name, adapter in service.adapters().items()],
                      # adapters a reload took away or replaced, while requests still run on them
                      "retiring_adapters": retiring,
                      # adapters in one batch at most (None: no limit), and the requests waiting for a turn
                      "max_loras": engine.settings.max_loras, "lora_turns_waiting": len(engine.lora_turn_waiters)},
            # kvd's version and its libraries' (software.py): replicas that differ may answer differently
            "software": software_versions(),
            "blocks": {"device": {"total": cache.num_blocks, **counts}},
            "block_size": cache.block_size,
            "bytes_per_block": engine.cache.block_bytes,
            "bytes_per_token": engine.cache.block_bytes // cache.block_size,
            "capacity_tokens": cache.num_blocks * cache.block_size,
            # how many more tokens the active format holds than the model dtype would in the same bytes
            "extra_tokens_vs_model_dtype": cache.num_blocks * cache.block_size * (
                engine.model.cache_bytes_per_block(cache.block_size) - engine.cache.block_bytes)
                // engine.cache.block_bytes,
            "eviction_policy": cache.policy_name,
            "tokens": {"prompt": stats.prompt_tokens, "hit": stats.hit_tokens,
                       "recomputed": stats.recomputed_tokens, "restored": stats.restored_tokens,
                       "hit_ratio": stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0},
            # what an LRU cache of other sizes would have served of the same prompts (cache/hit_curve.py)
            "hit_curve": None if cache.hit_curve is None else {  # None: hit_curve false
                **cache.hit_curve.figures(cache.block_size), "device_blocks": cache.num_blocks,
                "formats": engine.format_blocks},  # the blocks each other cache format holds in the same memory
            "evictions": {"capacity": cache.pool.evictions, "operator": cache.pool.operator_evictions,
                          "tenant_share": cache.pool.share_evictions, "space": cache.pool.space_evictions,
                          "sleep": cache.pool.sleep_evictions, "private": cache.pool.private_evictions},
            # per tenant: idle (evictable) blocks and share in blocks; None when no shares are set
            "tenant_shares": cache.tenant_shares(),
            "queue": queue,
            "rejections": dict(stats.rejections), "preemptions": stats.preemptions,
            "step_failures": service.step_failures.report(),  # engine steps that raised (step_failures.py)
            # the output reservation policy, and of the requests that finished the blocks they held at
            # their finish and those reserved they never wrote (as kvctl bench replay's reservation_waste)
            "reservation": {"policy": engine.reservation.spec, "finished_blocks": stats.finished_blocks,
                            "unused_blocks": stats.reserved_unused_blocks},
            # requests admitted while an earlier arrival still waited (queue_order lpm or priority, ...)
            "admitted_ahead": stats.admitted_ahead,
            # speculative decoding (engine/speculative.py): the config served (None: off) and its totals
            # and, apart, the drafts of requests' predictions (a chat's `prediction`), counted alike, with
            # the most sequences running that they are drafted beside (prediction_max_batch; None: any)
            "speculation": {"config": None if engine.speculator.config is None else engine.speculator.config.describe(),
                            **engine.speculator.stats.describe(), "prediction": {
                                **engine.speculator.predicted.describe(),
                                "max_batch": engine.speculator.prediction_max_batch}},
            # model steps by kind and their summed wall time: Δseconds / Δwall is how busy the engine is
            "steps": {kind: {"count": stats.steps[kind], "seconds": stats.step_seconds[kind]}
                      for kind in sorted(stats.steps)},
            "engine_threads": service.engine_threads,  # torch intra-op threads of the engine (others use one)
            # the host's CPUs shared with other busy kvd engines (CPU device under kvd serve), else None
            "cpu_share": service.cpu_share.report() if service.cpu_share is not None else None,
            "pins": len(cache.pins.all()),
            "stranded_pins": len(pin_ops.stranded_pins(service)),  # pins no request reaches any more
            "rollout": service.rollouts.summary(),
            "last_reload": service.last_reload,
            "cache": cache_status(service),
            "uptime_seconds": time.time() - service.started_at,
            "start": None if service.start_timer is None else service.start_timer.report(),
            "gc": service.gc_pauses.report(),
            # the responses /v1/responses keeps for previous_response_id (response_store.py), in memory
            "responses": service.responses.figures(),
            "conversations": service.conversations.figures(),  # /v1/conversations (conversation_store.py)
            "reply_ids": service.reply_ids.figures(),  # chat replies' own ids for the next turn (reply_ids.py)
            # the kvd router /v1/batches' requests go through (batch_via.py), and since when and why they have
            # not gone (BatchRunner.unsent); None: served here
            "batch_via": None if service.batch_via is None else {"target": service.batches.via_target(),
                                                                  "unsent": service.batches.unsent},
            "draining": service.draining,
            # the TCP front's certificate (tls.py): subject, names, expiry; None without TLS
            "tls": None if service.tls is None else service.tls.describe(time.time()),
            # what sleeps (sleep_ops.Sleep.describe) while the cache's memory, or the weights', is given back
            "asleep": None if service.asleep is None else service.asleep.describe(),
            # weights an admin caller swapped in (weights_ops.py), which a restart does not keep
            "weights_updated": service.weights_updated,
            # blocks passed to other kvds through Redis, and taken from them (kv_transfer.py); {} if none
            "kv_transfers": service.kv_transfers.snapshot(),
            "store": {"file_ok": service.store.file_ok, "written_back": service.store.written_back,
                      "audit_write_failures": service.store.audit_failures,
                      # a rollback kvd made that the store has not taken (a restart would undo it)
                      "unstored_rollback": None if service.rollouts.unstored is None
                      else service.rollouts.unstored["rollout_id"],
                      # where kvd keeps it meanwhile (a restart then keeps it rolled back); None: only in memory
                      "unstored_rollback_kept": None if service.rollouts.unstored is None
                      else service.rollouts.unstored.get("kept"),
                      "failing_jobs": service.housekeeping.failing(),
                      # writes waiting to begin now (another process may hold the write lock), the longest wait
                      "waiting_writes": waiting_writes, "longest_write_wait_seconds": longest_write_wait},
        }
    body["latency"] = service.latency_summary()
    device = engine.model.device  # the GPU kvd runs on, as NVML numbers it (None on the CPU)
    body["gpu"] = gpu_nvml.NVML.rows((device.index or 0) if device.type == "cuda" else None)
    if service.tiers is not None:
        report = service.tiers.report()
        # (the disk tier's filesystem_bound: where its filesystem holds it below its bytes, or None)
        body["tiers"] = {name: {k: t[k] for k in ("used_bytes", "capacity_bytes", "blocks", "health",
                                                  "filesystem_bound") if k in t}
                         for name, t in report["tiers"].items()}
    if block_map is not None:  # folded after the lock: a character per block, or per cell of blocks
        body["block_map"], body["block_map_per_cell"] = fold_block_map(block_map, cells or len(block_map) or 1)
    return body


def experts(config) -> dict | None:
    """A mixture of experts' routing, as `kvctl status` shows it: experts in each MoE layer, how
    many a token goes to, in how many of the layers, whether a shared expert runs beside them, and
    their weights where the checkpoint quantised them ("mxfp4", kept so; "dequantised from mxfp4";
    None: as stored); None for a dense model."""
    if not config.moe_layers:
        return None
    weights = None if config.quantisation != "mxfp4" else \
        "dequantised from mxfp4" if config.dequantise_experts else "mxfp4"
    return {"experts": config.num_experts, "per_token": config.experts_per_token,
            "layers": len(config.moe_layers), "of": config.num_layers,
            "shared_expert": bool(config.shared_expert_intermediate_size), "weights": weights}

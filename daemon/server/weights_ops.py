"""New weights in place, from a checkpoint folder on kvd's machine: SGLang's POST
/update_weights_from_disk, which RL trainers call after each training step, and `kvctl
update-weights` (POST /admin/weights). The model stays the same model (architecture, shapes,
tokenizer); only its weights, and so its revision, change.

The revision is part of every block key (the cache identity), so nothing computed under the
weights before can be served under the new ones: their cached trees go from the device and host
memory the moment the new weights serve, pins made under them are reported stranded, and disk and
Redis keep theirs for `kvctl evict --model-revision`. vLLM's weight updates leave its prefix cache
as it was, and every RL framework has to remember to call /reset_prefix_cache after them.

How it goes:
  1. the folder is checked: config.json must describe the served model (every shape, the RoPE,
     the norms; its dtype aside: kvd loads in the one it serves) and its tokenizer must be the
     served one, else a 409 that names the difference (a restart serves another model);
  2. a quantised cache needs an applied calibration of the new revision, or allow_uncalibrated
     (unit scales), as at start;
  3. the weights are read while kvd serves. On a GPU they wait in host memory (pinned), packed as
     the model serves them, and at the swap are copied into the tensors served, in place: the GPU
     never holds two sets of weights, as vLLM's and SGLang's in-place loads do not either. On the
     CPU the new tensors simply take the old ones' place (host memory holds both until then);
  4. admission pauses: running requests finish on the old weights, new ones wait in the queue;
     with none running the engine thread swaps them in (on a GPU, the copy: the pause is as long
     as the bus takes to carry them, ~0.3 s for 16 GB at 50 GB/s), and admission resumes. Still
     running after `timeout` seconds: nothing changes, 409.

What changes lasts until kvd stops: a restart serves the config's `model`. Audited.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from kvctl.daemon.model.config import ModelConfig
from kvctl.daemon.model.errors import ModelError
from kvctl.daemon.model.llama import StagedWeights, stage_weights
from kvctl.daemon.model.tokenizer import Tokenizer
from kvctl.daemon.model.weights import load_weights, model_revision

from . import pin_ops
from .calls import Principal, ServiceError
from .fleet_admin import UPDATE_WAIT_MAX_S

log = logging.getLogger("kvd")

# kvd loads in its own dtype, and keeps or dequantises MXFP4 experts as it chose; EOS ids stay the served ones
NOT_COMPARED = ("dtype", "eos_token_ids", "dequantise_experts")
# devices whose new weights wait in host memory and are copied into the served tensors in place
IN_PLACE_DEVICES = ("cuda",)


@dataclass
class PendingWeights:
    """New weights read, waiting for the engine thread to swap them in between steps."""

    weights: dict | StagedWeights  # on the device, to take the served ones' place; or staged, to copy in
    path: Path
    revision: str
    calibration: dict | None  # the new revision's applied calibration (a quantised cache), if any
    scales: tuple[dict, str] | None  # (scales, scale version) to load with them; None: an unquantised cache
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: BaseException | None = None


def update(service, principal: Principal, model_path: str, timeout: float = 60.0, abort_running: bool = False) -> dict:
    """Serve the weights of checkpoint folder `model_path` from the next request (see the module).
    `abort_running` (SGLang's abort_all_requests): cancel the requests in flight rather than wait."""
    if not 0 <= timeout <= UPDATE_WAIT_MAX_S:
        raise ServiceError(400, f"timeout: 0 to {UPDATE_WAIT_MAX_S:g} seconds, got {timeout!r}", "timeout")
    engine = service.require_ready()
    folder = Path(model_path).expanduser()
    if not folder.is_absolute():
        raise ServiceError(400, f"model_path: give the checkpoint folder's absolute path, got {model_path!r}",
                           "model_path")
    if not folder.is_dir():
        raise ServiceError(400, f"model_path: {model_path!r} is not a directory on kvd's machine", "model_path")
    # one update at a time, and no sleep or wake meanwhile (sleep_ops.py: the weights' memory)
    with service.weight_updates, service.sleep_lock:
        asleep = service.asleep
        if asleep is not None and "weights" in asleep.released:
            raise ServiceError(409, "model_path: kvd's weights are asleep; `kvctl wake --only weights` (POST "
                                    "/wake_up?tags=weights) first, then update them", "model_path")
        loaded = service.loaded
        started = time.perf_counter()
        try:
            _check_same_model(loaded, folder)
            revision = model_revision(folder)
            calibration, scales = _scales_for(service, engine, revision)
        except ModelError as exc:
            _refused(service, principal, folder, str(exc))
            raise ServiceError(400, f"model_path: {exc}", "model_path") from None
        except ServiceError as exc:
            _refused(service, principal, folder, str(exc))
            raise
        if revision == loaded.revision:
            return {"success": True, "updated": False, "model_path": str(folder), "revision": revision,
                    "message": f"revision {revision[:12]} is the one served already; nothing changed"}
        try:
            weights = _read(loaded, folder)
        except (ModelError, OSError, RuntimeError) as exc:  # RuntimeError: host memory could not be pinned
            _refused(service, principal, folder, str(exc))
            raise ServiceError(400, f"model_path: {exc}", "model_path") from None
        read_seconds = time.perf_counter() - started
        pending = PendingWeights(weights, folder, revision, calibration, scales)
        with service.change_lock(principal, "weights.update", f"model:{loaded.revision[:12]}",
                                 detail={"model_path": str(folder)}):
            if service.pending_scales is not None:
                raise ServiceError(409, "new scales wait to load (a calibration applied); update the weights once "
                                        "they have", "model_path")
            service.pending_weights = pending
            engine.admission_paused = True  # running requests finish on the weights before; new ones queue
            service.lock.notify_all()
        waiting = time.perf_counter()
        if abort_running:  # as their clients leaving would (kvctl cancel): they end `cancelled`
            with service.lock:
                running = [rid for rid, r in engine.requests.items() if not r.finished]
            for request_id in running:
                service.cancel(request_id)
        if not pending.done.wait(timeout):
            with service.lock:
                withdrawn = not pending.done.is_set()
                if withdrawn:  # before the engine thread took it: nothing changed
                    service.pending_weights = None
                    engine.admission_paused = False
                    running = engine.queue_figures()["running"]
            if withdrawn:  # (audited outside the engine's lock: a store write may wait)
                message = (f"model_path: {running} requests still running after {timeout:g} s; the weights served "
                           "stay (a longer timeout waits for them; `kvctl drain` first)")
                _refused(service, principal, folder, message)
                raise ServiceError(409, message, "model_path")
        if pending.error is not None:
            raise pending.error
    body = {**pending.result, "read_seconds": read_seconds, "waited_seconds": time.perf_counter() - waiting}
    # the revision a restart serves (the config's model): the one before the first update
    config_revision = (service.weights_updated or {}).get("config_revision", body["previous_revision"])
    service.weights_updated = None if body["revision"] == config_revision else {
        "model_path": body["model_path"], "revision": body["revision"], "at": time.time(), "by": principal.actor,
        "config_model": service.config.model or None, "config_revision": config_revision}
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="weights.update",
                        target=f"model:{body['previous_revision'][:12]}", result="ok",
                        detail={k: body[k] for k in ("model_path", "revision", "previous_revision", "dropped_blocks",
                                                     "dropped_host_blocks")})
    return body


def apply(service, pending: PendingWeights) -> None:
    """Engine thread, lock held, nothing running: swap the new weights in (Engine.serve_weights)
    and their scales, point the tiers at the new block space, and answer the caller."""
    engine, loaded = service.engine, service.loaded
    previous, before = loaded.revision, engine.block_space()
    try:
        dropped, dropped_host = engine.serve_weights(pending.weights, pending.revision, pending.path)
        if pending.scales is not None:  # (a quantised cache) the new revision's, or unit scales
            more, more_host = engine.set_scales(*pending.scales)
            dropped, dropped_host = dropped + more, dropped_host + more_host
            service.calibration = pending.calibration
        if service.tiers is not None:
            from kvctl.daemon.cache.tiers import engine_layout, engine_space_record, space_digest

            service.tiers.retarget(engine_layout(engine), space_digest(engine), engine_space_record(engine))
        stranded = pin_ops.stranded_pins(service, space=before)
        pending.result = {
            "success": True, "updated": True, "model_path": str(pending.path), "revision": pending.revision,
            "in_place": isinstance(pending.weights, StagedWeights),  # copied into the served tensors
            "previous_revision": previous, "dropped_blocks": dropped, "dropped_host_blocks": dropped_host,
            "stranded_pins": stranded, "scale_version": engine.scale_version or None, "until_restart": True,
            "message": f"serving revision {pending.revision[:12]} (was {previous[:12]}) until kvd restarts; "
                       "set model in its config to keep it"}
        log.info("weights of %s serve now: revision %s (was %s); %d cached blocks of the revision before dropped "
                 "(%d in host memory)", pending.path, pending.revision[:12], previous[:12], dropped, dropped_host)
        pin_ops.warn_stranded(stranded, f"weights of {pending.path}")
    except Exception as exc:  # noqa: BLE001  (answered to the caller, who sees what went wrong)
        log.exception("weights of %s: not swapped in", pending.path)
        pending.error = ServiceError(500, f"model_path: the weights could not be swapped in: {exc}", "model_path")
    finally:
        service.pending_weights = None
        engine.admission_paused = False
        pending.done.set()


def _read(loaded, folder: Path) -> dict | StagedWeights:
    """The checkpoint's weights as the swap takes them: staged in host memory for a device of
    IN_PLACE_DEVICES (pinned for a GPU), else on the device to take the served ones' place."""
    model = loaded.model
    if model.device.type not in IN_PLACE_DEVICES:
        return load_weights(folder, loaded.config, model.dtype, model.device)
    host = load_weights(folder, loaded.config, model.dtype, torch.device("cpu"))
    return stage_weights(loaded.config, host, pin=model.device.type == "cuda")


def _check_same_model(loaded, folder: Path) -> None:
    """ServiceError (409) unless `folder` holds the served model's shapes and tokenizer."""
    config = ModelConfig.load(folder)
    for f in fields(ModelConfig):
        if f.name in NOT_COMPARED:
            continue
        new, served = getattr(config, f.name), getattr(loaded.config, f.name)
        if new != served:
            raise ServiceError(409, f"model_path: {folder} holds another model ({f.name}: {new!r} there, {served!r} "
                                    "served); new weights in place keep the model, so restart kvd with model: "
                                    "set to serve it", "model_path")
    tokenizer = Tokenizer(folder)
    if tokenizer.digest != loaded.tokenizer.digest:
        raise ServiceError(409, f"model_path: {folder} has another tokenizer (digest {tokenizer.digest[:12]}, "
                                f"{loaded.tokenizer.digest[:12]} served): prompts would become other tokens; "
                                "restart kvd with model: set to serve it", "model_path")


def _scales_for(service, engine, revision: str) -> tuple[dict | None, tuple[dict, str] | None]:
    """A quantised cache's scales for `revision`: its applied calibration, else unit scales with
    allow_uncalibrated (ServiceError otherwise, as at start). (None, None) for an unquantised cache."""
    config = service.config
    if engine.cache_dtype is None:
        return None, None
    calibration = service.store.calibration(revision, config.cache_dtype, applied=True)
    if calibration is not None:
        return calibration, (calibration["scales"], f"cal-{calibration['id']}")
    if not config.allow_uncalibrated:
        raise ServiceError(409, f"model_path: cache_dtype {config.cache_dtype} has no applied calibration for "
                                f"revision {revision[:12]}; set allow_uncalibrated: true to serve it with unit scales, "
                                "then `kvctl calibrate --apply`", "model_path")
    heads = engine.loaded.config.num_kv_heads
    unit = {layer: ([1.0] * heads, [1.0] * heads) for layer, cache in enumerate(engine.kv_caches)
            if cache.k_scale is not None}
    log.warning("SERVING AN UNCALIBRATED %s CACHE WITH UNIT SCALES for revision %s (allow_uncalibrated)",
                config.cache_dtype, revision[:12])
    return None, (unit, "unit")


def _refused(service, principal: Principal, folder: Path, why: str) -> None:
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="weights.update",
                        target=f"model:{service.loaded.revision[:12]}", result="refused",
                        detail={"model_path": str(folder), "error": why})

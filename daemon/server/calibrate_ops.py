"""`kvctl calibrate`: measure the model's K/V ranges, derive the scales of a quantised cache
format, judge them by KL divergence on held-out prompts by length, rank the layers by how much
quantising them costs, store the result with its provenance, and apply it when it meets the
target (new scales load once running requests finish: service._load_scales).
"""

from __future__ import annotations

import time

from kvctl.daemon.config import cache_dtype_name
from kvctl.kernels import cache_dtype, format_unsupported_on

from .calls import Principal, ServiceError
from .durations import format_duration

MAX_MARGIN = 100.0  # headroom over the measured absmax; past 254 every int8 value rounds to zero (and past
# about 1e36 the float32 scales are infinite, which no answer or audit record can hold)


def calibrate(service, *, dtype: str, prompts: list[list[int]] | None, greedy_tokens: int, max_kl: float,
              margin: float, slices: list[int], if_older_than: float | None, apply: bool,
              principal: Principal) -> dict:
    """Measure, derive scales, evaluate by slice, rank layers; store; apply if it meets the target."""
    from kvctl.daemon import calibration as cal

    service.require_awake()  # it runs the model
    # (on a device a stalled step may hang, and its scales load under the lock)
    service.refuse_change_if_stalled(principal, "calibrate", "-", "-", detail={"dtype": dtype})
    loaded = service.loaded
    dtype = cache_dtype_name(dtype)
    if dtype not in ("fp8_e4m3", "fp8_e5m2", "int8"):
        raise ServiceError(400, f"dtype: invalid value {dtype!r}; use fp8_e4m3 (or fp8), fp8_e5m2 or int8",
                           "dtype")
    problem = format_unsupported_on(loaded.model.device, cache_dtype(dtype))
    if problem:  # scales for a format this GPU cannot serve would never be used
        raise ServiceError(400, f"dtype: {problem}", "dtype")
    if not 1.0 <= margin <= MAX_MARGIN:
        raise ServiceError(400, f"margin: must be from 1.0 to {MAX_MARGIN:g}, got {margin} (scale = absmax x margin / "
                                f"the format's largest value: at {MAX_MARGIN:g} int8 keeps one step for the largest)",
                           "margin")
    if not slices:
        raise ServiceError(400, "slices: must name at least one context length, got []", "slices")
    for i, length in enumerate(slices):
        if length < 1:
            raise ServiceError(400, f"slices[{i}]: must be a context length of 1 token or more, got {length}",
                               f"slices[{i}]")
    if if_older_than is not None:
        latest = service.store.calibration(loaded.revision, dtype, applied=False)
        age = None if latest is None else time.time() - latest["created_at"]
        if age is not None and age < if_older_than:
            return {"skipped": True, "calibration_id": latest["id"], "dtype": dtype, "age_seconds": age,
                    "reason": f"calibration {latest['id']} was made {format_duration(age)} ago, within "
                              f"if_older_than {format_duration(if_older_than)}"}
    calib, held = cal.builtin_prompts(loaded.tokenizer)
    if prompts:
        split = max(1, len(prompts) // 2)
        calib, held = prompts[:split], prompts[split:] or prompts[:split]
    k_max, v_max = cal.measure_absmax(loaded, calib)
    scales = cal.derive_scales(k_max, v_max, dtype, margin)
    sensitivity_set = [p for p in held if len(p) <= min(slices)][:3] or held[:1]
    sensitivity = cal.layer_sensitivity(loaded, sensitivity_set, dtype, scales)
    keep, _ = cal.recommend_keep(loaded, sensitivity_set, dtype, scales, sensitivity, max_kl)
    slice_results = [r.as_dict() for r in cal.evaluate(loaded, held, dtype, scales, keep, slices, greedy_tokens)]
    worst = max((r["kl"] for r in slice_results), default=0.0)
    meets = worst <= max_kl
    report = {"slices": slice_results, "layer_sensitivity": sensitivity, "margin": margin,
              "absmax": {"k": k_max.tolist(), "v": v_max.tolist()}}
    calibration_id = service.store.save_calibration({
        "model_revision": loaded.revision, "dtype": dtype, "margin": margin, "max_kl": max_kl,
        "scales": {str(k): v for k, v in scales.items()}, "keep_layers": list(keep), "report": report,
        "prompts_digest": cal.prompts_digest(calib + held), "meets_target": meets})
    body = {"calibration_id": calibration_id, "dtype": dtype, "model_revision": loaded.revision,
            "margin": margin, "max_kl": max_kl, "slices": slice_results, "layer_sensitivity": sensitivity,
            "recommended_keep_layers": list(keep), "meets_target": meets, "worst_kl": worst,
            "applied": False, "skipped": False}
    if apply and not meets:
        body["refused"] = (f"apply: calibration {calibration_id} misses the target: worst slice KL "
                           f"{worst:.3g} > max_kl {max_kl:.3g} (by {worst - max_kl:.3g})")
    elif apply:
        service.store.mark_calibration_applied(calibration_id)
        body["applied"] = True
        stored = service.store.calibration(loaded.revision, dtype, applied=True)
        with service.lock:
            if service.engine.settings.cache_dtype == dtype:
                service.engine.admission_paused = True
                service.pending_scales = stored
                body["takes_effect"] = "now: new scales load as soon as running requests finish"
                if tuple(keep) != tuple(service.engine.settings.keep_layers):
                    body["needs_restart_for_keep_layers"] = True
                service.lock.notify_all()
            else:
                body["takes_effect"] = f"when kvd serves cache_dtype {dtype}"
    service.store.audit(actor=principal.actor, tenant="-", action="calibrate", target=f"calibration:{calibration_id}",
                        result="applied" if body["applied"] else ("refused" if "refused" in body else "stored"),
                        detail={"dtype": dtype, "worst_kl": worst, "max_kl": max_kl})
    return body

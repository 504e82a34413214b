"""Reloading kvd's settings (SIGHUP, `kvctl config reload`): what can change live changes, the
rest waits for a restart and the answer says which; a kvd that could not load loads again.
LoRA adapters (lora_modules) change live too: added, taken away, or read again where their
files changed, while requests in flight finish on the adapter they came for.
Functions that take the EngineService (service.py), as the operator actions do."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from kvctl.daemon.cache.hit_curve import alone_tenants
from kvctl.daemon.config import ConfigError, KvdConfig, quick_prefill_default, speculation_of
from kvctl.daemon.engine.engine import prefetch_wait
from kvctl.daemon.model.errors import ModelError
from kvctl.daemon.model.lora import adapter_changes, kept_adapter, load_adapters, warn_if_kv_changes
from kvctl.policies.reservation import parse_reservation

from . import pin_ops
from .adapter_room import gpu_room
from .auth import TokenFileError, TokenTable
from .batch_via import BatchViaError, via_router
from .calls import ServiceError
from .lora_ops import served_modules, standing_changes
from .tls import TlsFileError
from .webhooks import WebhooksFileError, read_endpoints

log = logging.getLogger("kvd")

# settings a reload applies to the running kvd
LIVE_SETTINGS = ("max_batch_tokens", "max_running", "max_queue", "max_queue_wait", "max_tenant_requests", "reservation", "queue_order",
                 "pin_budget_blocks", "pin_room_tokens", "shutdown_timeout", "quick_prefill_tokens", "max_request_bytes",
                 "tenant_cache_shares", "tenant_priorities", "tenant_request_limits", "tenant_queue_waits",
                 "prefetch_policy",
                 "prefetch_timeout", "prefetch_timeout_per_1k_tokens", "tier_compress", "disk_compress",
                 "remote_compress", "trace_requests", "max_tracked_tenants", "gc_warn_seconds", "report_cached_tokens",
                 "prompt_cache_retention", "tenant_prompt_cache_retention", "predicted_outputs", "prediction_max_batch",
                 "log_requests",
                 "prompt_cache_breakpoints", "prompt_cache_explicit_tenants",
                 "batch_concurrency", "batch_via", "batch_via_token_file", "batch_via_ca_file",
                 "batch_via_client_cert", "webhooks_file", "max_file_bytes", "files_store_bytes", "tenant_files_bytes",
                 "files_max_age", "log_stats_interval",
                 "lora_modules", "lora_runtime_updates", "max_loras", "speculative_config", "responses_max_age",
                 "truncation_headroom", "responses_store_bytes", "conversations_store_bytes",
                 "reply_ids_bytes", "engine_stall_exit_seconds", "hit_curve_tenants")

# what the running process is bound to: its sockets, its store, its auth front, its metric families
BOUND_AT_START = ("state_dir", "socket", "listen", "token_file", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs",
                  "trusted_proxy", "metrics_aliases", "otlp_traces_endpoint",
                  "max_tenant_metric_series", "trace_key_file", "trace_block_tokens")


def quick_prefill_tokens(cfg: KvdConfig, device: str) -> int:
    """The quick prefill size in effect: the config's, or the device's default."""
    return quick_prefill_default(device) if cfg.quick_prefill_tokens is None else cfg.quick_prefill_tokens


def prefetch_settings(cfg: KvdConfig) -> dict:
    """The engine's prefetch settings from the daemon's config."""
    return {"prefetch_policy": cfg.prefetch_policy, "prefetch_timeout": cfg.prefetch_timeout,
            "prefetch_timeout_per_1k_tokens": cfg.prefetch_timeout_per_1k_tokens}


def reload_from_source(service, actor: str) -> dict:
    """Read the settings again as at start (the same flags and KVD_* environment, the YAML
    file as it is now) and apply what can change live (`reload`). A config that does not
    validate changes nothing: the refusal names the setting and is audited."""
    with service.adapter_updates:  # the adapters read here are the ones served (lora_ops changes none meanwhile)
        return _reload_from_source(service, actor)


REFUSED = "reload refused, nothing changed: "


def _count_refused(service, actor: str, refused: ServiceError) -> None:
    """Record a reload that changed nothing: audited, counted (kvd_config_reloads_total) and the
    last reload's result (kvd_config_last_reload_successful 0), with why (less REFUSED)."""
    why = str(refused).removeprefix(REFUSED)
    service.store.audit(actor=actor, tenant="-", action="reload", target="config", result="refused",
                        detail={"error": why})
    service.reloads["refused"] += 1
    service.last_reload = {"at": time.time(), "result": "refused", "error": why, "actor": actor}


def _reload_from_source(service, actor: str) -> dict:
    if service.config_source is None:
        raise ServiceError(409, "reload: this kvd has no settings source to read again", "config")
    try:
        new = service.config_source()
        refuse_an_emptied_file(service.config)
        fresh = TokenTable.load(service.config.token_file) if service.tokens is not None else None
        tls_files = service.tls.read_again() if service.tls is not None else None  # a rotated certificate or CAs
        adapters = read_adapters(service, new)
        endpoints = read_endpoints(new.webhooks_file) if new.webhooks_file else {}
        batch_via = via_router(new)  # (its token read again: a rotated one is taken)
    except (ConfigError, TokenFileError, TlsFileError, WebhooksFileError, BatchViaError) as exc:
        refused = ServiceError(400, REFUSED + str(exc), "config")
        _count_refused(service, actor, refused)
        raise refused from None
    failed = service.load_error is not None
    try:
        result = reload_after_failed_load(service, new, actor) if failed else reload(service, new, actor, adapters)
    except ServiceError as exc:  # a setting it cannot take live, or the engine stalled: nothing changed
        _count_refused(service, actor, exc)
        raise
    service.reloads["ok"] += 1
    service.last_reload = {"at": time.time(), "result": "ok", "error": None, "actor": actor}
    service.webhook_endpoints = endpoints  # (events waiting go to the endpoints the file names now)
    service.batch_via = batch_via
    if fresh is not None:  # rotated tokens take effect for the next request; counts only, never tokens
        result["tokens"] = service.tokens.adopt(fresh)
        service.store.audit(actor=actor, tenant="-", action="reload", target="token_file", result="ok",
                            detail=result["tokens"])
    if tls_files is not None:
        adopt_certificate(service, tls_files, actor, result)
    return result


def adopt_certificate(service, files, actor: str, result: dict) -> None:
    """Serve the certificate and client CAs a reload read (tls.py) from the next TCP connection
    on, where they changed: `result` gains `tls` (the rotation: fingerprints, subject, expiry) and
    `tls_client_cas` (the CA file: digests, how many CAs), each audited."""
    said = service.tls.adopt(files)
    for key, setting, shown in (("rotated", "ssl_certfile", "tls"), ("client_cas", "ssl_ca_certs", "tls_client_cas")):
        if key in said:
            result[shown] = said[key]
            service.store.audit(actor=actor, tenant="-", action="reload", target=setting, result="ok",
                                detail=said[key])


def read_adapters(service, new: KvdConfig) -> dict | None:
    """The LoRA adapters `new.lora_modules` names (with what admin callers loaded or unloaded
    at runtime over it: lora_ops), for the model served now, read outside the lock while kvd
    serves on: one whose name, folder and files are as they were is kept as it
    is, the others are read (load_adapters). None while no model is loaded. ConfigError names
    the adapter that cannot be served, or one that would be read while kvd is asleep (sleep_ops.py),
    and the reload then changes nothing."""
    loaded = service.loaded
    if loaded is None:
        return None
    modules = served_modules(service, new.lora_modules)
    asleep = service.asleep
    if asleep is not None:  # what the adapters may take of the GPU is weighed beside an awake cache
        unread = [name for name, path in modules
                  if kept_adapter(loaded.adapters, name, Path(path).expanduser()) is None]
        if unread:
            raise ConfigError(f"lora_modules: LoRA adapter {unread[0]!r} is read only while kvd is awake, and "
                              f"{asleep.refusal()}")
    try:
        return load_adapters(modules, loaded, service.model_name, current=loaded.adapters,
                             room=gpu_room(loaded.model.device))
    except ModelError as exc:
        raise ConfigError(str(exc)) from None


def refuse_an_emptied_file(config) -> None:
    """ConfigError when the file live settings came from holds nothing now (whitespace only). A
    tool that truncates before it writes leaves it so for a moment, and a reload then (a SIGHUP
    from a path watcher) put every one of them back to its default. `{}` there means no
    settings on purpose."""
    from_file: dict[str, list[str]] = {}
    for name, source in sorted(config.sources.items()):
        if not source.startswith(("--", "KVD_", "rollout ")):  # a flag, the environment, a completed rollout
            from_file.setdefault(source, []).append(name)
    for path, names in from_file.items():
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        if not text.strip():
            raise ConfigError(f"config: {path!r} is empty, and {', '.join(names)} came from it: a reload would "
                              "put them back to their defaults (a file caught mid-write?); write {} there to "
                              "mean no settings")


def reload_after_failed_load(service, new: KvdConfig, actor: str) -> dict:
    """kvd could not serve: its model, cache or tiers did not load (a quantised cache with no
    calibration yet, a checkpoint not there yet, a tier setting refused). A reload then loads
    again with the settings read now, all but those the process is bound to, so that fixing the
    config needs no restart. The answer names the earlier error; /readyz says "loading the
    model" until the load ends, and names the new error if it fails again."""
    with service.lock:
        if not service.failed_to_load():
            return reload(service, new, actor)  # loaded since, or a load is running already
        refuse_store_budgets(service, new)
        now, before = new.shown(), service.config.shown()  # shown: a Redis password stays out of answer and audit
        changed = {k: v for k, v in now.items() if k not in BOUND_AT_START and v != before[k]}
        previous = {k: before[k] for k in changed}
        bound = sorted(k for k in BOUND_AT_START if getattr(new, k) != getattr(service.config, k))
        earlier_error = service.load_error
        service.load_again(replace(new, **{k: getattr(service.config, k) for k in BOUND_AT_START}))
    result = {"changed": changed, "previous": previous, "needs_restart": bound, "loading_again": earlier_error,
              **resize_stores(service, changed)}
    service.store.audit(actor=actor, tenant="-", action="reload", target="config", result="ok", detail=result)
    log.info("loading again (reload by %s) after: %s; changed %s", actor, earlier_error, sorted(changed))
    return result


# the stores whose budget a reload sets anew: (setting, the store's name on the service and in the answer)
STORE_BUDGETS = (("responses_store_bytes", "responses"), ("conversations_store_bytes", "conversations"),
                 ("reply_ids_bytes", "reply_ids"))


def refuse_store_budgets(service, new: KvdConfig) -> None:
    """ServiceError (400, naming the setting) where a store's new budget cannot be set live
    (response_store.py, conversation_store.py: `budget_refusal`); the reload then changes nothing."""
    for name, store in STORE_BUDGETS:
        refusal = getattr(service, store).budget_refusal(getattr(new, name))
        if refusal is not None:
            raise ServiceError(400, REFUSED + refusal, name)


def resize_stores(service, changed: dict) -> dict:
    """Sets each store's budget a reload changed (`changed`: setting -> new value): what no
    longer fits goes, as for room. {"let_go": {store: how many}} where any went, else {}."""
    let_go = {store: getattr(service, store).resize(changed[name]) for name, store in STORE_BUDGETS if name in changed}
    return {"let_go": let_go} if any(let_go.values()) else {}


def tenant_priority_changes(old, new) -> dict[str, int]:
    """How the engine's priority (higher first) of a tenant's requests moves when `tenant_priorities`
    (lower first; a tenant not named is at 0) go from `old` to `new`: the tenants that moved."""
    before, after = dict(old), dict(new)
    return {tenant: before.get(tenant, 0) - after.get(tenant, 0) for tenant in sorted(before.keys() | after.keys())
            if before.get(tenant, 0) != after.get(tenant, 0)}


def reload(service, new: KvdConfig, actor: str = "sighup", adapters: dict | None = None) -> dict:
    """Apply policy settings that can change live (SIGHUP, `kvctl config reload`); the cache is
    kept. `reload_from_source` also re-reads the token file (token rotation). `adapters`: what
    `read_adapters` read for `new` (read here when not given)."""
    with service.adapter_updates:
        return _reload(service, new, actor, adapters)


def _reload(service, new: KvdConfig, actor: str, adapters: dict | None) -> dict:
    if adapters is None:
        try:
            adapters = read_adapters(service, new)
        except ConfigError as exc:
            raise ServiceError(400, REFUSED + str(exc), "lora_modules") from None
    if service.engine is not None:
        try:
            pin_ops.pin_room_of(service.engine, new)
        except ValueError as exc:
            raise ServiceError(400, REFUSED + str(exc), "pin_room_tokens") from None
    refuse_store_budgets(service, new)
    changed = {k: getattr(new, k) for k in LIVE_SETTINGS if getattr(new, k) != getattr(service.config, k)}
    reranked: dict[str, int] = {}
    previous = {k: getattr(service.config, k) for k in changed}
    ignored = sorted(k for k, v in new.describe().items()
                     if k not in LIVE_SETTINGS and v != getattr(service.config, k))
    with service.engine_lock(changes=True):
        engine = service.engine
        if engine is not None:
            engine.settings = replace(engine.settings, max_batch_tokens=new.max_batch_tokens,
                                      max_running=new.max_running, max_queue=new.max_queue,
                                      max_queue_wait=new.max_queue_wait, max_loras=new.max_loras,
                                      tenant_queue_waits=new.tenant_queue_waits,
                                      max_tenant_requests=new.max_tenant_requests,
                                      tenant_request_limits=new.tenant_request_limits,
                                      reservation=new.reservation, queue_order=new.queue_order,
                                      quick_prefill_tokens=quick_prefill_tokens(new, engine.model.device.type),
                                      tenant_cache_shares=new.tenant_cache_shares,
                                      max_tracked_tenants=new.max_tracked_tenants,
                                      hit_curve_tenants=new.hit_curve_tenants,
                                      speculation=speculation_of(new.speculative_config),
                                      prediction_max_batch=new.prediction_max_batch, **prefetch_settings(new))
            engine.prefetch = prefetch_wait(engine.settings)
            engine.cache.step_tokens = new.max_batch_tokens  # what a sliding-window sequence holds beside its window
            engine.speculator.configure(engine.settings.speculation, engine.settings.prediction_max_batch)
            engine.stats.tenants.resize(new.max_tracked_tenants)
            if engine.cache.hit_curve is not None:
                engine.cache.hit_curve.tenants.resize(new.max_tracked_tenants)
                engine.cache.hit_curve.follow_alone(  # a tenant still named keeps its curve
                    alone_tenants(new.hit_curve_tenants, new.tenant_cache_shares), engine.cache.num_blocks)
            if "tenant_cache_shares" in changed:
                engine.cache.set_tenant_shares(new.tenant_cache_shares)
                if service.tiers is not None and service.tiers.host is not None:
                    with service.tiers.lock:
                        service.tiers.host.set_tenant_shares(new.tenant_cache_shares)
                if service.tiers is not None and service.tiers.remote is not None:
                    service.tiers.remote.set_tenant_shares(new.tenant_cache_shares)
                if service.tiers is not None and service.tiers.disk is not None:
                    service.tiers.disk.set_tenant_shares(new.tenant_cache_shares)
            if "reservation" in changed:
                engine.reservation = parse_reservation(new.reservation)
            if "tenant_priorities" in changed:  # cached blocks rank at their tenant's new place too
                reranked = engine.cache.reprioritise_tenants(
                    tenant_priority_changes(service.config.tenant_priorities, new.tenant_priorities))
            if service.tiers is not None:  # blocks written from now on; those stored stay as they are
                service.tiers.compress = new.tier_codecs()
            pin_ops.set_pin_limits(engine, new)
            pin_ops.warn_no_room(engine)
        lora, retired = None, set()
        if adapters is not None and service.loaded is not None:
            lora = adapter_changes(service.loaded.adapters, adapters)
            retired = {service.loaded.adapters[name].digest for name in lora["removed"] + lora["replaced"]}
            service.loaded.adapters = adapters  # a new dict: whoever read the old one reads it whole
            service.runtime_lora = standing_changes(service, new.lora_modules)  # before the config changes
        service.trace.resize(new.trace_requests)  # the newest kept
        # the sources of settings that wait for a restart stay; a live one's is the new config's
        sources = {k: v for k, v in service.config.sources.items() if k not in LIVE_SETTINGS}
        sources.update({k: new.sources[k] for k in LIVE_SETTINGS if k in new.sources})  # absent: the default
        service.config = replace(service.config, **changed, sources=sources)
        # a completed rollout's setting is now either the config's too, or reverted by it
        reverted = {name: {**held, "now": changed[name]} for name, held in service.rollout_settings.items()
                    if name in changed}
        service.rollout_settings = {}
    result = {"changed": changed, "previous": previous, "needs_restart": ignored}
    result.update(resize_stores(service, changed))  # what a lowered budget no longer holds (its tenant is told)
    if lora is not None and any(lora.values()):
        result["adapters"] = lora  # requests in flight finish on the adapter they came for
        warn_if_kv_changes({name: adapters[name] for name in lora["added"] + lora["replaced"]},
                           service.config.cache_dtype)
    if reverted:
        result["reverted_rollout_settings"] = reverted
    if reranked:
        result["reranked_blocks"] = reranked
    result.update(pin_ops.stranded_by(service, retired, f"reload by {actor}"))
    service.store.audit(actor=actor, tenant="-", action="reload", target="config", result="ok", detail=result)
    log.info("reloaded by %s: changed %s; needs restart: %s", actor, sorted(changed), ignored)
    if reranked:
        log.info("cached blocks moved to their tenant's new priority: %s",
                 ", ".join(f"{tenant} {count}" for tenant, count in sorted(reranked.items())))
    for name, held in reverted.items():
        log.warning("reload reverted %s from %s (completed rollout %s) to the config's %s",
                    name, held["value"], held["rollout"], held["now"])
    return result

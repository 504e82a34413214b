"""The admin API that kvctl drives (`/admin/...`): status, prefixes, pins, evictions, the "why did
this miss?" explainer, tenants, requests in flight, the request trace, drain, route facts for a
router, rollouts, calibration, tiers, config and reload, and the audit log.

The handlers are thin: each reads its body and calls the service, or one of the modules of
operator actions that take it (pin_ops, evict_ops, tier_ops, ...). `create_app` (app.py) mounts
them on each front end, behind that front's `admin` dependency.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathPart
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kvctl.daemon.cache.events import KINDS, TIERS
from kvctl.daemon.model.chat_template import ChatTemplateError

from . import (cache_breakpoints, cache_questions, calibrate_ops, engine_profile, event_feed, evict_ops,
               health_checks, inflight, lora_ops, pin_ops, prefix_ops, reload_ops, response_admin, rollout_ops,
               service_tiers, sleep_ops, tier_ops, weights_ops)
from .admin_bodies import (CalibrateRequest, CancelRequest, DrainRequest, EvictRequest, ExplainRequest,
                           LoadLoraAdapterRequest, PinRequest, ProfileStartRequest, ReplyIdsRequest, ResponsesPurge,
                           RolloutAdvance, RolloutRollback,
                           RolloutStart, SleepRequest, SwapRequest, UnloadLoraAdapterRequest,
                           UpdateWeightsFromDiskRequest, VerifyRequest, WakeRequest, WeightsRequest)
from .api_errors import ApiError, checked_ids
from .auth import TENANT_PATTERN
from .calls import Principal, ServiceError
from .chat_messages import MessagesError, chat_messages, checked_tools, refuse_chat_fields_without_messages
from .durations import parse_duration
from .fleet_admin import RESET_WAIT_MAX_S
from .strict_json import StrictJSONRoute
from .tenants import list_tenants


def admin_routes(service, admin, *, tenant_header: bool) -> APIRouter:
    """The admin routes over `service`, each behind the `admin` dependency (which answers 403 to
    a caller without the admin role). `tenant_header`: whether this front serves a request under
    the X-KVD-Tenant it names (route facts tell a router)."""
    router = APIRouter(route_class=StrictJSONRoute)  # NaN and Infinity are not JSON: refused

    @router.get("/admin/status")
    def status(blocks: bool = Query(False), cells: int | None = Query(None, ge=1), _: Principal = Depends(admin)):
        """kvd's state; `blocks`: the block map too, a character per block, or per cell of
        consecutive blocks (their most common state) when `cells` caps how many."""
        return service.status(with_blocks=blocks, cells=cells)

    @router.get("/admin/checks")
    def checks(_: Principal = Depends(admin)):
        """Whether kvd is fit to serve, check by check (health_checks.py): what `kvctl check` shows."""
        return health_checks.kvd_report(service)

    @router.get("/admin/prefixes")
    def prefixes(tenant: str | None = None, pinned: bool = False, sort: str = "recent", limit: int = 0,
                 under: str | None = None, model: str | None = None, _: Principal = Depends(admin)):
        rows, total = prefix_ops.prefixes(service, tenant, pinned, sort, limit, under, model)
        return {"prefixes": rows, "total": total, "sort": sort}

    @router.get("/admin/events")
    async def events(since: int = 0, limit: int = 1000, kind: str | None = None, tier: str | None = None,
                     wait: float = 0.0, tail: int | None = None, key: str | None = None,
                     _: Principal = Depends(admin)):
        """The cache's events after `since` (blocks stored in and removed from each tier, with why);
        with `wait`, held open up to that many seconds until there is one. `tail`: the newest
        that many instead. `key`: only events naming a block whose key starts with these hex digits."""
        event_feed.check_page(since, limit, wait, tail)
        kinds = event_feed.parse_filter(kind, KINDS, "kind")
        tiers = event_feed.parse_filter(tier, TIERS, "tier")
        prefix = event_feed.parse_key(key)
        log = service.require_ready().events
        if tail is not None:
            return event_feed.read_tail(log, tail, kinds, tiers, prefix)
        return await event_feed.wait_for_events(log, since, limit, kinds, tiers, wait, prefix)

    @router.get("/admin/events/snapshot")
    def events_snapshot(_: Principal = Depends(admin)):
        return event_feed.snapshot(service)

    @router.get("/admin/tokenizer")
    def tokenizer(_: Principal = Depends(admin)):
        """The model's tokenizer files as text, with the digest the cache keys' namespace records,
        and the chat template (text and digest; null when there is none): a router that computes
        prompts' keys itself (`kvd router --view events`) loads them from here."""
        tok = service.require_ready().tokenizer
        tokenizer_json, config_json = tok.texts
        template = service.chat_template
        return {"digest": tok.digest, "tokenizer_json": tokenizer_json, "tokenizer_config_json": config_json,
                "chat_template": None if template is None else template.text,
                "chat_template_kwargs": None if template is None else template.defaults,
                "chat_template_digest": service.chat_template_digest}

    @router.get("/admin/pins")
    def pins(keys: bool = False, tenant: str | None = Query(None, pattern=TENANT_PATTERN.pattern),
             _: Principal = Depends(admin)):
        """Every pin (`tenant`: that tenant's); `keys`: with its block keys and the block space they
        belong to, for a copy on another replica (`kvd router`'s sync-pins)."""
        if not keys:
            return {"pins": pin_ops.list_pins(service, tenant=tenant), "room": pin_ops.room_beside_pins(service)}
        return {"pins": pin_ops.list_pins(service, with_keys=True, tenant=tenant), "space": service.block_space()}

    @router.post("/admin/pins")
    def pin(body: PinRequest, who: Principal = Depends(admin)):
        if sum(x is not None for x in (body.text, body.tokens, body.messages, body.prefix, body.keys)) > 1:
            raise ApiError(400, "give exactly one of text, tokens, messages, prefix and keys", param="prefix")
        if body.model is not None and (body.prefix is not None or body.keys is not None):
            raise ApiError(400, "model: names the LoRA adapter a prompt is hashed under; a prefix or keys name their "
                                "blocks already", param="model")
        if body.adapter_id is not None and body.keys is None:
            raise ApiError(400, "adapter_id: names the LoRA adapter that keys were made under; give it with keys",
                           param="adapter_id")
        if body.keys is not None and body.tenant is None:
            raise ApiError(400, "tenant: a pin by keys names its tenant (the keys were made under it)", param="tenant")
        try:
            ttl = parse_duration(body.ttl)
        except ValueError:
            raise ApiError(400, f"ttl: must be a finite number of seconds > 0 (or 30m, 1h, 2d), got {body.ttl!r}",
                           param="ttl") from None
        if body.prefix is not None:
            return pin_ops.pin_prefix(service, body.prefix, who, body.tenant, ttl, body.note)
        if body.keys is not None:
            return pin_ops.pin_copy(service, [bytes.fromhex(k) for k in body.keys], body.tenant, who, ttl, body.note,
                                    body.owner, body.adapter_id)
        target = Principal(body.tenant or who.tenant, who.role, who.actor)
        token_ids = tokens_of(body, target.tenant, opens_reply=False)
        return pin_ops.pin(service, token_ids, target, ttl, body.note, service.adapter_named(body.model))

    @router.delete("/admin/pins")
    def unpin_stranded(stranded: bool = False, who: Principal = Depends(admin)):
        """Every stranded pin (made under LoRA weights or a block space kvd no longer serves:
        pin_ops.stranded_pins), unpinned; a tenant's: DELETE /admin/tenants/{tenant}/pins."""
        if not stranded:
            raise ApiError(400, "stranded: DELETE /admin/pins unpins the stranded pins only (stranded=true); "
                                "unpin one pin by its id, DELETE /admin/pins/{pin_id}, or a tenant's, "
                                "DELETE /admin/tenants/{tenant}/pins", param="stranded")
        return pin_ops.unpin_many(service, who, stranded=True, tenant=None)

    @router.delete("/admin/tenants/{tenant}/pins")
    def unpin_tenant(tenant: str = PathPart(pattern=TENANT_PATTERN.pattern), stranded: bool = False,
                     who: Principal = Depends(admin)):
        """Every pin of a tenant (`stranded`: its stranded ones), unpinned, each audited: a tenant
        leaving, whose blocks `POST /admin/evict {"tenant": ...}` then takes. A path of its own, so
        that a kvd that does not know it answers 404 rather than unpinning more than was asked."""
        return pin_ops.unpin_many(service, who, stranded=stranded, tenant=tenant)

    @router.delete("/admin/pins/{pin_id}")
    def unpin(pin_id: str, who: Principal = Depends(admin)):
        return pin_ops.unpin(service, pin_id, who)

    @router.post("/admin/evict")
    def evict(body: EvictRequest, who: Principal = Depends(admin)):
        """Evict a prefix, a prompt, a tenant's blocks, a model revision's, or everything unpinned,
        from every tier (evict_ops.py)."""
        return evicting(body, who, dry_run=False)

    @router.post("/admin/evict/preview")
    def evict_preview(body: EvictRequest, who: Principal = Depends(admin)):
        """What `POST /admin/evict` with this body would take, with nothing evicted (`kvctl evict
        --dry-run`). A path of its own: a kvd that does not know it answers 404, where a field it
        did not know would have been ignored, and the eviction done."""
        return evicting(body, who, dry_run=True)

    def evicting(body: EvictRequest, who: Principal, dry_run: bool) -> dict:
        prompt = None
        if any(x is not None for x in (body.text, body.tokens, body.messages)):
            # `tenant` and `model` (a LoRA adapter): the prompt's namespace
            prompt = (tokens_of(body, body.tenant or who.tenant), body.tenant or who.tenant,
                      service.adapter_named(body.model))
        elif body.model is not None or body.adapter_id is not None:  # every block of an adapter
            field = "model" if body.model is not None else "adapter_id"
            if body.prefix or body.tenant or body.model_revision or body.all_unpinned or (
                    body.model is not None and body.adapter_id is not None):
                raise ApiError(400, f"{field}: alone, takes every block of the LoRA adapter it names; with a prompt "
                                    "(text, tokens or messages), model takes the prompt's blocks under the adapter; "
                                    "give neither with prefix, tenant, model_revision or all_unpinned", param=field)
            adapter = evict_ops.adapter_target(service, body.model, body.adapter_id)
            return evict_ops.evict(service, prefix_id=None, tenant=None, model_revision=None, all_unpinned=False,
                                   principal=who, purge_once=body.purge_once, adapter=adapter, dry_run=dry_run)
        return evict_ops.evict(service, prefix_id=body.prefix, tenant=None if prompt else body.tenant,
                               model_revision=body.model_revision, all_unpinned=body.all_unpinned, principal=who,
                               purge_once=body.purge_once, prompt=prompt, dry_run=dry_run)

    # vLLM's and SGLang's cache resets, for the scripts and benchmark harnesses (AIPerf's
    # --reset-kv-cache) that call them between runs: every unpinned block, as `kvctl evict
    # --all-unpinned` (the host and disk copies too; a shared Redis stays, other replicas use it).
    # `timeout` (SGLang's): wait up to that many seconds for the requests in flight to finish
    # first. Not all of it (blocks in use): a 409 whose body says what went and what stayed,
    # where vLLM answers 200 and SGLang 400 with nothing done.
    @router.post("/reset_prefix_cache", operation_id="reset_prefix_cache")
    @router.post("/flush_cache", operation_id="flush_cache")
    @router.get("/flush_cache", operation_id="flush_cache_get")
    def reset_prefix_cache(timeout: float = Query(0.0, ge=0.0, le=RESET_WAIT_MAX_S),
                           who: Principal = Depends(admin)):
        engine = service.require_ready()
        deadline = time.monotonic() + timeout
        while engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        body = evict_ops.evict(service, prefix_id=None, tenant=None, model_revision=None, all_unpinned=True,
                               principal=who)
        return JSONResponse(body, status_code=200 if body["result"] == "ok" else 409)

    @router.post("/admin/explain")
    def explain(body: ExplainRequest, who: Principal = Depends(admin)):
        tenant = body.tenant or who.tenant
        token_ids, replies = prompt_of(body, tenant)
        answer = cache_questions.explain(service, token_ids, tenant, service.adapter_named(body.model),
                                         explicit_mode(body, tenant, token_ids))
        return answer if replies is None else {**answer, "replies": replies}  # a chat's: how its replies went in

    @router.get("/admin/tenants")
    def tenants(tenant: str | None = Query(None, pattern=TENANT_PATTERN.pattern), _: Principal = Depends(admin)):
        """Each tenant's prompt and hit tokens, requests in flight, cached blocks, share and pins
        (counts only); `tenant`: that tenant's row alone."""
        return list_tenants(service, tenant)

    @router.get("/admin/requests")
    def requests_in_flight(tenant: str | None = None, _: Principal = Depends(admin)):
        """Every request in flight, oldest first: who, which API, where it stands, for how long,
        what the cache gave it and the blocks it holds (never its tokens or text)."""
        return inflight.list_requests(service, tenant)

    @router.get("/admin/trace")
    def request_trace(last: int | None = Query(None, ge=1), ids: Literal["numbered", "keyed"] = "numbered",
                      _: Principal = Depends(admin)):
        """The last finished requests (`last` of them, else every one kept) as a Mooncake trace:
        arrivals, prompt and output lengths, tenants, and chained ids of 512-token prompt blocks
        (HMACs under a key kvd never shows, numbered from 0); never tokens or text. `ids=keyed`:
        the ids as keyed and Unix arrivals, for kvd router to merge replicas' traces."""
        return service.trace_report(last, keyed=ids == "keyed")

    @router.post("/admin/cancel")
    def cancel(body: CancelRequest, who: Principal = Depends(admin)):
        """Cancel requests in flight by id (the X-KVD-Request-Id of their answers), or all of a
        tenant's: as if their clients had left. Audited."""
        return inflight.cancel_requests(service, who, body.request_ids, body.tenant)

    # ---- profiling the engine thread (engine_profile.py); vLLM's and SGLang's names too ----------
    @router.post("/admin/profile/start")
    def profile_start(body: ProfileStartRequest, who: Principal = Depends(admin)):
        return engine_profile.start_profile(service, who, body.max_seconds, body.max_steps)

    @router.post("/admin/profile/stop")
    def profile_stop(who: Principal = Depends(admin)):
        return engine_profile.stop_profile(service, who)

    @router.get("/admin/profile")
    def profile_status(_: Principal = Depends(admin)):
        """The profile running (since when, by whom, steps so far) and the latest one written."""
        return service.profiler.status()

    @router.post("/start_profile", operation_id="start_profile")
    def start_profile_compat(who: Principal = Depends(admin)):
        """vLLM's and SGLang's start (an empty POST, as AIPerf sends it): the default limits."""
        defaults = ProfileStartRequest()
        return engine_profile.start_profile(service, who, defaults.max_seconds, defaults.max_steps)

    @router.post("/stop_profile", operation_id="stop_profile")
    def stop_profile_compat(who: Principal = Depends(admin)):
        return engine_profile.stop_profile(service, who)

    # ---- sleep: the cache's memory (and the weights') given back, and taken again (sleep_ops.py) --
    @router.post("/admin/sleep")
    def go_to_sleep(body: SleepRequest, who: Principal = Depends(admin)):
        return sleep_ops.sleep(service, who, body.level, float(body.timeout), body.tags)

    @router.post("/admin/wake")
    def wake(body: WakeRequest, who: Principal = Depends(admin)):
        return sleep_ops.wake(service, who, body.tags)

    @router.post("/sleep", operation_id="sleep")
    def sleep_compat(level: int = Query(1), timeout: float = Query(0.0), who: Principal = Depends(admin)):
        """vLLM's sleep mode: POST /sleep?level=1|2 (`timeout`: kvd's, as the cache resets take it)."""
        return sleep_ops.sleep(service, who, level, timeout)

    @router.post("/wake_up", operation_id="wake_up")
    def wake_up_compat(tags: list[str] | None = Query(None), who: Principal = Depends(admin)):
        """vLLM's: POST /wake_up, or ?tags=weights then ?tags=kv_cache (the weights first, to update them)."""
        return sleep_ops.wake(service, who, tags)

    @router.get("/is_sleeping", operation_id="is_sleeping")
    def is_sleeping(_: Principal = Depends(admin)):
        return sleep_ops.status(service)

    @router.post("/release_memory_occupation", operation_id="release_memory_occupation")
    def release_memory(body: WakeRequest | None = None, who: Principal = Depends(admin)):
        """SGLang's: {"tags": ["kv_cache", "weights"]} (none: both), at level 1."""
        return sleep_ops.sleep(service, who, 1, 0.0, None if body is None else body.tags)

    @router.post("/resume_memory_occupation", operation_id="resume_memory_occupation")
    def resume_memory(body: WakeRequest | None = None, who: Principal = Depends(admin)):
        return sleep_ops.wake(service, who, None if body is None else body.tags)

    # ---- new weights in place (weights_ops.py); SGLang's name too --------------------------------
    @router.post("/admin/weights")
    def update_weights(body: WeightsRequest, who: Principal = Depends(admin)):
        return weights_ops.update(service, who, body.model_path, float(body.timeout), body.abort_running)

    @router.post("/update_weights_from_disk", operation_id="update_weights_from_disk")
    def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, who: Principal = Depends(admin)):
        """SGLang's answer: {"success", "message"}, with kvd's figures; a refusal as
        {"success": false, "message"} under its status."""
        try:
            return weights_ops.update(service, who, body.model_path, weights_ops.UPDATE_WAIT_MAX_S,
                                      body.abort_all_requests)
        except ServiceError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=exc.status)

    @router.post("/admin/drain")
    def drain(body: DrainRequest, who: Principal = Depends(admin)):
        return service.drain(body.drain, who)

    @router.post("/admin/route-facts")
    def route_facts(body: ExplainRequest, who: Principal = Depends(admin)):
        """What a router weighs for this prompt, in one call: how much of it the device cache
        holds, and how busy this replica is (its predicted wait, running and waiting requests).
        `tenant_header`: whether this front serves a request under the X-KVD-Tenant it names (else
        under the caller's token's tenant, `tenant` here when the body names none)."""
        # a model it does not serve is the router's to refuse (route-facts weighs; the model's blocks)
        adapter = body.model if body.model in service.adapters() else ""
        tenant = body.tenant or who.tenant
        try:
            tier = service_tiers.checked_tier(body.service_tier)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="service_tier") from None
        facts = cache_questions.route_facts(service, tokens_of(body, tenant), tenant, adapter, body.priority, tier)
        return {**facts, "tenant_header": tenant_header,
                "report_cached_tokens": service.config.report_cached_tokens}  # a router's X-KVD-Route keeps to it

    @router.post("/admin/reply-ids")
    def reply_ids(body: ReplyIdsRequest, who: Principal = Depends(admin)):
        """The ids of each text that is a reply kvd keeps for the tenant (None where it keeps none:
        another tenant's, edited, let go for room), under the tokenizer named by its digest: what a
        chat's next turn is prompted with in its place (reply_ids.py). kvd router's events view asks
        it for the replies of the Responses answers it relays, which carry no token ids."""
        service.require_ready()
        tokenizer, tenant = service.loaded.tokenizer, body.tenant or who.tenant
        return {"tenant": tenant, "tokenizer_digest": tokenizer.digest,
                "ids": [service.reply_ids.ids_for(tenant, tokenizer.digest, text) for text in body.texts]}

    @router.post("/admin/rollouts")
    def rollout_start(body: RolloutStart, who: Principal = Depends(admin)):
        if body.baseline != "current":
            raise ApiError(400, f"baseline: only 'current' is supported, got {body.baseline!r}", param="baseline")
        return rollout_ops.start_rollout(service, body.policy, body.cohort, body.stops, body.adr, who.actor)

    @router.get("/admin/rollouts")
    def rollout_latest(_: Principal = Depends(admin)):
        return rollout_ops.rollout_status(service)

    @router.get("/admin/rollouts/history")
    def rollout_history(limit: int = Query(50, ge=1, le=10_000), _: Principal = Depends(admin)):
        return {"rollouts": service.rollouts.history(limit)}

    @router.get("/admin/rollouts/{rollout_id}")
    def rollout_status(rollout_id: str, samples: bool = False, _: Principal = Depends(admin)):
        """`samples=true`: each side's totals and latest samples too (kvd router's fleet figures)."""
        return rollout_ops.rollout_status(service, service.rollouts.resolve(rollout_id), samples)

    @router.post("/admin/rollouts/{rollout_id}/advance")
    def rollout_advance(rollout_id: str, body: RolloutAdvance, who: Principal = Depends(admin)):
        return service.rollouts.advance(service.rollouts.resolve(rollout_id), body.to, who.actor)

    @router.post("/admin/rollouts/{rollout_id}/pause")
    def rollout_pause(rollout_id: str, who: Principal = Depends(admin)):
        return service.rollouts.pause(service.rollouts.resolve(rollout_id), who.actor)

    @router.post("/admin/rollouts/{rollout_id}/resume")
    def rollout_resume(rollout_id: str, who: Principal = Depends(admin)):
        return service.rollouts.resume(service.rollouts.resolve(rollout_id), who.actor)

    @router.post("/admin/rollouts/{rollout_id}/rollback")
    def rollout_rollback(rollout_id: str, body: RolloutRollback, who: Principal = Depends(admin)):
        return service.rollouts.rollback(service.rollouts.resolve(rollout_id), body.reason, who.actor)

    @router.post("/admin/rollouts/{rollout_id}/complete")
    def rollout_complete(rollout_id: str, who: Principal = Depends(admin)):
        return rollout_ops.complete_rollout(service, service.rollouts.resolve(rollout_id), who)

    @router.post("/admin/calibrate")
    def calibrate(body: CalibrateRequest, who: Principal = Depends(admin)):
        service.require_ready()
        prompts = None if body.prompts is None else [
            service.tokenize(p) if isinstance(p, str) else list(p) for p in body.prompts]
        return calibrate_ops.calibrate(service, dtype=body.dtype, prompts=prompts, greedy_tokens=body.max_tokens,
                                       max_kl=body.max_kl, margin=body.margin, slices=body.slices,
                                       if_older_than=body.if_older_than, apply=body.apply, principal=who)

    @router.get("/admin/tiers")
    def tiers(_: Principal = Depends(admin)):
        return tier_ops.report(service)

    @router.post("/admin/tiers/verify")
    def verify_tiers(body: VerifyRequest, who: Principal = Depends(admin)):
        """Read the disk tier through and verify every block, in the background (tier_verify.py)."""
        return tier_ops.start_verify(service, body.rate, who, unpaced=body.unpaced)

    @router.delete("/admin/tiers/verify")
    def stop_verifying_tiers(who: Principal = Depends(admin)):
        return tier_ops.stop_verify(service, who)

    @router.post("/admin/swap")
    async def swap(body: SwapRequest, who: Principal = Depends(admin)):
        return await run_in_threadpool(tier_ops.swap, service, body.prefix, body.to, body.keep_source, who)

    @router.get("/admin/config")
    def config(_: Principal = Depends(admin)):
        return {"config": service.config.shown(), "effective": service.effective_settings(),
                "from_rollouts": service.rollout_settings,
                "sources": {name: service.config.sources.get(name, "default") for name in service.config.describe()},
                "precedence": "flag > KVD_* env > YAML file > default",
                "live": sorted(reload_ops.LIVE_SETTINGS),  # what a reload changes; the rest wait for a restart
                # where kvctl's store commands (adr, db, runs) find this daemon's records
                "store_path": str(Path(service.store.path).resolve())}

    @router.post("/admin/reload")
    def reload(who: Principal = Depends(admin)):
        return service.reload_from_source(who.actor)

    # LoRA adapters at runtime, as vLLM's endpoints (lora_ops.py; lora_runtime_updates)
    @router.post("/v1/load_lora_adapter")
    def load_lora_adapter(body: LoadLoraAdapterRequest, who: Principal = Depends(admin)):
        return lora_ops.load(service, body.lora_name, body.lora_path, who, in_place=body.load_inplace)

    @router.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(body: UnloadLoraAdapterRequest, who: Principal = Depends(admin)):
        return lora_ops.unload(service, body.lora_name, who)

    @router.get("/admin/responses")
    def kept_responses(_: Principal = Depends(admin)):
        """The responses kept for /v1/responses, by tenant: counts, bytes and ages (never text)."""
        return response_admin.listing(service)

    @router.post("/admin/responses/purge")
    async def purge_responses(body: ResponsesPurge, who: Principal = Depends(admin)):
        """Remove a tenant's kept responses, those older than a span, or every one; audited."""
        return await response_admin.purge(service, body.tenant, body.older_than, body.all, body.dry_run, who,
                                          body.ids)

    @router.get("/admin/audit")
    def audit(since: float = 0.0, action: str | None = None, result: str | None = None, actor: str | None = None,
              tenant: str | None = None, target: str | None = None, _: Principal = Depends(admin)):
        return {"entries": service.store.audit_since(since, action=action, result=result, actor=actor,
                                                     tenant=tenant, target=target)}

    def tokens_of(body: ExplainRequest | PinRequest | EvictRequest, tenant: str, opens_reply: bool = True) -> list[int]:
        """The prompt an admin request names (`prompt_of`)."""
        return prompt_of(body, tenant, opens_reply)[0]

    def explicit_mode(body: ExplainRequest, tenant: str, token_ids: list[int]) -> tuple[str, int] | None:
        """Whether a request of `tenant` sending this body would be served in explicit prompt cache
        mode, and its first block hashed as its own (cache_breakpoints.private_start): its
        `prompt_cache_options` and its messages' marks, placed as a chat request's are."""
        options = body.prompt_cache_options
        try:
            marked = cache_breakpoints.marks(body.messages, options)  # (checks options too)
            lengths = [] if not marked or service.config.prompt_cache_breakpoints != "honour" else \
                cache_breakpoints.rendered_lengths(service, body.messages, marked, token_ids,
                                                   body.chat_template_kwargs, checked_tools(body.tools), tenant)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        return cache_breakpoints.private_start(options, tenant, service.config, lengths,
                                               service.require_ready().settings.block_size)

    def prompt_of(body: ExplainRequest | PinRequest | EvictRequest, tenant: str,
                  opens_reply: bool = True) -> tuple[list[int], dict | None]:
        """The prompt an admin request names: its text, its token ids, or its chat messages rendered
        by the chat template (`opens_reply`: ending with the assistant's turn opening, as a chat
        request's prompt does), `tenant`'s replies as their own ids, as its chat would send them;
        and for a chat, how its assistant messages went in (EngineService.render_chat), else None."""
        text, token_ids, messages = body.text, body.tokens, body.messages
        if sum(x is not None for x in (text, token_ids, messages)) != 1:
            raise ApiError(400, "give exactly one of text, tokens and messages", param="text")
        engine = service.require_ready()
        try:
            if messages is None:
                refuse_chat_fields_without_messages(body)
            else:
                return service.render_chat(chat_messages(messages), add_generation_prompt=opens_reply,
                                           template_kwargs=body.chat_template_kwargs, tools=checked_tools(body.tools),
                                           tenant=tenant)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages", code="chat_template_refused") from None
        if text is not None:
            return service.tokenize(text), None
        return checked_ids(list(token_ids), "tokens", engine), None

    return router

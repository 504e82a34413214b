"""Prometheus metrics for kvd (one registry per service, read at scrape time).

    kvd_blocks{state,tier}                    blocks by state (free, reserved, active, shared, cached, pinned)
    kvd_prompt_tokens_total                   prompt tokens of admitted requests
    kvd_prefix_hit_tokens_total               of those, served from the prefix cache
    kvd_recomputed_tokens_total               tokens computed again after preemption
    kvd_hit_curve_hit_tokens_total{times}     prompt tokens an LRU cache of `times` the device's blocks ("inf":
                                              one that never evicts) would have served (hit_curve.py); over
    kvd_hit_curve_prompt_tokens_total         the prompt tokens it was fed: the hit ratio at each size
    kvd_hit_curve_blocks{times}               the blocks each size is; exact up to kvd_hit_curve_exact_blocks,
    kvd_hit_curve_sample_rate                 estimated beyond from this share of the older blocks
    kvd_evicted_blocks_total{reason}          capacity (by the policy), tenant_share (from a tenant over its
                                              share, tenant_cache_shares), operator, space, or sleep (the
                                              cache's memory given back)
    kvd_sleep_level                           0 awake; 1 or 2 asleep at that level (sleep_ops.py)
    kvd_kv_transfer_requests_total{side}      prompts of disaggregated requests (kv_transfer.py): prefill (computed
                                              here for a decode kvd) or decode (decoded here after a prefill kvd)
    kvd_kv_transfer_blocks_total{direction}   their blocks written to Redis (published) or read from it (fetched)
    kvd_kv_transfer_seconds_total{side}       and the time those took, summed (over the requests: the mean)
    kvd_tenant_prompt_tokens_total{tenant}    prompt tokens per tenant, and kvd_tenant_hit_tokens_total{tenant}
    kvd_tenant_hit_curve_hit_tokens_total{tenant,times}  what one LRU cache of 1 and 2 times the device's blocks,
                                              shared by every tenant, would have served each tenant (hit_curve.py)
    kvd_tenant_alone_hit_tokens_total{tenant,share}  for the tenants the curve follows alone (hit_curve_tenants),
                                              what a cache share of its own of each size would have served it, over
    kvd_tenant_alone_prompt_tokens_total{tenant}  its prompt tokens since it was followed
    kvd_tenant_cached_blocks{tenant}          device blocks holding a tenant's cached prefixes
    kvd_tenant_rejected_requests_total{tenant} requests turned away per tenant, any reason (tenant_queue_waits,
                                              tenant_request_limits and priorities decide whose)
    kvd_tenant_retained_blocks_total{tenant}  blocks a tenant's prompt_cache_retention 24h wrote down
    kvd_tenant_explicit_requests_total{tenant}  a tenant's requests served in explicit prompt cache mode
    kvd_tenant_ttft_seconds{tenant}           histogram: time to first token per tenant (client requests)
    kvd_tenant_idle_blocks{tenant}            with tenant_cache_shares: idle cached blocks per tenant
    kvd_tenant_share_blocks{tenant}           and each tenant's share in blocks
    kvd_tenant_tier_bytes{tenant,tier}        bytes a tenant's blocks take in each lower tier (Redis: this daemon's)
                                              (per-tenant families: the first max_tenant_metric_series tenants
                                              seen by name, the rest summed under tenant="*"; tenant_labels.py)
    kvd_cache_stored_blocks_total{tier}       blocks indexed per tier (device, host, disk, remote)
    kvd_cache_removed_blocks_total{tier,reason}  blocks dropped per tier and why (capacity, operator,
                                              corrupt, unwritten, gone, space, tenant_share, filesystem, sleep): the event log's counts
    kvd_cache_events_dropped_total            events trimmed from the log (a slow reader sees a gap)
    kvd_allocation_seconds                    histogram: time per cache-core call
    kvd_admission_rejections_total{reason}    never_fits, pinned_out, queue_full, tenant_limit, queue_timeout
    kvd_generation_tokens_total               output tokens of finished requests
    kvd_finished_total{api,finish_reason}     samples (choices) finished: api completions, chat or internal
                                              (a pin's warm-up); stop, length or cancelled
    kvd_preemptions_total
    kvd_engine_step_failures_total            engine steps that raised, each stopping the requests in flight
                                              (answered 500 engine_error; step_failures.py)
    kvd_engine_stalled                        1 while the engine has not come round its loop in 60 s: /healthz
                                              says 503 engine_stalled (engine_liveness.py)
    kvd_metrics_engine_figures_missed_total   scrapes answered without the engine's figures, its lock (held for
                                              a step) not had in 5 s, or at once while the engine is stalled
    kvd_requests_refused_total{reason}        completions refused (503) before the engine took them in: draining,
                                              asleep, engine_stalled (a router sends each to another replica)
    kvd_finished_blocks_total                 blocks requests held at their finish (not cancelled), reserved
                                              ones included; kvd_reserved_unused_blocks_total, those reserved
                                              for output they never wrote: their ratio is the reservation's waste
    kvd_admitted_ahead_total                  requests admitted while one that arrived earlier still waited
                                              (queue_order lpm or priority, a prefix fetch, a LoRA turn)
    kvd_prompt_cache_breakpoints_total{outcome}  requests' prompt_cache_breakpoint marks as they finished:
                                              held, extended, pinned (an operator's pin holds it), short
                                              (under a block), over_budget (the tenant's pins), no_room
    kvd_prompt_cache_explicit_requests_total{why}  requests served in explicit prompt cache mode (cached only
                                              up to what they mark): asked, or tenant (prompt_cache_explicit_tenants)
    kvd_spec_decode_drafts_total              speculative decoding (speculative_config): decode steps that
                                              carried a draft; kvd_spec_decode_draft_tokens_total, the
                                              tokens drafted; kvd_spec_decode_accepted_tokens_total, those the
                                              model agreed with (kept); and
    kvd_spec_decode_accepted_tokens_per_pos_total{position}  drafts whose token at position (0 first) was kept
    kvd_prediction_drafts_total               the same for the drafts of requests' predictions (a chat's
                                              `prediction`, apart from speculative_config's):
                                              kvd_prediction_draft_tokens_total, kvd_prediction_accepted_tokens_total
    kvd_queue_age_seconds                     age of the oldest waiting request
    kvd_ttft_seconds                          histogram: time to first token
    kvd_inter_token_seconds                   histogram: time between output tokens
    kvd_pinned_blocks{tenant}                 distinct blocks pinned per tenant
    kvd_stranded_pins{reason}                 pins no request can reach any more: made under LoRA weights
                                              (adapter) or a block space (space) kvd no longer serves
    kvd_lora_requests{adapter,state}          requests in flight per LoRA adapter (lora_modules): running
                                              (some sample admitted) or waiting
    kvd_restored_tokens_total                 prompt tokens restored from a lower tier (not recomputed)
    kvd_audit_write_failures_total            audit records the store could not take (each logged whole)
    kvd_store_waiting_writes                  store writes waiting to begin now; kvd_store_longest_write_wait_seconds
    kvd_store_writes_total, kvd_store_write_wait_seconds_total   writes, and their waits to begin, summed
    kvd_housekeeping_failures_total{task}     failed runs of the periodic jobs (pin expiry, store file check,
                                              rollout stop conditions, state folder claim); each is tried again
    kvd_start_seconds{phase}                  the latest start: ready (from the process's start), model,
                                              cache, tiers (the disk tier's scan), pins, pins_warmed
    kvd_tier_bytes{tier}                      bytes held per lower tier (host, disk, remote)
    kvd_tier_capacity_bytes{tier}
    kvd_tier_block_bytes{tier}                bytes a block takes in each tier as written now (tier_compress)
    kvd_tier_moved_bytes_total{src,dst}       bytes moved between tiers (device included)
    kvd_tier_checksum_failures_total{tier}    payloads that failed verification (misses, deleted)
    kvd_tier_errors_total{tier}               I/O errors and timeouts
    kvd_tier_degraded{tier}                   1 while a tier is degraded or its breaker is open
    kvd_tier_retained_blocks_total            blocks written down for requests asking prompt_cache_retention 24h
    kvd_tier_restore_seconds                  histogram: time to put a prefix back on the device
    kvd_prefetch_requests_total{outcome}      requests whose prefix came from disk or Redis while they waited,
                                              by how the wait ended: complete, timeout, best_effort, cancelled
    kvd_prefetch_wait_seconds                 histogram: how long a request was held for such a fetch: until the
                                              fetch ended or the policy stopped waiting (not its queueing after)
    kvd_build_info{version,python,torch,cuda,triton,tokenizers,llguidance}  1, labelled with the software kvd
                                              runs (daemon/software.py; a library not installed: "")
    kvd_model_info{model,revision,dtype,cache_dtype}  1, labelled with what it serves (cache_dtype auto: the
                                              model's dtype); replicas of one model that differ answer differently
    kvd_rollout_info{rollout,state,policy,version}   1 for the running or paused rollout
    kvd_rollout_fraction{rollout}             the share of traffic asked for the cohort
    kvd_rollout_requests_total{rollout,side}  finished requests per side (cohort, baseline); likewise
    kvd_rollout_prompt_tokens_total, kvd_rollout_hit_tokens_total, kvd_rollout_recomputed_tokens_total,
    kvd_rollout_preemptions_total,            (the figures its stop conditions compare)
    kvd_rollout_finished_blocks_total, kvd_rollout_reserved_unused_blocks_total
    kvd_rollout_ttft_seconds{rollout,side}    histogram: time to first token per side
    kvd_config_reloads_total{result}          ok or refused (SIGHUP, kvctl config reload)
    kvd_config_last_reload_successful         0 while the latest reload was refused, else 1
    kvd_gc_pause_seconds{generation}          histogram: how long each of Python's garbage collections stopped
                                              every thread (kvd serve; daemon/server/gc_pauses.py)
    kvd_gc_frozen_objects                     objects frozen out of the collector's walks (gc_freeze)

Asked for OpenMetrics (`Accept: application/openmetrics-text`, as Prometheus asks by default), the
TTFT histograms carry exemplars where kvd sends spans (otlp_traces_endpoint): each bucket's latest
request, by its span's `trace_id` and `span_id`, so a dashboard goes from a slow bucket to its trace.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections import OrderedDict, deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kvctl.daemon.engine.tenant_book import EVICTED, EXPLICIT, HIT, PROMPT, REJECTED, RETAINED
from kvctl.daemon.software import software_versions
from kvctl.daemon.stats import LATENCY_BUCKETS, percentile
from kvctl.policies.tiering import PREFETCH_OUTCOMES

from . import engine_liveness, pin_ops
from .cut_connections import CutConnections
from .gc_pauses import metric_families as gc_metric_families
from .request_spans import exemplar_of
from .service import EngineService
from .status_body import cache_format


# kvd_build_info's labels: software_versions' keys, kvd's own as "version" (the usual build_info label)
BUILD_LABELS = ("version", "python", "torch", "cuda", "triton", "tokenizers", "llguidance")

TENANT_CURVE_TIMES = ("1", "2")  # the sizes kvd_tenant_hit_curve_hit_tokens names: the device's blocks, twice them
# disaggregated prefill and decode (kv_transfer.py): (family, help, label, ((label value, TransferBook key), ...))
TRANSFER_FAMILIES = (
    ("kvd_kv_transfer_requests", "Prompts of disaggregated requests: prefill (computed here for a decode kvd) or "
     "decode (decoded here after a prefill kvd)", "side", (("prefill", "prefills"), ("decode", "decodes"))),
    ("kvd_kv_transfer_blocks", "Blocks of disaggregated requests' prompts written to Redis for a decode kvd "
     "(published) or read from it for a decode here (fetched)", "direction",
     (("published", "published_blocks"), ("fetched", "fetched_blocks"))),
    ("kvd_kv_transfer_seconds", "Time disaggregated requests' prompts took to write to Redis (prefill) or to read "
     "from it onto the device (decode), summed", "side", (("prefill", "publish_seconds"), ("decode", "fetch_seconds"))),
)


def counted_by(name: str, documentation: str, label: str, counts, keys: tuple[str, ...]) -> CounterMetricFamily:
    """A counter with one `label`, a sample for each of `keys` (every one, counted 0 or more, from `counts`)."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key in keys:
        family.add_metric([key], counts[key])
    return family


def _speculation_metrics(figures: dict):
    """Speculative decoding's totals (engine/speculative.py SpeculationStats.describe)."""
    yield CounterMetricFamily("kvd_spec_decode_drafts", "Decode steps of a sequence that carried a speculative "
                              "draft (speculative_config)", value=figures["drafts"])
    yield CounterMetricFamily("kvd_spec_decode_draft_tokens", "Speculative tokens drafted",
                              value=figures["draft_tokens"])
    yield CounterMetricFamily("kvd_spec_decode_accepted_tokens", "Speculative tokens the model agreed with (kept)",
                              value=figures["accepted_tokens"])
    per_position = CounterMetricFamily("kvd_spec_decode_accepted_tokens_per_pos", "Drafts whose token at this "
                                       "position (0: the first) was kept", labels=["position"])
    for position, value in enumerate(figures["accepted_per_position"]):
        per_position.add_metric([str(position)], value)
    yield per_position


def _prediction_metrics(figures: dict):
    """The drafts of requests' predictions (a chat's `prediction`), apart from prompt lookup's."""
    yield CounterMetricFamily("kvd_prediction_drafts", "Decode steps of a sequence that carried a draft from its "
                              "request's prediction (Predicted Outputs)", value=figures["drafts"])
    yield CounterMetricFamily("kvd_prediction_draft_tokens", "Tokens drafted from requests' predictions",
                              value=figures["draft_tokens"])
    yield CounterMetricFamily("kvd_prediction_accepted_tokens", "Tokens drafted from requests' predictions that "
                              "the model agreed with (kept: accepted_prediction_tokens)",
                              value=figures["accepted_tokens"])


def tenant_hit_curve_family(labels, curve, rows: list, retired: list, block_size: int) -> CounterMetricFamily:
    """Per tenant, what the shared LRU cache over the device's blocks and over twice them would have
    served (TENANT_CURVE_TIMES; cache/hit_curve.py's tenant rows), folded as the other tenant families."""
    family = CounterMetricFamily("kvd_tenant_hit_curve_hit_tokens", "Prompt tokens of a tenant that an LRU cache "
                                 "of `times` the device's blocks, shared by every tenant, would have served (over "
                                 "kvd_tenant_prompt_tokens_total: its hit ratio there)", labels=["tenant", "times"])
    for times in TENANT_CURVE_TIMES:
        if times in curve.labels:
            tokens = [(tenant, curve.whole_hit_tokens(row, times, block_size)) for tenant, row in rows]
            for label, value in labels.fold(tokens, curve.whole_hit_tokens(retired, times, block_size)):
                family.add_metric([label, times], value)
    return family


def tenant_alone_families(alone: dict, block_size: int):
    """The tenants followed alone (at most 8, named by the operator: each by its own name): what a
    cache share of its own of each size would have served it, and its prompt tokens since followed."""
    hits = CounterMetricFamily("kvd_tenant_alone_hit_tokens", "Prompt tokens of a tenant followed alone "
                               "(hit_curve_tenants) that a cache of its own of `share` of the device's blocks would "
                               "have served (inf: one that never evicts)", labels=["tenant", "share"])
    prompts = CounterMetricFamily("kvd_tenant_alone_prompt_tokens", "Prompt tokens of a tenant followed alone, "
                                  "since it was", labels=["tenant"])
    for tenant, (curve, totals, _) in sorted(alone.items()):  # (its recent windows: /admin/tenants)
        figures = curve.row_figures(totals, block_size)
        for share, tokens in figures["hit_tokens"].items():
            hits.add_metric([tenant, share], tokens)
        prompts.add_metric([tenant], figures["prompt_tokens"])
    yield hits
    yield prompts


def hit_curve_families(curve: dict):
    """What an LRU cache of each size would have served (cache/hit_curve.py figures)."""
    hits = CounterMetricFamily("kvd_hit_curve_hit_tokens", "Prompt tokens an LRU cache of `times` the device's "
                               "blocks would have served (inf: one that never evicts), estimated", labels=["times"])
    blocks = GaugeMetricFamily("kvd_hit_curve_blocks", "The blocks of each size of kvd_hit_curve_hit_tokens",
                               labels=["times"])
    for row in curve["sizes"]:
        hits.add_metric([row["times"]], row["hit_tokens"])
        if row["blocks"] is not None:
            blocks.add_metric([row["times"]], row["blocks"])
    yield hits
    yield blocks
    yield CounterMetricFamily("kvd_hit_curve_prompt_tokens", "Prompt tokens the hit curve was fed (its hit "
                              "tokens over this: each size's hit ratio)", value=curve["prompt_tokens"])
    yield GaugeMetricFamily("kvd_hit_curve_exact_blocks", "Sizes up to this many blocks are exact in the hit "
                            "curve; larger ones are estimated from a sample", value=curve["exact_blocks"])
    yield GaugeMetricFamily("kvd_hit_curve_sample_rate", "The share of older blocks the hit curve keeps to "
                            "estimate its larger sizes (1: all)", value=curve["sample_rate"])


class _EngineCollector:
    def __init__(self, service: EngineService) -> None:
        self.service = service
        self.missed = 0  # scrapes answered without the engine's figures (its lock not had in time)
        self._missed_lock = threading.Lock()

    def collect(self):
        engine, loop = self.service.engine, self.service.engine_loop
        if engine is None:
            yield from self._without_the_lock(loop.stalled() is not None)
            return
        # the engine's figures, under its lock (held for a step): not had in time, the scrape answers
        # without them and says why (engine_liveness.py), where it failed before
        with engine_liveness.held_for_scrape(self.service.lock, loop) as had:
            if had:
                counts = engine.cache.state_counts()
                stats = engine.stats
                pool = engine.cache.pool
                window_released = engine.cache.window_released
                curve = None if engine.cache.hit_curve is None else engine.cache.hit_curve.figures(
                    engine.cache.block_size)
                hit_curve = engine.cache.hit_curve  # (its tenants' counts copied here, read after the lock)
                tenant_curves = None if hit_curve is None else hit_curve.tenant_snapshot()
                now = engine.clock()
                ages = [now - s.request.metrics.arrival for s in engine.waiting()]
                pins = {t: engine.cache.pins.used(t) for t in {p.tenant for p in engine.cache.pins.all()}}
                rejections = dict(stats.rejections)
                prompt, hit, recomputed, preemptions = (stats.prompt_tokens, stats.hit_tokens,
                                                        stats.recomputed_tokens, stats.preemptions)
                finished_blocks, unused_blocks = stats.finished_blocks, stats.reserved_unused_blocks
                admitted_ahead = stats.admitted_ahead
                breakpoints = dict(stats.breakpoints)
                steps, step_seconds = dict(stats.steps), dict(stats.step_seconds)
                by_tenant, retired = stats.tenants.items(), list(stats.tenants.retired)
                cached_by_tenant = sorted((t, n) for t, n in pool.tenant_blocks.items() if t is not None)
                shares = engine.cache.tenant_shares()
                prefetched = dict(stats.prefetch_outcomes)
                adapters = engine.adapter_requests()
                speculation, predicted = engine.speculator.stats.describe(), engine.speculator.predicted.describe()
                reasons = Tally(row["stranded"] for row in pin_ops.stranded_pins(self.service))
        if not had:
            with self._missed_lock:
                self.missed += 1
        yield from self._without_the_lock(loop.stalled() is not None)  # (after the wait: it may have stalled meanwhile)
        if not had:
            return
        blocks = GaugeMetricFamily("kvd_blocks", "KV cache blocks by state and tier", labels=["state", "tier"])
        for state, value in counts.items():
            blocks.add_metric([state, "device"], value)
        yield blocks
        if adapters:
            lora = GaugeMetricFamily("kvd_lora_requests", "Requests in flight per LoRA adapter: running (some "
                                     "sample admitted) or waiting", labels=["adapter", "state"])
            for name, states in adapters.items():
                for state, value in states.items():
                    lora.add_metric([name, state], value)
            yield lora
        yield CounterMetricFamily("kvd_prompt_tokens", "Prompt tokens of admitted requests", value=prompt)
        yield CounterMetricFamily("kvd_prefix_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=hit)
        yield CounterMetricFamily("kvd_recomputed_tokens", "Tokens computed again after preemption",
                                  value=recomputed)
        counted = CounterMetricFamily("kvd_engine_steps", "Model steps by kind (decode, mixed, prefill, quick)",
                                      labels=["kind"])
        busy = CounterMetricFamily("kvd_engine_step_seconds", "Wall time of model steps by kind; its rate is "
                                   "the fraction of time the engine is busy", labels=["kind"])
        for kind in sorted(steps):
            counted.add_metric([kind], steps[kind])
            busy.add_metric([kind], step_seconds[kind])
        yield counted
        yield busy
        yield GaugeMetricFamily("kvd_engine_threads", "torch intra-op threads the engine runs (fewer while other "
                                "busy kvd engines share the host's CPUs)", value=self.service.engine_threads)
        share = self.service.cpu_share
        if share is not None:
            yield GaugeMetricFamily("kvd_cpu_busy_neighbours", "Other busy kvd engines on this kvd's CPUs at the "
                                    "last look", value=share.busy_neighbours)
        evicted = CounterMetricFamily("kvd_evicted_blocks", "Cached blocks evicted", labels=["reason"])
        evicted.add_metric(["capacity"], pool.evictions - pool.share_evictions)
        evicted.add_metric(["tenant_share"], pool.share_evictions)  # to make room, from tenants over their share
        evicted.add_metric(["operator"], pool.operator_evictions)
        evicted.add_metric(["space"], pool.space_evictions)  # made under scales since replaced
        evicted.add_metric(["sleep"], pool.sleep_evictions)  # the cache's memory given back (sleep_ops.py)
        evicted.add_metric(["private"], pool.private_evictions)  # a request's own blocks, as it ended
        yield evicted
        yield CounterMetricFamily("kvd_sliding_window_released_blocks", "Blocks sequences gave back as their "
                                  "sliding window passed them (they stay cached); 0 unless every layer slides one",
                                  value=window_released)
        if curve is not None:
            yield from hit_curve_families(curve)
        asleep = self.service.asleep
        transfers = self.service.kv_transfers.snapshot()
        for name, text, label, values in TRANSFER_FAMILIES:
            family = CounterMetricFamily(name, text, labels=[label])
            for value, key in values:
                family.add_metric([value], transfers.get(key, 0))
            yield family
        yield GaugeMetricFamily("kvd_sleep_level", "0 while awake; 1 or 2 while asleep at that level (the cache's "
                                "memory given back; at 2 the weights too)", value=0 if asleep is None else asleep.level)
        kept = self.service.responses.figures()  # /v1/responses kept for previous_response_id (response_store.py)
        yield GaugeMetricFamily("kvd_responses_kept", "Responses kept in memory for previous_response_id",
                                value=kept["responses"])
        yield GaugeMetricFamily("kvd_responses_kept_bytes", "Bytes the kept responses are counted at (of "
                                "responses_store_bytes)", value=kept["bytes"])
        yield CounterMetricFamily("kvd_responses_dropped", "Kept responses let go for room (least recently used "
                                  "first) or too big to keep: a turn that continues one gets a 404",
                                  value=kept["dropped"])
        yield CounterMetricFamily("kvd_responses_expired", "Kept responses let go once older than "
                                  "responses_max_age", value=kept["expired"])
        yield GaugeMetricFamily("kvd_responses_running", "Background responses (background: true) running now",
                                value=kept["running"])
        yield CounterMetricFamily("kvd_responses_served_again", "Background responses kvd's last stop cut short, "
                                  "served again from the start at this start (responses_store_file)",
                                  value=kept["served_again"])
        yield GaugeMetricFamily("kvd_responses_replay_bytes", "Bytes of the events kept to stream ended background "
                                "responses again (within a quarter of responses_store_bytes, beside the kept "
                                "responses' bytes)", value=kept["replay_bytes"])
        if kept["file"] is not None:  # responses_store_file
            yield CounterMetricFamily("kvd_responses_file_failed_writes", "Writes to responses_store_file that did "
                                      "not land (a full disk, say): what they wrote is kept in memory only, and a "
                                      "restart will not find it", value=kept["file"]["failed_writes"])
        conversations = self.service.conversations.figures()  # /v1/conversations (conversation_store.py)
        yield GaugeMetricFamily("kvd_conversations_kept", "Conversations kept (/v1/conversations)",
                                value=conversations["conversations"])
        yield GaugeMetricFamily("kvd_conversations_kept_bytes", "Bytes the kept conversations are counted at (of "
                                "conversations_store_bytes)", value=conversations["bytes"])
        yield CounterMetricFamily("kvd_conversations_dropped", "Conversations let go for room (least recently used "
                                  "first): a request that names one gets a 404", value=conversations["dropped"])
        yield CounterMetricFamily("kvd_conversations_expired", "Conversations let go once unchanged longer than "
                                  "responses_max_age", value=conversations["expired"])
        yield CounterMetricFamily("kvd_conversation_turns_lost", "Responses whose turn was not added to their "
                                  "conversation: it would have outgrown conversations_store_bytes",
                                  value=conversations["turns_lost"])
        batches = self.service.batches.figures()  # /v1/batches (batches.py)
        family = GaugeMetricFamily("kvd_batches", "Batches kvd keeps (/v1/batches), by status", labels=["status"])
        for status, n in batches["batches"].items():
            family.add_metric([status], n)
        yield family
        yield GaugeMetricFamily("kvd_batch_requests_waiting", "Requests of the batches in progress not answered yet",
                                value=batches["waiting"])
        family = CounterMetricFamily("kvd_batch_requests", "Requests of batches answered, 2xx (completed) or not "
                                     "(failed)", labels=["outcome"])
        for outcome, n in batches["served"].items():
            family.add_metric([outcome], n)
        yield family
        hooks = self.service.webhooks.figures()  # webhooks.py
        yield GaugeMetricFamily("kvd_webhooks_pending", "Webhook events not delivered yet (tried again with backoff "
                                "for up to 3 days)", value=hooks["pending"])
        family = CounterMetricFamily("kvd_webhook_deliveries", "Webhook delivery attempts: delivered (2xx), retried "
                                     "(answered otherwise, or not at all) or dropped (given up)", labels=["outcome"])
        for outcome in ("delivered", "retried", "dropped"):
            family.add_metric([outcome], hooks[outcome])
        yield family
        files = self.service.files  # /v1/files (batch_files.py)
        yield GaugeMetricFamily("kvd_files", "Files kvd keeps (/v1/files: uploads and batches' outputs)",
                                value=len(files.files))
        yield GaugeMetricFamily("kvd_files_bytes", "Bytes of the files kvd keeps, every tenant's (of "
                                "files_store_bytes)", value=files.held())
        yield GaugeMetricFamily("kvd_files_store_budget_bytes", "files_store_bytes: what kvd's files may take, "
                                "every tenant's together (uploads past it are refused)",
                                value=self.service.config.files_store_bytes)
        yield counted_by("kvd_file_uploads_refused", "Uploads to /v1/files refused for room, by the budget they "
                         "would have passed: tenant (tenant_files_bytes) or store (files_store_bytes)", "budget",
                         files.refused, ("tenant", "store"))
        yield counted_by("kvd_files_expired", "Files removed once past their expiry since kvd started, by what set "
                         "it: expires_after (the file's own, or a batch's output_expires_after) or files_max_age",
                         "set_by", files.expired, ("expires_after", "files_max_age"))
        replies = self.service.reply_ids.figures()  # chat replies' own ids (reply_ids.py)
        yield GaugeMetricFamily("kvd_reply_ids_kept", "Chat replies whose token ids kvd keeps for the next turn",
                                value=replies["replies"])
        yield GaugeMetricFamily("kvd_reply_ids_kept_bytes", "Bytes the kept replies' ids are counted at (of "
                                "reply_ids_bytes)", value=replies["bytes"])
        yield CounterMetricFamily("kvd_reply_ids_dropped", "Replies' ids let go for room (least recently used of "
                                  "the tenant holding the most first)", value=replies["dropped"])
        yield CounterMetricFamily("kvd_reply_ids_spliced", "Assistant messages a chat was prompted with as the "
                                  "ids the model made, not tokenized again", value=replies["spliced"])
        yield CounterMetricFamily("kvd_reply_ids_template_changed", "Chats tokenized from their text although "
                                  "a reply's ids were kept: the chat template writes the reply otherwise (trims "
                                  "it, cuts its reasoning)", value=replies["template_changed"])
        labels = self.service.tenant_labels

        def per_tenant(name: str, text: str, index: int) -> CounterMetricFamily:
            family = CounterMetricFamily(name, text, labels=["tenant"])
            for label, value in labels.fold(((tenant, counts[index]) for tenant, counts in by_tenant),
                                            retired[index]):
                family.add_metric([label], value)
            return family

        yield per_tenant("kvd_tenant_prompt_tokens", "Prompt tokens of admitted requests, per tenant", PROMPT)
        yield per_tenant("kvd_tenant_hit_tokens", "Of those, served from the prefix cache, per tenant", HIT)
        if tenant_curves is not None:
            yield tenant_hit_curve_family(labels, hit_curve, tenant_curves.rows, tenant_curves.retired,
                                          engine.cache.block_size)
            if tenant_curves.alone:
                yield from tenant_alone_families(tenant_curves.alone, engine.cache.block_size)
        yield per_tenant("kvd_tenant_evicted_blocks", "A tenant's cached blocks evicted to make room, per tenant",
                         EVICTED)
        yield per_tenant("kvd_tenant_rejected_requests", "Requests turned away, per tenant, for any reason "
                         "(kvd_admission_rejections_total says which)", REJECTED)
        yield per_tenant("kvd_tenant_retained_blocks", "Blocks a tenant's requests asking prompt_cache_retention "
                         "24h wrote to disk and Redis", RETAINED)
        yield per_tenant("kvd_tenant_explicit_requests", "Requests served in explicit prompt cache mode (cached up "
                         "to their marked breakpoints alone), per tenant", EXPLICIT)
        cached = GaugeMetricFamily("kvd_tenant_cached_blocks", "Device blocks holding a tenant's cached prefixes "
                                   "(in use or idle)", labels=["tenant"])
        for label, count in labels.fold(cached_by_tenant):
            cached.add_metric([label], count)
        yield cached
        tiers = self.service.tiers
        if tiers is not None:
            lower = GaugeMetricFamily("kvd_tenant_tier_bytes", "Bytes a tenant's blocks take in each lower tier "
                                      "(Redis: what this daemon wrote)", labels=["tenant", "tier"])
            for tier, held in tiers.tenant_bytes().items():
                for label, value in labels.fold((tenant or "-", n) for tenant, n in held.items()):
                    lower.add_metric([label, tier], value)
            yield lower
        if shares is not None:
            idle = GaugeMetricFamily("kvd_tenant_idle_blocks", "Cached blocks nobody uses, per tenant (the ones "
                                     "eviction may take), beside each tenant's share", labels=["tenant"])
            share = GaugeMetricFamily("kvd_tenant_share_blocks", "A tenant's share of the device cache in blocks: "
                                      "beyond it, its idle blocks are evicted first", labels=["tenant"])
            for label, value in labels.fold((tenant, row["idle_blocks"]) for tenant, row in shares.items()):
                idle.add_metric([label], value)
            for label, value in labels.fold((tenant, row["share_blocks"]) for tenant, row in shares.items()
                                            if row["share_blocks"] is not None):
                share.add_metric([label], value)
            yield idle
            yield share
        yield from _event_metrics(engine.events)
        rejected = CounterMetricFamily("kvd_admission_rejections", "Requests rejected at admission",
                                       labels=["reason"])
        for reason in ("never_fits", "pinned_out", "queue_full", "tenant_limit", "queue_timeout"):
            rejected.add_metric([reason], rejections.get(reason, 0))
        yield rejected
        yield CounterMetricFamily("kvd_preemptions", "Sequences preempted for recomputation",
                                  value=preemptions)
        yield CounterMetricFamily("kvd_engine_step_failures", "Engine steps that raised: each stopped every request "
                                  "in flight (each answered 500 engine_error)",
                                  value=self.service.step_failures.total)
        yield CounterMetricFamily("kvd_finished_blocks", "Blocks requests held at their finish (not cancelled), "
                                  "reserved ones included", value=finished_blocks)
        yield CounterMetricFamily("kvd_reserved_unused_blocks", "Blocks reserved for output that requests never "
                                  "wrote, at their finish (not cancelled)", value=unused_blocks)
        yield CounterMetricFamily("kvd_admitted_ahead", "Requests admitted while one that arrived earlier still "
                                  "waited (queue_order lpm or priority, a prefix fetch, a LoRA adapter's turn)",
                                  value=admitted_ahead)
        marks = CounterMetricFamily("kvd_prompt_cache_breakpoints", "Requests' prompt_cache_breakpoint marks as they "
                                    "finished, by what became of each", labels=["outcome"])
        for outcome in ("held", "extended", "pinned", "short", "over_budget", "no_room"):
            marks.add_metric([outcome], breakpoints.get(outcome, 0))
        yield marks
        explicit = CounterMetricFamily("kvd_prompt_cache_explicit_requests", "Requests served in OpenAI's explicit "
                                       "prompt cache mode (cached only up to the prefixes they mark), by why: asked "
                                       "(prompt_cache_options.mode) or tenant (prompt_cache_explicit_tenants)",
                                       labels=["why"])
        for why, count in self.service.explicit_requests.items():
            explicit.add_metric([why], count)
        yield explicit
        yield from _speculation_metrics(speculation)
        yield from _prediction_metrics(predicted)
        yield GaugeMetricFamily("kvd_queue_age_seconds", "Age of the oldest waiting request",
                                value=max(ages, default=0.0))
        if self.service.tls is not None:
            yield GaugeMetricFamily("kvd_tls_certificate_expiry_timestamp_seconds", "When the certificate the TCP "
                                    "front serves expires (Unix time): alert well before it",
                                    value=self.service.tls.certificate.not_after)
        yield GaugeMetricFamily("kvd_cache_uncalibrated", "1 while a quantised cache runs on unit scales",
                                value=1.0 if engine.scale_version == "unit" else 0.0)
        yield CounterMetricFamily("kvd_audit_write_failures", "Audit records the SQLite store could not take "
                                  "(the log holds each whole): alert on any", value=self.service.store.audit_failures)
        yield GaugeMetricFamily("kvd_store_file_ok", "1 while the SQLite store's file is the one kvd opened; 0 once "
                                "another was put in its place (or it was deleted and cannot be written back): "
                                "writes are refused until a restart", value=1.0 if self.service.store.file_ok else 0.0)
        yield CounterMetricFamily("kvd_store_written_back", "Times the SQLite store's file was deleted under kvd "
                                  "and written back whole", value=self.service.store.written_back)
        store = self.service.store
        waiting, longest = store.waiting_writes()
        yield GaugeMetricFamily("kvd_store_waiting_writes", "Writes to the SQLite store waiting to begin now (another "
                                "process may hold its write lock: they wait up to 30 s, then fail)", value=waiting)
        yield GaugeMetricFamily("kvd_store_longest_write_wait_seconds", "How long the longest of those has waited",
                                value=longest)
        yield CounterMetricFamily("kvd_store_writes", "Writes to the SQLite store, begun or refused", value=store.writes)
        yield CounterMetricFamily("kvd_store_write_wait_seconds", "Time writes to the SQLite store waited to begin, "
                                  "summed (its rate over kvd_store_writes_total's: the mean wait)",
                                  value=store.write_wait_seconds)
        failures = CounterMetricFamily("kvd_housekeeping_failures", "Failed runs of kvd's periodic jobs (pin "
                                       "expiry, store file check, rollout stop conditions, state folder claim), each "
                                       "tried again at its next turn: the log says why", labels=["task"])
        for job, count in self.service.housekeeping.failures.items():
            failures.add_metric([job], count)
        yield failures
        timer = self.service.start_timer
        if timer is not None:
            start = GaugeMetricFamily("kvd_start_seconds", "How long kvd's latest start took: ready (from the "
                                      "process's start), and the load's phases (model, cache, tiers: the disk "
                                      "tier's scan, pins); pins_warmed once pinned prefixes are back from the "
                                      "lower tiers", labels=["phase"])
            for phase, took in [("ready", timer.ready_after), *timer.phases.items(), ("pins_warmed", timer.pins_warmed)]:
                if took is not None:
                    start.add_metric([phase], took)
            yield start
        yield from gc_metric_families(self.service.gc_pauses)
        yield CounterMetricFamily("kvd_restored_tokens", "Prompt tokens restored from a lower tier",
                                  value=engine.stats.restored_tokens)
        tiers = self.service.tiers
        if tiers is not None:
            yield from _tier_metrics(tiers.report())
            outcomes = CounterMetricFamily("kvd_prefetch_requests", "Requests whose prefix was fetched from disk or "
                                           "Redis while they waited, by how the wait ended", labels=["outcome"])
            for outcome in PREFETCH_OUTCOMES:
                outcomes.add_metric([outcome], prefetched.get(outcome, 0))
            yield outcomes
        pinned = GaugeMetricFamily("kvd_pinned_blocks", "Distinct pinned blocks per tenant", labels=["tenant"])
        for label, value in labels.fold(pins.items()):
            pinned.add_metric([label], value)
        yield pinned
        stranded = GaugeMetricFamily("kvd_stranded_pins", "Pins no request can reach any more: made under LoRA "
                                     "weights (adapter) or a block space (space) kvd no longer serves",
                                     labels=["reason"])
        for reason in ("adapter", "space"):
            stranded.add_metric([reason], reasons[reason])
        yield stranded
        rollout = self.service.rollouts.counts()
        if rollout is not None:
            yield from _rollout_metrics(rollout)
        yield from _reload_metrics(self.service.reloads, self.service.last_reload)

    def _without_the_lock(self, stalled: bool):
        """The families a scrape has whether or not it had the engine's lock: what kvd runs and
        serves, whether the engine is stalled, the scrapes without its figures, the completions
        refused before it took them in."""
        build = GaugeMetricFamily("kvd_build_info", "1, labelled with kvd's version and its libraries' (replicas "
                                  "that differ may answer one request differently)", labels=list(BUILD_LABELS))
        software = software_versions()
        build.add_metric([software["kvd" if key == "version" else key] or "" for key in BUILD_LABELS], 1.0)
        yield build
        engine, loaded = self.service.engine, self.service.loaded
        if engine is not None and loaded is not None:
            model = GaugeMetricFamily("kvd_model_info", "1, labelled with the model kvd serves: its checkpoint "
                                      "revision, dtype and cache format", labels=["model", "revision", "dtype",
                                                                                  "cache_dtype"])
            model.add_metric([self.service.model_name, loaded.revision, str(engine.model.dtype).removeprefix("torch."),
                              cache_format(engine)], 1.0)
            yield model
        yield GaugeMetricFamily("kvd_engine_stalled", "1 while the engine has not come round its loop in "
                                f"{self.service.engine_loop.after:g} s (a step that does not end): /healthz "
                                "answers 503 engine_stalled, and scrapes have none of the engine's figures",
                                value=1.0 if stalled else 0.0)
        with self._missed_lock:
            missed = self.missed
        yield CounterMetricFamily("kvd_metrics_engine_figures_missed", "Scrapes answered without the engine's "
                                  "figures: its lock, which a step holds, was not had in "
                                  f"{engine_liveness.SCRAPE_LOCK_WAIT_S:g} s (a step that long, or a stalled "
                                  "engine)", value=missed)
        refused = CounterMetricFamily("kvd_requests_refused", "Completions refused (503) before the engine took them "
                                      "in: draining (kvctl drain), asleep (kvctl sleep), engine_stalled",
                                      labels=["reason"])
        for reason, count in self.service.refused_counts().items():
            refused.add_metric([reason], count)
        yield refused


def _event_metrics(log):
    stored = CounterMetricFamily("kvd_cache_stored_blocks", "Blocks indexed per tier", labels=["tier"])
    removed = CounterMetricFamily("kvd_cache_removed_blocks", "Blocks dropped per tier, by why",
                                  labels=["tier", "reason"])
    for (kind, tier, reason), blocks in sorted(log.counts().items()):
        if kind == "stored":
            stored.add_metric([tier], blocks)
        else:
            removed.add_metric([tier, reason], blocks)
    yield stored
    yield removed
    yield CounterMetricFamily("kvd_cache_events_dropped", "Events trimmed from the cache's event log before "
                              "every reader may have read them", value=log.dropped_events)


def _reload_metrics(reloads: dict, last: dict | None):
    counted = CounterMetricFamily("kvd_config_reloads", "Config reloads (SIGHUP or kvctl config reload) by result",
                                  labels=["result"])
    for result in ("ok", "refused"):
        counted.add_metric([result], reloads[result])
    yield counted
    yield GaugeMetricFamily("kvd_config_last_reload_successful", "0 while the latest reload was refused (kvd "
                            "runs on its earlier settings), else 1",
                            value=0.0 if last is not None and last["result"] == "refused" else 1.0)


ROLLOUT_COUNTS = {"requests": "Finished requests", "prompt_tokens": "Prompt tokens",
                  "hit_tokens": "Prompt tokens served from the prefix cache",
                  "recomputed_tokens": "Tokens computed again after preemption", "preemptions": "Preemptions",
                  "finished_blocks": "Blocks finished requests held at their finish",
                  "reserved_unused_blocks": "Blocks finished requests reserved for output and never wrote"}


def _rollout_metrics(rollout: dict):
    rollout_id = str(rollout["id"])
    info = GaugeMetricFamily("kvd_rollout_info", "1 for the running or paused rollout",
                             labels=["rollout", "state", "policy", "version"])
    info.add_metric([rollout_id, rollout["state"], rollout["policy"], rollout["version"]], 1.0)
    yield info
    fraction = GaugeMetricFamily("kvd_rollout_fraction", "Share of traffic asked for the rollout's cohort",
                                 labels=["rollout"])
    fraction.add_metric([rollout_id], rollout["fraction"])
    yield fraction
    for name, help_text in ROLLOUT_COUNTS.items():
        family = CounterMetricFamily(f"kvd_rollout_{name}", f"{help_text} per side of the rollout",
                                     labels=["rollout", "side"])
        for side, counts in rollout["sides"].items():
            family.add_metric([rollout_id, side], counts[name])
        yield family
    ttft = HistogramMetricFamily("kvd_rollout_ttft_seconds", "Time to first token per side of the rollout",
                                 labels=["rollout", "side"])
    for side, counts in rollout["sides"].items():
        cumulative, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), counts["ttft_buckets"]):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))  # as kvd_ttft_seconds writes its bounds
        ttft.add_metric([rollout_id, side], buckets, counts["ttft_sum"])
    yield ttft


def _tier_metrics(report: dict):
    used = GaugeMetricFamily("kvd_tier_bytes", "Bytes held per lower tier", labels=["tier"])
    capacity = GaugeMetricFamily("kvd_tier_capacity_bytes", "Capacity per lower tier", labels=["tier"])
    failures = CounterMetricFamily("kvd_tier_checksum_failures", "Payloads that failed verification",
                                   labels=["tier"])
    errors = CounterMetricFamily("kvd_tier_errors", "Tier I/O errors and timeouts", labels=["tier"])
    degraded = GaugeMetricFamily("kvd_tier_degraded", "1 while a tier is degraded or unreachable", labels=["tier"])
    block = GaugeMetricFamily("kvd_tier_block_bytes", "Bytes a block takes in each lower tier as written now",
                              labels=["tier"])
    for name, tier in report["tiers"].items():
        used.add_metric([name], tier["used_bytes"])
        block.add_metric([name], tier["block_bytes"])
        if tier["capacity_bytes"] is not None:  # a remote tier without a budget has no capacity to chart
            capacity.add_metric([name], tier["capacity_bytes"])
        failures.add_metric([name], tier["checksum_failures"])
        errors.add_metric([name], tier["errors"])
        degraded.add_metric([name], 0.0 if tier["health"] == "ok" else 1.0)
    moved = CounterMetricFamily("kvd_tier_moved_bytes", "Bytes moved between tiers", labels=["src", "dst"])
    for pair, value in report["moved_bytes"].items():
        src, dst = pair.split("->")
        moved.add_metric([src, dst], value)
    retained = CounterMetricFamily("kvd_tier_retained_blocks", "Blocks written to the persistent tiers for "
                                   "requests asking prompt_cache_retention 24h", value=report.get("retained_blocks", 0))
    yield from (used, capacity, block, failures, errors, degraded, moved, retained)


class Metrics:
    """The registry, plus the histograms fed as requests finish and steps allocate."""

    def __init__(self, service: EngineService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(service))
        self.registry.register(CutConnections("kvd_http_cut_connections"))
        self.ttft = Histogram("kvd_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("kvd_inter_token_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.alloc = Histogram("kvd_allocation_seconds", "Time per cache-core call",
                               buckets=(1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 0.1),
                               registry=self.registry)
        self.finished = Counter("kvd_finished", "Samples (choices) finished, by API and finish reason",
                                ["api", "finish_reason"], registry=self.registry)
        self.generated = Counter("kvd_generation_tokens", "Output tokens of finished requests",
                                 registry=self.registry)
        self._generated = 0
        self._by_reason: dict[str, int] = {}  # finished samples by finish reason (every API)
        self.prefetch_wait = Histogram("kvd_prefetch_wait_seconds", "How long a request was held for its prefix's "
                                       "fetch (disk, Redis): until the fetch ended or the prefetch policy stopped "
                                       "waiting", buckets=LATENCY_BUCKETS,
                                       registry=self.registry)
        self.restore = Histogram("kvd_tier_restore_seconds", "Time to put a prefix back on the device",
                                 buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5),
                                 registry=self.registry)
        # the latest TTFTs and inter-token gaps, for the percentiles of /admin/status (bounded;
        # appended on the engine thread as requests finish, so O(new values), never a copy)
        self._recent_ttft: deque[float] = deque(maxlen=2000)
        self._recent_itl: deque[float] = deque(maxlen=20000)
        # per tenant, its latest TTFTs (bounded as above), for the max_tracked_tenants most recent tenants
        self._tenant_ttft: OrderedDict[str, deque[float]] = OrderedDict()
        self.tenant_ttft = Histogram("kvd_tenant_ttft_seconds", "Time to first token, per tenant", ["tenant"],
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()
        self.service = service
        service.on_finished(self.observe_request)
        service.latency_summary = self.summary
        service.tenant_latency = self.tenant_summary
        aliases = getattr(service.config, "metrics_aliases", ())
        if aliases:  # the same figures under vLLM's / SGLang's names as well
            from .metric_aliases import AliasCollector

            self.registry.register(AliasCollector(service, self, tuple(aliases)))

    def generated_tokens(self) -> int:
        with self._lock:
            return self._generated

    def finished_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_reason)

    def observe_request(self, request) -> None:
        metrics = request.metrics
        api = request.params.extra.get("api", "internal")
        outputs = 0
        for seq in request.sequences:
            reason = seq.finish_reason or "unknown"
            self.finished.labels(api, reason).inc()
            outputs += len(seq.output_ids)
        self.generated.inc(outputs)
        with self._lock:
            self._generated += outputs
            for seq in request.sequences:
                reason = seq.finish_reason or "unknown"
                self._by_reason[reason] = self._by_reason.get(reason, 0) + 1
            if metrics.ttft is not None:
                exemplar = exemplar_of(request)  # its span's ids, where kvd sends spans (request_spans.py)
                self.ttft.observe(metrics.ttft, exemplar)
                self._recent_ttft.append(metrics.ttft)
                if api != "internal":  # a pin's warm-up is no client's wait
                    self.tenant_ttft.labels(self.service.tenant_labels(request.tenant)).observe(metrics.ttft,
                                                                                                 exemplar)
                    self._recent_ttft_of(request.tenant).append(metrics.ttft)
            gaps = metrics.inter_token_latencies
            for gap in gaps:
                self.itl.observe(gap)
            self._recent_itl.extend(gaps)
        engine = self.service.engine
        with self.service.lock:
            samples = list(engine.stats.alloc_seconds)
            engine.stats.alloc_seconds.clear()
            waits = list(engine.stats.prefetch_waits)
            engine.stats.prefetch_waits.clear()
        for value in samples:
            self.alloc.observe(value)
        for value in waits:
            self.prefetch_wait.observe(value)
        tiers = self.service.tiers
        if tiers is not None:
            with tiers.lock:
                restores, tiers.stats["host"].restore_seconds = tiers.stats["host"].restore_seconds, []
            for value in restores:
                self.restore.observe(value)

    def _recent_ttft_of(self, tenant: str) -> deque[float]:
        """`tenant`'s latest TTFTs, now the most recent tenant's; windows beyond max_tracked_tenants
        go, the least recent first (called with self._lock held)."""
        windows = self._tenant_ttft
        recent = windows.get(tenant)
        if recent is not None:
            windows.move_to_end(tenant)
            return recent
        recent = windows[tenant] = deque(maxlen=2000)
        while len(windows) > max(1, self.service.config.max_tracked_tenants):
            windows.popitem(last=False)
        return recent

    def tenant_summary(self, only: str | None = None) -> dict:
        """Per tenant (`only`: that one's alone): p50 and p95 of its latest TTFTs (up to 2,000), and how many."""
        with self._lock:
            windows = self._tenant_ttft if only is None else {
                tenant: self._tenant_ttft[tenant] for tenant in (only,) if tenant in self._tenant_ttft}
            recent = {tenant: list(values) for tenant, values in windows.items()}
        return {tenant: {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "count": len(values)}
                for tenant, values in recent.items()}

    def summary(self) -> dict:
        def percentiles(values) -> dict:
            values = list(values)
            return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95),
                    "p99": percentile(values, 0.99), "count": len(values)}

        with self._lock:
            return {"ttft_seconds": percentiles(self._recent_ttft),
                    "inter_token_seconds": percentiles(self._recent_itl)}

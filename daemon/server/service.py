"""EngineService: the engine on its own thread, its life cycle (load, reload, drain, stop), the
requests handed to it, and the views of it (status).

The serving loop owns the engine; HTTP handlers call in under one lock (short critical
sections) and receive token events through a per-request callback that the loop invokes
outside the lock. The loop also pings the systemd watchdog.

An operator's actions on the cache are modules of their own, each a set of functions that take
the service: pin_ops (pins), evict_ops (evictions), tier_ops (the lower tiers), prefix_ops (the
prefix tree and its ids), cache_questions (route facts, "why did this miss?") and calibrate_ops.
So are reload_ops (settings read again), rollout_ops (a rollout's settings made everyone's) and
status_body (what `kvctl status` shows).
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kvctl.daemon import gpu_nvml
from kvctl.daemon.config import KvdConfig, speculation_of
from kvctl.daemon.engine.engine import AdmissionRejected, Engine, EngineSettings, TokenEvent
from kvctl.daemon.engine.requests import Request
from kvctl.daemon.engine.sampling import RequestError, SamplingParams
from kvctl.daemon.model.chat_template import ChatTemplate, TemplateKwargsError, load_chat_template
from kvctl.daemon.model.demo import ensure_demo_checkpoint
from kvctl.daemon.model.hub_cache import resolve_model
from kvctl.daemon.model.llama import LoadedModel, load_model
from kvctl.daemon.model.lora import load_adapters, warn_if_kv_changes
from kvctl.daemon.store import ROLLBACK_PENDING_FILE, Store
from kvctl.kernels import cache_dtype, format_unsupported_on
from kvctl.policies.queue_order import by_priority

from . import device_loss, lora_ops, pin_ops, reasoning, reload_ops, response_admin, tier_ops, tool_calls, weights_ops
from .breakpoint_holds_file import restore_holds, save_holds
from .cache_breakpoints import EXPLICIT_BECAUSE
from .admin_slots import WriteSlots
from .batch_files import FileBudgets, FileStore
from .batch_via import via_router
from .webhooks import Webhooks, read_endpoints
from .batches import BatchRunner
from .calls import Principal, ServiceError
from .chat_messages import MessagesError
from .durations import format_duration, unix_time
from .engine_liveness import (NOT_STARTED, NOTHING_CHANGED, QUESTION_WAITS, STALLED_EXIT, EngineLoop,
                              held_unless_stalled, refuse_if_stalled, stack_of, stalled_refusal, take_unless_stalled)
from .engine_profile import EngineProfiler
from .gc_pauses import GcPauses
from .gpu_cache_size import gpu_cache_blocks
from .housekeeping import Housekeeping, Job
from .kv_transfer import TransferBook
from .notify import Notifier
from .reload_ops import prefetch_settings, quick_prefill_tokens
from .reply_ids import ReplyIds
from .reply_ids_file import load_reply_ids, save_reply_ids
from .reply_splice import spliced_prompt
from .otlp_export import span_processor
from .request_log import RequestLog
from .request_spans import install as install_spans
from .request_trace import RequestTrace, load_trace_key
from .step_failures import ENGINE_ERROR, STEP_FAILED, StepFailures
from .conversation_file import ConversationFile
from .conversation_store import ConversationStore
from .response_file import ResponseFile
from .response_store import ResponseStore
from .rollouts import RolloutManager
from .start_timing import StartTimer
from .status_body import status_body
from .tenant_labels import TenantLabels

log = logging.getLogger("kvd")

STORE_CHECK_SECONDS = 2.0  # how often housekeeping makes sure the store's file is still there
RESPONSES_AGE_CHECK_SECONDS = 60.0  # how often housekeeping lets go of responses past responses_max_age
FILES_EXPIRY_CHECK_SECONDS = 60.0  # how often housekeeping removes /v1/files past their expires_at
# why a completion is refused before the engine takes it in (kvd_requests_refused_total): an
# operator's drain, kvd asleep, its engine stalled (engine_liveness.py)
REFUSAL_REASONS = ("draining", "asleep", "engine_stalled")
STACK_FRAMES_LOGGED, STACK_FRAMES_KEPT = 16, 4  # a stuck engine thread's innermost frames: logged, audited
STEP_SEQUENCES_SHOWN = 8  # of a stuck step's sequences, those named
ENGINE_LOOP_CHECK_SECONDS = 5.0  # how often housekeeping looks whether the engine stalled, to log it (once)
PIN_EXPIRY_SECONDS = 1.0  # how often housekeeping ends the pins whose TTL is over

EventSink = Callable[[TokenEvent], None]


class LoopSink:
    """Delivers a request's token events into an asyncio queue on the loop that serves it."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop, queue) -> None:
        self.loop, self.queue = loop, queue

    def __call__(self, event: TokenEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    @staticmethod
    def deliver(batch: list) -> None:
        """Runs on the loop: one wake-up hands over every (sink, event) of a step."""
        for sink, event in batch:
            sink.queue.put_nowait(event)


def _refused(error: Exception) -> Future:
    """A submission's future that says `error` (refused before it reached the engine thread)."""
    future: Future = Future()
    future.set_exception(error)
    return future


@dataclass
class _Submission:
    """Prompts handed to the engine thread by `EngineService.submit_nowait`."""

    prompts: list[list[int]]
    params: SamplingParams
    principal: "Principal"
    sink: EventSink
    hashed: list[tuple | None]  # each prompt's block keys, computed by the submitter
    future: Future
    priority: int = 0  # the engine's (higher first): EngineService.queue_priority
    grammars: list | None = None  # each prompt's samples' grammars, compiled by the submitter (prepare_grammars)
    adapter: str = ""  # the LoRA adapter that computes them ("": the base model)


GRAMMARS_COMPILED_AHEAD = 64  # a shaped request's samples whose grammars its submitter compiles (n is at most 64)
# at kvd's stop: the most it waits for the background responses it cancelled to end (on the event loop), so
# that each is written down failed before the responses file closes (one not: failed at the next start)
STOP_RUNS_WAIT_S = 2.0
STOP_STORE_WAIT_S = 5.0  # at kvd's stop: the most the periodic jobs, then the rollout's last figures, wait


class EngineService:
    def __init__(self, config: KvdConfig, store: Store, notifier: Notifier | None = None) -> None:
        self.config, self.store = config, store
        self.notifier = notifier or Notifier.from_environment()
        self.lock = threading.Condition(threading.RLock())
        self.engine: Engine | None = None
        self.loaded: LoadedModel | None = None
        self.chat_template: ChatTemplate | None = None  # renders /v1/chat/completions' messages
        # /v1/responses' previous_response_id (with responses_store_file, kept across restarts as well)
        # and /v1/conversations, which a response's `conversation` continues (in the same file)
        kept_file = ResponseFile(config.responses_store_file) if config.responses_store_file else None
        self.conversations = ConversationStore(config.conversations_store_bytes,
                                               ConversationFile(kept_file) if kept_file is not None else None)
        self.responses = ResponseStore(config.responses_store_bytes, kept_file)  # (starts the file's thread)
        self.reply_ids = ReplyIds(config.reply_ids_bytes)  # chat replies' own ids, for the next turn's prompt
        # /v1/files and /v1/batches: kept in the state folder, served from it again after a restart
        self.files = FileStore(Path(config.state_dir) / "files", budgets=lambda: FileBudgets(
            self.config.files_store_bytes, self.config.tenant_files_bytes), max_age=lambda: self.config.files_max_age)
        # OpenAI's webhooks to each tenant's endpoint when its batch or background response ends
        self.webhook_endpoints = read_endpoints(config.webhooks_file) if config.webhooks_file else {}
        self.webhooks = Webhooks(Path(config.state_dir) / "webhooks", lambda: self.webhook_endpoints)
        # a background response's end, told once the responses file has it (and those not told at the last stop)
        self.responses.tell_untold(self.webhooks.told)
        self.batch_via = via_router(config)  # the router a batch's requests go through (batch_via.py), or None
        self.batches = BatchRunner(Path(config.state_dir) / "batches", self.files,
                                   lambda: self.config.batch_concurrency, via=lambda: self.batch_via,
                                   on_end=lambda batch: self.webhooks.told(batch.tenant, f"batch.{batch.status}",
                                                                            batch.id))
        self._reply_ids_read = False  # read back from the state directory once, at the first load
        self.hub_name: str | None = None  # the model's Hugging Face id, where --model named one (hub_cache.py)
        self.ready = threading.Event()
        self.accepting = True
        self.draining = False  # an operator's drain: no new completion; what runs finishes (kvctl drain)
        # completions refused before the engine took them in, by why (REFUSAL_REASONS; count_refused)
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)
        # requests served in OpenAI's explicit prompt cache mode, by why (cache_breakpoints.EXPLICIT_BECAUSE)
        self.explicit_requests = dict.fromkeys(EXPLICIT_BECAUSE, 0)
        self._refused_lock = threading.Lock()
        self.asleep = None  # sleep_ops.Sleep while the cache's memory (or the weights') is given back
        self.sleep_lock = threading.Lock()  # one sleep or wake at a time
        self.started_at = time.time()
        self.load_error: str | None = None
        self._sinks: dict[str, EventSink] = {}
        self._inbox: deque[_Submission] = deque()  # handed in by submit_nowait, queued by the engine thread
        self._engine_idle = False  # set (under the lock) before the engine thread looks at the inbox to sleep
        self.idle_wait = 0.5  # seconds the idle engine thread sleeps between its watchdog pings
        self.device_check_seconds = device_loss.IDLE_CHECK_SECONDS  # the idle engine asks its device this often
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.engine_threads = 0  # torch intra-op threads of the engine thread, once it runs
        self.cpu_share = None  # CpuShare on a CPU device under `kvd serve`: threads shared with other kvd engines
        self._share_cpus = False  # set by start(confine_threads=True)
        self.pin_warmer: threading.Thread | None = None  # brings pinned prefixes back from lower tiers at start
        self._observers: list[Callable[[Request], None]] = []  # called when a request finishes
        trace_key = load_trace_key(config.trace_key_file) if config.trace_key_file else None  # else kvd's own
        self.trace = RequestTrace(config.trace_requests, trace_key, shared=trace_key is not None,  # `kvctl trace save`
                                  block_tokens=config.trace_block_tokens)
        self.on_finished(self._trace_request)
        self.request_log = RequestLog(self)  # a line per finished request, and the engine's summary (log_*)
        # what hears of a request turned away at admission (AdmissionRejected), with the limit it met
        self._rejection_observers: list[Callable[[Request, str], None]] = [self.request_log.rejected]
        self.request_spans = None  # OpenTelemetry spans of the requests (otlp_traces_endpoint); None: off
        processor = span_processor(config.otlp_traces_endpoint)
        if processor is not None:
            install_spans(self, processor)
        self.latency_summary: Callable[[], dict] = dict  # TTFT/ITL percentiles; the metrics set it
        # per tenant (or one tenant's): TTFT percentiles; the metrics set it
        self.tenant_latency: Callable[[str | None], dict] = lambda only=None: {}
        self.tenant_labels = TenantLabels(config.max_tenant_metric_series)  # per-tenant metrics' labels, bounded
        self.rollouts = RolloutManager(store, pending_path=Path(config.state_dir) / ROLLBACK_PENDING_FILE)
        self.profiler = EngineProfiler(Path(config.state_dir) / "profiles")  # kvctl profile
        self._observers.append(self.rollouts.observe)
        self.rollout_check_seconds = 10.0
        # the jobs that write to the store, off the engine thread (housekeeping.py says why)
        self.engine_loop = EngineLoop()  # whether the engine thread comes round its loop: /healthz (engine_liveness.py)
        self.housekeeping = Housekeeping([
            Job("engine loop", lambda: ENGINE_LOOP_CHECK_SECONDS, self._say_engine_loop),
            Job("pin expiry", lambda: PIN_EXPIRY_SECONDS, partial(pin_ops.expire_pins, self)),
            Job("store file check", lambda: STORE_CHECK_SECONDS, self.store.check_file),  # deleted: written back
            Job("rollout stop conditions", lambda: self.rollout_check_seconds, self.rollouts.evaluate),
            Job("responses past their age", lambda: RESPONSES_AGE_CHECK_SECONDS,
                partial(response_admin.expire, self)),
            Job("engine summary", self.request_log.every, self.request_log.run),
            Job("files past their expiry", lambda: FILES_EXPIRY_CHECK_SECONDS, self._expire_files)])
        self._housekeepers: list[threading.Thread] = []
        self.admin_write_slots = WriteSlots()  # the admin calls that change something, at once, on every front
        # settings a completed rollout made everyone's, not (yet) in the config: {name: {value, rollout}};
        # a reload whose config says otherwise reverts them, and says so
        self.rollout_settings: dict[str, dict] = {}
        self.config_source: Callable[[], KvdConfig] | None = None  # reads the settings again (reload)
        # LoRA adapters admin callers loaded (name -> folder) or unloaded (None) over lora_modules
        # until kvd stops (lora_ops.py); one change of the served adapters at a time
        self.runtime_lora: dict[str, str | None] = {}
        self.adapter_updates = threading.RLock()
        self.tokens = None  # the TCP front's TokenTable, re-read by a reload (token rotation)
        self.tls = None  # the TCP front's TLS (tls.ServingTls), its certificate re-read by a reload (rotation)
        # reloads by result, and the latest one (at, result, error): a refused reload leaves kvd on its
        # old settings, which /metrics and `kvctl status` say (Prometheus' own convention)
        self.reloads = {"ok": 0, "refused": 0}
        self.last_reload: dict | None = None
        self.step_failures = StepFailures()  # engine steps that raised (step_failures.py)
        self.device_lost: str | None = None  # why the device cannot be used again by this process (device_loss.py)
        self.on_device_lost: Callable[[], None] | None = None  # asks the process to exit (kvd serve sets it)
        # ends the process at once, its engine stalled past engine_stall_exit_seconds (kvd serve sets it)
        self.on_stall_exit: Callable[[], None] | None = None
        self.stall_exit: str | None = None  # why kvd is exiting with its engine stalled; None: it is not
        self.pending_scales: dict | None = None  # a calibration to load once running work drains
        self.pending_weights = None  # weights_ops.PendingWeights: new weights to swap in once running work drains
        self.weight_updates = threading.Lock()  # one update of the weights at a time
        self.kv_transfers = TransferBook()  # blocks passed to and taken from other kvds through Redis (kv_transfer.py)
        self.weights_updated: dict | None = None  # the latest update_weights (weights_ops.py): lasts until a restart
        self.tiers = None  # TieredCache when lower tiers are configured (see tier_ops)
        self.start_timer: StartTimer | None = None  # the latest load's phases (start_timing.py)
        self.disk_verify = None  # the latest `kvctl tiers verify` run (tier_verify.py)
        self.verify_lock = threading.Lock()  # one run at a time
        self.tier_scan = None
        # Python's collections timed (gc_pauses.py; `kvd serve` installs the callback), and whether
        # the load freezes the heap it made (start(freeze_heap=True): kvd serve's gc_freeze)
        self.gc_pauses = GcPauses(warn_seconds=lambda: self.config.gc_warn_seconds or None)
        self._freeze_heap = False

    # ---- life cycle --------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model (the demo checkpoint by default), size the cache, restore pins."""
        timer = StartTimer()
        cfg = self.config
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: cuda, but torch {torch.__version__} finds no CUDA device ("
                             + ("a build without CUDA" if torch.version.cuda is None else "none visible to this process")
                             + "); use device auto or cpu")
        problem = None if cfg.cache_dtype == "auto" else format_unsupported_on(device, cache_dtype(cfg.cache_dtype))
        if problem:  # refused before the model loads
            raise ValueError(f"cache_dtype: {problem}")
        if self._freeze_heap:  # the imports (torch's: 200,000 objects) are there for good
            self.gc_pauses.freeze()
        if cfg.model:  # a folder, or a Hugging Face id found in the local cache
            model_dir, self.hub_name = resolve_model(cfg.model)
        else:
            model_dir, self.hub_name = ensure_demo_checkpoint(cfg.state_dir), None
        loaded = load_model(model_dir, device=device, dtype=None if cfg.dtype == "auto" else cfg.dtype,
                            generation_config=cfg.generation_config,
                            dequantise_experts=cfg.mxfp4_experts == "dequantise" or (cfg.mxfp4_experts == "auto"
                                                                                     and device != "cuda"))
        loaded.tokenizer.keep_in_text((*tool_calls.MARKERS.get(cfg.tool_call_parser, ()),
                                       *reasoning.MARKERS.get(cfg.reasoning_parser, ())))
        loaded.adapters = load_adapters(lora_ops.served_modules(self, cfg.lora_modules), loaded,
                                        cfg.model_name or self.hub_name or Path(model_dir).name)
        warn_if_kv_changes(loaded.adapters, cfg.cache_dtype)
        chat_template = load_chat_template(model_dir, loaded.tokenizer.config, cfg.chat_template,
                                           json.loads(cfg.chat_template_kwargs or "{}"))
        timer.mark("model")
        scales, scale_version, keep = None, "", ()
        self.calibration: dict | None = None
        if cfg.cache_dtype != "auto":
            self.calibration = self.store.calibration(loaded.revision, cfg.cache_dtype, applied=True)
            if self.calibration is None and not cfg.allow_uncalibrated:
                raise ValueError(
                    f"cache_dtype: {cfg.cache_dtype} has no applied calibration for model revision "
                    f"{loaded.revision[:12]}; start with cache_dtype auto and run `kvctl calibrate --dtype "
                    f"{cfg.cache_dtype} --apply`, or set allow_uncalibrated: true to serve with unit scales")
            if self.calibration is not None:
                scales, scale_version = self.calibration["scales"], f"cal-{self.calibration['id']}"
                keep = self.calibration["keep_layers"]
            else:
                scale_version = "unit"
                log.warning("SERVING AN UNCALIBRATED %s CACHE WITH UNIT SCALES (allow_uncalibrated)", cfg.cache_dtype)
            if cfg.keep_layers_unquantised is not None:
                keep = tuple(int(x) for x in cfg.keep_layers_unquantised.split(",") if x)
            bad = [i for i in keep if not 0 <= i < loaded.config.num_layers]
            if bad:
                raise ValueError(f"keep_layers_unquantised: layer {bad[0]} does not exist "
                                 f"(the model has {loaded.config.num_layers})")
        storage = None if cfg.cache_dtype == "auto" else cache_dtype(cfg.cache_dtype)
        per_block = loaded.model.cache_bytes_per_block(cfg.block_size, storage, keep)
        if cfg.num_blocks:
            num_blocks = cfg.num_blocks
        elif cfg.cache_memory:
            num_blocks = cfg.cache_memory // per_block
        elif device == "cuda":
            free, total = torch.cuda.mem_get_info()
            num_blocks, crowded = gpu_cache_blocks(free, total, torch.cuda.memory_reserved(), per_block)
            if crowded:
                log.warning("%s", crowded)
        else:
            num_blocks = (256 * 2**20) // per_block
        if num_blocks < 1:
            raise ValueError(f"cache_memory: {cfg.cache_memory} bytes holds no block of {per_block} bytes")
        settings = EngineSettings(num_blocks=num_blocks, block_size=cfg.block_size,
                                  max_batch_tokens=cfg.max_batch_tokens, max_running=cfg.max_running,
                                  max_loras=cfg.max_loras,
                                  max_queue=cfg.max_queue, max_queue_wait=cfg.max_queue_wait,
                                  tenant_queue_waits=cfg.tenant_queue_waits,
                                  max_tenant_requests=cfg.max_tenant_requests,
                                  tenant_request_limits=cfg.tenant_request_limits,
                                  reservation=cfg.reservation,
                                  eviction=cfg.eviction, queue_order=cfg.queue_order,
                                  cache_dtype=cfg.cache_dtype, keep_layers=tuple(keep),
                                  quick_prefill_tokens=quick_prefill_tokens(cfg, device),
                                  tenant_cache_shares=cfg.tenant_cache_shares,
                                  max_tracked_tenants=cfg.max_tracked_tenants, max_model_len=cfg.max_model_len,
                                  hit_curve=cfg.hit_curve, hit_curve_tenants=cfg.hit_curve_tenants,
                                  speculation=speculation_of(cfg.speculative_config),
                                  prediction_max_batch=cfg.prediction_max_batch, **prefetch_settings(cfg))
        engine = Engine(loaded, settings, scales=scales, scale_version=scale_version)
        timer.mark("cache")
        engine.stats.tenants.keep = self.tenant_labels.has_own  # a tenant's own metric series never shrinks
        if engine.cache.hit_curve is not None:  # the curve's book lists the same tenants
            engine.cache.hit_curve.tenants.keep = self.tenant_labels.has_own
        pin_ops.set_pin_limits(engine, cfg)
        tier_ops.attach(self, engine)
        timer.mark("tiers")
        with self.lock:
            self.loaded, self.engine, self.chat_template = loaded, engine, chat_template
            lapsed = pin_ops.restore_pins(self)
            held = restore_holds(engine.cache, engine.clock(), cfg.state_dir,  # (after the operator's pins)
                                 pin_ops.served_origin(self))
            pin_ops.warn_no_room(engine)
            pin_ops.warn_stranded(pin_ops.stranded_pins(self), "pins restored from the store")
        timer.mark("pins")
        if any(held.values()):
            log.info("requests' prompt cache breakpoint holds from before the restart: %d held again, %d lapsed "
                     "meanwhile, %d made where no request reaches them now (another model revision, cache format, "
                     "block size or LoRA weights), %d not (past the pin budget or room)", held["held"],
                     held["lapsed"], held["stranded"], held["refused"])
        if not self._reply_ids_read and self._cache_outlives_kvd():
            self._reply_ids_read = True
            restored = load_reply_ids(self.reply_ids, cfg.state_dir, loaded.tokenizer.digest)
            if restored:
                log.info("read back the ids of %d chat replies kept before the restart", restored)
        if lapsed:  # off the start: a store another process holds locked must not hold it up
            threading.Thread(target=lambda: [pin_ops.forget_stored_pin(self, pin_id) for pin_id in lapsed],
                             name="kvd-lapsed-pins", daemon=True).start()
        self.start_timer = timer
        if self.tiers is not None and engine.cache.pins.all():  # pinned prefixes a lower tier kept
            warmer = threading.Thread(target=self._warm_pins, args=(timer,), name="kvd-warm-pins", daemon=True)
            warmer.start()
            self.pin_warmer = warmer
        if device == "cpu" and self._share_cpus and Path("/proc/self/status").is_file():  # Linux: see cpu_share.py
            self._share_cpus_with_neighbours()
        if self._freeze_heap:  # the model, the cache and a disk tier's index: they live as long as kvd
            self.gc_pauses.frozen_at_ready = self.gc_pauses.freeze()
        timer.ready()
        self.ready.set()
        log.info("model loaded: %s (%s), %d blocks of %d tokens, %s; ready %.1f s after kvd started (%s)",
                 loaded.config.architecture, loaded.revision[:12], num_blocks, cfg.block_size,
                 gpu_nvml.NVML.describe(loaded.model.device.index or 0) if device == "cuda" else device,
                 timer.ready_after, ", ".join(f"{phase} {took:.2f} s" for phase, took in timer.phases.items()))
        if loaded.generation.sampling:  # as vLLM says it: the operator may not expect it
            log.info("sampling defaults from %s for requests that leave them out: %s (generation_config: none "
                     "keeps kvd's own)", loaded.generation.source,
                     ", ".join(f"{name} {value}" for name, value in loaded.generation.sampling.items()))
        model = loaded.config
        if model.every_layer_slides:
            log.info("model: every one of its %d layers attends to a sliding window of %d tokens: a sequence holds "
                     "the blocks of its window, not of its whole context", model.num_layers, model.sliding_window)
        elif model.sliding_window is not None:
            log.info("model: %d of its %d layers attend to a sliding window of %d tokens, the others to the whole "
                     "context, which a sequence keeps every block of", len(model.sliding_layers), model.num_layers,
                     model.sliding_window)

    def _warm_pins(self, timer: StartTimer) -> None:
        began = time.perf_counter()
        tier_ops.warm_pins(self)
        timer.pins_warmed = time.perf_counter() - began

    def _share_cpus_with_neighbours(self, neighbours=None) -> None:
        """Start looking at the other kvd engines on this host's CPUs (cpu_share.py): the engine
        thread runs the threads `CpuShare` wants from its next pass on."""
        import os

        from .cpu_share import CpuShare

        self.cpu_share = CpuShare(self.engine_threads, neighbours,
                                  operator_threads=bool(os.environ.get("OMP_NUM_THREADS")))
        self.cpu_share.look()  # a first look: notes who is there; busy ones show from the next look
        threading.Thread(target=self.cpu_share.run, args=(self._stop,), name="kvd-cpu-share", daemon=True).start()

    def start(self, confine_threads: bool = False, freeze_heap: bool = False) -> None:
        """Start the engine thread.

        `confine_threads` (what `kvd serve` asks for): only the engine thread runs torch's CPU ops
        on several threads; every other thread, the ones started later included (request and
        tier workers), runs them on itself alone. torch's OpenMP runtime (libgomp) spins only
        ~1,000 times before sleeping once it manages more threads than there are CPUs. A second
        OpenMP team anywhere in the process, such as one tier copy in a request thread, made
        every parallel region of the engine pay a wake-up from then on: on 2 cores, decode steps
        went from 3.3 ms to 6.7-8.4 ms after a single `kvctl swap`.

        `freeze_heap` (kvd serve's `gc_freeze`): the load freezes the heap that the imports made,
        then the one the load made (gc_pauses.py), so that Python's collector does not walk them
        while kvd serves. Only for a process that loads once and lives on: a test that builds
        services one after another would keep each one's reference cycles for good."""
        threads = torch.get_num_threads() if confine_threads else 0
        self._share_cpus = confine_threads
        self._freeze_heap = freeze_heap
        self._engine_thread_count = threads  # for an engine thread started again (load_again)
        entered = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(threads, entered), name="kvd-engine", daemon=True)
        self._thread.start()
        if threads > 1:
            entered.wait()
            torch.set_num_threads(1)  # this thread's count, and the default of every thread started later
        self._housekeepers = self.housekeeping.start(self._stop)  # (after: they run torch on one thread too)

    def _loop(self, threads: int = 0, entered: threading.Event | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)  # the engine's own count (and MKL's, for its GEMMs)
        self.engine_threads = torch.get_num_threads()
        if entered is not None:
            entered.set()
        try:
            self.load()
        except Exception as exc:  # reported on /readyz, in the log and to systemd; a reload loads again
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("cannot serve (model, cache or tiers): %s; fix the config and reload (kvctl config reload, "
                      "SIGHUP) to load again", self.load_error)
            self.notifier.send(f"STATUS=cannot serve: {self.load_error}"[:1024], timeout=0)
            return
        self.notifier.ready()
        device = self.engine.model.device.type
        device_asked_at = time.monotonic()
        while not self._stop.is_set():
            self.notifier.watchdog()
            self.engine_loop.turned()
            self.profiler.turn(device)  # `kvctl profile`: started and stopped here, between steps
            if self.cpu_share is not None and self.cpu_share.wanted != self.engine_threads:
                torch.set_num_threads(self.cpu_share.wanted)  # this thread's count: only it can set it
                self.engine_threads = self.cpu_share.wanted
            with self.lock:
                answered = self._queue_submissions()
                if self.pending_scales is not None and not self.engine.num_running:
                    self._load_scales(self.pending_scales)
                if self.pending_weights is not None and not self.engine.num_running:
                    weights_ops.apply(self, self.pending_weights)
                busy = self.engine.has_work()
                if not busy and not answered:
                    if time.monotonic() - device_asked_at >= self.device_check_seconds:
                        device_asked_at = time.monotonic()
                        if lost := device_loss.idle_check(self.engine.model.device):
                            self._lose_device(lost)
                            continue
                    self._engine_idle = True  # before the inbox is read: see _wake_engine
                    if not self._inbox:
                        self.lock.wait(timeout=self.idle_wait)
                    self._engine_idle = False
                    continue
                events = []
                if busy:  # (all of what was handed in may have been refused)
                    try:
                        with self.profiler.step_context():
                            events = self.engine.step()
                        self.step_failures.stepped()
                    except Exception as exc:  # a failed step must not strand clients or leak blocks
                        stopped = [rid for rid, r in self.engine.requests.items() if not r.finished]
                        log.exception("engine step failed; %d in flight stopped, each answered 500 engine_error",
                                      len(stopped))
                        self.step_failures.failed(exc, len(stopped))
                        events = [e for rid in stopped for e in self.engine.fail(rid, ENGINE_ERROR, STEP_FAILED)]
                        if lost := device_loss.lost_device(exc, self.engine.model.device):
                            self._lose_device(lost)
            self._dispatch(events)
        self.engine_loop.stopped()
        self.profiler.turn(device, stopping=True)  # a profile running is written, not lost
        self._refuse_submissions(self._stopped())

    def engine_lock(self, changes: bool = False):
        """`with service.engine_lock():` holds the engine's lock for an operator's view, as `with
        service.lock:` does, but answers 503 once the engine is stalled (engine_liveness.py).
        `changes`: for an operator's change, whose refusal says nothing was changed: the first
        take of one, before it has changed anything (a later one waits: a refusal would tear it)."""
        return held_unless_stalled(self.lock, self.engine_loop, NOTHING_CHANGED if changes else QUESTION_WAITS)

    def change_lock(self, principal: Principal, action: str, target: str, tenant: str | None = None,
                    detail: dict | None = None):
        """engine_lock(changes=True) for the first take of an operator's change: its refusal for a
        stalled engine is written to the audit log first (`action` on `target`, result refused, the
        503's message as the detail's `error`), as the change's other refusals are: the record of an
        incident keeps what operators tried while the engine was stuck. `tenant`: the record's
        (default: the principal's)."""
        return held_unless_stalled(self.lock, self.engine_loop, NOTHING_CHANGED,
                                   self._audit_refusal(principal, action, target, tenant, detail))

    def refuse_change_if_stalled(self, principal: Principal, action: str, target: str, tenant: str | None = None,
                                 detail: dict | None = None) -> None:
        """A 503 saying nothing was changed while the engine is stalled, audited as change_lock's:
        asked by a change whose first step is not under the engine's lock."""
        refuse_if_stalled(self.engine_loop, refused=self._audit_refusal(principal, action, target, tenant, detail))

    def _audit_refusal(self, principal: Principal, action: str, target: str, tenant: str | None,
                       detail: dict | None) -> Callable[[ServiceError], None]:
        def audit(refusal: ServiceError) -> None:
            self.store.audit(actor=principal.actor, tenant=principal.tenant if tenant is None else tenant,
                             action=action, target=target, result="refused",
                             detail={**(detail or {}), "error": str(refusal)})
        return audit

    def count_refused(self, reason: str, count: int = 1) -> None:
        """Count completions refused before the engine took them in, for `reason` (REFUSAL_REASONS)."""
        with self._refused_lock:
            self.refused[reason] += count

    def refused_counts(self) -> dict[str, int]:
        """Completions refused before the engine took them in, by reason (count_refused)."""
        with self._refused_lock:
            return dict(self.refused)

    def _expire_files(self) -> None:
        """Remove the files (/v1/files) past their expires_after or files_max_age, but a running batch's input."""
        gone = self.files.expire(keep=lambda stored: self.batches.holds_input(stored.id) is not None)
        for why in ("expires_after", "files_max_age"):
            those = [stored for stored, set_by in gone if set_by == why]
            if those:
                past = "their expires_after" if why == "expires_after" else \
                    f"files_max_age ({format_duration(self.config.files_max_age)})"
                log.info("removed %d files past %s: %s", len(those), past, ", ".join(
                    f"{f.id} of tenant {f.tenant}" for f in those[:10]) + (" ..." if len(those) > 10 else ""))

    def _say_engine_loop(self) -> None:
        """Log once that the engine stopped coming round its loop, and once that it came round again;
        while it is stalled, refuse what was handed in before it stalled (nothing takes it: 503,
        engine_stalled); end kvd once it has been stalled engine_stall_exit_seconds (_exit_if_stalled)."""
        said = self.engine_loop.to_log()
        if said is not None:
            log.log(logging.ERROR if said[0] == "error" else logging.INFO, "%s", said[1])
        if said is not None and said[0] == "error":  # where it is stuck, once
            log.error("the engine thread is stuck %s; where it stands (innermost last):\n  %s", self._stuck_step(),
                      "\n  ".join(stack_of(self._thread)[-STACK_FRAMES_LOGGED:]))
        why = self.engine_loop.stalled()
        refused = self._refuse_submissions(stalled_refusal(why, NOT_STARTED)) if why is not None else 0
        if refused:
            self.count_refused("engine_stalled", refused)
            log.warning("%d completions handed in as the engine stalled refused (503 engine_stalled): nothing "
                        "would start them", refused)
        self._exit_if_stalled()

    def _stuck_step(self) -> str:
        """What the engine's step in progress computes (Engine.stepping): its sequences' requests,
        tenants and tokens; never their text or token ids."""
        plan = self.engine.stepping if self.engine is not None else None
        if not plan:
            return "with no step's sequences planned (admitting requests, restoring a prefix from a tier, or outside " \
                   "a step: its stack says where)"
        shown = ", ".join(f"{seq.request.request_id} (tenant {seq.request.tenant}, {n} token{'' if n == 1 else 's'} "
                          f"of {seq.status.value})" for seq, n in plan[:STEP_SEQUENCES_SHOWN])
        more = f" and {len(plan) - STEP_SEQUENCES_SHOWN} more" if len(plan) > STEP_SEQUENCES_SHOWN else ""
        return f"in a step of {len(plan)} sequence{'' if len(plan) == 1 else 's'}: {shown}{more}"

    def _exit_if_stalled(self) -> None:
        """Once the engine has been stalled engine_stall_exit_seconds (0: never), record why and
        end the process (on_stall_exit), for its service manager to start it again
        (engine_liveness.py)."""
        after, idle = self.config.engine_stall_exit_seconds, self.engine_loop.idle_seconds()
        why = self.engine_loop.stalled()
        if not after or why is None or idle < after or self.stall_exit is not None:
            return
        self._exit_stalled(why, f"after engine_stall_exit_seconds ({after:g} s)")

    def _exit_stalled(self, why: str, when: str) -> None:
        """Record why kvd ends with its engine stalled, and end the process (on_stall_exit)."""
        self.stall_exit = why
        log.critical("%s; %s kvd exits (code %d) for its service manager to start it again: its requests in flight "
                     "are lost", why, when, STALLED_EXIT)
        self.notifier.send("STATUS=engine stalled: exiting", timeout=0)
        self.store.audit(actor="kvd", tenant="-", action="exit", target="engine", result="engine_stalled",
                         detail={"error": why, "exit_code": STALLED_EXIT, "step": self._stuck_step(),
                                 "stuck_at": stack_of(self._thread)[-STACK_FRAMES_KEPT:]})
        if self.on_stall_exit is not None:
            self.on_stall_exit()

    def _lose_device(self, why: str) -> None:
        """The device cannot be used again by this process (device_loss.py): the engine thread steps
        no more, what comes is refused, and the process is asked to exit (to be restarted)."""
        self.device_lost = why
        log.critical("the device cannot be used again by this process (%s): kvd exits for its service manager to "
                     "start it again", why)
        self.notifier.send(f"STATUS=device lost: {why}"[:1024], timeout=0)
        self._stop.set()  # (the engine loop ends after this step's events are delivered)
        if self.on_device_lost is not None:
            self.on_device_lost()

    def _stopped(self) -> ServiceError:
        """What a request is refused with once the engine thread has stopped, or is stopping."""
        return ServiceError(503, device_loss.refusal() if self.device_lost else "kvd is shutting down")

    def _dispatch(self, events: list[TokenEvent]) -> None:
        """Deliver a step's events, then retire the requests they finished (not before: a
        request's last samples may finish in the same step as its first). Sinks that live on
        an event loop (`LoopSink`) get one wake-up per loop per step, not one per token."""
        by_loop: dict = {}
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            if isinstance(sink, LoopSink):
                by_loop.setdefault(sink.loop, []).append((sink, event))
                continue
            try:
                sink(event)
            except Exception as exc:  # the client is gone (its event loop closed): stop its work
                self._drop_client(event.request_id, exc)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(LoopSink.deliver, batch)
            except Exception as exc:  # that loop is closed: every client on it is gone
                for request_id in dict.fromkeys(e.request_id for _, e in batch):
                    self._drop_client(request_id, exc)
        for request_id in dict.fromkeys(e.request_id for e in events if e.finish_reason is not None):
            self._maybe_finished(request_id)

    def _drop_client(self, request_id: str, exc: Exception) -> None:
        log.warning("dropping request %s: its client cannot take events (%s)", request_id, exc)
        self._sinks.pop(request_id, None)
        self.cancel(request_id)

    def _maybe_finished(self, request_id: str) -> None:
        with self.lock:
            request = self.engine.requests.get(request_id)
            if request is None or not request.finished:
                return
            self._sinks.pop(request_id, None)
            del self.engine.requests[request_id]
        if self.request_spans is not None:  # first, so that the observers (the metrics' exemplars) see its ids
            self.request_spans.observe(request)
        for observe in self._observers:
            observe(request)

    def on_finished(self, observer: Callable[[Request], None]) -> None:
        self._observers.append(observer)

    def on_rejected(self, observer: Callable[[Request, str], None]) -> None:
        """`observer(request, kind)` for each request turned away at admission (engine.AdmissionRejected)."""
        self._rejection_observers.append(observer)

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop admitting, let in-flight work finish until the deadline, cancel the rest. With the
        engine stalled (now or meanwhile) nothing can finish, and what a stop does waits for the
        lock the stalled step holds: kvd ends at once instead (_exit_stalled), where the stop hung
        until its service manager killed it."""
        self.notifier.stopping()
        self.batches.stopping = True  # (what a batch has in flight is served again at the next start)
        self.accepting = False
        if self.engine is not None:  # held-open event reads answer now: they would hold up the server's stop
            self.engine.events.stop_waits()
        limit = time.monotonic() + (self.config.shutdown_timeout if deadline is None else deadline)
        while self.engine is not None and time.monotonic() < limit:
            if self._stalled_at_stop():
                return
            try:
                busy = self.engine.has_work()
            finally:
                self.lock.release()
            if not busy:
                break
            time.sleep(0.05)
        if self.engine is not None:
            if self._stalled_at_stop():
                return
            try:
                pending = list(self.engine.requests)
            finally:
                self.lock.release()
            for request_id in pending:  # (a step runs between two: it may stall)
                if self._stalled_at_stop():
                    return
                try:
                    self.cancel(request_id)  # (the lock is re-entrant)
                finally:
                    self.lock.release()
        self._stop.set()
        if self.device_lost:  # (after a restart, `kvctl audit --action exit` says why it came)
            self.store.audit(actor="kvd", tenant="-", action="exit", target="device", result="device_lost",
                             detail={"error": self.device_lost, "exit_code": device_loss.DEVICE_LOST_EXIT})
        self._stop_verify("shutdown")
        if self.tiers is not None:
                tier_ops.save_on_shutdown(self, max(limit, time.monotonic() + 1.0))
        with self.lock:
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._save_holds()
        if self.reply_ids.keeps and self._cache_outlives_kvd():
            try:
                saved = save_reply_ids(self.reply_ids, self.config.state_dir)
                log.info("wrote the ids of %d chat replies for the next start (the cache outlives kvd)", saved)
            except (OSError, sqlite3.Error) as exc:
                log.warning("could not write the chat replies' ids (%s): after the restart their next turns "
                            "read them as text", exc)
        joined_by = time.monotonic() + STOP_STORE_WAIT_S
        for thread in self._housekeepers:  # one waiting on a locked store is left to end with the process
            thread.join(timeout=max(0.0, joined_by - time.monotonic()))
        # a restart starts them again from zero; a locked store holds the stop this long at most
        self.rollouts.record_figures("shutdown", "kvd", wait=STOP_STORE_WAIT_S)
        runs_by = time.monotonic() + STOP_RUNS_WAIT_S
        while self.responses.runs and time.monotonic() < runs_by:
            time.sleep(0.01)
        self.conversations.close()
        self.responses.close()  # (the kept responses' and conversations' last writes land before kvd exits)
        if self.request_spans is not None:
            self.request_spans.shutdown()  # the batched spans sent

    def _stalled_at_stop(self) -> bool:
        """Take the engine's lock for the stop (the caller releases it): False. With the engine
        stalled, now or while waiting, nothing is taken and kvd ends instead (_exit_stalled): True."""
        if take_unless_stalled(self.lock, self.engine_loop):
            return False
        self._exit_stalled(self.engine_loop.stalled() or "the engine stalled", "asked to stop,")
        return True

    def _save_holds(self) -> None:
        """Writes the requests' prompt cache breakpoint holds for the next start (breakpoint_holds_file.py)."""
        if self.engine is None:
            return
        with self.lock:
            pins, clock = self.engine.cache.pins.all(), self.engine.clock()
        try:
            saved = save_holds(pins, clock, self.config.state_dir)
        except OSError as exc:
            log.warning("could not write the requests' prompt cache breakpoint holds (%s): the next start does not "
                        "hold their prefixes", exc)
            return
        if saved:
            log.info("wrote %d requests' prompt cache breakpoint holds for the next start", saved)

    def _cache_outlives_kvd(self) -> bool:
        """Whether a disk or Redis tier keeps the cache through a restart (and so the replies' ids
        are worth keeping too: reply_ids_file.py)."""
        return self.tiers is not None and (self.tiers.disk is not None or self.tiers.remote is not None)

    def failed_to_load(self) -> bool:
        """Whether the load failed and no load runs now (a reload then loads again: reload_ops)."""
        return self.engine is None and self.load_error is not None and self._thread is not None

    def load_again(self, config: KvdConfig) -> None:
        """Start the engine thread again to load with `config` (caller holds the lock, and
        `failed_to_load()`): the failed load's tiers end first."""
        self.load_error = None
        if self.tiers is not None:  # a load that failed after building its tiers: their threads end
            self._stop_verify("reload")
            self.tiers.close()
            self.tiers = self.tier_scan = None
        self.config = config
        self._thread.join(timeout=10)  # the failed load's thread has returned, or is about to
        self._thread = threading.Thread(target=self._loop, args=(self._engine_thread_count,),
                                        name="kvd-engine", daemon=True)
        self._thread.start()

    def reload_from_source(self, actor: str) -> dict:
        """Read the settings again as at start and apply what can change live (reload_ops)."""
        return reload_ops.reload_from_source(self, actor)

    def reload(self, new: KvdConfig, actor: str = "sighup") -> dict:
        """Apply the settings of `new` that can change live; the answer says which wait for a
        restart (reload_ops)."""
        return reload_ops.reload(self, new, actor)

    def _stop_verify(self, why: str) -> None:
        """A disk verification ends with the tiers it reads (kvd stopping, a load tried again)."""
        run = self.disk_verify
        if run is not None and run.running:
            run.stop(why)
            run.join(timeout=10)

    def effective_settings(self) -> dict:
        """What the daemon chose for settings left to it ("auto", unset): the device, the cache
        blocks and the quick prefill size; empty until the model is loaded."""
        engine = self.engine
        if engine is None:
            return {}
        return {"device": engine.model.device.type, "num_blocks": engine.settings.num_blocks,
                "quick_prefill_tokens": engine.settings.quick_prefill_tokens}

    # ---- requests ----------------------------------------------------------------------------
    def not_ready(self) -> str | None:
        """Why kvd does not take completions now (/readyz's 503 and `kvctl check`), or None."""
        failing = self.step_failures.not_ready(time.time()) or self.engine_loop.stalled()
        if self.ready.is_set() and self.accepting and not self.draining and self.asleep is None \
                and failing is None and not self.device_lost:
            return None
        return (device_loss.refusal(self.device_lost) if self.device_lost else None) \
            or self.load_error or failing or ("shutting down" if not self.accepting else
                                              "draining (kvctl resume takes completions again)" if self.draining
                                              else self.asleep.refusal() if self.asleep is not None
                                              else "loading the model")

    def require_ready(self) -> Engine:
        if not self.ready.is_set() or self.engine is None:
            raise ServiceError(503, self.load_error or "the model is still loading")
        if not self.accepting or self.device_lost:
            raise self._stopped()
        return self.engine

    def require_awake(self) -> Engine:
        """The engine, for work that needs the cache's memory (and the weights): a 503 while kvd
        is asleep (sleep_ops.py)."""
        engine = self.require_ready()
        asleep = self.asleep
        if asleep is not None:
            raise ServiceError(503, asleep.refusal())
        return engine

    def inbox_size(self) -> int:
        """Submissions handed to the engine thread and not yet queued by it."""
        return len(self._inbox)

    def submit(self, prompts: list[list[int]], params: SamplingParams, principal: Principal,
               sink: EventSink, adapter: str = "") -> list[Request]:
        """Queue one request per prompt and wait until they are queued (see `submit_nowait`).
        Not from the engine thread, which is the one that queues them."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("submit() on the engine thread would wait for itself; use submit_nowait()")
        return self.submit_nowait(prompts, params, principal, sink, adapter=adapter).result()

    def queue_priority(self, tenant: str, requested: int | None) -> int:
        """The engine's priority (higher first) for a request of `tenant` that asks `requested`
        (vLLM's `priority`: lower runs first; None or 0: none). A request may defer itself (a
        positive priority) but never jump ahead of its tenant's place, which the operator sets
        (`tenant_priorities`); with a FIFO queue it may ask nothing. ServiceError names the field."""
        requested = requested or 0
        if requested and not by_priority(self.config.queue_order):
            serves = ("first come, first served (queue_order: fifo" if self.config.queue_order == "fifo" else
                      "the longest cached prefix first (queue_order: lpm")
            raise ServiceError(400, f"priority: {requested} asks for a place in the queue, but kvd serves its queue "
                                    f"{serves}; queue_order: priority or priority+lpm orders it)", "priority")
        if requested < 0:
            raise ServiceError(400, f"priority: {requested} would jump ahead of its tenant's place; a request may "
                                    "only defer itself (0 or more, lower runs first, as vLLM orders it); the "
                                    "operator sets tenants' places (tenant_priorities)", "priority")
        return -(dict(self.config.tenant_priorities).get(tenant, 0) + requested)

    def submit_nowait(self, prompts: list[list[int]], params: SamplingParams, principal: Principal,
                      sink: EventSink, priority: int = 0, adapter: str = "",
                      hashed: list[tuple | None] | None = None) -> Future:
        """Hand prompts to the engine thread, which queues them at the top of its next loop,
        just before the next step: a submitter never waits for the engine's lock, which is held
        for a whole step. The future gives the requests, one per prompt, or the error that
        `Engine.add_request` raised (all or nothing: a rejection cancels the ones queued).
        Prompts are hashed here, in the calling thread, not in a step (`hashed`: as `hash_prompts`
        hashed them already). `adapter`: the LoRA adapter that computes them, by its name ("": the
        base model)."""
        engine = self.require_awake()
        stalled = self.engine_loop.stalled()
        if stalled is not None:  # nothing would take it from the inbox (a router sends it to another replica)
            self.count_refused("engine_stalled")
            return _refused(stalled_refusal(stalled, NOT_STARTED))
        try:  # in this thread, before hashing: a bad or oversized prompt never reaches the engine thread
            if adapter:
                engine.adapter(adapter)
            for prompt_ids in prompts:
                engine.check_prompt(prompt_ids, params)
            if len(prompts) > engine.settings.max_queue:
                raise RequestError(f"prompt: {len(prompts)} prompts in one request can never be queued at once "
                                   f"(max_queue {engine.settings.max_queue}); send at most that many per request")
            # a shape is checked once, and its first samples' grammars compiled here (at most
            # GRAMMARS_COMPILED_AHEAD: 100 prompts of n 64 would hold 6,400 matchers while they wait)
            starts = engine.prepare_grammars(params, min(len(prompts) * params.n, GRAMMARS_COMPILED_AHEAD))
            grammars = None if starts is None else [starts[p * params.n:(p + 1) * params.n] or None
                                                    for p in range(len(prompts))]
        except RequestError as exc:
            return _refused(exc)
        if hashed is None or len(hashed) != len(prompts):
            hashed = self.hash_prompts(prompts, principal.tenant, adapter, params, checked=True)
        submission = _Submission(prompts, params, principal, sink, hashed, Future(), priority, grammars, adapter)
        self._inbox.append(submission)
        self._wake_engine()
        if self._stop.is_set():  # the engine thread is gone or going: it may never look again
            self._refuse_submissions(self._stopped())
        return submission.future

    def _wake_engine(self) -> None:
        """Wake the engine thread if it sleeps. It sets `_engine_idle` before it reads the inbox
        to decide to sleep, so a submission it did not see finds the flag set and notifies;
        while it is busy, the next loop finds the submission without a wake-up (and without
        this thread waiting for the step in progress)."""
        if self._engine_idle:
            with self.lock:
                self.lock.notify_all()

    def _queue_submissions(self) -> int:
        """Engine thread, lock held: queue what was handed in, and answer each submitter (before
        the step that starts its requests). Returns how many submissions were answered."""
        answers = []
        engine = self.engine
        while self._inbox:
            submission = self._inbox.popleft()
            queued: list[Request] = []
            if self.asleep is not None:  # handed in as kvd went to sleep: its cache's memory is going
                answers.append((submission.future, ServiceError(503, self.asleep.refusal())))
                continue
            try:
                for prompt_ids, keys, grammars in zip(submission.prompts, submission.hashed,
                                                      submission.grammars or [None] * len(submission.prompts)):
                    request_id = f"req-{secrets.token_hex(6)}"
                    reservation, speculation, cohort = self.rollouts.assign(submission.principal.tenant, request_id)
                    request = engine.add_request(prompt_ids, submission.params, tenant=submission.principal.tenant,
                                                 request_id=request_id, reservation=reservation, cohort=cohort,
                                                 speculation=speculation,
                                                 prefix_keys=keys, prompt_checked=True, grammars=grammars,
                                                 priority=submission.priority, adapter=submission.adapter)
                    self._sinks[request.request_id] = submission.sink
                    queued.append(request)
            except Exception as exc:  # AdmissionRejected, RequestError, ...: nothing stays queued
                if isinstance(exc, AdmissionRejected):  # demand all the same: the trace keeps it
                    self._trace_request(exc.request)
                    for observe in self._rejection_observers:
                        observe(exc.request, exc.kind)
                for request in queued:
                    engine.cancel(request.request_id)
                    self._sinks.pop(request.request_id, None)
                    engine.requests.pop(request.request_id, None)
                answers.append((submission.future, exc))
                continue
            answers.append((submission.future, queued))
        self._answer(answers)
        return len(answers)

    def _answer(self, answers: list[tuple[Future, object]]) -> None:
        for future, outcome in answers:
            if not future.set_running_or_notify_cancel():  # nobody waits any more
                for request in outcome if isinstance(outcome, list) else ():
                    self.cancel(request.request_id)
            elif isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _refuse_submissions(self, error: Exception) -> int:
        """Fail whatever is still in the inbox (the engine thread has stopped, or is stalled): how
        many submissions were still waiting for an answer."""
        refused = 0
        while True:
            try:
                submission = self._inbox.popleft()
            except IndexError:
                return refused
            if submission.future.set_running_or_notify_cancel():
                submission.future.set_exception(error)
                refused += 1

    def hash_prompts(self, prompts: list[list[int]], tenant: str, adapter: str = "",
                     params: SamplingParams | None = None, checked: bool = False) -> list[tuple | None]:
        """Each prompt's block keys (Engine.prefix_keys), computed in the calling thread, not in a
        step; None for ids the hasher refuses (add_request then names the bad field). Once per
        prompt: a KV transfer's fetch or publish and its submission take the same ones. With
        `params`, hashed as the request hashes them, and each prompt is checked first
        (Engine.check_prompt's RequestError, unless `checked`): an oversized one is refused before
        anything walks it."""
        engine = self.require_ready()
        if params is not None and not checked:
            for prompt_ids in prompts:
                engine.check_prompt(prompt_ids, params)
        hashed = []
        for prompt_ids in prompts:
            try:
                hashed.append(engine.prefix_keys(tenant, prompt_ids, adapter, params))
            except (TypeError, ValueError):
                hashed.append(None)
        return hashed

    def _load_scales(self, calibration: dict) -> None:
        """Swap in applied scales (caller holds the lock, nothing is running). Pins made under the
        scales before are stranded (their keys name those scales): the log says which."""
        before = self.engine.block_space()
        freed, freed_host = self.engine.set_scales(calibration["scales"], f"cal-{calibration['id']}")
        if self.tiers is not None:
            from kvctl.daemon.cache.tiers import engine_layout, engine_space_record, space_digest

            self.tiers.retarget(engine_layout(self.engine), space_digest(self.engine),
                                engine_space_record(self.engine))
        self.calibration = calibration
        self.pending_scales = None
        self.engine.admission_paused = False
        log.info("calibration %d loaded into the kernels%s", calibration["id"],
                 f"; {freed} cached blocks made under the scales before were dropped"
                 + (f" (and {freed_host} in host memory)" if freed_host else "") + " (no request reaches them)"
                 if freed or freed_host else "")
        if self.engine.block_space() != before:
            pin_ops.warn_stranded(pin_ops.stranded_pins(self, space=before), f"calibration {calibration['id']}")

    def cancel(self, request_id: str) -> None:
        with self.lock:
            if self.engine is None:
                return
            events = self.engine.cancel(request_id)
        self._dispatch(events)

    def tokenize(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text)

    def block_space(self) -> str:
        """The block space this daemon serves (its namespace less the tenant: model revision,
        tokenizer, format, scales, block size): two replicas with the same one make the same keys."""
        return self.require_ready().block_space()

    @property
    def sampling_defaults(self) -> dict:
        """What a request that leaves out temperature, top_p, top_k, min_p or repetition_penalty
        gets: the checkpoint's generation_config.json (unless generation_config: none)."""
        return self.loaded.generation.sampling if self.loaded is not None else {}

    @property
    def chat_template_digest(self) -> str | None:
        """Names the chat template (None: none): a router renders chats itself with the template of
        this digest, which `GET /admin/tokenizer` serves."""
        return None if self.chat_template is None else self.chat_template.digest

    def _trace_request(self, request: Request) -> None:
        """The request, finished or turned away, on the trace (`kvctl trace save`), its own blocks in
        explicit prompt cache mode counted in the cache's block size."""
        engine = self.engine
        self.trace.observe(request, engine.settings.block_size if engine is not None else None)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, tenant: str | None = None, count: bool = False) -> list[int]:
        """The token ids of `messages` (`render_chat`); `count`: the chat is served, and the replies'
        figures count it."""
        ids, replies = self.render_chat(messages, add_generation_prompt, continue_final_message, template_kwargs,
                                        tools, tenant)
        if count and replies is not None and (replies["as_ids"] or replies["template_changed"]):
            self.reply_ids.counted(replies["as_ids"], replies["template_changed"])
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, tenant: str | None = None) -> tuple[list[int], dict | None]:
        """The token ids of `messages` (checked by chat_messages.chat_messages) rendered by the model's chat
        template, with a request's `chat_template_kwargs` and `tools` (chat_messages.checked_tools);
        ServiceError 400 when the model has none, MessagesError naming a kwarg the template cannot take
        (or tools it does not write), ChatTemplateError when it refuses them. With `tenant`, each of
        its replies kvd keeps the ids of (reply_ids.py) goes in as those ids (reply_splice.py), and
        the second item says how the assistant messages went in: {assistant_messages, as_ids,
        as_text, template_changed} (None without `tenant`, or with no memory of replies)."""
        if self.chat_template is None:
            raise ServiceError(400, f"messages: model {self.model_name!r} has no chat template (none in its "
                                    "tokenizer_config.json or chat_template.jinja); start kvd with --chat-template "
                                    "FILE, or send the prompt to /v1/completions", param="messages")
        tokenizer = self.loaded.tokenizer

        def render(conversation: list[dict]) -> str:
            return self.chat_template.render(conversation, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, kwargs=template_kwargs,
                                             tools=tools)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        try:
            if tenant is None or not self.reply_ids.keeps:
                return encode(render(messages)), None
            ids, spliced, template_changed = spliced_prompt(
                messages, render, encode, lambda text: self.reply_ids.ids_for(tenant, tokenizer.digest, text))
        except TemplateKwargsError as exc:
            raise MessagesError(str(exc), exc.param) from None
        replies = sum(message.get("role") == "assistant" for message in messages)
        return ids, {"assistant_messages": replies, "as_ids": spliced, "as_text": replies - spliced,
                     "template_changed": template_changed}

    def remember_reply(self, tenant: str, output_ids, text: str) -> None:
        """Keeps a finished chat reply's ids by its text (as answered), for the tenant's next turn
        that sends it back (reply_ids.py); nothing where no ids say that text exactly."""
        if self.loaded is not None:
            self.reply_ids.remember_reply(tenant, self.loaded.tokenizer, output_ids, text)

    # ---- operator views ----------------------------------------------------------------------
    def status(self, with_blocks: bool = False, cells: int | None = None) -> dict:
        """`GET /admin/status` (status_body.py): with `with_blocks`, the block map too, in at most
        `cells` cells (None: a character per block)."""
        return status_body(self, with_blocks, cells)

    def drain(self, on: bool, principal: Principal) -> dict:
        """Take no new completion (`on`), letting what runs and waits finish, or take them again.
        Every router in front of this daemon sees it (route-facts says so, /readyz is 503), so a
        restart behind two routers loses no request. Pins and operator calls go on. Refused (503)
        while the engine is stalled: /readyz says so already, and its counts wait for it."""
        engine = self.require_ready()
        with self.change_lock(principal, "drain" if on else "resume", "completions"):
            was, self.draining = self.draining, on
            queue = engine.queue_figures()
        self.store.audit(actor=principal.actor, tenant=principal.tenant, action="drain" if on else "resume",
                         target="completions", result="ok", detail={"was_draining": was})
        log.info("%s: %d running, %d waiting", "draining" if on else "taking completions again",
                 queue["running"], queue["waiting"])
        return {"draining": on, "running": queue["running"], "waiting": queue["waiting"]}

    @property
    def model_name(self) -> str:
        """The name /v1/models lists: model_name, else the Hub id --model gave (as vLLM names it),
        else the checkpoint's folder."""
        if self.config.model_name:
            return self.config.model_name
        if self.hub_name:
            return self.hub_name
        return Path(self.loaded.path).name if self.loaded else "kvd"

    def adapters(self) -> dict:
        """The LoRA adapters served beside the model, by name (lora_modules; none before the load)."""
        return self.loaded.adapters if self.loaded is not None else {}

    def adapter_named(self, model: str | None) -> str:
        """The LoRA adapter a request's `model` names ("": the model itself, or None); a name served
        neither way is a 404 naming what is."""
        if model is None or model == self.model_name:
            return ""
        if model in self.adapters():
            return model
        names = ", ".join(repr(name) for name in [self.model_name, *self.adapters()])
        raise ServiceError(404, f"model: {model!r} is not served here; GET /v1/models lists {names}", "model")

    def trace_report(self, last: int | None = None, keyed: bool = False) -> dict:
        """`GET /admin/trace` (request_trace.RequestTrace.report), arrivals read as Unix time."""
        now = self.engine.clock() if self.engine is not None else time.monotonic()
        return self.trace.report(last, default_tenant="default", keyed=keyed,
                                 unix_time=lambda reading: unix_time(reading, now))


"""EngineService: the engine on its own thread, and every operation the APIs expose.

The serving loop owns the engine; HTTP handlers call in under one lock (short critical
sections) and receive token events through a per-request callback that the loop invokes
outside the lock. The loop also pings the systemd watchdog.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from kvctl.daemon.cache import InvalidRequest, PinBudgetExceeded, UnknownPin, chain_keys
from kvctl.daemon.cache.events import KeyPrefix
from kvctl.daemon.cache.prefix_tree import TIER_ORDER, CachedBlock, PrefixTree
from kvctl.daemon.cache.tiers.remote import RemoteUnavailable
from kvctl.daemon.config import ConfigError, KvdConfig, cache_dtype_name, quick_prefill_default
from kvctl.daemon.engine.engine import AdmissionRejected, Engine, EngineSettings, TokenEvent, prefetch_wait
from kvctl.daemon.engine.requests import Request
from kvctl.daemon.engine.sampling import RequestError, SamplingParams
from kvctl.daemon.model.chat_template import ChatTemplate, load_chat_template
from kvctl.daemon.model.demo import ensure_demo_checkpoint
from kvctl.daemon.model.llama import LoadedModel, load_model
from kvctl.daemon.store import ROLLBACK_PENDING_FILE, Store, StoreUnavailable
from kvctl.kernels import cache_dtype, format_unsupported_on
from kvctl.policies.reservation import parse_reservation
from kvctl.policies.tiering import restore_seconds

from .request_trace import RequestTrace, load_trace_key
from .durations import format_duration, parse_duration  # noqa: F401  (parse_duration re-exported for the app)
from .admin_slots import WriteSlots
from .housekeeping import Housekeeping, Job
from .gc_pauses import GcPauses
from .start_timing import StartTimer
from .notify import Notifier
from .tenant_labels import TenantLabels

log = logging.getLogger("kvd")

# How long an eviction waits for blocks on their way to disk or Redis to land, so that it drops them
# too (a write published after the eviction would bring back what it said it removed).
EVICT_WRITE_WAIT_S = 30.0
STORE_CHECK_SECONDS = 2.0  # how often housekeeping makes sure the store's file is still there
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


def is_short_hex(text: str) -> bool:
    """At least 4 lowercase hex digits: a prefix id or a model revision, shortened as git shortens
    a hash."""
    return len(text) >= 4 and all(c in "0123456789abcdef" for c in text)


STOP_STORE_WAIT_S = 5.0  # at kvd's stop: the most the periodic jobs, then the rollout's last figures, wait


class ServiceError(Exception):
    """An operator request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        self.status, self.param = status, param
        super().__init__(message)


@dataclass
class Principal:
    tenant: str
    role: str  # "user" or "admin"
    actor: str  # who, for the audit log ("unix-socket", or the token's name)


class EngineService:
    def __init__(self, config: KvdConfig, store: Store, notifier: Notifier | None = None) -> None:
        self.config, self.store = config, store
        self.notifier = notifier or Notifier.from_environment()
        self.lock = threading.Condition(threading.RLock())
        self.engine: Engine | None = None
        self.loaded: LoadedModel | None = None
        self.chat_template: ChatTemplate | None = None  # renders /v1/chat/completions' messages
        self.ready = threading.Event()
        self.accepting = True
        self.draining = False  # an operator's drain: no new completion; what runs finishes (kvctl drain)
        self.started_at = time.time()
        self.load_error: str | None = None
        self._sinks: dict[str, EventSink] = {}
        self._inbox: deque[_Submission] = deque()  # handed in by submit_nowait, queued by the engine thread
        self._engine_idle = False  # set (under the lock) before the engine thread looks at the inbox to sleep
        self.idle_wait = 0.5  # seconds the idle engine thread sleeps between its watchdog pings
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
        self.on_finished(self.trace.observe)
        self.latency_summary: Callable[[], dict] = dict  # TTFT/ITL percentiles; the metrics set it
        self.tenant_latency: Callable[[], dict] = dict  # per tenant: TTFT percentiles; the metrics set it
        self.tenant_labels = TenantLabels(config.max_tenant_metric_series)  # per-tenant metrics' labels, bounded
        from .rollouts import RolloutManager  # NOTE: late import; rollouts imports ServiceError from here

        self.rollouts = RolloutManager(store, pending_path=Path(config.state_dir) / ROLLBACK_PENDING_FILE)
        self._observers.append(self.rollouts.observe)
        self.rollout_check_seconds = 10.0
        # the jobs that write to the store, off the engine thread (housekeeping.py says why)
        self.housekeeping = Housekeeping([
            Job("pin expiry", lambda: PIN_EXPIRY_SECONDS, self.expire_pins),
            Job("store file check", lambda: STORE_CHECK_SECONDS, self.store.check_file),  # deleted: written back
            Job("rollout stop conditions", lambda: self.rollout_check_seconds, self.rollouts.evaluate)])
        self._housekeepers: list[threading.Thread] = []
        self.admin_write_slots = WriteSlots()  # the admin calls that change something, at once, on every front
        # settings a completed rollout made everyone's, not (yet) in the config: {name: {value, rollout}};
        # a reload whose config says otherwise reverts them, and says so
        self.rollout_settings: dict[str, dict] = {}
        self.config_source: Callable[[], KvdConfig] | None = None  # reads the settings again (reload)
        self.tokens = None  # the TCP front's TokenTable, re-read by a reload (token rotation)
        # reloads by result, and the latest one (at, result, error): a refused reload leaves kvd on its
        # old settings, which /metrics and `kvctl status` say (Prometheus' own convention)
        self.reloads = {"ok": 0, "refused": 0}
        self.last_reload: dict | None = None
        self.pending_scales: dict | None = None  # a calibration to load once running work drains
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
        model_dir = Path(cfg.model) if cfg.model else ensure_demo_checkpoint(cfg.state_dir)
        loaded = load_model(model_dir, device=device, dtype=None if cfg.dtype == "auto" else cfg.dtype)
        chat_template = load_chat_template(model_dir, loaded.tokenizer.config, cfg.chat_template)
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
            num_blocks = int(torch.cuda.mem_get_info()[0] * 0.8) // per_block
        else:
            num_blocks = (256 * 2**20) // per_block
        if num_blocks < 1:
            raise ValueError(f"cache_memory: {cfg.cache_memory} bytes holds no block of {per_block} bytes")
        settings = EngineSettings(num_blocks=num_blocks, block_size=cfg.block_size,
                                  max_batch_tokens=cfg.max_batch_tokens, max_running=cfg.max_running,
                                  max_queue=cfg.max_queue, max_tenant_requests=cfg.max_tenant_requests,
                                  tenant_request_limits=cfg.tenant_request_limits,
                                  reservation=cfg.reservation,
                                  eviction=cfg.eviction, queue_order=cfg.queue_order,
                                  cache_dtype=cfg.cache_dtype, keep_layers=tuple(keep),
                                  quick_prefill_tokens=self._quick_prefill_tokens(cfg, device),
                                  tenant_cache_shares=cfg.tenant_cache_shares,
                                  max_tracked_tenants=cfg.max_tracked_tenants, **prefetch_settings(cfg))
        engine = Engine(loaded, settings, scales=scales, scale_version=scale_version)
        timer.mark("cache")
        engine.stats.tenants.keep = self.tenant_labels.has_own  # a tenant's own metric series never shrinks
        if cfg.pin_budget_blocks is not None:
            engine.cache.pins.default_budget = cfg.pin_budget_blocks
        from . import tier_ops

        tier_ops.attach(self, engine)
        timer.mark("tiers")
        with self.lock:
            self.loaded, self.engine, self.chat_template = loaded, engine, chat_template
            lapsed = self._restore_pins()
        timer.mark("pins")
        if lapsed:  # off the start: a store another process holds locked must not hold it up
            threading.Thread(target=lambda: [self._forget_stored_pin(pin_id) for pin_id in lapsed],
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
                 loaded.config.architecture, loaded.revision[:12], num_blocks, cfg.block_size, device,
                 timer.ready_after, ", ".join(f"{phase} {took:.2f} s" for phase, took in timer.phases.items()))

    def _warm_pins(self, timer: StartTimer) -> None:
        from . import tier_ops

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
        self._engine_thread_count = threads  # for an engine thread started again (_load_again)
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
        while not self._stop.is_set():
            self.notifier.watchdog()
            if self.cpu_share is not None and self.cpu_share.wanted != self.engine_threads:
                torch.set_num_threads(self.cpu_share.wanted)  # this thread's count: only it can set it
                self.engine_threads = self.cpu_share.wanted
            with self.lock:
                answered = self._queue_submissions()
                if self.pending_scales is not None and not self.engine.num_running:
                    self._load_scales(self.pending_scales)
                busy = self.engine.has_work()
                if not busy and not answered:
                    self._engine_idle = True  # before the inbox is read: see _wake_engine
                    if not self._inbox:
                        self.lock.wait(timeout=self.idle_wait)
                    self._engine_idle = False
                    continue
                events = []
                if busy:  # (all of what was handed in may have been refused)
                    try:
                        events = self.engine.step()
                    except Exception:  # a failed step must not strand clients or leak blocks
                        log.exception("engine step failed; cancelling the requests in flight")
                        events = [e for rid in list(self.engine.requests) for e in self.engine.cancel(rid)]
            self._dispatch(events)
        self._refuse_submissions(ServiceError(503, "kvd is shutting down"))

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
        for observe in self._observers:
            observe(request)

    def on_finished(self, observer: Callable[[Request], None]) -> None:
        self._observers.append(observer)

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop admitting, let in-flight work finish until the deadline, cancel the rest."""
        self.notifier.stopping()
        self.accepting = False
        if self.engine is not None:  # held-open event reads answer now: they would hold up the server's stop
            self.engine.events.stop_waits()
        limit = time.monotonic() + (self.config.shutdown_timeout if deadline is None else deadline)
        while self.engine is not None and time.monotonic() < limit:
            with self.lock:
                if not self.engine.has_work():
                    break
            time.sleep(0.05)
        if self.engine is not None:
            with self.lock:
                pending = list(self.engine.requests)
            for request_id in pending:
                self.cancel(request_id)
        self._stop.set()
        self._stop_verify("shutdown")
        if self.tiers is not None:
            from . import tier_ops

            tier_ops.save_on_shutdown(self, max(limit, time.monotonic() + 1.0))
        with self.lock:
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        joined_by = time.monotonic() + STOP_STORE_WAIT_S
        for thread in self._housekeepers:  # one waiting on a locked store is left to end with the process
            thread.join(timeout=max(0.0, joined_by - time.monotonic()))
        # a restart starts them again from zero; a locked store holds the stop this long at most
        self.rollouts.record_figures("shutdown", "kvd", wait=STOP_STORE_WAIT_S)

    def _stop_verify(self, why: str) -> None:
        """A disk verification ends with the tiers it reads (kvd stopping, a load tried again)."""
        run = self.disk_verify
        if run is not None and run.running:
            run.stop(why)
            run.join(timeout=10)

    def reload_from_source(self, actor: str) -> dict:
        """Read the settings again as at start (the same flags and KVD_* environment, the YAML
        file as it is now) and apply what can change live (`reload`). A config that does not
        validate changes nothing: the refusal names the setting and is audited."""
        if self.config_source is None:
            raise ServiceError(409, "reload: this kvd has no settings source to read again", "config")
        from .auth import TokenFileError, TokenTable

        try:
            new = self.config_source()
            self._refuse_an_emptied_file()
            fresh = TokenTable.load(self.config.token_file) if self.tokens is not None else None
        except (ConfigError, TokenFileError) as exc:
            self.store.audit(actor=actor, tenant="-", action="reload", target="config", result="refused",
                             detail={"error": str(exc)})
            self.reloads["refused"] += 1
            self.last_reload = {"at": time.time(), "result": "refused", "error": str(exc), "actor": actor}
            raise ServiceError(400, f"reload refused, nothing changed: {exc}", "config") from None
        result = self._load_again(new, actor) if self.load_error is not None else self.reload(new, actor)
        self.reloads["ok"] += 1
        self.last_reload = {"at": time.time(), "result": "ok", "error": None, "actor": actor}
        if fresh is not None:  # rotated tokens take effect for the next request; counts only, never tokens
            result["tokens"] = self.tokens.adopt(fresh)
            self.store.audit(actor=actor, tenant="-", action="reload", target="token_file", result="ok",
                             detail=result["tokens"])
        return result

    def _refuse_an_emptied_file(self) -> None:
        """ConfigError when the file live settings came from holds nothing now (whitespace only). A
        tool that truncates before it writes leaves it so for a moment, and a reload then (a SIGHUP
        from a path watcher) put every one of them back to its default. `{}` there means no
        settings on purpose."""
        from_file: dict[str, list[str]] = {}
        for name, source in sorted(self.config.sources.items()):
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

    # what the running process is bound to: its sockets, its store, its auth front, its metric families
    BOUND_AT_START = ("state_dir", "socket", "listen", "token_file", "trusted_proxy", "metrics_aliases",
                      "max_tenant_metric_series", "trace_key_file", "trace_block_tokens")

    def _load_again(self, new: KvdConfig, actor: str) -> dict:
        """kvd could not serve: its model, cache or tiers did not load (a quantised cache with no
        calibration yet, a checkpoint not there yet, a tier setting refused). A reload then loads
        again with the settings read now, all but those the process is bound to, so that fixing the
        config needs no restart. The answer names the earlier error; /readyz says "loading the
        model" until the load ends, and names the new error if it fails again."""
        with self.lock:
            if self.engine is not None or self.load_error is None or self._thread is None:
                return self.reload(new, actor)  # loaded since, or a load is running already
            now, before = new.shown(), self.config.shown()  # shown: a Redis password stays out of answer and audit
            changed = {k: v for k, v in now.items() if k not in self.BOUND_AT_START and v != before[k]}
            previous = {k: before[k] for k in changed}
            bound = sorted(k for k in self.BOUND_AT_START if getattr(new, k) != getattr(self.config, k))
            earlier_error, self.load_error = self.load_error, None
            if self.tiers is not None:  # a load that failed after building its tiers: their threads end
                self._stop_verify("reload")
                self.tiers.close()
                self.tiers = self.tier_scan = None
            self.config = replace(new, **{k: getattr(self.config, k) for k in self.BOUND_AT_START})
            self._thread.join(timeout=10)  # the failed load's thread has returned, or is about to
            self._thread = threading.Thread(target=self._loop, args=(self._engine_thread_count,),
                                            name="kvd-engine", daemon=True)
            self._thread.start()
        result = {"changed": changed, "previous": previous, "needs_restart": bound, "loading_again": earlier_error}
        self.store.audit(actor=actor, tenant="-", action="reload", target="config", result="ok", detail=result)
        log.info("loading again (reload by %s) after: %s; changed %s", actor, earlier_error, sorted(changed))
        return result

    def reload(self, new: KvdConfig, actor: str = "sighup") -> dict:
        """Apply policy settings that can change live (SIGHUP, `kvctl config reload`); the cache is
        kept. `reload_from_source` also re-reads the token file (token rotation)."""
        live = ("max_batch_tokens", "max_running", "max_queue", "max_tenant_requests", "reservation", "queue_order",
                "pin_budget_blocks", "shutdown_timeout", "quick_prefill_tokens", "max_request_bytes",
                "tenant_cache_shares", "tenant_priorities", "tenant_request_limits", "prefetch_policy",
                "prefetch_timeout", "prefetch_timeout_per_1k_tokens", "tier_compress", "disk_compress",
                "remote_compress", "trace_requests", "max_tracked_tenants", "gc_warn_seconds")
        changed = {k: getattr(new, k) for k in live if getattr(new, k) != getattr(self.config, k)}
        previous = {k: getattr(self.config, k) for k in changed}
        ignored = sorted(k for k, v in new.describe().items()
                         if k not in live and v != getattr(self.config, k))
        with self.lock:
            engine = self.engine
            if engine is not None:
                engine.settings = replace(engine.settings, max_batch_tokens=new.max_batch_tokens,
                                          max_running=new.max_running, max_queue=new.max_queue,
                                          max_tenant_requests=new.max_tenant_requests,
                                          tenant_request_limits=new.tenant_request_limits,
                                          reservation=new.reservation, queue_order=new.queue_order,
                                          quick_prefill_tokens=self._quick_prefill_tokens(
                                              new, engine.model.device.type),
                                          tenant_cache_shares=new.tenant_cache_shares,
                                          max_tracked_tenants=new.max_tracked_tenants, **prefetch_settings(new))
                engine.prefetch = prefetch_wait(engine.settings)
                engine.stats.tenants.resize(new.max_tracked_tenants)
                if "tenant_cache_shares" in changed:
                    engine.cache.set_tenant_shares(new.tenant_cache_shares)
                    if self.tiers is not None and self.tiers.host is not None:
                        with self.tiers.lock:
                            self.tiers.host.set_tenant_shares(new.tenant_cache_shares)
                    if self.tiers is not None and self.tiers.remote is not None:
                        self.tiers.remote.set_tenant_shares(new.tenant_cache_shares)
                    if self.tiers is not None and self.tiers.disk is not None:
                        self.tiers.disk.set_tenant_shares(new.tenant_cache_shares)
                if "reservation" in changed:
                    engine.reservation = parse_reservation(new.reservation)
                if self.tiers is not None:  # blocks written from now on; those stored stay as they are
                    self.tiers.compress = new.tier_codecs()
                if new.pin_budget_blocks is not None:
                    engine.cache.pins.default_budget = new.pin_budget_blocks
            self.trace.resize(new.trace_requests)  # the newest kept
            sources = {k: v for k, v in self.config.sources.items() if k not in live}  # these wait for a restart
            sources.update({k: new.sources[k] for k in live if k in new.sources})  # absent: the default
            self.config = replace(self.config, **changed, sources=sources)
            # a completed rollout's setting is now either the config's too, or reverted by it
            reverted = {name: {**held, "now": changed[name]} for name, held in self.rollout_settings.items()
                        if name in changed}
            self.rollout_settings = {}
        result = {"changed": changed, "previous": previous, "needs_restart": ignored}
        if reverted:
            result["reverted_rollout_settings"] = reverted
        self.store.audit(actor=actor, tenant="-", action="reload", target="config",
                         result="ok", detail=result)
        log.info("reloaded by %s: changed %s; needs restart: %s", actor, sorted(changed), ignored)
        for name, held in reverted.items():
            log.warning("reload reverted %s from %s (completed rollout %s) to the config's %s",
                        name, held["value"], held["rollout"], held["now"])
        return result

    def effective_settings(self) -> dict:
        """What the daemon chose for settings left to it ("auto", unset): the device, the cache
        blocks and the quick prefill size; empty until the model is loaded."""
        engine = self.engine
        if engine is None:
            return {}
        return {"device": engine.model.device.type, "num_blocks": engine.settings.num_blocks,
                "quick_prefill_tokens": engine.settings.quick_prefill_tokens}

    @staticmethod
    def _quick_prefill_tokens(cfg: KvdConfig, device: str) -> int:
        return quick_prefill_default(device) if cfg.quick_prefill_tokens is None else cfg.quick_prefill_tokens

    # ---- requests ----------------------------------------------------------------------------
    def require_ready(self) -> Engine:
        if not self.ready.is_set() or self.engine is None:
            raise ServiceError(503, self.load_error or "the model is still loading")
        if not self.accepting:
            raise ServiceError(503, "kvd is shutting down")
        return self.engine

    def submit(self, prompts: list[list[int]], params: SamplingParams, principal: Principal,
               sink: EventSink) -> list[Request]:
        """Queue one request per prompt and wait until they are queued (see `submit_nowait`).
        Not from the engine thread, which is the one that queues them."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("submit() on the engine thread would wait for itself; use submit_nowait()")
        return self.submit_nowait(prompts, params, principal, sink).result()

    def queue_priority(self, tenant: str, requested: int | None) -> int:
        """The engine's priority (higher first) for a request of `tenant` that asks `requested`
        (vLLM's `priority`: lower runs first; None or 0: none). A request may defer itself (a
        positive priority) but never jump ahead of its tenant's place, which the operator sets
        (`tenant_priorities`); with a FIFO queue it may ask nothing. ServiceError names the field."""
        requested = requested or 0
        if requested and self.config.queue_order != "priority":
            raise ServiceError(400, f"priority: {requested} asks for a place in the queue, but kvd serves its queue "
                                    "first come, first served (queue_order: fifo; queue_order: priority orders it)",
                               "priority")
        if requested < 0:
            raise ServiceError(400, f"priority: {requested} would jump ahead of its tenant's place; a request may "
                                    "only defer itself (0 or more, lower runs first, as vLLM orders it); the "
                                    "operator sets tenants' places (tenant_priorities)", "priority")
        return -(dict(self.config.tenant_priorities).get(tenant, 0) + requested)

    def submit_nowait(self, prompts: list[list[int]], params: SamplingParams, principal: Principal,
                      sink: EventSink, priority: int = 0) -> Future:
        """Hand prompts to the engine thread, which queues them at the top of its next loop,
        just before the next step: a submitter never waits for the engine's lock, which is held
        for a whole step. The future gives the requests, one per prompt, or the error that
        `Engine.add_request` raised (all or nothing: a rejection cancels the ones queued).
        Prompts are hashed here, in the calling thread, not in a step."""
        engine = self.require_ready()
        try:  # in this thread, before hashing: a bad or oversized prompt never reaches the engine thread
            for prompt_ids in prompts:
                engine.check_prompt(prompt_ids, params)
            if len(prompts) > engine.settings.max_queue:
                raise RequestError(f"prompt: {len(prompts)} prompts in one request can never be queued at once "
                                   f"(max_queue {engine.settings.max_queue}); send at most that many per request")
        except RequestError as exc:
            refused: Future = Future()
            refused.set_exception(exc)
            return refused
        hashed = [self._hash_outside_the_step(engine, principal.tenant, p) for p in prompts]
        submission = _Submission(prompts, params, principal, sink, hashed, Future(), priority)
        self._inbox.append(submission)
        self._wake_engine()
        if self._stop.is_set():  # the engine thread is gone or going: it may never look again
            self._refuse_submissions(ServiceError(503, "kvd is shutting down"))
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
            try:
                for prompt_ids, keys in zip(submission.prompts, submission.hashed):
                    request_id = f"req-{secrets.token_hex(6)}"
                    reservation, cohort = self.rollouts.assign(submission.principal.tenant, request_id)
                    request = engine.add_request(prompt_ids, submission.params, tenant=submission.principal.tenant,
                                                 request_id=request_id, reservation=reservation, cohort=cohort,
                                                 prefix_keys=keys, prompt_checked=True,
                                                 priority=submission.priority)
                    self._sinks[request.request_id] = submission.sink
                    queued.append(request)
            except Exception as exc:  # AdmissionRejected, RequestError, ...: nothing stays queued
                if isinstance(exc, AdmissionRejected):  # demand all the same: the trace keeps it
                    self.trace.observe(exc.request)
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

    def _refuse_submissions(self, error: Exception) -> None:
        """Fail whatever is still in the inbox (the engine thread has stopped)."""
        while True:
            try:
                submission = self._inbox.popleft()
            except IndexError:
                return
            if submission.future.set_running_or_notify_cancel():
                submission.future.set_exception(error)

    @staticmethod
    def _hash_outside_the_step(engine: Engine, tenant: str, prompt_ids: list[int]) -> tuple | None:
        """A prompt's block keys, computed in the submitting thread, not in a step; None for
        ids the hasher refuses (add_request then names the bad field)."""
        try:
            return engine.prefix_keys(tenant, prompt_ids)
        except (TypeError, ValueError):
            return None

    def _load_scales(self, calibration: dict) -> None:
        """Swap in applied scales (caller holds the lock, nothing is running)."""
        self.engine.set_scales(calibration["scales"], f"cal-{calibration['id']}")
        if self.tiers is not None:
            from kvctl.daemon.cache.tiers import engine_layout, engine_space_record, space_digest

            self.tiers.retarget(engine_layout(self.engine), space_digest(self.engine),
                                engine_space_record(self.engine))
        self.calibration = calibration
        self.pending_scales = None
        self.engine.admission_paused = False
        log.info("calibration %d loaded into the kernels", calibration["id"])

    def calibrate(self, *, dtype: str, prompts: list[list[int]] | None, greedy_tokens: int, max_kl: float,
                  margin: float, slices: list[int], if_older_than: float | None, apply: bool,
                  principal: Principal) -> dict:
        """Measure, derive scales, evaluate by slice, rank layers; store; apply if it meets the target."""
        from kvctl.daemon import calibration as cal

        self.require_ready()
        loaded = self.loaded
        dtype = cache_dtype_name(dtype)
        if dtype not in ("fp8_e4m3", "fp8_e5m2", "int8"):
            raise ServiceError(400, f"dtype: invalid value {dtype!r}; use fp8_e4m3 (or fp8), fp8_e5m2 or int8",
                               "dtype")
        problem = format_unsupported_on(loaded.model.device, cache_dtype(dtype))
        if problem:  # scales for a format this GPU cannot serve would never be used
            raise ServiceError(400, f"dtype: {problem}", "dtype")
        if not margin >= 1.0:
            raise ServiceError(400, f"margin: must be >= 1.0, got {margin}", "margin")
        if if_older_than is not None:
            latest = self.store.calibration(loaded.revision, dtype, applied=False)
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
        calibration_id = self.store.save_calibration({
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
            self.store.mark_calibration_applied(calibration_id)
            body["applied"] = True
            stored = self.store.calibration(loaded.revision, dtype, applied=True)
            with self.lock:
                if self.engine.settings.cache_dtype == dtype:
                    self.engine.admission_paused = True
                    self.pending_scales = stored
                    body["takes_effect"] = "now: new scales load as soon as running requests finish"
                    if tuple(keep) != tuple(self.engine.settings.keep_layers):
                        body["needs_restart_for_keep_layers"] = True
                    self.lock.notify_all()
                else:
                    body["takes_effect"] = f"when kvd serves cache_dtype {dtype}"
        self.store.audit(actor=principal.actor, tenant="-", action="calibrate", target=f"calibration:{calibration_id}",
                         result="applied" if body["applied"] else ("refused" if "refused" in body else "stored"),
                         detail={"dtype": dtype, "worst_kl": worst, "max_kl": max_kl})
        return body

    def cache_status(self) -> dict:
        """Format, scale set and a check that the kernels read the stored scales."""
        engine = self.engine
        body = {"dtype": engine.settings.cache_dtype if engine.cache_dtype is not None else "auto",
                "layout": engine.layout(), "scale_version": engine.scale_version or None,
                "uncalibrated": engine.scale_version == "unit", "scale_set": None, "scales_verified": None}
        if self.calibration is not None:
            c = self.calibration
            body["scale_set"] = {"id": c["id"], "calibrated_at": c["created_at"], "applied_at": c["applied_at"],
                                 "prompts_digest": c["prompts_digest"], "margin": c["margin"]}
            loaded = engine.loaded_scales()
            body["scales_verified"] = all(
                all(abs(a - b) <= 1e-6 * max(abs(b), 1e-12) for a, b in zip(loaded[layer][i], c["scales"][layer][i]))
                for layer in loaded for i in (0, 1))
        return body

    def complete_rollout(self, rollout_id: int, principal: Principal) -> dict:
        """Finish a rollout: its settings become everyone's now. They live in memory only: the
        answer says which settings to write into the config, and a reload or restart with a
        config that says otherwise reverts them (the reload says so; `rollout_status` shows
        whether they are still in effect)."""
        rollout = self.rollouts.status(rollout_id)
        body = self.rollouts.complete(rollout_id, principal.actor)  # (its store write may wait: not under the lock)
        with self.lock:
            applied = {}
            reservation = rollout["policy"]["settings"].get("reservation")
            if reservation is not None:
                applied["reservation"] = {"value": str(reservation), "was": self.config.reservation}
                if self.engine is not None:
                    self.engine.reservation = parse_reservation(str(reservation))
                    self.engine.settings = replace(self.engine.settings, reservation=str(reservation))
                self.config = replace(self.config, reservation=str(reservation),
                                      sources={**self.config.sources, "reservation": f"rollout {rollout_id}"})
            for name, change in applied.items():
                if change["value"] != change["was"]:
                    self.rollout_settings[name] = {"value": change["value"], "rollout": rollout_id}
        body = self._with_settings_in_effect(body)
        body["applied"] = applied
        body["keep"] = {name: f"set {name}: {change['value']} in kvd's config (YAML, KVD_{name.upper()} or "
                              f"--{name.replace('_', '-')}); until then a reload or restart reverts it"
                        for name, change in applied.items() if name in self.rollout_settings}
        return body

    def start_rollout(self, policy, fraction, stops: list[str], adr_id: int | None, actor: str) -> dict:
        """`RolloutManager.start`; the answer also says when the cohort's settings are everyone's
        already (the two sides cannot differ: nothing to learn from it)."""
        body = self.rollouts.start(policy, fraction, stops, adr_id, actor)
        settings = body["policy"]["settings"]
        if all(self._settings_in_effect(settings).values()):
            body["note"] = ("the cohort's settings are everyone's already ("
                            + ", ".join(f"{name} {value}" for name, value in settings.items())
                            + "): cohort and baseline run alike")
        return body

    def rollout_status(self, rollout_id: int | None = None) -> dict:
        """A rollout as `RolloutManager.status` reports it; a completed one also says whether its
        settings are still in effect (a reload or restart may have reverted them)."""
        return self._with_settings_in_effect(self.rollouts.status(rollout_id))

    def _settings_in_effect(self, settings: dict) -> dict[str, bool]:
        """For each of a policy's settings, whether everyone has that value now."""
        return {name: str(getattr(self.config, name, None)) == str(value) for name, value in settings.items()}

    def _with_settings_in_effect(self, body: dict) -> dict:
        if body["state"] == "completed":
            body["settings_in_effect"] = self._settings_in_effect(body["policy"]["settings"])
        return body

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
        from kvctl.daemon.cache.tiers import space_digest

        return space_digest(self.require_ready()).hex()

    @property
    def chat_template_digest(self) -> str | None:
        """Names the chat template (None: none): a router renders chats itself with the template of
        this digest, which `GET /admin/tokenizer` serves."""
        return None if self.chat_template is None else self.chat_template.digest

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """The token ids of `messages` (checked by chat_messages.chat_messages) rendered by the model's chat
        template; ServiceError 400 when the model has none, ChatTemplateError when it refuses them."""
        if self.chat_template is None:
            raise ServiceError(400, f"messages: model {self.model_name!r} has no chat template (none in its "
                                    "tokenizer_config.json or chat_template.jinja); start kvd with --chat-template "
                                    "FILE, or send the prompt to /v1/completions", param="messages")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message)
        return self.loaded.tokenizer.encode(text, add_bos=False)

    # ---- operator views ----------------------------------------------------------------------
    def status(self, with_blocks: bool = False) -> dict:
        engine = self.require_ready()
        waiting_writes, longest_write_wait = self.store.waiting_writes()
        with self.lock:
            cache = engine.cache
            counts = cache.state_counts()
            stats = engine.stats
            queue = engine.queue_figures()
            block_map = None
            if with_blocks:
                block_map = self._block_map()
            body = {
                "model": {"name": self.model_name, "architecture": self.loaded.config.architecture,
                          "path": str(self.loaded.path),
                          "revision": self.loaded.revision, "dtype": str(engine.model.dtype),
                          "device": str(engine.model.device),
                          "chat_template": None if self.chat_template is None else {
                              "source": self.chat_template.source, "digest": self.chat_template.digest}},
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
                "evictions": {"capacity": cache.pool.evictions, "operator": cache.pool.operator_evictions,
                              "tenant_share": cache.pool.share_evictions},
                # per tenant: idle (evictable) blocks and share in blocks; None when no shares are set
                "tenant_shares": cache.tenant_shares(),
                "queue": queue,
                "rejections": dict(stats.rejections), "preemptions": stats.preemptions,
                # model steps by kind and their summed wall time: Δseconds / Δwall is how busy the engine is
                "steps": {kind: {"count": stats.steps[kind], "seconds": stats.step_seconds[kind]}
                          for kind in sorted(stats.steps)},
                "engine_threads": self.engine_threads,  # torch intra-op threads of the engine (others use one)
                # the host's CPUs shared with other busy kvd engines (CPU device under kvd serve), else None
                "cpu_share": self.cpu_share.report() if self.cpu_share is not None else None,
                "pins": len(cache.pins.all()),
                "rollout": self.rollouts.summary(),
                "last_reload": self.last_reload,
                "cache": self.cache_status(),
                "uptime_seconds": time.time() - self.started_at,
                "start": None if self.start_timer is None else self.start_timer.report(),
                "gc": self.gc_pauses.report(),
                "draining": self.draining,
                "store": {"file_ok": self.store.file_ok, "written_back": self.store.written_back,
                          "audit_write_failures": self.store.audit_failures,
                          # a rollback kvd made that the store has not taken (a restart would undo it)
                          "unstored_rollback": None if self.rollouts.unstored is None
                          else self.rollouts.unstored["rollout_id"],
                          # where kvd keeps it meanwhile (a restart then keeps it rolled back); None: only in memory
                          "unstored_rollback_kept": None if self.rollouts.unstored is None
                          else self.rollouts.unstored.get("kept"),
                          "failing_jobs": self.housekeeping.failing(),
                          # writes waiting to begin now (another process may hold the write lock), the longest wait
                          "waiting_writes": waiting_writes, "longest_write_wait_seconds": longest_write_wait},
            }
        body["latency"] = self.latency_summary()
        body["gpu"] = gpu_status()
        if self.tiers is not None:
            report = self.tiers.report()
            body["tiers"] = {name: {k: t[k] for k in ("used_bytes", "capacity_bytes", "blocks", "health")}
                             for name, t in report["tiers"].items()}
        if block_map is not None:
            body["block_map"] = block_map
        return body

    def drain(self, on: bool, principal: Principal) -> dict:
        """Take no new completion (`on`), letting what runs and waits finish, or take them again.
        Every router in front of this daemon sees it (route-facts says so, /readyz is 503), so a
        restart behind two routers loses no request. Pins and operator calls go on."""
        engine = self.require_ready()
        was, self.draining = self.draining, on
        with self.lock:
            queue = engine.queue_figures()
        self.store.audit(actor=principal.actor, tenant=principal.tenant, action="drain" if on else "resume",
                         target="completions", result="ok", detail={"was_draining": was})
        log.info("%s: %d running, %d waiting", "draining" if on else "taking completions again",
                 queue["running"], queue["waiting"])
        return {"draining": on, "running": queue["running"], "waiting": queue["waiting"]}

    def _block_map(self) -> str:
        """One character per block: . free  r reserved  a active  s shared  c cached  p pinned."""
        engine = self.engine
        reserved = engine.cache.reserved_block_ids()
        chars = []
        for block in engine.cache.pool.blocks:
            if block.block_id in reserved:
                chars.append("r")
            elif block.ref_count > 1:
                chars.append("s")
            elif block.ref_count == 1:
                chars.append("a")
            elif block.key is not None:
                chars.append("p" if block.pin_count else "c")
            else:
                chars.append(".")
        return "".join(chars)

    @property
    def model_name(self) -> str:
        if self.config.model_name:
            return self.config.model_name
        return Path(self.loaded.path).name if self.loaded else "kvd"

    def prefix_tree(self) -> tuple[PrefixTree, dict]:
        """The cached prefixes of every tier as one tree (see daemon/cache/prefix_tree.py), and
        what the cache knows of each tree's root (tenant, hits, last use)."""
        engine = self.require_ready()
        known = self.tiers.known_metas() if self.tiers is not None else {}
        lower = [CachedBlock(meta.key, meta.parent, meta.root, meta.depth, tier, meta.tenant, meta.hits, meta.last_use)
                 for meta, tier in known.values()]
        with self.lock:  # roots only lower tiers hold keep their tenant and hits
            device = engine.cache.cached_blocks()
            engine.cache.forget_roots(keep={meta.root for meta, _ in known.values()})
            roots = dict(engine.cache.roots)
        tree = PrefixTree(device + lower)
        for node in tree.nodes.values():  # where no block records its tenant, its root's record may
            if node.tenant is None and node.root in roots:
                node.tenant = roots[node.root].tenant
        return tree, roots

    def prefixes(self, tenant: str | None, pinned_only: bool, sort: str = "recent",
                 limit: int = 0, under: str | None = None) -> tuple[list[dict], int]:
        """One row per node of the prefix tree: a run of cached blocks between branch points.
        `sort`: recent (the tree, most recently used first), hits or size (largest first, ties in
        tree order). `under`: only the row that id names and the rows that extend it. Returns
        (the first `limit` rows, or all for 0; how many there are)."""
        if sort not in PREFIX_SORTS:
            raise ServiceError(400, f"sort: unknown value {sort!r}; use {', '.join(PREFIX_SORTS)}", "sort")
        if limit < 0:
            raise ServiceError(400, f"limit: must be >= 0, got {limit}", "limit")
        engine = self.require_ready()
        tree, roots = self.prefix_tree()
        nodes = tree.nodes.values()
        if under is not None:
            try:
                nodes = tree.subtree(tree.node_of[self.resolve_prefix(under, tree)])
            except ServiceError as exc:  # name the parameter the caller gave
                raise ServiceError(exc.status, str(exc).replace("prefix:", "under:", 1), "under") from None
        size, nbytes = engine.cache.block_size, engine.cache.block_bytes
        now = engine.clock()
        rows = []
        for node in nodes:
            info = roots.get(node.root)
            hits, last_use = node.hits, node.last_use
            if node.start_depth == 0 and info is not None:  # a tree's first node: its root's record spans tiers
                hits = max(hits or 0, info.hits)
                last_use = info.last_use if last_use is None else max(last_use, info.last_use)
            rows.append({
                "prefix_id": node.key.hex()[:16], "parent_id": node.parent.hex()[:16] if node.parent else None,
                "root_id": node.root.hex()[:16],  # the tree's first block: the row every row of it descends from
                "tenant": node.tenant,
                "start_token": node.start_depth * size, "tokens": (node.end_depth + 1) * size,
                "blocks": len(node.keys), "bytes": len(node.keys) * nbytes, "hits": hits,
                "idle_seconds": None if last_use is None else now - last_use,
                "last_use": self._unix_time(last_use, now), "tier": node.tier,
                "tiers": {t: node.tiers[t] for t in TIER_ORDER if t in node.tiers},
                "pinned": node.pinned_blocks > 0, "pinned_blocks": node.pinned_blocks,
                "in_use_blocks": node.in_use_blocks, "children": len(node.children), "detached": node.detached,
            })
        rows = [r for r in _tree_order(rows) if (tenant is None or r["tenant"] == tenant)
                and (not pinned_only or r["pinned"])]
        figure = PREFIX_SORTS[sort]
        if figure is not None:  # largest first; unknown last; sorted() keeps the tree order in ties
            rows = sorted(rows, key=lambda r: float("-inf") if r[figure] is None else r[figure], reverse=True)
        return (rows[:limit] if limit else rows), len(rows)

    @staticmethod
    def _unix_time(reading: float | None, now: float) -> float | None:
        """A reading of the engine's clock (monotonic, `now` being its current one) as Unix time:
        what the API hands out, so scripts and other hosts can read it."""
        return None if reading is None else time.time() - (now - reading)

    def trace_report(self, last: int | None = None, keyed: bool = False) -> dict:
        """`GET /admin/trace` (request_trace.RequestTrace.report), arrivals read as Unix time."""
        now = self.engine.clock() if self.engine is not None else time.monotonic()
        return self.trace.report(last, default_tenant="default", keyed=keyed,
                                 unix_time=lambda reading: self._unix_time(reading, now))

    # ---- pins --------------------------------------------------------------------------------
    def pin(self, token_ids: list[int], principal: Principal, ttl: float | None, note: str) -> dict:
        engine = self.require_ready()
        namespace = engine.namespace(principal.tenant)
        try:
            with self.lock:
                result = engine.cache.pin(namespace, token_ids, ttl=ttl, owner=principal.actor, note=note)
        except PinBudgetExceeded as exc:  # (audited outside the lock: the engine thread takes it, a store write may wait)
            self.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin",
                             target="-", result="refused", detail={"reason": str(exc)})
            raise ServiceError(409, str(exc)) from None
        except InvalidRequest as exc:
            raise ServiceError(400, str(exc), "tokens") from None
        warmed = False
        if result.pending_blocks:
            try:
                self._warm(token_ids, principal)
            except Exception as exc:  # the prefix cannot be prefilled: a new pin goes again, whole
                if not result.refreshed:
                    with self.lock:
                        engine.cache.unpin(result.pin.pin_id)
                self.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin", target="-",
                                 result="refused", detail={"reason": str(exc)})
                status = 400  # a bad prompt; 409 when the cache cannot take it; the service's own otherwise
                if isinstance(exc, ServiceError):
                    status = exc.status
                elif isinstance(exc, AdmissionRejected):
                    status = 409
                raise ServiceError(status, f"tokens: the prefix cannot be warmed: {exc}", "tokens") from None
            warmed = True
        return self._pinned(result, principal, ttl, note, warmed)

    def pin_prefix(self, prefix_id: str, principal: Principal, tenant: str | None, ttl: float | None,
                   note: str) -> dict:
        """Pin a cached prefix by its id from `kvctl prefixes`: the prefix as that row lists it (from
        the first token to the end of the row). No text needed; its tenant pays. Parts of it in
        a lower tier come back to the device and pin as they land."""
        self.require_ready()
        tree, _ = self.prefix_tree()
        first = self.resolve_prefix(prefix_id, tree)
        keys = tree.path(first)
        node, top = tree.nodes[tree.node_of[first]], tree.nodes[tree.node_of[keys[0]]]
        if top.detached:
            raise ServiceError(409, f"prefix: {prefix_id!r} is unreachable (the blocks before it are cached "
                                    "nowhere); pin it by its text to compute them again", "prefix")
        owner = node.tenant
        if owner is None:
            raise ServiceError(409, f"prefix: whose prefix {prefix_id!r} is, is not known; pin it by its text "
                                    "with --tenant", "prefix")
        if tenant is not None and tenant != owner:
            raise ServiceError(400, f"tenant: prefix {first.hex()[:16]} is tenant {owner!r}'s, not {tenant!r}'s",
                               "tenant")
        body = self._pin_keys(keys, owner, principal, ttl, note, principal.actor, f"prefix={first.hex()[:16]}",
                              "prefix")
        body["prefix_id"] = first.hex()[:16]
        return body

    def pin_copy(self, keys: list[bytes], tenant: str, principal: Principal, ttl: float | None, note: str,
                 owner: str | None) -> dict:
        """Pin a prefix by its block keys, as another replica of the fleet has it pinned (kvd
        router's `kvctl fleet sync-pins`): no text needed. What a lower tier here holds of it (a
        shared Redis, say) comes up pinned; the rest is pinned as the prefix is computed here."""
        self.require_ready()
        return self._pin_keys(keys, tenant, principal, ttl, note, owner or principal.actor,
                              f"keys={keys[-1].hex()[:16]}", "keys")

    def _pin_keys(self, keys: list[bytes], tenant: str, principal: Principal, ttl: float | None, note: str,
                  owner: str, target: str, param: str) -> dict:
        """Pin `keys` for `tenant` (its budget pays), bring what lower tiers hold of them up, and
        record it; a refusal is audited under `target` and named by `param`."""
        engine = self.engine
        try:
            with self.lock:
                result = engine.cache.pin_keys(tenant, keys, ttl=ttl, owner=owner, note=note)
        except PinBudgetExceeded as exc:  # (audited outside the lock, as in pin())
            self.store.audit(actor=principal.actor, tenant=tenant, action="pin", target=target,
                             result="refused", detail={"reason": str(exc)})
            raise ServiceError(409, str(exc)) from None
        except InvalidRequest as exc:
            raise ServiceError(400, str(exc), param) from None
        if result.pending_blocks and self.tiers is not None:  # what a lower tier holds comes up, pinned
            from . import tier_ops

            tier_ops.restore_chain(self, keys, tenant)
        return self._pinned(result, Principal(tenant, principal.role, principal.actor), ttl, note, warmed=False)

    def _pinned(self, result, principal: Principal, ttl: float | None, note: str, warmed: bool) -> dict:
        """Record a pin that took (store and audit) and describe it."""
        engine = self.engine
        with self.lock:
            cached = engine.cache.lookup(result.pin.keys)
        pin = result.pin
        try:
            self.store.save_pin({"pin_id": pin.pin_id, "tenant": pin.tenant,
                                 "keys": ",".join(k.hex() for k in pin.keys), "owner": pin.owner,
                                 "note": pin.note, "created_at": time.time(),
                                 "expires_at": None if ttl is None else time.time() + ttl})
        except StoreUnavailable as exc:  # a pin that would not survive a restart is no pin
            if not result.refreshed:
                with self.lock:
                    engine.cache.unpin(pin.pin_id)
            raise ServiceError(503, f"{exc}: " + ("the pin's new expiry holds until kvd restarts" if result.refreshed
                                                   else "nothing was pinned"), "pin") from None
        body = {**self._pin_times(pin.describe(), engine.clock()), "cached_blocks": cached, "warmed": warmed,
                "refreshed": result.refreshed}
        self.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin", target=pin.pin_id,
                         result="ok", detail={"blocks": pin.num_blocks, "ttl": ttl, "note": note})
        return body

    def _warm(self, token_ids: list[int], principal: Principal) -> None:
        """Prefill a prefix so its blocks are cached (and so pinned): one token of output."""
        done = threading.Event()
        self.submit([token_ids], SamplingParams(max_tokens=1, ignore_eos=True), principal,
                    lambda event: done.set() if event.finish_reason else None)
        done.wait(timeout=120)

    def unpin(self, pin_id: str, principal: Principal) -> dict:
        engine = self.require_ready()
        with self.lock:
            try:
                engine.cache.pins.get(pin_id)
            except UnknownPin as exc:
                hint = "" if pin_id.startswith("pin-") else "; pin ids start with pin- (kvctl pins lists them)"
                raise ServiceError(404, str(exc) + hint, "pin_id") from None
        try:  # from the store first: an unpin it could not record would come back at the next start
            self.store.delete_pin(pin_id)
        except StoreUnavailable as exc:
            raise ServiceError(503, f"{exc}: the pin stands", "pin_id") from None
        with self.lock:
            try:
                pin = engine.cache.unpin(pin_id)
            except UnknownPin as exc:  # it lapsed or went meanwhile
                raise ServiceError(404, str(exc), "pin_id") from None
        self.store.audit(actor=principal.actor, tenant=principal.tenant, action="unpin", target=pin_id,
                         result="ok", detail={"blocks": pin.num_blocks})
        return {"pin_id": pin_id, "unpinned_blocks": pin.num_blocks}

    def list_pins(self, with_keys: bool = False) -> list[dict]:
        """Every pin; `with_keys`: also its block keys (hex), which another replica of the same block
        space can pin by (`pin_copy`)."""
        engine = self.require_ready()
        with self.lock:
            pins, now = engine.cache.pins.all(), engine.clock()
            return [{**self._pin_times(p.describe(), now), "cached_blocks": engine.cache.lookup(p.keys),
                     **({"keys": [k.hex() for k in p.keys]} if with_keys else {})} for p in pins]

    def _pin_times(self, described: dict, now: float) -> dict:
        """A pin's engine-clock times as Unix times, with the seconds it has left (None: until unpinned)."""
        expires = described["expires_at"]
        return {**described, "created_at": self._unix_time(described["created_at"], now),
                "expires_at": self._unix_time(expires, now),
                "expires_in_seconds": None if expires is None else max(expires - now, 0.0)}

    def _restore_pins(self) -> list[str]:
        """Pins survive restarts: re-register them by key (they re-pin blocks as they fill).
        Returns the ids of those that lapsed while kvd was down, for the caller to take off the
        store (not here, under the engine's lock, where a locked store would hold up the start)."""
        now, lapsed = time.time(), []
        for row in self.store.pins():
            remaining = None if row["expires_at"] is None else row["expires_at"] - now
            if remaining is not None and not math.isfinite(remaining):  # stored before ttls had to be finite
                log.warning("pin %s: its stored expiry is not a time; kept until unpinned", row["pin_id"])
                remaining = None
            if remaining is not None and remaining <= 0:
                lapsed.append(row["pin_id"])
                continue
            keys = [bytes.fromhex(k) for k in row["keys"].split(",")]
            try:
                self.engine.cache.pin_keys(row["tenant"], keys, ttl=remaining, owner=row["owner"],
                                           note=row["note"])
            except PinBudgetExceeded as exc:
                log.warning("pin %s not restored: %s", row["pin_id"], exc)
        return lapsed

    def _forget_stored_pin(self, pin_id: str) -> None:
        """Take a lapsed pin off the store; one the store cannot take now stays there, lapsed, and
        the next start drops it (a full disk must not stop kvd loading or its expiry loop)."""
        try:
            self.store.delete_pin(pin_id)
        except StoreUnavailable as exc:
            log.warning("pin %s lapsed but stays in the store until the next start: %s", pin_id, exc)

    def expire_pins(self) -> None:
        with self.lock:
            lapsed = self.engine.cache.expire_pins() if self.engine else []
        for pin in lapsed:
            self._forget_stored_pin(pin.pin_id)
            self.store.audit(actor="ttl", tenant=pin.tenant, action="unpin", target=pin.pin_id,
                             result="expired", detail={})

    # ---- eviction and explanation ------------------------------------------------------------
    def resolve_prefix(self, prefix_id: str, tree: PrefixTree) -> bytes:
        """The block key that `prefix_id` names, as git resolves a short hash: at least 4 hex
        digits, and refused when several prefixes match, so that a short id never evicts or moves
        more than the prefix meant. Ids of `tree`'s nodes (what `kvctl prefixes` lists) come
        first; any other cached block's id works too, so that an id listed before the tree
        changed (a sibling evicted, nodes merged) still names the same block."""
        text = prefix_id.strip().lower()
        if not is_short_hex(text):
            raise ServiceError(400, f"prefix: give at least 4 hex digits of an id from `kvctl prefixes`, "
                                    f"got {prefix_id!r}", "prefix")
        matches = sorted(k for k in tree.nodes if k.hex().startswith(text)) or \
            sorted(k for k in tree.node_of if k.hex().startswith(text))
        if not matches:
            raise ServiceError(404, f"prefix: no cached prefix {prefix_id!r}", "prefix")
        if len(matches) > 1:
            shown = ", ".join(r.hex()[:16] for r in matches[:4]) + (", ..." if len(matches) > 4 else "")
            raise ServiceError(409, f"prefix: {prefix_id!r} matches {len(matches)} prefixes ({shown}); "
                                    "give more digits", "prefix")
        return matches[0]

    def evict(self, *, prefix_id: str | None, tenant: str | None, model_revision: str | None,
              all_unpinned: bool, principal: Principal, purge_once: str | None = None) -> dict:
        """Evict from every tier and say exactly what went. A tenant's or an old revision's entries
        are also searched for on the shared Redis, whichever daemon wrote them; with `purge_once`
        (a fleet eviction's token, from kvd router) only if this daemon is the first to claim it
        there: another replica on the same Redis searches it once for all."""
        engine = self.require_ready()
        chosen = [x for x in (prefix_id, tenant, model_revision) if x] + ([True] if all_unpinned else [])
        if len(chosen) != 1:
            raise ServiceError(400, "evict: give exactly one of prefix, tenant, model_revision, all_unpinned")
        subtree: list[bytes] | None = None
        if prefix_id:  # the prefix and every prefix that extends it; the one it branches from stays
            tree, _ = self.prefix_tree()
            first = self.resolve_prefix(prefix_id, tree)
            subtree = tree.subtree_keys(first)
        other_spaces, records_error = {}, None  # the revision's spaces but the served one: from disk and Redis
        if model_revision:
            revision, other_spaces, records_error = self._revision_spaces(model_revision)
            served = revision == self.loaded.revision
        with self.lock:
            if model_revision and revision != self.loaded.revision:
                report_blocks, skipped, select = 0, {}, None
                target = f"model_revision={revision[:16]}"
            else:
                if subtree is not None:
                    select = None
                    target = f"prefix={first.hex()[:16]}"
                elif tenant:  # a block's own record of its tenant, else its tree's
                    select = lambda root, info, owner: (owner or (info.tenant if info else None)) == tenant  # noqa: E731
                    target = f"tenant={tenant}"
                else:
                    select = lambda root, info, owner: True  # noqa: E731
                    target = "model_revision=current" if model_revision else "all_unpinned"
                if subtree is None:
                    report = engine.cache.evict_where(select)
                else:  # the device's part of it (lower tiers' copies are dropped below)
                    report = engine.cache.evict_prefix([k for k in subtree if engine.cache.pool.block_of(k) is not None])
                report_blocks, skipped = report.evicted_blocks, report.skipped
            roots = dict(engine.cache.roots)
            pinned = set(engine.cache.pins.key_counts())  # their lower-tier copies stay too
        lower_dropped = still_moving = 0
        doomed: list[bytes] = []
        if self.tiers is not None and subtree is not None:  # an eviction removes the prefix from every tier
            doomed = [k for k in subtree if k not in pinned]
        elif self.tiers is not None and select is not None:
            doomed = [k for k, (m, _) in self.tiers.known_metas().items()
                      if k not in pinned and select(m.root, roots.get(m.root), m.tenant)]
        if doomed:  # blocks on their way to disk or Redis land first, then go with the rest
            still_moving = self.tiers.wait_for_writes(doomed, EVICT_WRITE_WAIT_S)
            lower_dropped = self.tiers.drop(doomed)
        result = "ok" if not skipped.get("in_use") and not still_moving else "partial"
        body = {"evicted_blocks": report_blocks, "skipped": skipped, "result": result, "target": target,
                "lower_tier_blocks_dropped": lower_dropped}
        remote = self.tiers.remote if self.tiers is not None else None
        if model_revision and (other_spaces or (records_error and not served)):
            # another revision: its blocks everywhere, the shared Redis too. The served one: what this
            # daemon's disk holds of its older scales (daemons still serving them share the Redis's)
            body.update(self._purge_spaces(other_spaces, None if served else records_error, shared=not served,
                                           purge_once=purge_once))
            result = body["result"] = "partial" if body.get("message") else result
        elif remote is not None and (subtree is not None or (tenant and select is not None)):
            try:  # the shared Redis: every daemon's entries of the prefix, or of the tenant
                if subtree is not None:  # the keys this daemon's tree names: deleted by name, no search
                    body["remote_purge"] = remote.purge_keys([k for k in subtree if k not in pinned])
                elif purge_once is not None and not remote.claim(purge_once):
                    body["remote_purge"] = {"by_another_replica": True}  # it searches the shared Redis
                else:
                    body["remote_purge"] = remote.purge(
                        lambda m: m.key not in pinned and select(m.root, roots.get(m.root), m.tenant))
            except RemoteUnavailable as exc:
                body["remote_purge"] = {"error": str(exc)}
            purge = body["remote_purge"]
            if not purge.get("complete") and not purge.get("by_another_replica"):
                result = body["result"] = "partial"
                body["message"] = (f"the shared Redis could not be searched: {purge['error']}" if "error" in purge
                                   else f"the shared Redis was searched only in part ({purge['seen']:,} entries "
                                        "before the time limit); run the eviction again")
        if still_moving:
            body["lower_tier_blocks_still_moving"] = still_moving
            body["message"] = "; ".join(filter(None, [body.get("message"), (
                f"{still_moving} blocks were still being written to disk or Redis after {EVICT_WRITE_WAIT_S:g} s "
                f"and were not dropped; run the eviction again")]))
        if skipped.get("in_use"):
            body["message"] = "; ".join(filter(None, [f"{skipped['in_use']} blocks are in use by running requests "
                                                      "and were not evicted", body.get("message")]))
        self.store.audit(actor=principal.actor, tenant=principal.tenant, action="evict", target=target,
                         result=result, detail=body)
        return body

    def _revision_spaces(self, text: str) -> tuple[str, dict[str, dict], str | None]:
        """The model revision `text` (hex digits) names, the block spaces of it that the disk
        folder or the shared Redis records other than the one served now (older scales, another
        format, another revision: spaces.py), and why the shared Redis could not be asked."""
        from kvctl.daemon.cache.tiers import space_digest
        from kvctl.daemon.cache.tiers.spaces import with_revision

        if not is_short_hex(text):
            raise ServiceError(400, f"model_revision: give at least 4 lowercase hex digits of a revision (kvctl "
                                    f"status shows the model's), got {text!r}", "model_revision")
        records, error = self.tiers.space_records() if self.tiers is not None else ({}, None)
        served = space_digest(self.engine).hex()
        matched = {s: r for s, r in with_revision(records, text).items() if s != served}
        revisions = {r["model_revision"] for r in matched.values()}
        if self.loaded.revision.startswith(text):
            revisions.add(self.loaded.revision)
        if len(revisions) > 1:
            shown = ", ".join(sorted(r[:16] for r in revisions))
            raise ServiceError(409, f"model_revision: {text!r} matches {len(revisions)} revisions ({shown}); "
                                    "give more digits", "model_revision")
        if not revisions:
            known = sorted({r["model_revision"][:16] for r in records.values()} - {self.loaded.revision[:16]})
            where = (f"; the shared Redis could not be asked ({error})" if error else "") + \
                (f"; the tiers have held blocks of {', '.join(known)}" if known else "")
            raise ServiceError(503 if error else 404,
                               f"model_revision: no tier here holds blocks of {text!r} (this daemon serves "
                               f"{self.loaded.revision[:16]}{where})", "model_revision")
        return revisions.pop(), matched, error

    def _purge_spaces(self, spaces: dict[str, dict], records_error: str | None, shared: bool = True,
                      purge_once: str | None = None) -> dict:
        """Delete the blocks of these spaces (none served here) from the disk folder and, with
        `shared`, from the shared Redis, whichever daemon wrote them (with `purge_once`, unless
        another replica claimed it there): the body's part that says what went."""
        from kvctl.daemon.cache.tiers.spaces import summary

        chosen = {bytes.fromhex(s) for s in spaces}
        out: dict = {"spaces": [summary(s, r) for s, r in sorted(spaces.items())]}
        messages = [f"the shared Redis could not be asked which spaces it holds: {records_error}"] if records_error else []
        disk = self.tiers.disk if self.tiers is not None else None
        if disk is not None and chosen:
            out["disk_purge"] = disk.purge_spaces(chosen)
        remote = self.tiers.remote if self.tiers is not None else None
        if remote is not None and chosen and shared and not records_error:
            total = {"dropped": 0, "seen": 0, "complete": True}
            try:
                if purge_once is not None and not remote.claim(purge_once):
                    out["remote_purge"] = {"by_another_replica": True}
                    chosen = set()  # searched by the replica that claimed it
                for space in sorted(chosen):
                    done = remote.purge_space(space)
                    total = {"dropped": total["dropped"] + done["dropped"], "seen": total["seen"] + done["seen"],
                             "complete": total["complete"] and done["complete"]}
                    if not done["complete"]:
                        break
            except RemoteUnavailable as exc:
                total = {**total, "complete": False, "error": str(exc)}
            out.setdefault("remote_purge", total)
            if "error" in total:
                messages.append(f"the shared Redis could not be searched: {total['error']}")
            elif not total["complete"]:
                messages.append(f"the shared Redis was searched only in part ({total['seen']:,} entries before the "
                                "time limit); run the eviction again")
        if messages:
            out["message"] = "; ".join(messages)
        return out

    def route_facts(self, token_ids: list[int], tenant: str) -> dict:
        """This replica for this prompt, as a router weighs it: the prompt's tokens its device
        cache holds, and its load (see `Engine.predicted_wait`). Also the tenant it looked in, the
        namespace's other fields (a router that computes keys itself notices a change: new
        scales, say) and the model it serves (a router sends a request naming one only where it is
        served). Hashes before taking the lock."""
        engine = self.require_ready()
        keys = engine.prefix_keys(tenant, token_ids)[2]
        size = engine.settings.block_size
        with self.lock:
            hits = engine.cache.lookup(keys, len(token_ids)) if token_ids else 0
            limit = engine.cache.cacheable_blocks(len(token_ids))
            queue = engine.queue_figures()
        # the run after the device's part that lower tiers hold, per tier (the next block's tier
        # first), and what restoring it costs: the tiers have locks of their own
        run = self.tiers.lower_run(keys[hits:limit]) if self.tiers is not None else {}
        rates = self.tiers.read_rates() if self.tiers is not None else {}
        block_bytes = self.tiers.layout.block_bytes if self.tiers is not None else 0
        return {"prompt_tokens": len(token_ids), "cached_tokens": hits * size,
                # where the next block is, when a lower tier holds it (a restore, not a recompute)
                "lower_tier": next(iter(run), None), **queue, "tenant": tenant,
                "namespace": engine.namespace_fields(), "model": self.model_name,
                "lower_tier_tokens": {tier: blocks * size for tier, blocks in run.items()},
                "restore_seconds": restore_seconds(run, block_bytes, rates), "restore_rates": rates,
                "block_bytes": block_bytes, "draining": self.draining, "chat_template": self.chat_template_digest}

    def explain(self, token_ids: list[int], tenant: str) -> dict:
        engine = self.require_ready()
        size = engine.settings.block_size
        with self.lock:
            cache = engine.cache
            keys = chain_keys(engine.namespace(tenant), token_ids)
            cacheable = cache.cacheable_blocks(len(token_ids))
            hits = cache.lookup(keys, len(token_ids))
            body = {"prompt_tokens": len(token_ids), "block_size": size, "full_blocks": len(keys),
                    "hit_blocks": hits, "hit_tokens": hits * size, "tenant": tenant}
            if len(token_ids) < size:
                body["first_miss"] = {"block": 0, "reason": "shorter_than_a_block",
                                      "detail": f"{len(token_ids)} tokens is less than one block of {size}; "
                                                "only full blocks are cached"}
            elif hits >= cacheable and len(token_ids) % size:
                rest = len(token_ids) % size
                body["first_miss"] = {"block": hits, "reason": "partial_block",
                                      "detail": f"every full block hit; the last {rest} tokens fill only part "
                                                f"of a block of {size}, and only full blocks are cached"}
            elif hits >= cacheable:
                body["first_miss"] = {"block": hits, "reason": "last_token_computed",
                                      "detail": f"every block but the last hit; the last token is always computed, "
                                                f"so its block of {size} is computed again"}
            else:
                key = keys[hits]
                logged = cache.pool.eviction_log.get(key)
                lower = self.tiers.location(key) if self.tiers is not None else "evicted"
                other = [t for t in sorted({i.tenant for i in cache.roots.values()}) if t != tenant
                         and cache.pool.block_of(chain_keys(engine.namespace(t), token_ids[:(hits + 1) * size])[hits])
                         is not None]
                device_clock = engine.clock()
        if "first_miss" not in body:  # outside the lock: reading the event log does not hold up the engine
            body["first_miss"] = self._cached_miss(engine, hits, key, lower, logged, other, device_clock)
            if lower != "evicted":
                body["first_miss"].update(self._lower_tier_run(engine, keys[hits:cacheable]))
        return body

    def _lower_tier_run(self, engine: Engine, keys: list[bytes]) -> dict:
        """What the next request would do with the run of blocks lower tiers hold after the device's
        part: restore or recompute it (the tiering policy, at the measured rates), and how long it
        would wait for the disk's or Redis's part to come up (the prefetch policy)."""
        tiers, size = self.tiers, engine.settings.block_size
        run = tiers.lower_run(keys)
        blocks = sum(run.values())
        if not blocks:
            return {}
        restore = restore_seconds(run, tiers.layout.block_bytes, tiers.read_rates())
        recompute = blocks * size / engine.prefill_rate.rate
        slowest = next(t for t in ("remote", "disk", "host") if t in run)
        restores = tiers.policy.should_restore(blocks * size, sum(n * tiers.block_bytes_in(t) for t, n in run.items()),
                                               tiers.stats[slowest].read)
        fetched = (run.get("disk", 0) + run.get("remote", 0)) * size
        policy = engine.prefetch
        wait = policy.deadline(0.0, fetched) if fetched else 0.0
        where = ", ".join(f"{n} on {t}" for t, n in run.items())
        measured = tiers.stats[slowest].read.samples > 0 and engine.prefill_rate.samples > 0
        rates = "the measured rates" if measured else "assumed rates (nothing measured yet)"
        detail = (f"{blocks} blocks from here are in lower tiers ({where}): restoring them takes about "
                  f"{restore * 1e3:,.1f} ms at {rates}, recomputing them about {recompute * 1e3:,.1f} ms, "
                  f"so the next request {'restores' if restores else 'recomputes'} them")
        part = " and ".join(name for tier, name in (("disk", "disk"), ("remote", "Redis")) if run.get(tier))
        if restores and fetched:
            detail += (f"; it is admitted at once with what has come up from {part} (prefetch_policy best_effort)"
                       if policy.policy == "best_effort" else
                       f"; it waits until the {part} reads end (prefetch_policy wait_complete)"
                       if wait == float("inf") else
                       f"; it waits up to {wait:,.2f} s for the {part} part to come up (prefetch_policy timeout)")
        return {"detail": detail, "lower_tier_blocks": run, "restore_seconds": restore,
                "recompute_seconds": recompute, "restores": restores,
                "prefetch_wait_seconds": None if wait == float("inf") or not (restores and fetched) else wait}

    def _cached_miss(self, engine: Engine, block: int, key: bytes, lower: str, logged, other: list[str],
                     device_clock: float) -> dict:
        """Why a block that could be cached is not on the device: in a lower tier; dropped from
        one (the event log says which and why); evicted from the device (its eviction log);
        another tenant's; or unknown to kvd since it started. Names the block for `kvctl events --key`."""
        removal = engine.events.last(1, ("removed",), key=KeyPrefix(key, None)).events
        if lower != "evicted":
            miss = {"reason": "in_lower_tier", "tier": lower,
                    "detail": f"on the {lower} tier; the next request restores it instead of recomputing"}
        elif removal and removal[0].tier != "device":  # it left the device, then a lower tier too
            event = removal[0]
            ago = max(0.0, time.time() - event.at)
            miss = {"reason": "evicted", "tier": event.tier,
                    "detail": f"evicted from the {event.tier} tier {now_minus(ago, 0.0)} ago "
                              f"{REMOVAL_WORDS[event.reason]}",
                    "evicted_by": event.reason, "seconds_ago": ago}
        elif logged is not None:
            at, reason = logged
            miss = {"reason": "evicted", "tier": "device",
                    "detail": f"evicted {now_minus(device_clock, at)} ago " + (
                        "to make room: its tenant held more idle blocks than its cache share" if reason == "tenant_share"
                        else f"by {'an operator' if reason == 'operator' else reason + ' eviction'}"),
                    "evicted_by": reason, "seconds_ago": device_clock - at}
        elif other:
            miss = {"reason": "other_namespace", "detail": f"cached for tenant {other[0]!r}; tenants never share blocks"}
        else:
            started = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started_at))
            miss = {"reason": "never_cached",
                    "detail": f"no request has filled this block under this namespace since kvd started ({started})"}
        return {"block": block, **miss, "key": key.hex()[:16]}  # the key: its life in `kvctl events --key`


REMOVAL_WORDS = {"capacity": "to make room", "tenant_share": "to make room, its tenant holding more idle blocks than "
                 "its cache share", "filesystem": "to make room on a filesystem running short of space",
                 "operator": "by an operator", "corrupt": "after it failed verification",
                 "unwritten": "(the step that was to write it never ran)",
                 "gone": "(deleted outside this daemon: on the shared Redis by its memory policy or another "
                         "daemon, or its disk segment from the folder)",
                 "space": "(written under scales or a format this daemon no longer serves)"}


def prefetch_settings(cfg: KvdConfig) -> dict:
    """The engine's prefetch settings from the daemon's config."""
    return {"prefetch_policy": cfg.prefetch_policy, "prefetch_timeout": cfg.prefetch_timeout,
            "prefetch_timeout_per_1k_tokens": cfg.prefetch_timeout_per_1k_tokens}


def now_minus(now: float, then: float) -> str:
    seconds = max(0.0, now - then)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def gpu_status() -> list[dict] | None:
    """Memory and utilisation of each GPU through NVML, or None where there is none."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                        "memory_used": memory.used, "memory_total": memory.total, "utilization": util.gpu})
        return out
    finally:
        pynvml.nvmlShutdown()


PREFIX_SORTS = {"recent": None, "hits": "hits", "size": "bytes"}  # the figure each order sorts by


def _tree_order(rows: list[dict]) -> list[dict]:
    """Prefix rows depth first, each row's children right after it; trees, and the children of a
    row, most recently used first. (A client that sorts by one figure keeps this order in ties.)"""
    def recency(row: dict) -> tuple:
        return (-(row["last_use"] or 0), row["prefix_id"])

    ids = {row["prefix_id"] for row in rows}
    children: dict[str | None, list[dict]] = {}
    for row in rows:  # a row whose parent is not among them (a tree's first, or a subtree's) is a top
        children.setdefault(row["parent_id"] if row["parent_id"] in ids else None, []).append(row)
    out: list[dict] = []
    todo = sorted(children.get(None, []), key=recency, reverse=True)
    while todo:
        row = todo.pop()
        out.append(row)
        todo.extend(sorted(children.get(row["prefix_id"], []), key=recency, reverse=True))
    return out

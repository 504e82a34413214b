"""The engine: schedules requests against the cache core and runs the model, one step at a time.

Each `step()`:

1. admits waiting sequences in queue order while the cache can hold their prompt (minus
   cached prefix) plus the output reservation, up to `max_running` (head-of-line: the first
   that does not fit waits for room); one whose prefix is still coming up from disk or Redis
   waits as the prefetch policy says while those behind it go ahead (prefix_fetch.py);
2. plans a batch within `max_batch_tokens`: one token for every decoding sequence, then
   prompt chunks for prefilling ones (long prompts take several steps). With
   `quick_prefill_tokens`, prompts that have at most that many tokens left (a prefix hit's
   remainder, a long prompt's last chunk) first get a step of their own, never two in a row;
3. takes cache slots for the batch; a sequence that cannot grow triggers preemption by
   recomputation: the lowest-ranked running sequence gives back its blocks and waits again,
   keeping its output, and later recomputes it (with prefix hits) before continuing;
4. runs the model once over the batch and samples where a prompt completed or a decode ran.

With `speculation` (speculative.py), a decode also carries a draft of the tokens that followed
its latest words earlier in its context; the step keeps the draft's run the sequence would have
taken anyway and one token more, so a repetitive reply takes fewer steps.

Sampling randomness depends only on (seed, sample index, step), so preemption, chunking and
prefix hits never change the tokens a request gets.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy
import torch

from kvctl.daemon.cache import CacheFull, KVCacheManager, Namespace, PinBudgetExceeded, PinLeavesNoRoom, PrefixHasher
from kvctl.daemon.cache.pins import pin_origin
from kvctl.daemon.cache.events import EventLog
from kvctl.daemon.cache.hit_curve import HitCurve, alone_tenants, sizes_for
from kvctl.kernels import cache_dtype, copy_blocks, copy_blocks_ref
from kvctl.policies.admission import Verdict, pinned_out_reason, tenant_limit_reason
from kvctl.policies.queue_order import (LPM_MAX_WAITING, by_prefix, by_priority, check_queue_order, goes_before,
                                       longest_prefix_first, lpm_patience)
from kvctl.policies.reservation import parse_reservation
from kvctl.policies.speculation import NgramSpeculation
from kvctl.policies.tenant_map import any_queue_wait
from kvctl.policies.tiering import PrefetchWait, RateMeter

from ..model.llama import ForwardBatch, LoadedModel, StagedWeights
from ..model.memory import caches_released, release_caches, restore_caches
from ..model.tokenizer import first_outside_vocab
from . import prefix_fetch
from .logits import RowTokens, adjust_rows
from .requests import Request, RequestMetrics, Sequence, SeqStatus
from .sampling import ContextLengthExceeded, Draw, RequestError, SamplingParams, draw_tokens
from .speculative import Speculator
from .structured import GrammarVocabulary

from .tenant_book import (DEFAULT_LIMIT, EVICTED, EXPLICIT, HIT, PROMPT, RECOMPUTED, REJECTED, RETAINED,
                          TenantBook)

LOOK = object()  # _mask_to_grammars: a row whose mask its grammar gives now (not one made ahead)
QUEUE_TIMEOUT_LOG_S = 10.0  # the log says how many requests timed out in the queue at most this often

log = logging.getLogger("kvd.engine")


class AdmissionRejected(Exception):
    """The request was turned away before anything was allocated; the message says why, `kind`
    names the limit: never_fits, pinned_out, queue_full or tenant_limit. (A request turned away
    from the queue later, pinned_out or queue_timeout, ends its samples with "error" instead.)"""

    def __init__(self, request: Request, reason: str, kind: str = "never_fits") -> None:
        self.request, self.kind = request, kind
        super().__init__(reason)


@dataclass(frozen=True)
class EngineSettings:
    num_blocks: int
    block_size: int = 16
    max_batch_tokens: int = 256  # prompt chunk budget per step (decodes count one each)
    max_running: int = 16  # sequences in the batch at most
    max_loras: int | None = None  # LoRA adapters (their weights) in the batch at most; None: no limit
    max_queue: int = 256  # waiting requests before new ones are rejected
    # seconds a request may wait to be admitted before it is turned away (queue_timeout); 0: no limit
    max_queue_wait: float = 0.0
    tenant_queue_waits: tuple[tuple[str, float], ...] = ()  # (tenant, seconds; 0: none): overrides max_queue_wait
    max_tenant_requests: int | None = None  # one tenant's requests in flight (waiting, running) at most
    tenant_request_limits: tuple[tuple[str, int], ...] = ()  # (tenant, limit): overrides max_tenant_requests
    reservation: str = "fraction:1.0"  # output reservation policy (see policies.reservation)
    eviction: str = "lru"
    # or "priority": higher priority first, FIFO within a priority; or "lpm": the longest cached prefix
    # first; or "priority+lpm": lpm's order within each priority (policies.queue_order)
    queue_order: str = "fifo"
    cache_dtype: str = "auto"  # auto (the model's), fp8_e4m3, fp8_e5m2 or int8
    keep_layers: tuple[int, ...] = ()  # layers whose cache stays in the model dtype
    # prompts with at most this many tokens left run in a step of their own ahead of the decodes
    # (0: always in the decodes' step); see Engine._plan
    quick_prefill_tokens: int = 0
    # (tenant, fraction) pairs, "*" for the others: under pressure, over-share tenants' idle blocks go first
    tenant_cache_shares: tuple[tuple[str, float], ...] = ()
    max_tracked_tenants: int = DEFAULT_LIMIT  # tenants whose counters are kept by name (tenant_book.py)
    # how long a waiting request holds out for its prefix to come up from disk or Redis
    # (policies.tiering.PrefetchWait): timeout, best_effort or wait_complete
    prefetch_policy: str = "timeout"
    prefetch_timeout: float = 2.0
    prefetch_timeout_per_1k_tokens: float = 0.0
    # the longest context served (prompt + max_tokens), below the model's own limit (vLLM's
    # --max-model-len); None: the model's. A chat that leaves max_tokens out reserves up to it.
    max_model_len: int | None = None
    # speculative decoding by prompt lookup (vLLM's speculative_config, method ngram); None: off
    speculation: NgramSpeculation | None = None
    # requests' predictions (OpenAI's Predicted Outputs) are drafted only while at most this many
    # sequences run; None: at any batch size
    prediction_max_batch: int | None = None
    # a model whose every layer slides a window: give back each sequence's blocks before its window
    # (False keeps them all, as for full attention: `kvctl bench window`'s baseline)
    release_window_blocks: bool = True
    hit_curve: bool = True  # follow reuse distances for what other cache sizes would have served (hit_curve.py)
    # tenants the hit curve follows alone, in caches of their own (none named: those tenant_cache_shares names)
    hit_curve_tenants: tuple[str, ...] = ()


def prefetch_wait(settings: EngineSettings) -> PrefetchWait:
    """The prefetch policy the settings name (the engine's, and again on a live reload)."""
    return PrefetchWait(settings.prefetch_policy, settings.prefetch_timeout, settings.prefetch_timeout_per_1k_tokens)


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    index: int  # sample index
    token_id: int | None  # None for a sequence ended without a new token (cancelled)
    finish_reason: str | None
    # when the request asks for logprobs: the token's, and the most likely alternatives' (Sequence.logprobs)
    logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None


@dataclass
class EngineStats:
    """Running totals for metrics and status; the engine only adds to them."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    hit_tokens: int = 0  # of those, served from the prefix cache
    recomputed_tokens: int = 0  # tokens computed again after preemption
    preemptions: int = 0
    # requests admitted while one that arrived earlier still waited: passed over by queue_order (lpm,
    # priority), or waiting for its prefix to come up or be computed, or for a LoRA adapter's turn
    admitted_ahead: int = 0
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count
    finished: int = 0
    restored_tokens: int = 0  # prompt tokens brought back from a lower tier instead of recomputed
    # of the requests that finished (not cancelled): the blocks they held at their finish, and those of
    # their output reservation they never wrote (what a shorter reservation would have left free)
    finished_blocks: int = 0
    reserved_unused_blocks: int = 0
    # requests' prompt cache breakpoints by what became of each: held, extended, pinned (an operator's
    # pin holds it), short (under a block), over_budget (the tenant's pins), no_room (pin_room_tokens)
    breakpoints: dict[str, int] = field(default_factory=dict)
    # per cache call; drained by the server (an engine used without one keeps the latest 65,536)
    alloc_seconds: deque = field(default_factory=lambda: deque(maxlen=65536))
    # model steps by kind: decode, mixed, prefill, and quick (a short prefill ahead of the decodes)
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)  # wall time of those steps (admission to tokens)
    # per tenant, for the latest max_tracked_tenants: prompt, hit and recomputed tokens as the totals
    # above count them, and requests rejected (any reason); the rest summed as retired
    tenants: TenantBook = field(default_factory=lambda: TenantBook(DEFAULT_LIMIT))
    # requests whose prefix was fetched from disk or Redis, by how their wait ended (PREFETCH_OUTCOMES)
    prefetch_outcomes: dict[str, int] = field(default_factory=dict)
    prefetch_staged_blocks: int = 0  # blocks those fetches had staged when their requests were admitted
    # seconds from each fetch's start to its request's admission: drained by the server's histogram,
    # and the latest 2,000 kept for percentiles
    prefetch_waits: deque = field(default_factory=lambda: deque(maxlen=65536))
    recent_prefetch_waits: deque = field(default_factory=lambda: deque(maxlen=2000))


class Engine:
    def __init__(self, loaded: LoadedModel, settings: EngineSettings,
                 clock: Callable[[], float] = time.monotonic,
                 scales: dict[int, tuple[list[float], list[float]]] | None = None,
                 scale_version: str = "") -> None:
        if settings.max_model_len is not None and settings.max_model_len > loaded.config.context_limit:
            raise ValueError(f"max_model_len: {settings.max_model_len} is more than kvd can serve of this model: "
                             f"{loaded.config.context_limit_text()}")
        check_queue_order(settings.queue_order)
        if settings.max_batch_tokens < 1 or settings.max_running < 1 or settings.max_queue < 1:
            raise ValueError("max_batch_tokens, max_running and max_queue must be >= 1")
        if settings.quick_prefill_tokens < 0:
            raise ValueError(f"quick_prefill_tokens: must be >= 0, got {settings.quick_prefill_tokens}")
        if settings.max_loras is not None and settings.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {settings.max_loras}")
        self.loaded, self.model, self.settings, self.clock = loaded, loaded.model, settings, clock
        self.tokenizer = loaded.tokenizer
        self.cache_dtype = None if settings.cache_dtype == "auto" else cache_dtype(settings.cache_dtype)
        self.scale_version = scale_version
        self.cache = KVCacheManager(settings.num_blocks, settings.block_size, policy=settings.eviction,
                                    block_bytes=self.model.cache_bytes_per_block(
                                        settings.block_size, self.cache_dtype, settings.keep_layers),
                                    clock=clock, window=loaded.config.sliding_window
                                    if loaded.config.every_layer_slides and settings.release_window_blocks else None,
                                    step_tokens=settings.max_batch_tokens)
        self.cache.set_tenant_shares(settings.tenant_cache_shares)
        # the blocks each other cache format would hold in this cache's memory, for the hit curve's sizes
        self.format_blocks = self._format_blocks()
        if settings.hit_curve:  # what other sizes would have served
            self.cache.hit_curve = HitCurve(sizes_for(settings.num_blocks, extra=self.format_blocks.values()),
                                            tenants=settings.max_tracked_tenants, clock=clock)
            self.cache.hit_curve.follow_alone(alone_tenants(settings.hit_curve_tenants, settings.tenant_cache_shares),
                                              settings.num_blocks)
        self.events = EventLog()  # every block indexed in or dropped from a tier, for routers and operators
        self.prefill_rate = RateMeter(rate=2000.0)  # prompt tokens per second, measured on prefill steps
        self.cache.pool.events = self.events
        self.kv_caches = self.model.allocate_cache(settings.num_blocks, settings.block_size, self.cache_dtype,
                                                   settings.keep_layers, scales)
        self.reservation = parse_reservation(settings.reservation)
        self.eos_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # the vocabulary structured outputs are followed in (its llguidance index is built on the first shaped request)
        self.grammar_vocabulary = GrammarVocabulary(
            self.tokenizer.texts[0], loaded.config.vocab_size, self.eos_ids, self.tokenizer.token_text,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        self.requests: dict[str, Request] = {}
        self._waiting: list[tuple[tuple, Sequence]] = []
        self._running: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._quick_step_last = False  # the last step was a quick prefill step (see _plan)
        # the sequences the step in progress computes, with their tokens (None outside a step, and in
        # one before it has planned them): what a step that never ends was doing (engine_liveness.py)
        self.stepping: list[tuple[Sequence, int]] | None = None
        self.stats = EngineStats(tenants=TenantBook(settings.max_tracked_tenants))
        self.cache.pool.on_tenant_evictions = self._count_evictions
        self.admission_paused = False  # set while new scales wait for running work to drain
        # queue timeouts (max_queue_wait) not yet in the log, and when the log last said some
        self._queue_timeouts_unlogged, self._queue_timeout_logged = 0, float("-inf")
        # tenant_queue_waits as a mapping, and the settings' tuple it was made from (a reload replaces it)
        self._own_queue_waits: tuple[tuple, dict[str, float]] = ((), {})
        # ids of the requests the latest admission pass left waiting for an adapter's turn (max_loras)
        self.lora_turn_waiters: set[str] = set()
        self.tiers = None  # a TieredCache once attach_tiers() is called
        self.prefetch = prefetch_wait(settings)
        # drafts where settings.speculation is set, or a request has a prediction
        self.speculator = Speculator(settings.speculation, settings.prediction_max_batch)

    def attach_tiers(self, tiers) -> None:
        """Demote evicted blocks into `tiers` and restore prefixes from them (see daemon.cache.tiers)."""
        self.tiers = tiers
        pool, roots = self.cache.pool, self.cache.roots

        def prefix_hits(root) -> int:
            info = roots.get(root)
            return info.hits if info else 0

        pool.on_evict = lambda victims: tiers.on_device_evict(victims, prefix_hits)
        pool.inserted = [] if tiers.write_policy == "write_through" else None
        pool.reused = [] if tiers.write_policy == "write_through_selective" else None
        tiers.policy.prefill = self.prefill_rate  # restore-vs-recompute judged on the rate measured here

    # ---- the cache's memory while kvd sleeps (daemon/server/sleep_ops.py) ---------------------
    @property
    def cache_released(self) -> bool:
        return caches_released(self.kv_caches)

    def release_cache(self) -> tuple[int, int]:
        """Give back the KV cache's memory: every cached block goes from the pool, pinned ones too
        (their pins stay), and the K/V storage is freed; the books (hits, evictions) stay. Only
        with no request here (RuntimeError, and nothing changes). Returns (blocks dropped, bytes
        given back)."""
        live = sum(1 for r in self.requests.values() if not r.finished)
        if live or self.has_work():
            raise RuntimeError(f"the KV cache is released only with no request in the engine ({live} there)")
        report = self.cache.release_all()
        self.model.forget_plans()  # its copies and slices of cached blocks
        return report.evicted_blocks, release_caches(self.kv_caches)

    def restore_cache(self) -> int:
        """Take the KV cache's memory again, empty; returns its bytes."""
        return restore_caches(self.kv_caches)

    # ---- identity ----------------------------------------------------------------------------
    def namespace(self, tenant: str, adapter: str = "") -> Namespace:
        """The prefix cache's namespace of `tenant`'s prompts, under LoRA adapter `adapter` ("": the
        base model): an adapter's K/V differ from the base model's, so its blocks are its own."""
        return self._namespace(tenant, self.adapter(adapter).digest if adapter else "")

    def space_key(self) -> bytes:
        """The block space served (Namespace.space_key): what the tiers' payloads, a pin's keys and
        a cached tree must have been made in to be of use here."""
        return self.namespace("*").space_key()

    def block_space(self) -> str:
        """The block space served, in hex (as pins, answers and the store name it)."""
        return self.space_key().hex()

    def _namespace(self, tenant: str, adapter_id: str) -> Namespace:
        return Namespace(model_revision=self.loaded.revision, tokenizer_digest=self.tokenizer.digest,
                         adapter_id=adapter_id, cache_dtype=self.layout(), scale_version=self.scale_version,
                         block_size=self.settings.block_size, tenant=tenant)

    def request_namespace(self, request: Request) -> Namespace:
        """The namespace of `request`'s blocks: under the adapter it came for, as it was then."""
        return self._namespace(request.tenant, request.lora.digest if request.lora is not None else "")

    def adapter(self, name: str):
        """The LoRA adapter served as `name` (daemon/model/lora.py); RequestError names it if none is."""
        adapter = self.loaded.adapters.get(name)
        if adapter is None:
            served = ", ".join(repr(a) for a in self.loaded.adapters) or "none"
            raise RequestError(f"model: no LoRA adapter {name!r} is loaded (adapters: {served})")
        return adapter

    def namespace_fields(self) -> dict:
        """The namespace's fields less the tenant: with a tenant, what anyone needs to compute
        the keys this engine gives a prompt (a router does, `kvd router --view events`)."""
        fields = asdict(self.namespace("default"))
        del fields["tenant"]
        return fields

    def layout(self) -> str:
        """The cache format as the namespace records it, e.g. 'fp8_e4m3 keep=0,3' or 'float32'."""
        if self.cache_dtype is None:
            return str(self.model.dtype).replace("torch.", "")
        keep = ",".join(str(i) for i in sorted(self.settings.keep_layers))
        return self.settings.cache_dtype + (f" keep={keep}" if keep else "")

    def set_scales(self, scales: dict[int, tuple[list[float], list[float]]], scale_version: str) -> tuple[int, int]:
        """Load new scales into every quantised layer. Blocks written under the old ones become
        unreachable (the scale version is in the namespace): they go now, from the device but for
        pinned ones, and from host memory (disk and Redis keep theirs, which `kvctl evict
        --model-revision` purges, and which replicas still on the old scales share). Returns how
        many went (device, host). Call only with nothing running."""
        for layer, cache in enumerate(self.kv_caches):
            if cache.k_scale is not None and layer in scales:
                cache.k_scale.copy_(torch.tensor(scales[layer][0]))
                cache.v_scale.copy_(torch.tensor(scales[layer][1]))
        self.scale_version = scale_version
        return self._drop_unreachable()

    def serve_weights(self, weights, revision: str, path) -> tuple[int, int]:
        """Serve other weights of the same architecture and tokenizer (daemon/server/weights_ops.py),
        from `path`, whose revision is `revision`: `weights` on the device (checkpoint names) take
        the place of those served, or StagedWeights in host memory are copied into them in place.
        The revision is in the namespace, so the blocks cached under the one before become
        unreachable: they go now, as after new scales (returns how many, device and host). Call
        only with nothing running."""
        if isinstance(weights, StagedWeights):
            self.model.copy_weights_in(weights)
        else:
            self.model.use_weights(weights)
        self.loaded.revision, self.loaded.path = revision, path
        return self._drop_unreachable()

    def _drop_unreachable(self) -> tuple[int, int]:
        """Drop the cached trees of another block space than the one served now: from the device
        but for pinned blocks, and from host memory. Returns how many went (device, host)."""
        served = self.space_key()
        device = self.cache.evict_stale(served).evicted_blocks
        host = 0
        if self.tiers is not None:
            host = self.tiers.drop_host_trees({root for root, info in self.cache.roots.items() if info.stale(served)})
        return device, host

    def _count_evictions(self, by_tenant) -> None:
        """Each tenant's cached blocks evicted to make room, in its counters (kvctl tenants)."""
        book = self.stats.tenants
        for tenant, count in by_tenant.items():
            if tenant is not None:
                book.add_quietly(tenant, EVICTED, count)

    def loaded_scales(self) -> dict[int, tuple[list[float], list[float]]]:
        """The scales the kernels will read, straight from the cache tensors (for the status check)."""
        return {layer: (c.k_scale.tolist(), c.v_scale.tolist()) for layer, c in enumerate(self.kv_caches)
                if c.k_scale is not None}

    # ---- requests ----------------------------------------------------------------------------
    @property
    def context_limit(self) -> int:
        """The longest context served: max_model_len where set, else the model's (config.context_limit)."""
        return self.settings.max_model_len or self.loaded.config.context_limit

    def context_limit_text(self) -> str:
        """What `context_limit` is, for an error message."""
        if self.settings.max_model_len:
            return f"max_model_len {self.settings.max_model_len}"
        return self.loaded.config.context_limit_text()

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (ContextLengthExceeded for length) naming what is wrong with a prompt
        and its sampling parameters; cheap checks first, so an oversized prompt is refused
        before anything walks its tokens. Safe from any thread. (A shape is checked by
        `prepare_grammars`.)"""
        vocab = self.loaded.config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise RequestError("prompt: must hold at least one token")
        if len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ContextLengthExceeded(f"max_tokens: prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) "
                                        f"exceeds {self.context_limit_text()}")
        bad = first_outside_vocab(prompt_ids, vocab)
        if bad is not None:
            raise RequestError(f"prompt: token ids must lie in [0, {vocab}), found {prompt_ids[bad]!r}")

    def prepare_grammars(self, params: SamplingParams, samples: int) -> list | None:
        """For a shaped request: RequestError naming the field when its shape cannot be followed,
        else the starts in its grammar (structured.GrammarState) of its first `samples` samples
        (at least one: the matcher that checked it), compiled here, in the caller's thread, to hand
        to `add_request` (`grammars`), so that no step compiles them. None without a shape."""
        if params.constraint is None:
            return None
        return self.grammar_vocabulary.prepare(params.constraint, max(1, samples))

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, tenant: str = "default", reservation=None,
                    cohort: str | None = None, prefix_keys: tuple | None = None,
                    prompt_checked: bool = False, grammars: list | None = None, adapter: str = "",
                    speculation=None) -> Request:
        """Queue a request, or raise AdmissionRejected (nothing allocated) / RequestError.

        `prefix_keys`: what `prefix_keys(tenant, prompt_ids)` returned, computed by the submitter
        outside the engine's step, so a long prompt is not hashed inside one (where every decode
        of the batch would wait for it). Keys computed for other ids are ignored; admission also
        checks that the namespace has not changed since. `prompt_checked`: the submitter ran
        `check_prompt` and `prepare_grammars` already (outside the step), so its walk over the
        tokens is not repeated here; `grammars`, the starts `prepare_grammars` compiled for this
        prompt's samples (a sample without one compiles its own at its first draw). `adapter`: the
        LoRA adapter that computes it ("": the base model). `speculation`: a SpeculationOverride (a
        rollout cohort's speculative_config) in place of the engine's; None: the engine's."""
        lora = self.adapter(adapter) if adapter else None  # one not loaded is refused before anything is queued
        if not prompt_checked:
            self.check_prompt(prompt_ids, params)
            grammars = self.prepare_grammars(params, params.n)
        request_id = request_id or f"req-{secrets.token_hex(6)}"
        if request_id in self.requests and not self.requests[request_id].finished:
            raise RequestError(f"request_id: {request_id!r} is already in flight")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = Request(request_id, list(prompt_ids), params, seed, tenant, priority,
                          next(self._order), RequestMetrics(arrival=self.clock()), reservation=reservation,
                          cohort=cohort, grammars=list(grammars) if grammars else None, adapter=adapter,
                          lora=lora, speculation=speculation)
        total = self.settings.num_blocks
        reserve = self._reservation(request).reserve(params.max_tokens)
        needed = self.cache.peak_blocks(len(prompt_ids) + reserve)
        # at its longest: a sequence the whole cache cannot hold would, once alone, wait for room
        # that never comes (and every request behind it with it), however little it reserved
        # (under a sliding window, its longest is its window's blocks)
        longest = self.cache.peak_blocks(len(prompt_ids) + params.max_tokens)
        if prefix_keys is not None and (not (prefix_keys[4] is prompt_ids or prefix_keys[4] == prompt_ids)
                                        or prefix_keys[3].private != params.cache_private):
            prefix_keys = None  # hashed from other tokens (or not as its own): hashed again where needed
        pinned, room = 0, total
        # pinned blocks are never evicted: they count against it, but for those of its own prefix
        # (counted only when pins could stand in its way: the keys they hold bound their blocks)
        if longest > total - self.cache.pool.num_pin_keys:
            if prefix_keys is None:
                prefix_keys = self._keys_in(self.request_namespace(request), list(prompt_ids), params.cache_private)
            pinned, room = self.cache.room_beside_pins(prefix_keys[2], reuse=not request.scoring)
        kind = None
        if needed > total:
            kind, request.rejected = "never_fits", (f"request {request_id}: needs {needed} blocks for its prompt and "
                                                    f"output reservation but the cache has {total}; it can never fit")
        elif longest > total:
            kind, request.rejected = "never_fits", (
                f"request {request_id}: its prompt and max_tokens ({params.max_tokens}) need {longest} blocks but the "
                f"cache has {total}; it could never finish (its output reservation, {reserve} tokens, fits): lower "
                "max_tokens")
        elif reason := pinned_out_reason(request_id, longest, pinned, total, room):
            kind, request.rejected = "pinned_out", reason
        elif self._queued_requests() >= self.settings.max_queue:
            kind, request.rejected = "queue_full", (f"request {request_id}: admission queue full "
                                                    f"({self._queued_requests()} of {self.settings.max_queue} waiting)")
        elif (limit := self.tenant_request_limit(tenant)) is not None:
            in_flight = sum(1 for r in self.requests.values() if r.tenant == tenant and not r.finished)
            own = tenant in dict(self.settings.tenant_request_limits)
            request.rejected = tenant_limit_reason(request_id, tenant, in_flight, limit,
                                                   f"tenant_request_limits[{tenant}]" if own else "max_tenant_requests")
            kind = "tenant_limit" if request.rejected else None
        if request.rejected:
            request.rejected_kind = kind
            self.stats.rejections[kind] = self.stats.rejections.get(kind, 0) + 1
            self.stats.tenants.row(tenant)[REJECTED] += 1
            raise AdmissionRejected(request, request.rejected, kind)
        self.requests[request_id] = request
        first = Sequence(f"{request_id}/0", request, 0, prefix_keys=prefix_keys)
        request.sequences.append(first)
        self._enqueue(first)
        if self.tiers is not None and not request.scoring:
            prefix_fetch.start(self, request)
        return request

    def queue_wait_limit(self, tenant: str) -> float:
        """Seconds a request of `tenant` may wait to be admitted (0: no limit): its tenant's own
        (tenant_queue_waits), else max_queue_wait."""
        given, own = self._own_queue_waits
        if given is not self.settings.tenant_queue_waits:  # (once per reload: asked per waiting request a step)
            given, own = self.settings.tenant_queue_waits, dict(self.settings.tenant_queue_waits)
            self._own_queue_waits = (given, own)
        return own.get(tenant, self.settings.max_queue_wait)

    def tenant_request_limit(self, tenant: str) -> int | None:
        """The most requests `tenant` may have in flight: its own limit, else max_tenant_requests."""
        return dict(self.settings.tenant_request_limits).get(tenant, self.settings.max_tenant_requests)

    def prefix_keys(self, tenant: str, token_ids: list[int], adapter: str = "",
                    params: SamplingParams | None = None) -> tuple:
        """(namespace, token count, block keys, hasher after them, the ids) for these tokens: safe
        to call without the engine's lock (it reads configuration only; a namespace that changes
        before admission is noticed there). `params`: the request's, where it hashes part of its
        prompt as its own (SamplingParams.cache_private: PrefixHasher's `private`)."""
        return self._keys_in(self.namespace(tenant, adapter), token_ids,
                             params.cache_private if params is not None else None)

    @staticmethod
    def _keys_in(namespace: Namespace, token_ids: list[int], private: tuple[int, bytes] | None = None) -> tuple:
        hasher = PrefixHasher(namespace, private=private)
        return namespace, len(token_ids), hasher.feed(token_ids), hasher, token_ids

    def _prefix_keys(self, seq: Sequence) -> tuple[list, PrefixHasher]:
        """Block keys of the sequence's tokens and a hasher positioned after them. Computed once
        (or handed in by add_request) and kept while the sequence waits; again only if its tokens
        or namespace change."""
        tokens = seq.all_tokens
        memo = seq.prefix_keys
        request = seq.request
        namespace = self.request_namespace(request)
        if memo is None or memo[0] != namespace or memo[1] != len(tokens):
            memo = seq.prefix_keys = self._keys_in(namespace, tokens, request.params.cache_private)
        return memo[2], memo[3].copy()

    def fetching_prefix(self, request: Request) -> bool:
        """Whether the request waits while its prefix comes up from disk or Redis right now."""
        return prefix_fetch.fetching(self, request)

    def cancel(self, request_id: str) -> list[TokenEvent]:
        """Stop a request wherever it is; its blocks come back exactly once.

        Returns one "cancelled" event per sample that had not finished (empty if the request
        is unknown or already done)."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return []
        request.cancelled = True
        if self.tiers is not None:
            prefix_fetch.end(self, request, "cancelled")
        for seq in request.sequences:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "cancelled")
        done = {s.index for s in request.sequences if s.finish_reason != "cancelled"}
        return [TokenEvent(request_id, i, None, "cancelled") for i in range(request.params.n)
                if i not in done]

    def fail(self, request_id: str, kind: str, reason: str) -> list[TokenEvent]:
        """Stop a request kvd itself failed (an engine step raised while it was in flight): its
        samples end with "error", its blocks come back exactly once, and `reason` is what its
        client is told (`request.rejected`; `kind` its rejected_kind: the server answers a 500, not
        an answer cut short)."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return []
        return self._end_in_error(request, kind, reason)

    def _turn_away_pinned_out(self, request: Request, needed: int) -> list[TokenEvent]:
        """Turn away a queued request that pins alone keep out: pinned after it came, or it grew
        alone until they left it no room. Waiting would hold every request behind it for as long
        as the pins stand."""
        pinned, room = self.cache.room_beside_pins((), reuse=False)  # (what its prefix holds is not in `needed`)
        reason = pinned_out_reason(request.request_id, needed, pinned, self.settings.num_blocks, room,
                                   queued=True) or f"request {request.request_id}: pins keep it out"
        log.warning("%s", reason)
        return self._turn_away(request, "pinned_out", reason)

    def _time_out_waiting(self) -> list[TokenEvent]:
        """Turn away the requests that have waited their limit or longer without being admitted
        (queue_timeout; `queue_wait_limit`: their tenant's, else max_queue_wait): their clients, or a
        router, can try elsewhere instead of waiting on. A request admitted once (preempted since,
        or some of its samples running) waits on. The log says how many, at most once every
        QUEUE_TIMEOUT_LOG_S."""
        settings = self.settings
        if not self._waiting or not any_queue_wait(settings.max_queue_wait, settings.tenant_queue_waits):
            return []
        now = self.clock()
        late = {}
        for _, seq in self._waiting:
            request = seq.request
            limit = self.queue_wait_limit(request.tenant)
            if (seq.status is SeqStatus.WAITING and request.metrics.admitted is None and limit > 0
                    and now - request.metrics.arrival >= limit):
                late[request.request_id] = (request, limit)
        if not late:
            return []
        running, waiting = self.num_running, self._queued_requests()
        own = dict(settings.tenant_queue_waits)
        failed = []
        for request, limit in late.values():
            setting = f"tenant_queue_waits[{request.tenant}]" if request.tenant in own else "max_queue_wait"
            failed += self._turn_away(request, "queue_timeout", (
                f"request {request.request_id}: waited {now - request.metrics.arrival:.1f} s without being admitted, "
                f"{setting} {limit:g} s ({running} running, {waiting} waiting); try again later or elsewhere"))
        self._queue_timeouts_unlogged += len(late)
        if now - self._queue_timeout_logged >= QUEUE_TIMEOUT_LOG_S:
            log.warning("%d request%s turned away after waiting %s without being admitted "
                        "(queue_timeout); %d running, %d waiting", self._queue_timeouts_unlogged,
                        "" if self._queue_timeouts_unlogged == 1 else "s",
                        "their tenant's limit (tenant_queue_waits) or max_queue_wait" if own else
                        f"max_queue_wait ({settings.max_queue_wait:g} s)", self.num_running,
                        self._queued_requests())
            self._queue_timeouts_unlogged, self._queue_timeout_logged = 0, now
        return failed

    def _turn_away(self, request: Request, kind: str, reason: str) -> list[TokenEvent]:
        """Turn away a queued request (`kind`: pinned_out, queue_timeout): its samples end with
        "error" (their blocks come back); `reason` is `request.rejected`, which the API answers with."""
        self.stats.rejections[kind] = self.stats.rejections.get(kind, 0) + 1
        self.stats.tenants.row(request.tenant)[REJECTED] += 1
        return self._end_in_error(request, kind, reason)

    def _end_in_error(self, request: Request, kind: str, reason: str) -> list[TokenEvent]:
        """End each sample of `request` not finished yet with "error" (their blocks come back),
        `reason` and `kind` what the API answers its client with (`rejected`, `rejected_kind`)."""
        request.rejected, request.rejected_kind = reason, kind
        if self.tiers is not None:
            prefix_fetch.end(self, request, "cancelled")
        done = {s.index for s in request.sequences if s.status is SeqStatus.FINISHED}
        for seq in request.sequences:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "error")
        return [TokenEvent(request.request_id, i, None, "error") for i in range(request.params.n) if i not in done]

    def waiting(self) -> list[Sequence]:
        """Sequences waiting for admission, in queue order (stale heap entries skipped)."""
        return [s for _, s in sorted(self._waiting, key=lambda e: e[0]) if s.status is SeqStatus.WAITING]

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _waiting_work(self) -> list[tuple[Sequence, int, int]]:
        """Each waiting sequence in queue order, with the blocks of its tokens the cache holds and
        the tokens it lacks there (what admitting it will compute)."""
        size, rows = self.settings.block_size, []
        for seq in self.waiting():
            tokens = len(seq.request.prompt_ids) + len(seq.output_ids)
            hits = self._cached_blocks(seq)
            rows.append((seq, hits, max(tokens - hits * size, 0)))
        return rows

    def _cached_blocks(self, seq: Sequence) -> int:
        """Leading blocks of a waiting sequence's tokens the device cache holds now (none for a
        prompt scored position by position: it takes nothing from the cache)."""
        if seq.request.scoring:
            return 0
        keys, _ = self._prefix_keys(seq)  # hashed once, kept for its admission
        return self.cache.lookup(keys, len(seq.request.prompt_ids) + len(seq.output_ids))

    def admission_queue(self) -> list[tuple[Sequence, int]]:
        """The waiting sequences in the order the next admission pass tries them (under
        queue_order lpm, whether or not the batch has room now), each with the leading blocks of its
        tokens the device cache holds: what `kvctl requests` shows of the queue. Call under the
        service lock."""
        work = [(seq, hits) for seq, hits, _ in self._waiting_work()]
        if not by_prefix(self.settings.queue_order):
            return work
        now = self.clock()
        return longest_prefix_first(work, lambda item: item[1], lambda item: self._lpm_overdue(item[0], now),
                                    place=lambda item: -item[0].request.priority
                                    if by_priority(self.settings.queue_order) else 0)

    def tokens_ahead(self, cached_blocks: int | None = None,
                     work: list[tuple[Sequence, int, int]] | None = None, priority: int | None = None) -> int:
        """Prompt tokens the engine must compute before a request arriving now: what running
        prefills have left, and what waiting requests lack in the cache (`work`: `_waiting_work`,
        if already taken). Under queue_order lpm, for a prompt whose first `cached_blocks` blocks
        the cache holds: only the waiting requests lpm would try first (those holding as many
        blocks or more, and those past its patience). Under queue_order priority, for a request of
        engine `priority` (higher first): only the waiting requests of that priority or higher.
        Under priority+lpm, both: those of a higher priority, and of its own those lpm tries first."""
        ahead = sum(max(s.prefill_target - s.num_computed, 0) for s in self._running.values()
                    if s.status is SeqStatus.PREFILL)
        work = self._waiting_work() if work is None else work
        order = self.settings.queue_order
        blocks = cached_blocks if cached_blocks is not None and by_prefix(order) and len(work) <= LPM_MAX_WAITING \
            else None
        newcomer_place = -priority if priority is not None and by_priority(order) else None
        now = self.clock()
        for seq, hits, missing in work:
            if goes_before(-seq.request.priority, newcomer_place, lambda: hits, lambda: self._lpm_overdue(seq, now),
                           blocks):
                ahead += missing
        return ahead

    def priority_waiting(self, work: list[tuple[Sequence, int, int]] | None = None) -> list[list[int]] | None:
        """Under queue_order priority: the uncached prompt tokens of the waiting requests by their
        place (lower first, as tenant_priorities and a request's own priority give it), lowest
        place first: [[place, tokens], ...]. A router that knows a request's place takes the work
        of worse places off the wait it reported for one at the worst (ReplicaView.facts). None
        otherwise. `work`: as for `tokens_ahead`."""
        if self.settings.queue_order != "priority":
            return None  # (priority+lpm: priority_lpm_waiting)
        work = self._waiting_work() if work is None else work
        by_place: dict[int, int] = {}
        for seq, _, missing in work:
            place = -seq.request.priority
            by_place[place] = by_place.get(place, 0) + missing
        return [[place, by_place[place]] for place in sorted(by_place)]

    def priority_lpm_waiting(self, work: list[tuple[Sequence, int, int]] | None = None) -> list[list] | None:
        """Under queue_order priority+lpm: the uncached prompt tokens of the waiting requests by their
        place and the cached blocks each holds, [[place, blocks, tokens], ...], blocks None for those
        that go first at their place whatever a newcomer holds (past lpm's patience, or preempted; all
        of them beyond LPM_MAX_WAITING, where each place keeps its arrival order). A router that knows
        a request's place and its prompt's cached blocks takes off the wait it was told what waits at
        a worse place, or at its own holding fewer blocks (ReplicaView.facts). None otherwise."""
        if self.settings.queue_order != "priority+lpm":
            return None
        work = self._waiting_work() if work is None else work
        ordered, now = len(work) <= LPM_MAX_WAITING, self.clock()
        grouped: dict[tuple, int] = {}
        for seq, hits, missing in work:
            held = hits if ordered and not self._lpm_overdue(seq, now) else None
            key = (-seq.request.priority, held)
            grouped[key] = grouped.get(key, 0) + missing

        def rank(key: tuple) -> tuple:  # by place; at one place those that go first, then the most blocks first
            place, held = key
            return place, held is not None, -(held or 0)

        return [[place, held, grouped[place, held]] for place, held in sorted(grouped, key=rank)]

    def lpm_waiting(self, work: list[tuple[Sequence, int, int]] | None = None) -> list[list[int]] | None:
        """Under queue_order lpm (up to LPM_MAX_WAITING waiting): the uncached prompt tokens of the
        waiting requests that lpm may yet put after a newcomer (those short of its patience), by the
        cached blocks each holds, most blocks first: [[blocks, tokens], ...]. A router that knows
        how many of a prompt's blocks the replica holds takes those of fewer blocks off the wait it
        reported for a prompt holding none (ReplicaView.facts). None otherwise. `work`: as for
        `tokens_ahead`."""
        if self.settings.queue_order != "lpm":
            return None
        work = self._waiting_work() if work is None else work
        if len(work) > LPM_MAX_WAITING:
            return None
        now = self.clock()
        by_blocks: dict[int, int] = {}
        for seq, hits, missing in work:
            if not self._lpm_overdue(seq, now):  # (an overdue one goes first, whatever a newcomer holds)
                by_blocks[hits] = by_blocks.get(hits, 0) + missing
        return [[blocks, by_blocks[blocks]] for blocks in sorted(by_blocks, reverse=True)]

    def predicted_wait(self, ahead: int | None = None) -> float | None:
        """Seconds before a request arriving now starts computing: `tokens_ahead` (or `ahead`,
        already counted) at the measured prefill rate; None until a prefill step has been measured."""
        if not self.prefill_rate.samples:
            return None
        return (self.tokens_ahead() if ahead is None else ahead) / self.prefill_rate.rate

    def adapter_requests(self) -> dict[str, dict[str, int]]:
        """Each LoRA adapter's requests in flight: running (some sample admitted) and waiting.
        An adapter a reload took away is counted while its requests finish. Call under the
        service lock."""
        counts = {name: {"running": 0, "waiting": 0} for name in self.loaded.adapters}
        for request in self.requests.values():
            if request.adapter and not request.finished:
                waiting = all(s.status is SeqStatus.WAITING for s in request.sequences)
                counts.setdefault(request.adapter, {"running": 0, "waiting": 0})[
                    "waiting" if waiting else "running"] += 1
        return counts

    def retiring_adapters(self) -> list[dict]:
        """The LoRA adapters a reload took away or gave other weights to that requests in flight
        still run on: name, digest (the weights they run on) and their requests. Call under the
        service lock."""
        found: dict[int, dict] = {}
        for request in self.requests.values():
            lora = request.lora
            if lora is not None and not request.finished and self.loaded.adapters.get(request.adapter) is not lora:
                row = found.setdefault(id(lora), {"name": request.adapter, "digest": lora.digest, "requests": 0,
                                                  "replaced": request.adapter in self.loaded.adapters})
                row["requests"] += 1
        return list(found.values())

    def queue_figures(self, cached_blocks: int | None = None, priority: int | None = None,
                      tenant: str | None = None) -> dict:
        """The queue as /admin/status and /admin/route-facts report it: waiting and running
        requests, the oldest's age, the prompt tokens ahead of a new request and its predicted
        wait (of one whose first `cached_blocks` the cache holds, and of engine `priority`: see
        `tokens_ahead`), the measured prefill rate (None until measured), and the longest wait
        allowed (`tenant`'s, else max_queue_wait; None: no limit), with the tenants' own limits
        (`tenant_queue_waits`) where some have them; under queue_order lpm, `lpm_waiting` too,
        under priority, `priority_waiting`, and under priority+lpm, `priority_lpm_waiting`. Call under
        the service lock."""
        work = self._waiting_work()  # (one lookup per waiting request, for every figure)
        waiting = [seq for seq, _, _ in work]
        now = self.clock()
        ahead = self.tokens_ahead(cached_blocks, work, priority)
        rate = self.prefill_rate
        figures = {"waiting": len(waiting),
                   "oldest_age_seconds": max((now - s.request.metrics.arrival for s in waiting), default=0.0),
                   "running": self.num_running, "tokens_ahead": ahead,
                   "prefill_tokens_per_second": rate.rate if rate.samples else None,
                   "predicted_wait_seconds": self.predicted_wait(ahead),
                   "max_queue_wait_seconds": (self.settings.max_queue_wait if tenant is None else
                                              self.queue_wait_limit(tenant)) or None}
        if self.settings.tenant_queue_waits:  # (seconds; 0: none) for a router's view of each tenant's limit
            figures["tenant_queue_waits"] = dict(self.settings.tenant_queue_waits)
        lpm, ranked, both = self.lpm_waiting(work), self.priority_waiting(work), self.priority_lpm_waiting(work)
        if lpm is not None:
            figures["lpm_waiting"] = lpm
        if ranked is not None:
            figures["priority_waiting"] = ranked
        if both is not None:
            figures["priority_lpm_waiting"] = both
        return figures

    def has_work(self) -> bool:
        return bool(self._running) or any(s.status is SeqStatus.WAITING for _, s in self._waiting)

    def _reservation(self, request: Request):
        """The request's reservation policy: its rollout cohort's, else the engine's."""
        return request.reservation or self.reservation

    def _queued_requests(self) -> int:
        return len({s.request.request_id for _, s in self._waiting if s.status is SeqStatus.WAITING})

    def _rank(self, seq: Sequence) -> tuple:
        priority = seq.request.priority if by_priority(self.settings.queue_order) else 0
        return (-priority, seq.request.order, seq.index)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (self._rank(seq), seq))

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        try:
            return self._step()
        finally:
            self.stepping = None  # (a step that ended, or raised, computes nothing now)

    def _step(self) -> list[TokenEvent]:
        step_started = time.perf_counter()
        if self.cache_released:  # the service refuses work while asleep: never here
            raise RuntimeError("the KV cache is released (kvd is asleep): no step runs until it is taken again")
        failed = self._admit()
        plan = self._plan()
        if not plan:
            return failed
        plan, copies = self._take_slots(plan)
        if not plan:
            return failed
        self.stepping = plan
        if copies:
            self._copy_blocks(copies)
        batch, sample_rows, scored = self._forward_batch(plan)
        started = time.perf_counter()
        logits = self.model.forward(batch, self.kv_caches)
        prefill = sum(n for seq, n in plan if seq.status is SeqStatus.PREFILL)
        if prefill >= self.settings.block_size:  # a step that computes at least a block of prompt
            self.prefill_rate.observe(sum(n for _, n in plan), time.perf_counter() - started)
        if self.tiers is not None:
            self._write_through()
        decodes = sum(1 for seq, _ in plan if seq.status is SeqStatus.DECODE)  # before _advance moves prefills on
        kind = "quick" if self._quick_step_last else (
            "decode" if decodes == len(plan) else "prefill" if decodes == 0 else "mixed")
        if scored:
            self._record_prompt_logprobs(scored, logits[len(logits) - sum(count for _, _, count in scored):])
        events = self._advance(plan, sample_rows, logits)
        if self.cache.window is not None:  # blocks before each window go back (cached) for others to use
            for seq, _ in plan:
                if seq.seq_id in self._running:
                    self.cache.slide(seq.seq_id, seq.num_computed)
        stats = self.stats
        stats.steps[kind] = stats.steps.get(kind, 0) + 1
        stats.step_seconds[kind] = stats.step_seconds.get(kind, 0.0) + time.perf_counter() - step_started
        return failed + events

    def _write_through(self) -> None:
        """Newly full blocks (write_through), or blocks on their first reuse (write_through_selective),
        go to the persistent tiers."""
        pool = self.cache.pool
        for pending in (pool.inserted, pool.reused):
            if pending:  # (a request's own blocks go nowhere: TieredCache skips them)
                self.tiers.write_through([pool.blocks[b] for b in pending])
                pending.clear()

    def _own_keys(self, seq: Sequence, start: int) -> list[bytes]:
        """The keys of the blocks `seq` wrote as its request's own (from block `start`): those of its
        block table, or where it holds none (preempted, and ended while it waited for its turn again),
        those its tokens hash to, which the blocks it wrote before were indexed under."""
        if seq.seq_id in self.cache:
            pool = self.cache.pool
            return [pool.blocks[b].key for b in self.cache.block_table(seq.seq_id)[start:]
                    if b >= 0 and pool.blocks[b].key is not None]
        return self._prefix_keys(seq)[0][start:] if seq.ever_computed else []

    def _retain(self, seq: Sequence) -> None:
        """A request that asked for `prompt_cache_retention: "24h"`: every indexed block the sequence
        holds as it finishes (its prompt's and its reply's: a conversation's next turn begins with
        both) goes to the persistent tiers, whatever the write policy (TieredCache.retain); what was
        written is counted for its tenant."""
        pool = self.cache.pool  # (its own blocks are not kept, whatever it asks: TieredCache skips them)
        blocks = [pool.blocks[b] for b in self.cache.block_table(seq.seq_id) if b >= 0]
        written = self.tiers.retain([b for b in blocks if b.key is not None])
        if written:  # (whose requests write to disk: kvctl tenants)
            self.stats.tenants.add_quietly(seq.request.tenant, RETAINED, written)

    def _hold_breakpoints(self, seq: Sequence) -> None:
        """The prefixes `seq`'s request marked with OpenAI's prompt cache breakpoints (params.extra
        "breakpoints": (tokens, seconds, ttl) each, daemon/server/cache_breakpoints.py), held for
        their lifetimes as its first sample finishes (KVCacheManager.hold): each outcome counted,
        and what was newly held noted in its metrics (its usage's cache_write_tokens). The keys are
        those of the blocks the sample holds (hashed again only where a sliding window gave some back)."""
        request = seq.request
        marks = request.params.extra.get("breakpoints")
        if not marks or request.metrics.cache_written is not None:
            return
        request.metrics.cache_written = []
        namespace = self.request_namespace(request)
        size = self.settings.block_size
        longest = max(tokens for tokens, _, _ in marks)
        pool = self.cache.pool
        keys = [pool.blocks[b].key if b >= 0 else None for b in self.cache.block_table(seq.seq_id)[:longest // size]]
        if None in keys:
            keys = self._keys_in(namespace, request.prompt_ids[:longest])[2]
        for tokens, seconds, ttl in marks:
            blocks = tokens // size
            try:
                outcome = self.cache.hold(namespace.tenant, keys[:blocks], seconds, **pin_origin(namespace)) \
                    if blocks else "short"
            except PinBudgetExceeded:
                outcome = "over_budget"
            except PinLeavesNoRoom:
                outcome = "no_room"
            self.stats.breakpoints[outcome] = self.stats.breakpoints.get(outcome, 0) + 1
            if outcome == "held":
                request.metrics.cache_written.append((blocks * size, ttl))

    PREFETCH_POLL = 0.05  # seconds an idle engine waits at most for a held request's fetch before it looks again

    def _admit(self) -> None:
        """Admit waiting sequences in queue order while they fit (the first that does not fit
        waits for room, and so does everything behind it). A sequence whose next uncached block
        a running prefill is about to compute is passed over this step, so that it reuses that
        block instead of computing the shared prefix a second time (in-batch prefix sharing).
        So is one still waiting for its prefix to come up from disk or Redis (`self.prefetch`):
        a slow fetch holds up only its own request. With nothing to run, the engine waits a
        moment for the first such fetch instead of spinning.

        Returns the events of requests turned away: ones that waited past max_queue_wait
        (`_time_out_waiting`, paused or not), and ones at the head of the queue that pins alone
        keep out (`_turn_away_pinned_out`)."""
        failed: list[TokenEvent] = self._time_out_waiting()
        if self.admission_paused:
            return failed
        held: list[Request] = []
        self._admit_in_order(held, failed)
        if held and not self._running:
            prefix_fetch.wait_for(self, held[0], self.PREFETCH_POLL)
        return failed

    def _admit_in_order(self, held: list[Request], failed: list[TokenEvent]) -> None:
        """The admission pass of `_admit`; requests passed over for their fetch go into `held`, the
        events of those turned away into `failed`.

        With `max_loras`, a request for an adapter whose weights the batch does not run yet waits
        while the batch runs that many; the model's own requests go on past it, and so do none
        of the adapters' (those of the adapters running too): it would otherwise wait as long as
        they keep coming (SGLang's lora draining fixed the same starvation). Its turn comes once
        every running request of one of the adapters in the batch has finished."""
        while self._waiting and self._waiting[0][1].status is not SeqStatus.WAITING:
            heapq.heappop(self._waiting)  # entries of cancelled sequences
        upcoming = self._upcoming_keys()
        size = self.settings.block_size
        max_loras = self.settings.max_loras
        loras = set() if max_loras is None else {  # (no walk of the batch when there is no limit)
            id(s.request.lora) for s in self._running.values() if s.request.lora is not None}
        passed = self.lora_turn_waiters = set()  # requests left waiting for an adapter's turn
        for entry in self._admission_order():
            if len(self._running) >= self.settings.max_running:
                return
            seq = entry[1]
            if seq.status is not SeqStatus.WAITING:
                continue  # a sample of a request turned away this pass
            request = seq.request
            if max_loras is not None and request.lora is not None and (
                    passed or (id(request.lora) not in loras and len(loras) >= max_loras)):
                passed.add(request.request_id)
                continue
            tokens = seq.all_tokens
            reserve = self._reservation(request).reserve(request.params.max_tokens - len(seq.output_ids))
            keys, hasher = self._prefix_keys(seq)
            reuse = not request.scoring  # a prompt scored position by position takes nothing from the cache
            if self.tiers is not None and reuse and prefix_fetch.holds(self, seq, keys, len(tokens)):
                held.append(request)
                continue  # its turn passes to the requests behind it meanwhile
            if upcoming and reuse:
                hits = self.cache.lookup(keys, len(tokens))  # (under a sliding window, past blocks evicted)
                if hits < len(keys) and keys[hits] in upcoming:
                    continue  # its prefix is being computed right now: take it next step
            decision = self.cache.can_admit(keys, len(tokens), reserve, request=seq.seq_id, reuse=reuse)
            if decision.verdict is not Verdict.ADMIT:
                if self.cache.num_sequences == 0:  # nothing runs that could give a block back: only pins
                    failed += self._turn_away_pinned_out(request, decision.needed_blocks)
                    continue
                return  # head of line waits for room (add_request refused what can never fit)
            self._waiting.remove(entry)
            heapq.heapify(self._waiting)
            started = time.perf_counter()
            admission = self.cache.admit(seq.seq_id, keys, len(tokens), reserve, tenant=request.tenant,
                                         hasher=hasher, reuse=reuse, priority=request.priority,
                                         adapter_id=request.lora.digest if request.lora is not None else "")
            self.stats.alloc_seconds.append(time.perf_counter() - started)
            if self.tiers is not None:
                prefix_fetch.end(self, request)
            now = self.clock()
            by_tenant = self.stats.tenants.row(request.tenant)
            restored = min(request.metrics.installed_tokens, admission.hit_tokens)
            request.metrics.installed_tokens = 0
            if request.metrics.admitted is None:
                passed_over = {id(e[1].request): e[1].request for e in self._waiting
                               if e[1].request.order < request.order and e[1].status is SeqStatus.WAITING}
                for earlier in passed_over.values():
                    earlier.metrics.passed_over += 1
                self.stats.admitted_ahead += bool(passed_over)
                request.metrics.admitted = now
                request.metrics.cached_tokens = admission.hit_tokens
                request.metrics.restored_tokens = restored  # part of its hits, as they are counted
                self.stats.prompt_tokens += len(tokens)
                self.stats.hit_tokens += admission.hit_tokens
                if self.cache.hit_curve is not None:
                    shareable = self.cache.cacheable_blocks(len(tokens))
                    private = request.params.cache_private  # (the blocks it hashes as its own: no cache serves them)
                    if private is not None:
                        shareable = min(shareable, private[0])
                    self.cache.hit_curve.look(keys[:shareable] if reuse else (), len(tokens), request.tenant,
                                              admission.hit_tokens)
                self.stats.restored_tokens += restored
                by_tenant[PROMPT] += len(tokens)
                by_tenant[HIT] += admission.hit_tokens
                by_tenant[EXPLICIT] += request.params.cache_private is not None  # (why its hits stop at its marks)
            else:
                recomputed = max(0, min(seq.ever_computed, len(tokens)) - admission.hit_tokens)
                request.metrics.recomputed_tokens += recomputed
                self.stats.recomputed_tokens += recomputed
                by_tenant[RECOMPUTED] += recomputed
            seq.num_computed = admission.hit_tokens
            seq.prefill_target = len(tokens)
            seq.status = SeqStatus.PREFILL
            seq.prefix_keys = None  # the cache holds them now
            self._running[seq.seq_id] = seq
            if max_loras is not None and request.lora is not None:
                loras.add(id(request.lora))
            upcoming.update(keys[admission.hit_blocks:len(tokens) // size])  # what it will compute

    def _format_blocks(self) -> dict[str, int]:
        """{format: blocks}: what the model's own dtype ("auto"), fp8_e4m3 and int8 would each hold in
        the memory this cache's blocks take (layers kept unquantised stay so), but the format served."""
        settings, size = self.settings, self.settings.block_size
        memory = settings.num_blocks * self.cache.block_bytes
        held = {}
        for name in ("auto", "fp8_e4m3", "int8"):
            if name != settings.cache_dtype:
                per_block = self.model.cache_bytes_per_block(size, None if name == "auto" else cache_dtype(name),
                                                             settings.keep_layers)
                if memory // per_block != settings.num_blocks:
                    held[name] = memory // per_block
        return held

    def _admission_order(self) -> list[tuple[tuple, Sequence]]:
        """The waiting entries in the order an admission pass tries them: queue order, or under
        queue_order lpm the longest cached prefix first, and under priority+lpm so within each
        priority (policies.queue_order)."""
        entries = sorted(e for e in self._waiting if e[1].status is SeqStatus.WAITING)
        if not by_prefix(self.settings.queue_order) or len(self._running) >= self.settings.max_running:
            return entries  # (a full batch admits none: no lookups)
        now = self.clock()
        return longest_prefix_first(entries, lambda entry: self._cached_blocks(entry[1]),
                                    lambda entry: self._lpm_overdue(entry[1], now),
                                    place=lambda entry: entry[0][0])  # (-priority under priority+lpm, else 0)

    def _lpm_overdue(self, seq: Sequence, now: float) -> bool:
        """Whether lpm puts `seq` first, whatever the others hold: it has waited its patience
        (`lpm_patience` of its tenant's queue wait limit), or it is a preempted request (admitted
        once), which goes first as under fifo (no queue wait limit ends its wait)."""
        metrics = seq.request.metrics
        if metrics.admitted is not None:
            return True
        return now - metrics.arrival >= lpm_patience(self.queue_wait_limit(seq.request.tenant))

    def _upcoming_keys(self) -> set:
        """Keys of the prompt blocks running prefills have yet to compute."""
        size = self.settings.block_size
        upcoming: set = set()
        for seq in self._running.values():
            if seq.status is SeqStatus.PREFILL:
                keys = self.cache.sequence(seq.seq_id).keys
                upcoming.update(keys[seq.num_computed // size:seq.prefill_target // size])
        return upcoming

    def _plan(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) for this step: every decode, then prompt chunks within budget.

        A quick prefill step comes first when decodes are running and some prompts have at most
        `quick_prefill_tokens` left: just those prompts, whole, so their first tokens do not wait
        for a step that also carries every decode. On a CPU a step's time grows with its rows, so
        such a step is short: with 8 decodes beside a 32-token remainder over a cached 1,024-token
        prefix, the step that gave the first token took about twice a decode step. The decodes
        wait that short step; they are never held back two steps in a row."""
        quick = self.settings.quick_prefill_tokens
        if quick and not self._quick_step_last:
            short, budget = [], self.settings.max_batch_tokens
            for seq in self._running.values():
                left = seq.prefill_target - seq.num_computed
                if seq.status is SeqStatus.PREFILL and left <= min(quick, budget):
                    short.append((seq, left))
                    budget -= left
            if short and any(s.status is SeqStatus.DECODE for s in self._running.values()):
                self._quick_step_last = True
                return short
        self._quick_step_last = False
        plan = [(s, 1) for s in self._running.values() if s.status is SeqStatus.DECODE]
        budget = self.settings.max_batch_tokens
        for seq in self._running.values():
            if seq.status is SeqStatus.PREFILL and budget > 0:
                chunk = min(seq.prefill_target - seq.num_computed, budget)
                plan.append((seq, chunk))
                budget -= chunk
        if budget > 0:  # drafts take what the prompts left of the budget (none without a speculative_config
            # or a prediction)
            running = len(self._running)
            for i, (seq, n) in enumerate(plan):
                if seq.status is not SeqStatus.DECODE:
                    break  # the decodes come first
                seq.draft = self.speculator.draft(seq, running, budget)
                budget -= len(seq.draft)
                plan[i] = (seq, 1 + len(seq.draft))
        return plan

    def _take_slots(self, plan: list[tuple[Sequence, int]]):
        """Grow every planned sequence in the cache, preempting when it is full."""
        done: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        started = time.perf_counter()
        for seq, n in plan:
            while seq.status is not SeqStatus.WAITING:
                try:
                    if seq.status is SeqStatus.DECODE:
                        copies += self.cache.append_tokens(seq.seq_id, [seq.output_ids[-1]])
                        if seq.draft:
                            try:
                                copies += self.cache.append_draft(seq.seq_id, len(seq.draft))
                            except CacheFull:  # a guess never evicts a cached prefix or preempts
                                seq.draft = []
                            n = 1 + len(seq.draft)
                    else:
                        copies += self.cache.append(seq.seq_id, n)
                    done.append((seq, n))
                    break
                except CacheFull:
                    victim = max(self._running.values(), key=self._rank)
                    self._preempt(victim)
                    done = [(s, k) for s, k in done if s is not victim]
        self.stats.alloc_seconds.append(time.perf_counter() - started)
        return done, copies

    def _preempt(self, seq: Sequence) -> None:
        self.cache.release(seq.seq_id, written_tokens=seq.num_computed)
        del self._running[seq.seq_id]
        seq.draft = []  # its draft's slots went with its blocks
        seq.ever_computed = max(seq.ever_computed, seq.num_computed)
        seq.num_computed = 0
        seq.request.metrics.preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(seq)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        device = self.model.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
        copy = copy_blocks if device.type == "cuda" else copy_blocks_ref
        for layer in self.kv_caches:
            copy(layer.k, layer.v, src, dst)

    def _forward_batch(self, plan: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[int | None], list]:
        """The step's batch; each planned sequence's row of logits to sample from (None: none this
        step); and the prompt positions whose next token's logprob a scored prompt records, as
        (request, first token index, count), their logits after the sampling rows."""
        size, device = self.settings.block_size, self.model.device
        ids, positions, slots, starts, lengths, tables, rows = [], [], [], [0], [], [], []
        sample_rows: list[int | None] = []
        scored: list[tuple[Request, int, int]] = []
        scored_rows: list[int] = []
        for seq, n in plan:
            table = self.cache.block_table_ids(seq.seq_id)  # (its own: copied below, before anything changes it)
            begin = seq.num_computed
            ids += seq.tokens_between(begin, begin + n - len(seq.draft)) + seq.draft
            positions += range(begin, begin + n)
            slots += [table[p // size] * size + p % size for p in range(begin, begin + n)]
            starts.append(starts[-1] + n)
            lengths.append(begin + n)
            tables.append(table)
            samples = seq.status is SeqStatus.DECODE or begin + n == seq.prefill_target
            sample_rows.append(len(rows) if samples else None)
            if samples:  # the last row; a draft's rows too, from the row before its first token
                rows.extend(range(starts[-1] - 1 - len(seq.draft), starts[-1]))
            request = seq.request
            if request.scoring and seq.index == 0 and seq.status is SeqStatus.PREFILL:
                # position p's logits give the logprob of prompt token p + 1: those not recorded yet
                first = max(begin, len(request.prompt_logprobs)) + 1
                last = min(begin + n, len(request.prompt_ids) - 1)
                if last >= first:
                    scored.append((request, first, last - first + 1))
                    row0 = starts[-2] + (first - 1 - begin)
                    scored_rows.extend(range(row0, row0 + last - first + 1))
        rows += scored_rows
        lora = self._lora_rows(plan, starts)
        padded = numpy.zeros((len(tables), max(len(t) for t in tables)), dtype=numpy.int32)
        for i, table in enumerate(tables):  # each a copy of C ints (256 tables of 2,048 blocks: 0.4 ms, not 46)
            padded[i, :len(table)] = table
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(padded).to(device),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            max_new_tokens=max(n for _, n in plan), max_context=max(lengths), block_content=self._block_content,
            lora=lora)
        return batch, sample_rows, scored

    def _lora_rows(self, plan: list[tuple[Sequence, int]], starts: list[int]) -> list | None:
        """The step's LoRA adapters, each with the token rows of its sequences (None: every row is
        its); None when every sequence is the base model's. Each request runs on the adapter it
        came for (`Request.lora`), whatever a reload has served under its name since."""
        spans: dict[int, tuple[object, list[range]]] = {}
        for (seq, _), begin, end in zip(plan, starts, starts[1:]):
            lora = seq.request.lora
            if lora is not None:
                spans.setdefault(id(lora), (lora, []))[1].append(range(begin, end))
        if not spans:
            return None
        device, total = self.model.device, starts[-1]
        groups = []
        for lora, ranges in spans.values():
            rows = [row for span in ranges for row in span]
            groups.append((lora, None if len(rows) == total else torch.tensor(rows, dtype=torch.int64, device=device)))
        return groups

    def _block_content(self, block_id: int):
        """What a block holds: its prefix-index key (which names the tokens, the model and the
        scales), or None while it is not indexed. The attention plan keeps its copies of blocks
        whose content has not changed across steps."""
        return self.cache.pool.blocks[block_id].key

    def _record_prompt_logprobs(self, scored: list[tuple[Request, int, int]], logits: torch.Tensor) -> None:
        """Each scored prompt token's logprob, rank and alternatives, from the rows before it."""
        at = 0
        for request, first, count in scored:
            logprobs = torch.log_softmax(logits[at:at + count].float(), dim=-1)
            at += count
            targets = torch.tensor(request.prompt_ids[first:first + count], dtype=torch.int64, device=logits.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
            alternatives = request.params.prompt_logprobs
            tops = [()] * count
            if alternatives:
                values, ids = torch.topk(logprobs, alternatives)
                tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            request.prompt_logprobs.extend(zip(chosen[:, 0].tolist(), ranks, tops))

    def _advance(self, plan, sample_rows, logits) -> list[TokenEvent]:
        now = self.clock()
        greedy = logits.argmax(-1).tolist()  # one call for the batch; sampled rows draw together
        takers: list[tuple[int, list[Sequence]]] = []  # (row, the sequence and the samples it forked)
        verdicts: list[tuple[Sequence, int]] = []  # (a sequence with a draft, its first row): drawn below
        for (seq, n), row in zip(plan, sample_rows):
            if seq.draft:  # its verdict (_verify) counts what it computed
                verdicts.append((seq, row))
                continue
            seq.num_computed += n
            if row is None:
                continue
            if seq.status is SeqStatus.PREFILL:
                seq.status = SeqStatus.DECODE
            takers.append((row, [seq] + self._fork_children(seq)))
        picks = [(s, row) for row, samples in takers for s in samples]
        # a draft's rows with the others: row i as the sequence would take it after the draft's first
        # i tokens (its verdict keeps a row's token only while the rows before it took the draft's);
        # held to a grammar, each row masked as the grammar would after those tokens, up to the row
        # the verdict must end at (GrammarState.masks_ahead), and the grammar takes the verdict's tokens
        ahead, masks_ahead, rows_of = [], {}, {}
        for seq, row in verdicts:
            if seq.request.params.constraint is None:
                rows = len(seq.draft) + 1
            else:
                masks = self._grammar_of(seq).masks_ahead(seq.draft)
                masks_ahead.update((len(picks) + len(ahead) + i, mask) for i, mask in enumerate(masks))
                rows = len(masks)
            ahead += [(seq, row + i, seq.draft[:i]) for i in range(rows)]
            rows_of[seq.seq_id] = rows
        chosen = self._choose_all([(s, row, []) for s, row in picks] + ahead, logits, greedy, masks_ahead)
        drawn_ahead = iter(chosen[len(picks):])
        chosen = chosen[:len(picks)]
        verdict_tokens = {seq_id: [next(drawn_ahead) for _ in range(rows)] for seq_id, rows in rows_of.items()}
        # the logprobs of those that ask for them, for all at once: every row a verdict drew (those
        # past the rows it keeps cost a few rows of one op, where a call of their own was a sync each)
        asking = [(row, token, s.request.params.logprobs) for (s, row), token in zip(picks, chosen)
                  if s.request.params.logprobs is not None]
        verdict_asks: dict[str, slice] = {}  # a verdict's rows among those asked
        for seq, row in verdicts:
            if seq.request.params.logprobs is not None:
                drawn = verdict_tokens[seq.seq_id]
                verdict_asks[seq.seq_id] = slice(len(asking), len(asking) + len(drawn))
                asking += [(row + i, token, seq.request.params.logprobs) for i, token in enumerate(drawn)]
        every_report = _token_logprobs(logits, asking)
        reported = iter(every_report)  # (the picks' first)
        tokens, taking = iter(chosen), iter(takers)
        events: list[TokenEvent] = []
        for (seq, _), row in zip(plan, sample_rows):  # emitted in the plan's order
            if seq.draft:
                asked = verdict_asks.get(seq.seq_id)
                events += self._verify(seq, now, verdict_tokens[seq.seq_id],
                                       None if asked is None else every_report[asked])
                continue
            if row is None:
                continue
            _, samples = next(taking)
            for s in samples:
                events.append(self._emit(s, next(tokens), now,
                                         None if s.request.params.logprobs is None else next(reported)))
        return events

    def _choose_all(self, picks: list[tuple[Sequence, int, list[int]]], logits: torch.Tensor,
                    greedy: list[int], masks_ahead: dict[int, torch.Tensor | None] | None = None) -> list[int]:
        """The token each pick (sample `s`, row of the step's logits, `ahead`: tokens this step
        chose for it before this row and has not emitted yet) takes: the batch's argmax where
        nothing reshapes a greedy choice (no tensor op per row: each costs µs on a CPU, a launch
        on a GPU); else its row, copied out with the others that draw, adjusted (logits.adjust_rows)
        and masked by its grammar, which then takes the token, where those apply, each for all
        its rows at once, then drawn in one draw_tokens call (sampling.py). `masks_ahead`: by pick,
        the mask of a verdict's row its grammar gave looking ahead (its grammar takes the verdict's
        tokens in _verify, not here)."""
        masks_ahead = masks_ahead or {}
        tokens: list[int | None] = []
        drawing: list[int] = []  # the picks that draw, in order
        for i, (s, row, _) in enumerate(picks):
            params = s.request.params
            if params.temperature == 0 and not params.adjusts_logits and params.constraint is None:
                tokens.append(greedy[row])
                continue
            tokens.append(None)
            drawing.append(i)
        if drawing:
            drawers = [picks[i] for i in drawing]
            scores = logits[torch.tensor([row for _, row, _ in drawers], device=logits.device)].float()
            self._adjust(scores, drawers)
            self._mask_to_grammars(scores, drawers, [masks_ahead.get(i, LOOK) for i in drawing])
            drawn = iter(draw_tokens(scores, [Draw(s.request.params, s.request.seed, s.index,
                                                   len(s.output_ids) + len(ahead)) for s, _, ahead in drawers]))
            tokens = [next(drawn) if t is None else t for t in tokens]
        for i, ((s, _, _), token) in enumerate(zip(picks, tokens)):
            if s.request.params.constraint is not None and i not in masks_ahead:
                s.grammar.consume(token)
        return tokens

    def _adjust(self, scores: torch.Tensor, picks: list[tuple[Sequence, int, list[int]]]) -> None:
        """The penalties, bias and minimum length of the picks whose requests set them, on their
        rows of `scores` (one per pick), after each one's output and `ahead` (adjust_rows touches
        only the ids a row's controls name: the other rows cost nothing)."""
        if not any(s.request.params.adjusts_logits for s, _, _ in picks):
            return
        adjust_rows(scores, [RowTokens(s.request.params, s.output_ids + ahead if ahead else s.output_ids,
                                       s.request.prompt_tokens_on(scores.device)
                                       if s.request.params.repetition_penalty != 1.0 else None)
                             for s, _, ahead in picks], self.eos_ids)

    def _grammar_of(self, s: Sequence):
        """Sample `s`'s place in its grammar: compiled when the request was checked, else here."""
        if s.grammar is None:
            s.grammar = s.request.take_grammar(s.index) or self.grammar_vocabulary.follow(s.request.params.constraint)
        return s.grammar

    def _mask_to_grammars(self, scores: torch.Tensor, picks: list[tuple[Sequence, int, list[int]]],
                          given: list) -> None:
        """The tokens each pick's grammar leaves out, at -inf on its row of `scores`: the step's
        masks made on the host (`given`: by pick, one made already, or LOOK to ask its grammar now),
        copied to the logits' device together and applied in one op."""
        masks: dict[int, torch.Tensor] = {}
        for i, ((s, _, _), mask) in enumerate(zip(picks, given)):
            if s.request.params.constraint is None:
                continue
            allowed = self._grammar_of(s).mask() if mask is LOOK else mask
            if allowed is not None:
                masks[i] = allowed
        if not masks:
            return
        allowed = torch.stack(list(masks.values())).to(scores.device)
        if len(masks) == len(picks):
            scores.masked_fill_(~allowed, float("-inf"))
            return
        at = torch.tensor(list(masks), device=scores.device)
        scores[at] = scores[at].masked_fill(~allowed, float("-inf"))

    def _verify(self, seq: Sequence, now: float, drawn: list[int], reported: list | None) -> list[TokenEvent]:
        """A draft's verdict. Row by row, the sequence takes the token it would take without a
        draft (the same argmax, or the same seeded draw at the same position, after the same
        tokens, masked as its grammar would be after them); while that token is the draft's, the
        next row holds on from it. `drawn`: each row's token so taken, drawn with the step's other
        rows (_advance), up to the row the verdict must end at; a grammar takes them here in turn.
        `reported`: by row, the drawn token's logprobs where the request asks for them, else None.
        The tokens taken are emitted in order until one ends the sequence, and the draft's slots
        after them go back to the cache. For a draft of fixed tokens, keeping one exactly when the
        model's own draw equals it keeps it with the model's probability of it, as rejection
        sampling would, and leaves every reply, seeded or greedy, as it is without speculation."""
        draft, seq.draft = seq.draft, []
        tokens: list[int] = []
        for i in range(len(draft) + 1):
            tokens.append(drawn[i])
            if seq.grammar is not None:
                seq.grammar.consume(tokens[-1])
            if i == len(draft) or tokens[-1] != draft[i] or (
                    seq.grammar is not None and (seq.grammar.done or seq.grammar.failed)):
                break
        metrics = seq.request.metrics
        kept = self.speculator.judge(draft, tokens, seq.drafted_from_prediction)
        metrics.drafted_tokens += len(draft)
        metrics.kept_draft_tokens += kept
        if seq.drafted_from_prediction:
            metrics.predicted_tokens += len(draft)
            metrics.kept_predicted_tokens += kept
        self.cache.drop_draft(seq.seq_id)
        if len(tokens) > 1:  # into the slots the model wrote them in: nothing to copy
            self.cache.append_tokens(seq.seq_id, tokens[:-1])
        seq.num_computed += len(tokens)  # the token before the draft, and the accepted ones
        reported = reported or [None] * len(tokens)
        events = []
        for i, (token, logprob) in enumerate(zip(tokens, reported)):
            # (its grammar took every token of the verdict as it was drawn: only the last can complete the shape)
            events.append(self._emit(seq, token, now, logprob, shape_read=i == len(tokens) - 1))
            if seq.status is SeqStatus.FINISHED:
                break
        return events

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """After sample 0's prompt is in the cache, samples 1..n-1 share its blocks (copy-on-write)."""
        request = parent.request
        if parent.index != 0 or parent.output_ids or len(request.sequences) >= request.params.n:
            return []
        children = []
        self.cache.slide(parent.seq_id, parent.num_computed)  # the children share only what its window needs
        for index in range(1, request.params.n):
            child = Sequence(f"{request.request_id}/{index}", request, index)
            request.sequences.append(child)
            reserve = self._reservation(request).reserve(request.params.max_tokens)
            try:
                self.cache.fork(parent.seq_id, child.seq_id, reserve)
            except CacheFull:
                self._enqueue(child)  # it will prefill later, reusing the parent's cached prefix
                continue
            child.num_computed = child.prefill_target = parent.num_computed
            child.status = SeqStatus.DECODE
            self._running[child.seq_id] = child
            children.append(child)
        return children

    def _emit(self, seq: Sequence, token: int, now: float, logprob=None, shape_read: bool = True) -> TokenEvent:
        """Append `token` to `seq`'s reply and end the reply where it ends it (_finish_reason).
        `shape_read`: whether its grammar's state is this token's (False for a draft's verdict's
        tokens before its last, which the grammar took already)."""
        request = seq.request
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        metrics = request.metrics
        if metrics.first_token is None:
            metrics.first_token = now
        if seq.index == 0:
            metrics.token_times.append(now)
        reason = self._finish_reason(seq, token, shape_read)
        if reason:
            self._finish(seq, reason)
        return TokenEvent(request.request_id, seq.index, token, reason, logprob)

    def _finish_reason(self, seq: Sequence, token: int, shape_read: bool = True) -> str | None:
        params = seq.request.params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and len(seq.output_ids) >= params.min_tokens:
            text = self.tokenizer.decode(seq.output_ids)
            # with min_tokens, a stop string counts only if it ends in the text of token min_tokens or later
            shorter = len(self.tokenizer.decode(seq.output_ids[:params.min_tokens - 1])) if params.min_tokens > 1 else 0
            cuts = [(i, len(s)) for s in params.stop if (i := text.find(s, max(0, shorter - len(s) + 1))) >= 0]
            if cuts:
                at, length = min(cuts, key=lambda cut: (cut[0], -cut[1]))  # the first; of two there, the longer
                seq.text_end = at + length if params.include_stop_str_in_output else at
                return "stop"
        if seq.grammar is not None and shape_read:
            if seq.grammar.done:  # the reply's shape is complete
                return "stop"
            if seq.grammar.failed:  # llguidance's limits: the shape cannot be followed further
                log.warning("request %s sample %d: its reply's shape (%s) could not be followed after %d tokens: %s",
                            seq.request.request_id, seq.index, params.constraint.field, len(seq.output_ids),
                            seq.grammar.failed)
                return "error"
        if len(seq.output_ids) >= params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        ran = reason != "cancelled" and seq.request.rejected is None  # neither says how long replies run
        if self.tiers is not None and seq.request.params.extra.get("retain") and seq.seq_id in self.cache:
            self._retain(seq)
        if ran:
            self._hold_breakpoints(seq)
            held, unused = self.cache.holding(seq.seq_id)
            self.stats.finished_blocks += held
            self.stats.reserved_unused_blocks += unused
            seq.request.metrics.finished_blocks += held  # (a rollout's cohort figures, per request)
            seq.request.metrics.reserved_unused_blocks += unused
        private = seq.request.params.cache_private
        if private is not None:
            seq.request.own_keys += self._own_keys(seq, private[0])
        self.cache.release(seq.seq_id, written_tokens=seq.num_computed)
        self._running.pop(seq.seq_id, None)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if private is not None and seq.request.finished:
            # its own blocks: no other request reads them; kept until its last sample ends, for a sample
            # preempted meanwhile to find again (a sample still running keeps those it holds)
            self.cache.evict_prefix(seq.request.own_keys, reason="private")
            seq.request.own_keys = []
        if ran:
            self._reservation(seq.request).observe(len(seq.output_ids))
        self.stats.finished += 1

    # ---- convenience -------------------------------------------------------------------------
    def run_until_done(self, max_steps: int = 100_000) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for _ in range(max_steps):
            if not self.has_work():
                return events
            events += self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams) -> list[Request]:
        requests = [self.add_request(p, params) for p in prompts]
        self.run_until_done()
        return requests

    def text_of(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_ids)
        return text if seq.text_end is None else text[:seq.text_end]


def _token_logprobs(logits: torch.Tensor, asked: list[tuple[int, int, int]]) -> list[tuple[float, tuple]]:
    """For each (row of `logits`, token, alternatives): the token's logprob under the row's
    log-softmax and the row's `alternatives` most likely tokens with theirs, every row at once (a
    fixed number of ops and copies to the host, where each row took its own and a sync or two)."""
    if not asked:
        return []
    rows = torch.tensor([row for row, _, _ in asked], device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    tokens = torch.tensor([token for _, token, _ in asked], device=logits.device)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    ids = values = [[] for _ in asked]
    most = max(k for _, _, k in asked)
    if most:  # (topk's are in descending order: a row's first k are its k most likely)
        top = torch.topk(logprobs, most)
        ids, values = top.indices.tolist(), top.values.tolist()
    return [(value, tuple(zip(ids[i][:k], values[i][:k]))) for i, (value, (_, _, k)) in enumerate(zip(chosen, asked))]

"""kvd asleep: the memory its KV cache (and its weights) takes, given back while the process, its
sockets, its pins and its lower tiers stay; waking takes it again. vLLM's sleep mode (POST
/sleep?level=, POST /wake_up?tags=, GET /is_sleeping), which RL trainers call to lend the GPU to
training between rollouts, and SGLang's /release_memory_occupation and /resume_memory_occupation.

Where vLLM drops the cache at every level, kvd keeps it: before the cache's memory goes, every
cached device block that no lower tier holds is written to the first one there is (host memory,
else disk, else the Redis tier), the most reused prefixes first and each prefix root first.
Waking brings the pinned prefixes back at once (as after a restart) and the rest as requests
ask for them. Pins stay pins throughout.

Levels, as vLLM numbers them:
  1  the cache's memory is given back; on CUDA the weights move to host memory, and waking
     copies them back. On the CPU they stay where they are, which is host memory already.
  2  the cache's memory and the weights are given back; waking reads the checkpoint again, and
     refuses while its files differ from the revision served: the blocks cached so far, pins
     and lower tiers included, are keyed by that revision.

The LoRA adapters go with the weights: on CUDA, at either level, to host memory, and waking
copies them back. They are small beside the weights, and a host copy serves on waking the very
weights the adapter's cached blocks and pins were made under, where its folder read again might
hold others. Asleep, no adapter is loaded (a 503, as for a completion), nor read by a reload.

Going to sleep takes no new completion at once (a 503, code "asleep", with Retry-After), waits up
to `timeout` seconds for the requests in flight and, if some are left then, stays awake and
answers 409. Asleep, /readyz is 503 and route facts say so (routers leave the replica out);
what only reads goes on, and what needs the cache's memory (a completion, a pin to warm, a swap
to the device, a calibration) gets a 503 that says how to wake it. Audited either way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvctl.daemon.cache.tiers.payload import BlockMeta
from kvctl.daemon.model.errors import ModelError
from kvctl.daemon.model.weights import load_weights, model_revision

from .calls import Principal, ServiceError

log = logging.getLogger("kvd")

TAGS = ("kv_cache", "weights")  # what can sleep, as vLLM's and SGLang's `tags` name it
SLEEP_WAIT_MAX_S = 600.0  # the longest a sleep waits for requests in flight
SAVE_GROUP = 64  # blocks gathered from the device per hold of the engine's lock


@dataclass
class Sleep:
    """What is asleep now, since when and by whom, and what going to sleep did."""

    level: int
    since: float  # wall clock
    by: str  # the actor, as the audit log has it
    released: list[str] = field(default_factory=list)  # of TAGS, still given back
    weights: str | None = None  # "offloaded" (a host copy), "discarded" (the checkpoint is read again), "kept"
    adapters: str | None = None  # the LoRA adapters: "offloaded" (to host memory), "kept"; None: none served
    adapter_bytes: int = 0  # the adapters' memory given back
    cache_bytes: int = 0  # the cache memory given back
    weight_bytes: int = 0  # the weights' memory given back
    dropped_blocks: int = 0  # cached device blocks the cache's memory held
    saved_blocks: int = 0  # of those, written to a lower tier now
    held_below: int = 0  # of those, a lower tier held already
    saved_to: str | None = None  # the tier written to

    @property
    def discarded_blocks(self) -> int:
        return self.dropped_blocks - self.saved_blocks - self.held_below

    def describe(self) -> dict:
        return {"level": self.level, "since": self.since, "by": self.by, "released": list(self.released),
                "weights": self.weights, "cache_bytes": self.cache_bytes, "weight_bytes": self.weight_bytes,
                "adapters": self.adapters, "adapter_bytes": self.adapter_bytes,
                "dropped_blocks": self.dropped_blocks, "saved_blocks": self.saved_blocks,
                "held_below": self.held_below, "discarded_blocks": self.discarded_blocks, "saved_to": self.saved_to}

    def refusal(self) -> str:
        """Why a call that needs the cache's memory is refused, and what wakes kvd."""
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        given = " and ".join({"kv_cache": "its cache's memory", "weights": "its weights"}[t] for t in self.released)
        verb = "is" if self.released == ["kv_cache"] else "are"
        what = f"{given} {verb} given back" if given else "it is falling asleep"
        return f"kvd is asleep (level {self.level} since {at}, by {self.by}): {what}; `kvctl wake` (POST /wake_up) " \
               "takes it again"


def checked_tags(tags: list[str] | None, field_name: str = "tags") -> list[str]:
    """`tags` (None: all of them) in TAGS order; ServiceError names one kvd does not know."""
    if tags is None:
        return list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ServiceError(400, f"{field_name}: unknown tag {unknown[0]!r}; use {' or '.join(TAGS)}", field_name)
    return [t for t in TAGS if t in tags]


def sleep(service, principal: Principal, level: int = 1, timeout: float = 0.0, tags: list[str] | None = None) -> dict:
    """Give back the memory of `tags` (None: the cache and the weights) at `level`; see the module."""
    if level not in (1, 2):
        raise ServiceError(400, f"level: 1 (the cache's memory; weights to host memory) or 2 (the weights "
                                f"dropped too), got {level!r}", "level")
    if not 0 <= timeout <= SLEEP_WAIT_MAX_S:
        raise ServiceError(400, f"timeout: 0 to {SLEEP_WAIT_MAX_S:g} seconds, got {timeout!r}", "timeout")
    wanted = checked_tags(tags)
    engine = service.require_ready()
    with service.sleep_lock:  # one sleep or wake at a time
        state = service.asleep
        wanted = [t for t in wanted if state is None or not _asleep_already(state, t, level)]
        if not wanted:  # asleep as asked already (vLLM: a second sleep is a no-op)
            return {"is_sleeping": True, "already": True, **state.describe()}
        fresh = state is None
        if fresh:  # from here no new work is taken (the engine thread refuses what is handed in)
            state = service.asleep = Sleep(level, time.time(), principal.actor)
        try:
            _wait_until_idle(service, engine, time.monotonic() + timeout)
            if "kv_cache" in wanted:
                _save_and_release(service, engine, state)
            if "weights" in wanted:
                _release_weights(service, state, level)
        except Exception as exc:  # a ServiceError (409: requests in flight), or a failure nobody foresaw
            if fresh and not state.released:
                service.asleep = None
            service.store.audit(actor=principal.actor, tenant=principal.tenant, action="sleep", target="memory",
                                result="refused", detail={"level": level, "tags": wanted, "error": str(exc)})
            raise
        state.level = max(state.level, level)
    detail = state.describe()
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="sleep", target="memory",
                        result="ok", detail={**detail, "tags": wanted})
    log.info("asleep (level %d, by %s): %s", state.level, principal.actor, _told(state))
    return {"is_sleeping": True, "already": False, **detail}


def wake(service, principal: Principal, tags: list[str] | None = None) -> dict:
    """Take back the memory of `tags` (None: all that sleeps): the weights first (a trainer may
    wake them alone to update them), then the cache, empty; once nothing sleeps, completions are
    taken again and the pinned prefixes come back from the lower tiers."""
    wanted = checked_tags(tags)
    service.require_ready()
    # (its cache comes back under the engine's lock; an idle loop may stall too)
    service.refuse_change_if_stalled(principal, "wake", "memory", detail={"tags": wanted})
    with service.sleep_lock:
        state = service.asleep
        if state is None:  # awake already (vLLM: a no-op)
            return {"is_sleeping": False, "woke": [], "already": True}
        woke = [t for t in wanted if t in state.released]
        took: dict[str, object] = {}
        if "weights" in woke:
            took.update(_take_weights(service, state, principal))
            took.update(_take_adapters(service, state))
            state.released.remove("weights")
            state.weights = None
        if "kv_cache" in woke:
            with service.lock:
                took["cache_bytes"] = service.engine.restore_cache()
            state.released.remove("kv_cache")
        awake = not state.released
        if awake:
            service.asleep = None
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="wake", target="memory", result="ok",
                        detail={"woke": woke, "asleep_since": state.since, **took})
    warming = 0
    if awake:
        warming = _warm_pins(service)
        log.info("awake (by %s), asleep %.1f s; %d pinned prefixes warming from the lower tiers", principal.actor,
                 time.time() - state.since, warming)
    return {"is_sleeping": not awake, "woke": woke, "already": False, "still_released": list(state.released),
            "asleep_seconds": time.time() - state.since, "pins_warming": warming, **took}


def status(service) -> dict:
    """vLLM's GET /is_sleeping, with what sleeps."""
    state = service.asleep
    return {"is_sleeping": state is not None, **({"sleep": state.describe()} if state is not None else {})}


def _asleep_already(state: Sleep, tag: str, level: int) -> bool:
    """Whether `tag` sleeps as `level` asks already (the weights kept in host memory by the CPU's
    level 1 count as asleep at level 1)."""
    if tag == "kv_cache":
        return "kv_cache" in state.released
    return state.weights == "discarded" or (state.weights is not None and level == 1)


def _wait_until_idle(service, engine, deadline: float) -> None:
    """Until no request is in the engine or handed to it; a 409 saying how many run and wait when
    the deadline comes first."""
    while True:
        with service.engine_lock(changes=True):  # (sleep undoes its start: nothing else was changed)
            live = sum(1 for r in engine.requests.values() if not r.finished)
            if not live and not service.inbox_size() and not engine.has_work():
                return
            queue = engine.queue_figures()
        if time.monotonic() >= deadline:
            raise ServiceError(409, f"requests in flight: {queue['running']} running, {queue['waiting']} waiting; kvd "
                                    "stays awake (timeout=S waits up to S seconds for them; `kvctl cancel` or "
                                    "`kvctl drain` first)")
        time.sleep(0.02)


def _save_and_release(service, engine, state: Sleep) -> None:
    """Write the cached device blocks no lower tier holds to the first tier there is, then give
    back the cache's memory (every block dropped, pinned ones too: their pins stay)."""
    tiers = service.tiers
    with service.lock:
        hits = {root: info.hits for root, info in engine.cache.roots.items()}
        # (a request's own blocks, explicit prompt cache mode: no tier's)
        cached = [b for b in engine.cache.pool.blocks if b.key is not None and not b.own]
    target = None if tiers is None else next((t.name for t in tiers.tiers()), None)
    if target is not None:
        below = {b.key for b in cached if tiers.location(b.key) != "evicted"}
        state.held_below = len(below)
        todo = sorted((b for b in cached if b.key not in below), key=lambda b: (-hits.get(b.root, 0), b.root, b.depth))
        state.saved_to = target
        for start in range(0, len(todo), SAVE_GROUP):
            with service.lock:  # only an operator's eviction can take a block meanwhile: nothing adds one
                group = [b for b in todo[start:start + SAVE_GROUP] if b.key is not None]
                metas = [BlockMeta.of(b) for b in group]
                layers = tiers.gather([b.block_id for b in group]) if group else None
            if not group:
                continue
            try:
                state.saved_blocks += tiers.copy_to(target, metas, layers, src="device")
            except Exception as exc:  # noqa: BLE001  (a tier that fails: what is not written is computed again)
                log.warning("going to sleep: cached blocks not written to the %s tier: %s", target, exc)
                break
    with service.lock:  # (Engine.release_cache refuses with a request there; the engine thread takes none now)
        state.dropped_blocks, state.cache_bytes = engine.release_cache()
    state.released.append("kv_cache")


def _release_weights(service, state: Sleep, level: int) -> None:
    """Level 2: drop them (and a host copy level 1 made); level 1: to host memory on CUDA, kept on the CPU.
    The LoRA adapters go to host memory on CUDA at either level, first (the weights' release hands
    torch's cached memory back to the driver)."""
    model = service.loaded.model
    with service.adapter_updates:  # (no load or reload changes them meanwhile; asleep, neither reads one)
        adapters = list(service.adapters().values())
        if adapters and state.adapters is None:
            on_gpu = model.device.type == "cuda"
            state.adapters = "offloaded" if on_gpu else "kept"
            state.adapter_bytes = sum(a.offload() for a in adapters) if on_gpu else 0
    if level == 2:
        state.weights, freed = "discarded", model.release_weights(keep_host_copy=False)
    elif model.device.type == "cuda":
        state.weights, freed = "offloaded", model.release_weights(keep_host_copy=True)
    else:  # host memory is where they would go
        state.weights, freed = "kept", 0
    state.weight_bytes = state.weight_bytes or freed  # (from level 1 to 2, the first release said it)
    if state.weights != "kept" and "weights" not in state.released:
        state.released.append("weights")


def _take_weights(service, state: Sleep, principal: Principal) -> dict:
    loaded = service.loaded
    model = loaded.model
    if state.weights == "offloaded":
        return {"weight_bytes": model.restore_weights(), "weights": "copied back from host memory"}
    started = time.perf_counter()
    try:
        revision = model_revision(loaded.path)
        problem = f"changed while kvd slept (revision {loaded.revision[:12]}, now {revision[:12]})"
    except OSError as exc:
        revision, problem = None, f"cannot be read ({exc})"
    if revision != loaded.revision:
        message = (f"model: the checkpoint at {loaded.path} {problem}: kvd would serve other weights under the blocks, "
                   "pins and lower tiers keyed by the revision it loaded; put the files back, or restart kvd to serve "
                   "the new ones. kvd stays asleep")
        service.store.audit(actor=principal.actor, tenant=principal.tenant, action="wake", target="memory",
                            result="refused", detail={"error": message})
        raise ServiceError(409, message, "model")
    try:
        weights = load_weights(loaded.path, loaded.config, model.dtype, model.device)
    except (ModelError, OSError) as exc:
        raise ServiceError(409, f"model: the checkpoint at {loaded.path} could not be read again ({exc}); kvd stays "
                                "asleep", "model") from None
    return {"weight_bytes": model.use_weights(weights), "weights": "read again from the checkpoint",
            "weights_seconds": time.perf_counter() - started}


def _take_adapters(service, state: Sleep) -> dict:
    """The LoRA adapters back on the device from host memory (`_release_weights`)."""
    if state.adapters != "offloaded":
        state.adapters = None
        return {}
    with service.adapter_updates:
        moved = sum(a.restore() for a in service.adapters().values())
    state.adapters = None
    return {"adapter_bytes": moved, "adapters": "copied back from host memory"}


def _warm_pins(service) -> int:
    """Bring the pinned prefixes the lower tiers hold back to the device, in a thread of their own
    (tier_ops.warm_pins). Returns how many pins there are to warm: not the stranded ones (new
    weights, say, while asleep), which no request reaches and no tier holds in the served space."""
    from . import pin_ops, tier_ops

    if service.tiers is None:
        return 0
    with service.lock:
        pins = len(service.engine.cache.pins.all())
    count = pins - len(pin_ops.stranded_pins(service))
    if count:
        warmer = threading.Thread(target=tier_ops.warm_pins, args=(service,), name="kvd-warm-pins", daemon=True)
        warmer.start()
        service.pin_warmer = warmer
    return count


def _told(state: Sleep) -> str:
    """What going to sleep did, in a log line's words."""
    parts = []
    if "kv_cache" in state.released:
        parts.append(f"cache memory given back ({state.cache_bytes} bytes, {state.dropped_blocks} cached blocks: "
                     f"{state.saved_blocks} written to {state.saved_to or 'no lower tier'}, {state.held_below} held "
                     f"there already, {state.discarded_blocks} dropped)")
    if state.weights:
        parts.append(f"weights {state.weights}" + (f" ({state.weight_bytes} bytes)" if state.weight_bytes else
                                                   " in host memory (kvd runs on the CPU)"))
    if state.adapters:
        parts.append(f"LoRA adapters {state.adapters}" + (f" ({state.adapter_bytes} bytes)" if state.adapter_bytes
                                                          else " in host memory (kvd runs on the CPU)"))
    return "; ".join(parts)

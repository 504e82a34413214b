"""Disaggregated prefill and decode: one kvd computes a prompt's KV cache, another generates from
it, the blocks passed between them through the shared Redis tier. kvd router does this for every
completion when it has --prefill and --decode replicas (router.py, `prefill_first`); any admin
caller can too, with vLLM's request field for it, `kv_transfer_params`:

  at the prefill kvd, {"kv_transfer_params": {"do_remote_decode": true}} (and max_tokens 1,
  not streamed): once the prompt is computed, its full blocks that Redis lacks are written
  there and waited for, and the answer carries
  {"kv_transfer_params": {"do_remote_prefill": true, "remote_blocks": N, ...}} for the decode;

  at the decode kvd, {"kv_transfer_params": {"do_remote_prefill": true, ...}}: before the
  request is queued, the prompt's blocks that Redis holds come up to the device, whatever
  prefetch_policy says (the transfer is the point), so the request computes only its prompt's
  tail: the blocks Redis lacked and the last token, which starts decoding.

Why Redis, not a GPU-to-GPU copy (vLLM's NIXL connector): kvd has no RDMA path, and Redis is the
tier its replicas already share, with stable keys (the block space: model revision, tokenizer,
cache format, scales, block size; and the tenant in every key), verified payloads and capacity of
its own. A decode kvd of another block space finds nothing and computes the whole prompt, as it
would without a transfer; the answer's figures say so. The blocks stay in Redis for later
requests at any replica, as any write there does.

Only admin callers ask for a transfer (kvd router is one): it writes to the shared tier and
says how much of a prompt Redis holds. Neither side logs prompt text or token ids.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvctl.daemon.cache import PrefixHasher
from kvctl.daemon.cache.tiers import BlockMeta

from .calls import ServiceError

FIELD = "kv_transfer_params"
FETCH_TIMEOUT_S = 30.0  # a decode waits this long at most for its prompt's blocks from Redis
KNOWN_FLAGS = ("do_remote_decode", "do_remote_prefill")


@dataclass
class TransferBook:
    """What this kvd passed through Redis for other kvds (prefill) and took from them (decode),
    and the seconds those took, summed, for /metrics and kvctl status."""

    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **figures: int) -> None:
        with self.lock:
            self.counts.update(figures)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def wanted(body) -> bool:
    """Whether `body` asks for a KV transfer at all (`asked` checks the ask). Such a chat's prompt is
    its text tokenized, on both sides: the prefill kvd never made the replies the decode kvd keeps
    the ids of (reply_ids.py), and the two must hash the same prompt."""
    params = getattr(body, FIELD, None)
    return isinstance(params, dict) and any(params.get(name) is True for name in KNOWN_FLAGS)


def asked(body, role: str, stream: bool, service) -> str | None:
    """The transfer `body` asks for: "prefill" (do_remote_decode: this kvd computes the prompt
    for another), "decode" (do_remote_prefill: another kvd computed it), or None. A 400 naming
    the field for a malformed ask, a 403 for a caller who is not admin, a 409 where kvd has no
    Redis tier to pass blocks through."""
    params = getattr(body, FIELD, None)
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ServiceError(400, f"{FIELD}: expected an object, got {type(params).__name__}", FIELD)
    flags = {}
    for name in KNOWN_FLAGS:
        value = params.get(name, False)
        if not isinstance(value, bool):
            raise ServiceError(400, f"{FIELD}.{name}: expected true or false, got {value!r}", f"{FIELD}.{name}")
        flags[name] = value
    if flags["do_remote_decode"] and flags["do_remote_prefill"]:
        raise ServiceError(400, f"{FIELD}: do_remote_decode and do_remote_prefill cannot both be true (one kvd "
                                "computes the prompt, another decodes from it)", FIELD)
    side = "prefill" if flags["do_remote_decode"] else "decode" if flags["do_remote_prefill"] else None
    if side is None:
        return None
    if role != "admin":
        raise ServiceError(403, f"{FIELD}: only an admin caller (kvd router) asks for a KV transfer", FIELD)
    name = "do_remote_decode" if side == "prefill" else "do_remote_prefill"
    if side == "prefill" and stream:
        raise ServiceError(400, f"{FIELD}.do_remote_decode: ask without stream: the answer carries the transfer "
                                "for the decode", f"{FIELD}.{name}")
    tiers = service.tiers
    if tiers is None or tiers.remote is None:
        raise ServiceError(409, f"{FIELD}.{name}: kvd has no Redis tier to pass the prompt's blocks through (set "
                                "remote_url, the same one at the prefill and the decode kvds)", f"{FIELD}.{name}")
    return side


def prompt_keys(engine, namespace, token_ids: list[int], hashed: tuple | None = None) -> list:
    """The keys of the prompt's blocks a request may take from the cache (all full blocks but one
    that holds the last token, which is always computed). `hashed`: the prompt's hashing as
    EngineService.hash_prompts made it, taken while it is of these tokens in this namespace."""
    if hashed is not None and hashed[0] == namespace and hashed[1] == len(token_ids):
        keys = hashed[2]
    else:
        keys = PrefixHasher(namespace).feed(token_ids)
    return list(keys[:engine.cache.cacheable_blocks(len(token_ids))])


def publish(service, requests, hashed: list[tuple | None] | None = None) -> dict:
    """Prefill side, after `requests` finished: write each prompt's blocks that Redis lacks from
    the device to Redis, wait for the writes, and say what Redis holds of the prompts now
    (the decode's `kv_transfer_params`). `hashed`: the prompts' keys as they were submitted."""
    engine, tiers = service.engine, service.tiers
    remote, started = tiers.remote, time.perf_counter()
    prompt_blocks = written = held = 0
    for request, memo in zip(requests, [None] * len(requests) if hashed is None else hashed, strict=True):
        keys = prompt_keys(engine, engine.request_namespace(request), request.prompt_ids, memo)
        prompt_blocks += len(keys)
        with service.lock:  # the blocks and their contents in one hold: a step may reuse a block after it
            if service.asleep is not None:
                raise ServiceError(503, service.asleep.refusal())
            pool, run = engine.cache.pool, []
            for key in keys:  # the chain the device still holds (a block is of use only after its ancestors)
                block_id = pool.block_of(key)
                if block_id is None:
                    break
                run.append(pool.blocks[block_id])
            fresh = [b for b in run if not remote.holds(b.key)]
            metas = [BlockMeta.of(b) for b in fresh]
            layers = tiers.gather([b.block_id for b in fresh]) if fresh else None
        if metas:
            written += tiers.copy_to("remote", metas, layers, src="device")
        on_redis = 0
        for key in keys:
            if not remote.holds(key):
                break
            on_redis += 1
        held += on_redis
    seconds = time.perf_counter() - started
    service.kv_transfers.add(prefills=len(requests), published_blocks=written, publish_seconds=seconds)
    size = engine.settings.block_size
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_tier": "redis",
            "remote_blocks": held, "remote_tokens": held * size, "published_blocks": written,
            "prompt_blocks": prompt_blocks, "block_size": size, "publish_seconds": seconds}


def fetch(service, prompts: list[list[int]], tenant: str, adapter: str,
          hashed: list[tuple | None] | None = None) -> dict:
    """Decode side, before the request is queued: bring each prompt's blocks that Redis holds
    (and the device lacks) up to the device, waiting for them. Returns what came and what the
    device holds of the prompts now. `hashed`: the prompts' keys, which their submission takes too."""
    from .tier_ops import restore_chain

    engine, started = service.engine, time.perf_counter()
    namespace = engine.namespace(tenant, adapter)
    prompt_blocks = fetched = on_device = 0
    for ids, memo in zip(prompts, [None] * len(prompts) if hashed is None else hashed, strict=True):
        keys = prompt_keys(engine, namespace, ids, memo)
        prompt_blocks += len(keys)
        if not keys:
            continue
        restored, held = restore_chain(service, keys, tenant, timeout=FETCH_TIMEOUT_S)
        fetched, on_device = fetched + restored, on_device + held
    seconds = time.perf_counter() - started
    service.kv_transfers.add(decodes=len(prompts), fetched_blocks=fetched, fetch_seconds=seconds)
    size = engine.settings.block_size
    return {"do_remote_prefill": True, "fetched_blocks": fetched, "fetched_tokens": fetched * size,
            "cached_blocks": on_device, "prompt_blocks": prompt_blocks, "block_size": size, "fetch_seconds": seconds}

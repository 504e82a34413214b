"""Pins: an operator's hold on a prefix (by its text, its id in `kvctl prefixes`, or its block
keys as another replica pins it), with a TTL, an owner and a budget per tenant; each pin is
stored, so it survives a restart, and audited.

The cache's own pin table (daemon/cache/pins.py) decides what a pin holds; these functions
take the service lock for it, and write to the store outside that lock (a store another
process holds locked must not hold up the engine).
"""

from __future__ import annotations

import logging
import math
import threading
import time

from kvctl.daemon.cache import InvalidRequest, PinBudgetExceeded, PinLeavesNoRoom, UnknownPin
from kvctl.daemon.cache.pins import pin_origin, stranded_reason
from kvctl.daemon.engine.engine import AdmissionRejected
from kvctl.daemon.engine.sampling import SamplingParams
from kvctl.daemon.store import StoreUnavailable

from . import tier_ops
from .calls import Principal, ServiceError
from .durations import clock_reading, unix_time
from .prefix_ops import prefix_tree, resolve_prefix, served_names

log = logging.getLogger("kvd")

WARM_WAIT_S = 120.0  # how long a pin by text waits for its prefix to be computed before it answers


def pin(service, token_ids: list[int], principal: Principal, ttl: float | None, note: str,
        adapter: str = "") -> dict:
    """Pin a prefix by its tokens for `principal`'s tenant (under LoRA adapter `adapter`: its own
    blocks), computing what the cache lacks of it (one token of output: `_warm`). Hashes outside
    the service lock."""
    engine = service.require_ready()
    namespace = engine.namespace(principal.tenant, adapter)
    try:
        keys = engine.cache.keys_to_pin(namespace, token_ids)
        with service.change_lock(principal, "pin", "-"):
            result = engine.cache.pin_keys(namespace.tenant, keys, ttl=ttl, owner=principal.actor, note=note,
                                           **pin_origin(namespace))
    except (PinBudgetExceeded, PinLeavesNoRoom) as exc:  # (audited outside the lock: the engine thread takes
        raise _refused(service, exc, principal, principal.tenant, "-") from None  # it, a store write may wait)
    except InvalidRequest as exc:
        raise ServiceError(400, str(exc), "tokens") from None
    warmed = False
    if result.pending_blocks and service.asleep is None:  # asleep: it warms as kvd wakes (sleep_ops.wake)
        try:
            ended = _warm(service, token_ids, principal, adapter)
        except Exception as exc:  # the prefix cannot be prefilled: a new pin goes again, whole
            if not result.refreshed:
                with service.lock:
                    engine.cache.unpin(result.pin.pin_id)
            service.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin", target="-",
                                result="refused", detail={"reason": str(exc)})
            status = 400  # a bad prompt; 409 when the cache cannot take it; the service's own otherwise
            if isinstance(exc, ServiceError):
                status = exc.status
            elif isinstance(exc, AdmissionRejected):
                status = 409
            raise ServiceError(status, f"tokens: the prefix cannot be warmed: {exc}", "tokens") from None
        # a warm cancelled (an operator's cancel, kvd stopping), turned away in the queue (other pins
        # came while it waited: "error") or still running: the pin stands, and its blocks pin as a later
        # request fills them
        warmed = ended is not None and ended not in ("cancelled", "error")
    return _pinned(service, result, principal, ttl, note, warmed)


def pin_prefix(service, prefix_id: str, principal: Principal, tenant: str | None, ttl: float | None,
               note: str) -> dict:
    """Pin a cached prefix by its id from `kvctl prefixes`: the prefix as that row lists it (from
    the first token to the end of the row). No text needed; its tenant pays. Parts of it in
    a lower tier come back to the device and pin as they land.

    A running request's own blocks (explicit prompt cache mode: its prompt past its marked
    prefix) are never pinned: a pin would keep what the request asked to leave nowhere once it
    ends. A row that starts with them is refused (the message names the row they extend); a row
    that ends with them is pinned up to them, and the answer says how many were left out.

    A refusal for what the cache holds (409: a running request's own, unreachable, whose it is not
    known, stale, several prefixes matching) is audited, as a refusal for the pin budget is."""
    service.require_ready()
    try:
        first, keys, left_out, owner, origin = _prefix_keys(service, prefix_id, tenant)
    except ServiceError as exc:
        if exc.status == 409:
            service.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin",
                                target=f"prefix={prefix_id.strip().lower()[:16]}", result="refused",
                                detail={"reason": str(exc)})
        raise
    body = _pin_keys(service, keys, owner, principal, ttl, note, principal.actor, f"prefix={first.hex()[:16]}",
                     "prefix", origin)
    body["prefix_id"] = first.hex()[:16]
    if left_out:
        body["private_blocks_left_out"] = left_out
    return body


def _prefix_keys(service, prefix_id: str, tenant: str | None) -> tuple[bytes, list[bytes], int, str, dict]:
    """(the block key `prefix_id` names, the keys from its root to the end of its row less a
    running request's own, how many of those were left out, its tenant, where its keys were
    made: Pin's space and adapter_id) for pin_prefix; a ServiceError where it cannot be pinned."""
    tree, roots = prefix_tree(service)
    first = resolve_prefix(prefix_id, tree)
    keys = tree.path(first)
    own = next((i for i, key in enumerate(keys) if key in tree.own), len(keys))  # (a chain's own blocks end it)
    if first in tree.own:
        shared = "no part of it is shared" if own == 0 else \
            f"pin the prefix it extends, {tree.node_of[keys[own - 1]].hex()[:16]}"
        raise ServiceError(409, f"prefix: {prefix_id!r} is a running request's own (explicit prompt cache mode: "
                                f"no other request reads it, and it goes as that request ends); {shared}", "prefix")
    keys, left_out = keys[:own], len(keys) - own
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
    root = roots.get(keys[0])  # the adapter its tree was hashed under, where known
    if root is not None and root.stale(service.require_ready().space_key()):
        raise ServiceError(409, f"prefix: {prefix_id!r} is unreachable ({STRANDED_WHY['space']}); pin it by its "
                                "text to compute it again", "prefix")
    origin = {"space": service.block_space(), "adapter_id": None if root is None else root.adapter_id}
    return first, keys, left_out, owner, origin


def pin_copy(service, keys: list[bytes], tenant: str, principal: Principal, ttl: float | None, note: str,
             owner: str | None, adapter_id: str | None = None) -> dict:
    """Pin a prefix by its block keys, as another replica of the fleet has it pinned (kvd
    router's `kvctl fleet sync-pins`): no text needed. What a lower tier here holds of it (a
    shared Redis, say) comes up pinned; the rest is pinned as the prefix is computed here.
    `adapter_id`: the LoRA adapter the keys were made under, as that replica knows it."""
    service.require_ready()
    return _pin_keys(service, keys, tenant, principal, ttl, note, owner or principal.actor,
                     f"keys={keys[-1].hex()[:16]}", "keys", {"space": service.block_space(), "adapter_id": adapter_id})


def _pin_keys(service, keys: list[bytes], tenant: str, principal: Principal, ttl: float | None, note: str,
              owner: str, target: str, param: str, origin: dict) -> dict:
    """Pin `keys` for `tenant` (its budget pays), bring what lower tiers hold of them up, and
    record it; a refusal is audited under `target` and named by `param`. `origin`: where the
    keys were made (space, adapter_id: Pin)."""
    engine = service.engine
    try:
        with service.change_lock(principal, "pin", target, tenant):
            result = engine.cache.pin_keys(tenant, keys, ttl=ttl, owner=owner, note=note, **origin)
    except (PinBudgetExceeded, PinLeavesNoRoom) as exc:  # (audited outside the lock, as in pin())
        raise _refused(service, exc, principal, tenant, target) from None
    except InvalidRequest as exc:
        raise ServiceError(400, str(exc), param) from None
    if result.pending_blocks and service.tiers is not None:  # what a lower tier holds comes up, pinned
        try:
            tier_ops.restore_chain(service, keys, tenant)
        except ServiceError:  # kvd is asleep (sleep_ops.py): the pin stands, and warms as kvd wakes
            pass
    return _pinned(service, result, Principal(tenant, principal.role, principal.actor), ttl, note, warmed=False)


def _pinned(service, result, principal: Principal, ttl: float | None, note: str, warmed: bool) -> dict:
    """Record a pin that took (store and audit) and describe it."""
    engine = service.engine
    with service.lock:
        cached = engine.cache.lookup(result.pin.keys)
        now, wall = engine.clock(), time.time()  # (the times handed out are the same before and after the store's)
    pin = result.pin
    try:  # (made again: it keeps when it was first made)
        service.store.save_pin({"pin_id": pin.pin_id, "tenant": pin.tenant,
                                "keys": ",".join(k.hex() for k in pin.keys), "owner": pin.owner,
                                "note": pin.note, "created_at": unix_time(pin.created_at, now, wall),
                                "expires_at": None if ttl is None else wall + ttl,
                                "space": pin.space, "adapter_id": pin.adapter_id})
    except StoreUnavailable as exc:  # a pin that would not survive a restart is no pin
        if not result.refreshed:
            with service.lock:
                engine.cache.unpin(pin.pin_id)
        raise ServiceError(503, f"{exc}: " + ("the pin's new expiry holds until kvd restarts" if result.refreshed
                                               else "nothing was pinned"), "pin") from None
    body = {**_pin_times(pin.describe(), now, wall), "cached_blocks": cached, "warmed": warmed,
            "refreshed": result.refreshed}
    detail = {"blocks": pin.num_blocks, "ttl": ttl, "note": note}
    if result.let_go:  # requests' breakpoint holds gave way to it in the tenant's pin budget
        body["let_go_holds"] = detail["let_go_holds"] = list(result.let_go)
        log.info("pin %s of tenant %s: %d of its requests' breakpoint holds let go for room in its pin budget",
                 pin.pin_id, pin.tenant, len(result.let_go))
    if result.was is not None:  # made again: what it was before this call set its owner, note and expiry
        was = result.was
        body["was"] = detail["was"] = {"owner": was["owner"], "note": was["note"], "expires_in_seconds": (
            None if was["expires_at"] is None else max(was["expires_at"] - now, 0.0))}
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="pin", target=pin.pin_id,
                        result="ok", detail=detail)
    return body


def _warm(service, token_ids: list[int], principal: Principal, adapter: str = "") -> str | None:
    """Prefill a prefix so its blocks are cached (and so pinned): one token of output. Returns
    how the warm request ended (its finish reason), or None when it had not within WARM_WAIT_S."""
    ended: list[str] = []
    done = threading.Event()

    def sink(event) -> None:
        if event.finish_reason:
            ended.append(event.finish_reason)
            done.set()

    service.submit([token_ids], SamplingParams(max_tokens=1, ignore_eos=True), principal, sink, adapter)
    done.wait(timeout=WARM_WAIT_S)
    return ended[0] if ended else None


def unpin(service, pin_id: str, principal: Principal, detail: dict | None = None) -> dict:
    """Remove a pin (from the store first); audited with `detail` beside its blocks. The blocks of
    a pin made in a block space no longer served go with it (no request reaches them)."""
    engine = service.require_ready()
    with service.change_lock(principal, "unpin", pin_id, detail=detail):
        try:
            engine.cache.pins.get(pin_id)
        except UnknownPin as exc:
            hint = "" if pin_id.startswith("pin-") else "; pin ids start with pin- (kvctl pins lists them)"
            raise ServiceError(404, str(exc) + hint, "pin_id") from None
    try:  # from the store first: an unpin it could not record would come back at the next start
        service.store.delete_pin(pin_id)
    except StoreUnavailable as exc:
        raise ServiceError(503, f"{exc}: the pin stands", "pin_id") from None
    with service.lock:
        try:
            pin = engine.cache.unpin(pin_id)
        except UnknownPin as exc:  # it lapsed or went meanwhile
            raise ServiceError(404, str(exc), "pin_id") from None
        served = engine.space_key()
        dropped = engine.cache.evict_stale(served).evicted_blocks if pin.space not in (None, served.hex()) else 0
    freed = {"dropped_stale_blocks": dropped} if dropped else {}
    service.store.audit(actor=principal.actor, tenant=pin.tenant, action="unpin", target=pin_id,  # (as its pin's)
                        result="ok", detail={"blocks": pin.num_blocks, **freed, **(detail or {})})
    return {"pin_id": pin_id, "unpinned_blocks": pin.num_blocks, **freed}


def list_pins(service, with_keys: bool = False, tenant: str | None = None) -> list[dict]:
    """Every pin (`tenant`: that tenant's only); `with_keys`: also its block keys (hex), which another
    replica of the same block space can pin by (`pin_copy`). Each names the model or LoRA adapter
    it was made under (`model`: its name served now; None where not served or not known) and, where
    no request can reach it any more, why (`stranded`: stranded_reason)."""
    engine = service.require_ready()
    space, names = served_origin(service)
    with service.engine_lock():  # what only the lock makes consistent; the rows and the keys' hex after it
        now, wall = engine.clock(), time.time()
        listed = [(p.describe(), engine.cache.lookup(p.keys), p.keys, stranded_reason(p, space, names))
                  for p in engine.cache.pins.all() if tenant is None or p.tenant == tenant]
    return [{**_pin_times(described, now, wall), "cached_blocks": cached, "model": names.get(described["adapter_id"]),
             "stranded": stranded, **({"keys": [k.hex() for k in keys]} if with_keys else {})}
            for described, cached, keys, stranded in listed]


def pin_room_of(engine, cfg) -> int:
    """The room, in tokens of one request, new pins must leave beside the pins under `cfg`:
    its pin_room_tokens, or by default the context served or half the cache, whichever is less
    (a tenant's default budget is half the cache: one tenant alone always has it). ValueError
    naming the setting where the cache cannot hold so many."""
    cache = engine.cache
    if cfg.pin_room_tokens is None:
        return min(engine.context_limit, cache.capacity_tokens // 2)
    if cfg.pin_room_tokens > cache.capacity_tokens:
        raise ValueError(f"pin_room_tokens: {cfg.pin_room_tokens} is more than the cache holds ({cache.num_blocks} "
                         f"blocks of {cache.block_size} tokens: {cache.capacity_tokens})")
    return cfg.pin_room_tokens


def set_pin_limits(engine, cfg) -> None:
    """Apply `cfg`'s pin limits to the engine's cache (at start and on reload): each tenant's
    budget (default half the cache's blocks) and the room new pins must leave (pin_room_of).
    Pins that stand stay (warn_no_room); a request they leave too little room is turned away
    (pinned_out)."""
    cache = engine.cache
    cache.pins.default_budget = cache.num_blocks // 2 if cfg.pin_budget_blocks is None else cfg.pin_budget_blocks
    cache.set_pin_room(pin_room_of(engine, cfg))


def warn_no_room(engine) -> None:
    """Log where the pins that stand (restored at a start, or made before a reload raised
    pin_room_tokens) leave less room than new pins must."""
    cache = engine.cache
    pinned = cache.pool.num_pin_keys  # (cached or not: each holds a block once its prefix is computed)
    if pinned and cache.num_blocks - pinned < cache.pin_room_blocks:
        log.warning("pins hold %d of the cache's %d blocks, leaving %d, fewer than pin_room_tokens (%d tokens: "
                    "%d blocks) keeps: new pins are refused until some are unpinned", pinned, cache.num_blocks,
                    cache.num_blocks - pinned, cache.pin_room_tokens, cache.pin_room_blocks)


def room_beside_pins(service) -> dict:
    """What the pins leave of the device cache: pinned blocks are never evicted, so a request whose
    prompt and max_tokens need more than `room_blocks` (beyond a pinned prefix it starts with) is
    turned away (pinned_out)."""
    engine = service.require_ready()
    with service.engine_lock():
        pinned, room = engine.cache.room_beside_pins((), reuse=False)
    return {"pinned_blocks": pinned, "num_blocks": engine.settings.num_blocks, "room_blocks": room,
            "block_size": engine.settings.block_size, "pin_room_tokens": engine.cache.pin_room_tokens,
            "pin_room_blocks": engine.cache.pin_room_blocks}


STRANDED_WHY = {"space": "made under a model revision, tokenizer, cache format, scales or block size kvd no longer "
                         "serves",
                "adapter": "made under LoRA weights kvd no longer serves"}


def stranded_pins(service, adapter_ids: set[str] | None = None, space: str | None = None) -> list[dict]:
    """The pins no request can reach any more (stranded_reason): their blocks stay pinned and
    count against their tenant's budget until unpinned. `adapter_ids` / `space`: only those made
    under these LoRA weights (digests) / in this block space, as a change that retired them
    reports them. Each: pin_id, tenant, blocks, adapter_id, stranded (the reason)."""
    return [_row(p, reason) for p, reason in _stranded(service)
            if (adapter_ids is None or p.adapter_id in adapter_ids) and (space is None or p.space == space)]


def _row(pin, reason: str | None) -> dict:
    """A pin as a bulk unpin names it: pin_id, tenant, blocks, adapter_id, stranded (why, or None)."""
    return {"pin_id": pin.pin_id, "tenant": pin.tenant, "blocks": pin.num_blocks, "adapter_id": pin.adapter_id,
            "stranded": reason}


def _with_reasons(service) -> list[tuple]:
    """(pin, why no request reaches it, or None) for each pin (stranded_reason)."""
    served_space, names = served_origin(service)
    with service.lock:
        return [(p, stranded_reason(p, served_space, names)) for p in service.engine.cache.pins.all()]


def _stranded(service) -> list[tuple]:
    """(pin, why) for each pin no request can reach any more (stranded_reason)."""
    return [(p, reason) for p, reason in _with_reasons(service) if reason is not None]


def served_origin(service) -> tuple[str, dict[str, str]]:
    """The block space served (hex; also while kvd starts, before it answers ready) and the model
    and adapters served by their ids (served_names): what a pin must have been made under."""
    return service.engine.block_space(), served_names(service)


def _refused(service, exc: PinBudgetExceeded | PinLeavesNoRoom, principal: Principal, tenant: str,
             target: str) -> ServiceError:
    """A pin refused for its tenant's budget or for the room pins must leave: audited, and the
    409 that says so."""
    service.store.audit(actor=principal.actor, tenant=tenant, action="pin", target=target, result="refused",
                        detail={"reason": str(exc)})
    if isinstance(exc, PinBudgetExceeded):
        return ServiceError(409, _over_budget(service, exc))
    cache = service.engine.cache
    return ServiceError(409, f"pin: {exc} (pin_room_tokens: {cache.pin_room_tokens} tokens, in blocks of "
                             f"{cache.block_size}), so that a request that starts with no pinned prefix can "
                             "always finish: unpin some (kvctl pins, kvctl unpin), pin a shorter prefix, or lower "
                             "pin_room_tokens", "pin_room_tokens")


def _over_budget(service, exc: PinBudgetExceeded) -> str:
    """A pin's refusal over its tenant's budget, saying how much of the budget stranded pins hold."""
    held = {key for pin, _ in _stranded(service) if pin.tenant == exc.tenant for key in pin.keys}
    if not held:
        return str(exc)
    return (f"{exc}; {len(held)} of them are held by pins no request reaches any more (kvctl pins marks them "
            "stranded), which `kvctl unpin --stranded` frees")


def warn_stranded(stranded: list[dict], cause: str) -> None:
    """Log the pins `cause` stranded (ids only: never their text, which kvd does not keep)."""
    if stranded:
        log.warning("%s: %d pins (%s) hold %d blocks no request can reach now (%s); pin their prompts again, "
                    "then kvctl unpin --stranded", cause, len(stranded), ", ".join(p["pin_id"] for p in stranded),
                    sum(p["blocks"] for p in stranded),
                    "; ".join(dict.fromkeys(STRANDED_WHY[p["stranded"]] for p in stranded)))


def stranded_by(service, retired: set[str], cause: str) -> dict:
    """What an answer says of the pins that retiring the LoRA weights `retired` (digests no
    longer served) stranded: {"stranded_pins": [...]}, logged too; {} where it stranded none."""
    retired = retired - set(served_names(service))  # the same files served under another name
    stranded = stranded_pins(service, adapter_ids=retired) if retired else []
    warn_stranded(stranded, cause)
    return {"stranded_pins": stranded} if stranded else {}


def unpin_many(service, principal: Principal, *, stranded: bool, tenant: str | None) -> dict:
    """Unpin every stranded pin (`stranded`: stranded_pins), every pin of `tenant` (a tenant
    leaving: its blocks can then be evicted), or with both a tenant's stranded pins; each taken
    off the store first and audited as an unpin (`detail` says which sweep took it); one that
    lapsed or went meanwhile is left out. The cached blocks of those made in a block space no
    longer served go with them (`dropped_stale_blocks`)."""
    service.require_ready()
    rows = [_row(p, reason) for p, reason in _with_reasons(service)
            if (reason is not None or not stranded) and (tenant is None or p.tenant == tenant)]
    done, dropped = [], 0
    for row in rows:
        detail = {**({"stranded": row["stranded"]} if row["stranded"] else {}),
                  **({"swept_tenant": tenant} if tenant is not None else {})}
        try:
            body = unpin(service, row["pin_id"], principal, detail=detail)
        except ServiceError as exc:
            if exc.status != 404:
                what = "stranded pins" if tenant is None else f"pins of tenant {tenant}"
                raise ServiceError(exc.status, f"{exc} (unpinned before it: {len(done)} {what})",
                                   "pin_id") from None
            continue
        done.append({**row, "unpinned_blocks": body["unpinned_blocks"]})
        dropped += body.get("dropped_stale_blocks", 0)
    return {"unpinned": done, "unpinned_blocks": sum(p["unpinned_blocks"] for p in done),
            **({"tenant": tenant} if tenant is not None else {}),
            **({"dropped_stale_blocks": dropped} if dropped else {})}


def _pin_times(described: dict, now: float, wall: float | None = None) -> dict:
    """A pin's engine-clock times as Unix times (`now`, and `wall` read with it: unix_time), with
    the seconds it has left (None: until unpinned)."""
    expires = described["expires_at"]
    return {**described, "created_at": unix_time(described["created_at"], now, wall),
            "expires_at": unix_time(expires, now, wall),
            "expires_in_seconds": None if expires is None else max(expires - now, 0.0)}


def restore_pins(service) -> list[str]:
    """Pins survive restarts: re-register them by key (they re-pin blocks as they fill).
    Returns the ids of those that lapsed while kvd was down, for the caller to take off the
    store (not here, under the engine's lock, where a locked store would hold up the start)."""
    now, lapsed = time.time(), []
    clock = service.engine.clock()
    for row in service.store.pins():
        remaining = None if row["expires_at"] is None else row["expires_at"] - now
        if remaining is not None and not math.isfinite(remaining):  # stored before ttls had to be finite
            log.warning("pin %s: its stored expiry is not a time; kept until unpinned", row["pin_id"])
            remaining = None
        if remaining is not None and remaining <= 0:
            lapsed.append(row["pin_id"])
            continue
        keys = [bytes.fromhex(k) for k in row["keys"].split(",")]
        try:
            service.engine.cache.pin_keys(row["tenant"], keys, ttl=remaining, owner=row["owner"],
                                          note=row["note"], space=row.get("space"), adapter_id=row.get("adapter_id"),
                                          leave_room=False,  # the pins as they stood: warn_no_room warns
                                          created_at=clock_reading(row.get("created_at"), now, clock))
        except PinBudgetExceeded as exc:
            log.warning("pin %s not restored: %s", row["pin_id"], exc)
    return lapsed


def forget_stored_pin(service, pin_id: str) -> None:
    """Take a lapsed pin off the store; one the store cannot take now stays there, lapsed, and
    the next start drops it (a full disk must not stop kvd loading or its expiry loop)."""
    try:
        service.store.delete_pin(pin_id)
    except StoreUnavailable as exc:
        log.warning("pin %s lapsed but stays in the store until the next start: %s", pin_id, exc)


def expire_pins(service) -> None:
    with service.lock:
        lapsed = service.engine.cache.expire_pins() if service.engine else []
    for pin in lapsed:
        if pin.breakpoint:  # (a request's breakpoint: never stored, and not audited a request at a time)
            continue
        forget_stored_pin(service, pin.pin_id)
        service.store.audit(actor="ttl", tenant=pin.tenant, action="unpin", target=pin.pin_id,
                            result="expired", detail={})

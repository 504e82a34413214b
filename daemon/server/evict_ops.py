"""Evictions an operator asks for: a prefix and every prefix that extends it, a prompt (a
conversation: its own blocks and what extends it, not what it shares), a tenant's blocks, a LoRA
adapter's, an old model revision's, or everything unpinned, from every tier (the shared Redis
too, whichever daemon wrote them), with an answer that says exactly what went and what did not.
"""

from __future__ import annotations

from kvctl.daemon.cache.keys import chain_keys
from kvctl.daemon.cache.tiers.remote import RemoteUnavailable

from .calls import Principal, ServiceError
from .prefix_ops import is_short_hex, prefix_tree, resolve_prefix

# How long an eviction waits for blocks on their way to disk or Redis to land, so that it drops them
# too (a write published after the eviction would bring back what it said it removed).
EVICT_WRITE_WAIT_S = 30.0


def evict(service, *, prefix_id: str | None, tenant: str | None, model_revision: str | None,
          all_unpinned: bool, principal: Principal, purge_once: str | None = None,
          prompt: tuple[list[int], str, str] | None = None, dry_run: bool = False,
          adapter: tuple[str, str] | None = None) -> dict:
    """Evict from every tier and say exactly what went. A tenant's or an old revision's entries
    are also searched for on the shared Redis, whichever daemon wrote them; with `purge_once`
    (a fleet eviction's token, from kvd router) only if this daemon is the first to claim it
    there: another replica on the same Redis searches it once for all. `prompt`: (token ids, the
    tenant whose namespace they are hashed in, the LoRA adapter: "" for the model), as
    PrefixTree.prompt_subtree judges them. `adapter`: (its digest, "" for the model itself; how
    the answer names it), from `adapter_target`: every tree hashed under it.
    `dry_run`: the same answer, of what would go, with nothing evicted, searched or audited
    (`_preview`)."""
    engine = service.require_ready()
    chosen = [x for x in (prefix_id, tenant, model_revision) if x] + ([True] if all_unpinned else []) \
        + ([True] if prompt is not None else []) + ([True] if adapter is not None else [])
    if len(chosen) != 1:
        raise ServiceError(400, "evict: give exactly one of prefix, a prompt (text, tokens or messages), tenant, "
                                "model_revision, all_unpinned")
    subtree: list[bytes] | None = None
    prompt_figures: dict = {}
    if prefix_id:  # the prefix and every prefix that extends it; the one it branches from stays
        tree, _ = prefix_tree(service)
        first = resolve_prefix(prefix_id, tree)
        subtree = tree.subtree_keys(first)
        target = f"prefix={first.hex()[:16]}"
    elif prompt is not None:  # hashed outside the lock; never its text or ids in the answer or the audit
        token_ids, prompt_tenant, adapter = prompt
        keys = chain_keys(engine.namespace(prompt_tenant, adapter), token_ids)
        tree, _ = prefix_tree(service)
        subtree, shared = tree.prompt_subtree(keys)
        target = f"prompt of {len(token_ids)} tokens (tenant {prompt_tenant}" + (
            f", LoRA adapter {adapter})" if adapter else ")")
        prompt_figures = {"prompt_blocks": len(keys), "shared_blocks_kept": shared}
    elif adapter is not None:  # its trees whole, in every tier, shallowest blocks first
        adapter_id, target = adapter
        tree, roots = prefix_tree(service)
        subtree = [key for _, key in sorted(
            ((node.start_depth + i, key) for node in tree.nodes.values()
             if roots.get(node.root) is not None and roots[node.root].adapter_id == adapter_id
             for i, key in enumerate(node.keys)), key=lambda pair: pair[0])]
    other_spaces, records_error = {}, None  # the revision's spaces but the served one: from disk and Redis
    if model_revision:
        revision, other_spaces, records_error = _revision_spaces(service, model_revision)
        served = revision == service.loaded.revision
    asked = target if subtree is not None else (  # (a dry run is not audited, refused or not)
        f"tenant={tenant}" if tenant else f"model_revision={model_revision}" if model_revision else "all_unpinned")
    with service.engine_lock(changes=True) if dry_run else service.change_lock(principal, "evict", asked):
        if model_revision and revision != service.loaded.revision:
            report_blocks, skipped, select = 0, {}, None
            target = f"model_revision={revision[:16]}"
        else:
            if subtree is not None:
                select = None
            elif tenant:  # a block's own record of its tenant, else its tree's
                select = lambda root, info, owner: (owner or (info.tenant if info else None)) == tenant  # noqa: E731
                target = f"tenant={tenant}"
            else:
                select = lambda root, info, owner: True  # noqa: E731
                target = "model_revision=current" if model_revision else "all_unpinned"
            if subtree is None:
                report = engine.cache.evict_where(select, dry_run=dry_run)
            else:  # the device's part of it (lower tiers' copies are dropped below)
                report = engine.cache.evict_prefix([k for k in subtree if engine.cache.pool.block_of(k) is not None],
                                                   dry_run=dry_run)
            report_blocks, skipped = report.evicted_blocks, report.skipped
        roots = dict(engine.cache.roots)
        pinned = set(engine.cache.pins.key_counts())  # their lower-tier copies stay too
    lower_dropped = still_moving = 0
    doomed: list[bytes] = []
    if service.tiers is not None and subtree is not None:  # an eviction removes the prefix from every tier
        doomed = [k for k in subtree if k not in pinned]
    elif service.tiers is not None and select is not None:
        doomed = [k for k, (m, _) in service.tiers.known_metas().items()
                  if k not in pinned and select(m.root, roots.get(m.root), m.tenant)]
    if dry_run:
        if subtree is not None and doomed:  # the tree's blocks on the device alone are no lower tier's to drop
            known = service.tiers.known_metas()
            doomed = [k for k in doomed if k in known]
        searched = bool(tenant and select is not None) or bool(model_revision and not served)
        return _preview(service, target, report_blocks, skipped, len(doomed), prompt_figures, other_spaces, searched)
    if doomed:  # blocks on their way to disk or Redis land first, then go with the rest
        still_moving = service.tiers.wait_for_writes(doomed, EVICT_WRITE_WAIT_S)
        lower_dropped = service.tiers.drop(doomed)
    result = "ok" if not skipped.get("in_use") and not still_moving else "partial"
    body = {"evicted_blocks": report_blocks, "skipped": skipped, "result": result, "target": target,
            "lower_tier_blocks_dropped": lower_dropped, **prompt_figures}
    remote = service.tiers.remote if service.tiers is not None else None
    if model_revision and (other_spaces or (records_error and not served)):
        # another revision: its blocks everywhere, the shared Redis too. The served one: what this
        # daemon's disk holds of its older scales (daemons still serving them share the Redis's)
        body.update(_purge_spaces(service, other_spaces, None if served else records_error, shared=not served,
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
    service.store.audit(actor=principal.actor, tenant=principal.tenant, action="evict", target=target,
                        result=result, detail=body)
    return body


def adapter_target(service, model: str | None, adapter_id: str | None) -> tuple[str, str]:
    """(digest, how an answer names it) of the adapter whose blocks an eviction takes: `model`, a
    name served (the model's own: its blocks, none of its adapters'), or `adapter_id`, hex digits
    of a digest that cached trees were hashed under (an adapter a reload replaced or took away).
    An id that matches none or several is refused, as a short prefix id is."""
    engine = service.require_ready()
    if model is not None:
        name = service.adapter_named(model)
        if not name:
            return "", f"model {service.model_name} (its own blocks, none of its LoRA adapters')"
        return service.adapters()[name].digest, f"LoRA adapter {name}"
    with service.engine_lock():
        known = {info.adapter_id for info in engine.cache.roots.values() if info.adapter_id}
    served = {a.digest: name for name, a in service.adapters().items()}
    matches = sorted(d for d in known | set(served) if d.startswith(adapter_id))
    if not matches:
        raise ServiceError(404, f"adapter_id: no LoRA adapter {adapter_id!r} is served or has blocks cached here "
                                "(kvctl prefixes and kvctl status show their ids)", "adapter_id")
    if len(matches) > 1:
        raise ServiceError(409, f"adapter_id: {adapter_id!r} matches {len(matches)} adapters "
                                f"({', '.join(d[:16] for d in matches)}); give more digits", "adapter_id")
    digest = matches[0]
    return digest, f"LoRA adapter {served[digest]}" if digest in served else f"LoRA adapter {digest[:12]} (not served)"


def _preview(service, target: str, device_blocks: int, skipped: dict, lower_blocks: int, prompt_figures: dict,
             other_spaces: dict[str, dict], searched: bool) -> dict:
    """What an eviction would take (`kvctl evict --dry-run`), in the answer's own shape with
    `dry_run: true`: the device's blocks as they stand, the lower tiers' copies this daemon knows
    of (blocks still on their way down included), and the spaces of another revision. What only the
    eviction finds (other daemons' entries on the shared Redis, a space's disk segments) is named
    under `not_counted`; `message` warns of blocks the eviction would leave (in use now)."""
    from kvctl.daemon.cache.tiers.spaces import summary

    body = {"dry_run": True, "evicted_blocks": device_blocks, "skipped": skipped, "result": "ok", "target": target,
            "lower_tier_blocks_dropped": lower_blocks, **prompt_figures}
    if skipped.get("in_use"):
        body["message"] = f"{skipped['in_use']} blocks are in use by running requests now and would stay"
    not_counted = []
    if other_spaces:
        body["spaces"] = [summary(s, r) for s, r in sorted(other_spaces.items())]
        not_counted.append("the disk segments of those spaces (counted when they are purged)")
    if searched and service.tiers is not None and service.tiers.remote is not None:
        not_counted.append("other daemons' entries on the shared Redis (searched for by the eviction itself)")
    if not_counted:
        body["not_counted"] = not_counted
    return body


def _revision_spaces(service, text: str) -> tuple[str, dict[str, dict], str | None]:
    """The model revision `text` (hex digits) names, the block spaces of it that the disk
    folder or the shared Redis records other than the one served now (older scales, another
    format, another revision: spaces.py), and why the shared Redis could not be asked."""
    from kvctl.daemon.cache.tiers import space_digest
    from kvctl.daemon.cache.tiers.spaces import with_revision

    if not is_short_hex(text):
        raise ServiceError(400, f"model_revision: give at least 4 lowercase hex digits of a revision (kvctl "
                                f"status shows the model's), got {text!r}", "model_revision")
    records, error = service.tiers.space_records() if service.tiers is not None else ({}, None)
    served = space_digest(service.engine).hex()
    matched = {s: r for s, r in with_revision(records, text).items() if s != served}
    revisions = {r["model_revision"] for r in matched.values()}
    if service.loaded.revision.startswith(text):
        revisions.add(service.loaded.revision)
    if len(revisions) > 1:
        shown = ", ".join(sorted(r[:16] for r in revisions))
        raise ServiceError(409, f"model_revision: {text!r} matches {len(revisions)} revisions ({shown}); "
                                "give more digits", "model_revision")
    if not revisions:
        known = sorted({r["model_revision"][:16] for r in records.values()} - {service.loaded.revision[:16]})
        where = (f"; the shared Redis could not be asked ({error})" if error else "") + \
            (f"; the tiers have held blocks of {', '.join(known)}" if known else "")
        raise ServiceError(503 if error else 404,
                           f"model_revision: no tier here holds blocks of {text!r} (this daemon serves "
                           f"{service.loaded.revision[:16]}{where})", "model_revision")
    return revisions.pop(), matched, error


def _purge_spaces(service, spaces: dict[str, dict], records_error: str | None, shared: bool = True,
                  purge_once: str | None = None) -> dict:
    """Delete the blocks of these spaces (none served here) from the disk folder and, with
    `shared`, from the shared Redis, whichever daemon wrote them (with `purge_once`, unless
    another replica claimed it there): the body's part that says what went."""
    from kvctl.daemon.cache.tiers.spaces import summary

    chosen = {bytes.fromhex(s) for s in spaces}
    out: dict = {"spaces": [summary(s, r) for s, r in sorted(spaces.items())]}
    messages = [f"the shared Redis could not be asked which spaces it holds: {records_error}"] if records_error else []
    disk = service.tiers.disk if service.tiers is not None else None
    if disk is not None and chosen:
        out["disk_purge"] = disk.purge_spaces(chosen)
    remote = service.tiers.remote if service.tiers is not None else None
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

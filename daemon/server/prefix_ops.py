"""The cached prefixes as operators see them: one tree across the tiers, its rows (`kvctl
prefixes`), and the short ids that name them (resolved as git resolves a short hash).

kvctl presents; these functions decide, under the service lock where they read the device cache.
"""

from __future__ import annotations

from kvctl.daemon.cache.prefix_tree import TIER_ORDER, CachedBlock, PrefixTree

from .calls import ServiceError
from .durations import unix_time

PREFIX_SORTS = {"recent": None, "hits": "hits", "size": "bytes"}  # the figure each order sorts by


def is_short_hex(text: str) -> bool:
    """At least 4 lowercase hex digits: a prefix id or a model revision, shortened as git shortens
    a hash."""
    return len(text) >= 4 and all(c in "0123456789abcdef" for c in text)


def prefix_tree(service) -> tuple[PrefixTree, dict]:
    """The cached prefixes of every tier as one tree (see daemon/cache/prefix_tree.py), and
    what the cache knows of each tree's root (tenant, hits, last use)."""
    engine = service.require_ready()
    known = service.tiers.known_metas() if service.tiers is not None else {}
    lower = [CachedBlock(meta.key, meta.parent, meta.root, meta.depth, tier, meta.tenant, meta.hits, meta.last_use)
             for meta, tier in known.values()]
    keep = {meta.root for meta, _ in known.values()}
    with service.engine_lock():  # roots only lower tiers hold keep their tenant and hits
        rows = engine.cache.cached_block_rows()  # (the CachedBlocks are made after: the engine steps meanwhile)
        engine.cache.forget_roots(keep=keep)
        roots = dict(engine.cache.roots)
    tree = PrefixTree([CachedBlock(*row) for row in rows] + lower)
    for node in tree.nodes.values():  # where no block records its tenant, its root's record may
        if node.tenant is None and node.root in roots:
            node.tenant = roots[node.root].tenant
    return tree, roots


def served_names(service) -> dict[str, str]:
    """The model and the LoRA adapters served, by the id their blocks are hashed under (an
    adapter's digest; "": the model's own), with their names; two names for the same files: the first."""
    names = {"": service.model_name}
    for name, adapter in service.adapters().items():
        names.setdefault(adapter.digest, name)
    return names


def prefixes(service, tenant: str | None, pinned_only: bool, sort: str = "recent",
             limit: int = 0, under: str | None = None, model: str | None = None) -> tuple[list[dict], int]:
    """One row per node of the prefix tree: a run of cached blocks between branch points.
    `sort`: recent (the tree, most recently used first), hits or size (largest first, ties in
    tree order). `under`: only the row that id names and the rows that extend it. `model`: only
    the rows of that LoRA adapter (the model's name: the model's own). Returns (the first
    `limit` rows, or all for 0; how many there are).

    Each row names the adapter its tree was hashed under: `adapter_id` (its digest; "": the model
    itself; None where kvd does not know, a tree restored from a lower tier that no request has
    reached since kvd started) and `model`, the name it is served under (None: not served now).
    `stale`: its tree was hashed in a block space kvd no longer serves (scales since replaced by a
    live calibration, say), so no request reaches it; kvd drops such blocks as the scales change
    (Engine.set_scales) and as their stranded pin goes (pin_ops.unpin), so a pin keeps these.
    `private_blocks`: those of its blocks a running request hashed as its own (OpenAI's explicit
    prompt cache mode): no other request reads them, no pin or lower tier takes them, and they go
    as that request ends."""
    if sort not in PREFIX_SORTS:
        raise ServiceError(400, f"sort: unknown value {sort!r}; use {', '.join(PREFIX_SORTS)}", "sort")
    if limit < 0:
        raise ServiceError(400, f"limit: must be >= 0, got {limit}", "limit")
    engine = service.require_ready()
    wanted = None
    if model is not None:
        name = service.adapter_named(model)
        wanted = service.adapters()[name].digest if name else ""
    names = served_names(service)
    tree, roots = prefix_tree(service)
    nodes = tree.nodes.values()
    if under is not None:
        try:
            nodes = tree.subtree(tree.node_of[resolve_prefix(under, tree)])
        except ServiceError as exc:  # name the parameter the caller gave
            raise ServiceError(exc.status, str(exc).replace("prefix:", "under:", 1), "under") from None
    size, nbytes = engine.cache.block_size, engine.cache.block_bytes
    now, served = engine.clock(), engine.space_key()
    rows = []
    for node in nodes:
        info = roots.get(node.root)
        adapter_id = info.adapter_id if info is not None else None
        hits, last_use = node.hits, node.last_use
        if node.start_depth == 0 and info is not None:  # a tree's first node: its root's record spans tiers
            hits = max(hits or 0, info.hits)
            last_use = info.last_use if last_use is None else max(last_use, info.last_use)
        rows.append({
            "prefix_id": node.key.hex()[:16], "parent_id": node.parent.hex()[:16] if node.parent else None,
            "root_id": node.root.hex()[:16],  # the tree's first block: the row every row of it descends from
            "tenant": node.tenant, "adapter_id": adapter_id, "model": names.get(adapter_id),
            "start_token": node.start_depth * size, "tokens": (node.end_depth + 1) * size,
            "blocks": len(node.keys), "bytes": len(node.keys) * nbytes, "hits": hits,
            "idle_seconds": None if last_use is None else now - last_use,
            "last_use": unix_time(last_use, now), "tier": node.tier,
            "tiers": {t: node.tiers[t] for t in TIER_ORDER if t in node.tiers},
            "pinned": node.pinned_blocks > 0, "pinned_blocks": node.pinned_blocks,
            "in_use_blocks": node.in_use_blocks, "private_blocks": node.private_blocks,
            "children": len(node.children), "detached": node.detached,
            "stale": info is not None and info.stale(served),
        })
    rows = [r for r in _tree_order(rows) if (tenant is None or r["tenant"] == tenant)
            and (not pinned_only or r["pinned"]) and (wanted is None or r["adapter_id"] == wanted)]
    figure = PREFIX_SORTS[sort]
    if figure is not None:  # largest first; unknown last; sorted() keeps the tree order in ties
        rows = sorted(rows, key=lambda r: float("-inf") if r[figure] is None else r[figure], reverse=True)
    return (rows[:limit] if limit else rows), len(rows)


def resolve_prefix(prefix_id: str, tree: PrefixTree) -> bytes:
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

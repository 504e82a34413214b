"""`kvctl hit-curve --tenants` and `--tenant T`: the hit curve split by tenant. kvd counts each
prompt block against the tenant whose prompt looked it up (daemon/cache/hit_curve.py, `hit_curve`
in each row of /admin/tenants): what the one shared LRU cache of each size would have served each
tenant. Beside what kvd served the tenant in fact, it says who gains from more blocks, and what
shares, priorities and pins cost or give each tenant against plain LRU. A tenant kvd follows alone
too (hit_curve_tenants) has a second table: what a cache share of its own would serve it, by size."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.text import Text

from .errors import UserError
from .hit_curve_cmd import BAR, NEAR, smallest_enough, where_it_flattens, window_span
from .tables import compact_table, count, fit_cells, keep_whole
from .tenant_row import listed_row

COLUMNS = ("0.5", "1", "2", "4", "inf")  # the sizes the per-tenant table shows, where the curve has them
NAMED = 5  # tenants named at most in a note


def tenant_row(body: dict, tenant: str) -> dict:
    """`tenant`'s row of /admin/tenants, or an error that says what there is to ask for instead."""
    _require_curve(body)
    return listed_row(body, tenant, "kvctl hit-curve --tenants")


def tenant_json(body: dict, tenant: str) -> dict:
    """What `--tenant T --json` prints: the curve's sizes and the tenant's figures (what kvd served it
    among them)."""
    return {"tenant": tenant, "sizes": body["hit_curve"]["sizes"], "alone_sizes": body["hit_curve"].get("alone_sizes"),
            "hit_curve": tenant_row(body, tenant)["hit_curve"]}


def tenants_json(body: dict) -> dict:
    """What `--tenants --json` prints: the sizes, each tenant's figures, and the retired tenants' sum."""
    _require_curve(body)
    return {"sizes": body["hit_curve"]["sizes"], "retired": body["hit_curve"]["retired"],
            "tenants": [{"tenant": row["tenant"], "hit_curve": row["hit_curve"]} for row in body["tenants"]]}


def render_tenant_curve(body: dict, tenant: str):
    """One tenant's curve: a row per size, the device's own in bold, then where it flattens and
    what kvd served the tenant in fact."""
    row = tenant_row(body, tenant)
    curve, sizes = row["hit_curve"], body["hit_curve"]["sizes"]
    if not curve or not curve["prompt_tokens"]:  # (None: at kvd router, only replicas older than the curve had it)
        return Text(f"no prompt of {tenant!r} counted by the hit curve yet")
    fleet = "replicas" in body
    table = compact_table("cache", "blocks", "hit tokens", "hit ratio", "")
    for size in sizes:
        hits = curve["hit_tokens"][size["times"]]
        ratio = hits / curve["prompt_tokens"]
        label = "never evicts" if size["blocks"] is None else f"{size['times']}x" + (
            " (device)" if size["times"] == "1" else "")
        table.add_row(label, "-" if size["blocks"] is None else f"{size['blocks']:,}", f"{hits:,}", f"{ratio:.1%}",
                      "█" * round(ratio * BAR), style="bold" if size["times"] == "1" else None)
    for column in table.columns[1:4]:
        column.justify = "right"
    fit_cells(table, 0, 1, 2, 3)
    heading = (f"{curve['prompts']:,} prompts of {tenant!r}, {curve['prompt_tokens']:,} tokens (of them "
               f"{curve['looked_tokens']:,} in full blocks a cache can serve); one LRU cache of each size, shared "
               f"by every tenant as kvd's is{' (at each replica, their blocks summed)' if fleet else ''}, would have "
               "served it:")
    blocks = "the devices' blocks" if fleet else "the device's blocks"
    notes = where_it_flattens(smallest_enough(sizes, curve["hit_tokens"], curve["prompt_tokens"]), sizes[0], blocks)
    notes.append(f"kvd served {tenant!r} {curve['served_tokens'] / curve['prompt_tokens']:.1%} in fact "
                 f"({curve['served_tokens']:,} tokens), under its eviction policy, shares, pins and lower tiers")
    missing = [Text(body["message"], style="yellow")] if body.get("message") else []  # replicas that did not answer
    return Group(Text(escape(heading)), table, *missing, *(Text(escape(note), style="dim") for note in notes),
                 *_alone_part(body, row, tenant, blocks))


def tenant_window(body: dict, tenant: str, seconds: int) -> tuple[dict, dict]:
    """`tenant`'s row, and its curve alone over the recent window of `seconds`; an error where it is
    not followed alone (its part of the shared curve is counted since kvd started)."""
    row = tenant_row(body, tenant)
    alone = (row["hit_curve"] or {}).get("alone")
    if alone is None:
        raise UserError(f"last: {tenant!r} is not followed alone (hit_curve_tenants), and its part of the shared "
                        f"curve is counted since kvd started: kvctl hit-curve --tenant {tenant} without --last")
    window = next((w for w in alone.get("recent") or () if w["window"] == seconds), None)
    if window is None:
        raise UserError(f"last: no recent window of {tenant!r} alone (a kvd older than kvctl hit-curve --tenant T "
                        "--last answered)")
    return row, window


def tenant_window_json(body: dict, tenant: str, seconds: int) -> dict:
    """What `--tenant T --last W --json` prints: its curve alone over the window, and the shares' sizes."""
    _, window = tenant_window(body, tenant, seconds)
    return {"tenant": tenant, "alone_sizes": body["hit_curve"].get("alone_sizes"), "alone": window}


def render_tenant_window(body: dict, tenant: str, seconds: int):
    """A tenant followed alone: what a cache share of its own of each size would have served it over
    the recent window: the share its traffic needs now."""
    row, window = tenant_window(body, tenant, seconds)
    since = window_span(window, "it was followed")  # (from kvd's start, or from the reload that named it)
    if not window["prompt_tokens"]:
        return Text(f"no prompt of {tenant!r} {since}")
    blocks = "the devices' blocks" if "replicas" in body else "the device's blocks"
    parts = _alone_part(body, {**row, "hit_curve": {**row["hit_curve"], "alone": window}}, tenant, blocks, since)
    return Group(*parts, Text(f"its part of the shared curve is counted since kvd started: kvctl hit-curve --tenant "
                              f"{tenant}", style="dim"))


def _alone_part(body: dict, row: dict, tenant: str, blocks: str, since: str | None = None) -> list:
    """For a tenant followed alone: a row per share of the device's blocks, its own share's marked,
    then the smallest share within a point of a cache of its own that never evicts. `since`: what
    a recent window covers (None: since it was followed)."""
    alone, sizes = row["hit_curve"].get("alone"), body["hit_curve"].get("alone_sizes") or []
    if not alone or not alone["prompt_tokens"] or not sizes:
        return []
    share = row.get("share_blocks")  # None: no shares set
    table = compact_table("share", "blocks", "hit tokens", "hit ratio", "")
    marked = False
    for size in sizes:
        hits = alone["hit_tokens"][size["times"]]
        ratio = hits / alone["prompt_tokens"]
        mine = size["blocks"] is not None and size["blocks"] == share
        marked = marked or mine
        table.add_row("never evicts" if size["blocks"] is None else size["times"] + (" (its share)" if mine else ""),
                      "-" if size["blocks"] is None else f"{size['blocks']:,}", f"{hits:,}", f"{ratio:.1%}",
                      "█" * round(ratio * BAR), style="bold" if mine else None)
    for column in table.columns[1:4]:
        column.justify = "right"
    fit_cells(table, 0, 1, 2, 3)
    when = "(followed since kvd started or since hit_curve_tenants named it)" if since is None else since
    heading = (f"Alone, in a cache of its own of each share of {blocks} (tenant_cache_shares), the same "
               f"{alone['prompts']:,} prompts of {tenant!r} would have been served {when}:")
    notes = []
    enough = smallest_enough(sizes, alone["hit_tokens"], alone["prompt_tokens"])
    if enough is not None:
        notes.append(f"a share of {enough['times']} ({enough['blocks']:,} blocks) would serve {tenant!r} within "
                     f"{NEAR * 100:g} point of a cache of its own that never evicts (tenant_cache_shares: "
                     f"{tenant}={enough['times']})")
    if share is None:
        notes.append(f"{tenant!r} has no share now")
    elif not marked:
        notes.append(f"its share now: {share:,} blocks")
    notes.append("a share keeps about that many of its idle blocks when others need room; the blocks its running "
                 "requests hold count toward none")
    return [Text(escape(heading)), table, *(Text(escape(note), style="dim") for note in notes)]


def render_tenant_curves(body: dict, top: int):
    """A row per tenant, the most prompt tokens first: what kvd served it, and LRU's ratio at each
    of a few sizes; then who would gain most from twice the blocks, and who kvd served under LRU."""
    _require_curve(body)
    sizes = [size for size in body["hit_curve"]["sizes"] if size["times"] in COLUMNS]
    counted = sorted((row for row in body["tenants"] if row["hit_curve"] and row["hit_curve"]["prompt_tokens"]),
                     key=lambda row: (-row["hit_curve"]["prompt_tokens"], row["tenant"]))
    if not counted:
        return Text("no tenant's prompt counted by the hit curve yet")
    table = compact_table("tenant", "prompt tokens", "kvd served",
                          *("never evicts" if s["blocks"] is None else f"LRU {s['times']}x" for s in sizes))
    shown = counted[:top] if top else counted
    for row in shown:
        curve = row["hit_curve"]
        served = curve["served_tokens"] / curve["prompt_tokens"]
        table.add_row(row["tenant"], count(curve["prompt_tokens"]), f"{served:.1%}",
                      *(f"{curve['hit_tokens'][s['times']] / curve['prompt_tokens']:.1%}" for s in sizes))
    for column in table.columns[1:]:
        column.justify = "right"
    keep_whole(table, 0)
    fit_cells(table, *range(1, len(table.columns)))
    whose = "each replica's blocks, their figures summed" if "replicas" in body else "the device's blocks"
    parts = [Text(f"What one LRU cache of each size (times {whose}, shared by every tenant) would have served each "
                  "tenant's prompts, beside what kvd served:"), table]
    if body.get("message"):  # at kvd router: the replicas that did not answer
        parts.append(Text(body["message"], style="yellow"))
    notes = []
    if len(counted) > len(shown):
        more = len(counted) - len(shown)
        notes.append(f"and {more:,} more tenant{'s' if more != 1 else ''} (--top 0 lists every one)")
    retired = body["hit_curve"]["retired"]
    if retired["prompt_tokens"]:
        notes.append(f"{retired['tenants']:,} tenants retired from the curve's book (max_tracked_tenants): "
                     f"{retired['prompt_tokens']:,} prompt tokens, LRU 1x "
                     f"{retired['hit_tokens'].get('1', 0) / retired['prompt_tokens']:.1%}")
    notes += _gain_notes(counted)
    alone = [row["tenant"] for row in body["tenants"] if row["hit_curve"] and row["hit_curve"].get("alone")]
    if alone:
        notes.append(f"followed alone too, to size their shares by (kvctl hit-curve --tenant T): {', '.join(alone)}")
    return Group(*parts, *(Text(escape(note), style="dim") for note in notes))


def _gain_notes(counted: list[dict]) -> list[str]:
    """Who twice the blocks would serve the most more tokens, and whom kvd served more than a
    point under plain LRU over the same blocks."""
    notes = []
    gains = [(row["hit_curve"]["hit_tokens"].get("2", 0) - row["hit_curve"]["hit_tokens"].get("1", 0), row)
             for row in counted]
    gained, most = max(gains, key=lambda pair: (pair[0], -counted.index(pair[1])))
    if gained > 0:
        curve = most["hit_curve"]
        before, after = (curve["hit_tokens"][t] / curve["prompt_tokens"] for t in ("1", "2"))
        notes.append(f"twice the blocks would serve {most['tenant']!r} the most more: {before:.1%} -> {after:.1%} "
                     f"({gained:,} tokens more)")
    under = []
    for row in counted:
        curve = row["hit_curve"]
        if "1" in curve["hit_tokens"]:
            behind = (curve["hit_tokens"]["1"] - curve["served_tokens"]) / curve["prompt_tokens"]
            if behind > NEAR:
                under.append((behind, row["tenant"]))
    if under:
        under.sort(key=lambda pair: (-pair[0], pair[1]))
        named = ", ".join(f"{tenant!r} (-{behind * 100:.1f} points)" for behind, tenant in under[:NAMED]) + (
            f" and {len(under) - NAMED:,} more" if len(under) > NAMED else "")
        notes.append(f"kvd served under plain LRU over its blocks: {named}: other tenants' shares or priorities, "
                     "pins, evictions by hand, or the blocks running requests hold")
    return notes


def _require_curve(body: dict) -> None:
    if body.get("hit_curve") is None:
        raise UserError("hit curve by tenant: kvd follows none (hit_curve: false in its settings, or a kvd older than "
                        "kvctl hit-curve --tenants)")

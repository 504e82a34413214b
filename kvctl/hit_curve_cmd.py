"""`kvctl hit-curve`: what an LRU prefix cache of each size would have served of the prompts kvd
took since it started. kvd measures it (daemon/cache/hit_curve.py, `hit_curve` in /admin/status);
this draws it, one table per replica at kvd router."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Group
from rich.markup import escape
from rich.text import Text

from .command_kit import client_for, show_or_watch
from .errors import UserError
from .fleet_status import is_fleet
from .tables import compact_table, duration, fit_cells, size

BAR = 20  # the widest bar, at a hit ratio of 100%
NEAR = 0.01  # a size within this of the never-evicting cache's hit ratio is where more blocks stop paying
LAST = {"5m": 300, "1h": 3600}  # --last: the recent windows kvd keeps (daemon/cache/hit_curve.py WINDOWS)


def hit_curve(ctx: typer.Context,
              tenant: Optional[str] = typer.Option(
                  None, "--tenant", help="One tenant's part of the curve: what the same cache of each size, "
                  "shared by every tenant, would have served its prompts."),
              tenants: bool = typer.Option(False, "--tenants", help="A row per tenant: what kvd served it, and what "
                                           "LRU at a few sizes would have."),
              top: int = typer.Option(20, "--top", min=0, help="With --tenants: the N tenants with the most "
                                      "prompt tokens (0: every one). --json lists every one."),
              last: Optional[str] = typer.Option(None, "--last", help="5m or 1h: the prompts of the last 5 minutes "
                                                 "or hour only (default: since kvd started)."),
              watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """What a prefix cache of each size would have served of this kvd's prompts: hit ratio by size.

    kvd follows every prompt block it admits (and every block a reply writes) and measures how
    many other blocks were used since it was last used: an LRU cache of that many blocks would
    have held it. So one pass over the traffic gives, for caches from an eighth of the device's
    blocks to 64 times them and one that never evicts, the prompt tokens each would have served.
    Read it to size the device cache and the lower tiers: where the curve flattens, more blocks buy
    little. Exact up to 32,768 blocks; larger sizes are estimated from a sample of the older blocks.
    Counts only, never prompts. At kvd router, each replica's.

    By tenant (`--tenants`, `--tenant T`), each block counts for the tenant whose prompt looked it
    up: who would gain from more blocks, and whom kvd's shares, priorities and pins served under
    plain LRU. At kvd router, the replicas' figures summed.

    `--last 5m` or `--last 1h` draws the prompts of the last 5 minutes or hour (within a minute):
    what traffic needs now, where the default, since kvd started, may be weeks of it.

    Example: kvctl hit-curve --last 1h --watch; kvctl hit-curve --tenants
    """
    client = client_for(ctx)
    if tenant is not None and tenants:
        raise UserError("give --tenant or --tenants, not both")
    if last is not None and last not in LAST:
        raise UserError(f"last: must be {' or '.join(LAST)}, got {last!r}")
    if last is not None and tenants:
        raise UserError("last: the tenants' figures are since kvd started (give --last without --tenants; a tenant "
                        "followed alone, hit_curve_tenants, has recent windows: --tenant T --last 1h)")
    from .hit_curve_tenants import (render_tenant_curve, render_tenant_curves, render_tenant_window, tenant_json,
                                    tenant_window_json, tenants_json)
    if tenant is not None and last is not None:
        show_or_watch(lambda: client.get("/admin/tenants", tenant=tenant),
                      lambda body: render_tenant_window(body, tenant, LAST[last]), watch,
                      as_json, for_json=lambda body: tenant_window_json(body, tenant, LAST[last]))
        return
    if tenant is not None:
        show_or_watch(lambda: client.get("/admin/tenants", tenant=tenant),
                      lambda body: render_tenant_curve(body, tenant), watch,
                      as_json, for_json=lambda body: tenant_json(body, tenant))
        return
    if tenants:
        show_or_watch(lambda: client.get("/admin/tenants"), lambda body: render_tenant_curves(body, top), watch,
                      as_json, for_json=tenants_json)
        return
    show_or_watch(lambda: client.get("/admin/status"), lambda status: render_hit_curves(status, last), watch,
                  as_json, for_json=curves_of)


def curves_of(status: dict) -> dict:
    """The part of a status answer `--json` prints: the curve, or each replica's."""
    if is_fleet(status):
        return {"replicas": [{"replica": row["replica"], "hit_curve": row.get("hit_curve"),
                              **({"error": row["error"]} if "error" in row else {})}
                             for row in status["replica_status"]]}
    return {"hit_curve": status.get("hit_curve"), "bytes_per_block": status.get("bytes_per_block"),
            "tokens": status.get("tokens")}


def window_span(recent: dict, began: str = "kvd started") -> str:
    """What a recent window's figures cover: `in the last 1h`, or all of a curve younger than the
    window (one that `began` then)."""
    if recent["seconds"] >= recent["window"]:
        return f"in the last {duration(recent['seconds'])}"
    return f"since {began}, {duration(recent['seconds'])} ago"


def twice_the_cache(curve: dict | None) -> str:
    """What `kvctl status` adds to its prefix hits: what LRU over the device's blocks, and over twice
    them, would have served ("" before any prompt, or from a kvd older than the curve)."""
    if not curve or not curve["prompt_tokens"]:
        return ""
    ratios = {row["times"]: row["hit_tokens"] / curve["prompt_tokens"] for row in curve["sizes"]}
    if "1" not in ratios or "2" not in ratios:
        return ""
    return f"; LRU over these blocks {ratios['1']:.1%}, over twice them {ratios['2']:.1%} (kvctl hit-curve)"


def render_hit_curves(status: dict, last: str | None = None):
    if not is_fleet(status):
        return render_hit_curve(status, last)
    parts = []
    for row in status["replica_status"]:
        parts.append(Text(f"replica {row['replica']}", style="bold"))
        parts.append(Text(f"  no answer: {row['error']}") if "error" in row else render_hit_curve(row, last))
    return Group(*parts)


def render_hit_curve(status: dict, last: str | None = None):
    """One kvd's curve (over the `last` window, or since kvd started): a row per size, the device's
    own marked, then what the figures rest on."""
    curve = status.get("hit_curve")
    if curve is None:
        return Text("this kvd follows no hit curve (hit_curve: false in its settings)" if "hit_curve" in status
                    else "this kvd reports no hit curve (it is older than kvctl hit-curve)")
    since = "since kvd started"
    if last is not None:
        recent = next((row for row in curve.get("recent") or () if row["window"] == LAST[last]), None)
        if recent is None:
            return Text("this kvd keeps no recent hit curve (it is older than kvctl hit-curve --last)")
        curve, since = {**curve, **recent}, window_span(recent)
    if not curve["prompts"]:
        return Text(f"no prompt admitted {since}: nothing to draw yet")
    per_block, prompt_tokens = status.get("bytes_per_block"), curve["prompt_tokens"]
    dtype = str((status.get("model") or {}).get("dtype", "the model's dtype")).removeprefix("torch.")
    formats: dict[int, list[str]] = {}  # blocks -> the other cache formats holding that many in the same memory
    for name, blocks in (curve.get("formats") or {}).items():  # (an older kvd does not say)
        formats.setdefault(blocks, []).append(dtype if name == "auto" else name)
    table = compact_table("cache", "blocks", "bytes", "hit tokens", "hit ratio", "")
    enough = smallest_enough(curve["sizes"], {row["times"]: row["hit_tokens"] for row in curve["sizes"]},
                             prompt_tokens)
    for row in curve["sizes"]:
        ratio = row["hit_tokens"] / prompt_tokens
        if row["blocks"] is None:
            label, blocks, held = "never evicts", "-", "-"
        else:
            label = f"{row['times']}x" + (" (device)" if row["times"] == "1" else "") + (
                f" ({', '.join(formats[row['blocks']])})" if row["blocks"] in formats else "")
            blocks, held = f"{row['blocks']:,}", "-" if per_block is None else size(row["blocks"] * per_block)
        table.add_row(label, blocks, held, f"{row['hit_tokens']:,}", f"{ratio:.1%}",
                      "█" * round(ratio * BAR), style="bold" if row["times"] == "1" else None)
    for column in table.columns[1:5]:
        column.justify = "right"
    fit_cells(table, 0, 1, 2, 3, 4)
    heading = (f"{curve['prompts']:,} prompts, {prompt_tokens:,} tokens {since} (of them "
               f"{curve['looked_tokens']:,} in full blocks a cache can serve); an LRU cache of each size would "
               "have served:")
    notes = _notes(status, curve, enough, formats)
    return Group(Text(heading), table, *(Text(escape(note), style="dim") for note in notes))


def _notes(status: dict, curve: dict, enough: dict | None, formats: dict[int, list[str]]) -> list[str]:
    """What the table rests on, under it: where more blocks stop paying, what another cache format
    would serve, what kvd served in fact, its tiers' room, and the curve's own limits."""
    prompt_tokens, per_block, tokens = curve["prompt_tokens"], status.get("bytes_per_block"), status.get("tokens") or {}
    notes = where_it_flattens(enough, curve["sizes"][0])
    now = next((row for row in curve["sizes"] if row["times"] == "1"), None)
    for row in curve["sizes"]:
        if row["blocks"] in formats and now is not None and row["blocks"] > now["blocks"]:
            names = formats[row["blocks"]]
            notes.append(f"{' and '.join(names)} would hold {row['times']}x the blocks in the same memory: LRU "
                         f"{row['hit_tokens'] / prompt_tokens:.1%} against {now['hit_tokens'] / prompt_tokens:.1%} "
                         f"at these (kvctl calibrate, then cache_dtype: {names[0]})")
    served = curve.get("served_tokens", tokens.get("hit"))  # (a kvd older than served_tokens: its total)
    if served is not None:
        notes.append(f"kvd served {served / prompt_tokens:.1%} in fact ({served:,} tokens), under "
                     f"{status.get('eviction_policy', 'its')} eviction, its pins, the blocks running requests hold "
                     "and its lower tiers; the curve is plain LRU over one pool")
    tiers = status.get("tiers") or {}
    sized = {name: t["capacity_bytes"] // per_block for name, t in tiers.items()
             if t.get("capacity_bytes") and per_block}
    if sized:
        notes.append("lower tiers hold up to " + ", ".join(f"{name} {blocks:,}" for name, blocks in sized.items())
                     + " blocks more (uncompressed)")
    if curve["sample_rate"] < 1:
        notes.append(f"exact up to {curve['exact_blocks']:,} blocks; larger sizes estimated from "
                     f"{curve['sample_rate']:.2%} of the older blocks")
    window = (status.get("model") or {}).get("sliding_window")
    if window:
        notes.append(f"the model slides a window of {window['tokens']:,} tokens: a hit needs only the blocks it "
                     "reaches, the curve counts whole prefixes")
    return notes


def smallest_enough(sizes: list[dict], hit_tokens: dict[str, int], prompt_tokens: int) -> dict | None:
    """The smallest size (a row of `sizes`) whose hit tokens are within NEAR of a cache that never
    evicts (None: none is, or no prompt)."""
    if not prompt_tokens:
        return None
    never = hit_tokens[sizes[-1]["times"]] / prompt_tokens
    return next((row for row in sizes if row["blocks"] is not None
                 and never - hit_tokens[row["times"]] / prompt_tokens <= NEAR), None)


def where_it_flattens(enough: dict | None, first: dict, blocks: str = "the device's blocks") -> list[str]:
    """The note that says from which size more blocks buy little (none where no size is near)."""
    if enough is first:
        return [f"even {enough['times']}x {blocks} would serve within {NEAR * 100:g} point of a cache that never "
                "evicts: the misses are blocks used for the first time"]
    if enough is not None:
        return [f"{enough['times']}x {blocks} would serve within {NEAR * 100:g} point of a cache that never evicts: "
                "more blocks than that buy little"]
    return []

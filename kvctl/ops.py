"""Operator commands: prefixes, pin, unpin, evict, explain, config, audit (status: status_view.py).

kvctl presents; the daemon decides. Every command talks to kvd over its API and has --json.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import quote

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from .command_kit import client_for, emit, prompt_body
from .errors import UserError
from .tables import compact_table, duration, fit_cells, keep_whole, size, when

PREFIX_SORTS = ("recent", "hits", "size")  # kvd sorts and cuts the list (a large cache has many rows)


def prefixes(ctx: typer.Context, tenant: Optional[str] = typer.Option(None, help="Only this tenant."),
             pinned: bool = typer.Option(False, "--pinned", help="Only pinned prefixes."),
             sort: str = typer.Option("recent", help="recent (a tree, each row followed by the rows that extend "
                                                       "it, most recently used first), hits or size."),
             limit: int = typer.Option(50, help="Rows in the table (0: all); --json always has all."),
             under: Optional[str] = typer.Option(None, "--under", help="Only this row (an id) and the rows "
                                                                       "that extend it."),
             model: Optional[str] = typer.Option(None, "--model", help="Only a LoRA adapter's rows (lora_modules); "
                                                                      "the model's name: the model's own."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Cached prefixes as a tree, in every tier: one row per run of blocks between branch points.

    Each row has the row it extends (parent), tenant, LoRA adapter, tokens, blocks, size, hits,
    idle time, tier and pin; never text. A running request's own blocks (explicit prompt cache
    mode) are counted under private: they go as it ends, and no pin takes them. An adapter's rows
    name it; rows of weights a reload replaced or took away show their id (`kvctl evict
    --adapter-id` takes them).

    Prompts that share a start (a chat template, a system prompt) share a row, and each way they
    go on from it is a row of its own whose parent is that row. An id given to `kvctl evict
    --prefix` or `kvctl swap` takes its row and every row that extends it.

    At kvd router, every replica's rows, replica by replica (#0, #1, ... named below the table):
    a prefix's id is the same on every replica that holds it.

    Example: kvctl prefixes --tenant acme --pinned; kvctl prefixes --under 9d3476bf
    """
    if sort not in PREFIX_SORTS:
        raise UserError(f"sort: unknown value {sort!r}; use {', '.join(PREFIX_SORTS)}")
    if limit < 0:
        raise UserError(f"limit: must be >= 0, got {limit}")
    data = client_for(ctx).get("/admin/prefixes", tenant=tenant, pinned=pinned or None, sort=sort,
                               limit=None if as_json or not limit else limit, under=under, model=model)

    def render(d):
        shown = d["prefixes"]
        total = d.get("total", len(shown))
        # Columns that would say the same on every row are left out (said once below the table)
        # so that the table fits 80 columns; --json has every field.
        tenants = {"-" if p["tenant"] is None else p["tenant"] for p in shown}  # None: not known
        models = {_prefix_model(p) for p in shown}
        adapters = any(p.get("adapter_id") for p in shown)  # some row is a LoRA adapter's (an older kvd: none)
        optional = {"tenant": len(tenants) > 1, "pinned": any(p["pinned"] for p in shown),
                    "in use": any(p["in_use_blocks"] for p in shown),
                    "private": any(p.get("private_blocks") for p in shown),  # (an older kvd: none)
                    "model": len(models) > 1 and adapters}  # with no adapter, every row is the model's
        fleet = [r["replica"] for r in d.get("replicas") or []]  # at kvd router: rows replica by replica
        optional["replica"] = bool(fleet)
        headers = ["replica", "prefix", "parent", "tenant", "model", "tokens", "size", "hits", "idle", "tier", "pinned",
                   "in use", "private"]
        headers = [h for h in headers if optional.get(h, True)]
        table = compact_table(*headers)
        for column in table.columns:
            column.justify = "right" if column.header in ("tokens", "size", "hits", "idle", "in use", "private") \
                else "left"
        for p in shown:
            cells = {"prefix": p["prefix_id"],
                     "parent": _prefix_parent(p),
                     "tenant": "-" if p["tenant"] is None else p["tenant"], "model": _prefix_model(p),
                     "tokens": f"{p.get('start_token', 0):,}-{p['tokens']:,}", "size": size(p["bytes"]),
                     "hits": "-" if p["hits"] is None else f"{p['hits']:,}", "idle": duration(p.get("idle_seconds")),
                     "tier": "+".join(p.get("tiers") or [p["tier"]]), "pinned": "yes" if p["pinned"] else "",
                     "in use": f"{p['in_use_blocks']:,}" if p["in_use_blocks"] else "",
                     "private": f"{p['private_blocks']:,}" if p.get("private_blocks") else "",
                     "replica": f"#{fleet.index(p['replica'])}" if fleet else ""}
            table.add_row(*(cells[h] for h in headers))
        keep_whole(table, 0)
        console = Console()
        console.print(table if shown else "no cached prefixes")
        if len(shown) < total:
            console.print(f"{len(shown)} of {total:,} prefixes, by {sort}; --limit 0 shows all")
        quiet = [name for name in ("pinned", "in use") if not optional[name]]
        only_adapter = len(models) == 1 and adapters  # the model's alone: unsaid
        same = ([f"tenant {next(iter(tenants))}"] if len(tenants) == 1 else []) + \
            ([f"model {next(iter(models))}"] if only_adapter else []) + \
            (["none " + " or ".join(quiet)] if quiet else [])
        if shown and same:
            console.print("; ".join(same))
        if any(p.get("detached") and not p.get("stale") for p in shown):
            console.print("detached: the blocks before it are cached nowhere, so no request reaches it")
        if optional["private"]:
            console.print("private: blocks a running request hashed as its own (explicit prompt cache mode); no other "
                          "request reads them, no pin or lower tier takes them, and they go as it ends")
        if any(p.get("stale") for p in shown):
            console.print(f"stale: made under {STRANDED_CAUSES['space']}; no request reaches it, and a stranded pin "
                          "keeps it (kvctl unpin --stranded)")
        for i, name in enumerate(fleet):
            console.print(f"#{i} {escape(name)}", highlight=False, soft_wrap=True)
        if d.get("message"):
            Console(stderr=True).print(f"[yellow]{escape(d['message'])}[/yellow]")
    emit(data, as_json, render)


def _dropped(unpinned: dict) -> str:
    """What an unpin answer says of the cached blocks that went with stranded pins, if any (kvd
    drops the blocks of a pin made in a block space no longer served)."""
    dropped = unpinned.get("dropped_stale_blocks")
    return f"; {dropped:,} cached blocks dropped with them" if dropped else ""


def _prefix_parent(row: dict) -> str:
    """A prefix row's parent column: the row it branches from, or why no request reaches it."""
    if row.get("stale"):
        return "stale"
    return "detached" if row.get("detached") else (row.get("parent_id") or "-")[:8]


def _prefix_model(row: dict) -> str:
    """Who a prefix row's blocks are for: the model or a LoRA adapter by name, an adapter no longer
    served by its id, "-" where kvd does not know (or an older kvd does not say)."""
    if row.get("model"):
        return row["model"]
    adapter_id = row.get("adapter_id")
    return f"lora {adapter_id[:12]}" if adapter_id else "-"


def pin(ctx: typer.Context, text: Optional[str] = typer.Argument(None, help="Prefix text to pin."),
        tokens: Optional[str] = typer.Option(None, "--tokens", help="Token ids, comma-separated."),
        file: Optional[Path] = typer.Option(None, "--file", help="Read the prefix text from a file."),
        messages: Optional[Path] = typer.Option(
            None, "--messages", help="A JSON file of chat messages (a system prompt, say), rendered by the "
                                     "model's chat template as every chat that starts with them begins."),
        prefix: Optional[str] = typer.Option(None, "--prefix", help="A cached prefix's id from `kvctl prefixes`."),
        tenant: Optional[str] = typer.Option(None, help="Tenant whose namespace and budget to use."),
        model: Optional[str] = typer.Option(None, help="With a prompt: the LoRA adapter (lora_modules) whose own "
                                                       "blocks to warm and pin. Default: the model's."),
        ttl: Optional[str] = typer.Option(None, help="Lifetime: 90s, 30m, 1h, 2d; default: until unpinned."),
        note: str = typer.Option("", help="Why, for the record."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Warm a prefix if needed and pin it; pins survive restarts.

    `--prefix ID` pins a cached prefix as its row in `kvctl prefixes` lists it (from the first
    token to the row's end), without its text; its tenant pays.

    Chat traffic: pin its system prompt with `--messages system.json` (`[{"role": "system",
    "content": "..."}]`). Pinned as text, the prompt would lack the template's tokens around it and
    match no chat.

    At kvd router, every replica pins it (and warms it where it is not cached).

    Example: kvctl pin --file system_prompt.txt --tenant acme --ttl 24h --note "support bot"
    """
    if prefix is not None:
        if any(x is not None for x in (text, tokens, file, messages)):
            raise UserError("give exactly one of TEXT, --tokens, --file, --messages or --prefix")
        if model is not None:
            raise UserError("--model is for a prompt; a prefix id names its LoRA adapter's blocks already")
        body = {"prefix": prefix, "tenant": tenant, "ttl": ttl, "note": note}
    else:
        body = {**prompt_body(text, tokens, file, messages), "tenant": tenant, "ttl": ttl, "note": note,
                **({"model": model} if model else {})}
    data = client_for(ctx).post("/admin/pins", body)

    def render(d):
        fleet = "replicas" in d  # at kvd router: what each replica holds is on a line of its own
        cached = "" if fleet else f" ({d['cached_blocks']} cached{', warmed' if d['warmed'] else ''})"
        Console().print(f"pinned {d['pin_id']}" + (f" on {len(d['replicas'])} replicas" if fleet else "")
                        + f": {d['blocks']} blocks for tenant {d['tenant']}{cached}"
                        + (f", expires in {duration(d['expires_in_seconds'])}" if d.get("expires_in_seconds") else ""))
        replica_lines(d, lambda row: f"{row['cached_blocks']} cached" + (", warmed" if row["warmed"] else ""))
        if d.get("was"):
            Console().print(pinned_again(d["was"], d), highlight=False, soft_wrap=True)
        if d.get("private_blocks_left_out"):
            left = d["private_blocks_left_out"]
            Console().print(f"{left} block{'s' if left != 1 else ''} at the row's end left unpinned: a running "
                            "request's own (explicit prompt cache mode), which go as it ends", highlight=False,
                            soft_wrap=True)
        if d.get("let_go_holds"):
            holds = len(d["let_go_holds"])
            Console().print(f"{holds} of tenant {d['tenant']}'s requests' prompt cache breakpoint hold"
                            f"{'s' if holds != 1 else ''} let go for room in its pin budget", highlight=False,
                            soft_wrap=True)
        missing = d["blocks"] - d["cached_blocks"]
        if not fleet and missing > 0 and not d["warmed"]:  # the warm was cancelled or is still running
            them = "them" if missing != 1 else "it"
            Console().print(f"the other {missing} block{'s pin' if missing != 1 else ' pins'} as requests compute "
                            f"{them} (or a lower tier brings {them} back)", highlight=False, soft_wrap=True)
        fleet_message(d)
    emit(data, as_json, render)
    if data.get("result") == "partial":
        raise typer.Exit(3)


def pinned_again(was: dict, now: dict) -> str:
    """What pinning a pinned prefix again changed: this call's owner, note and expiry replace the
    pin's (none given: it no longer expires, its note is empty), so say what they were."""
    changes = []
    before, after = was.get("expires_in_seconds"), now.get("expires_in_seconds")
    if before is not None and after is None:
        changes.append(f"it no longer expires (it had {duration(before)} left; --ttl keeps an expiry)")
    elif before is None and after is not None:
        changes.append("it had no expiry")
    elif before is not None:
        changes.append(f"it had {duration(before)} left")
    if was.get("note") != now.get("note"):
        changes.append(f"its note was {was.get('note')!r}" + ("" if now.get("note") else " (--note keeps one)"))
    if was.get("owner") != now.get("owner"):
        changes.append(f"its owner was {was.get('owner')}")
    return "pinned already: " + ("; ".join(changes) if changes else "nothing else changed")


def pins(ctx: typer.Context,
         tenant: Optional[str] = typer.Option(None, "--tenant", help="Only this tenant's pins."),
         holds: bool = typer.Option(True, "--holds/--no-holds",
                                    help="List requests' prompt cache breakpoint holds too, or leave them out."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every pin: id, tenant, model or LoRA adapter, blocks, how many are cached now, owner, note, expiry.

    A pin made under LoRA weights a reload or an unload took away, or under scales, a model
    revision or a cache format kvd no longer serves, is marked stranded: no request reaches its
    blocks, which stay pinned and count against the tenant's budget. Pin the prompt again and
    `kvctl unpin --stranded`.

    A request's prompt cache breakpoint holds its prefix as a pin of its tenant's (owner
    prompt_cache_breakpoint) until its ttl lapses; `--no-holds` leaves those out.

    At kvd router, the fleet's pins, each once, with how many replicas hold it and how many of its
    blocks each has cached (a range where they differ).

    Example: kvctl pins --tenant acme; kvctl pins --no-holds; kvctl pins --json
    """
    data = client_for(ctx).get("/admin/pins", tenant=tenant)
    if tenant is not None:  # (a kvd of before the filter lists every tenant's)
        data["pins"] = [p for p in data["pins"] if p["tenant"] == tenant]
    left_out = [p for p in data["pins"] if p.get("breakpoint")] if not holds else []
    if left_out:
        data["pins"] = [p for p in data["pins"] if not p.get("breakpoint")]

    def render(d):
        fleet = "replica_count" in d  # at kvd router: the fleet's pins, each once
        adapters = any(p.get("adapter_id") for p in d["pins"])  # some pin is a LoRA adapter's (an older kvd: none)
        stranded = any(p.get("stranded") for p in d["pins"])
        table = compact_table("pin", "tenant", *(["model"] if adapters else []), "blocks", "cached",
                              *(["replicas"] if fleet else []), "owner", "expires in", "note")
        for p in d["pins"]:
            left = p.get("expires_in_seconds")
            where = [f"{len(p['replicas'])}/{d['replica_count']}"] if fleet else []
            each = sorted(set((p.get("cached_by_replica") or {"": p["cached_blocks"]}).values()))
            cached = f"{each[0]:,}" if len(each) == 1 else f"{each[0]:,}-{each[-1]:,}"  # on each replica
            if p.get("stranded"):  # at kvd router: on some replicas, or on every one
                on = p.get("stranded_on") or []
                cached = Text(f"{cached} stranded" + (f" on {len(on)}/{len(p['replicas'])}" if fleet and on
                                                      and len(on) < len(p["replicas"]) else ""), style="yellow")
            table.add_row(p["pin_id"], p["tenant"], *([_prefix_model(p)] if adapters else []), f"{p['blocks']:,}",
                          cached, *where, p["owner"], "never" if p["expires_at"] is None else duration(left), p["note"])
        keep_whole(table, 0)
        Console().print(table if d["pins"] else "no pins" if tenant is None else f"tenant {escape(tenant)} has no pins",
                        highlight=False)
        if stranded:
            why = {p["stranded"] for p in d["pins"] if p.get("stranded")}
            Console().print(Text("stranded: made under " + " or under ".join(
                STRANDED_CAUSES[w] for w in sorted(why) if w in STRANDED_CAUSES) + ", so no request reaches them; "
                "pin the prompts again, then `kvctl unpin --stranded`", style="yellow"))
        room = d.get("room")
        if room and room["pinned_blocks"]:  # (an older kvd: none)
            on = f" on {room['replica']}, the fleet's least" if fleet else ""
            Console().print(
                f"pins hold {room['pinned_blocks']:,} of the cache's {room['num_blocks']:,} blocks{on}: a request may "
                f"take {room['room_blocks']:,} beside them ({room['room_blocks'] * room['block_size']:,} tokens of "
                "prompt and max_tokens past a pinned prefix it starts with); one that needs more is turned away "
                "(pinned_out)" + (f"; a new pin that would leave fewer than {room['pin_room_blocks']:,} is refused "
                                  f"(pin_room_tokens: {room['pin_room_tokens']:,})" if room.get("pin_room_blocks")
                                  else ""))
        listed_holds = [p for p in d["pins"] if p.get("breakpoint")]
        if listed_holds:
            Console().print(f"holds of requests' prompt cache breakpoints among them: {len(listed_holds):,} "
                            f"({sum(p['blocks'] for p in listed_holds):,} blocks), each lapsing by itself; "
                            "--no-holds leaves them out", highlight=False)
        if left_out:
            Console().print(f"holds of requests' prompt cache breakpoints not listed (--no-holds): {len(left_out):,} "
                            f"({sum(p['blocks'] for p in left_out):,} blocks)", highlight=False)
        if d.get("message"):
            Console(stderr=True).print(f"[yellow]{escape(d['message'])}[/yellow]")
    emit(data, as_json, render)


STRANDED_CAUSES = {"adapter": "LoRA weights kvd no longer serves (a reload or an unload took them away)",
                   "space": "a model revision, tokenizer, cache format, scales or block size kvd no longer serves"}


def replica_lines(d: dict, done: Callable[[dict], str]) -> None:
    """At kvd router, a line per replica under the fleet's answer: what it did (`done`), that it
    had nothing of it (404), or why it did not."""
    for row in d.get("replicas") or []:
        if row["status"] == 200:
            what = done(row)
        elif row["status"] == 404:
            what = "nothing of it"
        elif row["status"] is None:
            what = f"not done: {row.get('error')}"
        else:
            error = row.get("error")
            what = f"not done ({row['status']}): {error.get('message') if isinstance(error, dict) else error}"
        Console().print(f"  {escape(row['replica'])}: {escape(str(what))}", highlight=False, soft_wrap=True)


def show_fleet_answer(data: dict, as_json: bool, print_answer: Callable[[dict], None],
                      each: Callable[[dict], str]) -> None:
    """kvd's answer as `print_answer` prints it; at kvd router, a line per replica (`each`: what it
    did) and what some replica could not do (exit 3)."""
    def render(d):
        print_answer(d)
        replica_lines(d, each)
        fleet_message(d)
    emit(data, as_json, render)
    if data.get("result") == "partial":
        raise typer.Exit(3)


def fleet_message(d: dict) -> None:
    if d.get("message") and "replicas" in d:
        Console(stderr=True).print(f"[yellow]{escape(d['message'])}[/yellow]")


def unpin(ctx: typer.Context, pin_id: Optional[str] = typer.Argument(None, help="Pin id from `kvctl pins`."),
          stranded: bool = typer.Option(False, "--stranded", help="Every stranded pin (kvctl pins marks them): "
                                                                 "made under weights, scales or a format no longer "
                                                                 "served."),
          tenant: Optional[str] = typer.Option(None, "--tenant", help="Every pin of this tenant (with --stranded: "
                                                                      "its stranded ones)."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Remove a pin; its blocks become evictable again.

    `--stranded` removes every pin no request can reach any more: made under LoRA weights a
    reload or an unload took away, or under scales, a model revision or a cache format kvd no
    longer serves. `--tenant T` removes every pin of a tenant (one leaving: `kvctl evict --tenant
    T` then takes its blocks, which its pins kept). Each is audited as an unpin.

    At kvd router, every replica removes it.

    Example: kvctl unpin pin-0123456789abcdef; kvctl unpin --stranded; kvctl unpin --tenant acme
    """
    if pin_id is not None and (stranded or tenant is not None):
        raise UserError("pin_id: give a pin's id, or --stranded or --tenant, not both")
    if pin_id is None and not stranded and tenant is None:
        raise UserError("pin_id: give a pin's id, --stranded or --tenant, not neither")
    if tenant is not None:  # a path of its own: a kvd without it refuses (404), unpinning nothing
        data = client_for(ctx).delete(f"/admin/tenants/{quote(tenant, safe='')}/pins",
                                      stranded="true" if stranded else None)
    elif stranded:
        data = client_for(ctx).delete("/admin/pins", stranded="true")
    else:
        data = client_for(ctx).delete(f"/admin/pins/{pin_id}")

    def render(d):
        if "unpinned" in d:  # --stranded, --tenant
            for p in d["unpinned"]:
                why = f": made under {STRANDED_CAUSES.get(p['stranded'], p['stranded'])}" if p["stranded"] else ""
                Console().print(f"unpinned {p['pin_id']} (tenant {escape(p['tenant'])}, {p['blocks']} blocks){why}",
                                highlight=False, soft_wrap=True)
            which = "stranded pins" if stranded else "pins"
            whose = "" if tenant is None else f" of tenant {escape(tenant)}"
            count = len(d["unpinned"])
            what = which if count != 1 else which[:-1]
            Console().print(f"{count} {what}{whose} unpinned, {d['unpinned_blocks']} blocks"
                            + (f" over {len(d['replicas'])} replicas" if "replicas" in d else "") + _dropped(d)
                            if d["unpinned"] else f"no {which}{whose}", highlight=False)
        else:
            Console().print(f"unpinned {d['pin_id']} ({d['unpinned_blocks']} blocks"
                            + (f" over {len(d['replicas'])} replicas)" if "replicas" in d else ")") + _dropped(d),
                            highlight=False)
        replica_lines(d, lambda row: f"{row['unpinned_blocks']} blocks")
        fleet_message(d)
    emit(data, as_json, render)
    if data.get("result") == "partial":
        raise typer.Exit(3)


def evict(ctx: typer.Context,
          text: Optional[str] = typer.Argument(None, help="A prompt's text: the conversation to forget."),
          prefix: Optional[str] = typer.Option(None, "--prefix", help="Prefix id."),
          tokens: Optional[str] = typer.Option(None, "--tokens", help="A prompt's token ids, comma-separated."),
          file: Optional[Path] = typer.Option(None, "--file", help="Read the prompt's text from a file."),
          messages: Optional[Path] = typer.Option(
              None, "--messages", help="A JSON file of chat messages (or a chat request's body, with its "
                                       "chat_template_kwargs and tools, or a /v1/responses request's), rendered as "
                                       "/v1/chat/completions renders them."),
          tenant: Optional[str] = typer.Option(None, "--tenant", help="Every prefix of a tenant; with a prompt, the "
                                                                      "tenant whose namespace it was served in."),
          model_revision: Optional[str] = typer.Option(None, "--model-revision",
                                                       help="A model revision (4 or more hex digits), served or not."),
          all_unpinned: bool = typer.Option(False, "--all-unpinned", help="Everything not pinned."),
          model: Optional[str] = typer.Option(None, "--model", help="With a prompt: the LoRA adapter (lora_modules) "
                                                                   "whose blocks of it go (default: the model's). "
                                                                   "Alone: every block of that adapter."),
          adapter_id: Optional[str] = typer.Option(None, "--adapter-id",
                                                   help="Every block of the LoRA adapter of this id (8 or more hex "
                                                        "digits), served or not: weights a reload replaced."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Say what would go, and evict nothing."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Evict cached blocks from every tier and report exactly what went.

    Blocks in use are refused, not faked. A prefix id takes that prefix and every prefix that
    extends it (its rows in `kvctl prefixes`); the prefix it extends stays for the others that
    share it. A prefix's, a prompt's or a tenant's blocks also go from the shared Redis,
    whichever daemon wrote them. Blocks still being written to disk or Redis are waited for (up
    to 30 s) and go too; any still moving then make the eviction partial.

    A prompt (TEXT, --tokens, --file or --messages) is a conversation to forget, named by one of
    its requests: its blocks go from every tier, with every block that extends it (the reply,
    later turns), but not the blocks it shares with other cached prefixes (a system prompt that
    other conversations go on from). To forget a whole chat, name its first request (`--messages
    first-request.json`): every later turn extends it. A prompt that stops short names less: the
    system prompt alone takes every conversation on from it, as its prefix id would.

    --model ADAPTER alone takes every block of a LoRA adapter, in every tier; --adapter-id takes
    those of an adapter's earlier weights, which a reload replaced or took away (`kvctl prefixes`
    and `kvctl status` show the id). The model's own name takes the model's blocks and none of
    its adapters'.

    A model revision's blocks go from every tier, including a revision this daemon no longer
    serves: what an upgrade set aside on disk, and what any daemon left on the shared Redis
    under it (`kvctl tiers` shows what is set aside, and whose).

    At kvd router, every replica evicts its own blocks of it: the answer sums them and lists
    each replica's. A shared Redis is searched for other daemons' entries once, by one of the
    replicas on it.

    --dry-run answers as the eviction would, and evicts nothing: the device's blocks as they stand
    now, the copies in lower tiers that kvd knows of; other daemons' entries on a shared Redis are
    found only by the eviction itself.

    Example: kvctl evict --tenant acme; kvctl evict --messages chat.json --tenant acme --dry-run;
    kvctl evict --adapter-id 3f2a9c1b
    """
    if any(x is not None for x in (text, tokens, file, messages)):
        if prefix is not None or model_revision is not None or all_unpinned or adapter_id is not None:
            raise UserError("give exactly one of a prompt (TEXT, --tokens, --file, --messages), --prefix, --tenant, "
                            "--model, --adapter-id, --model-revision or --all-unpinned")
        body = {**prompt_body(text, tokens, file, messages), "tenant": tenant, **({"model": model} if model else {})}
    elif model is not None or adapter_id is not None:
        if prefix is not None or tenant is not None or model_revision is not None or all_unpinned or (
                model is not None and adapter_id is not None):
            raise UserError("--model alone takes every block of a LoRA adapter, and with a prompt that prompt's "
                            "blocks under it; --adapter-id goes alone")
        if adapter_id is not None and not re.fullmatch(r"[0-9a-f]{8,64}", adapter_id.strip().lower()):
            raise UserError(f"--adapter-id: give 8 or more hex digits of a LoRA adapter's id (kvctl prefixes and kvctl "
                            f"status show them), got {adapter_id!r}")
        body = {"model": model} if model is not None else {"adapter_id": adapter_id.strip().lower()}
    else:
        body = {"prefix": prefix, "tenant": tenant, "model_revision": model_revision, "all_unpinned": all_unpinned}
    data = client_for(ctx).post("/admin/evict/preview" if dry_run else "/admin/evict", body)

    def render(d):
        if "replicas" in d:  # at kvd router: the fleet's sum, then each replica's answer
            Console().print(f"fleet of {len(d['replicas'])} replicas:", highlight=False)
        skipped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(d["skipped"].items()))
        lower = d.get("lower_tier_blocks_dropped") or 0
        shared = (d.get("remote_purge") or {}).get("dropped")
        aside = d.get("disk_purge") or {}
        Console().print(f"{'would evict' if d.get('dry_run') else 'evicted'} {d['target']}: "
                        f"{d['evicted_blocks']} blocks from the device"
                        + (f", {lower} from lower tiers" if lower else "")
                        + (f", {aside['segments']} disk segment{'s' if aside['segments'] != 1 else ''} ({size(aside['bytes'])})"
                           if aside.get("segments") else "")
                        + (f", {shared} from the shared Redis" if shared else "")
                        + (f"; left alone: {skipped}" if skipped else ""), highlight=False)
        if tenant is not None and d["skipped"].get("pinned") and d["target"].startswith("tenant="):
            Console().print(f"its pins keep {d['skipped']['pinned']} blocks: `kvctl unpin --tenant {tenant}`, then "
                            "evict again, takes them too", highlight=False, markup=False)
        if "prompt_blocks" in d:
            kept = d["shared_blocks_kept"]
            Console().print(f"the prompt has {d['prompt_blocks']} full blocks"
                            + (f"; {kept} of them stay, shared with other cached prefixes" if kept else ""),
                            highlight=False)
        if d.get("not_counted"):
            Console().print("not counted: " + "; ".join(d["not_counted"]), highlight=False)
        if d.get("spaces"):
            purged = "spaces to purge" if d.get("dry_run") else "spaces purged"
            Console().print(f"{purged} (not served here): " + ", ".join(
                f"{s['space']} ({s.get('cache_dtype') or '?'}{', scales ' + s['scale_version'] if s.get('scale_version') else ''})"
                for s in d["spaces"]), highlight=False)
        replica_lines(d, lambda row: f"{row['evicted_blocks']} from the device, "
                                     f"{row.get('lower_tier_blocks_dropped') or 0} from lower tiers"
                                     + shared_search(row.get("remote_purge") or {})
                                     + ("" if row.get("result") == "ok" else " (partial)"))
        if d.get("message"):
            Console(stderr=True).print(f"[yellow]{escape(d['message'])}[/yellow]")
    emit(data, as_json, render)
    if data.get("result") == "partial":
        raise typer.Exit(3)


def shared_search(purge: dict) -> str:
    """A replica's part in a fleet eviction's search of the shared Redis."""
    if purge.get("by_another_replica"):
        return "; the shared Redis searched by another replica"
    if "seen" in purge:
        return f"; searched the shared Redis: {purge['dropped']} of {purge['seen']} entries"
    return ""


def replies_text(replies: dict) -> str:
    """How a chat's assistant messages went into its prompt, as `kvctl explain` says it."""
    text = (f"replies: {replies['as_ids']} of {replies['assistant_messages']} assistant messages go in as the ids "
            "the model made")
    if replies["template_changed"]:
        return text + "; the chat template writes a kept reply otherwise (trims it, cuts its reasoning), so the " \
                      "chat is read as text"
    if replies["as_text"]:
        text += (f"; {replies['as_text']} read as text: kvd keeps no reply of that text for this tenant (edited, "
                 "another tenant's, let go for room, or made before a restart without a disk tier), and its "
                 "blocks miss where the text reads back otherwise")
    return text


def explain(ctx: typer.Context, text: Optional[str] = typer.Argument(None, help="Prompt text."),
            tokens: Optional[str] = typer.Option(None, "--tokens", help="Token ids, comma-separated."),
            file: Optional[Path] = typer.Option(None, "--file", help="Read the prompt text from a file."),
            messages: Optional[Path] = typer.Option(
                None, "--messages", help="A JSON file of chat messages (or a chat request's body, with its "
                                         "chat_template_kwargs and tools, or a /v1/responses request's), rendered "
                                         "as /v1/chat/completions renders them."),
            tenant: Optional[str] = typer.Option(None, help="Tenant namespace to look in."),
            model: Optional[str] = typer.Option(None, help="A LoRA adapter's name (lora_modules): look in its own "
                                                           "blocks. Default: the model's."),
            mode: Optional[str] = typer.Option(None, "--prompt-cache-mode",
                                               help="implicit or explicit: as a request asking OpenAI's prompt cache "
                                                    "mode (explicit: cached up to its marked breakpoints alone). "
                                                    "Default: what a --messages request body asks, else implicit."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """How much of a prompt would hit the cache, and why the first miss misses.

    A tenant kvd serves in explicit prompt cache mode (prompt_cache_explicit_tenants), or a request
    asking it, reads the cache only up to its longest marked breakpoint.

    Example: kvctl explain --file system_prompt.txt --tenant acme
    """
    body = {**prompt_body(text, tokens, file, messages, cache_options=True), "tenant": tenant,
            **({"model": model} if model else {})}
    if mode is not None:
        if mode not in ("implicit", "explicit"):
            raise UserError(f"prompt-cache-mode: must be implicit or explicit, got {mode!r}")
        options = body.get("prompt_cache_options")
        body["prompt_cache_options"] = {**(options if isinstance(options, dict) else {}), "mode": mode}
    data = client_for(ctx).post("/admin/explain", body)

    def render(d):
        Console().print(f"{d['hit_tokens']} of {d['prompt_tokens']} tokens would hit "
                        f"({d['hit_blocks']} of {d['full_blocks']} full blocks, tenant {d['tenant']}"
                        + (f", LoRA adapter {d['adapter']}" if d.get("adapter") else "") + ")")
        cache = d.get("prompt_cache") or {}  # (an older kvd does not say)
        if cache.get("mode") == "explicit":
            why = "its tenant's setting" if cache["why"] == "tenant" else "asked"
            Console().print(f"explicit prompt cache mode ({why}): only its first {cache['shared_blocks']} full "
                            "blocks can hit", highlight=False)
        replies = d.get("replies")  # a chat's (an older kvd does not say)
        if replies and replies["assistant_messages"]:
            Console().print(replies_text(replies), highlight=False)
        miss = d.get("first_miss")
        if miss:
            Console().print(f"first miss at block {miss['block']}: {miss['reason']} — {miss['detail']}")
            if miss.get("key") and miss["reason"] in ("evicted", "in_lower_tier"):
                Console().print(f"its moves between tiers: kvctl events --key {miss['key']}", highlight=False)
    emit(data, as_json, render)


config_app = typer.Typer(help="The daemon's settings.", no_args_is_help=True)


def _setting_text(value) -> str:
    """A setting as an operator writes it: per-tenant pairs as acme=3,free=1, lists comma-separated."""
    if isinstance(value, list) and value and all(isinstance(v, list) and len(v) == 2 for v in value):
        return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in value)  # 600, not 600.0
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


@config_app.command("show")
def config_show(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The settings the daemon resolved, and the precedence it used.

    Example: kvctl config show --json
    """
    data = client_for(ctx).get("/admin/config")

    def render(d):
        sources = d.get("sources") or {}
        table = compact_table("setting", "value", "from", title=f"kvd settings ({d['precedence']})")
        effective = d.get("effective") or {}
        from_rollouts = d.get("from_rollouts") or {}
        for key, value in d["config"].items():
            shown = "auto" if value is None and key in effective else _setting_text(value)
            if key in effective and effective[key] != value:
                shown += f" ({effective[key]} in effect)"
            if key in from_rollouts:
                shown += " (not in the config yet)"
            table.add_row(key, shown, sources.get(key, "-"))
        console = Console()
        keep_whole(table, 0)  # a setting's name is what goes in the YAML file or after --
        fit_cells(table, words=(1, 2))  # a path or a flag whole where it fits ("/run/kvd/kvd.so…" was cut)
        value, source = table.columns[1], table.columns[2]
        source.min_width = min(source.min_width, 24)
        room = console.width - table.columns[0].min_width - source.min_width - 2
        value.min_width = max(8, min(value.min_width, room))
        for column in (value, source):
            column.overflow = "fold"  # what is wider than that folds onto the next line, never cut
        console.print(table)
        live = [key for key in d.get("live") or () if key in d["config"]]  # (an older kvd does not say)
        if live:
            console.print(f"live on a reload (kvctl config reload, SIGHUP): {', '.join(live)}; the others wait for a "
                          "restart", highlight=False)
        for key, held in from_rollouts.items():
            console.print(f"[yellow]{key} {held['value']} came from completed rollout {held['rollout']}: a reload "
                          f"or restart reverts it unless the config says {key}: {held['value']}[/yellow]")
    emit(data, as_json, render)


def stranded_lines(pins: list[dict] | None) -> None:
    """The pins a change of the served LoRA weights stranded (in a reload's answer, say)."""
    if pins:
        Console().print(Text(f"pins stranded on the weights taken away ({', '.join(p['pin_id'] for p in pins)}: "
                             f"{sum(p['blocks'] for p in pins):,} blocks): no request reaches them now; pin their "
                             "prompts again (--model NAME), then `kvctl unpin --stranded`", style="yellow"),
                        soft_wrap=True)


KEPT_NAMES = {"reply_ids": "chat replies' ids"}  # a reload's let_go, by store, as `config reload` names them


@config_app.command("reload")
def config_reload(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Read kvd's config again and apply what can change live (as SIGHUP, with the answer here).

    A config that does not validate changes nothing, and the error names the setting. LoRA
    adapters (lora_modules) change too: those added, replaced and removed are listed, and
    requests in flight finish on the adapter they came for.
    Example: kvctl config reload
    """
    data = client_for(ctx).post("/admin/reload", {})

    def render(d):
        console = Console()
        if d.get("loading_again"):
            console.print(f"[yellow]kvd could not serve ({d['loading_again']}); it loads again with the settings "
                          "read now: `kvctl status` answers once it serves[/yellow]", highlight=False)
        elif not d["changed"] and not d.get("adapters"):
            console.print("reloaded: no setting that applies live has changed")
        for key, value in d["changed"].items():
            console.print(f"reloaded: {key} {_setting_text(d['previous'][key])} -> {_setting_text(value)}",
                          highlight=False)
        let_go = {kind: count for kind, count in (d.get("let_go") or {}).items() if count}
        if let_go:  # a lowered store budget
            told = " a client naming one is told why" if let_go.keys() - {"reply_ids"} else ""
            console.print("let go to fit the lowered budget: " + ", ".join(
                f"{count:,} {KEPT_NAMES.get(kind, kind)}" for kind, count in let_go.items())
                + " (the least recently used of the tenants holding the most;" + (told or " their next turns are "
                "tokenized from their text") + ")", highlight=False)
        reranked = d.get("reranked_blocks")
        if reranked:
            console.print("cached blocks now ranked at their tenant's new priority (eviction: priority): "
                          + ", ".join(f"{tenant} {count:,}" for tenant, count in reranked.items()), highlight=False)
        adapters = d.get("adapters") or {}
        for change in ("added", "replaced", "removed"):
            if adapters.get(change):
                console.print(f"LoRA adapters {change}: {', '.join(adapters[change])}", highlight=False)
        if adapters.get("replaced") or adapters.get("removed"):
            console.print("requests in flight finish on the adapter they came for; `kvctl status` lists them "
                          "until they have", highlight=False)
        stranded_lines(d.get("stranded_pins"))
        if d["needs_restart"]:
            console.print(f"[yellow]changed in the config but applied only at a restart: "
                          f"{', '.join(d['needs_restart'])}[/yellow]")
        tokens = d.get("tokens")
        if tokens:
            console.print(f"token file read again: {tokens['tokens']} tokens ({tokens['added']} added, "
                          f"{tokens['removed']} removed)")
        rotated = d.get("tls")
        if rotated:  # the TCP front's certificate (tls.py): new connections get the new one
            expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(rotated["not_after"]))
            console.print(f"TLS certificate rotated: {rotated['subject']} (sha256 {rotated['from']}... -> "
                          f"{rotated['to']}...), expires {expires}; connections already open keep the old one",
                          highlight=False)
        cas = d.get("tls_client_cas")
        if cas:  # ssl_ca_certs: new connections' client certificates are checked against these
            console.print(f"TLS client CAs reloaded: {cas['cas']} CA{'' if cas['cas'] == 1 else 's'} (sha256 "
                          f"{cas['from']}... -> {cas['to']}...); new connections' client certificates are checked "
                          "against them", highlight=False)
        for key, held in (d.get("reverted_rollout_settings") or {}).items():
            console.print(f"[yellow]{key} {held['value']} from completed rollout {held['rollout']} is reverted to "
                          f"the config's {held['now']}[/yellow]", highlight=False)
    emit(data, as_json, render)


def audit(ctx: typer.Context, since: Optional[str] = typer.Option(None, help="Only entries newer than 1h, 2d, ..."),
          action: Optional[str] = typer.Option(None, help="Only this action (pin, unpin, evict, reload, adr.new, ...)."),
          result: Optional[str] = typer.Option(None, help="Only this result (ok, refused, partial, applied, ...)."),
          actor: Optional[str] = typer.Option(None, help="Only this actor (a token's name, unix-socket, kvd, ttl)."),
          tenant: Optional[str] = typer.Option(None, help="Only records of this tenant (-: the daemon's own)."),
          target: Optional[str] = typer.Option(None, help="Only records of this target, whole: a pin's id (its "
                                                          "pin, its unpin), tenant=acme (its evictions), ..."),
          state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Read the store directly (KVD_STATE_DIR)."),
          limit: int = typer.Option(50, help="Newest rows in the table (0: all); --json always has all."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The audit log of mutating operator actions: who, what, when, result.

    Asks the daemon; with --state-dir or KVD_STATE_DIR, or when no daemon answers, reads the
    store directly.

    Example: kvctl audit --since 24h --action evict

    Example: kvctl audit --since 1h --result refused   (what an incident turned away)

    Example: kvctl audit --target pin-0123456789abcdef   (who made a pin, who took it away)
    """
    from kvctl.daemon.server.durations import parse_duration

    try:
        start = time.time() - parse_duration(since) if since else 0.0
    except ValueError:
        raise UserError(f"since: invalid value {since!r}; use 30m, 1h, 2d") from None
    if limit < 0:
        raise UserError(f"limit: must be >= 0, got {limit}")
    wanted = {k: v for k, v in (("action", action), ("result", result), ("actor", actor), ("tenant", tenant),
                                ("target", target)) if v}
    data = None
    if not (state_dir or os.environ.get("KVD_STATE_DIR")):
        try:
            data = client_for(ctx).get("/admin/audit", since=start, **wanted)
        except UserError as exc:
            if "not reachable" not in str(exc):
                raise
    if data is None:
        from .records_cmd import open_store

        data = {"entries": open_store(None, state_dir).audit_since(start, **wanted)}
    # (a kvd older than --result, --actor, --tenant and --target answers every record: they are matched here too)
    data = {**data, "entries": [e for e in data["entries"] if all(e.get(k) == v for k, v in wanted.items())]}

    def audit_table(entries, time_below_date: bool):
        fleet = any("replica" in e for e in entries)  # kvd router's: every replica's records, each naming it
        table = compact_table("when", *(["replica"] if fleet else []), "actor", "tenant", "action", "target",
                              "result")
        for e in entries:
            at = when(e["at"])
            table.add_row(at.replace(" ", "\n") if time_below_date else at, *([e["replica"]] if fleet else []),
                          e["actor"], e["tenant"], e["action"], e["target"], e["result"])
        shift = int(fleet)
        keep_whole(table, 0, *range(1, 2 + shift), 3 + shift, 5 + shift)
        fit_cells(table, words=(2 + shift, 4 + shift))  # the target wraps at its spaces; an id is never cut
        return table

    def render(d):
        entries = d["entries"] if limit == 0 else d["entries"][:limit]  # newest first
        console = Console()
        table = audit_table(entries, time_below_date=False)
        narrowest = sum(column.min_width for column in table.columns) + len(table.columns) - 1
        if narrowest > console.width:  # 80 columns: the time goes below the date
            table = audit_table(entries, time_below_date=True)
        console.print(table if d["entries"] else "no audit entries")
        if d.get("message"):  # kvd router: the replicas that did not answer
            console.print(d["message"])
        if len(entries) < len(d["entries"]):
            console.print(f"the newest {len(entries)} of {len(d['entries']):,} entries; --limit 0 shows all, "
                          "--since and --action narrow them")
    emit(data, as_json, render)

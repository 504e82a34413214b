"""kvctl requests and kvctl cancel: the requests in flight, and stopping one (or a tenant's);
kvctl tenants: each tenant's use of the cache.

kvd decides and reports; these show its answer (`GET /admin/requests`, `POST /admin/cancel`). At
kvd router both go to every replica: the listing marks each row with its replica, and a
cancel takes effect wherever the request runs.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.text import Text

from .errors import UserError
from .command_kit import client_for, emit, show_or_watch
from .ops import replica_lines
from .tables import compact_table, count, keep_whole, seconds, size
from .tenant_row import listed_row


def requests(ctx: typer.Context, tenant: Optional[str] = typer.Option(None, help="Only this tenant's."),
             watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The requests in flight, oldest first: tenant, API, state, age, cache hits, blocks held.

    Never their prompts or outputs. The id is the X-KVD-Request-Id header of the request's answer;
    `kvctl cancel ID` stops it.

    Example: kvctl requests --tenant acme
    """
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/requests", tenant=tenant), render_requests, watch, as_json)


def render_requests(d: dict) -> Group:
    """The table of requests in flight (with the replica of each at kvd router), and the counts."""
    rows = d["requests"]
    fleet = any("replica" in row for row in rows) or "replicas" in d
    adapters = any(row.get("adapter") for row in rows)  # a column only where some request runs on a LoRA adapter
    table = compact_table("request", *(["replica"] if fleet else []), "tenant", *(["adapter"] if adapters else []),
                          "api", "state", "age", "prompt", "cached", "output", "blocks")
    for index in range(4 + fleet + adapters, 9 + fleet + adapters):  # age .. blocks
        table.columns[index].justify = "right"
    names = {r["replica"]: i for i, r in enumerate(d.get("replicas") or [])}  # in the router's order
    in_line = False  # whether a waiting row says where it stands (an older kvd does not)
    reserving = any(row.get("reserved_blocks") for row in rows)  # (an older kvd does not say)
    for row in rows:
        mark = [f"#{names.setdefault(row['replica'], len(names))}"] if fleet else []
        place = row.get("queue_position") if row["state"] == "waiting" else None
        in_line = in_line or place is not None
        state = row["state"] + (" (fetching prefix)" if row.get("fetching_prefix") else "") \
            + (" (for an adapter's turn)" if row.get("waiting_for_lora_turn") else "") \
            + (f", {ordinal(place)} in line" if place is not None else "") \
            + (f", passed by {row['passed_over']:,}" if place is not None and row.get("passed_over") else "") \
            + (f", {seconds(row['queue_wait_left_seconds'])} left" if place is not None
               and row.get("queue_wait_left_seconds") is not None else "") \
            + (f", preempted {row['preemptions']}x" if row["preemptions"] else "") \
            + explicit_words(row.get("explicit_cache_tokens")) \
            + (f", {row['kept_draft_tokens']:,} of {row['drafted_tokens']:,} drafted kept"
               if row.get("drafted_tokens") else "")  # speculative decoding (an older kvd does not say)
        api = row["api"] + (f":{row['shape']}" if row.get("shape") else "")  # the field that shapes its reply
        adapter = [escape(row.get("adapter") or "-")] if adapters else []
        table.add_row(row["request_id"], *mark, escape(row["tenant"]), *adapter, api, state,
                      seconds(row["age_seconds"]), f"{row['prompt_tokens']:,}",
                      f"({row['cached_prefix_tokens']:,})" if place is not None else f"{row['cached_tokens']:,}",
                      f"{row['output_tokens']:,}/{row['max_tokens']:,}" + (f" ×{row['n']}" if row["n"] > 1 else ""),
                      f"{row['blocks']:,}" + (f"+{row['reserved_blocks']:,}" if row.get("reserved_blocks") else ""))
    parts = []
    if rows:
        keep_whole(table, 0)
        parts.append(table)
    counts = f"{d['running']} running, {d['waiting']} waiting"
    if fleet and not rows:  # no row to mark: how many replicas answered is the news
        answered = sum(1 for r in d.get("replicas") or [] if r.get("status") == 200)
        counts += f" on {answered} replica{'s' if answered != 1 else ''}"
    parts.append(Text(counts))
    if rows:
        parts += [Text(f"#{mark}: {name}") for name, mark in names.items()]
    if in_line:
        order = QUEUE_ORDER_WORDS.get(d.get("queue_order"), "")
        parts.append(Text("in line: the order kvd tries its waiting requests in" + (f" ({order})" if order else "")
                          + (", each replica its own" if fleet else "") + "; (cached): the tokens of a waiting "
                          "request's prefix the device cache holds now; passed by: requests that came after it "
                          "and went in while it waited; left: before its queue wait limit turns it away"))
    if reserving:
        parts.append(Text("blocks: held+reserved: the blocks its tokens fill, and those its output reservation "
                          "holds for tokens not made yet (kvctl status says what the reservation leaves unwritten)"))
    if d.get("message"):
        parts.append(Text(d["message"], style="yellow"))
    return Group(*parts)


def explicit_words(tokens: int | None) -> str:
    """A request in explicit prompt cache mode, as its state says it: how much of its prompt the cache
    may serve it (None: implicit, nothing to say; an older kvd does not say either)."""
    if tokens is None:
        return ""
    return f", explicit: cached up to {tokens:,}" if tokens else ", explicit: no mark, nothing cached"


QUEUE_ORDER_WORDS = {"fifo": "queue_order fifo: as they came",
                     "priority": "queue_order priority: lower priority first, then as they came",
                     "lpm": "queue_order lpm: the most cached first, after any preempted or past lpm's patience",
                     "priority+lpm": "queue_order priority+lpm: lower priority first; within one, the most cached "
                                     "first, after any preempted or past lpm's patience"}


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def cancel(ctx: typer.Context, request_ids: list[str] = typer.Argument(None, help="Request ids (kvctl requests)."),
           tenant: Optional[str] = typer.Option(None, help="Every request of this tenant in flight instead."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Stop requests in flight, as if their clients had left; audited.

    Their samples finish as `cancelled` (a streaming client sees that finish reason) and their
    blocks come back. At kvd router, wherever each one runs.

    Example: kvctl cancel req-3f9a1c2b7d40
    """
    if bool(request_ids) == (tenant is not None):
        raise UserError("give request ids or --tenant")
    body = {"tenant": tenant} if tenant is not None else {"request_ids": request_ids}
    data = client_for(ctx).post("/admin/cancel", body)

    def render(d):
        console = Console()
        for row in d["cancelled"]:
            console.print(f"cancelled {row['request_id']} (tenant {escape(row['tenant'])}, {row['state']}, "
                          f"{row['output_tokens']:,} tokens out, {row['blocks']:,} blocks held)", highlight=False)
        if not d["cancelled"]:
            console.print(f"nothing of tenant {escape(tenant or '')} in flight", highlight=False)
        replica_lines(d, lambda row: f"{len(row['cancelled'])} cancelled")
        if d.get("not_found"):
            Console(stderr=True).print("not in flight: " + ", ".join(d["not_found"]), highlight=False)
    emit(data, as_json, render)
    if data.get("not_found"):
        raise typer.Exit(3)


def tenants(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
            top: int = typer.Option(0, "--top", min=0, help="Show the N tenants with the most prompt tokens "
                                    "(0: every one). --json lists every one."),
            tenant: Optional[str] = typer.Option(None, "--tenant", help="This tenant's row alone (kvd makes no "
                                                 "other: cheap to watch beside 10,000 tenants)."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Each tenant's use of the cache: prompt tokens and hits, requests, cached blocks, share, pins, evictions.

    Counts only, never prompts. At kvd router, the fleet's (each tenant summed over the replicas).
    kvd keeps the counters of the tenants active most recently (max_tracked_tenants, default
    10,000); the others' are summed on the last line, so the rows and that line add up to
    `kvctl status`'s totals.

    Example: kvctl tenants --top 20 --watch; kvctl tenants --tenant acme --watch
    """
    client = client_for(ctx)
    if tenant is not None and top:
        raise UserError("give --tenant or --top, not both")
    if tenant is None:
        show_or_watch(lambda: client.get("/admin/tenants"), lambda d: render_tenants(d, top), watch, as_json)
        return
    show_or_watch(lambda: client.get("/admin/tenants", tenant=tenant), lambda d: render_tenants(one_row(d, tenant)),
                  watch, as_json, for_json=lambda d: one_row(d, tenant))


def one_row(body: dict, tenant: str) -> dict:
    """An /admin/tenants answer of `tenant`'s row alone (or an error naming how many kvd lists), less
    the retired tenants' sum, which is not this tenant's."""
    return {**body, "tenants": [listed_row(body, tenant, "kvctl tenants")], "retired": None}


class TenantTable:
    """The tenants' table, drawn to the width it is given: each figure whole on one line, and where
    that is wider than the terminal, the pairs (running/waiting, idle/share, host, pins, TTFT) on
    two lines, the second part under the first; the tenant name wraps. No figure is ever cut."""

    def __init__(self, rows: list[dict], shares: bool, host: bool) -> None:
        self.shares, self.host = shares, host
        self.rounded = False  # whether a figure is shown rounded (`count`): the table says so below it
        self.rows = [self.cells(row) for row in rows]

    def count(self, n: int) -> str:
        shown = count(n)
        self.rounded = self.rounded or shown != f"{n:,}"
        return shown

    def cells(self, row: dict) -> list[str]:
        """A row's cells; a pair is `first/second` (`split_pair` may put them on two lines)."""
        count = self.count
        share = []
        if self.shares:
            share = ["-" if row["share_blocks"] is None and row["idle_blocks"] is None else
                     f"{count(row['idle_blocks'] or 0)}/" + ("-" if row["share_blocks"] is None else
                                                             count(row["share_blocks"]))]
        return [escape(row["tenant"]), count(row["prompt_tokens"]), f"{row['hit_ratio']:.1%}",
                count(row["recomputed_tokens"]), f"{row['running']}/{row['waiting']}",
                count(row.get("rejected", 0)), count(row["cached_blocks"]), *share,
                *([self.host_cell(row)] if self.host else []),
                f"{count(row['pinned_blocks'])}/{count(row['pin_budget_blocks'])}",
                "-" if row.get("ttft_p50_s") is None else
                f"{row['ttft_p50_s'] * 1e3:.0f}/{row['ttft_p95_s'] * 1e3:.0f}"]

    def headers(self) -> list[str]:
        # short headers, explained below the table
        return ["tenant", "prompt", "hit", "recomp", "run/wait", "rej", "cached",
                *(["idle/share"] if self.shares else []), *(["host"] if self.host else []), "pins", "TTFT ms"]

    def table(self, split: bool):
        headers, rows = self.headers(), self.rows
        if split:
            headers = [split_pair(h) if "/" in h else h.replace(" ", "\n") for h in headers]
            rows = [[cells[0]] + [split_pair(cell) for cell in cells[1:]] for cells in rows]
        table = compact_table(*headers)
        table.columns[0].overflow = "fold"  # a long tenant name wraps whole, never cut
        for index in range(1, len(table.columns)):
            table.columns[index].justify = "right"
        for cells in rows:
            table.add_row(*cells)
        for column in table.columns[1:]:  # figures whole: the name wraps first
            column.min_width = max(len(line) for cell in [*column.cells, column.header]
                                   for line in str(cell).splitlines())
        return table

    def needed(self, split: bool) -> int:
        """Columns the table takes with each figure whole and the tenant names at 8 columns or less."""
        table = self.table(split)
        names = min(8, max(len(line) for cell in [*table.columns[0].cells, table.columns[0].header]
                           for line in str(cell).splitlines()))
        return names + sum(c.min_width for c in table.columns[1:]) + len(table.columns) - 1

    def __rich_console__(self, console, options):
        yield self.table(split=self.needed(False) > options.max_width)


    def host_cell(self, row: dict) -> str:
        held = row.get("host_blocks")
        if held is None:
            return "-"
        share = row.get("host_share_blocks")
        return self.count(held) + ("" if share is None else f"/{self.count(share)}")


def split_pair(text: str) -> str:
    """`45.0k/60.0k` as two lines, `45.0k` over `/60.0k`."""
    first, slash, second = text.partition("/")
    return f"{first}\n{slash}{second}" if slash else text


def render_tenants(d: dict, top: int = 0) -> Group:
    rows, more = d["tenants"], 0
    if top and len(rows) > top:  # the busiest, then by name as kvd lists them
        rows = sorted(rows, key=lambda row: -row["prompt_tokens"])[:top]
        more = len(d["tenants"]) - top
    shares = d.get("shares")
    host = any(row.get("host_blocks") is not None for row in rows)
    table = TenantTable(rows, bool(shares), host)
    retired = d.get("retired") or {}
    parts = [table] if rows else [Text("no tenant seen lately" if retired.get("tenants") else
                                       "no tenant seen since kvd started")]
    if more:
        parts.append(Text(f"and {more:,} more tenant{'s' if more != 1 else ''} (--top 0 lists every one)"))
    if retired.get("tenants"):
        prompt = retired["prompt_tokens"]
        parts.append(Text(f"retired: {retired['tenants']:,} tenant{'s' if retired['tenants'] != 1 else ''} not active "
                          f"among the latest {retired['limit']:,} (max_tracked_tenants), summed: {prompt:,} prompt "
                          f"tokens, {retired['hit_tokens'] / prompt if prompt else 0.0:.1%} hit, "
                          f"{retired['recomputed_tokens']:,} recomputed, {retired['rejected']:,} rejected"))
    parts.append(Text(f"hit: prompt tokens served from the cache; recomp: tokens recomputed after preemption; "
                      f"run/wait: requests running and waiting; rej: requests turned away; cached: device blocks "
                      f"holding the tenant's prefixes, of {d['blocks']:,}"
                      + ("; idle/share: unused cached blocks against its share (beyond it they are evicted first)"
                         if shares else "")
                      + ("; host: host-memory slots holding its blocks (against its share there)" if host else "")
                      + "; pins: pinned blocks against the pin budget; TTFT ms: p50/p95 of its latest requests"
                      + ("; figures of 100,000 or more are rounded (123k, 1.23M; --json has them whole)"
                         if table.rounded else "")))
    for key, lead, unit in (("evicted_blocks", "evicted to make room", "blocks"),
                            ("retained_blocks", "written to disk and Redis for prompt_cache_retention 24h", "blocks"),
                            ("explicit_requests", "served in explicit prompt cache mode (their hits stop at their "
                                                  "marked breakpoints)", "requests")):
        line = _most_line(rows, key, lead, unit=unit)
        if line:
            parts.append(Text(line))
    for tier, name in (("disk", "disk"), ("remote", "Redis")):
        line = _lower_tier_line(rows, tier, name)
        if line:
            parts.append(Text(line))
    if d.get("message"):
        parts.append(Text(d["message"], style="yellow"))
    return Group(*parts)


def _most_line(rows: list[dict], key: str, lead: str, most: int = 5, unit: str = "blocks") -> str | None:
    """`evicted to make room: globex 1,200 blocks, acme 3`: the tenants with the most `unit` of `key`
    (evicted_blocks: whose cached blocks paid for the others' requests; retained_blocks: whose
    "24h" prompt_cache_retention wrote to disk; explicit_requests: whose hits stop at their marks),
    the most first (none when no tenant has any; an older kvd does not say)."""
    counted = sorted(((row.get(key) or 0, row["tenant"]) for row in rows if row.get(key)),
                     key=lambda item: (-item[0], item[1]))
    if not counted:
        return None
    shown = [f"{tenant} {n:,}" + (f" {unit}" if i == 0 else "") for i, (n, tenant) in enumerate(counted[:most])]
    return f"{lead}: " + ", ".join(shown) + (f", and {len(counted) - most} more" if len(counted) > most else "")


def _lower_tier_line(rows: list[dict], tier: str, name: str, most: int = 5) -> str | None:
    """`disk: acme 1.2 MiB of its 1.0 MiB share, globex 300.0 KiB`: the tenants with the most bytes
    in that tier first (none when the tier is not there or holds nothing)."""
    held = sorted(((row.get(f"{tier}_bytes") or 0, row["tenant"], row.get(f"{tier}_share_bytes")) for row in rows
                   if row.get(f"{tier}_bytes")), key=lambda h: (-h[0], h[1]))
    if not held:
        return None
    shown = [f"{tenant} {size(n)}" + ("" if share is None else f" of its {size(share)} share")
             for n, tenant, share in held[:most]]
    more = f", and {len(held) - most} more" if len(held) > most else ""
    return f"{name}: " + ", ".join(shown) + more

"""kvctl events: what the cache stored and removed, tier by tier, and why; --follow to watch."""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .errors import KvdUnavailable, UserError
from .command_kit import client_for

WAIT_S = 25.0  # each follow request is held open this long at most (kvd allows 30)


def event_line(event: dict, key: str | None = None) -> str:
    """One event as a line of the listing (see HEADER): at most 80 columns for a stored event of
    the default tenant. With `key` (hex digits), the line is about the block it names."""
    keys = event["keys"]
    at = next((i for i, k in enumerate(keys) if k.startswith(key)), 0) if key else 0
    first = keys[at][:16] + ("…" if len(keys) > 1 else "")
    if event["kind"] == "stored":
        parent = keys[at - 1] if at else event["parent"]
        detail = "starts a chain" if parent is None else f"block {event['depth'] + at} after {parent[:8]}"
        if event.get("tenant") not in (None, "default"):
            detail += f", tenant {event['tenant']}"
    else:
        detail = event["reason"]
    clock = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    return f"{event['seq']:>7} {clock} {event['kind']:<7} {event['tier']:<6} {len(keys):>6} {first:<17} {detail}"


HEADER = f"{'seq':>7} {'time':<8} {'change':<7} {'tier':<6} {'blocks':>6} {'first key':<17} detail"
HEADER_FOR_KEY = HEADER.replace("first key", "key      ")


def gap_message(since: int, body: dict) -> str:
    if since > body["latest"]:
        return (f"seq {since} is past this daemon's newest event ({body['latest']}): it restarted since; "
                "showing its events from the oldest it holds")
    return f"events {since + 1}-{body['oldest'] - 1} were dropped before they were read (kvd keeps the newest)"


def print_events(events: list[dict], console: Console, as_json: bool, key: str | None = None) -> None:
    for event in events:
        if as_json:
            typer.echo(json.dumps(event))
        else:
            console.print(escape(event_line(event, key)), highlight=False, soft_wrap=True)


def print_fleet_events(body: dict, events: list[dict], console: Console, as_json: bool, key: str | None) -> None:
    """kvd router's answer: each replica's newest events merged by time, each line led by its
    replica's number (named above the listing)."""
    if as_json:
        print_events(events, console, True)
        return
    numbers = {book["replica"]: n for n, book in enumerate(body["replicas"], 1)}
    for n, book in enumerate(body["replicas"], 1):
        held = (f"seq {book['oldest']}-{book['latest']}" if book["latest"] >= book["oldest"] else "no event yet") \
            if book["status"] == 200 else f"not listed ({book['status'] or 'not reached'})"
        console.print(escape(f"replica {n}: {book['replica']}, {held}"), highlight=False, soft_wrap=True)
    if events:
        console.print("r  " + (HEADER_FOR_KEY if key else HEADER), style="bold underline", highlight=False)
    for event in events:
        console.print(escape(f"{numbers[event['replica']]:<2} " + event_line(event, key)), highlight=False,
                      soft_wrap=True)
    if body.get("message"):
        console.print(f"[yellow]{escape(body['message'])}[/yellow]", highlight=False)
    console.print(f"{len(events)} events of the fleet's newest, oldest first; each replica numbers its own (kvctl "
                  "--socket REPLICA events --since SEQ pages one, --follow follows it)", highlight=False)


def follow(fetch: Callable[[int], dict], first: dict, console: Console, as_json: bool,
           count: int | None = None, sleep=time.sleep, key: str | None = None) -> int:
    """Print events as kvd logs them, from `first`'s `next`, until Ctrl-C or `count` events.
    Across a restart of kvd it waits, then follows the new daemon from its first event; when
    events were dropped before they were read it says so and carries on. Returns events printed."""
    stream, since, printed, lost = first["stream_id"], first["next"], 0, None
    while count is None or printed < count:
        try:
            body = fetch(since)
        except KvdUnavailable as exc:
            if lost is None:
                lost = time.strftime("%H:%M:%S")
                console.print(f"[yellow]{escape(str(exc))} — since {lost}; still following (Ctrl-C stops)[/yellow]",
                              highlight=False)
            sleep(1.0)
            continue
        lost = None
        if body["stream_id"] != stream:  # a new daemon: its events start again from 1
            stream, since = body["stream_id"], 0
            console.print("[yellow]kvd restarted: following the new daemon from its first event[/yellow]")
            continue
        if body["gap"]:
            console.print(f"[yellow]{gap_message(since, body)}; `kvctl prefixes` shows what is cached now[/yellow]",
                          highlight=False)
        events = body["events"] if count is None else body["events"][:count - printed]
        print_events(events, console, as_json, key)
        printed += len(events)
        since = body["next"]
    return printed


def events(ctx: typer.Context,
           follow_: bool = typer.Option(False, "--follow", "-f", help="Keep printing events as they happen."),
           tail: int = typer.Option(30, "--tail", help="How many of the newest events to show first."),
           since: Optional[int] = typer.Option(None, "--since", help="Show the events after this seq instead."),
           tier: Optional[str] = typer.Option(None, "--tier", help="Only these tiers: device, host, disk, remote "
                                              "(comma-separated)."),
           kind: Optional[str] = typer.Option(None, "--kind", help="Only stored or removed."),
           key: Optional[str] = typer.Option(None, "--key", help="Only events naming a block whose key starts with "
                                             "these hex digits (a `kvctl prefixes` id): that block's life."),
           count: Optional[int] = typer.Option(None, "--count", help="With --follow: stop after this many."),
           as_json: bool = typer.Option(False, "--json", help="One JSON object per event (JSON Lines)."),
           ) -> None:
    """What the cache stored and removed in each tier, and why each block left.

    Reasons: capacity, tenant_share, filesystem, operator, corrupt, unwritten, gone, space. Block keys only, never tokens.
    `--follow` watches; `--key` follows one block (a prefix's id) from tier to tier.

    Example: kvctl events --follow --kind removed --tier device
    """
    if tail < 0:
        raise UserError(f"tail: must be >= 0, got {tail}")
    if count is not None and count < 1:
        raise UserError(f"count: must be >= 1, got {count}")
    if since is not None and since < 0:
        raise UserError(f"since: must be >= 0, got {since}")
    client = client_for(ctx)
    filters = {"tier": tier, "kind": kind, "key": key}
    key = key.strip().lower() if key else None
    console = Console()
    if since is not None:
        first = client.get("/admin/events", since=since, limit=10_000, **filters)
    elif tail:
        first = client.get("/admin/events", tail=tail, **filters)
    else:  # --tail 0: from now on
        first = client.get("/admin/events", tail=1, **filters) | {"events": []}
    shown = first["events"] if count is None else first["events"][:count]
    if "stream_id" not in first:  # kvd router: every replica's newest, merged by time
        if follow_:
            raise UserError("follow: kvd router has no sequence of events of its own (each replica numbers its "
                            "own): follow one replica (kvctl --socket REPLICA events --follow)")
        print_fleet_events(first, shown, console, as_json, key)
        return
    if first.get("gap"):
        console.print(f"[yellow]{gap_message(since, first)}[/yellow]", highlight=False)
    if not as_json and (shown or follow_):
        console.print(HEADER_FOR_KEY if key else HEADER, style="bold underline", highlight=False)
    print_events(shown, console, as_json, key)
    if not follow_:
        if not as_json:
            more = f"; more after them: --since {first['next']}" if first["next"] < first["latest"] else ""
            held = f"kvd holds seq {first['oldest']}-{first['latest']}" if first["latest"] >= first["oldest"] \
                else "kvd has logged no event yet"
            console.print(f"{len(shown)} events{more}; {held}", highlight=False)
        return
    if follow_ and (count is None or len(shown) < count):
        def fetch(after: int) -> dict:
            return client.get("/admin/events", since=after, wait=WAIT_S, limit=1000, **filters)
        try:
            follow(fetch, first, console, as_json, None if count is None else count - len(shown), key=key)
        except KeyboardInterrupt:
            pass

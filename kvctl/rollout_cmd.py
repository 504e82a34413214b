"""`kvctl rollout ...`: roll live policy settings out to a cohort, with automatic stop."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError
from .command_kit import client_for, emit
from .tables import compact_table, duration, keep_whole, when

rollout_app = typer.Typer(help="Gradual rollouts of cache settings with stop conditions.", no_args_is_help=True)
AS_JSON = typer.Option(False, "--json", help="Print JSON.")
ROLLOUT_ID = "Rollout id: its number, or a fleet rollout's id (fleet-...; the only kind at kvd router)"


FIGURES = ("requests", "recomputed_token_ratio", "hit_ratio", "ttft_p50_seconds", "ttft_p95_seconds",
           "preemptions_per_request", "reserved_unused_ratio", "tpot_p50_seconds", "tpot_p95_seconds")
EVENTS_SHOWN = 10


def _figure(value) -> str:
    return "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))


def _figures_table(cohort: dict, baseline: dict, title: str) -> Table:
    table = Table("figure", "cohort", "baseline", title=title, title_justify="left")
    for name in FIGURES:
        table.add_row(name, _figure(cohort.get(name)), _figure(baseline.get(name)))
    return table


def event_text(event: dict) -> str:
    """One transition as a line: when, what, who, and its detail in words (not its figures)."""
    parts = []
    detail = event["detail"]
    for key, value in sorted(detail.items(), key=lambda item: item[0] != "reason"):  # the reason first
        if key == "figures":
            continue
        if key in ("fraction", "to"):
            parts.append(f"cohort {value:.0%}" if key == "fraction" else f"to {value:.0%}")
        elif key == "stops":
            parts.append("stop when " + "; ".join(value) if value else "no stop conditions")
        elif key == "reason":
            parts.append(str(value))
        elif key == "condition":
            continue  # the reason names it
        else:
            parts.append(f"{key} {_figure(value)}")
    return f"{when(event['at'])} {event['action']} by {event['actor']}" + (f": {', '.join(parts)}" if parts else "")


def _render(d: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"rollout {d['id']}: {d['state']}, cohort {d['fraction']:.0%}, policy "
                  f"{d['policy'].get('name', '-')} (version {d['policy'].get('version')})"
                  + (f", ADR {d['adr_id']}" if d.get("adr_id") else "")
                  + (f", one of fleet rollout {d['policy']['fleet']}" if d["policy"].get("fleet") else ""),
                  highlight=False)
    settings = ", ".join(f"{name} {value}" for name, value in d["policy"].get("settings", {}).items())
    in_effect = d.get("settings_in_effect")
    if in_effect is None:
        console.print(f"settings: {settings}")
    elif all(in_effect.values()):
        console.print(f"settings: {settings} (everyone's now)")
    else:
        reverted = ", ".join(name for name, kept in in_effect.items() if not kept)
        console.print(f"settings: {settings} [yellow](no longer in effect: {reverted}; a reload or restart "
                      f"with a config that says otherwise reverted it)[/yellow]")
    last = d.get("last_figures")
    if d.get("cohort") is not None:
        since = d.get("figures_since")
        if last and last["action"] == "shutdown" and since and last["at"] <= since:  # kvd restarted meanwhile
            console.print(_figures_table(last["cohort"], last["baseline"],
                                         f"figures before kvd stopped ({when(last['at'])})"))
        console.print(_figures_table(d["cohort"], d["baseline"], "figures" + (f" since {when(since)}" if since else "")))
    elif last:
        console.print(_figures_table(last["cohort"], last["baseline"],
                                     f"figures at its {last['action']} ({when(last['at'])})"))
    traffic = d.get("traffic")
    if traffic and traffic["requests"]:
        share = traffic["cohort_share"]
        line = (f"traffic: {share:.0%} of {traffic['requests']:,} requests in the cohort (asked {d['fraction']:.0%}, "
                f"by {traffic['by']})")
        if traffic["by"] == "tenant" and abs(share - d["fraction"]) > 0.15 and traffic["requests"] >= 20:
            line += (" [yellow]— few tenants make a coarse split; `by: request` in the policy splits "
                     "requests[/yellow]")
        console.print(line)
    if d["policy"].get("judged") == "fleet":
        console.print("stop conditions judged by kvd router on the fleet's figures (judged: fleet)")
    elif traffic and d["state"] == "running" and d["stops"] and not traffic["stops_checked"]:
        console.print(f"[yellow]stop conditions not checked yet: they wait for {traffic['stops_waiting_for']}"
                      "[/yellow]")
    for stop in d["stops"]:
        console.print(f"stop when: {stop}")
    if d.get("note"):
        console.print(f"[yellow]{d['note']}[/yellow]")
    if d.get("unstored"):
        console.print(f"[red]not stored: {d['unstored']}[/red]")
    for hint in (d.get("keep") or {}).values():
        console.print(f"[yellow]to keep it: {hint}[/yellow]")
    events = d["events"]
    if len(events) > EVENTS_SHOWN:
        console.print(f"  ({len(events) - EVENTS_SHOWN} earlier transitions; --json has them all)")
    for event in events[-EVENTS_SHOWN:]:
        console.print("  " + event_text(event), highlight=False)


def _emit(data: dict, as_json: bool) -> None:
    """A rollout's report; at kvd router, a fleet rollout's: its state, then each replica's."""
    emit(data, as_json, _fleet_render if "replicas" in data else _render)


def _fleet_render(d: dict, console: Console | None = None) -> None:
    console = console or Console()
    if d.get("fleet"):
        done = {"advance": "advanced", "pause": "paused", "resume": "resumed", "rollback": "rolled back",
                "complete": "completed"}.get(d.get("action"), "")
        console.print(f"fleet rollout {d['fleet']}: {d['state']}" + (f" ({done} at every replica that has it)"
                                                                    if done and d.get("result") == "ok" else ""),
                      style="bold", highlight=False)
    if d.get("message"):
        console.print(f"[yellow]{d['message']}[/yellow]", highlight=False)
    pooled = d.get("fleet_figures")
    if pooled:
        console.print(_figures_table(pooled["cohort"], pooled["baseline"],
                                     "figures across the fleet" + (" at its end" if pooled.get("ended") else "")
                                     + f" ({', '.join(pooled['replicas'])})"))
    _each_replica(_render)(d)


def _each_replica(render):
    """At kvd router, `render` of each replica's report under its name (a rollout is a replica's
    own: each runs, stops and numbers its rollouts apart); one without says why."""
    def each(d: dict, console: Console | None = None) -> None:
        console = console or Console()
        for row in d["replicas"]:
            console.print(f"replica {row['replica']}", style="bold", highlight=False)
            if "report" in row:
                render(row["report"], console)
            else:
                console.print(f"  {row.get('error')}", highlight=False)
    return each


@rollout_app.command("start")
def start(ctx: typer.Context, policy: Path = typer.Option(..., "--policy", help="Policy YAML (settings: ...)."),
          cohort: str = typer.Option(..., "--cohort", help="Share of traffic, e.g. 10%."),
          baseline: str = typer.Option("current", "--baseline", help="What the cohort is compared with."),
          stop: list[str] = typer.Option([], "--stop", help="e.g. 'ttft_p95_seconds > 1.5 * baseline'."),
          adr: Optional[int] = typer.Option(None, "--adr", help="The decision record this carries out."),
          as_json: bool = AS_JSON) -> None:
    """Start rolling a policy out to a cohort; kvd rolls back by itself when a stop condition trips.

    At kvd router: one rollout at every replica under one fleet id (a tenant on the same side
    everywhere; a stop at one replica rolls it back at all of them; `judged: fleet` in the policy
    has the router judge the stop conditions on the fleet's figures instead).

    Example: kvctl rollout start --policy p95.yaml --cohort 10% --stop "recomputed_token_ratio > 1.2 * baseline"
    """
    import yaml  # (loaded by the one command that reads a policy file)

    try:
        document = yaml.safe_load(policy.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"policy: cannot read {str(policy)!r} ({exc})") from None
    if isinstance(document, dict) and not document.get("name"):  # known by its file's name in list and status
        document = {"name": policy.stem, **document}
    body = {"policy": document, "cohort": cohort, "stops": stop, "adr": adr, "baseline": baseline}
    _emit(client_for(ctx).post("/admin/rollouts", body), as_json)


@rollout_app.command("status")
def status(ctx: typer.Context,
           rollout_id: Optional[str] = typer.Argument(None, help=ROLLOUT_ID + " (default: latest)."),
           as_json: bool = AS_JSON) -> None:
    """Cohort against baseline, stop conditions and the transitions so far.

    Example: kvctl rollout status 3
    """
    client = client_for(ctx)
    latest = client.get("/admin/rollouts/history?limit=1")
    if "replicas" in latest:  # kvd router: each replica's newest, or a fleet rollout at each replica
        path = "/admin/rollouts" if rollout_id is None else f"/admin/rollouts/{rollout_id}"
        emit(client.get(path), as_json, _fleet_render)
        return
    if rollout_id is None and not latest["rollouts"]:
        if as_json:
            typer.echo("null")
        else:
            Console().print("no rollout has been started; start one with `kvctl rollout start`")
        return
    path = "/admin/rollouts" if rollout_id is None else f"/admin/rollouts/{rollout_id}"
    _emit(client.get(path), as_json)


@rollout_app.command("list")
def list_rollouts(ctx: typer.Context, limit: int = typer.Option(20, "--limit", help="Newest rollouts to show."),
                  as_json: bool = AS_JSON) -> None:
    """Every rollout, newest first: state, cohort, policy, when it started and its latest transition.

    Example: kvctl rollout list --limit 50
    """
    if limit < 1:
        raise UserError(f"limit: must be at least 1, got {limit}")
    data = client_for(ctx).get(f"/admin/rollouts/history?limit={limit}")

    def render(d: dict, console: Console | None = None) -> None:
        console = console or Console()
        if not d["rollouts"]:
            console.print("no rollout has been started; start one with `kvctl rollout start`")
            return
        now = time.time()
        fleets = any(r["policy"].get("fleet") for r in d["rollouts"])
        table = compact_table("id", "state", "cohort", "policy", "started", "latest", "adr", *(["fleet"] * fleets))
        for r in d["rollouts"]:
            table.add_row(str(r["id"]), r["state"] + (" (not stored)" if r.get("unstored") else ""),
                          f"{r['fraction']:.0%}", r["policy"].get("name", "-"),
                          when(r["created_at"]), f"{r['last_action']} {duration(now - r['last_at'])} ago",
                          "-" if r["adr_id"] is None else str(r["adr_id"]),
                          *([r["policy"].get("fleet") or "-"] * fleets))
        keep_whole(table, 0, 4, *([1, 7] if fleets else [5]))  # (the latest transition wraps before a fleet id)
        console.print(table)

    def at_router(d: dict, console: Console | None = None) -> None:
        console = console or Console()
        fleet_table(d["replicas"], console)
        _each_replica(render)(d, console)

    emit(data, as_json, at_router if "replicas" in data else render)


def fleet_table(rows: list[dict], console: Console) -> None:
    """At kvd router, the fleet rollouts among the replicas' listed rollouts, each once: its state
    at the replicas that list it (one state, or how many are in each), cohort share and policy."""
    listing = [row for row in rows if "report" in row]
    fleets: dict[str, list[dict]] = {}
    for row in listing:
        for rollout in row["report"]["rollouts"]:
            if rollout["policy"].get("fleet"):
                fleets.setdefault(rollout["policy"]["fleet"], []).append(rollout)
    if not fleets:
        return
    table = compact_table("fleet", "state", "cohort", "policy", "started", "replicas")
    for fleet, rollouts in sorted(fleets.items(), key=lambda item: -min(r["created_at"] for r in item[1])):
        states = Counter(r["state"] for r in rollouts)
        shares = {f"{r['fraction']:.0%}" for r in rollouts}
        table.add_row(fleet, next(iter(states)) if len(states) == 1 else
                      "mixed: " + ", ".join(f"{state} at {count}" for state, count in sorted(states.items())),
                      shares.pop() if len(shares) == 1 else "mixed", rollouts[0]["policy"].get("name", "-"),
                      when(min(r["created_at"] for r in rollouts)), f"{len(rollouts)} of {len(listing)}")
    keep_whole(table, 0, 4)
    console.print("fleet rollouts", style="bold")
    console.print(table)


@rollout_app.command("advance")
def advance(ctx: typer.Context, rollout_id: str = typer.Argument(..., help=ROLLOUT_ID + "."),
            to: str = typer.Option(..., "--to", help="New cohort share, e.g. 50%."), as_json: bool = AS_JSON) -> None:
    """Grow (or shrink) the cohort.

    Example: kvctl rollout advance 3 --to 50%
    """
    _emit(client_for(ctx).post(f"/admin/rollouts/{rollout_id}/advance", {"to": to}), as_json)


@rollout_app.command("pause")
def pause(ctx: typer.Context, rollout_id: str = typer.Argument(..., help=ROLLOUT_ID + "."),
          as_json: bool = AS_JSON) -> None:
    """Stop sending new requests to the cohort settings (resume continues).

    Example: kvctl rollout pause 3
    """
    _emit(client_for(ctx).post(f"/admin/rollouts/{rollout_id}/pause", {}), as_json)


@rollout_app.command("resume")
def resume(ctx: typer.Context, rollout_id: str = typer.Argument(..., help=ROLLOUT_ID + "."),
           as_json: bool = AS_JSON) -> None:
    """Continue a paused rollout.

    Example: kvctl rollout resume 3
    """
    _emit(client_for(ctx).post(f"/admin/rollouts/{rollout_id}/resume", {}), as_json)


@rollout_app.command("rollback")
def rollback(ctx: typer.Context, rollout_id: str = typer.Argument(..., help=ROLLOUT_ID + "."),
             reason: str = typer.Option(..., "--reason", help="Why, for the record."), as_json: bool = AS_JSON) -> None:
    """Return everyone to the baseline settings.

    Example: kvctl rollout rollback 3 --reason "TTFT regression in eu-west"
    """
    _emit(client_for(ctx).post(f"/admin/rollouts/{rollout_id}/rollback", {"reason": reason}), as_json)


@rollout_app.command("complete")
def complete(ctx: typer.Context, rollout_id: str = typer.Argument(..., help=ROLLOUT_ID + "."),
             as_json: bool = AS_JSON) -> None:
    """Make the cohort's settings everyone's.

    Example: kvctl rollout complete 3
    """
    _emit(client_for(ctx).post(f"/admin/rollouts/{rollout_id}/complete", {}), as_json)

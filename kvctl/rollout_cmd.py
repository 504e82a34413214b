"""`kvctl rollout ...`: roll live policy settings out to a cohort, with automatic stop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from .errors import UserError
from .ops import _client
from .ops import _emit as emit

rollout_app = typer.Typer(help="Gradual rollouts of cache settings with stop conditions.", no_args_is_help=True)
AS_JSON = typer.Option(False, "--json", help="Print JSON.")


def _render(d: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"rollout {d['id']}: {d['state']}, cohort {d['fraction']:.0%}, policy "
                  f"{d['policy'].get('name', '-')} (version {d['policy'].get('version')})"
                  + (f", ADR {d['adr_id']}" if d.get("adr_id") else ""))
    if d.get("cohort") is not None:
        table = Table("figure", "cohort", "baseline")
        for name in ("requests", "recomputed_token_ratio", "hit_ratio", "ttft_p50_seconds", "ttft_p95_seconds",
                     "preemptions_per_request"):
            fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
            table.add_row(name, fmt(d["cohort"].get(name)), fmt(d["baseline"].get(name)))
        console.print(table)
    traffic = d.get("traffic")
    if traffic and traffic["requests"]:
        share = traffic["cohort_share"]
        line = (f"traffic: {share:.0%} of {traffic['requests']:,} requests in the cohort (asked {d['fraction']:.0%}, "
                f"by {traffic['by']})")
        if traffic["by"] == "tenant" and abs(share - d["fraction"]) > 0.15 and traffic["requests"] >= 20:
            line += (" [yellow]— few tenants make a coarse split; `by: request` in the policy splits "
                     "requests[/yellow]")
        console.print(line)
    if traffic and d["state"] == "running" and d["stops"] and not traffic["stops_checked"]:
        console.print(f"[yellow]stop conditions not checked yet: they wait for {traffic['stops_waiting_for']}"
                      "[/yellow]")
    for stop in d["stops"]:
        console.print(f"stop when: {stop}")
    for event in d["events"][-5:]:
        console.print(f"  {event['action']} by {event['actor']}: {json.dumps(event['detail'])}")


def _emit(data: dict, as_json: bool) -> None:
    emit(data, as_json, _render)


@rollout_app.command("start")
def start(ctx: typer.Context, policy: Path = typer.Option(..., "--policy", help="Policy YAML (settings: ...)."),
          cohort: str = typer.Option(..., "--cohort", help="Share of traffic, e.g. 10%."),
          baseline: str = typer.Option("current", "--baseline", help="What the cohort is compared with."),
          stop: list[str] = typer.Option([], "--stop", help="e.g. 'ttft_p95_seconds > 1.5 * baseline'."),
          adr: Optional[int] = typer.Option(None, "--adr", help="The decision record this carries out."),
          as_json: bool = AS_JSON) -> None:
    """Start rolling a policy out to a cohort; kvd rolls back by itself when a stop condition trips.

    Example: kvctl rollout start --policy p95.yaml --cohort 10% --stop "recomputed_token_ratio > 1.2 * baseline"
    """
    try:
        document = yaml.safe_load(policy.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"policy: cannot read {str(policy)!r} ({exc})") from None
    body = {"policy": document, "cohort": cohort, "stops": stop, "adr": adr, "baseline": baseline}
    _emit(_client(ctx).post("/admin/rollouts", body), as_json)


@rollout_app.command("status")
def status(ctx: typer.Context, rollout_id: Optional[int] = typer.Argument(None, help="Rollout id (default: latest)."),
           as_json: bool = AS_JSON) -> None:
    """Cohort against baseline, stop conditions and the transitions so far.

    Example: kvctl rollout status 3
    """
    path = "/admin/rollouts" if rollout_id is None else f"/admin/rollouts/{rollout_id}"
    _emit(_client(ctx).get(path), as_json)


@rollout_app.command("advance")
def advance(ctx: typer.Context, rollout_id: int = typer.Argument(..., help="Rollout id."),
            to: str = typer.Option(..., "--to", help="New cohort share, e.g. 50%."), as_json: bool = AS_JSON) -> None:
    """Grow (or shrink) the cohort.

    Example: kvctl rollout advance 3 --to 50%
    """
    _emit(_client(ctx).post(f"/admin/rollouts/{rollout_id}/advance", {"to": to}), as_json)


@rollout_app.command("pause")
def pause(ctx: typer.Context, rollout_id: int = typer.Argument(..., help="Rollout id."), as_json: bool = AS_JSON) -> None:
    """Stop sending new requests to the cohort settings (resume continues).

    Example: kvctl rollout pause 3
    """
    _emit(_client(ctx).post(f"/admin/rollouts/{rollout_id}/pause", {}), as_json)


@rollout_app.command("resume")
def resume(ctx: typer.Context, rollout_id: int = typer.Argument(..., help="Rollout id."), as_json: bool = AS_JSON) -> None:
    """Continue a paused rollout.

    Example: kvctl rollout resume 3
    """
    _emit(_client(ctx).post(f"/admin/rollouts/{rollout_id}/resume", {}), as_json)


@rollout_app.command("rollback")
def rollback(ctx: typer.Context, rollout_id: int = typer.Argument(..., help="Rollout id."),
             reason: str = typer.Option(..., "--reason", help="Why, for the record."), as_json: bool = AS_JSON) -> None:
    """Return everyone to the baseline settings.

    Example: kvctl rollout rollback 3 --reason "TTFT regression in eu-west"
    """
    _emit(_client(ctx).post(f"/admin/rollouts/{rollout_id}/rollback", {"reason": reason}), as_json)


@rollout_app.command("complete")
def complete(ctx: typer.Context, rollout_id: int = typer.Argument(..., help="Rollout id."), as_json: bool = AS_JSON) -> None:
    """Make the cohort's settings everyone's.

    Example: kvctl rollout complete 3
    """
    _emit(_client(ctx).post(f"/admin/rollouts/{rollout_id}/complete", {}), as_json)

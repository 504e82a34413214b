"""kvctl batches: every tenant's batches of /v1/batches, and an operator's cancel of one.

kvd decides and reports (`GET /admin/batches`, `POST /admin/batches/{id}/cancel`); these show
its answer. Ids, counts, tokens and times only: never a request's text.
"""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.text import Text

from .command_kit import client_for, emit, show_or_watch
from .tables import by_replica, count, duration

batches_app = typer.Typer(no_args_is_help=False)


@batches_app.callback(invoke_without_command=True)
def batches(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every tenant's batches (/v1/batches), the latest first: status, requests answered, failed
    and in flight, tokens, and age; and how many requests kvd serves at once.

    `kvctl batches cancel ID` cancels one, whoever's (audited): it hands out no more of its
    requests, and ends once those in flight end, their answers in its output file.

    Example: kvctl batches
    """
    if ctx.invoked_subcommand is not None:
        return
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/batches"), batches_view, watch, as_json)


def batches_view(d: dict, now: float | None = None) -> Group:
    """Each batch in two lines, and kvd's line under them; at kvd router, each replica's."""
    if "replicas" in d:
        return by_replica(d["replicas"], lambda report: batches_view(report, now))
    now = time.time() if now is None else now
    parts: list = []
    for row in d["batches"]:  # (two lines a batch: its id whole, which `cancel` takes, on a narrow terminal too)
        counts, usage = row["request_counts"], row["usage"]
        parts.append(Text.assemble((row["id"], "bold"), f"  {row['status']}  ",
                                   f"(tenant {row['tenant']}, made {duration(max(0.0, now - row['created_at']))} ago)"))
        parts.append(Text(f"  {count(counts['completed'])} of {count(counts['total'])} answered, "
                          f"{count(counts['failed'])} failed, {count(row['in_flight'])} in flight; "
                          f"{count(usage['input_tokens'])} input tokens "
                          f"({count(usage['input_tokens_details']['cached_tokens'])} cached), "
                          f"{count(usage['output_tokens'])} output"))
    served = d["served"]
    parts.append(Text(f"{len(d['batches']):,} batches kept; {d['concurrency']:,} requests served at once "
                      f"(batch_concurrency); since kvd started {served['completed']:,} answered 2xx, "
                      f"{served['failed']:,} failed"
                      + (f"; sent through kvd router at {d['via']} (batch_via)" if d.get("via") else "")))
    unsent = d.get("via_unsent")
    if unsent:  # (the requests wait meanwhile, none failed for it)
        parts.append(Text(f"requests have not gone through kvd router for {duration(max(0.0, now - unsent['since']))}: "
                          f"{unsent['why']}; they wait, and are sent once it takes them", style="yellow"))
    return Group(*parts)


@batches_app.command("cancel")
def cancel(ctx: typer.Context, batch_id: str = typer.Argument(..., help="The batch (batch_...)."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Cancel a batch, whoever's; audited. Requests in flight end and are kept in its output file.

    Example: kvctl batches cancel batch_0123...
    """
    data = client_for(ctx).post(f"/admin/batches/{batch_id}/cancel", {})
    emit(data, as_json, lambda d: typer.echo(
        f"{d['id']} of tenant {d['tenant']}: {d['status']} ({d['request_counts']['completed']:,} of "
        f"{d['request_counts']['total']:,} answered; those in flight end first)"))

"""kvctl webhooks: where kvd sends its webhooks (webhooks_file), the events not delivered yet, a
retry of those now, and an ended batch's or background response's end told again.

kvd decides and reports (`GET /admin/webhooks`, `POST /admin/webhooks/retry`, `POST
/admin/webhooks/resend/{id}`); these show its answer. Ids, tenants, types, addresses and errors only: never a secret.
"""

from __future__ import annotations

from urllib.parse import quote

import typer
from rich.console import Group
from rich.text import Text

from .command_kit import client_for, emit, show_or_watch
from .tables import by_replica, duration

webhooks_app = typer.Typer(no_args_is_help=False)


@webhooks_app.callback(invoke_without_command=True)
def webhooks(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Each tenant's webhook endpoint (webhooks_file), the events waiting to be delivered (the oldest
    first: tries, next try, last error), and the deliveries since kvd started.

    `kvctl webhooks retry` tries every waiting event now (an endpoint mended; audited);
    `kvctl webhooks resend ID` tells an ended batch's or background response's end again.

    Example: kvctl webhooks
    """
    if ctx.invoked_subcommand is not None:
        return
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/webhooks"), webhooks_view, watch, as_json)


def webhooks_view(d: dict) -> Group:
    """A line per endpoint, per event waiting, and kvd's line under them; at kvd router, each replica's."""
    if "replicas" in d:
        return by_replica(d["replicas"], webhooks_view)
    parts: list = [Text(f"tenant {e['tenant']}: {e['url']}") for e in d["endpoints"]]
    if not d["endpoints"]:
        parts.append(Text("no endpoint: webhooks_file names none (kvd sends no webhook)"))
    for p in d["pending"]:
        parts.append(Text.assemble((p["id"], "bold"), f"  {p['type']} of tenant {p['tenant']}: {p['attempts']:,} "
                                   f"tries, next in {duration(p['next_in'])}"
                                   + (f" (last: {p['last_error']})" if p["last_error"] else "")))
    parts.append(Text(f"{len(d['pending']):,} waiting; since kvd started {d['delivered']:,} delivered, "
                      f"{d['retried']:,} tries failed, {d['dropped']:,} dropped"))
    return Group(*parts)


@webhooks_app.command("retry")
def retry(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Try every waiting event now, not at its backoff's time; audited.

    Example: kvctl webhooks retry
    """
    data = client_for(ctx).post("/admin/webhooks/retry", {})

    def said(d: dict) -> None:  # (at kvd router: each replica's, and what one could not do)
        for row in d.get("replicas", []):
            typer.echo(f"replica {row['replica']}: " + (
                f"{row['retried']:,} events tried now" if "retried" in row else
                "not reached" if row.get("status") is None else f"refused ({row['status']})"))
        typer.echo(f"{d['retried']:,} events tried now" + (f"; {d['message']}" if d.get("message") else ""))

    emit(data, as_json, said)


@webhooks_app.command("resend")
def resend(ctx: typer.Context, object_id: str = typer.Argument(..., metavar="ID",
                                                              help="An ended batch's id or background response's."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Tell an ended batch's or background response's end again to its tenant's endpoint (its
    receiver lost it), under the event id it was told with first; audited. At kvd router, the
    replica that keeps it sends it.

    Example: kvctl webhooks resend batch_0123
    """
    data = client_for(ctx).post(f"/admin/webhooks/resend/{quote(object_id, safe='')}", {})
    emit(data, as_json, lambda d: typer.echo(
        f"{d['type']} of {d['object_id']} (tenant {d['tenant']}) sent again as {d['id']}"
        + (f" by replica {d['replica']}" if d.get("replica") else "")))

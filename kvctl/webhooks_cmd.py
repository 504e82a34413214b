"""kvctl webhooks: where kvd sends its webhooks (webhooks_file), the events not delivered yet, and
a retry of those now.

kvd decides and reports (`GET /admin/webhooks`, `POST /admin/webhooks/retry`); these show its
answer. Ids, tenants, types, addresses and errors only: never a secret.
"""

from __future__ import annotations

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

    `kvctl webhooks retry` tries every waiting event now (an endpoint mended; audited).

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

"""kvctl responses: the responses kvd keeps for /v1/responses, and the conversations of
/v1/conversations, by tenant; and their purge.

kvd decides and reports (`GET /admin/responses`, `POST /admin/responses/purge`); these show its
answer. Counts, bytes and times only: never a response's text. At kvd router, each replica's.
"""

from __future__ import annotations

import time
from typing import Optional

import typer
from rich.console import Group
from rich.markup import escape
from rich.text import Text

from .command_kit import client_for, emit, show_or_watch
from .errors import UserError
from .tables import by_replica, compact_table, count, duration, size

responses_app = typer.Typer(no_args_is_help=False)


@responses_app.callback(invoke_without_command=True)
def responses(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The responses and conversations kvd keeps, by tenant: how many, their bytes, their ages.

    The responses kept for previous_response_id: how many, their bytes, the oldest's and newest's
    age, and those running in the background; and the conversations kept (/v1/conversations), how
    many and their bytes. Never their text. `kvctl responses purge` removes a tenant's, or those older than a span.
    At kvd router, each replica's under its name.

    Example: kvctl responses
    """
    if ctx.invoked_subcommand is not None:
        return
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/responses"), responses_view, watch, as_json)


def responses_view(d: dict, now: float | None = None) -> Group:
    """The table of tenants and the store's line under it; at kvd router, each replica's."""
    if "replicas" in d:
        return by_replica(d["replicas"], lambda report: responses_view(report, now))
    now = time.time() if now is None else now
    parts: list = []
    if d["tenants"]:
        talks = "conversations" in d  # (an older kvd keeps none)
        table = compact_table("tenant", "responses", "bytes", "oldest", "newest", "running",
                              *(("conversations", "their bytes") if talks else ()))
        for index in range(1, 8 if talks else 6):
            table.columns[index].justify = "right"
        for row in d["tenants"]:
            table.add_row(escape(row["tenant"]), count(row["responses"]), size(row["bytes"]),
                          _age(row["oldest"], now), _age(row["newest"], now), count(row["running"]),
                          *((count(row.get("conversations", 0)), size(row.get("conversation_bytes", 0)))
                            if talks else ()))
        parts.append(table)
    line = (f"{d['responses']:,} kept in {size(d['bytes'])} of {size(d['budget_bytes'])}"
            + (f"; {d['dropped']:,} let go for room" if d["dropped"] else "")
            + (f"; {d['expired']:,} past responses_max_age" if d.get("expired") else "")
            + (f"; {d['running']:,} running in the background" if d["running"] else "")
            + (f"; {size(d['replay_bytes'])} of events kept to stream again" if d.get("replay_bytes") else ""))
    parts.append(Text(line if d["budget_bytes"] else "kvd keeps no response (responses_store_bytes 0)"))
    if d["budget_bytes"] and "file" in d:  # (an older kvd does not say)
        parts.append(file_line(d["file"]))
    talks = d.get("conversations")
    if talks is not None:
        parts.append(Text(f"conversations: {talks['conversations']:,} kept in {size(talks['bytes'])} of "
                          f"{size(talks['budget_bytes'])}"
                          + (f"; {talks['dropped']:,} let go for room" if talks["dropped"] else "")
                          + (f"; {talks['expired']:,} idle past responses_max_age" if talks.get("expired") else "")
                          if talks["budget_bytes"] else "kvd keeps no conversation (conversations_store_bytes 0)"))
    return Group(*parts)


def file_line(file: dict | None) -> Text:
    """Where the kept responses and conversations are written as well (a restart keeps them), or
    that they are in memory only; and the writes that did not land, and why the latest did not."""
    if file is None:
        return Text("kept in memory only: a restart forgets them (responses_store_file writes them to disk)")
    line = Text(f"written to {file['path']} as well: a restart keeps them")
    failed = file["failed_writes"]
    if failed:
        line.append(f"; {failed:,} write{'s' if failed != 1 else ''} did not land ({file['last_failure']}): what "
                    f"{'they' if failed != 1 else 'it'} held is in memory only", style="red")
    return line


def _age(at: float | None, now: float) -> str:
    return "-" if at is None else duration(now - at) + " ago"


@responses_app.command("purge")
def purge(ctx: typer.Context,
          tenant: Optional[str] = typer.Option(None, "--tenant", help="This tenant's responses and conversations."),
          older_than: Optional[str] = typer.Option(None, "--older-than", help="Those made longer ago than this "
                                                   "(90, 30m, 12h, 7d); with --tenant, that tenant's only."),
          ids: Optional[list[str]] = typer.Option(None, "--id", help="This response (resp_...) or conversation "
                                                  "(conv_...), whoever's (with --tenant, that tenant's only); "
                                                  "again for more."),
          every: bool = typer.Option(False, "--all", help="Every kept response, of every tenant."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Say what it would remove; change nothing."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Remove kept responses and conversations from memory and from responses_store_file; audited.

    A tenant's (a customer leaving), those older than a span (a retention rule: a response's age
    is since it was made, a conversation's since it last changed), those named by id (--id: a
    user's request to forget a conversation; an id kvd does not keep is named, exit status 3), or
    every one (--all). Background responses still running are cancelled first. A client that then
    names a removed response or conversation gets a 404. At kvd router, on every replica.

    Example: kvctl responses purge --tenant acme --dry-run
    """
    if not (tenant or older_than or every or ids):
        raise UserError("give --tenant, --older-than, --id or --all")
    body = {"tenant": tenant, "older_than": older_than, "ids": ids or None, "all": every, "dry_run": dry_run}
    data = client_for(ctx).post("/admin/responses/purge", {k: v for k, v in body.items() if v is not None})
    emit(data, as_json, lambda d: typer.echo(purge_text(d)))
    if data.get("result") == "partial" or data.get("ids_not_found"):
        raise typer.Exit(3)  # kvd router: some replica refused or was not reached; or an id is not kept


def purge_text(d: dict) -> str:
    """What a purge removed (or, dry, would remove); at kvd router, the fleet's sum, and what some
    replica could not do."""
    verb = "would remove" if d["dry_run"] else "removed"
    by_tenant = ", ".join(f"{tenant} {n:,}" for tenant, n in sorted(d["tenants"].items()))
    line = f"{verb} {d['responses']:,} responses ({size(d['bytes'])})" + (f": {by_tenant}" if by_tenant else "")
    talks = d.get("conversations")  # (an older kvd keeps none)
    if talks and talks["conversations"]:
        theirs = ", ".join(f"{tenant} {n:,}" for tenant, n in sorted(talks["tenants"].items()))
        line += f"; and {talks['conversations']:,} conversations ({size(talks['bytes'])}): {theirs}"
    if d["running"]:
        line += f"; would cancel {d['running']:,} running in the background first"
    if d["cancelled"]:
        line += f"; cancelled {d['cancelled']:,} running in the background first"
    if "replicas" in d:
        line += f" on {sum(1 for row in d['replicas'] if row.get('status') == 200)} of {len(d['replicas'])} replicas"
    if d.get("ids_not_found"):
        line += f"\nnot kept{' for ' + d['tenant'] if d.get('tenant') else ''}: {', '.join(d['ids_not_found'])}"
    return line + (f"\n{d['message']}" if d.get("message") else "")

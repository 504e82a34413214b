"""kvctl files: every tenant's files of /v1/files (batches' inputs and outputs), what each tenant's
take of its budget and of kvd's, and an operator's delete of one.

kvd decides and reports (`GET /admin/files`, `DELETE /admin/files/{id}`); these show its answer.
Ids, names, sizes and times only: never a file's content.
"""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.text import Text

from .command_kit import client_for, emit, show_or_watch
from .tables import by_replica, count, duration, size

files_app = typer.Typer(no_args_is_help=False)


@files_app.callback(invoke_without_command=True)
def files(ctx: typer.Context, tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's files."),
          watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every tenant's files (/v1/files: batches' inputs and their outputs), the latest first; each
    tenant's bytes of its budget (tenant_files_bytes) and all of them of files_store_bytes.

    `kvctl files delete ID` deletes one, whoever's (audited); not one a batch still reads.

    Example: kvctl files --tenant acme
    """
    if ctx.invoked_subcommand is not None:
        return
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/files", tenant=tenant), files_view, watch, as_json)


def printable(text: str) -> str:
    """A caller's file name as a terminal may show it: what it cannot print (a control character, an
    escape sequence's start) as '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def files_view(d: dict, now: float | None = None) -> Group:
    """A line per file, a line per tenant, and kvd's line under them; at kvd router, each replica's."""
    if "replicas" in d:
        return Group(by_replica(d["replicas"], lambda report: files_view(report, now)), *fleet_tenants(d["replicas"]))
    now = time.time() if now is None else now
    parts: list = []
    for row in d["files"]:
        expiry = "" if row["expires_at"] is None else \
            f", expires in {duration(max(0.0, row['expires_at'] - now))}"
        parts.append(Text.assemble((row["id"], "bold"), f"  {row['purpose']}  {size(row['bytes'])}  ",
                                   f"(tenant {row['tenant']}, made {duration(max(0.0, now - row['created_at']))} ago"
                                   f"{expiry}) {printable(row['filename'])}"))
    for name, row in d["tenants"].items():
        budget = "files_store_bytes" if row["budget"] is None else f"{size(row['budget'])} (tenant_files_bytes)"
        parts.append(Text(f"tenant {name}: {count(row['files'])} files, {size(row['bytes'])} of {budget}"))
    refused = d["refused"]
    parts.append(Text(f"{size(d['bytes'])} of {size(d['store_bytes'])} kept (files_store_bytes); uploads up to "
                      f"{size(d['max_file_bytes'])} (max_file_bytes); since kvd started {refused['tenant']:,} "
                      f"refused past a tenant's budget, {refused['store']:,} past files_store_bytes"
                      + (f"; each removed {duration(d['max_age'])} after it was made at the latest (files_max_age)"
                         if d.get("max_age") else "")))
    return Group(*parts)


def fleet_tenants(replicas: list[dict]) -> list[Text]:
    """At kvd router, a line per tenant: its files at every replica that answered, against its
    budget, which counts them all (the router tells each upload's replica what the others keep)."""
    reports = [row["report"] for row in replicas if "report" in row]
    lines = []
    for name in sorted({tenant for report in reports for tenant in report["tenants"]}):
        rows = [report["tenants"][name] for report in reports if name in report["tenants"]]
        budgets = {row["budget"] for row in rows}
        budget = "files_store_bytes at each replica" if budgets == {None} else \
            f"{size(next(iter(budgets)))} (tenant_files_bytes)" if len(budgets) == 1 else \
            "budgets that differ from replica to replica (give each the same tenant_files_bytes)"
        lines.append(Text(f"tenant {name} across the fleet: {count(sum(row['files'] for row in rows))} files, "
                          f"{size(sum(row['bytes'] for row in rows))} of {budget}"))
    unanswered = len(replicas) - len(reports)
    if lines and unanswered:
        lines.append(Text(f"(not counting the {unanswered} replicas that did not answer)", style="yellow"))
    return lines


@files_app.command("delete")
def delete(ctx: typer.Context, file_id: str = typer.Argument(..., help="The file (file-...)."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Delete a file, whoever's; audited. Not one a batch not yet ended reads (cancel the batch first).

    Example: kvctl files delete file-0123...
    """
    data = client_for(ctx).delete(f"/admin/files/{file_id}")
    emit(data, as_json, lambda d: typer.echo(f"{d['id']} of tenant {d['tenant']} deleted ({size(d['bytes'])})"))

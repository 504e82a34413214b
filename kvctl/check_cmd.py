"""kvctl check: is kvd (or the fleet behind kvd router) fit to serve? Check by check, with the
exit status monitoring plugins give (0 ok, 1 warning, 2 critical): a deploy gate or a Nagios,
Icinga or Sensu check. kvd decides each check (daemon/server/health_checks.py); kvctl asks,
waits where told to, and shows the answer."""

from __future__ import annotations

import time
from typing import Callable

import typer
from rich.console import Console
from rich.text import Text

from .command_kit import client_for, emit
from .errors import KvdUnavailable, UserError
from .tables import compact_table, keep_whole

EXIT_STATUS = {"ok": 0, "warning": 1, "critical": 2}
STYLES = {"ok": "green", "warning": "yellow", "critical": "bold red"}


def unreachable(why: str) -> dict:
    """The report of a kvd that does not answer: critical, saying why."""
    return {"status": "critical", "checks": [{"check": "kvd", "status": "critical", "detail": why}]}


def ignoring(report: dict, ignored: list[str]) -> dict:
    """`report` without the checks `ignored` names (a name alone also names it on every replica:
    "pins" is "kvd-0: pins" too), its status that of the rest, and how many were left out."""
    if not ignored:
        return report
    names = set(ignored)
    kept = [c for c in report["checks"] if c["check"] not in names and c["check"].rpartition(": ")[2] not in names]
    status = max((c["status"] for c in kept), key=EXIT_STATUS.__getitem__, default="ok")
    return {**report, "status": status, "checks": kept, "ignored": len(report["checks"]) - len(kept)}


def ask_until_ok(ask: Callable[[], dict], wait: float, every: float = 1.0, clock=time.monotonic,
                 sleep=time.sleep, waiting: Callable[[str], None] = lambda line: None) -> tuple[dict, int]:
    """`ask()` (a report; KvdUnavailable: critical) until its status is ok or `wait` seconds have
    passed: the last report and how many times it was asked. While it waits, `waiting` gets a line
    saying what is not ok, each time that changes."""
    deadline, asked, said = clock() + wait, 0, None
    while True:
        try:
            report = ask()
        except KvdUnavailable as exc:
            report = unreachable(str(exc))
        asked += 1
        if report["status"] == "ok" or clock() + every > deadline:
            return report, asked
        line = "; ".join(f"{c['check']} {c['status']}: {c['detail']}" for c in report["checks"] if c["status"] != "ok")
        if line != said:
            waiting(f"waiting ({deadline - clock():.0f} s left): {line}")
            said = line
        sleep(every)


def render_report(report: dict, where: str, asked: int, console: Console) -> None:
    table = compact_table("check", "status", "detail")
    for row in report["checks"]:
        table.add_row(row["check"], Text(row["status"], style=STYLES[row["status"]]), row["detail"])
    keep_whole(table, 0, 1)
    console.print(table)
    counts = {status: sum(row["status"] == status for row in report["checks"]) for status in ("warning", "critical")}
    said = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if report.get("ignored"):
        said = ", ".join(filter(None, [said, f"{report['ignored']} ignored"]))
    console.print(Text.assemble(f"{where}: ", (report["status"].upper(), STYLES[report["status"]]),
                                f" ({said})" if said else "",
                                f" after {asked} tries" if asked > 1 else ""))


def check(ctx: typer.Context,
          wait: float = typer.Option(0.0, "--wait", help="Ask again every second until every check is ok, up to this "
                                     "many seconds (a deploy gate: kvd may still be loading)."),
          ignore: list[str] = typer.Option([], "--ignore", help="Leave out this check (repeat for more): as the table "
                                           "names it, or by its name alone on every replica (e.g. pins)."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Whether kvd, or every replica behind kvd router, is fit to serve: each check ok, warning or critical.

    The checks: serving (ready, drained or asleep), engine (a step failed within the hour), cache
    scales (a quantised cache on unit scales, or scales the kernels do not read), store, tiers,
    TLS certificate, stranded pins, a refused config reload, weights swapped in at run time, and
    the responses file. At kvd router, each replica's, a critical one for a replica that does not
    answer, and a warning for each way the replicas differ (software, weights, formats). Exit
    status 0 when all are ok, 1 with a warning, 2 with a critical one (as a monitoring plugin).

    Example: kvctl check --wait 300 --ignore weights || ./roll-back
    """
    if wait < 0:
        raise UserError(f"wait: must be 0 or more seconds, got {wait:g}")
    client = client_for(ctx)
    report, asked = ask_until_ok(lambda: ignoring(client.get("/admin/checks"), ignore), wait,
                                 waiting=lambda line: typer.echo(line, err=True))
    where = f"kvd router at {client.where} ({report['replicas']} replicas)" if "replicas" in report \
        else f"kvd at {client.where}"
    emit(report, as_json, lambda r: render_report(r, where, asked, Console()))
    raise typer.Exit(EXIT_STATUS[report["status"]])

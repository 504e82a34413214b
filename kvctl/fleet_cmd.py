"""kvctl fleet: the replicas behind `kvd router`: drain one before its restart or upgrade, and
take it back after. The router decides where requests go; these only ask it to leave one out."""

from __future__ import annotations

import time

import typer
from rich.console import Console

from .errors import UserError
from .ops import _client, _emit

fleet_app = typer.Typer(help="The replicas behind kvd router: drain one for a restart, take it back.",
                        no_args_is_help=True)

REPLICA_HELP = "The replica as the router names it (its socket or URL: `kvctl status` at the router lists them)."


def _open_requests(client, replica: str) -> int:
    for row in client.get("/router/status")["replicas"]:
        if row["replica"] == replica:
            return row["open"]
    return 0  # it has left the fleet: nothing of it is open


@fleet_app.command("drain")
def drain(ctx: typer.Context, replica: str = typer.Argument(..., help=REPLICA_HELP),
          wait: float = typer.Option(0.0, "--wait", help="Wait up to this many seconds for its open requests to "
                                     "answer; exit 3 if some are still open then."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Send a replica no new request; those it is serving answer as usual.

    With --wait it returns once the replica has none open: then it can be stopped without
    failing a request. A router restart forgets a drain.

    Example: kvctl fleet drain /run/kvd-1/kvd.sock --wait 120 && systemctl restart kvd@1
    """
    if not wait >= 0:
        raise UserError(f"wait: must be >= 0 seconds, got {wait!r}")
    client = _client(ctx)
    data = client.post("/router/drain", {"replica": replica, "drain": True})
    started = time.monotonic()
    if wait > 0:
        while data["open"] > 0 and time.monotonic() - started < wait:
            time.sleep(0.2)
            data["open"] = _open_requests(client, replica)
    data["waited_seconds"] = round(time.monotonic() - started, 3) if wait > 0 else None

    def render(d):
        tail = (f"; {d['open']} open after {d['waited_seconds']:.1f} s" if d["waited_seconds"] is not None
                else f"; {d['open']} open")
        done = "; none open: it can be stopped" if d["open"] == 0 else ""
        Console().print(f"drained {d['replica']}: no new request goes there" + (done or tail), highlight=False,
                        soft_wrap=True)
    _emit(data, as_json, render)
    if wait > 0 and data["open"] > 0:
        raise typer.Exit(3)


@fleet_app.command("resume")
def resume(ctx: typer.Context, replica: str = typer.Argument(..., help=REPLICA_HELP),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Let a drained replica take new requests again.

    Example: kvctl fleet resume /run/kvd-1/kvd.sock
    """
    data = _client(ctx).post("/router/drain", {"replica": replica, "drain": False})
    _emit(data, as_json, lambda d: Console().print(f"resumed {d['replica']}: it takes new requests again",
                                                   highlight=False, soft_wrap=True))

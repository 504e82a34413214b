"""kvctl fleet: the replicas behind `kvd router`: drain one before its restart or upgrade, and
take it back after. The router decides where requests go; these only ask it to leave one out."""

from __future__ import annotations

import time
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape

from .errors import UserError
from .command_kit import client_for, emit

fleet_app = typer.Typer(help="The replicas behind kvd router: drain one for a restart, take it back.",
                        no_args_is_help=True)

REPLICA_HELP = "The replica as the router names it (its socket or URL: `kvctl status` at the router lists them)."


def wait_until_idle(left: int, ask: Callable[[], int], wait: float, every: float = 0.2) -> tuple[int, float]:
    """Ask what is still open every `every` seconds until none is, or `wait` seconds have passed:
    (what is left, seconds waited)."""
    started = time.monotonic()
    while left > 0 and time.monotonic() - started < wait:
        time.sleep(every)
        left = ask()
    return left, time.monotonic() - started


def _open_requests(client, replica: str) -> int:
    """What the replica still has to answer: its own queue (every router's requests), or, where it
    does not say, what this router has open there."""
    status = client.get("/admin/status")
    for row in status.get("replica_status", []):
        if row["replica"] == replica and "queue" in row:
            return row["queue"]["running"] + row["queue"]["waiting"]
    for row in status.get("replicas", []):
        if row["replica"] == replica:
            return row["open"]
    return 0  # it has left the fleet: nothing of it is open


@fleet_app.command("drain")
def drain(ctx: typer.Context, replica: str = typer.Argument(..., help=REPLICA_HELP),
          wait: float = typer.Option(0.0, "--wait", help="Wait up to this many seconds for its open requests to "
                                     "answer; exit 3 if some are still open then."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Send a replica no new request; those it is serving answer as usual.

    The replica is told too, so every router in front of it leaves it out. With --wait it returns
    once the replica has nothing running or waiting: then it can be stopped without failing a
    request.

    Example: kvctl fleet drain /run/kvd-1/kvd.sock --wait 120 && systemctl restart kvd@1
    """
    if not wait >= 0:
        raise UserError(f"wait: must be >= 0 seconds, got {wait!r}")
    client = client_for(ctx)
    data = client.post("/router/drain", {"replica": replica, "drain": True})
    there = data.get("at_replica") or {}
    if "running" in there:  # the replica's own queue: every router's requests
        data["open"] = there["running"] + there["waiting"]
    data["open"], waited = wait_until_idle(data["open"], lambda: _open_requests(client, replica), wait)
    data["waited_seconds"] = round(waited, 3) if wait > 0 else None

    def render(d):
        tail = (f"; {d['open']} open after {d['waited_seconds']:.1f} s" if d["waited_seconds"] is not None
                else f"; {d['open']} open")
        done = "; none open: it can be stopped" if d["open"] == 0 else ""
        Console().print(f"drained {d['replica']}: no new request goes there" + (done or tail), highlight=False,
                        soft_wrap=True)
        if "error" in (d.get("at_replica") or {}):
            Console(stderr=True).print(f"the replica was not told (other routers still send there): "
                                       f"{d['at_replica']['error']}", highlight=False, soft_wrap=True)
    emit(data, as_json, render)
    if wait > 0 and data["open"] > 0:
        raise typer.Exit(3)


@fleet_app.command("resume")
def resume(ctx: typer.Context, replica: str = typer.Argument(..., help=REPLICA_HELP),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Let a drained replica take new requests again.

    Example: kvctl fleet resume /run/kvd-1/kvd.sock
    """
    data = client_for(ctx).post("/router/drain", {"replica": replica, "drain": False})
    emit(data, as_json, lambda d: Console().print(f"resumed {d['replica']}: it takes new requests again",
                                                  highlight=False, soft_wrap=True))


def drain_daemon(ctx: typer.Context,
                 wait: float = typer.Option(0.0, "--wait", help="Wait up to this many seconds for what runs and "
                                            "waits there to finish; exit 3 if some is left then."),
                 as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Take no new completion at this kvd; what runs and waits finishes.

    /readyz answers 503 and route-facts say so, so every router in front of it (and a load
    balancer's readiness check) leaves it out. `kvctl resume` takes completions again.

    Example: kvctl drain --wait 120 && systemctl restart kvd
    """
    if not wait >= 0:
        raise UserError(f"wait: must be >= 0 seconds, got {wait!r}")
    client = client_for(ctx)
    data = client.post("/admin/drain", {"drain": True})

    def left_here() -> int:
        data.update(client.get("/admin/status")["queue"])
        return data["running"] + data["waiting"]

    left, _ = wait_until_idle(data["running"] + data["waiting"], left_here, wait)

    def render(d):
        Console().print("draining: no new completion is taken here; "
                        + ("nothing running or waiting: it can be stopped" if not left
                           else f"{d['running']} running, {d['waiting']} waiting"), highlight=False)
    emit({k: data[k] for k in ("draining", "running", "waiting")}, as_json, render)
    if wait > 0 and left:
        raise typer.Exit(3)


def resume_daemon(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Take completions again after `kvctl drain`.

    Example: kvctl resume
    """
    data = client_for(ctx).post("/admin/drain", {"drain": False})
    emit(data, as_json, lambda d: Console().print("taking completions again", highlight=False))


@fleet_app.command("sync-pins")
def sync_pins(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Give every replica the fleet's pins it lacks (a replica that joined, or was down).

    Pins are block keys: each copy pins the same keys, brings up what the replica's lower tiers
    hold of them (a shared Redis), and pins the rest as the prefix is computed there. A replica
    serving another model or cache format is left out. Exit 3 when some replica could not be
    listed or take a copy.

    Example: kvctl fleet sync-pins   # kvctl --socket ROUTER_SOCKET, or KVD_SOCKET
    """
    data = client_for(ctx).post("/router/sync-pins", {})

    def render(d):
        console = Console()
        for pin in d["pins"]:
            copied = ", ".join(f"{name} ({c['cached_blocks']} cached)" for name, c in pin["copied_to"].items())
            console.print(f"{pin['pin_id']} (tenant {escape(pin['tenant'])}, {pin['blocks']} blocks): "
                          + (f"copied to {escape(copied)}" if copied else "on every replica it can be"),
                          highlight=False, soft_wrap=True)
            for name, why in pin["left_out"].items():
                console.print(f"  {escape(name)}: {escape(why)}", highlight=False, soft_wrap=True)
        console.print(f"{d['copied']} copies made, {len(d['pins'])} pins in the fleet", highlight=False)
        if d.get("message"):
            Console(stderr=True).print(f"[yellow]{escape(d['message'])}[/yellow]")
    emit(data, as_json, render)
    if data.get("result") == "partial":
        raise typer.Exit(3)

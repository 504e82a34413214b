"""kvctl profile: where the engine's time goes, from torch.profiler over kvd's engine thread
(daemon/server/engine_profile.py). kvd records and writes the trace; kvctl asks for it and shows
the ops that took the most time."""

from __future__ import annotations

import time

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.text import Text

from .command_kit import client_for, emit
from .errors import UserError
from .tables import compact_table, size

MAX_SECONDS = 600.0  # kvd's own limits (engine_profile.MAX_SECONDS_LIMIT, MAX_STEPS_LIMIT); kvctl does not
MAX_STEPS = 10_000  # import the daemon
GRACE_S = 5.0  # kvd stops a profile by itself this long after kvctl should have (kvctl killed meanwhile)
LOOK_EVERY_S = 0.5  # how often kvctl profile asks whether the profile stopped by itself (its steps)
STEPS_HELP = ("Stop after this many engine steps, if sooner: the trace grows with the steps (a busy CPU "
              "engine's 450 steps are about 60 MiB of JSON).")

profile_app = typer.Typer(no_args_is_help=False)


@profile_app.callback(invoke_without_command=True)
def profile(ctx: typer.Context,
            seconds: float = typer.Option(10.0, "--seconds", help="How long to record; Ctrl-C stops it sooner."),
            steps: int = typer.Option(200, "--steps", help=STEPS_HELP),
            top: int = typer.Option(15, "--top", help="Ops listed, the most self time first."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Record kvd's engine thread with torch.profiler: the ops that took the most time, and a trace.

    kvd starts and stops the profiler between steps and writes a Chrome trace under its state
    directory (profiles/, the newest 10 kept); open it in https://ui.perfetto.dev. Each step shows
    as kvd.step, whose own time is the engine's Python around its ops. A profile slows the steps
    it records, and its trace grows with them: record seconds and hundreds of steps, not hours.

    Example: kvctl profile --seconds 30 --steps 500
    """
    if ctx.invoked_subcommand is not None:
        return
    if not 0 < seconds <= MAX_SECONDS - GRACE_S:
        raise UserError(f"--seconds: must be more than 0 and at most {MAX_SECONDS - GRACE_S:g}, got {seconds:g}")
    _check_steps(steps)
    client = client_for(ctx)
    client.post("/admin/profile/start", {"max_seconds": seconds + GRACE_S, "max_steps": steps})
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(min(LOOK_EVERY_S, max(deadline - time.monotonic(), 0)))
            if not _still_running(client.get("/admin/profile")):
                break  # it stopped by itself: its steps
    except KeyboardInterrupt:
        pass  # stop now: what was recorded so far
    show_written(client.post("/admin/profile/stop", {}), top, as_json)  # (or the one that stopped by itself)


def _check_steps(steps: int) -> None:
    if not 0 < steps <= MAX_STEPS:
        raise UserError(f"--steps: must be from 1 to {MAX_STEPS:,}, got {steps}")


def _still_running(state: dict) -> bool:
    """Whether a profile runs (at kvd router: on any replica)."""
    if "replicas" in state:
        return any((row.get("report") or {}).get("running") for row in state["replicas"])
    return bool(state.get("running"))


@profile_app.command("start")
def start(ctx: typer.Context,
          max_seconds: float = typer.Option(30.0, "--max-seconds", help="kvd stops it by itself after this long."),
          steps: int = typer.Option(200, "--steps", help=STEPS_HELP),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Start recording kvd's engine thread; `kvctl profile stop` ends it (a script's start and stop).

    Example: kvctl profile start --max-seconds 120
    """
    if not 0 < max_seconds <= MAX_SECONDS:
        raise UserError(f"--max-seconds: must be more than 0 and at most {MAX_SECONDS:g}, got {max_seconds:g}")
    _check_steps(steps)
    data = client_for(ctx).post("/admin/profile/start", {"max_seconds": max_seconds, "max_steps": steps})

    def render(d: dict) -> None:
        count = d.get("replicas_profiled", 0)
        where = f" on {count} replica{'s' if count != 1 else ''}" if "replicas" in d else ""
        Console().print(f"profiling kvd's engine thread{where}, for at most {d['max_seconds']:g} s and "
                        f"{d['max_steps']:,} steps: `kvctl profile stop` ends it", highlight=False)
        _partial_line(d)
    emit(data, as_json, render)
    _exit_if_partial(data)


@profile_app.command("stop")
def stop(ctx: typer.Context, top: int = typer.Option(15, "--top", help="Ops listed, the most self time first."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Stop the running profile: where kvd wrote its trace, and the ops that took the most time.

    Example: kvctl profile stop --top 30
    """
    show_written(client_for(ctx).post("/admin/profile/stop", {}), top, as_json)


@profile_app.command("show")
def show(ctx: typer.Context, top: int = typer.Option(15, "--top", help="Ops listed, the most self time first."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The profile running now, if one is, and the latest one kvd wrote.

    Example: kvctl profile show
    """
    def one(d: dict) -> list:
        running, parts = d["running"], []
        if running:
            parts.append(Text(f"a profile is running: started by {running['by']}, {running['steps']:,} steps so "
                              f"far, for at most {running['max_seconds']:g} s and {running['max_steps']:,} steps"))
        if d["latest"]:
            parts.append(profile_view(d["latest"], top))
        elif not running:
            parts.append(Text(f"no profile since kvd started (they are written to {d['folder']})"))
        return parts

    def render(d: dict) -> None:  # at kvd router, each replica's under its name
        rows = d.get("replicas")
        Console().print(Group(*one(d)) if rows is None else Group(*(
            part for row in rows for part in [Text(f"replica {row['replica']}", style="bold"),
                                              *(one(row["report"]) if "report" in row else
                                                [Text(f"no answer: {row.get('error')}", style="yellow")]),
                                              Text("")])))
    emit(client_for(ctx).get("/admin/profile"), as_json, render)


def show_written(d: dict, top: int, as_json: bool) -> None:
    """A stop's answer: the profile written; at kvd router, each replica's under its name (exit 3
    when some replica wrote none)."""
    def render(d: dict) -> None:
        if "replicas" not in d:
            Console().print(profile_view(d, top))
            return
        for row in d["replicas"]:
            Console().print(Text(f"replica {row['replica']}", style="bold"))
            Console().print(profile_view(row, top) if row["status"] == 200 else
                            Text(f"no profile: {_said(row)}", style="yellow"))
        _partial_line(d)
    emit(d, as_json, render)
    _exit_if_partial(d)


def _said(row: dict) -> str:
    error = row.get("error")
    return error.get("message", "") if isinstance(error, dict) else str(error)


def _partial_line(d: dict) -> None:
    if d.get("result") == "partial" and d.get("message"):
        Console(stderr=True).print(Text(d["message"], style="yellow"), soft_wrap=True)


def _exit_if_partial(d: dict) -> None:
    if d.get("result") == "partial":
        raise typer.Exit(3)


def profile_view(d: dict, top: int = 15) -> Group:
    """A profile's answer: where its trace is, then its CPU ops, the most self time first, and on a
    GPU its kernels, the most GPU time first."""
    steps = f"{d['steps']:,} step{'s' if d['steps'] != 1 else ''}"
    parts: list = [Text(f"profile of {d['seconds']:.1f} s, {steps} ({d['device']}), stopped by {d['stopped_by']}; "
                        f"its trace ({size(d['bytes'])}):\n{d['path']}")]
    if not d["top"]:
        return Group(*parts, Text("no op was recorded (no step ran)"))
    total = d.get("self_ms_total") or 0.0
    ops = compact_table("op", "calls", "self CPU ms", "CPU ms", "self share")
    for row in _first(d["top"], top):
        ops.add_row(escape(row["name"]), f"{row['calls']:,}", f"{row['self_cpu_ms']:,.1f}", f"{row['cpu_ms']:,.1f}",
                    f"{row['self_cpu_ms'] / total if total else 0.0:.1%}")
    parts.append(_figures_right(ops))
    kernels = d.get("top_device")
    if kernels:
        total = d.get("device_ms_total") or 0.0
        table = compact_table("GPU kernel", "calls", "GPU ms", "share")
        for row in _first(kernels, top):
            table.add_row(escape(row["name"]), f"{row['calls']:,}", f"{row['device_ms']:,.1f}",
                          f"{row['device_ms'] / total if total else 0.0:.1%}")
        parts.append(_figures_right(table))
    parts.append(Text("self share: of every op's own CPU time (less the ops inside it); kvd.step's own time is the "
                      "engine's Python around its ops. Open the trace in https://ui.perfetto.dev"))
    return Group(*parts)


def _first(rows: list[dict], top: int) -> list[dict]:
    return rows[:top] if top > 0 else rows


def _figures_right(table):
    for column in table.columns[1:]:
        column.justify = "right"
    table.columns[0].overflow = "fold"
    return table

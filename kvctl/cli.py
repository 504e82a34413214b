"""kvctl: see and steer the KV cache of a kvd daemon, and plan cache settings offline.

Start-up imports stay light (no torch): commands import what they need when run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from kvctl import __version__

from . import ops, records_cmd, status_view
from .bench_kernels import kernels_command
from .bench_replay import replay_command
from .bench_sampler import sampler_command
from .bench_serve import serve_command
from .bench_batch import batch_command
from .bench_speculation import speculation_command
from .bench_tiers import tiers_command as tiers_bench_command
from .bench_window import window_command
from .calibrate_cmd import calibrate_command
from .capacity_cmd import capacity_command
from .command_kit import client_for
from . import batches_cmd, events_cmd, files_cmd, requests_cmd, responses_cmd, route_cmd, tiers_cmd, webhooks_cmd
from .fleet_cmd import drain_daemon, fleet_app, resume_daemon
from .profile_cmd import profile_app
from .rollout_cmd import rollout_app
from .check_cmd import check
from .hit_curve_cmd import hit_curve
from .sleep_cmd import sleep_daemon, wake_daemon
from .weights_cmd import update_weights
from .errors import UserError
from .help_text import keep_names_whole, reflow_help
from .outputs import is_trace, refuse_clobber
from .tables import seconds

app = typer.Typer(help="Operate the KV cache of LLM serving: inspect, steer, replay, benchmark.",
                  no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
bench = typer.Typer(help="Benchmarks that print figures beside a baseline from the same run.",
                    no_args_is_help=True)
trace_app = typer.Typer(help="Request traces in the Mooncake JSONL format.", no_args_is_help=True)
app.add_typer(bench, name="bench")
app.add_typer(trace_app, name="trace")
bench.command("replay")(replay_command)
bench.command("kernels")(kernels_command)
bench.command("serve")(serve_command)
bench.command("tiers")(tiers_bench_command)
bench.command("speculation")(speculation_command)
bench.command("batch")(batch_command)
bench.command("window")(window_command)
bench.command("sampler")(sampler_command)
for _command in (status_view.status, ops.prefixes, ops.pin, ops.pins, ops.unpin, ops.evict, ops.explain, ops.audit):
    app.command(_command.__name__)(_command)
app.add_typer(ops.config_app, name="config")
app.command("capacity")(capacity_command)
app.command("check")(check)
app.command("hit-curve")(hit_curve)
app.add_typer(records_cmd.adr_app, name="adr")
app.add_typer(records_cmd.db_app, name="db")
app.add_typer(rollout_app, name="rollout")
app.command("calibrate")(calibrate_command)
app.add_typer(tiers_cmd.tiers_app, name="tiers")
app.add_typer(responses_cmd.responses_app, name="responses")
app.add_typer(batches_cmd.batches_app, name="batches")
app.add_typer(files_cmd.files_app, name="files")
app.add_typer(webhooks_cmd.webhooks_app, name="webhooks")
app.command("swap")(tiers_cmd.swap)
app.command("events")(events_cmd.events)
app.command("route")(route_cmd.route)
app.add_typer(fleet_app, name="fleet")
app.command("drain")(drain_daemon)
app.command("resume")(resume_daemon)
app.command("sleep")(sleep_daemon)
app.command("wake")(wake_daemon)
app.command("update-weights")(update_weights)
app.command("requests")(requests_cmd.requests)
app.command("cancel")(requests_cmd.cancel)
app.command("tenants")(requests_cmd.tenants)
app.add_typer(profile_app, name="profile")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(ctx: typer.Context,
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit."),
          socket: Optional[str] = typer.Option(None, "--socket", help="kvd's Unix socket (KVD_SOCKET)."),
          url: Optional[str] = typer.Option(None, "--url", help="kvd over TCP (KVD_URL)."),
          token_file: Optional[str] = typer.Option(None, "--token-file",
                                                   help="Bearer token for --url (KVD_TOKEN_FILE)."),
          ca_file: Optional[str] = typer.Option(None, "--ca-file", help="CAs that an https --url's certificate is "
                                                "checked against (KVD_CA_FILE; default: the system's)."),
          client_cert: Optional[str] = typer.Option(None, "--client-cert", help="kvctl's certificate and key "
                                                    "(PEM) for a kvd that asks for one (KVD_CLIENT_CERT).")) -> None:
    """Operate the KV cache of LLM serving."""
    ctx.obj = {"socket": socket, "url": url, "token_file": token_file, "ca_file": ca_file, "client_cert": client_cert}


@trace_app.command("generate")
def trace_generate(
    out: Path = typer.Argument(..., help="Where to write the JSONL trace."),
    requests: int = typer.Option(600, help="Number of requests."),
    seed: int = typer.Option(0, help="Random seed; equal seeds give equal traces."),
    noisy_fraction: float = typer.Option(0.0, help="Two tenants: this fraction of requests are tenant "
                                         "'noisy''s one-off documents, the rest tenant 'quiet''s mix."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Write a synthetic trace (shared system prompts, multi-turn chats, one-off documents).

    Example: kvctl trace generate /tmp/demo.jsonl --requests 1000 --seed 7
    """
    from kvctl.daemon.replay.trace import generate_trace, write_trace

    if requests < 1:
        raise UserError(f"requests: must be >= 1, got {requests}")
    if not 0 <= noisy_fraction < 1:
        raise UserError(f"noisy_fraction: must be in [0, 1), got {noisy_fraction}")
    refuse_clobber(out, "out", is_trace, "a trace")
    trace = generate_trace(requests, seed=seed, noisy_fraction=noisy_fraction)
    write_trace(out, trace)
    if as_json:
        typer.echo(json.dumps({"path": str(out), "requests": len(trace), "seed": seed,
                               "input_tokens": sum(r.input_length for r in trace),
                               "output_tokens": sum(r.output_length for r in trace),
                               "seconds": trace[-1].timestamp_ms / 1000.0}))
        return
    typer.echo(f"wrote {requests} requests to {out}")


@trace_app.command("stats")
def trace_stats_command(
    trace: Path = typer.Argument(..., help="A Mooncake-format JSONL trace (kvctl trace save or generate writes one)."),
    block_size: int = typer.Option(16, help="Block size in tokens for the reuse figures."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """What a trace holds: its shape, its reuse and working set, its most shared openings, and how
    kvd served it (a trace kvd saved).

    Example: kvctl trace stats /tmp/today.jsonl
    """
    from rich.console import Console
    from rich.table import Table

    from kvctl.daemon.cache.keys import validate_block_size
    from kvctl.daemon.replay.trace import read_trace

    from .trace_stats import coarse_ids, stats_lines, trace_stats

    try:
        validate_block_size(block_size)
        figures = trace_stats(read_trace(trace), block_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(figures))
        return
    table = Table(title=str(trace), show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    for label, value in stats_lines(figures):
        table.add_row(label, value)
    Console().print(table)
    note = coarse_ids(figures["block_tokens"], (figures["served"] or {}).get("cached_token_ratio"),
                      figures["unbounded_hit_ratio"])
    if note:
        Console(stderr=True).print(f"[yellow]{note}[/yellow]")


@trace_app.command("save")
def trace_save(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="Where to write the JSONL trace."),
    last: Optional[int] = typer.Option(None, help="Only the last N requests to arrive (default: all kvd keeps)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Save the requests kvd served lately as a Mooncake trace, to replay your own traffic.

    kvd keeps its last finished requests (trace_requests, 10,000 by default; turned-away ones
    too): arrivals, prompt and output lengths, tenants, how kvd served each (times, cached tokens),
    and chained ids of 512-token prompt blocks (finer with trace_block_tokens; keyed hashes
    numbered from 0; never tokens or text). Replay the file to choose a block size,
    an eviction policy or tier sizes for this traffic.

    At kvd router, the fleet's trace: every replica's requests in the order the router routed them
    (on its clock), for `kvctl bench replay --replicas N` to compare routing policies. The replicas
    must share one trace_key_file, so that one prompt has one id on all of them. A request one
    replica turned away and the router sent to another is one line (its last try). A request no
    replica took in (none reachable, or each stopping: 503) is in no line; it says how many fell in
    the trace's span. Exit status 3 when a replica was left out.

    Example: kvctl trace save /tmp/today.jsonl && kvctl bench replay /tmp/today.jsonl
    """
    from kvctl.daemon.replay.trace import parse_request, write_trace

    if last is not None and last < 1:
        raise UserError(f"last: must be >= 1, got {last}")
    refuse_clobber(out, "out", is_trace, "a trace")
    answer = client_for(ctx).get("/admin/trace", last=last)
    untraced = answer.get("router_untraced", 0)  # at kvd router: requests no replica took in
    if not answer["requests"]:
        raise UserError("trace: kvd has finished no request since it started; nothing to save"
                        + (f" ({untraced:,} request{'s' if untraced != 1 else ''} no replica took in, "
                           f"none reachable or taking requests)" if untraced else ""))
    trace = [parse_request(line, f"kvd's trace line {i + 1}") for i, line in enumerate(answer["requests"])]
    write_trace(out, trace)
    figures = {"path": str(out), "requests": len(trace), "capacity": answer["capacity"], "observed": answer["observed"],
               "input_tokens": sum(r.input_length for r in trace),
               "output_tokens": sum(r.output_length for r in trace),
               "seconds": trace[-1].timestamp_ms / 1000.0,
               "tenants": sorted({r.tenant or "default" for r in trace})}
    fleet = answer.get("replicas")  # at kvd router: the replicas whose requests it holds
    if fleet is not None:
        figures["replicas"] = [row["replica"] for row in fleet if row["status"] == 200]
        figures["result"] = answer["result"]
        figures["retries_merged"] = answer.get("retries_merged", 0)
        figures["router_untraced"] = untraced
        if answer.get("message"):
            figures["message"] = answer["message"]
    if as_json:
        typer.echo(json.dumps(figures))
    else:
        merged = figures.get("retries_merged", 0)  # a fleet's replicas count each try they saw
        earlier = figures["observed"] - len(trace) - merged
        typer.echo(f"wrote {len(trace):,} requests over {seconds(figures['seconds'])} to {out} "
                   f"({figures['input_tokens']:,} prompt tokens, {len(figures['tenants'])} "
                   f"tenant{'s' if len(figures['tenants']) != 1 else ''}"
                   + (f", {len(figures['replicas'])} replica{'s' if len(figures['replicas']) != 1 else ''}"
                      if fleet is not None else "") + ")"
                   + (f"; {merged:,} earlier tr{'ies' if merged != 1 else 'y'} of requests the router sent on to "
                      f"another replica left out" if merged > 0 else "")
                   + (f"; {earlier:,} earlier requests are not in it" if earlier > 0 else "")
                   + (f"; {untraced:,} request{'s' if untraced != 1 else ''} no replica took in (none "
                      f"reachable or taking requests) {'are' if untraced != 1 else 'is'} not in it" if untraced else ""))
        ops.fleet_message(answer)
    if answer.get("result") == "partial":
        raise typer.Exit(3)


reflow_help(app)  # after every command is registered
keep_names_whole()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: bad input becomes one line on stderr and exit status 2."""
    try:
        app(args=argv, prog_name="kvctl")
    except (UserError, ValueError, OSError) as exc:  # library validation names field and value
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

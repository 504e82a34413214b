"""kvctl tiers and kvctl swap: what each memory tier holds, and moving a prefix between them."""

from __future__ import annotations

import math
import time
from typing import Optional

import typer
from rich.console import Console, Group
from rich.text import Text

from .errors import UserError
from .command_kit import client_for, emit, show_or_watch
from .sizes import positive_size
from .tables import by_replica, compact_table, seconds, size


def render_tiers(d: dict, console: Console | None = None) -> None:
    (console or Console()).print(tiers_view(d))


def tiers_view(d: dict) -> Group:
    """The tiers table and the lines under it, as one renderable (`kvctl tiers [--watch]`); at
    kvd router, each replica's under its name."""
    if "replicas" in d:
        return by_replica(d["replicas"], tiers_view)
    parts: list = []

    def say(line: str) -> None:  # plain text, never markup: a line may quote a path or a reason
        parts.append(Text(line))

    if not d["configured"]:
        say("no lower tier configured (tiers: in the config, or --host-cache-bytes, "
            "--disk-cache-bytes, --remote-url)")
    dev = d["device"]
    device_hits = d["tokens"]["hit"] - d["tokens"]["restored"]
    columns = {"device": {"used": size(dev["used_bytes"]), "capacity": size(dev["capacity_bytes"]),
                          "blocks": f"{dev['blocks']:,}", "hit tokens": f"{device_hits:,}", "health": "ok"}}
    for name, t in d["tiers"].items():
        style = "green" if t["health"] == "ok" else "red"
        columns[name] = {"used": size(t["used_bytes"]),
                         "capacity": "no budget" if t["capacity_bytes"] is None else size(t["capacity_bytes"]),
                         "blocks": f"{t['blocks']:,}", "hit tokens": f"{t['hit_tokens']:,}",
                         "bytes in": size(t["bytes_in"]), "bytes out": size(t["bytes_out"]),
                         "read/s": size(t["read_bytes_per_second"]), "write/s": size(t["write_bytes_per_second"]),
                         "checksum fails": f"{t['checksum_failures']:,}", "errors": f"{t['errors']:,}",
                         "health": f"[{style}]{t['health']}[/{style}]"}
        if "share_evictions" in t:
            columns[name]["share evictions"] = f"{t['share_evictions']:,}"
        if t.get("set_aside_bytes"):
            columns[name]["set aside"] = size(t["set_aside_bytes"])
        if t.get("vanished_segments"):  # deleted from the folder by something other than kvd
            columns[name]["vanished segments"] = f"{t['vanished_segments']:,}"
        if t.get("degraded_reason"):
            columns[name]["why"] = t["degraded_reason"]
    # one column per tier, one row per figure: four tiers fit an 80-column terminal
    retained = d.get("retained_blocks")  # (requests asking prompt_cache_retention "24h": written down as they end)
    title = f"write policy: {d.get('write_policy') or '-'}" + (
        f"; {retained:,} blocks written down for 24h retention" if retained else "")
    table = compact_table("", *columns, title=title)
    for column in table.columns[1:]:
        column.justify = "right"
    figures = ["used", "set aside", "capacity", "blocks", "hit tokens", "bytes in", "bytes out", "read/s", "write/s",
               "share evictions", "checksum fails", "errors", "health", "why"]
    for figure in figures:
        if any(figure in c for c in columns.values()):
            table.add_row(figure, *(c.get(figure, "") for c in columns.values()))
    parts.append(table)
    tokens = d["tokens"]
    say(f"prompt tokens {tokens['prompt']:,}: {tokens['hit']:,} from cache "
        f"({tokens['restored']:,} restored from lower tiers), {tokens['recomputed']:,} recomputed "
        "after preemption")
    if d.get("moved_bytes"):
        say("moved: " + ", ".join(f"{k} {size(v)}" for k, v in d["moved_bytes"].items()))
    if d.get("break_even_tokens"):
        measured = d.get("break_even_measured") or {}
        say("restore beats recompute from: " + ", ".join(
            f"{k} {'never' if v is None or math.isinf(v) else f'{v:,.0f} tokens'}"
            + ("" if measured.get(k, True) else " (assumed rates: nothing measured yet)")
            for k, v in d["break_even_tokens"].items()))
    if d.get("prefetch") and ("disk" in d["tiers"] or "remote" in d["tiers"]):
        say(prefetch_line(d["prefetch"]))
    if d.get("compress") and ("disk" in d["tiers"] or "remote" in d["tiers"]):
        say(compress_line(d["compress"]))
    disk_room = filesystem_line(d["tiers"].get("disk") or {})
    if disk_room:
        say(disk_room)
    aside = (d["tiers"].get("disk") or {}).get("set_aside")
    if aside:
        say("disk set aside: " + "; ".join(_aside_group(g) for g in aside))
        if any(g.get("model_revision") for g in aside):
            say("kvctl evict --model-revision REV deletes a revision's blocks from disk and the shared Redis")
    if d.get("disk_scan"):
        s = d["disk_scan"]
        back = f" ({s['readmitted']} segments of them back from a rollback)" if s.get("readmitted") else ""
        dropped = f", {s['set_aside_dropped']} set aside before (for room)" if s.get("set_aside_dropped") else ""
        took = f" in {seconds(s['seconds'])}" if s.get("seconds") is not None else ""
        say(f"disk at start: {s['blocks']:,} blocks re-indexed{took}{back}; set aside {s['corrupt']} corrupt, "
            f"{s['foreign']} foreign; removed {s['torn']} unfinished{dropped}")
    if d.get("verify"):
        say(verify_line(d["verify"]))
    return Group(*parts)


def filesystem_line(disk: dict) -> str | None:
    """A line when the disk tier's filesystem, not its bytes, bounds it (or has evicted from it)."""
    bound, evicted = disk.get("filesystem_bound"), disk.get("filesystem_evictions") or 0
    if bound is None and not evicted:
        return None
    line = (f"disk: its filesystem has room for {size(bound['room_bytes'])} more (some is kept free for other "
            f"files), so the tier holds at most {size(bound['holds_at_most_bytes'])} of its "
            f"{size(disk['capacity_bytes'])}" if bound else "disk: its filesystem ran short of space")
    return line + (f"; {evicted:,} blocks evicted for the filesystem" if evicted else "")


def prefetch_line(p: dict) -> str:
    """How requests waited for their prefixes from disk or Redis, in one line."""
    policy = p["policy"]
    if policy == "timeout":
        per_1k = p["timeout_per_1k_tokens_seconds"]
        policy += f" {p['timeout_seconds']:g} s" + (f" + {per_1k:g} s per 1k tokens" if per_1k else "")
    counts = p["outcomes"]
    ended = ", ".join(f"{counts[k]:,} {label}" for k, label in (
        ("complete", "complete"), ("timeout", "timed out"), ("best_effort", "not waited for"),
        ("cancelled", "cancelled"), ("miss", "found nothing")) if counts.get(k))
    waits = p["wait_seconds"]
    line = f"prefetch ({policy}): " + (ended or "none yet")
    if waits["count"]:
        line += (f"; {p['staged_blocks']:,} blocks staged by admission; waited p50 {seconds(waits['p50'])}, "
                 f"p95 {seconds(waits['p95'])}, max {seconds(waits['max'])}")
    if p["fetching_now"]:
        line += f"; {p['fetching_now']} waiting for a fetch now"
    return line


def compress_line(per_tier: dict) -> str:
    """How disk and Redis store a block, in one line: `{tier: {"setting", "codec", ...}}` as
    /admin/tiers reports it."""
    names = {"disk": "disk", "remote": "Redis"}
    entries = list(per_tier.items())
    if len(entries) > 1 and all(e == entries[0][1] for _, e in entries):
        entries = [(" and ".join(names[t] for t in per_tier), entries[0][1])]
    else:
        entries = [(names[t], e) for t, e in entries]
    phrases = []
    for subject, c in entries:
        verb = "store" if " and " in subject else "stores"
        if c["codec"] == "none":
            phrase = f"{subject} {verb} blocks as the device does ({size(c['block_bytes'])} a block)"
            if c["setting"] != "none":
                phrase += f"; compress {c['setting']} is not applied: {c['inactive_reason']}"
        else:
            phrase = (f"{subject} {verb} blocks compressed ({c['codec']}, lossy): {size(c['stored_block_bytes'])} a "
                      f"block instead of {size(c['block_bytes'])} ({c['stored_block_bytes'] / c['block_bytes']:.2f})")
        phrases.append(phrase)
    line = "; ".join(phrases)
    if any(c["codec"] != "none" for c in per_tier.values()):
        line += "; blocks stored before stay as they were"
    return line


def _aside_group(g: dict) -> str:
    """One kind of set-aside segment: `12.0 MiB in 3 segments of model 3fa2c1d09e8b7a66 (fp8_e4m3, scales cal-3)`."""
    head = f"{size(g['bytes'])} in {g['segments']} segment{'s' if g['segments'] != 1 else ''}"
    if g["kind"] == "corrupt":
        return head + " corrupt"
    if not g.get("model_revision"):
        return head + (f" of space {g['space']} (no record of it)" if g.get("space") else " of an older format")
    detail = ", ".join(filter(None, [g.get("cache_dtype"), f"block size {g['block_size']}" if g.get("block_size") else "",
                                     f"scales {g['scale_version']}" if g.get("scale_version") else ""]))
    return head + f" of model {g['model_revision'][:16]}" + (f" ({detail})" if detail else "")


tiers_app = typer.Typer(no_args_is_help=False)


@tiers_app.callback(invoke_without_command=True)
def tiers(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Each memory tier: capacity, use, hit tokens, bytes moved, transfer rates, checksum failures, health.

    At kvd router, each replica's tiers under its name.

    Example: kvctl tiers --watch
    """
    if ctx.invoked_subcommand is not None:
        return
    client = client_for(ctx)
    show_or_watch(lambda: client.get("/admin/tiers"), tiers_view, watch, as_json, for_json=_finite)


@tiers_app.command("verify")
def verify(ctx: typer.Context,
           rate: Optional[str] = typer.Option(None, "--rate", help="Read at most this much a second (default "
                                              "256MiB; max: as fast as the disk and a core allow, which takes CPU "
                                              "from serving)."),
           wait: bool = typer.Option(False, "--wait", help="Wait for the end, showing progress; exit status 1 "
                                     "when a block failed or a segment could not be read."),
           stop: bool = typer.Option(False, "--stop", help="Stop the verification that is running."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Read the disk tier through and verify every block's checksum, in the background.

    kvd's start reads only the blocks' headers, and checks a block's checksum when it restores it.
    This checks them all now; a block that fails is dropped (a miss, never served). kvd keeps serving.

    At kvd router, every replica verifies its own disk (exit status 3 when some replica did not).

    Example: kvctl tiers verify --rate 200MiB --wait
    """
    client = client_for(ctx)
    if stop:
        if rate is not None or wait:
            raise UserError("--stop: give it alone (not with --rate or --wait)")
        answer = client.delete("/admin/tiers/verify")
    else:
        body = {} if rate is None else {"unpaced": True} if rate == "max" else {"rate": positive_size("rate", rate, "a size a second: 200MiB, 1GiB; or max")}
        answer = client.post("/admin/tiers/verify", body)
    fleet = "replicas" in answer  # kvd router: each replica's run in its row
    if wait:
        answer = _wait_for_fleet(client, answer, as_json) if fleet else {"verify": _wait_for_verify(client, as_json)}
    emit(answer, as_json, lambda d: typer.echo(verify_text(d)))
    runs = [row["verify"] for row in answer["replicas"] if row.get("verify")] if fleet else [answer["verify"]]
    if wait and any(run["bad_blocks"] or run["unreadable_segments"] or run["state"] == "failed" for run in runs):
        raise typer.Exit(1)
    if fleet and (answer.get("result") == "partial" or len(runs) < len(answer["replicas"])):
        raise typer.Exit(3)  # a replica refused, was not reached, or stopped answering while waited for


def _poll_until_done(poll, quiet: bool, interval: float, sleep) -> dict:
    """Call `poll()` -> (result, a progress line while the run goes on, else None) until the run
    ends; the progress stays on one stderr line, ended before the result is printed."""
    shown = False
    while True:
        result, progress = poll()
        if progress is None:
            if shown:
                typer.echo("", err=True)
            return result
        if not quiet:
            typer.echo("\r" + progress, nl=False, err=True)
            shown = True
        sleep(interval)


def _wait_for_verify(client, quiet: bool, interval: float = 0.5, sleep=time.sleep) -> dict:
    """Poll kvd until the verification ends; its last report. Progress goes to stderr."""
    def poll():
        run = client.get("/admin/tiers").get("verify")
        if run is None:
            raise UserError("kvd has no disk verification to wait for (did kvd restart?)")
        return run, verify_line(run) if run["state"] == "running" else None
    return _poll_until_done(poll, quiet, interval, sleep)


def _wait_for_fleet(client, started: dict, quiet: bool, interval: float = 0.5, sleep=time.sleep) -> dict:
    """At kvd router: poll until the run of every replica that began one ends; the rows as
    `started` had them, each that began with its last report (None: the replica stopped answering)."""
    rows = [dict(row) for row in started["replicas"]]
    waiting = {row["replica"] for row in rows if row.get("verify")}

    def poll():
        reports = {row["replica"]: (row.get("report") or {}).get("verify")
                   for row in client.get("/admin/tiers")["replicas"]}
        for row in rows:
            if row["replica"] in waiting:
                row["verify"] = reports.get(row["replica"])
        running = [row for row in rows if row["replica"] in waiting and row["verify"] and
                   row["verify"]["state"] == "running"]
        if not running:
            return {**started, "replicas": rows}, None
        done = sum(r["verify"]["segments_done"] for r in rows if r.get("verify"))
        total = sum(r["verify"]["segments_total"] for r in rows if r.get("verify"))
        return None, f"disk verify: {len(running)} replicas running, {done:,} of {total:,} segments read"
    return _poll_until_done(poll, quiet, interval, sleep)


def verify_text(answer: dict) -> str:
    """What `kvctl tiers verify` prints: kvd's run, or at kvd router one line per replica."""
    if "replicas" not in answer:
        return verify_line(answer["verify"])
    lines = []
    for row in answer["replicas"]:
        if row.get("verify"):
            lines.append(f"{row['replica']}: {verify_line(row['verify'])}")
        elif row.get("status") == 200:  # it began one, then stopped answering
            lines.append(f"{row['replica']}: no answer while waiting for its verification")
        else:
            error = row.get("error")
            said = error.get("message") if isinstance(error, dict) else error
            lines.append(f"{row['replica']}: " + (f"refused ({said})" if row.get("status") else f"not reached ({said})"))
    return "\n".join(lines)


def verify_line(run: dict) -> str:
    """One line for a disk verification's report (`kvctl tiers verify`, `kvctl tiers`)."""
    done = (f"{run['segments_done']:,} of {run['segments_total']:,} segments, {run['blocks']:,} blocks, "
            f"{size(run['bytes'])} read in {seconds(run['seconds'])}")
    bad, unreadable = run["bad_blocks"], run["unreadable_segments"]
    failed = ("no block failed verification" if not bad else "1 block failed verification and was dropped"
              if bad == 1 else f"{bad:,} blocks failed verification and were dropped")
    if unreadable:
        failed += f"; {unreadable:,} segment{'s' if unreadable > 1 else ''} could not be read"
    paced = f" at most {size(run['rate_bytes_per_second'])}/s" if run.get("rate_bytes_per_second") else ""
    state = run["state"]
    if state == "running":
        return f"disk verify: running{paced} (started by {run['actor']}): {done}; {failed}"
    if state == "stopped":
        state = f"stopped by {run['stopped_by']}" if run.get("stopped_by") else "stopped"
    elif state == "failed":
        state = f"failed ({run['error']})"
    return f"disk verify: {state} (started by {run['actor']}): {done}; {failed}"


def _finite(data: dict) -> dict:
    """An older kvd sent inf for a tier that never beats recomputing, which JSON cannot carry."""
    for report in [data] + [row["report"] for row in data.get("replicas", []) if "report" in row]:
        if "break_even_tokens" in report:
            report["break_even_tokens"] = {k: (None if v is None or math.isinf(v) else v)
                                           for k, v in report["break_even_tokens"].items()}
    return data


def swap(ctx: typer.Context, prefix_id: str = typer.Argument(..., help="Prefix id from `kvctl prefixes`."),
         to: str = typer.Option(..., "--to", help="device, host, disk or remote."),
         copy: bool = typer.Option(False, "--copy", help="Keep the source copies (default: move)."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Move (or copy) a prefix and the prefixes that extend it to one tier, verified.

    It waits for the verified result. To the device, the blocks it extends come up too where
    they are missing.

    Example: kvctl swap 3f9a1c0b2d4e5f60 --to disk
    """
    data = client_for(ctx).post("/admin/swap", {"prefix": prefix_id, "to": to, "copy": copy})

    def render(d):
        ok = d["verified_blocks"] == d["blocks"]
        verb = "copied" if d["copy"] else "moved"
        Console().print(f"{verb} {d['prefix_id']} to {d['to']}: {d['verified_blocks']} of {d['blocks']} "
                        f"blocks verified in {d['seconds'] * 1000:.0f} ms"
                        + ("" if ok else " [yellow](partial)[/yellow]"))
        kept = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in sorted((d.get("kept_on_device") or {}).items()))
        if kept:
            Console().print(f"still on the device too: {kept}")
        if d.get("extended_blocks"):
            Console().print(f"the prefix it extends: {d['extended_on_device']} of {d['extended_blocks']} blocks "
                            "on the device")
    emit(data, as_json, render)
    if data["verified_blocks"] != data["blocks"]:
        raise typer.Exit(3)

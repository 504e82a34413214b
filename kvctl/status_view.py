"""`kvctl status`: one daemon's blocks by state, hits and recomputation, queue, tiers, latency,
start and store, with the block map (`--blocks`); pointed at kvd router, a row per replica
(fleet_status.py).
"""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvctl.daemon.server.block_map import BLOCK_STATES, fold_block_map

from .command_kit import client_for, emit, redraw
from .fleet_status import (PHASE_NAMES, before_load, cohort_text, is_fleet, prompts, render_fleet_status,
                           reservation_text, step_failures_line, store_trouble)
from .gc_status import gc_line
from .hit_curve_cmd import twice_the_cache
from .software_status import software_line
from .tls_status import tls_text
from .gpu_status import gpu_label, gpu_line
from .tables import duration, seconds, size, when

STATE_STYLES = {"free": "grey50", "reserved": "yellow", "active": "green", "shared": "cyan",
                "cached": "blue", "pinned": "magenta"}
MAP_STYLES = {char: STATE_STYLES[state] for char, state in BLOCK_STATES.items()}  # the map's characters


MAP_MAX_CELLS = 2048  # 32 lines of 64: a GPU cache's hundred thousand blocks still fit a screen


# how `kvctl status` words the experts' weights (status_body.experts' "weights")
EXPERT_WEIGHTS = {"mxfp4": ", kept in MXFP4 as published", "dequantised from mxfp4": ", dequantised from MXFP4"}


def map_cells(data: dict, max_cells: int = MAP_MAX_CELLS) -> tuple[str, int]:
    """The status answer's block map in at most `max_cells` cells, and the blocks a cell covers:
    as kvd folded it (`cells=`), or folded here when kvd sent a character per block (an older kvd)."""
    block_map, per_cell = data["block_map"], data.get("block_map_per_cell", 1)
    if len(block_map) <= max_cells:
        return block_map, per_cell
    return fold_block_map(block_map, max_cells)


def start_line(start: dict, uptime: float | None) -> str:
    """How long kvd's latest start took and where the time went, in one line (`kvctl status`)."""
    parts = ", ".join(f"{PHASE_NAMES.get(phase, phase)} {seconds(took)}" for phase, took in start["phases"].items())
    early = before_load(start)
    before = "" if early is None else f"{seconds(early)} before the load (imports, settings), "
    line = f"ready {seconds(start['ready_after_seconds'])} after the process began: {before}{parts}"
    if start.get("pins_warmed_seconds") is not None:
        line += f"; pinned prefixes back from the lower tiers {seconds(start['pins_warmed_seconds'])} later"
    if uptime is not None:
        line += f"; up {duration(uptime)}"
    return line


def transfer_line(counts: dict) -> str:
    """What kvd passed through Redis as a prefill replica and took as a decode one (kv_transfer.py)."""
    parts = []
    if counts.get("prefills"):
        parts.append(f"computed {prompts(counts['prefills'])} for decode replicas "
                     f"({counts.get('published_blocks', 0):,} blocks written to Redis, "
                     f"{seconds(counts.get('publish_seconds', 0.0) / counts['prefills'])} a prompt)")
    if counts.get("decodes"):
        parts.append(f"decoded {prompts(counts['decodes'])} after a prefill replica "
                     f"({counts.get('fetched_blocks', 0):,} blocks read from Redis, "
                     f"{seconds(counts.get('fetch_seconds', 0.0) / counts['decodes'])} a prompt)")
    return "; ".join(parts) or "none"


def speculation_line(spec: dict) -> str:
    """Speculative decoding's config and what it gave (engine/speculative.py), in one line."""
    config = spec.get("config")
    said = "off" if config is None else (
        f"ngram, up to {config['num_speculative_tokens']} draft tokens after a {config['prompt_lookup_min']}"
        f"-{config['prompt_lookup_max']} token match"
        + ("" if config.get("disable_by_batch_size") is None
           else f", none while over {config['disable_by_batch_size']} sequences run"))
    if not spec.get("drafts"):
        return said + ("" if config is None else "; no draft yet")
    return (f"{said}; {spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafted tokens kept "
            f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens a step where a draft ran")


def render_status(data: dict, console: Console | None = None):
    if is_fleet(data):  # pointed at kvd router: a row per replica
        return render_fleet_status(data, console)
    blocks = data["blocks"]["device"]
    total = blocks["total"]
    table = Table(title=f"KV cache blocks (device, {total:,} blocks of {data['block_size']} tokens, "
                        f"{data['bytes_per_token']:,} bytes/token)")
    table.add_column("state")
    table.add_column("blocks", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    for state in ("free", "reserved", "active", "shared", "cached", "pinned"):
        count = blocks[state]
        bar = "█" * round(30 * count / total) if total else ""
        table.add_row(Text(state, style=STATE_STYLES[state]), f"{count:,}", f"{count / total:.1%}",
                      Text(bar, style=STATE_STYLES[state]))
    tokens = data["tokens"]
    latency = data.get("latency") or {}
    ttft, itl = latency.get("ttft_seconds") or {}, latency.get("inter_token_seconds") or {}
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    context = f", contexts up to {data['model']['max_model_len']:,} tokens" if "max_model_len" in data["model"] else ""
    facts.add_row("model", f"{data['model']['name']} ({data['model']['architecture']}, "
                           f"rev {data['model']['revision'][:12]}, {data['model']['device']}{context})")
    if data.get("software"):  # an older kvd does not say
        facts.add_row("software", software_line(data["software"]))
    window = data["model"].get("sliding_window")  # an older kvd does not say
    if window:
        facts.add_row("sliding window", f"{window['tokens']:,} tokens, " + (
            f"every layer: a sequence holds at most {window['blocks_per_sequence']:,} blocks; "
            f"{window['released_blocks']:,} given back as windows passed them (they stay cached)"
            if window["blocks_per_sequence"] is not None else
            f"{window['layers']} of {window['of']} layers: the others attend in full, so a sequence keeps every block"))
    if experts := data["model"].get("experts"):  # a mixture of experts (an older kvd does not say)
        facts.add_row("experts", f"{experts['experts']:,} in {experts['layers']} of {experts['of']} layers, "
                                 f"{experts['per_token']} for each token" + (", and a shared expert for every token"
                                                                            if experts["shared_expert"] else "")
                       + EXPERT_WEIGHTS.get(experts.get("weights"), ""))
    if "chat_template" in data["model"]:  # an older kvd does not say
        template = data["model"]["chat_template"]
        facts.add_row("chat template", "none: /v1/chat/completions refuses chats (kvd serve --chat-template FILE)"
                      if template is None else f"{template['source']} ({template['digest'][:12]})" + "".join(
                          f"; {name} {json.dumps(value)} unless a request says otherwise"
                          for name, value in sorted((template.get("defaults") or {}).items())))
    for adapter in data["model"].get("adapters") or ():  # LoRA adapters (an older kvd does not say)
        modules = ",".join(m.removesuffix("_proj") for m in adapter["modules"])
        memory = f", {size(adapter['bytes'])}" if adapter.get("bytes") else ""  # its weights (an older kvd: -)
        facts.add_row("LoRA adapter", f"{adapter['name']} (rank {adapter['rank']}, {modules}{memory}; "
                                      f"{adapter['digest'][:12]}): {adapter['requests']} in flight"
                                      + _cached_blocks(adapter)
                                      + ("; loaded at runtime, until a restart" if adapter.get("source") == "runtime"
                                         else ""))
    if data["model"].get("max_loras") and data["model"].get("adapters"):  # an older kvd does not say
        waiting = data["model"].get("lora_turns_waiting") or 0
        facts.add_row("LoRA batch", f"at most {data['model']['max_loras']} adapters in a batch"
                      + (f"; {waiting} requests wait for an adapter's turn" if waiting else ""))
    for old in data["model"].get("retiring_adapters") or ():
        why = "replaced by a reload" if old["replaced"] else "taken away by a reload"
        facts.add_row("LoRA adapter", f"{old['name']} ({old['digest'][:12]}): {why}; {old['requests']} "
                                      f"in flight finish on it" + _cached_blocks(old))
    sampling = data["model"].get("sampling_defaults")  # an older kvd does not say
    if sampling and sampling["values"]:
        facts.add_row("sampling", ", ".join(f"{name} {value}" for name, value in sampling["values"].items())
                      + f" unless a request says otherwise ({sampling['source']})")
    facts.add_row("prefix hits", f"{tokens['hit']:,} of {tokens['prompt']:,} prompt tokens "
                                 f"({tokens['hit_ratio']:.1%})" + twice_the_cache(data.get("hit_curve")))
    facts.add_row("recomputed", f"{tokens['recomputed']:,} tokens after {data['preemptions']} preemptions")
    reservation = data.get("reservation")  # an older kvd does not say
    if reservation:
        facts.add_row("reservation", reservation_text(reservation))
    kept = data.get("responses")  # /v1/responses kept for previous_response_id (an older kvd does not say)
    running = (kept or {}).get("running", 0)  # background responses still running (an older kvd does not say)
    expired = (kept or {}).get("expired", 0)  # let go past responses_max_age (an older kvd does not say)
    unwritten = ((kept or {}).get("file") or {}).get("failed_writes", 0)  # to responses_store_file
    if kept and (kept["responses"] or kept["dropped"] or running or expired or unwritten):
        facts.add_row("responses kept", f"{kept['responses']:,} in {size(kept['bytes'])} of "
                                        f"{size(kept['budget_bytes'])}"
                      + (f"; {kept['dropped']:,} let go for room (a turn that continues one gets a 404)"
                         if kept["dropped"] else "")
                      + (f"; {expired:,} let go past responses_max_age" if expired else "")
                      + (f"; {running:,} running in the background" if running else "")
                      + (f"; {size(kept['replay_bytes'])} of events kept to stream again"
                         if kept.get("replay_bytes") else "")
                      + (f"; {unwritten:,} write{'s' if unwritten != 1 else ''} to responses_store_file did not "
                         "land (kvctl responses)"
                         if unwritten else ""))
    talks = data.get("conversations")  # /v1/conversations (an older kvd does not say)
    if talks and (talks["conversations"] or talks["dropped"] or talks["turns_lost"] or talks.get("expired")):
        facts.add_row("conversations", f"{talks['conversations']:,} kept in {size(talks['bytes'])} of "
                                       f"{size(talks['budget_bytes'])}"
                      + (f"; {talks['dropped']:,} let go for room (a request that names one gets a 404)"
                         if talks["dropped"] else "")
                      + (f"; {talks['expired']:,} idle past responses_max_age" if talks.get("expired") else "")
                      + (f"; {talks['turns_lost']:,} turns not added (the conversation would outgrow the budget)"
                         if talks["turns_lost"] else ""))
    replies = data.get("reply_ids")  # chat replies' own ids (an older kvd does not say)
    if replies and (replies["replies"] or replies["spliced"] or replies["template_changed"]):
        facts.add_row("reply ids", f"{replies['replies']:,} replies kept in {size(replies['bytes'])} of "
                                   f"{size(replies['budget_bytes'])}; {replies['spliced']:,} sent back as their ids"
                      + (f"; {replies['template_changed']:,} chats read as text (the template rewrites replies)"
                         if replies["template_changed"] else "")
                      + (f"; {replies['dropped']:,} let go for room" if replies["dropped"] else ""))
    spec = data.get("speculation")  # absent from an older kvd
    if spec and (spec.get("config") or spec.get("drafts")):
        facts.add_row("speculation", speculation_line(spec))
    predicted = (spec or {}).get("prediction")  # requests' predictions' drafts (absent from an older kvd)
    if predicted and predicted["drafts"]:
        facts.add_row("predictions", f"{predicted['accepted_tokens']:,} of {predicted['draft_tokens']:,} tokens "
                                     f"drafted from requests' predictions kept ({predicted['acceptance_rate']:.0%}), "
                                     f"{predicted['mean_accepted_length']:.2f} tokens a step where one ran"
                                     + (f"; drafted while at most {predicted['max_batch']:,} sequences run"
                                        if predicted.get("max_batch") else ""))
    if data.get("tiers"):
        facts.add_row("restored", f"{tokens.get('restored', 0):,} prompt tokens from lower tiers (part of the hits)")
        facts.add_row("tiers", "  ".join(
            f"{name} {size(t['used_bytes'])}"
            + (" (no budget)" if t["capacity_bytes"] is None else f" of {size(t['capacity_bytes'])}")
            + ("" if t["health"] == "ok" else f" [{t['health'].upper()}]")
            for name, t in data["tiers"].items()))
    evictions = data["evictions"]
    by_share = evictions.get("tenant_share", 0)
    facts.add_row("evictions", f"{evictions['capacity']:,} by {data['eviction_policy']}"
                  + (f" ({by_share:,} of them from tenants over their share)" if by_share else "")
                  + f", {evictions['operator']:,} by operators"
                  + (f", {evictions['space']:,} made under scales since replaced" if evictions.get("space") else "")
                  + (f", {evictions['sleep']:,} as kvd went to sleep" if evictions.get("sleep") else "")
                  + (f", {evictions['private']:,} requests' own as they ended (explicit prompt cache mode)"
                     if evictions.get("private") else ""))
    if data.get("tenant_shares"):  # absent from an older kvd, null without shares
        facts.add_row("tenant shares", "; ".join(
            f"{tenant} {row['idle_blocks']:,} idle" + (", no share" if row["share_blocks"] is None else
                                                        f", share {row['share_blocks']:,}"
                                                        + (" (over: evicted first)"
                                                           if row["idle_blocks"] > row["share_blocks"] else ""))
            for tenant, row in data["tenant_shares"].items()))
    queue = data["queue"]
    limit = queue.get("max_queue_wait_seconds")  # absent from an older kvd, null without a limit
    waiting = f"{queue['waiting']} waiting" + (
        f" (oldest {seconds(queue['oldest_age_seconds'])}" + (f" of {seconds(limit)} allowed" if limit else "") + ")"
        if queue["waiting"] else "")
    ahead, late = "", False
    both = "priority_lpm_waiting" in queue  # queue_order priority+lpm: by place, then lpm within one
    lpm = "lpm_waiting" in queue or both  # queue_order lpm: the longest cached prefix first
    ranked = "priority_waiting" in queue or both  # queue_order priority: by place (tenant_priorities)
    if queue.get("predicted_wait_seconds") is not None:
        rate = f"prefill {queue['prefill_tokens_per_second']:,.0f} tokens/s"
        late = bool(limit) and queue["predicted_wait_seconds"] >= limit
        ahead = f"; {rate}" if not queue["tokens_ahead"] else (
            f"; {queue['tokens_ahead']:,} prompt tokens ahead: a new request "
            + ("holding no cached prefix " if lpm else "") + ("at the last place " if ranked else "")
            + f"waits ~{seconds(queue['predicted_wait_seconds'])} ({rate})"
            + (f", past max_queue_wait {seconds(limit)}: it would be turned away (queue_timeout)" if late else ""))
    own = queue.get("tenant_queue_waits")  # tenants' own limits (tenant_queue_waits; absent from an older kvd)
    if own:
        ahead += "; tenants' own limits: " + ", ".join(f"{tenant} {seconds(limit) if limit else 'none'}"
                                                       for tenant, limit in sorted(own.items()))
    facts.add_row("queue", Text(f"{waiting}, {queue['running']} running{ahead}", style="yellow" if late else ""))
    if data.get("admitted_ahead"):  # absent from an older kvd
        facts.add_row("queue order", f"{data['admitted_ahead']:,} requests went in while an earlier arrival waited"
                      + (" (priority+lpm: by the tenants' places, the longest cached prefix first within one)"
                         if both else " (lpm: the longest cached prefix first)" if lpm else
                         " (priority: by the tenants' places)" if ranked else ""))
    if data.get("draining"):
        facts.add_row("draining", Text("no new completion is taken (kvctl resume takes them again)", style="yellow"))
    if data.get("tls"):
        facts.add_row("TLS", tls_text(data["tls"]))
    asleep = data.get("asleep")  # absent from an older kvd, null while awake
    if asleep:
        given = " and ".join({"kv_cache": "the cache's memory", "weights": "the weights"}[t]
                             for t in asleep["released"]) or "nothing"
        facts.add_row("asleep", Text(f"level {asleep['level']} since {when(asleep['since'])}, by {asleep['by']}: "
                                     f"{given} given back; completions get 503 until `kvctl wake`", style="yellow"))
    for what, line in store_trouble(data):
        facts.add_row(what, line)
    rejections = data["rejections"]
    facts.add_row("rejections", ", ".join(f"{k} {v}" for k, v in sorted(rejections.items())) or "none")
    failures = data.get("step_failures")  # engine steps that raised (an older kvd does not say)
    if failures and failures["total"]:
        facts.add_row("engine failures", Text(step_failures_line(failures), style="red"))
    stranded = data.get("stranded_pins")  # absent from an older kvd
    facts.add_row("pins", Text.assemble(str(data["pins"]), ("" if not stranded else (
        f"; {stranded} stranded: made under weights, scales or a format no longer served, so no request reaches "
        "them (kvctl pins; kvctl unpin --stranded)", "yellow"))))
    if data.get("start"):  # absent from an older kvd
        facts.add_row("started", start_line(data["start"], data.get("uptime_seconds")))
    reload = data.get("last_reload")
    if reload and reload["result"] == "refused":
        facts.add_row("config", Text(f"the latest reload ({when(reload['at'])}, by {reload['actor']}) was refused, "
                                     f"kvd runs on its earlier settings: {reload['error'].splitlines()[0]}",
                                     style="yellow"))
    updated = data.get("weights_updated")  # absent from an older kvd, null unless kvctl update-weights ran
    if updated:
        facts.add_row("weights", Text(f"from {updated['model_path']} (revision {updated['revision'][:12]}) since "
                                      f"{when(updated['at'])}, by {updated['by']}: a restart serves "
                                      f"{updated['config_model'] or 'the demo checkpoint'} again (set model in the "
                                      "config to keep them)", style="yellow"))
    transfers = data.get("kv_transfers")  # absent from an older kvd, {} until a transfer
    if transfers:
        facts.add_row("kv transfer", transfer_line(transfers))
    rollout = data.get("rollout")
    if rollout:
        facts.add_row("rollout", f"{rollout['id']} {rollout['state']}: {cohort_text(rollout)}"
                                 + (f", one of fleet rollout {rollout['fleet']}" if rollout.get("fleet") else "")
                                 + f"; kvctl rollout status {rollout['id']})")
    cache = data.get("cache") or {}
    if cache.get("uncalibrated"):
        facts.add_row("cache format", Text(f"{cache['layout']}: UNCALIBRATED, unit scales", style="bold red"))
    elif cache.get("scale_set"):
        scale_set = cache["scale_set"]
        facts.add_row("cache format", f"{cache['layout']}, scale set {scale_set['id']} (prompts "
                                      f"{scale_set['prompts_digest']}), loaded in kernels: "
                                      f"{'verified' if cache['scales_verified'] else 'MISMATCH'}")
    elif cache:
        facts.add_row("cache format", cache["layout"])
    if data.get("extra_tokens_vs_model_dtype"):
        facts.add_row("format gain", f"{data['capacity_tokens']:,} tokens, {data['extra_tokens_vs_model_dtype']:,} "
                                     "more than the model dtype in the same memory")
    facts.add_row("TTFT", f"p50 {seconds(ttft.get('p50'))}  p95 {seconds(ttft.get('p95'))}  "
                          f"p99 {seconds(ttft.get('p99'))}")
    facts.add_row("inter-token", f"p50 {seconds(itl.get('p50'))}  p95 {seconds(itl.get('p95'))}  "
                                 f"p99 {seconds(itl.get('p99'))}")
    steps = data.get("steps") or {}
    if steps:
        decode = steps.get("decode")
        mean = f"; decode step {seconds(decode['seconds'] / decode['count'])} mean" if decode else ""
        count = data.get("engine_threads")
        threads = f" on {count} thread{'s' if count != 1 else ''}" if count else ""
        share = data.get("cpu_share") or {}
        if share.get("busy_neighbours"):
            threads += (f" (its {share['cpus']} CPUs shared with {share['busy_neighbours']} other busy kvd"
                        + (", fixed by OMP_NUM_THREADS" if share.get("fixed_by") else "") + ")")
        facts.add_row("engine", ", ".join(f"{s['count']:,} {kind}" for kind, s in steps.items())
                      + f" steps{threads}, {seconds(sum(s['seconds'] for s in steps.values()))} busy{mean}")
    if (data.get("gc") or {}).get("watching"):  # kvd serve (absent from an older kvd)
        facts.add_row("gc", gc_line(data["gc"]))
    for gpu in data.get("gpu") or []:  # the GPU kvd runs on, by NVML's (nvidia-smi's) index
        facts.add_row(gpu_label(gpu), gpu_line(gpu))
    parts = [table, facts]
    if data.get("block_map"):
        cells, per_cell = map_cells(data)
        text = Text()
        for i, char in enumerate(cells):
            text.append("■", style=MAP_STYLES[char])
            if i % 64 == 63 and i + 1 < len(cells):
                text.append("\n")
        text.append("\n\n")  # the legend under the map, in the map's colours: a title would be cut at 80 columns
        for char, state in BLOCK_STATES.items():
            text.append("■", style=MAP_STYLES[char]).append(f" {state}  ")
        scale = "" if per_cell == 1 else f" (a cell is {per_cell} blocks, in its most common state)"
        parts.append(Panel(text, title=f"block map{scale}"))
    group = Group(*parts)
    if console is not None:
        console.print(group)
    return group


def status(ctx: typer.Context, watch: bool = typer.Option(False, "--watch", help="Refresh every second."),
           blocks: bool = typer.Option(False, "--blocks",
                                       help="Draw the physical block map (with --json: a character per block)."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Blocks by state, hits and recomputation, queue, rejections, latency, GPU.

    Example: kvctl status --blocks
    """
    client = client_for(ctx)
    # drawn, the map is folded by kvd to a screen's cells; --json keeps a character per block
    query = {"blocks": True, "cells": None if as_json else MAP_MAX_CELLS} if blocks else {}
    if not watch or as_json:
        data = client.get("/admin/status", **query)
        emit(data, as_json, lambda d: render_status(d, Console()))
        return
    watch_status(lambda: client.get("/admin/status", **query))


def watch_status(fetch, console: Console | None = None, interval: float = 1.0, sleep=time.sleep,
                 render=None) -> None:
    """Redraw the status (or what `render` makes of `fetch()`) every `interval` until Ctrl-C
    (command_kit.redraw)."""
    redraw(fetch, render or render_status, console, interval, sleep)


def _cached_blocks(adapter: dict) -> str:
    """", N blocks cached" for an adapter's line (an older kvd does not say)."""
    count = adapter.get("cached_blocks")
    return "" if count is None else f", {count:,} block{'s' if count != 1 else ''} cached"

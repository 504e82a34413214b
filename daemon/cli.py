"""kvd: the KV cache daemon (`kvd serve`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import typer

from kvctl import __version__
from kvctl.help_text import keep_names_whole, reflow_help

app = typer.Typer(help="kvd hosts a model over a paged KV cache and serves it to kvctl and OpenAI clients.",
                  no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
log = logging.getLogger("kvd")
QUIET_BELOW_DEBUG = ("httpx", "httpcore")  # a line per request to a replica (the router's feeds poll many a second)


def configure_logging(level: str, log_format: str = "text") -> None:
    """kvd's and kvd router's log: to stderr (the journal), as text or JSON lines (log_format.py),
    with the HTTP client libraries' per-request lines only at debug."""
    from kvctl.daemon.log_format import handler_for

    try:
        handler = handler_for(log_format, sys.stderr)
    except ValueError as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    quiet = logging.getLevelName(level.upper()) != logging.DEBUG
    for name in QUIET_BELOW_DEBUG:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context,
          version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    """kvd: the KV cache daemon."""
    if version:
        typer.echo(f"kvd {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


def _flags(**values) -> dict:
    return {k: v for k, v in values.items() if v is not None}


@app.command()
def serve(
    config: Optional[Path] = typer.Option(None, "--config", help="YAML settings file (flags and KVD_* win)."),
    model: Optional[str] = typer.Option(None, help="Checkpoint directory, or a Hugging Face id in the local cache "
                                                   "(kvd downloads nothing); default: the built-in demo."),
    chat_template: Optional[str] = typer.Option(
        None, help="Jinja chat template file for /v1/chat/completions; default: the checkpoint's own."),
    chat_template_kwargs: Optional[str] = typer.Option(
        None, help="What every chat's template gets unless its request says otherwise, as a JSON object: "
                   "'{\"enable_thinking\": false}' (names the template reads)."),
    generation_config: Optional[str] = typer.Option(
        None, help="auto (the checkpoint's generation_config.json gives requests' sampling defaults), none, or a "
                   "path to one."),
    reasoning_parser: Optional[str] = typer.Option(
        None, help="none, qwen3, deepseek_r1 or openai_gptoss: a chat reply's <think>...</think> (gpt-oss: its "
                   "analysis channel) goes to reasoning (and "
                   "reasoning_content), apart from content."),
    tool_call_parser: Optional[str] = typer.Option(
        None, help="none, hermes (Qwen2.5, Qwen3: <tool_call> blocks), llama3_json (Llama 3.1-3.3: a JSON "
                   "reply), mistral (Mistral: [TOOL_CALLS]), pythonic (Llama 4, Llama 3.2's pythonic template: a "
                   "Python list of calls) or openai (gpt-oss: a harmony message to=functions.NAME; with "
                   "--reasoning-parser openai_gptoss): a chat reply's calls become tool_calls when the chat sends "
                   "tools."),
    lora_modules: Optional[str] = typer.Option(
        None, help="LoRA adapters served beside the model, as NAME=DIR,NAME2=DIR2 (PEFT adapter folders): a "
                   "request's model field names one; each has its own blocks in the prefix cache."),
    lora_runtime_updates: Optional[bool] = typer.Option(
        None, help="Let admin callers load and unload LoRA adapters at runtime (POST /v1/load_lora_adapter, "
                   "/v1/unload_lora_adapter, as vLLM's); until a restart."),
    mxfp4_experts: Optional[str] = typer.Option(
        None, help="An MXFP4 checkpoint's experts (gpt-oss): keep (as published; each step decodes the experts it "
                   "runs), dequantise (as they load, to the model's dtype: about 3.8x their memory), or auto (the "
                   "default: keep on a GPU, dequantise on a CPU)."),
    max_loras: Optional[int] = typer.Option(
        None, help="LoRA adapters in one batch at most (vLLM's --max-loras): a request for another waits its turn, "
                   "and adapter requests behind it wait with it. Default: no limit."),
    state_dir: Optional[str] = typer.Option(None, help="State directory (demo checkpoint, SQLite)."),
    socket_path: Optional[str] = typer.Option(None, "--socket", help="Unix socket for the API."),
    listen: Optional[str] = typer.Option(None, help="Also serve TCP on HOST:PORT (needs --token-file)."),
    token_file: Optional[str] = typer.Option(None, help="Bearer tokens: lines 'TOKEN TENANT ROLE'."),
    ssl_certfile: Optional[str] = typer.Option(
        None, help="Serve --listen over TLS with this certificate chain (PEM, leaf first); a reload (SIGHUP, "
                   "kvctl config reload) reads it again: a rotated certificate serves without a restart."),
    ssl_keyfile: Optional[str] = typer.Option(None, help="The certificate's private key (PEM; mode 0600 or 0640). "
                                              "Default: in the --ssl-certfile file."),
    ssl_ca_certs: Optional[str] = typer.Option(None, help="Ask each TCP client for a certificate signed by one of "
                                               "these CAs (mutual TLS); bearer tokens are still checked. A reload "
                                               "reads it again."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="auto, float32, bfloat16 or float16."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per cache block."),
    num_blocks: Optional[int] = typer.Option(None, help="Cache blocks (wins over --cache-memory)."),
    cache_memory: Optional[str] = typer.Option(None, help="Cache bytes, e.g. 512MiB."),
    max_model_len: Optional[int] = typer.Option(
        None, help="The longest context served (prompt + reply), below the model's own; a chat without "
                   "max_tokens reserves up to it."),
    max_batch_tokens: Optional[int] = typer.Option(None, help="Prompt tokens per step."),
    quick_prefill_tokens: Optional[str] = typer.Option(
        None, help="Prompts with at most this many tokens left get a step of their own ahead of the "
                   "decodes (0: never; auto: 64 on a CPU, 0 on a GPU)."),
    max_running: Optional[int] = typer.Option(None, help="Sequences in a batch at most."),
    speculative_config: Optional[str] = typer.Option(
        None, help="Speculative decoding by prompt lookup, as vLLM's: '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 4}' (also prompt_lookup_max, prompt_lookup_min, "
                   "disable_by_batch_size). Replies do not change: fewer steps give them."),
    max_queue: Optional[int] = typer.Option(None, help="Waiting requests before 429."),
    max_queue_wait: Optional[float] = typer.Option(
        None, help="Seconds a request may wait to be admitted; past it, it is turned away (503, code "
                   "queue_timeout; kvd router tries another replica). Live on a reload (default 0: no limit)."),
    max_tenant_requests: Optional[int] = typer.Option(
        None, help="One tenant's requests in flight (waiting and running) at most; 429 beyond. Default: no limit."),
    tenant_request_limits: Optional[str] = typer.Option(
        None, help="Per-tenant limits overriding --max-tenant-requests, e.g. acme=128,free=4."),
    tenant_queue_waits: Optional[str] = typer.Option(
        None, help="Per-tenant queue wait limits in seconds overriding --max-queue-wait, e.g. batch=600,chat=10 "
                   "(0: none for that tenant). Live on a reload."),
    max_request_bytes: Optional[str] = typer.Option(None, help="Largest request body, e.g. 32MiB (413 above)."),
    webhooks_file: Optional[str] = typer.Option(
        None, help="OpenAI's webhooks when a batch or background response ends: TENANT URL SECRET lines (* for "
                   "every tenant not named; secrets from kvd webhook-secret), mode 0600 or 0640. Re-read on reload."),
    batch_via: Optional[str] = typer.Option(
        None, help="A kvd router's Unix socket, or the http(s) URL of its TCP front (run with --trusted-proxy): "
                   "/v1/batches' requests go through it, spread across its fleet by their prompts (default: served "
                   "here). Live on a reload."),
    batch_via_token_file: Optional[str] = typer.Option(
        None, help="A --batch-via URL's bearer token: an admin token of the router's clients file (mode 0600 or "
                   "0640; read again on a reload)."),
    batch_via_ca_file: Optional[str] = typer.Option(
        None, help="CAs an https --batch-via URL's certificate is checked against (default: the system's)."),
    batch_via_client_cert: Optional[str] = typer.Option(
        None, help="kvd's certificate and key (PEM) for a --batch-via router that asks for one."),
    max_file_bytes: Optional[str] = typer.Option(
        None, help="Largest file POST /v1/files takes, e.g. 200MiB (413 above; default 200MiB). Live on a reload."),
    files_store_bytes: Optional[str] = typer.Option(
        None, help="Bytes /v1/files keeps, every tenant's files together, e.g. 8GiB (default); an upload past them "
                   "is refused (507), nothing kept is removed. Live on a reload."),
    tenant_files_bytes: Optional[str] = typer.Option(
        None, help="Per-tenant budgets of --files-store-bytes, e.g. acme=20GiB,*=1GiB (* each tenant not named); "
                   "an upload past its tenant's is refused (400). Live on a reload."),
    files_max_age: Optional[str] = typer.Option(
        None, help="Remove files (uploads and batches' outputs) older than this (12h, 30d), whatever their own "
                   "expires_after; a running batch's input once it ends. Default: kept until deleted or their "
                   "own expiry. Live on a reload."),
    batch_concurrency: Optional[int] = typer.Option(
        None, help="Requests of /v1/batches served at once, across every tenant's batches (each batch's in turn; "
                   "flex under a priority queue). Live on a reload (default 8)."),
    responses_store_bytes: Optional[str] = typer.Option(
        None, help="Memory for the responses /v1/responses keeps for previous_response_id (least recently used "
                   "go first), e.g. 64MiB; 0 keeps none. Live on a reload: lowered, what no longer fits goes."),
    responses_max_age: Optional[str] = typer.Option(
        None, help="Let go of kept responses older than this (90, 30m, 12h, 30d), and of conversations unchanged "
                   "for as long, from the file too. Default: kept until room or a purge needs them."),
    conversations_store_bytes: Optional[str] = typer.Option(
        None, help="Memory for the conversations /v1/conversations keeps (least recently used go first), e.g. "
                   "64MiB; 0 keeps none. Live on a reload: lowered, what no longer fits goes."),
    reply_ids_bytes: Optional[str] = typer.Option(
        None, help="Memory for recent chat replies' token ids, e.g. 64MiB: a next turn that sends a reply back is "
                   "prompted with the ids the model made, so its blocks hit the cache; 0 tokenizes it again. Live "
                   "on a reload."),
    truncation_headroom: Optional[float] = typer.Option(
        None, help="With truncation auto, the share of the prompt's room a cut leaves free (default 0.25), so the "
                   "turns after it come from the prefix cache; 0 drops the fewest turns."),
    responses_store_file: Optional[str] = typer.Option(
        None, help="A SQLite file the kept responses are written to as well (mode 0600), and read back from at "
                   "start: a restart keeps them. Default: memory only."),
    reservation: Optional[str] = typer.Option(None, help="Output reservation: fixed:N, fraction:F, p95."),
    eviction: Optional[str] = typer.Option(None, help="Eviction policy: lru, cost, lfu (fewest uses first, never "
                                          "decayed) or priority (the prefixes of the requests that run first go "
                                          "last; with --queue-order priority)."),
    queue_order: Optional[str] = typer.Option(None, help="fifo, priority (by tenant_priorities and each "
                                              "request's priority, lower first), lpm (the longest cached prefix "
                                              "first, SGLang's; without --max-queue-wait, one that has waited 30 s "
                                              "goes first) or priority+lpm (lpm's order within each priority)."),
    tenant_priorities: Optional[str] = typer.Option(
        None, help="With --queue-order priority: each tenant's place, e.g. acme=-10,batch=5 (lower first)."),
    tenant_cache_shares: Optional[str] = typer.Option(
        None, help="Tenants' shares of the cache, e.g. acme=0.25,*=0.5: when room is needed, a tenant holding "
                   "more idle blocks than its share loses its own first."),
    trusted_proxy: Optional[bool] = typer.Option(None, help="Honour X-KVD-Tenant on TCP."),
    report_cached_tokens: Optional[str] = typer.Option(
        None, help="Who sees usage's cached_tokens: all, admin (callers with the admin role) or none. A count of "
                   "cached tokens lets a caller probe the cache for a guessed prompt."),
    prompt_cache_retention: Optional[str] = typer.Option(
        None, help="honour (a request's prompt_cache_retention 24h writes its blocks to disk and Redis as it ends) "
                   "or ignore (it is served as in_memory)."),
    predicted_outputs: Optional[str] = typer.Option(
        None, help="honour (a chat's prediction, OpenAI's Predicted Outputs, is drafted ahead of its reply) or "
                   "ignore (it is served as a chat without one). Live on a reload."),
    prediction_max_batch: Optional[int] = typer.Option(
        None, help="Draft a chat's prediction only while at most this many sequences run (a full batch is "
                   "compute-bound: checking guesses costs more than it saves). Default: at any batch size. "
                   "Live on a reload."),
    tenant_prompt_cache_retention: Optional[str] = typer.Option(
        None, help="Per-tenant settings overriding --prompt-cache-retention, e.g. acme=honour,free=ignore. "
                   "Live on a reload."),
    cache_dtype: Optional[str] = typer.Option(None, help="auto, fp8_e4m3 (or fp8, as vLLM names it), fp8_e5m2 "
                                              "or int8."),
    keep_layers_unquantised: Optional[str] = typer.Option(None, help="Layers kept in the model dtype, e.g. 0,31."),
    allow_uncalibrated: Optional[bool] = typer.Option(None, help="Serve a quantised cache with unit scales."),
    host_cache_bytes: Optional[str] = typer.Option(None, help="Host tier bytes, e.g. 8GiB (pinned on CUDA)."),
    disk_cache_bytes: Optional[str] = typer.Option(None, help="Disk tier bytes, e.g. 100GiB (under the state dir)."),
    disk_cache_path: Optional[str] = typer.Option(None, help="Disk tier folder; default STATE_DIR/kvcache."),
    remote_url: Optional[str] = typer.Option(None, help="Remote tier: redis://HOST:PORT/DB or redis+cluster://..."),
    write_policy: Optional[str] = typer.Option(None, help="write_back (on eviction), write_through (every "
                                               "filled block) or write_through_selective (a block once reused)."),
    tiering: Optional[str] = typer.Option(None, help="measured (judge by measured rates) or always."),
    tier_compress: Optional[str] = typer.Option(
        None, help="How disk and Redis store a block: none (the device's bytes), int8 or fp8_e4m3 "
                   "(about half a 16-bit block, lossy)."),
    disk_compress: Optional[str] = typer.Option(None, help="The disk tier's own --tier-compress."),
    remote_compress: Optional[str] = typer.Option(None, help="The Redis tier's own --tier-compress."),
    prefetch_policy: Optional[str] = typer.Option(
        None, help="How long a waiting request holds out for its prefix from disk or Redis: timeout "
                   "(--prefetch-timeout), best_effort (never) or wait_complete (until the fetch ends)."),
    prefetch_timeout: Optional[float] = typer.Option(
        None, help="Seconds a request waits for its prefix's fetch under prefetch_policy timeout (default 2)."),
    prefetch_timeout_per_1k_tokens: Optional[float] = typer.Option(
        None, help="Seconds more per 1,024 tokens fetched, under prefetch_policy timeout (default 0)."),
    metrics_aliases: Optional[str] = typer.Option(
        None, help="Also export /metrics under vLLM's and/or SGLang's names (vllm,sglang), for their dashboards."),
    max_tenant_metric_series: Optional[int] = typer.Option(
        None, help="Per-tenant metrics name the first N tenants seen (default 100); the rest are summed "
                   "under tenant=\"*\", so callers cannot grow the series without bound."),
    max_tracked_tenants: Optional[int] = typer.Option(
        None, help="Tenants whose counters and latest TTFTs are kept by name, the most recently active "
                   "(default 10000); the others' counters are summed as retired."),
    pin_budget_blocks: Optional[int] = typer.Option(
        None, help="Blocks each tenant may pin (default: half the cache's blocks)."),
    pin_room_tokens: Optional[int] = typer.Option(
        None, help="Room, in tokens of one request, a new pin must leave beside the pins (default: the context "
                   "served or half the cache, whichever is less; 0: none)."),
    prompt_cache_breakpoints: Optional[str] = typer.Option(
        None, help="honour (the prefixes a request marks with OpenAI's prompt_cache_breakpoint are pinned for "
                   "their ttl, 30m or 12h, from the tenant's pin budget) or ignore. Live on a reload."),
    prompt_cache_explicit_tenants: Optional[str] = typer.Option(
        None, help="Tenants (a,b; *: every tenant) whose requests are served in OpenAI's explicit prompt cache mode "
                   "whatever they ask: their prompts are cached only up to the prefixes they mark, none where they "
                   "mark none (zero data retention). Live on a reload."),
    trace_requests: Optional[int] = typer.Option(
        None, help="Finished requests kept as trace lines for `kvctl trace save` (default 10000; 0: none)."),
    hit_curve: Optional[bool] = typer.Option(
        None, help="Follow each prompt block's reuse distance for `kvctl hit-curve`: what a cache of each size "
                   "would have served (about 5 us a block on the engine thread; default on)."),
    hit_curve_tenants: Optional[str] = typer.Option(
        None, help="Tenants the hit curve also follows alone, as in a cache share of their own, to size their "
                   "shares by (kvctl hit-curve --tenant T; 8 at most; default: those tenant_cache_shares names)."),
    trace_key_file: Optional[str] = typer.Option(
        None, help="A secret file (32 bytes or more) keying the trace's block ids; give a fleet's replicas one, "
                   "and kvd router saves the fleet's trace (default: a key drawn at start)."),
    trace_block_tokens: Optional[int] = typer.Option(
        None, help="Prompt tokens per trace block id: 512 (the Mooncake format's, default) or finer (16 to 256), "
                   "so a replay keeps sharing past a 512-token boundary."),
    shutdown_timeout: Optional[float] = typer.Option(
        None, help="Seconds in-flight requests get to finish on SIGTERM before they are cancelled (default 30)."),
    engine_stall_exit_seconds: Optional[float] = typer.Option(
        None, help="Exit (code 75, to be started again) once the engine has been stalled this long: a step that "
                   "never ends (default 300; 0: never; /healthz says 503 from 60 s). Live on a reload."),
    model_name: Optional[str] = typer.Option(
        None, help="The model's name in /v1/models and requests (vLLM's --served-model-name); default: the "
                   "checkpoint folder's."),
    remote_cache_bytes: Optional[str] = typer.Option(
        None, help="What this daemon may write to the Redis tier, e.g. 8GiB (default: no bound of its own)."),
    remote_timeout: Optional[float] = typer.Option(None, help="Seconds per Redis call (default 0.5)."),
    gc_freeze: Optional[bool] = typer.Option(
        None, help="Freeze the heap kvd's start made (the model, torch's import), so that Python's garbage "
                   "collector does not walk it while kvd serves: 108-143 ms a walk on 2 cores (default on)."),
    gc_warn_seconds: Optional[float] = typer.Option(
        None, help="Log a WARNING (at most once a minute) when a garbage collection stops every thread this "
                   "long or longer (default 0.1; 0: never)."),
    log_requests: Optional[bool] = typer.Option(
        None, help="Log a line per finished request (logfmt: id, tenant, API, token counts, times; never text "
                   "or token ids). Live on a reload (default off)."),
    log_stats_interval: Optional[float] = typer.Option(
        None, help="Log the engine's summary (tokens/s in and out, prefix hits, queue, cache use) every this "
                   "many seconds where something happened; 0: never. Live on a reload (default 10)."),
    otlp_traces_endpoint: Optional[str] = typer.Option(
        None, help="Send a span per request (OpenTelemetry, OTLP) to this collector URL, e.g. "
                   "http://collector:4318/v1/traces, or http://collector:4317 with "
                   "OTEL_EXPORTER_OTLP_PROTOCOL=grpc; a caller's traceparent is its parent. Needs the otel "
                   "extra (OpenTelemetry's packages)."),
    log_level: str = typer.Option("info", help="Log level."),
    log_format: str = typer.Option("text", help="text, or json: one JSON object a line, a request's and the "
                                   "summary's fields its own (for Loki, Elasticsearch, Vector)."),
) -> None:
    """Run the daemon in the foreground (systemd Type=notify aware).

    Example: kvd serve --socket /run/kvd/kvd.sock --cache-memory 512MiB --host-cache-bytes 2GiB
    """
    from kvctl.daemon.config import ConfigError, kvd_env_typos, resolve

    configure_logging(log_level, log_format)
    for line in kvd_env_typos(os.environ):
        log.warning("%s", line)
    flags = _flags(model=model, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                   generation_config=generation_config, reasoning_parser=reasoning_parser,
                   tool_call_parser=tool_call_parser, lora_modules=lora_modules,
                   lora_runtime_updates=lora_runtime_updates, max_loras=max_loras,
                   mxfp4_experts=mxfp4_experts,
                   state_dir=state_dir, socket=socket_path, listen=listen, token_file=token_file,
                   ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, ssl_ca_certs=ssl_ca_certs,
                   device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                   cache_memory=cache_memory, max_model_len=max_model_len, max_batch_tokens=max_batch_tokens,
                   quick_prefill_tokens=quick_prefill_tokens, max_running=max_running,
                   speculative_config=speculative_config,
                   max_queue=max_queue, max_queue_wait=max_queue_wait, max_tenant_requests=max_tenant_requests,
                   tenant_request_limits=tenant_request_limits, tenant_queue_waits=tenant_queue_waits,
                   max_request_bytes=max_request_bytes, responses_store_bytes=responses_store_bytes,
                   batch_concurrency=batch_concurrency, batch_via=batch_via, batch_via_token_file=batch_via_token_file,
                   batch_via_ca_file=batch_via_ca_file, batch_via_client_cert=batch_via_client_cert,
                   webhooks_file=webhooks_file, max_file_bytes=max_file_bytes,
                   files_store_bytes=files_store_bytes, tenant_files_bytes=tenant_files_bytes,
                   files_max_age=files_max_age,
                   responses_store_file=responses_store_file, responses_max_age=responses_max_age,
                   conversations_store_bytes=conversations_store_bytes, truncation_headroom=truncation_headroom,
                   reply_ids_bytes=reply_ids_bytes,
                   reservation=reservation,
                   eviction=eviction, tenant_cache_shares=tenant_cache_shares, queue_order=queue_order,
                   tenant_priorities=tenant_priorities,
                   trusted_proxy=trusted_proxy, report_cached_tokens=report_cached_tokens,
                   prompt_cache_retention=prompt_cache_retention, predicted_outputs=predicted_outputs,
                   prediction_max_batch=prediction_max_batch,
                   tenant_prompt_cache_retention=tenant_prompt_cache_retention, cache_dtype=cache_dtype,
                   keep_layers_unquantised=keep_layers_unquantised, allow_uncalibrated=allow_uncalibrated,
                   host_cache_bytes=host_cache_bytes, disk_cache_bytes=disk_cache_bytes,
                   disk_cache_path=disk_cache_path, remote_url=remote_url, write_policy=write_policy,
                   tiering=tiering, tier_compress=tier_compress, disk_compress=disk_compress,
                   remote_compress=remote_compress, prefetch_policy=prefetch_policy, prefetch_timeout=prefetch_timeout,
                   prefetch_timeout_per_1k_tokens=prefetch_timeout_per_1k_tokens, metrics_aliases=metrics_aliases,
                   max_tenant_metric_series=max_tenant_metric_series, max_tracked_tenants=max_tracked_tenants,
                   pin_budget_blocks=pin_budget_blocks, pin_room_tokens=pin_room_tokens,
                   prompt_cache_breakpoints=prompt_cache_breakpoints,
                   prompt_cache_explicit_tenants=prompt_cache_explicit_tenants,
                   trace_requests=trace_requests, trace_key_file=trace_key_file, hit_curve=hit_curve,
                   hit_curve_tenants=hit_curve_tenants,
                   trace_block_tokens=trace_block_tokens,
                   shutdown_timeout=shutdown_timeout, engine_stall_exit_seconds=engine_stall_exit_seconds,
                   model_name=model_name, remote_cache_bytes=remote_cache_bytes,
                   remote_timeout=remote_timeout, gc_freeze=gc_freeze, gc_warn_seconds=gc_warn_seconds,
                   log_requests=log_requests, log_stats_interval=log_stats_interval,
                   otlp_traces_endpoint=otlp_traces_endpoint)
    try:
        settings = resolve(flags, os.environ, config)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(_serve(settings, lambda: resolve(flags, os.environ, config)))
    except (ConfigError, RuntimeError, OSError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    if code:  # the device lost (device_loss.py): a service manager starts kvd again
        raise typer.Exit(code)


# `kvd serve --help` in sections, one per concern: a table of fifty options is hard to scan, and
# at 80 columns every option's help got squeezed beside the widest name of them all.
SERVE_HELP_PANELS = {
    "Model and server": ("config", "model", "chat_template", "chat_template_kwargs", "generation_config",
                         "reasoning_parser", "tool_call_parser", "lora_modules", "lora_runtime_updates", "max_loras",
                         "model_name", "mxfp4_experts",
                         "device", "dtype",
                         "state_dir",
                         "socket_path", "listen", "token_file", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs",
                         "trusted_proxy", "max_request_bytes",
                         "responses_store_bytes", "responses_store_file", "responses_max_age", "batch_concurrency",
                         "batch_via", "batch_via_token_file", "batch_via_ca_file", "batch_via_client_cert",
                         "webhooks_file", "max_file_bytes", "files_store_bytes", "tenant_files_bytes",
                         "files_max_age",
                         "conversations_store_bytes", "reply_ids_bytes", "truncation_headroom",
                         "shutdown_timeout", "engine_stall_exit_seconds", "gc_freeze", "gc_warn_seconds",
                         "log_level", "log_format",
                         "log_requests", "log_stats_interval"),
    "Cache and batching": ("block_size", "num_blocks", "cache_memory", "max_model_len", "max_batch_tokens",
                           "quick_prefill_tokens",
                           "max_running", "speculative_config", "predicted_outputs", "prediction_max_batch",
                           "reservation", "eviction",
                           "pin_budget_blocks",
                           "pin_room_tokens", "prompt_cache_breakpoints", "prompt_cache_explicit_tenants"),
    "Admission and tenants": ("max_queue", "max_queue_wait", "max_tenant_requests", "tenant_request_limits",
                              "tenant_queue_waits", "queue_order", "tenant_priorities", "tenant_cache_shares",
                              "report_cached_tokens"),
    "Quantised cache formats": ("cache_dtype", "keep_layers_unquantised", "allow_uncalibrated"),
    "Tiers: host, disk, Redis": ("host_cache_bytes", "disk_cache_bytes", "disk_cache_path", "remote_url",
                                 "remote_cache_bytes", "remote_timeout", "write_policy", "prompt_cache_retention",
                                 "tenant_prompt_cache_retention",
                                 "tiering", "tier_compress",
                                 "disk_compress", "remote_compress", "prefetch_policy", "prefetch_timeout",
                                 "prefetch_timeout_per_1k_tokens"),
    "Metrics and trace": ("metrics_aliases", "max_tenant_metric_series", "max_tracked_tenants", "trace_requests",
                          "trace_key_file", "trace_block_tokens", "otlp_traces_endpoint", "hit_curve",
                          "hit_curve_tenants"),
}


def place_in_help_panels(command, panels: dict[str, tuple[str, ...]]) -> None:
    """Give each option of `command` (a Typer command function) its `--help` section; an option
    placed in none, or in two, is an error here, at import, so a new setting cannot go unlisted."""
    options = {name: p.default for name, p in inspect.signature(command).parameters.items()}
    placed = [name for names in panels.values() for name in names]
    unknown = sorted(set(placed) - set(options))
    twice = sorted({name for name in placed if placed.count(name) > 1})
    missing = sorted(set(options) - set(placed))
    if unknown or twice or missing:
        raise RuntimeError(f"help panels of {command.__name__}: unknown {unknown}, twice {twice}, missing {missing}")
    for panel, names in panels.items():
        for name in names:
            options[name].rich_help_panel = panel


place_in_help_panels(serve, SERVE_HELP_PANELS)


def exit_stalled(front) -> None:
    """End kvd's process now, its engine stalled past engine_stall_exit_seconds (the service has
    said why in the log and the audit log): a stop would wait for the engine's lock, which the
    stalled step holds. Its socket goes (a start would replace it as stale anyway), the log is
    flushed; the store's records are committed already."""
    from kvctl.daemon.server.engine_liveness import STALLED_EXIT

    front.remove()
    for logger in (logging.getLogger(), log):
        for handler in logger.handlers:
            handler.flush()
    os._exit(STALLED_EXIT)


def _loop_factory():
    """uvloop's event loop when it is installed (the `serve` extra brings it): less Python per
    streamed token than asyncio's own; asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(settings, re_resolve) -> int:
    """Serve until SIGTERM (or the device is lost to the process): the exit code."""
    from kvctl.daemon.file_identity import os_problem
    from kvctl.daemon.folder_claim import FolderClaim, FolderTaken
    from kvctl.daemon.server import serve_again, unix_front
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.auth import TokenTable
    from kvctl.daemon.server.device_loss import DEVICE_LOST_EXIT
    from kvctl.daemon.server.housekeeping import Job
    from kvctl.daemon.server.http_front import Fronts, bind_tcp, raise_open_file_limit
    from kvctl.daemon.server.metrics import Metrics
    from kvctl.daemon.server.service import STOP_STORE_WAIT_S, EngineService
    from kvctl.daemon.server.tls import ServingTls, clear_text_warning
    from kvctl.daemon.store import Store

    tokens = TokenTable.load(settings.token_file) if settings.token_file else None
    tls = ServingTls.from_settings(settings)  # a certificate that cannot serve: said before anything starts
    if warning := clear_text_warning(settings.listen, tls):
        log.warning("%s", warning)
    try:  # the claim is held until kvd exits: the kernel lets it go however kvd ends
        Path(settings.state_dir).mkdir(parents=True, exist_ok=True)
        claim = FolderClaim(Path(settings.state_dir), f"pid {os.getpid()}, socket {settings.socket}")
    except FolderTaken as taken:
        raise RuntimeError(f"state_dir: {settings.state_dir!r} is in use by another kvd ({taken.holder}); give each "
                           "kvd a state_dir of its own (--state-dir; kvctl and cron jobs may share one)") from None
    except OSError as exc:  # a file where the folder should be, a folder kvd's user cannot write
        raise RuntimeError(f"state_dir: {settings.state_dir!r} cannot be used: {os_problem(exc)}; kvd keeps its "
                           "store and lock there, and needs to write it") from None
    tcp_sock = bind_tcp(settings.listen) if settings.listen else None  # a port in use: said before anything starts
    store = Store(Path(settings.state_dir) / "kvd.sqlite3")
    service = EngineService(settings, store)
    service.config_source = re_resolve
    service.tokens = tokens
    service.tls = tls
    metrics = Metrics(service)
    front = unix_front.UnixFront(settings.socket)
    raise_open_file_limit()
    unix_app = create_app(service, metrics, front="unix")
    tcp_app = create_app(service, metrics, front="tcp", tokens=tokens, trusted_proxy=settings.trusted_proxy) \
        if settings.listen else None
    service.housekeeping.add(Job("state folder claim", lambda: unix_front.CHECK_SECONDS, claim.check))  # lock deleted
    service.housekeeping.add(Job("gc pauses", lambda: 1.0, service.gc_pauses.log_slow))
    if tls is not None:  # at start, then daily: a certificate near its end is said while there is time
        service.housekeeping.add(Job("tls certificate", lambda: 86_400.0, tls.warn))
    service.gc_pauses.install()
    service.start(confine_threads=True, freeze_heap=settings.gc_freeze)
    log.info("kvd %s listening on %s%s", __version__, settings.socket,
             f" and {settings.listen}" + (" (TLS)" if tls else "") if settings.listen else "")
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_term() -> None:
        if not stopping.is_set():
            log.info("shutting down (deadline %.0fs)", service.config.shutdown_timeout)
            stopping.set()

    def reload() -> None:
        try:
            service.reload_from_source("sighup")
        except Exception as exc:  # a bad edit must not take the daemon down
            log.error("%s", exc)

    def on_hup() -> None:  # off the event loop: the reload's audit record may wait for the store (up to 30 s)
        loop.run_in_executor(None, reload)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_term)
    service.on_device_lost = lambda: loop.call_soon_threadsafe(stopping.set)  # (from the engine thread)
    service.on_stall_exit = partial(exit_stalled, front)  # (from housekeeping: the engine holds what a stop needs)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    serve_again.start(service, unix_app)  # the background responses the last stop cut short: queued from the first call
    fronts = Fronts()
    fronts.serve(unix_app, sockets=[front.sock])
    if tcp_app is not None:
        fronts.serve(tcp_app, sockets=[tcp_sock], ssl_context=tls.context if tls else None)
    keeper = asyncio.create_task(unix_front.keep(front, lambda sock: fronts.serve(unix_app, sockets=[sock])))
    service.batches.start()  # what was left of each batch at the last stop
    service.webhooks.start()  # the events not delivered before it
    await stopping.wait()
    keeper.cancel()
    await loop.run_in_executor(None, service.shutdown)
    fronts.stop()
    await asyncio.gather(keeper, fronts.wait(), return_exceptions=True)
    if not store.close(wait=STOP_STORE_WAIT_S):
        log.warning("a write to the store was still waiting for another process's write lock; it ends with kvd")
    front.remove()
    claim.close()
    service.gc_pauses.uninstall()
    service.gc_pauses.unfreeze()
    if service.device_lost:
        log.critical("stopped: the device is lost to this process; exit code %d, for the service manager to start "
                     "kvd again", DEVICE_LOST_EXIT)
        return DEVICE_LOST_EXIT
    log.info("stopped")
    return 0


@app.command()
def router(
    config: Optional[Path] = typer.Option(None, "--config", help="YAML settings file (flags and KVD_ROUTER_* win)."),
    replica: list[str] = typer.Option([], "--replica", help="A kvd replica: its Unix socket, or an http(s):// "
                                      "URL (with --token-file). Repeat for each."),
    prefill: list[str] = typer.Option([], "--prefill", help="A replica that computes prompts for the decode "
                                      "replicas, writing their KV blocks to the Redis they share (disaggregated "
                                      "prefill and decode). Repeat for each."),
    decode: list[str] = typer.Option([], "--decode", help="A replica that decodes only, its prompts' blocks from "
                                     "a --prefill replica through Redis. Repeat for each."),
    local_prefill_tokens: Optional[int] = typer.Option(None, help="With --prefill: a replica that decodes "
                                                       "computes a prompt itself when it holds all but this many "
                                                       "tokens of it (default 256)."),
    replicas_file: Optional[str] = typer.Option(None, help="More replicas, one per line (# comments); SIGHUP "
                                                "re-reads it: new lines join the fleet, removed ones are "
                                                "drained and leave once their requests have answered."),
    socket_path: Optional[str] = typer.Option(None, "--socket", help="Unix socket the router serves on (mode 0660)."),
    routing: Optional[str] = typer.Option(None, help="round_robin, least_loaded, prefix (the default) or ttft."),
    balance_seconds: Optional[float] = typer.Option(None, help="prefix: the extra wait it accepts for a replica "
                                                    "that caches more (default 2)."),
    new_prefix: Optional[str] = typer.Option(None, help="prefix: where a prompt no replica holds goes: home (the "
                                             "default: a replica named by a hash of its opening, the same from "
                                             "every router, unless it is loaded beyond a bound) or least_loaded."),
    new_prefix_slack: Optional[int] = typer.Option(None, help="prefix: a prompt is new unless some replica holds "
                                                   "this many tokens more of it than its home (or the least "
                                                   "loaded): less is the opening all prompts share, such as a chat "
                                                   "template's (default 128)."),
    prefill_rate: Optional[float] = typer.Option(None, help="ttft: prompt tokens per second of a replica that "
                                                 "has not measured its own yet (default 20000)."),
    queue_limits: Optional[str] = typer.Option(None, help="heed (the default): least_loaded, prefix and ttft pass "
                                               "over a replica whose predicted wait is past its max_queue_wait "
                                               "(it would turn the request away after that long) while another "
                                               "would start it in time; or ignore."),
    view: Optional[str] = typer.Option(None, help="How it learns what each replica caches and how busy it is: "
                                       "events (the default: follows their event feeds and polls their load; no "
                                       "call on the request's path) or ask (every replica, per request)."),
    load_interval: Optional[float] = typer.Option(None, help="events: seconds between load polls of each "
                                                  "replica (default 0.25)."),
    pending_seconds: Optional[float] = typer.Option(None, help="events: how long a prompt just sent to a "
                                                    "replica counts as cached there before its feed confirms it "
                                                    "(default 30)."),
    silent_give_up_seconds: Optional[float] = typer.Option(None, help="A request's replica that has answered none "
                                                           "of the router's questions this long is given up (the "
                                                           "caller gets a 504; default 30; 0: never, waited up to "
                                                           "the 600 s forward timeout)."),
    silent_probe_seconds: Optional[float] = typer.Option(None, help="ask: how often a replica is asked while it has "
                                                         "a request, to learn it has gone silent (default 5)."),
    reply_ids_bytes: Optional[str] = typer.Option(
        None, help="events: memory for the ids of the chat replies it relays, e.g. 64MiB (the default): a next turn "
                   "that sends a reply back is weighed as the replica prompts it, with the ids the model made; 0 "
                   "reads replies as text."),
    max_file_bytes: Optional[str] = typer.Option(
        None, help="The largest upload to /v1/files it takes, e.g. 1GiB (413 above; default 200MiB); at least "
                   "the replicas' --max-file-bytes."),
    token_file: Optional[str] = typer.Option(None, help="Bearer token (admin role) for URL replicas."),
    listen: Optional[str] = typer.Option(None, help="Also serve TCP on HOST:PORT (needs --clients-file)."),
    clients_file: Optional[str] = typer.Option(None, help="The TCP callers' tokens: TOKEN TENANT ROLE lines, "
                                               "as kvd's --token-file (mode 0600 or 0640); SIGHUP reloads it."),
    trusted_proxy: Optional[bool] = typer.Option(
        None, help="Serve a TCP caller's request under the X-KVD-Tenant it names (default: its token's tenant): "
                   "its callers are trusted front ends, or kvds whose --batch-via is this router's URL."),
    ssl_certfile: Optional[str] = typer.Option(None, help="Serve --listen over TLS with this certificate chain "
                                               "(PEM); SIGHUP reads it again, as kvd serve's."),
    ssl_keyfile: Optional[str] = typer.Option(None, help="Its private key (default: in --ssl-certfile)."),
    ssl_ca_certs: Optional[str] = typer.Option(None, help="Ask each TCP caller for a certificate signed by one of "
                                               "these CAs (mutual TLS); SIGHUP reads it again."),
    replica_ca_certs: Optional[str] = typer.Option(None, help="CAs that https replicas' certificates are checked "
                                                   "against (default: the system's)."),
    replica_client_cert: Optional[str] = typer.Option(None, help="The router's certificate for https replicas "
                                                      "that ask for one (PEM, with its key unless "
                                                      "--replica-client-key)."),
    replica_client_key: Optional[str] = typer.Option(None, help="The key of --replica-client-cert."),
    gc_freeze: Optional[bool] = typer.Option(
        None, help="Freeze the heap the router's start made (its imports), so that Python's garbage collector "
                   "does not walk it while the router serves (default on)."),
    gc_warn_seconds: Optional[float] = typer.Option(
        None, help="Log a WARNING (at most once a minute) when a garbage collection stops the router this long "
                   "or longer (default 0.1; 0: never)."),
    log_level: str = typer.Option("info", help="Log level."),
    log_format: str = typer.Option("text", help="text, or json: one JSON object a line."),
    log_requests: Optional[bool] = typer.Option(None, help="Log a line per routed request: the replica, why "
                                                "it went there, those that turned it away (default off)."),
    otlp_traces_endpoint: Optional[str] = typer.Option(
        None, help="Send a span per routed request and per try at a replica (OpenTelemetry, OTLP) to this "
                   "collector URL, e.g. http://collector:4318/v1/traces; the replicas' spans are the tries' "
                   "children. Needs the otel extra (OpenTelemetry's packages)."),
) -> None:
    """Serve one OpenAI-compatible front for several replicas, each request routed by a policy.

    It learns what every replica caches of the prompt and how busy it is (--view), picks one by
    the routing policy, and streams that replica's answer back (headers X-KVD-Replica, X-KVD-Route).
    Every setting is also a KVD_ROUTER_* variable and a field of the YAML file (--config).

    Example: kvd router --replica /run/kvd-a/kvd.sock --replica /run/kvd-b/kvd.sock --socket /run/kvd/router.sock

    Disaggregated prefill and decode, every replica with the same remote_url (Redis): kvd router
    --prefill /run/kvd-p/kvd.sock --decode /run/kvd-d/kvd.sock --socket /run/kvd/router.sock
    """
    from kvctl.daemon.config import ConfigError
    from kvctl.daemon.router_config import resolve_router, router_env_typos
    from kvctl.daemon.server.auth import TokenTable
    from kvctl.daemon.server.fleet_file import FleetFile, replica_lines
    from kvctl.daemon.server.otlp_export import span_processor
    from kvctl.daemon.server.reply_ids import ReplyIds
    from kvctl.daemon.server.route_spans import RouteSpans
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.daemon.server.tls import ServingTls, clear_text_warning, client_context
    from kvctl.policies.routing import make_router

    configure_logging(log_level, log_format)
    for line in router_env_typos(os.environ):
        log.warning("%s", line)
    try:
        settings = resolve_router(_flags(
            replicas=replica or None, prefill_replicas=prefill or None, decode_replicas=decode or None,
            local_prefill_tokens=local_prefill_tokens,
            replicas_file=replicas_file, socket=socket_path, routing=routing,
            balance_seconds=balance_seconds, new_prefix=new_prefix, new_prefix_slack=new_prefix_slack,
            prefill_rate=prefill_rate, queue_limits=queue_limits, view=view, load_interval=load_interval,
            pending_seconds=pending_seconds, reply_ids_bytes=reply_ids_bytes, max_file_bytes=max_file_bytes,
            silent_give_up_seconds=silent_give_up_seconds, silent_probe_seconds=silent_probe_seconds,
            token_file=token_file, listen=listen, clients_file=clients_file, trusted_proxy=trusted_proxy,
            gc_freeze=gc_freeze,
            gc_warn_seconds=gc_warn_seconds, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
            ssl_ca_certs=ssl_ca_certs, replica_ca_certs=replica_ca_certs, replica_client_cert=replica_client_cert,
            replica_client_key=replica_client_key, log_requests=log_requests,
            otlp_traces_endpoint=otlp_traces_endpoint), os.environ, config)
        fixed = list(settings.replicas)
        lines = replica_lines(settings.replicas_file) if settings.replicas_file else []
        listed = [spec for spec, _ in lines]
        if settings.replicas_file and not fixed + listed + [*settings.prefill_replicas, *settings.decode_replicas]:
            raise ValueError(f"replicas_file: {settings.replicas_file!r} names no replica, and no --replica is given")
        policy = make_router(settings.routing, prefill_rate=settings.prefill_rate,
                             balance_seconds=settings.balance_seconds, new_prefix=settings.new_prefix,
                             new_prefix_slack=settings.new_prefix_slack, queue_limits=settings.queue_limits)
        token = None
        if settings.token_file:
            try:
                token = Path(settings.token_file).read_text().split()[0]
            except (OSError, IndexError):
                raise ValueError(f"token_file: cannot read a token from {settings.token_file!r}") from None
        clients = TokenTable.load(settings.clients_file) if settings.listen else None
        tls = ServingTls.from_settings(settings)
        if warning := clear_text_warning(settings.listen, tls):
            log.warning("%s", warning)
        verify = client_context(settings.replica_ca_certs, settings.replica_client_cert, settings.replica_client_key,
                                names=("replica_ca_certs", "replica_client_cert"))
        roles = {**{spec: "prefill" for spec in settings.prefill_replicas},
                 **{spec: "decode" for spec in settings.decode_replicas}}
        replicas = [Replica(spec, replica_client(spec, token, verify=verify), role=role)
                    for spec, role in [(spec, "both") for spec in fixed] + [*roles.items()] + lines]
        service = RouterService(replicas, policy, view=settings.view, load_interval=settings.load_interval,
                                pending_seconds=settings.pending_seconds,
                                silent_give_up_seconds=settings.silent_give_up_seconds,
                                silent_probe_seconds=settings.silent_probe_seconds,
                                local_prefill_tokens=settings.local_prefill_tokens,
                                reply_ids=ReplyIds(settings.reply_ids_bytes))
        service.gc_pauses.warn_seconds = lambda: settings.gc_warn_seconds or None
        service.tls = tls
        service.log_requests = settings.log_requests
        service.trusted_proxy = settings.trusted_proxy
        processor = span_processor(settings.otlp_traces_endpoint)
        if processor is not None:
            service.route_spans = RouteSpans(processor)
        membership = None
        if settings.replicas_file:
            membership = FleetFile(settings.replicas_file, fixed=set(fixed) | set(roles),
                                   client=lambda spec: replica_client(spec, token, verify=verify))
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_route(service, settings.socket, settings.listen, clients, settings.clients_file, membership,
                              settings.gc_freeze, tls, settings.max_file_bytes))
    except (ConfigError, RuntimeError, OSError, ValueError) as exc:
        print(f"kvd: error: {exc}", file=sys.stderr)
        raise typer.Exit(2)


async def _route(service, socket_path: str, listen: str | None, clients, clients_file: str | None,
                 membership=None, gc_freeze: bool = True, tls=None, max_file_bytes: int | None = None) -> None:
    from kvctl.daemon.server import unix_front
    from kvctl.daemon.server.http_front import Fronts, bind_tcp, raise_open_file_limit
    from kvctl.daemon.server.loop_errors import exception_handler
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_metrics import RouterMetrics

    tcp_sock = bind_tcp(listen) if listen else None  # a port in use: said before anything starts
    front = unix_front.UnixFront(socket_path)
    raise_open_file_limit()
    metrics = RouterMetrics(service)
    uploads = {} if max_file_bytes is None else {"max_file_bytes": max_file_bytes}  # (None: the default)
    unix_app = create_router_app(service, metrics=metrics, **uploads)
    tcp_app = create_router_app(service, front="tcp", tokens=clients, metrics=metrics, **uploads) if listen else None
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(exception_handler)  # anyio's cancelled-read race at debug (loop_errors.py)
    fronts = Fronts()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop by SIGTERM is a clean exit, not a re-raised signal
        loop.add_signal_handler(sig, fronts.stop)

    def reload() -> None:  # SIGHUP: the replicas file, the TCP front's certificate, its callers' tokens
        if tls is not None:
            _rotate_certificate(tls)
        if membership is not None:
            try:
                changed = membership.apply(service)
            except ValueError as exc:
                log.error("replicas file not applied, the fleet stays as it is: %s", exc)
            else:
                log.info("replicas file applied: %d added (%s), %d leaving once their requests answer (%s)%s",
                         len(changed["added"]), ", ".join(changed["added"]) or "-",
                         len(changed["leaving"]), ", ".join(changed["leaving"]) or "-",
                         "".join(f"; {name} now {role}" for name, role in changed["roles"].items()))
        if clients is None:
            return
        from kvctl.daemon.server.auth import TokenFileError, TokenTable

        try:
            counts = clients.adopt(TokenTable.load(clients_file))
        except TokenFileError as exc:
            log.error("clients file not reloaded, the tokens in use stay: %s", exc)
            return
        log.info("clients file reloaded: %(tokens)d tokens, %(added)d added, %(removed)d removed", counts)

    loop.add_signal_handler(signal.SIGHUP, reload)
    followers = service.follow()
    from kvctl.daemon.server.fleet_rollouts import watch

    rollout_watch = asyncio.create_task(watch(lambda: service.replicas, service.ask_each, service.rollout_watch))
    log.info("kvd router listening on %s%s, %s routing over %s (view: %s)", socket_path,
             f" and {listen}" + (" (TLS)" if tls else "") if listen else "", service.router.name,
             ", ".join(r.name for r in service.replicas), service.view)
    pauses = service.gc_pauses.install()
    if gc_freeze:  # the imports and the apps: they live as long as the router (gc_pauses.py)
        pauses.frozen_at_ready = pauses.freeze()
    slow_pauses = asyncio.create_task(_every(1.0, pauses.log_slow))
    fronts.serve(unix_app, sockets=[front.sock])
    if tcp_app is not None:
        fronts.serve(tcp_app, sockets=[tcp_sock], ssl_context=tls.context if tls else None)
    keeper = asyncio.create_task(unix_front.keep(front, lambda sock: fronts.serve(unix_app, sockets=[sock])))
    certificate_check = asyncio.create_task(_every(86_400.0, tls.warn, at_once=True)) \
        if tls is not None else None
    try:
        failed = [r for r in await fronts.wait() if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
    finally:
        keeper.cancel()
        slow_pauses.cancel()
        rollout_watch.cancel()
        if certificate_check is not None:
            certificate_check.cancel()
        followers = [task for r in service.replicas for task in r.tasks]  # with those that joined later
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for r in service.replicas:
            await r.client.aclose()
        front.remove()
        pauses.uninstall()
        pauses.unfreeze()
        if service.route_spans is not None:
            service.route_spans.shutdown()  # the batched spans sent
        log.info("router stopped")


async def _every(seconds: float, job, at_once: bool = False) -> None:
    """Run `job` every `seconds` on the loop (`at_once`: first now), until cancelled."""
    if at_once:
        job()
    while True:
        await asyncio.sleep(seconds)
        job()


@app.command("webhook-secret")
def webhook_secret() -> None:
    """Print a new signing secret for webhooks_file (whsec_ and 32 random bytes in base64, as OpenAI's
    dashboard gives one): the third field of a TENANT URL SECRET line, and what the tenant's
    receiver verifies with (`client.webhooks.unwrap(body, headers, secret=...)`)."""
    from kvctl.daemon.server.webhooks import new_secret

    print(new_secret())


def _rotate_certificate(tls) -> None:
    """kvd router's SIGHUP: serve its TCP front's certificate and client CAs as their files hold
    them now (tls.py, which logs what changed); files that do not load change nothing, and the log
    says why."""
    from kvctl.daemon.server.tls import TlsFileError

    try:
        tls.adopt(tls.read_again())
    except TlsFileError as exc:
        log.error("TLS files not reloaded, the certificate and CAs served stay: %s", exc)


reflow_help(app)  # after every command is registered
keep_names_whole()


def main() -> None:
    app()

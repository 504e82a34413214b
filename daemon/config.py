"""kvd settings: one resolver, one precedence.

    command-line flag  >  KVD_* environment variable  >  YAML file (--config)  >  default

Every field can be given all three ways: `--block-size 32`, `KVD_BLOCK_SIZE=32`, or
`block_size: 32` in the file. Values are parsed and checked once, here; an invalid one
is a ConfigError naming the field, the value and where it came from.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from kvctl.daemon.cache.hit_curve import MAX_ALONE
from kvctl.daemon.default_paths import default_socket, default_state_dir
from kvctl.daemon.engine.tenant_book import DEFAULT_LIMIT as DEFAULT_TRACKED_TENANTS
from kvctl.daemon.replay.trace import TRACE_BLOCK_SIZES
from kvctl.daemon.server.byte_sizes import SIZE_EXPECTED, size_in_bytes
from kvctl.daemon.server.durations import parse_duration
from kvctl.daemon.server.engine_liveness import STALLED_AFTER_S
from kvctl.daemon.server.otlp_export import check_endpoint, traces_protocol
from kvctl.daemon.server.reasoning import REASONING_PARSERS
from kvctl.daemon.server.reply_ids import REPLY_IDS_BYTES
from kvctl.daemon.server.tool_calls import TOOL_CALL_PARSERS

MXFP4_EXPERTS = ("auto", "keep", "dequantise")  # what kvd does with an MXFP4 checkpoint's experts
from kvctl.policies.eviction import EVICTION_POLICIES
from kvctl.policies.queue_order import QUEUE_ORDERS, by_priority
from kvctl.policies.reservation import parse_reservation
from kvctl.policies.speculation import NgramSpeculation, parse_speculation
from kvctl.policies.tenant_map import TENANT_NAME, named_values, parse_tenant_map, priority_of, queue_wait_of
from kvctl.policies.tenant_shares import parse_shares
from kvctl.policies.tiering import PREFETCH_POLICIES, TIER_CODECS, WRITE_POLICIES


class ConfigError(ValueError):
    """An invalid setting; the message names field, value and source."""


# names operators know from vLLM (`--kv-cache-dtype fp8` is fp8_e4m3 there too)
CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def cache_dtype_name(name: str) -> str:
    """The cache format's own name for `name`: 'fp8' is 'fp8_e4m3'; other names unchanged."""
    return CACHE_DTYPE_ALIASES.get(str(name).strip(), str(name).strip())


def template_kwargs(value: Any) -> str | None:
    """chat_template_kwargs as canonical JSON text (None: none): a YAML mapping, or a JSON object
    from a flag or KVD_CHAT_TEMPLATE_KWARGS. Which names the template reads is checked at load."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ValueError("must be a JSON object of names the chat template reads, e.g. "
                             "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, Mapping):
        raise ValueError("must be a mapping (YAML) or a JSON object of names the chat template reads, e.g. "
                         "'{\"enable_thinking\": false}'")
    return json.dumps(dict(value), sort_keys=True) if value else None


def speculative_config(value: Any) -> str | None:
    """speculative_config as canonical JSON text with every key (None: off): a YAML mapping, or a
    JSON object from --speculative-config or KVD_SPECULATIVE_CONFIG, as vLLM takes it
    ('{"method": "ngram", "num_speculative_tokens": 4}'); each key checked (policies/speculation.py)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() and value.strip() != "none" else None
        except ValueError:
            raise ValueError("must be a JSON object such as '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}'") from None
    spec = parse_speculation(value)
    return None if spec is None else json.dumps(spec.describe(), sort_keys=True)


def speculation_of(text: str | None) -> NgramSpeculation | None:
    """The engine's speculation from the config's canonical text."""
    return None if text is None else parse_speculation(json.loads(text))


def whole_number(value: Any) -> int:
    """A setting that counts: an integer, or its digits as text. A YAML `1.5` or `true` is refused
    rather than read as 1."""
    text = str(value).strip()
    if isinstance(value, (bool, float)) or not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError("must be a whole number")
    return int(text)


def finite_number(value: Any) -> float:
    """A setting in seconds or a rate: a finite number (a YAML `true` is refused, not read as 1.0)."""
    if isinstance(value, bool):
        raise ValueError("must be a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("must be a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return number


def _count_or_auto(text: Any) -> int | None:
    """A whole number, or "auto" (None: the daemon decides)."""
    value = str(text).strip().lower()
    if value == "auto":
        return None
    if not value.isdigit():
        raise ValueError("must be a whole number >= 0 or auto")
    return int(value)


def _limit(tenant: str, value: Any) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"limit of {tenant!r} must be a whole number >= 1, got {value!r}")
    return number


def _bytes_of(tenant: str, value: Any) -> int:
    """A tenant's budget of bytes (tenant_files_bytes); ValueError names the tenant and the value."""
    try:
        amount = size_in_bytes(value)
    except ValueError:
        raise ValueError(f"bytes of {tenant!r} {SIZE_EXPECTED}, got {value!r}") from None
    if amount < 0:
        raise ValueError(f"bytes of {tenant!r} must be >= 0, got {value!r}")
    return amount


def _retention_of(tenant: str, value: Any) -> str:
    setting = str(value).strip().lower()
    if setting not in RETENTION_SETTINGS:
        raise ValueError(f"prompt_cache_retention of {tenant!r} must be {' or '.join(RETENTION_SETTINGS)}, "
                         f"got {value!r}")
    return setting


def retention_for(config: "KvdConfig", tenant: str | None) -> str:
    """Whether `tenant`'s requests that ask for `prompt_cache_retention: "24h"` are kept so (honour) or
    served as "in_memory" (ignore): its own setting (tenant_prompt_cache_retention), else kvd's."""
    if tenant is not None:
        for name, setting in config.tenant_prompt_cache_retention:
            if name == tenant:
                return setting
    return config.prompt_cache_retention


def parse_lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """lora_modules: "name=DIR,name2=DIR2" or a mapping of name to folder -> (name, folder) pairs in
    the order given; ValueError names a part that is not NAME=DIR, or a name given twice."""
    items = [(name.strip(), "" if path is None else str(path).strip())
             for name, path in named_values(value, "NAME=DIR")]
    seen: set[str] = set()
    for name, path in items:
        if not name or not path:
            raise ValueError(f"expected NAME=DIR, got {name!r}={path!r}")
        if name in seen:
            raise ValueError(f"adapter {name!r} is given twice")
        seen.add(name)
    return tuple(items)


def on_or_off(text: Any) -> bool:
    """A switch: a YAML boolean, or 1/0, true/false, yes/no, on/off as text."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be on or off (true/false, yes/no, 1/0)")


CACHED_TOKEN_REPORTS = ("all", "admin", "none")  # report_cached_tokens: who sees usage's cached_tokens
# prompt_cache_retention: whether a request's "24h" writes its blocks to the persistent tiers as it ends;
# predicted_outputs: whether a chat's prediction is drafted
RETENTION_SETTINGS = ("honour", "ignore")
MAX_FILE_BYTES = 200 * 2**20  # max_file_bytes' default: the largest input file of OpenAI's Batch API


@dataclass(frozen=True)
class KvdConfig:
    model: str | None = None  # checkpoint directory; None = the built-in demo checkpoint
    state_dir: str = field(default_factory=default_state_dir)
    socket: str = field(default_factory=default_socket)
    listen: str | None = None  # HOST:PORT for TCP (needs token_file)
    token_file: str | None = None  # lines "TOKEN TENANT ROLE", role user, proxy (names X-KVD-Tenant) or admin
    trusted_proxy: bool = False  # honour X-KVD-Tenant on TCP (a trusted front end sets it)
    # TLS on the TCP front (server/tls.py): the certificate chain (PEM), its key (absent: in the chain's
    # file), and CAs whose certificate each client must present (mutual TLS; absent: none asked)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    # who sees `usage.prompt_tokens_details.cached_tokens`: all (as OpenAI reports it), admin (callers
    # with the admin role; the others get usage without it, as vLLM answers by default) or none. A
    # count of cached tokens tells a caller whether a guessed prompt is in the cache, block by block
    # (prompt-cache probing, CVE-2025-46570): `admin` where one tenant's callers do not trust each other
    report_cached_tokens: str = "all"
    prompt_cache_retention: str = "honour"  # or ignore: a request's "24h" is served as "in_memory"
    # honour: the prefixes a request marks with OpenAI's prompt_cache_breakpoint are held for their ttl
    # (server/cache_breakpoints.py; the tenant's pin budget pays); ignore: served as if it marked none
    prompt_cache_breakpoints: str = "honour"
    # tenants whose requests are served in OpenAI's explicit prompt cache mode whatever they ask ("*": every
    # tenant): their prompts are cached only up to the prefixes they mark, none where they mark none
    prompt_cache_explicit_tenants: tuple[str, ...] = ()
    # honour: a chat's `prediction` (OpenAI's Predicted Outputs) is drafted ahead of its reply
    # (engine/speculative.py); ignore: it is served as a chat without one
    predicted_outputs: str = "honour"
    # a chat's prediction is drafted only while at most this many sequences run (vLLM's speculative
    # disable_by_batch_size, for predictions: a full batch is compute-bound); None: at any batch size
    prediction_max_batch: int | None = None
    # per-tenant settings that override it: "acme=honour,free=ignore" (YAML: a mapping)
    tenant_prompt_cache_retention: tuple[tuple[str, str], ...] = ()
    # kvd's log while it serves (server/request_log.py), both live on a reload: a logfmt line per finished
    # request (ids, tenant, counts, times; never text or token ids), and the engine's summary every N s (0: none)
    log_requests: bool = False
    log_stats_interval: float = 10.0
    # OpenTelemetry: a span per request sent over OTLP/HTTP to this collector URL (server/request_spans.py)
    otlp_traces_endpoint: str | None = None
    device: str = "auto"  # auto, cpu or cuda
    dtype: str = "auto"  # auto (the checkpoint's), float32, bfloat16, float16
    block_size: int = 16
    num_blocks: int | None = None  # wins over cache_memory
    cache_memory: int | None = None  # bytes for the KV cache; default 256 MiB on CPU, 80% free on GPU
    max_batch_tokens: int = 256
    # the longest context served, below the model's own limit (vLLM's --max-model-len): a chat that
    # leaves max_tokens out reserves what its context has left up to it; None: the model's limit
    max_model_len: int | None = None
    # prompts with at most this many tokens left get a step of their own ahead of the decodes;
    # None: auto (64 on a CPU, 0 on a GPU, see quick_prefill_default)
    quick_prefill_tokens: int | None = None
    max_running: int = 32
    max_queue: int = 256
    # seconds a request may wait to be admitted; past it, turned away (503, queue_timeout); 0: no limit
    max_queue_wait: float = 0.0
    max_tenant_requests: int | None = None  # one tenant's requests in flight at most (429 beyond); None: no limit
    # per-tenant limits that override it: "acme=128,free=4" (YAML: a mapping)
    tenant_request_limits: tuple[tuple[str, int], ...] = ()
    # per-tenant queue wait limits that override max_queue_wait: "batch=600,chat=10" (YAML: a mapping; 0: none)
    tenant_queue_waits: tuple[tuple[str, float], ...] = ()
    reservation: str = "fraction:1.0"
    eviction: str = "lru"
    queue_order: str = "fifo"
    # with queue_order: priority, each tenant's place in the queue: "acme=-10,batch=5" (YAML: a mapping),
    # lower first as vLLM orders `priority`; tenants not named are at 0
    tenant_priorities: tuple[tuple[str, int], ...] = ()
    pin_budget_blocks: int | None = None  # None: half the cache's blocks per tenant
    # the room, in tokens of one request (prompt and max_tokens), that a new pin must leave
    # beside the pins; None: the context served or half the cache, whichever is less; 0: none
    pin_room_tokens: int | None = None
    # "acme=0.25,*=0.5" (YAML: a mapping): when the cache needs room, a tenant holding more idle
    # blocks than its fraction of the device cache loses its own first (policies/tenant_shares.py)
    tenant_cache_shares: tuple[tuple[str, float], ...] = ()
    shutdown_timeout: float = 30.0
    # once the engine has been stalled this long (a step that never ends: only a new process recovers),
    # kvd exits (75) for its service manager to start it again (engine_liveness.py); 0: never
    engine_stall_exit_seconds: float = 300.0
    max_request_bytes: int = 32 * 2**20  # a bigger request body is refused (413) before it is read whole
    # the largest file POST /v1/files takes, its body's cap in place of max_request_bytes
    max_file_bytes: int = MAX_FILE_BYTES
    # the bytes /v1/files keeps in state_dir/files, every tenant's together (batch_files.py): an upload past
    # them is refused (507), nothing kept is removed for room; a batch's output is written whatever its size
    files_store_bytes: int = 8 * 2**30
    # one tenant's share of those: "acme=20GiB,*=1GiB" (YAML: a mapping; * each tenant not named); an
    # upload past its tenant's is refused (400); none: files_store_bytes alone bounds each tenant's files
    tenant_files_bytes: tuple[tuple[str, int], ...] = ()
    # files (uploads and batches' outputs) older than this many seconds are removed as an expired one is,
    # whatever their own expires_after (the earlier of the two counts; a running batch's input once the
    # batch has ended); "30d" in YAML or on the command line; None: kept until deleted or their own expiry
    files_max_age: float | None = None
    # the responses /v1/responses keeps for previous_response_id, in memory (response_store.py); 0: none
    responses_store_bytes: int = 64 * 2**20
    # requests of /v1/batches served at once, across every tenant's batches (each batch's in turn)
    batch_concurrency: int = 8
    # a kvd router: a batch's requests are sent through it, spread across its fleet by their prompts, as the
    # batch's tenant: its Unix socket (whose callers are trusted), or the http(s) URL of its TCP front (run with
    # --trusted-proxy), reached as the three settings after it say (server/batch_via.py); None: served here alone
    batch_via: str | None = None
    batch_via_token_file: str | None = None  # a URL's bearer token: an admin token of the router's clients_file
    batch_via_ca_file: str | None = None  # CAs an https URL's certificate is checked against (default: the system's)
    batch_via_client_cert: str | None = None  # kvd's certificate and key (PEM) for a router that asks for one
    # OpenAI's webhooks when a batch or a background response ends: TENANT URL SECRET lines, * for every tenant
    # not named (server/webhooks.py); re-read on reload; None: none sent
    webhooks_file: str | None = None
    # a SQLite file the kept responses are written to as well, and read back from at start, so a
    # restart keeps them (response_file.py); None: memory only
    responses_store_file: str | None = None
    # kept responses older than this many seconds are let go, and conversations unchanged for as long, from
    # the file too ("30d" in YAML or on the command line; housekeeping checks every minute); None: kept until
    # room or a purge needs them
    responses_max_age: float | None = None
    # the conversations /v1/conversations keeps (and a response's `conversation` continues), in memory
    # (conversation_store.py); the least recently used go first; 0: none
    conversations_store_bytes: int = 64 * 2**20
    # truncation "auto" (/v1/responses): the share of the room for the prompt a cut leaves free, so that the
    # turns after it come from the prefix cache until they fill it (response_truncation.py); 0: the fewest turns
    truncation_headroom: float = 0.25
    # the token ids of recent chat replies, by their text, per tenant (reply_ids.py): a next turn that sends
    # one back is prompted with the ids the model made, and finds its blocks cached; 0: none (tokenized again)
    reply_ids_bytes: int = REPLY_IDS_BYTES
    model_name: str | None = None  # the name /v1/models lists; default: the checkpoint folder
    chat_template: str | None = None  # a Jinja file for /v1/chat/completions; default: the checkpoint's own
    # what every chat's template gets unless the request's chat_template_kwargs say otherwise, as JSON
    # text ('{"enable_thinking": false}'; YAML: a mapping), vLLM's --default-chat-template-kwargs
    chat_template_kwargs: str | None = None
    # vLLM's --generation-config: auto (the checkpoint's generation_config.json gives a request's
    # sampling defaults), none (kvd's own), or a path (daemon/model/generation_config.py)
    generation_config: str = "auto"
    # where a reasoning model's thinking goes (vLLM's --reasoning-parser): none (in content, as
    # written), qwen3, deepseek_r1 or openai_gptoss (apart, in reasoning and reasoning_content;
    # server/reasoning.py)
    reasoning_parser: str = "none"
    # how a chat reply's tool calls are read (vLLM's --tool-call-parser): none (chats may show the model
    # tools with tool_choice none; no calls are parsed), hermes, llama3_json, mistral, pythonic or
    # openai (gpt-oss's harmony; with reasoning_parser openai_gptoss) (server/tool_calls.py)
    tool_call_parser: str = "none"
    # LoRA adapters served beside the model (vLLM's --lora-modules): "name=DIR,name2=DIR2" (YAML: a
    # mapping), each a PEFT adapter folder; a request names one in `model` (daemon/model/lora.py)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, under its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING) for admin callers; off, they answer 403
    lora_runtime_updates: bool = False
    # an MXFP4 checkpoint's experts (gpt-oss): keep (as published; a GPU's grouped GEMMs decode each tile,
    # a CPU dequantises each chosen expert per step, ~30x the GEMM), dequantise (as they load, to the
    # model's dtype: about 3.8x their memory, no decoding per step), or auto (keep on a GPU, dequantise on a CPU)
    mxfp4_experts: str = "auto"
    # LoRA adapters in one batch at most (vLLM's --max-loras, SGLang's --max-loras-per-batch): each
    # adds its own small GEMMs to every step; None: no limit
    max_loras: int | None = None
    # speculative decoding by prompt lookup (vLLM's --speculative-config, method ngram), as canonical
    # JSON text ({"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    # "disable_by_batch_size"}; YAML: a mapping); None: off (engine/speculative.py)
    speculative_config: str | None = None
    cache_dtype: str = "auto"  # auto (the model's), fp8_e4m3, fp8_e5m2, int8
    keep_layers_unquantised: str | None = None  # "0,31"; default: the calibration's recommendation
    allow_uncalibrated: bool = False  # serve a quantised cache with unit scales (loudly)
    # lower tiers (all optional); in YAML also as `tiers: {host: {bytes}, disk: {bytes, path}, remote: {url, bytes}}`
    host_cache_bytes: int | None = None
    disk_cache_bytes: int | None = None
    disk_cache_path: str | None = None  # default: STATE_DIR/kvcache
    remote_url: str | None = None  # redis://HOST:PORT/DB, rediss://, unix://, redis+cluster://HOST:PORT
    remote_cache_bytes: int | None = None  # what this daemon may write to the remote tier
    remote_timeout: float = 0.5  # seconds per Redis call
    write_policy: str = "write_back"  # or write_through, write_through_selective
    tiering: str = "measured"  # measured (judge from measured rates) or always (keep and restore everything)
    # how disk and Redis store a block (YAML also `tiers: {compress: int8}`): none (the device's bytes),
    # int8 or fp8_e4m3 (about half a 16-bit block; lossy, daemon/cache/tiers/codec.py); disk_compress
    # and remote_compress (YAML `tiers: {disk: {compress}}`) set one of them apart (None: tier_compress)
    tier_compress: str = "none"
    disk_compress: str | None = None
    remote_compress: str | None = None
    # how long a waiting request holds out for its prefix to come up from disk or Redis (SGLang
    # HiCache's policies): timeout (prefetch_timeout + prefetch_timeout_per_1k_tokens per 1,024
    # tokens fetched), best_effort (never wait) or wait_complete (until the fetch ends)
    prefetch_policy: str = "timeout"
    prefetch_timeout: float = 2.0
    prefetch_timeout_per_1k_tokens: float = 0.0
    # /metrics also under vLLM's and/or SGLang's metric names (daemon/server/metric_aliases.py): "vllm,sglang"
    metrics_aliases: tuple[str, ...] = ()
    # per-tenant metric families name this many tenants (the first seen) at most; the rest are summed
    # under tenant="*" (daemon/server/tenant_labels.py)
    max_tenant_metric_series: int = 100
    # tenants whose counters (prompt tokens, hits, recomputed tokens, rejections) and latest TTFTs
    # are kept by name, the most recently active; the others' counters are summed as retired
    # (daemon/engine/tenant_book.py), so kvd's memory does not grow with its tenants
    max_tracked_tenants: int = DEFAULT_TRACKED_TENANTS
    # finished requests kept as trace lines for `kvctl trace save` (daemon/server/request_trace.py); 0: none
    trace_requests: int = 10_000
    # follow every prompt block's reuse distance for `kvctl hit-curve` (daemon/cache/hit_curve.py): about
    # 5 us a block on the engine thread and 15 MiB; false leaves it out (a restart applies it)
    hit_curve: bool = True
    # tenants the hit curve also follows alone, as in a tenant cache share of their own, to size
    # their shares by (`kvctl hit-curve --tenant T`; 8 at most, about 1-3 MiB each); none named:
    # the first 8 tenant_cache_shares names
    hit_curve_tenants: tuple[str, ...] = ()
    # a file holding the secret that keys the trace's block ids (at least 32 bytes); the replicas of
    # a fleet given one file trace equal prompts alike, so kvd router can save the fleet's trace.
    # None: a key kvd draws at start
    trace_key_file: str | None = None
    # prompt tokens per trace block id: 512 is the Mooncake format's; finer (16 to 256) keeps sharing
    # past a 512-token boundary for the replay, for more ids a line (daemon/server/request_trace.py)
    trace_block_tokens: int = 512
    # Python's garbage collector (daemon/server/gc_pauses.py): freeze the heap kvd serve's start made,
    # so that a collection of the oldest generation does not walk it (108-143 ms a walk on 2 cores);
    # a WARNING for any collection that stops every thread for gc_warn_seconds or more (0: none)
    gc_freeze: bool = True
    gc_warn_seconds: float = 0.1
    # where each setting came from ("--max-queue", "KVD_MAX_QUEUE", the YAML file's path); absent: the default
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def tier_codecs(self) -> dict[str, str]:
        """The codec asked for each payload tier: its own setting, else `tier_compress`."""
        return {"disk": self.disk_compress or self.tier_compress, "remote": self.remote_compress or self.tier_compress}

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}

    def shown(self) -> dict[str, Any]:
        """`describe()` as an operator may see it (`kvctl config show`, tickets, logs): a password
        in the remote tier's URL is replaced by ***."""
        return {**self.describe(), "remote_url": redact_url(self.remote_url)}


def redact_url(url: Any) -> Any:
    """redis://user:secret@host:6379/0 -> redis://user:***@host:6379/0; anything else as it is."""
    if not isinstance(url, str) or "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


METRIC_ALIAS_SETS = ("vllm", "sglang")  # metric names kvd can also export its figures under


def name_list(value: Any) -> tuple[str, ...]:
    """Names from `a,b` (each stripped) or a YAML list, each once, in order; `none` or empty: none."""
    names = value if isinstance(value, (list, tuple)) else (part.strip() for part in str(value).split(","))
    return tuple(dict.fromkeys(str(name) for name in names if name and name != "none"))


_PARSERS = {
    "block_size": whole_number, "num_blocks": whole_number, "cache_memory": size_in_bytes,
    "max_request_bytes": size_in_bytes, "max_file_bytes": size_in_bytes, "files_store_bytes": size_in_bytes,
    "responses_store_bytes": size_in_bytes, "responses_max_age": parse_duration, "files_max_age": parse_duration,
    "conversations_store_bytes": size_in_bytes,
    "reply_ids_bytes": size_in_bytes,
    "truncation_headroom": finite_number,
    "max_batch_tokens": whole_number, "max_model_len": whole_number, "max_running": whole_number,
    "batch_concurrency": whole_number,
    "max_queue": whole_number, "max_queue_wait": finite_number, "max_loras": whole_number,
    "prediction_max_batch": whole_number,
    "max_tenant_requests": whole_number, "max_tenant_metric_series": whole_number,
    "max_tracked_tenants": whole_number, "trace_requests": whole_number,
    "trace_block_tokens": whole_number,
    "pin_budget_blocks": whole_number, "pin_room_tokens": whole_number, "shutdown_timeout": finite_number,
    "engine_stall_exit_seconds": finite_number,
    "gc_freeze": on_or_off, "gc_warn_seconds": finite_number, "hit_curve": on_or_off,
    "hit_curve_tenants": name_list, "prompt_cache_explicit_tenants": name_list,
    "trusted_proxy": on_or_off, "allow_uncalibrated": on_or_off, "lora_runtime_updates": on_or_off,
    "log_requests": on_or_off, "log_stats_interval": finite_number,

    "tenant_cache_shares": parse_shares,
    "chat_template_kwargs": template_kwargs, "speculative_config": speculative_config,
    "tenant_priorities": lambda v: parse_tenant_map(v, priority_of, "priority"),
    "tenant_request_limits": lambda v: parse_tenant_map(v, _limit, "limit"),
    "tenant_files_bytes": lambda v: parse_tenant_map(v, _bytes_of, "bytes", others=True, noun="budget"),
    "tenant_queue_waits": lambda v: parse_tenant_map(v, queue_wait_of, "seconds", noun="queue wait"),
    "tenant_prompt_cache_retention": lambda v: parse_tenant_map(v, _retention_of, "setting"),
    "lora_modules": parse_lora_modules,
    "metrics_aliases": name_list,
    "quick_prefill_tokens": _count_or_auto, "cache_dtype": cache_dtype_name,
    "host_cache_bytes": size_in_bytes, "disk_cache_bytes": size_in_bytes, "remote_cache_bytes": size_in_bytes,
    "remote_timeout": finite_number,
    "prefetch_timeout": finite_number, "prefetch_timeout_per_1k_tokens": finite_number,
    "keep_layers_unquantised": lambda v: ",".join(str(int(x)) for x in (v if isinstance(v, list) else str(v).split(",")) if str(x).strip()),
}


def _check(name: str, value: Any) -> None:
    if name == "block_size" and value not in (8, 16, 32, 64, 128, 256):
        raise ValueError("must be one of 8, 16, 32, 64, 128, 256")
    if name in ("num_blocks", "max_batch_tokens", "max_running", "max_queue", "cache_memory", "max_tenant_requests",
                "max_tracked_tenants", "max_model_len", "max_loras", "batch_concurrency", "prediction_max_batch") \
            and value is not None and value < 1:
        raise ValueError("must be >= 1")
    if name in ("pin_budget_blocks", "pin_room_tokens", "quick_prefill_tokens", "max_tenant_metric_series", "trace_requests") \
            and value is not None \
            and value < 0:
        raise ValueError("must be >= 0")
    if name == "trace_block_tokens" and value not in TRACE_BLOCK_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, TRACE_BLOCK_SIZES))}")
    if name == "batch_via" and value is not None and not (
            str(value).startswith("/") or (str(value).startswith(("http://", "https://"))
                                           and urllib.parse.urlsplit(str(value)).hostname)):
        raise ValueError("must be a kvd router's Unix socket (a path) or the http(s) URL of its TCP front")
    if name in ("max_request_bytes", "max_file_bytes") and value < 4096:
        raise ValueError("must be at least 4KiB")
    if name == "files_store_bytes" and value < 0:
        raise ValueError("must be >= 0 (0: no upload is kept)")
    if name == "shutdown_timeout" and value <= 0:
        raise ValueError("must be > 0")
    if name == "engine_stall_exit_seconds" and value != 0 and not value >= STALLED_AFTER_S:
        raise ValueError(f"must be 0 (never) or >= {STALLED_AFTER_S:g} (the engine is stalled once its loop has not "
                         f"come round in {STALLED_AFTER_S:g} s)")
    if name == "truncation_headroom" and not 0 <= value < 1:
        raise ValueError("must be from 0 (a cut drops the fewest turns) to below 1")
    if name == "gc_warn_seconds" and value < 0:
        raise ValueError("must be >= 0 (0: no warning)")
    if name == "max_queue_wait" and value < 0:
        raise ValueError("must be a number of seconds >= 0 (0: no limit)")
    if name == "log_stats_interval" and value < 0:
        raise ValueError("must be a number of seconds >= 0 (0: no summary)")
    if name == "otlp_traces_endpoint":
        check_endpoint(value)
    if name == "reasoning_parser" and value not in REASONING_PARSERS:
        raise ValueError(f"must be one of {', '.join(REASONING_PARSERS)}")
    if name == "mxfp4_experts" and value not in MXFP4_EXPERTS:
        raise ValueError(f"must be one of {', '.join(MXFP4_EXPERTS)}")
    if name == "tool_call_parser" and value not in TOOL_CALL_PARSERS:
        raise ValueError(f"must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if name == "generation_config" and not str(value).strip():
        raise ValueError("must be auto, none, or a path to generation_config.json or its folder")
    if name == "device" and value not in ("auto", "cpu", "cuda"):
        one_of_several = str(value).startswith("cuda:")  # kvd runs on its process's first GPU
        raise ValueError("must be auto, cpu or cuda" + ("; for GPU N of several, start kvd with "
                                                        "CUDA_VISIBLE_DEVICES=N (examples/kvd@.service)"
                                                        if one_of_several else ""))
    if name == "dtype" and value not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError("must be auto, float32, bfloat16 or float16")
    if name == "eviction" and value not in EVICTION_POLICIES:
        raise ValueError(f"must be one of {', '.join(EVICTION_POLICIES)}")
    if name == "queue_order" and value not in QUEUE_ORDERS:
        raise ValueError(f"must be {', '.join(QUEUE_ORDERS[:-1])} or {QUEUE_ORDERS[-1]}")
    if name in ("prompt_cache_retention", "predicted_outputs", "prompt_cache_breakpoints") \
            and value not in RETENTION_SETTINGS:
        raise ValueError(f"must be {' or '.join(RETENTION_SETTINGS)}")
    if name == "report_cached_tokens" and value not in CACHED_TOKEN_REPORTS:
        raise ValueError(f"must be {', '.join(CACHED_TOKEN_REPORTS[:-1])} or {CACHED_TOKEN_REPORTS[-1]}")
    if name == "reservation":
        parse_reservation(value)
    if name == "prompt_cache_explicit_tenants":
        bad = [n for n in value if n != "*" and not TENANT_NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"tenant {bad[0]!r} is not a tenant name (letters, digits, . _ -) or *")
    if name == "hit_curve_tenants":
        bad = [n for n in value if not TENANT_NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"tenant {bad[0]!r} is not a tenant name (letters, digits, . _ -)")
        if len(value) > MAX_ALONE:
            raise ValueError(f"at most {MAX_ALONE} tenants, got {len(value)}")
    if name == "metrics_aliases":
        unknown = [n for n in value if n not in METRIC_ALIAS_SETS]
        if unknown:
            raise ValueError(f"unknown alias set {unknown[0]!r}; use {', '.join(METRIC_ALIAS_SETS)} (comma-separated)")
    if name == "cache_dtype" and value not in ("auto", "fp8_e4m3", "fp8_e5m2", "int8"):
        raise ValueError("must be auto, fp8_e4m3 (or fp8), fp8_e5m2 or int8")
    if name in ("host_cache_bytes", "disk_cache_bytes", "remote_cache_bytes") and value is not None and value < 1:
        raise ValueError("must be >= 1")
    if name == "remote_timeout" and not value > 0:
        raise ValueError("must be > 0")
    if name == "write_policy" and value not in WRITE_POLICIES:
        raise ValueError(f"must be {', '.join(WRITE_POLICIES[:-1])} or {WRITE_POLICIES[-1]}")
    if name == "tiering" and value not in ("measured", "always"):
        raise ValueError("must be measured or always")
    if name in ("tier_compress", "disk_compress", "remote_compress") and value is not None \
            and value not in TIER_CODECS:
        raise ValueError(f"must be {', '.join(TIER_CODECS[:-1])} or {TIER_CODECS[-1]}")
    if name == "prefetch_policy" and value not in PREFETCH_POLICIES:
        raise ValueError(f"must be {', '.join(PREFETCH_POLICIES[:-1])} or {PREFETCH_POLICIES[-1]}")
    if name == "prefetch_timeout" and not value > 0:
        raise ValueError("must be a number of seconds > 0 (for no limit, use prefetch_policy: wait_complete)")
    if name == "prefetch_timeout_per_1k_tokens" and not value >= 0:
        raise ValueError("must be a number of seconds >= 0")
    if name == "remote_url" and value is not None and not str(value).startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://")):
        raise ValueError("must start with redis://, rediss://, unix:// or redis+cluster://")
    if name == "remote_url" and value is not None and not str(value).startswith("unix://"):
        try:  # a port that is no number failed only when the tiers were built, naming no setting
            port = urllib.parse.urlsplit(str(value)).port
        except ValueError:
            port = -1
        if port is not None and not 0 < port < 65536:
            raise ValueError("the port must be a number from 1 to 65535")
    if name == "listen" and value is not None:
        host, _, port = str(value).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be HOST:PORT")


_TIER_FIELDS = {("host", "bytes"): "host_cache_bytes", ("disk", "bytes"): "disk_cache_bytes",
                ("disk", "path"): "disk_cache_path", ("remote", "url"): "remote_url",
                ("remote", "bytes"): "remote_cache_bytes", ("remote", "timeout"): "remote_timeout",
                ("disk", "compress"): "disk_compress", ("remote", "compress"): "remote_compress"}


def _flatten_tiers(values: dict, source: str) -> dict:
    """`tiers: {host: {bytes}, disk: {bytes, path}, remote: {url, bytes, timeout}, compress}` -> flat fields."""
    if "tiers" not in values:
        return values
    out = {k: v for k, v in values.items() if k != "tiers"}
    tiers = values["tiers"] or {}
    if not isinstance(tiers, dict):
        raise ConfigError(f"tiers: must be a mapping of host, disk, remote in {source!r}")
    for tier, settings in tiers.items():
        if tier == "compress":  # how disk and Redis store blocks: one setting for both
            out["tier_compress"] = settings
            continue
        if tier not in ("host", "disk", "remote"):
            raise ConfigError(f"tiers: unknown tier {tier!r} in {source!r}; use host, disk, remote or compress")
        if not isinstance(settings, dict):
            raise ConfigError(f"tiers.{tier}: must be a mapping in {source!r}")
        for key, value in settings.items():
            name = _TIER_FIELDS.get((tier, key))
            if name is None:
                raise ConfigError(f"tiers.{tier}: unknown field {key!r} in {source!r}"
                                  + did_you_mean(key, [k for t, k in _TIER_FIELDS if t == tier]))
            out[name] = value
    return out


def quick_prefill_default(device: str) -> int:
    """`quick_prefill_tokens` when unset: 64 on a CPU, 0 on a GPU.

    On a CPU a step's time grows with its rows, so a short prompt run alone is quick and its first
    token comes sooner than in a step that also carries every decode (kvd on the demo checkpoint,
    2 cores, 10 cold pairs: TTFT p50 28.9 -> 18.2 ms, cached / uncached TTFT 0.24 -> 0.15, output
    tokens/s within the noise; docs/results/2026-11-29-bench-serve-cpu.md). On a GPU a step costs
    about the same with or without the decodes, so a separate step would only make them wait."""
    return 0 if device == "cuda" else 64


def did_you_mean(word: str, choices, quote=repr) -> str:
    """` (did you mean 'block_size'?)` for a near miss among `choices`; empty when none is near."""
    import difflib

    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {quote(near[0])}?)" if near else ""


def env_typos(env: Mapping[str, str], names: set[str], prefix: str, program: str,
              not_ours: tuple[str, ...] = ()) -> list[str]:
    """A line for each `prefix`* variable in `env` that names no setting (KVD_MAX_RUNING=8 in a unit
    file would be ignored without a word), leaving out those that start with `not_ours` (another
    program's: kvctl's KVD_URL, kvd router's KVD_ROUTER_*)."""
    known = {prefix + name.upper() for name in names}
    return [f"{variable} is not a {program} setting and is ignored"
            + did_you_mean(variable, known, quote=str)
            for variable in sorted(env) if variable.startswith(prefix) and variable not in known
            and not variable.startswith(not_ours)]


def read_settings_file(config_file: str | Path, names: set[str], flatten=lambda values, source: values) -> dict:
    """The YAML file's mapping of settings, refused whole (naming the file) when it cannot be read,
    does not parse, is not a mapping, or names a field there is not."""
    import yaml

    path = Path(config_file)
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config: cannot read {str(path)!r} ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {str(path)!r} is not valid YAML ({exc})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {str(path)!r} must hold a mapping of settings")
    loaded = flatten(loaded, str(path))
    unknown = sorted(set(loaded) - names)
    if unknown:
        raise ConfigError(f"config: unknown field {unknown[0]!r} in {str(path)!r}{did_you_mean(unknown[0], names)}")
    return loaded


def setting_names(settings_class) -> set[str]:
    """The settings a settings dataclass holds (`sources`, where each came from, is not one)."""
    return {f.name for f in fields(settings_class)} - {"sources"}


def field_defaults(settings_class) -> dict[str, Any]:
    """Each field of a settings dataclass with its default value."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(settings_class) if f.default is not MISSING or f.default_factory is not MISSING}


def merge_settings(names: set[str], flags: Mapping[str, Any] | None, env: Mapping[str, str], env_prefix: str,
                   file_values: Mapping[str, Any], config_file: str | Path | None,
                   parsers: Mapping[str, Any], check, defaults: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each setting from its first source by precedence (flag > env > file; absent: the default),
    parsed and checked: (values, where each came from). A bad value is a ConfigError naming the
    setting, the value (a URL's password hidden) and its source. A key the file leaves empty
    (`max_running:`) is refused where the setting's default is a value, which an empty key would
    not mean; where the default is none (None, or an empty list or map) it is that default."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        flag_value = (flags or {}).get(name)
        env_value = env.get(env_prefix + name.upper())
        if flag_value is not None:
            raw, source = flag_value, f"--{name.replace('_', '-')}"
        elif env_value is not None and env_value != "":
            raw, source = env_value, f"{env_prefix}{name.upper()}"
        elif name in file_values:
            raw, source = file_values[name], str(config_file)
        else:
            continue
        default = defaults.get(name)
        if raw is None and default in ((), {}):  # an empty list or map: none, which is the default
            values[name], sources[name] = default, source
            continue
        if raw is None and default is not None:
            raise ConfigError(f"{name}: no value given in {source}; give one, or leave the line out for the "
                              f"default ({redact_url(default)!r})")
        try:
            value = None if raw is None else parsers.get(name, str)(raw)
            check(name, value)
        except (ValueError, TypeError) as exc:
            detail = str(exc) or "has the wrong type"
            raise ConfigError(f"{name}: invalid value {redact_url(raw)!r} from {source}: {detail}") from None
        values[name] = value
        sources[name] = source
    return values, sources


def resolve(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            config_file: str | Path | None = None) -> KvdConfig:
    """Merge the sources by precedence (flag > env > file > default) and validate every field."""
    env = os.environ if env is None else env
    names = setting_names(KvdConfig)
    file_values = read_settings_file(config_file, names, _flatten_tiers) if config_file is not None else {}
    values, sources = merge_settings(names, flags, env, "KVD_", file_values, config_file, _PARSERS, _check,
                                     field_defaults(KvdConfig))
    config = KvdConfig(**values, sources=sources)
    if config.listen and not config.token_file:
        raise ConfigError(f"listen: {config.listen!r} needs token_file: TCP requests must carry a bearer token")
    check_tls_settings(config)
    check_traces_protocol(config, env)
    check_priorities(config)
    check_batch_via(config)
    if config.hit_curve_tenants and not config.hit_curve:
        raise ConfigError(f"hit_curve_tenants: set (from {config.sources.get('hit_curve_tenants', 'the config')}) "
                          "but hit_curve is false: the tenants are followed beside the curve; set hit_curve: true")
    if config.tool_call_parser == "openai" and config.reasoning_parser != "openai_gptoss":
        raise ConfigError(f"tool_call_parser: openai (from {config.sources.get('tool_call_parser', 'the config')}) "
                          "reads calls in harmony's channels, which reasoning_parser openai_gptoss reads, but "
                          f"reasoning_parser is {config.reasoning_parser!r}; set reasoning_parser: openai_gptoss")
    return config


def kvd_env_typos(env: Mapping[str, str]) -> list[str]:
    """`env_typos` for kvd serve: kvctl's KVD_URL and kvd router's KVD_ROUTER_* are not kvd's."""
    return env_typos(env, setting_names(KvdConfig), "KVD_", "kvd serve", not_ours=("KVD_ROUTER_", "KVD_URL"))


def check_traces_protocol(config, env: Mapping[str, str]) -> None:
    """Where spans are sent (otlp_traces_endpoint), the OTLP protocol the environment names must be
    one the exporters speak (otlp_export.py): refused at start, not when the first span goes."""
    if config.otlp_traces_endpoint is not None:
        try:
            traces_protocol(env)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_tls_settings(config) -> None:
    """TLS settings (kvd's and kvd router's) that serve nothing: TLS is the TCP front's, and the key
    and client CAs go with a certificate."""
    def where(name: str) -> str:
        return config.sources.get(name, "the config")
    if config.ssl_certfile and not config.listen:
        raise ConfigError(f"ssl_certfile: set (from {where('ssl_certfile')}) but listen is not: TLS serves the TCP "
                          "front (--listen HOST:PORT); the Unix socket needs none")
    for name in ("ssl_keyfile", "ssl_ca_certs"):
        if getattr(config, name) and not config.ssl_certfile:
            raise ConfigError(f"{name}: set (from {where(name)}) but ssl_certfile is not: TLS needs the server's "
                              "certificate (--ssl-certfile)")


def check_batch_via(config: KvdConfig) -> None:
    """A batch_via URL needs a token; the settings of one serve nothing for a socket, or none."""
    url = config.batch_via is not None and config.batch_via.startswith(("http://", "https://"))
    if url and not config.batch_via_token_file:
        raise ConfigError(f"batch_via: {redact_url(config.batch_via)!r} (from "
                          f"{config.sources.get('batch_via', 'the config')}) is a router's TCP front, which takes a "
                          "bearer token: set batch_via_token_file (an admin token of its clients_file)")
    for name in ("batch_via_token_file", "batch_via_ca_file", "batch_via_client_cert"):
        if getattr(config, name) and not url:
            raise ConfigError(f"{name}: set (from {config.sources.get(name, 'the config')}) but batch_via is not "
                              "the URL of a kvd router's TCP front: it serves nothing")


def check_priorities(config: KvdConfig) -> None:
    """Tenant priorities order a priority queue only: with a FIFO queue they would be ignored; so
    would the `priority` eviction policy, every request being at 0 there (it would be lru)."""
    if config.tenant_priorities and not by_priority(config.queue_order):
        raise ConfigError(f"tenant_priorities: set (from {config.sources.get('tenant_priorities', 'the config')}) but "
                          f"queue_order is {config.queue_order!r}; set queue_order: priority (or priority+lpm) for "
                          "them to order the queue")
    if config.eviction == "priority" and not by_priority(config.queue_order):
        raise ConfigError(f"eviction: priority (from {config.sources.get('eviction', 'the config')}) keeps the "
                          f"prefixes of the requests that run first, but queue_order is {config.queue_order!r}, "
                          "where every request is equal (it would be lru); set queue_order: priority, with "
                          "tenant_priorities")

"""kvd router settings: the same resolver and precedence as kvd's own (daemon/config.py).

    command-line flag  >  KVD_ROUTER_* environment variable  >  YAML file (--config)  >  default

`kvd router --routing ttft`, `KVD_ROUTER_ROUTING=ttft` or `routing: ttft` in the file. The
replicas are `replicas:` (a list) in the file, `--replica` (repeated) on the command line, or
`KVD_ROUTER_REPLICAS` (comma-separated); a source that names any replaces the others' list. A bad
value is a ConfigError naming the setting, the value and where it came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvctl.policies.routing import (LOCAL_PREFILL_TOKENS, NEW_PREFIX, NEW_PREFIX_SLACK_TOKENS, QUEUE_LIMITS,
                                   ROUTING_POLICIES)

from .config import (MAX_FILE_BYTES, ConfigError, check_tls_settings, check_traces_protocol, env_typos, field_defaults,
                     finite_number, merge_settings, on_or_off, read_settings_file, setting_names, whole_number)
from .server.byte_sizes import size_in_bytes
from .server.otlp_export import check_endpoint
from .server.reply_ids import REPLY_IDS_BYTES
from .server.silent_replicas import GIVE_UP_SILENT_S, PROBE_EVERY_S


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...] = ()  # Unix sockets or http(s) URLs; more may come from replicas_file
    replicas_file: str | None = None  # one replica per line, re-read on SIGHUP
    # disaggregated prefill and decode (router.py): replicas that compute prompts into the shared Redis,
    # and replicas that only decode from it (`replicas` do both: whole requests, and decodes)
    prefill_replicas: tuple[str, ...] = ()
    decode_replicas: tuple[str, ...] = ()
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # a decode replica computes this many uncached tokens itself
    socket: str | None = None  # the Unix socket the router serves on (required)
    routing: str = "prefix"
    balance_seconds: float = 2.0  # prefix: the extra wait it accepts for a replica that caches more
    new_prefix: str = "home"  # prefix: where a new prefix goes (home or least_loaded)
    new_prefix_slack: int = NEW_PREFIX_SLACK_TOKENS  # prefix: tokens more a replica must hold to win a prompt
    prefill_rate: float = 20_000.0  # ttft: prompt tokens/s of a replica that has not measured its own
    # heed: pass over a replica predicted to wait past its max_queue_wait while another would not; or ignore
    queue_limits: str = "heed"
    view: str = "events"  # events or ask
    load_interval: float = 0.25  # events: seconds between load polls
    pending_seconds: float = 30.0  # events: how long a sent prompt counts as cached before its feed says
    # a replica whose questions go unanswered this long while it has a request: the request is given up
    # (a 504; silent_replicas.py); 0: never (waited for up to the 600 s forward timeout)
    silent_give_up_seconds: float = GIVE_UP_SILENT_S
    silent_probe_seconds: float = PROBE_EVERY_S  # ask: how often such a replica is asked while it has a request
    # events: memory for the ids of the chat replies relayed, with which a chat's next turn is weighed as the
    # replica prompts it (server/router_replies.py); 0: its replies are read as text
    reply_ids_bytes: int = REPLY_IDS_BYTES
    # the largest upload to /v1/files it takes (413 above), as kvd's max_file_bytes: at least the replicas'
    max_file_bytes: int = MAX_FILE_BYTES
    token_file: str | None = None  # an admin bearer token for URL replicas
    listen: str | None = None  # HOST:PORT for TCP callers (needs clients_file)
    clients_file: str | None = None  # the TCP callers' tokens: TOKEN TENANT ROLE lines
    # the TCP front serves a request under the X-KVD-Tenant it names (as kvd's trusted_proxy): its callers are
    # trusted front ends, or kvds sending their batches' requests through it (batch_via); else the token's tenant
    trusted_proxy: bool = False
    ssl_certfile: str | None = None  # TLS on the TCP front, as kvd serve's (server/tls.py)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    # https replicas: the CAs their certificates are checked against (absent: the system's), and the
    # router's own certificate (with its key, or `replica_client_key`) for replicas that ask for one
    replica_ca_certs: str | None = None
    replica_client_cert: str | None = None
    replica_client_key: str | None = None
    log_requests: bool = False  # a logfmt line per routed request: where it went and why (router.py)
    otlp_traces_endpoint: str | None = None  # spans of the routing, to this OTLP collector (route_spans.py)
    gc_freeze: bool = True  # freeze the heap the start made (gc_pauses.py), as kvd serve does
    gc_warn_seconds: float = 0.1  # a WARNING for a collection that stops the router this long (0: none)
    # where each setting came from ("--routing", "KVD_ROUTER_ROUTING", the file); absent: the default
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


def _replicas(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise ValueError("must be socket paths or URLs")
    return tuple(item.strip() for item in items if item.strip())


_PARSERS = {"replicas": _replicas, "prefill_replicas": _replicas, "decode_replicas": _replicas,
            "balance_seconds": finite_number, "new_prefix_slack": whole_number, "local_prefill_tokens": whole_number,
            "prefill_rate": finite_number, "load_interval": finite_number, "pending_seconds": finite_number,
            "silent_give_up_seconds": finite_number, "silent_probe_seconds": finite_number,
            "gc_freeze": on_or_off, "gc_warn_seconds": finite_number, "log_requests": on_or_off,
            "trusted_proxy": on_or_off,
            "reply_ids_bytes": size_in_bytes, "max_file_bytes": size_in_bytes}


def _check(name: str, value: Any) -> None:
    if name == "max_file_bytes" and value < 4096:
        raise ValueError("must be at least 4KiB")
    if name == "routing" and value not in ROUTING_POLICIES:
        raise ValueError(f"must be one of {', '.join(ROUTING_POLICIES)}")
    if name == "new_prefix" and value not in NEW_PREFIX:
        raise ValueError(f"must be one of {', '.join(NEW_PREFIX)}")
    if name == "queue_limits" and value not in QUEUE_LIMITS:
        raise ValueError(f"must be one of {', '.join(QUEUE_LIMITS)}")
    if name == "view" and value not in ("events", "ask"):
        raise ValueError("must be events or ask")
    if name in ("balance_seconds", "pending_seconds", "new_prefix_slack", "local_prefill_tokens") and value < 0:
        raise ValueError("must be >= 0")
    if name == "gc_warn_seconds" and value < 0:
        raise ValueError("must be >= 0 (0: no warning)")
    if name == "silent_give_up_seconds" and value < 0:
        raise ValueError("must be >= 0 (0: never give a request up)")
    if name in ("prefill_rate", "load_interval", "silent_probe_seconds") and not value > 0:
        raise ValueError("must be > 0")
    if name == "otlp_traces_endpoint":
        check_endpoint(value)
    if name == "listen" and value is not None:
        host, _, port = str(value).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be HOST:PORT")


def router_env_typos(env: Mapping[str, str]) -> list[str]:
    return env_typos(env, setting_names(RouterConfig), "KVD_ROUTER_", "kvd router")


def resolve_router(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                   config_file: str | Path | None = None) -> RouterConfig:
    """Merge the sources by precedence (flag > env > file > default) and check the whole."""
    env = os.environ if env is None else env
    names = setting_names(RouterConfig)
    file_values = read_settings_file(config_file, names) if config_file is not None else {}
    values, sources = merge_settings(names, flags, env, "KVD_ROUTER_", file_values, config_file, _PARSERS, _check,
                                     field_defaults(RouterConfig))
    config = RouterConfig(**values, sources=sources)
    if config.socket is None:
        raise ConfigError("socket: the router needs a Unix socket to serve on (--socket, KVD_ROUTER_SOCKET or "
                          "socket: in the file)")
    named = config.replicas + config.prefill_replicas + config.decode_replicas
    if not config.replicas_file and len(named) < 2:
        raise ConfigError(f"replicas: give two or more (--replica, repeated; replicas: in the file), or a "
                          f"replicas_file, got {len(named)}")
    lists = (set(config.replicas), set(config.prefill_replicas), set(config.decode_replicas))
    twice = sorted({spec for spec in named if sum(spec in names for names in lists) > 1})
    if twice:  # (twice in one list: RouterService says so)
        raise ConfigError(f"replicas: {twice[0]!r} is named in two roles (replicas, prefill_replicas, "
                          "decode_replicas); each replica in one")
    if config.prefill_replicas and not (config.replicas or config.decode_replicas or config.replicas_file):
        raise ConfigError("decode_replicas: prefill replicas need a replica that decodes (--decode, or --replica)")
    if config.listen and not config.clients_file:
        raise ConfigError("clients_file: --listen needs the TCP callers' tokens (--clients-file)")
    check_tls_settings(config)
    check_traces_protocol(config, env)
    if config.replica_client_key and not config.replica_client_cert:
        raise ConfigError(f"replica_client_key: set (from {config.sources.get('replica_client_key', 'the config')}) "
                          "but replica_client_cert is not: the key goes with the router's certificate")
    return config

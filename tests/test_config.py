"""kvd's settings resolver: precedence flag > env > file > default, and errors that name things."""

from __future__ import annotations

import pytest

from kvctl.daemon.config import ConfigError, resolve
from kvctl.daemon.router_config import resolve_router


def test_precedence_flag_env_file_default(tmp_path):
    path = tmp_path / "kvd.yaml"
    path.write_text("block_size: 64\nmax_queue: 7\neviction: cost\ncache_memory: 64MiB\n")
    env = {"KVD_BLOCK_SIZE": "32", "KVD_MAX_QUEUE": "9"}
    config = resolve({"block_size": 128}, env, path)
    assert (config.block_size, config.max_queue, config.eviction) == (128, 9, "cost")
    assert config.cache_memory == 64 * 2**20
    assert config.max_running == 32  # default
    assert config.max_request_bytes == 32 * 2**20 and resolve({}, {"KVD_MAX_REQUEST_BYTES": "8MiB"}).max_request_bytes == 8 * 2**20
    assert resolve({}, env, path).block_size == 32
    files = tmp_path / "files.yaml"
    files.write_text('tenant_files_bytes: {acme: 20GiB, "*": 1GiB}\nfiles_store_bytes: 64GiB\n')
    config = resolve({}, {}, files)
    assert (config.tenant_files_bytes, config.files_store_bytes, config.max_file_bytes) == (
        (("*", 2**30), ("acme", 20 * 2**30)), 64 * 2**30, 200 * 2**20)
    assert resolve({}, {}, path).block_size == 64


@pytest.mark.parametrize("flags, env, message", [
    ({"block_size": 24}, {}, "block_size: invalid value 24 from --block-size: must be one of 8, 16, 32"),
    ({}, {"KVD_EVICTION": "fifo"}, "eviction: invalid value 'fifo' from KVD_EVICTION: must be one of lru, cost, lfu"),
    ({"queue_order": "sjf"}, {},
     "queue_order: invalid value 'sjf' from --queue-order: must be fifo, priority, lpm or priority+lpm"),
    ({}, {"KVD_PROMPT_CACHE_RETENTION": "24h"},
     "prompt_cache_retention: invalid value '24h' from KVD_PROMPT_CACHE_RETENTION: must be honour or ignore"),
    ({}, {"KVD_CACHE_MEMORY": "lots"}, "cache_memory: invalid value 'lots' from KVD_CACHE_MEMORY: must be a size in "
                                       "bytes: a number with an optional unit (4096, 512MiB, 2GiB, 500MB)"),
    ({}, {"KVD_HOST_CACHE_BYTES": "1e999"}, "host_cache_bytes: invalid value '1e999' from KVD_HOST_CACHE_BYTES: must be "
                                            "a size in bytes"),  # was an OverflowError's traceback
    ({"disk_cache_bytes": "infGiB"}, {}, "disk_cache_bytes: invalid value 'infGiB' from --disk-cache-bytes: must be "
                                        "a size in bytes"),
    ({"listen": "nowhere"}, {}, "listen: invalid value 'nowhere' from --listen: must be HOST:PORT"),
    ({"device": "gpu"}, {}, "device: invalid value 'gpu' from --device: must be auto, cpu or cuda"),
    ({}, {"KVD_DEVICE": "cuda:1"}, "device: invalid value 'cuda:1' from KVD_DEVICE: must be auto, cpu or cuda; "
                                   "for GPU N of several, start kvd with CUDA_VISIBLE_DEVICES=N (examples/kvd@.service)"),
    ({"listen": "127.0.0.1:8000"}, {}, "listen: '127.0.0.1:8000' needs token_file"),
    ({"reservation": "half"}, {}, "reservation: invalid value 'half' from --reservation"),
    ({"max_queue": 0}, {}, "max_queue: invalid value 0 from --max-queue: must be >= 1"),
    ({}, {"KVD_MAX_LORAS": "0"}, "max_loras: invalid value '0' from KVD_MAX_LORAS: must be >= 1"),
    ({"max_request_bytes": "1KiB"}, {}, "max_request_bytes: invalid value '1KiB' from --max-request-bytes: "
                                        "must be at least 4KiB"),
    ({"batch_via": "router:8000"}, {}, "batch_via: invalid value 'router:8000' from --batch-via: must be a kvd "
     "router's Unix socket (a path) or the http(s) URL of its TCP front"),
    ({"batch_via": "https://"}, {}, "batch_via: invalid value 'https://' from --batch-via: must be a kvd"),
    ({"batch_via": "https://router:8443"}, {}, "batch_via: 'https://router:8443' (from --batch-via) is a router's "
     "TCP front, which takes a bearer token: set batch_via_token_file (an admin token of its clients_file)"),
    ({"batch_via": "/run/kvd/router.sock"}, {"KVD_BATCH_VIA_CA_FILE": "/etc/ca.pem"}, "batch_via_ca_file: set (from "
     "KVD_BATCH_VIA_CA_FILE) but batch_via is not the URL of a kvd router's TCP front: it serves nothing"),
    ({"batch_via_token_file": "/etc/kvd/router-token"}, {}, "batch_via_token_file: set (from "
     "--batch-via-token-file) but batch_via is not the URL"),
    ({"max_file_bytes": "2KiB"}, {}, "max_file_bytes: invalid value '2KiB' from --max-file-bytes: must be at least "
                                     "4KiB"),
    ({}, {"KVD_FILES_STORE_BYTES": "-1"}, "files_store_bytes: invalid value '-1' from KVD_FILES_STORE_BYTES: must be "
                                         ">= 0 (0: no upload is kept)"),
    ({"tenant_files_bytes": "acme=lots"}, {}, "tenant_files_bytes: invalid value 'acme=lots' from "
     "--tenant-files-bytes: bytes of 'acme' must be a size in bytes: a number with an optional unit"),
    ({"tenant_files_bytes": "acme=1GiB,acme=2GiB"}, {}, "tenant_files_bytes: invalid value 'acme=1GiB,acme=2GiB' "
     "from --tenant-files-bytes: tenant 'acme' is given twice"),
    ({}, {"KVD_QUICK_PREFILL_TOKENS": "-8"},
     "quick_prefill_tokens: invalid value '-8' from KVD_QUICK_PREFILL_TOKENS: must be a whole number >= 0 or auto"),
    ({"engine_stall_exit_seconds": 30}, {}, "engine_stall_exit_seconds: invalid value 30 from "
     "--engine-stall-exit-seconds: must be 0 (never) or >= 60 (the engine is stalled once its loop has not come round "
     "in 60 s)"),
])
def test_invalid_values_name_field_value_and_source(flags, env, message):
    with pytest.raises(ConfigError) as info:
        resolve(flags, env)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("text, message", [
    ("max_queue: 1.5", "max_queue: invalid value 1.5 from {path}: must be a whole number"),
    ("max_running: true", "max_running: invalid value True from {path}: must be a whole number"),
    ("shutdown_timeout: .inf", "shutdown_timeout: invalid value inf from {path}: must be a finite number"),
    ("remote_timeout: yes", "remote_timeout: invalid value True from {path}: must be a number"),
    ("prefetch_timeout: soon", "prefetch_timeout: invalid value 'soon' from {path}: must be a number"),
])
def test_a_yaml_number_of_the_wrong_kind_is_refused_not_rounded(tmp_path, text, message):
    """YAML reads `1.5`, `true` and `.inf` as numbers: a count of 1.5 was read as 1, `true` as 1."""
    path = tmp_path / "kvd.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        resolve({}, {}, path)
    assert str(info.value) == message.format(path=path)
    path.write_text("max_queue: 12\nshutdown_timeout: 2\n")  # a whole number is a number too
    settings = resolve({}, {"KVD_MAX_RUNNING": "+8"}, path)
    assert (settings.max_queue, settings.shutdown_timeout, settings.max_running) == (12, 2.0, 8)


def test_a_key_the_file_leaves_empty_is_refused_where_it_would_not_mean_the_default(tmp_path):
    """`max_running:` with its value commented out reads as null: it was taken as None and failed
    later (a TypeError at the first request, or "'<=' not supported" naming no value)."""
    path = tmp_path / "kvd.yaml"
    for key, default in (("max_running", "32"), ("reservation", "'fraction:1.0'"), ("shutdown_timeout", "30.0"),
                         ("trusted_proxy", "False")):
        path.write_text(f"{key}:\n")
        with pytest.raises(ConfigError) as info:
            resolve({}, {}, path)
        assert str(info.value) == f"{key}: no value given in {path}; give one, or leave the line out for the " \
                                  f"default ({default})"
    path.write_text("tenant_cache_shares:\nmax_tenant_requests:\nnum_blocks:\n")  # none: what their defaults are
    settings = resolve({}, {}, path)
    assert (settings.tenant_cache_shares, settings.max_tenant_requests, settings.num_blocks) == ((), None, None)
    path.write_text("replicas: [/run/a.sock, /run/b.sock]\nsocket: /run/r.sock\nbalance_seconds:\n")
    with pytest.raises(ConfigError, match=r"^balance_seconds: no value given in .*; give one, or leave the line out "
                                          r"for the default \("):
        resolve_router({}, {}, path)


def test_file_errors(tmp_path):
    path = tmp_path / "kvd.yaml"
    path.write_text("blok_size: 16\n")
    with pytest.raises(ConfigError) as unknown:
        resolve({}, {}, path)
    assert str(unknown.value) == f"config: unknown field 'blok_size' in {str(path)!r} (did you mean 'block_size'?)"
    path.write_text("tiers:\n  disk:\n    byts: 1GiB\n")
    with pytest.raises(ConfigError) as unknown:
        resolve({}, {}, path)
    assert str(unknown.value) == f"tiers.disk: unknown field 'byts' in {str(path)!r} (did you mean 'bytes'?)"
    path.write_text("colour: blue\n")
    with pytest.raises(ConfigError) as unknown:
        resolve({}, {}, path)
    assert str(unknown.value) == f"config: unknown field 'colour' in {str(path)!r}"  # nothing near: no guess
    path.write_text("block_size: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        resolve({}, {}, path)
    with pytest.raises(ConfigError, match="cannot read"):
        resolve({}, {}, tmp_path / "missing.yaml")


def test_systemd_directories_are_the_defaults(monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvd")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvd")
    config = resolve({}, {})
    assert (config.state_dir, config.socket) == ("/var/lib/kvd", "/run/kvd/kvd.sock")


def test_quick_prefill_tokens_is_auto_unless_set_and_auto_depends_on_the_device():
    from kvctl.daemon.config import quick_prefill_default

    assert resolve({}, {}).quick_prefill_tokens is None
    assert resolve({}, {"KVD_QUICK_PREFILL_TOKENS": "auto"}).quick_prefill_tokens is None
    assert resolve({"quick_prefill_tokens": "0"}, {"KVD_QUICK_PREFILL_TOKENS": "32"}).quick_prefill_tokens == 0
    assert (quick_prefill_default("cpu"), quick_prefill_default("cuda")) == (64, 0)


def test_the_example_config_resolves_as_written():
    """examples/kvd.yaml is what operators copy: every field in it must still be a valid setting."""
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "kvd.yaml"
    config = resolve({}, {}, example)
    assert (config.listen, config.token_file, config.max_request_bytes) == ("127.0.0.1:8000", "/etc/kvd/tokens",
                                                                             32 * 2**20)
    assert (config.reservation, config.max_queue, config.pin_budget_blocks) == ("p95", 512, 4096)


def test_a_password_in_the_remote_url_is_never_shown():
    from kvctl.daemon.config import redact_url

    config = resolve({"remote_url": "redis://:s3cret@10.0.0.5:6379/0"}, {})
    assert config.remote_url == "redis://:s3cret@10.0.0.5:6379/0"  # what kvd connects with
    assert config.shown()["remote_url"] == "redis://:***@10.0.0.5:6379/0"  # what config show prints
    assert config.shown()["block_size"] == config.describe()["block_size"]
    assert [redact_url(u) for u in ("rediss://ops:pw@h:6380/1", "redis://ops@h:6379", "redis://10.0.0.5:6379/0",
                                    "unix:///run/redis.sock", None)] == [
        "rediss://ops:***@h:6380/1", "redis://ops@h:6379", "redis://10.0.0.5:6379/0", "unix:///run/redis.sock", None]
    with pytest.raises(ConfigError) as refused:
        resolve({"remote_url": "http://:pw@cache:6379"}, {})
    assert "pw" not in str(refused.value) and "'http://:***@cache:6379'" in str(refused.value)
    for bad in ("redis://u:pw@cache:notaport/0", "redis://cache:70000/0"):  # refused at start, naming the setting
        with pytest.raises(ConfigError) as refused:
            resolve({"remote_url": bad}, {})
        assert str(refused.value).endswith("from --remote-url: the port must be a number from 1 to 65535")
        assert "pw" not in str(refused.value)
    assert resolve({"remote_url": "redis+cluster://a:7000"}, {}).remote_url == "redis+cluster://a:7000"
    assert resolve({"remote_url": "unix:///run/redis.sock"}, {}).remote_url == "unix:///run/redis.sock"


def test_fp8_is_vllm_s_name_for_fp8_e4m3_wherever_a_cache_format_is_set(tmp_path):
    config = tmp_path / "kvd.yaml"
    config.write_text("cache_dtype: fp8\n")
    assert resolve({}, {}, config).cache_dtype == "fp8_e4m3"
    assert resolve({"cache_dtype": "fp8"}, {}, None).cache_dtype == "fp8_e4m3"
    assert resolve({}, {"KVD_CACHE_DTYPE": "fp8_e5m2"}, None).cache_dtype == "fp8_e5m2"
    with pytest.raises(ConfigError, match=r"cache_dtype: invalid value 'fp4' from --cache-dtype: must be auto, "
                                          r"fp8_e4m3 \(or fp8\), fp8_e5m2 or int8"):
        resolve({"cache_dtype": "fp4"}, {}, None)


def test_each_setting_knows_where_it_came_from(tmp_path):
    config = tmp_path / "kvd.yaml"
    config.write_text("max_queue: 64\nblock_size: 32\nreservation: p95\n")
    resolved = resolve({"block_size": 16}, {"KVD_RESERVATION": "fixed:8"}, config)
    assert (resolved.block_size, resolved.reservation, resolved.max_queue) == (16, "fixed:8", 64)
    assert resolved.sources == {"block_size": "--block-size", "reservation": "KVD_RESERVATION",
                                "max_queue": str(config)}  # the rest are defaults
    assert "sources" not in resolved.describe()
    with pytest.raises(ConfigError, match="config: unknown field 'sources'"):
        config.write_text("sources: {}\n")
        resolve({}, {}, config)


def test_router_settings_follow_the_same_precedence_and_name_their_source(tmp_path):
    from kvctl.daemon.router_config import RouterConfig, resolve_router

    path = tmp_path / "router.yaml"
    path.write_text("socket: /run/r.sock\nreplicas: [/run/a.sock, /run/b.sock]\nrouting: ttft\nview: ask\n"
                    "load_interval: 0.5\n")
    from_file = resolve_router({}, {}, path)
    assert (from_file.replicas, from_file.routing, from_file.view, from_file.load_interval) == (
        ("/run/a.sock", "/run/b.sock"), "ttft", "ask", 0.5)
    assert from_file.new_prefix == RouterConfig.new_prefix and from_file.sources["routing"] == str(path)
    env = {"KVD_ROUTER_ROUTING": "least_loaded", "KVD_ROUTER_REPLICAS": "/run/c.sock, /run/d.sock"}
    merged = resolve_router({"routing": "prefix", "view": "events"}, env, path)
    assert (merged.routing, merged.view, merged.replicas) == ("prefix", "events", ("/run/c.sock", "/run/d.sock"))
    assert (merged.sources["routing"], merged.sources["replicas"], merged.sources["load_interval"]) == (
        "--routing", "KVD_ROUTER_REPLICAS", str(path))
    assert (from_file.gc_freeze, from_file.gc_warn_seconds) == (True, 0.1)  # as kvd serve's
    unfrozen = resolve_router({}, {"KVD_ROUTER_GC_FREEZE": "off", "KVD_ROUTER_GC_WARN_SECONDS": "0.05"}, path)
    assert (unfrozen.gc_freeze, unfrozen.gc_warn_seconds) == (False, 0.05)
    assert from_file.queue_limits == "heed"  # replicas predicted past their max_queue_wait are passed over
    blind = resolve_router({}, {"KVD_ROUTER_QUEUE_LIMITS": "ignore"}, path)
    assert (blind.queue_limits, blind.sources["queue_limits"]) == ("ignore", "KVD_ROUTER_QUEUE_LIMITS")
    assert from_file.reply_ids_bytes == 64 * 2**20  # as kvd serve's
    assert resolve_router({}, {"KVD_ROUTER_REPLY_IDS_BYTES": "8MiB"}, path).reply_ids_bytes == 8 * 2**20
    assert (from_file.silent_give_up_seconds, from_file.silent_probe_seconds) == (30.0, 5.0)
    patient = resolve_router({"silent_probe_seconds": 2.5}, {"KVD_ROUTER_SILENT_GIVE_UP_SECONDS": "0"}, path)
    assert (patient.silent_give_up_seconds, patient.silent_probe_seconds) == (0.0, 2.5)
    assert patient.sources["silent_give_up_seconds"] == "KVD_ROUTER_SILENT_GIVE_UP_SECONDS"
    assert from_file.max_file_bytes == 200 * 2**20  # as kvd serve's
    assert resolve_router({"max_file_bytes": "1GiB"}, {}, path).max_file_bytes == 2**30
    assert from_file.trusted_proxy is False  # (a TCP caller is served as its token's tenant)
    trusting = resolve_router({}, {"KVD_ROUTER_TRUSTED_PROXY": "true"}, path)
    assert (trusting.trusted_proxy, trusting.sources["trusted_proxy"]) == (True, "KVD_ROUTER_TRUSTED_PROXY")


@pytest.mark.parametrize("text, flags, message", [
    ("socket: /r.sock\nreplicas: [/a, /b]\nroutng: ttft\n", {}, "config: unknown field 'routng' in {path!r}"),
    ("socket: /r.sock\nreplicas: [/a, /b]\nview: gossip\n", {},
     "view: invalid value 'gossip' from {path}: must be events or ask"),
    ("socket: /r.sock\nreplicas: [/a, /b]\n", {"prefill_rate": 0.0},
     "prefill_rate: invalid value 0.0 from --prefill-rate: must be > 0"),
    ("replicas: [/a, /b]\n", {}, "socket: the router needs a Unix socket to serve on"),
    ("socket: /r.sock\nreplicas: [/a]\n", {}, "replicas: give two or more"),
    ("socket: /r.sock\nreplicas_file: /etc/kvd/router-replicas\nlisten: 0.0.0.0:8000\n", {},
     "clients_file: --listen needs the TCP callers' tokens (--clients-file)"),
    ("socket: /r.sock\nreplicas: [/a, 3]\n", {}, "replicas: invalid value ['/a', 3] from {path}: must be socket paths"),
    ("socket: /r.sock\nreplicas: [/a, /b]\nreply_ids_bytes: plenty\n", {},
     "reply_ids_bytes: invalid value 'plenty' from {path}: must be a size in bytes"),
    ("socket: /r.sock\nreplicas: [/a, /b]\n", {"max_file_bytes": "1KiB"},
     "max_file_bytes: invalid value '1KiB' from --max-file-bytes: must be at least 4KiB"),
    ("socket: /r.sock\nreplicas: [/a, /b]\ngc_freeze: sometimes\n", {},
     "gc_freeze: invalid value 'sometimes' from {path}: must be on or off (true/false, yes/no, 1/0)"),
])
def test_bad_router_settings_are_refused_naming_field_value_and_source(tmp_path, text, flags, message):
    from kvctl.daemon.router_config import resolve_router

    path = tmp_path / "router.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        resolve_router(flags, {}, path)
    assert str(caught.value).startswith(message.format(path=str(path)))



def test_every_setting_is_a_kvd_serve_flag_too(tmp_path, monkeypatch):
    """`kvd serve --help` lists every setting the YAML file and KVD_* take (five had none), and a flag
    reaches the setting it names, with its source."""
    from dataclasses import fields

    import typer
    from typer.testing import CliRunner

    import kvctl.daemon.cli as cli
    from kvctl.daemon.config import KvdConfig

    serve = typer.main.get_command(cli.app).commands["serve"]
    options = {opt for param in serve.params for opt in param.opts}
    settings = [f.name for f in fields(KvdConfig) if f.name != "sources"]
    assert [name for name in settings if "--" + name.replace("_", "-") not in options] == []
    seen = {}

    async def served(config, re_resolve):  # what `kvd serve` would run with
        seen["config"] = config

    monkeypatch.setattr(cli, "_serve", served)
    result = CliRunner().invoke(cli.app, ["serve", "--state-dir", str(tmp_path), "--pin-budget-blocks", "40",
                                          "--shutdown-timeout", "5", "--model-name", "support-bot",
                                          "--remote-cache-bytes", "2GiB", "--remote-timeout", "0.25"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.pin_budget_blocks, config.shutdown_timeout, config.model_name, config.remote_cache_bytes,
            config.remote_timeout) == (40, 5.0, "support-bot", 2 * 2**30, 0.25)
    assert config.sources["remote_cache_bytes"] == "--remote-cache-bytes"


def test_kvd_serve_help_is_in_sections_and_every_option_has_one():
    """`kvd serve --help` shows its fifty settings in sections by concern, each option in exactly
    one; a section map that leaves an option out (or names one twice, or one that does not exist)
    is refused with the names."""
    import typer

    import kvctl.daemon.cli as cli

    serve = typer.main.get_command(cli.app).commands["serve"]
    panels = {param.name: getattr(param, "rich_help_panel", None) for param in serve.params}
    panels.pop("help", None)
    assert {name for name, panel in panels.items() if panel is None} == set()
    assert panels["cache_memory"] == "Cache and batching"
    assert panels["remote_url"] == panels["prefetch_policy"] == "Tiers: host, disk, Redis"
    assert panels["trace_key_file"] == "Metrics and trace"
    assert set(panels.values()) == set(cli.SERVE_HELP_PANELS)

    def command(a=typer.Option(None), b=typer.Option(None), c=typer.Option(None)) -> None:
        """A command with three options."""

    with pytest.raises(RuntimeError) as caught:
        cli.place_in_help_panels(command, {"One": ("a", "b"), "Two": ("b", "d")})
    assert str(caught.value) == "help panels of command: unknown ['d'], twice ['b'], missing ['c']"


def _commands(command, path=()):
    """Every command of a click group, with the words that run it."""
    if hasattr(command, "commands"):  # a group (Typer's own click, not necessarily the installed one)
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, command


@pytest.mark.parametrize("program", ["kvd", "kvctl"])
def test_every_option_name_of_every_command_shows_whole_at_80_columns(program):
    """Typer's tables cut "--prefetch-timeout-per-1k-tokens" to "--prefetch-timeout-per-1k-tok…"
    and "--no-allow-uncalibrated" to "--no-allow-uncalib…" at 80 columns (help_text.keep_names_whole)."""
    import re

    import typer
    from typer.testing import CliRunner

    import kvctl.cli
    import kvctl.daemon.cli

    app = kvctl.daemon.cli.app if program == "kvd" else kvctl.cli.app
    checked = 0
    for path, command in _commands(typer.main.get_command(app)):
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert result.exit_code == 0, (path, result.output)
        assert max(len(line) for line in result.output.splitlines()) <= 80, path
        shown = set(re.findall(r"(?<![\w-])--?[a-z0-9][a-z0-9-]*(?![\w…-])", result.output))
        for option in (o for param in command.params for o in (*param.opts, *param.secondary_opts)
                       if o.startswith("-")):
            assert option in shown, (path, option)
            checked += 1
    assert checked > (200 if program == "kvctl" else 70)  # the walk reached every command


def test_kvd_serve_help_shows_each_option_name_whole_at_100_columns():
    """Sectioned, each table is as wide as its own names: at 100 columns no option name is cut
    (before the sections, 16 lines were cut at 80 columns)."""
    from typer.testing import CliRunner

    import kvctl.daemon.cli as cli

    result = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
    assert result.exit_code == 0, result.output
    for title in cli.SERVE_HELP_PANELS:
        assert title in result.output
    assert "…" not in result.output
    for option in ("--prefetch-timeout-per-1k-tokens", "--keep-layers-unquantised", "--no-allow-uncalibrated",
                   "--trace-block-tokens", "--quick-prefill-tokens", "--max-tenant-metric-series"):
        assert option in result.output


def test_a_kvd_variable_that_names_no_setting_is_named_with_its_near_miss():
    """KVD_MAX_RUNING=8 in a unit file was ignored without a word."""
    from kvctl.daemon.config import kvd_env_typos
    from kvctl.daemon.router_config import router_env_typos

    env = {"KVD_MAX_RUNING": "8", "KVD_BLOCK_SIZE": "32", "KVD_URL": "http://x", "KVD_ROUTER_ROUTING": "ttft",
           "KVD_COLOUR": "blue", "HOME": "/root", "KVD_SOCKET": "/run/kvd/kvd.sock"}
    assert kvd_env_typos(env) == [
        "KVD_COLOUR is not a kvd serve setting and is ignored",
        "KVD_MAX_RUNING is not a kvd serve setting and is ignored (did you mean KVD_MAX_RUNNING?)"]
    assert router_env_typos({"KVD_ROUTER_ROUTNG": "ttft", "KVD_ROUTER_ROUTING": "ttft", "KVD_MAX_RUNING": "8"}) == [
        "KVD_ROUTER_ROUTNG is not a kvd router setting and is ignored (did you mean KVD_ROUTER_ROUTING?)"]


def test_tenant_prompt_cache_retention_overrides_kvd_s_setting_for_the_tenants_it_names():
    from kvctl.daemon.config import retention_for
    from kvctl.daemon.server.reload_ops import LIVE_SETTINGS

    config = resolve({"prompt_cache_retention": "ignore", "tenant_prompt_cache_retention": "agents=honour,free=IGNORE"},
                     env={})
    assert config.tenant_prompt_cache_retention == (("agents", "honour"), ("free", "ignore"))
    assert [retention_for(config, t) for t in ("agents", "free", "acme", None)] == ["honour", "ignore", "ignore",
                                                                                   "ignore"]
    assert resolve({"tenant_prompt_cache_retention": {"free": "ignore"}}, env={}).tenant_prompt_cache_retention == (
        ("free", "ignore"),)
    from_env = resolve({}, env={"KVD_TENANT_PROMPT_CACHE_RETENTION": "free=ignore"})
    assert [retention_for(from_env, t) for t in ("free", "acme")] == ["ignore", "honour"]
    for value, why in (("free=24h", "prompt_cache_retention of 'free' must be honour or ignore, got '24h'"),
                       ("free", "expected TENANT=SETTING, got 'free'"),
                       ("free=ignore,free=honour", "tenant 'free' is given twice"),
                       ("a b=ignore", "tenant 'a b' is not a tenant name (letters, digits, . _ -)")):
        with pytest.raises(ConfigError) as refused:
            resolve({"tenant_prompt_cache_retention": value}, env={})
        assert str(refused.value) == (f"tenant_prompt_cache_retention: invalid value {value!r} from "
                                      f"--tenant-prompt-cache-retention: {why}")
    assert "tenant_prompt_cache_retention" in LIVE_SETTINGS

"""kvctl and kvd as a user drives them: output documents, errors, help."""

from __future__ import annotations

import json

import pytest
import typer

from kvctl.cli import app, main
from kvctl.daemon.replay.trace import TraceRequest, write_trace


def cli(capsys, *args):
    """Run kvctl in-process; returns (exit status, stdout, stderr)."""
    try:
        main(list(args))
        status = 0
    except SystemExit as exc:
        status = exc.code or 0
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.jsonl"
    write_trace(path, [TraceRequest(0.0, 1024, 4, (1, 2)), TraceRequest(10.0, 1324, 4, (1, 2, 3)),
                       TraceRequest(20.0, 512, 4, (1,))])
    return path


def test_replay_json_document_has_every_figure(capsys, small_trace):
    status, out, _ = cli(capsys, "bench", "replay", str(small_trace), "--block-sizes", "256,512",
                         "--capacity-tokens", "65536", "--policy", "lru,cost", "--sequential", "--json")
    assert status == 0
    doc = json.loads(out)
    assert doc["trace"] == str(small_trace) and doc["requests"] == 3
    assert [(r["block_size"], r["policy"]) for r in doc["runs"]] == [
        (256, "lru"), (256, "cost"), (512, "lru"), (512, "cost")]
    for run in doc["runs"]:
        for field in ("block_size", "capacity_tokens", "policy", "hit_ratio", "max_hit_ratio",
                      "recomputed_tokens", "evictions", "fragmentation", "peak_occupancy",
                      "mean_occupancy", "rejections", "alloc_us_p50", "alloc_us_p99",
                      "block_ops_per_second", "seconds"):
            assert field in run
        assert run["block_ops_per_second"] > 0
    # block 256: r1 reuses 4 blocks, r2 one; block 512: r1 reuses 2 blocks.
    assert [r["hit_ratio"] for r in doc["runs"]] == pytest.approx(
        [1280 / 2860, 1280 / 2860, 1024 / 2860, 1024 / 2860])


def test_replay_without_a_trace_generates_one_and_prints_a_table(capsys):
    status, out, err = cli(capsys, "bench", "replay", "--demo-requests", "40", "--block-sizes", "64",
                           "--policy", "lru")
    assert status == 0
    assert "No trace given: replaying a generated trace of 40 requests (seed 0)" in err.replace("\n", " ")
    assert "replay of generated:40:seed=0 (40 requests)" in out
    lines = out.splitlines()
    header = lines.index("block capacity policy   hit recomputed evictions  frag occupancy rejected")
    row = lines[header + 1].split()
    assert row[:3] == ["64", "262,144", "lru"] and row[3].endswith("%") and row[-1] == "0"
    assert len(max(lines, key=len)) <= 80  # an operator's terminal
    assert "hit with an unbounded cache: block 64 " in out and "cost of the cache core in the replay" in out


def test_replay_with_max_queue_wait_says_why_requests_were_rejected(capsys, tmp_path):
    path = tmp_path / "burst.jsonl"  # one at a time, 10 s each: the third waits 20 s to start
    write_trace(path, [TraceRequest(0.0, 256, 10, (n,)) for n in (1, 2, 3)])
    base = ("bench", "replay", str(path), "--block-sizes", "256", "--policy", "lru", "--capacity-tokens", "65536",
            "--prefill-rate", "1e12", "--decode-rate", "1", "--max-running", "1")
    status, out, _ = cli(capsys, *base, "--max-queue-wait", "15")
    assert status == 0
    assert "rejected at block 256, capacity 65,536, lru: queue_timeout 1" in out.splitlines()
    status, out, _ = cli(capsys, *base, "--max-queue-wait", "15", "--json")
    doc = json.loads(out)
    assert doc["settings"]["max_queue_wait"] == 15.0 and doc["runs"][0]["reject_reasons"] == {"queue_timeout": 1}
    status, out, _ = cli(capsys, *base)
    assert status == 0 and "rejected at block" not in out
    status, _, err = cli(capsys, *base, "--max-queue-wait", "-1")
    assert status == 2 and "max_queue_wait: must be a number of seconds >= 0 (0: no limit), got -1.0" in err


def test_replay_with_lower_tier_sizes_shows_what_each_restored_within_80_columns(capsys):
    status, out, _ = cli(capsys, "bench", "replay", "--demo-requests", "120", "--block-sizes", "64",
                         "--policy", "lru", "--capacity-tokens", "4096", "--tier-tokens", "0,65536")
    assert status == 0
    lines = out.splitlines()
    header = lines.index("block capacity   tier policy   hit restored recomputed occupancy rejected")
    without, tiered = lines[header + 1].split(), lines[header + 2].split()
    assert without[:4] == ["64", "4,096", "0", "lru"] and without[5] == "0.0%"
    assert tiered[:4] == ["64", "4,096", "65,536", "lru"] and float(tiered[5].rstrip("%")) > 0
    assert int(tiered[6].replace(",", "")) < int(without[6].replace(",", ""))  # restored, not recomputed
    assert len(max(lines, key=len)) <= 80
    status, out, _ = cli(capsys, "bench", "replay", "--demo-requests", "120", "--block-sizes", "64",
                         "--policy", "lru", "--capacity-tokens", "4096", "--tier-tokens", "0,65536", "--json")
    doc = json.loads(out)
    assert doc["settings"]["tier_tokens"] == [0, 65536] and doc["settings"]["restore_rate"] == 200_000.0
    assert [r["tier_tokens"] for r in doc["runs"]] == [0, 65536]
    tiered = doc["runs"][1]
    assert tiered["restored_ratio"] == pytest.approx(tiered["restored_tokens"] / tiered["prompt_tokens"])
    assert doc["runs"][0]["restored_tokens"] == 0 and tiered["restored_tokens"] > 0


def test_a_fleet_replay_with_a_shared_tier_fits_80_columns(capsys):
    status, out, _ = cli(capsys, "bench", "replay", "--demo-requests", "120", "--block-sizes", "64",
                         "--policy", "lru", "--capacity-tokens", "4096", "--replicas", "2",
                         "--routing", "round_robin,least_loaded", "--tier-tokens", "0,1048576",
                         "--tier-write", "write_through")
    assert status == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["block", "capacity", "tier"])
    assert lines[header].split() == ["block", "capacity", "tier", "policy", "routing", "hit", "restored",
                                     "TTFT", "s", "imbal", "rejected"]
    rows = [line.split() for line in lines[header + 1:header + 5]]
    assert [(r[1], r[2], r[4]) for r in rows] == [("4,096", "0", "round_robin"), ("4,096", "0", "least_loaded"),
                                                 ("4,096", "1.05M", "round_robin"), ("4,096", "1.05M", "least_loaded")]
    assert [r[6] for r in rows[:2]] == ["0.0%", "0.0%"] and all(float(r[6].rstrip("%")) > 0 for r in rows[2:])
    assert len(max(lines, key=len)) <= 80


def test_a_plot_never_overwrites_what_is_not_a_plot(capsys, small_trace, tmp_path):
    precious = tmp_path / "passwd"
    precious.write_text("root:x:0:0:root:/root:/bin/bash\n")
    fake_png = tmp_path / "notes.png"
    fake_png.write_text("my notes")
    for target, message in ((precious, f"plot: give a path ending in .png, got {str(precious)!r}"),
                            (fake_png, f"plot: {str(fake_png)!r} exists and is not a PNG; it would be overwritten"),
                            (tmp_path, f"plot: give a path ending in .png, got {str(tmp_path)!r}")):
        status, out, err = cli(capsys, "bench", "replay", str(small_trace), "--block-sizes", "16",
                               "--capacity-tokens", "4096", "--plot", str(target))
        assert status == 2 and err.strip() == f"error: {message}" and out == ""  # refused before the replay
    assert precious.read_text() == "root:x:0:0:root:/root:/bin/bash\n" and fake_png.read_text() == "my notes"
    status, _, err = cli(capsys, "bench", "serve", "--plot", str(precious), "--baseline", "none")
    assert status == 2 and err.strip() == f"error: plot: {str(precious)!r} is a file; give a folder for the charts"
    charts = tmp_path / "charts"
    charts.mkdir()
    (charts / "ttft.png").write_text("not a chart")
    status, _, err = cli(capsys, "bench", "serve", "--plot", str(charts), "--baseline", "none")
    assert status == 2 and "ttft.png' exists and is not a PNG; it would be overwritten" in err
    status, _, err = cli(capsys, "trace", "generate", str(precious), "--requests", "5")
    assert status == 2 and err.strip() == f"error: out: {str(precious)!r} exists and is not a trace; it would be overwritten"
    status, _, err = cli(capsys, "db", "backup", str(precious), "--state-dir", str(small_trace.parent / "state"))
    assert status == 2  # no store there: nothing read, nothing written
    assert precious.read_text().startswith("root:")
    trace = tmp_path / "t.jsonl"
    for _ in range(2):  # a trace may replace a trace
        assert cli(capsys, "trace", "generate", str(trace), "--requests", "5")[0] == 0


def test_replay_plot_writes_a_png(capsys, small_trace, tmp_path):
    plot = tmp_path / "charts" / "replay.png"
    status, _, _ = cli(capsys, "bench", "replay", str(small_trace), "--block-sizes", "128,256",
                       "--json", "--plot", str(plot))
    assert status == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--block-sizes", "24"], "error: block_size: expected a power of two from 1 to 512, got 24"),
    (["--block-sizes", "sixteen"], "error: block_sizes: expected integers, got 'sixteen'"),
    (["--policy", "fifo"], "error: policy: unknown value 'fifo'; choose from lru, cost, lfu, priority"),
    (["--tenant-priorities", "quiet=-10"], "error: tenant_priorities: 'quiet=-10' are read by the priority eviction "
                                           "policy and the priority queue order only; add one (e.g. --policy "
                                           "lru,priority or --queue-order fifo,priority)"),
    (["--policy", "priority", "--tenant-priorities", "quiet=high"],
     "error: tenant_priorities: invalid value 'quiet=high': priority of 'quiet' must be an integer, got 'high'"),
    (["--capacity-tokens", "8", "--block-sizes", "16"],
     "error: capacity_tokens: 8 is smaller than one block of 16 tokens"),
    (["--reserve", "fraction:2"], "error: output reservation: invalid value 'fraction:2'"),
    (["--decode-rate", "0"], "error: decode_rate: must be > 0, got 0.0"),
    (["--replicas", "0"], "error: replicas: must be an integer >= 1, got 0"),
    (["--replicas", "2", "--routing", "random"],
     "error: routing: unknown value 'random'; choose from round_robin, least_loaded, prefix, ttft"),
    (["--replicas", "2", "--sequential"], "error: replicas: a fleet replays in concurrent mode only"),
    (["--replicas", "2", "--balance-seconds", "-1"], "error: balance_seconds: must be >= 0, got -1.0"),
    (["--replicas", "2", "--plot", "x.png"], "error: plot: the plot compares block sizes of one cache"),
    (["--tenant-shares", "noisy=2"],
     "error: tenant_shares: invalid value 'noisy=2': share of 'noisy' must be in (0, 1], got '2'"),
    (["--noisy-fraction", "1"], "error: noisy_fraction: must be in [0, 1), got 1.0"),
    (["--tier-tokens", "-5"], "error: tier_tokens: -5 is neither 0 (no lower tier) nor a block"),
    (["--tier-write", "sometimes"], "error: tier_write: unknown value 'sometimes'; choose write_back, write_through, write_through_selective"),
    (["--restore-rate", "0"], "error: restore_rate: must be > 0, got 0.0"),
    (["--replicas", "2", "--queue-limits", "obey"],
     "error: queue_limits: unknown value 'obey'; choose from heed, ignore"),
    (["--replicas", "2", "--replica-speeds", "1,fast"], "error: replica_speeds: expected numbers, got 'fast'"),
    (["--replicas", "3", "--replica-speeds", "1,0.5"],
     "error: replica_speeds: 2 speeds for 3 replicas; give one per replica"),
    (["--replica-speeds", "1"], "error: replica_speeds: speeds are for a fleet (--replicas N)"),
    (["--replicas", "2", "--replica-queue-waits", "30,soon"],
     "error: replica_queue_waits: expected numbers, got 'soon'"),
    (["--replicas", "2", "--replica-queue-waits", "30"],
     "error: replica_queue_waits: 1 waits for 2 replicas; give one per replica"),
    (["--replicas", "2", "--replica-queue-waits", "30,-1"],
     "error: replica_queue_waits: each must be a number of seconds >= 0 (0: no limit), got -1.0"),
    (["--replica-queue-waits", "30"], "error: replica_queue_waits: waits are for a fleet (--replicas N)"),
    (["--replicas", "2", "--replica-queue-waits", "30,5", "--max-queue-wait", "10"],
     "error: replica_queue_waits: '30,5' gives each replica its own max_queue_wait; drop --max-queue-wait 10"),
    (["--replicas", "2", "--replica-queue-waits", "0,0", "--queue-limits", "heed,ignore"],
     "error: queue_limits: heed,ignore compares nothing without --max-queue-wait"),
    (["--replicas", "2", "--queue-limits", "heed,ignore"],
     "error: queue_limits: heed,ignore compares nothing without --max-queue-wait"),
    (["--queue-order", "sjf"], "error: queue_order: unknown value 'sjf'; use fifo, priority, lpm or priority+lpm"),
    (["--tenant-queue-waits", "noisy=-5"], "error: tenant_queue_waits: invalid value 'noisy=-5': queue wait of "
                                           "'noisy' must be a number of seconds >= 0 (0: no limit), got '-5'"),
    (["--queue-order", "fifo,priority"], "error: queue_order: priority orders the queue by the tenants' priorities "
                                         "and the requests' own; give the tenants' (--tenant-priorities, e.g. "
                                         "quiet=-10), or a trace whose lines carry priorities"),
    (["--queue-order", "fifo,lpm", "--sequential"],
     "error: queue_order: lpm orders a queue, and --sequential has none (one request at a time)"),
])
def test_bad_options_name_field_and_value(capsys, small_trace, args, message):
    status, out, err = cli(capsys, "bench", "replay", str(small_trace), *args)
    assert status == 2 and out == ""
    assert err.startswith(message)


def replay_json(capsys, *args: str) -> dict:
    """`kvctl bench replay ARGS --json`, which must succeed: its document."""
    status, out, _ = cli(capsys, "bench", "replay", *args, "--json")
    assert status == 0
    return json.loads(out)


def test_replay_of_a_fleet_compares_routing_policies_in_a_table_and_json(capsys):
    doc = replay_json(capsys, "--demo-requests", "80", "--block-sizes", "64", "--policy", "lru",
                      "--capacity-tokens", "20000", "--replicas", "3", "--routing", "round_robin,prefix")
    assert doc["fleet"] == {"replicas": 3, "routing": ["round_robin", "prefix"], "balance_seconds": 2.0,
                            "new_prefix": "home", "placements": 1, "queue_limits": ["heed"], "reroute": True,
                            "replica_speeds": None, "replica_queue_waits": None}
    assert [(r["routing"], r["replicas"], r["block_size"]) for r in doc["runs"]] == [
        ("round_robin", 3, 64), ("prefix", 3, 64)]
    for r in doc["runs"]:
        assert sum(r["requests_per_replica"]) == r["admitted"] and r["admitted"] + r["rejections"] == 80
        assert r["hit_ratio"] <= r["max_hit_ratio"]
    status, out, _ = cli(capsys, "bench", "replay", "--demo-requests", "80", "--block-sizes", "64",
                         "--policy", "lru", "--capacity-tokens", "20000", "--replicas", "3")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("block capacity policy routing"))
    assert [line.split()[3] for line in lines[header + 1:header + 5]] == [
        "round_robin", "least_loaded", "prefix", "ttft"]
    assert "hit with one unbounded cache for the fleet: block 64 " in out


def test_a_fleet_replay_compares_heeding_queue_limits_with_ignoring_them(capsys, tmp_path):
    """tests/test_replay.py's HELD_UP: prefix routing heeding the replicas' 5 s max_queue_wait sends
    the third request to the replica that starts it in time; ignoring it, the request times out and
    is re-routed there; round_robin, blind to load, is replayed once."""
    path = tmp_path / "held-up.jsonl"
    write_trace(path, [TraceRequest(0, 1024, 20, (1, 10)), TraceRequest(0, 1024, 3, (2, 20)),
                       TraceRequest(1000, 1024, 1, (1, 11))])
    args = (str(path), "--block-sizes", "512", "--policy", "lru", "--capacity-tokens", "4096", "--replicas", "2",
            "--max-running", "1", "--prefill-rate", "1e12", "--decode-rate", "1", "--max-queue-wait", "5",
            "--balance-seconds", "100", "--routing", "round_robin,prefix", "--queue-limits", "heed,ignore")
    doc = replay_json(capsys, *args)
    assert [(r["routing"], r["queue_limits"], r["rerouted"], r["reject_reasons"]) for r in doc["runs"]] == [
        ("round_robin", "ignore", 1, {}), ("prefix", "heed", 0, {}), ("prefix", "ignore", 1, {})]
    assert [r["ttft_p99_s"] for r in doc["runs"][1:]] == [pytest.approx(2.0), pytest.approx(5.0)]
    status, out, _ = cli(capsys, "bench", "replay", *args)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("block capacity policy routing"))
    assert [" ".join(line.split()[3:5]) for line in lines[header + 1:header + 4]] == [
        "round_robin 0.0%", "prefix, heed", "prefix, ignore"]
    words = " ".join(out.split())  # rich wraps at 80 columns
    assert "heed/ignore: whether the router passed over replicas predicted past their max_queue_wait" in words
    assert "prefix, ignore (block 512, capacity 4,096, lru): re-routed 1 after a queue timeout" in words
    doc = replay_json(capsys, *args[:-2], "--queue-limits", "ignore", "--no-reroute")
    assert [(r["routing"], r["rerouted"], r["reject_reasons"]) for r in doc["runs"]] == [
        ("round_robin", 0, {"queue_timeout": 1}), ("prefix", 0, {"queue_timeout": 1})]


def test_a_fleet_replay_of_mixed_speeds_says_where_each_routing_sent_its_requests(capsys, tmp_path):
    path = tmp_path / "mixed.jsonl"
    write_trace(path, [TraceRequest(t, 1024, 1, (n, 100 + n)) for n, t in enumerate((0, 0, 10_000, 20_000), 1)])
    args = (str(path), "--block-sizes", "256", "--policy", "lru", "--capacity-tokens", "16384", "--replicas", "2",
            "--max-running", "1", "--prefill-rate", "1000", "--decode-rate", "1e6", "--replica-speeds", "1,0.25",
            "--routing", "round_robin,ttft")
    doc = replay_json(capsys, *args)
    assert doc["fleet"]["replica_speeds"] == [1.0, 0.25]
    assert [(r["routing"], r["speeds"], r["requests_per_replica"]) for r in doc["runs"]] == [
        ("round_robin", [1.0, 0.25], [2, 2]), ("ttft", [1.0, 0.25], [4, 0])]
    status, out, _ = cli(capsys, "bench", "replay", *args)
    words = " ".join(out.split())
    assert "requests per replica (speeds 1/0.25), round_robin (block 256, capacity 16,384, lru): 2/2" in words
    assert "requests per replica (speeds 1/0.25), ttft (block 256, capacity 16,384, lru): 4/0" in words


def test_a_fleet_replay_gives_each_replica_its_own_queue_limit_and_re_routes_a_full_queue_s_refusal(capsys,
                                                                                                     tmp_path):
    """tests/test_replay.py's FULL_QUEUES (one prompt, one slot and a queue of one per replica):
    prefix routing takes two refusals by a full queue to the other replica (the fourth request it
    turns away everywhere). With a 0.5 s limit on each replica of its own, round_robin re-routes
    three queue timeouts; with one on replica-0 only, the line under the table says where each
    routing sent what."""
    path = tmp_path / "full.jsonl"
    write_trace(path, [TraceRequest(t, 1024, out, (1, 10 + n)) for n, (t, out) in enumerate(
        ((0, 20), (1000, 1), (2000, 5), (3000, 1), (4000, 1)))])
    args = (str(path), "--block-sizes", "512", "--policy", "lru", "--capacity-tokens", "4096", "--replicas", "2",
            "--max-running", "1", "--max-queue", "1", "--prefill-rate", "1e12", "--decode-rate", "1",
            "--balance-seconds", "100", "--routing", "round_robin,prefix")
    doc = replay_json(capsys, *args)
    assert [(r["routing"], r["rerouted_full"], r["reject_reasons"]) for r in doc["runs"]][1] == (
        "prefix", 2, {"queue_full": 1})
    words = " ".join(cli(capsys, "bench", "replay", *args)[1].split())
    assert "prefix (block 512, capacity 4,096, lru): rejected queue_full 1; re-routed 2 after a full queue (429)" \
        in words
    doc = replay_json(capsys, *args, "--replica-queue-waits", "0.5,0.5")
    assert (doc["fleet"]["replica_queue_waits"], doc["runs"][0]["queue_waits"]) == ([0.5, 0.5], [0.5, 0.5])
    assert [(r["routing"], r["rerouted"], r["reject_reasons"], r["admitted"]) for r in doc["runs"]] == [
        ("round_robin", 3, {"queue_timeout": 2}, 3), ("prefix", 0, {"queue_timeout": 2}, 3)]
    words = " ".join(cli(capsys, "bench", "replay", *args, "--replica-queue-waits", "0.5,0")[1].split())
    assert "requests per replica (max_queue_wait 0.5/0 s), round_robin (block 512, capacity 4,096, lru): 1/3" in words
    assert "requests per replica (max_queue_wait 0.5/0 s), prefix (block 512, capacity 4,096, lru): 1/2" in words


def test_a_replay_compares_first_come_first_served_with_the_longest_cached_prefix_first(capsys, tmp_path):
    """tests/test_replay.py's LPM_TRACE: lpm starts the request opening with a cached block first."""
    path = tmp_path / "lpm.jsonl"
    write_trace(path, [TraceRequest(0, 1024, 4, (1, 10)), TraceRequest(1000, 1024, 1, (2, 20)),
                       TraceRequest(2000, 1024, 1, (1, 11))])
    args = (str(path), "--block-sizes", "512", "--policy", "lru", "--capacity-tokens", "8192", "--max-running", "1",
            "--prefill-rate", "1e12", "--decode-rate", "1", "--queue-order", "fifo,lpm")
    doc = replay_json(capsys, *args)
    assert doc["settings"]["queue_order"] == ["fifo", "lpm"]
    assert [(r["policy"], r["queue_order"], round(r["ttft_p50_s"], 6), round(r["ttft_p95_s"], 6))
            for r in doc["runs"]] == [("lru", "fifo", 3.0, 3.0), ("lru+lpm", "lpm", 2.0, 4.0)]
    out = cli(capsys, "bench", "replay", *args)[1]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["block", "capacity", "policy"])
    assert [line.split()[2] for line in lines[header + 1:header + 3]] == ["lru", "lru+lpm"]
    words = " ".join(out.split())
    assert "time to first token p50/p95/p99 at block 512, capacity 8,192, lru: 3.00/3.00/3.00 s" in words
    assert "time to first token p50/p95/p99 at block 512, capacity 8,192, lru+lpm: 2.00/4.00/4.00 s" in words
    fleet = replay_json(capsys, *args, "--replicas", "2", "--routing", "prefix")
    assert [(r["policy"], r["queue_order"]) for r in fleet["runs"]] == [("lru", "fifo"), ("lru+lpm", "lpm")]


def test_a_replay_compares_first_come_first_served_with_the_tenants_priorities(capsys, tmp_path):
    """tests/test_replay.py's PRIORITY_TRACE: quiet's request goes before noisy's earlier ones."""
    path = tmp_path / "priority.jsonl"
    write_trace(path, [TraceRequest(0, 512, 4, (1,), "noisy"), TraceRequest(1000, 512, 1, (2,), "noisy"),
                       TraceRequest(2000, 512, 1, (3,), "noisy"), TraceRequest(3000, 512, 1, (4,), "quiet")])
    args = (str(path), "--block-sizes", "512", "--policy", "lru", "--capacity-tokens", "8192", "--max-running", "1",
            "--prefill-rate", "1e12", "--decode-rate", "1", "--queue-order", "fifo,priority",
            "--tenant-priorities", "quiet=-10", "--max-queue-wait", "3.5")
    doc = replay_json(capsys, *args)
    assert doc["settings"]["queue_order"] == ["fifo", "priority"]
    def rounded(figures):
        return {tenant: round(seconds, 6) for tenant, seconds in figures.items()}

    assert [(r["policy"], rounded(r["tenant_ttft_p50_s"]), rounded(r["tenant_ttft_p95_s"]), r["tenant_rejected"])
            for r in doc["runs"]] == [
        ("lru", {"noisy": 3.0, "quiet": 3.0}, {"noisy": 3.0, "quiet": 3.0}, {"noisy": 0, "quiet": 0}),
        ("lru+prio", {"noisy": 0.0, "quiet": 1.0}, {"noisy": 3.0, "quiet": 1.0}, {"noisy": 1, "quiet": 0})]
    out = cli(capsys, "bench", "replay", *args)[1]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip() == "first token p50/p95 (s), by tenant")
    assert lines[header + 1].split() == ["block", "capacity", "policy", "noisy", "quiet"]
    assert [" ".join(line.split()) for line in lines[header + 2:header + 4]] == [
        "512 8,192 lru 3.00/3.00 3.00/3.00", "512 8,192 lru+prio 0.00/3.00 (rej 1) 1.00/1.00"]
    words = " ".join(out.split())
    assert "time to first token p50/p95/p99 at block 512, capacity 8,192, lru+prio: 1.00/3.00/3.00 s" in words
    assert len(max(lines, key=len)) <= 80
    fleet = replay_json(capsys, *args, "--replicas", "2", "--routing", "round_robin")
    assert [(r["policy"], r["queue_order"]) for r in fleet["runs"]] == [("lru", "fifo"), ("lru+prio", "priority")]
    # noisy's own limit of 10 s (as kvd's tenant_queue_waits): none of its requests is turned away
    own = replay_json(capsys, *args, "--tenant-queue-waits", "noisy=10")
    assert own["settings"]["tenant_queue_waits"] == {"noisy": 10.0}
    assert [r["tenant_rejected"] for r in own["runs"]] == [{"noisy": 0, "quiet": 0}] * 2
    # each tenant's figures under the fleet's table: round robin puts r2 behind r0 (2 s), the others alone
    two = " ".join(cli(capsys, "bench", "replay", *args, "--replicas", "2", "--routing", "round_robin")[1].split())
    assert ("first token p50/p95 by tenant, round_robin (block 512, capacity 8,192, lru+prio): noisy 0.00/2.00 s, "
            "quiet 0.00/0.00 s") in two
    assert [(r["tenant_ttft_p95_s"], r["tenant_rejected"]) for r in fleet["runs"]] == [
        ({"noisy": pytest.approx(2.0), "quiet": pytest.approx(0.0, abs=1e-6)}, {"noisy": 0, "quiet": 0})] * 2


def test_missing_or_bad_trace_file(capsys, tmp_path):
    status, _, err = cli(capsys, "bench", "replay", str(tmp_path / "nope.jsonl"))
    assert status == 2 and err.startswith("error: trace: no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    status, _, err = cli(capsys, "bench", "replay", str(bad))
    assert status == 2
    assert err.startswith("error: bad.jsonl line 1: field 'input_length' must be an integer >= 1")


def test_trace_generate_writes_a_replayable_file(capsys, tmp_path):
    path = tmp_path / "gen.jsonl"
    status, out, _ = cli(capsys, "trace", "generate", str(path), "--requests", "25", "--seed", "4")
    assert status == 0 and out.strip() == f"wrote 25 requests to {path}"
    lines = path.read_text().splitlines()
    assert len(lines) == 25 and set(json.loads(lines[0])) == {
        "timestamp", "input_length", "output_length", "hash_ids"}
    rows = [json.loads(line) for line in lines]
    status, out, _ = cli(capsys, "trace", "generate", str(path), "--requests", "25", "--seed", "4", "--json")
    assert status == 0 and json.loads(out) == {
        "path": str(path), "requests": 25, "seed": 4, "input_tokens": sum(r["input_length"] for r in rows),
        "output_tokens": sum(r["output_length"] for r in rows), "seconds": rows[-1]["timestamp"] / 1000.0}
    assert path.read_text().splitlines() == lines  # equal seeds, equal traces


def test_version(capsys):
    status, out, _ = cli(capsys, "--version")
    assert status == 0 and out.strip() == "kvctl 0.1.0"


def _commands(group, prefix=(), groups=False):
    """(path, command) for each command under `group`; `groups`: each group too (`kvctl tiers`)."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            if groups:
                yield prefix + (name,), command
            yield from _commands(command, prefix + (name,), groups)
        else:
            yield prefix + (name,), command


def test_every_command_has_one_line_help_and_an_example():
    root = typer.main.get_command(app)
    commands = list(_commands(root))
    assert {" ".join(path) for path, _ in commands} >= {"bench replay", "trace generate"}
    for path, command in commands:
        assert command.help and command.help.strip().splitlines()[0], path
        assert "Example: kvctl " + " ".join(path) in command.help, path
        if any(p.name == "as_json" for p in command.params) or path == ("bench", "replay"):
            assert any("--json" in p.opts for p in command.params), path


def test_help_paragraphs_wrap_to_the_terminal_and_examples_stay_as_written():
    from kvctl.help_text import reflow

    doc = """First line.

        A paragraph written across
        two lines.

        Indented rows stay:
          a  1
          b  2

        Example: kvctl x --y
        """
    assert reflow(doc) == ("First line.\n\nA paragraph written across two lines.\n\n"
                           "Indented rows stay:\n  a  1\n  b  2\n\nExample: kvctl x --y")
    root = typer.main.get_command(app)
    shown = list(_commands(root, groups=True))
    assert {("tiers",), ("responses",), ("profile",)} <= {path for path, _ in shown}  # groups with a help of their own
    for path, command in shown:  # every paragraph of every command and group is one line, wrapped by rich
        for paragraph in (command.help or "").split("\n\n"):
            lines = paragraph.splitlines()
            assert len(lines) == 1 or any(line.startswith((" ", "\t")) for line in lines), (path, paragraph)


def test_bench_kernels_without_cuda_checks_correctness_only(capsys, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the figures path runs instead")
    status, out, _ = cli(capsys, "bench", "kernels", "--json", "--save", "--state-dir", str(tmp_path))
    assert status == 0
    doc = json.loads(out)
    from kvctl.daemon.store import Store

    assert Store(tmp_path / "kvd.sqlite3").get_run(doc["run_id"])["kind"] == "bench_kernels"
    assert doc["figures"] is None and doc["note"] == "figures need CUDA; correctness only"
    assert [c["check"] for c in doc["checks"]] == [
        "write_kv float32", "paged_decode_attention float32 (GQA 4)",
        "paged_prefill_attention float32 (GQA 4)", "paged_decode_attention float32, window 20",
        "paged_prefill_attention float32, window 20", "paged_decode_attention float32, softcap 2",
        "paged_prefill_attention float32, softcap 2", "paged_decode_attention float32, sinks, window 20",
        "paged_prefill_attention float32, sinks, window 20", "copy_blocks",
        "moe_experts float32 (8 experts, 2 per row)", "moe_experts float32, MXFP4 experts"]
    assert all(c["ok"] and c["max_abs_diff"] <= c["tolerance"] for c in doc["checks"])


def test_bench_kernels_on_a_cpu_machine_as_an_operator_runs_it():
    """A fresh process without TRITON_INTERPRET (the tests set it for themselves): the command
    must choose the interpreter before anything imports the kernels."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the figures path runs instead")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", "from kvctl.cli import main; main(['bench', 'kernels', '--json'])"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["note"] == "figures need CUDA; correctness only"


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 4.8e12), ("NVIDIA GH200 480GB", 4.0e12),
                                        ("NVIDIA GH200 144G HBM3e", 4.9e12),
                                        ("NVIDIA H100 80GB HBM3", 3.35e12),
                                        ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA A100-SXM4-80GB", 2.039e12),
                                        ("Some Future GPU", None)])
def test_peak_bandwidth_table(name, peak):
    from kvctl.bench_kernels import peak_bandwidth

    assert peak_bandwidth(name) == peak


def test_bench_kernels_bad_options(capsys):
    status, _, err = cli(capsys, "bench", "kernels", "--shape", "gpt5")
    assert status == 2 and err.startswith("error: shape: unknown value 'gpt5'; choose from llama3-8b, llama3-70b")
    status, _, err = cli(capsys, "bench", "kernels", "--dtype", "fp4")
    assert status == 2 and err.startswith("error: dtype: unknown value 'fp4'")


def test_bench_kernels_launch_options_name_the_field_and_value(capsys):
    pytest.importorskip("torch")
    status, _, err = cli(capsys, "bench", "kernels", "--decode-launch", "tile=48")
    assert status == 2
    assert err.startswith("error: decode_launch: launch.tile: must be a power of two of at least 16, got 48")
    status, _, err = cli(capsys, "bench", "kernels", "--decode-launch", "tile=64,warps=8")
    assert status == 2
    assert err.startswith("error: decode_launch: unknown field 'warps' in 'tile=64,warps=8'; choose from tile, "
                          "num_warps, num_stages, programs_per_sm, fp16_dot, direct_write as name=value")
    status, _, err = cli(capsys, "bench", "kernels", "--prefill-launch", "rows=many")
    assert status == 2 and err.startswith("error: prefill_launch: rows must be an integer, got 'many'")
    status, _, err = cli(capsys, "bench", "kernels", "--repeat", "0")
    assert status == 2 and err.startswith("error: repeat: must be at least 1, got 0")


def test_bench_kernels_launch_option_sets_every_named_field():
    pytest.importorskip("torch")
    from kvctl.bench_kernels import parse_launch
    from kvctl.kernels import DecodeLaunch, PrefillLaunch

    assert parse_launch("decode_launch", "tile=128, num_warps=8,num_stages=2", DecodeLaunch) == DecodeLaunch(
        tile=128, num_warps=8, num_stages=2, programs_per_sm=DecodeLaunch().programs_per_sm)
    assert parse_launch("prefill_launch", None, PrefillLaunch) == PrefillLaunch()


def test_bench_decode_figures_count_the_bytes_moved_and_check_the_baseline():
    """The figures' arithmetic, on the CPU with a stand-in timer: K/V of every token, the scales,
    q and out, and the block tables, over the kernel's time; the baseline computes the same
    attention (its output lies within bfloat16 rounding of the kernel's)."""
    pytest.importorskip("triton")
    import torch

    from kvctl.bench_kernels import SHAPES, run_decode, run_prefill

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the figures' arithmetic is the same on either
    times = iter([2.0, 3.0])
    decode = run_decode(["llama3-8b"], [2], [40], "int8", 16, 1 << 20, 1e12, device=device,
                        timer=lambda fn: next(times))
    assert len(decode) == 1
    f = decode[0]
    heads, kv_heads, head_dim = SHAPES["llama3-8b"]
    moved = (2 * 2 * 40 * kv_heads * head_dim * 1  # int8 K and V
             + 2 * kv_heads * 4  # float32 scales
             + 2 * 2 * heads * head_dim * 2  # bfloat16 q read and out written
             + 2 * 3 * 4)  # int32 tables: 3 blocks of 16 for 40 tokens
    assert (f.batch, f.context, f.ms, f.sdpa_ms) == (2, 40, 2.0, 3.0)
    assert f.bytes_per_second == pytest.approx(moved / 2e-3)
    assert f.fraction_of_peak == pytest.approx(moved / 2e-3 / 1e12)
    assert f.speedup_vs_sdpa == pytest.approx(1.5)
    assert f.max_abs_diff_vs_sdpa < 2e-3  # outputs near 0.01 (cache scale 0.01)
    assert not run_decode(["llama3-8b"], [4], [40], "int8", 16, 100, 1e12, device=device, timer=lambda fn: 1.0)

    times = iter([2.0, 3.0])  # a sliding window of 24: the kernel and SDPA attend to the last 24 tokens
    (w,) = run_decode(["llama3-8b"], [2], [40], "int8", 16, 1 << 20, 1e12, device=device,
                      timer=lambda fn: next(times), window=24)
    assert w.bytes_per_second == pytest.approx((moved - 2 * 2 * 16 * kv_heads * head_dim) / 2e-3)
    assert w.max_abs_diff_vs_sdpa < 2e-3 and w.speedup_vs_sdpa == pytest.approx(1.5)

    times = iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])  # --repeat 3: three kernel timings, then three of SDPA
    (r,) = run_decode(["llama3-8b"], [2], [40], "int8", 16, 1 << 20, 1e12, device=device,
                      timer=lambda fn: next(times), repeat=3)
    assert (r.ms, r.ms_range, r.sdpa_ms, r.sdpa_ms_range) == (2.0, [1.0, 3.0], 5.0, [4.0, 6.0])
    assert r.speedup_vs_sdpa == pytest.approx(2.5) and r.bytes_per_second == pytest.approx(moved / 2e-3)

    times = iter([4.0, 2.0])
    (p,) = run_prefill(["llama3-8b"], "bfloat16", 16, batch=1, new_tokens=20, prefixes=(24,), device=device,
                       timer=lambda fn: next(times))
    pairs = heads * (20 * 24 + 20 * 21 / 2)  # each new token sees the prefix and the new tokens up to it
    assert p.tflops == pytest.approx(4 * pairs * head_dim / 4e-3 / 1e12)
    assert p.speedup_vs_sdpa == pytest.approx(0.5)
    # both outputs are bfloat16 averages of standard-normal values, below 4 in size: one step there is 2**-6
    assert p.max_abs_diff_vs_sdpa <= 2 ** -6


def test_bench_kernels_compile_for_names_a_bad_architecture(capsys):
    pytest.importorskip("torch")
    status, _, err = cli(capsys, "bench", "kernels", "--compile-for", "sm_90,sm_70")
    assert status == 2
    assert err.startswith("error: compile_for: unknown value 'sm_70'; choose from sm_80, sm_86, sm_89, sm_90, sm_100")


def test_bench_kernels_compile_report_lists_each_kernel_and_every_refusal():
    """The real compile check (quick matrix, its own process) rendered as an operator sees it."""
    pytest.importorskip("triton")
    from rich.console import Console

    from kvctl.bench_kernels import compile_for_arch, print_compile_report

    report = compile_for_arch("sm_80", quick=True)
    assert report["arch"] == "sm_80" and report["shared_limit"] == 166_912
    console = Console(record=True, width=120)
    print_compile_report(console, "sm_80", report)
    text = console.export_text()
    assert "kernels compiled for sm_80 (A100): shared memory limit 163 KiB per block" in text
    cells = [line.replace("│", " ").split() for line in text.splitlines()]
    rows = {c[0]: c[1:] for c in cells if c and c[0].endswith("_kernel")}
    assert set(rows) == {"write_kv_kernel", "decode_partial_kernel", "decode_merge_kernel", "prefill_kernel",
                         "copy_blocks_kernel", "grouped_gemm_kernel"}
    # bfloat16 at head_dim 64 and 256 (fp8_e4m3 refused), each writing its output, split for a merge,
    # over a sliding window, with capped scores, and with sinks on a window (written, then merged);
    # prefill over the whole context, over a window, capped, and with sinks on a window
    assert rows["decode_partial_kernel"][0] == "12" and rows["decode_merge_kernel"][0] == "2"
    assert rows["prefill_kernel"][0] == "8"
    assert rows["grouped_gemm_kernel"][0] == "4"  # a MoE's two GEMMs in bfloat16, its weights as they are and in MXFP4
    assert all(r[-2:] == ["0", "0"] for r in rows.values())  # no spills, no failures
    assert ("refused by the launchers on sm_80 (2 configurations): fp8_e4m3 needs a GPU of compute capability "
            "8.9 or newer (L4, L40S, H100, H200); this one is 8.0: use fp8_e5m2 or int8") in " ".join(text.split())


def test_bench_kernels_on_an_a100_refuses_fp8_e4m3_before_timing_anything(capsys, monkeypatch):
    pytest.importorskip("torch")
    import torch

    import kvctl.bench_kernels as bench_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(bench_kernels, "run_decode", lambda *a: pytest.fail("timed on a GPU without fp8_e4m3"))
    status, _, err = cli(capsys, "bench", "kernels", "--dtype", "fp8_e4m3")
    assert status == 2
    assert err.startswith("error: dtype: fp8_e4m3 needs a GPU of compute capability 8.9 or newer (L4, L40S, "
                          "H100, H200); this one is 8.0: use fp8_e5m2 or int8")


def test_bench_kernels_on_a_gpu_reports_medians_ranges_and_the_launch(capsys, monkeypatch):
    """The figures path as on a GPU (the kernels run under the interpreter, a stand-in timer):
    the JSON document and the tables carry each case's median, its range and the launch."""
    pytest.importorskip("triton")
    from dataclasses import asdict

    import torch

    import kvctl.bench_kernels as bench_kernels
    from kvctl.kernels import DecodeLaunch, PrefillLaunch

    real_decode, real_prefill = bench_kernels.run_decode, bench_kernels.run_prefill
    device = "cuda" if torch.cuda.is_available() else "cpu"
    times = [3.0, 1.0, 2.0, 5.0, 4.0, 6.0]

    def timer(fn, clock=iter(times * 12)):
        return next(clock)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(bench_kernels, "run_decode", lambda *a, **k: real_decode(*a, **k, device=device))
    monkeypatch.setattr(bench_kernels, "run_prefill", lambda *a, **k: real_prefill(
        *a, **k, batch=1, new_tokens=20, prefixes=(24,), device=device))
    monkeypatch.setattr(bench_kernels, "TIMERS", {"calls": timer, "graph": lambda fn: pytest.fail("graph timer")})
    # a MoE layer of 4 experts (2 per row, hidden 64, intermediate 32), 3 rows through it
    real_moe = bench_kernels.run_moe
    monkeypatch.setattr(bench_kernels, "MOE_SHAPES", {"tiny": (4, 2, 64, 32)})
    monkeypatch.setattr(bench_kernels, "run_moe", lambda *a, **k: real_moe(*a, **k, device=device))
    monkeypatch.setattr(bench_kernels, "_do_bench", timer)
    args = ["bench", "kernels", "--shape", "llama3-8b", "--batch", "2", "--context", "40", "--repeat", "3",
            "--decode-launch", "tile=32", "--moe-shape", "tiny", "--moe-tokens", "3"]
    status, out, _ = cli(capsys, *args, "--json")
    assert status == 0
    doc = json.loads(out)
    assert (doc["device"], doc["peak_bytes_per_second"], doc["repeat"]) == ("NVIDIA H200", 4.8e12, 3)
    assert doc["timer"] == "calls"
    assert doc["decode_launch"] == asdict(DecodeLaunch(tile=32)) and doc["prefill_launch"] == asdict(PrefillLaunch())
    (d,) = doc["decode"]
    assert (d["ms"], d["ms_range"], d["sdpa_ms"], d["sdpa_ms_range"]) == (2.0, [1.0, 3.0], 5.0, [4.0, 6.0])
    assert [(p["prefix"], p["ms"], p["ms_range"]) for p in doc["prefill"]] == [(24, 2.0, [1.0, 3.0])]
    m, q = doc["moe"]  # bfloat16 weights, then kept in MXFP4
    assert (m["shape"], m["weights"], m["tokens"], m["ms"], m["ms_range"], m["loop_ms"], m["loop_ms_range"],
            m["speedup_vs_loop"]) == ("tiny", "bf16", 3, 2.0, [1.0, 3.0], 5.0, [4.0, 6.0], 2.5)
    assert 2 <= m["experts_run"] <= 4 and m["max_abs_diff_vs_loop"] < 0.02  # bfloat16 rows, float32 sums
    weight_bytes = m["experts_run"] * 3 * 64 * 32 * 2
    assert m["weight_bytes_per_second"] == weight_bytes / 2e-3 and m["fraction_of_peak"] == weight_bytes / 2e-3 / 4.8e12
    assert (q["shape"], q["weights"], q["tokens"]) == ("tiny", "mxfp4", 3) and q["max_abs_diff_vs_loop"] < 0.02
    assert q["weight_bytes_per_second"] == q["experts_run"] * 3 * 64 * 32 * 17 / 32 / (q["ms"] / 1e3)
    monkeypatch.setenv("COLUMNS", "160")  # one line a row
    status, out, _ = cli(capsys, *args)
    assert status == 0
    assert "paged decode on NVIDIA H200 (bfloat16 cache, block 16; time per call)" in out
    assert "2.000 (1.000-3.000)" in out and "2.50x" in out
    assert "a MoE layer's experts, bfloat16 rows (time per call): grouped GEMMs vs expert by expert" in out
    status, _, err = cli(capsys, *args, "--moe-weights", "fp8")
    assert status == 2 and err.strip() == "error: moe_weights: unknown value 'fp8'; choose from bf16, mxfp4"
    status, out, _ = cli(capsys, *args, "--window", "24")
    assert status == 0
    assert ("paged decode on NVIDIA H200 (bfloat16 cache, block 16, the last 24 tokens of each context; time per "
            "call)") in " ".join(out.split())  # (the title wraps)
    status, _, err = cli(capsys, *args, "--window", "0")
    assert status == 2 and err.strip() == "error: window: must be at least 1, got 0"


def test_bench_kernels_timer_graph_times_kernel_and_sdpa_from_cuda_graphs(capsys, monkeypatch):
    """--timer graph times every case, the kernels' and SDPA's alike, with the graph timer; the
    document and the table titles say so. A timer name that does not exist is refused by name."""
    pytest.importorskip("triton")
    import torch

    import kvctl.bench_kernels as bench_kernels

    status, _, err = cli(capsys, "bench", "kernels", "--timer", "wall")
    assert status == 2 and err.startswith("error: timer: unknown value 'wall'; choose from calls, graph")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timed = []

    def graph_timer(fn):
        timed.append(fn.__name__)
        return 1.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real_decode, real_prefill = bench_kernels.run_decode, bench_kernels.run_prefill
    monkeypatch.setattr(bench_kernels, "run_decode", lambda *a, **k: real_decode(*a, **k, device=device))
    monkeypatch.setattr(bench_kernels, "run_prefill", lambda *a, **k: real_prefill(
        *a, **k, batch=1, new_tokens=20, prefixes=(24,), device=device))
    monkeypatch.setattr(bench_kernels, "TIMERS", {"calls": lambda fn: pytest.fail("calls timer"),
                                                  "graph": graph_timer})
    args = ["bench", "kernels", "--shape", "llama3-8b", "--batch", "2", "--context", "40", "--timer", "graph",
            "--moe-shape", "none"]
    status, out, _ = cli(capsys, *args, "--json")
    assert status == 0
    assert json.loads(out)["timer"] == "graph" and json.loads(out)["moe"] == []
    assert timed == ["kernel", "baseline", "kernel", "baseline"]  # one decode case, one prefill case
    monkeypatch.setenv("COLUMNS", "160")
    status, out, _ = cli(capsys, *args)
    assert "block 16; GPU time, CUDA graph)" in out and "paged prefill (GPU time, CUDA graph)" in out


def test_bench_kernels_fails_when_a_kernel_does_not_fit(capsys, monkeypatch):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the figures path runs instead")
    import kvctl.bench_kernels as bench_kernels

    failing = {"arch": "sm_89", "devices": "L40S, L4, RTX 40xx", "shared_limit": 101_376, "results": [
        {"kernel": "decode_partial_kernel", "config": "float32 cache, float32 q, head_dim 256, 64/1 heads",
         "ok": False, "shared_bytes": 139_648, "shared_limit": 101_376, "registers": 64, "spill_bytes": 0,
         "num_warps": 4, "num_stages": 3, "problem": "needs 139,648 bytes of shared memory; sm_89 allows 101,376",
         "refused": None}]}
    monkeypatch.setattr(bench_kernels, "compile_for_arch", lambda arch: failing)
    status, out, _ = cli(capsys, "bench", "kernels", "--compile-for", "sm_89", "--json")
    assert status == 1
    assert json.loads(out)["compile"] == {"sm_89": failing}
    status, out, _ = cli(capsys, "bench", "kernels", "--compile-for", "sm_89")
    assert status == 1
    assert ("FAILED decode_partial_kernel (float32 cache, float32 q, head_dim 256, 64/1 heads): needs 139,648 "
            "bytes of shared memory; sm_89 allows 101,376") in " ".join(out.split())


def test_readme_documents_every_command():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    root = typer.main.get_command(app)
    for path, _ in _commands(root):
        assert f"kvctl {' '.join(path)}" in readme, path


def test_table_helpers_print_spans_and_sizes_at_a_glance_and_keep_ids_whole():
    from rich.console import Console

    from kvctl.tables import compact_table, duration, keep_whole, size

    assert [duration(s) for s in (None, -3, 0, 59.9, 60, 3599, 3600, 3660, 86399, 86400, 90000)] == [
        "-", "0s", "0s", "59s", "1m", "59m", "1h", "1h 1m", "23h 59m", "1d", "1d 1h"]
    assert [size(b) for b in (None, 512, 1024, 1441792, 3 * 2**40)] == ["-", "512 B", "1.0 KiB", "1.4 MiB",
                                                                       "3.0 TiB"]
    table = compact_table("id", "note")
    table.add_row("pin-296845ab33f0d6a9", "a long note that has to wrap somewhere in a narrow terminal")
    keep_whole(table, 0)
    console = Console(record=True, width=40)
    console.print(table)
    lines = console.export_text().splitlines()
    assert lines[1].startswith("pin-296845ab33f0d6a9 a long") and len(lines) > 3  # the note wraps, the id does not


def test_a_large_block_map_is_drawn_in_at_most_2048_cells_of_their_most_common_state():
    from rich.console import Console

    from kvctl.daemon.server.block_map import fold_block_map
    from kvctl.status_view import map_cells, render_status

    assert fold_block_map("..aa", max_cells=8) == ("..aa", 1)
    assert fold_block_map("..a" + "ppc" + "sss" + ".", max_cells=4) == (".ps.", 3)  # 10 blocks in cells of 3
    assert fold_block_map("acca", max_cells=2) == ("ac", 2)  # a tie goes to the state met first
    big = "." * 100_000 + "a" * 28_000 + "p" * 3_072  # a GPU's 131,072 blocks
    cells, per_cell = fold_block_map(big, 2048)
    # the cell across 99,968..100,031 holds 32 free and 32 active blocks: a tie, so free
    assert (per_cell, len(cells)) == (64, 2048) and [cells.count(c) for c in ".ap"] == [1563, 437, 48]
    # kvd folded it (the answer says how many blocks a cell is): drawn as it came
    assert map_cells({"block_map": cells, "block_map_per_cell": 64}) == (cells, 64)
    # an older kvd sent a character per block: kvctl folds it the same way
    assert map_cells({"block_map": big}) == (cells, 64)
    for answer in ({"block_map": big}, {"block_map": cells, "block_map_per_cell": 64}):
        data = {**_status_data(0), **answer}
        data["blocks"]["device"] = {**data["blocks"]["device"], "total": len(big), "free": len(big)}
        console = Console(record=True, width=80)
        render_status(data, console)
        text = console.export_text()
        assert "block map (a cell is 64 blocks, in its most common state)" in text
        # the legend stands whole under the map in an 80-column terminal, a square of each colour
        legend = [line for line in text.splitlines() if "■ free" in line]
        assert [part.strip() for part in legend[0].strip("│ ").split("■")[1:]] == [
            "free", "reserved", "active", "shared", "cached", "pinned"]
        assert sum(line.count("■") for line in text.splitlines()) == 2048 + 6  # 32 rows of 64, the legend


def test_status_blocks_asks_kvd_to_fold_the_map_and_json_asks_for_every_block(capsys, monkeypatch):
    import kvctl.status_view as status_view

    asked = []

    class Fake:
        def get(self, path, **params):
            assert path == "/admin/status"
            asked.append({k: v for k, v in params.items() if v is not None})
            return {**_status_data(0), "block_map": "..ac", "block_map_per_cell": 2}

    monkeypatch.setattr(status_view, "client_for", lambda ctx: Fake())
    status, out, _ = cli(capsys, "status", "--blocks")
    assert status == 0 and asked[-1] == {"blocks": True, "cells": 2048}
    assert "block map (a cell is 2 blocks, in its most common state)" in out
    cli(capsys, "status", "--blocks", "--json")
    assert asked[-1] == {"blocks": True}
    cli(capsys, "status")
    assert asked[-1] == {}


def _prefix_rows():
    return [{"prefix_id": f"{i:016x}", "parent_id": None if i == 0 else f"{0:016x}", "tenant": "acme",
             "start_token": 0 if i == 0 else 16, "tokens": 16 if i == 0 else 16 * (i + 1), "blocks": max(i, 1),
             "bytes": 16384 * max(i, 1), "hits": [5, 50, 0, 7][i], "idle_seconds": [30.0, 600.0, 5.0, None][i],
             "tier": "device", "tiers": {"device": max(i, 1)}, "pinned": False, "pinned_blocks": 0,
             "in_use_blocks": 0, "children": 3 if i == 0 else 0, "detached": False} for i in range(4)]


def test_prefixes_asks_kvd_to_sort_and_cut_and_says_how_many_there_are(capsys, monkeypatch):
    """kvd sorts and cuts the list (a large cache has a row per branch); --json asks for them all."""
    import kvctl.ops as ops

    rows, asked = _prefix_rows(), []

    class Fake:
        def get(self, path, **params):
            assert path == "/admin/prefixes"
            asked.append({k: v for k, v in params.items() if v is not None})
            limit = params.get("limit") or len(rows)
            return {"prefixes": rows[:limit], "total": len(rows), "sort": params["sort"]}

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    status, out, _ = cli(capsys, "prefixes", "--sort", "hits", "--limit", "2")
    lines = out.splitlines()
    assert status == 0 and asked[-1] == {"sort": "hits", "limit": 2}
    assert [line.split()[0] for line in lines[1:3]] == [f"{0:016x}", f"{1:016x}"]
    assert lines[3:] == ["2 of 4 prefixes, by hits; --limit 0 shows all", "tenant acme; none pinned or in use"]
    status, out, _ = cli(capsys, "prefixes", "--limit", "0")
    assert asked[-1] == {"sort": "recent"} and len(out.splitlines()) == 6  # header, 4 rows, one line
    status, out, _ = cli(capsys, "prefixes", "--limit", "1", "--json")
    assert asked[-1] == {"sort": "recent"} and len(json.loads(out)["prefixes"]) == 4
    cli(capsys, "prefixes", "--under", "0435de85")
    assert asked[-1] == {"sort": "recent", "limit": 50, "under": "0435de85"}
    assert cli(capsys, "prefixes", "--sort", "age")[2].strip() == "error: sort: unknown value 'age'; use recent, hits, size"


def test_evict_and_swap_say_what_went_in_every_tier(capsys, monkeypatch):
    import kvctl.ops as ops
    import kvctl.tiers_cmd as tiers_cmd

    answers = {
        "/admin/evict": {"evicted_blocks": 4, "skipped": {}, "result": "ok", "target": "prefix=0435de855e2354d8",
                         "lower_tier_blocks_dropped": 3},
        "/admin/swap": {"prefix_id": "0435de855e2354d8", "to": "device", "copy": True, "blocks": 3,
                        "moved_blocks": 4, "verified_blocks": 3, "extended_blocks": 1, "extended_on_device": 1,
                        "seconds": 0.012},
    }

    class Fake:
        def post(self, path, body):
            return answers[path]

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    monkeypatch.setattr(tiers_cmd, "client_for", lambda ctx, tenant=None: Fake())
    status, out, _ = cli(capsys, "evict", "--prefix", "0435de85")
    assert (status, out) == (0, "evicted prefix=0435de855e2354d8: 4 blocks from the device, 3 from lower tiers\n")
    answers["/admin/evict"].update(target="tenant=acme", evicted_blocks=0, lower_tier_blocks_dropped=0,
                                   remote_purge={"dropped": 5, "seen": 9, "complete": True})
    status, out, _ = cli(capsys, "evict", "--tenant", "acme")
    assert (status, out) == (0, "evicted tenant=acme: 0 blocks from the device, 5 from the shared Redis\n")
    answers["/admin/evict"].update(result="partial", remote_purge={"error": "ConnectionError: refused"},
                                   message="the shared Redis could not be searched: ConnectionError: refused")
    status, out, err = cli(capsys, "evict", "--tenant", "acme")
    assert status == 3 and err == "the shared Redis could not be searched: ConnectionError: refused\n"
    status, out, _ = cli(capsys, "swap", "0435de85", "--to", "device", "--copy")
    assert (status, out.splitlines()) == (0, ["copied 0435de855e2354d8 to device: 3 of 3 blocks verified in "
                                              "12 ms", "the prefix it extends: 1 of 1 blocks on the device"])
    answers["/admin/swap"].update(to="disk", copy=False, kept_on_device={"pinned": 2}, extended_blocks=0)
    status, out, _ = cli(capsys, "swap", "0435de85", "--to", "disk")
    assert (status, out.splitlines()[1]) == (0, "still on the device too: 2 pinned")
    answers["/admin/swap"].update(verified_blocks=0, extended_on_device=0)
    status, out, _ = cli(capsys, "swap", "0435de85", "--to", "device")
    assert status == 3 and out.splitlines()[0].endswith("0 of 3 blocks verified in 12 ms (partial)")


def test_evict_a_prompt_sends_it_with_its_tenant_and_says_what_stayed_shared(capsys, monkeypatch, tmp_path):
    import kvctl.ops as ops

    posted = []
    answer = {"evicted_blocks": 3, "skipped": {}, "result": "ok", "target": "prompt of 88 tokens (tenant acme)",
              "lower_tier_blocks_dropped": 0, "prompt_blocks": 5, "shared_blocks_kept": 3}

    class Fake:
        def post(self, path, body):
            posted.append((path, body))
            return answer

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    status, out, _ = cli(capsys, "evict", "What is a pin?", "--tenant", "acme")
    assert posted[-1] == ("/admin/evict", {"text": "What is a pin?", "tenant": "acme"})
    assert (status, out.splitlines()) == (0, [
        "evicted prompt of 88 tokens (tenant acme): 3 blocks from the device",
        "the prompt has 5 full blocks; 3 of them stay, shared with other cached prefixes"])
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}))
    answer.update(shared_blocks_kept=0)
    status, out, _ = cli(capsys, "evict", "--messages", str(chat))
    assert posted[-1] == ("/admin/evict", {"messages": [{"role": "user", "content": "hi"}], "tenant": None})
    assert out.splitlines()[-1] == "the prompt has 5 full blocks"
    cli(capsys, "evict", "--tokens", "1,2,3")
    assert posted[-1] == ("/admin/evict", {"tokens": [1, 2, 3], "tenant": None})
    # --dry-run asks a path of its own (a kvd that does not know it answers 404 rather than evict)
    answer.update(dry_run=True, not_counted=["other daemons' entries on the shared Redis (searched for by the "
                                             "eviction itself)"])
    status, out, _ = cli(capsys, "evict", "--tokens", "1,2,3", "--dry-run")
    assert posted[-1] == ("/admin/evict/preview", {"tokens": [1, 2, 3], "tenant": None})
    assert (status, out.splitlines()[0]) == (0, "would evict prompt of 88 tokens (tenant acme): 3 blocks from the device")
    assert " ".join(out.split()).endswith("not counted: other daemons' entries on the shared Redis (searched for by "
                                          "the eviction itself)")
    status, _, err = cli(capsys, "evict", "--tokens", "1,2", "--prefix", "0435de85")
    assert (status, err.strip()) == (2, "error: give exactly one of a prompt (TEXT, --tokens, --file, --messages), "
                                        "--prefix, --tenant, --model, --adapter-id, --model-revision or "
                                        "--all-unpinned")
    assert len(posted) == 4


def test_pin_by_prefix_id_sends_the_id_and_refuses_text_beside_it(capsys, monkeypatch):
    import kvctl.ops as ops

    posted = []

    class Fake:
        def post(self, path, body):
            posted.append((path, body))
            return {"pin_id": "pin-0123456789abcdef", "blocks": 3, "tenant": "acme", "cached_blocks": 3,
                    "warmed": False, "expires_in_seconds": 3600.0, "prefix_id": "0435de855e2354d8"}

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    status, out, _ = cli(capsys, "pin", "--prefix", "0435de85", "--ttl", "1h", "--note", "support bot")
    assert (status, posted) == (0, [("/admin/pins", {"prefix": "0435de85", "tenant": None, "ttl": "1h",
                                                     "note": "support bot"})])
    assert out == "pinned pin-0123456789abcdef: 3 blocks for tenant acme (3 cached), expires in 1h\n"
    status, _, err = cli(capsys, "pin", "hello", "--prefix", "0435de85")
    assert status != 0 and err.strip() == "error: give exactly one of TEXT, --tokens, --file, --messages or --prefix"


@pytest.mark.parametrize("was, now, said", [
    ({"owner": "ops", "note": "support bot", "expires_in_seconds": 2520.0}, {"note": "", "expires_in_seconds": None},
     "pinned already: it no longer expires (it had 42m left; --ttl keeps an expiry); its note was 'support bot' "
     "(--note keeps one)"),
    ({"owner": "ops", "note": "x", "expires_in_seconds": None}, {"note": "x", "expires_in_seconds": 3600.0},
     "pinned already: it had no expiry"),
    ({"owner": "cron", "note": "x", "expires_in_seconds": 60.0}, {"note": "y", "expires_in_seconds": 86400.0},
     "pinned already: it had 1m left; its note was 'x'; its owner was cron"),
    ({"owner": "ops", "note": "", "expires_in_seconds": None}, {"note": "", "expires_in_seconds": None},
     "pinned already: nothing else changed"),
])
def test_a_pin_made_again_says_what_its_expiry_note_and_owner_were(capsys, monkeypatch, was, now, said):
    import kvctl.ops as ops

    answer = {"pin_id": "pin-0123456789abcdef", "blocks": 3, "tenant": "acme", "cached_blocks": 3, "warmed": False,
              "owner": "ops", "refreshed": True, "was": was, **now}
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {
        "post": lambda self, path, body: answer})())
    status, out, _ = cli(capsys, "pin", "A system prompt.")
    assert status == 0 and out.splitlines()[1] == said


def test_a_pin_not_warmed_says_how_its_other_blocks_come_to_be_pinned(capsys, monkeypatch):
    """kvd answers "warmed": false when the warm request was cancelled or had not ended: kvctl
    says what becomes of the blocks not cached yet."""
    import kvctl.ops as ops

    answers = [{"pin_id": "pin-0123456789abcdef", "blocks": 7, "tenant": "default", "cached_blocks": 0,
                "warmed": False, "expires_in_seconds": None},
               {"pin_id": "pin-0123456789abcdef", "blocks": 7, "tenant": "default", "cached_blocks": 6,
                "warmed": False, "expires_in_seconds": None}]
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {
        "post": lambda self, path, body: answers.pop(0)})())
    assert cli(capsys, "pin", "A system prompt.")[:2] == (
        0, "pinned pin-0123456789abcdef: 7 blocks for tenant default (0 cached)\n"
           "the other 7 blocks pin as requests compute them (or a lower tier brings them back)\n")
    assert cli(capsys, "pin", "A system prompt.")[1].endswith(
        "(6 cached)\nthe other 1 block pins as requests compute it (or a lower tier brings it back)\n")


def test_pin_and_explain_take_chat_messages_from_a_json_file(capsys, monkeypatch, tmp_path):
    """A list of messages, or a chat request's body, is sent as it is: kvd checks and renders it."""
    import kvctl.ops as ops

    posted = []

    class Fake:
        def post(self, path, body):
            posted.append((path, body))
            if path == "/admin/explain":
                return {"hit_tokens": 32, "prompt_tokens": 40, "hit_blocks": 2, "full_blocks": 2, "tenant": "default"}
            return {"pin_id": "pin-0123456789abcdef", "blocks": 2, "tenant": "default", "cached_blocks": 0,
                    "warmed": True, "expires_in_seconds": None, "prefix_id": "0435de855e2354d8"}

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    system = [{"role": "system", "content": "Be brief."}]
    listed, request = tmp_path / "system.json", tmp_path / "request.json"
    listed.write_text(json.dumps(system))
    request.write_text(json.dumps({"model": "m", "messages": system + [{"role": "user", "content": "hi"}]}))
    assert cli(capsys, "pin", "--messages", str(listed), "--note", "chat bot")[:2] == (
        0, "pinned pin-0123456789abcdef: 2 blocks for tenant default (0 cached, warmed)\n")
    assert cli(capsys, "explain", "--messages", str(request))[0] == 0
    assert posted == [("/admin/pins", {"messages": system, "tenant": None, "ttl": None, "note": "chat bot"}),
                      ("/admin/explain", {"messages": system + [{"role": "user", "content": "hi"}], "tenant": None})]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, _, err = cli(capsys, "explain", "--messages", str(bad))
    assert status == 2 and err.startswith(f"error: messages: {str(bad)!r} is not JSON (")
    bad.write_text('{"role": "system"}')
    status, _, err = cli(capsys, "pin", "--messages", str(bad))
    assert status == 2 and err.strip() == (f"error: messages: {str(bad)!r} holds a dict; give a list of "
                                           '{"role", "content"} messages, or a chat request with "messages"')
    status, _, err = cli(capsys, "explain", "hello", "--messages", str(listed))
    assert status == 2 and err.strip() == "error: give exactly one of TEXT, --tokens, --file or --messages"
    assert len(posted) == 2
    explicit = {"mode": "explicit"}  # a request's own prompt cache mode goes to explain alone
    request.write_text(json.dumps({"messages": system, "prompt_cache_options": explicit}))
    responses = tmp_path / "responses.json"
    responses.write_text(json.dumps({"input": "hi", "instructions": "Be brief.", "prompt_cache_options": explicit}))
    for args in (["explain", "--messages", str(request)], ["pin", "--messages", str(request)],
                 ["explain", "--messages", str(responses)]):
        assert cli(capsys, *args)[0] == 0
    assert [body.get("prompt_cache_options") for _, body in posted[2:]] == [explicit, None, explicit]
    assert posted[4][1]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("socket", ["/run/kvd/kvd.sock", "/tmp/pytest-of-root/pytest-614/test_a_long_name0/kvd.sock"])
def test_config_show_fits_80_columns_with_every_name_and_source_whole(capsys, monkeypatch, socket):
    """At 80 columns a boxed table cut the socket's path to "…/kvd.so…" and the name
    "prefetch_timeout_per_1k_tok…"; with a longer path the "from" column was not shown at all."""
    import kvctl.ops as ops

    config = {"socket": socket, "prefetch_timeout_per_1k_tokens": 0.0, "max_queue": 9, "reservation": "p95"}
    sources = {"socket": "--socket", "prefetch_timeout_per_1k_tokens": "default", "max_queue": "KVD_MAX_QUEUE",
               "reservation": "/etc/kvd/kvd.yaml"}
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {
        "get": lambda self, path, **params: {"config": config, "sources": sources, "effective": {},
                                              "from_rollouts": {}, "precedence": "flag > default"}})())
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = cli(capsys, "config", "show")
    lines = [line.rstrip() for line in out.splitlines()]
    assert status == 0 and max(map(len, lines)) <= 80 and "…" not in out
    assert lines[1].split() == ["setting", "value", "from"]
    rows, folded = {}, []  # a path too wide for its column goes on below its row, whole words never cut
    for line in lines[2:]:
        if line.startswith(" "):
            folded += line.split()
        else:
            rows[line.split()[0]] = line.split()[1:]
    assert rows["prefetch_timeout_per_1k_tokens"] == ["0.0", "default"]
    assert rows["max_queue"] == ["9", "KVD_MAX_QUEUE"]
    assert rows["reservation"] == ["p95", "/etc/kvd/kvd.yaml"]
    assert rows["socket"][-1] == "--socket" and "".join(rows["socket"][:-1] + folded) == socket
    assert bool(folded) == (len(socket) > 40)


def test_config_show_says_which_settings_a_reload_changes(capsys, monkeypatch):
    import kvctl.ops as ops

    config = {"block_size": 16, "max_queue": 9, "reservation": "p95"}
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {
        "get": lambda self, path, **params: {"config": config, "sources": {}, "effective": {}, "from_rollouts": {},
                                              "precedence": "flag > default",
                                              "live": ["max_queue", "reservation", "truncation_headroom"]}})())
    monkeypatch.setenv("COLUMNS", "120")
    status, out, _ = cli(capsys, "config", "show")
    assert status == 0 and out.splitlines()[-1] == (
        "live on a reload (kvctl config reload, SIGHUP): max_queue, reservation; the others wait for a restart")


def test_prefixes_table_shows_the_tree_and_fits_80_columns(capsys, monkeypatch):
    """Each row says which row it extends and which tokens it covers; columns that would say the
    same on every row (one tenant, nothing pinned or in use) become one line below the table."""
    import kvctl.ops as ops

    rows = _prefix_rows()
    rows[2].update(tier="device", tiers={"device": 1, "disk": 1}, bytes=32768, blocks=2, tokens=48)
    rows[3].update(parent_id=None, detached=True, start_token=1024, tokens=1040, hits=None, tier="disk",
                   tiers={"disk": 1}, idle_seconds=None)
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {  # as kvd sorts by size
        "get": lambda self, path, **params: {"prefixes": [rows[i] for i in (3, 2, 0, 1)], "total": 4}})())
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = cli(capsys, "prefixes", "--sort", "size")
    assert status == 0 and [line.rstrip() for line in out.splitlines()] == [
        "prefix           parent        tokens     size hits idle tier",
        "0000000000000003 detached 1,024-1,040 48.0 KiB    -    - disk",
        "0000000000000002 00000000       16-48 32.0 KiB    0   5s device+disk",
        "0000000000000000 -               0-16 16.0 KiB    5  30s device",
        "0000000000000001 00000000       16-32 16.0 KiB   50  10m device",
        "tenant acme; none pinned or in use",
        "detached: the blocks before it are cached nowhere, so no request reaches it"]
    assert max(len(line) for line in out.splitlines()) <= 80
    rows[1].update(tenant="globex", pinned=True, pinned_blocks=1, in_use_blocks=1)
    status, out, _ = cli(capsys, "prefixes", "--sort", "size")
    assert out.splitlines()[0].split() == ["prefix", "parent", "tenant", "tokens", "size", "hits", "idle", "tier",
                                           "pinned", "in", "use"]
    assert "tenant acme" not in out and "none pinned" not in out


def test_prefixes_table_marks_the_trees_of_a_block_space_no_longer_served(capsys, monkeypatch):
    """A tree cached under scales since replaced (a live calibration) is listed stale: no request
    reaches it; kvd dropped the rest of such trees as the scales changed, so a stranded pin keeps it."""
    import kvctl.ops as ops

    rows = _prefix_rows()
    for row in rows[:3]:  # one tree, made under the scales before
        row.update(stale=True)
    rows[3].update(parent_id=None, start_token=0, tokens=16, blocks=1, stale=False)  # a tree of the served ones
    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: type("Fake", (), {
        "get": lambda self, path, **params: {"prefixes": rows, "total": 4}})())
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = cli(capsys, "prefixes")
    lines = [line.rstrip() for line in out.splitlines()]
    assert status == 0 and [line.split()[:2] for line in lines[1:5]] == [
        ["0000000000000000", "stale"], ["0000000000000001", "stale"], ["0000000000000002", "stale"],
        ["0000000000000003", "-"]]
    assert lines[5] == "tenant acme; none pinned or in use" and max(map(len, lines)) <= 80
    assert " ".join(lines[6:]) == ("stale: made under a model revision, tokenizer, cache format, scales or block size "
                                   "kvd no longer serves; no request reaches it, and a stranded pin keeps it (kvctl "
                                   "unpin --stranded)")


def test_explain_and_pin_read_a_prompt_file_and_name_one_that_is_not_text(capsys, monkeypatch, tmp_path):
    import kvctl.ops as ops

    posted = []

    class Fake:
        def post(self, path, body):
            posted.append((path, body))
            return {"hit_tokens": 0, "prompt_tokens": 3, "hit_blocks": 0, "full_blocks": 0, "tenant": "acme"}

    monkeypatch.setattr(ops, "client_for", lambda ctx, tenant=None: Fake())
    prompt = tmp_path / "system.txt"
    prompt.write_text("Système: réponds brièvement.\n", encoding="utf-8")
    assert cli(capsys, "explain", "--file", str(prompt), "--tenant", "acme")[0] == 0
    assert posted == [("/admin/explain", {"text": "Système: réponds brièvement.\n", "tenant": "acme"})]
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x89\xb7\x00\xff" * 8)
    for command in ("explain", "pin"):
        status, _, err = cli(capsys, command, "--file", str(binary))
        assert status == 2 and err.strip() == (f"error: file: {str(binary)!r} is not UTF-8 text; give the prompt's "
                                               "text, or its token ids with --tokens")
    assert len(posted) == 1


def _status_data(pins: int) -> dict:
    return {"blocks": {"device": {"total": 8, "free": 8, "reserved": 0, "active": 0, "shared": 0, "cached": 0,
                                  "pinned": 0}},
            "block_size": 16, "bytes_per_token": 1024,
            "model": {"name": "m", "architecture": "llama", "revision": "0" * 16, "device": "cpu"},
            "tokens": {"hit": 0, "prompt": 0, "hit_ratio": 0.0, "recomputed": 0}, "preemptions": 0,
            "evictions": {"capacity": 0, "operator": 0}, "eviction_policy": "lru",
            "queue": {"waiting": 0, "oldest_age_seconds": 0.0, "running": 0}, "rejections": {}, "pins": pins}


def test_a_view_with_watch_redraws_until_ctrl_c_and_with_json_prints_one_answer(capsys):
    """`kvctl tiers --watch`, `kvctl requests --watch`: the view is drawn from each answer until
    Ctrl-C; with --json the first answer is printed once, as JSON, and nothing is redrawn."""
    import json

    from kvctl.command_kit import show_or_watch

    def answers(*given):
        fetched, left = [], list(given)

        def fetch():
            if not left:
                raise KeyboardInterrupt  # as Ctrl-C during the watch's wait ends it
            fetched.append(left.pop(0))
            return fetched[-1]
        return fetched, fetch

    fetched, fetch = answers({"blocks": 3}, {"blocks": 5})
    show_or_watch(fetch, lambda d: f"{d['blocks']} blocks on disk", watch=True, as_json=False)
    assert fetched == [{"blocks": 3}, {"blocks": 5}] and "5 blocks on disk" in capsys.readouterr().out
    fetched, fetch = answers({"blocks": 3}, {"blocks": 5})
    show_or_watch(fetch, lambda d: f"{d['blocks']} blocks on disk", watch=True, as_json=True)
    assert fetched == [{"blocks": 3}] and json.loads(capsys.readouterr().out) == {"blocks": 3}


def test_status_watch_keeps_watching_through_a_restart_and_stops_on_other_errors():
    from rich.console import Console

    from kvctl.errors import KvdUnavailable, UserError
    from kvctl.status_view import watch_status

    def run(answers, stop_after):
        """Watch with `answers` (data, or an exception to raise) until the sleep after `stop_after` fetches."""
        fetched = []

        def fetch():
            answer = answers[len(fetched)]
            fetched.append(answer)
            if isinstance(answer, Exception):
                raise answer
            return answer

        def sleep(_):
            if len(fetched) == stop_after:
                raise KeyboardInterrupt

        console = Console(record=True, width=200)
        watch_status(fetch, console, sleep=sleep)
        return " ".join(console.export_text().split())

    gone = KvdUnavailable("kvd is not reachable at /run/kvd/kvd.sock (is it running? `kvd serve`)")
    text = run([_status_data(1), gone, gone], stop_after=3)  # the last picture stays, with a line that says so
    assert "pins 1" in text and "kvd is not reachable at /run/kvd/kvd.sock" in text
    assert "still watching (Ctrl-C stops)" in text
    text = run([_status_data(1), gone, _status_data(2)], stop_after=3)  # back: the new picture, no warning
    assert "pins 2" in text and "not reachable" not in text
    with pytest.raises(UserError, match="kvd answered 403"):
        run([_status_data(1), UserError("kvd answered 403: this endpoint needs the admin role")], stop_after=9)


def test_status_shows_the_engine_steps_and_mean_decode_step():
    from rich.console import Console

    from kvctl.status_view import render_status

    data = {**_status_data(0), "engine_threads": 2,
            "steps": {"decode": {"count": 100, "seconds": 0.3}, "mixed": {"count": 4, "seconds": 0.05}}}
    console = Console(record=True, width=200)
    render_status(data, console)
    text = " ".join(console.export_text().split())
    assert "engine 100 decode, 4 mixed steps on 2 threads, 350.0 ms busy; decode step 3.0 ms mean" in text
    assert "queue 0 waiting, 0 running rejections" in text  # nothing measured: no prediction
    data["queue"] = {"waiting": 3, "oldest_age_seconds": 0.25, "running": 2, "tokens_ahead": 6144,
                     "prefill_tokens_per_second": 4096.0, "predicted_wait_seconds": 1.5}
    console = Console(record=True, width=200)
    render_status(data, console)
    text = " ".join(console.export_text().split())
    assert ("queue 3 waiting (oldest 250.0 ms), 2 running; 6,144 prompt tokens ahead: a new request waits ~1.50 s "
            "(prefill 4,096 tokens/s)") in text
    data["queue"] = {"waiting": 0, "oldest_age_seconds": 0.0, "running": 1, "tokens_ahead": 0,
                     "prefill_tokens_per_second": 4096.0, "predicted_wait_seconds": 0.0}
    console = Console(record=True, width=200)
    render_status(data, console)
    assert "queue 0 waiting, 1 running; prefill 4,096 tokens/s rejections" in " ".join(console.export_text().split())
    # with max_queue_wait: the oldest's age beside it, and a predicted wait past it said
    data["queue"] = {"waiting": 3, "oldest_age_seconds": 12.0, "running": 2, "tokens_ahead": 122_880,
                     "prefill_tokens_per_second": 4096.0, "predicted_wait_seconds": 30.0, "max_queue_wait_seconds": 20.0}
    console = Console(record=True, width=300)
    render_status(data, console)
    assert ("queue 3 waiting (oldest 12.00 s of 20.00 s allowed), 2 running; 122,880 prompt tokens ahead: a new "
            "request waits ~30.00 s (prefill 4,096 tokens/s), past max_queue_wait 20.00 s: it would be turned away "
            "(queue_timeout)") in " ".join(console.export_text().split())
    # queue_order lpm: the wait said is for a prompt holding nothing; what went in out of arrival order
    data["queue"] = {**data["queue"], "max_queue_wait_seconds": None, "predicted_wait_seconds": 1.5,
                     "lpm_waiting": [[4, 2048], [0, 4096]]}
    console = Console(record=True, width=300)
    render_status({**data, "admitted_ahead": 1234}, console)
    text = " ".join(console.export_text().split())
    assert ("122,880 prompt tokens ahead: a new request holding no cached prefix waits ~1.50 s (prefill 4,096 "
            "tokens/s)") in text
    assert "queue order 1,234 requests went in while an earlier arrival waited (lpm: the longest cached prefix " \
           "first)" in text
    # queue_order priority: the wait said is for a request at the last place (a better place waits less)
    del data["queue"]["lpm_waiting"]
    data["queue"]["priority_waiting"] = [[-10, 2048], [0, 4096]]
    console = Console(record=True, width=300)
    render_status({**data, "admitted_ahead": 7}, console)
    text = " ".join(console.export_text().split())
    assert ("122,880 prompt tokens ahead: a new request at the last place waits ~1.50 s (prefill 4,096 "
            "tokens/s)") in text
    assert "queue order 7 requests went in while an earlier arrival waited (priority: by the tenants' places)" in text
    # queue_order priority+lpm: both, said once
    del data["queue"]["priority_waiting"]
    data["queue"]["priority_lpm_waiting"] = [[-10, None, 2048], [0, 2, 4096]]
    console = Console(record=True, width=300)
    render_status({**data, "admitted_ahead": 9}, console)
    text = " ".join(console.export_text().split())
    assert ("122,880 prompt tokens ahead: a new request holding no cached prefix at the last place waits ~1.50 s "
            "(prefill 4,096 tokens/s)") in text
    assert ("queue order 9 requests went in while an earlier arrival waited (priority+lpm: by the tenants' places, "
            "the longest cached prefix first within one)") in text
    # tenants with queue wait limits of their own (tenant_queue_waits): said after the queue
    data["queue"]["tenant_queue_waits"] = {"chat": 10.0, "batch": 0.0}
    console = Console(record=True, width=300)
    render_status(data, console)
    assert "(prefill 4,096 tokens/s); tenants' own limits: batch none, chat 10.00 s" in \
        " ".join(console.export_text().split())


def test_every_kvctl_line_in_the_examples_is_a_command_kvctl_accepts():
    """The unit files and the crontab call kvctl, and the alert rules tell operators to; each call
    must parse (command, options and values), so that `systemctl reload kvd`, the calibration timer
    and the alerts' advice do not rot silently."""
    import re
    import shlex

    import yaml
    from pathlib import Path

    examples = Path(__file__).parent.parent / "examples"
    calls = []
    names = ("kvd.service", "kvd-calibrate.service", "crontab", "kvd@.service", "kvd-calibrate@.service")
    for path in (examples / name for name in names):
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#") or "bin/kvctl " not in line:
                continue
            words = shlex.split(line.split("bin/kvctl ", 1)[1])
            calls.append((path.name, words[:words.index(">>")] if ">>" in words else words))
    assert {name for name, _ in calls} == set(names)
    alerts = yaml.safe_load((examples / "kvd-alerts.yml").read_text())
    for rule in (rule for group in alerts["groups"] for rule in group["rules"]):
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", r"\1", " ".join(rule["annotations"].values()))
        calls += [("kvd-alerts.yml", shlex.split(found)) for found in re.findall(r"`kvctl ([^`]+)`", text)]
    root = typer.main.get_command(app)
    for name, words in calls:
        group, args = root, list(words)
        while hasattr(group, "commands") and (args or not group.invoke_without_command):  # `kvctl tiers` shows
            group = group.commands[args.pop(0)]
        group.make_context(name, args)  # raises on an unknown option or a bad value
    assert ("kvd.service", ["config", "reload"]) in calls and ("kvd@.service", ["config", "reload"]) in calls
    assert ("kvd-alerts.yml", ["fleet", "resume", "replica"]) in calls


def test_the_router_unit_runs_a_kvd_router_command_kvd_accepts():
    """examples/kvd-router.service's ExecStart must parse as `kvd router` options and values."""
    import shlex
    from pathlib import Path

    from kvctl.daemon.cli import app as kvd_app

    unit = (Path(__file__).parent.parent / "examples" / "kvd-router.service").read_text()
    [line] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    words = shlex.split(line.split("bin/kvd ", 1)[1])
    assert words[0] == "router"
    context = typer.main.get_command(kvd_app).commands["router"].make_context("kvd router", words[1:])
    assert str(context.params["config"]) == "/etc/kvd/router.yaml"
    from kvctl.daemon.router_config import resolve_router

    examples = Path(__file__).parent.parent / "examples"
    settings = resolve_router({}, {}, examples / "kvd-router.yaml")  # what the unit's file says, as it is shipped
    assert (settings.view, settings.replicas_file, settings.clients_file, settings.socket) == (
        "events", "/etc/kvd/router-replicas", "/etc/kvd/router-clients", "/run/kvd-router/router.sock")
    from kvctl.daemon.server.fleet_file import read_replicas_file

    listed = read_replicas_file(str(Path(__file__).parent.parent / "examples" / "router-replicas"))
    assert listed == ["/run/kvd-0/kvd.sock", "/run/kvd-1/kvd.sock"]


def _event(seq, kind="stored", tier="device", keys=1, **fields):
    event = {"seq": seq, "at": 1796024970.0 + seq, "kind": kind, "tier": tier,
             "keys": [f"{seq:02x}{i:02x}".ljust(64, "a") for i in range(keys)]}
    if kind == "stored":
        event.update(parent=None, depth=0, tenant="default")
    event.update(fields)
    return event


def test_events_lists_the_newest_and_says_what_it_holds(capsys, monkeypatch):
    import time as time_module

    import kvctl.events_cmd as events_cmd

    asked = []

    class Fake:
        def get(self, path, **params):
            assert path == "/admin/events"
            asked.append({k: v for k, v in params.items() if v is not None})
            return {"stream_id": "s1", "next": 9, "latest": 9, "oldest": 3, "gap": False, "events": [
                _event(8, "stored", "host", 3, parent="ab" * 32, depth=4, tenant="acme"),
                _event(9, "removed", "device", 1, reason="capacity")]}

    monkeypatch.setattr(events_cmd, "client_for", lambda ctx: Fake())
    monkeypatch.setattr(time_module, "localtime", time_module.gmtime)
    status, out, _ = cli(capsys, "events", "--tail", "2", "--tier", "host,device")
    assert status == 0 and asked[-1] == {"tail": 2, "tier": "host,device"}
    assert out.splitlines() == [
        "    seq time     change  tier   blocks first key         detail",
        "      8 07:49:38 stored  host        3 0800aaaaaaaaaaaa… block 4 after abababab, tenant acme",
        "      9 07:49:39 removed device      1 0900aaaaaaaaaaaa  capacity",
        "2 events; kvd holds seq 3-9"]
    status, out, _ = cli(capsys, "events", "--json", "--kind", "removed")
    assert asked[-1] == {"tail": 30, "kind": "removed"}
    assert [json.loads(line)["seq"] for line in out.splitlines()] == [8, 9]
    status, out, _ = cli(capsys, "events", "--key", "0801AA")  # one block's life: the line is about it
    assert asked[-1] == {"tail": 30, "key": "0801AA"}
    assert out.splitlines()[:2] == [
        "    seq time     change  tier   blocks key               detail",
        "      8 07:49:38 stored  host        3 0801aaaaaaaaaaaa… block 5 after 0800aaaa, tenant acme"]
    status, out, _ = cli(capsys, "events", "--tail", "0")  # from now on: nothing listed yet
    assert asked[-1] == {"tail": 1} and out.splitlines() == ["0 events; kvd holds seq 3-9"]
    assert cli(capsys, "events", "--count", "0")[2].strip() == "error: count: must be >= 1, got 0"
    assert cli(capsys, "events", "--since", "-2")[2].strip() == "error: since: must be >= 0, got -2"


def test_events_follow_carries_on_through_a_gap_and_a_restart_and_stops_at_count():
    from rich.console import Console

    from kvctl.errors import KvdUnavailable
    from kvctl.events_cmd import follow

    answers = [
        {"stream_id": "s1", "events": [_event(11, keys=2)], "next": 11, "latest": 11, "oldest": 1, "gap": False},
        {"stream_id": "s1", "events": [_event(90, "removed", reason="operator")], "next": 90, "latest": 90,
         "oldest": 90, "gap": True},  # it fell behind: 12-89 were trimmed
        KvdUnavailable("kvd is not reachable at /run/kvd/kvd.sock (is it running? `kvd serve`)"),
        KvdUnavailable("kvd is not reachable at /run/kvd/kvd.sock (is it running? `kvd serve`)"),
        {"stream_id": "s2", "events": [], "next": 3, "latest": 3, "oldest": 1, "gap": True},  # restarted
        {"stream_id": "s2", "events": [_event(1, "stored", "disk", 4), _event(2), _event(3)], "next": 3,
         "latest": 3, "oldest": 1, "gap": False},
    ]
    asked, slept = [], []

    def fetch(since):
        asked.append(since)
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    console = Console(record=True, width=200)
    first = {"stream_id": "s1", "next": 10, "events": []}
    printed = follow(fetch, first, console, as_json=False, count=4, sleep=slept.append)
    text = console.export_text()
    assert printed == 4 and asked == [10, 11, 90, 90, 90, 0] and slept == [1.0, 1.0]
    lines = [line.split()[0] for line in text.splitlines()]
    assert lines == ["11", "events", "90", "kvd", "kvd", "1", "2"]
    assert "events 12-89 were dropped before they were read" in text
    assert text.count("kvd is not reachable") == 1 and "still following (Ctrl-C stops)" in text
    assert "kvd restarted: following the new daemon from its first event" in text


def test_route_asks_each_replica_and_says_where_each_policy_would_send_the_prompt(capsys, monkeypatch):
    import kvctl.route_cmd as route_cmd
    from kvctl.errors import KvdUnavailable

    class Replica:
        def __init__(self, cached, running, waiting, age, lower=None, predicted=None):
            self.cached, self.running, self.waiting, self.age, self.lower = cached, running, waiting, age, lower
            self.predicted = predicted  # kvd's own estimate; None before it measured a prefill
            self.rate = None
            self.held, self.restore = {}, 0.0  # tokens its lower tiers hold, per tier; seconds to restore them
            self.asked = []

        def post(self, path, body):
            self.asked.append((path, body))
            return {"prompt_tokens": 4100, "cached_tokens": self.cached, "lower_tier": self.lower,
                    "running": self.running, "waiting": self.waiting, "oldest_age_seconds": self.age,
                    "tokens_ahead": 0, "predicted_wait_seconds": self.predicted,
                    "prefill_tokens_per_second": self.rate, "lower_tier_tokens": self.held,
                    "restore_seconds": self.restore}

    class Down:
        def post(self, path, body):
            raise KvdUnavailable("kvd is not reachable at /run/c.sock (is it running? `kvd serve`)")

    fleet = {"/run/a.sock": Replica(3072, 4, 2, 1.5), "/run/b.sock": Replica(0, 1, 0, 3.0, lower="disk", predicted=0.0),
             "/run/c.sock": Down()}
    monkeypatch.setattr(route_cmd, "replica_client", lambda ctx, spec: fleet[spec])
    args = ["route", "--tokens", "1,2,3", "--replica", "/run/a.sock", "--replica", "/run/b.sock",
            "--replica", "/run/c.sock", "--prefill-rate", "2048"]
    status, out, _ = cli(capsys, *args)
    assert status == 0
    assert fleet["/run/a.sock"].asked == [("/admin/route-facts", {"tokens": [1, 2, 3], "tenant": None})]
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[:3] == ["replica          cached lower tier running waiting        wait",
                         "/run/a.sock 3,072/4,100 -                4       2 1.5 s (age)",
                         "/run/b.sock     0/4,100 disk             1       0       0.0 s"]
    assert "/run/c.sock: kvd is not reachable at /run/c.sock" in out
    # ttft at 2,048 tokens/s: a: 1.5 + 1028/2048 = 2.0 s; b: 0 + 4100/2048 = 2.0 s -> the one caching more
    assert [line.split()[:2] for line in lines if line.split()[:1] in (["least_loaded"], ["prefix"], ["ttft"])] == [
        ["least_loaded", "/run/b.sock"], ["prefix", "/run/a.sock"], ["ttft", "/run/a.sock"]]
    status, out, _ = cli(capsys, *args, "--routing", "prefix", "--balance-seconds", "1", "--json")
    doc = json.loads(out)
    assert doc["routes"] == {"prefix": {"replica": "/run/b.sock", "reason": "the replica caching most waits "
                                        "1.50 s, over 1 s more than this one"}}
    assert doc["replicas"][2] == {"replica": "/run/c.sock",
                                  "error": "kvd is not reachable at /run/c.sock (is it running? `kvd serve`)"}
    fleet["/run/b.sock"].rate = 4096.0  # b measured its prefill: 4,100 tokens in 1.0 s beats a's 2.0 s
    status, out, _ = cli(capsys, *args, "--routing", "ttft", "--json")
    assert json.loads(out)["routes"] == {"ttft": {"replica": "/run/b.sock",
                                                  "reason": "first token in 1.00 s (0 tokens cached)"}}
    # b's disk holds 2,048 tokens of it, 0.05 s to restore: 0.05 + 2,052 / 4,096 = 0.55 s
    fleet["/run/b.sock"].held, fleet["/run/b.sock"].restore = {"disk": 2048}, 0.05
    status, out, _ = cli(capsys, *args, "--routing", "ttft,prefix")
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[2] == "/run/b.sock     0/4,100 disk 2,048 (0.05 s)       1       0       0.0 s"
    status, out, _ = cli(capsys, *args, "--routing", "ttft,prefix", "--json")
    assert json.loads(out)["routes"] == {
        "ttft": {"replica": "/run/b.sock", "reason": "first token in 0.55 s (0 tokens cached, 2048 in a lower tier)"},
        "prefix": {"replica": "/run/a.sock", "reason": "caches 3072 of its 4100 tokens"}}
    assert cli(capsys, "route", "hi", "--replica", "/run/a.sock")[2].strip() == \
        "error: replica: give two or more (--replica SOCKET_OR_URL, repeated), got 1"
    fleet["/run/a.sock"].asked.clear()
    assert cli(capsys, *args, "--priority", "5")[0] == 0  # the request's own: each replica weighs its place
    assert fleet["/run/a.sock"].asked == [("/admin/route-facts", {"tokens": [1, 2, 3], "priority": 5, "tenant": None})]
    assert " ".join(cli(capsys, *args, "--priority", "-1")[2].split()) == (
        "error: priority: -1 would jump ahead of its tenant's place; a request may only defer itself (0 or more)")
    fleet["/run/a.sock"].asked.clear()
    assert cli(capsys, *args, "--service-tier", "flex")[0] == cli(capsys, *args, "--service-tier", "priority")[0] == 0
    assert fleet["/run/a.sock"].asked == [  # (flex defers it under a priority queue; any other is default)
        ("/admin/route-facts", {"tokens": [1, 2, 3], "service_tier": "flex", "tenant": None}),
        ("/admin/route-facts", {"tokens": [1, 2, 3], "tenant": None})]
    assert " ".join(cli(capsys, *args, "--service-tier", "economy")[2].split()) == (
        "error: service-tier: must be one of auto, default, flex, priority, scale, got 'economy'")
    assert cli(capsys, *args, "--routing", "round_robin")[2].strip() == \
        "error: routing: unknown value 'round_robin' for one prompt; choose from least_loaded, prefix, ttft"
    fleet["/run/a.sock"] = fleet["/run/b.sock"] = Down()
    assert cli(capsys, *args)[2].startswith("error: no replica answered: kvd is not reachable at /run/c.sock")


def test_replay_with_tenant_shares_compares_each_policy_with_and_without_them(capsys):
    args = ("bench", "replay", "--demo-requests", "300", "--noisy-fraction", "0.5", "--block-sizes", "16",
            "--capacity-tokens", "65536", "--policy", "lru,cost", "--tenant-shares", "noisy=0.1")
    status, out, _ = cli(capsys, *args, "--json")
    assert status == 0
    doc = json.loads(out)
    assert doc["trace"] == "generated:300:seed=0:noisy=0.5" and doc["settings"]["tenant_shares"] == {"noisy": 0.1}
    assert [r["policy"] for r in doc["runs"]] == ["lru", "lru+shares", "cost", "cost+shares"]
    assert all(set(r["tenant_hit_ratio"]) == {"noisy", "quiet"} for r in doc["runs"])
    assert all(r["tenant_hit_ratio"]["noisy"] == 0 for r in doc["runs"])  # one-off documents never hit
    status, out, _ = cli(capsys, *args)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip() == "hit by tenant")
    assert lines[header + 1].split() == ["block", "capacity", "policy", "noisy", "quiet"]
    assert [line.split()[2] for line in lines[header + 2:header + 6]] == ["lru", "lru+shares", "cost", "cost+shares"]
    evicted = next(i for i, line in enumerate(lines) if line.strip() == "evicted to make room, by tenant")
    assert lines[evicted + 1].split() == ["block", "capacity", "policy", "noisy", "quiet"]
    assert [line.split()[3:] for line in lines[evicted + 2:evicted + 6]] == [
        [f"{r['tenant_evicted_blocks']['noisy']:,}", f"{r['tenant_evicted_blocks']['quiet']:,}"] for r in doc["runs"]]
    assert len(max(lines, key=len)) <= 80


def test_replay_with_tenant_priorities_shows_what_the_priority_policy_keeps_of_each_tenant(capsys):
    doc = replay_json(capsys, "--demo-requests", "300", "--noisy-fraction", "0.5", "--block-sizes", "16",
                      "--capacity-tokens", "65536", "--policy", "lru,priority", "--tenant-priorities", "quiet=-10")
    assert doc["settings"]["tenant_priorities"] == {"quiet": -10}
    lru, priority = doc["runs"]
    assert (lru["policy"], priority["policy"]) == ("lru", "priority")
    # the noisy tenant's one-off documents take less of quiet's prefixes (deterministic: the same trace and keys)
    quiet = [round(run["tenant_hit_ratio"]["quiet"], 3) for run in (lru, priority)]
    assert quiet == [0.496, 0.556]  # (outputs' blocks stay cached, as kvd's: they take room too)
    assert priority["tenant_hit_ratio"]["noisy"] == lru["tenant_hit_ratio"]["noisy"] == 0
    # whose blocks paid for the room: a quarter fewer of quiet's under priority, more of noisy's own
    assert [run["tenant_evicted_blocks"] for run in (lru, priority)] == [{"noisy": 18438, "quiet": 10642},
                                                                          {"noisy": 19894, "quiet": 7858}]


def test_config_show_writes_per_tenant_settings_as_an_operator_writes_them():
    from kvctl.ops import _setting_text

    assert _setting_text([["acme", 3], ["free", 1]]) == "acme=3,free=1"
    assert _setting_text([["batch", 600.0], ["chat", 0.0], ["noisy", 0.25]]) == "batch=600,chat=0,noisy=0.25"
    assert _setting_text(["vllm", "sglang"]) == "vllm,sglang" and _setting_text([]) == "none"
    assert _setting_text(256) == "256" and _setting_text(None) == "None"


def test_a_server_that_is_not_kvd_is_named_as_such_not_as_a_json_error(tmp_path):
    """Another server at kvd's address (a typo in --url): kvctl said `Expecting value: line 1
    column 1 (char 0)` for a 200, or dumped an HTML page for a 404."""
    import httpx

    from kvctl.client import Client
    from kvctl.errors import UserError

    answers = {"/admin/status": httpx.Response(200, text="hello\n", headers={"content-type": "text/plain"}),
               "/admin/tenants": httpx.Response(404, text="<!DOCTYPE HTML>\n<html>...</html>",
                                                headers={"content-type": "text/html; charset=utf-8"}),
               "/admin/pins": httpx.Response(400, json={"error": {"message": "ttl: bad"}})}
    client = Client(socket=str(tmp_path / "kvd.sock"))
    client.http = httpx.Client(base_url="http://kvd", transport=httpx.MockTransport(lambda r: answers[r.url.path]))
    with pytest.raises(UserError) as plain:
        client.get("/admin/status")
    assert str(plain.value) == (f"{tmp_path / 'kvd.sock'} answered GET /admin/status with 200 (text/plain: 'hello'), "
                                "not kvd's JSON: is kvd (or kvd router) what listens there? (--socket, --url)")
    with pytest.raises(UserError) as page:
        client.get("/admin/tenants")
    assert str(page.value).startswith(f"{tmp_path / 'kvd.sock'} answered GET /admin/tenants with 404 "
                                      "(text/html: '<!DOCTYPE HTML>'), not kvd's JSON")
    with pytest.raises(UserError, match="^kvd answered 400: ttl: bad$"):  # kvd's own errors as before
        client.post("/admin/pins", {})


def test_a_call_kvd_does_not_answer_in_time_says_what_its_healthz_says(tmp_path):
    """A stalled engine holds the lock kvctl's calls wait for; /healthz answers without it, and
    kvctl says what it said (nothing more where it says kvd is well, or does not answer either)."""
    import httpx

    from kvctl.client import Client, KvdUnavailable

    health = {"status_code": 503, "json": {"status": "engine_stalled", "reason": "the engine has not come round its "
                                                                                 "loop in 75 s (...)"}}

    def answer(request):
        if request.url.path == "/healthz":
            return httpx.Response(**health)
        raise httpx.ReadTimeout("timed out", request=request)

    client = Client(socket=str(tmp_path / "kvd.sock"))
    client.http = httpx.Client(base_url="http://kvd", transport=httpx.MockTransport(answer))
    with pytest.raises(KvdUnavailable) as stalled:
        client.get("/admin/status")
    assert str(stalled.value) == (f"kvd at {tmp_path / 'kvd.sock'} did not answer in time; its /healthz says: the "
                                  "engine has not come round its loop in 75 s (...)")
    health.update(status_code=200, json={"status": "ok"})
    with pytest.raises(KvdUnavailable) as busy:
        client.get("/admin/status")
    assert str(busy.value) == f"kvd at {tmp_path / 'kvd.sock'} did not answer in time"


def test_status_shows_the_responses_kept_and_those_let_go_for_room():
    from rich.console import Console

    from kvctl.status_view import render_status

    data = {**_status_data(0), "responses": {"responses": 0, "bytes": 0, "budget_bytes": 64 * 2**20, "dropped": 0}}

    def shown(figures):
        console = Console(record=True, width=200)
        render_status({**data, "responses": figures}, console)
        return " ".join(console.export_text().split())

    assert "responses kept" not in shown(data["responses"])  # none yet: no line
    assert "responses kept 1,200 in 3.0 MiB of 64.0 MiB" in shown(
        {"responses": 1200, "bytes": 3 * 2**20, "budget_bytes": 64 * 2**20, "dropped": 0})
    assert ("responses kept 10 in 1.0 MiB of 1.0 MiB; 7 let go for room (a turn that continues one gets a 404)"
            in shown({"responses": 10, "bytes": 2**20, "budget_bytes": 2**20, "dropped": 7}))
    assert "responses kept 0 in 0 B of 64.0 MiB; 2 running in the background" in shown(
        {"responses": 0, "bytes": 0, "budget_bytes": 64 * 2**20, "dropped": 0, "running": 2})
    assert "responses kept 5 in 1.0 KiB of 64.0 MiB; 9 let go past responses_max_age" in shown(
        {"responses": 5, "bytes": 1024, "budget_bytes": 64 * 2**20, "dropped": 0, "expired": 9, "running": 0})
    assert "responses kept 2 in 1.0 KiB of 64.0 MiB; 2.0 KiB of events kept to stream again" in shown(
        {"responses": 2, "bytes": 1024, "budget_bytes": 64 * 2**20, "dropped": 0, "running": 0, "replay_bytes": 2048})
    file = {"path": "/var/lib/kvd/responses.sqlite", "failed_writes": 3, "last_failure": "database or disk is full"}
    assert ("responses kept 0 in 0 B of 64.0 MiB; 3 writes to responses_store_file did not land (kvctl responses)"
            in shown({"responses": 0, "bytes": 0, "budget_bytes": 64 * 2**20, "dropped": 0, "file": file}))
    assert "responses kept" not in shown({**data["responses"], "file": {**file, "failed_writes": 0}})


def test_status_shows_the_conversations_kept_and_those_let_go():
    from rich.console import Console

    from kvctl.status_view import render_status

    def shown(figures):
        console = Console(record=True, width=200)
        render_status({**_status_data(0), "conversations": figures}, console)
        return " ".join(console.export_text().split())

    none = {"conversations": 0, "bytes": 0, "budget_bytes": 64 * 2**20, "dropped": 0, "turns_lost": 0}
    assert "conversations" not in shown(none)  # none yet: no line
    assert "conversations 12 kept in 3.0 KiB of 64.0 MiB" in shown({**none, "conversations": 12, "bytes": 3072})
    assert ("conversations 2 kept in 1.0 MiB of 1.0 MiB; 5 let go for room (a request that names one gets a 404); "
            "3 idle past responses_max_age; 1 turns not added (the conversation would outgrow the budget)") in shown(
        {"conversations": 2, "bytes": 2**20, "budget_bytes": 2**20, "dropped": 5, "expired": 3, "turns_lost": 1})


def test_status_shows_the_replies_sent_back_as_their_own_ids():
    from rich.console import Console

    from kvctl.status_view import render_status

    def shown(figures):
        console = Console(record=True, width=200)
        render_status({**_status_data(0), "reply_ids": figures}, console)
        return " ".join(console.export_text().split())

    none = {"replies": 0, "bytes": 0, "budget_bytes": 64 * 2**20, "remembered": 0, "dropped": 0, "spliced": 0,
            "template_changed": 0}
    assert "reply ids" not in shown(none)  # no chat yet: no line
    assert "reply ids 40 replies kept in 8.0 KiB of 64.0 MiB; 31 sent back as their ids" in shown(
        {**none, "replies": 40, "bytes": 8192, "remembered": 40, "spliced": 31})
    assert ("reply ids 2 replies kept in 1.0 KiB of 1.0 KiB; 9 sent back as their ids; 4 chats read as text (the "
            "template rewrites replies); 6 let go for room") in shown(
        {**none, "replies": 2, "bytes": 1024, "budget_bytes": 1024, "dropped": 6, "spliced": 9, "template_changed": 4})


def test_status_says_what_the_output_reservation_left_unwritten():
    from rich.console import Console

    from kvctl.status_view import render_status

    def shown(reservation):
        console = Console(record=True, width=200)
        render_status({**_status_data(0), **({"reservation": reservation} if reservation else {})}, console)
        return " ".join(console.export_text().split())

    assert "reservation" not in shown(None)  # an older kvd says nothing
    assert "reservation p95 (no request has finished yet)" in shown(
        {"policy": "p95", "finished_blocks": 0, "unused_blocks": 0})
    assert ("reservation fraction:1: 25.3% of the blocks finished requests held were reserved and never written "
            "(2,530 of 10,000)") in shown({"policy": "fraction:1", "finished_blocks": 10_000, "unused_blocks": 2_530})

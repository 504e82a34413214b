"""`kvctl trace stats FILE`: a trace's shape, reuse, working set, openings and kvd's own account,
on a trace small enough to work out by hand."""

from __future__ import annotations

import json
import statistics

import pytest

from kvctl.daemon.replay.trace import Served, TraceRequest, write_trace
from kvctl.trace_stats import stats_lines, trace_stats

from .test_cli import cli

TRACE = [
    TraceRequest(0.0, 1024, 10, (1, 2), None, 512, Served(1.0, 50.0, 90.0, 0)),
    TraceRequest(500.0, 1024, 20, (1, 3), None, 512, Served(3.0, 10.0, 190.0, 512)),
    TraceRequest(1000.0, 600, 0, (4, 5), "acme"),  # turned away: kvd says nothing of how it served it
    TraceRequest(2000.0, 1100, 5, (1, 2, 6), None, 512, Served(2.0, 20.0, 40.0, 1024)),
]


PREFILL = statistics.linear_regression([1024, 512, 76], [0.050, 0.010, 0.020])


def test_a_trace_s_figures_worked_out_by_hand():
    figures = trace_stats(TRACE, block_size=16)
    assert figures == {
        "requests": 4, "seconds": 2.0, "requests_per_second": 2.0, "tenants": {"default": 3, "acme": 1},
        "block_tokens": 512, "input_tokens": 3748, "input_length": {"p50": 1024, "p95": 1100, "max": 1100},
        "output_tokens": 35, "output_length": {"p50": 5, "p95": 20, "max": 20}, "block_size": 16,
        # the second reuses its first 512 tokens, the fourth its first 1,024; acme's ids are its own
        "unbounded_hit_ratio": (32 + 64) * 16 / 3748,
        # whole blocks of 16: 64 + 32 new + 37 (acme's) + 4 new, and of the outputs, written (the last token
        # never is), one of the second's (1,024 + 19) and one of the fourth's (1,100 + 4)
        "working_set_tokens": (64 + 32 + 37 + 4 + 2) * 16, "output_working_set_tokens": 2 * 16,
        # LRU at the ids: 4 whole ids in the working set (1, 1-2, 1-3 and acme's 4; a prompt's last part-id
        # is no block), caches of 1, 1, 1, 2 and 4 of them. The second's id 1 was used 0 ids before (held
        # by 1); the fourth's id 1, 1 id before (acme's 4: held by 2), and its 1-2, 3 before (1, 1-3, 4)
        "lru_hit_ratios": [{"share": share, "tokens": ids * 512, "hit_ratio": hit * 512 / 3748}
                           for share, ids, hit in (("1/64", 1, 1), ("1/16", 1, 1), ("1/4", 1, 1), ("1/2", 2, 2),
                                                   ("whole", 4, 3))],
        "openings": 2, "shared_openings": 1, "shared_opening_share": 0.75,
        "top_openings": [{"tenant": "default", "first_id": 1, "requests": 3, "share": 0.75}],
        "served": {"requests": 3, "cached_token_ratio": (512 + 1024) / (1024 + 1024 + 1100),
                   "queued_p50_s": 0.002, "queued_p95_s": 0.003, "prefill_p50_s": 0.02,
                   "prefill_cached_over_uncached": 0.010 / 0.050,  # the lower median of 10 and 20 ms, over 50
                   # the plane through the three prompts falls with the context: a line through their uncached
                   # tokens, its slope a token's time and its value at 0 what each prompt takes more
                   "prefill_rate": pytest.approx(1 / PREFILL.slope),
                   "prefill_overhead": pytest.approx(PREFILL.intercept), "prefill_context_cost": 0.0,
                   "decode_rate": pytest.approx(32 / 0.32),
                   "decode_batch_cost": None, "decode_context_cost": None},  # each decoded alone: no line
        "fleet": None,  # no line names a replica: not a fleet's trace
    }
    assert ("hit, LRU cache by size (512-token ids)", "1/64 13.7%, 1/16 13.7%, 1/4 13.7%, 1/2 27.3%, whole 41.0% of "
            "the working set (1/4 is 512 tokens)") in stats_lines(figures)
    # at 512: the second's 1,024 tokens are two blocks, of which one can hit (its last token is computed)
    assert trace_stats(TRACE, block_size=512)["unbounded_hit_ratio"] == (512 + 1024) / 3748


def test_kvctl_trace_stats_prints_them_and_refuses_bad_input_by_name(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, TRACE)
    status, printed, _ = cli(capsys, "trace", "stats", str(path), "--json")
    assert status == 0 and json.loads(printed)["working_set_tokens"] == 2224
    status, printed, _ = cli(capsys, "trace", "stats", str(path))
    text = " ".join(printed.replace("│", " ").split())
    for said in ["requests 4 over 2.00 s (2.0 a second)", "tenants default 3, acme 1",
                 "prompt tokens 3,748: p50 1,024, p95 1,100, max 1,100", "hit, unbounded cache (block 16) 41.0%",
                 "working set 2,224 tokens (32 of them outputs'): a cache this size never forgets a block", "openings (first blocks) 2 distinct; 1 shared by two requests or more, "
                 "opening 75% of them; the most shared open 3 requests",
                 "kvd served 3 requests, cached-token ratio 0.488",
                 "queued p50 2.0 ms, p95 3.0 ms; admission to first token p50 20.0 ms, cached ÷ uncached 0.200",
                 "prefill 30,317 tokens/s, 8.94 ms more a prompt, decode 100 tokens/s a request"]:
        assert said in text, said
    status, _, err = cli(capsys, "trace", "stats", str(path), "--block-size", "24")
    assert status == 2 and "block_size: expected a power of two from 1 to 512, got 24" in err
    status, _, err = cli(capsys, "trace", "stats", str(tmp_path / "none.jsonl"))
    assert status == 2 and f"trace: no such file {str(tmp_path / 'none.jsonl')!r}" in err


def test_a_fleet_s_trace_shows_each_replica_and_the_openings_the_router_spread(tmp_path, capsys):
    """kvd router's trace names each line's replica: each replica's share, what it turned away
    and its own cached-token ratio, and how many shared openings went to more than one replica
    (here opening 1 to both, opening 7 to r1 alone; opening 9 is no one's to share)."""
    how = lambda cached: Served(1.0, 10.0, 20.0, cached)  # noqa: E731
    fleet = [TraceRequest(0.0, 1024, 4, (1, 2), None, 512, how(0), "r0"),
             TraceRequest(10.0, 1024, 4, (1, 3), None, 512, how(0), "r1"),
             TraceRequest(20.0, 1024, 4, (1, 4), None, 512, how(512), "r0"),
             TraceRequest(30.0, 512, 4, (7,), None, 512, how(0), "r1"),
             TraceRequest(40.0, 512, 0, (7,), None, 512, None, "r1"),  # turned away
             TraceRequest(50.0, 512, 4, (9,), None, 512, how(0), "r1")]
    figures = trace_stats(fleet, block_size=16)
    assert figures["fleet"] == {
        "replicas": {"r0": {"requests": 2, "input_tokens": 2048, "turned_away": 0, "cached_token_ratio": 0.25},
                     "r1": {"requests": 4, "input_tokens": 2560, "turned_away": 1, "cached_token_ratio": 0.0}},
        "shared_openings": 2, "split_openings": 1}
    path = tmp_path / "fleet.jsonl"
    write_trace(path, fleet)
    status, printed, _ = cli(capsys, "trace", "stats", str(path))
    text = " ".join(printed.replace("│", " ").split())
    assert status == 0
    assert "replicas r0 2 (33%), cached 0.250; r1 4 (67%), cached 0.000, 1 turned away" in text
    assert "shared openings across replicas 1 of 2 served on more than one replica" in text
    status, printed, _ = cli(capsys, "trace", "stats", str(path), "--json")
    assert json.loads(printed)["fleet"]["split_openings"] == 1


def test_trace_stats_says_when_kvd_cached_more_than_the_trace_s_ids_can_replay(tmp_path, capsys):
    """The demo's prompts share a system prompt shorter than 512 tokens: kvd cached 47.9% of them,
    and a trace of 512-token ids replays none of it."""
    short = [TraceRequest(0.0, 200, 4, (1,), None, 512, Served(0.1, 5.0, 6.0, 0)),
             TraceRequest(45.0, 210, 4, (2,), None, 512, Served(0.1, 2.0, 6.0, 192))]
    path = tmp_path / "short.jsonl"
    write_trace(path, short)
    status, printed, err = cli(capsys, "trace", "stats", str(path))
    assert status == 0 and "requests 2 over 45.0 ms" in " ".join(printed.replace("│", " ").split())
    assert " ".join(err.split()) == ("kvd cached 46.8% of these prompts, more than a replay of these ids can (0.0%): "
                                     "its ids of 512 tokens are coarser than the prefixes the prompts share (kvd's "
                                     "trace_block_tokens 64 or 16 traces them finer), or kvd's cache held prefixes "
                                     "from before the trace's first request")
    fine = [TraceRequest(0.0, 200, 4, tuple(range(13)), None, 16, Served(0.1, 5.0, 6.0, 0)),
            TraceRequest(45.0, 210, 4, tuple(range(12)) + (20, 21), None, 16, Served(0.1, 2.0, 6.0, 192))]
    write_trace(path, fine)
    status, _, err = cli(capsys, "trace", "stats", str(path))
    assert status == 0 and err == ""  # at 16 tokens an id the replay sees what kvd cached


def test_kvctl_bench_replay_says_so_too_where_an_operator_picks_a_block_size(tmp_path, capsys):
    short = [TraceRequest(0.0, 200, 4, (1,), None, 512, Served(0.1, 5.0, 6.0, 0)),
             TraceRequest(45.0, 210, 4, (2,), None, 512, Served(0.1, 2.0, 6.0, 192))]
    path = tmp_path / "short.jsonl"
    write_trace(path, short)
    status, printed, err = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru")
    note = ("kvd cached 46.8% of these prompts, more than a replay of these ids can (0.0%): its ids of 512 tokens "
            "are coarser than the prefixes the prompts share (kvd's trace_block_tokens 64 or 16 traces them finer), "
            "or kvd's cache held prefixes from before the trace's first request")
    assert status == 0 and " ".join(err.split()) == note
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru", "--json")
    assert status == 0 and json.loads(printed)["coarse_ids"] == note
    status, printed, _ = cli(capsys, "bench", "replay", "--block-sizes", "16", "--policy", "lru", "--json")
    assert status == 0 and json.loads(printed)["coarse_ids"] is None  # a generated trace: kvd said nothing

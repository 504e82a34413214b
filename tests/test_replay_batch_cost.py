"""The replay's decode batch cost: a request decodes more slowly the more requests are in service
(processor sharing, re-paced at each admission, finish and preemption), and `--rates-from-trace`
fits that cost from the timings kvd's trace keeps."""

from __future__ import annotations

import json
import statistics

import pytest

from kvctl.daemon.replay.service_rates import MeasuredRates, fit_batch_cost, mean_in_service, measured_rates
from kvctl.daemon.replay.trace import Served, TraceRequest, write_trace

from .test_cli import cli
from .test_replay import PREEMPT_SETTINGS, PREEMPT_TRACE, fleet, replica_run

# A (20 tokens out) alone from 0 s, B (6 tokens out) from 1 s; prefill takes no time, 10 tokens/s alone.
SHARED = [TraceRequest(0.0, 16, 20, (1,)), TraceRequest(1000.0, 16, 6, (2,))]
SHARED_SETTINGS = dict(capacity_tokens=1024, prefill_rate=1e12, decode_rate=10.0)


def test_requests_in_service_together_each_decode_at_the_pace_of_their_batch():
    alone = replica_run(SHARED, **SHARED_SETTINGS)
    assert alone.e2e == [pytest.approx(0.6), pytest.approx(2.0)]  # B, then A: each at 10 tokens/s
    # cost 1.0: two in service decode at 5 tokens/s each. A makes 10 tokens by 1 s, then 6 more beside
    # B until B finishes at 1 + 6/5 = 2.2 s, then its last 4 alone at 10 tokens/s: 2.6 s
    shared = replica_run(SHARED, **SHARED_SETTINGS, decode_batch_cost=1.0)
    assert shared.e2e == [pytest.approx(1.2), pytest.approx(2.6)]
    assert shared.ttft == alone.ttft  # a prompt's prefill keeps its own rate
    assert shared.rate == 10.0 and shared.anchors == {}  # alone again at the end, nothing left anchored
    half = replica_run(SHARED, **SHARED_SETTINGS, decode_batch_cost=0.25)  # 8 tokens/s beside B
    assert half.e2e == [pytest.approx(6 / 8), pytest.approx(1.75 + (20 - 10 - 6) / 10)]


def test_a_preempted_request_keeps_the_tokens_it_made_at_each_pace():
    """PREEMPT_TRACE (see test_replay) with a cost of 1.0: both decode at 5 tokens/s, so the first
    needs its 4th block at 0.1 + 17/5 = 3.5 s. The second, 16.75 tokens on by then, is preempted
    with 16 (all its blocks hold); the first, 17 tokens made, decodes its last 23 alone by 5.8 s. The
    second restarts then, computes 32 tokens again (0.1 s) and its last 24 alone: 8.3 s."""
    replica = replica_run(PREEMPT_TRACE, **PREEMPT_SETTINGS, decode_batch_cost=1.0)
    assert (replica.preemptions, replica.recomputed_after_preemption) == (1, 32)
    assert replica.ttft == [0.1, 0.1]
    assert replica.e2e == [pytest.approx(5.8), pytest.approx(8.3 - 0.05)]
    no_cost = replica_run(PREEMPT_TRACE, **PREEMPT_SETTINGS)
    assert no_cost.e2e == [4.1, 6.6 - 0.05]  # as test_replay works it out, bit for bit


def test_a_fleet_s_replicas_each_pace_their_own_batch():
    one = fleet(SHARED, 1, "round_robin", block_size=16, **SHARED_SETTINGS, decode_batch_cost=1.0)
    assert one.e2e_p95_s == pytest.approx(2.6)
    two = fleet(SHARED, 2, "round_robin", block_size=16, **SHARED_SETTINGS, decode_batch_cost=1.0)
    assert two.e2e_p95_s == pytest.approx(2.0)  # each alone on its replica


def served(t_ms, output, decode_ms, replica=None, queued_ms=0.0, prefill_ms=0.0):
    return TraceRequest(float(t_ms), 512, output, (int(t_ms),), None, 512,
                        Served(queued_ms, prefill_ms, decode_ms, 0), replica)


# one alone at 0.1 s a token; two together at 0.2 s a token each: 10 tokens/s alone, cost 1.0
PAIRED = [served(0, 11, 1000.0), served(10_000, 11, 2000.0), served(10_000, 11, 2000.0)]


def test_the_mean_number_in_service_counts_every_request_from_admission_to_its_last_token():
    # (admitted, first token, last token): the second is in service while the first decodes its
    # second half; the third decodes in no time
    spans = [(0.0, 1.0, 3.0), (1.5, 2.0, 4.0), (5.0, 5.0, 5.0)]
    assert mean_in_service(spans) == [pytest.approx((1 * 0.5 + 2 * 1.5) / 2.0), pytest.approx((2 + 1) / 2), None]


def test_the_batch_cost_and_the_rate_alone_come_from_a_line_through_the_trace_s_timings():
    assert fit_batch_cost(PAIRED) == (pytest.approx(10.0), pytest.approx(1.0))
    assert measured_rates(PAIRED) == MeasuredRates(3, None, pytest.approx(10.0), pytest.approx(1.0))
    # each replica's requests are in service beside their own replica's only: two replicas, one request
    # each at 10,000 ms, decode alone at 0.2 s a token; the line through three alone is flat: no fit
    split = PAIRED[:1] + [served(10_000, 11, 2000.0, "r0"), served(10_000, 11, 2000.0, "r1")]
    assert fit_batch_cost(split) is None
    assert measured_rates(split) == MeasuredRates(3, None, 30 / 5.0, None)  # the mean rate, as before
    # decoding faster beside another: no slowing, so cost 0 at the mean rate
    faster = [served(0, 11, 2000.0), served(10_000, 11, 1000.0), served(10_000, 11, 1000.0)]
    assert fit_batch_cost(faster) == (pytest.approx(30 / 4.0), 0.0)
    assert fit_batch_cost(PAIRED[1:]) is None  # two requests: too few for a line
    # in service from admission to the last token: the first decodes alone while the second waits (0 to
    # 2 s), then the second alone; the fourth decodes beside the fifth's prefill (20 to 22 s), then the
    # fifth alone. Counting the wait, or not the prefill, would draw no straight line
    staged = [served(0, 21, 2000.0), served(0, 11, 1000.0, queued_ms=2000.0, prefill_ms=1000.0),
              *PAIRED[1:], served(20_000, 11, 2000.0), served(20_000, 11, 1000.0, prefill_ms=2000.0)]
    assert mean_in_service([(0.0, 0.0, 2.0), (2.0, 3.0, 4.0), (20.0, 20.0, 22.0), (20.0, 22.0, 23.0)]) == [
        1.0, 1.0, 2.0, 1.0]
    assert fit_batch_cost(staged) == (pytest.approx(10.0), pytest.approx(1.0))


def test_kvctl_bench_replay_takes_a_batch_cost_or_fits_it_from_the_trace(tmp_path, capsys):
    path = tmp_path / "paired.jsonl"
    write_trace(path, SHARED)
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "1024", "--policy", "lru",
            "--prefill-rate", "1e12", "--decode-rate", "10")
    status, printed, _ = cli(capsys, *args, "--decode-batch-cost", "1.0", "--json")
    document = json.loads(printed)
    assert status == 0 and document["settings"]["decode_batch_cost"] == 1.0
    [run] = document["runs"]
    assert (run["e2e_p50_s"], run["e2e_p95_s"]) == (pytest.approx(1.2), pytest.approx(2.6))
    status, _, err = cli(capsys, *args, "--decode-batch-cost", "-0.5")
    assert status == 2 and "decode_batch_cost: must be a number >= 0 (0: none), got -0.5" in " ".join(err.split())
    write_trace(path, PAIRED)
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru",
                             "--rates-from-trace", "--json")
    settings = json.loads(printed)["settings"]
    assert status == 0 and (settings["decode_rate"], settings["decode_batch_cost"]) == (
        pytest.approx(10.0), pytest.approx(1.0))
    assert settings["rates_from_trace"]["decode_batch_cost"] == pytest.approx(1.0)
    status, _, err = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru",
                         "--rates-from-trace", "--decode-batch-cost", "0.5")
    assert status == 0 and ("decode 10 tokens/s a request alone, a step 100.0% longer for each other request in "
                            "service") in " ".join(err.split())  # the trace's cost in place of the option's
    status, printed, _ = cli(capsys, "trace", "stats", str(path))
    assert status == 0 and ("decode 10 tokens/s a request alone, a step 100.0% longer for each other request in "
                            "service") in " ".join(printed.replace("│", " ").split())


def test_a_bigger_batch_starts_a_request_sooner_and_decodes_every_one_more_slowly():
    """SHARED at cost 1.0. One at a time, B waits for A (done at 2.0 s), then decodes alone: first
    token after 1.0 s, 6 tokens by 2.6 s. Two at once, B starts at once but both decode at half pace
    (test above): A's tokens take 2.6 / 19 s each, B's 1.2 / 5."""
    one = replica_run(SHARED, **SHARED_SETTINGS, decode_batch_cost=1.0, max_running=1)
    assert one.ttft == [pytest.approx(0.0, abs=1e-9), pytest.approx(1.0)]
    assert one.e2e == [pytest.approx(2.0), pytest.approx(1.6)]
    assert one.itl == [pytest.approx(2.0 / 19), pytest.approx(0.6 / 5)]
    two = replica_run(SHARED, **SHARED_SETTINGS, decode_batch_cost=1.0, max_running=2)
    assert two.itl == [pytest.approx(1.2 / 5), pytest.approx(2.6 / 19)]  # (B finishes first)
    result = two.result(1.0)
    assert (result.max_running, result.itl_p50_s, result.itl_p95_s) == (2, pytest.approx(2.6 / 19),
                                                                        pytest.approx(1.2 / 5))
    a_fleet = fleet(SHARED, 1, "round_robin", block_size=16, **SHARED_SETTINGS, decode_batch_cost=1.0, max_running=2)
    assert (a_fleet.max_running, a_fleet.itl_p95_s) == (2, pytest.approx(1.2 / 5))


def test_kvctl_bench_replay_compares_requests_in_service_at_once(tmp_path, capsys):
    path = tmp_path / "shared.jsonl"
    write_trace(path, SHARED)
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "1024", "--policy", "lru",
            "--prefill-rate", "1e12", "--decode-rate", "10", "--decode-batch-cost", "1.0", "--max-running", "1,2")
    status, printed, _ = cli(capsys, *args, "--json")
    document = json.loads(printed)
    assert status == 0 and document["settings"]["max_running"] == [1, 2]
    assert [(r["max_running"], round(r["ttft_p95_s"], 3), round(r["e2e_p95_s"], 3)) for r in document["runs"]] == [
        (1, 1.0, 2.0), (2, 0.0, 2.6)]
    status, printed, _ = cli(capsys, *args)
    text = " ".join(printed.split())
    assert status == 0
    assert ("block 16, capacity 1,024, lru x1: 0 preempted; reserved unused 0.0%; first token p50/p95 0.00/1.00 s, "
            "end to end 1.60/2.00 s; a token 105/120 ms") in text
    assert ("block 16, capacity 1,024, lru x2: 0 preempted; reserved unused 0.0%; first token p50/p95 0.00/0.00 s, "
            "end to end 1.20/2.60 s; a token 137/240 ms") in text
    status, printed, _ = cli(capsys, *args[:-1], "64", "--json")  # one: a number, as before
    assert status == 0 and json.loads(printed)["settings"]["max_running"] == 64
    for bad, message in (("0", "max_running: must be >= 1, got 0"), ("x", "max_running: expected integers, got 'x'")):
        status, _, err = cli(capsys, *args[:-1], bad)
        assert status == 2 and message in " ".join(err.split())


@pytest.mark.parametrize("reservation, cost, tier", [("fixed:0", 0.05, 0), ("fixed:32", 0.5, 0), ("fixed:16", 0.05, 4096)])
def test_every_request_comes_back_and_the_books_balance_under_preemption_at_a_changing_pace(reservation, cost, tier):
    """A generated trace squeezed into a small cache with short reservations: requests grow, preempt
    and restart on their cached prompts and outputs while every admission and finish re-paces the
    rest; the cache's books must balance (audit), every request finish or be turned away, and each
    be counted once."""
    from kvctl.daemon.replay.trace import generate_trace

    from .test_replay import run

    trace = generate_trace(300, seed=5)
    result = run(trace, 16, 8192, "lru", reservation=reservation, max_tokens=1024, decode_batch_cost=cost,
                 tier_tokens=tier, max_running=32)  # audit=True inside
    assert result.admitted + result.rejections == 300 and result.preemptions > 0
    assert 0 < result.hit_ratio <= result.max_hit_ratio <= 1
    assert result.itl_p50_s is not None and result.itl_p50_s >= 1 / 40.0 - 1e-9  # never faster than alone


# kvd's own account: arrival to first token 0.10, 0.05 and 0.03 s; to the last 0.6, 0.45 and 0.03 s;
# a token 50 and 20 ms (the third made one); the fourth turned away
SERVED_TRACE = [served(0, 11, 500.0, prefill_ms=100.0), served(1000, 21, 400.0, queued_ms=10.0, prefill_ms=40.0),
                served(2000, 1, 0.0, prefill_ms=30.0), TraceRequest(3000.0, 512, 0, (3000,), block_tokens=512)]


def test_kvctl_bench_replay_sets_kvd_s_own_timings_beside_the_runs(tmp_path, capsys):
    from kvctl.trace_stats import live_timings

    assert live_timings(SERVED_TRACE) == {
        "requests": 3, "cached_token_ratio": 0.0, "ttft_p50_s": 0.05, "ttft_p95_s": 0.1,
        "e2e_p50_s": 0.45, "e2e_p95_s": 0.6, "itl_p50_s": 0.02, "itl_p95_s": 0.05}
    assert live_timings(SHARED) is None  # a trace that does not say how it was served
    path = tmp_path / "served.jsonl"
    write_trace(path, SERVED_TRACE)
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--policy", "lru", "--rates-from-trace")
    status, printed, _ = cli(capsys, *args, "--json")
    assert status == 0 and json.loads(printed)["live_timings"]["e2e_p95_s"] == 0.6
    status, printed, _ = cli(capsys, *args)
    text = " ".join(printed.split())
    assert status == 0 and ("kvd's own account in the trace (3 requests): cached 0.0%; first token p50/p95 "
                            "0.05/0.10 s, end to end 0.45/0.60 s; a token 20/50 ms") in text
    assert "block 16, capacity 262,144, lru: 0 preempted; reserved unused" in text  # the run's, beside it
    status, printed, _ = cli(capsys, *args, "--replicas", "2", "--routing", "round_robin")
    text = " ".join(printed.split())
    assert status == 0 and "kvd's own account in the trace (3 requests)" in text
    assert "round_robin (block 16, capacity 262,144, lru): 0 preempted" in text
    status, printed, _ = cli(capsys, *args, "--sequential")  # no times in sequential mode: nothing beside
    assert status == 0 and "kvd's own account" not in printed


# ---- the context a batch holds (decode_context_cost) ---------------------------------------------
# A (1,014 prompt tokens, 20 out) alone from 0 s, B (1,019, 10 out) from 1 s: prefill takes no time,
# 10 tokens/s alone with no context. Cost 1.0 for each 1,024 tokens of context.
LONG = [TraceRequest(0.0, 1014, 20, (1, 2)), TraceRequest(1000.0, 1019, 10, (3, 4))]
LONG_SETTINGS = dict(capacity_tokens=4096, prefill_rate=1e12, decode_rate=10.0, decode_context_cost=1.0)


def test_a_request_decodes_more_slowly_the_more_context_its_batch_holds():
    # alone, A holds 1,014 + (0 + 20) / 2 = 1,024 tokens on average as it decodes: 5 tokens/s, 4 s
    [alone] = replica_run(LONG[:1], **LONG_SETTINGS).e2e
    assert alone == pytest.approx(4.0)
    # A makes 5 tokens by 1 s. Then A holds 1,014 + (5 + 20) / 2 and B 1,019 + (0 + 10) / 2 ahead: both
    # at 10 / (1 + 2,050.5 / 1,024). B finishes after its 10; A, 5 from its end, goes on alone holding
    # 1,014 + (15 + 20) / 2
    together = 10.0 / (1.0 + (1014 + 12.5 + 1019 + 5) / 1024)
    b_done = 1.0 + 10 / together
    a_done = b_done + 5 / (10.0 / (1.0 + (1014 + 17.5) / 1024))
    assert replica_run(LONG, **LONG_SETTINGS).e2e == [pytest.approx(b_done - 1.0), pytest.approx(a_done)]
    both = replica_run(LONG, **LONG_SETTINGS, decode_batch_cost=0.5)  # and each other request costs half a step
    assert both.e2e[0] == pytest.approx(10 / (10.0 / (1.5 + 2050.5 / 1024)))
    # no context cost: 10 tokens/s each, A done at 2 s, B too
    assert sorted(replica_run(LONG, **{**LONG_SETTINGS, "decode_context_cost": 0.0}).e2e) == [
        pytest.approx(1.0), pytest.approx(2.0)]


def test_the_context_in_service_is_each_prompt_from_admission_and_its_output_as_it_decodes():
    from kvctl.daemon.replay.service_rates import context_in_service

    # alone: admitted at 0, first token at 1 s, last at 3 s, 100 prompt tokens and 20 out: 110 on average
    assert context_in_service([(0.0, 1.0, 3.0)], [(100, 20)]) == [pytest.approx(110.0)]
    # beside a second, admitted at 2 s (50 tokens) that decodes 10 from 2.5 s to 4 s; far from the origin
    # too (the sums are kept near it). The third decoded in no time
    for origin in (0.0, 86_400.0):
        spans = [(origin, origin + 1.0, origin + 3.0), (origin + 2.0, origin + 2.5, origin + 4.0),
                 (origin + 9.0, origin + 9.0, origin + 9.0)]
        first = (2 * 110 + 0.5 * 50 + 0.5 * (50 + 10 * 0.25 / 1.5)) / 2
        second = (0.5 * (100 + 10 * 1.75) + 1.5 * 55) / 1.5
        assert context_in_service(spans, [(100, 20), (50, 10), (7, 1)]) == [
            pytest.approx(first), pytest.approx(second), 0.0]


def timed(t_ms, prompt, decode_ms):
    ids = tuple(int(t_ms) + i for i in range(-(-prompt // 512)))
    return TraceRequest(float(t_ms), prompt, 11, ids, None, 512, Served(0.0, 0.0, decode_ms, 0))


def decode_ms(others, context):
    """10 later tokens at 0.1 s a token alone with no context; each other request in service 50%
    more, each 1,024 tokens of context it holds 25% more."""
    return 10 * 0.1 * (1 + 0.5 * others + 0.25 * context / 1024) * 1000


def test_the_context_cost_comes_from_a_plane_through_the_trace_s_timings():
    """decode_ms's costs. Alone a request holds its prompt and half its output (+5.5, of 11) on
    average as it decodes; two together twice that."""
    trace = [timed(0, 1019, decode_ms(0, 1024.5)), timed(100_000, 3067, decode_ms(0, 3072.5)),
             timed(200_000, 1019, decode_ms(1, 2 * 1024.5)), timed(200_000, 1019, decode_ms(1, 2 * 1024.5)),
             timed(300_000, 2043, decode_ms(0, 2048.5))]
    rates = measured_rates(trace)
    assert (rates.decode_rate, rates.decode_batch_cost, rates.decode_context_cost) == (
        pytest.approx(10.0), pytest.approx(0.5), pytest.approx(0.25))
    # beside another a request decoded faster (a plane falling with the batch): no batch cost, and the
    # least-squares line through seconds a token against the context alone (equal tokens: unweighted)
    faster = [timed(0, 1019, decode_ms(0, 1024.5)), timed(100_000, 3067, decode_ms(0, 3072.5)),
              timed(200_000, 1019, decode_ms(-0.2, 2049)), timed(200_000, 1019, decode_ms(-0.2, 2049))]
    line = statistics.linear_regression([1024.5 / 1024, 3072.5 / 1024, 2049 / 1024, 2049 / 1024],
                                        [decode_ms(0, 1024.5) / 1e4, decode_ms(0, 3072.5) / 1e4,
                                         decode_ms(-0.2, 2049) / 1e4, decode_ms(-0.2, 2049) / 1e4])
    fitted = measured_rates(faster)
    assert (fitted.decode_rate, fitted.decode_batch_cost, fitted.decode_context_cost) == (
        pytest.approx(1 / line.intercept), 0.0, pytest.approx(line.slope / line.intercept))
    # every request holds the context its batch size says (PAIRED): no plane, the batch cost alone
    assert measured_rates(PAIRED) == MeasuredRates(3, None, pytest.approx(10.0), pytest.approx(1.0), None)


def test_kvctl_bench_replay_takes_a_context_cost_and_trace_stats_prints_the_fitted_one(tmp_path, capsys):
    path = tmp_path / "long.jsonl"
    write_trace(path, LONG[:1])
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "4096", "--policy", "lru",
            "--prefill-rate", "1e12", "--decode-rate", "10")
    status, printed, _ = cli(capsys, *args, "--decode-context-cost", "1.0", "--json")
    document = json.loads(printed)
    assert status == 0 and document["settings"]["decode_context_cost"] == 1.0
    assert document["runs"][0]["e2e_p50_s"] == pytest.approx(4.0)
    status, _, err = cli(capsys, *args, "--decode-context-cost", "-1")
    assert status == 2 and "decode_context_cost: must be a number >= 0 (0: none), got -1.0" in " ".join(err.split())
    write_trace(path, [timed(0, 1019, decode_ms(0, 1024.5)), timed(100_000, 3067, decode_ms(0, 3072.5)),
                       timed(200_000, 1019, decode_ms(1, 2049)), timed(200_000, 1019, decode_ms(1, 2049))])
    status, printed, _ = cli(capsys, "trace", "stats", str(path))
    assert status == 0 and ("a step 50.0% longer for each other request in service and 25.0% for each 1,024 "
                            "tokens of context it holds") in " ".join(printed.replace("│", " ").split())


# ---- a prompt's computation: an overhead, and a cost per token of context before each token --------
# A computes 1,024 new tokens at 0 s; B, at 10 s, shares A's first 512 (one 512-token block) and computes
# 512 more after them. 1,000 tokens/s with no context, 10 ms more a prompt, each 1,024 tokens before a
# token doubling its time.
PROMPTS = [TraceRequest(0.0, 1024, 2, (1, 2), None, 512), TraceRequest(10_000.0, 1024, 2, (1, 3), None, 512)]
PROMPT_SETTINGS = dict(capacity_tokens=4096, prefill_rate=1000.0, decode_rate=1e12, prefill_overhead=0.01,
                       prefill_context_cost=1.0)


def test_a_prompt_takes_an_overhead_and_longer_the_more_context_stands_before_its_tokens():
    replica = replica_run(PROMPTS, **PROMPT_SETTINGS)
    # A: 0.01 + 1.024 s * (1 + 512 / 1,024), its tokens' context 512 on average; B: 0.01 + 0.512 s *
    # (1 + (512 + 256) / 1,024)
    assert replica.ttft == [pytest.approx(0.01 + 1.024 * 1.5), pytest.approx(0.01 + 0.512 * 1.75)]
    assert replica_run(PROMPTS, **{**PROMPT_SETTINGS, "prefill_context_cost": 0.0}).ttft == [
        pytest.approx(1.034), pytest.approx(0.522)]
    plain = replica_run(PROMPTS, capacity_tokens=4096, prefill_rate=1000.0, decode_rate=1e12)
    assert plain.ttft == [1.024, 0.512]  # neither: as before, bit for bit
    # preempted while it computes its prompt: what it computed is cached, at an even pace after the overhead
    assert [replica._prefilled(t, 1.01, 100) for t in (0.005, 0.51, 2.0)] == [0, 50, 100]


def test_the_prefill_costs_come_from_a_plane_through_the_trace_s_first_token_times():
    def timed_prefill(t_ms, prompt, cached):
        uncached = prompt - cached
        seconds = 0.004 + uncached / 50_000 * (1 + 0.75 * (cached + uncached / 2) / 1024)
        ids = tuple(int(t_ms) + i for i in range(-(-prompt // 512)))
        return TraceRequest(float(t_ms), prompt, 1, ids, None, 512, Served(0.0, seconds * 1000, 0.0, cached))

    trace = [timed_prefill(0, 2080, 0), timed_prefill(1000, 2080, 2048), timed_prefill(2000, 6176, 6144),
             timed_prefill(3000, 6176, 0), timed_prefill(4000, 96, 64)]
    rates = measured_rates(trace)
    assert (rates.prefill_rate, rates.prefill_overhead, rates.prefill_context_cost) == (
        pytest.approx(50_000), pytest.approx(0.004), pytest.approx(0.75))
    # every prompt computed in no time beyond an overhead that shrinks with it: no plane or line holds
    shrinking = [TraceRequest(float(t), n, 1, tuple(range(t, t + n // 512 + 1)), None, 512, Served(0.0, ms, 0.0, 0))
                 for t, n, ms in ((0, 100, 9.0), (10, 1000, 5.0), (20, 4000, 1.0))]
    assert measured_rates(shrinking).prefill_overhead is None
    assert measured_rates(shrinking).prefill_rate == pytest.approx(5100 / 0.015)  # the ratio, as before


def test_kvctl_bench_replay_takes_the_prefill_costs(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    write_trace(path, PROMPTS)
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "4096", "--policy", "lru",
            "--prefill-rate", "1000", "--decode-rate", "1e12")
    status, printed, _ = cli(capsys, *args, "--prefill-overhead", "0.01", "--prefill-context-cost", "1", "--json")
    document = json.loads(printed)
    assert status == 0 and (document["settings"]["prefill_overhead"], document["settings"]["prefill_context_cost"]) \
        == (0.01, 1.0)
    assert document["runs"][0]["ttft_p95_s"] == pytest.approx(0.01 + 1.024 * 1.5)
    for option in ("--prefill-overhead", "--prefill-context-cost"):
        status, _, err = cli(capsys, *args, option, "-0.5")
        name = option[2:].replace("-", "_")
        assert status == 2 and f"{name}: must be a number >= 0 (0: none), got -0.5" in " ".join(err.split())

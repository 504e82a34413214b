"""`kvctl bench replay --slo`: which replayed runs meet the operator's objectives, and the pick among
them; the condition syntax is the rollouts' stop conditions' (policies/figure_condition.py)."""

from __future__ import annotations

import json

import pytest

from kvctl.daemon.replay.trace import write_trace
from kvctl.policies.figure_condition import FigureCondition
from kvctl.replay_slo import SLO_FIGURES, parse_slo, pick

from .test_cli import cli
from .test_replay import fleet
from .test_replay_batch_cost import SHARED, SHARED_SETTINGS


def test_an_slo_is_a_condition_on_a_run_s_figure_without_a_baseline():
    [slo] = parse_slo(["itl_p95_s <= 0.05"])
    assert (slo.figure, slo.op, slo.value, slo.relative) == ("itl_p95_s", "<=", 0.05, False)
    assert (slo.holds(0.05), slo.holds(0.051), slo.holds(None)) == (True, False, None)
    for text, message in [("itl_p95_s is low", "slo: cannot parse 'itl_p95_s is low'; write e.g. 'itl_p95_s <= 0.05'"),
                          ("vibes < 1", "slo: unknown figure 'vibes'; use one of " + ", ".join(SLO_FIGURES)),
                          ("ttft_p95_s < 1.5 * baseline", "slo: 'ttft_p95_s < 1.5 * baseline' compares with a "
                                                          "baseline, and there is none here; write a number, e.g. "
                                                          "'itl_p95_s <= 0.05'")]:
        with pytest.raises(ValueError) as refused:
            parse_slo([text])
        assert str(refused.value) == message
    relative = FigureCondition.parse("hit_ratio < 0.5 * baseline", ("hit_ratio",), field="stop", example="x")
    assert (relative.holds(0.3, 0.8), relative.holds(0.5, 0.8), relative.holds(0.3, None)) == (True, False, None)


# SHARED at cost 1.0: one at a time, the second request waits 1 s for its first token and each token
# takes at most 120 ms; two at once, none waits but a token takes up to 240 ms (test_replay_batch_cost)
def shared_runs():
    return [fleet(SHARED, 1, "round_robin", block_size=16, **SHARED_SETTINGS, decode_batch_cost=1.0, max_running=m)
            for m in (1, 2)]


@pytest.mark.parametrize("slo, met, best", [
    (["itl_p95_s <= 0.2"], [0], 0),
    (["ttft_p95_s <= 0.5"], [1], 1),
    (["e2e_p95_s <= 3"], [0, 1], 1),  # both meet it: equal hits, so the lower first-token p95
    (["itl_p95_s <= 0.2", "ttft_p95_s <= 0.5"], [], None),
    (["hit_ratio > 0.5"], [], None),
])
def test_the_pick_is_the_run_meeting_every_objective_with_the_best_hit_then_first_token(slo, met, best):
    assert pick(shared_runs(), parse_slo(slo)) == (met, best)


def test_kvctl_bench_replay_says_which_runs_meet_the_slo_and_exits_3_when_none_does(tmp_path, capsys):
    path = tmp_path / "shared.jsonl"
    write_trace(path, SHARED)
    args = ("bench", "replay", str(path), "--block-sizes", "16", "--capacity-tokens", "1024", "--policy", "lru",
            "--prefill-rate", "1e12", "--decode-rate", "10", "--decode-batch-cost", "1.0", "--max-running", "1,2")
    status, printed, _ = cli(capsys, *args, "--slo", "e2e_p95_s <= 3", "--slo", "itl_p95_s <= 0.2", "--json")
    document = json.loads(printed)
    assert status == 0 and document["slo"] == {"conditions": ["e2e_p95_s <= 3", "itl_p95_s <= 0.2"], "met": [0],
                                               "pick": 0}
    assert [run["meets_slo"] for run in document["runs"]] == [True, False]
    status, printed, _ = cli(capsys, *args, "--slo", "e2e_p95_s <= 3")
    assert status == 0 and ("SLO e2e_p95_s <= 3: 2 of 2 runs meet it; the pick (the highest hit, then the lowest "
                            "first-token p95): block 16, capacity 1,024, lru x2 (hit 0.0%, first token p95 0.00 s, "
                            "end to end p95 2.60 s)") in " ".join(printed.split())
    status, printed, _ = cli(capsys, *args, "--slo", "ttft_p95_s <= 0.5", "--slo", "itl_p95_s <= 0.2")
    assert status == 3 and ("SLO ttft_p95_s <= 0.5; itl_p95_s <= 0.2: no run meets it"
                            in " ".join(printed.split()))
    status, printed, _ = cli(capsys, *args, "--slo", "ttft_p95_s <= 0.5", "--slo", "itl_p95_s <= 0.2", "--json")
    assert status == 3 and json.loads(printed)["slo"]["pick"] is None
    status, _, err = cli(capsys, *args, "--slo", "vibes < 1")
    assert status == 2 and "slo: unknown figure 'vibes'" in err
    status, printed, _ = cli(capsys, "bench", "replay", str(path), "--block-sizes", "16", "--replicas", "2",
                             "--routing", "round_robin", "--prefill-rate", "1e12", "--decode-rate", "10",
                             "--slo", "itl_p95_s <= 0.2")
    assert status == 0 and ("the pick (the highest hit, then the lowest first-token p95): block 16, capacity "
                            "262,144, lru, round_robin") in " ".join(printed.split())

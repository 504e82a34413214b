"""The batched sampler (sampling.draw_tokens): which tokens a row keeps and with what weight, held
to the row-by-row reference (sampling_scores); the draw of each row the same in any batch and
alone; draws that follow those weights; never a token left out, whatever u."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvctl.daemon.engine import sampling  # noqa: E402
from kvctl.daemon.engine.sampling import Draw, SamplingParams, draw_tokens, sampling_scores, step_uniform  # noqa: E402

VOCAB = 300
MIXED = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, top_k=40, top_p=0.5),
         SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.9, min_p=0.1, top_k=12, top_p=0.8),
         SamplingParams(temperature=1.0, top_p=0.999, top_k=VOCAB + 5), SamplingParams(temperature=0.0)]


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def table_of(params: SamplingParams, u: float = 0.5) -> torch.Tensor:
    k = params.top_k if 0 < params.top_k < VOCAB else VOCAB
    return torch.tensor([[params.temperature, params.min_p, k, params.top_p, u]], dtype=torch.float32)


@pytest.mark.parametrize("params", [p for p in MIXED if p.temperature > 0], ids=str)
def test_each_row_keeps_the_references_tokens_with_its_weights(params):
    for seed in range(5):
        row = logits(1, seed)
        cut = params.top_p < 1.0 or 0 < params.top_k < VOCAB
        weights, order = sampling._weights(row, table_of(params), cut)
        if order is not None:  # back to vocabulary order
            weights = torch.zeros_like(weights).scatter(-1, order, weights)
        expected = torch.softmax(sampling_scores(row[0], params), dim=-1)
        assert torch.equal(weights[0] > 0, expected > 0)
        torch.testing.assert_close(weights[0] / weights[0].sum(), expected, rtol=1e-5, atol=1e-7)


def test_a_row_draws_the_same_token_in_any_batch_and_alone():
    rows = logits(len(MIXED) * 3, seed=7)
    draws = [Draw(MIXED[i % len(MIXED)], seed=11 + i, sample_index=i % 2, step=i) for i in range(rows.shape[0])]
    together = draw_tokens(rows, draws)
    alone = [draw_tokens(rows[i:i + 1], [d])[0] for i, d in enumerate(draws)]
    reversed_ = draw_tokens(rows.flip(0), draws[::-1])[::-1]
    assert together == alone == reversed_
    for i, (token, d) in enumerate(zip(together, draws)):
        if d.params.temperature == 0:
            assert token == int(rows[i].argmax())
        else:
            assert sampling_scores(rows[i], d.params)[token] > float("-inf"), (i, d.params)


def test_draws_follow_the_rows_weights():
    """20,000 draws of one row (its steps 0..19,999): each token's share within 0.01 of its
    probability under the reference."""
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
                   SamplingParams(temperature=1.0, top_k=3)):
        draws = [Draw(params, seed=5, sample_index=0, step=t) for t in range(20_000)]
        tokens = draw_tokens(row.expand(len(draws), -1), draws)
        shares = torch.bincount(torch.tensor(tokens), minlength=8).double() / len(tokens)
        expected = torch.softmax(sampling_scores(row[0], params), dim=-1).double()
        assert (shares - expected).abs().max() < 0.01, (params, shares, expected)
        assert shares[expected == 0].sum() == 0


def test_a_draw_at_the_top_of_u_never_takes_a_token_left_out(monkeypatch):
    """u x total can round up to the total: the draw takes the last token kept, not the
    vocabulary's last (left out by a grammar's mask, or by min_p)."""
    monkeypatch.setattr(sampling, "step_uniform", lambda seed, index, step: 1.0 - 2.0 ** -53)
    row = torch.full((1, VOCAB), float("-inf"))
    row[0, [3, 17, 42]] = torch.tensor([0.5, 2.0, 1.0])  # a grammar's mask: three tokens may follow
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95),
                   SamplingParams(temperature=2.0, min_p=0.2)):
        [token] = draw_tokens(row, [Draw(params, 1, 0, 0)])
        assert token in (3, 17, 42), params
    wide = logits(1, seed=3)
    wide[0, -1] = -30.0  # the vocabulary's last token: left out by min_p
    [token] = draw_tokens(wide, [Draw(SamplingParams(temperature=1.0, min_p=0.01), 1, 0, 0)])
    assert token != VOCAB - 1 and sampling_scores(wide[0], SamplingParams(temperature=1.0, min_p=0.01))[token] > float(
        "-inf")


def shaped_rows(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of VOCAB logits in three shapes: a model's long tail (the r-th likeliest token at
    -1.2 ln r), flat (normal), and integers 0..5 (ties at every boundary)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(VOCAB, generator=g) for _ in range(rows)]) + 1
    return {"tail": -1.2 * ranks.float().log(), "flat": torch.randn(rows, VOCAB, generator=g),
            "ties": torch.randint(0, 6, (rows, VOCAB), generator=g).float()}


CUT = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5),
       SamplingParams(temperature=0.5, top_k=20), SamplingParams(temperature=1.3, top_k=40, top_p=0.9),
       SamplingParams(temperature=1.0, min_p=0.05, top_p=0.8), SamplingParams(temperature=1.0, top_k=100)]


def test_a_cut_row_found_in_its_window_keeps_the_whole_sort_s_tokens_and_weights():
    """_window_weights looks for a cut row's kept tokens among its `window` highest scores: where it
    says the window holds them all, they and their weights are the whole sort's (_weights); where it
    does not (a flat row's nucleus, ties at the window's edge, a top_k wider than the window), the
    row is sorted whole. Every shape here has rows of each kind."""
    window, found = 32, {"whole": 0, "spilled": 0}
    for shape, rows in shaped_rows(len(CUT) * 4, seed=2).items():
        table = torch.cat([table_of(CUT[i % len(CUT)], u=0.5) for i in range(rows.shape[0])])
        probs, ids, whole = sampling._window_weights(rows, table, window)
        full, order = sampling._weights(rows, table, cut=True)
        full = torch.zeros_like(full).scatter(-1, order, full)
        for i in range(rows.shape[0]):
            found["whole" if whole[i] else "spilled"] += 1
            if not whole[i]:
                continue
            mine = torch.zeros(VOCAB).scatter(0, ids[i], probs[i])
            assert torch.equal(mine > 0, full[i] > 0), (shape, CUT[i % len(CUT)])
            torch.testing.assert_close(mine / mine.sum(), full[i] / full[i].sum(), rtol=1e-5, atol=1e-7)
        if shape == "ties":  # 300 integers of 6 values: every window's edge is a tie
            assert not any(whole[i] for i in range(rows.shape[0]) if CUT[i % len(CUT)].top_p < 0.9)
    assert found["whole"] > 10 and found["spilled"] > 10, found
    wide = table_of(SamplingParams(temperature=1.0, top_k=window + 1))  # wider than the window: sorted whole
    assert not sampling._window_weights(shaped_rows(1, seed=3)["tail"], wide, window)[2][0]


def test_draws_through_the_window_take_the_tokens_the_whole_sort_takes():
    """The same u, the same token, whether the row was resolved in a window of 32 or sorted whole,
    in every shape, and alone as in the batch."""
    for seed in range(3):
        for shape, rows in shaped_rows(len(CUT) * 5, seed=seed).items():
            draws = [Draw(CUT[i % len(CUT)], seed=seed, sample_index=0, step=i) for i in range(rows.shape[0])]
            windowed = draw_tokens(rows, draws, window=32)
            assert windowed == draw_tokens(rows, draws, window=VOCAB), shape
            assert windowed == [draw_tokens(rows[i:i + 1], [d], window=32)[0] for i, d in enumerate(draws)]
            assert all(sampling_scores(rows[i], d.params)[t] > float("-inf")
                       for i, (t, d) in enumerate(zip(windowed, draws)))


def test_step_uniform_is_fixed_by_seed_sample_and_step_and_spread_over_0_1():
    assert step_uniform(3, 0, 7) == step_uniform(3, 0, 7)
    values = [step_uniform(3, i, t) for i in range(2) for t in range(2000)]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_a_draw_for_each_row_is_asked():
    with pytest.raises(ValueError, match="draws: 1 for 2 rows of scores"):
        draw_tokens(logits(2), [Draw(SamplingParams(temperature=1.0), 1, 0, 0)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_on_the_gpu_draw_what_they_draw_on_the_cpu():
    """The draw runs on the logits' device (no row goes to the host); the same tokens as there but
    where float rounding moves a boundary past u (none in these 64 rows)."""
    rows = logits(64, seed=9)
    draws = [Draw(MIXED[i % len(MIXED)], seed=i, sample_index=0, step=3) for i in range(64)]
    assert draw_tokens(rows.cuda(), draws) == draw_tokens(rows, draws)


def test_kvctl_bench_sampler_times_both_paths_on_the_same_rows_and_checks_the_tokens(capsys):
    import json

    from .test_cli import cli

    status, out, _ = cli(capsys, "bench", "sampler", "--vocab", "500", "--batch", "2,8", "--repeats", "2",
                         "--device", "cpu", "--json")
    body = json.loads(out)
    assert status == 0 and (body["device"], body["vocab"], body["mix"], body["repeats"]) == ("cpu", 500, "mixed", 2)
    assert [r["batch"] for r in body["rows"]] == [2, 8] and all(r["tokens_kept"] for r in body["rows"])
    assert all(r["batched_ms"] > 0 and r["per_row_ms"] > 0 and
               r["speedup"] == pytest.approx(r["per_row_ms"] / r["batched_ms"]) for r in body["rows"])
    assert body["logits"] == "zipf" and body["window"] == sampling.WINDOW
    assert all(r["whole_sort_ms"] > 0 for r in body["rows"])  # the draw with no window, timed beside it
    assert all(r["same_as_sorted_whole"] for r in body["rows"])
    status, out, _ = cli(capsys, "bench", "sampler", "--vocab", "5000", "--batch", "3", "--repeats", "1",
                         "--device", "cpu", "--mix", "penalties", "--logits", "normal", "--json")
    body = json.loads(out)  # every row penalised: adjusted together on one side, row by row on the other
    assert status == 0 and (body["mix"], body["logits"]) == ("penalties", "normal")
    assert [r["batch"] for r in body["rows"]] == [3]
    assert body["rows"][0]["tokens_kept"]
    status, out, _ = cli(capsys, "bench", "sampler", "--vocab", "500", "--batch", "4", "--repeats", "1")
    assert status == 0 and "sampled rows of 500 zipf logits on cpu (mixed; median of 1)" in out and "yes" in out
    assert "The window drew the whole sort's tokens in every batch." in out
    for args, said in ((["--batch", "4,x"], "batch: expected numbers separated by commas, got '4,x'"),
                       (["--batch", "0"], "batch: each must be >= 1, got '0'"),
                       (["--mix", "hot"], "mix: must be one of mixed, top-p, plain, penalties, got 'hot'"),
                       (["--logits", "flat"], "logits: must be one of zipf, normal, got 'flat'"),
                       (["--vocab", "1"], "vocab: must be >= 2, got 1"),
                       (["--repeats", "0"], "repeats: must be >= 1, got 0"),
                       (["--device", "tpu"], "device: must be auto, cpu or cuda, got 'tpu'")):
        status, _, err = cli(capsys, "bench", "sampler", *args)
        assert status == 2 and said in " ".join(err.split()), (args, err)


def test_the_row_by_row_baseline_keeps_the_references_tokens():
    from kvctl.bench_sampler import per_row_draws

    rows = logits(len(MIXED), seed=4)
    draws = [Draw(p, seed=2, sample_index=0, step=i) for i, p in enumerate(MIXED) if p.temperature > 0]
    tokens = per_row_draws(rows[:len(draws)], draws)
    assert all(sampling_scores(rows[i], d.params)[t] > float("-inf") for i, (t, d) in enumerate(zip(tokens, draws)))

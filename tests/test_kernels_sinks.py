"""Attention sinks (gpt-oss): each query head has a learned logit s that joins its softmax's sum
and adds no value, so the keys' weights sum to exp(L) / (exp(L) + exp(s)) (L the log-sum-exp
of the scores) rather than to 1. The references against a hand-written softmax with the sink
as an extra column; the Triton kernels (CPU: TRITON_INTERPRET=1), one split and several merged,
and the batched torch path (cascade over shared prefixes, decode rows, prompt chunks) against
the references, alone and under a sliding window."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvctl.kernels import (KernelArgumentError, paged_attention_torch, paged_decode_attention,  # noqa: E402
                           paged_decode_attention_ref, paged_prefill_attention, paged_prefill_attention_ref)
from kvctl.kernels.decode import gather_sequence  # noqa: E402

from .test_kernels_attention import (assert_cascade_matches_the_reference, assert_kernels_match_references,  # noqa: E402
                                     assert_torch_path_matches_references, attention_by_hand, build, decode_inputs, prefill_inputs, query_dtype,
                                     run_decode, run_prefill)

LENGTHS = [1, 15, 16, 17, 40, 100]
NEW = [1, 15, 5, 17, 40, 3]
MIXED = (NEW, [1] * len(LENGTHS), [1, 3, 4, 2, 1, 3])  # prompt chunks; decodes; decode rows of a few tokens


def head_sinks(heads: int, seed: int) -> torch.Tensor:
    """Sinks from -2 to 3: some heads give the sink most of their weight, some little."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(heads, generator=g) * 5 - 2


def sunk_attention(q, k, v, scale, sinks, positions, window=None):
    """For each head and row, the softmax over the scores of the keys it sees and the head's
    sink, the sink's weight then dropped."""
    return attention_by_hand(q, k, v, scale, positions, window,
                             lambda s, head: torch.softmax(torch.cat((s, sinks[head:head + 1])), dim=0)[:-1])


@pytest.mark.parametrize("window", [None, 17])
def test_the_references_put_each_heads_sink_in_its_softmax(window):
    case = build(torch.float32, lengths=LENGTHS, seed=51)
    sinks = head_sinks(case["heads"], 1)
    q, lens = decode_inputs(case, torch.float32)
    scale = case["head_dim"] ** -0.5
    decode = run_decode(paged_decode_attention_ref, case, q, lens, window=window, sinks=sinks)
    qp, qsl, _ = prefill_inputs(case, NEW, torch.float32)
    prefill = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, window=window, sinks=sinks)
    for seq, (length, new) in enumerate(zip(LENGTHS, NEW)):
        k = gather_sequence(case["k_cache"], case["block_tables"][seq], length, None)
        v = gather_sequence(case["v_cache"], case["block_tables"][seq], length, None)
        want = sunk_attention(q[seq:seq + 1], k, v, scale, sinks, [length - 1], window)
        torch.testing.assert_close(decode[seq:seq + 1], want, atol=1e-5, rtol=1e-5)
        rows = slice(int(qsl[seq]), int(qsl[seq + 1]))
        want = sunk_attention(qp[rows], k, v, scale, sinks, list(range(length - new, length)), window)
        torch.testing.assert_close(prefill[rows], want, atol=1e-5, rtol=1e-5)
    plain = run_decode(paged_decode_attention_ref, case, q, lens, window=window)
    assert (plain - decode).abs().max() > 0.1  # the sinks took weight from the keys
    # a sink far below every score takes nothing
    torch.testing.assert_close(run_decode(paged_decode_attention_ref, case, q, lens, window=window,
                                          sinks=torch.full((case["heads"],), -1e4)), plain, atol=1e-6, rtol=1e-6)


def test_a_single_key_keeps_exactly_the_weight_the_sink_leaves_it():
    """One key of score x and a sink s: the output is v * exp(x) / (exp(x) + exp(s))."""
    case = build(torch.float32, lengths=[1], seed=52)
    q, lens = decode_inputs(case, torch.float32)
    sinks = head_sinks(case["heads"], 2)
    got = run_decode(paged_decode_attention_ref, case, q, lens, sinks=sinks)
    k = gather_sequence(case["k_cache"], case["block_tables"][0], 1, None)[0]
    v = gather_sequence(case["v_cache"], case["block_tables"][0], 1, None)[0]
    group = case["heads"] // k.shape[0]
    for head in range(case["heads"]):
        x = (q[0, head] @ k[head // group]) * case["head_dim"] ** -0.5
        weight = torch.exp(x) / (torch.exp(x) + torch.exp(sinks[head]))
        torch.testing.assert_close(got[0, head], weight * v[head // group], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("window", [None, 17])
def test_the_triton_kernels_match_the_references_with_sinks(cache_dtype, window):
    case = build(cache_dtype, lengths=LENGTHS, seed=53)
    assert_kernels_match_references(case, query_dtype(cache_dtype), NEW, window=window,
                                    sinks=head_sinks(case["heads"], 3))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("window", [None, 16])
def test_the_batched_torch_path_matches_the_references_with_sinks(cache_dtype, window):
    """Decodes, decode rows of a few tokens and prompt chunks, mixed."""
    case = build(cache_dtype, lengths=LENGTHS, seed=54)
    assert_torch_path_matches_references(case, query_dtype(cache_dtype), MIXED, window=window,
                                         sinks=head_sinks(case["heads"], 4))


@pytest.mark.parametrize("rows", [1, 3])
def test_cascade_decode_over_shared_prefixes_counts_each_sink_once(rows):
    """The shared prefix and each suffix are attended apart and merged by log-sum-exp; the sink
    joins the merged sum once, not once per part. With `rows` new tokens per sequence, each row
    keeps its own head's sink."""
    assert_cascade_matches_the_reference(rows, sinks=head_sinks(4, 5))


@pytest.mark.parametrize("sinks, message", [
    (torch.zeros(4), "sinks: expected shape (8,), one per query head, got (4,)"),
    (torch.zeros(8, dtype=torch.float64), "sinks: expected dtype float32, got float64"),
    (torch.zeros(1, 8), "sinks: expected 1 dimensions, got shape (1, 8)"),
    (torch.zeros(16)[::2], "sinks: must be contiguous, got strides (2,)"),
    ([0.0] * 8, "sinks: expected a tensor, got list"),
], ids=["heads", "dtype", "shape", "strides", "list"])
def test_sinks_are_checked_by_name(sinks, message):
    case = build(torch.float32, lengths=[20, 40], seed=55)
    assert case["heads"] == 8
    q, lens = decode_inputs(case, torch.float32)
    for fn in (paged_decode_attention, paged_decode_attention_ref):
        with pytest.raises(KernelArgumentError) as refused:
            run_decode(fn, case, q, lens, sinks=sinks)
        assert str(refused.value) == message
    qp, qsl, _ = prefill_inputs(case, [2, 3], torch.float32)
    for fn in (paged_prefill_attention, paged_prefill_attention_ref, paged_attention_torch):
        with pytest.raises(KernelArgumentError) as refused:
            run_prefill(fn, case, qp, qsl, lens, sinks=sinks)
        assert str(refused.value) == message

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

from kvctl.kernels import (DecodeLaunch, KernelArgumentError, PrefillLaunch, paged_attention_torch,  # noqa: E402
                           paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention,
                           paged_prefill_attention_ref)
from kvctl.kernels.decode import gather_sequence  # noqa: E402

from .kernel_cases import OUT_TOL, out_tolerance  # noqa: E402
from .test_kernels_attention import (build, decode_inputs, prefill_inputs, query_dtype, run_decode,  # noqa: E402
                                     run_prefill)

LENGTHS = [1, 15, 16, 17, 40, 100]
NEW = [1, 15, 5, 17, 40, 3]


def head_sinks(heads: int, seed: int) -> torch.Tensor:
    """Sinks from -2 to 3: some heads give the sink most of their weight, some little."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(heads, generator=g) * 5 - 2


def sunk_attention(q, k, v, scale, sinks, positions, window=None):
    """q [n, H, D] at `positions`, k/v [t, Hkv, D]: for each head and row, the softmax over the
    scores of the keys it sees and the head's sink, the sink's weight then dropped."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for head in range(q.shape[1]):
        keys, values = k[:, head // group].float(), v[:, head // group].float()
        for row, position in enumerate(positions):
            lo = 0 if window is None else max(0, position - window + 1)
            s = keys[lo:position + 1] @ q[row, head].float() * scale
            p = torch.softmax(torch.cat((s, sinks[head:head + 1])), dim=0)[:-1]
            out[row, head] = p @ values[lo:position + 1]
    return out


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
    q_dtype = query_dtype(cache_dtype)
    tol = out_tolerance(q_dtype, case["v_cache"], case["v_scale"])
    sunk = dict(window=window, sinks=head_sinks(case["heads"], 3))
    q, lens = decode_inputs(case, q_dtype)
    want = run_decode(paged_decode_attention_ref, case, q, lens, **sunk).float()
    for extra in ({}, dict(partition_size=16, launch=DecodeLaunch(tile=16))):  # one split, then several merged
        torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens, **sunk, **extra).float(),
                                   want, **tol)
    qp, qsl, _ = prefill_inputs(case, NEW, q_dtype)
    want = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, **sunk).float()
    for launch in (PrefillLaunch(), PrefillLaunch(rows=16, tile=16)):
        got = run_prefill(paged_prefill_attention, case, qp, qsl, lens, launch=launch, **sunk).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("window", [None, 16])
def test_the_batched_torch_path_matches_the_references_with_sinks(cache_dtype, window):
    """Decodes, decode rows of a few tokens and prompt chunks, mixed."""
    case = build(cache_dtype, lengths=LENGTHS, seed=54)
    q_dtype = query_dtype(cache_dtype)
    extra = dict(scale=case["head_dim"] ** -0.5, k_scale=case["k_scale"], v_scale=case["v_scale"], window=window,
                 sinks=head_sinks(case["heads"], 4))
    tables = (case["k_cache"], case["v_cache"], case["block_tables"])
    for new in (NEW, [1] * len(LENGTHS), [1, 3, 4, 2, 1, 3]):
        q, qsl, lens = prefill_inputs(case, new, q_dtype)
        got = paged_attention_torch(q, *tables, qsl, lens, **extra)
        want = paged_prefill_attention_ref(q, *tables, qsl, lens, **extra)
        torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])


@pytest.mark.parametrize("rows", [1, 3])
def test_cascade_decode_over_shared_prefixes_counts_each_sink_once(rows):
    """The shared prefix and each suffix are attended apart and merged by log-sum-exp; the sink
    joins the merged sum once, not once per part. With `rows` new tokens per sequence, each row
    keeps its own head's sink."""
    from kvctl.kernels.torch_paged import plan_decode

    torch.manual_seed(6)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache = torch.randn(64, block, kv_heads, dim)
    v_cache = torch.randn(64, block, kv_heads, dim)
    shared = list(range(10, 16))
    tables = [shared + [30, 31], shared + [32], [60, 61, 62]]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([7 * 16 + 5, 6 * 16 + 16, 40], dtype=torch.int32)
    assert [g.members for g in plan_decode(table, lens, block).groups] == [[0, 1]]
    sinks = head_sinks(heads, 5)
    q = torch.randn(3 * rows, heads, dim)
    starts = torch.arange(0, 3 * rows + 1, rows, dtype=torch.int32)
    got = paged_attention_torch(q, k_cache, v_cache, table, starts, lens, scale=dim ** -0.5, max_new_tokens=rows,
                                sinks=sinks)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, table, starts, lens, scale=dim ** -0.5, sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


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

"""Capped attention scores (Gemma 2's attn_logit_softcapping): each score s, after the softmax
scale, becomes C * tanh(s / C) before the mask. The references against a hand-written capped
softmax, the Triton kernels (CPU: TRITON_INTERPRET=1) and the batched torch path (cascade over
shared prefixes included) against the references, alone and under a sliding window."""

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
CAP = 1.5  # small enough that most scores of these random heads are bent by it


def capped_attention(q, k, v, scale, cap, positions, window=None):
    """The softmax over cap * tanh(q.k * scale / cap) of the keys each row sees."""
    return attention_by_hand(q, k, v, scale, positions, window, lambda s, _: torch.softmax(cap * torch.tanh(s / cap),
                                                                                          dim=0))


@pytest.mark.parametrize("window", [None, 17])
def test_the_references_cap_each_score_before_the_softmax(window):
    case = build(torch.float32, lengths=LENGTHS, seed=41)
    q, lens = decode_inputs(case, torch.float32)
    q = q * 3  # scores well past the cap
    scale = case["head_dim"] ** -0.5
    decode = run_decode(paged_decode_attention_ref, case, q, lens, window=window, softcap=CAP)
    qp, qsl, _ = prefill_inputs(case, NEW, torch.float32)
    prefill = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, window=window, softcap=CAP)
    for seq, (length, new) in enumerate(zip(LENGTHS, NEW)):
        k = gather_sequence(case["k_cache"], case["block_tables"][seq], length, None)
        v = gather_sequence(case["v_cache"], case["block_tables"][seq], length, None)
        want = capped_attention(q[seq:seq + 1], k, v, scale, CAP, [length - 1], window)
        torch.testing.assert_close(decode[seq:seq + 1], want, atol=1e-5, rtol=1e-5)
        rows = slice(int(qsl[seq]), int(qsl[seq + 1]))
        want = capped_attention(qp[rows], k, v, scale, CAP, list(range(length - new, length)), window)
        torch.testing.assert_close(prefill[rows], want, atol=1e-5, rtol=1e-5)
    uncapped = run_decode(paged_decode_attention_ref, case, q, lens, window=window)
    assert (uncapped - decode).abs().max() > 0.1  # the cap changed what the heads attend to
    # a cap far above every score changes nothing
    torch.testing.assert_close(run_decode(paged_decode_attention_ref, case, q, lens, window=window, softcap=1e6),
                               uncapped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("window", [None, 17])
def test_the_triton_kernels_match_the_references_with_capped_scores(cache_dtype, window):
    case = build(cache_dtype, lengths=LENGTHS, seed=42)
    assert_kernels_match_references(case, query_dtype(cache_dtype), NEW, q_factor=3, window=window, softcap=CAP)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("window", [None, 16])
def test_the_batched_torch_path_matches_the_references_with_capped_scores(cache_dtype, window):
    """Decodes, decode rows of a few tokens and prompt chunks, mixed."""
    case = build(cache_dtype, lengths=LENGTHS, seed=43)
    assert_torch_path_matches_references(case, query_dtype(cache_dtype), (NEW, [1] * len(LENGTHS), [1, 3, 4, 2, 1, 3]),
                                         q_factor=3, window=window, softcap=CAP)


def test_cascade_decode_over_shared_prefixes_caps_every_part_alike():
    """The shared prefix and each suffix are attended apart and merged by log-sum-exp: the cap
    acts on each score alone, so the merge is exact."""
    assert_cascade_matches_the_reference(q_factor=3, softcap=CAP)


@pytest.mark.parametrize("softcap", [0, -1.0, float("inf"), "50", True])
def test_a_cap_is_checked_by_name(softcap):
    case = build(torch.float32, lengths=[20, 40], seed=44)
    q, lens = decode_inputs(case, torch.float32)
    for fn in (paged_decode_attention, paged_decode_attention_ref):
        with pytest.raises(KernelArgumentError) as refused:
            run_decode(fn, case, q, lens, softcap=softcap)
        assert str(refused.value) == f"softcap: must be a positive number or None, got {softcap!r}"
    qp, qsl, _ = prefill_inputs(case, [2, 3], torch.float32)
    for fn in (paged_prefill_attention, paged_prefill_attention_ref, paged_attention_torch):
        with pytest.raises(KernelArgumentError):
            run_prefill(fn, case, qp, qsl, lens, softcap=softcap)

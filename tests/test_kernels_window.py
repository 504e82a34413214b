"""Sliding-window attention (Mistral 7B v0.1, Qwen's `use_sliding_window` layers): a query at
position p sees keys p-W+1..p. The references against scaled_dot_product_attention with that
band mask, the Triton kernels (CPU: TRITON_INTERPRET=1) and the batched torch path against the
references, and the plans that read only the blocks a window reaches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from kvctl.kernels import (DecodeLaunch, KernelArgumentError, PrefillLaunch, paged_attention_torch,  # noqa: E402
                           paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention,
                           paged_prefill_attention_ref, plan_attention)
from kvctl.kernels import torch_paged  # noqa: E402
from kvctl.kernels.decode import gather_sequence  # noqa: E402

from .kernel_cases import DEVICE, out_tolerance  # noqa: E402
from .test_kernels_attention import (assert_torch_path_matches_references, build, decode_inputs,  # noqa: E402
                                     prefill_inputs, query_dtype, run_decode, run_prefill)

# Contexts on every block edge (B = 16) and past them; windows of one token, a block and a bit.
LENGTHS = [1, 15, 16, 17, 40, 100]
NEW = [1, 15, 5, 17, 40, 3]  # prefill rows: whole prompts, prefix hits, a chunk after 97 cached
WINDOWS = [1, 15, 16, 17, 33]


def band(length: int, new: int, window: int) -> torch.Tensor:
    """[new, length] True where row i (position length-new+i) sees key j: the last `window` keys."""
    keys = torch.arange(length, device=DEVICE)[None, :]
    rows = (length - new + torch.arange(new, device=DEVICE))[:, None]
    return (keys <= rows) & (keys > rows - window)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_references_match_sdpa_with_a_band_mask(window):
    case = build(torch.float32, lengths=LENGTHS, seed=31)
    q, lens = decode_inputs(case, torch.float32)
    decode = run_decode(paged_decode_attention_ref, case, q, lens, window=window)
    qp, qsl, _ = prefill_inputs(case, NEW, torch.float32)
    prefill = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, window=window)
    scale = case["head_dim"] ** -0.5
    for seq, (length, new) in enumerate(zip(LENGTHS, NEW)):
        k = gather_sequence(case["k_cache"], case["block_tables"][seq], length, None).transpose(0, 1)[None]
        v = gather_sequence(case["v_cache"], case["block_tables"][seq], length, None).transpose(0, 1)[None]
        one = F.scaled_dot_product_attention(q[seq][None, :, None, :], k, v, attn_mask=band(length, 1, window),
                                             scale=scale, enable_gqa=True)[0, :, 0, :]
        torch.testing.assert_close(decode[seq], one, atol=1e-5, rtol=1e-5)
        rows = qp[int(qsl[seq]):int(qsl[seq + 1])].transpose(0, 1)[None]
        many = F.scaled_dot_product_attention(rows, k, v, attn_mask=band(length, new, window), scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(prefill[int(qsl[seq]):int(qsl[seq + 1])], many, atol=1e-5, rtol=1e-5)
    # a window as long as the context is full attention
    torch.testing.assert_close(run_decode(paged_decode_attention_ref, case, q, lens, window=100),
                               run_decode(paged_decode_attention_ref, case, q, lens))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("window", [1, 17, 33])
def test_the_triton_kernels_match_the_references_under_a_window(cache_dtype, window):
    """Decode with one split and with several (the splits cover the window only), prefill with
    row tiles whose windows start in a later key tile (rows that have seen no key yet)."""
    case = build(cache_dtype, lengths=LENGTHS, seed=32)
    q_dtype = query_dtype(cache_dtype)
    tol = out_tolerance(q_dtype, case["v_cache"], case["v_scale"])
    q, lens = decode_inputs(case, q_dtype)
    want = run_decode(paged_decode_attention_ref, case, q, lens, window=window).float()
    for extra in ({}, dict(partition_size=16, launch=DecodeLaunch(tile=16))):
        torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens, window=window, **extra).float(),
                                   want, **tol)
    qp, qsl, _ = prefill_inputs(case, NEW, q_dtype)
    want = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, window=window).float()
    for launch in (PrefillLaunch(), PrefillLaunch(rows=16, tile=16)):
        got = run_prefill(paged_prefill_attention, case, qp, qsl, lens, window=window, launch=launch).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-attention", "matmul-fallback"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("window", [1, 16, 33])
def test_the_batched_torch_path_matches_the_references_under_a_window(cache_dtype, window, fused, monkeypatch):
    """Decodes, decode rows of a few tokens (speculation) and prompt chunks, mixed."""
    if not fused:
        monkeypatch.setattr(torch_paged, "_FLASH_CPU", None)
    case = build(cache_dtype, lengths=LENGTHS, seed=33)
    assert_torch_path_matches_references(case, query_dtype(cache_dtype), (NEW, [1] * len(LENGTHS), [1, 3, 4, 2, 1, 3]),
                                         window=window)


def test_a_windowed_decode_plan_reads_only_the_blocks_its_window_reaches_and_groups_nothing():
    """Two decodes sharing six prefix blocks: full attention cascades over them; a window of 20
    tokens reads from the block holding each row's first visible key, so a 117-token context
    reads 2 blocks, not 8, and no shared prefix is attended for a window it has left."""
    shared = list(range(10, 16))
    tables = torch.tensor([shared + [30, 31], shared + [32, 0]], dtype=torch.int32)
    lens = torch.tensor([7 * 16 + 5, 6 * 16 + 16], dtype=torch.int32)
    ones = torch.arange(3, dtype=torch.int32)
    full = plan_attention(tables, ones, lens, 16, 1)
    assert [g.members for g in full.decode.groups] == [[0, 1]]
    windowed = plan_attention(tables, ones, lens, 16, 1, window=20)
    assert windowed.window == 20 and windowed.decode.groups == []
    # first visible keys: 117 - 20 = 97 (block 6) and 112 - 20 = 92 (block 5)
    assert windowed.decode.prefix == [6, 5]
    assert windowed.decode.suffix_tables.tolist() == [[30, 31], [15, 32]]
    visible = windowed.decode.suffix_mask[:, 0, 0, :] == 0
    assert [row.nonzero().flatten().tolist() for row in visible] == [list(range(1, 21)), list(range(12, 32))]


def test_a_window_is_checked_by_name_and_a_plan_must_match_it():
    case = build(torch.float32, lengths=[20, 40], seed=34)
    q, lens = decode_inputs(case, torch.float32)
    for fn in (paged_decode_attention, paged_decode_attention_ref):
        with pytest.raises(KernelArgumentError, match=r"^window: must be a positive number of tokens or None, got 0$"):
            run_decode(fn, case, q, lens, window=0)
    ones = torch.arange(3, dtype=torch.int32)
    plan = plan_attention(case["block_tables"], ones, lens, 16, 1)
    with pytest.raises(KernelArgumentError, match=r"^plan: was planned for window None, not 8$"):
        paged_attention_torch(q, case["k_cache"], case["v_cache"], case["block_tables"], ones, lens,
                              scale=0.125, plan=plan, window=8)

"""Experts kept in MXFP4 (kvctl.kernels.mxfp4): the grouped GEMM decodes each weight tile as it
loads it (CPU: TRITON_INTERPRET=1), and computes exactly what it computes on the weights the
blocks dequantise to; kvd's torch path, which dequantises each chosen expert as it runs, the same;
bad blocks and scales are named."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvctl.daemon.model.moe import clamped_swiglu, moe_mlp, moe_mlp_ref  # noqa: E402
from kvctl.kernels import MoeLaunch, align_pairs, grouped_gemm, grouped_gemm_ref  # noqa: E402
from kvctl.kernels.mxfp4 import dequantise_mxfp4  # noqa: E402

from .kernel_cases import DEVICE, refused_alike  # noqa: E402


def random_mxfp4(experts: int, rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of an [experts, rows, columns] weight: every FP4 code (both nibbles, both
    signs of zero), scales 2^-5..2^-2, and one group each at 2^-20 and 2^8."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 126, (experts, rows, columns // 32), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[-1, -1, -1] = 107, 135
    return blocks.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("launch", [MoeLaunch(), MoeLaunch(rows=32, cols=16, depth=32), MoeLaunch(depth=128)],
                         ids=["default", "narrow", "deep"])
def test_an_mxfp4_weight_gives_what_its_dequantised_weight_gives(dtype, launch):
    """Depth tiles of 32, 64 and 128 values (one group, two, four); N not a multiple of the tile;
    an expert no token chose. The kernel's sums are those of the same kernel on the dequantised
    weight, bit for bit: the decoded tile is the dequantised one."""
    g = torch.Generator().manual_seed(3)
    tokens, top_k, num_experts, n, k = 23, 2, 5, 80, 96
    blocks, scales = random_mxfp4(num_experts, n, k, seed=4)
    dense = dequantise_mxfp4(blocks, scales, dtype)
    x = torch.randn(tokens, k, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(num_experts, n, generator=g).to(dtype).to(DEVICE)
    experts = torch.stack([torch.tensor([0, 2, 3, 4])[torch.randperm(4, generator=g)[:top_k]] for _ in range(tokens)])
    experts = experts.to(DEVICE)
    tiles = align_pairs(experts, num_experts, launch.rows)
    quantised = grouped_gemm(x, blocks, tiles, top_k, by_token=True, bias=bias, weight_scales=scales, launch=launch)
    assert torch.equal(quantised, grouped_gemm(x, dense, tiles, top_k, by_token=True, bias=bias, launch=launch))
    reference = grouped_gemm_ref(x, blocks, experts, by_token=True, bias=bias, weight_scales=scales)
    assert torch.equal(reference, grouped_gemm_ref(x, dense, experts, by_token=True, bias=bias))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(quantised, reference, **tol)


def test_kvd_s_experts_in_mxfp4_compute_what_they_dequantise_to_fused_and_looped():
    """gpt-oss's routed MLP, its experts kept in MXFP4: the grouped GEMMs (decoding tiles) and the
    expert-by-expert torch path (dequantising each chosen expert) both give what the dequantised
    experts give, exactly; and they agree with the every-expert reference."""
    g = torch.Generator().manual_seed(11)
    tokens, hidden, inter, num_experts, top_k = 19, 64, 96, 6, 2
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    router = torch.randn(num_experts, hidden, generator=g).to(DEVICE)
    gate_up, gate_up_scales = random_mxfp4(num_experts, 2 * inter, hidden, seed=12)
    down, down_scales = random_mxfp4(num_experts, hidden, inter, seed=13)
    glu = clamped_swiglu(limit=7.0, alpha=1.702)
    biases = dict(router_bias=torch.randn(num_experts, generator=g).to(DEVICE),
                  gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g).to(DEVICE),
                  down_bias=torch.randn(num_experts, hidden, generator=g).to(DEVICE))
    kept = dict(gate_up_scales=gate_up_scales, down_scales=down_scales)
    dense = (dequantise_mxfp4(gate_up, gate_up_scales, torch.float32),
             dequantise_mxfp4(down, down_scales, torch.float32))
    for fused in (True, False):
        ours = moe_mlp(x, router, gate_up, down, top_k, True, glu, **biases, fused=fused, **kept)
        assert torch.equal(ours, moe_mlp(x, router, *dense, top_k, True, glu, **biases, fused=fused))
    reference = moe_mlp_ref(x, router, gate_up, down, top_k, True, glu, **biases, **kept)
    assert torch.equal(reference, moe_mlp_ref(x, router, *dense, top_k, True, glu, **biases))
    torch.testing.assert_close(moe_mlp(x, router, gate_up, down, top_k, True, glu, **biases, **kept), reference,
                               atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(blocks=lambda b: b[..., :8].contiguous()), "weight: MXFP4 blocks end in groups of 16 bytes, got shape "
                                                     "(3, 40, 2, 8)"),
    (dict(blocks=lambda b: b.to(torch.int16)), "weight: expected dtype uint8, got int16"),
    (dict(scales=lambda s: s[:, :20].contiguous()), "weight_scales: expected shape (3, 40, 2), one per group of 32 "
                                                    "values, got (3, 20, 2)"),
    (dict(scales=lambda s: s.float()), "weight_scales: expected dtype uint8, got float32"),
    (dict(x=lambda x: x[:, :32].contiguous()), "weight: takes 64 input features, x has 32"),
], ids=["group", "blocks-dtype", "scales-shape", "scales-dtype", "features"])
def test_mxfp4_arguments_are_checked_by_name(change, message):
    blocks, scales = random_mxfp4(3, 40, 64, seed=5)
    x = torch.randn(4, 64).to(DEVICE)
    experts = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], device=DEVICE)
    blocks = change.get("blocks", lambda b: b)(blocks)
    scales = change.get("scales", lambda s: s)(scales)
    x = change.get("x", lambda x: x)(x)
    tiles = align_pairs(experts, 3, MoeLaunch().rows)
    refused_alike((lambda: grouped_gemm(x, blocks, tiles, 2, by_token=True, weight_scales=scales),
                   lambda: grouped_gemm_ref(x, blocks, experts, by_token=True, weight_scales=scales)), message)

"""The grouped GEMM of a mixture of experts (kvctl.kernels.moe): pairs aligned to experts'
tiles exactly as stated, the Triton kernel (CPU: TRITON_INTERPRET=1) against its pair-by-pair
reference, and the whole routed MLP through it against kvd's expert-by-expert torch path
(Mixtral's SiLU and gpt-oss's biased, clamped SwiGLU), with experts no token chose."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvctl.daemon.model.moe import clamped_swiglu, gated, moe_mlp  # noqa: E402
from kvctl.kernels import KernelArgumentError, MoeLaunch, align_pairs, grouped_gemm, grouped_gemm_ref  # noqa: E402

from .kernel_cases import DEVICE, refused_alike  # noqa: E402


def test_pairs_are_sorted_by_expert_and_each_run_padded_to_whole_tiles():
    # 4 tokens, 2 slots each: pair p = token * 2 + slot
    experts = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 2]], device=DEVICE)
    tiles = align_pairs(experts, num_experts=5, rows=2)
    sentinel = 8  # the pair count marks a padded row
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5, 6, 7 (padded to 6); expert 3: pair 3 (padded to 2);
    # the grid's 7 tiles (min(pairs, ceil((pairs + E·(rows - 1)) / rows)), from shapes alone) leave two
    # tiles past the last run: they belong to no expert (5) and exit at once
    assert tiles.order.tolist() == [1, 4, 0, 2, 5, 6, 7, sentinel, 3, sentinel] + [sentinel] * 4
    assert tiles.expert.tolist() == [0, 2, 2, 2, 3, 5, 5]
    assert (tiles.pairs, tiles.tiles) == (8, 7)
    wide = align_pairs(torch.tensor([[1], [1], [1]], device=DEVICE), num_experts=5, rows=16)
    assert (wide.tiles, wide.expert.tolist(), wide.order.tolist()) == (3, [1, 5, 5], [0, 1, 2] + [3] * 45)
    spread = align_pairs(torch.tensor([[0], [1], [2], [3]], device=DEVICE), num_experts=8, rows=16)
    assert spread.expert.tolist() == [0, 1, 2, 3] and spread.order.view(4, 16)[:, 0].tolist() == [0, 1, 2, 3]


def random_case(tokens: int, top_k: int, num_experts: int, n: int, k: int, dtype, seed: int, unused=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    weight = (torch.randn(num_experts, n, k, generator=g) * 0.2).to(dtype)
    bias = torch.randn(num_experts, n, generator=g).to(dtype)
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    experts = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    scale = torch.rand(tokens * top_k, generator=g)
    return [t.to(DEVICE) for t in (x, weight, bias, experts, scale)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("launch", [MoeLaunch(), MoeLaunch(rows=32, cols=16, depth=32)], ids=["default", "narrow"])
def test_the_grouped_gemm_matches_its_reference(dtype, launch):
    """K and N not multiples of the tile; experts 1 and 4 chosen by no token; a lone token."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for tokens, top_k in ((37, 2), (1, 4)):
        x, weight, bias, experts, scale = random_case(tokens, top_k, 6, 80, 72, dtype, seed=tokens, unused=(1, 4))
        tiles = align_pairs(experts, 6, launch.rows)
        first = grouped_gemm(x, weight, tiles, top_k, by_token=True, bias=bias, launch=launch)
        torch.testing.assert_close(first, grouped_gemm_ref(x, weight, experts, by_token=True, bias=bias), **tol)
        pair_rows = torch.randn(tokens * top_k, 72).to(dtype).to(DEVICE)
        second = grouped_gemm(pair_rows, weight, tiles, top_k, by_token=False, scale=scale, launch=launch,
                              out_dtype=torch.float32)
        assert second.dtype == torch.float32
        torch.testing.assert_close(second, grouped_gemm_ref(pair_rows, weight, experts, by_token=False,
                                                            scale=scale).float(), **tol)


@pytest.mark.parametrize("kind", ["mixtral", "gpt-oss"])
def test_the_routed_mlp_through_the_kernel_equals_kvds_expert_by_expert_path(kind):
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, num_experts, top_k = 29, 64, 48, 8, 2
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(num_experts, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.3
    router[5] = -100.0  # expert 5 wins no token
    if kind == "gpt-oss":
        glu = clamped_swiglu(limit=1.0, alpha=1.702)
        biases = dict(router_bias=torch.randn(num_experts, generator=g),
                      gate_up_bias=torch.randn(num_experts, 2 * inter, generator=g),
                      down_bias=torch.randn(num_experts, hidden, generator=g))
    else:
        glu, biases = gated(torch.nn.functional.silu), {}
    args = [t.to(DEVICE) for t in (x, router, gate_up, down)]
    biases = {name: t.to(DEVICE) for name, t in biases.items()}
    fused = moe_mlp(*args, top_k, True, glu, **biases, fused=True)
    looped = moe_mlp(*args, top_k, True, glu, **biases, fused=False)
    torch.testing.assert_close(fused, looped, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(weight=lambda w: w[:, :, :8].contiguous()), "weight: takes 8 input features, x has 72"),
    (dict(weight=lambda w: w.to(torch.float64)), "weight: expected dtype float32, got float64"),
    (dict(bias=lambda b: b[:3]), "bias: expected shape (6, 80), one row per expert, got (3, 80)"),
    (dict(x=lambda x: x.t().contiguous().t()), "x: must be contiguous, got strides (1, 5)"),
], ids=["features", "dtype", "bias", "strides"])
def test_arguments_are_checked_by_name(change, message):
    x, weight, bias, experts, _ = random_case(5, 2, 6, 80, 72, torch.float32, seed=1)
    x = change.get("x", lambda x: x)(x)
    weight = change.get("weight", lambda w: w)(weight)
    bias = change.get("bias", lambda b: b)(bias)
    tiles = align_pairs(experts, 6, MoeLaunch().rows)
    refused_alike((lambda: grouped_gemm(x, weight, tiles, 2, by_token=True, bias=bias),
                   lambda: grouped_gemm_ref(x, weight, experts, by_token=True, bias=bias)), message)


def test_tiles_rows_and_weights_that_do_not_fit_the_launch_are_named():
    x, weight, bias, experts, scale = random_case(5, 2, 6, 80, 72, torch.float32, seed=2)
    tiles = align_pairs(experts, 6, 16)
    for call, message in (
            (lambda: grouped_gemm(x, weight, tiles, 2, by_token=True, launch=MoeLaunch(rows=32)),
             "tiles: aligned to tiles of 16 rows, the launch takes 32: align_pairs(experts, E, launch.rows)"),
            (lambda: grouped_gemm(x[:4], weight, tiles, 2, by_token=True),
             "x: 4 rows for 10 pairs of 2 slots (one row per token)"),
            (lambda: grouped_gemm(x, weight, tiles, 2, by_token=False),
             "x: 5 rows for 10 pairs of 2 slots (one row per pair)"),
            (lambda: grouped_gemm(torch.zeros(10, 72, device=DEVICE), weight, tiles, 2, by_token=False,
                                  scale=scale[:3]), "scale: 3 weights for 10 pairs")):
        with pytest.raises(KernelArgumentError) as refused:
            call()
        assert str(refused.value) == message

"""moe_experts: a mixture of experts' MLP as two grouped GEMMs (Triton), for GPUs.

A MoE layer sends each token to its top k experts. Run one expert at a time, a step costs a pair
of small GEMMs for every expert some token chose, and knowing which ones costs the host a device
sync (vLLM's and SGLang's fused MoE avoid both the same way, with their own kernels). Here the
(token, slot) pairs are sorted by expert on the device and each expert's run padded to whole
tiles of `rows` (`align_pairs`, plain torch, no sync); one launch then multiplies every tile by
its own expert's weights:

    gate_up = grouped_gemm(x rows of each pair, experts' gate_up)      [pairs, 2·I]  (+ bias)
    act     = glu(gate, up)                                             [pairs, I]    (torch)
    out     = grouped_gemm(act, experts' down) · routing weight         [pairs, hidden] (+ bias)
    y       = out summed over each token's k slots                      [tokens, hidden]

The activation stays a torch callable between the two launches, so any gated form (SiLU, GELU,
gpt-oss's clamped SwiGLU) runs unchanged. Tiles past the last expert's run exit at once: the
grid is sized from shapes alone (at most one tile per pair), never from the device's counts.

Layouts::

    x          [tokens, K]             rows (the first GEMM) or pairs' rows (the second)
    weight     [E, N, K]               each expert's projection, as F.linear takes it
    bias       [E, N] or None
    experts    [tokens, k] int64       each token's experts (route's output)
    out        [tokens · k, N]         pair p = token · k + slot

A weight may be kept in MXFP4 (gpt-oss's experts, kvctl.kernels.mxfp4): `weight` is then its
blocks [E, N, K/32, 16] uint8 and `weight_scales` its scales [E, N, K/32] uint8, and the kernel
decodes each tile as it loads it (`mxfp4_tile`), so a step reads 4.25 bits a weight, not 16.

`grouped_gemm_ref` is its plain-torch twin: each pair's row times its expert's weight.
"""

from dataclasses import dataclass

import torch

from ._triton import interpreting, tl, triton
from .checks import check, check_device, check_tensor
from .launch import TritonLaunch, check_tile
from .mxfp4 import GROUP, dequantise_mxfp4, mxfp4_tile

MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoeLaunch(TritonLaunch):
    """How the grouped GEMM is launched: `rows` pairs per tile (each tile is one expert's),
    `cols` output features and `depth` input features per step. Not yet timed on a GPU: the
    defaults are a decode-sized guess (few pairs per expert), not a sweep's choice."""

    rows: int = 16
    cols: int = 64
    depth: int = 64
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "depth"):
            check_tile(name, getattr(self, name))
        self.check_warps_and_stages()


DEFAULT_MOE_LAUNCH = MoeLaunch()


@dataclass(frozen=True)
class PairTiles:
    """The pairs sorted by expert, each expert's run padded to whole tiles (`align_pairs`).

    order    [tiles · rows] int32   pair of each tile row, or `pairs` (the count) where padded
    expert   [tiles] int32          expert of each tile, or E for a tile past the last run
    tiles    tiles the grid covers: at most one per pair, and no more than every run padded needs
    """

    order: torch.Tensor
    expert: torch.Tensor
    pairs: int
    tiles: int


def align_pairs(experts: torch.Tensor, num_experts: int, rows: int) -> PairTiles:
    """Sort `experts`' (token, slot) pairs by expert and pad each expert's run to a multiple of
    `rows`, on the device and without reading anything back to the host."""
    flat = experts.flatten()
    pairs = flat.numel()
    device = flat.device
    # (scatter_add, not bincount: bincount reads its input's maximum back to the host to size its output)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + rows - 1) // rows * rows
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within each
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    tiles = min(pairs, -(-(pairs + num_experts * (rows - 1)) // rows))  # a bound from shapes alone
    slots = torch.full((tiles * rows,), pairs, dtype=torch.int32, device=device)
    slots[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=device) * rows
    expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)  # E past the last run
    return PairTiles(slots, expert, pairs, tiles)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # [rows of x, K]
    w_ptr,  # [E, N, K], or MXFP4 blocks [E, N, K/2] bytes
    w_scale_ptr,  # [E, N, K/32] uint8 (MXFP4 only)
    bias_ptr,  # [E, N] (BIAS only)
    scale_ptr,  # [pairs] float32 (SCALE only): each pair's routing weight
    out_ptr,  # [pairs, N]
    order_ptr,  # [tiles * ROWS] int32
    expert_ptr,  # [tiles] int32
    pairs, num_experts, N, K, top_k,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DEPTH: tl.constexpr,
    BY_TOKEN: tl.constexpr,  # x's rows are tokens (pair // top_k), not pairs
    BIAS: tl.constexpr,
    SCALE: tl.constexpr,
    MXFP4: tl.constexpr,  # the weight is kept in MXFP4: each tile decoded as it loads
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(expert_ptr + tile)
    if expert >= num_experts:  # past the last expert's run
        return
    pair = tl.load(order_ptr + tile * ROWS + tl.arange(0, ROWS))
    row_mask = pair < pairs
    if BY_TOKEN:
        row = pair // top_k
    else:
        row = pair
    cols = col_tile * COLS + tl.arange(0, COLS)
    col_mask = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = w_scale_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for start in range(0, K, DEPTH):
        depth = start + tl.arange(0, DEPTH)
        depth_mask = depth < K
        a = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + depth[None, :],
                    mask=row_mask[:, None] & depth_mask[None, :], other=0.0)
        if MXFP4:
            b = mxfp4_tile(w_base, s_base, depth, cols, stride_wn, stride_sn,
                           depth_mask[:, None] & col_mask[None, :]).to(x_ptr.dtype.element_ty)
        else:
            b = tl.load(w_base + cols.to(tl.int64)[None, :] * stride_wn + depth[:, None],
                        mask=depth_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + pair, mask=row_mask, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _check(x, weight, bias, top_k: int, weight_scales=None) -> None:
    check_tensor("x", x, ndim=2, dtypes=MOE_DTYPES)
    if weight_scales is None:
        check_tensor("weight", weight, ndim=3, dtypes=(x.dtype,))
        features = weight.shape[2]
    else:  # MXFP4: blocks and scales
        check_tensor("weight", weight, ndim=4, dtypes=(torch.uint8,))
        check_tensor("weight_scales", weight_scales, ndim=3, dtypes=(torch.uint8,))
        if weight.shape[3] != GROUP // 2:
            check(False, "weight", f"MXFP4 blocks end in groups of {GROUP // 2} bytes, got shape {tuple(weight.shape)}")
        if tuple(weight_scales.shape) != tuple(weight.shape[:3]):
            check(False, "weight_scales", f"expected shape {tuple(weight.shape[:3])}, one per group of {GROUP} "
                                          f"values, got {tuple(weight_scales.shape)}")
        features = weight.shape[2] * GROUP
    if features != x.shape[1]:
        check(False, "weight", f"takes {features} input features, x has {x.shape[1]}")
    if bias is not None:
        check_tensor("bias", bias, ndim=2, dtypes=(x.dtype,))
        if tuple(bias.shape) != tuple(weight.shape[:2]):
            check(False, "bias", f"expected shape {tuple(weight.shape[:2])}, one row per expert, got "
                                 f"{tuple(bias.shape)}")
    check(top_k >= 1, "top_k", f"must be at least 1, got {top_k}")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: PairTiles, top_k: int, *,
                 by_token: bool, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 weight_scales: torch.Tensor | None = None, launch: MoeLaunch = DEFAULT_MOE_LAUNCH,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[p] = weight[e(p)] @ x[r(p)] (+ bias[e(p)]) (· scale[p]) for every pair p (Triton):
    e(p) the pair's expert; r(p) its token (`by_token`, x [tokens, K]) or the pair itself
    (x [pairs, K]). `tiles` from `align_pairs(experts, E, launch.rows)`; `scale` [pairs]
    float32; `out_dtype` (default x's): what the float32 sums are stored as. `weight_scales`:
    the weight is kept in MXFP4, `weight` its blocks (see the module docstring)."""
    _check(x, weight, bias, top_k, weight_scales)
    if tiles.order.numel() != tiles.tiles * launch.rows:
        check(False, "tiles", f"aligned to tiles of {tiles.order.numel() // max(tiles.tiles, 1)} rows, the launch "
                              f"takes {launch.rows}: align_pairs(experts, E, launch.rows)")
    if x.shape[0] * (top_k if by_token else 1) != tiles.pairs:
        check(False, "x", f"{x.shape[0]} rows for {tiles.pairs} pairs of {top_k} slots"
                          + (" (one row per token)" if by_token else " (one row per pair)"))
    if scale is not None:
        check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,))
        if scale.shape[0] != tiles.pairs:
            check(False, "scale", f"{scale.shape[0]} weights for {tiles.pairs} pairs")
    check_device({"x": x, "weight": weight, "weight_scales": weight_scales, "bias": bias, "scale": scale,
                  "order": tiles.order})
    (num_experts, n), k = weight.shape[:2], x.shape[1]
    out = torch.empty((tiles.pairs, n), dtype=out_dtype or x.dtype, device=x.device)
    if tiles.pairs == 0:
        return out
    dot_f32 = x.dtype == torch.float32 or interpreting()
    a = x if not interpreting() or x.dtype == torch.float32 else x.float()  # the interpreter's dots in float32
    w = weight if a.dtype == weight.dtype or weight_scales is not None else weight.float()
    w_scales = weight_scales if weight_scales is not None else w
    grid = (tiles.tiles, -(-n // launch.cols))
    _grouped_gemm_kernel[grid](
        a, w, w_scales, bias if bias is not None else w, scale if scale is not None else tiles.order, out,
        tiles.order, tiles.expert, tiles.pairs, num_experts, n, k, top_k,
        a.stride(0), w.stride(0), w.stride(1), w_scales.stride(0), w_scales.stride(1), out.stride(0),
        ROWS=launch.rows, COLS=launch.cols, DEPTH=launch.depth, BY_TOKEN=by_token, BIAS=bias is not None,
        SCALE=scale is not None, MXFP4=weight_scales is not None, PRECISION="ieee" if dot_f32 else "tf32",
        **launch.compile_options())
    return out


def grouped_gemm_ref(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, *, by_token: bool,
                     bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                     weight_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of `grouped_gemm`, pair by pair (slow, plain): float32 sums, cast back
    (an MXFP4 weight dequantised to x's dtype first, as the kernel decodes it)."""
    top_k = experts.shape[1]
    _check(x, weight, bias, top_k, weight_scales)
    flat = experts.flatten()
    out = torch.empty((flat.numel(), weight.shape[1]), dtype=x.dtype, device=x.device)
    for p, e in enumerate(flat.tolist()):
        w = weight[e] if weight_scales is None else dequantise_mxfp4(weight[e], weight_scales[e], x.dtype)
        y = w.float() @ x[p // top_k if by_token else p].float()
        if bias is not None:
            y = y + bias[e].float()
        if scale is not None:
            y = y * scale[p]
        out[p] = y.to(x.dtype)
    return out


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, glu, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, launch: MoeLaunch = DEFAULT_MOE_LAUNCH,
                gate_up_scales: torch.Tensor | None = None, down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each row's chosen experts of weight · down(glu(gate, up)) (see the module
    docstring): x [T, hidden], weights and experts [T, k] (the router's), gate_up [E, 2·I, hidden]
    (gate rows, then up rows), down [E, hidden, I], biases [E, 2·I] and [E, hidden] or None;
    `glu(gate, up)` in torch between the two launches. The k slots of a row are summed in float32.
    `gate_up_scales`, `down_scales`: those weights are kept in MXFP4 (their blocks given)."""
    tokens, top_k = experts.shape
    tiles = align_pairs(experts, gate_up.shape[0], launch.rows)
    gate, up = grouped_gemm(x, gate_up, tiles, top_k, by_token=True, bias=gate_up_bias, launch=launch,
                            weight_scales=gate_up_scales).chunk(2, dim=-1)
    act = glu(gate, up).contiguous()
    out = grouped_gemm(act, down, tiles, top_k, by_token=False, bias=down_bias, launch=launch,
                       scale=weights.reshape(-1).float(), out_dtype=torch.float32, weight_scales=down_scales)
    return out.view(tokens, top_k, -1).sum(1).to(x.dtype)


__all__ = ["DEFAULT_MOE_LAUNCH", "MoeLaunch", "PairTiles", "align_pairs", "grouped_gemm", "grouped_gemm_ref",
           "moe_experts"]

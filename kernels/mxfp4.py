"""MXFP4 weights (the OCP microscaling format gpt-oss's checkpoints store their experts in): the
torch dequantisation, and the Triton tile loader the grouped GEMM reads them through.

Each row of a weight is cut into groups of 32 values. A group is 16 bytes of `blocks`, two FP4
(E2M1) values a byte, the low nibble first, and one byte of `scales`, a power of two stored with
a bias of 127 (E8M0). Value = FP4_E2M1[nibble] · 2^(scale − 127).

    blocks  [..., groups, 16] uint8
    scales  [..., groups]     uint8
    ->      [..., groups · 32] in the dtype asked for

A weight kept in MXFP4 takes 4.25 bits a value (17 bytes per 32), against 16 in bfloat16.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

# the 16 values of a 4-bit E2M1 number: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values sharing one scale
SCALE_BIAS = 127
DEQUANTISE_CHUNK = 1 << 22  # values dequantised at a time (16 MiB of float32)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError naming what is wrong when `blocks` and `scales` do not describe one weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks must end in groups of {GROUP // 2} bytes, got shape {tuple(blocks.shape)}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}: "
                         f"one scale per group of {GROUP}")


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight `blocks` and `scales` hold, in `dtype`, on their device (`check_mxfp4`'s
    ValueError when the two do not describe one weight). A byte is looked up as its two values at
    once, and the rows are done a few million values at a time: the float32 values never take
    more than 16 MiB beside the result, however large the weight."""
    check_mxfp4(blocks, scales)
    out = torch.empty((*blocks.shape[:-1], GROUP), dtype=dtype, device=blocks.device)
    if out.numel() == 0:  # no rows, or rows of no groups
        return out.flatten(-2)
    pairs = byte_values(blocks.device)
    rows_b, rows_s = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    rows_out = out.view(-1, *out.shape[-2:])
    step = max(1, DEQUANTISE_CHUNK // (blocks.shape[-2] * GROUP))
    for start in range(0, rows_b.shape[0], step):
        values = pairs[rows_b[start:start + step].int()].flatten(-2)  # [rows, G, 32]
        exponents = rows_s[start:start + step].float() - SCALE_BIAS
        rows_out[start:start + step] = values.mul_(torch.exp2(exponents)[..., None])  # exact: powers of two
    return out.flatten(-2)


def byte_values(device) -> torch.Tensor:
    """[256, 2] float32: the two FP4 values of each byte, the low nibble's first."""
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1)


@triton.jit
def mxfp4_tile(blocks_row_ptr, scales_row_ptr, depth, cols, stride_bn, stride_sn, mask):
    """A [DEPTH, COLS] tile of a weight kept in MXFP4, as float32: value (depth, col) of rows
    `cols`, their bytes at blocks_row_ptr + col·stride_bn (K/2 a row) and their scales at
    scales_row_ptr + col·stride_sn (K/32 a row). Each FP4 code is decoded arithmetically
    (sign, two exponent bits, one mantissa bit) and scaled by 2^(scale − 127): exact in float32."""
    byte = tl.load(blocks_row_ptr + cols.to(tl.int64)[None, :] * stride_bn + (depth // 2)[:, None],
                   mask=mask, other=0).to(tl.int32)
    code = (byte >> ((depth % 2) * 4)[:, None]) & 0xF
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    value = tl.where((code & 8) != 0, -magnitude, magnitude)
    scale = tl.load(scales_row_ptr + cols.to(tl.int64)[None, :] * stride_sn + (depth // 32)[:, None],
                    mask=mask, other=127).to(tl.float32)
    return value * tl.exp2(scale - 127.0)


__all__ = ["FP4_E2M1", "GROUP", "SCALE_BIAS", "byte_values", "check_mxfp4", "dequantise_mxfp4", "mxfp4_tile"]

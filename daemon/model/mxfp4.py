"""MXFP4 weights (the OCP microscaling format gpt-oss's checkpoints store their experts in),
dequantised as they load.

Each row of a weight is cut into groups of 32 values. A group is 16 bytes of `blocks`, two FP4
(E2M1) values a byte, the low nibble first, and one byte of `scales`, a power of two stored with
a bias of 127 (E8M0). Value = FP4_E2M1[nibble] · 2^(scale − 127).

    blocks  [..., groups, 16] uint8
    scales  [..., groups]     uint8
    ->      [..., groups · 32] in the dtype asked for
"""

from __future__ import annotations

import torch

# the 16 values of a 4-bit E2M1 number: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values sharing one scale
SCALE_BIAS = 127


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight `blocks` and `scales` hold, in `dtype`, on their device; ValueError naming the
    argument when the two do not describe one weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks must end in groups of {GROUP // 2} bytes, got shape {tuple(blocks.shape)}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}: "
                         f"one scale per group of {GROUP}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).int()], table[(blocks >> 4).int()]), dim=-1)  # [..., G, 16, 2]
    exponents = scales.int() - SCALE_BIAS
    values = torch.ldexp(values.flatten(-2), exponents[..., None].float())  # [..., G, 32], exact in float32
    return values.flatten(-2).to(dtype)

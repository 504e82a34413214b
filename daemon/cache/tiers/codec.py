"""How a block's K/V is stored on disk and in Redis: as the device holds it, or compressed.

    none      the device cache's bytes as they are (lossless; the default)
    int8      one byte a value and one float32 scale a (token, KV head) row: scale = max |row| / 127,
              value / scale rounded half away from zero (kernels/formats.py's int8 rule)
    fp8_e4m3  one byte a value (torch.float8_e4m3fn) and one float32 scale a row: max |row| / 448

LMCache calls this "compress". A compressed block is a little over half of a float16 or bfloat16
block (head_dim 64: 0.53; 128: 0.52) and a little over a quarter of a float32 one, so a tier's
bytes hold about twice the blocks and a restore reads half the bytes. It is lossy, with a bound
per value (`error_bound`): int8 is off by at most max |row| / 254, fp8_e4m3 by 1/16 of the value
(1/1024 of the row's scale near zero). The host tier always holds the device's own bytes.

Only caches stored in float32, float16 or bfloat16 are compressed: a quantised device cache
(`cache_dtype`) already stores a byte a value, and is written as it is. So is a group holding a
value that is not finite (the scale would be too).

A compressed body is all rows' float32 scales, then all values, [layers, K|V, block, heads, dim]
in C order; the payload header names the codec (payload.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvctl.kernels.formats import QUANT_MAX, to_format
from kvctl.policies.tiering import TIER_CODECS

CODEC_CODES = {"none": 0, "int8": 1, "fp8_e4m3": 2}  # the byte in a payload header
CODEC_NAMES = {code: name for name, code in CODEC_CODES.items()}
_FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
COMPRESSIBLE = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_BYTES = 4


def check_codec(codec: str) -> str:
    if codec not in TIER_CODECS:
        raise ValueError(f"tier_compress: unknown value {codec!r}; use {', '.join(TIER_CODECS)}")
    return codec


def unsupported(layer_dtypes: Sequence[torch.dtype], codec: str) -> str | None:
    """Why blocks of these layer dtypes cannot be stored with `codec`, or None when they can."""
    if codec == "none":
        return None
    dtypes = set(layer_dtypes)
    if len(dtypes) == 1 and next(iter(dtypes)) in COMPRESSIBLE:
        return None
    names = ",".join(sorted({str(d).replace("torch.", "") for d in dtypes}))
    return f"the device cache is {names}: only float32, float16 and bfloat16 caches are compressed"


def rows(num_layers: int, block_size: int, num_kv_heads: int) -> int:
    """Scaled rows in one block: one per layer, K or V, token and KV head."""
    return num_layers * 2 * block_size * num_kv_heads


def body_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one compressed block's body (either codec): its scales and a byte a value."""
    n = rows(num_layers, block_size, num_kv_heads)
    return n * _SCALE_BYTES + n * head_dim


def compress(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], codec: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A group's (K [n, block, heads, dim], V) per layer -> (scales, values) as bytes, one row of
    each per block ([n, rows × 4] and [n, rows × dim], uint8), or None when a value is not finite."""
    fmt = _FORMATS[codec]
    whole = torch.stack([torch.stack((k.float(), v.float()), dim=1) for k, v in layers], dim=1)  # [n, L, 2, B, H, D]
    amax = whole.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        return None
    scales = torch.where(amax > 0, amax / QUANT_MAX[fmt], torch.ones_like(amax))
    values = to_format(whole / scales.unsqueeze(-1), fmt)
    n = whole.shape[0]
    return scales.reshape(n, -1).view(torch.uint8), values.view(torch.uint8).reshape(n, -1)


def decompress(body: torch.Tensor, codec: str, dtype: torch.dtype, num_layers: int, block_size: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """One block's compressed body (uint8) -> its K/V [layers, 2, block, heads, dim] in `dtype`."""
    n = rows(num_layers, block_size, num_kv_heads)
    shape = (num_layers, 2, block_size, num_kv_heads)
    scales = body[:n * _SCALE_BYTES].view(torch.float32).view(shape)
    values = body[n * _SCALE_BYTES:].view(_FORMATS[codec]).view(*shape, head_dim)
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def error_bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The most each value of x [..., dim] may move through `codec` and back (before rounding to
    the cache dtype): what the tests hold compression to."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    if codec == "int8":
        return amax / 254
    scale = amax / QUANT_MAX[torch.float8_e4m3fn]
    return torch.maximum(x.float().abs() / 16, scale / 1024)

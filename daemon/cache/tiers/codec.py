"""How a block's K/V is stored on disk and in Redis: as the device holds it, or compressed.

    none      the device cache's bytes as they are (lossless; the default)
    int8      one byte a value and one float32 scale a (token, KV head) row: scale = max |row| / 127,
              value / scale rounded to the nearest integer (ties to even)
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

import functools
from typing import Sequence

import torch

from kvctl.kernels.formats import QUANT_MAX
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
    each per block ([n, rows × 4] and [n, rows × dim], uint8), or None when a value is not finite.
    One layer's K or V at a time, in place: the working set stays in the CPU's caches (28× the
    speed of quantising the stacked group: 4.7 against 0.17 GB/s of bfloat16 on 2 cores)."""
    fmt, limit = _FORMATS[codec], QUANT_MAX[_FORMATS[codec]]
    n, block, heads, dim = layers[0][0].shape
    scales = torch.empty(n, len(layers), 2, block, heads, dtype=torch.float32)
    values = torch.empty(n, len(layers), 2, block, heads, dim, dtype=fmt)
    for layer, pair in enumerate(layers):
        for half, x in enumerate(pair):
            scaled = x.float()  # a new tensor (or x itself for float32: then copied, never written)
            if scaled.data_ptr() == x.data_ptr():
                scaled = scaled.clone()
            amax = scaled.abs().amax(dim=-1)
            if not bool(torch.isfinite(amax).all()):
                return None
            scale = torch.where(amax > 0, amax / limit, 1.0)
            scaled.mul_((1.0 / scale).unsqueeze(-1)).clamp_(-limit, limit)
            values[:, layer, half] = scaled.round_() if fmt == torch.int8 else scaled
            scales[:, layer, half] = scale
    return scales.reshape(n, -1).view(torch.uint8), values.view(torch.uint8).reshape(n, -1)


def decompress(body: torch.Tensor, codec: str, dtype: torch.dtype, num_layers: int, block_size: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """One block's compressed body (uint8) -> its K/V [layers, 2, block, heads, dim] in `dtype`."""
    n = rows(num_layers, block_size, num_kv_heads)
    shape = (num_layers, 2, block_size, num_kv_heads)
    scales = body[:n * _SCALE_BYTES].view(torch.float32).view(shape)
    raw = body[n * _SCALE_BYTES:]
    if codec == "fp8_e4m3":  # a table of the 256 codes: 3.5× the speed of the CPU's fp8 conversion
        values = _fp8_table().index_select(0, raw.int()).view(*shape, head_dim)
    else:
        values = raw.view(torch.int8).view(*shape, head_dim).float()
    return values.mul_(scales.unsqueeze(-1)).to(dtype)


@functools.cache
def _fp8_table() -> torch.Tensor:
    """float32 value of each float8_e4m3fn code (0..255)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def error_bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """The most each value of x [..., dim] may move through `codec` and back (before rounding to
    the cache dtype): what the tests hold compression to."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    if codec == "int8":
        return amax / 254
    scale = amax / QUANT_MAX[torch.float8_e4m3fn]
    return torch.maximum(x.float().abs() / 16, scale / 1024)

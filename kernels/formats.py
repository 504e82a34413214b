"""Cache storage formats and their quantisation rules (plain torch; the kernels follow them).

Quantised formats store x / scale, with one float32 scale per KV head:

    fp8_e4m3  torch.float8_e4m3fn   clamp to +-448, then round to the format
    fp8_e5m2  torch.float8_e5m2     clamp to +-57344, then round to the format
    int8      torch.int8            round half away from zero, clamp to +-127 (symmetric)

Dequantisation is q.float() * scale. The kernels dequantise tiles in registers;
nothing materialises a dequantised copy of the cache.
"""

import torch

CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
QUANTISED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.int8: 127.0,
}


def cache_dtype(name: str) -> torch.dtype:
    """torch dtype for a cache format name; unknown names raise ValueError naming them."""
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"cache_dtype: unknown value {name!r}; choose one of "
                         f"{', '.join(CACHE_DTYPES)}") from None


def is_quantised(dtype: torch.dtype) -> bool:
    return dtype in QUANTISED_DTYPES


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """The int8 rounding rule, identical in the kernels: ties go away from zero."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def quantise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] -> dtype, dividing by scale [num_kv_heads]."""
    scaled = x.float() / scale.float()[:, None]
    limit = QUANT_MAX[dtype]
    if dtype == torch.int8:
        return round_half_away(scaled).clamp(-limit, limit).to(torch.int8)
    return scaled.clamp(-limit, limit).to(dtype)


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., num_kv_heads, head_dim] -> float32."""
    return q.float() * scale.float()[:, None]


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Convert new K or V to the cache format (quantising when the format is quantised)."""
    if is_quantised(dtype):
        return quantise(x, scale, dtype)
    return x.to(dtype)


def from_cache(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Read cache values back as float32."""
    if is_quantised(x.dtype):
        return dequantise(x, scale)
    return x.float()


def absmax_scales(x: torch.Tensor, dtype: torch.dtype, margin: float = 1.0) -> torch.Tensor:
    """Per-KV-head scales that map the absolute maximum of x [tokens, heads, dim] to the format's max."""
    amax = x.float().abs().amax(dim=(0, 2)).clamp_min(1e-8)
    return (amax * margin / QUANT_MAX[dtype]).to(torch.float32)

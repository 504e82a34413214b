"""Builders for kernel tests: scattered block tables, ragged lengths, exact quantisable data."""

from __future__ import annotations

import torch

from kvctl.kernels import is_quantised
from kvctl.kernels.formats import QUANT_MAX

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Per-dtype tolerances of attention outputs against the float32 reference, set by the output
# dtype's rounding (one ulp near 1) plus float32 accumulation-order noise.
OUT_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}

# On a GPU the kernels round attention probabilities to the query dtype before the product
# with V (as FlashAttention does): each p·v term is then off by up to the dtype's unit roundoff
# u times |v|, so an output may be off by u·max|v| however small the output itself is (values
# of opposite sign cancel). fp8_e5m2's range puts |V| in the hundreds in these cases: errors
# up to 0.72 at bfloat16 (u = 2**-8) on the H200, where 0.016 + 1.6% of the output was allowed.
# The CPU interpreter multiplies in float32 and gets no such term, so its bound stays tight.
PROBABILITY_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def out_tolerance(q_dtype: torch.dtype, v_cache: torch.Tensor, v_scale: torch.Tensor | None,
                  base: float | None = None) -> dict:
    """OUT_TOL for `q_dtype` (or atol = rtol = `base`), widened on a GPU by the probability
    rounding above."""
    tol = dict(OUT_TOL[q_dtype]) if base is None else dict(atol=base, rtol=base)
    if DEVICE == "cuda":
        values = v_cache.float() * (1.0 if v_scale is None else v_scale[None, None, :, None])
        tol["atol"] += PROBABILITY_ROUNDOFF[q_dtype] * float(values.abs().max())
    return tol


def ragged_lengths(block_size: int, long: int) -> list[int]:
    """1, B-1, B, B+1 and a long context: every edge of a block boundary."""
    return [1, max(block_size - 1, 1), block_size, block_size + 1, long]


def scattered_tables(lengths: list[int], block_size: int, num_blocks: int, generator: torch.Generator,
                     device=DEVICE) -> torch.Tensor:
    """Block tables drawing distinct random blocks (non-contiguous, out of order)."""
    per_seq = [-(-n // block_size) for n in lengths]
    assert sum(per_seq) <= num_blocks
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros((len(lengths), max(per_seq) + 1), dtype=torch.int32)
    used = 0
    for seq, count in enumerate(per_seq):
        table[seq, :count] = order[used:used + count].int()
        used += count
    return table.to(device)


def slots_for(table: torch.Tensor, lengths: list[int], block_size: int,
              starts: list[int] | None = None) -> torch.Tensor:
    """Slot of every token in [start, length) of every sequence, in order."""
    slots = []
    for seq, length in enumerate(lengths):
        positions = torch.arange(starts[seq] if starts else 0, length, device=table.device)
        slots.append(table[seq, positions // block_size].long() * block_size + positions % block_size)
    return torch.cat(slots)


def make_scales(dtype: torch.dtype, num_kv_heads: int, generator: torch.Generator):
    """Power-of-two scales per head (exact division), or None for unquantised caches."""
    if not is_quantised(dtype):
        return None, None
    exponents = torch.randint(-7, -4, (2, num_kv_heads), generator=generator).float()
    k_scale, v_scale = (2.0 ** exponents).to(DEVICE)
    return k_scale.contiguous(), v_scale.contiguous()


def representable(shape, dtype: torch.dtype, scale: torch.Tensor | None, generator: torch.Generator,
                  value_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values that the cache format holds exactly after scaling (no rounding ties to disagree on)."""
    x = torch.randn(shape, generator=generator)
    if is_quantised(dtype):
        limit = QUANT_MAX[dtype]
        grid = (x * limit / 4).clamp(-limit, limit).to(dtype).float()  # on the format's grid
        x = grid * scale.cpu()[:, None]
    elif dtype != torch.float32:
        x = x.to(dtype).float()
    return x.to(value_dtype).to(DEVICE)


def refused_alike(calls, message: str) -> None:
    """Each of `calls` (a launcher and its reference, on the same bad arguments) raises
    KernelArgumentError with `message`."""
    import pytest

    from kvctl.kernels import KernelArgumentError

    for call in calls:
        with pytest.raises(KernelArgumentError) as refused:
            call()
        assert str(refused.value) == message

"""RoPE as a checkpoint's `rope_scaling` (or `rope_parameters`) asks for it: plain, `llama3`,
`linear` or `yarn` (YaRN, which Qwen3 and Qwen2.5 turn on for contexts past 32k tokens).

Every scaling here is fixed per position, so the K written to the paged cache at a position
stays right whatever length the context later grows to. `dynamic` NTK scaling changes every
position's rotation with the context's length, which cached K cannot follow: it is refused, as
are the types not written here (`longrope`), by name.

    inv_freq = inverse_frequencies(head_dim, theta, scaling)   # [head_dim / 2]
    cos, sin *= attention_factor(scaling)                       # YaRN's "mscale"; 1 otherwise
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ModelError

if TYPE_CHECKING:  # torch is imported where frequencies are computed: kvd router reads configs without it
    import torch

ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al., 2023): frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times are kept, a linear ramp blends those between; cos and sin are scaled by
    `attention_factor` (0.1·ln(factor) + 1 unless the config gives it or its mscale pair)."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded out to whole dimensions


RopeScaling = Llama3Scaling | LinearScaling | YarnScaling


def read_scaling(scaling: dict, max_positions: int, where: str) -> RopeScaling | None:
    """The scaling a config's `rope_scaling` / `rope_parameters` names (None: plain RoPE);
    ModelError naming the field that is missing or not a number, or the type not supported."""
    rope_type = scaling.get("rope_type", scaling.get("type"))

    def number(name: str, default=None, kind=float):
        value = scaling.get(name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ModelError(f"{where}: rope_scaling {rope_type} needs {name} as a positive number (got {value!r})")
        return kind(value)

    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return Llama3Scaling(number("factor"), number("low_freq_factor"), number("high_freq_factor"),
                             number("original_max_position_embeddings", kind=int))
    if rope_type == "linear":
        return LinearScaling(number("factor"))
    if rope_type == "yarn":
        original = number("original_max_position_embeddings", kind=int)
        # no factor: the ratio of the positions to the original ones (DeepSeek-V3's configs)
        factor = number("factor", max_positions / original)
        given = scaling.get("attention_factor")
        if given is not None:
            attention = number("attention_factor")
        elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = _mscale(factor, number("mscale")) / _mscale(factor, number("mscale_all_dim"))
        else:
            attention = _mscale(factor)
        return YarnScaling(factor, original, attention, number("beta_fast", 32.0), number("beta_slow", 1.0),
                           bool(scaling.get("truncate", True)))
    why = (" (it rescales every position as the context grows, which K already in the cache cannot follow)"
           if rope_type == "dynamic" else "")
    raise ModelError(f"{where}: rope_scaling type {rope_type!r} is not supported{why}; supported: "
                     + ", ".join(ROPE_TYPES))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE's inverse frequencies, [head_dim / 2] float32, with `scaling` applied."""
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnScaling):
        return _yarn(inv_freq, head_dim, theta, scaling)
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    import torch

    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    def dimension_turning(turns: float) -> float:
        """The (fractional) dimension whose frequency turns `turns` times over the original context."""
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(s.beta_fast), dimension_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    import torch

    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the frequency as trained (turns often); 0: interpolated
    return (inv_freq / s.factor) * (1 - kept) + inv_freq * kept

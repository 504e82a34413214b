"""write_kv: store new keys and values into the paged cache, quantising when it is quantised.

Layout (per layer)::

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset  (one per new token)

One program writes one token: all its KV heads, K and V.
"""

import torch

from ._triton import tl, triton
from .checks import CheckedOnce, check, check_cache, check_device, check_scales, check_tensor, next_power_of_2
from .formats import QUANT_MAX, QUERY_DTYPES, to_cache


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    k_scale_ptr,  # [num_kv_heads] float32 (read only when QUANT)
    v_scale_ptr,  # [num_kv_heads] float32 (read only when QUANT)
    stride_kt, stride_kh,  # key strides: token, head (head_dim is contiguous)
    stride_vt, stride_vh,  # value strides: token, head
    stride_cb, stride_co, stride_ch,  # cache strides: block, offset, head
    block_size, num_kv_heads, head_dim,
    QUANT_LIMIT,  # the format's largest magnitude (QUANT only)
    HEADS_P: tl.constexpr,  # num_kv_heads rounded up to a power of two
    DIM_P: tl.constexpr,  # head_dim rounded up to a power of two
    QUANT: tl.constexpr,  # cache is fp8 or int8
    IS_INT8: tl.constexpr,  # cache is int8 (round half away from zero)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, DIM_P)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        k = k / k_scale[:, None]
        v = v / v_scale[:, None]
        if IS_INT8:
            k = tl.where(k >= 0, tl.floor(k + 0.5), tl.ceil(k - 0.5))
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        k = tl.minimum(tl.maximum(k, -QUANT_LIMIT), QUANT_LIMIT)
        v = tl.minimum(tl.maximum(v, -QUANT_LIMIT), QUANT_LIMIT)
    dest = block * stride_cb + offset * stride_co + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache)
    check_tensor("key", key, ndim=3, dtypes=QUERY_DTYPES, contiguous=False)
    check_tensor("value", value, ndim=3, dtypes=QUERY_DTYPES, contiguous=False)
    # Messages are built only on failure: this runs for every layer of every step.
    if key.shape[1:] != (num_kv_heads, head_dim):
        check(False, "key", f"expected [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        check(False, "value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    check(key.stride(2) == 1 and value.stride(2) == 1, "key",
          "the head_dim axis of key and value must be contiguous (stride 1)")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    if slot_mapping.shape[0] != key.shape[0]:
        check(False, "slot_mapping", f"{slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    return check_scales(k_cache, k_scale, v_scale)


_CHECKED = CheckedOnce()  # once per distinct argument metadata: every layer of a step writes alike


def _check_all(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    quantised = _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_device({"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
                  "slot_mapping": slot_mapping, "k_scale": k_scale, "v_scale": v_scale})
    return quantised


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] at `slot_mapping` (Triton)."""
    quantised = _CHECKED.get((key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale), (), lambda: _check_all(
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if quantised else slot_mapping, v_scale if quantised else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, num_kv_heads, head_dim,
        QUANT_MAX.get(k_cache.dtype, 0.0),
        HEADS_P=next_power_of_2(num_kv_heads), DIM_P=next_power_of_2(head_dim),
        QUANT=quantised, IS_INT8=k_cache.dtype == torch.int8,
    )


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Plain-torch twin of `write_kv` (runs anywhere)."""
    _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    if slots.numel():
        check(int(slots.min()) >= 0 and int(slots.max()) < num_blocks * block_size, "slot_mapping",
              f"slots must lie in [0, {num_blocks * block_size})")
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots] = to_cache(key, k_cache.dtype, k_scale)
    v_flat[slots] = to_cache(value, v_cache.dtype, v_scale)

"""copy_blocks: whole-block copies inside one layer's cache, for copy-on-write.

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    src, dst          [num_pairs] int64; block dst[i] becomes a copy of block src[i]

Destinations must be distinct and must not be sources (copies run in parallel).
"""

import torch

from ._triton import tl, triton
from .checks import check, check_cache, check_device, check_tensor

COPY_BLOCK = 1024  # elements per program


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src_ptr,  # [num_pairs] int64
    dst_ptr,  # [num_pairs] int64
    block_numel,  # elements in one block
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    tl.store(k_cache_ptr + dst * block_numel + offsets,
             tl.load(k_cache_ptr + src * block_numel + offsets, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst * block_numel + offsets,
             tl.load(v_cache_ptr + src * block_numel + offsets, mask=mask), mask=mask)


def _check(k_cache, v_cache, src, dst) -> None:
    num_blocks = check_cache(k_cache, v_cache)[0]
    check_tensor("src", src, ndim=1, dtypes=(torch.int64,))
    check_tensor("dst", dst, ndim=1, dtypes=(torch.int64,))
    check(src.shape == dst.shape, "dst", f"{dst.shape[0]} destinations for {src.shape[0]} sources")
    if src.numel():
        low = int(torch.minimum(src.min(), dst.min()))
        high = int(torch.maximum(src.max(), dst.max()))
        check(low >= 0 and high < num_blocks, "src", f"block ids must lie in [0, {num_blocks})")
        check(torch.unique(dst).numel() == dst.numel(), "dst", "a destination block appears twice")
        check(not bool(torch.isin(dst, src).any()), "dst", "a destination block is also a source")


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block src[i] onto dst[i] in both caches (Triton)."""
    _check(k_cache, v_cache, src, dst)
    if k_cache.element_size() == 1:  # bytes are copied as bytes: fp8 formats need no fp8 support
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    check_device({"k_cache": k_cache, "v_cache": v_cache, "src": src, "dst": dst})
    if src.numel() == 0:
        return
    block_numel = k_cache[0].numel()
    grid = (src.numel(), -(-block_numel // COPY_BLOCK))
    _copy_blocks_kernel[grid](k_cache, v_cache, src, dst, block_numel, CHUNK=COPY_BLOCK)


def copy_blocks_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Plain-torch twin of `copy_blocks`."""
    _check(k_cache, v_cache, src, dst)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]

"""kvd's cache on a GPU when nothing sizes it: a share of the free memory, and a warning when the
GPU is crowded (daemon/server/gpu_cache_size.py)."""

from __future__ import annotations

GIB = 2**30


def test_a_gpu_cache_is_a_share_of_what_is_free_and_a_crowded_gpu_is_named():
    """Two kvds started without CUDA_VISIBLE_DEVICES on one H200: the second finds 120 GiB held by
    the first, takes 80% of the 20 GiB left, and says why (a 2 GiB context and workspaces do not)."""
    from kvctl.daemon.server.gpu_cache_size import gpu_cache_blocks

    block = 2 * 2**20  # Llama-3-8B, bfloat16, 16 tokens
    alone = gpu_cache_blocks(free=125 * GIB, total=141 * GIB, own=15 * GIB, per_block=block)
    assert alone == (int(125 * GIB * 0.8) // block, None) == (51_200, None)  # 1 GiB outside kvd: its context
    second = gpu_cache_blocks(free=5 * GIB, total=141 * GIB, own=16 * GIB, per_block=block)
    assert second == (2_048, "120.0 GiB of this GPU's 141.0 GiB is held outside kvd (another process, another kvd): "
                             "the cache takes 80% of the 5.0 GiB free, 2,048 blocks; on a host of several GPUs start "
                             "each kvd on its own (CUDA_VISIBLE_DEVICES=N, examples/kvd@.service), or size the cache "
                             "with cache_memory")

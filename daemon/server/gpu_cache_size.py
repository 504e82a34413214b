"""How many blocks kvd's cache takes on a GPU when neither `num_blocks` nor `cache_memory` says:
a share of the memory free once the model is loaded, and a warning when much of the GPU is
held by someone else.

The usual cause on a host of several GPUs is a kvd started without `CUDA_VISIBLE_DEVICES`: every
such kvd lands on GPU 0, and the second one's cache is a share of what the first left, with no
error to say so.
"""

from __future__ import annotations

GPU_CACHE_SHARE = 0.8  # of the free memory, after the weights
# memory held beside kvd's own allocations worth a warning: above the CUDA context and the
# libraries' workspaces (about half a GiB to a GiB), well below a model or another cache
OTHERS_WARN_BYTES = 2 * 2**30
GIB = 2**30


def gpu_cache_blocks(free: int, total: int, own: int, per_block: int) -> tuple[int, str | None]:
    """(blocks, warning or None) for a GPU with `free` of `total` bytes free while kvd's allocator
    holds `own` (torch.cuda.mem_get_info, torch.cuda.memory_reserved)."""
    blocks = int(free * GPU_CACHE_SHARE) // per_block
    others = total - free - own
    if others <= OTHERS_WARN_BYTES:
        return blocks, None
    return blocks, (f"{others / GIB:.1f} GiB of this GPU's {total / GIB:.1f} GiB is held outside kvd (another process, "
                    f"another kvd): the cache takes {GPU_CACHE_SHARE:.0%} of the {free / GIB:.1f} GiB free, "
                    f"{blocks:,} blocks; on a host of several GPUs start each kvd on its own "
                    f"(CUDA_VISIBLE_DEVICES=N, examples/kvd@.service), or size the cache with cache_memory")

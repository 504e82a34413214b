"""Giving back the memory the KV cache takes while kvd sleeps, and taking it again on waking.

A layer's K and V tensors keep their shape and stay the objects every holder knows (the engine,
the tiers, an attention plan's slices of them); only the storage under them is freed, so that a
slice nobody let go of cannot keep the memory. While released, no kernel may touch them: the
engine refuses to step and the tiers to copy (`caches_released`). On CUDA the freed memory goes
back to the driver, where another process can take it.
"""

from __future__ import annotations

import torch


def _tensors(caches) -> list[torch.Tensor]:
    return [t for cache in caches for t in (cache.k, cache.v)]


def caches_released(caches) -> bool:
    """Whether the K/V storage of `caches` (LayerCache per layer) is given back now."""
    return bool(caches) and caches[0].k.untyped_storage().nbytes() == 0 < caches[0].k.numel()


def release_caches(caches) -> int:
    """Free the storage under every layer's K and V; returns the bytes given back."""
    freed = 0
    for tensor in _tensors(caches):
        storage = tensor.untyped_storage()
        freed += storage.nbytes()
        storage.resize_(0)
    if caches and caches[0].k.is_cuda:
        torch.cuda.empty_cache()  # from torch's caching allocator back to the driver
    return freed


def restore_caches(caches) -> int:
    """Give every layer's K and V its storage again, zeroed (what was cached is gone: it comes back
    from the lower tiers, or is computed again); returns the bytes taken."""
    taken = 0
    for tensor in _tensors(caches):
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        tensor.zero_()
        taken += nbytes
    return taken

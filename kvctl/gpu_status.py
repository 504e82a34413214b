"""`kvctl status`'s line on the GPU a kvd runs on (its status's `gpu`, made by
daemon/gpu_nvml.py), for one kvd and for each replica behind kvd router."""

from __future__ import annotations


def gpu_label(gpu: dict) -> str:
    """'GPU 3', numbered as nvidia-smi numbers it; 'GPU' for a MIG instance (no index of its own)."""
    return "GPU" if gpu.get("index") is None else f"GPU {gpu['index']}"


def gpu_line(gpu: dict) -> str:
    """'NVIDIA H200: 13.0 of 141.0 GiB, 60% busy' (no load for a MIG instance: NVML measures none)."""
    busy = "" if gpu.get("utilization") is None else f", {gpu['utilization']}% busy"
    return f"{gpu['name']}: {gpu['memory_used'] / 2**30:.1f} of {gpu['memory_total'] / 2**30:.1f} GiB{busy}"

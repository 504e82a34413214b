"""Room on the GPU for a LoRA adapter read while kvd serves (a reload of lora_modules, POST
/v1/load_lora_adapter).

kvd sizes its cache at the start from the memory free once the model and the adapters of
lora_modules are on the GPU (gpu_cache_size.py); what it leaves is the steps' workspace. An
adapter read later takes its weights from that same memory, and one that leaves too little
would fail a later step out of memory, mid-request. So before its packed weights go to the GPU
they are weighed against what is free there beside the largest workspace a step has taken so
far (torch's peak allocation above what is allocated now), and an adapter that does not fit is
refused, with nothing of it loaded.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvctl.daemon.model.lora import NoRoomForAdapter

from .byte_sizes import format_bytes


def room_refusal(name: str, nbytes: int, free: int, workspace: int) -> str | None:
    """Why adapter `name`, `nbytes` on the GPU, cannot be loaded where `free` bytes are free and
    steps have needed `workspace` bytes at most; None where it fits."""
    if nbytes <= free - workspace:
        return None
    return (f"LoRA adapter {name!r} needs {format_bytes(nbytes)} of GPU memory, and "
            f"{format_bytes(max(free - workspace, 0))} is free beside the {format_bytes(workspace)} the largest step "
            "so far has needed: unload an adapter, or give the cache less memory (cache_memory) at the next start")


def gpu_room(device: torch.device) -> Callable[[str, int], None] | None:
    """The check load_adapter asks before an adapter's weights go to `device` (None off a GPU,
    where the host's memory is not planned the same way): NoRoomForAdapter where they do not fit."""
    if device.type != "cuda":
        return None

    def check(name: str, nbytes: int) -> None:
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        free += torch.cuda.memory_reserved(device) - allocated  # held by torch's allocator, unused
        refusal = room_refusal(name, nbytes, free, max(torch.cuda.max_memory_allocated(device) - allocated, 0))
        if refusal is not None:
            raise NoRoomForAdapter(refusal)
    return check

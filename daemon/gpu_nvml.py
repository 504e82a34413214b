"""The GPUs this process uses, read through NVML (nvidia-ml-py).

NVML numbers every GPU of the host in PCI order and knows nothing of `CUDA_VISIBLE_DEVICES`:
CUDA's device 0 in a kvd started with `CUDA_VISIBLE_DEVICES=3` is NVML's GPU 3. An entry of
that variable may be an index or a GPU's UUID (`GPU-…`, or a unique start of one, as CUDA takes
it) or a MIG instance's (`MIG-…`). Indices are taken in NVML's (PCI) order, which is CUDA's
when `CUDA_DEVICE_ORDER=PCI_BUS_ID` and, on a host of identical GPUs, its default order too.

NVML is opened once for the process and left open: `nvmlInit` walks every GPU of the host, and
`kvctl status --watch` asks for the figures each second.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

NO_GPU_VISIBLE = ("", "-1", "NoDevFiles")  # CUDA_VISIBLE_DEVICES values that hide every GPU


class Nvml:
    """NVML, opened on first use; `module` is pynvml (a stand-in in tests), None to import it."""

    def __init__(self, module=None) -> None:
        self._module, self._opened, self._lock = module, None, threading.Lock()

    def _open(self):
        """pynvml after a successful nvmlInit, else None (no library, no driver); tried once."""
        with self._lock:
            if self._opened is None:
                try:
                    module = self._module
                    if module is None:
                        import pynvml as module
                    module.nvmlInit()
                    self._opened = module
                except Exception:  # nvidia-ml-py missing, no driver, no GPU
                    self._opened = False
            return self._opened or None

    def cuda_device_handle(self, cuda_index: int, environ: Mapping[str, str] = os.environ):
        """NVML's handle of CUDA device `cuda_index` of this process, or None where NVML is
        missing or the device cannot be told (hidden, out of range, no UUID matches)."""
        nvml = self._open()
        if nvml is None:
            return None
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            entry = str(cuda_index)
        else:
            entries = [part.strip() for part in visible.split(",")]
            if visible.strip() in NO_GPU_VISIBLE or cuda_index >= len(entries):
                return None
            entry = entries[cuda_index]
        try:
            if entry.isdigit():
                index = int(entry)
                return nvml.nvmlDeviceGetHandleByIndex(index) if index < nvml.nvmlDeviceGetCount() else None
            if entry.startswith("MIG-"):
                return nvml.nvmlDeviceGetHandleByUUID(entry)
            matches = [handle for handle in self._handles(nvml)
                       if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(entry)]
            return matches[0] if len(matches) == 1 else None
        except Exception:  # an NVML error (a GPU lost, a MIG UUID this driver cannot look up)
            return None

    def free_memory(self, cuda_index: int = 0, environ: Mapping[str, str] = os.environ) -> int | None:
        """Free bytes on CUDA device `cuda_index` of this process, or None where it cannot be told."""
        handle = self.cuda_device_handle(cuda_index, environ)
        return None if handle is None else _or_none(lambda h: self._opened.nvmlDeviceGetMemoryInfo(h).free, handle)

    def rows(self, cuda_index: int | None, environ: Mapping[str, str] = os.environ) -> list[dict] | None:
        """Memory and utilisation of the GPU a process on CUDA device `cuda_index` uses (`kvctl
        status`); every GPU of the host where that device cannot be told; None without NVML, or
        for a process on the CPU (`cuda_index` None)."""
        nvml = self._open()
        if nvml is None or cuda_index is None:
            return None
        try:
            own = self.cuda_device_handle(cuda_index, environ)
            handles = [own] if own is not None else self._handles(nvml)
            return [self._row(nvml, handle) for handle in handles]
        except Exception:  # a GPU fell off the bus between two calls: the status goes on without it
            return None

    def describe(self, cuda_index: int, environ: Mapping[str, str] = os.environ) -> str:
        """'cuda (GPU 3 of the host, NVIDIA H200)' for kvd's start line; 'cuda' where NVML cannot tell."""
        handle = self.cuda_device_handle(cuda_index, environ)
        row = None if handle is None else _or_none(lambda h: self._row(self._opened, h), handle)
        if row is None:
            return "cuda"
        where = "a MIG instance" if row["index"] is None else f"GPU {row['index']} of the host"
        return f"cuda ({where}, {row['name']})"

    @staticmethod
    def _handles(nvml) -> list:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    @staticmethod
    def _row(nvml, handle) -> dict:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return {"index": _or_none(nvml.nvmlDeviceGetIndex, handle),  # None for a MIG instance
                "name": _text(nvml.nvmlDeviceGetName(handle)), "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                "memory_used": memory.used, "memory_total": memory.total,
                # None where NVML does not measure it (a MIG instance)
                "utilization": _or_none(lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu, handle)}


def _or_none(read, handle):
    try:
        return read(handle)
    except Exception:  # NVMLError_NotSupported and the like
        return None


def _text(value) -> str:
    """Older nvidia-ml-py releases answer bytes."""
    return value.decode() if isinstance(value, bytes) else value


NVML = Nvml()  # the process's one NVML session

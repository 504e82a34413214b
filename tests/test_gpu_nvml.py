"""Which GPU NVML reports for this process: CUDA_VISIBLE_DEVICES honoured, NVML opened once.

NVML numbers the host's GPUs in PCI order and knows nothing of CUDA_VISIBLE_DEVICES, so a kvd
started on CUDA_VISIBLE_DEVICES=2 runs on NVML's GPU 2. A stand-in for pynvml with four GPUs
and a MIG instance plays the driver.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvctl.daemon.gpu_nvml import Nvml

GIB = 2**30
UUIDS = ["GPU-0a11aaaa-0000", "GPU-1b22bbbb-0000", "GPU-2c33cccc-0000", "GPU-2c34dddd-0000"]
MIG = "MIG-9f00eeee-0000"


class FakeNvml:
    """pynvml's calls kvd makes, over four H200s (handles are NVML indices) and a MIG instance of
    the last one (its handle is its UUID)."""

    def __init__(self, fail_init: bool = False):
        self.inits, self.fail_init = 0, fail_init

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self):
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index):
        assert 0 <= index < len(UUIDS)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != MIG:
            raise RuntimeError("Not Found")
        return uuid

    def nvmlDeviceGetUUID(self, handle):
        return handle if handle == MIG else UUIDS[handle].encode()  # bytes, as older releases answer

    def nvmlDeviceGetIndex(self, handle):
        if handle == MIG:
            raise RuntimeError("Invalid Argument")
        return handle

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H200 MIG 1g.18gb" if handle == MIG else b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle):
        used = 18 * GIB if handle == MIG else (10 + handle) * GIB
        total = 18 * GIB if handle == MIG else 141 * GIB
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle == MIG:
            raise RuntimeError("Not Supported")
        return SimpleNamespace(gpu=20 * handle)


def _indices(nvml: Nvml, cuda_index: int, visible: str | None) -> int | str | None:
    return nvml.cuda_device_handle(cuda_index, {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})


@pytest.mark.parametrize(("cuda_index", "visible", "handle"), [
    (0, None, 0), (1, None, 1), (4, None, None),            # no variable: CUDA's order is NVML's
    (0, "2,3", 2), (1, "2,3", 3), (2, "2,3", None),          # CUDA device 0 of "2,3" is NVML's 2
    (0, " 3 , 1", 3), (0, "7", None),                        # spaces; an index the host lacks
    (0, "GPU-1b22", 1), (1, "GPU-2c33cccc-0000,GPU-0a11", 0),  # a UUID, or a unique start of one
    (0, "GPU-2c3", None),                                    # two GPUs start so: CUDA could not tell either
    (0, MIG, MIG),                                           # a MIG instance, by its UUID
    (0, "", None), (0, "-1", None), (0, "NoDevFiles", None),  # every GPU hidden
])
def test_cuda_device_is_found_in_nvml_as_cuda_visible_devices_names_it(cuda_index, visible, handle):
    assert _indices(Nvml(FakeNvml()), cuda_index, visible) == handle


def test_status_rows_are_kvds_own_gpu_and_nvml_is_opened_once():
    fake = FakeNvml()
    nvml = Nvml(fake)
    rows = nvml.rows(1, {"CUDA_VISIBLE_DEVICES": "2,3"})  # kvd on cuda:1 of "2,3": NVML's GPU 3
    assert rows == [{"index": 3, "name": "NVIDIA H200", "uuid": UUIDS[3], "memory_used": 13 * GIB,
                     "memory_total": 141 * GIB, "utilization": 60}]
    assert nvml.rows(0, {}) == [{"index": 0, "name": "NVIDIA H200", "uuid": UUIDS[0], "memory_used": 10 * GIB,
                                 "memory_total": 141 * GIB, "utilization": 0}]
    assert nvml.rows(None, {}) is None  # kvd on the CPU: no GPU of its own to show
    # a device NVML cannot tell: every GPU of the host rather than none
    assert [row["index"] for row in nvml.rows(0, {"CUDA_VISIBLE_DEVICES": "GPU-2c3"})] == [0, 1, 2, 3]
    # a MIG instance: no index of its own, no utilisation measured
    assert nvml.rows(0, {"CUDA_VISIBLE_DEVICES": MIG}) == [
        {"index": None, "name": "NVIDIA H200 MIG 1g.18gb", "uuid": MIG, "memory_used": 18 * GIB,
         "memory_total": 18 * GIB, "utilization": None}]
    assert nvml.free_memory(0, {"CUDA_VISIBLE_DEVICES": "1"}) == 130 * GIB
    assert fake.inits == 1  # kvctl status --watch asks each second; nvmlInit walks every GPU


def test_an_nvml_error_reading_free_memory_is_none_and_capacity_says_so(capsys, monkeypatch):
    import kvctl.capacity_cmd as capacity_cmd

    from .test_cli import cli

    class Lost(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle):
            raise RuntimeError("GPU is lost")

    assert Nvml(Lost()).free_memory(0, {}) is None
    monkeypatch.setattr(capacity_cmd, "Nvml", lambda: Nvml(Lost()))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    status, _, err = cli(capsys, "capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu", "auto")
    assert status == 2 and " ".join(err.split()) == (
        "error: gpu: --gpu auto needs an NVIDIA GPU visible through NVML; give --gpu-memory BYTES")


def test_kvds_start_line_names_the_gpu_of_the_host_it_runs_on():
    nvml = Nvml(FakeNvml())
    assert nvml.describe(0, {"CUDA_VISIBLE_DEVICES": "3"}) == "cuda (GPU 3 of the host, NVIDIA H200)"
    assert nvml.describe(0, {"CUDA_VISIBLE_DEVICES": MIG}) == "cuda (a MIG instance, NVIDIA H200 MIG 1g.18gb)"
    assert nvml.describe(0, {"CUDA_VISIBLE_DEVICES": "GPU-2c3"}) == "cuda"  # not told apart: no guess
    assert Nvml(FakeNvml(fail_init=True)).describe(0, {}) == "cuda"


def test_without_a_driver_nvml_is_tried_once_and_nothing_is_reported():
    fake = FakeNvml(fail_init=True)
    nvml = Nvml(fake)
    assert nvml.rows(0, {}) is None and nvml.free_memory(0, {}) is None
    assert nvml.cuda_device_handle(0, {}) is None and fake.inits == 1


def test_kvctl_status_draws_kvds_gpu_and_a_mig_instance_without_utilisation():
    from rich.console import Console

    from kvctl.status_view import render_status
    from .test_cli import _status_data

    for gpu, line in (
            ({"index": 3, "name": "NVIDIA H200", "memory_used": 13 * GIB, "memory_total": 141 * GIB,
              "utilization": 60}, "GPU 3 NVIDIA H200: 13.0 of 141.0 GiB, 60% busy"),
            ({"index": None, "name": "NVIDIA H200 MIG 1g.18gb", "memory_used": 18 * GIB, "memory_total": 18 * GIB,
              "utilization": None}, "GPU NVIDIA H200 MIG 1g.18gb: 18.0 of 18.0 GiB")):
        console = Console(record=True, width=100)
        render_status({**_status_data(0), "gpu": [gpu]}, console)
        assert [" ".join(row.split()) for row in console.export_text().splitlines() if row.startswith("GPU")] == [line]


def test_capacity_gpu_auto_reads_the_gpu_cuda_visible_devices_leaves_visible(capsys, monkeypatch):
    import kvctl.capacity_cmd as capacity_cmd
    from .test_cli import cli

    monkeypatch.setattr(capacity_cmd, "Nvml", lambda: Nvml(FakeNvml()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2c33,GPU-0a11")
    args = ("capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu", "auto",
            "--weights-bytes", "16GB", "--workspace", "1GiB", "--dtype", "bfloat16", "--json")
    status, out, _ = cli(capsys, *args)
    free = 129 * GIB  # NVML's GPU 2: 141 GiB, 12 in use; not GPU 0's 131
    budget = free - 16 * 10**9 - GIB - int(0.1 * free)
    assert status == 0 and json.loads(out)["rows"][0]["blocks"] == budget // (131_072 * 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    status, _, err = cli(capsys, *args)
    assert status == 2 and " ".join(err.split()) == (
        "error: gpu: --gpu auto needs an NVIDIA GPU visible through NVML (CUDA_VISIBLE_DEVICES=''); "
        "give --gpu-memory BYTES")


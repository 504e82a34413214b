"""Scatter/gather writes: many buffers out in few system calls, whatever each call takes."""

from __future__ import annotations

from typing import Callable, Sequence

IOV_MAX = 512  # buffers per call (Linux allows 1024)


def write_vectored(write: Callable[[list], int], buffers: Sequence, batch: int = IOV_MAX) -> None:
    """Write every buffer in order with `write(list_of_buffers) -> bytes written` (os.writev on
    a file, socket.sendmsg on a socket), resuming after short writes."""
    pending = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    while pending:
        written = write(pending[:batch])
        while written:
            if written >= len(pending[0]):
                written -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][written:]
                written = 0

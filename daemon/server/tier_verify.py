"""`kvctl tiers verify`: read the disk tier through and verify every block, in the background.

kvd's start scan reads the disk tier's payload headers only (disk.py), so a large tier does not
hold up the start; a body's XXH3-64 is checked when a restore reads it. An operator who wants to
know now (after a disk error, or before trusting a folder copied from another host) runs a
verification: one segment at a time, least recently used first, on a thread of its own, at most
`rate` bytes a second (DEFAULT_RATE unless the operator asks for another, or for none). Reading
and hashing cost CPU the engine would use, so a pace is the default: on the 2-core development VM
an unpaced run (about 0.9 GB/s) cut the engine's streaming to a third while it ran
(`scripts/disk-start`). A block that fails is dropped as a failed restore's is
(`checksum fails` in `kvctl tiers`, a `corrupt` removal in `kvctl events`), so it is a miss rather
than a failed restore later. Segments written after it began were checksummed as they were
written and are not read again. One run at a time; an operator can stop it, and it stops with kvd.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .byte_sizes import format_bytes

log = logging.getLogger("kvd")

DEFAULT_RATE = 256 << 20  # bytes a second a verification reads unless asked otherwise


class DiskVerification:
    """One run over a TieredCache's disk tier. `clock` paces it; `wall` stamps its report."""

    def __init__(self, tiers, actor: str, rate: float | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.tiers, self.actor, self.rate, self.clock = tiers, actor, rate, clock
        self.state = "running"  # then done, stopped (by an operator or kvd's stop) or failed
        self.started_at, self.finished_at = wall(), None
        self._wall = wall
        self._began = clock()
        self.seconds = 0.0
        self.segments_total = self.segments_done = self.blocks = self.bytes = 0
        self.bad_blocks = self.unreadable_segments = 0
        self.stopped_by: str | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.run, name="kvd-tier-verify", daemon=True)

    def start(self) -> "DiskVerification":
        self._thread.start()
        return self

    def stop(self, actor: str) -> None:
        """Ask the run to end after the segment it is reading."""
        with self._lock:
            if self.state == "running" and not self._stop.is_set():
                self.stopped_by = actor
                self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self.state == "running"

    def run(self) -> None:
        """The whole run, on the calling thread (`start` runs it on a thread of its own)."""
        state = "done"
        try:
            names = self.tiers.disk.segment_names()
            with self._lock:
                self.segments_total = len(names)
            for name in names:
                if self._stop.is_set():
                    break
                check = self.tiers.verify_disk_segment(name)
                with self._lock:
                    self.segments_done += 1
                    if check is not None:
                        self.blocks += check.blocks
                        self.bytes += check.bytes
                        self.bad_blocks += len(check.bad)
                        self.unreadable_segments += check.unreadable is not None
                if self.rate and self._stop.wait(max(0.0, self.bytes / self.rate - (self.clock() - self._began))):
                    break
            if self._stop.is_set():
                state = "stopped"
        except Exception as exc:  # the run ends; kvd serves on
            log.exception("disk tier verification failed")
            state, self.error = "failed", f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.state, self.finished_at, self.seconds = state, self._wall(), self.clock() - self._began
        level = logging.WARNING if self.bad_blocks or self.unreadable_segments else logging.INFO
        log.log(level, "disk tier verification %s (started by %s%s): %d of %d segments, %d blocks, %s read in %.1f s; "
                "blocks that failed verification (dropped) %d, segments that could not be read %d", state, self.actor,
                f", stopped by {self.stopped_by}" if state == "stopped" else "", self.segments_done,
                self.segments_total, self.blocks, format_bytes(self.bytes), self.seconds, self.bad_blocks,
                self.unreadable_segments)

    def report(self) -> dict:
        with self._lock:
            seconds = self.seconds if self.state != "running" else self.clock() - self._began
            return {"state": self.state, "actor": self.actor, "stopped_by": self.stopped_by,
                    "started_at": self.started_at, "finished_at": self.finished_at, "seconds": seconds,
                    "rate_bytes_per_second": self.rate, "segments_total": self.segments_total,
                    "segments_done": self.segments_done, "blocks": self.blocks, "bytes": self.bytes,
                    "bad_blocks": self.bad_blocks, "unreadable_segments": self.unreadable_segments,
                    "error": self.error}

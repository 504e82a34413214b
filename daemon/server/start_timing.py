"""How long kvd took to become ready after its process started, and where the time went.

A rolling restart of a fleet waits on each replica's start, so an operator wants the figure and
its parts: the model's load, the device cache's allocation, the lower tiers (the disk tier's
start scan), and the pins restored; then, off the serving path, pinned prefixes brought back from
the lower tiers. `kvctl status` prints them, `/admin/status` has them under `start`, and
`kvd_start_seconds{phase}` charts them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

PHASES = ("model", "cache", "tiers", "pins")  # in the order the load runs them


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat against the boot clock), so that
    Python's and torch's imports count too; None where the system cannot say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartTimer:
    """The phases of one load, each timed from the end of the one before (`mark`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, age: Callable[[], float | None] = process_age):
        self.clock, self.age = clock, age
        self.began = self._last = clock()
        self.phases: dict[str, float] = {}
        self.ready_after: float | None = None  # seconds from the process's start to ready
        self.pins_warmed: float | None = None  # seconds the pinned prefixes took to come back, once done

    def mark(self, phase: str) -> None:
        now = self.clock()
        self.phases[phase] = now - self._last
        self._last = now

    def ready(self) -> None:
        age = self.age()
        self.ready_after = age if age is not None else self.clock() - self.began

    def report(self) -> dict:
        return {"ready_after_seconds": self.ready_after, "load_seconds": sum(self.phases.values()),
                "phases": dict(self.phases), "pins_warmed_seconds": self.pins_warmed}

"""Python's garbage collector in kvd: how long each collection stopped every thread, and the
start's heap frozen so that a collection does not walk it.

CPython's cyclic collector walks every tracked object of the generations it collects, holding the
GIL: no thread runs meanwhile, the engine thread included, so no token moves. A collection of the
oldest generation walks the whole heap. After kvd has imported torch and loaded its model that is
over 200,000 objects, and on the 2-core VM each such walk took 108-143 ms: a stall in every
stream, each time some 50,000 more objects had outlived the young generations (indexed blocks,
cached prefixes' nodes, events). Nothing about it showed in kvd's figures.

`GcPauses.freeze` (gc.freeze, which vLLM's engine and Instagram's servers use for the same reason)
moves what exists into a generation the collector never walks: `kvd serve` calls it once its
imports are done (before the model loads) and again when the load has finished (the model, the
cache, a disk tier's index). Frozen objects are still freed when their last reference goes; only
a reference cycle among them would outlive its use, which is why a collection runs first and why
only `kvd serve`'s one successful load freezes (a failed load's objects are never frozen).

`GcPauses` times every collection (gc.callbacks) by generation, for `kvd_gc_pause_seconds`
(histogram, `metric_families`), /admin/status's `gc` and `kvctl status`. `log_slow`, a
housekeeping job, logs a WARNING, at most once a minute, for pauses of `gc_warn_seconds` or more
(SGLang's --gc-warning-threshold-secs does the same). `kvd router` does all of this for its own
process too: its start leaves some 67,000 objects (its imports), 32-44 ms a whole-heap walk on
2 cores, frozen the same way.

The callback runs inside the collector, in whichever thread allocated last, and that thread may
hold any lock at that moment (prometheus_client's, logging's, this module's reader's). So it
takes none: it adds to plain counters under the GIL and returns. Readers copy them.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from typing import Callable

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger("kvd")

GENERATIONS = (0, 1, 2)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds; +Inf after
WARN_EVERY_S = 60.0  # at most one WARNING a minute; the pauses in between are counted in the next


class GcPauses:
    """Each collection's duration by generation: counts, sums, the longest, a histogram over
    BUCKETS, and the pauses of `warn_seconds()` or more. `install` adds the callback to
    gc.callbacks; `uninstall` removes it. `stalls`: what stops meanwhile, in the WARNING and the
    metric's help (kvd: no token moves; kvd router: no request is routed)."""

    def __init__(self, warn_seconds: Callable[[], float | None] = lambda: 0.1,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time, stalls: str = "no token moves meanwhile") -> None:
        self.warn_seconds, self.clock, self.wall, self.stalls = warn_seconds, clock, wall, stalls
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self.longest = dict.fromkeys(GENERATIONS, 0.0)
        self.buckets = {g: [0] * (len(BUCKETS) + 1) for g in GENERATIONS}  # per bucket, not cumulative
        self.slow = 0  # pauses of warn_seconds or more, ever
        self.last_slow: tuple[int, float, float] | None = None  # (generation, seconds, wall clock at its end)
        self.frozen_at_ready: int | None = None  # objects frozen when kvd's load ended (kvd serve)
        self.freeze_seconds = 0.0  # the collections `freeze` ran (at start, before kvd was ready)
        self._freezing = False
        self._began: float | None = None
        self._logged_slow = 0  # `slow` when log_slow last logged
        self._logged_at: float | None = None  # clock reading of that WARNING

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def freeze(self) -> int:
        """Collect, then freeze every object that survives (gc.freeze); the number frozen so far.
        Its own collection is counted in `freeze_seconds`, not among the pauses."""
        began, self._freezing = self.clock(), True
        try:
            gc.collect()
            gc.freeze()
        finally:
            self._freezing = False
            self.freeze_seconds += self.clock() - began
        return gc.get_freeze_count()

    @staticmethod
    def unfreeze() -> None:
        """Give the frozen heap back to the collector (at exit: the interpreter's last collections
        then free it, and native extensions do not report their objects as leaked)."""
        gc.unfreeze()

    @property
    def installed(self) -> bool:
        return self._callback in gc.callbacks

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = None if self._freezing else self.clock()
            return
        if self._began is None:  # installed while a collection ran, or `freeze`'s own
            return
        took, self._began = self.clock() - self._began, None
        self.record(info.get("generation", 2), took)

    def record(self, generation: int, took: float) -> None:
        """Count one collection of `generation` that took `took` seconds."""
        self.collections[generation] += 1
        self.seconds[generation] += took
        if took > self.longest[generation]:
            self.longest[generation] = took
        self.buckets[generation][bisect.bisect_left(BUCKETS, took)] += 1
        threshold = self.warn_seconds()
        if threshold is not None and took >= threshold:
            self.slow += 1
            self.last_slow = (generation, took, self.wall())

    def log_slow(self) -> None:
        """Log a WARNING for the slow pauses since the last one logged, at most once a minute."""
        new = self.slow - self._logged_slow
        if not new or self.last_slow is None:
            return
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < WARN_EVERY_S:
            return
        self._logged_slow, self._logged_at = self.slow, now
        generation, took, _ = self.last_slow
        log.warning("Python's garbage collector stopped every thread for %.0f ms (generation %d)%s: %s; "
                    "%d objects are frozen, which it does not walk (gc_warn_seconds %s)",
                    took * 1e3, generation, f", one of {new} such pauses since the last warning" if new > 1 else "",
                    self.stalls, gc.get_freeze_count(), self.warn_seconds())

    def report(self) -> dict:
        """Plain figures for /admin/status (copies: a collection may add to them meanwhile)."""
        last = self.last_slow
        return {"watching": self.installed, "frozen_objects": gc.get_freeze_count(),
                "frozen_at_ready": self.frozen_at_ready, "freeze_seconds": self.freeze_seconds,
                "collections": {str(g): self.collections[g] for g in GENERATIONS},
                "seconds": {str(g): self.seconds[g] for g in GENERATIONS},
                "longest_seconds": {str(g): self.longest[g] for g in GENERATIONS},
                "warn_seconds": self.warn_seconds(), "slow": self.slow,
                "last_slow": None if last is None else {"generation": last[0], "seconds": last[1], "at": last[2]}}

    def histogram(self, generation: int) -> tuple[list[tuple[float, int]], float]:
        """([(upper bound, collections that took at most that)], summed seconds): cumulative, the
        last bound infinite, as a Prometheus histogram has them."""
        counts, running, out = list(self.buckets[generation]), 0, []
        for bound, n in zip((*BUCKETS, float("inf")), counts):
            running += n
            out.append((bound, running))
        return out, self.seconds[generation]


def metric_families(pauses: GcPauses):
    """`kvd_gc_pause_seconds{generation}` and `kvd_gc_frozen_objects`, for a process that watches
    its collections (kvd serve, kvd router); nothing for one that does not (an in-process service)."""
    if not pauses.installed:
        return
    histogram = HistogramMetricFamily("kvd_gc_pause_seconds", "How long each collection of Python's garbage "
                                      f"collector stopped every thread ({pauses.stalls}), by generation",
                                      labels=["generation"])
    for generation in GENERATIONS:
        buckets, total = pauses.histogram(generation)
        histogram.add_metric([str(generation)], [(floatToGoString(b), n) for b, n in buckets], total)
    yield histogram
    yield GaugeMetricFamily("kvd_gc_frozen_objects", "Objects frozen out of the collector's walks (gc_freeze: "
                            "what the start made)", value=gc.get_freeze_count())

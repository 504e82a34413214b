"""A CPU engine's share of the host's CPUs when other kvd engines run there (`policies.cpu_threads`).

`CpuShare.look()` asks `KvdNeighbours` which other kvd engines sharing this one's CPUs are busy,
and sets `wanted`: the intra-op threads the engine thread should run. The engine thread applies
it between steps (torch's thread count is per thread, so only it can). Fewer threads are taken
at once (the cliff is many times over); more only once the share has allowed them for
`policies.cpu_threads.RAISE_AFTER_S`, so that bursty neighbours do not flip the count at every
burst. An operator's OMP_NUM_THREADS is kept as it is; kvd then only warns when it
oversubscribes the CPUs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvctl.policies.cpu_threads import LOOK_EVERY_S, RAISE_AFTER_S, intra_op_threads

from .cpu_neighbours import KvdNeighbours

log = logging.getLogger("kvd")


class CpuShare:
    def __init__(self, default_threads: int, neighbours: KvdNeighbours | None = None,
                 operator_threads: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.default = default_threads  # the engine's count at start: torch's, or OMP_NUM_THREADS
        self.neighbours = neighbours or KvdNeighbours()
        self.operator_threads = operator_threads  # OMP_NUM_THREADS is set: keep it, warn only
        self.wanted = default_threads
        self.busy_neighbours = 0
        self.cpus = 0
        self._warned_at = 0  # busy neighbours when the last oversubscription warning was logged
        self.clock = clock
        self._more_since: float | None = None  # since when the share has allowed more threads than wanted
        self.looks = self.shared_looks = 0  # looks, and those that found busy neighbours (a bench's share of a run)

    def look(self) -> int:
        """Look at the neighbours once; the threads the engine should run."""
        busy, cpus = self.neighbours.look()
        self.busy_neighbours, self.cpus = busy, len(cpus)
        self.looks += 1
        self.shared_looks += busy > 0
        if not cpus:  # this process's CPUs could not be read: nothing to share out
            return self.wanted
        share = intra_op_threads(len(cpus), busy, self.default)
        if self.operator_threads:
            if share < self.default and busy != self._warned_at:
                log.warning("%s this kvd's %d CPUs, and OMP_NUM_THREADS=%d oversubscribes them: each engine's "
                            "steps slow many times over; give each kvd OMP_NUM_THREADS=%d or its own CPUs "
                            "(CPUAffinity=)", _others_share(busy), len(cpus), self.default, share)
            self._warned_at = busy if share < self.default else 0
            return self.default
        if share > self.wanted:
            now = self.clock()
            self._more_since = now if self._more_since is None else self._more_since
            if now - self._more_since < RAISE_AFTER_S:
                return self.wanted
        self._more_since = None
        if share != self.wanted:
            log.info("engine threads %d -> %d: %s this kvd's %d CPUs (OMP_NUM_THREADS fixes the count instead)",
                     self.wanted, share, _others_share(busy), len(cpus))
        self.wanted = share
        return share

    def run(self, stop: threading.Event, every: float = LOOK_EVERY_S) -> None:
        """Look every `every` seconds until `stop` is set (the body of the kvd-cpu-share thread)."""
        while not stop.wait(every):
            try:
                self.look()
            except Exception:  # said once, not four times a second: the share stays where it is
                log.exception("looking at other kvd engines failed; the engine keeps %d threads from now on",
                              self.wanted)
                return

    def report(self) -> dict:
        return {"cpus": self.cpus, "busy_neighbours": self.busy_neighbours, "threads": self.wanted,
                "fixed_by": "OMP_NUM_THREADS" if self.operator_threads else None,
                "looks": self.looks, "shared_looks": self.shared_looks}


def _others_share(busy: int) -> str:
    """'1 other busy kvd engine shares', '2 other busy kvd engines share', 'no other … shares'."""
    if busy == 0:
        return "no other busy kvd engine shares"
    return f"{busy} other busy kvd engine{'s share' if busy > 1 else ' shares'}"

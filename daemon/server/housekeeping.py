"""kvd's periodic jobs, each on a thread of its own: never on the engine thread.

The jobs (a pin's TTL ending, the store's file check, a rollout's stop conditions; under `kvd
serve`, the state folder's claim too) touch files, and most write to the
SQLite store. A write waits while another process holds the store's write lock (a `sqlite3`
shell in a transaction, a long `kvctl db` command), for up to the store's busy timeout (30 s),
and then fails. On the engine thread that wait stopped every token; a failure there ended the
thread, and kvd served nothing more. Here a job that waits delays only itself (a pin's TTL
still ends while the file check waits), and a job that fails is logged (the first failure of a
run, with its traceback unless the store says why, then one line when it works again), counted
in `failures` (`kvd_housekeeping_failures_total{task}`) and run again at its next turn.

A job is a name, a period and a function. The period is a callable, read after each run, so
that a setting changed at run time applies from the next turn.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvctl.daemon.store import StoreUnavailable

log = logging.getLogger("kvd")


@dataclass(slots=True)
class Job:
    name: str  # for the log and the metric's `job` label
    every: Callable[[], float]  # seconds between the end of one run and the start of the next
    run: Callable[[], object]
    due: float = 0.0  # the clock's time of the next run (0: at once)
    failing: int = 0  # failures in a row; 0 when the last run worked


class Housekeeping:
    def __init__(self, jobs: list[Job], clock: Callable[[], float] = time.monotonic) -> None:
        self.jobs = jobs
        self.clock = clock
        self.failures: dict[str, int] = {job.name: 0 for job in jobs}  # every failure, by job

    def add(self, job: Job) -> None:
        """One more job (before `start`)."""
        self.jobs.append(job)
        self.failures[job.name] = 0

    def failing(self) -> list[str]:
        """The jobs whose latest run failed."""
        return [job.name for job in self.jobs if job.failing]

    def run_once(self, job: Job) -> float:
        """Run `job` now; return the seconds until its next turn."""
        try:
            job.run()
        except Exception as exc:
            self.failures[job.name] += 1
            if not job.failing:  # a store that cannot take writes says why in its message: no traceback
                log.error("housekeeping: %s failed; tried again every %.3g s (said once): %s", job.name,
                          job.every(), exc, exc_info=not isinstance(exc, StoreUnavailable))
            job.failing += 1
        else:
            if job.failing:
                log.info("housekeeping: %s works again after %d failure%s", job.name, job.failing,
                         "" if job.failing == 1 else "s")
            job.failing = 0
        job.due = self.clock() + job.every()
        return max(job.due - self.clock(), 0.01)

    def _run(self, job: Job, stop: threading.Event) -> None:
        stop.wait(max(job.due - self.clock(), 0.0))
        while not stop.is_set():
            stop.wait(self.run_once(job))

    def start(self, stop: threading.Event) -> list[threading.Thread]:
        """A thread for each job (kvd-housekeeping-<job>), until `stop` is set."""
        threads = [threading.Thread(target=self._run, args=(job, stop), daemon=True,
                                    name="kvd-housekeeping-" + job.name.replace(" ", "-")) for job in self.jobs]
        for thread in threads:
            thread.start()
        return threads
